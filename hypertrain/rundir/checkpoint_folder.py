"""A sharded run's checkpoint: the folder `ckpt-u<next update>.dcp` holding torch.distributed.checkpoint's
files (one `__<rank>_0.distcp` per rank, `.metadata`) and `run.pt` (the payload of a single-file
checkpoint, its sharded tensors left empty). Written into `<name>.tmp`, every file's sha256 sealed beside
it (`<name>.sha256`, one `<digest>  <file>` line each) before the folder is renamed into place; `verify`
checks every file against those lines. No torch here (`finish` is handed the payload's writer).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from hypertrain.config import UserError

STATE_FILE = "run.pt"


def digest_path(path: Path) -> Path:
    """Where the sha256 of checkpoint `path`'s bytes (a file's; a folder's files', a line each) is kept."""
    return path.with_name(path.name + ".sha256")


def temporary(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """A checkpoint (a file or a folder) or a temporary one, gone; nothing when it is not there."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def prepare(path: Path) -> Path:
    """The writer's empty temporary folder for checkpoint `path` (one a kill left is removed first)."""
    tmp = temporary(path)
    remove(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finish(path: Path, save_payload: Callable[[Path], None], before_rename: Callable[[], None]) -> int:
    """The writer, once every rank's shards are in `temporary(path)`: the payload written there
    (`save_payload(file)`, fsynced), every file's digest sealed beside `path`, then the folder renamed
    into place (an older folder of the same name moved aside first) and the parent fsynced; its bytes."""
    tmp = temporary(path)
    save_payload(tmp / STATE_FILE)
    _fsync(tmp)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    digest, sealing = digest_path(path), temporary(digest_path(path))
    try:
        with open(sealing, "w") as out:
            out.writelines(f"{file_sha256(p)}  {p.relative_to(tmp).as_posix()}\n" for p in files)
            out.flush()
            os.fsync(out.fileno())
        os.replace(sealing, digest)  # the digest first: a checkpoint in place always has its own
    finally:
        sealing.unlink(missing_ok=True)
    size = sum(p.stat().st_size for p in files)
    before_rename()
    if path.exists():  # the same update written again (a stop right after a resume): the old one aside
        aside = temporary(path.with_name(path.name + ".old"))
        remove(aside)
        os.replace(path, aside)
        os.replace(tmp, path)
        remove(aside)
    else:
        os.replace(tmp, path)
    _fsync(path.parent)
    return size


def verify(path: Path) -> None:
    """UserError (one line) unless every file the digest beside folder `path` lists is there with its
    bytes, and the folder holds the payload."""
    digest = digest_path(path)
    if not digest.is_file():
        raise UserError(
            f"checkpoint {path} was written with a digest, and {digest.name} is missing; valid: a "
            "checkpoint beside its digest"
        )
    listed = [line.split("  ", 1) for line in digest.read_text().splitlines() if line]
    for want, name in listed:
        file = path / name
        got = file_sha256(file) if file.is_file() else "missing"
        if got != want:
            raise UserError(
                f"checkpoint {path} is not the one that was written (its {name}'s sha256 {got[:16]}... "
                f"differs from {digest.name}'s {want[:16]}...); valid: a checkpoint whose bytes match its "
                "digest"
            )
    if STATE_FILE not in {name for _, name in listed}:
        raise UserError(f"{path} is not a hypertrain checkpoint (no {STATE_FILE}); valid: a whole checkpoint")
