"""The speech cache: which directory holds the dataset a config describes, and what is in it.

`recipe(cfg)` gathers every input that determines the built data and keys the directory by their
sha256, so the same inputs find the one built before; a missing espeak-ng or build package is one
line naming how to install it. docs/audio.md, "The cache", lists the inputs and the files.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from hypertrain.config import DataConfig, UserError
from hypertrain.data.preparation.lockfile import LockFile
from hypertrain.data.speech import corpus
from hypertrain.data.speech.speech import Speaker

# Bumped when the build makes something else from the same inputs (2: the k-means fit on one thread).
BUILD_VERSION = 2
TEXT, CODES, FRAMES, KEPT, SPOKEN = "text.npy", "codes.npy", "frames.npy", "kept.npy", "spoken.txt"
QUANTIZER_MEAN, QUANTIZER_CODEBOOKS = "quantizer_mean.npy", "quantizer_codebooks.npy"
TOKENIZER, MANIFEST = "tokenizer.json", "manifest.json"
CONTENT = (TEXT, CODES, FRAMES, KEPT, SPOKEN, QUANTIZER_MEAN, QUANTIZER_CODEBOOKS, TOKENIZER)
# The build's Python packages (pyproject's dependencies), each with the reason it is needed.
PACKAGES = {
    "librosa": "the mel filterbank",
    "scipy": "the short-time Fourier transform",
    "scikit-learn": "the quantiser's k-means",
    "tokenizers": "the text channel's BPE",
    "tqdm": "the progress bar",
    "threadpoolctl": "one thread for the k-means fit",
}


class BuildError(UserError):
    """The inputs cannot make a dataset (too little text for the quantiser, no sentence aligned)."""


@dataclass(frozen=True)
class Recipe:
    cfg: DataConfig
    source: corpus.TextSource
    inputs: dict  # everything that determines the content, as JSON
    key: str  # sha256 hex of `inputs`
    directory: Path  # where the dataset is (or will be) built


def cache_root(cfg: DataConfig) -> Path:
    """`cfg.cache_dir`, or $XDG_CACHE_HOME/hypertrain/speech (~/.cache/hypertrain/speech)."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hypertrain" / "speech"


def check_packages() -> dict[str, str]:
    """The build's packages' versions; UserError naming the first one missing and how to install it."""
    found = {}
    for name, why in PACKAGES.items():
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            raise UserError(
                f"data=speech needs the Python package {name} ({why}); install the project's "
                f"dependencies: pip install -e . (or pip install {name})"
            ) from None
    return found


def recipe(cfg: DataConfig) -> Recipe:
    """The inputs of the dataset `cfg` describes and its cache directory; UserError (one line) for a
    bad field, a missing package, a missing espeak-ng library or voice, or a text glob matching nothing."""
    from hypertrain.data.speech import codes, features, synth

    cfg.check_speech()
    packages = check_packages()
    speaker = Speaker(cfg.speech_voice, cfg.speech_rate)
    source = corpus.read_source(cfg.path)
    inputs = {
        "build": BUILD_VERSION,
        "text_sha256": source.digest,
        "text_reading": "python docstrings and comments" if source.python else "plain text",
        "espeak_ng": speaker.version,
        "voice": cfg.speech_voice,
        "rate": cfg.speech_rate,
        "sentences": cfg.speech_sentences,
        "max_words": cfg.speech_max_words,
        "min_words": corpus.MIN_WORDS,
        "seed": cfg.speech_seed,
        "block": synth.BLOCK,
        "mel_bins": cfg.mel_bins,
        "features": features.settings(speaker.sample_rate, cfg.mel_bins),
        "codebooks": cfg.codebooks,
        "codebook_size": cfg.codebook_size,
        "quantizer_frames": cfg.quantizer_frames,
        "kmeans": {"init": "random", "max_iter": codes.MAX_ITER},
        "text_vocab": cfg.text_vocab,
        "packages": {"numpy": version("numpy"), **packages},
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return Recipe(cfg, source, inputs, key, cache_root(cfg) / key[:16])


def content_digest(directory: Path) -> str:
    """sha256 hex over the content files, in a fixed order (names and bytes)."""
    digest = hashlib.sha256()
    for name in CONTENT:
        data = (directory / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


@contextmanager
def build_lock(directory: Path):
    """Held while building `directory`: a second build of the same inputs (another rank, another
    user's command) waits, then finds it built. The lock file `<directory>.lock` is removed while
    still held, on every exit Python sees (a result, an error, Ctrl-C, SIGTERM: `__main__`), so none
    is left; a waiter that then gets the lock of the removed file takes the lock anew. UserError
    when the cache root cannot be written."""
    lock = LockFile(directory.parent / f"{directory.name}.lock")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire(wait=True)
    except OSError as error:
        raise _unwritable(directory, error) from None
    try:
        yield
    finally:
        lock.release()


def _unwritable(directory: Path, error: OSError) -> UserError:
    return UserError(
        f"the speech cache {directory.parent} cannot be written ({error.strerror}); "
        "valid: data.cache_dir=a writable directory"
    )


def is_built(directory: Path) -> bool:
    """The directory holds a finished build (the manifest is written last, then the directory renamed)."""
    return (directory / MANIFEST).is_file()
