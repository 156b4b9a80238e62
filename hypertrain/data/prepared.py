"""`data=prepared`: a corpus `python -m hypertrain.data prepare` wrote (`corpus.py`) as a `TextDataset`.

`prepared_dataset(cfg)` cuts the corpus's documents into examples, holds out whole documents of every
source and orders the rest into the plan's stream (docs/data.md, "Training on a prepared corpus"):
- A *run* is a maximal range of consecutive training documents of one source (with
  `window_across_documents=false`, one document). `windows`: window w of a run starting at `a` is tokens
  `[a + w*seq_len, a + w*seq_len + seq_len + 1)`, so windows cross documents (the eod between them) but
  never a held-out document nor a source boundary. `documents`: each document, its eod included, cut to
  `max_len + 1` tokens; one under 2 tokens is dropped. Every example belongs to exactly one source.
- Held-out: of S sources, held-out id N + j is an example of source j mod S. One
  `np.random.default_rng(shuffle_seed)` is used in a fixed order: per source, a permutation of its
  documents, whose shortest prefix holding enough examples (each document alone) is held out; then the
  training stream's permutation(s).
- `replica_split=iid`: every source's training examples pooled in source order, then permuted.
  `by_source`: each source's permuted on its own, then interleaved, id i < N being source (i mod S)'s
  example i // S, N = S * (the fewest any source has; the rest dropped). With S = 1 both are the same.
Examples are not de-duplicated (`duplicates` is 0): the corpus is taken as prepared. The fingerprint
covers the settings, the corpus's files (their sha256 in the meta, which `corpus.read` checks the
files against first) and the resulting order.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import numpy as np

import hypertrain.data.corpus as corpus_format
from hypertrain.config import DataConfig, UserError
from hypertrain.data.text import TextDataset

_FINGERPRINT_VERSION = 1


def heldout_per_source(heldout: int, sources: int) -> list[int]:
    """h_s: the held-out examples source s gives (held-out id N + j is source j mod S's)."""
    return [len(range(s, heldout, sources)) for s in range(sources)]


def _windows_in(begin: np.ndarray, end: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows of seq_len + 1 tokens (sharing one) in each token range [begin, end)."""
    return np.maximum(end - begin - 1, 0) // seq_len


def _window_starts(begin: np.ndarray, counts: np.ndarray, seq_len: int) -> np.ndarray:
    """The start of every window of ranges starting at `begin` holding `counts` windows, in order."""
    total = int(counts.sum())
    first = np.repeat(begin, counts)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return first + within * seq_len


class _Examples(NamedTuple):
    """Examples as parallel int64 arrays: where each starts, its length, its source."""

    starts: np.ndarray
    lengths: np.ndarray
    sources: np.ndarray


def _cut(cfg: DataConfig, starts: np.ndarray, docs: np.ndarray, alone: bool) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the examples of documents `docs` (one source's), in the order of `docs`.
    `alone`: each document is its own run (held-out documents, or window_across_documents=false);
    otherwise `docs` are increasing and each range of consecutive ones is a run."""
    if len(docs) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    begin, end = starts[docs], starts[docs + 1]
    if cfg.examples == "documents":
        lengths = np.minimum(end - begin, cfg.max_len + 1)
        keep = lengths >= 2
        return begin[keep], lengths[keep]
    if not alone:  # runs: maximal ranges of consecutive documents
        opens = np.ones(len(docs), dtype=bool)
        opens[1:] = docs[1:] != docs[:-1] + 1
        closes = np.ones(len(docs), dtype=bool)
        closes[:-1] = opens[1:]
        begin, end = begin[opens], end[closes]
    counts = _windows_in(begin, end, cfg.seq_len)
    return _window_starts(begin, counts, cfg.seq_len), np.full(int(counts.sum()), cfg.seq_len + 1, np.int64)


def _examples_per_document(cfg: DataConfig, starts: np.ndarray, docs: np.ndarray) -> np.ndarray:
    lengths = starts[docs + 1] - starts[docs]
    if cfg.examples == "documents":
        return (np.minimum(lengths, cfg.max_len + 1) >= 2).astype(np.int64)
    return _windows_in(np.zeros_like(lengths), lengths, cfg.seq_len)


def _split(cfg: DataConfig, meta: corpus_format.Meta, starts: np.ndarray, rng) -> tuple[list, list]:
    """Per source: its training examples (starts, lengths) in corpus order, and its held-out examples
    (the first h_s of its held-out documents', in the permutation's order)."""
    bounds = meta.source_documents
    need = heldout_per_source(cfg.heldout, len(meta.sources))
    training, heldout = [], []
    for s, source in enumerate(meta.sources):
        docs = np.arange(bounds[s], bounds[s + 1], dtype=np.int64)
        order = docs[rng.permutation(len(docs))]
        have = np.cumsum(_examples_per_document(cfg, starts, order))
        holds = int(have[-1]) if len(have) else 0
        if holds < need[s]:
            raise UserError(
                f"source {s} of data.path={cfg.path!r} ({source.name}) holds {holds} {cfg.examples}, fewer "
                f"than the {need[s]} held-out ones it owes (held-out id N + j is source j mod "
                f"{len(meta.sources)}'s); valid: a smaller data.heldout, or more text in that source"
            )
        prefix = int(np.searchsorted(have, need[s])) + 1 if need[s] else 0
        out = order[:prefix]
        held_starts, held_lengths = _cut(cfg, starts, out, alone=True)  # in the permutation's order
        trained = np.ones(len(docs), dtype=bool)
        trained[out - bounds[s]] = False
        training.append(_cut(cfg, starts, docs[trained], alone=not cfg.window_across_documents))
        heldout.append((held_starts[: need[s]], held_lengths[: need[s]]))
    return training, heldout


def _stream(cfg: DataConfig, training: list, rng) -> tuple[_Examples, str]:
    """The training stream's examples in stream order, and a line saying how many each source gave."""
    S = len(training)
    counts = [len(t[0]) for t in training]
    if cfg.replica_split == "iid":
        starts = np.concatenate([t[0] for t in training])
        lengths = np.concatenate([t[1] for t in training])
        sources = np.repeat(np.arange(S, dtype=np.int64), counts)
        order = rng.permutation(len(starts))
        return _Examples(starts[order], lengths[order], sources[order]), ""
    fewest = min(counts)
    orders = [rng.permutation(n)[:fewest] for n in counts]  # each source's own permutation, cut
    starts = np.stack([t[0][o] for t, o in zip(training, orders, strict=True)], axis=1).reshape(-1)
    lengths = np.stack([t[1][o] for t, o in zip(training, orders, strict=True)], axis=1).reshape(-1)
    sources = np.tile(np.arange(S, dtype=np.int64), fewest)
    dropped = sum(n - fewest for n in counts)
    note = f"; by_source: {fewest:,} per source, {dropped:,} dropped" if S > 1 else ""
    return _Examples(starts, lengths, sources), note


def prepared_dataset(cfg: DataConfig) -> TextDataset:
    """The dataset of the prepared corpus at `cfg.path`; UserError (one line) when it is not one, or a
    source cannot give its held-out share or training examples. `cfg` is checked (`validate`)."""
    assert cfg.name == "prepared" and cfg.examples in ("windows", "documents"), cfg
    corpus = corpus_format.read(cfg.path)
    meta, S = corpus.meta, len(corpus.meta.sources)
    if S == 0 or meta.documents == 0:
        raise UserError(f"data.path={cfg.path!r} holds no documents; valid: a corpus prepared from some text")
    rng = np.random.default_rng(cfg.shuffle_seed)
    training, heldout = _split(cfg, meta, corpus.starts, rng)
    stream, note = _stream(cfg, training, rng)
    if len(stream.starts) == 0:
        raise UserError(
            f"data.path={cfg.path!r} leaves no training {cfg.examples} once data.heldout={cfg.heldout} "
            f"whole documents are held out (replica_split={cfg.replica_split}); valid: a smaller "
            "data.heldout, a smaller data.seq_len, or more text in every source"
        )
    need = heldout_per_source(cfg.heldout, S)
    held = np.array([(j % S, j // S) for j in range(cfg.heldout)], dtype=np.int64).reshape(-1, 2)
    held_starts = np.array([heldout[s][0][k] for s, k in held.tolist()], dtype=np.int64)
    held_lengths = np.array([heldout[s][1][k] for s, k in held.tolist()], dtype=np.int64)
    assert [int((held[:, 0] == s).sum()) for s in range(S)] == need
    starts = np.concatenate([stream.starts, held_starts])
    lengths = np.concatenate([stream.lengths, held_lengths])
    sources = np.concatenate([stream.sources, held[:, 0]]).astype(np.int64)

    settings = {
        "v": _FINGERPRINT_VERSION,
        "data": cfg.name,
        "examples": cfg.examples,
        "seed": cfg.shuffle_seed,
        "heldout": cfg.heldout,
        "window_across_documents": cfg.window_across_documents,
    }
    if S > 1:  # one source: iid and by_source are the same stream
        settings["replica_split"] = str(cfg.replica_split)
    settings |= {"seq_len": cfg.seq_len} if cfg.examples == "windows" else {"max_len": cfg.max_len}
    order = np.concatenate([starts, lengths]).astype("<i8")
    order_digest = hashlib.sha256(np.ascontiguousarray(order)).hexdigest()
    parts = [meta.tokens_sha256, meta.documents_sha256, meta.tokenizer_sha256, order_digest]
    header = json.dumps(settings, sort_keys=True).encode()
    fingerprint = hashlib.sha256(b"\0".join([header, *(p.encode() for p in parts)])).hexdigest()

    windows = cfg.examples == "windows"
    n_total = len(starts)
    if windows:
        across = "across documents" if cfg.window_across_documents else "inside documents"
        what = f"{n_total:,} windows of {cfg.seq_len + 1} ({across})"
    else:
        what = f"{n_total:,} documents of 2..{int(lengths.max())} tokens (cut at {cfg.max_len + 1})"
    per_source = ", ".join(f"{len(t[0]):,}" for t in training)
    description = (
        f"prepared {cfg.path}: {meta.describe()}; {what}, training {cfg.examples} per source {per_source}"
        f"{note}; {cfg.heldout} held out, whole documents of every source"
        + (f"; replica_split={cfg.replica_split}" if S > 1 else "")
    )
    return TextDataset(
        n_total=n_total,
        vocab=meta.vocab,
        fingerprint=fingerprint,
        description=description,
        duplicates=0,
        fixed_length=windows,
        max_length=cfg.seq_len + 1 if windows else int(lengths.max()),
        _tokens=corpus.tokens,
        _starts=starts,
        _lengths=None if windows else lengths,
        source_names=tuple(s.name for s in meta.sources),
        corpus=meta.describe(),
        tokenizer_sha256=meta.tokenizer_sha256,
        _sources=sources.astype(np.int32) if S > 1 else None,
    )
