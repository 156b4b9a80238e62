"""The reference engine: each replica's inner steps of one round, replica after replica.

`train_replicas(cfg, theta, assigns, states)` starts every replica from a fresh copy of the
global weights `theta`, runs its H (or fewer) inner steps on its own microbatches, and returns
per replica its weights, its optimizer state and its loss at every step (None where it had no
ids and skipped the step). Parameters and optimizer state carry a replica axis of size 1, so
the math is exactly the shared model and optimizer code the stacked engine runs with R > 1.
"""

from __future__ import annotations

import time

import torch

from hypertrain.compiled import inner_step_fn
from hypertrain.config import TrainConfig
from hypertrain.engines import (
    Assignment,
    GradientAverage,
    ReplicaResult,
    check_finite,
    gradients,
    microbatch_loss,
    timed_average,
)
from hypertrain.model import Params
from hypertrain.optim import OptState, lr_at


def train_replica(
    cfg: TrainConfig,
    theta: Params,
    assign: Assignment,
    state: OptState,
    average_in_replica: GradientAverage | None = None,
) -> ReplicaResult:
    """One replica's inner steps for one round (state is updated in place and returned)."""
    device = torch.device(cfg.engine.device)
    params = {n: t.detach().unsqueeze(0).clone().requires_grad_(True) for n, t in theta.items()}
    losses: list[float | None] = []
    seconds, allreduce = [0.0] * len(assign.batches), [0.0] * len(assign.batches)
    for t, batch in enumerate(assign.batches):
        if batch.empty:
            losses.append(None)
            continue
        start = time.perf_counter()
        loss = torch.zeros((), device=device)
        for mb in batch.microbatches:
            part = microbatch_loss(cfg, params, mb)
            part.backward()
            loss += part.detach()
        grads = gradients(params)
        allreduce[t] = timed_average(average_in_replica, grads, loss.view(1))
        lr = lr_at(cfg.inner, assign.global_step0 + t, t)
        norms = inner_step_fn(cfg.engine.compile)(cfg.inner, params, grads, state, lr)
        check_finite(loss.view(1), norms, grads, [assign.replica], assign.global_step0 + t)
        for p in params.values():
            p.grad = None
        losses.append(loss.item())
        seconds[t] = time.perf_counter() - start
    return ReplicaResult({n: p.detach() for n, p in params.items()}, state, losses, seconds, allreduce)


def train_replicas(
    cfg: TrainConfig,
    theta: Params,
    assigns: list[Assignment],
    states: list[OptState],
    average_in_replica: GradientAverage | None = None,
) -> list[ReplicaResult]:
    """Every replica's round, one after another (the reference for the stacked engine)."""
    return [train_replica(cfg, theta, a, s, average_in_replica) for a, s in zip(assigns, states, strict=True)]
