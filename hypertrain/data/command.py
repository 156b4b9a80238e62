"""What the data commands (`python -m hypertrain.data`, `python -m hypertrain.data.speech`) share: an
argument parser whose mistakes are one line `hypertrain: error: ...` with exit 2, and SIGTERM handled
as Ctrl-C, so a half-written temporary directory is removed on the way out.
"""

from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")  # one line, however long
        self.exit(2, f"hypertrain: error: {message}; valid: {usage}\n")


def exit_on_sigterm(signum: int, frame) -> None:
    """SIGTERM (a scheduler, `kill`) ends the command as Ctrl-C does: through Python's exit, so the
    `finally` blocks run (a lock file removed, a half-built temporary directory cleaned up)."""
    sys.exit(128 + signum)
