"""Seeded churn (issue 26, docs/churn.md): the schedule is the documented rule, recomputed here from the
seed independently; every sync of a run with absences, misses, a rejoin and a sync skipped below the
quorum equals a float64 reference of DiLoCo over the contributors, fed the run's own replica weights;
loop and stacked agree within rounding; a stop mid-absence resumes bit-identically; a missed or absent
replica's error-feedback buffer is untouched; bad input is one line, exit 2. Real processes against
the simulation with churn: tests/test_dist.py's churn cases.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import (
    KILLED,
    QUICK,
    assert_engines_agree,
    assert_identical,
    cfg_for,
    ckpt,
    entry,
    error_lines,
    finish,
    observe,
    start_entry,
)
from references import U32

from hypertrain.config import ChurnConfig
from hypertrain.diloco.churn import ABSENT, MISS, PRESENT, Schedule
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.run.checks import validate
from hypertrain.run.prepare import initial_weights, prepare
from hypertrain.run.records import read_metrics

# -- 1. the schedule is the documented rule -------------------------------------------------------------


def documented_rule(seed, R, rounds_, p_miss, p_leave, mean_absence, events=()):
    """docs/churn.md's rule, written from the docs: per round k, hand events first, then
    default_rng([seed, k]) draws u (2 x R uniforms) and g (R geometric lengths of mean `mean_absence`);
    an absent replica stays absent; a present one leaves if u[0] < p_leave (for g rounds), else misses if
    u[1] < p_miss or a hand miss names it."""
    leave_by_hand, back = set(), {}
    out = []
    for k in range(1, rounds_ + 1):
        misses = {m for (kk, m, e) in events if kk == k and e == "miss"}
        for kk, m, e in events:
            if kk == k and e == "rejoin":
                leave_by_hand.discard(m)
                back.pop(m, None)
            if kk == k and e == "leave":
                leave_by_hand.add(m)
        gen = np.random.default_rng([seed, k])
        u, g = gen.random((2, R)), gen.geometric(1 / mean_absence, R)
        row = []
        for m in range(R):
            if m in leave_by_hand or back.get(m, 0) > k:
                row.append("absent")
            elif u[0][m] < p_leave:
                back[m] = k + g[m]
                row.append("absent")
            elif u[1][m] < p_miss or m in misses:
                row.append("miss")
            else:
                row.append("present")
        out.append(row)
    return out


@pytest.mark.parametrize(
    "seed, p_miss, p_leave, mean_absence, events",
    [
        (0, 0.1, 0.05, 2.0, ()),
        (7, 0.3, 0.2, 3.5, ()),
        (3, 0.0, 0.3, 1.0, ((2, 1, "leave"), (5, 1, "rejoin"), (4, 0, "miss"), (6, 2, "rejoin"))),
        (11, 0.5, 0.0, 2.0, ((1, 3, "leave"),)),
    ],
)
def test_the_schedule_is_the_documented_rule(seed, p_miss, p_leave, mean_absence, events):
    R, K = 5, 40
    churn = ChurnConfig(
        p_miss=p_miss,
        p_leave=p_leave,
        mean_absence=mean_absence,
        seed=seed,
        events=[f"{k}:{m}:{e}" for k, m, e in events],
    )
    got = Schedule.of(churn, R, K)
    assert [list(r) for r in got.status] == documented_rule(seed, R, K, p_miss, p_leave, mean_absence, events)
    assert {ABSENT, MISS, PRESENT} >= {s for r in got.status for s in r}


def test_the_draws_have_the_configured_rates():
    """Over 4000 replica-rounds: misses among present-or-missing replicas at p_miss, leaves at p_leave
    per non-absent replica-round, absences of mean `mean_absence` rounds (within 4 standard errors)."""
    R, K, p_miss, p_leave, mean = 4, 1000, 0.2, 0.05, 3.0
    status = Schedule.of(ChurnConfig(p_miss=p_miss, p_leave=p_leave, mean_absence=mean, seed=1), R, K).status
    runs, leaves, misses, eligible = [], 0, 0, 0
    for m in range(R):
        column = [row[m] for row in status]
        k = 0
        while k < K:
            if column[k] == ABSENT:
                j = k
                while j < K and column[j] == ABSENT:
                    j += 1
                if j < K:  # a finished absence (possibly two back to back: each is >= 1 round)
                    runs.append(j - k)
                leaves += 1
                k = j
                continue
            eligible += 1
            misses += column[k] == MISS
            k += 1
    n_present = eligible
    assert abs(misses / n_present - p_miss * (1 - p_leave)) < 4 * np.sqrt(p_miss / n_present)
    assert abs(leaves / (n_present + leaves) - p_leave) < 4 * np.sqrt(p_leave / (n_present + leaves)) + 0.01
    assert abs(np.mean(runs) - mean) < 4 * np.std(runs) / np.sqrt(len(runs)) + 0.5  # back-to-back merge


# -- 2. every sync against a float64 reference over the contributors --------------------------------


EVENTS = ["2:1:leave", "4:1:rejoin", "3:2:miss", "5:0:leave", "5:2:miss", "5:3:miss", "6:0:rejoin"]


def churn_cfg(events=EVENTS, min_quorum=2, merge_alpha=0.0, rejoin_state="reset", **churn):
    """R 4, H 2, 14 updates (7 rounds): replica 1 absent in rounds 2-3 (over two syncs) and rejoining in 4,
    replica 2 missing round 3 (0 and 3 contribute), round 5 below the quorum of 2 (0 absent, 2 and 3
    missing: 1 alone), replica 0 rejoining in 6."""
    cfg = cfg_for(R=4, H=2)
    cfg = replace(
        cfg,
        phase=replace(cfg.phase, updates=14),
        outer=replace(cfg.outer, merge_alpha=merge_alpha),
        churn=ChurnConfig(events=list(events), min_quorum=min_quorum, rejoin_state=rejoin_state, **churn),
    )
    validate(cfg)
    return cfg


def check_syncs(cfg, reference=None) -> dict[str, int]:
    """Replay DiLoCo in float64 over each round's contributors (recomputed here from the documented rule
    and the run's ids: present, with ids), fed the run's replica weights before each sync; assert the
    run's global weights, outer momentum and replicas after it. Bounds as tests/test_streaming.py's, n the
    contributors. A round below the quorum leaves weights and momentum exactly as they were. Absent
    replicas trained nothing (their weights before the sync are where the previous sync left them,
    exactly: the global weights at merge alpha 0); a rejoining
    replica was handed a zero inner state (rejoin_state=reset). `reference`: the config whose churn the
    reference replays (the run's by default). Returns what was seen."""
    o, H, R = cfg.outer, cfg.inner.H, cfg.replicas
    c = (reference or cfg).churn
    rounds_ = -(-cfg.phase.updates // H)
    status = documented_rule(c.seed, R, rounds_, c.p_miss, c.p_leave, c.mean_absence, c.parsed_events())
    _, theta0, before, after, handed = observe(cfg)
    prev_theta = {x: t.double() for x, t in theta0.items()}
    prev_buf = {x: torch.zeros_like(t) for x, t in prev_theta.items()}
    prev_replicas = None  # the replicas' weights after the previous sync, when they differ from the global
    seen = {"skipped": 0, "synced": 0, "absent_checked": 0, "rejoins": 0}
    for count in sorted(before):
        run_theta, run_buf, run_replicas = after[count]
        if count % H and count != cfg.phase.updates:
            continue
        k = (count - 1) // H + 1
        row = status[k - 1]
        replicas = [{x: t.double() for x, t in w.items()} for w in before[count]]
        for m in range(R):
            if row[m] == "absent":  # trained nothing this round: where the previous sync left it, exactly
                start = prev_theta if prev_replicas is None else prev_replicas[m]
                assert all(torch.equal(replicas[m][x], start[x]) for x in prev_theta), (k, m)
                seen["absent_checked"] += 1
            if (
                k > 1
                and row[m] != "absent"
                and status[k - 2][m] == "absent"
                and cfg.churn.rejoin_state == "reset"
            ):
                first = handed[(k - 1) * H][m]
                assert int(first.step.sum()) == 0 and all(not t.any() for t in first.m.values()), (k, m)
                seen["rejoins"] += 1
        contributors = [m for m in range(R) if row[m] == "present"]
        if len(contributors) < cfg.churn.min_quorum:
            for x in prev_theta:
                assert torch.equal(run_theta[x].double(), prev_theta[x]) and torch.equal(
                    run_buf[x].double(), prev_buf[x]
                )
            seen["skipped"] += 1
            contributors = []  # every replica restarts from the unchanged global weights
        else:
            n = len(contributors)
            for x in prev_theta:
                delta = sum(prev_theta[x] - replicas[m][x] for m in contributors) / n
                spread = sum((prev_theta[x] - replicas[m][x]).abs() for m in contributors) / n
                old = prev_buf[x]
                new_buf = o.momentum * old + delta
                new_theta = prev_theta[x] - o.lr * (delta + o.momentum * new_buf if o.nesterov else new_buf)
                scale = spread + o.momentum * old.abs()
                assert ((run_buf[x].double() - new_buf).abs() <= (n + 3) * U32 * scale).all(), (k, x)
                bound = 2 * U32 * new_theta.abs() + o.lr * (1 + o.momentum) * (n + 5) * U32 * scale
                assert ((run_theta[x].double() - new_theta).abs() <= bound).all(), (k, x)
            seen["synced"] += 1
        if run_replicas is not None:  # merge alpha > 0: a non-contributor restarts from the global weights
            for m in range(R):
                for x, g in run_theta.items():
                    if m in contributors:
                        want = g.double() + o.merge_alpha * (replicas[m][x] - g.double())
                        bound = 3 * U32 * (g.double().abs() + replicas[m][x].abs())
                        assert ((run_replicas[m][x].double() - want).abs() <= bound).all(), (k, m, x)
                    else:
                        assert torch.equal(run_replicas[m][x], g), (k, m, x)
        prev_theta = {x: t.double() for x, t in run_theta.items()}
        prev_buf = {x: t.double() for x, t in run_buf.items()}
        prev_replicas = (
            None if run_replicas is None else [{x: t.double() for x, t in r.items()} for r in run_replicas]
        )
    return seen


@pytest.mark.parametrize("merge_alpha", [0.0, 0.5])
def test_every_sync_equals_the_float64_reference_over_the_contributors(merge_alpha):
    seen = check_syncs(churn_cfg(merge_alpha=merge_alpha))
    assert seen == {"skipped": 1, "synced": 6, "absent_checked": 3, "rejoins": 2}


def test_drawn_churn_equals_the_reference_too():
    seen = check_syncs(churn_cfg(events=(), min_quorum=1, p_miss=0.3, p_leave=0.25, seed=4))
    assert seen["synced"] + seen["skipped"] == 7 and seen["absent_checked"] > 0


def test_a_reference_that_ignores_the_miss_is_caught():
    """The negative control: the run where replica 2 missed round 3, checked against a reference where it
    did not, differs at round 3's sync."""
    without_miss = churn_cfg(events=[x for x in EVENTS if x != "3:2:miss"])
    with pytest.raises(AssertionError) as e:
        check_syncs(churn_cfg(), reference=without_miss)
    assert str(e.value).startswith("(3, ")


# -- 3. engines agree, resume is exact, error buffers are left alone ------------------------------------


def test_stacked_equals_the_loop_with_churn():
    assert_engines_agree(churn_cfg())


def test_a_missed_or_absent_replicas_error_buffer_is_untouched():
    """int8 with error feedback: across round 3's sync, replica 2 (missing) and replica 1 (absent) keep
    their buffers bitwise; replicas 0 and 3 (contributing) change theirs."""
    cfg = churn_cfg()
    cfg = replace(cfg, outer=replace(cfg.outer, compress="int8", error_feedback=True))
    validate(cfg)
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    buffers = {}
    for part in rounds(run, state):
        buffers[part.index] = [{n: t.clone() for n, t in e.items()} for e in state.errors]
    changed = lambda m: any(not torch.equal(buffers[3][m][n], buffers[2][m][n]) for n in buffers[2][m])  # noqa: E731
    assert [changed(m) for m in range(4)] == [True, False, False, True]


def test_killed_mid_absence_resumes_bit_identically(tmp_path):
    """Invariant 9 with churn: SIGKILL after update 5 (replica 1 absent in rounds 2-3, updates 3-6), the
    newest checkpoint at 4; resume=true equals an uninterrupted run exactly: every row (the sync rows'
    contributors, absent, missed, skipped included), the summary's churn figures and weights.pt."""
    args = [*QUICK, "logger=none", "replicas=4", "inner.H=2", "phase.updates=10",
            "checkpoint.every_updates=2", f"churn.events=[{','.join(EVENTS)}]",
            "churn.min_quorum=2"]  # fmt: skip
    reference = tmp_path / "reference"
    proc = start_entry([*args, f"hydra.run.dir={reference}"], tmp_path)
    run_dir = tmp_path / "run"
    try:
        killed = entry([*args, f"hydra.run.dir={run_dir}"], tmp_path, "0:5:kill:after")
    finally:
        done = finish(proc)
    assert done.returncode == 0, done.stderr
    assert killed.returncode == KILLED and ckpt(run_dir, 4).exists()
    resumed = entry([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert_identical(run_dir, reference)
    rows, want = read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    churned = lambda rs: [
        {k: v for k, v in r.items() if k.startswith("churn/")} for r in rs if r["kind"] == "summary"
    ][-1]  # noqa: E731
    assert churned(rows) == churned(want) and churned(want)["churn/skipped_syncs"] == 1
    syncs = [r for r in want if r["kind"] == "sync"]
    assert [r["contributors"] for r in syncs] == [[0, 1, 2, 3], [0, 2, 3], [0, 3], [0, 1, 2, 3], []]
    assert [r["skipped"] for r in syncs] == [False, False, False, False, True]


# -- 4. bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("churn.p_miss=1.5", "churn.p_miss=1.5 is out of range; valid: [0, 1]"),
        ("churn.p_leave=-0.1", "churn.p_leave=-0.1 is out of range; valid: [0, 1]"),
        ("churn.min_quorum=5", "churn.min_quorum=5 is out of range; valid: 1 to replicas (4)"),
        ("churn.events=[2:4:leave]", "churn.events names replica 4; valid: 0 to 3 (replicas=4)"),
        ("churn.events=[2:1:crash]", "churn.events entry '2:1:crash' is not valid"),
        ("churn.mean_absence=0.5", "churn.mean_absence=0.5 is too small; valid: >= 1.0"),
        ("churn.rejoin_state=keep", "churn.rejoin_state='keep' is not valid; valid: 'reset', 'carry'"),
    ],
)
def test_bad_churn_is_one_line_and_exit_2(tmp_path, override, message):
    run_dir = tmp_path / "run"
    done = entry([*QUICK, "logger=none", "replicas=4", override, f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 2 and not run_dir.exists()
    (line,) = error_lines(done.stderr)
    assert message in line, line
