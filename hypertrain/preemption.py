"""A stop signal ends a run at the next update boundary, checkpointed, then hands over.

SIGTERM (what SLURM sends at a time limit or preemption, and torchrun forwards to its workers),
SIGUSR2 (submitit's warning, `signal_delay_s` before the limit), SIGINT (Ctrl-C) and SIGHUP (the
terminal went away) only set a flag here. The round loop asks after every update whether some
process of the run got one (`hypertrain.trainer`); if so every process stops after that same
update, a checkpoint is written, the records are flushed with an `end` row (status `preempted`
for SIGTERM and SIGUSR2, `interrupted` for SIGINT and SIGHUP, and the exit code: 143, 143, 130,
129), and the entry calls `hand_over()`: the handler that was installed before this one
(submitit's, which requeues the job) when it was a Python function, otherwise the process exits
with that code.

A repeated SIGTERM, SIGUSR2 or SIGHUP changes nothing; the launcher's or the scheduler's SIGKILL
after its grace time (torch's agent: 30 s; SLURM: KillWait) is the hard stop. A second SIGINT (a
second Ctrl-C) stops at once (`StoppedAtOnce`, exit 130): the update in flight and the stop's own
checkpoint are given up, the newest checkpoint already written stays intact and the end row names
it. Under a launcher one Ctrl-C reaches a worker twice (the terminal signals the whole process
group and torch's agent forwards the signal too), so there a SIGINT within `REPEAT_S` of the first
counts as the same one. Once the stop's checkpoint is written (`settled()`), nothing stops at once.

`StopSignals` is a context manager (only the main thread may install handlers; elsewhere it does
nothing); one is active at a time, and `requested()` tells anyone whether it has been asked to stop.
"""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

from hypertrain.failures import RunFailure

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)
# A stop's exit code and end-row status per signal (a scheduler's preemption, or a user's interrupt).
EXIT_CODES = {signal.SIGTERM: 143, signal.SIGUSR2: 143, signal.SIGINT: 130, signal.SIGHUP: 129}
STATUSES = {signal.SIGTERM: "preempted", signal.SIGUSR2: "preempted"}  # the others: "interrupted"
REPEAT_S = 1.0  # under a launcher: a SIGINT this soon after the first is the same Ctrl-C delivered twice


class Preempted(RunFailure):
    """The run stopped on a stop signal after a checkpoint; `resume=auto` goes on from it."""

    exit_code = 143
    status = "preempted"  # the end row's status (hypertrain.log)

    def __init__(self, message: str, signum: int, exit_code: int | None = None, status: str | None = None):
        super().__init__(message)
        self.signum = signum
        self.exit_code = exit_code or EXIT_CODES.get(signum, Preempted.exit_code)
        self.status = status or STATUSES.get(signum, "interrupted")


class StoppedAtOnce(Preempted):
    """A second SIGINT: the run stopped where it was, without a checkpoint of its own; the newest
    checkpoint written before it is intact (`session.stopping` names it)."""


_active: StopSignals | None = None


def requested() -> int | None:
    """The stop signal this process has received (its number), None when there is none."""
    return None if _active is None else _active.received


def settled() -> None:
    """The stop's checkpoint is written (or there is none to write): a second SIGINT changes nothing."""
    if _active is not None:
        _active.settled = True


def under_launcher() -> bool:
    """Whether a launcher (torchrun, the self-launch, srun) started this process as one rank."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


class StopSignals:
    """Installs the flag-setting handler for the stop signals; restores the previous ones on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.at = 0.0  # time.monotonic() of the first signal
        self.settled = False
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        return self.install()

    def install(self) -> StopSignals:
        global _active
        try:
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread: leave the process's handlers as they are
            self.previous.clear()
            return self
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        global _active
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {} if _active is self else self.previous
        if _active is self:
            _active = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # No line here: the stop's one line is printed once the run has stopped (the entry's).
        if self.received is None:
            self.received, self.at = signum, time.monotonic()
            return
        # A repeated signal changes nothing (a process group's signal reaches a worker both directly
        # and through its launcher), except a second Ctrl-C, which stops at once.
        if signum != signal.SIGINT or self.received != signal.SIGINT or self.settled:
            return
        if under_launcher() and time.monotonic() - self.at < REPEAT_S:
            return
        self.settled = True  # once: the records' closing goes on undisturbed
        raise StoppedAtOnce("stopped at once by a second SIGINT", signum)

    def hand_over(self) -> None:
        """After the stop's checkpoint: call the handler that was there before (a launcher's requeue)
        when it was a Python function; return otherwise (the caller exits with the stop's code).
        Python's own SIGINT handler (it raises KeyboardInterrupt) is not called."""
        signum = self.received
        before = self.previous.get(signum) if signum is not None else None
        self.restore()
        if callable(before) and before is not signal.default_int_handler:
            before(signum, None)
