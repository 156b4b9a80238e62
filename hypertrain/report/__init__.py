"""The run report: reads runs' records and compares them (python -m hypertrain.report)."""
