"""Datasets behind one `SampleFn`: `get(id)` returns example `id` as an int64 array of token ids.

`build_dataset(cfg)` turns a `DataConfig` into a `Dataset` of `n_total` examples in a seeded shuffled
order; the last `cfg.heldout` ids are the held-out slice. The same config gives the same rows in every
process. `load_batch` stacks fixed-length rows into a tensor; `pad_batch` pads variable-length ones.

Sources (all read in sorted path order, files concatenated without separators):
- `stdlib`: the running Python's own standard-library `.py` files, byte-level (vocab 256); no download.
- `text_files`: the files matched by the glob `cfg.path` (`**` recursive), byte-level (vocab 256).
- `token_bin`: a flat little-endian uint16/uint32 token file (nanoGPT's `train.bin`), memory-mapped;
  `vocab` is its largest token id + 1 (the trainer checks `model.vocab >= dataset.vocab`).
Examples:
- `windows`: window w is tokens `[w*seq_len, w*seq_len + seq_len + 1)`, so consecutive windows share
  one token and every token but the first is a target once; `n_total = (n_tokens - 1) // seq_len`.
- `documents` (byte sources): each file split on `b"\\n\\n"` into paragraphs, each cut to its first
  `max_len + 1` tokens; paragraphs under 2 tokens (no input/target pair) are dropped.
Stream id i is example `perm[i]`, `perm = np.random.default_rng(shuffle_seed).permutation(n_total)`,
so the held-out slice is a uniform sample of the examples and, being a permutation, never shares an
example with the training ids `0 .. n_total - heldout - 1`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import operator
import os
import platform
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from hypertrain.config import ConfigError, DataConfig

SampleFn = Callable[[int], np.ndarray]

# Bumped whenever the way examples are derived from the source changes, so old fingerprints differ.
_FINGERPRINT_VERSION = 1
_EXCLUDED_DIRS = ("site-packages", "dist-packages")
_TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_HASH_CHUNK = 1 << 24  # tokens per chunk when hashing and scanning a token file


@dataclass(frozen=True, eq=False)
class Dataset:
    """`n_total` examples in stream order; `get(id)` copies one out as int64 token ids."""

    n_total: int  # examples in the stream, the held-out slice included
    vocab: int  # token ids are in [0, vocab)
    fingerprint: str  # sha256 hex of the source and the settings that determine the examples
    description: str  # one line for logs
    fixed_length: bool  # every example has `max_length` tokens (windows)
    max_length: int  # tokens in the longest example (seq_len + 1 for windows)
    _tokens: np.ndarray = field(repr=False)  # the whole token stream (uint8, or a uint16/32 memmap)
    _starts: np.ndarray = field(repr=False)  # int64 [n_total]: where stream id i starts in _tokens
    _lengths: np.ndarray | None = field(repr=False)  # int64 [n_total]; None when fixed_length

    def __len__(self) -> int:
        return self.n_total

    def get(self, sample_id: int) -> np.ndarray:
        """Example `sample_id` as a fresh int64 array; the same id always gives the same row."""
        i = operator.index(sample_id)
        if not 0 <= i < self.n_total:
            raise IndexError(f"sample id {i} is outside the stream; valid: 0..{self.n_total - 1}")
        start = int(self._starts[i])
        length = self.max_length if self._lengths is None else int(self._lengths[i])
        return np.array(self._tokens[start : start + length], dtype=np.int64)

    def get_many(self, ids: Iterable[int]) -> np.ndarray:
        """Fixed-length examples `ids` as one int64 array [len(ids), max_length], by one fancy index."""
        if not self.fixed_length:
            raise ValueError("get_many needs fixed-length examples (windows); use get and pad_batch")
        index = self._checked(ids)
        positions = self._starts[index][:, None] + np.arange(self.max_length)
        return np.asarray(self._tokens[positions], dtype=np.int64)

    def lengths(self, ids: Iterable[int]) -> np.ndarray:
        """Token counts of examples `ids` as int64, without reading their tokens."""
        index = self._checked(ids)
        if self._lengths is None:
            return np.full(len(index), self.max_length, dtype=np.int64)
        return self._lengths[index].copy()

    def _checked(self, ids: Iterable[int]) -> np.ndarray:
        index = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= self.n_total):
            bad = index[(index < 0) | (index >= self.n_total)][0]
            raise IndexError(f"sample id {bad} is outside the stream; valid: 0..{self.n_total - 1}")
        return index


@dataclass(frozen=True)
class _Source:
    tokens: np.ndarray  # the concatenated token stream
    file_bounds: np.ndarray  # int64 [n_files + 1]: file f is tokens[bounds[f]:bounds[f + 1]]
    digest: str  # sha256 hex of the file names and contents, in order
    label: str  # the start of the description, e.g. "stdlib (Python 3.11.7): 1790 files, 31.5 MB"
    vocab: int


def build_dataset(cfg: DataConfig) -> Dataset:
    """The dataset `cfg` describes; raises ConfigError (one line) for a missing or too short source."""
    if cfg.examples not in ("windows", "documents"):
        raise ConfigError(f"data.examples={cfg.examples!r} is not valid; valid: 'windows', 'documents'")
    if cfg.name == "stdlib":
        source = _stdlib_source()
    elif cfg.name == "text_files":
        source = _text_files_source(cfg.path)
    elif cfg.name == "token_bin":
        if cfg.examples != "windows":
            raise ConfigError("data.examples='documents' needs text; data=token_bin gives windows only")
        source = _token_bin_source(cfg.path, cfg.token_dtype)
    else:
        raise ConfigError(f"data.name={cfg.name!r} is not valid; valid: 'stdlib', 'text_files', 'token_bin'")

    settings = {
        "v": _FINGERPRINT_VERSION,
        "data": cfg.name,
        "examples": cfg.examples,
        "seed": cfg.shuffle_seed,
    }
    if cfg.name == "token_bin":
        settings["token_dtype"] = cfg.token_dtype
    if cfg.examples == "windows":
        if cfg.seq_len < 1:
            raise ConfigError(f"data.seq_len={cfg.seq_len} is too small; valid: >= 1")
        settings["seq_len"] = cfg.seq_len
        n_total = max(len(source.tokens) - 1, 0) // cfg.seq_len
        example_starts, example_lengths = np.arange(n_total, dtype=np.int64) * cfg.seq_len, None
        max_length = cfg.seq_len + 1
        what = f"{n_total:,} windows of {max_length}"
    else:
        if cfg.max_len < 2:
            raise ConfigError(f"data.max_len={cfg.max_len} is too small; valid: >= 2")
        settings["max_len"] = cfg.max_len
        example_starts, example_lengths = _paragraphs(source, cfg.max_len + 1)
        n_total = len(example_starts)
        max_length = int(example_lengths.max()) if n_total else 0
        mean = float(example_lengths.mean()) if n_total else 0.0
        what = f"{n_total:,} paragraphs of 2..{max_length} tokens (mean {mean:.0f}, cut at {cfg.max_len + 1})"

    if n_total <= cfg.heldout:
        raise ConfigError(
            f"data.heldout={cfg.heldout} leaves no training examples: data={cfg.name} gives {n_total} "
            f"{cfg.examples}; valid: heldout < {n_total} (or a longer source / shorter examples)"
        )
    order = np.random.default_rng(cfg.shuffle_seed).permutation(n_total)
    header = json.dumps(settings, sort_keys=True).encode()
    return Dataset(
        n_total=n_total,
        vocab=source.vocab,
        fingerprint=hashlib.sha256(header + b"\0" + source.digest.encode()).hexdigest(),
        description=f"{source.label}, {what}",
        fixed_length=example_lengths is None,
        max_length=max_length,
        _tokens=source.tokens,
        _starts=example_starts[order],
        _lengths=None if example_lengths is None else example_lengths[order],
    )


def load_batch(get: SampleFn | Dataset, ids: Iterable[int]) -> torch.Tensor:
    """Fixed-length examples `ids` as an int64 tensor [len(ids), T + 1], rows in `ids` order.

    `get` is a SampleFn or a Dataset; a Dataset (or its bound `get`) takes the vectorised `get_many`.
    Rows of different lengths raise ValueError: variable-length examples go through `pad_batch`.
    """
    dataset = get if isinstance(get, Dataset) else getattr(get, "__self__", None)
    if isinstance(dataset, Dataset) and dataset.fixed_length:
        return torch.from_numpy(dataset.get_many(ids))
    fetch = get.get if isinstance(get, Dataset) else get
    rows = [fetch(int(i)) for i in ids]
    if not rows:
        return torch.zeros((0, 0), dtype=torch.int64)
    lengths = {len(row) for row in rows}
    if len(lengths) > 1:
        raise ValueError(
            f"load_batch needs rows of one length, got lengths {min(lengths)}..{max(lengths)}; "
            "use pad_batch for variable-length examples"
        )
    return torch.from_numpy(np.stack(rows).astype(np.int64, copy=False))


def pad_batch(rows: list[np.ndarray], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows right-padded with 0 to the longest row (or `length`): int64 tokens [n, T] and bool mask [n, T].

    `mask[i, t]` is True where `tokens[i, t]` is a real token; the loss keeps the targets `mask[:, 1:]`.
    """
    row_lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    longest = int(row_lengths.max()) if len(rows) else 0
    width = longest if length is None else length
    if width < longest:
        raise ValueError(f"pad_batch length={length} is shorter than the longest row ({longest} tokens)")
    mask = np.arange(width) < row_lengths[:, None]
    tokens = np.zeros((len(rows), width), dtype=np.int64)
    if longest:
        tokens[mask] = np.concatenate(rows)  # mask is row-major, the order of the concatenated rows
    return torch.from_numpy(tokens), torch.from_numpy(mask)


def _stdlib_source() -> _Source:
    # Listing with os.walk, pruning site-packages before descending, takes ~20 ms; rglob walks
    # the installed packages too and takes ~300 ms. The whole build takes ~0.2-0.3 s, so no cache.
    root = sysconfig.get_paths()["stdlib"]
    names = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if not any(x in d for x in _EXCLUDED_DIRS)]
        prefix = os.path.relpath(directory, root).replace(os.sep, "/") + "/"
        names += [prefix.removeprefix("./") + f for f in files if f.endswith(".py")]
    names.sort()
    source = _read_files([os.path.join(root, n) for n in names], names)
    label = f"stdlib (Python {platform.python_version()}): {len(names)} files, {_megabytes(source)}"
    return replace(source, label=label)


def _text_files_source(pattern: str) -> _Source:
    expanded = os.path.expanduser(pattern)
    paths = [os.path.abspath(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p)]
    if not paths:
        raise ConfigError(
            f"data.path={pattern!r} matches no files; valid: a glob of text files, e.g. 'docs/**/*.txt'"
        )
    # Names relative to the files' common folder, so the fingerprint does not depend on where they live.
    base = os.path.commonpath(paths)
    base = os.path.dirname(base) if len(paths) == 1 else base
    entries = sorted((Path(os.path.relpath(p, base)).as_posix(), p) for p in paths)
    source = _read_files([p for _, p in entries], [name for name, _ in entries])
    return replace(source, label=f"text_files {pattern}: {len(paths)} files, {_megabytes(source)}")


def _read_files(paths: list[str], names: list[str]) -> _Source:
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
    return _Source(tokens, np.array(bounds, dtype=np.int64), digest.hexdigest(), "", vocab=256)


def _token_bin_source(path_text: str, token_dtype: str) -> _Source:
    if token_dtype not in _TOKEN_DTYPES:
        raise ConfigError(f"data.token_dtype={token_dtype!r} is not valid; valid: 'uint16', 'uint32'")
    dtype = _TOKEN_DTYPES[token_dtype]
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"data.path={path_text!r} is not a file; data=token_bin needs a flat {token_dtype} token file"
        )
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(
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
    return _Source(tokens, np.array([0, len(tokens)], dtype=np.int64), digest.hexdigest(), label, largest + 1)


def _paragraphs(source: _Source, cut: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and length (cut to `cut`) of every paragraph of at least 2 tokens, in file order."""
    starts, lengths = [], []
    bounds = source.file_bounds
    for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        sizes = np.array([len(p) for p in source.tokens[begin:end].tobytes().split(b"\n\n")], dtype=np.int64)
        starts.append(begin + np.concatenate(([0], np.cumsum(sizes[:-1] + 2))))  # + 2: the separator
        lengths.append(sizes)
    start = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
    length = np.minimum(np.concatenate(lengths), cut) if lengths else np.zeros(0, dtype=np.int64)
    keep = length >= 2
    return start[keep].astype(np.int64), length[keep].astype(np.int64)


def _megabytes(source: _Source) -> str:
    return f"{len(source.tokens) / 1e6:.1f} MB"
