"""SparseLoCo's pieces (issue 37; Sarfi et al. 2025, arXiv 2508.15706): top-k's 12-bit in-block indices,
its fp16 / int8 / two_bit values (templar's `_quantize_values` with 4 bins over 6 standard deviations) and
the decayed error buffer u = beta * e + delta, e <- u - sent, against float64 references written here from
each definition (never from the code under test): the documented bytes, the recursion at every sync and
its telescoped sum, today's numbers at the neutral settings, loop = stacked and a killed run resumed."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    KILLED,
    RUN,
    assert_identical_but,
    ckpt,
    killed_beside_uninterrupted,
    resumed,
    run_losses,
    run_rounds,
    small_cfg,
)
from omegaconf import OmegaConf
from references import U32, templar_chunks, templar_k, templar_topk

from hypertrain.codecs.kernels import Blocks, TopK, decode, encode, payload_size
from hypertrain.codecs.tiles import blocks_and_order
from hypertrain.config import CodecConfig, ModelConfig, OuterConfig, TopKConfig
from hypertrain.diloco.exchange.communication import compressed_mean, topk
from hypertrain.distributed.groups import ReplicaGroups
from hypertrain.engines import loop, stacked
from hypertrain.model.shapes import param_specs
from hypertrain.records import formats
from hypertrain.rundir.checkpoint import seal

VALUES = ("fp32", "fp16", "int8", "two_bit")
REPO = Path(__file__).resolve().parents[1]


# --- references: the payload's documented layout, read here --------------------------------------------


def block_slices(sizes, block) -> list[tuple[int, int, int]]:
    """(tensor, start, stop) of every block: each tensor cut from its own start into runs of `block`."""
    out, offset = [], 0
    for t, size in enumerate(sizes):
        out += [(t, offset + a, offset + min(a + block, size)) for a in range(0, size, block)]
        offset += size
    return out


def kept(fraction: float, length: int) -> int:
    return max(1, math.ceil(round(fraction * length, 9)))  # the ceil(fraction x length)


def chosen(x: np.ndarray, fraction: float) -> list[int]:
    """Top-k's positions in a block from the definition: the k largest |x|, largest first, ties to the
    lower position (a stable sort on -|x|)."""
    return sorted(range(len(x)), key=lambda j: (-abs(x[j]), j))[: kept(fraction, len(x))]


def value_bytes(values: str, k: int) -> int:
    return {"fp32": 4 * k, "fp16": 2 * k, "int8": 4 + k, "two_bit": math.ceil(k / 4)}[values]


def index_bytes(bits: int, k: int) -> int:
    return 4 * k if bits == 32 else math.ceil(3 * k / 2)


def formula(sizes, block, spec: TopK) -> int:
    """docs/compression.md's bytes: sum over blocks of V(k_b) + I(k_b), plus 20 per non-empty tensor
    for two_bit."""
    total = sum(
        value_bytes(spec.values, kept(spec.fraction, b - a))
        + index_bytes(spec.index_bits, kept(spec.fraction, b - a))
        for _, a, b in block_slices(sizes, block)
    )
    return total + (20 * sum(1 for s in sizes if s) if spec.values == "two_bit" else 0)


def unpack12(raw: bytes, k: int) -> list[int]:
    """k 12-bit indices from their documented bytes: a pair (a, b) is a & 255, a >> 8 | (b & 15) << 4,
    b >> 4; an odd k's last index is two bytes (b = 0, its byte left off)."""
    raw = bytes(raw) + b"\0"
    out = []
    for i in range(0, k, 2):
        b0, b1, b2 = raw[3 * i // 2 : 3 * i // 2 + 3]
        out += [b0 | (b1 & 15) << 8, b1 >> 4 | b2 << 4]
    return out[:k]


def parse(payload: np.ndarray, sizes, block, spec: TopK) -> list[dict]:
    """One replica's payload read block by block by the documented layout: per block its header (int8:
    the fp32 scale; two_bit: the tensor's 20-byte header before its first block), its values' bytes,
    its indices (in the vector: 32-bit ones as they are, 12-bit ones plus the block's start)."""
    raw, at, out, seen = payload.tobytes(), 0, [], set()
    for t, a, b in block_slices(sizes, block):
        k, entry = kept(spec.fraction, b - a), {"tensor": t, "start": a}
        if spec.values == "two_bit" and t not in seen:
            entry["header"] = np.frombuffer(raw[at : at + 20], np.float32).astype(np.float64)
            at += 20
            seen.add(t)
        if spec.values == "int8":
            entry["scale"] = float(np.frombuffer(raw[at : at + 4], np.float32)[0])
            at += 4
        size = value_bytes(spec.values, k) - (4 if spec.values == "int8" else 0)
        entry["values"] = raw[at : at + size]
        at += size
        size = index_bytes(spec.index_bits, k)
        if spec.index_bits == 32:
            entry["index"] = np.frombuffer(raw[at : at + size], np.int32).tolist()
        else:
            entry["index"] = [a + i for i in unpack12(raw[at : at + size], k)]
        at += size
        entry["k"] = k
        out.append(entry)
    assert at == len(raw)
    return out


def f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def two_bit_reference(v: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """templar's `_quantize_values` with n_bins = 4, range 6 sigmas, in float64: (shift, the four
    reconstruction values, the codes)."""
    shift = v.mean()
    c = v - shift
    std = math.sqrt((c**2).sum() / (len(v) - 1)) if len(v) > 1 else 0.0
    scale = 6 * std / 4 or 1.0
    codes = np.clip(np.round(c / scale + 2), 0, 3).astype(np.int64)  # np.round: half to even
    levels = np.array([c[codes == q].mean() if (codes == q).any() else 0.0 for q in range(4)])
    return shift, levels, codes


# --- the codec ----------------------------------------------------------------------------------------


def test_12_bit_indices_round_trip_every_position_of_a_4096_block_and_an_odd_k():
    """A whole 4096-value block kept (fraction 1): every index 0..4095 (4095 included, odd and even
    positions, in the order of magnitude) read back from the documented three-byte pairs equals the
    reference order; a ragged 9-value block keeps k = 3 (odd: its last index in two bytes). The decoded
    vector is x exactly and equals index_bits=32's, in 3/8 of its index bytes."""
    sizes, block = (4096, 9), 4096
    x = torch.randn(2, sum(sizes), generator=torch.Generator().manual_seed(1))
    twelve, spec32 = TopK(1.0, 12), TopK(1.0, 32)
    payload = encode("topk", x, Blocks(sizes, block), twelve)
    assert (
        payload.shape[1]
        == payload_size("topk", Blocks(sizes, block), twelve)
        == formula(sizes, block, twelve)
    )
    for m in range(2):
        row = x[m].double().numpy()
        got = parse(payload[m].numpy(), sizes, block, twelve)
        assert got[0]["index"] == chosen(row[:4096], 1.0) and 4095 in got[0]["index"]
        assert got[1]["index"] == [4096 + j for j in chosen(row[4096:], 1.0)]
    decoded = decode("topk", payload, Blocks(sizes, block), twelve)
    assert torch.equal(decoded, x)
    assert torch.equal(
        decoded, decode("topk", encode("topk", x, Blocks(sizes, block), spec32), Blocks(sizes, block), spec32)
    )

    # a broken packer (the pair's nibbles swapped: b's low four bits where a's high ones go) is caught
    a, b = 4095, 1
    good = bytes([a & 255, a >> 8 | (b & 15) << 4, b >> 4])
    broken = bytes([a & 255, (b & 15) | (a >> 8) << 4, b >> 4])
    assert unpack12(good, 2) == [4095, 1] and unpack12(broken, 2) != [4095, 1]


SIZES = [((10, 7, 16, 1), 4), ((300, 64, 1000, 7, 0), 32), ((4096, 5), 4096)]


@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize("bits", [32, 12])
@pytest.mark.parametrize("sizes, block", SIZES)
@pytest.mark.parametrize("fraction", [0.5, 0.1, 1.0])
def test_the_payload_is_the_documented_bytes_and_its_length_the_formula(values, bits, sizes, block, fraction):
    """Every combination: encode()'s measured length == payload_size == docs/compression.md's formula;
    the bytes read by the documented layout give the reference's indices (every block's k largest, in
    order) and values: fp32 exact; fp16 the value rounded to half (nearest even); int8 scale =
    fl(amax / 127), code = round-half-even(fl(v / scale)); two_bit `two_bit_reference`'s shift, levels and
    codes, the header rounded to fp32. Decoding gives the value each code stands for, at its index, and
    zeros elsewhere.

    Exact for fp32, fp16 and int8 (single correctly rounded fp32 operations: f32 of the float64 result).
    two_bit's statistics are float64 sums in torch's order and numpy's: they agree to a few float64
    ulps, so the fp32 header agrees unless a value lies within ~1e-15 of an fp32 rounding boundary
    and a code unless c / scale + 2 does of a half-integer; the seeded inputs have none (exact ==)."""
    spec, blocks = TopK(fraction, bits, values), Blocks(sizes, block)
    n = sum(sizes)
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(7)) * 3
    payload = encode("topk", x, blocks, spec)
    assert payload.shape[1] == payload_size("topk", blocks, spec) == formula(sizes, block, spec)
    decoded = decode("topk", payload, blocks, spec).double().numpy()
    for m in range(2):
        row, want = x[m].double().numpy(), np.zeros(n)
        parts = parse(payload[m].numpy(), sizes, block, spec)
        for part in parts:
            start = part["start"]
            stop = start + min(block, sum(sizes[: part["tensor"] + 1]) - start)
            order = [start + j for j in chosen(row[start:stop], fraction)]
            assert part["index"] == order
            v = row[order]
            if values == "fp32":
                assert np.array_equal(np.frombuffer(part["values"], np.float32), v)
                want[order] = v
            elif values == "fp16":
                assert np.array_equal(np.frombuffer(part["values"], np.float16), v.astype(np.float16))
                want[order] = v.astype(np.float16)
            elif values == "int8":
                scale = f32(np.abs(v).max() / 127)
                codes = np.clip(np.round(f32(v / scale)), -127, 127)
                assert part["scale"] == scale
                assert np.array_equal(np.frombuffer(part["values"], np.int8), codes)
                want[order] = f32(codes * scale)
        if values != "two_bit":
            assert np.array_equal(decoded[m], want)
            continue
        for t in {p["tensor"] for p in parts}:
            mine = [p for p in parts if p["tensor"] == t]
            v = np.concatenate([row[p["index"]] for p in mine])
            shift, levels, codes = two_bit_reference(v)
            assert np.array_equal(mine[0]["header"], f32([shift, *levels]))
            got = np.concatenate(
                [
                    (np.frombuffer(p["values"], np.uint8)[:, None] >> np.array([0, 2, 4, 6]) & 3).ravel()[
                        : p["k"]
                    ]
                    for p in mine
                ]
            )
            assert np.array_equal(got, codes)
            header = f32([shift, *levels])
            index = np.concatenate([p["index"] for p in mine])
            want[index] = f32(header[0] + header[1 + codes])
        assert np.array_equal(decoded[m], want)


def test_two_bit_empty_bins_decode_to_the_shift_and_one_value_to_itself():
    """Hand-picked: kept values 0, 0, 0, 10 (one tensor of 4, fraction 1): shift 2.5, c = -2.5 x 3, 7.5,
    std = sqrt((3 x 6.25 + 56.25) / 3) = 5, scale = 7.5, c / scale + 2 = 1.67, 1.67, 1.67, 3: codes
    2, 2, 2, 3; bins 0 and 1 are empty (reconstruction 0: the shift), r_2 = -2.5, r_3 = 7.5, so the
    values come back exactly. A tensor of one value: shift = the value, its code 2 (scale 0 -> 1), r_2 = 0."""
    spec = TopK(1.0, 32, "two_bit")
    x = torch.tensor([[0.0, 10.0, 0.0, 0.0, -3.25]])
    blocks = Blocks((4, 1), 4)
    payload = encode("topk", x, blocks, spec)
    parts = parse(payload[0].numpy(), (4, 1), 4, spec)
    assert parts[0]["header"].tolist() == [2.5, 0.0, 0.0, -2.5, 7.5]
    assert parts[1]["header"].tolist() == [-3.25, 0.0, 0.0, 0.0, 0.0]
    assert torch.equal(decode("topk", payload, blocks, spec), x)


# --- the decayed error buffer ------------------------------------------------------------------------

TINY = Blocks((10, 7, 16), 4)  # ragged: blocks 4, 4, 2 | 4, 3 | 4 x 4


def outer(beta: float, values: str = "fp32", bits: int = 32) -> OuterConfig:
    return OuterConfig(
        compress="topk",
        codec=CodecConfig(block=4, error_decay=beta),
        topk=TopKConfig(fraction=0.5, index_bits=bits, values=values),
        error_feedback=True,
    )


def recursion(cfg: OuterConfig, syncs: int = 6, R: int = 2) -> list[dict]:
    """`syncs` syncs of R replicas through `compressed_mean` (the simulation's collectives) on seeded
    pseudo-gradients: per sync the fp32 buffers before and after, each replica's decoded d_m and delta."""
    gen = torch.Generator().manual_seed(3)
    errors = torch.zeros(R, TINY.numel)
    out = []
    for _ in range(syncs):
        deltas = torch.randn(R, TINY.numel, generator=gen) * torch.exp2(
            torch.randint(-6, 2, (R, TINY.numel), generator=gen).float()
        )
        before = errors.clone()
        reduction = compressed_mean(
            cfg, deltas, errors, torch.ones(R, dtype=torch.bool), TINY, ReplicaGroups(R)
        )
        reduction.wait()
        out.append(
            {
                "delta": deltas.double(),
                "before": before.double(),
                "after": errors.double(),
                "sent": reduction.own.double(),
            }
        )
    return out


def step_excess(steps: list[dict], beta: float) -> float:
    """The largest ratio, over syncs and elements, of |sent + e_new - (beta e_old + delta)| (float64) to
    its rounding bound 2 U32 (|beta e_old| + |delta| + |e_new|): u = fl(delta + fl(beta e_old)) rounds
    twice (U32 |beta e_old| and U32 |u| <= U32 (|delta| + |beta e_old|)(1 + U32)), e_new = fl(u - sent)
    once (U32 |e_new|); the factor 2 covers the (1 + U32) terms and a tiny value's absolute floor."""
    worst = 0.0
    for s in steps:
        want = beta * s["before"] + s["delta"]
        bound = 2 * U32 * (beta * s["before"].abs() + s["delta"].abs() + s["after"].abs()) + 2.0**-140
        worst = max(worst, float(((s["sent"] + s["after"] - want).abs() / bound).max()))
    return worst


@pytest.mark.parametrize("values", ["fp32", "two_bit"])
def test_error_decay_follows_the_recursion_at_every_sync_and_telescopes(values):
    """beta = 0.9, 6 syncs, R = 2, top-k of half of every block: at every sync sent + e_new = beta e_old +
    delta within `step_excess`'s bound; and over all syncs (e_0 = 0) the identity of the recursion,
    sum_t beta^(K-t) sent_t + e_K = sum_t beta^(K-t) delta_t, holds within the same per-sync bounds
    weighted alike (their sum: each sync's rounding, decayed as the buffer decays it).

    The broken variant, the code run with error_decay = 1 (no decay) against the beta = 0.9 reference,
    fails both by orders of magnitude."""
    beta, steps = 0.9, recursion(outer(0.9, values))
    assert step_excess(steps, beta) <= 1.0
    K = len(steps)
    lhs = sum(beta ** (K - 1 - t) * s["sent"] for t, s in enumerate(steps)) + steps[-1]["after"]
    rhs = sum(beta ** (K - 1 - t) * s["delta"] for t, s in enumerate(steps))
    bound = sum(
        beta ** (K - 1 - t) * 2 * U32 * (beta * s["before"].abs() + s["delta"].abs() + s["after"].abs())
        for t, s in enumerate(steps)
    )
    assert ((lhs - rhs).abs() <= bound + 2.0**-140).all()
    assert steps[-1]["after"].abs().max() > 0  # the buffers hold something: the check is not vacuous

    broken = recursion(outer(1.0, values))
    assert step_excess(broken, beta) > 1e3
    lhs = sum(beta ** (K - 1 - t) * s["sent"] for t, s in enumerate(broken)) + broken[-1]["after"]
    rhs = sum(beta ** (K - 1 - t) * s["delta"] for t, s in enumerate(broken))
    assert not ((lhs - rhs).abs() <= bound + 2.0**-140).all()


def test_decay_1_fp32_values_are_todays_numbers_bitwise_and_12_bit_indices_the_same_in_fewer_bytes():
    """outer.codec.error_decay=1.0, topk_values=fp32, index_bits=32 spelled out is today's stage bitwise:
    x = delta + e, d = decode(encode(x)) of the bare fraction (today's call), e <- x - d, the mean in
    replica order; index_bits=12 gives the same decoded means and buffers, bitwise, with each block's
    4k index bytes down to ceil(3k / 2)."""
    gen = torch.Generator().manual_seed(5)
    deltas = torch.randn(3, TINY.numel, generator=gen)
    start = torch.randn(3, TINY.numel, generator=gen) / 8
    active = torch.ones(3, dtype=torch.bool)
    results = {}
    for bits in (32, 12):
        errors = start.clone()
        got = compressed_mean(
            outer(1.0, "fp32", bits), deltas.clone(), errors, active, TINY, ReplicaGroups(3)
        ).wait()
        results[bits] = (got.mean, errors, got.figures["payload_bytes"])
    x = deltas + start
    d = decode("topk", encode("topk", x, TINY, 0.5), TINY, 0.5)
    mean, errors, b32 = results[32]
    assert torch.equal(mean, (d[0] + d[1] + d[2]) / 3)
    assert torch.equal(errors, x - d)
    assert b32 == payload_size("topk", TINY, 0.5)
    mean12, errors12, b12 = results[12]
    assert torch.equal(mean12, mean) and torch.equal(errors12, errors)
    ks = [kept(0.5, b - a) for _, a, b in block_slices(TINY.sizes, 4)]
    assert b32 - b12 == sum(4 * k - math.ceil(3 * k / 2) for k in ks) > 0


# --- whole runs: engines, resume ---------------------------------------------------------------------

SPARSELOCO = dict(
    compress="topk",
    topk=TopKConfig(fraction=0.0625, index_bits=12, values="two_bit"),
    error_feedback=True,
    codec=CodecConfig(error_decay=0.9),
)


def test_stacked_equals_the_loop_with_sparseloco():
    """The stacked engine and the loop, R = 2, H = 2, 4 updates (2 syncs), two_bit values, 12-bit
    indices, error_decay 0.9: this tiny config's fixed windows give both engines bitwise-equal
    pseudo-gradients (tests/test_compression.py's stacked/loop test says so and counts flips where they
    are not), and the stage is exact on identical inputs, so the losses and final weights are equal (==)."""
    cfg = small_cfg(outer=OuterConfig(**SPARSELOCO))
    loop_losses, loop_theta = run_rounds(cfg, loop.train_replicas)
    losses, theta = run_rounds(cfg, stacked.train_replicas)
    assert losses == loop_losses
    assert all(torch.equal(theta[n], loop_theta[n]) for n in theta)
    plain = run_rounds(
        replace(
            cfg, outer=OuterConfig(compress="topk", topk=TopKConfig(fraction=0.0625), error_feedback=True)
        ),
        stacked.train_replicas,
    )[1]
    assert any(not torch.equal(theta[n], plain[n]) for n in theta)  # the settings did change the run


def preset() -> OuterConfig:
    """`outer=sparseloco`, from its own file (conf/outer/sparseloco.yaml)."""
    written = OmegaConf.load(REPO / "conf/outer/sparseloco.yaml")
    loaded = OmegaConf.merge(OmegaConf.structured(OuterConfig), written)
    return OmegaConf.to_object(loaded)  # typed, its node outer.topk a TopKConfig


def test_the_preset_is_templars_compressor_on_the_tiny_models_tensors():
    """Issue 48 item 7: the preset's stage (`compressed_mean`, R = 2, five syncs with decayed feedback) on
    the default tiny model's tensors (64 x 64 and 256 x 64 matrices, the FFN's 64 x 176 and 176 x 64, 1-D
    norms of 64) against templar's compressor written from its rule (tests/references.py): per tensor,
    its chunks (a side cut at its largest divisor <= 64: the FFN in 64 x 44 chunks), 64 kept of each
    chunk (a norm's 64: all of it), two_bit statistics over the tensor's kept values
    (`two_bit_reference`), x = delta + 0.95 e and e <- x - sent. Exact (==): x and e are correctly
    rounded fp32 operations (f32 of the float64 result, 0.95 itself in fp32), the decoded value is
    f32(header shift + header level), and the float64 statistics agree to a few ulps, which the seeded
    inputs never bring to an fp32 rounding boundary (`test_the_payload_is_the_documented_bytes...`).
    The payload is templar's bytes: per tensor a 20-byte header, per chunk ceil(k / 4) codes and
    ceil(3k / 2) index bytes."""
    outer, R = preset(), 2
    shapes = [shape for shape, _ in param_specs(ModelConfig()).values()]
    assert {(64, 176), (176, 64), (64,)} <= set(shapes)
    sizes = [math.prod(s) for s in shapes]
    n, tile, k = sum(sizes), outer.codec.tile, topk_kept_of_a_tile(outer)
    blocks, order = blocks_and_order(shapes, outer.codec.block, tile)
    beta = f32(outer.codec.error_decay)  # torch multiplies fp32 by a Python float rounded to fp32
    gen = torch.Generator().manual_seed(11)
    errors, e_ref = torch.zeros(R, n), np.zeros((R, n))
    for _ in range(5):
        deltas = torch.randn(R, n, generator=gen) / 100
        reduction = compressed_mean(outer, deltas, errors, torch.ones(R, dtype=torch.bool), blocks,
                                    ReplicaGroups(R), order=order)  # fmt: skip
        result = reduction.wait()
        for m in range(R):
            x = f32(deltas[m].double().numpy() + f32(beta * e_ref[m]))
            sent, start = np.zeros(n), 0
            for shape, size in zip(shapes, sizes, strict=True):
                kept = [start + c for c in templar_topk(x[start : start + size], shape, tile, k)]
                index = np.concatenate(kept)
                shift, levels, codes = two_bit_reference(x[index])
                header = f32([shift, *levels])
                sent[index] = f32(header[0] + header[1 + codes])
                start += size
            assert np.array_equal(reduction.own[m].double().numpy(), sent), m
            e_ref[m] = f32(x - sent)
            assert np.array_equal(errors[m].double().numpy(), e_ref[m]), m
    chunks = [len(c) for s in shapes for c in templar_chunks(s, tile)]
    counts = [templar_k(k, length) for length in chunks]
    per_chunk = sum(math.ceil(c / 4) + math.ceil(3 * c / 2) for c in counts)
    assert result.payload_bytes == 20 * len(shapes) + per_chunk


def topk_kept_of_a_tile(outer: OuterConfig) -> int:
    """templar's `topk_compression` of the preset: its fraction of a whole T x T tile (64 of 4096)."""
    return math.ceil(outer.topk.fraction * outer.codec.tile * outer.codec.tile)


def test_the_preset_with_one_replica_syncs_and_sends_nothing(tmp_path):
    """Issue 48 item 8: `outer=sparseloco replicas=1` stopped at its first sync (the one replica's
    message, header then a payload of a ragged number of bytes, read as fp32). The preset's own fields
    (conf/outer/sparseloco.yaml), R = 1, 4 updates at H = 2, d_model 24 (a payload of 4k + 2 bytes): both
    syncs are written, each with its one replica, and nothing leaves a lone replica (0 bits,
    docs/compression.md "Bits")."""
    model = ModelConfig(d_model=24, n_layers=1, n_heads=2, n_kv_heads=2)
    cfg = small_cfg(outer=preset(), replicas=1, model=model)
    syncs = [row for row in run_losses(cfg, tmp_path) if row["kind"] == "sync"]
    assert [row["update"] for row in syncs] == [2, 4]
    assert all(row["bits_per_param"] == [0.0] and row["payload_bytes"] % 4 for row in syncs)


KILL_RUN = [
    *RUN,
    "inner.H=2",
    "phase.updates=6",
    "outer.compress=topk",
    "outer.topk.fraction=0.0625",
    "outer.error_feedback=true",
    "outer.codec.error_decay=0.9",
    "outer.topk.index_bits=12",
    "outer.topk.values=two_bit",
    "checkpoint.every_updates=3",
    "checkpoint.keep=10",
]


def test_killed_with_decayed_buffers_resumes_bit_identically(tmp_path):
    """Invariant 9 for SparseLoCo's pieces (stacked): SIGKILL after update 4's inner step; the newest
    checkpoint is the mid-round one at 3, whose buffers are non-zero (what the sync at 2 did not send);
    resumed, the run equals an uninterrupted one exactly (rows, payload bytes, errors, weights)."""
    run_dir, reference = killed_beside_uninterrupted(KILL_RUN, tmp_path, "0:4:kill:after", KILLED)
    saved = torch.load(ckpt(run_dir, 3), weights_only=False)["state"]["errors"]
    assert len(saved) == 2 and all(any(bool(t.any()) for t in e.values()) for e in saved)
    resumed(KILL_RUN, run_dir, tmp_path)
    assert_identical_but(run_dir, reference, skip=("comm_measured_inner_bytes", "comm_measured_outer_bytes"))


def test_topk_settings_are_what_the_stage_hands_the_codecs():
    assert topk(OuterConfig(**SPARSELOCO)) == TopK(0.0625, 12, "two_bit")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize("bits", [32, 12])
def test_cuda_bytes_and_values_equal_cpu(values, bits):
    """The same bytes and decoded values on CUDA as on CPU. two_bit's float64 statistics are summed in
    each device's own order; they round to the same fp32 header and codes unless a value lies within a
    few float64 ulps of an fp32 rounding boundary or a bin edge (none in these seeded inputs)."""
    spec, blocks = TopK(0.1, bits, values), Blocks((300, 64, 1000, 7, 0), 32)
    x = torch.randn(3, blocks.numel, generator=torch.Generator().manual_seed(11))
    cpu = encode("topk", x, blocks, spec)
    gpu = encode("topk", x.cuda(), blocks, spec)
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(decode("topk", gpu, blocks, spec).cpu(), decode("topk", cpu, blocks, spec))


def test_bad_top_k_settings_are_refused_by_the_codec_in_one_line():
    x = torch.zeros(1, 8)
    for spec, says in (
        (TopK(0.5, 16), "index_bits=16 is not valid; valid: 32 or 12"),
        (TopK(0.5, 32, "fp8"), "values='fp8' is not valid; valid: fp32, fp16, int8, two_bit"),
    ):
        with pytest.raises(ValueError, match=f"^{re.escape(says)}$"):
            encode("topk", x, Blocks((8,), 4), spec)
    says = "index_bits=12 with block=8192 is not valid; valid: block <= 4096"
    with pytest.raises(ValueError, match=f"^{re.escape(says)}$"):
        payload_size("topk", Blocks((8,), 8192), TopK(0.5, 12))


# Today's top-k (k = 7 of 128: odd, so 12-bit indices would be refused) with error feedback, killed after
# update 4's inner step, its newest checkpoint the mid-round one at 3.
OLD_TOPK = [
    *RUN,
    "inner.H=2",
    "phase.updates=6",
    "outer.compress=topk",
    "outer.topk_fraction=0.05",
    "outer.error_feedback=true",
    "checkpoint.every_updates=3",
    "checkpoint.keep=10",
]
# issue 37's (its error_decay, transform and tile are today's node outer.codec, beside outer.block of then;
# its lowrank_rank today's node outer.lowrank, null in a top-k run's config; its index_bits and
# topk_values, with topk_fraction, today's node outer.topk)
NEW_FIELDS = ("codec", "lowrank")


def schema_2_outer(outer: dict) -> dict:
    """`outer` as schema 2 wrote it: without issue 37's fields, top-k's fraction, the block and the reduction
    flat."""
    kept = {k: v for k, v in outer.items() if k not in (*NEW_FIELDS, "topk")}
    codec = outer["codec"]
    return kept | {
        "topk_fraction": outer["topk"]["fraction"],
        "block": codec["block"],
        "reduce": codec["reduce"],
    }


def as_schema_2(run_dir) -> None:
    """The run directory as schema 2 wrote it: config.yaml and every checkpoint's config without
    SparseLoCo's fields, under schema_version 2 (each checkpoint resealed: a whole, older file)."""
    import yaml

    config = run_dir / "config.yaml"
    written = yaml.safe_load(config.read_text())
    assert written.pop("schema_version") == formats.SCHEMA_VERSION
    assert set(NEW_FIELDS) <= set(written["outer"]) and written["outer"]["topk"]["index_bits"] == 32
    assert set(written["outer"]["codec"]) == {"block", "error_decay", "transform", "tile", "reduce"}
    older = {"schema_version": 2, **written, "outer": schema_2_outer(written["outer"])}
    config.write_text(yaml.safe_dump(older, sort_keys=False))
    for path in sorted((run_dir / "checkpoints").glob("ckpt-u*.pt")):
        saved = torch.load(path, weights_only=False)
        saved["schema_version"] = 2
        saved["config"]["outer"] = schema_2_outer(saved["config"]["outer"])
        torch.save(saved, path)
        seal(path)


def test_a_schema_2_top_k_run_resumes_with_its_own_bytes(tmp_path):
    """A top-k run with error feedback written before SparseLoCo's fields (schema 2: config.yaml and its
    checkpoints without them), killed mid-round, resumes (its config upgraded to index_bits=32,
    topk_values=fp32, error_decay=1.0: what it sent) and equals the uninterrupted run of today exactly,
    payload bytes included."""
    run_dir, reference = killed_beside_uninterrupted(OLD_TOPK, tmp_path, "0:4:kill:after", KILLED)
    as_schema_2(run_dir)
    resumed(OLD_TOPK, run_dir, tmp_path)
    assert_identical_but(run_dir, reference, skip=("comm_measured_inner_bytes", "comm_measured_outer_bytes"))
