"""churn.deadline (issue 26, docs/churn.md "Deadline"): in round k replica m's inner step takes the
network clock's modelled seconds `6 N targets / (peak * mfu)` times its straggler factor
`exp(sigma * z_m)`, z from `default_rng([seed, k])`; it stops after the last step that ends by the
deadline. Here: the steps each replica finishes equal that rule written out independently; a stopped
replica's weights and inner state stay exactly where its last step left them, and the sync averages
what the replicas reached (float64 reference, tests/test_churn.py's `check_syncs`); the clock's round
is the slowest replica's own seconds, never more than the deadline; loop = stacked; a kill mid-round
resumes bit-identically (the clock's per-replica seconds travel in the checkpoint); a deadline with
measured compute is one line, exit 2 (tests/test_bad_input.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import (
    QUICK,
    assert_engines_agree,
    assert_identical,
    cfg_for,
    ckpt,
    killed_beside_uninterrupted,
    observe,
    resumed,
    run_losses,
)
from test_churn import check_syncs

from hypertrain.config import ChurnConfig, ClusterConfig, StragglerConfig
from hypertrain.diloco.churn import Churn
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.preflight.checks import validate
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.rundir.records import read_metrics

R, H, UPDATES = 4, 4, 12
STRAGGLER = StragglerConfig(sigma=0.5, seed=3)
DEADLINE_STEPS = 3.3  # the deadline, in steps of a replica at factor 1


def step_seconds(cfg) -> float:
    """One replica's modelled step, written out here: every replica gets global_batch / R windows of
    seq_len targets per update (fixed-length text), 6 FLOPs per parameter and target."""
    params = sum(t.numel() for t in initial_weights(prepare(cfg)).values())
    targets = cfg.phase.global_batch // cfg.replicas * cfg.data.seq_len
    return 6 * params * targets / (cfg.cluster.peak_tflops * 1e12 * cfg.cluster.mfu)


def deadline_cfg(steps: float = DEADLINE_STEPS):
    """R 4, H 4, 12 updates, modelled compute with seeded stragglers and a deadline of `steps` steps."""
    cfg = cfg_for(R=R, H=H)
    cluster = ClusterConfig(name="test", compute="modelled", peak_tflops=1e-3, mfu=0.5, straggler=STRAGGLER)
    cfg = replace(cfg, phase=replace(cfg.phase, updates=UPDATES), cluster=cluster)
    cfg = replace(cfg, churn=ChurnConfig(deadline=steps * step_seconds(cfg)))
    validate(cfg)
    return cfg


def finished_by_rule(cfg) -> dict[int, list[int]]:
    """Per round, each replica's finished steps: the most n with n * t * f_m <= deadline (the steps of a
    round are equal here), f_m = exp(sigma z_m), n at most H."""
    t, out = step_seconds(cfg), {}
    for k in range(1, UPDATES // H + 1):
        z = np.random.default_rng([STRAGGLER.seed, k]).standard_normal(R)
        f = np.exp(STRAGGLER.sigma * z)
        out[k] = [min(H, int(np.floor(cfg.churn.deadline / (t * f[m])))) for m in range(R)]
        # no product lies within rounding of the deadline: the floor is the run's count
        assert all(abs(cfg.churn.deadline / (t * x) - round(cfg.churn.deadline / (t * x))) > 1e-6 for x in f)
    return out


def test_the_steps_finished_by_the_deadline_are_the_rule():
    cfg = deadline_cfg()
    want = finished_by_rule(cfg)
    churn = Churn.of(prepare(cfg))
    assert {k: list(churn.finished(k)) for k in want} == want
    late = sum(n < H for row in want.values() for n in row)
    assert 0 < late < len(want) * R and min(min(row) for row in want.values()) >= 1  # cuts, and no empty


def test_a_stopped_replica_stays_where_its_last_step_left_it_and_the_syncs_are_the_reference():
    """A replica's weights change at each of its finished steps and, after the last, stay bitwise
    unchanged up to the sync; every sync equals the float64 DiLoCo reference over the four
    replicas' reached weights (each finished at least one step)."""
    cfg = deadline_cfg()
    want = finished_by_rule(cfg)
    _, _, before, _, handed = observe(cfg)
    stopped = 0
    for k, row in want.items():
        first = (k - 1) * H
        for m, n in enumerate(row):
            reached = before[first + n][m]
            for count in range(first + 1, first + n + 1):  # it took each of its n steps
                previous = before[count - 1][m] if count - 1 in before else None
                if previous is not None:
                    assert any(not torch.equal(before[count][m][x], previous[x]) for x in reached), (k, m)
            for count in range(first + n + 1, first + H + 1):
                assert all(torch.equal(before[count][m][x], reached[x]) for x in reached), (k, m, count)
                stopped += 1
            steps = [int(handed[u][m].step.sum()) for u in range(first, first + H) if u in handed]
            assert steps == sorted(steps)  # the inner state never goes back
    assert stopped == sum(H - n for row in want.values() for n in row) > 0
    seen = check_syncs(cfg)
    assert seen == {"skipped": 0, "synced": UPDATES // H, "absent_checked": 0, "rejoins": 0}


def test_the_clock_waits_for_the_slowest_replica_never_past_the_deadline(tmp_path):
    """Each sync's compute seconds are the largest n_m * t * f_m (the replicas run on their own between
    syncs), at most the deadline; the sync rows name the replicas the deadline stopped. Bound: the
    clock adds fp64 seconds, a few ulps of the sum (rel 1e-12)."""
    cfg = deadline_cfg()
    want, t = finished_by_rule(cfg), step_seconds(cfg)
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    syncs = [s for part in rounds(run, state) for s in part.syncs]
    assert [s.churn.late for s in syncs] == [[m for m in range(R) if want[k][m] < H] for k in want]
    rows = run_losses(cfg, tmp_path)  # the trainer's records, its clock fed as it writes
    for k, sync in zip(want, [r for r in rows if r["kind"] == "sync"], strict=True):
        f = np.exp(STRAGGLER.sigma * np.random.default_rng([STRAGGLER.seed, k]).standard_normal(R))
        slowest = max(want[k][m] * t * f[m] for m in range(R))
        assert sync["clock_compute_s"] == pytest.approx(slowest, rel=1e-12)
        assert sync["clock_compute_s"] <= cfg.churn.deadline * (1 + 1e-12)


def test_stacked_equals_the_loop_with_a_deadline():
    assert_engines_agree(deadline_cfg())


@pytest.mark.slow  # the quick loop's churn kill: tests/test_churn.py's fragment in flight mid-absence
@pytest.mark.parametrize("weights", ["uniform", "tokens"])
def test_killed_mid_round_with_a_deadline_resumes_bit_identically(tmp_path, weights):
    """SIGKILL after update 7 (round 2, whose replicas 0 and 3 stop after 3 steps), the newest checkpoint
    at 6, mid-round: resume=true equals an uninterrupted run exactly, every row's clock included (each
    replica's seconds since the round's start are in the checkpoint); with outer.mean_weights=tokens too
    (the weights are recomputed from the plan at the take, nothing of them in the checkpoint)."""
    args = [*QUICK, "logger=none", "replicas=4", "inner.H=4", "phase.updates=12",
            "checkpoint.every_updates=2", "cluster=h100", "cluster.straggler.sigma=0.5",
            "cluster.straggler.seed=3", "churn.deadline=6e-7", f"outer.mean_weights={weights}"]  # fmt: skip
    run_dir, reference = killed_beside_uninterrupted(args, tmp_path, "0:7:kill:after")
    assert ckpt(run_dir, 6).exists()
    resumed(args, run_dir, tmp_path)
    assert_identical(run_dir, reference)
    syncs = [r for r in read_metrics(reference / "metrics.jsonl") if r["kind"] == "sync"]
    assert [r["late"] for r in syncs] == [[0, 3], [0, 3], [1]]  # the deadline cut every round
