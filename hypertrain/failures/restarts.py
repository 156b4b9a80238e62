"""Restarts by torch's elastic agent: how many this process's agent allows, which one this is.

Under `torchrun --max-restarts N` (or the self-launch with `processes.max_restarts=N`) a worker that
fails (exits non-zero or dies) makes the agent stop every worker (SIGTERM, SIGKILL after 30 s) and
start them all again, at most N times; it tells each worker its restart count (0 on the first start)
in `TORCHELASTIC_RESTART_COUNT` and N in `TORCHELASTIC_MAX_RESTARTS`. A restarted session resumes
the run from its newest checkpoint (docs/resume.md, "Restarts").

Telling the agent's SIGTERM from a scheduler's: the agent restarts its workers only after one of
them failed, so the survivors' next collective fails (gloo sees the dead or exited worker's
connections closed) and they never agree on a stop; a stop signal is a preemption only where every
rank agrees on it after the same update (`diloco.rounds.StopCheck`), as with a scheduler's SIGTERM,
which reaches every rank alive. A session that ends on a failure while restarts are left (`left()`)
is one the agent restarts: its lines and its end row say so (`note()`), its exit code is the
failure's (3 for a collective that failed), never a stop's 143.
"""

from __future__ import annotations

import os

COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_ENV = "TORCHELASTIC_MAX_RESTARTS"


def _int(name: str) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else 0


def count() -> int:
    """This start's restart count: 0 on the first start, and without torch's agent."""
    return _int(COUNT_ENV)


def allowed() -> int:
    """The restarts the agent allows in all (its max_restarts); 0 without torch's agent."""
    return _int(MAX_ENV)


def left() -> int:
    """The restarts the agent has left: a failure of this session restarts every worker when > 0."""
    return max(0, allowed() - count())


def note() -> str:
    """What a failing session adds to its line when the agent restarts it; "" when none is left."""
    if not left():
        return ""
    return f"; torch's agent restarts every rank (restart {count() + 1} of {allowed()})"


def restarting(error: BaseException) -> str:
    """`error`'s one line, and when the agent restarts this session, the line says so (`note()`, once)
    and the error's exit code is never a stop's 143 (a hung rank's `Terminated`: the agent's SIGTERM
    is no preemption) but a failed rank's 3. Sets the error's message to that line; returns it."""
    said = str(error).strip().splitlines()
    line = said[0] if said else type(error).__name__
    if not left() or line.endswith(note()):
        return line
    line += note()
    error.args = (line,)
    if getattr(error, "exit_code", None) == 143:
        from hypertrain.failures import RankFailed

        error.exit_code = RankFailed.exit_code
    return line
