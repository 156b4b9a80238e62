"""What a run's start pays to check a prepared corpus against its meta.json (`corpus.verify`).

A `bytes`-vocabulary corpus of --mb MB of uint16 ids (random documents of 1,000 to 100,000 ids) is
written with `corpus.write`; then `corpus.verify` is timed (a) as written, its stamps (size, mtime_ns)
holding: no hash; (b) after its files' mtimes moved (as `cp` without -p leaves them): both files hashed,
the largest id found in the same pass. Medians of --repeats, read from the page cache (the files were
just written), so (b) is the hash's and numpy's speed, not the disk's.

    .venv/bin/python experiments/bench/corpus_check.py [--mb 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from hypertrain.data import corpus


def documents(mb: int, rng: np.random.Generator):
    left = mb << 19  # ids of 2 bytes
    while left > 0:
        n = min(left, int(rng.integers(1_000, 100_000)))
        left -= n + 1  # its eod
        yield rng.integers(0, 256, n, dtype=np.uint16)


def timed(directory: Path, meta: corpus.Meta, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        corpus.verify(directory, meta)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        source = corpus.SourceMeta("random", 1, 0, 0, "0" * 64)
        meta = corpus.write(
            directory,
            [documents(args.mb, np.random.default_rng(0))],
            [source],
            vocab=corpus.BYTES_VOCAB,
            eod=corpus.BYTES_EOD,
            tokenizer="bytes",
            tokenizer_json=None,
            request="0" * 64,
        )
        size = (directory / corpus.TOKENS).stat().st_size / 2**20
        stamped = timed(directory, meta, args.repeats)
        for name in (corpus.TOKENS, corpus.DOCUMENTS):
            status = (directory / name).stat()
            os.utime(directory / name, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))
        hashed = timed(directory, meta, args.repeats)
    print(f"tokens.bin {size:,.0f} MiB, {meta.documents:,} documents; medians of {args.repeats}")
    print(f"stamps hold:   {stamped * 1e3:8.2f} ms")
    print(f"stamps differ: {hashed * 1e3:8.0f} ms ({size / hashed:,.0f} MiB/s: sha256 and the largest id)")


if __name__ == "__main__":
    main()
