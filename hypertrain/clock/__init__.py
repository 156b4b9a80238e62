"""The network clock (docs/clock.md): how long a run would take on a named cluster, from its schedule
and bytes alone. `formulas`: the collectives' alpha-beta seconds; `timeline.Clock`: the running clock
training writes into its rows; `replay.clock_of`: the same clock of a finished run on any cluster
(`python -m hypertrain.clock RUN_DIR ... cluster=...`, hypertrain.report.clock.retime)."""
