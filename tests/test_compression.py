"""Compressed pseudo-gradients (issue 24, "Proof"; docs/compression.md; docs/design.md invariant 10 and
"The sync pipeline and its schemes"): the compress and reduce stages of the sync, fed chosen inputs, and
whole runs through the entry.

1. Top-k with error feedback loses nothing: after K syncs what each replica sent plus its buffer is the
   sum of its pseudo-gradients (exactly on dyadic inputs, within a derived count of half-ulps on random
   ones), and the indices sent are a reference top-k with ties broken by the lower index.
2. The edges of the stage: a replica that did not step keeps its buffer; an all-zero pseudo-gradient
   gives zeros (no NaN from a zero scale); a non-finite one stops the sync before anything is sent (and
   a run, through the entry: exit 1, one line).
3. The stage on real processes (gloo, 2 and 4 of them, both layouts) equals the simulation bitwise on
   bitwise-identical inputs: decoded means, per-replica errors and error buffers, for both reductions.
4. Whole runs: real processes equal the simulation exactly where the arithmetic is the same (W = R = 2,
   one replica per process, the loop engine), fragments with a delay included; the stacked engine
   against the loop flips quantization codes only where their pseudo-gradients straddle a rounding
   boundary (counted).
5. SIGKILL mid-round and resume is bit-identical with error buffers in the checkpoint; the same
   checkpoint with its buffers zeroed resumes into another run.
6. Bytes, from the run's own records: the ratios of the issue against the fp32 ring all-reduce.
7. Bad input: one line, exit 2, nothing created.
8. `outer.compress=none` spelled out is the default run, bitwise.

The stage is called directly where inputs are chosen (`communication.compressed_mean` with
`ReplicaGroups`, every replica in one process: the simulation). It is the same function for the loop and
the stacked engine (`sync.take` hands it the replicas' pseudo-gradients whatever engine made them), so
"loop = stacked on identical inputs" is the simulation's case here.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from helpers import (
    KILLED,
    RUN,
    ReferenceRuns,
    assert_identical,
    assert_identical_but,
    assert_identical_streaming,
    ckpt,
    entry,
    finish,
    fork_ranks,
    killed_beside_uninterrupted,
    outcome,
    resumed,
    run_losses,
    run_rounds,
    small_cfg,
    start_entry,
    stderr_lines,
    tree,
)
from omegaconf import OmegaConf
from references import U32, templar_chunks, templar_k

from hypertrain.codecs import kernels as codecs
from hypertrain.codecs.kernels import Blocks
from hypertrain.config import (
    CodecConfig,
    DataConfig,
    ModelConfig,
    OuterConfig,
    PhaseConfig,
    TopKConfig,
    WorldConfig,
)
from hypertrain.diloco.exchange.communication import HEADER_BYTES, compressed_mean, topk
from hypertrain.distributed.groups import ReplicaGroups
from hypertrain.engines import loop, stacked
from hypertrain.failures import NonFiniteError, RankFailed
from hypertrain.model.transformer import init_params
from hypertrain.rundir.checkpoint import seal
from hypertrain.rundir.records import read_metrics

REPO = Path(__file__).resolve().parents[1]
QUANTIZERS = ("int8", "uint8", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "e3m0")


# -- the stage in one process, and what it hands to the collectives ---------------------------------------


class Spy(ReplicaGroups):
    """The simulation's collectives (every replica in this process), recording the messages the stage
    hands to them: `gathered` (each call's [R, header + payload] rows) and `exchanged` (two_phase's
    all-to-all, [R, R shards, width])."""

    def __init__(self, replicas: int):
        super().__init__(replicas)
        self.gathered: list[torch.Tensor] = []
        self.exchanged: list[torch.Tensor] = []

    def start_all_gather_replicas(self, local):
        self.gathered.append(local.clone())
        return super().start_all_gather_replicas(local)

    def start_exchange_shards(self, local):
        self.exchanged.append(local.clone())
        return super().start_exchange_shards(local)


def outer_cfg(
    codec: str,
    reduce: str = "gather",
    block: int = 4,
    fraction: float = 0.5,
    ef: bool = False,
    transform: str = "none",
):
    return OuterConfig(
        compress=codec,
        codec=CodecConfig(block=block, transform=transform, reduce=reduce),
        topk=TopKConfig(fraction=fraction) if codec == "topk" else None,  # top-k's node: with top-k alone
        error_feedback=ef,
    )


def block_lengths(blocks: Blocks) -> list[int]:
    """Every block's length, in order: runs of `block` values that never cross a tensor's boundary."""
    return [min(blocks.block, size - i) for size in blocks.sizes for i in range(0, size, blocks.block)]


def kept(fraction: float, length: int) -> int:
    """k of a top-k block of `length` values (the issue: ceil(fraction x length)); fractions here are
    dyadic, so the product is exact."""
    return max(1, math.ceil(fraction * length))


def topk_fields(payload: torch.Tensor, blocks: Blocks, fraction: float) -> tuple[list[float], list[int]]:
    """One replica's top-k payload (uint8 [b]) read by its documented layout (codecs.py: block after
    block, each block's k fp32 values, then their k int32 indices in the vector): (values, indices)."""
    raw, values, indices, at = payload.contiguous(), [], [], 0
    for length in block_lengths(blocks):
        k = kept(fraction, length)
        values += raw[at : at + 4 * k].view(torch.float32).tolist()
        indices += raw[at + 4 * k : at + 8 * k].view(torch.int32).tolist()
        at += 8 * k
    assert at == raw.numel()
    return values, indices


def reference_topk(x: list[float], blocks: Blocks, fraction: float) -> list[int]:
    """The indices top-k sends, from its definition: in each block the k largest |x|, listed by
    magnitude, largest first, equal magnitudes by the lower index (a stable sort on -|x|)."""
    out, start = [], 0
    for length in block_lengths(blocks):
        order = sorted(range(start, start + length), key=lambda i: (-abs(x[i]), i))
        out += order[: kept(fraction, length)]
        start += length
    return out


def payloads(spy: Spy) -> torch.Tensor:
    """The payloads [R, b] of the one gather the spy saw (its messages without their headers)."""
    (rows,) = spy.gathered
    return rows[:, HEADER_BYTES:]


# -- 1. top-k with error feedback --------------------------------------------------------------------------

TINY = Blocks((10, 7, 16), 4)  # ragged: a tensor of 10 (blocks 4, 4, 2), one of 7 (4, 3), one of 16


def test_topk_with_error_feedback_sends_everything_in_the_end_exactly_on_dyadic_inputs():
    """K = 6 syncs of R = 2 replicas, top-k of half of every block of `TINY` with error feedback, fed
    pseudo-gradients that are multiples of 1/8 in [-1, 1] (many equal magnitudes, of both signs).

    Exact, by the arithmetic: top-k copies the kept entries of x_t = delta_t + e_{t-1} and leaves the
    rest in e_t = x_t - d_t, so d_t and e_t are x_t's own values or zeros; the only addition is x_t's,
    and sums of at most 6 multiples of 1/8 of magnitude <= 6 are exact in fp32 (and in float64 here).
    So, per replica, sum_t d_t + e_K == sum_t delta_t, ==, and the buffer after every sync equals the
    test's own recursion (e_t = x_t off the reference top-k of x_t, 0 on it).

    The indices each replica sent (read from its payload, codecs.py's documented layout) equal the
    reference top-k of x_t (`reference_topk`: per block the k = ceil(fraction x length) largest
    magnitudes, largest first, ties by the lower index) in that order, and its values are x_t's there.
    """
    R, K, fraction = 2, 6, 0.5
    outer = outer_cfg("topk", fraction=fraction, ef=True)
    gen = torch.Generator().manual_seed(0)
    errors = torch.zeros(R, TINY.numel)
    ref_errors = [[0.0] * TINY.numel for _ in range(R)]
    sent_total = torch.zeros(R, TINY.numel, dtype=torch.float64)
    delta_total = torch.zeros(R, TINY.numel, dtype=torch.float64)
    ties = 0
    for _ in range(K):
        deltas = torch.randint(-8, 9, (R, TINY.numel), generator=gen).float() / 8
        spy = Spy(R)
        reduction = compressed_mean(outer, deltas, errors, torch.tensor([True] * R), TINY, spy)
        d = codecs.decode("topk", payloads(spy).contiguous(), TINY, fraction)
        for m in range(R):
            x = [a + b for a, b in zip(deltas[m].tolist(), ref_errors[m], strict=True)]  # exact
            values, indices = topk_fields(payloads(spy)[m], TINY, fraction)
            want = reference_topk(x, TINY, fraction)
            assert indices == want, (m, indices, want)
            assert values == [x[i] for i in want]
            ref_errors[m] = [0.0 if i in set(want) else v for i, v in enumerate(x)]
            assert errors[m].tolist() == ref_errors[m]
            ties += len({abs(v) for v in x}) < len(x)
        mean = reduction.wait().mean
        assert torch.equal(mean, (d[0] + d[1]) / 2)
        sent_total += d.double()
        delta_total += deltas.double()
    assert ties  # the inputs did hold equal magnitudes to break
    assert torch.equal(sent_total + errors.double(), delta_total)


def half_ulp(x: torch.Tensor) -> torch.Tensor:
    """Half the fp32 spacing above |x| per entry, in float64: a correctly rounded fp32 sum whose result is
    x errs by at most this (the spacing below |x| is never larger)."""
    a = x.abs()
    return (torch.nextafter(a, torch.tensor(math.inf)) - a).double() / 2


def test_topk_with_error_feedback_loses_at_most_half_an_ulp_per_sync_on_random_inputs():
    """The same identity on random fp32 pseudo-gradients (normal, each entry scaled by 2^j, j uniform in
    -12..2), K = 8 syncs, R = 3 replicas, 10% of each block of 32 (ragged tensors, k = ceil(0.1 x L)).

    Bound, derived: d_t and e_t = x_t - d_t are exact (each entry is x_t's or zero), so
    sum_t d_t + e_K - sum_t delta_t telescopes to sum_t r_t, r_t = fl(delta_t + e_{t-1}) - (delta_t +
    e_{t-1}), the rounding of the one fp32 addition of each sync; |r_t| <= half an ulp of x_t
    (`half_ulp`). Per entry: |sum_t d_t + e_K - sum_t delta_t| <= sum_t half_ulp(x_t), i.e. at most
    K/2 = 4 ulps of the largest |x_t|. The test forms the sums in float64, adding at most
    (2K + 2) 2^-53 times the sum of the magnitudes added (a float64 sum of m terms errs by at most
    (m - 1) 2^-53 of their magnitudes' sum), far below the fp32 term. The replica that did not step in a
    sync (replica 2 in every third) is left out of the sums and keeps its buffer, bitwise.
    The indices sent equal the reference top-k of x_t (as computed by the stage, fp32)."""
    R, K, fraction = 3, 8, 0.1
    blocks = Blocks((300, 64, 1000, 7), 32)
    outer = outer_cfg("topk", block=32, fraction=fraction, ef=True)
    gen = torch.Generator().manual_seed(1)
    errors = torch.zeros(R, blocks.numel)
    sent = torch.zeros(R, blocks.numel, dtype=torch.float64)
    given = torch.zeros(R, blocks.numel, dtype=torch.float64)
    bound = torch.zeros(R, blocks.numel, dtype=torch.float64)
    magnitudes = torch.zeros(R, blocks.numel, dtype=torch.float64)
    for t in range(K):
        scale = torch.exp2(torch.randint(-12, 3, (R, blocks.numel), generator=gen).float())
        deltas = torch.randn(R, blocks.numel, generator=gen) * scale
        active = torch.tensor([True, True, t % 3 != 2])
        x = deltas + errors  # what the stage forms, the same fp32 addition
        before = errors.clone()
        spy = Spy(R)
        compressed_mean(outer, deltas, errors, active, blocks, spy).wait()
        d = codecs.decode("topk", payloads(spy).contiguous(), blocks, fraction)
        for m in range(R):
            _, indices = topk_fields(payloads(spy)[m], blocks, fraction)
            assert indices == reference_topk(x[m].tolist(), blocks, fraction), (t, m)
            if not active[m]:
                assert torch.equal(errors[m], before[m])
                continue
            sent[m] += d[m].double()
            given[m] += deltas[m].double()
            bound[m] += half_ulp(x[m])
            magnitudes[m] += d[m].double().abs() + deltas[m].double().abs()
    magnitudes += errors.double().abs()
    bound += (2 * K + 2) * 2.0**-53 * magnitudes
    gap = (sent + errors.double() - given).abs()
    assert (gap <= bound).all(), float((gap - bound).max())
    assert bool((gap > 0).any())  # the additions did round somewhere: the bound is not vacuous
    print(f"largest gap / bound: {float((gap / bound.clamp(min=1e-300)).max()):.3f}")


# -- 2. the edges: a replica that did not step, zeros, non-finite numbers ------------------------------


@pytest.mark.parametrize("codec", ["int8", "fp4_e2m1", "topk"])
def test_a_replica_that_did_not_step_keeps_its_buffer_and_is_left_out(codec):
    """R = 3, replica 1 did not step (active = [T, F, T]), error feedback on with non-zero buffers:
    replica 1's buffer is unchanged, bitwise; the others' become x_m - d_m (x_m = delta_m + e_m, d_m
    their decoded payloads); the mean is (d_0 + d_2) / 2 over the 2 that took part, `synced` is 2 and
    replica 1's compression error is null (the header says it did not take part)."""
    R = 3
    gen = torch.Generator().manual_seed(2)
    deltas = torch.randn(R, TINY.numel, generator=gen)
    errors = torch.randn(R, TINY.numel, generator=gen) / 16
    x, before = deltas + errors, errors.clone()
    spy = Spy(R)
    result = compressed_mean(
        outer_cfg(codec, ef=True), deltas, errors, torch.tensor([True, False, True]), TINY, spy
    ).wait()
    d = codecs.decode(codec, payloads(spy).contiguous(), TINY, 0.5)
    assert torch.equal(errors[1], before[1])
    for m in (0, 2):
        assert torch.equal(errors[m], x[m] - d[m])
    assert torch.equal(result.mean, (d[0] + d[2]) / 2)
    assert result.synced == 2
    error = result.figures["compress_error"]
    assert error[1] is None and all(e > 0 for e in (error[0], error[2]))


CODEC_REDUCTIONS = [(c, r, "none") for c in QUANTIZERS for r in ("gather", "two_phase")] + [
    ("topk", "gather", "none"),
    ("topk", "gather", "dct"),
    ("e3m0", "two_phase", "dct"),
]


@pytest.mark.parametrize("codec,reduce,transform", CODEC_REDUCTIONS)
def test_an_all_zero_pseudo_gradient_gives_zeros(codec, reduce, transform):
    """Every compressor and reduction (and the DCT before top-k and e3m0), R = 2, error feedback on with
    zero buffers, pseudo-gradients all zero: the mean is zeros (no NaN from a zero scale), the buffers
    stay zero, both compression errors are 0 and, for the quantizers, every byte sent is zero (an
    all-zero block encodes to zeros)."""
    R = 2
    errors = torch.zeros(R, TINY.numel)
    spy = Spy(R)
    result = compressed_mean(
        outer_cfg(codec, reduce, ef=True, transform=transform),
        torch.zeros(R, TINY.numel),
        errors,
        torch.tensor([True] * R),
        TINY,
        spy,
    ).wait()
    assert torch.equal(result.mean, torch.zeros(TINY.numel)) and not result.mean.signbit().any()
    assert not errors.any()
    assert result.figures["compress_error"] == [0.0, 0.0]
    if codec != "topk":  # top-k's indices are positions, not zeros
        sent = (
            spy.gathered[0][:, HEADER_BYTES:] if reduce == "gather" else spy.exchanged[0][..., HEADER_BYTES:]
        )
        assert not sent.any()


# Every codec whose payload can be a ragged number of bytes (top-k's fp32 values with int32 indices are
# 8 bytes an entry: always whole words), top-k's fractions chosen so that TINY's payload is ragged.
ONE_REPLICA = [(c, r, codecs.TopK(0.5)) for c in QUANTIZERS for r in ("gather", "two_phase")] + [
    ("topk", "gather", codecs.TopK(0.75 if (bits, values) == (12, "fp16") else 0.5, bits, values))
    for bits, values in [(32, "fp16"), (32, "int8"), (32, "two_bit"), (12, "fp32"), (12, "fp16")]
    + [(12, "int8"), (12, "two_bit")]
]


@pytest.mark.parametrize(
    "codec,reduce,spec", ONE_REPLICA, ids=[f"{c}-{r}-{s.index_bits}-{s.values}" for c, r, s in ONE_REPLICA]
)
def test_one_replica_whose_message_is_not_whole_fp32_words_gets_its_own_contribution(codec, reduce, spec):
    """Issue 48 item 8: with R = 1 the gathered rows are one [1, 8 + b] message, whose header slice has a
    row stride of 8 + b bytes; a payload of b bytes not a multiple of 4 (checked here for every codec on
    TINY's ragged blocks) once made reading the fp32 header fail. The one replica's mean is its own decoded
    contribution d (gather), or d re-encoded and decoded (two_phase: the one shard's mean)."""
    size = codecs.payload_size(codec, TINY, spec)
    assert size % 4, f"{codec} {spec}: {size} bytes, a multiple of 4 would not test the stride"
    gen = torch.Generator().manual_seed(48)
    x = torch.randn(1, TINY.numel, generator=gen)
    outer = outer_cfg(codec, reduce, fraction=spec.fraction, ef=True)
    if codec == "topk":
        outer = replace(outer, topk=TopKConfig(spec.fraction, spec.index_bits, spec.values))
    errors = torch.zeros(1, TINY.numel)
    reduction = compressed_mean(outer, x, errors, torch.tensor([True]), TINY, ReplicaGroups(1))
    result = reduction.wait()
    assert result is not None and result.synced == 1
    own = reduction.own
    assert torch.equal(errors, x - own)  # error feedback kept what was not sent
    want = own[0] if reduce == "gather" else codecs.decode(codec, codecs.encode(codec, own, TINY), TINY)[0]
    assert torch.equal(result.mean, want)


@pytest.mark.parametrize("reduce", ["gather", "two_phase"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_pseudo_gradient_stops_the_sync_before_anything_is_sent(bad, reduce):
    """One entry of an active replica's x = delta + e is +-inf or NaN: `compressed_mean` raises
    NonFiniteError (the run's exit 1) and no collective was started (the spy saw no gather and no
    exchange); the error buffers are untouched."""
    R = 2
    deltas = torch.ones(R, TINY.numel)
    deltas[1, 5] = bad
    errors = torch.full((R, TINY.numel), 0.25)
    spy = Spy(R)
    with pytest.raises(NonFiniteError, match="not finite"):
        compressed_mean(
            outer_cfg("int8", reduce, ef=True), deltas, errors, torch.tensor([True, True]), TINY, spy
        )
    assert spy.gathered == [] and spy.exchanged == []
    assert torch.equal(errors, torch.full((R, TINY.numel), 0.25))


def test_a_run_whose_pseudo_gradient_overflows_stops_with_one_line_exit_1(tmp_path):
    """Through the entry: inner.lr=1e300 (an AdamW update of that size overflows fp32, whose largest is
    3.4e38, to +-inf whatever the warmup divides it by), inner.H = 1 (so the sync comes right after the
    first inner step, before any forward pass could see the weights) and guard.enabled=false (the guard
    acts after a sync; this is the compress stage's own check): the run stops with exit 1 and one line,
    its metrics closed by a failed `end` row, no sync row written."""
    run_dir = tmp_path / "run"
    args = [
        *RUN,
        "inner.H=1",
        "phase.updates=2",
        "inner.lr=1e300",
        "guard.enabled=false",
        "outer.compress=int8",
    ]
    done = entry([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == NonFiniteError.exit_code == 1, done.stderr
    lines = stderr_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert re.match(
        r"hypertrain: error: run failed: the pseudo-gradient of replica [01] at the sync at update 1 is "
        r"not finite; the run stops before sending it",
        lines[0],
    ), lines[0]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert not [r for r in rows if r["kind"] == "sync"]
    assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "failed" and rows[-1]["exit_code"] == 1


# -- 3. the stage on real processes equals the simulation --------------------------------------------------

STAGE_BLOCKS = Blocks((300, 64, 1000, 7), 32)  # 45 blocks, ragged: shards of 23/22 (n = 2), 12/11/11/11


@dataclass(frozen=True)
class StageCase:
    layout: str  # benchmark or replicas
    world: int  # W (a plan label under the replicas layout)
    replicas: int  # R
    codec: str
    reduce: str
    ef: bool
    active: tuple[bool, ...]
    transform: str = "none"
    sparseloco: bool = False  # top-k's SparseLoCo settings: two_bit values, 12-bit indices, decay 0.9

    @property
    def name(self) -> str:
        stepped = "".join("T" if a else "F" for a in self.active)
        where = f"{self.layout}-w{self.world}-r{self.replicas}"
        extra = "-sparseloco" if self.sparseloco else ""
        return f"{where}-{self.codec}-{self.transform}-{self.reduce}-ef{int(self.ef)}-{stepped}{extra}"

    @property
    def outer(self) -> OuterConfig:
        outer = outer_cfg(self.codec, self.reduce, STAGE_BLOCKS.block, 0.1, self.ef, self.transform)
        if self.sparseloco:  # k = 4 of a whole block of 32 (even); ragged ones keep 1 or 2
            codec = replace(outer.codec, error_decay=0.9)
            outer = replace(outer, codec=codec, topk=replace(outer.topk, index_bits=12, values="two_bit"))
        return outer


def _cases(layout: str, world: int, R: int) -> list[StageCase]:
    some = tuple(m != 1 for m in range(R))  # replica 1 did not step
    every = (True,) * R
    return [
        StageCase(layout, world, R, "int8", "gather", False, every),
        StageCase(layout, world, R, "int8", "two_phase", True, some),
        StageCase(layout, world, R, "fp4_e2m1", "gather", True, some),
        StageCase(layout, world, R, "fp4_e2m1", "two_phase", False, every),
        StageCase(layout, world, R, "topk", "gather", True, every),
        StageCase(layout, world, R, "uint8", "gather", True, some),  # a minimum and a scale per block
        StageCase(layout, world, R, "fp8_e4m3", "two_phase", False, every),  # float8 sent as bytes
        StageCase(layout, world, R, "e3m0", "two_phase", True, some),
        StageCase(layout, world, R, "topk", "gather", True, every, "dct"),  # DeMo's chunked DCT, top-k
        StageCase(
            layout, world, R, "fp4_e2m1", "two_phase", False, some, "dct"
        ),  # shard means re-transformed
    ]


STAGE_CASES = {
    # P = 2: one replica per process; two stacked replicas per process; SparseLoCo's top-k once (issue 37)
    2: _cases("replicas", 2, 2)
    + _cases("replicas", 4, 4)
    + [StageCase("replicas", 2, 2, "topk", "gather", True, (True, True), sparseloco=True)],
    # P = 4: one replica per process; the benchmark layout W = 4, R = 2 (L = 2: each of a replica's two
    # ranks exchanges the whole payload in its own cross-replica group)
    4: _cases("replicas", 4, 4) + _cases("benchmark", 4, 2),
}


def stage_inputs(case: StageCase, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bitwise the same pseudo-gradients [R, n] (and error buffers) on every process: a seeded CPU
    generator; magnitudes over 2^-10..2^2, replica 0's second block of its second tensor all zero."""
    gen = torch.Generator().manual_seed(100 + index)
    R, n = case.replicas, STAGE_BLOCKS.numel
    deltas = torch.randn(R, n, generator=gen) * torch.exp2(
        torch.randint(-10, 3, (R, n), generator=gen).float()
    )
    deltas[0, 332:364] = 0
    errors = torch.randn(R, n, generator=gen) / 64 if case.ef else None
    return deltas, errors


def stage_result(case: StageCase, index: int, groups, mine: list[int]) -> dict:
    """The stage run on this process's replicas `mine`: the mean, who took part, the figures, the
    buffers afterwards (None without error feedback)."""
    deltas, errors = stage_inputs(case, index)
    local = None if errors is None else errors[mine].clone()
    active = torch.tensor(case.active)[mine]
    result = compressed_mean(case.outer, deltas[mine].clone(), local, active, STAGE_BLOCKS, groups).wait()
    return {"mean": result.mean, "synced": result.synced, "figures": result.figures, "errors": local}


def stage_worker(rank: int, world: int, out: Path) -> None:
    """One rank: join the gloo group (a file rendezvous in the test's directory), build the collectives of
    every layout as `hypertrain.launchers.local.run_worker` does (`choose_layout`, `DistReplicaGroups`; every
    rank creates every group in the same order) and run every case; its results and the bytes it handed
    to the collectives per case go to out/rank{r}.pt."""
    import torch.distributed as dist

    from hypertrain.distributed.collectives import DistReplicaGroups
    from hypertrain.distributed.layouts import choose_layout

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out / 'rendezvous'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    results, built = {}, {}
    for index, case in enumerate(STAGE_CASES[world]):
        key = (case.layout, case.world, case.replicas)
        if key not in built:
            layout = choose_layout(world, case.world, case.replicas, case.layout)
            assert layout.kind == case.layout
            built[key] = DistReplicaGroups(layout, rank, torch.device("cpu"), 60.0)
        groups = built[key]
        results[case.name] = stage_result(case, index, groups, groups.replicas)
        results[case.name]["replicas"] = groups.replicas
        results[case.name]["handed"] = groups.comm_stats()["comm_measured_outer_bytes"]
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def stage_ranks(world: int, out: Path) -> None:
    """The ranks, forked from one process that imported torch and hypertrain (before any thread or
    process group exists), as tests/test_streaming_overlap.py starts its ranks."""
    torch.set_num_threads(1)
    fork_ranks(world, lambda rank: stage_worker(rank, world, out))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_stage_on_real_processes_equals_the_simulation_bitwise(tmp_path, world):
    """Invariant 10's stage equality: `world` real processes (gloo on CPU, forked ranks) run
    `compressed_mean` on their replicas' rows of bitwise-identical inputs (`stage_inputs`, a seeded CPU
    generator; ragged blocks of 32 in tensors of 300, 64, 1000 and 7, so two_phase's shards are uneven;
    a replica that did not step in some cases; error feedback in some) and the simulation
    (`ReplicaGroups`, all replicas here) runs it on all rows. For int8 and fp4_e2m1 with gather and
    two_phase, top-k with gather, uint8 with gather, fp8_e4m3 and e3m0 with two_phase, top-k with gather and
    fp4_e2m1 with two_phase after the DCT (outer.codec.transform=dct), under the replicas
    layout (P = 2: R = 2 and R = 4 with two replicas per process; P = 4: R = 4) and the benchmark
    layout W = 4, R = 2 (L = 2): every rank's decoded mean,
    count, figures (per-replica compression errors, payload bytes, the formula's bytes) and error
    buffers equal the simulation's, bitwise (== on the int32 bit patterns). Exact by construction:
    every process decodes the same bytes and adds them in replica order, as the simulation does.

    What each process handed to the collectives (its measured outer bytes) is the compressed messages,
    never fp32: gather, its R_local messages of 8 header bytes and the b-byte payload; two_phase, the
    all-to-all's R_local x R messages padded to the widest shard (8 + max_j b_j) and its shards'
    re-encoded means padded to max_j b_j."""
    out = tmp_path
    proc = subprocess.Popen(
        [sys.executable, __file__, "stage", str(world), str(out)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        simulated = {
            case.name: stage_result(case, i, ReplicaGroups(case.replicas), list(range(case.replicas)))
            for i, case in enumerate(STAGE_CASES[world])
        }
        _, err = proc.communicate(timeout=120)  # gloo's timeout is 60 s
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the ranks this test started
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    for rank in range(world):
        got = torch.load(out / f"rank{rank}.pt", weights_only=False)
        for case in STAGE_CASES[world]:
            mine, want, have = got[case.name]["replicas"], simulated[case.name], got[case.name]
            where = f"rank {rank}, {case.name}"
            assert torch.equal(bits(have["mean"]), bits(want["mean"])), where
            assert have["synced"] == want["synced"] == sum(case.active), where
            assert have["figures"] == want["figures"], where
            if case.ef:
                assert torch.equal(bits(have["errors"]), bits(want["errors"][mine])), where
            b = want["figures"]["payload_bytes"]
            assert b == codecs.payload_size(case.codec, STAGE_BLOCKS, topk(case.outer)), where
            if case.reduce == "gather":
                handed = len(mine) * (HEADER_BYTES + b)
            else:
                shards = [
                    codecs.payload_size(case.codec, own) for _, _, own in STAGE_BLOCKS.shards(case.replicas)
                ]
                assert sum(shards) == b
                owned = len(mine)  # the shards of this process's replicas
                handed = len(mine) * case.replicas * (HEADER_BYTES + max(shards)) + owned * max(shards)
            assert have["handed"] == handed < len(mine) * 4 * STAGE_BLOCKS.numel, where


# -- 4. whole runs ----------------------------------------------------------------------------------------


def int8_codes(payload: torch.Tensor, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """One replica's int8 payload read by its documented layout (block after block: an fp32 scale, then
    the block's int8 codes): (each element's block scale, float64 [n]; its code, int64 [n])."""
    raw, scales, codes, at = payload.contiguous(), [], [], 0
    for length in block_lengths(blocks):
        scale = raw[at : at + 4].view(torch.float32).double()
        codes.append(raw[at + 4 : at + 4 + length].view(torch.int8).long())
        scales.append(scale.expand(length))
        at += 4 + length
    assert at == raw.numel()
    return torch.cat(scales), torch.cat(codes)


def test_stacked_and_loop_flip_int8_codes_only_where_their_pseudo_gradients_straddle_a_boundary(monkeypatch):
    """Invariant 10 for whole runs on two engines: the stacked engine and the loop, int8 with gather,
    R = 2, 3 syncs (H = 2, 6 updates), on documents (variable-length examples, padded; this tiny
    config's fixed windows give bitwise-equal pseudo-gradients on both engines, nothing to flip). Their
    pseudo-gradients differ by fp32 rounding (invariant 6), so a code may flip where an entry lies within
    that difference of a rounding boundary, and nowhere else.

    Each engine's input to the stage at each sync (x_m, captured at `compressed_mean`) is encoded, and
    each element's code and block scale read back (`int8_codes`). The flips are bounded by the measured
    difference: a code may differ only where the interval between the two engines' x / s (in code
    units, float64) reaches a rounding boundary (k + 1/2), widened by the fp32 division's own rounding
    (127 U32: |x / s| <= 127), so the flips are at most the entries whose interval straddles one; both
    counts are printed. Later syncs start from weights that earlier flips moved; the rule still holds."""
    captured: dict[str, list] = {"loop": [], "stacked": []}
    real = compressed_mean

    def capture(into):
        def stage(outer, deltas, errors, active, blocks, groups, update=None, order=None, weights=None):
            into.append(((deltas if errors is None else deltas + errors).clone(), blocks))
            return real(outer, deltas, errors, active, blocks, groups, update, order, weights)

        return stage

    cfg = small_cfg(
        outer=OuterConfig(compress="int8"),
        phase=PhaseConfig(name="t", kind="strong", offset=0, global_batch=24, updates=6, timing_warmup=0),
        data=DataConfig(seq_len=16, heldout=32, examples="documents", max_len=48, max_examples=4),
    )
    for name, engine in (("loop", loop.train_replicas), ("stacked", stacked.train_replicas)):
        monkeypatch.setattr("hypertrain.diloco.sync.compressed_mean", capture(captured[name]))
        run_rounds(cfg, engine)
    assert len(captured["loop"]) == len(captured["stacked"]) == 3
    widen = 127 * U32
    flips = straddling = elements = differ = 0
    for (xa, blocks), (xb, _) in zip(captured["loop"], captured["stacked"], strict=True):
        differ += int((xa != xb).sum())
        pa, pb = codecs.encode("int8", xa, blocks), codecs.encode("int8", xb, blocks)
        for m in range(cfg.replicas):
            (sa, ca), (sb, cb) = int8_codes(pa[m], blocks), int8_codes(pb[m], blocks)
            ua = xa[m].double() / torch.where(sa > 0, sa, 1.0)
            ub = xb[m].double() / torch.where(sb > 0, sb, 1.0)
            lo, hi = torch.minimum(ua, ub) - widen, torch.maximum(ua, ub) + widen
            straddles = torch.floor(hi - 0.5) >= torch.ceil(lo - 0.5)  # some k + 1/2 in [lo, hi]
            flipped = ca != cb
            assert not (flipped & ~straddles).any(), "a code flipped where no boundary lies between"
            flips += int(flipped.sum())
            straddling += int(straddles.sum())
            elements += ca.numel()
    assert differ > 0  # the engines' pseudo-gradients did differ: the check is not vacuous
    print(
        f"{differ} pseudo-gradient entries differ between the engines; {flips} of {elements} codes flipped, "
        f"{straddling} could have"
    )


ENGINE_CASES = {
    "e3m0": outer_cfg("e3m0", block=32),
    "dct-topk-ef": outer_cfg("topk", block=32, fraction=0.125, ef=True, transform="dct"),
}


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_loop_and_stacked_are_bitwise_equal_with_e3m0_and_the_dct(name):
    """Invariant 6 with e3m0 and with the DCT before top-k (error feedback on): small_cfg's fixed windows
    give both engines bitwise-equal pseudo-gradients (see the int8 test above), and the compressed sync is
    the same function on the same numbers, so the loop and the stacked engine end equal, == (3 syncs of
    R = 2); not vacuously: the run ends on other weights than the uncompressed one."""
    cfg = small_cfg(outer=ENGINE_CASES[name], phase=replace_updates(6))
    looped, looped_theta = run_rounds(cfg, loop.train_replicas)
    stacked_losses, stacked_theta = run_rounds(cfg, stacked.train_replicas)
    assert looped == stacked_losses
    assert all(torch.equal(looped_theta[k], stacked_theta[k]) for k in looped_theta)
    _, plain = run_rounds(small_cfg(phase=replace_updates(6)), loop.train_replicas)
    assert any(not torch.equal(plain[k], looped_theta[k]) for k in plain)


def replace_updates(updates: int) -> PhaseConfig:
    return PhaseConfig(name="t", kind="strong", offset=0, global_batch=24, updates=updates, timing_warmup=0)


# Whole runs, real processes against the simulation, through the entry. W = R = 2 under the benchmark
# layout: one replica per process, L = 1 (each rank trains its replica's whole share, `world` = 1 in the
# channel weights, as the simulation does); the loop engine in both computes a replica with the same
# code on the same numbers whether its process holds one replica or two. So the replicas' pseudo-
# gradients are bitwise the simulation's, and the compressed sync is exact on identical inputs (3.): the
# runs are equal, ==, with no flip to count.
WHOLE = [*RUN, "engine=loop", "world=2", "replicas=2"]
WHOLE_CASES = {
    "fp4-gather": ["outer.compress=fp4_e2m1"],
    # SparseLoCo's pieces (issue 37): k = 8 of a block of 128, two_bit values, 12-bit indices, decay 0.9
    "topk-sparseloco": [
        "outer.compress=topk",
        "outer.topk.fraction=0.0625",
        "outer.error_feedback=true",
        "outer.codec.error_decay=0.9",
        "outer.topk.index_bits=12",
        "outer.topk.values=two_bit",
    ],
    "fp4-two_phase": ["outer.compress=fp4_e2m1", "outer.codec.reduce=two_phase"],
    "e3m0-gather": ["outer.compress=e3m0"],
    "dct-topk-ef": [
        "outer.compress=topk",
        "outer.codec.transform=dct",
        "outer.topk.fraction=0.05",
        "outer.error_feedback=true",
    ],
    # SparseLoCo's chunks (issue 37; templar's, issue 48): 4 x 4 tiles of every matrix, one tile a block of
    # 16, k = 2 of it, and of every chunk of the 1-D tensors (runs of 4)
    "topk-tiles-ef": [
        "outer.compress=topk",
        "outer.codec.tile=4",
        "outer.codec.block=16",
        "outer.topk.fraction=0.125",
        "outer.error_feedback=true",
    ],
    # fragments: H = 4, P = 2 (a fragment every 2 updates), taken one update early (in flight meanwhile)
    "int8-fragments2-delay1": [
        "outer.compress=int8",
        "inner.H=4",
        "phase.updates=8",
        "outer.fragments=2",
        "outer.delay=1",
    ],
}
MEASURED = ("comm_measured_inner_bytes", "comm_measured_outer_bytes")


@pytest.mark.parametrize(
    "name",
    # every case slow: the quick loop's codec on real processes is the stage's, above (world 2)
    [pytest.param(n, marks=pytest.mark.slow) for n in WHOLE_CASES],
)
def test_real_processes_equal_the_simulation_exactly_with_compression(tmp_path, name):
    """`processes=dist world=2 replicas=2` (two self-launched gloo workers, benchmark layout) against the
    simulation of the same overrides (one process), both through the entry, side by side: every update
    row, every sync row (bytes, payload, per-replica compression errors) but the measured figures only
    real processes record, the held-out losses, the final summary and weights.pt, exactly (see WHOLE for
    why exact). Fragments with a delay compose with compression the same way (each fragment's
    pseudo-gradient through the same stages, the gather in flight over the delayed update).

    The bytes the gather handed to the collective at a sync (`comm_measured_outer_bytes`, without
    fragments: one exchange per row) are the compressed message, its 8 header bytes and the payload, and
    that payload is the formats' count for the model's tensors (`payload_formula`; the DCT changes no
    byte)."""
    extra = WHOLE_CASES[name]
    runs = {"sim": [*WHOLE, *extra], "dist": [*WHOLE, *extra, "processes=dist"]}
    procs = {k: start_entry([*args, f"hydra.run.dir={tmp_path / k}"], tmp_path) for k, args in runs.items()}
    done = {k: finish(p) for k, p in procs.items()}
    for k, result in done.items():
        assert result.returncode == 0, (k, result.stderr)
    if "outer.fragments=2" in extra:
        assert_identical_streaming(tmp_path / "dist", tmp_path / "sim", skip=MEASURED)
        return
    assert OmegaConf.load(tmp_path / "dist" / "config.yaml").processes.layout == "benchmark"
    assert_identical_but(tmp_path / "dist", tmp_path / "sim", skip=MEASURED)
    syncs = [r for r in read_metrics(tmp_path / "dist" / "metrics.jsonl") if r["kind"] == "sync"]
    assert syncs and all(r["payload_bytes"] > 0 and len(r["compress_error"]) == 2 for r in syncs)
    if "outer.codec.reduce=two_phase" not in extra:
        assert all(r["comm_measured_outer_bytes"] == HEADER_BYTES + r["payload_bytes"] for r in syncs), syncs
    outer = OmegaConf.load(tmp_path / "dist" / "config.yaml").outer
    weights = torch.load(tmp_path / "dist" / "weights.pt", weights_only=True)
    blocks = Blocks(tuple(t.numel() for t in weights.values()), outer.codec.block)
    tiled = ([tuple(t.shape) for t in weights.values()], outer.codec.tile) if outer.codec.tile else None
    own = outer.topk or TopKConfig()  # None under another codec than top-k
    # own["values"], not own.values: on the config.yaml read back (a DictConfig) .values is Mapping's method
    spec = (own.fraction, str(own["values"] if outer.topk else own.values), own.index_bits)
    b = payload_formula(outer.compress, blocks, *spec, tiled=tiled)
    assert all(r["payload_bytes"] == b for r in syncs), (b, syncs)


# -- 5. killed mid-round with error buffers, resumed: bit-identical ---------------------------------------

# Syncs after updates 2, 4, 6 (H = 2); a checkpoint every 3 updates falls mid-round at 3, after the
# sync at 2 left what top-k did not send in the buffers. The fault kills after update 4's inner step,
# before its sync: the newest checkpoint is the one at 3.
KILL_RUN = [
    *RUN,
    "inner.H=2",
    "phase.updates=6",
    "outer.compress=topk",
    "outer.topk.fraction=0.05",
    "outer.error_feedback=true",
    "checkpoint.every_updates=3",
    "checkpoint.keep=10",
]
KILL_ENGINES = {
    "stacked": ([], "0:4:kill:after", KILLED),
    "dist": (["processes=dist", "world=2", "replicas=2"], "1:4:kill:after", RankFailed.exit_code),
    # DeMo's chunked DCT before the top-k: the buffers hold what was not sent, in the parameter domain
    "stacked-dct": (["outer.codec.transform=dct"], "0:4:kill:after", KILLED),
}


def buffers(path: Path) -> list[dict]:
    return torch.load(path, weights_only=False)["state"]["errors"]


# The quick loop's case is the stacked one: a killed rank of real processes resumes in test_dist.py and
# test_streaming_engines.py, and the buffers' checkpoint is the same object on every engine.
@pytest.mark.parametrize("engine", ["stacked", pytest.param("dist", marks=pytest.mark.slow), "stacked-dct"])
def test_killed_with_error_buffers_resumes_bit_identically(tmp_path, engine):
    """Invariant 9 with error feedback: top-k (5%) with error feedback, SIGKILL after update 4's inner
    step (under processes=dist rank 1 dies and the run fails; stacked-dct: the top-k of each block's DCT
    coefficients, outer.codec.transform=dct); the newest checkpoint is the mid-round one
    at 3, whose `state['errors']` holds every replica's non-zero buffer (what the sync at 2 did not
    send). `resume=true` goes on from it and equals an uninterrupted run exactly (`assert_identical_but`:
    update rows, sync rows with their payload bytes and compression errors, held-out losses, summary,
    weights.pt; under dist without the measured bytes, a killed session's own).

    Negative control (stacked): the uninterrupted run's checkpoint at 3 with its buffers zeroed, resumed,
    trains update 4 alike (the buffers act at syncs only) but sends other values at the sync after it (its
    pseudo-gradient norm differs) and ends on other weights: the buffers are restored, not recomputed."""
    extra, fault, killed_rc = KILL_ENGINES[engine]
    overrides = [*KILL_RUN, *extra]
    run_dir, reference = killed_beside_uninterrupted(overrides, tmp_path, fault, killed_rc)
    assert sorted((run_dir / "checkpoints").glob("ckpt-u*.pt"))[-1] == ckpt(run_dir, 3)
    saved = buffers(ckpt(run_dir, 3))
    assert len(saved) == 2 and all(any(bool(t.any()) for t in e.values()) for e in saved)
    resumed(overrides, run_dir, tmp_path)
    assert [r["from"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "resume"] == [
        str(ckpt(run_dir, 3))
    ]
    assert_identical_but(run_dir, reference, skip=MEASURED)
    if engine != "stacked":
        return

    edited = shutil.copytree(reference, tmp_path / "edited")
    whole = torch.load(ckpt(edited, 3), weights_only=False)
    for e in whole["state"]["errors"]:
        for t in e.values():
            t.zero_()
    torch.save(whole, ckpt(edited, 3))
    seal(ckpt(edited, 3))  # a whole checkpoint whose buffers are wrong
    done = entry([*overrides, f"resume={ckpt(edited, 3)}"], tmp_path)
    assert done.returncode == 0, done.stderr
    got, want = outcome(edited), outcome(reference)
    assert got.updates[:4] == want.updates[:4]
    assert [r["update"] for r in got.syncs] == [r["update"] for r in want.syncs] == [2, 4, 6]
    assert got.syncs[0] == want.syncs[0]
    assert got.syncs[1]["pseudo_grad_norm"] != want.syncs[1]["pseudo_grad_norm"]
    assert got.updates[4:] != want.updates[4:] and got.heldout[2:] != want.heldout[2:]
    assert any(not torch.equal(got.weights[n], want.weights[n]) for n in want.weights)


# -- 6. bytes from the run's own records ---------------------------------------------------------------


def fp32_ring_bytes(params: int, n: int) -> float:
    return 2 * (n - 1) / n * 4 * params


def payload_formula(
    codec: str, blocks: Blocks, fraction: float, values: str = "fp32", index_bits: int = 32, tiled=None
) -> int:
    """One replica's payload from the formats' definitions (docs/compression.md): int8 one byte per value
    and an fp32 scale per block; fp4_e2m1 and e3m0 two values per byte, packed per block, and a scale;
    top-k, for each of ceil(f x L) entries of a block of L, its value (fp32 4 bytes, fp16 2, int8 1 and
    an fp32 scale per block, two_bit 2 bits packed per block and 20 bytes per tensor) and its index (int32,
    or 12 bits: two in three bytes, an odd last one in two). `tiled` (the tensors' shapes, outer.codec.tile
    T): the blocks are templar's chunks and top-k keeps `templar_k` of a whole tile's ceil(f T^2) of each
    (tests/references.py)."""
    lengths = block_lengths(blocks)
    ks = [kept(fraction, length) for length in lengths]
    if tiled is not None:
        shapes, tile = tiled
        lengths = [len(c) for shape in shapes for c in templar_chunks(shape, tile)]
        ks = [templar_k(math.ceil(fraction * tile * tile), length) for length in lengths]
    if codec == "int8":
        return sum(lengths) + 4 * len(lengths)
    if codec in ("fp4_e2m1", "e3m0"):
        return sum(-(-length // 2) for length in lengths) + 4 * len(lengths)
    per_value = {"fp32": lambda k: 4 * k, "fp16": lambda k: 2 * k, "int8": lambda k: 4 + k}
    per_value["two_bit"] = lambda k: -(-k // 4)
    total = sum(per_value[str(values)](k) for k in ks)
    if str(values) == "two_bit":
        total += 20 * sum(1 for size in blocks.sizes if size)
    per_index = (lambda k: 4 * k) if int(index_bits) == 32 else (lambda k: 3 * (k // 2) + 2 * (k % 2))
    return total + sum(per_index(k) for k in ks)


BYTES_CASES = {
    # (replicas n, compress, reduce, block, topk_fraction, the least ratio the issue asks, transform)
    "n2-int8-gather": (2, "int8", "gather", 128, 0.01, 3.5, "none"),
    "n2-fp4-gather": (2, "fp4_e2m1", "gather", 128, 0.01, 7.0, "none"),
    "n2-topk-1/64-gather": (2, "topk", "gather", 64, 1 / 64, 32.0, "none"),
    "n4-int8-two_phase": (4, "int8", "two_phase", 128, 0.01, 3.5, "none"),
    "n4-fp4-two_phase": (4, "fp4_e2m1", "two_phase", 128, 0.01, 7.0, "none"),
    "n4-e3m0-two_phase": (4, "e3m0", "two_phase", 128, 0.01, 7.0, "none"),
    "n2-dct-topk-1/64-gather": (2, "topk", "gather", 64, 1 / 64, 32.0, "dct"),  # the DCT adds no byte
}


@pytest.mark.parametrize("name", list(BYTES_CASES))
def test_compressed_bytes_against_the_fp32_ring_from_the_runs_records(tmp_path, name):
    """The default tiny model (d_model 64, 2 layers; its tensor sizes are multiples of 64: checked), a
    run of 2 updates and one sync, trained in this process with its records written as the entry writes
    them (`run_losses`), one replica per participant (n = R). From the sync row: `payload_bytes` equals
    the formats' count (`payload_formula`), exactly; `comm_outer_bytes` is the reduction's formula,
    (n - 1) b for gather and 2 (n - 1) / n b for two_phase; and the fp32 ring all-reduce, the same run
    uncompressed (its own `comm_outer_bytes`, 2 (n - 1) / n x 4 x params), is at least the issue's
    factor above it: 3.5 (8-bit: 4 bytes / (1 + 4/128)), 7 (4-bit: 4 / (1/2 + 4/128)); top-k at
    f = 1/64 with fp32 values and int32 indices 1 / (2f) = 32, exactly, since every block of 64 is full
    (ragged blocks would keep ceil(f x L) of fewer values)."""
    n, codec, reduce, block, fraction, least, transform = BYTES_CASES[name]
    model = ModelConfig()
    sizes = tuple(t.numel() for t in init_params(model, seed=0).values())
    assert all(s % 64 == 0 for s in sizes), sizes
    params = sum(sizes)

    def sync_row(outer: OuterConfig, where: Path) -> dict:
        cfg = small_cfg(
            model=model,
            outer=outer,
            replicas=n,
            world=WorldConfig(size=8),
            phase=PhaseConfig(name="t", kind="strong", offset=0, global_batch=8, updates=2, timing_warmup=0),
        )
        (row,) = [r for r in run_losses(cfg, where) if r["kind"] == "sync"]
        assert row["replicas_synced"] == n
        return row

    (tmp_path / "none").mkdir()
    (tmp_path / "compressed").mkdir()
    plain = sync_row(OuterConfig(), tmp_path / "none")
    assert plain["comm_outer_bytes"] == int(fp32_ring_bytes(params, n))
    row = sync_row(outer_cfg(codec, reduce, block, fraction, transform=transform), tmp_path / "compressed")
    blocks = Blocks(sizes, block)
    b = payload_formula(codec, blocks, fraction)
    assert row["payload_bytes"] == b
    formula = (n - 1) * b if reduce == "gather" else int(2 * (n - 1) / n * b)
    assert row["comm_outer_bytes"] == formula
    ratio = plain["comm_outer_bytes"] / row["comm_outer_bytes"]
    assert ratio >= least, ratio
    if codec == "topk":
        assert ratio == 1 / (2 * fraction)
    print(f"{name}: {plain['comm_outer_bytes']} fp32 ring bytes / {row['comm_outer_bytes']} = {ratio:.2f}x")


# -- 7. bad input ---------------------------------------------------------------------------------------

BAD = {
    "unknown-compressor": (
        ["outer.compress=int4"],
        "outer.compress='int4' is not a codec; valid: none, int8, uint8, fp8_e4m3, fp8_e5m2, fp4_e2m1, e3m0, "
        "topk, lowrank, or the import path",
    ),
    "unknown-reduction": (
        ["outer.compress=int8", "outer.codec.reduce=ring"],
        "outer.codec.reduce='ring' is not valid",
    ),
    "block-0": (
        ["outer.compress=int8", "outer.codec.block=0"],
        "outer.codec.block=0 is too small; valid: >= 1",
    ),
    "fraction-0": (
        ["outer.compress=topk", "outer.topk.fraction=0"],
        "outer.topk.fraction=0.0 is out of range; valid: (0, 1]",
    ),
    "fraction-1.5": (
        ["outer.compress=topk", "outer.topk.fraction=1.5"],
        "outer.topk.fraction=1.5 is out of range; valid: (0, 1]",
    ),
    "fraction-nan": (["outer.compress=topk", "outer.topk.fraction=nan"], "outer.topk.fraction=nan is not"),
    "error-feedback-with-none": (
        ["outer.error_feedback=true"],
        "outer.error_feedback=true with outer.compress=none has nothing to feed back",
    ),
    "topk-two_phase": (
        ["outer.compress=topk", "outer.codec.reduce=two_phase"],
        "outer.compress=topk with outer.codec.reduce=two_phase",
    ),
    "unknown-transform": (
        ["outer.compress=topk", "outer.codec.transform=fft"],
        "outer.codec.transform='fft' is not valid",
    ),
    "transform-with-none": (
        ["outer.codec.transform=dct"],
        "outer.codec.transform=dct is not read by outer.compress=none; valid: a codec that reads it (int8, ",
    ),
}
# the same checks as unknown-compressor and fraction-1.5; both transforms' also in test_bad_input.py
SLOW_BAD = {"unknown-reduction", "fraction-0", "unknown-transform", "transform-with-none"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW_BAD else ()) for n in BAD]
)
def test_a_bad_compression_setting_is_one_line_exit_2_and_creates_nothing(tmp_path, name):
    """Each mistake: exit 2, one line on stderr naming the value and what is valid, no traceback, and
    the empty working directory left empty (no run directory, no outputs/)."""
    args, says = BAD[name]
    done = entry([*RUN, *args], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = stderr_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("hypertrain: error: " + says), lines[0]
    assert "Traceback" not in done.stderr + done.stdout
    assert tree(tmp_path) == {}


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_a_block_beyond_every_tensor_trains_as_one_block_per_tensor(codec):
    """Issue 48 item 12: outer.codec.block=2^62 once overflowed torch's storage at the first sync. A block
    never crosses a tensor, so it is each tensor one block: the run (stacked, 2 syncs, top-k with error
    feedback) equals the run at outer.codec.block = the largest tensor's size, losses and weights exactly."""
    base = small_cfg(
        outer=OuterConfig(
            compress=codec,
            topk=TopKConfig(fraction=0.25) if codec == "topk" else None,
            error_feedback=codec == "topk",
        )
    )
    largest = max(t.numel() for t in init_params(base.model, seed=0).values())
    runs = [
        run_rounds(
            replace(base, outer=replace(base.outer, codec=CodecConfig(block=block))), stacked.train_replicas
        )
        for block in (2**62, largest)
    ]
    (losses, theta), (want_losses, want_theta) = runs
    assert losses == want_losses and all(torch.equal(theta[n], want_theta[n]) for n in theta)


# -- 8. none spelled out is today's run ---------------------------------------------------------------


def test_compress_none_spelled_out_is_the_default_run_bitwise(tmp_path):
    """Invariant 10's neutral setting through the entry: `outer.compress=none` with the other compression
    settings at their defaults, spelled out, gives the same resolved config, the same run name (its
    config hash) and the same run as leaving them out, exactly (`assert_identical`), and its sync rows
    are today's (no payload or compression-error fields): two runs of 2 rounds of 2 updates, side by
    side."""
    plain = [*RUN, "inner.H=2", "phase.updates=4"]
    spelled = [
        *plain,
        "outer.compress=none",
        "outer.codec.reduce=gather",
        "outer.codec.block=128",
        "outer.topk.fraction=0.01",
        "outer.codec.transform=none",
        "outer.error_feedback=false",
    ]
    runs = {"plain": ReferenceRuns.beside(tmp_path)(plain), "spelled": tmp_path / "spelled"}
    done = entry([*spelled, f"hydra.run.dir={runs['spelled']}"], tmp_path)
    assert done.returncode == 0, done.stderr
    configs = {name: OmegaConf.load(run / "config.yaml") for name, run in runs.items()}
    assert configs["spelled"] == configs["plain"] and configs["plain"].outer.compress == "none"
    starts = {
        name: next(r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "start")
        for name, run in runs.items()
    }
    assert starts["spelled"]["name"] == starts["plain"]["name"]
    assert_identical(runs["spelled"], runs["plain"])
    syncs = [r for r in read_metrics(runs["plain"] / "metrics.jsonl") if r["kind"] == "sync"]
    assert [r["update"] for r in syncs] == [2, 4]
    assert all("payload_bytes" not in r and "compress_error" not in r for r in syncs)


if __name__ == "__main__":  # the stage test's ranks: `python tests/test_compression.py stage WORLD OUT`
    assert sys.argv[1] == "stage"
    stage_ranks(int(sys.argv[2]), Path(sys.argv[3]))
