"""A tuned study in the report (experiments/tuned_study.py, docs/sweeps.md): each scheme's tuned outer step
over its seeds, timed by the network clock on three links (`study`), and its loss bands (`plot`).
"""
