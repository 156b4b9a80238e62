"""What `python -m hypertrain.report` and `python -m hypertrain.clock` do alike at the command line.

`check_out(out)` checks `--out` before anything is written: one line (ReportInputError) for a path
that is a file, lies below one, or cannot be made or written into. `print_out(lines)` prints to stdout
a reader may close early (`... | head -1`): the lines it takes, then it stops quietly, with exit
status 1 and no traceback, as Python's note on SIGPIPE recommends
(https://docs.python.org/3/library/signal.html#note-on-sigpipe).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

from hypertrain.report.runs import ReportInputError

VALID_OUT = "valid: a directory (made if missing)"
READER_GONE = 1  # the exit status when stdout's reader closed early (Python's, on EPIPE)


def _what(path: Path) -> str:
    """What stands at `path` instead of a directory."""
    if path.is_file():
        return "a file"
    return "a link to nothing" if path.is_symlink() and not path.exists() else "not a directory"


def check_out(out: Path, name: str | None = None) -> None:
    """ReportInputError, one line naming `out` as `name` (default `--out=OUT`), unless `out` is a
    directory this process can write into or can be made one (its nearest existing folder above is a
    directory it can write into)."""
    name = f"--out={out}" if name is None else name
    path = out.absolute()  # `..` kept and links not followed: the path as mkdir will walk it
    first = next(p for p in (path, *path.parents) if os.path.lexists(p))  # "/" always exists
    if first == path:
        if not path.is_dir():
            raise ReportInputError(f"{name} is {_what(path)}; {VALID_OUT}")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ReportInputError(f"{name} is not writable by this user; {VALID_OUT}")
        return
    under = first if out.is_absolute() else os.path.relpath(first)  # as the user wrote `out`
    if not first.is_dir():
        raise ReportInputError(f"{name} cannot be made (under {under}), which is {_what(first)}; {VALID_OUT}")
    if not os.access(first, os.W_OK | os.X_OK):
        raise ReportInputError(
            f"{name} cannot be made (under {under}), which is not writable by this user; {VALID_OUT}"
        )


def print_out(lines: Iterable[str]) -> int:
    """Print `lines` to stdout and flush; 0, or READER_GONE when the reader closed stdout early. Then
    stdout is pointed at os.devnull, so the interpreter's own flush at exit raises nothing either."""
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return READER_GONE
    return 0
