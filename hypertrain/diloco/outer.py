"""The outer step of DiLoCo (Douillard et al. 2023, arXiv:2311.08105, Algorithm 1, lines 10-12): the
pseudo-gradient Delta = mean over replicas of (theta_global - theta_m), then theta_global steps by an
outer optimizer on Delta: torch.optim.SGD's (Nesterov) momentum, the paper's choice, written out here
rather than as torch.optim.SGD: SGD's first step clones the gradient into its buffer where ours adds it
to a zero buffer, so a -0.0 of the pseudo-gradient is kept as -0.0 in SGD's buffer and +0.0 in ours
(the weights are bitwise equal, the checkpoint's `outer_momentum` is not); and SGD keeps its buffer in
the weights' dtype and its state keyed by parameter, where ours is fp32 and keyed by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hypertrain.config import OuterConfig
from hypertrain.model.transformer import Params
from hypertrain.optim.inner import per_replica


@dataclass
class OuterState:
    """Outer momentum buffer per param, fp32, shaped like the global params (no replica axis)."""

    momentum: Params


def init_outer_state(global_params: Params) -> OuterState:
    return OuterState({n: torch.zeros_like(p, dtype=torch.float32) for n, p in global_params.items()})


def pseudo_gradient_sum(
    global_params: Params,
    replica_params: Params | list[Params],
    active: Tensor | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """sum over active replicas of (theta_global - theta_m), fp32, flat in `global_params` order, with
    the number of active replicas appended: [n_params + 1]. What a sync sums over processes.

    `replica_params` is one Params with a leading replica axis [R, ...] or a list of them (concatenated
    in order); `active` bool [R] over all those rows (None = all). `weights` fp32 [R] (None = all 1):
    each row's weight in the sum, `server.token_weights` (outer.mean_weights=tokens). Always freshly
    allocated.
    """
    stacked = replica_params if isinstance(replica_params, dict) else _concat(replica_params)
    parts = []
    for name, theta in global_params.items():
        replicas = stacked[name].float()
        delta = theta.float().reshape(1, *replicas.shape[1:]) - replicas
        if active is not None:
            # where, not a 0/1 weight: a skipped replica's rows never leak in, even non-finite ones
            delta = torch.where(per_replica(active, delta), delta, 0.0)
        if weights is not None:
            delta = per_replica(weights, delta) * delta
        parts.append(delta.sum(0).reshape(-1))
    count = len(next(iter(stacked.values()))) if active is None else active.sum()
    parts.append(torch.as_tensor(count, dtype=torch.float32, device=parts[0].device).reshape(1))
    return torch.cat(parts)


def pseudo_gradients(global_params: Params, replica_params: Params) -> Tensor:
    """Each replica's (theta_global - theta_m), fp32, flat in `global_params` order: [R, n_params]
    (`replica_params` [R, ...]). What a compressed sync encodes, replica by replica. `global_params`
    may hold one origin per replica instead ([R, ...]: eager's own outer weights)."""
    parts = []
    for name, theta in global_params.items():
        replicas = replica_params[name].float()
        parts.append((theta.float().reshape(-1, *replicas.shape[1:]) - replicas).reshape(len(replicas), -1))
    return torch.cat(parts, dim=1)


def unflatten(flat: Tensor, like: Params) -> Params:
    """A flat vector in `like`'s order -> tensors shaped like `like`'s (views of `flat`)."""
    out, start = {}, 0
    for name, t in like.items():
        out[name] = flat[start : start + t.numel()].view(t.shape)
        start += t.numel()
    return out


def _concat(replica_params: list[Params]) -> Params:
    if len(replica_params) == 1:
        return replica_params[0]
    return {n: torch.cat([p[n] for p in replica_params]) for n in replica_params[0]}


@torch.no_grad()
def outer_step(outer: OuterConfig, global_params: Params, mean_delta: Params, state: OuterState) -> None:
    """theta_global -= lr * update, in place, with torch.optim.SGD's momentum semantics.

    buf = momentum * buf + delta (buf starts at zero, so the first step gives buf = delta as torch);
    update = delta + momentum * buf with Nesterov, else buf. lr 1, momentum 0 is plain averaging.
    """
    for name, theta in global_params.items():
        delta = mean_delta[name].float()
        buf = state.momentum[name]
        buf.mul_(outer.momentum).add_(delta)
        update = delta.add(buf, alpha=outer.momentum) if outer.nesterov else buf
        theta.add_(update.to(theta.dtype), alpha=-outer.lr)


def weights_norm(theta: Params) -> float:
    """The global weights' norm (all tensors as one vector, summed in float64)."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in theta.values()))
