"""What every engine shares: a replica's work for a round in, its weights, state and losses out.

An engine is `train_replicas(cfg, theta, assigns, states, average=None, stop=None) ->
list[ReplicaResult]`: every replica in `assigns` starts from the global weights `theta` (or, in the
middle of a round, from its own `Assignment.start`), takes its inner steps on its own microbatches
and returns its weights, optimizer state and loss at every update it took. `stop(update)` is asked
after every update of the first replicas an engine runs (the same updates in every process); when
it says yes, every replica stops after that update, so all leave at the same update.
`microbatch_loss` is the loss every engine and the held-out eval weight the same way; `check_finite`
stops a round at the first non-finite loss or gradient. No engine imports another; each imports this
module, and `hypertrain.engines.engine_for` chooses one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor

from hypertrain.config import ModelConfig, TrainConfig
from hypertrain.data.batches import Microbatch, ReplicaBatch
from hypertrain.engines.compiled import forward_fn
from hypertrain.failures import NonFiniteError
from hypertrain.model.spec import model_spec
from hypertrain.model.transformer import Params, loss_channels
from hypertrain.optim.inner import OptState, lr_at


@dataclass
class Assignment:
    """A replica's work for (part of) a round: its batch at every update, where they start in the
    phase and in the round, and the weights it starts from when that is not the round's start."""

    replica: int
    global_step0: int  # the plan's 0-based update of batches[0]
    batches: list[ReplicaBatch]
    # batches[0]'s step within its round (the lr's re-warmup counts from it); with Streaming DiLoCo's
    # fragments one per fragment, each counted from that fragment's last sync
    inner_step0: int | tuple[int, ...] = 0
    start: Params | None = None  # [1, ...] weights the replica has reached; None = the global weights

    def lr(self, cfg: TrainConfig, t: int) -> float | tuple[float, ...]:
        """The inner learning rate of this assignment's update `t`; one per fragment where the
        fragments' re-warmups make them differ."""
        if isinstance(self.inner_step0, int):
            return lr_at(cfg.inner, self.global_step0 + t, self.inner_step0 + t)
        rates = tuple(lr_at(cfg.inner, self.global_step0 + t, k + t) for k in self.inner_step0)
        return rates[0] if len(set(rates)) == 1 else rates

    def first(self, updates: int) -> Assignment:
        """The same work cut to its first `updates` updates."""
        return replace(self, batches=self.batches[:updates])


@dataclass
class ReplicaResult:
    params: Params  # [1, ...] weights after the round
    state: OptState  # [1, ...] optimizer state after the round
    losses: list[float | None]  # loss at every update of the round; None = skipped (no ids)
    # Wall seconds of each update (forward, backward, gradient average, step; ended by the finite
    # check's host sync), and of its gradient average alone; shared by replicas stacked together.
    seconds: list[float] = field(default_factory=list)
    allreduce_seconds: list[float] = field(default_factory=list)
    # multistream: each update's per-channel token means (a list of C; None = skipped); [] otherwise
    channel_losses: list = field(default_factory=list)
    # mixture of experts: each update's router figures (model.spec.ROUTER_FIGURES: the token-weighted
    # load-balancing loss, the min and max fraction of tokens a layer sends to an expert; None =
    # skipped); [] otherwise
    routing: list = field(default_factory=list)

    @property
    def stepped(self) -> bool:
        return any(loss is not None for loss in self.losses)

    @classmethod
    def of(
        cls, model: ModelConfig, weights, state, losses, seconds, allreduce, channels, routing
    ) -> ReplicaResult:
        """A replica's result, its per-update channel losses and router figures kept only where the model
        `model` has them (multistream, a mixture of experts)."""
        spec = model_spec(model)
        multistream, experts = spec.loss_channels(model) > 0, bool(spec.router_figures())
        channels, routing = channels if multistream else [], routing if experts else []
        return cls(weights, state, losses, seconds, allreduce, channels, routing)


def check_finite(losses: Tensor, grad_norms: Tensor, grads: Params, replicas: list[int], update: int) -> None:
    """Raise NonFiniteError naming the first replica whose loss or gradient is not finite.

    `losses` and `grad_norms` are [R] for the replicas `replicas` (their global indices) at the plan's
    0-based `update`; `grads` [R, ...] name the tensor. One host sync per call: engines call it once per
    update, so a diverged run stops at the update it diverged, not after its round.
    """
    if bool(torch.isfinite(losses).all() & torch.isfinite(grad_norms).all()):
        return
    bad = (~torch.isfinite(losses)) | (~torch.isfinite(grad_norms))
    r = int(bad.nonzero()[0, 0])
    loss = float(losses[r])
    if not torch.isfinite(losses[r]):
        what = f"its loss is {loss}"
    else:
        name = next(n for n, g in grads.items() if not bool(torch.isfinite(g[r]).all()))
        what = f"the gradient of {name} is non-finite (loss {loss:.4f})"
    raise NonFiniteError(
        f"replica {replicas[r]} at update {update + 1}: {what}; the run stops before training on it"
    )


# In place: a replica's gradients and update statistics [local replicas, 1 + 2C] (its loss, its
# channel sums, its channel counts) averaged over its ranks (benchmark layout).
GradientAverage = Callable[[Params, Tensor], None]
# stop(update) -> True to end every replica's work after the plan's 0-based `update`.
StopAfter = Callable[[int], bool]


class Engine(Protocol):
    """How one process computes its replicas' inner steps (`loop.train_replicas`,
    `stacked.train_replicas`): the contract in this module's docstring."""

    def __call__(
        self,
        cfg: TrainConfig,
        theta: Params,
        assigns: list[Assignment],
        states: list[OptState],
        average_in_replica: GradientAverage | None = None,
        stop: StopAfter | None = None,
    ) -> list[ReplicaResult]:
        """One result per assignment, in order; `states` are updated in place."""
        ...


def in_lockstep(
    run_group: Callable, assigns: list, states: list, groups: list[slice], stop: StopAfter | None
) -> list[ReplicaResult]:
    """Run `run_group(assigns, states, stop)` for each slice of replicas in `groups`, one after another:
    the first may stop early (asking `stop`); the others are then cut to the updates it took, so every
    replica leaves at the same update. Returns the results of all, in order."""
    results: list[ReplicaResult] = []
    for part in groups:
        todo = assigns[part]
        if results:  # the first group decided how far this call goes
            todo = [a.first(len(results[0].losses)) for a in todo]
        results += run_group(todo, states[part], stop if not results else None)
    return results


def timed_average(average: GradientAverage | None, grads: Params, loss: Tensor) -> float:
    """Average a replica's gradients and loss over its ranks when `average` is given; its seconds."""
    if average is None:
        return 0.0
    start = time.perf_counter()
    average(grads, loss)
    return time.perf_counter() - start


def channel_means(sums: Tensor, counts: Tensor) -> Tensor:
    """Per-channel token means from sums and target counts (0 where a channel had no target)."""
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))


def gradients(params: Params) -> Params:
    """The accumulated gradients; zeros for a rank that had no ids while its replica did (it still
    takes part in its replica's average, with nothing to add)."""
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}


def microbatch_loss(cfg: TrainConfig, params: Params, mb: Microbatch) -> Tensor:
    """One replica's weighted loss on one microbatch: its share of the replica batch's token mean."""
    return microbatch_terms(cfg, params, mb)[0]


def microbatch_terms(cfg: TrainConfig, params: Params, mb: Microbatch) -> tuple[Tensor, Tensor]:
    """`microbatch_loss`, and the microbatch's per-channel sums of cross-entropy [C] (for the
    per-channel losses; C = 0 for one stream)."""
    out = microbatch_forward(cfg, params, mb)[0]
    return out[0] * mb.weight, out[1 : 1 + loss_channels(cfg.model)]


def microbatch_forward(cfg: TrainConfig, params: Params, mb: Microbatch) -> Tensor:
    """`model.forward` of one replica (params `[1, ...]`) on one microbatch: [1, 1 + C + M], the loss
    before the microbatch's weight, the channel sums and a mixture of experts' router columns."""
    device = torch.device(cfg.engine.device)
    tokens = mb.tokens.unsqueeze(0).to(device)
    mask = None if mb.mask is None else mb.mask.unsqueeze(0).to(device)
    weights = None if mb.channel_weights is None else mb.channel_weights.unsqueeze(0).to(device)
    return forward_fn(cfg.engine.compile)(cfg.model, params, tokens, mask, weights)
