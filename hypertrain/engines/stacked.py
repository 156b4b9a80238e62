"""The fast engine: all replicas of a sub-round as one stacked model, params `[R, ...]`.

Same contract (`hypertrain.engines`) and math as the loop engine (`hypertrain.loop`): the same
`model.forward` and `optim.inner_step`, run once for the replicas of a sub-round instead of once
per replica. One forward and one backward per microbatch serve every stacked replica; the loss is each
replica's weighted mean, summed over replicas (never averaged: that would shrink gradients and
change clipping). Replicas with fewer rows or microbatches get masked rows; variable-length
microbatches are padded to their longest row across the replicas and cut to stay within
`data.max_padded_tokens` per replica; a replica with no ids in an update is masked out of that
optimizer step. Losses come back to the host once per sub-round. A mixture of experts' replicas
are stacked alike (expert weights `[R, E, d, f]`, routed together: `model.moe`). Reduction shapes
differ from the loop, so results agree within float rounding, not always bitwise (docs/parity.md).
"""

from __future__ import annotations

import time

import torch

from hypertrain.config import TrainConfig
from hypertrain.data import data_source
from hypertrain.data.batches import stack_microbatches, stacked_channel_counts, stacked_microbatches
from hypertrain.engines.compiled import forward_fn, inner_step_fn
from hypertrain.engines.contract import (
    Assignment,
    GradientAverage,
    ReplicaResult,
    StopAfter,
    channel_means,
    check_finite,
    gradients,
    in_lockstep,
    timed_average,
)
from hypertrain.model.moe import router_figures, weigh
from hypertrain.model.spec import model_spec
from hypertrain.model.transformer import Params, loss_channels, objective, router_columns
from hypertrain.optim.inner import OptState


def _stack_states(states: list[OptState]) -> OptState:
    return OptState(
        {n: torch.cat([s.m[n] for s in states]) for n in states[0].m},
        {n: torch.cat([s.v[n] for s in states]) for n in states[0].v},
        torch.cat([s.step for s in states]),
        states[0].fragment_of,
    )


def _replica_state(state: OptState, r: int) -> OptState:
    return OptState(
        {n: t[r : r + 1].clone() for n, t in state.m.items()},
        {n: t[r : r + 1].clone() for n, t in state.v.items()},
        state.step[r : r + 1].clone(),
        state.fragment_of,
    )


def train_many(
    cfg: TrainConfig,
    theta: Params,
    assigns: list[Assignment],
    states: list[OptState],
    average_in_replica: GradientAverage | None = None,
    stop: StopAfter | None = None,
) -> list[ReplicaResult]:
    """The inner steps of the replicas in `assigns`, stacked (one sub-round); they end together after
    the update at which `stop` says so."""
    device = torch.device(cfg.engine.device)
    spans = {(a.global_step0, a.inner_step0, len(a.batches)) for a in assigns}
    if len(spans) != 1:
        raise ValueError(
            "engine=stacked: the replicas of a sub-round must share the round's updates "
            f"((first update, step in round, updates): {sorted(spans)})"
        )
    if len(states) != len(assigns):
        raise ValueError(f"engine=stacked: {len(assigns)} assignments but {len(states)} optimizer states")
    R, steps = len(assigns), len(assigns[0].batches)
    if assigns[0].start is None:  # a round's start: every replica from the global weights
        begin = {n: t.detach().unsqueeze(0).expand(R, *t.shape) for n, t in theta.items()}
    else:  # mid-round: each from the weights it reached
        begin = {n: torch.cat([a.start[n] for a in assigns]) for n in theta}
    params = {n: t.clone().requires_grad_(True) for n, t in begin.items()}
    state = _stack_states(states)
    forward, inner_step = forward_fn(cfg.engine.compile), inner_step_fn(cfg.engine.compile)
    losses = torch.zeros(steps, R, device=device)
    # Per update and replica, each channel's token mean (filled by _update; C = 0 for one stream).
    C = loss_channels(cfg.model)
    channels = torch.zeros(steps, R, C, dtype=torch.float64, device=device)
    # Per update and replica, a mixture of experts' router figures (none for a dense model).
    figures = len(model_spec(cfg.model).router_figures())
    routing = torch.zeros(steps, R, figures, dtype=torch.float64)
    routing = routing.to(device)
    stepped = torch.zeros(steps, R, dtype=torch.bool)
    seconds, allreduce = [0.0] * steps, [0.0] * steps
    for t in range(steps):
        batches = [a.batches[t] for a in assigns]
        active = [not b.empty for b in batches]
        if any(active):
            seconds[t], allreduce[t] = _update(
                cfg,
                assigns,
                t,
                params,
                state,
                (forward, inner_step),
                active,
                (losses, channels, routing),
                average_in_replica,
            )
            stepped[t] = torch.tensor(active)
        if stop is not None and stop(assigns[0].global_step0 + t):
            steps = t + 1
            break
    host_losses = losses.cpu().tolist()  # the sub-round's one device-to-host copy (two: multistream, MoE)
    host_channels = channels.cpu().tolist() if C else None
    host_routing = routing.cpu().tolist() if figures else None
    # One timing list shared by the stacked replicas (throughput.process_table counts it once).
    seconds, allreduce = seconds[:steps], allreduce[:steps]
    return [
        ReplicaResult(
            {n: p[r : r + 1].detach().clone() for n, p in params.items()},
            _replica_state(state, r),
            [host_losses[t][r] if stepped[t, r] else None for t in range(steps)],
            seconds,
            allreduce,
            [host_channels[t][r] if stepped[t, r] else None for t in range(steps)] if C else [],
            [host_routing[t][r] if stepped[t, r] else None for t in range(steps)] if host_routing else [],
        )
        for r in range(R)
    ]


def _update(cfg, assigns, t, params, state, fns, active, records, average_in_replica) -> tuple[float, float]:
    """Update `t` of the stacked replicas, in place; (its seconds, its gradient average's seconds).
    `records` are the losses [steps, R], the channel means [steps, R, C] and a mixture's router
    figures [steps, R, 3] to fill."""
    forward, inner_step = fns
    losses, channels, routing = records
    device = losses.device
    M = router_columns(cfg.model)
    bound = cfg.data.max_padded_tokens if data_source(cfg.data).variable_length(cfg.data) else 0
    batches = [a.batches[t] for a in assigns]
    start = time.perf_counter()
    C = channels.shape[-1]
    sums = counts = None
    router = torch.zeros(len(batches), M, device=device)
    for parts in stacked_microbatches(batches, bound):
        tokens, mask, weights, channel_weights = stack_microbatches(parts, device)
        out = forward(cfg.model, params, tokens, mask, channel_weights)  # [R, 1 + C + M]
        (objective(cfg.model, out) * weights).sum().backward()
        losses[t] += out[:, 0].detach() * weights
        sums = out[:, 1 : 1 + C].detach() + (0 if sums is None else sums)
        counts = stacked_channel_counts(parts, device) + (0 if counts is None else counts)
        if M:
            router += weigh(out[:, 1 + C :].detach(), weights)
    if sums is None:  # a rank without ids in its replicas' update adds nothing, in the same shape
        sums = counts = torch.zeros(len(batches), C, device=device)
    grads = gradients(params)
    # The replica's ranks average the channel sums and counts with the loss (ratios unchanged), and a
    # mixture's router columns (its weighted loss becomes the replica's, its counts keep their ratios).
    parts = [losses[t].unsqueeze(1), sums, counts, router]
    stats = torch.cat([x.to(losses.dtype) for x in parts], dim=1)
    allreduce = timed_average(average_in_replica, grads, stats)
    losses[t] = stats[:, 0]
    channels[t] = channel_means(stats[:, 1 : 1 + C].double(), stats[:, 1 + C : 1 + 2 * C].double())
    if M:
        routing[t] = router_figures(stats[:, 1 + 2 * C :].double(), cfg.model.n_layers, cfg.model.n_experts)
    # The mask costs a copy of the state: pass it only when some replica sits this step out.
    mask = None if all(active) else torch.tensor(active, device=device)
    norms = inner_step(cfg.inner, params, grads, state, assigns[0].lr(cfg, t), active=mask)
    # A skipped replica's gradient is zero and its loss 0, so only real steps can trip the check.
    check_finite(losses[t], norms, grads, [a.replica for a in assigns], assigns[0].global_step0 + t)
    for p in params.values():
        p.grad = None
    return time.perf_counter() - start, allreduce  # check_finite synced with the device


def train_replicas(
    cfg: TrainConfig,
    theta: Params,
    assigns: list[Assignment],
    states: list[OptState],
    average_in_replica: GradientAverage | None = None,
    stop: StopAfter | None = None,
) -> list[ReplicaResult]:
    """Every replica's updates, `engine.stack` replicas at a time (0 = all at once); the first
    sub-round asks `stop`, the others take as many updates as it did."""
    size = cfg.engine.stack or len(assigns)

    def group(todo: list[Assignment], kept: list[OptState], asking: StopAfter | None) -> list[ReplicaResult]:
        return train_many(cfg, theta, todo, kept, average_in_replica, asking)

    parts = [slice(start, start + size) for start in range(0, len(assigns), size)]
    return in_lockstep(group, assigns, states, parts, stop)
