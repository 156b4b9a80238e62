"""The reference engine: each replica's inner steps of one round, replica after replica.

`train_replicas(cfg, theta, assigns, states, average, stop)` starts every replica from a fresh
copy of the global weights `theta` (or of its `Assignment.start` mid-round), runs its inner steps
on its own microbatches, and returns per replica its weights, its optimizer state and its loss at
every step (None where it had no ids and skipped the step), and a mixture of experts' router
figures (`model.spec.ROUTER_FIGURES`). The first replica asks `stop` after
every update; the others then take as many updates as it did. Parameters and optimizer state
carry a replica axis of size 1, so the math is exactly the shared model and optimizer code the
stacked engine runs with R > 1.
"""

from __future__ import annotations

import time

import torch

from hypertrain.config import TrainConfig
from hypertrain.engines.compiled import inner_step_fn
from hypertrain.engines.contract import (
    Assignment,
    GradientAverage,
    ReplicaResult,
    StopAfter,
    channel_means,
    check_finite,
    gradients,
    in_lockstep,
    microbatch_forward,
    timed_average,
)
from hypertrain.model.moe import router_figures, weigh
from hypertrain.model.transformer import Params, loss_channels, objective, router_columns
from hypertrain.optim.inner import OptState


def train_replica(
    cfg: TrainConfig,
    theta: Params,
    assign: Assignment,
    state: OptState,
    average_in_replica: GradientAverage | None = None,
    stop: StopAfter | None = None,
) -> ReplicaResult:
    """One replica's inner steps (state is updated in place and returned); it ends after the update
    at which `stop` says so."""
    device = torch.device(cfg.engine.device)
    begin = theta if assign.start is None else {n: t[0] for n, t in assign.start.items()}
    params = {n: t.detach().unsqueeze(0).clone().requires_grad_(True) for n, t in begin.items()}
    losses: list[float | None] = []
    seconds, allreduce, channels, routing = [], [], [], []
    for t in range(len(assign.batches)):
        loss, seconds_t, allreduce_t, channel_t, routing_t = _update(
            cfg, assign, t, params, state, average_in_replica, device
        )
        losses.append(loss)
        seconds.append(seconds_t)
        allreduce.append(allreduce_t)
        channels.append(channel_t)
        routing.append(routing_t)
        if stop is not None and stop(assign.global_step0 + t):
            break
    weights = {n: p.detach() for n, p in params.items()}
    return ReplicaResult.of(cfg.model, weights, state, losses, seconds, allreduce, channels, routing)


def _update(cfg, assign: Assignment, t: int, params: Params, state: OptState, average, device):
    """The replica's update `t`: (loss or None when it had no ids, seconds, gradient-average seconds,
    the per-channel token means: C of them, none for one stream; a mixture of experts' router figures)."""
    batch = assign.batches[t]
    if batch.empty:
        return None, 0.0, 0.0, None, None
    start = time.perf_counter()
    C, M = loss_channels(cfg.model), router_columns(cfg.model)
    loss, router = torch.zeros((), device=device), torch.zeros(M, device=device)
    sums = counts = None
    for mb in batch.microbatches:
        out = microbatch_forward(cfg, params, mb)  # [1, 1 + C + M]
        (objective(cfg.model, out)[0] * mb.weight).backward()
        loss += out[0, 0].detach() * mb.weight
        sums = out[0, 1 : 1 + C].detach() + (0 if sums is None else sums)
        counts = mb.channel_counts.to(device) + (0 if counts is None else counts)
        if M:
            router += weigh(out[:, 1 + C :].detach(), torch.full((1,), mb.weight, device=device))[0]
    if sums is None:  # a rank without ids in its replica's update adds nothing, in the same shape
        sums = counts = torch.zeros(C, device=device)
    grads = gradients(params)
    # The replica's ranks average the channel sums and counts with the loss (ratios unchanged), and a
    # mixture's router columns (its weighted loss becomes the replica's, its counts keep their ratios).
    parts = [loss.view(1), sums, counts, router]
    stats = torch.cat([x.to(loss.dtype) for x in parts]).view(1, -1)
    allreduce = timed_average(average, grads, stats)
    loss, sums, counts = stats[0, 0], stats[0, 1 : 1 + C], stats[0, 1 + C : 1 + 2 * C]
    norms = inner_step_fn(cfg.engine.compile)(cfg.inner, params, grads, state, assign.lr(cfg, t))
    check_finite(loss.view(1), norms, grads, [assign.replica], assign.global_step0 + t)
    for p in params.values():
        p.grad = None
    figures = None
    if M:
        columns = stats[:, 1 + 2 * C :].double()
        figures = router_figures(columns, cfg.model.n_layers, cfg.model.n_experts)[0].tolist()
    return (
        loss.item(),
        time.perf_counter() - start,
        allreduce,
        channel_means(sums.double(), counts.double()).tolist(),
        figures,
    )


def train_replicas(
    cfg: TrainConfig,
    theta: Params,
    assigns: list[Assignment],
    states: list[OptState],
    average_in_replica: GradientAverage | None = None,
    stop: StopAfter | None = None,
) -> list[ReplicaResult]:
    """Every replica's updates, one replica after another (the reference for the stacked engine)."""

    def one(todo: list[Assignment], kept: list[OptState], asking: StopAfter | None) -> list[ReplicaResult]:
        return [train_replica(cfg, theta, todo[0], kept[0], average_in_replica, asking)]

    return in_lockstep(one, assigns, states, [slice(i, i + 1) for i in range(len(assigns))], stop)
