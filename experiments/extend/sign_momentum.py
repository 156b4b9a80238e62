"""Signum (Bernstein et al. 2018, "signSGD: Compressed Optimisation for Non-Convex Problems",
arXiv:1802.04434, Algorithm 3) as an outer optimizer that lives outside the package: a plain
torch.optim.Optimizer subclass, named on the command line by its import path (docs/extending.md).

Per parameter: m = beta m + (1 - beta) g (m starts at 0), then x = x - lr sign(m). The run hands it the
mean pseudo-gradient as `.grad` and calls `step()`; its state (`momentum_buffer`) is saved in every
checkpoint by the run, as any torch optimizer's `state_dict()`.
"""

from __future__ import annotations

import torch


class SignMomentum(torch.optim.Optimizer):
    """Signum: the sign of an exponential moving average of the gradient, times lr."""

    def __init__(self, params, lr: float, beta: float = 0.9):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta={beta} is not in [0, 1)")
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                m = state["momentum_buffer"]
                m.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(torch.sign(m), alpha=-group["lr"])
        return None
