"""The speech dataset behind `get(id)`: variable-length multistream examples read from the built cache.

`speech_dataset(cfg)` returns a `SpeechDataset` on the cache of `cfg`, building it first when absent
(one line, then `python -m hypertrain.data.speech build` in a subprocess). An example's layout, its
channel counts and scales, and the stream order: docs/audio.md, "An example".
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path

import numpy as np

from hypertrain.config import DataConfig, UserError
from hypertrain.data.speech import cache, text
from hypertrain.data.speech.codes import Quantizer
from hypertrain.data.streams import stream_index, stream_indices

logger = logging.getLogger(__name__)
NO_TOKEN = -1
_FINGERPRINT_VERSION = 1


@dataclass(frozen=True, eq=False)
class SpeechDataset:
    """`n_total` utterances in stream order; `get(id)` copies one out as int64 [channels, positions]."""

    n_total: int  # examples in the stream, the held-out slice included
    channel_names: tuple[str, ...]  # "text", "codebook 1", ..., "codebook K"
    channel_vocabs: tuple[int, ...]  # channel c's ids are in [0, channel_vocabs[c])
    channel_scales: tuple[float, ...]  # the seed's k per channel: 1 for text, 32 / K per codebook
    audio_delay: int  # positions codebooks 2..K lag the text and codebook 1
    fingerprint: str  # sha256 hex of the cache's content, the delay and the stream order
    description: str  # one line for logs
    duplicates: int  # sentences dropped because an earlier one has the same text
    max_length: int  # positions in the longest example
    directory: Path  # the cache directory
    manifest: dict = field(repr=False)  # the build's inputs and figures
    _text: np.ndarray = field(repr=False)  # uint16 [F] memmap: each frame's text token
    _codes: np.ndarray = field(repr=False)  # uint16 [F, K] memmap
    _starts: np.ndarray = field(repr=False)  # int64 [n_total]: stream id i's first frame in _text/_codes
    _frames: np.ndarray = field(repr=False)  # int64 [n_total]: stream id i's frames T
    _order: np.ndarray = field(repr=False)  # int64 [n_total]: stream id i is cached example _order[i]

    fixed_length = False  # examples have different lengths (batches pad them)

    @property
    def channels(self) -> int:
        return len(self.channel_names)

    @property
    def vocab(self) -> int:
        """Every id of every channel is below this (the largest channel vocabulary)."""
        return max(self.channel_vocabs)

    def __len__(self) -> int:
        return self.n_total

    def get(self, sample_id: int) -> np.ndarray:
        """Example `sample_id` as a fresh int64 [channels, positions] array (layout: module docstring)."""
        i = stream_index(sample_id, self.n_total)
        start, frames = int(self._starts[i]), int(self._frames[i])
        codes = np.asarray(self._codes[start : start + frames], dtype=np.int64).T  # [K, T]
        out = np.full((self.channels, self._length(frames)), NO_TOKEN, dtype=np.int64)
        out[0, 1 : frames + 1] = self._text[start : start + frames]
        out[0, frames + 1] = text.END
        out[1, 1 : frames + 1] = codes[0]
        out[2:, 1 + self.audio_delay : frames + 1 + self.audio_delay] = codes[1:]
        return out

    def get_many(self, ids: Iterable[int]) -> np.ndarray:
        """Examples `ids` as one int64 array [len(ids), channels, longest], right-padded with -1."""
        rows = [self.get(i) for i in self._checked(ids).tolist()]
        out = np.full((len(rows), self.channels, max((r.shape[1] for r in rows), default=0)), NO_TOKEN)
        for j, row in enumerate(rows):
            out[j, :, : row.shape[1]] = row
        return out

    def lengths(self, ids: Iterable[int]) -> np.ndarray:
        """Positions L of examples `ids` (int64), without reading their tokens: the microbatch lengths."""
        return self._length(self._frames[self._checked(ids)])

    def frames(self, ids: Iterable[int]) -> np.ndarray:
        """Frames T of examples `ids` (int64): 80 ms of speech each."""
        return self._frames[self._checked(ids)].copy()

    def channel_counts(self, ids: Iterable[int]) -> np.ndarray:
        """int64 [len(ids), channels]: each example's targets per channel (tokens after position 0):
        T + 1 for the text, T for each codebook."""
        frames = self.frames(ids)
        counts = np.repeat(frames[:, None], self.channels, axis=1)
        counts[:, 0] += 1
        return counts

    def sentence(self, sample_id: int) -> str:
        """The sentence example `sample_id` speaks."""
        i = operator.index(sample_id)
        return self._sentences[int(self._order[i])]

    def decode_text(self, tokens: Iterable[int]) -> str:
        """The text of a text channel's tokens (PAD, END and -1 left out)."""
        return text.decode(self.tokenizer, [t for t in tokens if t >= 0])

    def log_mel(self, sample_id: int) -> np.ndarray:
        """float64 [T, mel_bins]: the log-mel frames example `sample_id`'s codes stand for."""
        i = operator.index(sample_id)
        start, frames = int(self._starts[i]), int(self._frames[i])
        return self.quantizer.decode(np.asarray(self._codes[start : start + frames]))

    @cached_property
    def quantizer(self) -> Quantizer:
        return Quantizer(
            np.load(self.directory / cache.QUANTIZER_MEAN),
            np.load(self.directory / cache.QUANTIZER_CODEBOOKS),
        )

    @cached_property
    def tokenizer(self):
        """The text channel's byte-level BPE (a `tokenizers.Tokenizer`); words encode as " " + word."""
        return text.load(self.directory / cache.TOKENIZER)

    @cached_property
    def _sentences(self) -> list[str]:
        spoken = (self.directory / cache.SPOKEN).read_text().splitlines()
        kept = np.load(self.directory / cache.KEPT)
        return [spoken[k] for k in kept.tolist()]

    def _length(self, frames):
        return frames + 1 + max(1, self.audio_delay)

    def _checked(self, ids: Iterable[int]) -> np.ndarray:
        return stream_indices(ids, self.n_total)


def speech_dataset(cfg: DataConfig) -> SpeechDataset:
    """The speech dataset `cfg` describes, built first if its cache directory is absent; UserError
    (one line) for a bad field, a missing tool or package, or too few examples for the held-out slice."""
    found = cache.recipe(cfg)
    if not cache.is_built(found.directory):
        logger.warning(
            "data=speech: no built dataset in %s; building it now (python -m hypertrain.data.speech build; "
            "2.5 to 3.5 minutes on 2 cores for the defaults)",
            found.directory,
        )
        run_build(cfg)
        if not cache.is_built(found.directory):
            raise UserError(f"the speech build left no dataset in {found.directory}")
    return load(found.directory, cfg)


def run_build(cfg: DataConfig) -> None:
    """`python -m hypertrain.data.speech build` for `cfg`, in a process of its own (its main module is light,
    as the synthesis's forked processes need); its progress bar shows on this stderr, and its one-line
    error (exit 2) is raised here as a UserError."""
    overrides = [f"{f.name}={getattr(cfg, f.name)}" for f in fields(DataConfig)]
    command = [sys.executable, "-m", "hypertrain.data.speech", "--quiet", "build", *overrides]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if done.returncode == 2:
        said = done.stdout.strip().removeprefix("hypertrain: error: ")
        raise UserError(said or "the speech build refused its arguments (exit 2)")
    if done.returncode:
        raise RuntimeError(f"the speech build failed with exit code {done.returncode}")


def load(directory: Path, cfg: DataConfig) -> SpeechDataset:
    """The built dataset in `directory`, in the stream order `cfg.shuffle_seed` gives, delayed by
    `cfg.audio_delay`; UserError when it holds no more examples than `cfg.heldout`."""
    manifest = json.loads((directory / cache.MANIFEST).read_text())
    inputs = manifest["inputs"]
    frames = np.load(directory / cache.FRAMES)
    n_total = len(frames)
    if n_total <= cfg.heldout:
        raise UserError(
            f"the speech dataset in {directory} holds {n_total:,} examples, not more than "
            f"data.heldout={cfg.heldout}; valid: data.heldout < {n_total}, or more sentences "
            "(data.speech_sentences, a longer text)"
        )
    starts = np.concatenate([[0], np.cumsum(frames)[:-1]]).astype(np.int64)
    order = np.random.default_rng(cfg.shuffle_seed).permutation(n_total)
    stream_frames = frames[order]
    K = int(inputs["codebooks"])
    settings = {"v": _FINGERPRINT_VERSION, "delay": cfg.audio_delay}
    fingerprint = hashlib.sha256(
        json.dumps(settings, sort_keys=True).encode()
        + manifest["content_sha256"].encode()
        + hashlib.sha256(np.ascontiguousarray(order, dtype="<i8")).hexdigest().encode()
    )
    f = manifest["figures"]
    description = (
        f"speech ({f['source']}; espeak-ng {inputs['espeak_ng']} {inputs['voice']}): {n_total:,} utterances, "
        f"{f['hours']:.1f} h, {f['frames']:,} frames at 12.5/s; text BPE {inputs['text_vocab']} + "
        f"{K} x {inputs['codebook_size']} RVQ codes (delay {cfg.audio_delay}); "
        f"{f['duplicate_sentences']:,} duplicate sentences dropped"
    )
    return SpeechDataset(
        n_total=n_total,
        channel_names=("text",) + tuple(f"codebook {k + 1}" for k in range(K)),
        channel_vocabs=(int(inputs["text_vocab"]),) + (int(inputs["codebook_size"]),) * K,
        channel_scales=(1.0,) + (32.0 / K,) * K,
        audio_delay=cfg.audio_delay,
        fingerprint=fingerprint.hexdigest(),
        description=description,
        duplicates=int(f["duplicate_sentences"]),
        max_length=int(frames.max()) + 1 + max(1, cfg.audio_delay),
        directory=directory,
        manifest=manifest,
        _text=np.load(directory / cache.TEXT, mmap_mode="r"),
        _codes=np.load(directory / cache.CODES, mmap_mode="r"),
        _starts=starts[order],
        _frames=stream_frames,
        _order=order,
    )
