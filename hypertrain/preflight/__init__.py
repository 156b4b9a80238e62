"""Everything that refuses a run before anything is written: the command line as Hydra composes it,
the config's checks across sections, memory, the data and plan prepared, the run directory's and a
checkpoint's fitness; a refusal is one line, exit 2 (`refusal`)."""
