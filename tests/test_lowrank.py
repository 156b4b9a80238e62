"""Low-rank pseudo-gradients, outer.compress=lowrank (issue 37, item 4; docs/compression.md, "Low rank";
PowerSGD, Vogels, Karimireddy, Jaggi 2019, arXiv 1905.13727, Algorithm 1): the reduction fed chosen
inputs, against float64 references written here from the paper's algorithm, and whole runs.

1. One sync's P (the replicas' P_m = M_m Q summed over their count, orthogonalized), Q (the mean of the
   Q_m = M_m^T P) and decoded mean P Q^T against a float64 power iteration on the same inputs, the
   warm start carried from sync to sync; the 1-D tensors' exact mean; the error buffers.
2. Deliberately broken variants (P not orthogonalized; the warm start not kept) are caught.
3. Error feedback telescopes: after K syncs, for every replica and every matrix, what was applied plus
   the replica's buffer is the sum of its pseudo-gradients; a replica that did not step keeps its buffer.
4. rank = min(rows, cols) recovers the mean exactly within rounding, whatever P's condition (P is
   orthonormalized by a Householder QR: issue 48), the benchmark layout's real processes too; a matrix
   that did not move gives zeros and keeps its warm start; a non-finite pseudo-gradient stops the sync
   before anything is sent.
5. loop = stacked (each against the float64 run of the same code); the stage on real processes (gloo,
   P = 2 and 4, both layouts) equals the simulation bitwise, the bytes handed to the collectives the
   formula's; whole runs on 2 real processes equal the simulation exactly (fragments with a delay too);
   SIGKILL + resume is bit-identical with the warm starts and error buffers in the checkpoint (and a
   fragment's low-rank sync in flight).

Every bound is derived where it is used: gamma(k) = k u / (1 - k u) bounds the rounding of k fp32
operations in sequence (Higham, "Accuracy and Stability of Numerical Algorithms", Lemma 3.1 and
eq. 3.5 for a dot product: |fl(x . y) - x . y| <= gamma(len) |x| . |y|).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    DIST,
    RUN,
    assert_engines_agree,
    assert_identical_but,
    assert_identical_streaming,
    cfg_for,
    ckpt,
    compose_cfg,
    finish,
    fork_ranks,
    killed_beside_uninterrupted,
    resumed,
    rounding_floors,
    simulate,
    simulated_beside,
    start_entry,
)
from references import ROUNDING_FACTOR, U32, assert_losses_within_rounding, assert_within_rounding

from hypertrain.config import LowRankConfig, OuterConfig
from hypertrain.diloco import sync as sync_module
from hypertrain.diloco.exchange import lowrank
from hypertrain.diloco.exchange.communication import HEADER_BYTES
from hypertrain.diloco.exchange.lowrank import Factors, initial_q, lowrank_mean
from hypertrain.distributed.groups import ReplicaGroups
from hypertrain.failures import NonFiniteError
from hypertrain.rundir.records import read_metrics

REPO = Path(__file__).resolve().parents[1]

# A fragment's parameters: matrices (one of three dims, [4, 6] as PowerSGD sees it), 1-D tensors between.
SHAPES = {"w": (12, 9), "b": (9,), "c": (4, 2, 3), "e": (20, 6), "g": (6,)}
RANK = 3


def gamma(k: int) -> float:
    return k * U32 / (1 - k * U32)


def matrices(shapes: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (flat start, rows, cols) of each tensor of 2 or more dims, [shape[0], rest]."""
    out, start = {}, 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if len(shape) >= 2:
            out[name] = (start, shape[0], numel // shape[0])
        start += numel
    return out


def exact_spans(shapes: dict) -> list[tuple[int, int]]:
    out, start = [], 0
    for shape in shapes.values():
        numel = math.prod(shape)
        if len(shape) < 2:
            out.append((start, numel))
        start += numel
    return out


def inputs(R: int, seed: int, shapes: dict = SHAPES, ef: bool = True):
    """Pseudo-gradients [R, n] and error buffers (None without error feedback), seeded, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(math.prod(s) for s in shapes.values())
    deltas = torch.randn(R, n, generator=gen)
    errors = torch.randn(R, n, generator=gen) / 8 if ef else None
    return deltas, errors


def warm_starts(shapes: dict, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return initial_q({n: torch.empty(s) for n, s in shapes.items()}, rank, seed)


def one_sync(shapes, rank, deltas, errors, active, q, groups=None):
    """The stage, in this process (the simulation): the reduction object after its wait."""
    groups = groups or ReplicaGroups(deltas.shape[0])
    reduction = lowrank_mean(Factors.of(shapes, rank), deltas, errors, torch.tensor(active), q, groups)
    result = reduction.wait()
    return reduction, result


# -- the float64 reference, from the paper ----------------------------------------------------------------


def orthonormal64(p: np.ndarray) -> np.ndarray:
    """Gram-Schmidt's orthonormal columns of p, float64: the Q factor of p's QR with R's diagonal
    positive (the factorisation Gram-Schmidt computes), from numpy's Householder QR."""
    q, r = np.linalg.qr(p)
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def power_iteration64(ms: list[np.ndarray], q0: np.ndarray, active: list[bool]):
    """Algorithm 1 in float64 over the replicas that took part: P = mean M_m Q0, P orthonormalized,
    Q = mean M_m^T P, decoded P Q^T."""
    took = [m for m, a in zip(ms, active, strict=True) if a]
    p = sum(m @ q0 for m in took) / len(took)
    p_hat = orthonormal64(p)
    q = sum(m.T @ p_hat for m in took) / len(took)
    return p, p_hat, q, p_hat @ q.T


def check_sync(
    shapes, rank, deltas, errors_before, active, q_before, reduction, result, q_after, errors_after
):
    """One sync of the stage against the float64 reference on its inputs (the fp32 pseudo-gradients and
    buffers, the warm start it was handed); AssertionError naming what is off. The bounds:

    - M_m = fl(delta_m + e_m) is within U32 |M_m| of the exact sum; each P_m entry is a dot product of
      length cols (gamma(cols)), the replicas' sum and the division add R + 1 roundings: elementwise
      |P32 - P64| <= gamma(cols + R + 2) mean_m |M_m| |Q0|;
    - P orthonormalized: to first order the Q factor of A + dA moves by at most sqrt(2) ||A^+||_2 ||dA||_F
      (the normwise perturbation bound of the QR factorization's Q factor: Sun 1991, "Perturbation bounds
      for the Cholesky and QR factorizations"), dA being the input's error above plus the Householder
      QR's own backward error, gamma(rows r) ||A||_F (Higham, "Accuracy and Stability of Numerical
      Algorithms", Thm 19.4; gamma(2 rows r) here); twice that for the second-order terms;
    - Q_m = M_m^T P: ||dQ||_F <= mean_m (||M_m||_F ||dP||_F + gamma(rows + R + 2) || |M_m|^T |P| ||_F);
    - P Q^T: ||dD||_F <= ||dP||_F ||Q||_F + (1 + ||dP||_F) ||dQ||_F + gamma(r) || |P| |Q|^T ||_F.
    """
    R = deltas.shape[0]
    x64 = deltas.double().numpy() + (0 if errors_before is None else errors_before.double().numpy())
    took = [m for m in range(R) if active[m]]
    mean = result.mean.double().numpy()
    bounds_d = {}
    delta64 = deltas.double().numpy()
    # each replica's compression error ||P Q_m^T - delta_m|| / ||delta_m|| (its own contribution's
    # residual): the float64 squares and the bound of the fp32 one, summed over the matrices
    residual2, residual_bound = [0.0] * R, [0.0] * R
    for name, (start, rows, cols) in matrices(shapes).items():
        ms = [x64[m, start : start + rows * cols].reshape(rows, cols) for m in range(R)]
        q0 = q_before[name].double().numpy()
        p64, p_hat64, q64, d64 = power_iteration64(ms, q0, active)
        r = q0.shape[1]
        assert r == min(rank, rows, cols), name
        abs_p = sum(np.abs(ms[m]) @ np.abs(q0) for m in took) / len(took)
        dp_input = float(np.linalg.norm(gamma(cols + R + 2) * abs_p))
        a_plus = 1 / np.linalg.svd(p64, compute_uv=False)[-1]
        dp = 2 * math.sqrt(2) * a_plus * (dp_input + gamma(2 * rows * r) * np.linalg.norm(p64))
        got_p = reduction.p_hat[name].double().numpy()
        assert np.linalg.norm(got_p - p_hat64) <= dp, (name, "P", np.linalg.norm(got_p - p_hat64), dp)
        dq = sum(
            np.linalg.norm(ms[m]) * dp
            + gamma(rows + R + 2) * np.linalg.norm(np.abs(ms[m]).T @ np.abs(p_hat64))
            for m in took
        ) / len(took)
        got_q = q_after[name].double().numpy()
        assert np.linalg.norm(got_q - q64) <= dq, (name, "Q", np.linalg.norm(got_q - q64), dq)
        dd = (
            dp * np.linalg.norm(q64)
            + (1 + dp) * dq
            + gamma(r) * np.linalg.norm(np.abs(p_hat64) @ np.abs(q64).T)
        )
        got_d = mean[start : start + rows * cols].reshape(rows, cols)
        assert np.linalg.norm(got_d - d64) <= dd, (name, "PQ^T", np.linalg.norm(got_d - d64), dd)
        bounds_d[name] = (d64, dd)
        for m in took:  # Q_m = M_m^T P and P Q_m^T - delta_m: the bounds above for one replica, and the
            q_m = ms[m].T @ p_hat64  # fp32 subtraction's rounding (U32 of the residual)
            own = p_hat64 @ q_m.T - delta64[m, start : start + rows * cols].reshape(rows, cols)
            residual2[m] += float(np.linalg.norm(own)) ** 2
            abs_mp = np.abs(ms[m]).T @ np.abs(p_hat64)
            dq_m = np.linalg.norm(ms[m]) * dp + gamma(rows) * np.linalg.norm(abs_mp)
            residual_bound[m] += (
                dp * np.linalg.norm(q_m)
                + (1 + dp) * dq_m
                + gamma(r) * np.linalg.norm(np.abs(p_hat64) @ np.abs(q_m).T)
                + U32 * np.linalg.norm(own)
            )
    # the 1-D tensors: sent exact, their mean added in replica order and divided, in fp32 (bitwise)
    x32 = deltas if errors_before is None else deltas + errors_before
    for a, n in exact_spans(shapes):
        total = torch.zeros(n)
        for m in took:
            total = total + x32[m, a : a + n]
        assert torch.equal(result.mean[a : a + n], total / len(took)), ("1-D", a)
    assert result.synced == len(took)
    for m in range(R):  # the 1-D tensors' residual: x - delta (e, or 0), one fp32 rounding of |x| each
        if not active[m]:
            assert result.compress_error[m] is None, ("error of one not there", m)
            continue
        for a, n in exact_spans(shapes):
            residual2[m] += float(np.linalg.norm(x64[m, a : a + n] - delta64[m, a : a + n])) ** 2
            residual_bound[m] += U32 * float(np.linalg.norm(x64[m, a : a + n]))
        norm = float(np.linalg.norm(delta64[m]))
        want = math.sqrt(residual2[m]) / norm
        bound = residual_bound[m] / norm + 2 * U32 * want  # and the header's fp32 rounding of it
        assert abs(result.compress_error[m] - want) <= bound, ("compress error", m, want, bound)
    if errors_after is None:
        return
    # e_m <- M_m - P Q^T (the shared approximation) for the replicas that took part; 1-D buffers 0
    for m in range(R):
        if not active[m]:
            assert torch.equal(errors_after[m], errors_before[m]), ("kept", m)
            continue
        for name, (start, rows, cols) in matrices(shapes).items():
            d64, dd = bounds_d[name]
            want = x64[m, start : start + rows * cols].reshape(rows, cols) - d64
            got = errors_after[m, start : start + rows * cols].double().numpy().reshape(rows, cols)
            # the fp32 subtraction rounds once more (U32 |e|) beside D's error and M's rounding
            bound = (
                dd + U32 * np.linalg.norm(want) + U32 * np.linalg.norm(x64[m, start : start + rows * cols])
            )
            assert np.linalg.norm(got - want) <= 2 * bound, ("error buffer", m, name)
        for a, n in exact_spans(shapes):
            assert not errors_after[m, a : a + n].any(), ("1-D buffer", m, a)


def run_and_check(syncs: int = 3, keep_warm_start: bool = True, R: int = 3):
    """`syncs` syncs of the stage, each checked against the float64 reference from the warm start the
    previous one left (the first: the seeded initial Q); replica 1 sits the second sync out. Returns the
    largest fraction of a bound used. `keep_warm_start=False` is a broken variant: every sync starts
    from the initial Q again, as a reducer that forgot its state would."""
    q = warm_starts(SHAPES, RANK)
    initial = {n: t.clone() for n, t in q.items()}
    _, errors = inputs(R, 0)
    carried = {n: t.clone() for n, t in q.items()}  # the warm start the reference starts from
    for k in range(syncs):
        deltas, _ = inputs(R, 1 + k)
        active = [not (k == 1 and m == 1) for m in range(R)]
        before_e = errors.clone()
        reduction, result = one_sync(SHAPES, RANK, deltas, errors, active, q)
        check_sync(SHAPES, RANK, deltas, before_e, active, carried, reduction, result, q, errors)
        # the Q of this sync, checked against the reference above, is the next sync's warm start
        carried = {n: t.clone() for n, t in q.items()}
        if not keep_warm_start:
            for n, t in q.items():
                t.copy_(initial[n])


def test_one_sync_equals_a_float64_power_iteration_with_the_warm_start_carried():
    """Three syncs of R = 3 replicas (one sits the second out) of two matrices, a tensor of three dims
    and two 1-D tensors at rank 3, error feedback on: each sync's P, Q, decoded mean and buffers against
    the float64 Algorithm 1 from the warm start the previous sync left (`check_sync`'s bounds); the 1-D
    tensors' mean bitwise the fp32 sum in replica order over the count."""
    run_and_check()


def test_a_broken_variant_is_caught():
    """The same check fails for P left unorthogonalized (ORTHOGONALIZE skipped) and for a reduction that
    does not keep its warm start between syncs: the checks are not vacuous."""
    original = lowrank.orthogonalize
    try:
        lowrank.orthogonalize = lambda p: p.clone()
        with pytest.raises(AssertionError, match="'P'"):
            run_and_check(syncs=1)
    finally:
        lowrank.orthogonalize = original
    with pytest.raises(AssertionError, match="'P'"):
        run_and_check(syncs=2, keep_warm_start=False)


def test_error_feedback_telescopes_over_syncs():
    """Invariant 10's error feedback, PowerSGD's form (Algorithm 2, e_m <- Delta_m - DECOMPRESS): after K
    syncs each replica's pseudo-gradients summed equal what was applied (the decoded means) plus its
    buffer, for every matrix entry (sum_k delta_m(k) = sum_k D(k) + e_m(K), e_m(0) = 0), within
    the fp32 roundings: each sync forms x = delta + e (one rounding, U32 |x|) and e' = x - D (one, U32
    |e'|); the sums here are float64 (exact enough: K terms, gamma(K) in float64). A replica that did not
    step (replica 1 at the second sync) keeps its buffer and has its pseudo-gradient left out of its sum."""
    R, K = 3, 6
    q = warm_starts(SHAPES, 2)
    n = sum(math.prod(s) for s in SHAPES.values())
    errors = torch.zeros(R, n)
    sent = torch.zeros(R, n, dtype=torch.float64)
    applied = torch.zeros(R, n, dtype=torch.float64)
    slack = torch.zeros(R, n, dtype=torch.float64)
    for k in range(K):
        deltas, _ = inputs(R, 10 + k)
        active = [not (k == 1 and m == 1) for m in range(R)]
        x = deltas + errors
        _, result = one_sync(SHAPES, 2, deltas, errors, active, q)
        for m in range(R):
            if active[m]:
                sent[m] += deltas[m].double()
                applied[m] += result.mean.double()
                slack[m] += U32 * (x[m].double().abs() + errors[m].double().abs())
    for name, (start, rows, cols) in matrices(SHAPES).items():
        span = slice(start, start + rows * cols)
        gap = (sent[:, span] - applied[:, span] - errors[:, span].double()).abs()
        assert (gap <= 2 * slack[:, span]).all(), (name, float((gap / slack[:, span]).max()))
        assert errors[:, span].abs().max() > 0.1  # rank 2 leaves a good part in the buffers
    for a, size in exact_spans(SHAPES):
        assert not errors[:, a : a + size].any()


def test_rank_min_rows_cols_recovers_the_mean_exactly_within_rounding():
    """At rank = min(rows, cols) P spans M's whole column space, so P Q^T = P P^T mean(M) = mean(M): the
    float64 reference recovers it within its rounding bound (checked), and the stage is within
    `check_sync`'s bound of the reference, so within that bound of the mean itself, for a wide matrix, a
    tall one and one of three dims; outer.lowrank.rank larger than both is cut to min(rows, cols)."""
    shapes = {"wide": (5, 8), "tall": (8, 3), "deep": (4, 2, 3), "b": (3,)}
    R = 2
    deltas, _ = inputs(R, 7, shapes, ef=False)
    q = warm_starts(shapes, 99)
    assert {n: tuple(t.shape) for n, t in q.items()} == {"wide": (8, 5), "tall": (3, 3), "deep": (6, 4)}
    before = {n: t.clone() for n, t in q.items()}
    reduction, result = one_sync(shapes, 99, deltas, None, [True, True], q)
    check_sync(shapes, 99, deltas, None, [True, True], before, reduction, result, q, None)
    for name, (start, rows, cols) in matrices(shapes).items():
        span = slice(start, start + rows * cols)
        want = deltas[:, span].double().mean(0).numpy().reshape(rows, cols)
        ms = [deltas[m, span].double().numpy().reshape(rows, cols) for m in range(R)]
        p64, *_, d64 = power_iteration64(ms, before[name].double().numpy(), [True, True])
        # float64: numpy's Householder QR (the reference's) is backward stable, its P's span within about
        # eps64 * cond(P) of P's, and P P^T M adds two products of length rows and cols: within
        # 4 (rows + cols) eps64 cond(P) ||M||
        eps64 = 2.0**-53
        bound = 4 * (rows + cols) * eps64 * np.linalg.cond(p64) * np.linalg.norm(want)
        assert np.linalg.norm(d64 - want) <= bound, name


# -- full rank: P orthonormal whatever its condition (issue 48, item 6) -----------------------------------


def householder_theta(rows: int, r: int) -> float:
    """A bound on ||P^T P - I||_2 for orthogonalize's fp32 P [rows, r]: Householder QR's computed Q is
    within sqrt(r) g (Frobenius) of an exactly orthonormal Q, g = gamma(rows r) (Higham, "Accuracy and
    Stability of Numerical Algorithms", Thm 19.4, its constant c taken as 1), so ||P^T P - I||_2 <=
    2 sqrt(r) g + r g^2. The sign flips are exact."""
    g = gamma(rows * r)
    return 2 * math.sqrt(r) * g + r * g * g


def full_rank_bound(ms: list[np.ndarray], q0: np.ndarray) -> float:
    """How far (Frobenius) the stage's decoded mean may be from mean(M) at r = min(rows, cols), where
    PowerSGD is exact in exact arithmetic. `ms`: the fp32 inputs M_m of the replicas that took part,
    `q0` the fp32 warm start, both as float64. With P-hat the computed orthonormal P, Pi the projection on
    the exactly orthonormal Q of Thm 19.4 (whose QR is that of P + dA, ||dA||_F <= g ||P||_F) and
    theta = `householder_theta`: decoded - mean(M) = (P-hat P-hat^T - Pi) mean(M) + (Pi - I) mean(M) +
    the products' rounding, so the bound is the sum of
    - theta ||mean(M)||_F;
    - for a tall matrix (r = cols < rows; a wide or square one's Pi is I): P = mean(M) Q0 + E, |E| <=
      gamma(cols + R) mean_m |M_m| |Q0| (each P_m a product of length cols, then R - 1 sums and the
      division), and (I - Pi)(P + dA) = 0, so ||(I - Pi) mean(M)||_F <= (||E||_F + ||dA||_F) ||Q0^-1||_2:
      PowerSGD reaches a tall matrix's columns through Q0, so its rounding is amplified by cond(Q0), in
      every fp32 path alike;
    - Q = mean_m M_m^T P-hat, rows + R roundings: ||dQ||_F <= gamma(rows + R) mean_m ||M_m||_F ||P-hat||_F,
      entering as ||P-hat||_2 ||dQ||_F; the product P-hat Q^T, r terms: gamma(r) ||P-hat||_F ||Q||_F;
      ||P-hat||_2 <= 1 + theta, ||P-hat||_F <= sqrt(r) (1 + theta)."""
    R, (rows, cols) = len(ms), ms[0].shape
    r = min(rows, cols)
    assert q0.shape == (cols, r)
    mean = sum(ms) / R
    theta = householder_theta(rows, r)
    bound = theta * np.linalg.norm(mean)
    if r < rows:
        e = gamma(cols + R) * np.linalg.norm(sum(np.abs(m) @ np.abs(q0) for m in ms) / R)
        da = gamma(rows * r) * (np.linalg.norm(mean @ q0) + e)
        bound += (e + da) / np.linalg.svd(q0, compute_uv=False)[-1]
    p_2, p_f = 1 + theta, math.sqrt(r) * (1 + theta)
    dq = gamma(rows + R) * sum(np.linalg.norm(m) for m in ms) / R * p_f
    return bound + p_2 * dq + gamma(r) * p_f * (p_2 * np.linalg.norm(mean) + dq)


def conditioned(rows: int, cols: int, rank: int, cond: float, gen: torch.Generator) -> torch.Tensor:
    """A [rows, cols] fp32 matrix of `rank` singular values spaced geometrically from 1 down to 1 / cond
    (random singular vectors): ill conditioned, or rank deficient when rank < min(rows, cols)."""
    u, _ = torch.linalg.qr(torch.randn(rows, rank, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, rank, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -math.log10(cond), rank, dtype=torch.float64)
    return ((u * s) @ v.t()).float()


def test_orthogonalize_keeps_the_columns_orthonormal_whatever_the_condition():
    """P [rows, r] of condition 1e7, rank deficient (rank 8 of 32, as a matrix whose rows are mostly zero
    gives), square, and all zero (a matrix that did not move): the columns are orthonormal within
    `householder_theta` and span P's (P-hat P-hat^T P = P within 3 theta ||P|| and the two products'
    rounding). fp32 Gram-Schmidt loses orthogonality by about u cond(P) (Bjorck 1967): O(1) on all but
    the zero one. (Its signs, Gram-Schmidt's, where P is well conditioned: `check_sync`.)"""
    gen = torch.Generator().manual_seed(48)
    cases = {
        "cond 1e7": conditioned(96, 32, 32, 1e7, gen),
        "rank 8 of 32": conditioned(48, 32, 8, 10.0, gen),
        "square cond 1e6": conditioned(32, 32, 32, 1e6, gen),
        "zero": torch.zeros(16, 8),
    }
    for name, p in cases.items():
        rows, r = p.shape
        got = lowrank.orthogonalize(p.clone()).double()
        theta = householder_theta(rows, r)
        gram = got.t() @ got - torch.eye(r, dtype=torch.float64)
        assert float(torch.linalg.matrix_norm(gram, ord=2)) <= theta, name
        back = got @ (got.t() @ p.double()) - p.double()
        assert float(back.norm()) <= (3 * theta + 2 * gamma(rows + r)) * float(p.norm()), name


def test_full_rank_recovers_the_mean_within_the_derived_bound_whatever_the_condition():
    """rank >= every side: the stage's decoded mean of R = 2 replicas' ill-conditioned matrices (wide,
    square, tall, condition 1e6; one of rank 4 of 24) is mean(M) within `full_rank_bound`, at the first
    sync (the drawn Q0) and the next (warm-started from the first's Q, as ill conditioned as the mean:
    the tall matrix's bound grows with it); so is one worker's `power_step` and its decode (an
    asynchronous arrival, R = 1) from the same warm start. fp32 Gram-Schmidt left P P^T no projection
    here and missed the mean by O(1)."""
    gen = torch.Generator().manual_seed(6)
    shapes = {"wide": (24, 40), "square": (32, 32), "tall": (48, 16), "deficient": (24, 24), "b": (5,)}
    ranks = {"wide": 24, "square": 32, "tall": 16, "deficient": 4}
    factors, q = Factors.of(shapes, 64), warm_starts(shapes, 64)

    def replica() -> torch.Tensor:
        parts = [conditioned(*shapes[n], k, 1e6, gen).reshape(-1) for n, k in ranks.items()]
        return torch.cat([*parts, torch.randn(5, generator=gen)])

    for sync in range(2):
        q0 = {n: t.clone() for n, t in q.items()}  # this sync's warm start (the sync moves q)
        deltas = torch.stack([replica(), replica()])
        _, result = one_sync(shapes, 64, deltas, None, [True, True], q)
        worker_q = {n: t.clone() for n, t in q0.items()}
        alone = lowrank.from_power_step(factors, lowrank.power_step(factors, deltas[0], worker_q), worker_q)
        for name, (start, rows, cols) in matrices(shapes).items():
            span = slice(start, start + rows * cols)
            ms = [deltas[m, span].double().numpy().reshape(rows, cols) for m in range(2)]
            warm = q0[name].double().numpy()
            got = result.mean[span].double().numpy().reshape(rows, cols)
            assert np.linalg.norm(got - sum(ms) / 2) <= full_rank_bound(ms, warm), (sync, name, "sync")
            worker = alone[span].double().numpy().reshape(rows, cols)
            assert np.linalg.norm(worker - ms[0]) <= full_rank_bound(ms[:1], warm), (sync, name, "worker")


def test_a_matrix_that_did_not_move_gives_zeros_and_keeps_its_warm_start():
    """An all-zero pseudo-gradient (a sync where nothing moved) gives a zero mean, no NaN (P = 0 gets
    orthonormal columns, and M^T P = 0), and every warm start unchanged (a Q that came back zero would
    hold the power iteration at zero for good); the next sync, with movement, is the float64 power
    iteration from that same warm start."""
    R = 2
    q = warm_starts(SHAPES, RANK)
    kept = {n: t.clone() for n, t in q.items()}
    deltas, _ = inputs(R, 5, ef=False)
    _, result = one_sync(SHAPES, RANK, torch.zeros_like(deltas), None, [True, True], q)
    assert torch.equal(result.mean, torch.zeros_like(result.mean))
    assert all(torch.equal(q[n], kept[n]) for n in q)
    reduction, result = one_sync(SHAPES, RANK, deltas, None, [True, True], q)
    check_sync(SHAPES, RANK, deltas, None, [True, True], kept, reduction, result, q, None)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_pseudo_gradient_stops_the_sync_before_anything_is_sent(bad):
    """A non-finite entry of a replica that took part stops the sync (NonFiniteError naming the replica)
    before any message is handed to the collectives; the same entry in a replica that did not step is
    left out, and the sync goes on."""
    R = 3
    deltas, _ = inputs(R, 6, ef=False)
    deltas[2, 5] = bad

    class Spy(ReplicaGroups):
        gathered = 0

        def start_all_gather_replicas(self, local):
            Spy.gathered += 1
            return super().start_all_gather_replicas(local)

    q = warm_starts(SHAPES, RANK)
    with pytest.raises(NonFiniteError, match="replica 2"):
        lowrank_mean(Factors.of(SHAPES, RANK), deltas, None, torch.tensor([True] * 3), q, Spy(R))
    assert Spy.gathered == 0
    _, result = one_sync(SHAPES, RANK, deltas, None, [True, True, False], q, Spy(R))
    assert result.synced == 2 and bool(torch.isfinite(result.mean).all())


# -- whole runs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ef, churn", [(False, False), (True, False), (True, True)])
def test_loop_equals_stacked(ef, churn):
    """Invariant 6 with low rank: the stacked engine and the loop, each against the float64 run of the
    same code (`assert_engines_agree`: losses and final weights within twice the loop's own error or its
    rounding floor), R = 2, H = 2, two syncs at rank 2, with and without error feedback, and with churn
    (replica 1 misses round 2: the second sync is replica 0's alone). The stage itself is the same
    function whatever engine made the pseudo-gradients."""
    outer = OuterConfig(compress="lowrank", lowrank=LowRankConfig(rank=2), error_feedback=ef)
    cfg = replace(cfg_for(2, 2), outer=outer)
    if churn:
        cfg = replace(cfg, churn=replace(cfg.churn, events=["2:1:miss"]))
    assert_engines_agree(cfg)


# -- real processes ---------------------------------------------------------------------------------------

# (layout, W, R, error feedback, who took part at the second sync) per process count P: P = 2 under the
# replicas layout (one replica per process, two); P = 4 one replica per process, and the benchmark layout
# W = 4, R = 2 (L = 2: each of a replica's two ranks exchanges the factors in its cross-replica group)
STAGE_CASES = {
    2: [
        ("replicas", 2, 2, True, (True, True)),
        ("replicas", 4, 4, True, (True, False, True, True)),
        ("replicas", 4, 4, False, (True,) * 4),
    ],
    4: [("replicas", 4, 4, True, (True, False, True, True)), ("benchmark", 4, 2, True, (False, True))],
}
STAGE_SYNCS = 2


def stage_results(groups, R: int, ef: bool, active2: tuple[bool, ...], mine: list[int]) -> dict:
    """Two syncs of the stage on this process's replicas `mine` of bitwise-identical inputs: each one's
    mean, count and figures, and the warm starts and buffers after."""
    q = warm_starts(SHAPES, RANK)
    _, errors = inputs(R, 20, ef=ef)
    local = None if errors is None else errors[mine].clone()
    out = []
    for k in range(STAGE_SYNCS):
        deltas, _ = inputs(R, 21 + k)
        active = (True,) * R if k == 0 else active2
        reduction = lowrank_mean(
            Factors.of(SHAPES, RANK), deltas[mine].clone(), local, torch.tensor(active)[mine], q, groups
        )
        result = reduction.wait()
        out.append({"mean": result.mean, "synced": result.synced, "figures": result.figures})
    return {"syncs": out, "q": q, "errors": local}


def stage_worker(rank: int, world: int, out: Path) -> None:
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
    for case in STAGE_CASES[world]:
        layout, W, R, ef, active2 = case
        if (layout, W, R) not in built:
            plan = choose_layout(world, W, R, layout)
            built[layout, W, R] = DistReplicaGroups(plan, rank, torch.device("cpu"), 60.0)
        groups = built[layout, W, R]
        key = str(case)
        results[key] = stage_results(groups, R, ef, active2, groups.replicas)
        results[key]["replicas"] = groups.replicas
        results[key]["handed"] = groups.comm_stats()["comm_measured_outer_bytes"]
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("world", [2, 4])
def test_real_processes_equal_the_simulation_bitwise_and_send_the_formula(tmp_path, world):
    """`world` real processes (gloo, forked ranks; P = 2 under the replicas layout: R = 2, one replica
    each, R = 4, two each; P = 4: R = 4, and the benchmark layout W = 4, R = 2, L = 2) run two syncs of
    the stage on bitwise-identical inputs, error feedback on and off, a replica sitting the second sync
    out: every rank's means, counts, figures (payload bytes, the gather's bytes,
    per-replica errors), warm starts and buffers equal the simulation's (`ReplicaGroups`, all replicas
    here), bitwise (== on the bit patterns): every process sums the same gathered factors in replica
    order, and each replica's factors are computed alone, the same way wherever it lives.

    The payload is the formula (docs/compression.md): 4 (rows r + cols r) per matrix + 4 per 1-D element;
    each process handed the collectives, per sync, its replicas' two messages: the 8 header bytes and
    the payload."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "stage", str(world), str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        simulated = {
            str(case): stage_results(ReplicaGroups(case[2]), *case[2:], list(range(case[2])))
            for case in STAGE_CASES[world]
        }
        _, err = proc.communicate(timeout=120)  # gloo's timeout is 60 s
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the ranks this test started
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    b = 4 * (12 * 3 + 9 * 3) + 4 * (4 * 3 + 6 * 3) + 4 * (20 * 3 + 6 * 3) + 4 * (9 + 6)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for case in STAGE_CASES[world]:
            _, _, R, ef, _ = case
            key = str(case)
            have, want, mine = got[key], simulated[key], got[key]["replicas"]
            for k, (h, w) in enumerate(zip(have["syncs"], want["syncs"], strict=True)):
                assert torch.equal(bits(h["mean"]), bits(w["mean"])), (rank, key, k)
                assert h["synced"] == w["synced"] and h["figures"] == w["figures"], (rank, key, k)
                assert w["figures"]["payload_bytes"] == b and w["figures"]["comm_outer_bytes"] == (R - 1) * b
            for n in want["q"]:
                assert torch.equal(bits(have["q"][n]), bits(want["q"][n])), (rank, key, n)
            if ef:
                assert torch.equal(bits(have["errors"]), bits(want["errors"][mine])), (rank, key)
            assert have["handed"] == STAGE_SYNCS * len(mine) * (HEADER_BYTES + b), (rank, key)


# Whole runs through the entry, W = R = 2 under the benchmark layout, the loop engine: one replica per
# process computed by the same code on the same numbers as in the simulation (test_compression.py's
# WHOLE), so the runs are equal, ==. Fragments (H = 4, P = 2) taken one update early: each fragment's
# first all-gather is in flight over the delayed update, its second at the landing.
WHOLE = [*RUN, "engine=loop", "world=2", "replicas=2", "outer.compress=lowrank", "outer.lowrank.rank=2"]
MEASURED = ("comm_measured_inner_bytes", "comm_measured_outer_bytes")


@pytest.mark.parametrize(
    "extra",
    [
        ["outer.error_feedback=true", "inner.H=2", "phase.updates=4"],
        pytest.param(
            ["inner.H=4", "phase.updates=8", "outer.fragments=2", "outer.delay=1"], marks=pytest.mark.slow
        ),
        # churn: replica 1 misses round 2 (its flag 0 in both gathers: the sync at 4 is replica 0's alone)
        pytest.param(
            ["outer.error_feedback=true", "inner.H=2", "phase.updates=6", "churn.events=[2:1:miss]"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["ef", "fragments2-delay1", "churn-miss"],
)
def test_real_processes_equal_the_simulation_exactly_in_whole_runs(tmp_path, extra):
    """`processes=dist` (two self-launched gloo workers) against the simulation of the same overrides,
    side by side through the entry: every update row, every sync row (payload bytes, per-replica errors;
    not the measured figures only real processes record), the held-out losses, the summary and
    weights.pt, exactly. Without fragments the bytes handed to the collectives at each sync are the two
    messages' 8 header bytes and the payload."""
    runs = {"sim": [*WHOLE, *extra], "dist": [*WHOLE, *extra, "processes=dist"]}
    procs = {k: start_entry([*args, f"hydra.run.dir={tmp_path / k}"], tmp_path) for k, args in runs.items()}
    done = {k: finish(p) for k, p in procs.items()}
    for k, result in done.items():
        assert result.returncode == 0, (k, result.stderr)
    if "outer.fragments=2" in extra:
        assert_identical_streaming(tmp_path / "dist", tmp_path / "sim", skip=MEASURED)
        return
    assert_identical_but(tmp_path / "dist", tmp_path / "sim", skip=MEASURED)
    syncs = [r for r in read_metrics(tmp_path / "dist" / "metrics.jsonl") if r["kind"] == "sync"]
    assert syncs and all(len(r["compress_error"]) == 2 for r in syncs)
    if any("churn" in a for a in extra):  # the miss: one contributor, its error alone, its bits alone
        missed = [r for r in syncs if r["update"] == 4]
        assert missed and missed[0]["replicas_synced"] == 1 and missed[0]["compress_error"][1] is None
        assert missed[0]["bits_per_param"][1] is None
    assert all(r["comm_measured_outer_bytes"] == HEADER_BYTES + r["payload_bytes"] for r in syncs), syncs


# Full rank in the benchmark layout (issue 48, item 6): W = 4 processes, R = 2 replicas of L = 2 ranks each
# (a replica's gradient the average of its two ranks', so its weights are the simulation's within rounding,
# not bitwise); rank 32 = the width of QUICK's model, every matrix's smaller side; three syncs.
FULL_RANK = [*DIST, "world=4", "replicas=2", "inner.H=2", "phase.updates=6"]


@pytest.mark.slow
def test_full_rank_in_the_benchmark_layout_equals_the_simulation_within_rounding(tmp_path, monkeypatch):
    """Invariant 7 at full rank, real processes in the benchmark layout against the simulation, both
    against the float64 DiLoCo run (outer.compress=none): at r = min(rows, cols) PowerSGD is exact in
    exact arithmetic (`full_rank_bound`), so that run is both fp32 low-rank paths' reference.

    1. Each path against the other, test_dist's bound (invariant 7: the same arithmetic, the inner sums
       in another order): its losses', held-out losses' and final weights' error within twice the
       other's, or twice the rounding floor (`rounding_floors`, references.py).
    2. Each path's final weights within twice (fp32 DiLoCo's own error, or the floor, plus what the stage
       may add): every sync's decoded mean within `full_rank_bound` of the mean on the simulation's own
       inputs (recorded here), an error of the mean pseudo-gradient reaching the weights through the outer
       step with gain at most lr (1 + mu + mu^2 + ...) = lr / (1 - mu) (its share of this and every later
       update, torch.optim.SGD's momentum, Nesterov or not).
    fp32 Gram-Schmidt, which loses orthogonality by about u cond(P) (at full rank P is ill conditioned),
    failed both: real processes' wv 2.4 times the first bound, and weights up to 60 times the second."""
    full = [*FULL_RANK, "outer.compress=lowrank", "outer.lowrank.rank=32"]
    proc = start_entry([*full, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    diloco = compose_cfg([*FULL_RANK, "outer.compress=none"])
    batches, ref, diloco32, run = simulated_beside(proc, diloco)  # float64 and fp32 DiLoCo, here
    allowed: dict[str, float] = {}  # what the stage may add to each matrix, summed over the syncs

    def recorded(factors, deltas, errors, active, q, *args, **kwargs):
        for mat in factors.matrices:
            span = slice(mat.start, mat.start + mat.rows * mat.cols)
            ms = [
                deltas[m, span].double().numpy().reshape(mat.rows, mat.cols)
                for m in range(len(active))
                if active[m]
            ]
            bound = full_rank_bound(ms, q[mat.name].double().numpy())
            allowed[mat.name] = allowed.get(mat.name, 0.0) + bound
        return lowrank_mean(factors, deltas, errors, active, q, *args, **kwargs)

    monkeypatch.setattr(sync_module, "lowrank_mean", recorded)
    cfg = compose_cfg(full)
    try:
        sim = simulate(cfg)[:3]  # the low-rank simulation, fp32, the stage's inputs recorded
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    done = finish(proc)
    assert done.returncode == 0, done.stderr
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    weights = torch.load(tmp_path / "run" / "weights.pt")
    assert set(allowed) == {n for n, t in weights.items() if t.dim() >= 2}
    assert min(min(t.shape[0], t[0].numel()) for t in weights.values() if t.dim() >= 2) == 32
    syncs = [r for r in rows if r["kind"] == "sync"]
    assert len(syncs) == 3 and all(r["payload_bytes"] > 0 for r in syncs)
    evals = [r["eval_loss"] for r in rows if r["kind"] == "eval"] + [r["eval_loss"] for r in syncs]
    got = ([r["loss"] for r in rows if r["kind"] == "update"], evals, weights)
    loss_floor, weight_floor = rounding_floors(diloco, batches, len(ref[0]))
    heldout_floor = rounding_floors(diloco, [run.heldout], 1)[0]
    as_rows = lambda xs: [[x] for x in xs]  # noqa: E731
    gain = cfg.outer.lr / (1 - cfg.outer.momentum)
    used = {}
    for name, path, other in (("dist", got, sim), ("simulation", sim, got)):
        losses = assert_losses_within_rounding(path[0], other[0], ref[0], loss_floor)
        heldout = assert_losses_within_rounding(
            as_rows(path[1]), as_rows(other[1]), as_rows(ref[1]), heldout_floor
        )
        mutual = max(
            assert_within_rounding(path[2][n], other[2][n], t, weight_floor * float(t.norm()), n)
            for n, t in ref[2].items()
        )
        diloco_used = 0.0
        for n, t in ref[2].items():
            err, own = (float((w[n].double() - t).norm()) for w in (path[2], diloco32[2]))
            bound = ROUNDING_FACTOR * (max(own, weight_floor * float(t.norm())) + gain * allowed.get(n, 0.0))
            assert err <= bound, (name, n, err, bound)
            diloco_used = max(diloco_used, err / bound)
        used[name] = {
            "losses": losses,
            "held-out": heldout,
            "weights": mutual,
            "weights vs DiLoCo": diloco_used,
        }
    print("fraction of each bound used:", used)


# -- SIGKILL and resume -----------------------------------------------------------------------------------

# Syncs after updates 2, 4, 6 (H = 2); a checkpoint every 3 updates falls mid-round at 3, after the sync
# at 2 updated the warm starts and left what rank 2 did not send in the buffers. The fault kills after
# update 4's inner step, before its sync: the newest checkpoint is the one at 3.
KILL_RUN = [
    *RUN,
    "inner.H=2",
    "phase.updates=6",
    "outer.compress=lowrank",
    "outer.lowrank.rank=2",
    "outer.error_feedback=true",
    "checkpoint.every_updates=3",
    "checkpoint.keep=10",
]


# Fragments (H = 4, P = 2, tau = 1): fragment 1 is taken after update 3 and lands after 4, so the
# checkpoint at 3 holds its sync in flight (waited for: its result, the buffers and warm starts it
# updated); the kill after update 4's inner step, before that landing, leaves it the newest.
KILL_FRAGMENTS = [
    *RUN,
    "inner.H=4",
    "phase.updates=8",
    "outer.fragments=2",
    "outer.delay=1",
    "outer.compress=lowrank",
    "outer.lowrank.rank=2",
    "outer.error_feedback=true",
    "checkpoint.every_updates=3",
    "checkpoint.keep=10",
]
KILL_CASES = {
    "mid-round": (KILL_RUN, "0:4:kill:after"),
    "fragments-in-flight": (KILL_FRAGMENTS, "0:4:kill:after"),
    # churn: replica 1 misses round 2 (updates 3-4), the round the kill falls in
    "churn-miss": ([*KILL_RUN, "churn.events=[2:1:miss]"], "0:4:kill:after"),
}


@pytest.mark.parametrize(
    "name",
    [
        "mid-round",
        pytest.param("fragments-in-flight", marks=pytest.mark.slow),
        pytest.param("churn-miss", marks=pytest.mark.slow),
    ],
)
def test_killed_with_warm_starts_and_error_buffers_resumes_bit_identically(tmp_path, name):
    """Invariant 9 with low rank: SIGKILL after an inner step; the newest checkpoint (at 3) holds every
    matrix's warm start Q (moved from the seeded initial one by the syncs before it) and every replica's
    non-zero buffer (with fragments, a fragment's sync in flight too); `resume=true` goes on from it and
    equals an uninterrupted run exactly (update rows, sync rows with their payload bytes and errors,
    held-out losses, summary, weights.pt)."""
    args, fault = KILL_CASES[name]
    run_dir, reference = killed_beside_uninterrupted(args, tmp_path, fault)
    assert sorted((run_dir / "checkpoints").glob("ckpt-u*.pt"))[-1] == ckpt(run_dir, 3)
    saved = torch.load(ckpt(run_dir, 3), weights_only=False)["state"]
    assert saved["lowrank_q"] and all(any(bool(t.any()) for t in e.values()) for e in saved["errors"])
    drawn = initial_q(saved["theta"], 2, 0)
    assert set(drawn) == set(saved["lowrank_q"])
    moved = [n for n in drawn if not torch.equal(drawn[n], saved["lowrank_q"][n])]
    resumed(args, run_dir, tmp_path)
    if name == "fragments-in-flight":
        assert saved["pending"] is not None and saved["pending"]["fragment"] == 1
        assert moved  # fragment 0's matrices, synced at 2 (fragment 1's sync was taken, and is saved landed)
        assert_identical_streaming(run_dir, reference)
        return
    assert moved == list(drawn)
    assert_identical_but(run_dir, reference)
    syncs = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "sync"]
    assert [r["update"] for r in syncs] == [2, 4, 6] and all(r["payload_bytes"] > 0 for r in syncs)


if __name__ == "__main__":  # the stage test's ranks: `python tests/test_lowrank.py stage WORLD OUT`
    assert sys.argv[1] == "stage"
    torch.set_num_threads(1)
    world = int(sys.argv[2])
    fork_ranks(world, lambda rank: stage_worker(rank, world, Path(sys.argv[3])))


def test_the_clock_gathers_p_at_the_take_and_q_at_the_landing(tmp_path):
    """The network clock (docs/clock.md) times low rank as its two dependent gathers: P and the 1-D
    tensors started at the take (hidden by the compute since, here one update: tau = 1), Q's factors
    (`landing_bytes` = 4 x the fragment's sum of cols x r) at the landing, exposed whole. On a link slow
    enough that both show: hidden = min(compute, gather(P)), exposed = the rest of gather(P) + gather(Q);
    one gather of the whole payload, the clock's rule for a codec, would lack Q's latency and hide it."""
    from helpers import compose_cfg, entry
    from omegaconf import OmegaConf

    from hypertrain.clock.formulas import Link, all_gather_s
    from hypertrain.clock.replay import clock_of
    from hypertrain.config import ClusterConfig, LinkConfig
    from hypertrain.diloco.fragments import members
    from hypertrain.model.shapes import param_shapes
    from hypertrain.rundir.records import read_metrics

    args = [*WHOLE, "inner.H=4", "phase.updates=8", "outer.fragments=2", "outer.delay=1", "cluster=h100"]
    done = entry([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    resolved = OmegaConf.to_container(OmegaConf.load(tmp_path / "run" / "config.yaml"), resolve=True)
    cfg = compose_cfg([a for a in args if not a.startswith("logger")])
    shapes = param_shapes(cfg.model)
    q_bytes = [
        4
        * sum(
            math.prod(shapes[n][1:]) * min(2, shapes[n][0], math.prod(shapes[n][1:]))
            for n in names
            if len(shapes[n]) >= 2
        )
        for names in members(cfg)
    ]
    slow = LinkConfig("slow", bandwidth_gbit=1e-4, latency_us=1000.0)
    cluster = ClusterConfig(name="test", compute="modelled", peak_tflops=1e-3, mfu=0.5, inter=slow)
    cluster.check()
    link = Link.of(slow)
    clock = clock_of(rows, resolved, cluster)
    syncs = [r for r in rows if r.get("kind") == "sync"]
    assert len(syncs) == len(clock["syncs"]) == 5
    for row, sync in zip(syncs, clock["syncs"], strict=True):
        q = row["landing_bytes"]
        assert q == q_bytes[row["fragment"]], (row["fragment"], q)
        first, second = all_gather_s(row["payload_bytes"] - q, 2, link), all_gather_s(q, 2, link)
        hidden = sync["clock_outer_hidden_s"]
        assert 0.0 <= hidden <= first
        assert sync["clock_outer_exposed_s"] == pytest.approx(first - hidden + second, rel=1e-12)
    assert any(s["clock_outer_hidden_s"] > 0 for s in clock["syncs"])  # tau = 1: some of P hides


def test_the_error_decay_decays_the_buffer_low_rank_compresses():
    """outer.codec.error_decay reaches low rank as it reaches the codecs (`communication.fed_back`): what the
    stage compresses is delta + beta e, bitwise the same expression; beta = 1 is delta + e."""
    shapes = {"w": (4, 6), "b": (3,)}
    deltas, errors = inputs(2, 3, shapes, ef=True)
    for decay, want in ((0.5, deltas + errors * 0.5), (1.0, deltas + errors)):
        stage = lowrank_mean(
            Factors.of(shapes, 2), deltas, errors.clone(), torch.tensor([True, True]),
            warm_starts(shapes, 2), ReplicaGroups(2), decay=decay,
        )  # fmt: skip
        assert torch.equal(stage.x, want), decay
