"""Seeded churn (issue 26, docs/churn.md): the schedule is the documented rule, recomputed here from the
seed independently; every sync of a run with absences, misses, a rejoin and a sync skipped below the
quorum equals a float64 reference of DiLoCo over the contributors, fed the run's own replica weights;
loop and stacked agree within rounding; a stop mid-absence resumes bit-identically; a missed or absent
replica's error-feedback buffer is untouched; bad input is one line, exit 2. With Streaming DiLoCo's
fragments and an outer delay (section 4): every fragment sync equals a float64 reference whose windows
(the updates since the fragment's last landing, from the paper's schedule), contributors (present in
the take's round, with ids trained in the window) and quorum skips are decided here; references with
the wrong statuses are caught at the sync where they differ; loop and stacked agree; a run killed with a
fragment's reduction in flight mid-absence resumes bit-identically, and its summary's churn figures are
the ones computed here from the rule and the windows. Real processes against the simulation with churn:
tests/test_dist.py's churn cases (one with fragments and a delay).
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
    assert_identical_streaming,
    assert_same_weights,
    assert_streaming_engines_agree,
    cfg_for,
    ckpt,
    compose_cfg,
    entry,
    error_lines,
    killed_beside_uninterrupted,
    observe,
    resumed,
)
from references import U32, assert_outer_step
from test_streaming import paper_events

from hypertrain import plan
from hypertrain.config import ChurnConfig
from hypertrain.diloco.churn import ABSENT, MISS, PRESENT, Schedule
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.preflight.checks import validate
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.rundir.records import read_metrics

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
                assert_outer_step(
                    o, prev_theta[x], prev_buf[x], delta, spread, n, run_theta[x], run_buf[x], (k, x)
                )
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


def churn_summary(rows: list[dict]) -> dict:
    """The last summary's `churn/` figures."""
    summary = [r for r in rows if r["kind"] == "summary"][-1]
    return {k: v for k, v in summary.items() if k.startswith("churn/")}


@pytest.mark.slow  # the quick loop's churn kill: the one with a fragment in flight mid-absence, below
def test_killed_mid_absence_resumes_bit_identically(tmp_path):
    """Invariant 9 with churn: SIGKILL after update 5 (replica 1 absent in rounds 2-3, updates 3-6), the
    newest checkpoint at 4; resume=true equals an uninterrupted run exactly: every row (the sync rows'
    contributors, absent, missed, skipped included), the summary's churn figures and weights.pt."""
    args = [*QUICK, "logger=none", "replicas=4", "inner.H=2", "phase.updates=10",
            "checkpoint.every_updates=2", f"churn.events=[{','.join(EVENTS)}]",
            "churn.min_quorum=2"]  # fmt: skip
    run_dir, reference = killed_beside_uninterrupted(args, tmp_path, "0:5:kill:after")
    assert ckpt(run_dir, 4).exists()
    resumed(args, run_dir, tmp_path)
    assert_identical(run_dir, reference)
    rows, want = read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert churn_summary(rows) == churn_summary(want) and churn_summary(want)["churn/skipped_syncs"] == 1
    syncs = [r for r in want if r["kind"] == "sync"]
    assert [r["contributors"] for r in syncs] == [[0, 1, 2, 3], [0, 2, 3], [0, 3], [0, 1, 2, 3], []]
    assert [r["skipped"] for r in syncs] == [False, False, False, False, True]


# -- 4. with fragments and an outer delay ----------------------------------------------------------------

# R 4, H 4, two fragments (the tiny model's one layer: fragment 0 holds the embeddings and the layer,
# fragment 1 the final norm and the head), 20 updates: 5 rounds of two fragment syncs each (the flush adds
# a third, fragment 0's, to round 5). Replica 1 is absent in round 2 (over both of its fragment syncs) and
# rejoins in round 3, where replica 2 misses; round 4 is below the quorum of 2 (0 absent, 2 and 3 missing:
# 1 alone), so both of its fragment syncs are skipped; replica 0 rejoins in round 5. Fragment 0's windows
# from round 2 on span two rounds, so rounds 3 and 5 each have a contributor that trained only part of its
# window (it was absent in the round before).
FRAGMENT_EVENTS = ["2:1:leave", "3:1:rejoin", "3:2:miss", "4:0:leave", "4:2:miss", "4:3:miss", "5:0:rejoin"]


def fragments_cfg(tau, merge_alpha=0.0, events=FRAGMENT_EVENTS, min_quorum=2):
    """`churn_cfg`'s tiny model and data with Streaming DiLoCo: P 2, delay tau, R 4, H 4, 20 updates."""
    cfg = cfg_for(R=4, H=4)
    cfg = replace(
        cfg,
        phase=replace(cfg.phase, updates=20),
        outer=replace(cfg.outer, fragments=2, delay=tau, merge_alpha=merge_alpha),
        churn=ChurnConfig(events=list(events), min_quorum=min_quorum),
    )
    validate(cfg)
    return cfg


def fragment_syncs(cfg, reference=None, statuses="take") -> tuple[list[list[str]], list[dict], int]:
    """Every fragment sync of a churned run, decided here from the paper's schedule (tests/test_streaming's
    `paper_events`: the takes, the landings and the flush) and the documented rule (`documented_rule`, of
    `reference`'s churn, the run's by default): its fragment, take and landing counts, its round (the
    take's; the landing must lie in it), its window (the updates since the fragment's previous landing, or
    the phase's start, up to the take), each replica's steps in the window (the updates it has ids in and
    was not absent in the round of), its contributors (present in the round, with a step in the window)
    and whether it is skipped (fewer than the quorum: then no contributors). `statuses="window"`: the
    negative control's wrong rule, the statuses of the round the window starts in. Returns the statuses
    per round, the syncs in landing order and the replica-steps computed (the updates each replica has
    ids in and was not absent in the round of, summed)."""
    H, R, N, P = cfg.inner.H, cfg.replicas, cfg.phase.updates, cfg.outer.fragments
    c = (reference or cfg).churn
    status = documented_rule(c.seed, R, -(-N // H), c.p_miss, c.p_leave, c.mean_absence, c.parsed_events())
    run = prepare(cfg)

    def trained(u: int, m: int) -> bool:
        return status[u // H][m] != "absent" and len(plan.replica_ids(run.phase, u, m, R, run.samples)) > 0

    last_land, taken, syncs = [0] * P, {}, []
    for count, events in sorted(paper_events(H, P, cfg.outer.delay, N).items()):
        for kind, p in events:
            if kind == "take":
                k = (count - 1) // H + 1
                window = range(last_land[p], count)
                row = status[k - 1 if statuses == "take" else window[0] // H]
                steps = {m: sum(trained(u, m) for u in window) for m in range(R)}
                present = [m for m in range(R) if row[m] == "present" and steps[m]]
                skipped = len(present) < cfg.churn.min_quorum
                taken[p] = {"fragment": p, "take": count, "round": k, "window": window, "steps": steps}
                taken[p] |= {"contributors": [] if skipped else present, "skipped": skipped}
            else:
                sync = taken.pop(p) | {"land": count}
                assert (count - 1) // H + 1 == sync["round"], sync  # take and landing in one round
                syncs.append(sync)
                last_land[p] = count
    assert not taken
    return status, syncs, sum(trained(u, m) for u in range(N) for m in range(R))


def churn_figures(cfg, status, syncs, computed) -> dict:
    """The summary's churn figures from `fragment_syncs`: missed and absent replica-rounds (each once per
    round, however many fragment syncs it has), skipped fragment syncs, and the goodput: the contributors'
    steps in the windows of the syncs that were not skipped / (P * the replica-steps computed)."""
    reached = sum(s["steps"][m] for s in syncs for m in s["contributors"])
    return {
        "churn/missed_replica_rounds": sum(row.count("miss") for row in status),
        "churn/absent_replica_rounds": sum(row.count("absent") for row in status),
        "churn/skipped_syncs": sum(s["skipped"] for s in syncs),
        "churn/goodput": reached / (cfg.outer.fragments * computed),
    }


def check_fragment_syncs(cfg, reference=None, statuses="take") -> dict[str, int]:
    """Replay every fragment sync in float64 (`fragment_syncs` decides its window, contributors and skip),
    fed the run's replica weights after every update (`observe`); assert the run's global weights, outer
    momentum and replicas after each update count. At a take: the mean over the contributors of
    `theta - w_m` over the fragment's parameters (theta the global weights then, w_m the replicas'
    weights). At its landing: the outer Nesterov step (DiLoCo, Algorithm 1, torch.optim.SGD's momentum
    form) of the fragment's global weights and momentum; a skipped sync leaves both exactly as they were;
    the merge: at merge alpha 0 every replica's copy of the fragment is the new global weights exactly, at
    alpha > 0 a contributor's is lerp(global, own, alpha) and every other replica's the global weights
    exactly. Parameters of fragments that did not land are untouched (global, momentum and replicas,
    exactly). A replica absent in an update's round trained nothing in it (exactly where the previous count
    left it); one rejoining is handed a zero inner state (rejoin_state=reset) at its round's first update.

    Bounds: tests/test_streaming.py's `check_against_reference`, n the contributors. Each landing is
    checked against the run's own state before it, so no error carries over: the mean of n fp32
    differences ((n + 1) roundings, each within U32 of the mean |theta - w_m|, `spread`), then
    buf = mu buf + d (2) and theta - lr (d + mu buf) (4): |err(buf)| <= (n + 3) U32 (spread + mu |buf_old|),
    |err(theta)| <= 2 U32 |theta_new| + lr (1 + mu) (n + 5) U32 (spread + mu |buf_old|); the merge's fp32
    lerp errs by <= 3 U32 (|g| + |w|). Returns the counts of what was seen."""
    o, H, R = cfg.outer, cfg.inner.H, cfg.replicas
    status, syncs, _ = fragment_syncs(cfg, reference, statuses)
    takes = {(s["take"], s["fragment"]): s for s in syncs}
    landings = {(s["land"], s["fragment"]): s for s in syncs}
    where, theta0, before, after, handed = observe(cfg)
    names = list(theta0)
    frag = [[x for x in names if where[x] == p] for p in range(o.fragments)]
    prev_theta = {x: t.double() for x, t in theta0.items()}
    prev_buf = {x: torch.zeros_like(t) for x, t in prev_theta.items()}
    prev_replicas = [theta0] * R  # fp32, after the previous count's events: every replica starts at theta0
    taken: dict[int, tuple[dict, dict]] = {}
    keys = ("synced", "skipped", "across_rounds", "partial_windows", "restarted", "absent_updates", "rejoins")
    seen = dict.fromkeys(keys, 0)
    for count in sorted(before):
        k = (count - 1) // H + 1
        replicas = [{x: t.double() for x, t in w.items()} for w in before[count]]
        run_theta, run_buf, run_replicas = after[count]
        for m in range(R):
            if status[k - 1][m] == "absent":  # trained nothing: exactly where the previous count left it
                assert all(torch.equal(before[count][m][x], prev_replicas[m][x]) for x in names), (count, m)
                seen["absent_updates"] += 1
            elif count == (k - 1) * H + 1 and k > 1 and status[k - 2][m] == "absent":  # rejoining
                first = handed[count - 1][m]
                assert int(first.step.sum()) == 0 and all(not t.any() for t in first.m.values()), (count, m)
                seen["rejoins"] += 1
        moved: set[str] = set()
        for p in range(o.fragments):
            if (count, p) in takes:  # the mean pseudo-gradient over the contributors, from the weights now
                cs, n = takes[(count, p)]["contributors"], max(1, len(takes[(count, p)]["contributors"]))
                deltas = {x: sum(prev_theta[x] - replicas[m][x] for m in cs) / n for x in frag[p]}
                spread = {x: sum((prev_theta[x] - replicas[m][x]).abs() for m in cs) / n for x in frag[p]}
                taken[p] = (deltas, spread)
            if (count, p) not in landings:
                continue
            sync = landings[(count, p)]
            cs, n = sync["contributors"], len(sync["contributors"])
            deltas, spread = taken.pop(p)
            seen["across_rounds"] += sync["window"][0] // H + 1 != k
            if sync["skipped"]:  # below the quorum: the fragment's global weights and momentum stay, exactly
                for x in frag[p]:
                    assert torch.equal(run_theta[x].double(), prev_theta[x]), (count, p, x)
                    assert torch.equal(run_buf[x].double(), prev_buf[x]), (count, p, x)
                seen["skipped"] += 1
            else:
                for x in frag[p]:
                    args = (prev_theta[x], prev_buf[x], deltas[x], spread[x], n, run_theta[x], run_buf[x])
                    assert_outer_step(o, *args, (count, p, x))
                seen["synced"] += 1
                seen["partial_windows"] += sum(sync["steps"][m] < len(sync["window"]) for m in cs)
            for m in range(R):  # the merge
                for x in frag[p]:
                    g = run_theta[x]
                    if o.merge_alpha and m in cs:
                        want = g.double() + o.merge_alpha * (replicas[m][x] - g.double())
                        bound = 3 * U32 * (g.double().abs() + replicas[m][x].abs())
                        assert ((run_replicas[m][x].double() - want).abs() <= bound).all(), (count, p, x, m)
                    else:
                        assert torch.equal(run_replicas[m][x], g), (count, p, x, m)
                seen["restarted"] += bool(o.merge_alpha) and m not in cs
            moved |= set(frag[p])
        for x in names:  # what did not land is untouched, globally and in every replica
            if x not in moved:
                assert torch.equal(run_theta[x].double(), prev_theta[x]), (count, x)
                assert torch.equal(run_buf[x].double(), prev_buf[x]), (count, x)
                assert all(torch.equal(run_replicas[m][x], before[count][m][x]) for m in range(R)), (count, x)
        prev_theta = {x: t.double() for x, t in run_theta.items()}
        prev_buf = {x: t.double() for x, t in run_buf.items()}
        prev_replicas = run_replicas
    assert not taken  # every pseudo-gradient taken has landed
    return seen


@pytest.mark.parametrize("tau", [0, 1])
@pytest.mark.parametrize("merge_alpha", [0.0, 0.5])
def test_every_fragment_sync_equals_the_float64_reference_over_the_contributors(tau, merge_alpha):
    """11 fragment syncs (fragment 0 after counts 2, 6, 10, 14, 18 and in the flush at 20, fragment 1
    after 4, 8, ..., 20): 9 synced, round 4's 2 skipped; fragment 0's 4 syncs of rounds 2-5 have windows
    reaching back into the round before, and 2 contributors (replica 1 in round 3, replica 0 in round 5)
    trained only the part of theirs after their absence; at alpha 0.5 the 12 non-contributors' copies
    (1 in each of round 2's and round 3's syncs, all 4 in each of round 4's) restart from the global
    weights; replicas absent over 8 replica-updates; 2 rejoins."""
    seen = check_fragment_syncs(fragments_cfg(tau, merge_alpha))
    assert seen == {
        "synced": 9,
        "skipped": 2,
        "across_rounds": 4,
        "partial_windows": 2,
        "restarted": 12 if merge_alpha else 0,
        "absent_updates": 8,
        "rejoins": 2,
    }


@pytest.mark.parametrize(
    "control, reference, statuses, first",
    [
        # replica 2 missed round 3: its pseudo-gradient reaches round 3's first sync (fragment 0's, landing
        # after update 10) in the reference only
        ("ignores the miss", [x for x in FRAGMENT_EVENTS if x != "3:2:miss"], "take", "(10, 0, "),
        # round 2's fragment 0 sync (taken after update 5, landing after 6) has the window 2..4, which starts
        # in round 1: by round 1's statuses replica 1 (absent in round 2) would contribute its updates 2, 3
        ("the window's first round", FRAGMENT_EVENTS, "window", "(6, 0, "),
    ],
)
def test_a_reference_with_the_wrong_statuses_is_caught_at_that_sync(control, reference, statuses, first):
    """The negative controls (P 2, tau 1): the run checked against a reference that ignores a miss, or that
    takes a window's statuses from the round it starts in instead of the take's, fails at the first sync
    where they differ, and there (count, fragment, parameter)."""
    cfg, wrong = fragments_cfg(1), fragments_cfg(1, events=reference)
    with pytest.raises(AssertionError) as e:
        check_fragment_syncs(cfg, reference=wrong, statuses=statuses)
    assert str(e.value).startswith(first), (control, str(e.value)[:80])


@pytest.mark.parametrize("merge_alpha", [0.0, 0.5])
def test_stacked_equals_the_loop_with_fragments_delay_and_churn(merge_alpha):
    """Invariant 6 with churn, fragments and a delay (P 2, tau 1): the bound of
    tests/test_streaming_engines.py (`assert_streaming_engines_agree`: `assert_engines_agree`'s, with the
    syncs counted per fragment and the merge's lerp roundings in the floor, `streaming_rounding_floors`)."""
    assert_streaming_engines_agree(fragments_cfg(1, merge_alpha))


# The entry's run: R 4, H 4, P 2, tau 1, 16 updates (4 rounds). Replica 1 absent in round 2 and rejoining
# in 3, replica 2 missing round 2 and absent from round 3 on, replica 3 missing round 3, round 4 below the
# quorum of 2 (0 and 3 missing, 2 absent: 1 alone; its three fragment syncs, the flush's included, skipped).
KILL_EVENTS = ["2:1:leave", "3:1:rejoin", "2:2:miss", "3:2:leave", "3:3:miss", "4:0:miss", "4:3:miss"]


def test_killed_with_a_fragment_in_flight_mid_absence_resumes_bit_identically(tmp_path):
    """Invariant 9 with churn, fragments and a delay: fragment 0's sync of round 2 is taken after update 5
    (replica 1 absent, replica 2 missing: 0 and 3 contribute) and lands after 6; a checkpoint after
    update 5 holds it in flight; SIGKILL after update 6's inner step, before that landing. resume=true
    equals an uninterrupted run exactly: every row (the sync rows' contributors, absent, missed, skipped
    included), the summary's churn figures and weights.pt (`assert_identical_streaming`).

    The uninterrupted run's sync rows and summary figures equal what `fragment_syncs` and
    `churn_figures` compute from the documented rule and the paper's windows: missed replica-rounds
    1 + 1 + 2 = 4, absent 1 + 1 + 1 = 3, 3 syncs skipped, goodput 38 / (2 * 52): of the 52 replica-steps
    computed (16 + 12 + 12 + 12), round 1's syncs reach 4 * (1 + 3) (tau 1: fragment 0's window is
    update 0, fragment 1's updates 0-2), round 2's 2 * (3 + 3), round 3's (3 + 1) + (3 + 3) (replica 1
    trained only update 8 of fragment 0's window 6-8), round 4's none."""
    args = [*QUICK, "logger=none", "replicas=4", "inner.H=4", "phase.updates=16", "outer.fragments=2",
            "outer.delay=1", "checkpoint.every_updates=5", f"churn.events=[{','.join(KILL_EVENTS)}]",
            "churn.min_quorum=2"]  # fmt: skip
    run_dir, reference = killed_beside_uninterrupted(args, tmp_path, "0:6:kill:after")
    assert sorted((run_dir / "checkpoints").glob("ckpt-u*.pt"))[-1] == ckpt(run_dir, 5)
    pending = torch.load(ckpt(run_dir, 5), weights_only=False)["state"]["pending"]  # 0 and 3 contribute
    assert (pending["fragment"], pending["taken_at"]) == (0, 5)
    assert pending["stepped"] == [True, False, False, True]
    resumed(args, run_dir, tmp_path)
    assert_identical_streaming(run_dir, reference)
    rows, want = read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["from"] for r in rows if r["kind"] == "resume"] == [str(ckpt(run_dir, 5))]
    assert churn_summary(rows) == churn_summary(want)

    cfg = compose_cfg(args)
    status, syncs, computed = fragment_syncs(cfg)
    figures = churn_figures(cfg, status, syncs, computed)
    assert {k: churn_summary(want)[k] for k in figures} == figures
    assert figures == {
        "churn/missed_replica_rounds": 4,
        "churn/absent_replica_rounds": 3,
        "churn/skipped_syncs": 3,
        "churn/goodput": 38 / 104,
    }
    assert computed == sum(x is not None for r in want if r["kind"] == "update" for x in r["loss"])
    got = [(r["update"], r["fragment"], r["contributors"], r["skipped"]) for r in want if r["kind"] == "sync"]
    assert got == [(s["land"], s["fragment"], s["contributors"], s["skipped"]) for s in syncs]
    for field, status_ in (("absent", "absent"), ("missed", "miss")):  # the round's, on each of its syncs
        assert [r[field] for r in want if r["kind"] == "sync"] == [
            [m for m in range(4) if status[s["round"] - 1][m] == status_] for s in syncs
        ]


# -- 5. bad input --------------------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "everyone_out",
    [["churn.events=[1:0:leave,1:1:leave]"], ["cluster=h100", "churn.deadline=1e-15"]],
    ids=["absent", "late"],
)
def test_a_run_where_no_replica_ever_trains_finishes_on_its_initial_weights(tmp_path, everyone_out):
    """Every replica absent for the whole run, or stopped by a deadline shorter than any step: every sync
    is skipped, the run finishes (exit 0) on its initial weights and its summary has counts but no rates
    (issue 35: the throughput summary divided by zero seconds, a traceback, end row `failed`)."""
    run_dir = tmp_path / "run"
    done = entry([*QUICK, "logger=none", "replicas=2", *everyone_out, f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[-1] == {**rows[-1], "kind": "end", "status": "finished"}
    syncs = [r for r in rows if r["kind"] == "sync"]
    assert syncs and all(r["skipped"] and r["replicas_synced"] == 0 for r in syncs)
    summary = [r for r in rows if r["kind"] == "summary"][-1]
    assert summary["bench/presentations"] == 0 and "bench/tokens_per_s" not in summary
    cfg = compose_cfg([*QUICK, "logger=none", "replicas=2", *everyone_out])
    assert_same_weights(torch.load(run_dir / "weights.pt"), initial_weights(prepare(cfg)))
