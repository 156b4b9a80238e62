"""A residual vector quantiser of log-mel frames: k-means per stage, scikit-learn's KMeans.

`fit_and_encode(frames, stages, size, fit_frames, seed)` fits the stages on a seeded sample's
residuals and codes every frame (uint16: `size` <= 65535); `Quantizer.decode(codes)` inverts it, and
`errors(frames, codes)` is the squared error per bin after 0..K stages (docs/audio.md, "codes").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

_CHUNK = 1 << 16  # frames decoded at a time when measuring errors
# Lloyd iterations per stage, stopped short of convergence: almost the converged error in about half
# the time (docs/performance.md, "The speech build's choices").
MAX_ITER = 20


@dataclass(frozen=True)
class Quantizer:
    mean: np.ndarray  # float32 [mel_bins]
    codebooks: np.ndarray  # float32 [stages, size, mel_bins]

    @property
    def stages(self) -> int:
        return self.codebooks.shape[0]

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """float64 [n, mel_bins]: the frames `codes` (uint [n, stages]) stand for."""
        *_, decoded = self.partial_decodes(codes)
        return decoded

    def partial_decodes(self, codes: np.ndarray):
        """The decoded frames after 0, 1, ..., K stages: one float64 [n, mel_bins] array, updated in place."""
        decoded = np.repeat(self.mean[None, :].astype(np.float64), len(codes), axis=0)
        yield decoded
        for k in range(self.stages):
            decoded += self.codebooks[k][codes[:, k]]
            yield decoded


def fit_and_encode(
    frames: np.ndarray,
    stages: int,
    size: int,
    fit_frames: int,
    seed: int,
    progress: Callable[[], None] = lambda: None,
) -> tuple[Quantizer, np.ndarray]:
    """The quantiser fitted on a sample of `frames` [n, mel_bins] and every frame's codes, uint16 [n, stages].

    `progress` is called after each stage.
    """
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    if len(frames) < size:
        raise ValueError(f"{len(frames)} frames cannot fit {size} centroids")
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(len(frames), size=min(fit_frames, len(frames)), replace=False))
    mean = frames.mean(axis=0, dtype=np.float64).astype(np.float32)
    residual = frames - mean
    codebooks = np.zeros((stages, size, frames.shape[1]), dtype=np.float32)
    codes = np.zeros((len(frames), stages), dtype=np.uint16)
    for k in range(stages):
        # Random initial centroids: scikit-learn's k-means++ picks 1024 centroids one by one (minutes).
        kmeans = KMeans(size, init="random", n_init=1, max_iter=MAX_ITER, random_state=seed + k)
        # scikit-learn adds its threads' partial centroid sums under a lock, in the order the threads
        # arrive: on one thread the fit is the same on every run (with 2, builds differed in codes).
        with threadpool_limits(1, user_api="openmp"):
            kmeans.fit(residual[sample])
        labels = kmeans.predict(residual)  # each frame's nearest centroid: any thread count agrees
        codebooks[k] = kmeans.cluster_centers_
        codes[:, k] = labels
        residual -= codebooks[k][labels]
        progress()
    return Quantizer(mean, codebooks), codes


def errors(quantizer: Quantizer, frames: np.ndarray, codes: np.ndarray) -> list[float]:
    """Mean squared error (dB^2 per bin, float64) of the decoded frames after 0, 1, ..., K stages."""
    sums = np.zeros(quantizer.stages + 1)
    for start in range(0, len(frames), _CHUNK):
        target = frames[start : start + _CHUNK].astype(np.float64)
        for k, decoded in enumerate(quantizer.partial_decodes(codes[start : start + _CHUNK])):
            sums[k] += np.square(target - decoded).sum()
    return (sums / max(1, frames.size)).tolist()


def usage(codes: np.ndarray, size: int) -> list[dict]:
    """Per stage: the fraction of the codebook used and the perplexity exp(entropy) of the codes."""
    out = []
    for k in range(codes.shape[1]):
        counts = np.bincount(codes[:, k], minlength=size)
        p = counts[counts > 0] / counts.sum()
        out.append({"used": float((counts > 0).mean()), "perplexity": float(np.exp(-(p * np.log(p)).sum()))})
    return out
