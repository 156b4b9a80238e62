"""The outer optimizers' steps, each an `OuterStep` over some global weights that it moves in place:
`NesterovStep`, the built-in (`outer_step`), `DelayedNesterovStep` (the asynchronous server's rule) and
`TorchStep` (any torch.optim.Optimizer); the table `optim.outer` builds them (docs/concepts.md, "The
outer optimizer").

`outer_step` is torch.optim.SGD's (Nesterov) momentum, DiLoCo's choice (Douillard et al. 2023,
arXiv:2311.08105, Algorithm 1, line 12), written out here rather than as torch.optim.SGD: SGD's first
step clones the gradient into its buffer where ours adds it to a zero buffer, so a -0.0 of the
pseudo-gradient is kept as -0.0 in SGD's buffer and +0.0 in ours (the weights are bitwise equal, the
checkpoint's `outer_momentum` is not); and SGD keeps its buffer in the weights' dtype and its state keyed
by parameter, where ours is fp32 and keyed by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hypertrain.config import OuterConfig
from hypertrain.model.transformer import Params


@dataclass
class OuterState:
    """Outer momentum buffer per param, fp32, shaped like the global params (no replica axis)."""

    momentum: Params


def init_outer_state(global_params: Params) -> OuterState:
    return OuterState({n: torch.zeros_like(p, dtype=torch.float32) for n, p in global_params.items()})


def unflatten(flat: Tensor, like: Params) -> Params:
    """A flat vector in `like`'s order -> tensors shaped like `like`'s (views of `flat`)."""
    out, start = {}, 0
    for name, t in like.items():
        out[name] = flat[start : start + t.numel()].view(t.shape)
        start += t.numel()
    return out


@torch.no_grad()
def outer_step(outer: OuterConfig, global_params: Params, mean_delta: Params, state: OuterState) -> None:
    """theta_global -= lr * update, in place, with torch.optim.SGD's momentum semantics.

    buf = momentum * buf + delta (buf starts at zero, so the first step gives buf = delta as torch);
    update = delta + momentum * buf with Nesterov, else buf. lr 1, momentum 0 is plain averaging.
    """
    for name, theta in global_params.items():
        delta = mean_delta[name].float()
        buf = state.momentum[name]
        buf.mul_(outer.momentum).add_(delta)
        update = delta.add(buf, alpha=outer.momentum) if outer.nesterov else buf
        theta.add_(update.to(theta.dtype), alpha=-outer.lr)


class OuterStep:
    """An outer optimizer built over some global weights `theta` (views: a fragment's, under eager a
    replica's own, or the whole model's for the asynchronous server), which it moves in place.

    `step(mean)`: one outer step on the mean pseudo-gradient (shaped like `theta`). `arrive(total,
    mean, k)`: an asynchronous server update of k arrivals (flat fp32: their sum and mean), by default
    the naive rule, a step on their mean. `state_dict()`: its own state beside the run state's outer
    momentum, what a checkpoint saves (None: it keeps none); `load_state_dict` puts it back."""

    def __init__(self, theta: Params):
        self.theta = theta

    def step(self, mean: Params) -> None:
        raise NotImplementedError

    def arrive(self, total: Tensor, mean: Tensor, k: int) -> None:
        self.step(unflatten(mean, self.theta))

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, saved: dict | None) -> None:
        """Nothing to restore: the built-ins' momentum is the run state's (`outer_momentum`)."""


class NesterovStep(OuterStep):
    """The built-in: `outer_step` with the momentum buffers `momentum` (views of the run state's)."""

    def __init__(self, outer: OuterConfig, theta: Params, momentum: Params):
        super().__init__(theta)
        self.outer, self.momentum = outer, OuterState(momentum)

    def step(self, mean: Params) -> None:
        outer_step(self.outer, self.theta, mean, self.momentum)


class DelayedNesterovStep(OuterStep):
    """The asynchronous server's delayed Nesterov (Liu et al. 2024, Algorithm 3; docs/async.md): the
    momentum `momentum` (the run state's) is updated once per N arrivals from its buffer of
    pseudo-gradients (`buffer`, flat fp32) and the arrivals it holds (`count`); its state (saved as the
    asynchronous server's) is the buffer and the count."""

    def __init__(self, outer: OuterConfig, theta: Params, momentum: Params, replicas: int):
        super().__init__(theta)
        self.outer, self.momentum = outer, momentum
        self.N = outer.arrivals.dn_buffer or replicas
        n_params = sum(t.numel() for t in theta.values())
        self.buffer = torch.zeros(n_params, dtype=torch.float32)
        self.count = 0

    @torch.no_grad()
    def arrive(self, total: Tensor, mean: Tensor, k: int) -> None:
        """An update of k arrivals counting as k of the algorithm's iterations (buffer N, activation c,
        momentum beta, lr eta): the buffer gains S = k g (line "Delta <- Delta + g_t"); when it holds N
        or more arrivals, the momentum takes their mean, `m <- beta m + Delta / n` (its "if t mod N = 0"
        branch), the weights step `theta <- theta - eta ((1 - c n_before) beta m + S / N)` (n_before: the
        arrivals already stepped with c, N - 1 for k = 1: the algorithm's `1 - cN + c`) and the buffer
        empties; otherwise `theta <- theta - eta (c k beta m + S / N)` (its "else" branch, k times). With
        k = 1 it is Algorithm 3; with one update of all N = R arrivals and c = 0 it is DiLoCo's Nesterov
        step."""
        theta, before = self.theta, self.count
        beta, c, lr = self.outer.momentum, self.outer.arrivals.dn_activation, self.outer.lr
        self.buffer.add_(total)
        self.count += k
        full = self.count >= self.N
        if full:
            buffered = unflatten(self.buffer / self.count, theta)
            for name, m in self.momentum.items():
                m.mul_(beta).add_(buffered[name])
            weight = beta * (1.0 - c * before)
        else:
            weight = beta * c * k
        step = unflatten(total / self.N, theta)
        for name, t in theta.items():
            update = step[name].add(self.momentum[name], alpha=weight)
            t.add_(update.to(t.dtype), alpha=-lr)
        if full:
            self.buffer.zero_()
            self.count = 0

    def state_dict(self) -> dict:
        return {"buffer": self.buffer, "count": self.count}

    def load_state_dict(self, saved: dict) -> None:
        self.buffer.copy_(saved["buffer"])
        self.count = int(saved["count"])


class TorchStep(OuterStep):
    """A torch.optim.Optimizer over `theta` (class `cls`, lr `lr`, keyword arguments `args`): the mean
    pseudo-gradient is handed over as the parameters' `.grad` (torchft's convention; a copy, so the
    optimizer cannot change the mean the guard and the rows read), then `.step()`; the gradients are
    dropped after. Its state is the optimizer's `state_dict()`."""

    def __init__(self, cls, lr: float, args: dict, theta: Params):
        super().__init__(theta)
        self.optimizer = cls(list(theta.values()), lr=lr, **args)

    @torch.no_grad()
    def step(self, mean: Params) -> None:
        for name, p in self.theta.items():
            p.grad = mean[name].to(p.dtype, copy=True)
        self.optimizer.step()
        for p in self.theta.values():
            p.grad = None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, saved: dict) -> None:
        """`saved` copied in: torch's `load_state_dict` keeps the tensors it is given where their dtype
        and device already fit, and two runs (or a run and the payload it was read from) must not share
        an optimizer's state."""
        self.optimizer.load_state_dict(_cloned(saved))


def _cloned(tree):
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_cloned(v) for v in tree)
    return tree.clone() if torch.is_tensor(tree) else tree
