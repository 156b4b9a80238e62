"""What every dataset offers (`Dataset`, and `MultistreamDataset` for examples of several token
channels), whichever entry of the table `hypertrain.data.SOURCES` built it (`hypertrain.data.build_dataset`):
text (`text.py`: windows or documents), a prepared corpus (`prepared.py`, a `text.TextDataset` too)
or speech (`speech/`).
Every kind gives `n_total` examples in a seeded stream order; the last `data.heldout` ids are held out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import numpy as np


class Dataset(Protocol):
    """`n_total` examples in stream order, each read by its id; what preparation, the batches and the
    records read of any dataset (`text.TextDataset`, `speech.dataset.SpeechDataset`)."""

    n_total: int  # examples in the stream, the held-out slice included
    vocab: int  # every token id is below this
    fingerprint: str  # sha256 hex of what determines the examples and their order
    description: str  # one line for logs
    duplicates: int  # examples dropped because an earlier one is the same
    fixed_length: bool  # every example has `max_length` tokens (then a batch needs no padding)
    max_length: int  # the longest example's length (positions)

    def __len__(self) -> int: ...

    def get(self, sample_id: int) -> np.ndarray:
        """Example `sample_id` as a fresh int64 array: [L] tokens, or [C, L] for several channels."""
        ...

    def lengths(self, ids: Iterable[int]) -> np.ndarray:
        """int64 lengths L of examples `ids`, without reading their tokens."""
        ...


@runtime_checkable
class MultistreamDataset(Protocol):
    """What a dataset whose examples are [C, L] (a negative id = no token) offers besides `Dataset`:
    `batches.is_multistream` is an isinstance check on it."""

    channel_vocabs: tuple[int, ...]  # channel c's ids are in [0, channel_vocabs[c])
    channel_scales: tuple[float, ...]  # each channel's k in the loss weights (docs/design.md)

    def channel_counts(self, ids: Iterable[int]) -> np.ndarray:
        """int64 [len(ids), C]: each example's targets per channel."""
        ...
