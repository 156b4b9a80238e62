"""Encode + decode seconds per sync of each codec (hypertrain/diloco/codecs.py) against a round's compute.

For the default model (ModelConfig(), 133,440 parameters, whose norm weights make ragged blocks) and
model=base (4,484,352, every tensor a multiple of 128), R = 16 stacked replicas, outer.block 128, top-k at
its default fraction (1%): the seconds of `encode` of x [16, n] (every replica's payload, as the sync
encodes them) and of `decode` of those 16 payloads (what a gather's receiver decodes), medians of
interleaved repeats, beside the compute of one stacked round of H = 5 updates (forward, backward, AdamW)
of the same 16 replicas at the default workload's global batch (256 windows of 64 tokens: 16 rows per
replica): measured for the default model; for base one update takes ~20 s on 2 CPU cores, so its round
is 5 x one measured update (the second of two, the first paying one-time costs). The ratios are printed
side by side, never asserted (the issue aims at <= 5% of a round). `--sizes` prints the default model's
payload bytes and their ratio to fp32 only, nothing timed: the machine-independent cells of
docs/performance.md's table, which experiments/check_docs.py compares.

    .venv/bin/python experiments/bench/compression.py [--repeats 3] [--sizes]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from hypertrain.config import InnerConfig, ModelConfig, OuterConfig, PhaseConfig
from hypertrain.diloco.codecs import CODECS, Blocks, decode, encode, payload_size
from hypertrain.model.shapes import count_params, param_roles, param_shapes
from hypertrain.model.transformer import forward as model_forward
from hypertrain.model.transformer import init_params
from hypertrain.optim.inner import init_state, inner_step
from hypertrain.run.runtime import keep_freed_memory

R, SEQ = 16, 64
MODELS = {
    "default": ModelConfig(),
    "base": ModelConfig(
        name="base", d_model=256, n_layers=6, n_heads=8, n_kv_heads=4
    ),  # conf/model/base.yaml
}


def make_update(m: ModelConfig, rows: int):
    """One stacked update of R replicas, each on its own [rows, SEQ + 1] batch."""
    inner = InnerConfig()
    params = {
        n: t.unsqueeze(0).expand(R, *t.shape).clone().requires_grad_(True)
        for n, t in init_params(m, 0).items()
    }
    state = init_state(inner, params, param_roles(m))
    tokens = torch.randint(0, m.vocab, (R, rows, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def update() -> None:
        model_forward(m, params, tokens).sum().backward()
        inner_step(inner, params, {n: p.grad for n, p in params.items()}, state, 1e-3)
        for p in params.values():
            p.grad = None

    return update


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def round_seconds(m: ModelConfig, H: int, rows: int, repeats: int, measured: bool) -> float:
    """Seconds of H updates: the median of `repeats` measured rounds after a warm-up update, or (not
    measured) H x the second of two single updates."""
    update = make_update(m, rows)
    if not measured:
        update()
        return H * seconds(update)
    update()
    return statistics.median(seconds(lambda: [update() for _ in range(H)]) for _ in range(repeats))


def codec_seconds(m: ModelConfig, outer: OuterConfig, repeats: int) -> dict[str, tuple[float, float]]:
    """Per codec, median (encode, decode) seconds of R rows, codecs interleaved, after one warm-up each."""
    blocks = Blocks(tuple(math.prod(s) for s in param_shapes(m).values()), outer.block)
    x = torch.randn(R, blocks.numel, generator=torch.Generator().manual_seed(1)) * 1e-3
    times: dict[str, list[tuple[float, float]]] = {c: [] for c in CODECS}
    for repeat in range(repeats + 1):
        for codec in CODECS:
            start = time.perf_counter()
            payload = encode(codec, x, blocks, outer.topk_fraction)
            middle = time.perf_counter()
            decode(codec, payload, blocks, outer.topk_fraction)
            if repeat:  # the first pass builds the index maps and warms the allocator
                times[codec].append((middle - start, time.perf_counter() - middle))
            del payload
    return {
        c: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for c, v in times.items()
    }


def print_sizes(m: ModelConfig, outer: OuterConfig) -> None:
    blocks = Blocks(tuple(math.prod(s) for s in param_shapes(m).values()), outer.block)
    print(
        f"model {m.name}: {count_params(m):,} parameters, block {outer.block}, "
        f"topk fraction {outer.topk_fraction}"
    )
    print("codec      payload B/replica  x vs fp32")
    for codec in CODECS:
        size = payload_size(codec, blocks, outer.topk_fraction)
        print(f"{codec:<10} {size:>17,}  {4 * blocks.numel / size:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", action="store_true", help="the default model's payload bytes only")
    args = parser.parse_args()
    outer, H = OuterConfig(), InnerConfig().H
    if args.sizes:
        print_sizes(MODELS["default"], outer)
        return
    keep_freed_memory()  # as the trainer does (hypertrain/run/runtime.py)
    rows = PhaseConfig().global_batch // R
    print(
        f"R = {R}, block {outer.block}, topk fraction {outer.topk_fraction}, round: H = {H} stacked updates "
        f"of {R} x {rows} rows x {SEQ} tokens; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    for name, m in MODELS.items():
        measured = name == "default"
        round_s = round_seconds(m, H, rows, args.repeats, measured)
        blocks = Blocks(tuple(math.prod(s) for s in param_shapes(m).values()), outer.block)
        fp32 = 4 * blocks.numel
        how = "measured" if measured else f"{H} x one measured update"
        print(f"\nmodel {name}: {count_params(m):,} parameters, round {round_s:.2f} s ({how})")
        print("codec      payload B/replica  x vs fp32  encode s  decode s  enc+dec s  % of round")
        for codec, (enc, dec) in codec_seconds(m, outer, args.repeats).items():
            size = payload_size(codec, blocks, outer.topk_fraction)
            print(
                f"{codec:<10} {size:>17,}  {fp32 / size:9.2f}  {enc:8.3f}  {dec:8.3f}  {enc + dec:9.3f}  "
                f"{100 * (enc + dec) / round_s:9.1f}%"
            )


if __name__ == "__main__":
    main()
