"""The DiLoCo sync, one pipeline a reader follows top to bottom (docs/design.md, "The sync pipeline"):
`take` forms this process's replicas' pseudo-gradients over the parameters being synced (all of them,
or one Streaming DiLoCo fragment) and starts the communication stage (`communication.exact_mean`,
replaceable); `land` waits for its mean, steps those parameters' global weights with their outer
optimizer state (`outer.outer_step`), merges them into every replica and applies the inner state
policy (`optim.inner.sync_inner_states`). Between the two the replicas may train on (outer.delay).
The simulation and the real processes call the same functions; only their `Collectives` differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hypertrain.config import TrainConfig
from hypertrain.diloco.churn import RoundFacts
from hypertrain.diloco.codecs import Blocks
from hypertrain.diloco.communication import compressed_mean, exact_mean
from hypertrain.diloco.outer import outer_step, pseudo_gradient_sum, pseudo_gradients, unflatten, weights_norm
from hypertrain.diloco.pending import Pending
from hypertrain.diloco.state import RunState
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.model.transformer import Params
from hypertrain.optim.inner import sync_inner_states


@dataclass
class SyncFigures:
    """What a landed sync reports: its fragment, the mean pseudo-gradient's norm, the replicas that
    took part, the norm of the fragment's global weights before the outer step, its parameters and,
    under real processes, the payload bytes and seconds measured since the previous landing."""

    fragment: int
    delta_norm: float
    synced: int
    theta_norm: float
    params: int
    measured: dict = field(default_factory=dict)
    stage: dict = field(default_factory=dict)  # the communication stage's figures (a compressor's)
    churn: RoundFacts | None = None  # with churn: who contributed, was absent, missed; whether skipped


def take(
    cfg: TrainConfig,
    state: RunState,
    params: list[Params],
    stepped: list[bool],
    names: list[str],
    fragment: int,
    count: int,
    groups: Collectives,
) -> Pending:
    """Start a sync of the parameters `names`: this process's replicas' pseudo-gradients (theta -
    theta_m over the replicas that `stepped`) handed to the communication stage, which starts their
    mean over every process's replicas: fp32 sums and their count (`exact_mean`), or each replica's
    compressed payload, with its error-feedback buffer (`compressed_mean`)."""
    theta = {n: state.theta[n] for n in names}
    device = next(iter(theta.values())).device
    active = torch.tensor(stepped, device=device)
    replica_params = {n: torch.cat([p[n] for p in params]) for n in names}
    if cfg.outer.compress == "none":
        reduction = exact_mean(pseudo_gradient_sum(theta, replica_params, active), groups)
        return Pending(fragment, count, list(stepped), reduction)
    blocks = Blocks(tuple(t.numel() for t in theta.values()), cfg.outer.block)
    errors = None
    if state.errors is not None:  # this fragment's part of each local replica's buffer, flat
        errors = torch.cat([torch.cat([e[n].reshape(1, -1) for n in names], dim=1) for e in state.errors])
    deltas = pseudo_gradients(theta, replica_params)
    reduction = compressed_mean(cfg.outer, deltas, errors, active, blocks, groups, count)
    if errors is not None:  # the updated buffers back into the state
        for row, e in zip(errors, state.errors, strict=True):
            for n, part in zip(names, row.split([e[n].numel() for n in names]), strict=True):
                e[n].copy_(part.view_as(e[n]))
    return Pending(fragment, count, list(stepped), reduction)


@torch.no_grad()
def land(
    cfg: TrainConfig,
    state: RunState,
    pending: Pending,
    names: list[str],
    params: list[Params] | None,
    groups: Collectives,
) -> SyncFigures:
    """Finish a sync: wait for the mean pseudo-gradient, step the global weights of `names` with their
    outer state, merge them into every local replica's weights `params` (None: the replicas restart from
    the global weights), and apply the inner state policy to those parameters."""
    theta = {n: state.theta[n] for n in names}
    size = sum(t.numel() for t in theta.values())
    communicated = pending.reduction.wait()
    if communicated is None:  # nobody stepped: no pseudo-gradient, and momentum must not move theta
        figures = SyncFigures(pending.fragment, 0.0, 0, 0.0, size)
    else:
        mean, synced = communicated.mean, communicated.synced
        theta_norm = weights_norm(theta)  # before the outer step changes theta in place
        delta_norm = math.sqrt(float(mean.double().pow(2).sum()))
        outer_step(cfg.outer, theta, unflatten(mean, theta), state.outer)
        figures = SyncFigures(
            pending.fragment, delta_norm, synced, theta_norm, size, stage=communicated.figures
        )
    if params is not None:
        merge(theta, params, cfg.outer.merge_alpha)
    if communicated is not None:
        active = torch.tensor(pending.stepped, device=state.inner[0].step.device)
        sync_inner_states(
            cfg.inner,
            state.inner,
            active,
            groups.sum_over_replicas,
            groups.max_over_replicas,
            names=names if len(names) < len(state.theta) else None,
            fragment=pending.fragment,
        )
    return figures


def merge(theta: Params, params: list[Params], alpha: float) -> None:
    """Each replica's weights of `theta`'s parameters become lerp(theta_new, theta_m_now, alpha)
    (torchft's fragment_update_alpha): the new global weights at alpha = 0, exactly."""
    for p in params:
        for n, global_new in theta.items():
            local = p[n][0]
            if alpha == 0.0:
                local.copy_(global_new)
            else:
                local.copy_(torch.lerp(global_new.to(local.dtype), local, alpha))


def sync(
    cfg: TrainConfig,
    state: RunState,
    params: list[Params],
    stepped: list[bool],
    groups: Collectives | None = None,
) -> tuple[float, int]:
    """DiLoCo's sync of every parameter at once (take and land together; the replicas then restart
    from the global weights): the mean pseudo-gradient's norm and the replicas that took part."""
    groups = groups or ReplicaGroups(cfg.replicas)
    names = list(state.theta)
    pending = take(cfg, state, params, stepped, names, 0, state.next_update, groups)
    figures = land(cfg, state, pending, names, None, groups)
    return figures.delta_norm, figures.synced
