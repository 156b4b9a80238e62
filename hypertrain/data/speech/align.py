"""Where each word was spoken, from espeak-ng's phoneme events, and its text tokens placed on those frames.

`word_spans(text, events, duration_ms)` gives each word its spoken interval in ms ((-1, -1): none);
`place_tokens(spans, token_counts, frames)` puts each word's tokens on consecutive frames inside it,
or gives None when some word's do not fit (docs/audio.md, "alignment" and "text tokens").
"""

from __future__ import annotations

import re

import numpy as np

from hypertrain.data.speech.features import frame_span
from hypertrain.data.speech.speech import PHONEME


def words(text: str) -> list[tuple[int, int]]:
    """Character [start, end) of each whitespace-separated word of `text`."""
    return [m.span() for m in re.finditer(r"\S+", text)]


def word_spans(text: str, events: np.ndarray, duration_ms: float) -> np.ndarray:
    """int64 [n_words, 2]: the ms [start, end) of each word's phonemes; (-1, -1) for a word without any."""
    bounds = words(text)
    starts = np.array([a for a, _ in bounds], dtype=np.int64)
    spans = np.full((len(bounds), 2), -1, dtype=np.int64)
    phonemes = events[events["type"] == PHONEME]
    if not len(bounds) or not len(phonemes):
        return spans
    ends = np.append(phonemes["ms"][1:], max(duration_ms, phonemes["ms"][-1]))
    # The word a position falls in, or, for a space between words, the word after it.
    owner = np.clip(np.searchsorted(starts, phonemes["position"], side="right") - 1, 0, len(bounds) - 1)
    between = phonemes["position"] >= np.array([bounds[i][1] for i in owner])
    owner = np.minimum(owner + between, len(bounds) - 1)
    names, times = phonemes["name"].tolist(), phonemes["ms"].tolist()
    for i, name, start, end in zip(owner.tolist(), names, times, ends.tolist(), strict=True):
        if name.startswith(b"_"):
            continue  # a pause
        if spans[i, 0] < 0:
            spans[i] = (start, end)
        else:
            spans[i] = (min(spans[i, 0], start), max(spans[i, 1], end))
    return spans


def frame_spans(spans: np.ndarray, frames: int) -> np.ndarray:
    """int64 [n_words, 2]: the first and last frame overlapping each word's ms interval (-1 rows kept)."""
    out = np.full_like(spans, -1)
    for i, (start, end) in enumerate(spans.tolist()):
        if start >= 0:
            out[i] = frame_span(start, end, frames)
    return out


def place_tokens(frame_ranges: np.ndarray, token_counts: list[int], frames: int) -> np.ndarray | None:
    """The frame of each word's first token (int64 [n_words]); a word's tokens take the frames after it.

    Words are placed in order, each as early as its spoken frames and the words before it allow; a word
    without speech (range -1) goes right after the tokens of the word before it (for leading ones: just
    before the first spoken word's, all within that word's frames). None when a word's tokens, with
    those of the unspoken words that ride on it, do not fit inside its spoken frames.
    """
    spoken = [i for i in range(len(token_counts)) if frame_ranges[i, 0] >= 0]
    if not spoken:
        return None
    # Each unit: one spoken word with the unspoken words that ride on it, as (first word, last word).
    units = []
    for k, i in enumerate(spoken):
        first = 0 if k == 0 else i
        last = spoken[k + 1] - 1 if k + 1 < len(spoken) else len(token_counts) - 1
        units.append((first, last, i))
    positions = np.zeros(len(token_counts), dtype=np.int64)
    free = 0
    for first, last, i in units:
        lo, hi = int(frame_ranges[i, 0]), int(frame_ranges[i, 1])
        need = sum(token_counts[first : last + 1])
        start = max(lo, free)
        if start + need - 1 > min(hi, frames - 1):
            return None
        for j in range(first, last + 1):
            positions[j] = start
            start += token_counts[j]
        free = start
    return positions
