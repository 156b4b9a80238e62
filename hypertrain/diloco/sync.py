"""The DiLoCo sync at a round's end, one pipeline a reader follows top to bottom: the pseudo-gradient
(`outer.pseudo_gradient_sum`), the communication stage (`communication.exact_mean`, replaceable), the
outer optimizer (`outer.outer_step`) and the inner state policy (`optim.inner.sync_inner_states`).
The simulation and the real processes call the same `sync`; only their `Collectives` differ.
"""

from __future__ import annotations

import math

import torch

from hypertrain.config import TrainConfig
from hypertrain.diloco.communication import Communicate, exact_mean
from hypertrain.diloco.outer import outer_step, pseudo_gradient_sum, unflatten
from hypertrain.diloco.state import RunState
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.model.transformer import Params
from hypertrain.optim.inner import sync_inner_states


def sync(
    cfg: TrainConfig,
    state: RunState,
    params: list[Params],
    stepped: list[bool],
    groups: Collectives | None = None,
    communicate: Communicate = exact_mean,
) -> tuple[float, int]:
    """End a round: outer step on the replicas that stepped, then the inner state policy.

    `params` are this process's replicas' weights at the round's end ([1, ...] each), `stepped`
    whether each stepped in the round; their inner states are `state.inner`. Every process sums its
    replicas' pseudo-gradients and `communicate` makes the mean over all processes' replicas, so
    each steps the same `state.theta` in place (it never shares storage with a replica's weights).
    Returns the pseudo-gradient norm and the replicas that took part.
    """
    groups = groups or ReplicaGroups(cfg.replicas)
    theta = state.theta
    device = next(iter(theta.values())).device
    active = torch.tensor(stepped, device=device)
    # 1. pseudo-gradient: this process's replicas' (theta - theta_m), summed, with their count
    replica_params = {n: torch.cat([p[n] for p in params]) for n in theta}
    local_sum = pseudo_gradient_sum(theta, replica_params, active)
    # 2. communication: the mean over every replica that stepped, on every process
    communicated = communicate(local_sum, groups)
    if communicated is None:  # nobody stepped: no pseudo-gradient, and momentum must not move theta
        return 0.0, 0
    mean, synced = communicated
    delta_norm = math.sqrt(float(mean.double().pow(2).sum()))
    # 3. outer optimizer: theta steps on the mean pseudo-gradient
    outer_step(cfg.outer, theta, unflatten(mean, theta), state.outer)
    # 4. state policy: the replicas' inner optimizer states for the next round
    sync_inner_states(
        cfg.inner,
        state.inner,
        active.to(state.inner[0].step.device),
        groups.sum_over_replicas,
        groups.max_over_replicas,
    )
    return delta_norm, synced
