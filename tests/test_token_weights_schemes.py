"""outer.mean_weights=tokens in synchronous rounds with codecs, Streaming DiLoCo's fragments and
overlap (issue 39, docs/async.md "Weighted mean"): at every sync the run's outer step is the float64
step on g = sum_m v_m d_m, v_m = T_m / sum_j T_j with T_m the target tokens replica m trained on in the
sync's own window (worked out here from the plan's ids and the documents' lengths: since the fragment's
last sync; with overlap, the window the reduction took) and d_m replica m's contribution: its
pseudo-gradient (fp32), the codec's grid of it (int8, written in tests/test_async_codecs.py), or the
largest magnitudes of x_m = delta_m + e_m (top-k, its error buffer e_m <- x_m - C(x_m) followed here
exactly); the uniform mean is not it (negative control); loop = stacked bitwise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import (
    DOCUMENTS,
    QUICK,
    assert_identical_streaming,
    cfg_for,
    ckpt,
    entry,
    killed_beside_uninterrupted,
    resumed,
)
from omegaconf import OmegaConf
from references import U32
from test_async_codecs import BLOCK, blocks_of, grid_reference
from test_lowrank import RANK, SHAPES, gamma, matrices, power_iteration64, warm_starts
from test_lowrank import inputs as lowrank_inputs

from hypertrain.codec_table import codec_entry
from hypertrain.codecs.kernels import Blocks
from hypertrain.config import CodecConfig, TopKConfig
from hypertrain.diloco.exchange.communication import compressed_mean
from hypertrain.diloco.exchange.lowrank import Factors, lowrank_mean
from hypertrain.diloco.fragments import fragment_of
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.distributed.groups import ReplicaGroups
from hypertrain.engines import loop
from hypertrain.preflight.checks import validate
from hypertrain.preflight.prepare import initial_weights, prepare

R, H, FRACTION = 3, 4, 0.25


def documents_cfg(engine: str = "stacked", **outer):
    """R = 3 replicas, H = 4, 8 updates on documents of unequal length (their tokens differ per replica
    and window), one layer (two fragments at most), token-weighted; `outer` on top."""
    base = cfg_for(R=R, H=H)
    outer = {"mean_weights": "tokens"} | outer
    if str(outer.get("compress")) == "topk":  # top-k's node exists with top-k alone
        outer = {"topk": TopKConfig(fraction=FRACTION)} | outer
    blocks = {"block": BLOCK} if "block" in codec_entry(outer.get("compress", "none")).takes else {}
    shared = {k: outer.pop(k) for k in [f.name for f in dataclasses.fields(CodecConfig)] if k in outer}
    outer["codec"] = CodecConfig(**blocks | shared)  # the fields the codecs share (`Codec.takes`)
    cfg = replace(
        base,
        data=replace(base.data, examples="documents", max_len=48, max_examples=4),
        outer=replace(base.outer, **outer),
        engine=replace(base.engine, name=engine),
    )
    validate(cfg)
    return cfg


def observed(cfg):
    """Run `cfg` by the loop engine cut after every update: per update count, every replica's weights
    before its events, and after them the global weights, the outer momentum and every error buffer."""
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    before: dict[int, list[dict]] = {}

    def recording(cfg, theta, assigns, states, average=None, stop=None):
        results = loop.train_replicas(cfg, theta, assigns, states, average, stop)
        count = assigns[0].global_step0 + len(results[0].losses)
        before[count] = [{n: t[0].clone() for n, t in r.params.items()} for r in results]
        return results

    def snapshot():
        errors = (
            None if state.errors is None else [{n: t.clone() for n, t in e.items()} for e in state.errors]
        )
        theta = {n: t.clone() for n, t in state.theta.items()}
        return theta, {n: t.clone() for n, t in state.outer.momentum.items()}, errors

    after = {0: snapshot()}
    for part in rounds(run, state, recording, every_updates=1):
        after[part.updates.stop] = snapshot()
    return run, before, after


def tokens_in(run, window: range) -> torch.Tensor:
    """float64 [R]: the target tokens each replica trained on in `window`: every document of the plan's
    ids has one target fewer than its tokens."""
    return torch.tensor(
        [
            sum(len(run.dataset.get(int(x))) - 1 for u in window for x in run.replica_ids(u, m))
            for m in range(R)
        ],
        dtype=torch.float64,
    )


def flat(params: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([params[n].reshape(-1) for n in names])


def syncs(cfg) -> list[tuple[int, int, int]]:
    """Every sync as (fragment, take count, landing count), in landing order, from Streaming DiLoCo's
    schedule: fragment p lands at counts k H + (p + 1) H / P and is taken tau counts before; the phase's
    end lands one in flight with what it took, and takes and lands any other fragment not just landed."""
    P, U, tau = cfg.outer.fragments, cfg.phase.updates, cfg.outer.delay
    out = []
    for p in range(P):
        last = 0
        for k in range(U // H + 1):
            land = k * H + (p + 1) * H // P
            take = land - tau
            if take >= U:  # not taken before the end: the flush takes and lands it
                if last < U:
                    out.append((p, U, U))
                break
            out.append((p, take, min(land, U)))
            last = min(land, U)
            if last == U:
                break
    return sorted(out, key=lambda sync: (sync[2], sync[0]))


def float64_step(outer, theta, buf, g):
    """DiLoCo's outer step (SGD with Nesterov momentum) in float64."""
    new_buf = outer.momentum * buf + g
    return theta - outer.lr * (g + outer.momentum * new_buf if outer.nesterov else new_buf), new_buf


def topk_of(x, left, sizes):
    """float64: the top-k payload the run's buffers `left` say each row of `x` sent, d = x - left, after
    checking it is one: every entry x's own or 0, and per block min(k, x's nonzeros) of them kept,
    k = ceil(FRACTION * L), none smaller in magnitude than one dropped (which of two equal magnitudes
    at the cut is kept, the codec's choice, is left open)."""
    d = x - left  # exact: left is x or 0 entrywise
    assert ((d == x) | (d == 0)).all()
    for row_x, row_d in zip(x, d, strict=True):
        for b in blocks_of(row_x, sizes):
            v, kept = row_x[b].abs(), row_d[b] != 0
            k = math.ceil(FRACTION * len(v))
            assert int(kept.sum()) == min(k, int((v > 0).sum())), b
            if kept.any() and (~kept).any():
                assert v[kept].min() >= v[~kept].max(), b
    return d.double()


def contributions(cfg, deltas, errors, left):
    """Each replica's d_m (float64 [R, n]), its codec's error bound per entry and the buffers it leaves;
    `left`: the run's buffers after the sync (top-k: which of a tie it kept)."""
    sizes = errors["sizes"]
    if cfg.outer.compress == "none":
        return deltas.double(), torch.zeros(len(deltas)), None
    if cfg.outer.compress == "int8":
        # tests/test_async_codecs.py's bound for the grid's fp32 scale and product: 4 U32 amax
        d = torch.stack([grid_reference("int8", x, sizes) for x in deltas])
        return d, 4 * U32 * deltas.abs().amax(1).double(), None
    x = (
        deltas + errors["e"]
    )  # fp32, as the run adds them (outer.codec.error_decay = 1), from the test's buffers
    d = topk_of(x, left, sizes)
    return d, torch.zeros(len(deltas)), x - d.float()  # the kept values are x's own: exact


def check_every_sync(cfg) -> int:
    """Every sync of `cfg` against the float64 token-weighted step (and not the uniform one); returns the
    syncs checked. Bound per entry of the weights (the run forms g in fp32: each delta_m one rounding,
    v_m one, each product and add one: 3R + 1 roundings of at most U32 sum_m v_m |d_m|, `spread`; then
    the step's as `references.assert_outer_step`), plus sum_m v_m codec_m (the codec's bound; times
    lr (1 + mu) in the weights); an overlapped
    flush chains two steps: the first's error carries into the second (theta's, and lr mu^2 of buf's)."""
    run, before, after = observed(cfg)
    where = fragment_of(run.cfg)
    names = [[n for n, f in where.items() if f == p] for p in range(cfg.outer.fragments)]
    outer, mu, lr = cfg.outer, cfg.outer.momentum, cfg.outer.lr
    last = [0] * cfg.outer.fragments
    errors = {p: None for p in range(cfg.outer.fragments)}
    in_flight: dict[int, tuple] = {}
    checked = 0
    for p, take, land in syncs(cfg):
        keys = names[p]
        theta_take, errors_run = after[take - 1][0], after[take][2]
        sizes = tuple(theta_take[n].numel() for n in keys)
        if errors[p] is None and cfg.outer.error_feedback:
            errors[p] = torch.zeros(R, sum(sizes))
        window, last[p] = range(last[p], take), land
        T = tokens_in(run, window)
        assert len(set(T.tolist())) > 1, T  # unequal: the weights are not uniform
        v = T / T.sum()
        origin = flat(theta_take, keys).float()
        deltas = torch.stack([origin - flat(before[take][m], keys).float() for m in range(R)])
        run_left = None if errors_run is None else torch.stack([flat(e, keys) for e in errors_run])
        d, codec, left = contributions(cfg, deltas, {"sizes": sizes, "e": errors[p]}, run_left)
        if left is not None:
            assert torch.equal(run_left, left), (take, p)
            errors[p] = left
        g = (v[:, None] * d).sum(0)
        spread, codec_term = (v[:, None] * d.abs()).sum(0), float((v * codec).sum())
        steps = [(g, spread, codec_term, d.mean(0))]
        if outer.overlap != "none":  # the reduction lands a period later, and the last at the end
            steps = [in_flight[p]] if p in in_flight else []
            in_flight[p] = (g, spread, codec_term, d.mean(0))
            if land == cfg.phase.updates:
                steps.append(in_flight.pop(p))
        theta_pre, buf_pre, _ = after[land - 1]
        theta_run, buf_run, _ = after[land]
        theta, buf = flat(theta_pre, keys).double(), flat(buf_pre, keys).double()
        err_theta = err_buf = torch.zeros_like(theta)
        uniform = (theta, buf)
        for g_i, spread_i, codec_i, mean_i in steps:
            scale = spread_i + mu * buf.abs()
            carried_theta = err_theta + lr * mu * mu * err_buf
            theta, buf = float64_step(outer, theta, buf, g_i)
            uniform = float64_step(outer, *uniform, mean_i)
            err_buf = mu * err_buf + (3 * R + 3) * U32 * scale + codec_i
            rounding = (3 * R + 6) * U32 * scale + codec_i
            err_theta = carried_theta + 2 * U32 * theta.abs() + lr * (1 + mu) * rounding
            checked += 1
        assert ((flat(buf_run, keys).double() - buf).abs() <= err_buf).all(), (land, p)
        got = flat(theta_run, keys).double()
        assert ((got - theta).abs() <= err_theta).all(), (land, p)
        if steps:  # negative control: the uniform mean's step is not the run's
            assert not ((got - uniform[0]).abs() <= err_theta).all(), (land, p)
    return checked


COMBINATIONS = {
    "int8": {"compress": "int8"},
    "topk-feedback": {"compress": "topk", "error_feedback": True},
    "fragments": {"fragments": 2},
    "fragments-delay-merge-int8": {"fragments": 2, "delay": 1, "merge_alpha": 0.5, "compress": "int8"},
    "overlap": {"overlap": "delayed"},
    "fragments-overlap-topk-feedback": {
        "fragments": 2,
        "overlap": "delayed",
        "compress": "topk",
        "error_feedback": True,
    },
}


# the quick loop keeps the combinations that hold the others (int8 and top-k with feedback each with
# fragments); each codec alone is slow
ALONE = {"int8", "topk-feedback"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow if n in ALONE else ()) for n in COMBINATIONS]
)
def test_every_sync_is_the_float64_token_weighted_step_of_its_window(name):
    cfg = documents_cfg(**COMBINATIONS[name])
    assert check_every_sync(cfg) >= 2


def final(cfg):
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    for _ in rounds(run, state):
        pass
    return state


COMBINATIONS_BUILT_ELSEWHERE = {  # the stage tests below check their weighted sums
    "lowrank-fragments-feedback": {"compress": "lowrank", "fragments": 2, "error_feedback": True},
    "two-phase-int8-dct": {"compress": "int8", "reduce": "two_phase", "transform": "dct"},
    "topk-tiles-feedback": {"compress": "topk", "tile": 4, "block": 16, "error_feedback": True},
}


@pytest.mark.parametrize(
    "name",
    [
        "fragments-overlap-topk-feedback",
        "lowrank-fragments-feedback",
        *(
            pytest.param(n, marks=pytest.mark.slow)
            for n in ["topk-feedback", "two-phase-int8-dct", "topk-tiles-feedback"]
        ),
    ],
)
def test_stacked_equals_the_loop_bitwise(name):
    outer = (COMBINATIONS | COMBINATIONS_BUILT_ELSEWHERE)[name]
    got, want = final(documents_cfg("stacked", **outer)), final(documents_cfg("loop", **outer))
    for n, t in want.theta.items():
        assert torch.equal(got.theta[n], t), n
        assert torch.equal(got.outer.momentum[n], want.outer.momentum[n]), n
    for e_got, e_want in zip(got.errors or [], want.errors or [], strict=True):
        assert all(torch.equal(e_got[n], t) for n, t in e_want.items())


# -- the reductions' weighted sums, stage by stage -------------------------------------------------------

WEIGHTS = torch.tensor([0.5, 0.125, 0.375])  # exact in fp32: T = (4, 1, 3) / 8


def test_two_phase_re_encodes_the_weighted_sum_of_the_decoded_shards():
    """outer.codec.reduce=two_phase with int8: each block's mean is grid(sum_m w_m d_m) with d_m the grid of
    x_m (tests/test_async_codecs.py's reference), the sum formed in fp32 in replica order as documented,
    so the second quantization sees the same fp32 numbers (bound: the grid's 4 U32 amax); the uniform
    mean's grid is not it."""
    outer = documents_cfg(compress="int8", reduce="two_phase").outer
    sizes = (70, 33, 64)
    x = torch.randn(R, sum(sizes), generator=torch.Generator().manual_seed(3))
    x[1] *= 8  # a replica of larger steps: the weights move the mean
    everyone, blocks = torch.ones(R, dtype=torch.bool), Blocks(sizes, BLOCK)
    got = compressed_mean(outer, x.clone(), None, everyone, blocks, ReplicaGroups(R), weights=WEIGHTS).wait()
    total = torch.zeros(sum(sizes))
    for m in range(R):
        total = total + WEIGHTS[m] * grid_reference("int8", x[m], sizes).float()
    want = grid_reference("int8", total, sizes)
    assert (got.mean.double() - want).abs().max() <= 4 * U32 * total.abs().max()
    uniform = grid_reference(
        "int8", sum(grid_reference("int8", x[m], sizes) for m in range(R)).float() / R, sizes
    )
    assert (got.mean.double() - uniform).abs().max() > 1e3 * U32 * total.abs().max()


def test_low_rank_weighs_both_factors_and_the_exact_tensors():
    """outer.compress=lowrank with weights: P = orth(sum_m w_m M_m Q0), Q = sum_m w_m M_m^T P, the mean
    P Q^T (= sum_m w_m P Q_m^T) and the 1-D tensors' sum_m w_m x_m: PowerSGD's float64 Algorithm 1 on
    R w_m M_m (tests/test_lowrank.py's `power_iteration64`, whose mean over R then is the weighted sum),
    within test_lowrank's bounds with the weighted sum's 2R roundings in place of R + 1; the uniform
    mean is not it."""
    deltas, _ = lowrank_inputs(R, 5, ef=False)
    deltas[2] *= 4
    q = warm_starts(SHAPES, RANK)
    q0 = {n: t.clone() for n, t in q.items()}
    everyone, factors = torch.ones(R, dtype=torch.bool), Factors.of(SHAPES, RANK)
    reduction = lowrank_mean(factors, deltas, None, everyone, q, ReplicaGroups(R), weights=WEIGHTS)
    mean = reduction.wait().mean.double().numpy()
    x64, w = deltas.double().numpy(), WEIGHTS.double().numpy()
    for name, (start, rows, cols) in matrices(SHAPES).items():
        ms = [R * w[m] * x64[m, start : start + rows * cols].reshape(rows, cols) for m in range(R)]
        p64, p_hat64, q64, d64 = power_iteration64(ms, q0[name].double().numpy(), [True] * R)
        r = q64.shape[1]
        abs_p = sum(np.abs(m) @ np.abs(q0[name].double().numpy()) for m in ms) / R
        dp_input = float(np.linalg.norm(gamma(cols + 2 * R + 2) * abs_p))
        a_plus = 1 / np.linalg.svd(p64, compute_uv=False)[-1]
        dp = 2 * math.sqrt(2) * a_plus * (dp_input + gamma(2 * rows * r) * np.linalg.norm(p64))
        got_p = reduction.p_hat[name].double().numpy()
        assert np.linalg.norm(got_p - p_hat64) <= dp, name
        dq = (
            sum(
                np.linalg.norm(m) * dp
                + gamma(rows + 2 * R + 2) * np.linalg.norm(np.abs(m).T @ np.abs(p_hat64))
                for m in ms
            )
            / R
        )
        dd = (
            dp * np.linalg.norm(q64)
            + (1 + dp) * dq
            + gamma(r) * np.linalg.norm(np.abs(p_hat64) @ np.abs(q64).T)
        )
        got_d = mean[start : start + rows * cols].reshape(rows, cols)
        assert np.linalg.norm(got_d - d64) <= dd, name
        plain = [x64[m, start : start + rows * cols].reshape(rows, cols) for m in range(R)]
        uniform = power_iteration64(plain, q0[name].double().numpy(), [True] * R)[3]
        assert np.linalg.norm(got_d - uniform) > 100 * dd, name
    exact = [
        i
        for i in range(mean.shape[0])
        if not any(s <= i < s + a * b for s, a, b in matrices(SHAPES).values())
    ]
    want = (w[:, None] * x64[:, exact]).sum(0)
    assert np.abs(mean[exact] - want).max() <= 2 * R * U32 * (w[:, None] * np.abs(x64[:, exact])).sum(0).max()


# -- real processes and resume (slow: each starts the entry) ----------------------------------------------

# R = 4 on documents, H = 4 with two fragments (a sync every 2 updates), each reduction in flight a whole
# period (delayed), top-k with error feedback, token-weighted
WHOLE = [*QUICK, "logger=none", *DOCUMENTS, "replicas=4", "inner.H=4", "phase.updates=12",
         "outer.mean_weights=tokens", "outer.fragments=2", "outer.overlap=delayed", "outer.compress=topk",
         "outer.topk.fraction=0.25", "outer.error_feedback=true"]  # fmt: skip
MEASURED = ("comm_measured_inner_bytes", "comm_measured_outer_bytes")


@pytest.mark.slow
def test_torchrun_two_processes_equal_the_simulation_bitwise(tmp_path):
    """torchrun, 2 processes of two replicas each (the replicas layout), against the one-process
    simulation: every process decodes every payload and sums them weighted in replica order, with the
    weights every process computes from the plan, so every update and sync row (but the bytes only real
    processes measure), the held-out losses, the summary and weights.pt are the same, exactly."""
    sim, real = tmp_path / "sim", tmp_path / "dist"
    done = entry([*WHOLE, f"hydra.run.dir={sim}"], tmp_path)
    assert done.returncode == 0, done.stderr
    done = entry([*WHOLE, "processes=dist", f"hydra.run.dir={real}"], tmp_path, torchrun=2)
    assert done.returncode == 0, done.stderr
    assert OmegaConf.load(real / "config.yaml").processes.layout == "replicas"
    assert_identical_streaming(real, sim, skip=MEASURED)


@pytest.mark.slow
def test_killed_mid_round_with_reductions_in_flight_resumes_bit_identically(tmp_path):
    """SIGKILL after update 7, the newest checkpoint at 6 (mid-round; fragment 0's reduction taken at 6
    and fragment 1's at 4 in flight, stored as taken with their windows' token weights): resume=true
    equals the uninterrupted run exactly."""
    args = [*WHOLE, "checkpoint.every_updates=3"]
    run_dir, reference = killed_beside_uninterrupted(args, tmp_path, "0:7:kill:after")
    saved = torch.load(ckpt(run_dir, 6), weights_only=False)["state"]["in_flight"]
    assert sorted(x["taken_at"] for x in saved) == [4, 6]
    assert all(x["weights"].sum() == pytest.approx(1.0) for x in saved)
    resumed(args, run_dir, tmp_path)
    assert_identical_streaming(run_dir, reference)
