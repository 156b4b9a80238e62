"""The network clock in the report and in `python -m hypertrain.clock` (docs/clock.md): each
run's clock and the held-out target (`clocks`), finished runs retimed on a cluster (`retime`).
"""
