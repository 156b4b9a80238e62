"""What every logger of a run's rows offers (`Logger`: write a row, close with the run's error), and
the two facts they share about that error: the exit code the run leaves with, and a full disk behind it.

The loggers are `jsonl.JsonlWriter` (metrics.jsonl, the source of truth) and `wandb_mirror.WandbMirror`;
`records.RunLogger` holds them, in the shape of torchtitan's `BaseLogger` and `LoggerContainer`.
"""

from __future__ import annotations

import errno
from typing import Protocol

from hypertrain.records.rows import Row


class Logger(Protocol):
    """One destination of a run's rows (tests/test_interfaces.py holds each logger to it)."""

    def write(self, row: Row) -> None: ...

    def close(self, error: BaseException | None = None) -> None: ...


def exit_code(error: BaseException | None) -> int:
    """The code a run that ended with `error` exits with: 0 without one, else its `exit_code` (1 if none)."""
    return 0 if error is None else int(getattr(error, "exit_code", 1))


def no_space(error: BaseException) -> OSError | None:
    """The ENOSPC OSError behind `error` (itself, or its cause or context: torch.save reports one as
    a RuntimeError), None when there is none."""
    cause: BaseException | None = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno == errno.ENOSPC):
        cause = cause.__cause__ or cause.__context__
    return cause
