"""Where a text dataset's tokens come from, read in sorted path order, files concatenated.

- `stdlib_source()`: the running Python's standard-library `.py` files, byte-level (vocab 256), no download.
- `text_files_source(glob)`: the files a glob matches (`**` recursive, not into symlinked folders;
  `expand_glob`), byte-level (vocab 256).
- `token_bin_source(path, dtype)`: a flat little-endian uint16/uint32 token file, memory-mapped.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import platform
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hypertrain.config import UserError

_EXCLUDED_DIRS = ("site-packages", "dist-packages")
_TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_HASH_CHUNK = 1 << 24  # tokens per chunk when hashing and scanning a token file


@dataclass(frozen=True)
class Source:
    tokens: np.ndarray  # the concatenated token stream
    file_bounds: np.ndarray  # int64 [n_files + 1]: file f is tokens[bounds[f]:bounds[f + 1]]
    digest: str  # sha256 hex of the file names and contents, in order
    label: str  # the start of the description, e.g. "stdlib (Python 3.11.7): 1790 files, 31.5 MB"
    vocab: int


def stdlib_source() -> Source:
    # Listing with os.walk, pruning site-packages before descending, takes ~20 ms; rglob walks
    # the installed packages too and takes ~300 ms. The whole build, de-duplication included, takes
    # ~0.15 s (windows) to ~0.2 s (documents), so no cache.
    root = sysconfig.get_paths()["stdlib"]
    names = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if not any(x in d for x in _EXCLUDED_DIRS)]
        prefix = os.path.relpath(directory, root).replace(os.sep, "/") + "/"
        names += [prefix.removeprefix("./") + f for f in files if f.endswith(".py")]
    names.sort()
    source = read_files([os.path.join(root, n) for n in names], names)
    label = f"stdlib (Python {platform.python_version()}): {len(names)} files, {megabytes(source)}"
    return replace(source, label=label)


def text_files_source(pattern: str) -> Source:
    entries = expand_glob(pattern)
    if not entries:
        raise UserError(
            f"data.path={pattern!r} matches no files; valid: a glob of text files, e.g. 'docs/**/*.txt'"
        )
    source = read_files([p for _, p in entries], [name for name, _ in entries])
    return replace(source, label=f"text_files {pattern}: {len(entries)} files, {megabytes(source)}")


def expand_glob(pattern: str, skipped: tuple[Path, ...] = ()) -> list[tuple[str, str]]:
    """The files `pattern` matches (`~` expanded, `**` recursive; none under a folder of `skipped`) as
    sorted (name, absolute path) pairs, each name relative to the files' common folder, so a fingerprint
    does not depend on where they live. `**` never enters a symlinked folder (a link back up would loop,
    a second name for a folder would read it twice), and a file reached by two names (a link to a file
    matched too, a symlinked folder named by a `*`) is read once, under its first name in sorted order."""
    expanded = os.path.expanduser(pattern)
    paths = sorted({os.path.abspath(p) for p in matches(expanded) if os.path.isfile(p)})
    skipped_real = [os.path.realpath(folder) for folder in skipped]
    real = {p: os.path.realpath(p) for p in paths}
    paths = [p for p in paths if not any(Path(real[p]).is_relative_to(folder) for folder in skipped_real)]
    if not paths:
        return []
    base = os.path.commonpath(paths)
    base = os.path.dirname(base) if len(paths) == 1 else base
    entries, seen = [], set()
    for name, path in sorted((Path(os.path.relpath(p, base)).as_posix(), p) for p in paths):
        if real[path] not in seen:
            seen.add(real[path])
            entries.append((name, path))
    return entries


def matches(pattern: str) -> Iterator[str]:
    """What `glob.iglob(pattern, recursive=True)` yields (hidden names matched only by a pattern that
    starts with a dot), except that `**` does not descend into symlinked folders."""
    if not glob.has_magic(pattern):
        if os.path.lexists(pattern):
            yield pattern
        return
    head, tail = os.path.split(pattern)
    for folder in matches(head) if glob.has_magic(head) else [head]:
        if tail == "**":
            yield from below(folder)
        elif glob.has_magic(tail):
            names = [n for n in listed(folder) if not n.startswith(".") or tail.startswith(".")]
            yield from (os.path.join(folder, n) for n in fnmatch.filter(names, tail))
        elif os.path.lexists(os.path.join(folder, tail)):
            yield os.path.join(folder, tail)


def below(folder: str) -> Iterator[str]:
    """`folder` and every path under it but hidden ones and symlinked folders, which `**` neither
    enters nor yields (a later part of the pattern would look inside)."""
    yield folder
    for name in listed(folder):
        path = os.path.join(folder, name)
        if name.startswith(".") or (os.path.islink(path) and os.path.isdir(path)):
            continue
        if os.path.isdir(path):
            yield from below(path)
        else:
            yield path


def listed(folder: str) -> list[str]:
    """The names in `folder` ("" is the working folder); none where it is no folder or unreadable."""
    try:
        return os.listdir(folder or os.curdir)
    except OSError:
        return []


def read_files(paths: list[str], names: list[str]) -> Source:
    digest = hashlib.sha256()
    chunks, bounds = [], [0]
    for path, name in zip(paths, names, strict=True):
        with open(path, "rb") as file:
            data = file.read()
        digest.update(os.fsencode(name) + b"\0" + str(len(data)).encode() + b"\0")
        digest.update(data)
        chunks.append(data)
        bounds.append(bounds[-1] + len(data))
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)  # read-only: rows are always copied out
    return Source(tokens, np.array(bounds, dtype=np.int64), digest.hexdigest(), "", vocab=256)


def token_bin_source(path_text: str, token_dtype: str) -> Source:
    assert token_dtype in _TOKEN_DTYPES, token_dtype  # DataConfig.check refuses any other
    dtype = _TOKEN_DTYPES[token_dtype]
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UserError(
            f"data.path={path_text!r} is not a file; data=token_bin needs a flat {token_dtype} token file"
        )
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise UserError(
            f"data.path={path_text!r} has {size} bytes, not a whole number of {token_dtype} tokens; "
            "valid: a flat token file written with that dtype (data.token_dtype)"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
    # One pass over the file gives both the content hash and the largest id (a few s per GB of tokens).
    digest, largest = hashlib.sha256(), -1
    for start in range(0, len(tokens), _HASH_CHUNK):
        chunk = np.asarray(tokens[start : start + _HASH_CHUNK])
        digest.update(chunk.tobytes())
        largest = max(largest, int(chunk.max()))
    label = f"token_bin {path.name} ({token_dtype}): {len(tokens):,} tokens, largest id {largest}"
    return Source(tokens, np.array([0, len(tokens)], dtype=np.int64), digest.hexdigest(), label, largest + 1)


def megabytes(source: Source) -> str:
    return f"{len(source.tokens) / 1e6:.1f} MB"
