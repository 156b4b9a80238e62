"""Encode + decode seconds per sync of each codec setting against a round's compute (issue 37's target: at
most 5% of a round at H = 30 for 16 replicas of model=base).

For the default model (ModelConfig(), 133,440 parameters, whose norm weights make ragged blocks) and
model=base (4,484,352, every tensor a multiple of 128), R = 16 stacked replicas: each block codec at
outer.codec.block 128 (top-k at its default fraction, 1%), SparseLoCo's recipe (`outer=sparseloco`: k 64 of
each chunk, 64 x 64 tiles and templar's chunks of the others, two_bit values, 12-bit indices; and its 3%
variant, k 128), top-k after the DCT,
and PowerSGD's low rank at r = 1 and 4. A block codec's seconds are `encode` of x [16, n] (every replica's
payload, as the sync encodes them, in the tiles' order where it has tiles) and `decode` of those 16
payloads (what a gather's receiver decodes); low rank's are its whole stage in one process
(`lowrank_mean(...).wait()`: both factors of all 16, both gathers, the orthogonalization, P Q^T), as
"encode" with no separate decode. Medians of interleaved repeats, beside one round: H (default 30) x the
median of single stacked updates (forward, backward, AdamW) of the same 16 replicas at the default
workload's global batch (256 windows of 64 tokens: 16 rows per replica), after a warm-up update. The
ratios are printed side by side, never asserted. `--sizes` prints the default model's payload bytes and
their ratio to fp32 only, nothing timed: the machine-independent cells of docs/performance.md's table,
which experiments/check_docs.py compares.

    .venv/bin/python experiments/bench/compression.py [--repeats 3] [--H 30] [--sizes]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from hypertrain.codecs.kernels import decode, encode, payload_size
from hypertrain.codecs.tiles import blocks_and_order, to_tiles
from hypertrain.config import (
    CodecConfig,
    InnerConfig,
    LowRankConfig,
    ModelConfig,
    OuterConfig,
    PhaseConfig,
    TopKConfig,
)
from hypertrain.diloco.exchange.communication import topk
from hypertrain.diloco.exchange.lowrank import Factors, initial_q, lowrank_mean
from hypertrain.distributed.groups import ReplicaGroups
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


def round_seconds(m: ModelConfig, H: int, rows: int, repeats: int) -> float:
    """Seconds of H updates: H x the median of `repeats` single updates after a warm-up one."""
    update = make_update(m, rows)
    update()
    return H * statistics.median(seconds(update) for _ in range(repeats))


# The settings, each an OuterConfig (the block codecs at block 128; SparseLoCo's at its preset's).
SPARSELOCO = dict(compress="topk", codec=CodecConfig(block=4096, tile=64))
SETTINGS = {
    **{c: OuterConfig(compress=c) for c in ("int8", "uint8", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "e3m0")},
    "topk": OuterConfig(compress="topk"),
    "sparseloco": OuterConfig(**SPARSELOCO, topk=TopKConfig(64 / 4096, index_bits=12, values="two_bit")),
    "sparseloco-3%": OuterConfig(**SPARSELOCO, topk=TopKConfig(128 / 4096, index_bits=12, values="two_bit")),
    "dct-topk": OuterConfig(compress="topk", codec=CodecConfig(transform="dct")),
    "lowrank-r1": OuterConfig(compress="lowrank", lowrank=LowRankConfig(rank=1)),
    "lowrank-r4": OuterConfig(compress="lowrank", lowrank=LowRankConfig(rank=4)),
}


def _shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {n: tuple(s) for n, s in param_shapes(m).items()}


def payload_bytes(m: ModelConfig, outer: OuterConfig) -> int:
    """One replica's payload of `outer`'s setting for model `m`."""
    shapes = _shapes(m)
    if outer.compress == "lowrank":
        return Factors.of(shapes, outer.lowrank.rank).payload_bytes
    blocks, _ = blocks_and_order(list(shapes.values()), outer.codec.block, outer.codec.tile)
    return payload_size(str(outer.compress), blocks, topk(outer))


def stage(m: ModelConfig, outer: OuterConfig, x: torch.Tensor):
    """The setting's work for x [R, n] as a pair of thunks (encode, decode; low rank: its stage, None)."""
    shapes = _shapes(m)
    if outer.compress == "lowrank":
        factors = Factors.of(shapes, outer.lowrank.rank)
        theta = {n: torch.zeros(s) for n, s in shapes.items()}
        q = initial_q(theta, outer.lowrank.rank, 0)
        active = torch.ones(R, dtype=torch.bool)
        return (lambda: lowrank_mean(factors, x, None, active, q, ReplicaGroups(R)).wait()), None
    blocks, order = blocks_and_order(list(shapes.values()), outer.codec.block, outer.codec.tile)
    codec, spec, transform = str(outer.compress), topk(outer), str(outer.codec.transform)
    held = {}

    def enc():
        held["payload"] = encode(codec, to_tiles(x, order), blocks, spec, transform)

    def dec():
        decode(codec, held.pop("payload"), blocks, spec, transform)

    return enc, dec


def codec_seconds(m: ModelConfig, repeats: int) -> dict[str, tuple[float, float]]:
    """Per setting, median (encode, decode) seconds of R rows, settings interleaved, after a warm-up."""
    n = sum(math.prod(s) for s in _shapes(m).values())
    x = torch.randn(R, n, generator=torch.Generator().manual_seed(1)) * 1e-3
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS}
    for repeat in range(repeats + 1):
        for name, outer in SETTINGS.items():
            enc, dec = stage(m, outer, x)
            a = seconds(enc)
            b = 0.0 if dec is None else seconds(dec)
            if repeat:  # the first pass builds the index maps and the DCT matrices, warms the allocator
                times[name].append((a, b))
    return {
        c: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for c, v in times.items()
    }


def print_sizes(m: ModelConfig) -> None:
    print(f"model {m.name}: {count_params(m):,} parameters")
    print("codec          payload B/replica  x vs fp32")
    for name, outer in SETTINGS.items():
        size = payload_bytes(m, outer)
        print(f"{name:<14} {size:>17,}  {4 * count_params(m) / size:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--H", type=int, default=30, help="the round's inner updates")
    parser.add_argument("--sizes", action="store_true", help="the default model's payload bytes only")
    args = parser.parse_args()
    if args.sizes:
        print_sizes(MODELS["default"])
        return
    keep_freed_memory()  # as the trainer does (hypertrain/run/runtime.py)
    rows = PhaseConfig().global_batch // R
    print(
        f"R = {R}, round: H = {args.H} x one stacked update of {R} x {rows} rows x {SEQ} tokens; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    for name, m in MODELS.items():
        round_s = round_seconds(m, args.H, rows, args.repeats)
        fp32 = 4 * count_params(m)
        print(f"\nmodel {name}: {count_params(m):,} parameters, round {round_s:.2f} s")
        print("codec          payload B/replica  x vs fp32  encode s  decode s  enc+dec s  % of round")
        for setting, (enc, dec) in codec_seconds(m, args.repeats).items():
            size = payload_bytes(m, SETTINGS[setting])
            print(
                f"{setting:<14} {size:>17,}  {fp32 / size:9.2f}  {enc:8.3f}  {dec:8.3f}  {enc + dec:9.3f}  "
                f"{100 * (enc + dec) / round_s:9.1f}%"
            )


if __name__ == "__main__":
    main()
