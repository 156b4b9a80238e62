"""The reference engine: each replica's inner steps of one round, replica after replica.

`train_replicas(cfg, theta, assigns, states)` starts every replica from a fresh copy of the
global weights `theta`, runs its H (or fewer) inner steps on its own microbatches, and returns
per replica its weights, its optimizer state and its loss at every step (None where it had no
ids and skipped the step). Parameters and optimizer state carry a replica axis of size 1, so
the math is exactly the shared model and optimizer code the stacked engine runs with R > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hypertrain.batches import Microbatch, ReplicaBatch
from hypertrain.compiled import forward_fn, inner_step_fn
from hypertrain.config import TrainConfig
from hypertrain.model import Params
from hypertrain.optim import OptState, lr_at


@dataclass
class Assignment:
    """A replica's work for one round: its batch at every update, and the round's first update."""

    replica: int
    global_step0: int
    batches: list[ReplicaBatch]


@dataclass
class ReplicaResult:
    params: Params  # [1, ...] weights after the round
    state: OptState  # [1, ...] optimizer state after the round
    losses: list[float | None]  # loss at every update of the round; None = skipped (no ids)

    @property
    def stepped(self) -> bool:
        return any(loss is not None for loss in self.losses)


def microbatch_loss(cfg: TrainConfig, params: Params, mb: Microbatch) -> Tensor:
    """One replica's weighted loss on one microbatch: its share of the replica batch's token mean."""
    device = torch.device(cfg.engine.device)
    tokens = mb.tokens.unsqueeze(0).to(device)
    mask = None if mb.mask is None else mb.mask.unsqueeze(0).to(device)
    return forward_fn(cfg.engine.compile)(cfg.model, params, tokens, mask)[0] * mb.weight


def train_replica(cfg: TrainConfig, theta: Params, assign: Assignment, state: OptState) -> ReplicaResult:
    """One replica's inner steps for one round (state is updated in place and returned)."""
    device = torch.device(cfg.engine.device)
    params = {n: t.detach().unsqueeze(0).clone().requires_grad_(True) for n, t in theta.items()}
    losses: list[float | None] = []
    for t, batch in enumerate(assign.batches):
        if batch.empty:
            losses.append(None)
            continue
        loss = torch.zeros((), device=device)
        for mb in batch.microbatches:
            part = microbatch_loss(cfg, params, mb)
            part.backward()
            loss += part.detach()
        grads = {n: p.grad for n, p in params.items()}
        lr = lr_at(cfg.inner, assign.global_step0 + t, t)
        inner_step_fn(cfg.engine.compile)(cfg.inner, params, grads, state, lr)
        for p in params.values():
            p.grad = None
        losses.append(loss.item())
    return ReplicaResult({n: p.detach() for n, p in params.items()}, state, losses)


def train_replicas(
    cfg: TrainConfig, theta: Params, assigns: list[Assignment], states: list[OptState]
) -> list[ReplicaResult]:
    """Every replica's round, one after another (the reference for the stacked engine)."""
    return [train_replica(cfg, theta, a, s) for a, s in zip(assigns, states, strict=True)]
