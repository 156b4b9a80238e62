"""engine.compile: the compiled loss and inner step agree with eager ones within float rounding.

Slow (each test compiles with inductor, ~10-30 s on a CPU). The compiled runs must really be
compiled (dynamo's graph counter moves) and must not recompile for every learning rate. "Within
float rounding" is against a float64 reference: the compiled path's error within twice the eager
path's (tests/references.py), never a bound set at a measured difference; each test says its floor.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import pytest
import torch
from helpers import assert_engines_agree, cfg_for, run_rounds
from references import U32, assert_within_rounding, float64_inner_step, float64_state, to_float64

from hypertrain.config import InnerConfig, ModelConfig
from hypertrain.engines import stacked
from hypertrain.engines.compiled import inner_step_fn
from hypertrain.model.shapes import param_roles
from hypertrain.model.transformer import init_params
from hypertrain.optim.inner import init_state, inner_step

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def a_cxx_compiler():
    """torch.compile's inductor builds C++: `scripts/setup --dev` installs g++, so its absence fails."""
    compiler = os.environ.get("CXX", "g++")
    assert shutil.which(compiler), (
        f"no C++ compiler {compiler!r} on PATH (`scripts/setup --dev` installs g++)"
    )


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters  # here, not at collection: torch._dynamo costs 2 s to import

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_compiled_inner_step_equals_eager_for_every_learning_rate_without_recompiling(optimizer):
    """Compiled and eager steps, each against the float64 result of the same fp32 step.

    Bound: ||compiled - ref|| <= 2 * max(||eager - ref||, 2 U32 ||ref||) per tensor (references.py).
    Inductor fuses and reorders the same arithmetic, so its error is a draw of the same size as
    eager's. The floor: a step rounds weight-sized values twice (w * (1 - lr*wd), then + update), each
    within U32 per entry. At these rates (updates 1e-4 to 2e-2 of the weights) that storage rounding
    dominates both paths' errors, whatever Newton-Schulz's amplification of the update's own
    rounding; so an update is only checked to ~4 U32 ||w|| / ||update||, not to a fixed fraction.

    The decay factor is also checked bitwise: from zero gradients and state every update is exactly
    zero (clip factor 1, AdamW m / (sqrt(v) + eps) = 0, Newton-Schulz of 0 is 0), so both steps compute
    w * fp32(1 - lr*wd) in one correctly rounded multiply. A factor kept in float64 (a Python float lr
    traced as a constant) would round differently there, an error below the norm bound's resolution
    per step but the same at every step, which is how it once drifted a whole run (docs/parity.md).
    """
    torch._dynamo.reset()
    inner = InnerConfig(name=optimizer, wd=0.1, grad_clip=1.0)
    m = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2)
    eager = {n: t.expand(3, *t.shape).clone() for n, t in init_params(m, 0).items()}
    compiled = {n: t.clone() for n, t in eager.items()}
    roles = param_roles(m)
    eager_state, compiled_state = init_state(inner, eager, roles), init_state(inner, compiled, roles)
    step = inner_step_fn(True)
    gen = torch.Generator().manual_seed(0)
    before_graphs = compiled_graphs()
    for i, lr in enumerate([1e-4, 3e-4, 5e-4, 2e-4, 7e-4]):
        grads = {n: torch.randn(t.shape, generator=gen) * 0.01 for n, t in eager.items()}
        ref = to_float64(eager)  # the exact result of this fp32 step (references.py)
        float64_inner_step(inner, ref, grads, float64_state(eager_state), lr)
        inner_step(inner, eager, grads, eager_state, lr)
        step(inner, compiled, grads, compiled_state, lr)
        for n in eager:
            floor = 2 * U32 * float(ref[n].norm())
            assert_within_rounding(compiled[n], eager[n], ref[n], floor, f"step {i}, {n}")
            compiled[n].copy_(eager[n])  # restart every step from equal weights and state
            compiled_state.m[n].copy_(eager_state.m[n])
            if n in eager_state.v:
                compiled_state.v[n].copy_(eager_state.v[n])
        zero = {n: torch.zeros_like(t) for n, t in eager.items()}
        decayed_eager, decayed_compiled = ({n: t.clone() for n, t in eager.items()} for _ in range(2))
        inner_step(inner, decayed_eager, zero, init_state(inner, zero, roles), lr)
        step(inner, decayed_compiled, zero, init_state(inner, zero, roles), lr)
        for n, t in decayed_eager.items():
            assert torch.equal(decayed_compiled[n], t), (i, n)
    assert compiled_graphs() - before_graphs == 1  # one graph for all five learning rates


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_compiled_stacked_engine_agrees_with_the_eager_loop(optimizer):
    """The compiled stacked engine and the eager loop, each against the float64 loop (test_stacked's
    `assert_engines_agree`: losses and weights within twice the eager loop's own error, or its floor
    of the fp32 roundings of a loss and of the weights)."""
    torch._dynamo.reset()
    eager_cfg = cfg_for(3, 3, 0, name=optimizer)  # warmup then cosine: the lr changes every step
    compiled_cfg = replace(eager_cfg, engine=replace(eager_cfg.engine, compile=True))
    before_graphs = compiled_graphs()
    assert_engines_agree(eager_cfg, got=run_rounds(compiled_cfg, stacked.train_replicas))
    assert compiled_graphs() - before_graphs >= 2  # the loss and the step ran compiled
