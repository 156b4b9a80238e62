"""The two hot functions of an inner step, eager or `torch.compile`d (`engine.compile`).

`forward_fn(enabled)` is `model.forward` (the loss; autograd then runs the compiled backward too)
and `inner_step_fn(enabled)` is `optim.inner_step`, either as written or compiled once per process
with inductor. Both engines call them, so `engine=loop` and `engine=stacked` compile the same code.
Compiled results agree with eager ones within float rounding, not bitwise (inductor fuses the
elementwise work between matmuls and reorders its arithmetic). The first calls pay the
compilation (about a minute on a 2-core CPU with an empty inductor cache); a changed shape
(another sub-round size, a tail update, variable-length documents) compiles once more, after
which torch treats that dimension as dynamic instead of compiling per size; the learning rate
enters as a tensor, so it never recompiles. torch falls back to eager, with a warning, past its
recompile limit. A mixture of experts' forward breaks its graph at each layer's group size, which
is data (`model.moe`); the rest of it compiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hypertrain.model.transformer import forward
from hypertrain.optim.inner import inner_step


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


def forward_fn(enabled: bool) -> Callable:
    """`model.forward`, or its one compiled form in this process when `enabled`."""
    return _compiled(forward) if enabled else forward


@functools.cache  # one wrapper per process, not a new closure at every step
def inner_step_fn(enabled: bool) -> Callable:
    """`optim.inner_step`, or its one compiled form in this process when `enabled` (which takes the
    learning rate as a 0-d float64 tensor, a graph input, so a new rate needs no new graph)."""
    if not enabled:
        return inner_step
    compiled = _compiled(inner_step)

    def step(inner, params, grads, state, lr, active=None):
        return compiled(inner, params, grads, state, torch.tensor(lr, dtype=torch.float64), active)

    return step
