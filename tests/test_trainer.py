"""The rounds, proven on the real stdlib corpus: docs/design.md invariants 4, 5 and 8, plain DP, skips."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import run_losses, small_cfg, update_losses
from references import schedule_lr, torch_adamw

from hypertrain import plan
from hypertrain.config import (
    DataConfig,
    InnerConfig,
    ModelConfig,
    OuterConfig,
    PhaseConfig,
    TrainConfig,
    WorldConfig,
)
from hypertrain.data.batches import replica_batch
from hypertrain.diloco.guard import uniform_loss
from hypertrain.diloco.rounds import assignments
from hypertrain.diloco.state import RunState
from hypertrain.diloco.sync import sync
from hypertrain.engines.loop import train_replicas
from hypertrain.failures import Diverged
from hypertrain.model.shapes import param_roles
from hypertrain.model.transformer import forward, init_params
from hypertrain.optim.inner import init_state
from hypertrain.preflight.prepare import prepare


def test_strong_world_8_and_16_give_bitwise_equal_replica_losses(tmp_path):
    a = run_losses(small_cfg(world=WorldConfig(size=8)), tmp_path / "w8")
    b = run_losses(small_cfg(world=WorldConfig(size=16)), tmp_path / "w16")
    assert update_losses(a) == update_losses(b)
    assert [r["eval_loss"] for r in a if r["kind"] == "sync"] == [
        r["eval_loss"] for r in b if r["kind"] == "sync"
    ]


def test_weak_phase_at_twice_the_base_world_gives_the_base_losses(tmp_path):
    weak = PhaseConfig(
        name="w", kind="weak", offset=100, base_world=2, per_rank_batch=8, updates=3, timing_warmup=0
    )
    a = update_losses(run_losses(small_cfg(phase=weak, world=WorldConfig(size=2)), tmp_path / "b"))
    b = update_losses(run_losses(small_cfg(phase=weak, world=WorldConfig(size=4)), tmp_path / "2b"))
    np.testing.assert_allclose(np.array(b, dtype=float), np.array(a, dtype=float), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"inner": InnerConfig(name="muon", H=2, lr=3e-3, warmup_steps=2)},
        {"model": ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, compute_dtype="bf16")},
        {"data": DataConfig(seq_len=16, heldout=32, examples="documents", max_len=32)},
    ],
    ids=["adamw", "muon", "bf16-gqa", "documents"],
)
def test_losses_fall_on_the_real_corpus(tmp_path, variant):
    phase = PhaseConfig(name="t", kind="strong", global_batch=32, updates=24, timing_warmup=0)
    cfg = small_cfg(phase=phase, **variant)
    rows = run_losses(cfg, tmp_path)
    evals = [r["eval_loss"] for r in rows if r["kind"] in ("eval", "sync")]
    train_means = [r["loss_mean"] for r in rows if r["kind"] == "update"]
    assert evals[0] == pytest.approx(math.log(256), rel=0.05)  # uniform over bytes at init
    assert evals[-1] < 0.8 * evals[0]
    assert np.mean(train_means[-4:]) < 0.8 * np.mean(train_means[:4])


def _replica_grad(cfg: TrainConfig, params, batches, world: int = 1) -> dict:
    """Sum over ranks and microbatches of coefficient * microbatch mean, averaged over ranks."""
    leaves = {n: t.detach().clone().unsqueeze(0).requires_grad_(True) for n, t in params.items()}
    for batch in batches:
        for mb in batch.microbatches:
            mask = None if mb.mask is None else mb.mask.unsqueeze(0)
            weight = plan.channel_coefficients([mb.targets], [sum(b.targets for b in batches)], [1.0], world)[
                0
            ]
            (forward(cfg.model, leaves, mb.tokens.unsqueeze(0), mask)[0] * weight / world).backward()
    return {n: t.grad[0] for n, t in leaves.items()}


@pytest.mark.parametrize("examples", ["windows", "documents"])
def test_any_split_into_ranks_and_microbatches_gives_the_one_batch_gradient(examples):
    cfg = small_cfg(data=DataConfig(seq_len=16, heldout=32, examples=examples, max_len=48, max_examples=5))
    run = prepare(cfg)
    params = {n: t.double() for n, t in init_params(cfg.model, 3).items()}
    phase, samples = run.phase, run.samples
    ids = plan.replica_ids(phase, 1, 0, cfg.replicas, samples)
    whole = replica_batch(run.dataset, ids, replace(cfg.data, max_examples=10**6, max_padded_tokens=10**9), 0)
    assert len(whole.microbatches) == 1
    reference = _replica_grad(cfg, params, [whole])
    split = replica_batch(run.dataset, ids, cfg.data, 5)
    assert len(split.microbatches) > 1
    ranks = cfg.world.size // cfg.replicas
    per_rank = [
        replica_batch(
            run.dataset, plan.rank_ids(phase, 1, r, cfg.world.size, cfg.replicas, samples), cfg.data, 2
        )
        for r in range(ranks)
    ]
    for batches, world in (([split], 1), (per_rank, ranks)):
        grads = _replica_grad(cfg, params, batches, world)
        for n in reference:
            torch.testing.assert_close(grads[n], reference[n], rtol=1e-6, atol=1e-12)
    # A plain mean of microbatch means is not the token mean: the check above can fail.
    if examples == "documents":
        naive = {n: torch.zeros_like(t) for n, t in reference.items()}
        leaves = {n: t.detach().clone().unsqueeze(0).requires_grad_(True) for n, t in params.items()}
        for mb in split.microbatches:
            (
                forward(cfg.model, leaves, mb.tokens.unsqueeze(0), mb.mask.unsqueeze(0))[0]
                / len(split.microbatches)
            ).backward()
        naive = {n: t.grad[0] for n, t in leaves.items()}
        assert not torch.allclose(naive["head"], reference["head"], rtol=1e-6, atol=1e-12)


def test_every_sync_matches_a_float64_reference_outer_step():
    cfg = small_cfg(
        replicas=3,
        world=WorldConfig(size=6),
        phase=PhaseConfig(name="t", global_batch=18, updates=6, timing_warmup=0),
    )
    run = prepare(cfg)
    state = RunState.start(cfg, init_params(cfg.model, cfg.seed))
    theta = state.theta
    ref_theta = {n: t.double().clone() for n, t in theta.items()}
    ref_buf = {n: torch.zeros_like(t) for n, t in ref_theta.items()}
    mu, lr = cfg.outer.momentum, cfg.outer.lr
    for first in range(0, 6, cfg.inner.H):
        results = train_replicas(cfg, theta, assignments(run, range(first, first + cfg.inner.H)), state.inner)
        state.inner = [r.state for r in results]
        for res in results:
            for n, t in theta.items():
                assert t.untyped_storage().data_ptr() != res.params[n].untyped_storage().data_ptr()
        before = {n: t.clone() for n, t in theta.items()}
        sync(cfg, state, [r.params for r in results], [r.stepped for r in results])
        for n in theta:
            delta = torch.stack([before[n].double() - r.params[n][0].double() for r in results]).mean(0)
            ref_buf[n] = mu * ref_buf[n] + delta
            ref_theta[n] = ref_theta[n] - lr * (delta + mu * ref_buf[n])
            assert delta.abs().max() > 0  # every round moves the replicas, the first and the later ones
            torch.testing.assert_close(theta[n].double(), ref_theta[n], rtol=1e-5, atol=1e-7)
            ref_theta[n] = theta[n].double().clone()  # compare each sync from the same start


def test_one_replica_with_averaging_and_carry_is_plain_data_parallel(tmp_path):
    cfg = small_cfg(
        replicas=1,
        outer=OuterConfig(name="average", lr=1.0, momentum=0.0, nesterov=False),
        inner=InnerConfig(H=3, lr=3e-3, warmup_steps=2, grad_clip=0.5),
        phase=PhaseConfig(name="t", global_batch=16, updates=7, timing_warmup=0),
    )
    rows = run_losses(cfg, tmp_path)
    losses = [r["loss"][0] for r in rows if r["kind"] == "update"]
    # Plain synchronous data parallel: one model, torch's own AdamW and clipping, no rounds.
    run = prepare(cfg)
    model = {
        n: t.clone().unsqueeze(0).requires_grad_(True) for n, t in init_params(cfg.model, cfg.seed).items()
    }
    opt = torch_adamw(run.cfg.inner, list(model.values()), matrix_ndim=3)
    expected = []
    for u in range(cfg.phase.updates):
        for group in opt.param_groups:
            group["lr"] = schedule_lr(run.cfg.inner, u)
        ids = plan.update_ids(run.phase, u, run.samples)
        tokens = torch.from_numpy(run.dataset.get_many(ids)).unsqueeze(0)
        loss = forward(cfg.model, model, tokens)[0]
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.values()), cfg.inner.grad_clip)
        opt.step()
        expected.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


def test_a_replica_with_no_ids_in_a_tail_update_skips_its_step(tmp_path):
    cfg = small_cfg(replicas=4)
    run = prepare(cfg)
    tail = replace(cfg.phase, offset=run.samples - 24 - 2, updates=2)  # update 1 has 2 ids for 4 replicas
    cfg = replace(cfg, phase=tail, inner=replace(cfg.inner, H=2))
    run = prepare(cfg)
    theta = init_params(cfg.model, cfg.seed)
    states = [
        init_state(cfg.inner, {n: t.unsqueeze(0) for n, t in theta.items()}, param_roles(cfg.model))
        for _ in range(4)
    ]
    results = train_replicas(cfg, theta, assignments(run, range(0, 2)), states)
    assert [r.losses[1] is None for r in results] == [False, False, True, True]
    assert [int(r.state.step) for r in results] == [2, 2, 1, 1]
    rows = run_losses(cfg, tmp_path)
    assert [r["loss"][2:] for r in rows if r["kind"] == "update"][1] == [None, None]
    assert rows[-1] == rows[-1] | {"kind": "end", "status": "finished"}


def test_updates_past_the_end_of_the_stream_are_skipped_with_one_warning(tmp_path, caplog):
    run = prepare(small_cfg())
    tail = replace(run.cfg.phase, offset=run.samples - 24 - 5, updates=4)  # update 1 has 5 ids, 2-3 none
    cfg = small_cfg(phase=tail, inner=InnerConfig(H=3, lr=3e-3, warmup_steps=2))
    with caplog.at_level("WARNING", logger="hypertrain"):
        run = prepare(cfg)
    assert run.updates == 2
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "updates 2..3 are past the end of the stream" in warning
    rows = run_losses(cfg, tmp_path)
    assert [r["update"] for r in rows if r["kind"] == "update"] == [1, 2]
    syncs = [r for r in rows if r["kind"] == "sync"]
    assert syncs[-1]["update"] == 2 and rows[-3] is syncs[-1]  # a round of 2 < H updates still syncs


def test_throughput_leaves_out_the_timing_warmup_updates(tmp_path):
    base = small_cfg()
    cfg = small_cfg(phase=replace(base.phase, updates=6, timing_warmup=2))
    rows = run_losses(cfg, tmp_path)
    updates = [r for r in rows if r["kind"] == "update"]
    summary = [r for r in rows if r["kind"] == "summary"][-1]
    assert summary["train/timed_updates"] == 4
    # The window opens after update 2 is logged and closes after the last sync's eval.
    assert 0 < summary["train/timed_s"] <= summary["train/wall_s"] - updates[1]["wall"]
    stepped = sum(x is not None for r in updates[2:] for x in r["loss"])
    assert summary["train/replica_steps_per_s"] == pytest.approx(stepped / summary["train/timed_s"])
    everything = small_cfg(phase=replace(base.phase, updates=2, timing_warmup=2))
    summary = [r for r in run_losses(everything, tmp_path / "all") if r["kind"] == "summary"][-1]
    assert summary["train/timed_updates"] == 2 and summary["train/timed_s"] == summary["train/wall_s"]


def test_the_timed_window_opens_inside_a_round_where_the_warm_up_ends(tmp_path):
    """One round of 6 updates, warm-up 2: the window opens during the round (rows are written at its
    end, so a window opened at the first timed row would time almost nothing)."""
    base = small_cfg()
    cfg = small_cfg(phase=replace(base.phase, updates=6, timing_warmup=2), inner=replace(base.inner, H=6))
    rows = run_losses(cfg, tmp_path)
    summary = [r for r in rows if r["kind"] == "summary"][-1]
    seconds = [r["rank_seconds"][0] for r in rows if r["kind"] == "update"]
    # At least the timed updates' own seconds, at most the whole run.
    assert sum(seconds[2:]) <= summary["train/timed_s"] <= summary["train/wall_s"]


def test_the_uniform_prediction_loss_weighs_the_channels_as_the_held_out_loss_does():
    """The divergence guard's reference: ln vocab; multistream: sum_c k_c ln V_c / sum_c k_c over the
    channels with held-out targets (a channel without any leaves the loss and its k the normaliser)."""
    from types import SimpleNamespace as NS

    decoder = NS(cfg=NS(model=ModelConfig(vocab=300)), dataset=NS(), heldout=NS(microbatches=[]))
    assert uniform_loss(decoder)[0] == math.log(300)
    counts = [torch.tensor(c, dtype=torch.float64) for c in ([5.0, 4.0, 0.0], [3.0, 4.0, 0.0])]
    multistream = NS(
        cfg=NS(model=NS(channel_vocabs=[4096, 1024, 2048])),
        dataset=NS(
            channel_vocabs=(4096, 1024, 2048),
            channel_scales=(1.0, 16.0, 16.0),
            channel_counts=lambda ids: None,
        ),
        heldout=NS(microbatches=[NS(channel_counts=c) for c in counts]),
    )
    assert uniform_loss(multistream)[0] == pytest.approx((math.log(4096) + 16 * math.log(1024)) / 17)


@pytest.mark.parametrize("engine", ["loop", "stacked"])
def test_the_divergence_guard_stops_a_finite_but_diverged_run_at_its_first_sync(tmp_path, engine):
    cfg = small_cfg(inner=InnerConfig(H=2, lr=1000.0, warmup_steps=0))
    cfg = replace(cfg, engine=replace(cfg.engine, name=engine))
    with pytest.raises(Diverged, match=r"^diverged: the pseudo-gradient norm at the sync at update 2 is "):
        run_losses(cfg, tmp_path)
