"""A stop signal ends a run at the next update boundary, checkpointed, then hands over.

TERM, USR2, INT, HUP and QUIT only set a flag (`StopSignals`, `requested()`); the round loop stops
every process after the same update and the entry calls `hand_over()`. A second Ctrl-C stops at once
(`StoppedAtOnce`); before training, `guard_start()` ends the process (docs/resume.md, "Stop signals
and preemption").
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import FrameType

from hypertrain.failures import RunFailure

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# A stop's exit code and end-row status per signal (a scheduler's preemption, or a user's interrupt):
# 128 + the signal's number, as a shell reports a process the signal ended, but SIGUSR2 (submitit's
# warning before SIGTERM) ends as SIGTERM would.
EXIT_CODES = {
    signal.SIGTERM: 143,
    signal.SIGUSR2: 143,
    signal.SIGINT: 130,
    signal.SIGHUP: 129,
    signal.SIGQUIT: 131,
}
STATUSES = {signal.SIGTERM: "preempted", signal.SIGUSR2: "preempted"}  # the others: "interrupted"
REPEAT_S = 1.0  # under a launcher: a SIGINT this soon after the first is the same Ctrl-C delivered twice


class Preempted(RunFailure):
    """The run stopped on a stop signal after a checkpoint; `resume=auto` goes on from it."""

    exit_code = 143
    status = "preempted"  # the end row's status (run.records)

    def __init__(self, message: str, signum: int, exit_code: int | None = None, status: str | None = None):
        super().__init__(message)
        self.signum = signum
        self.exit_code = exit_code or EXIT_CODES.get(signum, Preempted.exit_code)
        self.status = status or STATUSES.get(signum, "interrupted")


class StoppedAtOnce(Preempted):
    """A second SIGINT: the run stopped where it was, without a checkpoint of its own; the newest
    checkpoint written before it is intact (`session.stopping` names it)."""


# One call of the entry's own (hypertrain.train.cli runs each call in a context of its own): what empties
# a new run's directory (returning the directories emptied), and the StopSignals now installed.
_leave: ContextVar[Callable[[], list[Path]]] = ContextVar("hypertrain_leave", default=list)
_active: ContextVar[StopSignals | None] = ContextVar("hypertrain_stop_signals", default=None)


def _stop_before_start(signum: int, frame: FrameType | None) -> None:
    """No update runs: nothing to checkpoint; what a new run made so far goes, then the process."""
    emptied = _leave.get()()
    left = f"; nothing of the run was left in {emptied[0]}" if emptied else ""
    name = signal.Signals(signum).name
    if not under_launcher() or _launched_rank() == 0:  # rank 0 says it once for every rank
        print(f"hypertrain: stopped by {name} while no update was running{left}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODES[signum])  # at once: no library code half way through an import or a write goes on


def guard_start(leave: Callable[[], list[Path]] | None = None) -> None:
    """The entry's first statement (and again, with `leave`, once it can empty a run directory): until
    a `StopSignals` takes over, and again once it has put this back, a stop signal ends the process
    with one line and its exit code, after `leave()` (`directory.abandon_unstarted`)."""
    if leave is not None:
        _leave.set(leave)
    try:
        for signum in STOP_SIGNALS:
            signal.signal(signum, _stop_before_start)
    except ValueError:  # not the main thread (the entry called from one): the caller's handlers stay
        pass


def interrupted(prog: str) -> str:
    """The line of a command that only reads (`python -m hypertrain.sample`) stopped by Ctrl-C; it
    exits with EXIT_CODES[SIGINT], the entry's code for the same signal."""
    return f"{prog}: stopped by SIGINT (Ctrl-C); nothing was written"


def guard_command(prog: str) -> None:
    """Such a command's first statement: until it restores Python's handler (and catches the
    KeyboardInterrupt itself), a Ctrl-C during its imports prints `interrupted(prog)` and ends the
    process at once (no frame of the command's to unwind yet)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        print(interrupted(prog), file=sys.stderr, flush=True)
        os._exit(EXIT_CODES[signum])

    signal.signal(signal.SIGINT, stop)


@contextmanager
def ctrl_c_after_imports() -> Iterator[None]:
    """A command's lazy imports of torch or transformers: a SIGINT meanwhile is held and handled by the
    handler before it when they are done. Raised inside torch's import, a KeyboardInterrupt was swallowed
    there, or ended the process by SIGINT (-2) after the command had caught it and returned 130. Only the
    main thread has handlers: elsewhere it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if held and callable(before):
        before(signal.SIGINT, None)
    elif held and before == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)


def requested() -> int | None:
    """The stop signal this process has received (its number), None when there is none."""
    active = _active.get()
    return None if active is None else active.received


def settled() -> None:
    """The stop's checkpoint is written (or there is none to write): a second SIGINT changes nothing."""
    active = _active.get()
    if active is not None:
        active.settled = True


def _launched_rank() -> int:
    """This process's rank under a launcher (torchrun's RANK, srun's SLURM_PROCID), 0 without one."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)


def under_launcher() -> bool:
    """Whether a launcher (torchrun, the self-launch, srun) started this process as one rank."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


class StopSignals:
    """Installs the flag-setting handler for the stop signals; restores the previous ones on exit.
    Only the main thread may install handlers (elsewhere it does nothing); one is active at a time."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.at = 0.0  # time.monotonic() of the first signal
        self.settled = False
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        return self.install()

    def install(self) -> StopSignals:
        try:
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread: leave the process's handlers as they are
            self.previous.clear()
            return self
        _active.set(self)
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back the handlers that were there before (the entry's guard, where it is the entry)."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if _active.get() is self:
            self.previous = {}
            _active.set(None)

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
        Python's own SIGINT handler (it raises KeyboardInterrupt) and the entry's guard are not called."""
        signum = self.received
        before = self.previous.get(signum) if signum is not None else None
        self.restore()
        if callable(before) and before not in (signal.default_int_handler, _stop_before_start):
            before(signum, None)
