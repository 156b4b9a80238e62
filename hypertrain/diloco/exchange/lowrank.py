"""PowerSGD's low-rank compression as the sync's reduction (outer.compress=lowrank; Vogels, Karimireddy,
Jaggi 2019, arXiv 1905.13727, Algorithm 1; docs/compression.md): per matrix, one power iteration warm-
started from the previous Q (P orthonormalized by a sign-fixed Householder QR), its two factors
all-gathered and summed in replica order, so every process and the simulation compute the same numbers
from the same numbers. `Factors` says which tensors are matrices and what one replica sends; `initial_q`
draws the warm start; `lowrank_mean` starts a sync. `power_step` and `from_power_step` are one worker's
step and its decode (an asynchronous arrival, docs/async.md "Codecs"), sharing `orthogonalize` and
`warm_start` with the sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hypertrain.diloco.exchange.communication import (
    HEADER_BYTES,
    fed_back,
    mean_in_replica_order,
    refuse_non_finite,
)
from hypertrain.diloco.pending import Reduced
from hypertrain.distributed.groups import Collectives

FLAG_BYTES = HEADER_BYTES // 2  # the first message's header (took part), the second's (its error): fp32


@dataclass(frozen=True)
class Matrix:
    """One tensor of the flat vector, as PowerSGD sees it: elements [start, start + rows * cols) are a
    [rows, cols] matrix (a tensor of more dims is [shape[0], rest]) and its factors have `rank` columns
    (outer.lowrank.rank, cut to min(rows, cols))."""

    name: str
    start: int
    rows: int
    cols: int
    rank: int


@dataclass(frozen=True)
class Factors:
    """The parameters `names` (a fragment's, in order) of shapes `shapes`, concatenated flat: which are
    matrices (`matrices`), and where the 1-D ones are (`exact`: (start, numel), sent exact in fp32)."""

    matrices: tuple[Matrix, ...]
    exact: tuple[tuple[int, int], ...]
    numel: int

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]], rank: int) -> Factors:
        matrices, exact, start = [], [], 0
        for name, shape in shapes.items():
            numel = int(np.prod(shape, dtype=np.int64))
            if len(shape) >= 2 and numel > 0:
                rows, cols = shape[0], numel // shape[0]
                matrices.append(Matrix(name, start, rows, cols, min(rank, rows, cols)))
            elif numel:
                exact.append((start, numel))
            start += numel
        return cls(tuple(matrices), tuple(exact), start)

    @property
    def p_numel(self) -> int:
        return sum(m.rows * m.rank for m in self.matrices)

    @property
    def q_numel(self) -> int:
        return sum(m.cols * m.rank for m in self.matrices)

    @property
    def exact_numel(self) -> int:
        return sum(n for _, n in self.exact)

    @property
    def payload_bytes(self) -> int:
        """One replica's payload per sync, its two messages' headers aside:
        4 * (sum over matrices of rows * r + cols * r) + 4 * (the 1-D tensors' elements)."""
        return 4 * (self.p_numel + self.q_numel + self.exact_numel)


def initial_q(theta: dict[str, Tensor], rank: int, seed: int) -> dict[str, Tensor]:
    """The first warm start of every matrix of the model `theta` (all its parameters, in order): Q
    [cols, r] of i.i.d. standard normals (Algorithm 1's initialisation) from a CPU generator seeded by
    (the run's seed, the parameter's index in the model), so every process draws the same Q whatever
    it holds; fp32, on the weights' device."""
    out = {}
    for index, (name, t) in enumerate(theta.items()):
        if t.dim() < 2 or t.numel() == 0:
            continue
        cols = t.numel() // t.shape[0]
        state = np.random.SeedSequence([seed, index]).generate_state(2, dtype=np.uint32)
        gen = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        q = torch.randn(cols, min(rank, t.shape[0], cols), generator=gen, dtype=torch.float32)
        out[name] = q.to(t.device)
    return out


def orthogonalize(p: Tensor) -> Tensor:
    """[rows, r] (r <= rows) -> orthonormal columns spanning p's (PowerSGD's ORTHOGONALIZE): the Q of
    p's Householder QR (torch.linalg.qr), each column's sign flipped where R's diagonal is negative, so
    that diag(R) >= 0: for p of full column rank, in exact arithmetic, the basis Gram-Schmidt gives.
    Householder's columns are orthonormal within a small multiple of fp32's unit roundoff whatever p's
    condition (Higham, "Accuracy and Stability of Numerical Algorithms", Thm 19.4), where fp32 Gram-Schmidt
    loses orthogonality by about u cond(p) (Bjorck 1967): at a rank near a matrix's sides p is ill
    conditioned and P P^T stopped being a projection (issue 48: real processes 10-23% from the simulation
    at rank 64 on the tiny model). A rank-deficient p still gets r orthonormal columns, its span completed
    (p = 0, a matrix that did not move: M^T P = 0, so its warm start stays). Bits: one LAPACK (or
    cuSOLVER) call per matrix, the same on identical inputs at the same thread count (as every product of
    the run), whatever the input's alignment."""
    q, r = torch.linalg.qr(p)
    return torch.where(torch.diagonal(r)[None, :] < 0, -q, q)  # the sign flips: exact


def warm_start(warm: Tensor, q_new: Tensor) -> None:
    """The next warm start, in place: Q, but a column that came back all zero (a matrix that did not
    move) keeps the previous one, else the power iteration would stay at zero for good."""
    moved = (q_new != 0).any(dim=0)
    warm.copy_(torch.where(moved[None, :], q_new, warm))


def power_step(factors: Factors, x: Tensor, q: dict[str, Tensor]) -> Tensor:
    """One worker's step of Algorithm 1 (W = 1) on the flat `x` [n]: per matrix M, P = orthogonalize(M Q)
    and Q' = M^T P. Returns what that worker sends, fp32 [p_numel + q_numel + exact_numel]: every
    matrix's P, then every Q', then the 1-D tensors as they are (`Factors.payload_bytes` bytes)."""
    rows, ps, qs = x[None], [], []
    for mat in factors.matrices:
        m = _matrix(rows, 0, mat)
        p = orthogonalize(m @ q[mat.name])
        ps.append(p.reshape(-1))
        qs.append((m.t() @ p).reshape(-1))
    return torch.cat([*ps, *qs, *(x[a : a + n] for a, n in factors.exact)])


def from_power_step(factors: Factors, sent: Tensor, q: dict[str, Tensor]) -> Tensor:
    """`power_step`'s output -> the decoded flat vector: P Q'^T per matrix, the 1-D tensors as sent; each
    matrix's warm start `q` moves to its Q' (`warm_start`), in place."""
    out = torch.empty(factors.numel, dtype=sent.dtype, device=sent.device)
    p_at, q_at = 0, factors.p_numel
    for mat in factors.matrices:
        p = sent[p_at : p_at + mat.rows * mat.rank].view(mat.rows, mat.rank)
        q_new = sent[q_at : q_at + mat.cols * mat.rank].view(mat.cols, mat.rank)
        p_at, q_at = p_at + mat.rows * mat.rank, q_at + mat.cols * mat.rank
        out[mat.start : mat.start + mat.rows * mat.cols] = (p @ q_new.t()).reshape(-1)
        warm_start(q[mat.name], q_new)
    for a, n in factors.exact:
        out[a : a + n] = sent[q_at : q_at + n]
        q_at += n
    return out


def _matrix(x: Tensor, m: int, mat: Matrix) -> Tensor:
    """Replica row m's `mat` as [rows, cols], a fresh contiguous copy: a matrix product's input at the
    allocator's alignment whatever rows of which tensor it came from (so a process holding one replica
    multiplies exactly as one holding all)."""
    flat = x[m, mat.start : mat.start + mat.rows * mat.cols]
    return flat.view(mat.rows, mat.cols).clone(memory_format=torch.contiguous_format)


class LowRankMean:
    """A low-rank sync in flight (a `Reduction`): started with the first all-gather (each replica's
    took-part flag, its P_m = M_m Q of every matrix and its 1-D tensors); `wait()` finishes it: P, the
    mean of the P_m in replica order, orthogonalized; each replica's Q_m = M_m^T P; the second all-gather
    (each one's compression error and its Q_m); Q, their mean in replica order; the decoded mean P Q^T
    (the 1-D tensors' mean beside it). It then updates the warm starts and, with error feedback, the
    local replicas' buffers."""

    def __init__(
        self,
        factors: Factors,
        x: Tensor,
        deltas: Tensor,
        active: Tensor,
        q: dict[str, Tensor],
        errors: Tensor | None,
        store: Callable[[Tensor], None],
        groups: Collectives,
        weights: Tensor | None = None,
    ):
        self.factors, self.x, self.deltas, self.active = factors, x, deltas, active
        self.q, self.errors, self.store, self.groups = q, errors, store, groups
        self.result, self.done, self.weights = None, False, weights
        rows = []
        # each local replica's matrices, copied once: both products of the power iteration read them
        self.mats = [{mat.name: _matrix(x, m, mat) for mat in factors.matrices} for m in range(x.shape[0])]
        for m in range(x.shape[0]):
            parts = [active[m : m + 1].to(x.dtype)]
            for mat in factors.matrices:
                parts.append((self.mats[m][mat.name] @ q[mat.name]).reshape(-1))
            parts += [x[m, a : a + n] for a, n in factors.exact]
            row = torch.cat(parts)
            rows.append(torch.where(active[m], row, 0.0).contiguous().view(torch.uint8))
        self.flight = groups.start_all_gather_replicas(torch.stack(rows))

    def is_completed(self) -> bool:
        return self.done or self.flight.is_completed()

    def wait(self) -> Reduced | None:
        if self.done:
            return self.result
        self.done = True
        factors, x = self.factors, self.x
        first = self.flight.wait().view(x.dtype)  # [R, 1 + P + exact] in replica order
        active = [bool(a) for a in first[:, 0].tolist()]
        if not any(active):
            return None
        count = sum(active)
        p_sums = mean_in_replica_order(first[:, 1 : 1 + factors.p_numel], active, self.weights)
        exact = mean_in_replica_order(first[:, 1 + factors.p_numel :], active, self.weights)
        p_hat, at = {}, 0
        for mat in factors.matrices:
            size = mat.rows * mat.rank
            p_hat[mat.name] = orthogonalize(p_sums[at : at + size].view(mat.rows, mat.rank))
            at += size
        # each local replica's Q_m and its own contribution's error ||P Q_m^T - delta_m|| / ||delta_m||
        rows = []
        for m in range(x.shape[0]):
            q_parts, square = [], torch.zeros((), dtype=torch.float64, device=x.device)
            delta = self.deltas[m]
            for mat in factors.matrices:
                q_m = self.mats[m][mat.name].t() @ p_hat[mat.name]
                q_parts.append(q_m.reshape(-1))
                # ||P Q_m^T - delta_m|| of the matrix: its own contribution's residual, in fp32 (the
                # header carries the error in fp32), its square summed in float64
                d = delta[mat.start : mat.start + mat.rows * mat.cols].view(mat.rows, mat.cols)
                square += torch.linalg.vector_norm(p_hat[mat.name] @ q_m.t() - d, dtype=torch.float64) ** 2
            for a, n in factors.exact:
                exact_residual = x[m, a : a + n] - delta[a : a + n]
                square += torch.linalg.vector_norm(exact_residual, dtype=torch.float64) ** 2
            norm = torch.linalg.vector_norm(delta, dtype=torch.float64)
            error = square.sqrt() / torch.where(norm > 0, norm, 1.0)
            row = torch.cat([error.to(x.dtype).reshape(1), *q_parts])
            rows.append(torch.where(self.active[m], row, 0.0).contiguous().view(torch.uint8))
        self.mats = None  # the copies served both products
        second = self.groups.start_all_gather_replicas(torch.stack(rows)).wait().view(x.dtype)
        errors = second[:, 0].tolist()
        q_mean = mean_in_replica_order(second[:, 1:], active, self.weights)
        mean = torch.empty(factors.numel, dtype=x.dtype, device=x.device)
        at = 0
        for mat in factors.matrices:
            size = mat.cols * mat.rank
            q_new = q_mean[at : at + size].view(mat.cols, mat.rank)
            at += size
            span = slice(mat.start, mat.start + mat.rows * mat.cols)
            mean[span] = (p_hat[mat.name] @ q_new.t()).reshape(-1)
            warm_start(self.q[mat.name], q_new)
        offset = 0
        for a, n in factors.exact:
            mean[a : a + n] = exact[offset : offset + n]
            offset += n
        self.p_hat = p_hat  # the orthogonalized P of every matrix (what tests compare)
        if self.errors is not None:
            # PowerSGD's error feedback (arXiv 1905.13727, Algorithm 2, "memorize local errors"):
            # e_m <- Delta_m - DECOMPRESS(C(Delta_m)), Delta_m = delta_m + e_m the replica's own input and
            # DECOMPRESS the shared P Q^T (Algorithm 1, DECOMPRESS), as the paper's code computes it after
            # the all-reduce; the 1-D tensors, sent exact, leave nothing: their buffers stay 0
            decoded = mean[None].expand_as(x).clone()
            for a, n in factors.exact:
                decoded[:, a : a + n] = x[:, a : a + n]
            self.errors.copy_(torch.where(self.active[:, None], x - decoded, self.errors))
            self.store(self.errors)
        b = factors.payload_bytes
        taken = [e if a else None for a, e in zip(active, errors, strict=True)]
        landing = 4 * factors.q_numel  # the second gather's factors: exchanged at the landing
        self.result = Reduced(mean, count, (self.groups.total_replicas - 1) * b, b, taken, landing)
        return self.result


def lowrank_mean(
    factors: Factors,
    deltas: Tensor,
    errors: Tensor | None,
    active: Tensor,
    q: dict[str, Tensor],
    groups: Collectives,
    store: Callable[[Tensor], None] | None = None,
    update: int | None = None,
    decay: float = 1.0,
    weights: Tensor | None = None,
) -> LowRankMean:
    """Start a low-rank sync of this process's replicas' pseudo-gradients `deltas` [R_local, n] (with
    error feedback, `errors` [R_local, n], decayed by `decay` (outer.codec.error_decay), is added first and,
    once the sync is waited for, updated in place and handed to `store`), warm-started from `q` (each
    matrix's [cols, r], updated in place at the wait). Raises NonFiniteError (every process, agreed)
    when an input that would be sent is not finite, before anything is sent, naming the replica (the
    highest-numbered) and the sync's `update`. `weights` (outer.mean_weights=tokens, every replica's,
    fp32 [R]): both factors' means and the 1-D tensors' become weighted sums in replica order, so the
    mean is `P (sum_m w_m Q_m)^T = sum_m w_m P Q_m^T`, P the power iteration of `sum_m w_m x_m`
    (linear in each replica's factors: exact); the buffers stay each replica's own, x_m - P Q^T."""
    x = fed_back(deltas, errors, decay)
    refuse_non_finite(x, active, groups, update)
    store = store or (lambda _: None)
    return LowRankMean(factors, x, deltas, active, q, errors, store, groups, weights)
