"""The stacked engine equals the per-replica loop (docs/design.md invariant 6).

Each case runs the same plan through `hypertrain.engines.loop` and `hypertrain.engines.stacked` with the
trainer's own `assignments` and `sync`, and compares per-replica losses at every step and the
final global weights. The bound is not a number picked from a measured difference: both engines
are compared with the same plan run in float64 by the loop, and the stacked engine's error must
stay within twice the fp32 loop's own, or twice the worst-case rounding of a stored loss or weight
where the loop's error is below that (`assert_engines_agree`, `rounding_floors`, references.py).
The same rule gives the bf16 cases (Newton-Schulz, autocast) a bf16 bound: the loop's own bf16
error. On CPU the engines are in practice bitwise equal at equal per-replica shapes (docs/parity.md),
but nothing here relies on that; the bitwise checks below are the masked rows, which the engine
restores from a copy (`torch.where`), so they are bitwise by construction.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import (
    assert_engines_agree,
    cfg_for,
    rounding_floors,
    run_losses,
    run_rounds,
    update_losses,
)
from references import assert_losses_within_rounding

from hypertrain.config import DataConfig, EngineConfig
from hypertrain.data.batches import Microbatch, ReplicaBatch, stacked_microbatches
from hypertrain.diloco.rounds import assignments
from hypertrain.engines import loop, stacked
from hypertrain.model.shapes import param_roles
from hypertrain.model.transformer import init_params
from hypertrain.optim.inner import init_state
from hypertrain.preflight.prepare import prepare


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
# The quick loop (`pytest -m 'not slow'`) keeps R = 1 and R = 3 in sub-rounds; the rest are slow.
@pytest.mark.parametrize(
    "R,H,stack",
    [
        pytest.param(*case, marks=() if case in {(1, 1, 0), (3, 3, 1)} else pytest.mark.slow)
        for case in [(1, 1, 0), (1, 3, 1), (3, 1, 2), (3, 3, 0), (3, 3, 1), (3, 3, 2)]
    ],
)
def test_stacked_equals_loop_for_any_R_H_and_sub_round_size(optimizer, R, H, stack):
    assert_engines_agree(cfg_for(R, H, stack, name=optimizer))


def test_bf16_newton_schulz_agrees_within_bf16_rounding():
    assert_engines_agree(cfg_for(3, 3, 2, name="muon", ns_dtype="bf16"))


def test_bf16_autocast_agrees_within_bf16_rounding():
    cfg = cfg_for(3, 3, 0, name="muon")
    assert_engines_agree(replace(cfg, model=replace(cfg.model, compute_dtype="bf16")))


def test_grouped_query_attention():
    cfg = cfg_for(3, 2, 0)
    assert_engines_agree(replace(cfg, model=replace(cfg.model, n_heads=4, n_kv_heads=2)))


@pytest.mark.parametrize("policy", ["reset", "average"])
def test_state_policies_and_rewarmup(policy):
    cfg = cfg_for(3, 2, 2, name="muon", state_policy=policy, rewarmup_steps=2)
    assert_engines_agree(replace(cfg, phase=replace(cfg.phase, updates=5)))  # a short last round too


def test_uneven_micro_batches_and_replicas_of_unequal_rows():
    # 13 ids over 3 replicas: 5, 4 and 4 rows, cut in chunks of 2 (3 vs 2 microbatches).
    cfg = cfg_for(3, 2, 0, micro_batch=2)
    assert_engines_agree(replace(cfg, phase=replace(cfg.phase, global_batch=13)))


def test_variable_length_documents_within_the_padded_token_bound():
    data = DataConfig(
        seq_len=16, heldout=32, examples="documents", max_len=128, max_examples=4, max_padded_tokens=256
    )
    cfg = replace(cfg_for(3, 2, 0, name="muon"), data=data)
    assert_engines_agree(cfg)
    run = prepare(cfg)
    split = 0
    for t in range(cfg.phase.updates):
        batches = [a.batches[0] for a in assignments(run, range(t, t + 1))]
        groups = stacked_microbatches(batches, data.max_padded_tokens)
        split += len(groups) > max(len(b.microbatches) for b in batches)
        for parts in groups:
            present = [p for p in parts if p is not None]
            rows = max(p.tokens.shape[0] for p in present)
            width = max(p.tokens.shape[1] for p in present)
            assert rows * width <= data.max_padded_tokens and rows <= data.max_examples
        for r, batch in enumerate(batches):
            weights = sum(parts[r].weight for parts in groups if parts[r] is not None)
            assert weights == pytest.approx(1.0, rel=1e-12)
            assert sum(parts[r].targets for parts in groups if parts[r] is not None) == batch.targets
    assert split  # the bound was exercised: some stacked group had to be cut


def test_row_ranges_of_a_cut_group_carry_their_share_of_the_weight():
    def part(lengths: list[int], weight: float) -> Microbatch:
        mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
        return Microbatch(
            torch.ones(len(lengths), max(lengths), dtype=torch.int64),
            mask,
            weight,
            sum(lengths) - len(lengths),
        )

    a = ReplicaBatch([part([3, 3, 3, 3], 1.0)], 8)
    b = ReplicaBatch([part([2, 10], 1.0)], 10)
    groups = stacked_microbatches([a, b], max_padded_tokens=20)
    assert [[None if p is None else p.tokens.shape for p in g] for g in groups] == [
        [(2, 3), (2, 10)],
        [(2, 3), None],
    ]
    assert [g[0].weight for g in groups] == [0.5, 0.5]
    assert groups[0][1].weight == 1.0


def test_a_tail_update_with_empty_replicas_skips_them():
    cfg = cfg_for(4, 2, 3)
    run = prepare(cfg)
    tail = replace(cfg.phase, offset=run.samples - 12 - 2, updates=2)  # update 1: 2 ids, 4 replicas
    cfg = replace(cfg, phase=tail)
    losses, _ = run_rounds(cfg, stacked.train_replicas)
    assert [x is None for x in losses[1]] == [False, False, True, True]
    assert_engines_agree(cfg)
    assert_engines_agree(replace(cfg, inner=replace(cfg.inner, name="muon", state_policy="average")))


def test_skipped_replicas_keep_weights_state_and_step_count():
    cfg = cfg_for(4, 2, 0)
    run = prepare(cfg)
    cfg = replace(cfg, phase=replace(cfg.phase, offset=run.samples - 12 - 2, updates=2))
    run = prepare(cfg)
    theta = init_params(cfg.model, cfg.seed)
    states = [
        init_state(cfg.inner, {n: t.unsqueeze(0) for n, t in theta.items()}, param_roles(cfg.model))
        for _ in range(4)
    ]
    first = stacked.train_replicas(cfg, theta, assignments(run, range(0, 1)), states)
    saved = [
        ({n: t.clone() for n, t in r.params.items()}, {n: t.clone() for n, t in r.state.m.items()})
        for r in first
    ]
    second = stacked.train_replicas(
        cfg, theta, assignments(run, range(1, 2)), [r.state for r in first]
    )  # restarts from theta, so compare the state only
    assert [int(r.state.step) for r in second] == [2, 2, 1, 1]
    # Bitwise by construction: a skipped replica's rows are restored from their copy by torch.where.
    for r in (2, 3):
        for n, m in saved[r][1].items():
            assert torch.equal(second[r].state.m[n], m)
        assert all(torch.equal(second[r].params[n], theta[n].unsqueeze(0)) for n in theta)


def test_the_run_entry_gives_the_loop_losses(tmp_path):
    """The losses the run entry logs, stacked against loop, each against the float64 loop's (bound as
    in `assert_engines_agree`)."""
    cfg = cfg_for(3, 2, 2, name="muon")
    stacked = update_losses(run_losses(cfg, tmp_path / "stacked"))
    looped = update_losses(run_losses(replace(cfg, engine=EngineConfig(name="loop")), tmp_path / "loop"))
    batches: list = []
    ref, _ = run_rounds(cfg, loop.train_replicas, torch.float64, batches)
    assert_losses_within_rounding(stacked, looped, ref, rounding_floors(cfg, batches, len(ref))[0])
