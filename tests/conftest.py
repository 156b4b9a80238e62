"""Shared pytest setup: one torch thread per test process, and offline W&B.

Tests run in parallel (`pytest -n 2` on 2 cores). Two processes each running torch's default two
OpenMP threads oversubscribe the cores, and a descheduled thread stalls the others at every
barrier: a tiny model's step measured 27x slower (2.0 s against 76 ms). So every test process, and
every subprocess a test starts, uses one thread.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ["WANDB_ERROR_REPORTING"] = "false"

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads at import)

torch.set_num_threads(1)

# The one-node SLURM cluster of the `slurm` tests (tests/slurm_cluster.py), started only when asked for.
from slurm_cluster import slurm_cluster  # noqa: E402, F401
