"""Text datasets behind one `SampleFn`: `get(id)` returns example `id` as an int64 array of token ids.

`text_dataset(cfg, entry)` turns a `DataConfig` and its data source's entry (a `TextSource`: one of
`hypertrain.data.SOURCES` or from outside the package, whose `read` gives the token stream) into a
`TextDataset` (a `datasets.Dataset`) of `n_total` examples in a seeded shuffled order; the last
`cfg.heldout` ids are the held-out slice. The same config gives the same rows in every process.
`load_batch` stacks fixed-length rows into a tensor; `pad_batch` pads variable-length ones.

Sources: `sources.py`. Examples:
- `windows`: window w is tokens `[w*seq_len, w*seq_len + seq_len + 1)`, so consecutive windows share
  one token and every token but the first is a target once; there are `(n_tokens - 1) // seq_len`.
- `documents` (byte sources): each file split on `b"\\n\\n"` into paragraphs, each cut to its first
  `max_len + 1` tokens; paragraphs under 2 tokens (no input/target pair) are dropped.
Examples are de-duplicated by content (the tokens of the example as presented, after the cut): of
equal examples only the first in source order is kept, so no two ids hold the same tokens, and in
particular no held-out example also appears among the training ids (licence headers and other
boilerplate repeat across files). `n_total` counts the distinct examples; the description says how
many duplicates were dropped. Windows are grouped by a vectorised 64-bit hash and then compared
token for token, so the result depends on content only, never on the hash.
Stream id i is distinct example `perm[i]`, `perm = np.random.default_rng(shuffle_seed).permutation(n_total)`,
so the held-out slice is a uniform sample of the distinct examples. numpy does not promise that stream
across versions, so the fingerprint covers the resulting order: two machines whose orders differ get
different fingerprints.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

import hypertrain.data.sources as sources
from hypertrain.config import DataConfig, UserError
from hypertrain.data.streams import stream_index, stream_indices

SampleFn = Callable[[int], np.ndarray]

# Bumped whenever the way examples are derived from the source changes, so old fingerprints differ.
_FINGERPRINT_VERSION = 2  # 2: examples de-duplicated by content; the order hashed in
_ROWS_CHUNK_BYTES = 1 << 22  # bytes of window rows handled at once when de-duplicating


class TextSource(Protocol):
    """What `text_dataset` asks of a data source's entry (`hypertrain.data.DataSource`)."""

    path: str  # what a required data.path names ("": none needed), for the too-short refusal
    tokenizer: str  # "bytes": its tokens are bytes (the refusal counts bytes, else tokens)

    def read(self, d: DataConfig) -> sources.Source: ...


@dataclass(frozen=True, eq=False)
class TextDataset:
    """`n_total` examples in stream order; `get(id)` copies one out as int64 token ids."""

    n_total: int  # examples in the stream, the held-out slice included
    vocab: int  # token ids are in [0, vocab)
    fingerprint: str  # sha256 hex of the source, the settings that determine the examples, and their order
    description: str  # one line for logs
    duplicates: int  # examples dropped because an earlier example has the same tokens
    fixed_length: bool  # every example has `max_length` tokens (windows)
    max_length: int  # tokens in the longest example (seq_len + 1 for windows)
    _tokens: np.ndarray = field(repr=False)  # the whole token stream (uint8, or a uint16/32 memmap)
    _starts: np.ndarray = field(repr=False)  # int64 [n_total]: where stream id i starts in _tokens
    _lengths: np.ndarray | None = field(repr=False)  # int64 [n_total]; None when fixed_length
    # data=prepared: the corpus's sources, its one-line description, its tokenizer.json's sha256 ("" for
    # bytes; what `python -m hypertrain.sample` compares) and each stream id's source (int32 [n_total];
    # None: every example is source 0's)
    source_names: tuple[str, ...] = ()
    corpus: str = ""
    tokenizer_sha256: str = ""
    _sources: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return self.n_total

    def get(self, sample_id: int) -> np.ndarray:
        """Example `sample_id` as a fresh int64 array; the same id always gives the same row."""
        i = stream_index(sample_id, self.n_total)
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

    def example_sources(self, ids: Iterable[int]) -> np.ndarray:
        """The source (an index into `source_names`) of each of examples `ids`, as int64."""
        index = self._checked(ids)
        if self._sources is None:
            return np.zeros(len(index), dtype=np.int64)
        return self._sources[index].astype(np.int64)

    def _checked(self, ids: Iterable[int]) -> np.ndarray:
        return stream_indices(ids, self.n_total)


def text_dataset(cfg: DataConfig, entry: TextSource) -> TextDataset:
    """The text dataset `cfg` describes, from the tokens its data source's `entry` reads
    (`data.build_dataset` gives speech's); raises UserError (one line) for a missing or too short
    source. `cfg` is checked (`validate`)."""
    assert cfg.examples in ("windows", "documents") and cfg.seq_len >= 1 and cfg.max_len >= 2, cfg
    source = entry.read(cfg)

    settings = {
        "v": _FINGERPRINT_VERSION,
        "data": cfg.name,
        "examples": cfg.examples,
        "seed": cfg.shuffle_seed,
    }
    if cfg.name == "token_bin":
        settings["token_dtype"] = cfg.token_dtype
    if cfg.examples == "windows":
        settings["seq_len"] = cfg.seq_len
        windows = max(len(source.tokens) - 1, 0) // cfg.seq_len
        kept = _distinct_windows(source.tokens, cfg.seq_len, windows)
        example_starts, example_lengths = kept * cfg.seq_len, None
        n_total, duplicates = len(kept), windows - len(kept)
        max_length = cfg.seq_len + 1
        what = f"{n_total:,} windows of {max_length} ({duplicates:,} duplicates dropped)"
    else:
        settings["max_len"] = cfg.max_len
        example_starts, example_lengths, duplicates = _paragraphs(source, cfg.max_len + 1)
        n_total = len(example_starts)
        max_length = int(example_lengths.max()) if n_total else 0
        mean = float(example_lengths.mean()) if n_total else 0.0
        what = (
            f"{n_total:,} paragraphs of 2..{max_length} tokens (mean {mean:.0f}, cut at {cfg.max_len + 1}; "
            f"{duplicates:,} duplicates dropped)"
        )

    if n_total <= cfg.heldout:
        raise UserError(_too_short(cfg, entry, source, n_total, duplicates))
    order = np.random.default_rng(cfg.shuffle_seed).permutation(n_total)
    stream_starts = example_starts[order]
    # The order is hashed in (numpy does not promise permutation's stream across versions): the
    # starts of the stream's examples in stream order, as little-endian int64, cover both the
    # permutation and which examples were kept.
    order_digest = hashlib.sha256(np.ascontiguousarray(stream_starts, dtype="<i8")).hexdigest()
    header = json.dumps(settings, sort_keys=True).encode()
    fingerprint = hashlib.sha256(header + b"\0" + source.digest.encode() + b"\0" + order_digest.encode())
    return TextDataset(
        n_total=n_total,
        vocab=source.vocab,
        fingerprint=fingerprint.hexdigest(),
        description=f"{source.label}, {what}",
        duplicates=duplicates,
        fixed_length=example_lengths is None,
        max_length=max_length,
        _tokens=source.tokens,
        _starts=stream_starts,
        _lengths=None if example_lengths is None else example_lengths[order],
    )


def _too_short(
    cfg: DataConfig, entry: TextSource, source: sources.Source, n_total: int, duplicates: int
) -> str:
    """One line for a source with no more examples than the held-out slice, naming the source (its
    data.path where it needs one)."""
    where = f"data.path={cfg.path!r}" if entry.path else f"data={cfg.name}"
    unit = "bytes" if entry.tokenizer == "bytes" else "tokens"
    one = "window" if cfg.examples == "windows" else "paragraph"
    valid = f"a source with more than data.heldout={cfg.heldout} {one}s"
    holds = f"{where} holds {len(source.tokens):,} {unit}"
    if n_total == 0:
        need = f"seq_len + 1 = {cfg.seq_len + 1}" if cfg.examples == "windows" else "at least 2"
        return f"{holds}: no {one}s (one needs {need} {unit}); valid: {valid}"
    gives = f"{n_total:,} distinct {one}{'s' if n_total > 1 else ''}"
    dropped = f" ({duplicates:,} duplicates dropped)" if duplicates else ""
    valid = f"data.heldout < {n_total}, or {valid}" if n_total > 1 else valid
    return (
        f"{holds}: {gives}{dropped}, not more than "
        f"data.heldout={cfg.heldout}, so none to train on; valid: {valid}"
    )


def load_batch(get: SampleFn | TextDataset, ids: Iterable[int]) -> torch.Tensor:
    """Fixed-length examples `ids` as an int64 tensor [len(ids), T + 1], rows in `ids` order.

    `get` is a SampleFn or a TextDataset; a TextDataset (or its bound `get`) takes the vectorised
    `get_many`.
    Rows of different lengths raise ValueError: variable-length examples go through `pad_batch`.
    """
    dataset = get if isinstance(get, TextDataset) else getattr(get, "__self__", None)
    if isinstance(dataset, TextDataset) and dataset.fixed_length:
        return torch.from_numpy(dataset.get_many(ids))
    fetch = get.get if isinstance(get, TextDataset) else get
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


def _paragraphs(source: sources.Source, cut: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Start, length (cut to `cut`) of the first of each distinct paragraph of >= 2 tokens, in file order.

    Also the number of paragraphs dropped as duplicates: equal to an earlier one once cut.
    """
    starts, lengths, seen, duplicates = [], [], set(), 0
    bounds = source.file_bounds
    for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        position = begin
        for paragraph in source.tokens[begin:end].tobytes().split(b"\n\n"):
            example = paragraph[:cut]
            if len(example) >= 2:
                if example in seen:
                    duplicates += 1
                else:
                    seen.add(example)
                    starts.append(position)
                    lengths.append(len(example))
            position += len(paragraph) + 2  # + 2: the separator
    return np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64), duplicates


def _distinct_windows(tokens: np.ndarray, seq_len: int, n: int) -> np.ndarray:
    """Indices of windows `0..n-1` whose tokens no earlier window has, increasing (first occurrences)."""
    length = seq_len + 1
    data = np.asarray(tokens)  # a memmap stays a view: rows are read on demand

    def rows(windows: np.ndarray) -> np.ndarray:
        return data[windows[:, None] * seq_len + np.arange(length)]

    # One np.sort of (key, window) packed in a uint64, the key's high bits above the window's index,
    # orders by key and, within a key, by source order (3x faster than a stable argsort). The key
    # loses `bits` bits: a few more windows share a key, which only means a few more comparisons.
    bits = max(1, (n - 1).bit_length())
    packed = _window_hashes(tokens, seq_len, n) >> np.uint64(bits) << np.uint64(bits)
    packed |= np.arange(n, dtype=np.uint64)
    packed.sort()
    order = (packed & np.uint64((1 << bits) - 1)).astype(np.int64)
    packed >>= np.uint64(bits)  # the keys, sorted
    opens = np.ones(n, dtype=bool)
    opens[1:] = packed[1:] != packed[:-1]
    first = np.empty(n, dtype=np.int64)  # first[w]: the earliest window with w's key
    first[order] = order[np.maximum.accumulate(np.where(opens, np.arange(n), 0))]
    keep = first == np.arange(n)
    # A window whose key an earlier window has is a duplicate when its tokens equal that window's;
    # a key shared by different tokens (a hash collision) leaves its whole group to be settled by content.
    candidates = np.flatnonzero(~keep)
    step = max(1, _ROWS_CHUNK_BYTES // (length * data.dtype.itemsize))
    collided = [np.zeros(0, dtype=np.int64)]
    for i in range(0, len(candidates), step):
        chunk = candidates[i : i + step]
        differ = (rows(chunk) != rows(first[chunk])).any(axis=1)
        collided.append(first[chunk[differ]])
    collided_keys = np.unique(np.concatenate(collided))
    if len(collided_keys):
        members = np.flatnonzero(np.isin(first, collided_keys))  # every window of those groups, in order
        seen = set()
        for i in range(0, len(members), step):
            chunk = members[i : i + step]
            for window, row in zip(chunk.tolist(), rows(chunk), strict=True):
                content = row.tobytes()
                keep[window] = content not in seen
                seen.add(content)
    return np.flatnonzero(keep).astype(np.int64)


def _window_hashes(tokens: np.ndarray, seq_len: int, n: int) -> np.ndarray:
    """A uint64 key per window `0..n-1` that equal windows share (distinct ones almost never do).

    Multilinear hashing: the window's bytes as little-endian 32-bit words, each times its own odd
    64-bit constant, summed mod 2**64 (about 2 GB/s, faster than the sha256 of the source).
    """
    length, itemsize = seq_len + 1, tokens.dtype.itemsize
    size = length * itemsize
    words = -(-size // 4)
    multipliers = _odd_constants(words)
    step = max(1, _ROWS_CHUNK_BYTES // (words * 4))
    keys = np.empty(n, dtype=np.uint64)
    for w0 in range(0, n, step):
        w1 = min(n, w0 + step)
        span = np.ascontiguousarray(tokens[w0 * seq_len : (w1 - 1) * seq_len + length]).view(np.uint8)
        rows = np.lib.stride_tricks.as_strided(
            span, shape=(w1 - w0, size), strides=(seq_len * itemsize, 1), writeable=False
        )
        padded = np.zeros((w1 - w0, words * 4), dtype=np.uint8)
        padded[:, :size] = rows
        keys[w0:w1] = padded.view("<u4").astype(np.uint64) @ multipliers
    return keys


def _odd_constants(count: int) -> np.ndarray:
    """`count` fixed odd uint64 constants (splitmix64 of 1..count), the same on every machine."""
    with np.errstate(over="ignore"):
        z = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) | np.uint64(1)
