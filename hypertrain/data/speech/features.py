"""Log-mel frames at 12.5 per second: scipy's short-time Fourier transform, librosa's mel filterbank.

`log_mel(samples, sample_rate, mel_bins)` gives float32 [T, mel_bins], frame t standing for the audio
in [80t - 40, 80t + 40) ms (docs/audio.md, "frames"); `frame_span(start_ms, end_ms)` is the frames
whose share of time overlaps an interval.
"""

from __future__ import annotations

import functools
import math

import numpy as np

FRAME_RATE = 12.5  # frames per second, as Moshi's Mimi codec
FRAME_MS = 1000 / FRAME_RATE  # 80 ms
FLOOR_DB = -80.0  # power below 1e-8 (espeak-ng's exact silence) reads as -80 dB


def hop_length(sample_rate: int) -> int:
    """Samples per frame; the sample rate must hold a whole number of them (22050 Hz: 1764)."""
    hop = sample_rate / FRAME_RATE
    if hop != int(hop):
        raise ValueError(f"a sample rate of {sample_rate} Hz holds no whole number of samples per frame")
    return int(hop)


@functools.lru_cache(maxsize=4)
def _filterbank(sample_rate: int, mel_bins: int) -> np.ndarray:
    # Imported here: reading a built dataset needs no librosa. Only its filterbank: librosa's own STFT
    # compiles numba kernels the first time a fresh environment runs it (docs/performance.md, "The
    # speech build's choices").
    import librosa.filters

    return librosa.filters.mel(sr=sample_rate, n_fft=2 * hop_length(sample_rate), n_mels=mel_bins)


def settings(sample_rate: int, mel_bins: int) -> dict:
    """Everything that determines the frames, for the cache key (the libraries' versions are keyed apart)."""
    return {
        "sample_rate": sample_rate,
        "frame_rate": FRAME_RATE,
        "stft": "scipy.signal.stft, hann window of 2 frames, transform of its length, centred",
        "mel_bins": mel_bins,
        "filterbank": "librosa.filters.mel (slaney)",
        "floor_db": FLOOR_DB,
    }


def log_mel(samples: np.ndarray, sample_rate: int, mel_bins: int) -> np.ndarray:
    """float32 [1 + len(samples) // hop, mel_bins]: the log-mel frames of int16 `samples`, in dB."""
    from scipy.signal import stft

    hop = hop_length(sample_rate)
    window = 2 * hop  # Hann windows at half overlap sum to a constant: every sample weighs the same
    frames = 1 + len(samples) // hop
    # boundary="zeros" pads half a window of zeros at each end, so segment t is centred on sample
    # t * hop. The transform is as long as the window (no zero padding), and scipy's stft rather than
    # its ShortTimeFFT, which loops over the segments in Python: both for speed (docs/performance.md,
    # "The speech build's choices").
    _, _, spectrum = stft(
        samples.astype(np.float32) / 32768.0,
        window="hann",
        nperseg=window,
        noverlap=window - hop,
        nfft=window,
        boundary="zeros",
        padded=True,
    )
    spectrum = spectrum[:, :frames]
    # stft divides by the window's sum (`scaling="spectrum"`); the power is taken without it.
    power = (spectrum.real**2 + spectrum.imag**2) * float(hop) ** 2
    mel = _filterbank(sample_rate, mel_bins) @ power
    return (10.0 * np.log10(np.maximum(mel, 10.0 ** (FLOOR_DB / 10)))).T.astype(np.float32)


def frame_span(start_ms: float, end_ms: float, frames: int) -> tuple[int, int]:
    """First and last frame (inclusive) whose [80t - 40, 80t + 40) ms overlaps [start_ms, end_ms),
    clipped to the utterance's `frames`."""
    first = math.floor((start_ms + FRAME_MS / 2) / FRAME_MS)
    last = math.ceil((end_ms + FRAME_MS / 2) / FRAME_MS) - 1
    return max(0, min(first, frames - 1)), max(0, min(max(last, first), frames - 1))
