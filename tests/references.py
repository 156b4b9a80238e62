"""Independent references that several tests share: torch's own AdamW and the schedule's formula."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import numpy as np
import torch

from hypertrain.config import InnerConfig
from hypertrain.optim import inner as optim


def torch_adamw(inner: InnerConfig, params: list[torch.Tensor], matrix_ndim: int = 2) -> torch.optim.AdamW:
    """torch.optim.AdamW with decay on matrices only (tensors of at least `matrix_ndim` dims)."""
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= matrix_ndim], "weight_decay": inner.wd},
            {"params": [p for p in params if p.ndim < matrix_ndim], "weight_decay": 0.0},
        ],
        lr=inner.lr,
        betas=(inner.beta1, inner.beta2),
        eps=inner.eps,
    )


def schedule_lr(inner: InnerConfig, update: int) -> float:
    """Linear warmup, then cosine from lr to lr * min_lr_ratio between warmup_steps and decay_steps."""
    if update < inner.warmup_steps:
        return inner.lr * (update + 1) / inner.warmup_steps
    progress = min(1.0, (update - inner.warmup_steps) / (inner.decay_steps - inner.warmup_steps))
    return inner.lr * (
        inner.min_lr_ratio + (1 - inner.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


# Float64 references and the rounding bounds derived from them (docs/design.md, "Within float rounding").
#
# A result computed in fp32 is compared with the same computation in float64 (hypertrain's own code on
# float64 tensors, in `float64_arithmetic`). Two fp32 paths that evaluate the same real-number expression
# and differ only in the order or fusion of their roundings (stacked vs loop, compiled vs eager, ours vs
# torch's) make errors of the same size against that reference, so each must stay within a small
# factor of the other's: ||got - ref|| <= ROUNDING_FACTOR * max(||peer - ref||, floor). The floor is the
# worst-case rounding of the stored results themselves (k roundings of a value, each within U32 of
# it, per entry): below it the two errors are too small to say one is worse, and it keeps the bound
# from collapsing where the peer happens to be nearly exact.

U32 = 2.0**-24  # fp32 unit roundoff: a correctly rounded fp32 operation errs by at most U32 relative
U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)
# Each path's error within twice the other's. Over many entries two draws of rounding error of the
# same size have nearly equal norms (an extra rounding adds in quadrature, a factor ~sqrt(2)); where a
# few amplified directions dominate (bf16 Newton-Schulz on 8x8 matrices) independent draws were seen
# to differ by up to 1.7x. A real difference in the arithmetic (a wrong factor, a skipped step) is
# orders of magnitude larger, and where both errors are below the floor the floor decides.
ROUNDING_FACTOR = 2.0


@contextlib.contextmanager
def float64_arithmetic() -> Iterator[None]:
    """Run hypertrain's own code as a float64 reference, given float64 weights, gradients and state:
    Newton-Schulz in float64 whatever `inner.ns_dtype` says, and tensors the code creates without a
    dtype (the loop engine's loss accumulator) in float64 (so create fp32 inputs such as initial
    weights before entering). What the code rounds to fp32 on purpose stays fp32: AdamW's step-size
    scalars, RoPE's tables, the outer step's pseudo-gradient and momentum (their rounding is U32 of a
    pseudo-gradient, far below U32 of the weights), the same in every path."""
    saved_dtype, saved_ns = torch.get_default_dtype(), dict(optim._NS_DTYPES)
    torch.set_default_dtype(torch.float64)
    optim._NS_DTYPES.update(dict.fromkeys(saved_ns, torch.float64))
    try:
        yield
    finally:
        torch.set_default_dtype(saved_dtype)
        optim._NS_DTYPES.update(saved_ns)


def assert_within_rounding(got, peer, ref, floor: float, what: str = "") -> float:
    """||got - ref|| <= ROUNDING_FACTOR * max(||peer - ref||, floor), norms in float64; returns the
    fraction of the bound used. `ref` is the float64 reference, `floor` an absolute norm."""
    ref = ref.double()
    err, peer_err = float((got.double() - ref).norm()), float((peer.double() - ref).norm())
    bound = ROUNDING_FACTOR * max(peer_err, floor)
    assert err <= bound, (
        f"{what}: ||got - ref|| = {err:.3g} > {ROUNDING_FACTOR} * max(||peer - ref|| = {peer_err:.3g}, "
        f"floor {floor:.3g}) (||ref|| = {float(ref.norm()):.3g})"
    )
    return err / bound if bound else 0.0


def assert_entries_within(actual, expected, bound, what: str = "") -> float:
    """|actual - expected| <= bound entrywise, in float64 (a per-entry bound derived in the test);
    returns the largest fraction of its bound an entry uses."""
    used = float(((actual.double() - expected.double()).abs() / bound).max())
    assert used <= 1, f"{what}: an entry is {used:.3g} times its bound"
    return used


def assert_losses_within_rounding(got, peer, ref, floor: float) -> float:
    """Elementwise |got - ref| <= rtol * |ref| with rtol = ROUNDING_FACTOR * max(the peer's largest
    relative error, floor); None (a skipped step) must be None in all three. Returns the fraction of
    the bound used."""

    def array(rows):
        return np.array([[np.nan if x is None else x for x in row] for row in rows], dtype=np.float64)

    got, peer, ref = array(got), array(peer), array(ref)
    assert (np.isnan(got) == np.isnan(ref)).all() and (np.isnan(peer) == np.isnan(ref)).all()
    rel = lambda a: float(np.nanmax(np.abs(a - ref) / np.abs(ref)))  # noqa: E731
    rtol = ROUNDING_FACTOR * max(rel(peer), floor)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=0)
    return rel(got) / rtol


@torch.no_grad()
def float64_inner_step(inner: InnerConfig, params, grads, state, lr: float, active=None) -> None:
    """`optim.inner_step` on float64 params and state (in place) as the exact result of an fp32 step.

    The decay factor 1 - lr*wd is part of the fp32 step's definition, rounded to fp32 once (as eager
    torch rounds a float scalar), so it is applied here exactly as that fp32 number, to the rows that
    step, and the rest runs with wd = 0 in float64 (decoupled decay: the update does not depend on the
    decayed weights). Grads may be fp32; they are converted."""
    factor = torch.tensor(1.0 - lr * inner.wd, dtype=torch.float64).float().item()
    for t in params.values():
        if t.ndim - 1 >= 2:  # matrices beyond the replica axis decay, as in inner_step
            rows = torch.ones(t.shape[0], dtype=t.dtype) if active is None else active.to(t.dtype)
            t.mul_((1.0 + rows * (factor - 1.0)).view(-1, *[1] * (t.ndim - 1)))
    with float64_arithmetic():
        optim.inner_step(
            dataclasses.replace(inner, wd=0.0),
            params,
            {n: g.double() for n, g in grads.items()},
            state,
            lr,
            active,
        )


def to_float64(tensors: dict) -> dict:
    return {n: t.double() for n, t in tensors.items()}


def float64_state(state: optim.OptState) -> optim.OptState:
    return optim.OptState(to_float64(state.m), to_float64(state.v), state.step.clone())


def assert_outer_step(outer, theta, buf, delta, spread, n: int, run_theta, run_buf, where) -> None:
    """The run's global weights and momentum after an outer step (DiLoCo, Algorithm 1: SGD with
    Nesterov momentum on the mean pseudo-gradient `delta` of n replicas) against the float64 step from the
    run's own `theta` and `buf` before it (all float64). Bounds, per entry: the run forms the mean of n
    fp32 differences ((n + 1) roundings, each within U32 of the mean |theta - w_m|, `spread`), then
    buf = mu buf + d (2 roundings) and theta - lr (d + mu buf) (4): |err(buf)| <= (n + 3) U32 (spread +
    mu |buf_old|), |err(theta)| <= 2 U32 |theta_new| + lr (1 + mu) (n + 5) U32 (spread + mu |buf_old|).
    `where` names the sync in the assertion's message."""
    mu = outer.momentum
    new_buf = mu * buf + delta
    new_theta = theta - outer.lr * (delta + mu * new_buf if outer.nesterov else new_buf)
    scale = spread + mu * buf.abs()
    assert ((run_buf.double() - new_buf).abs() <= (n + 3) * U32 * scale).all(), where
    bound = 2 * U32 * new_theta.abs() + outer.lr * (1 + mu) * (n + 5) * U32 * scale
    assert ((run_theta.double() - new_theta).abs() <= bound).all(), where


# SparseLoCo's chunks and counts as its production code has them (templar, src/tplr/compress.py at
# tplr-ai/templar c2397ac: `ChunkingTransformer`, `_get_smaller_split`, `TopKCompressor._clamp_topk`), read
# there and written here from that reading, not from hypertrain's tiles or codecs.


def templar_split(side: int, most: int) -> int:
    """`_get_smaller_split`: the largest divisor of `side` that is at most `most` (itself when smaller)."""
    return max(d for d in range(1, min(side, most) + 1) if side % d == 0)


def templar_chunks(shape: tuple[int, ...], tile: int) -> list[np.ndarray]:
    """Each chunk of a tensor of `shape` as the flat indices (row-major, the parameter's own order) of its
    values in the order they are compressed: a matrix `rearrange("(y h) (x w) -> y x h w")`, its sides cut at
    `templar_split(side, tile)`, chunks row after row of the grid, each chunk's values row-major (a
    leading axis: its matrices in turn, as hypertrain extends templar's 2-D rule); a 1-D tensor
    `rearrange("(x w) -> x w")`, runs of `templar_split(size, tile)`."""
    index = np.arange(math.prod(shape)).reshape(shape)
    if len(shape) == 1:
        w = templar_split(shape[0], tile)
        return [index[a : a + w] for a in range(0, shape[0], w)]
    rows, cols = shape[-2:]
    h, w = templar_split(rows, tile), templar_split(cols, tile)
    return [
        m[i : i + h, j : j + w].reshape(-1)
        for m in index.reshape(-1, rows, cols)
        for i in range(0, rows, h)
        for j in range(0, cols, w)
    ]


def templar_k(k: int, length: int) -> int:
    """`_clamp_topk` of a chunk of `length` values: min(k, length), at least 2, made even; a chunk of one
    value keeps it (templar's would ask torch.topk for 2 of 1: hypertrain's one departure)."""
    if length == 1:
        return 1
    k = max(min(k, length), 2)
    return k - k % 2


def templar_topk(x: np.ndarray, shape: tuple[int, ...], tile: int, k: int) -> list[np.ndarray]:
    """The flat indices each chunk of one tensor's values `x` (float64, parameter order) keeps: its
    `templar_k` largest magnitudes, largest first, equal ones to the lower position in the chunk."""
    kept = []
    for chunk in templar_chunks(shape, tile):
        order = np.lexsort((np.arange(len(chunk)), -np.abs(x[chunk])))
        kept.append(chunk[order[: templar_k(k, len(chunk))]])
    return kept
