"""keep_freed_memory: a stacked step's large activations are reused, not page-faulted in anew."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hypertrain.config import ModelConfig
from hypertrain.model.shapes import ffn_width

# A stacked step: R replicas of a d-wide, 2-layer model on B rows of T tokens each.
R, B, T = 16, 8, 64
MODEL_ARGS = {"d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4}
MODEL = ModelConfig(**MODEL_ARGS)
PAGE = 4096  # bytes of a page (Linux x86-64 and aarch64 default); a first touch of one is a minor fault
FP32_BYTES = 4


def activation_pages(width: int) -> int:
    """Pages of one fp32 activation [R, B*T, width] of the stacked step."""
    return R * B * T * width * FP32_BYTES // PAGE


# The smallest of the step's large activations: a residual-stream tensor [R, B*T, d] (4 MiB here),
# above glibc's initial mmap threshold (128 KiB); the largest: the SwiGLU hidden [R, B*T, ffn] (11 MiB).
SMALLEST = activation_pages(MODEL.d_model)
LARGEST = activation_pages(ffn_width(MODEL))

# Two warm-up steps, then the minor page faults of each of five warm steps.
CHILD = f"""
import resource, sys, torch
from hypertrain.config import InnerConfig, ModelConfig
from hypertrain.model.transformer import forward, init_params
from hypertrain.model.shapes import param_roles
from hypertrain.optim.inner import init_state, inner_step
from hypertrain.run.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.set_num_threads(1)
m, inner = ModelConfig(**{MODEL_ARGS!r}), InnerConfig()
params = {{n: t.expand({R}, *t.shape).clone().requires_grad_() for n, t in init_params(m, 0).items()}}
state = init_state(inner, params, param_roles(m))
tokens = torch.randint(0, m.vocab, ({R}, {B}, {T + 1}))
def step():
    forward(m, params, tokens).sum().backward()
    inner_step(inner, params, {{n: p.grad for n, p in params.items()}}, state, 1e-3)
    for p in params.values():
        p.grad = None
step(); step()
counts = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(counts), sum(counts) / len(counts))
"""


def faults_per_step(mode: str) -> tuple[float, float]:
    """(fewest, mean) minor page faults per step over five warm steps, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    fewest, mean = done.stdout.split()
    return float(fewest), float(mean)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
@pytest.mark.slow
def test_a_stacked_step_stops_page_faulting_its_activations():
    """Bounds from the sizes, in pages of the step's own activations (SMALLEST = 1024, LARGEST = 2816).

    Default glibc: a freed block above the mmap threshold goes back to the OS (munmap, or a trim of
    the heap's top once the free top exceeds twice the threshold, which adapts only up to the
    largest block freed), so a step's activations, many times the largest in all, come back as fresh
    pages: on average at least the largest one's worth a step (in practice several). Kept: freed
    blocks stay in the heap, and a warm step faults only where the heap must still grow past its
    high-water mark (fragmentation, now and then one activation's worth): so the quietest of five warm
    steps faults fewer pages than the smallest activation holds (no activation came from fresh
    memory), and the mean is below the default's. The default's quietest step can also be near 0
    (a step whose frees happened not to trim), hence the third check.
    """
    default, kept = faults_per_step("default"), faults_per_step("keep")
    assert default[1] > LARGEST, default  # the premise: without the setting, activations fault anew
    assert kept[0] < SMALLEST, kept
    assert kept[1] < default[1], (kept, default)
