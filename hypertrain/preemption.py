"""A scheduler's stop signal ends a run at the next update boundary, checkpointed, then hands over.

SIGTERM (what SLURM sends at a time limit or preemption, and torchrun forwards to its workers) and
SIGUSR2 (submitit's warning, `signal_delay_s` before the limit) only set a flag here. The round loop
asks after every update whether some process of the run got one (`hypertrain.trainer`); if so every
process stops after that same update, a checkpoint is written, the records are flushed with an
`end` row whose status is `preempted`, and the entry calls `hand_over()`: the handler that was
installed before this one (submitit's, which requeues the job) when it was a Python function,
otherwise the process exits with code 143. A repeated signal changes nothing; the launcher's or the
scheduler's SIGKILL after its grace time (torch's agent: 30 s; SLURM: KillWait) is the hard stop.

`StopSignals` is a context manager (only the main thread may install handlers; elsewhere it does
nothing); one is active at a time, and `requested()` tells anyone whether it has been asked to stop.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from hypertrain.failures import RunFailure

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


class Preempted(RunFailure):
    """The run stopped on a stop signal after a checkpoint; `resume=auto` goes on from it."""

    exit_code = 143
    status = "preempted"  # the end row's status (hypertrain.log)

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


_active: StopSignals | None = None


def requested() -> int | None:
    """The stop signal this process has received (its number), None when there is none."""
    return None if _active is None else _active.received


class StopSignals:
    """Installs the flag-setting handler for SIGTERM and SIGUSR2; restores the previous ones on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
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
        # A repeated signal changes nothing (a process group's signal reaches a worker both directly
        # and through its launcher): the launcher's or scheduler's SIGKILL is the hard stop.
        if self.received is None:
            self.received = signum
            if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":  # one line per run
                name = signal.Signals(signum).name
                print(f"hypertrain: {name} received: stopping after the update in flight", file=sys.stderr)

    def hand_over(self) -> None:
        """After the stop's checkpoint: call the handler that was there before (a launcher's requeue)
        when it was a Python function; return otherwise (the caller exits with 143)."""
        signum = self.received
        before = self.previous.get(signum) if signum is not None else None
        self.restore()
        if callable(before):
            before(signum, None)
