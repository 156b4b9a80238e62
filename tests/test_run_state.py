"""The run's state is one object: saved between rounds and loaded into a fresh run, the rest is identical."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import small_cfg

from hypertrain.config import InnerConfig
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.preflight.prepare import initial_weights, prepare


def losses_of(rnds) -> list:
    return [[r.losses for r in rnd.results] for rnd in rnds]


@pytest.mark.parametrize("policy", ["carry", "average"])
def test_a_state_saved_after_a_round_resumes_bit_identically(policy):
    cfg = small_cfg(inner=InnerConfig(H=2, lr=3e-3, warmup_steps=2, state_policy=policy))  # 4 updates
    run = prepare(cfg)
    whole = RunState.start(cfg, initial_weights(run))
    ref = losses_of(rounds(run, whole))

    first = RunState.start(cfg, initial_weights(run))
    stream = rounds(run, first)
    head = losses_of([next(stream)])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # what a checkpoint holds, through torch's serialisation
    del stream, first

    resumed = RunState.start(cfg, initial_weights(run))
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    assert resumed.next_update == 2 and resumed.rounds_done == 1
    tail = losses_of(rounds(run, resumed))
    assert head + tail == ref
    for name, t in whole.theta.items():
        assert torch.equal(resumed.theta[name], t), name
    assert torch.equal(resumed.inner[1].step, whole.inner[1].step)


def test_training_draws_no_random_numbers():
    """So a checkpoint needs no RNG state: the plan, the data order and the steps are deterministic."""
    cfg = small_cfg()
    run = prepare(cfg)
    state = RunState.start(cfg, initial_weights(run))
    before = torch.random.get_rng_state()
    for _ in rounds(run, state):
        pass
    assert torch.equal(torch.random.get_rng_state(), before)
