"""Stream ids: id i of a stream of n examples is an index into it; anything outside is an IndexError."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import numpy as np


def stream_index(sample_id: int, n_total: int) -> int:
    """`sample_id` as an index into a stream of `n_total` examples; IndexError naming the valid range."""
    i = operator.index(sample_id)
    if not 0 <= i < n_total:
        raise IndexError(f"sample id {i} is outside the stream; valid: 0..{n_total - 1}")
    return i


def stream_indices(ids: Iterable[int], n_total: int) -> np.ndarray:
    """`ids` as an int64 index array into a stream of `n_total`; IndexError naming the first outside."""
    index = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
    if index.size and (index.min() < 0 or index.max() >= n_total):
        bad = index[(index < 0) | (index >= n_total)][0]
        raise IndexError(f"sample id {bad} is outside the stream; valid: 0..{n_total - 1}")
    return index
