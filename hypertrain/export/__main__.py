"""`python -m hypertrain.export RUN_DIR [--checkpoint PATH] --out DIR` (hypertrain.export.command)."""

from __future__ import annotations

if __name__ == "__main__":  # first of all: a Ctrl-C during the imports below is the one line too
    from hypertrain.failures.signals import guard_command

    guard_command("hypertrain.export")

import signal
import sys

from hypertrain.export.command import cli

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the imports are done: `cli` catches it
    sys.exit(cli())
