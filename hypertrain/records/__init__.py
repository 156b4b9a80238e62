"""The run's records, low enough for everyone to read: the rows of `metrics.jsonl` as types (`rows`) and
the file read back (`files`). `run.records` writes them; the clock's replay, the report and resume read
them through the same types. `formats` upgrades an older config.yaml or checkpoint to today's form.
"""
