"""`python -m hypertrain.data prepare` beside tokenizers' own encode_batch, and the loader beside the engine.

(a) prepare keeps up with its tokenizer: about --mb MB of text (the running Python's standard-library
    `.py` files and /usr/share's text files, each a document, repeated and cut to size) written as text
    files; a byte-level BPE of 4096 tokens trained by prepare on a 2 MB sample (train:4096); then, in
    this process, `prepare` end to end (hash, read, encode, write: tokens/s) beside tokenizers'
    `encode_batch` over the same documents already in memory (the same batches), interleaved;
    target: prepare's tokens/s >= 0.8 of encode_batch's.
(b) the loader keeps up with the engine: data=prepared on that corpus (`build_dataset`), the batches of
    one update of the default run (replicas 4, global batch 256: 64 windows of seq_len 64 a replica,
    `replica_batch` for each replica) per second, beside the stacked engine's inner steps per second
    for the default model (tiny, vocab the corpus's) on the same shapes; the ratio is the headroom
    (target > 1). Skipped, saying why, where data=prepared cannot be built yet.

    .venv/bin/python experiments/bench/prepare.py [--mb 50] [--repeats 1]

Exits 1 if a target is missed; 3 if (b) could not be measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

from hypertrain.data import corpus  # noqa: E402
from hypertrain.data.preparation.prepare import prepare  # noqa: E402

PREPARE_TARGET, LOADER_TARGET = 0.8, 1.0
TRAINED_VOCAB, SAMPLE_MB = 4096, 2
EXIT_MISSED, EXIT_NOT_MEASURED = 1, 3


def source_texts() -> list[bytes]:
    """Every standard-library .py file and /usr/share text file (.txt, .md, .rst), in name order."""
    roots = [
        (Path(sysconfig.get_paths()["stdlib"]), ("*.py",)),
        (Path("/usr/share"), ("*.txt", "*.md", "*.rst")),
    ]
    texts = []
    for root, patterns in roots:
        for pattern in patterns:
            for path in sorted(root.rglob(pattern)):
                if "site-packages" not in path.parts and path.is_file() and not path.is_symlink():
                    texts.append(path.read_bytes())
    return [t for t in texts if t.strip()]


def write_documents(directory: Path, megabytes: float) -> list[str]:
    """Text files of about `megabytes` MB in `directory` (the sources repeated, the last one cut); the
    documents as prepare reads them."""
    texts, budget, documents = source_texts(), int(megabytes * 1e6), []
    directory.mkdir(parents=True)
    while budget > 0:
        for text in texts:
            data = text[:budget]
            (directory / f"{len(documents):06d}.txt").write_bytes(data)
            documents.append(data.decode("utf-8", errors="replace"))
            budget -= len(data)
            if budget <= 0:
                break
    return documents


def bench_prepare(root: Path, documents: list[str], tokenizer: Path, repeats: int) -> tuple[dict, Path]:
    """Seconds of prepare end to end and of encode_batch alone, interleaved; the last corpus written."""
    import tokenizers

    from hypertrain.data.preparation.inputs import BATCH_CHARS

    loaded = tokenizers.Tokenizer.from_file(str(tokenizer))
    loaded.encode_special_tokens = True  # as prepare encodes
    batches, batch, chars = [], [], 0
    for document in documents:  # the batches prepare's reader makes
        batch.append(document)
        chars += len(document)
        if chars >= BATCH_CHARS:
            batches.append(batch)
            batch, chars = [], 0
    batches += [batch] if batch else []
    times: dict[str, list[float]] = {"prepare": [], "encode_batch": []}
    tokens = 0
    for repeat in range(repeats):
        out = root / f"corpus-{repeat}"
        start = time.perf_counter()
        meta = prepare([str(root / "docs" / "*.txt")], out, str(tokenizer), "text", progress=False).meta
        times["prepare"].append(time.perf_counter() - start)
        start = time.perf_counter()
        tokens = sum(
            len(e.ids) + 1 for b in batches for e in loaded.encode_batch(b, add_special_tokens=False)
        )
        times["encode_batch"].append(time.perf_counter() - start)
        assert tokens == meta.tokens, (tokens, meta.tokens)  # the same ids, each document's eod counted
        if repeat < repeats - 1:
            shutil.rmtree(out)
    return {k: statistics.median(v) for k, v in times.items()} | {"tokens": tokens}, out


def engine_step(vocab: int, replicas: int, rows: int, seq_len: int):
    """One inner step of the stacked engine's math (forward, backward, AdamW) for `replicas` replicas
    of the default model with `vocab` tokens, on [replicas, rows, seq_len + 1] tokens."""
    import torch

    from hypertrain.config import InnerConfig, ModelConfig
    from hypertrain.model.shapes import param_roles
    from hypertrain.model.transformer import forward, init_params, objective
    from hypertrain.optim.inner import init_state, inner_step

    model, inner = ModelConfig(vocab=vocab), InnerConfig()
    params = {
        n: t.unsqueeze(0).expand(replicas, *t.shape).clone().requires_grad_(True)
        for n, t in init_params(model, 0).items()
    }
    state = init_state(inner, params, param_roles(model))
    tokens = torch.randint(
        0, vocab, (replicas, rows, seq_len + 1), generator=torch.Generator().manual_seed(0)
    )

    def step() -> None:
        objective(model, forward(model, params, tokens)).sum().backward()
        inner_step(inner, params, {n: p.grad for n, p in params.items()}, state, 1e-3)
        for p in params.values():
            p.grad = None

    return step


def bench_loader(directory: Path, repeats: int) -> dict | str:
    """Updates per second of the loader (every replica's batch) and of the engine; a string saying why
    when data=prepared cannot be built."""
    from hypertrain.config import DataConfig, TrainConfig

    defaults = TrainConfig()
    data = DataConfig(name="prepared", path=str(directory))
    try:
        from hypertrain.data import build_dataset
        from hypertrain.data.batches import replica_batch

        dataset = build_dataset(data)
    except Exception as error:  # the loader is written beside this command (issue 38)
        return f"data=prepared cannot be built here ({type(error).__name__}: {str(error)[:120]})"
    replicas, rows = defaults.replicas, defaults.phase.global_batch // defaults.replicas
    rng = np.random.default_rng(0)
    updates = [
        rng.choice(dataset.n_total - data.heldout, size=(replicas, rows), replace=False) for _ in range(20)
    ]

    def load() -> None:
        for ids in updates[rng.integers(len(updates))]:
            replica_batch(dataset, ids, data, defaults.inner.micro_batch or rows)

    step = engine_step(dataset.vocab, replicas, rows, data.seq_len)
    load(), step()  # warm-up
    times: dict[str, list[float]] = {"loader": [], "engine": []}
    for _ in range(max(repeats, 1) * 5):
        for name, fn in (("loader", load), ("engine", step)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()} | {"replicas": replicas, "rows": rows}


def trained_tokenizer(root: Path) -> Path:
    """train:4096 by prepare on the first SAMPLE_MB MB of root/docs; its tokenizer.json."""
    sample, taken = root / "sample", 0
    sample.mkdir()
    for path in sorted((root / "docs").iterdir()):
        if taken >= SAMPLE_MB * 1e6:
            break
        shutil.copy(path, sample / path.name)
        taken += path.stat().st_size
    start = time.perf_counter()
    prepare([str(sample / "*.txt")], root / "trained", f"train:{TRAINED_VOCAB}", "text", progress=False)
    seconds = time.perf_counter() - start
    print(f"tokenizer: train:{TRAINED_VOCAB} on a {taken / 1e6:.1f} MB sample in {seconds:.1f} s")
    return root / "trained" / corpus.TOKENIZER


def report_prepare(figures: dict, size: int, repeats: int) -> bool:
    rates = {k: figures["tokens"] / figures[k] for k in ("prepare", "encode_batch")}
    ratio = rates["prepare"] / rates["encode_batch"]
    print(f"(a) {figures['tokens']:,} tokens (eods included), {os.cpu_count()} cores, medians of {repeats}")
    for name, rate in rates.items():
        per_second = f"{rate / 1e6:6.2f} M tokens/s  {size / 1e6 / figures[name]:6.1f} MB/s"
        print(f"    {name:<13} {figures[name]:7.2f} s  {per_second}")
    met = ratio >= PREPARE_TARGET
    print(f"    prepare / encode_batch = {ratio:.2f} (target >= {PREPARE_TARGET}) {_verdict(met)}")
    return met


def report_loader(loader: dict) -> bool:
    headroom = loader["engine"] / loader["loader"]
    print(f"(b) one update: {loader['replicas']} replicas x {loader['rows']} windows, medians")
    print(f"    loader (replica_batch)  {1 / loader['loader']:8.1f} updates/s")
    print(f"    engine (inner step)     {1 / loader['engine']:8.1f} updates/s")
    met = headroom > LOADER_TARGET
    print(f"    loader / engine = {headroom:.1f} (target > {LOADER_TARGET}) {_verdict(met)}")
    return met


def _verdict(met: bool) -> str:
    return "PASS" if met else "MISS"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="megabytes of text to prepare")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats of (a), medians")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as temporary:
        root = Path(temporary)
        start = time.perf_counter()
        documents = write_documents(root / "docs", args.mb)
        size = sum(f.stat().st_size for f in (root / "docs").iterdir())
        seconds = time.perf_counter() - start
        print(f"text: {len(documents):,} documents, {size / 1e6:.1f} MB (written in {seconds:.1f} s)")
        tokenizer = trained_tokenizer(root)
        figures, out = bench_prepare(root, documents, tokenizer, args.repeats)
        met = report_prepare(figures, size, args.repeats)
        loader = bench_loader(out, args.repeats)
        if isinstance(loader, str):
            print(f"(b) not measured: {loader}")
            return EXIT_NOT_MEASURED if met else EXIT_MISSED
        return 0 if report_loader(loader) and met else EXIT_MISSED


if __name__ == "__main__":
    sys.exit(main())
