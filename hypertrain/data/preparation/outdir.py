"""Where `python -m hypertrain.data prepare` writes a corpus `out`: `claimed(out)` checks the place (not
under a file, not a mount point), takes the lock beside it (one prepare at a time) and makes the partial
directory the corpus is built in, all removed on the way out; `put_in_place` renames it to `out`.
`place_error` and `write_error` are the one lines of a filesystem that refuses (a full disk: DiskFull).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hypertrain.config import UserError
from hypertrain.data.preparation.lockfile import LockFile
from hypertrain.failures import DiskFull, RunFailure


def partial_of(out: Path) -> Path:
    """Where `out` is written before it is renamed into place (removed first: a killed run's remains)."""
    return out.parent / f".{out.name}.partial"


def lock_of(out: Path) -> Path:
    """The lock file a prepare into `out` holds (lockfile.LockFile): one prepare at a time per `out`."""
    return out.parent / f".{out.name}.lock"


def mount_point_error(out: Path) -> UserError:
    return UserError(
        f"--out {str(out)!r} is a mount point, which prepare cannot replace (it builds the corpus beside "
        f"--out and renames it into place); valid: a new or empty directory inside it, "
        f"e.g. '{out / 'corpus'}'"
    )


def check_place(out: Path) -> None:
    """UserError when a corpus cannot be at `out`: under a file, or a mount point (checked before any
    work; a bind mount that looks like a folder is refused at the rename, with nothing left)."""
    above = first_existing(out.parent)
    if not above.is_dir():
        raise UserError(
            f"--out {str(out)!r} lies under {above}, which is a file; valid: a path under a directory"
        )
    if out.is_dir() and os.path.ismount(out):
        raise mount_point_error(out)


def place_error(out: Path, error: OSError) -> UserError | DiskFull:
    """The one line for an OSError making the lock or the partial corpus beside `out`."""
    if error.errno == errno.ENOSPC:
        return DiskFull(
            f"no space left on the device for --out {str(out)!r}: nothing was written; "
            "valid: an --out on a filesystem with room"
        )
    return UserError(
        f"--out {str(out)!r}: nothing can be created in {first_existing(out.parent)} ({error.strerror}); "
        "valid: a new or empty directory where this user can write"
    )


def write_error(out: Path, error: OSError) -> RunFailure:
    """The one line for an OSError while the corpus is written: DiskFull (exit 4) for a full disk, else a
    RunFailure (exit 1); the partial corpus is removed either way."""
    where = f" ({error.filename})" if error.filename else ""
    if error.errno == errno.ENOSPC:
        return DiskFull(
            f"no space left on the device writing --out {str(out)!r}{where}: nothing was written "
            "(the partial corpus removed); valid: an --out on a filesystem with room"
        )
    return RunFailure(f"prepare of --out {str(out)!r} failed: {error.strerror}{where}; nothing was written")


@contextmanager
def claimed(out: Path) -> Iterator[Path]:
    """The partial directory `out` is built in, fresh (a killed prepare's removed), under the lock beside
    `out` (the folders above `out` made where missing). On the way out (a result, a refusal, an error,
    Ctrl-C, SIGTERM's exit) the partial directory, the lock and the folders made go; `out` stays once
    renamed into place. UserError when another prepare holds the lock or nothing can be made there."""
    check_place(out)
    made = first_missing(out.parent)
    lock = LockFile(lock_of(out))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        held = lock.acquire(wait=False)
    except OSError as error:
        remove_made(out.parent, made)
        raise place_error(out, error) from None
    if not held:
        remove_made(out.parent, made)  # only empty folders: the holder's lock keeps its own
        raise UserError(
            f"--out {str(out)!r} is being prepared by another process (it holds {lock_of(out)}); "
            "valid: wait until it has ended (the same command then says nothing to do), or another --out"
        )
    partial = partial_of(out)
    try:
        shutil.rmtree(partial, ignore_errors=True)
        try:
            partial.mkdir()
        except OSError as error:
            raise place_error(out, error) from None
        yield partial
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        lock.release()
        remove_made(out.parent, made)


def put_in_place(partial: Path, out: Path) -> None:
    """`partial` renamed to `out` (an empty `out` removed first); a bind mount, which os.path.ismount does
    not see, refused as a mount point (EBUSY), another OSError as `write_error`'s line."""
    try:
        if out.exists():
            out.rmdir()  # empty (prepare checked): the rename needs it gone
        os.rename(partial, out)
    except OSError as error:
        raise (mount_point_error(out) if error.errno == errno.EBUSY else write_error(out, error)) from None


def first_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def first_missing(directory: Path) -> Path | None:
    """The outermost of `directory` and its parents that does not exist: what mkdir(parents=True) makes."""
    missing = None
    while not directory.exists():
        missing, directory = directory, directory.parent
    return missing


def remove_made(directory: Path, made: Path | None) -> None:
    """`directory` and its parents up to `made` removed where empty (what mkdir(parents=True) made)."""
    if made is None:
        return
    for folder in [directory, *directory.parents]:
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == made:
            return
