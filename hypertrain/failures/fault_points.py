"""Tests only: make a process fail at a named point of a run, so a test names the point instead of
racing a clock.

`HYPERTRAIN_FAULT=RANK:UPDATE:ACTION[:POINT[:RESTART]]` acts in the process of rank RANK at UPDATE, at
POINT, in the session of torch's agent's restart count RESTART (default 0: the first start, and every
process no agent started), so a fault that makes the agent restart the workers does not fire again in
the restarted ones (docs/resume.md, "The fault hook"). Unset, every call is one dictionary lookup. Set
to anything else, the run is refused before it starts (`check`, one line): a hook a test left in a
user's environment must not break a run halfway, nor be silently ignored.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from hypertrain.config import UserError
from hypertrain.failures import restarts

FAULT_ENV = "HYPERTRAIN_FAULT"
POINTS = ("round", "after", "checkpoint", "metrics", "end")
_SIGNALS = {
    "kill": signal.SIGKILL,
    "term": signal.SIGTERM,
    "usr2": signal.SIGUSR2,
    "int": signal.SIGINT,
    "hup": signal.SIGHUP,
}


def check() -> None:
    """UserError (one line) when HYPERTRAIN_FAULT is set but is not a fault this hook can act on."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    numbers = [parts[0], parts[1], *parts[4:5]] if len(parts) >= 3 else []
    ok = 3 <= len(parts) <= 5 and all(p.isdigit() for p in numbers)
    ok = ok and parts[2] in (*_SIGNALS, "sleep", "int2") and (len(parts) < 4 or parts[3] in POINTS)
    if not ok:
        raise UserError(
            f"{FAULT_ENV}={spec!r} is not a fault of the tests' hook; valid: unset it (it is for tests "
            f"only), or RANK:UPDATE:ACTION[:POINT[:RESTART]] with ACTION one of "
            f"{', '.join((*_SIGNALS, 'sleep', 'int2'))} and POINT one of {', '.join(POINTS)}"
        )


def due(rank: int, point: str, updates: range) -> bool:
    """Whether the fault is set for this rank at `point` of one of `updates` (0-based)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    target, update, _action, *where = spec.split(":")
    if int(target) != rank or (where[0] if where else "round") != point or int(update) - 1 not in updates:
        return False
    return int(where[1] if len(where) > 1 else 0) == restarts.count()


def act(rank: int, point: str, updates: range, ready: Callable[[], bool] | None = None) -> None:
    """Do the fault's action when it is due here (docs/resume.md, "The fault hook"); with `ready`, once
    it says so (polled for at most a minute)."""
    if not due(rank, point, updates):
        return
    deadline = time.monotonic() + 60
    while ready is not None and not ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    action = os.environ[FAULT_ENV].split(":")[2]
    if action == "sleep":  # a hung process: only a stop signal ends it (or SIGKILL)
        from hypertrain.failures import Terminated
        from hypertrain.failures.signals import requested

        while requested() is None:
            time.sleep(0.05)
        raise Terminated("stopped by SIGTERM while hung (the test-only fault)")
    if action == "int2":  # two Ctrl-Cs in a terminal: the second one stops at once
        from hypertrain.failures.signals import REPEAT_S

        os.killpg(os.getpgrp(), signal.SIGINT)
        time.sleep(REPEAT_S + 0.5)
        os.killpg(os.getpgrp(), signal.SIGINT)
        time.sleep(5)  # the second one's StoppedAtOnce arrives here
        return
    os.kill(os.getpid(), _SIGNALS[action])
    time.sleep(0.1)  # let a handled signal arrive before going on
