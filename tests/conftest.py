"""Shared pytest setup: one torch thread per test process, offline W&B, the stdlib corpus built once.

Tests run in parallel (`pytest -n 2` on 2 cores). Two processes each running torch's default two
OpenMP threads oversubscribe the cores, and a descheduled thread stalls the others at every
barrier: a tiny model's step measured 27x slower (2.0 s against 76 ms). So every test process, and
every subprocess a test starts, uses one thread.

The embedded stdlib corpus is built once per test process for each data config, not once per
`prepare.prepare` (up to ~1 s each at short windows). The stdlib cannot change during a session
and a Dataset is read-only (frozen; its arrays are made unwritable here, so a test that wrote into
one would fail, not leak into the next). Other sources are built every time: their files are the
tests' own and may change. Tests of building itself call `hypertrain.data.text.build_dataset` unwrapped.
"""

import dataclasses
import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("WANDB_MODE", "offline")
os.environ["WANDB_ERROR_REPORTING"] = "false"

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads at import)

# The one-node SLURM cluster of the `slurm` tests (tests/slurm_cluster.py), started only when asked for.
from slurm_cluster import slurm_cluster  # noqa: E402, F401

from hypertrain.data import build_dataset  # noqa: E402
from hypertrain.preflight import prepare  # noqa: E402

torch.set_num_threads(1)

_STDLIB: dict[tuple, object] = {}


def _build_dataset_once(cfg):
    if cfg.name != "stdlib":
        return build_dataset(cfg)
    key = dataclasses.astuple(cfg)
    if key not in _STDLIB:
        dataset = build_dataset(cfg)
        for array in (dataset._tokens, dataset._starts, dataset._lengths):
            if array is not None:
                array.flags.writeable = False
        _STDLIB[key] = dataset
    return _STDLIB[key]


prepare.build_dataset = _build_dataset_once
