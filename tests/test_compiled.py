"""engine.compile: the compiled loss and inner step agree with eager ones within float rounding.

Slow (each test compiles with inductor, ~10-30 s on a CPU). The compiled runs must really be
compiled (dynamo's graph counter moves) and must not recompile for every learning rate.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_stacked import cfg_for, run_rounds
from torch._dynamo.utils import counters

from hypertrain import loop
from hypertrain.compiled import inner_step_fn
from hypertrain.config import InnerConfig, ModelConfig
from hypertrain.model import init_params
from hypertrain.optim import init_state, inner_step
from hypertrain.sim import batched

NO_COMPILER = shutil.which(os.environ.get("CXX", "g++")) is None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(NO_COMPILER, reason="torch.compile's inductor needs a C++ compiler"),
]


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_compiled_inner_step_equals_eager_for_every_learning_rate_without_recompiling(optimizer):
    torch._dynamo.reset()
    inner = InnerConfig(name=optimizer, wd=0.1, grad_clip=1.0)
    m = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2)
    eager = {n: t.expand(3, *t.shape).clone() for n, t in init_params(m, 0).items()}
    compiled = {n: t.clone() for n, t in eager.items()}
    eager_state, compiled_state = init_state(inner, eager), init_state(inner, compiled)
    step = inner_step_fn(True)
    gen = torch.Generator().manual_seed(0)
    before_graphs = compiled_graphs()
    for i, lr in enumerate([1e-4, 3e-4, 5e-4, 2e-4, 7e-4]):
        grads = {n: torch.randn(t.shape, generator=gen) * 0.01 for n, t in eager.items()}
        start = {n: t.clone() for n, t in eager.items()}
        inner_step(inner, eager, grads, eager_state, lr)
        step(inner, compiled, grads, compiled_state, lr)
        for n in eager:
            # Update sizes are ~lr; weight decay's factor 1 - lr*wd rounded differently (float64
            # against float32) would move them by ~1e-3 of their size, far past this bound.
            want, got = eager[n] - start[n], compiled[n] - start[n]
            assert (got - want).norm() <= 1e-5 * want.norm(), (i, n)
            compiled[n].copy_(eager[n])  # restart every step from equal weights and state
            compiled_state.m[n].copy_(eager_state.m[n])
            if n in eager_state.v:
                compiled_state.v[n].copy_(eager_state.v[n])
    assert compiled_graphs() - before_graphs == 1  # one graph for all five learning rates


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_compiled_stacked_engine_agrees_with_the_eager_loop(optimizer):
    torch._dynamo.reset()
    eager_cfg = cfg_for(3, 3, 0, name=optimizer)  # warmup then cosine: the lr changes every step
    compiled_cfg = replace(eager_cfg, engine=replace(eager_cfg.engine, compile=True))
    ref_losses, ref_theta = run_rounds(eager_cfg, loop.train_replicas)
    before_graphs = compiled_graphs()
    losses, theta = run_rounds(compiled_cfg, batched.train_replicas)
    assert compiled_graphs() - before_graphs >= 2  # the loss and the step ran compiled
    np.testing.assert_allclose(np.array(losses), np.array(ref_losses), rtol=1e-5, atol=0)
    for n, t in ref_theta.items():
        assert (theta[n] - t).norm() <= 1e-5 * t.norm(), n
