"""The console handler of a run's log (conf/train.yaml names it for Hydra's job and Hydra's own log):
the standard StreamHandler, except that a reader that went away (`... | head -1`, a broken pipe)
ends the console and not the run. The log still reaches train.log, the records are whole, and
nothing is printed about it, as with any command whose reader stopped reading."""

from __future__ import annotations

import logging
import os
import sys


class Console(logging.StreamHandler):
    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            self.reader_gone()
            return
        super().handleError(record)

    def reader_gone(self) -> None:
        """Point the stream's file descriptor at /dev/null: later lines, and the interpreter's flush
        at exit, are written to nothing instead of failing again."""
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):  # no descriptor (a StringIO): drop the lines
            self.setStream(open(os.devnull, "w"))  # noqa: SIM115 - the handler's stream from now on
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
