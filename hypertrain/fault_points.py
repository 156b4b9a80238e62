"""Tests only: make a process fail at a named point of a run, so a test names the point instead of
racing a clock.

`HYPERTRAIN_FAULT=RANK:UPDATE:ACTION[:POINT]` acts in the process of rank RANK (0 without
torch.distributed) at the 1-based update UPDATE, at POINT:
- `round` (the default): as the round (or the part of one) that holds UPDATE starts;
- `after`: right after UPDATE's inner step, before the processes agree whether to stop;
- `checkpoint`: writing the checkpoint taken at UPDATE's end, its temporary file whole but not
  yet renamed into place;
- `metrics`: writing UPDATE's row of metrics.jsonl, half the row on disk.
ACTION is `kill` (SIGKILL: no handler runs, nothing is flushed), `sleep` (hang until a stop
signal arrives), or `term` / `usr2` (send this process SIGTERM / SIGUSR2, as a scheduler would).
Unset, every call is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time

FAULT_ENV = "HYPERTRAIN_FAULT"
POINTS = ("round", "after", "checkpoint", "metrics")
_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "usr2": signal.SIGUSR2}


def due(rank: int, point: str, updates: range) -> bool:
    """Whether the fault is set for this rank at `point` of one of `updates` (0-based)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    target, update, _action, *where = spec.split(":")
    return int(target) == rank and (where[0] if where else "round") == point and int(update) - 1 in updates


def act(rank: int, point: str, updates: range) -> None:
    """Do the fault's action when it is due here (see the module docstring)."""
    if not due(rank, point, updates):
        return
    action = os.environ[FAULT_ENV].split(":")[2]
    if action == "sleep":  # a hung process: only a stop signal ends it (or SIGKILL)
        from hypertrain.failures import Terminated
        from hypertrain.preemption import requested

        while requested() is None:
            time.sleep(0.05)
        raise Terminated("stopped by SIGTERM while hung (the test-only fault)")
    os.kill(os.getpid(), _SIGNALS[action])
    time.sleep(0.1)  # let a handled signal arrive before going on
