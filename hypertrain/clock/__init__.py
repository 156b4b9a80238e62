"""The network clock (docs/clock.md): how long a finished run would take on a named cluster, from its
records and its config alone (`replay.clock_of`), with the collectives' alpha-beta formulas
(`formulas`); `python -m hypertrain.clock RUN_DIR ... cluster=...` prints it."""
