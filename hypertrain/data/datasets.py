"""The dataset a `DataConfig` names: text (`text.py`: windows or documents) or speech (`speech/`).

Both kinds give `n_total` examples in a seeded stream order; the last `data.heldout` ids are held out.
"""

from __future__ import annotations

from hypertrain.config import DataConfig
from hypertrain.data.speech.dataset import SpeechDataset, speech_dataset
from hypertrain.data.text import Dataset, text_dataset


def build_dataset(cfg: DataConfig) -> Dataset | SpeechDataset:
    """The dataset `cfg` describes; ConfigError (one line) for a missing or too short source."""
    if cfg.name == "speech":  # multistream examples from a built cache (docs/audio.md)
        return speech_dataset(cfg)
    return text_dataset(cfg)
