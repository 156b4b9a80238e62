"""An exclusive flock on a lock file beside what a process builds, held while it builds: `LockFile(path)`.
The file is removed while still held, on every exit Python sees, so none is left but by a killed
process (the next holder takes it over); a process that locked a file its holder had just removed
takes the lock anew. The kernel drops a dead holder's lock, so a lock is never stale.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class LockFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = None

    def acquire(self, wait: bool = True) -> bool:
        """Take the lock (creating the file), waiting for its holder with `wait`; without, False when
        another process holds it. OSError when the file cannot be opened (an unwritable folder)."""
        while True:
            lock = open(self.path, "a")  # "a": never truncates a file another process holds
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                lock.close()
                return False
            except BaseException:
                lock.close()
                raise
            try:  # the file locked must still be the one at the path (not removed by its holder)
                held = os.path.samestat(os.fstat(lock.fileno()), os.stat(self.path))
            except FileNotFoundError:
                held = False
            if held:
                self._file = lock
                return True
            lock.close()

    def release(self) -> None:
        """Remove the file, then give the lock back (a waiter sees the file gone and takes a new one)."""
        if self._file is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            self._file.close()
            self._file = None
