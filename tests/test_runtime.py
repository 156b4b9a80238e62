"""keep_freed_memory: a stacked step's large activations are reused, not page-faulted in anew."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A stacked step (R = 16, d 128: activations of 4-12 MiB, above glibc's default mmap threshold),
# then the minor page faults of each of five warm steps.
CHILD = """
import resource, sys, torch
from hypertrain.config import InnerConfig, ModelConfig
from hypertrain.model import forward, init_params
from hypertrain.optim import init_state, inner_step
from hypertrain.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.set_num_threads(1)
m, inner = ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=4), InnerConfig()
params = {n: t.expand(16, *t.shape).clone().requires_grad_() for n, t in init_params(m, 0).items()}
state = init_state(inner, params)
tokens = torch.randint(0, 256, (16, 8, 65))
def step():
    forward(m, params, tokens).sum().backward()
    inner_step(inner, params, {n: p.grad for n, p in params.items()}, state, 1e-3)
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
def test_a_stacked_step_stops_page_faulting_its_activations():
    default, kept = faults_per_step("default"), faults_per_step("keep")
    assert default[1] > 4000  # 4 KiB pages of activations faulted in and zeroed, step after step
    # Kept: the quietest warm step faults nothing (0 in ten runs; the heap still grows in some
    # steps, so the mean was 1.7-2.4k per step, against a mean of 9.7-14k without).
    assert kept[0] < 0.02 * default[1]
