"""The asynchronous server's step (docs/async.md): `AsyncServer.apply(theta, deltas, tokens)` steps the
global weights in place on one server update, the pseudo-gradients of the jobs it applies together
(flat fp32, replica order), by outer.arrivals.rule: naive (outer.optimizer's step on their mean) or delayed
Nesterov (Liu et al. 2024), the outer optimizers' table's (`optim.outer`) steps.
`AsyncState` is the server and the jobs in flight: an asynchronous run's part of the run state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypertrain.config import OuterConfig
from hypertrain.diloco.outer import OuterStep
from hypertrain.model.transformer import Params


def contribution(deltas: Tensor, tokens: list[int], weights: str) -> tuple[Tensor, Tensor]:
    """(S, g): the k pseudo-gradients `deltas` [k, n] applied together as k arrivals' worth, S = k * g,
    and their mean g: uniform, `S = sum_i delta_i` and `g = S / k` (DiLoCo's sum and division); tokens,
    `g = sum_i w_i delta_i / sum_i w_i` with w_i a job's training tokens (uniform when they sum to 0), and
    `S = k * g`."""
    k = len(deltas)
    w = token_weights(tokens, weights, deltas.dtype)
    if w is None:
        total = deltas.sum(0)
        return total, total / torch.tensor(float(k), dtype=total.dtype)
    mean = (w[:, None] * deltas).sum(0)
    return mean * k, mean


def token_weights(tokens: list[int], weights: str, dtype: torch.dtype) -> Tensor | None:
    """outer.mean_weights' weights of the pseudo-gradients whose trainers trained on `tokens`:
    `w_i / sum_j w_j` (formed in float64, then `dtype`) with w_i the tokens, so `g = sum_i w_i delta_i`;
    None for uniform (outer.mean_weights=uniform, or no tokens to weigh by: every one empty). The one
    rule of asynchronous updates (`contribution`) and of synchronous rounds (`diloco.sync`)."""
    if weights == "uniform" or not sum(tokens):
        return None
    w = torch.tensor(tokens, dtype=torch.float64)
    return (w / w.sum()).to(dtype)


class AsyncServer:
    """The server's step beside the global weights: the run's outer optimizer over the whole model
    (`rule`, a `optim.outer_steps.OuterStep` of the table `optim.outer`: delayed Nesterov with its buffer, or
    under the naive rule outer.optimizer's own step); its state is what the server saves."""

    def __init__(self, cfg_outer: OuterConfig, rule: OuterStep):
        self.cfg, self.rule = cfg_outer, rule

    @torch.no_grad()
    def apply(self, theta: Params, deltas: Tensor, tokens: list[int]) -> Tensor:
        """One server update of k = len(deltas) arrivals applied together (docs/async.md) to the global
        weights `theta` (the rule's own); returns their mean g (`contribution`), the pseudo-gradient the
        divergence guard weighs. naive: the outer optimizer's step on g; delayed_nesterov: its buffer
        gains their sum S = k g (`optim.outer_steps.DelayedNesterovStep.arrive`)."""
        total, mean = contribution(deltas, tokens, self.cfg.mean_weights)
        self.rule.arrive(total, mean, len(deltas))
        return mean

    def state_dict(self) -> dict:
        """The rule's state: delayed Nesterov's buffer and count, a torch optimizer's state_dict(), {}
        for the built-in's naive step (its momentum is the run state's)."""
        return self.rule.state_dict() or {}

    def load_state_dict(self, saved: dict) -> None:
        """`saved` into the rule (a checkpoint of the naive built-in written before this held a buffer it
        never read: nothing to put back)."""
        self.rule.load_state_dict(saved)


class AsyncState:
    """What an asynchronous run holds beside the global weights and the replicas' inner states: the
    server's buffer (`server`), the server updates applied (`applied`), and each replica's job in flight
    (computed when it pulled): its pseudo-gradient (flat fp32) and its losses."""

    def __init__(self, server: AsyncServer):
        self.server, self.applied = server, 0
        self.flying: dict[int, dict] = {}

    def state_dict(self, flying: dict[int, dict] | None = None) -> dict:
        """With `flying` (every replica's job in flight, gathered from the processes that ran them) it
        holds the run's jobs, else this process's."""
        flying = self.flying if flying is None else flying
        flying = [{"replica": m, **job} for m, job in sorted(flying.items())]
        return {"server": self.server.state_dict(), "applied": self.applied, "flying": flying}

    def load_state_dict(self, saved: dict, replicas: list[int] | None = None) -> None:
        """`saved` in place; with `replicas`, the jobs in flight of those only (this process's)."""
        self.server.load_state_dict(saved["server"])
        self.applied = int(saved["applied"])
        self.flying = {
            int(job["replica"]): {
                "delta": job["delta"].clone(),
                "losses": list(job["losses"]),
            }
            for job in saved["flying"]
            if replicas is None or int(job["replica"]) in replicas
        }
