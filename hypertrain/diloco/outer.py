"""The pseudo-gradient of DiLoCo (Douillard et al. 2023, arXiv:2311.08105, Algorithm 1, lines 10-11):
Delta = mean over replicas of (theta_global - theta_m), summed or per replica, flat in the global
weights' order; the outer step on it is an outer optimizer's (`optim.outer_steps`, re-exported here).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hypertrain.model.transformer import Params
from hypertrain.optim.inner import per_replica
from hypertrain.optim.outer_steps import (  # noqa: F401 (re-exported: the sync's and the tests' names)
    DelayedNesterovStep,
    NesterovStep,
    OuterState,
    OuterStep,
    TorchStep,
    init_outer_state,
    outer_step,
    unflatten,
)


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


def _concat(replica_params: list[Params]) -> Params:
    if len(replica_params) == 1:
        return replica_params[0]
    return {n: torch.cat([p[n] for p in replica_params]) for n in replica_params[0]}


def weights_norm(theta: Params) -> float:
    """The global weights' norm (all tensors as one vector, summed in float64)."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in theta.values()))
