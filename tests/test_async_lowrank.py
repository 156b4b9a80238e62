"""Asynchronous replicas with low-rank compression (outer.schedule=async, outer.compress=lowrank;
docs/async.md "Codecs"): each arrival is one step of PowerSGD's Algorithm 1 (Vogels et al. 2019) with
one worker, warm-started from the server's Q, checked against a float64 reference written here
(P = M Q, Gram-Schmidt, Q' = M^T P, d = P Q'^T) at every arrival; the warm start is the previous
arrival's Q' whatever replica sent it; error feedback follows e' = x - d; the payload bits are the
factors'; loop = stacked bitwise; a SIGKILL resumes bitwise. A wrong Q or a wrong rank falls outside
the bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ReferenceRuns, assert_same_weights, killed_beside_uninterrupted, resumed
from test_async import ASYNC, arrivals, async_cfg, four_one_slow
from test_async_codecs import observed as codecs_observed

import hypertrain.diloco.asynchrony.asynchronous as asynchronous
from hypertrain.choices import Compressor
from hypertrain.config import LowRankConfig
from hypertrain.preflight.prepare import prepare

RANK = 2
U = 2.0**-24  # fp32's unit roundoff


def lowrank_cfg(engine="stacked", speeds=(1.0, 0.5), **outer):
    return async_cfg(speeds, engine, compress=Compressor.lowrank, lowrank=LowRankConfig(rank=RANK), **outer)


def observed(cfg):
    """Run `cfg` (test_async_codecs' `observed`, Q recorded too); returns the weights' shapes, every
    arrival's (delta, buffer before, Q before, decoded, buffer after, Q after) in order (the buffers [n]),
    every server update's applied deltas [k, n], and the final state."""

    def q_of(s):
        return {n: t.clone() for n, t in s.lowrank_q.items()}

    _, calls, applied, state = codecs_observed(cfg, also=q_of)
    calls = [(d, before[0], q, decoded, after[0], q_after) for d, before, decoded, after, q, q_after in calls]
    shapes = {n: tuple(t.shape) for n, t in state.theta.items()}
    return shapes, calls, applied, state


def gram_schmidt(p):
    """float64 [rows, r] -> orthonormal columns, column by column: divide by its norm, then take its
    component out of every later column (PowerSGD's ORTHOGONALIZE, written here)."""
    p = p.clone()
    for i in range(p.shape[1]):
        p[:, i] /= p[:, i].norm()
        for j in range(i + 1, p.shape[1]):
            p[:, j] -= (p[:, i] @ p[:, j]) * p[:, i]
    return p


def reference(x, q, shapes, rank=RANK):
    """float64: per matrix M of x ([shape[0], rest]), P = gram_schmidt(M Q[:, :rank]), Q' = M^T P,
    d = P Q'^T; the 1-D tensors as they are. Returns (d, {name: Q'}, {name: (M, P_unorthogonalized)})."""
    d, q_new, parts, start = torch.empty_like(x, dtype=torch.float64), {}, {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        v = x[start : start + n].double()
        if len(shape) >= 2:
            M = v.view(shape[0], n // shape[0])
            raw = M @ q[name].double()[:, :rank]
            P = gram_schmidt(raw)
            q_new[name] = M.t() @ P
            d[start : start + n] = (P @ q_new[name].t()).reshape(-1)
            parts[name] = (M, raw)
        else:
            d[start : start + n] = v
        start += n
    return d, q_new, parts


def bound(M, raw):
    """How far fp32 may put d = P Q'^T from float64's, in Frobenius norm: each product of K terms is
    within K u of its float64 value relative to ||M|| (P = M Q, Q' = M^T P, P Q'^T: K = cols, rows, r),
    and orthonormalizing moves P's columns by at most kappa(P) times P's relative error (QR's perturbation
    bound, kappa = sigma_max / sigma_min of M Q, in float64), that error including the fp32 Householder
    QR's own, gamma(rows r) (Higham, "Accuracy and Stability of Numerical Algorithms", Thm 19.4: within
    the 4 (rows + cols + r) u below at r = RANK = 2); P enters d twice. Summed with a factor 4 for the
    casts and the float64 reference's own rounding."""
    rows, cols = M.shape
    s = torch.linalg.svdvals(raw)
    kappa = float(s[0] / s[-1])
    return 4 * (rows + cols + raw.shape[1]) * U * (1 + 2 * kappa) * float(M.norm())


@pytest.mark.parametrize("speeds", [(1.0, 0.5), (1.0, 1.0)], ids=["one-slower", "tied"])
def test_each_arrival_is_one_power_iteration_from_the_servers_q_within_the_derived_bound(speeds):
    """With error feedback: at every arrival x = e + delta (the replica's buffer its last arrival left),
    d is the reference's P Q'^T within `bound` per matrix, the 1-D tensors exact; the buffer left is
    x - d (0 on the 1-D tensors); Q after it is Q' (within the bound over ||M||) and is the next arrival's
    warm start bitwise, whichever replica sends it. Tied arrivals (equal speeds: one server update of both)
    are each compressed on their own, in replica order, and applied as their mean's rows. A Q left at the
    first draw, or rank 1, falls outside the bound (negative controls)."""
    cfg = lowrank_cfg(speeds=speeds, error_feedback=True)
    shapes, calls, applied, state = observed(cfg)
    flat_applied = [d for deltas in applied for d in deltas]
    assert len(calls) == len(flat_applied) == 8
    if speeds == (1.0, 1.0):
        assert all(len(deltas) == 2 for deltas in applied)
    run = prepare(cfg)
    order = [job.replica for u in asynchronous.arrival_schedule(run) for job in u.jobs]
    buffers, first_q, wrong_q, wrong_rank = {}, calls[0][2], 0, 0
    previous_q = first_q
    for m, (delta, before, q, decoded, after, q_after), got in zip(order, calls, flat_applied, strict=True):
        assert torch.equal(got, decoded)
        assert all(torch.equal(q[n], previous_q[n]) for n in q)  # the server's Q, warm from the last arrival
        assert torch.equal(before, buffers.get(m, torch.zeros_like(delta)))
        x = before + delta  # fp32's sum, as a round forms it (communication.fed_back)
        want, q_want, parts = reference(x, q, shapes)
        start = 0
        for name, shape in shapes.items():
            span = slice(start, start + math.prod(shape))
            start = span.stop
            if name not in parts:
                assert torch.equal(got[span], x[span]) and not after[span].any()
                continue
            M, raw = parts[name]
            tol = bound(M, raw)
            assert float((got[span].double() - want[span]).norm()) <= tol, name
            assert float((q_after[name].double() - q_want[name]).norm()) <= tol, name
            if q is not first_q:
                stale, _, _ = reference(x[span], {name: first_q[name]}, {name: shape})
                wrong_q += float((got[span].double() - stale).norm()) > tol
            one, _, _ = reference(x[span], {name: q[name]}, {name: shape}, rank=1)
            wrong_rank += float((got[span].double() - one).norm()) > tol
        assert torch.equal(after, x - decoded)  # e' = x - d, the fp32 difference
        buffers[m], previous_q = after, q_after
    matrices = sum(len(s) >= 2 for s in shapes.values())
    assert wrong_rank == len(calls) * matrices
    assert wrong_q >= (len(calls) - 1) * matrices - 1  # from the second arrival on the Q has moved
    for m, own in enumerate(state.errors):
        assert torch.equal(torch.cat([t.reshape(-1) for t in own.values()]), buffers[m])
    assert all(torch.equal(state.lowrank_q[n], previous_q[n]) for n in previous_q)


def test_the_loop_and_stacked_engines_agree_bitwise_with_lowrank_and_error_feedback():
    """Four replicas, one half as fast, with DyLU: weights, every error buffer and the server's Q equal."""
    got = []
    for engine in ("stacked", "loop"):
        base = lowrank_cfg(engine=engine, error_feedback=True, dylu=True)
        cfg = four_one_slow(base, engine)
        got.append(observed(cfg)[3])
    a, b = got
    for name, t in a.theta.items():
        assert torch.equal(b.theta[name], t), name
    for name, t in a.lowrank_q.items():
        assert torch.equal(b.lowrank_q[name], t), name
    assert len(a.errors) == 4
    for x, y in zip(a.errors, b.errors, strict=True):
        assert any(t.any() for t in x.values())
        for name, t in x.items():
            assert torch.equal(y[name], t), name


LOWRANK_EF = ["outer.compress=lowrank", f"outer.lowrank.rank={RANK}", "outer.error_feedback=true"]


def test_an_arrivals_payload_bits_are_its_factors_and_its_1d_tensors_in_fp32(tmp_path):
    """Per job 32 (sum over matrices of rows r + cols r + the 1-D tensors' elements), r = min(rank, rows,
    cols), a matrix [shape[0], rest] (docs/compression.md, PowerSGD's two factors)."""
    run_dir = ReferenceRuns.beside(tmp_path)([*ASYNC, *LOWRANK_EF])
    weights = torch.load(run_dir / "weights.pt")
    elements = 0
    for t in weights.values():
        if t.dim() >= 2:
            rows, cols = t.shape[0], t.numel() // t.shape[0]
            elements += (rows + cols) * min(RANK, rows, cols)
        else:
            elements += t.numel()
    rows = arrivals(run_dir)
    assert len(rows) == 12
    assert all(r["payload_bits"] == [32 * elements] * len(r["replicas"]) for r in rows)
    assert 32 * elements < 32 * sum(t.numel() for t in weights.values()) / 4


@pytest.mark.slow
def test_a_lowrank_run_killed_between_server_updates_resumes_bitwise(tmp_path):
    """SIGKILL before server update 6: the error buffers and the server's Q are in the checkpoint; every
    arrival row and the weights equal the uninterrupted run's."""
    args = [*ASYNC, *LOWRANK_EF]
    run_dir, reference_dir = killed_beside_uninterrupted(args, tmp_path, "0:6:kill")
    resumed(args, run_dir, tmp_path)
    want = arrivals(reference_dir)
    assert len(want) == 12 and arrivals(run_dir) == want
    assert_same_weights(torch.load(run_dir / "weights.pt"), torch.load(reference_dir / "weights.pt"))
