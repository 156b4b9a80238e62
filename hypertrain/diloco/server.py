"""The asynchronous server's step (docs/async.md): `AsyncServer.apply(theta, deltas, tokens)` steps the
global weights in place on one server update, the pseudo-gradients of the jobs it applies together
(flat fp32, replica order), by outer.async_rule: naive or delayed Nesterov (Liu et al. 2024).
`AsyncState` is the server and the jobs in flight: an asynchronous run's part of the run state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypertrain.config import OuterConfig
from hypertrain.diloco.outer import OuterState, outer_step, unflatten
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
    """The server's state beside the global weights: the outer momentum (`outer.momentum`, the run
    state's), and delayed Nesterov's buffer of pseudo-gradients (`buffer`, flat fp32) and the arrivals
    it holds (`count`)."""

    def __init__(self, cfg_outer: OuterConfig, replicas: int, outer: OuterState, n_params: int):
        self.cfg, self.outer = cfg_outer, outer
        self.N = cfg_outer.dn_buffer or replicas
        self.buffer = torch.zeros(n_params, dtype=torch.float32)
        self.count = 0

    @torch.no_grad()
    def apply(self, theta: Params, deltas: Tensor, tokens: list[int]) -> Tensor:
        """One server update of k = len(deltas) arrivals applied together (docs/async.md); returns their
        mean g (`contribution`), the pseudo-gradient the divergence guard weighs.

        naive: the outer Nesterov step (`outer.outer_step`) on their mean g.

        delayed_nesterov, Liu et al. 2024, Algorithm 3 (buffer N, activation c, momentum beta, lr eta),
        an update of k arrivals counting as k of its iterations: the buffer gains S = k g (line
        "Delta <- Delta + g_t"); when it holds N or more arrivals, the momentum takes their mean,
        `m <- beta m + Delta / n` (its "if t mod N = 0" branch), the weights step
        `theta <- theta - eta ((1 - c n_before) beta m + S / N)` (n_before: the arrivals already
        stepped with c, N - 1 for k = 1: the algorithm's `1 - cN + c`) and the buffer empties;
        otherwise `theta <- theta - eta (c k beta m + S / N)` (its "else" branch, k times). With k = 1 it
        is Algorithm 3; with one update of all N = R arrivals and c = 0 it is DiLoCo's Nesterov step."""
        total, mean = contribution(deltas, tokens, self.cfg.mean_weights)
        if self.cfg.async_rule == "naive":
            outer_step(self.cfg, theta, unflatten(mean, theta), self.outer)
            return mean
        k, before = len(deltas), self.count
        beta, c, lr = self.cfg.momentum, self.cfg.dn_activation, self.cfg.lr
        self.buffer.add_(total)
        self.count += k
        full = self.count >= self.N
        if full:
            buffered = unflatten(self.buffer / self.count, theta)
            for name, m in self.outer.momentum.items():
                m.mul_(beta).add_(buffered[name])
            weight = beta * (1.0 - c * before)
        else:
            weight = beta * c * k
        step = unflatten(total / self.N, theta)
        for name, t in theta.items():
            update = step[name].add(self.outer.momentum[name], alpha=weight)
            t.add_(update.to(t.dtype), alpha=-lr)
        if full:
            self.buffer.zero_()
            self.count = 0
        return mean

    def state_dict(self) -> dict:
        return {"buffer": self.buffer, "count": self.count}

    def load_state_dict(self, saved: dict) -> None:
        self.buffer.copy_(saved["buffer"])
        self.count = int(saved["count"])


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
