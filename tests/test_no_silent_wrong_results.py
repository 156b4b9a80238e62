"""Settings that once trained to NaN or to wrong numbers and still exited 0, each pinned by a test.

Each test fails on the code before its fix: AdamW divided by the learning rate (lr = 0 gave 0/0),
a non-finite loss ran on to "done", `state_policy=average` averaged in replicas that never
stepped and left a step-0 bias correction on warm moments, G < R was accepted, outer bytes were
counted for syncs that never happened, and `min_lr_ratio` took [0, 2) while saying [0, 1).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers import run_losses, small_cfg
from references import U32

from hypertrain.config import InnerConfig, PhaseConfig, UserError
from hypertrain.diloco.exchange.communication import ring_allreduce_bytes, round_bytes
from hypertrain.engines.contract import check_finite
from hypertrain.failures import NonFiniteError
from hypertrain.model.shapes import count_params
from hypertrain.optim.inner import init_state, inner_step, sync_inner_states
from hypertrain.preflight.checks import validate

ROLES = {"emb": "embedding", "layers.000.w1": "hidden"}  # embedding_like's parameters


def embedding_like(R: int = 2) -> tuple[dict, dict]:
    """Weights and gradients where row 0 of the table was never looked up: its grad and moments are 0."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "emb": torch.randn(R, 4, 3, generator=gen),
        "layers.000.w1": torch.randn(R, 3, 5, generator=gen),
    }
    grads = {n: torch.randn(t.shape, generator=gen) for n, t in params.items()}
    grads["emb"][:, 0] = 0.0
    return params, grads


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_at_a_learning_rate_of_zero_moves_nothing_and_writes_no_nan(wd):
    inner = InnerConfig(wd=wd, grad_clip=1.0)
    params, grads = embedding_like()
    before = {n: t.clone() for n, t in params.items()}
    state = init_state(inner, params, ROLES)
    for _ in range(3):
        inner_step(inner, params, grads, state, 0.0)
    for n, t in params.items():
        assert torch.equal(t, before[n]), n  # lr 0: every factor is exactly 1 or an added exact 0
    # torch's own AdamW agrees (it multiplies by the rate, never divides by it).
    weight = before["emb"][0].clone().requires_grad_()
    opt = torch.optim.AdamW(
        [weight], lr=0.0, betas=(inner.beta1, inner.beta2), eps=inner.eps, weight_decay=wd
    )
    weight.grad = grads["emb"][0].clone()
    opt.step()
    assert torch.equal(weight.detach(), before["emb"][0])


def test_a_cosine_that_ends_at_a_rate_of_zero_trains_to_finite_losses(tmp_path):
    # The cosine reaches lr * min_lr_ratio = 0 at update decay_steps (0-based) and holds it after.
    cfg = small_cfg(inner=InnerConfig(H=2, lr=3e-3, warmup_steps=1, min_lr_ratio=0.0, decay_steps=3))
    rows = run_losses(cfg, tmp_path)
    updates = [r for r in rows if r["kind"] == "update"]
    assert updates[-1]["lr"] == 0.0
    assert all(math.isfinite(x) for r in updates for x in r["loss"])
    assert all(math.isfinite(r["eval_loss"]) for r in rows if r["kind"] == "sync")


def test_a_diverging_run_stops_at_the_update_it_diverged_naming_replica_and_tensor(tmp_path):
    # AdamW's step is ~lr whatever the gradient: at lr 1e30 the first update makes the weights
    # overflow the logits, so the second update's loss is not finite.
    for engine in ("loop", "stacked"):
        cfg = small_cfg(inner=InnerConfig(H=3, lr=1e30, warmup_steps=0))
        cfg = replace(cfg, engine=replace(cfg.engine, name=engine))
        with pytest.raises(
            NonFiniteError,
            match=r"^replica 0 at update 2: (its loss is nan|the gradient of [a-z0-9.]+ is non-finite)",
        ):
            run_losses(cfg, tmp_path / engine)


def test_a_non_finite_gradient_is_named_by_its_tensor():
    params, grads = embedding_like(R=3)
    grads["layers.000.w1"][2, 1, 1] = float("inf")
    losses = torch.tensor([2.0, 2.5, 3.0])
    norms = torch.tensor([1.0, 1.0, float("inf")])
    with pytest.raises(
        NonFiniteError, match=r"^replica 7 at update 5: the gradient of layers.000.w1 is non-finite"
    ):
        check_finite(losses, norms, grads, [5, 6, 7], 4)
    check_finite(losses, torch.ones(3), grads, [5, 6, 7], 4)  # finite: no error


def test_averaging_inner_states_uses_only_the_replicas_that_stepped():
    inner = InnerConfig(state_policy="average")
    params, grads = embedding_like(R=3)
    state = init_state(inner, params, ROLES)
    active = torch.tensor([True, True, False])  # replica 2 had no ids in this round
    for _ in range(3):
        inner_step(inner, params, grads, state, 1e-3, active=active)
    # The stepped replicas' mean, in float64: the sync's fp32 mean of n = 2 rows rounds one sum and
    # one quotient, so per entry it lies within n * U32 * mean|x| of it (references.py's argument).
    warm = {
        (kind, n): getattr(state, kind)[n][:2].double() for kind in ("m", "v") for n in getattr(state, kind)
    }
    sync_inner_states(inner, [state], active)
    for (kind, n), rows in warm.items():
        bound = 2 * U32 * rows.abs().mean(0)
        for r in range(3):  # every replica leaves the sync with the stepped replicas' mean
            assert ((getattr(state, kind)[n][r].double() - rows.mean(0)).abs() <= bound).all(), (kind, n, r)
    # Warm moments with a first step's bias correction would make replica 2's next step ~2x too large.
    assert state.step.tolist() == [3, 3, 3]


def test_averaging_when_no_replica_stepped_changes_nothing():
    inner = InnerConfig(state_policy="average")
    params, grads = embedding_like(R=2)
    state = init_state(inner, params, ROLES)
    inner_step(inner, params, grads, state, 1e-3)
    before = {n: t.clone() for n, t in state.m.items()}
    sync_inner_states(inner, [state], torch.tensor([False, False]))
    assert all(torch.equal(state.m[n], before[n]) for n in before) and state.step.tolist() == [1, 1]


def test_a_global_batch_smaller_than_the_replica_count_is_rejected():
    with pytest.raises(
        UserError, match=r"phase.global_batch=3 is smaller than replicas=4.*valid: global_batch >= 4"
    ):
        small_cfg(replicas=4, phase=PhaseConfig(name="t", global_batch=3, updates=2, timing_warmup=0))
    small_cfg(replicas=4, phase=PhaseConfig(name="t", global_batch=4, updates=2, timing_warmup=0))


def test_outer_bytes_are_counted_only_for_syncs_that_happen():
    cfg = small_cfg(replicas=2)  # world 8: L = 4 ranks per replica
    params = count_params(cfg.model)
    inner, outer = round_bytes(cfg, params, updates=3, synced=1)
    assert inner == 3 * ring_allreduce_bytes(4, params) and outer == ring_allreduce_bytes(2, params) > 0
    assert round_bytes(cfg, params, updates=3, synced=0) == (inner, 0)


def test_min_lr_ratio_takes_the_range_its_message_names():
    for ok in (0.0, 0.5, 1.0):
        small_cfg(inner=InnerConfig(min_lr_ratio=ok))
    for bad in (-0.1, 1.5):
        with pytest.raises(UserError, match=rf"inner.min_lr_ratio={bad} is out of range; valid: \[0, 1\]"):
            validate(
                small_cfg(inner=InnerConfig(min_lr_ratio=0.5)).__class__(inner=InnerConfig(min_lr_ratio=bad))
            )
