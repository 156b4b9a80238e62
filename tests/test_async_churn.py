"""Churn with asynchronous replicas (outer.schedule=async with churn.*, docs/async.md "Churn with async"):
replica m's j-th job has churn's round-j status; an absent job trains and pushes nothing, a missed one
trains and its push is dropped; either returns when it would have arrived and pulls the weights then.

The schedule is re-derived here by another walk (a heap of timed events, the rules of the docs), on exact
binary fractions and on a run's own clock; the server's weights equal the float64 delayed Nesterov of
tests/test_async.py over the arrivals that did arrive (and not with an absence counted as an arrival);
the steps trained are the plan's minus the absent jobs'; a rejoining job with rejoin_state=reset trains
from a fresh optimizer state; loop = stacked bitwise; drawn churn is a pure function of the config; a run
killed mid-absence resumes to the uninterrupted one and real processes equal the simulation (slow).
"""

from __future__ import annotations

import hashlib
import heapq
import shlex
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    QUICK,
    ReferenceRuns,
    assert_same_weights,
    compose_cfg,
    killed_beside_uninterrupted,
    resumed,
)
from test_async import ASYNC, FixedTiming, arrivals, async_cfg, excess, four_one_slow, reference_dn

from hypertrain.choices import RejoinState
from hypertrain.config import ChurnConfig
from hypertrain.data.batches import targets_of
from hypertrain.diloco.asynchrony.arrivals import Timing, job_steps, schedule
from hypertrain.diloco.asynchrony.asynchronous import server_updates
from hypertrain.diloco.churn import Schedule
from hypertrain.diloco.state import RunState
from hypertrain.engines import engine_for
from hypertrain.model.shapes import param_roles
from hypertrain.optim.inner import init_state
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.records.files import read_records

# -- the schedule, re-derived -----------------------------------------------------------------------


def derive(steps, updates, duration, message, absent, dropped):
    """The rules of docs/async.md walked as timed events, grace 0: every replica starts job 1 at 0;
    replica m's job j (`steps[m]` steps, the last cut) lasts `duration(m, j, first, n)` then `message`;
    at each clock time t the jobs arriving then (not in `absent` or `dropped`, pairs (m, j)) are one
    server update in replica order, whose replicas pull it and start their next jobs at t + message; then
    the jobs returning at t (absent or dropped) pull the weights so far and start theirs at t + message.
    Returns per update (clock, replicas, staleness, [(m, j, kind)] returned since the update before; the
    last update also those after it)."""
    R = len(steps)
    done, count, events, rows, away, applied = [0] * R, [0] * R, [], [], [], 0

    def begin(m: int, t: float, pulled: int) -> None:
        if done[m] >= updates:
            return
        count[m] += 1
        n = min(steps[m], updates - done[m])
        kind = "absent" if (m, count[m]) in absent else "dropped" if (m, count[m]) in dropped else "arrives"
        end = t + duration(m, count[m], done[m], n) + message
        heapq.heappush(events, (end, 1 if kind != "arrives" else 0, m, count[m], kind, pulled))
        done[m] += n

    for m in range(R):
        begin(m, 0.0, 0)
    while events:
        t = events[0][0]
        now = []
        while events and events[0][0] == t:
            now.append(heapq.heappop(events))
        arriving = [e for e in now if e[4] == "arrives"]  # sorted by (order 0, replica)
        if arriving:
            applied += 1
            rows.append((t, [e[2] for e in arriving], [applied - 1 - e[5] for e in arriving], away))
            away = []
            for e in arriving:
                begin(e[2], t + message, applied)
        for e in (e for e in now if e[4] != "arrives"):
            away.append((e[2], e[3], e[4]))
            begin(e[2], t + message, applied)
    if away:
        rows[-1] = (*rows[-1][:3], rows[-1][3] + away)
    return rows


def walked(updates) -> list:
    """`arrivals.schedule`'s updates in `derive`'s terms."""
    return [
        (
            u.clock_s,
            [j.replica for j in u.jobs],
            u.staleness,
            [(j.replica, j.index, "absent" if j.absent else "dropped") for j in u.away],
        )
        for u in updates
    ]


def fixed_duration(timing):
    def duration(m, j, first, n):
        compute = 0.0
        for _ in range(n):
            compute += timing.step_s(16, m, j)
        return compute

    return duration


def statuses(events: list[str], replicas: int, jobs: int) -> Schedule:
    return Schedule.of(ChurnConfig(events=events), replicas, jobs)


def test_equal_speeds_with_a_replica_away_for_its_jobs_2_and_3():
    """R = 3, H = 2, 8 steps: 4 jobs each of 2S + M = 9/16 s (S = 1/4, M = 1/16). Replica 2 leaves at
    its job 2 and rejoins at its job 4 (`2:2:leave`, `4:2:rejoin`): updates 1 and 4 apply all three,
    2 and 3 replicas 0 and 1 only; replica 2's jobs 2 and 3 return at updates 2 and 3's times, pull
    them (after the update at the same time) and are listed on the update after (3, 4)."""
    churn = statuses(["2:2:leave", "4:2:rejoin"], 3, 4)
    assert [churn.absent(j, 2) for j in (1, 2, 3, 4)] == [False, True, True, False]
    timing = FixedTiming((1.0, 1.0, 1.0))
    got = walked(schedule(async_cfg().outer, 2, 8, timing, lambda k, m: 16, churn))
    t = [9 / 16 + (i - 1) * 10 / 16 for i in (1, 2, 3, 4)]
    assert got == [
        (t[0], [0, 1, 2], [0, 0, 0], []),
        (t[1], [0, 1], [0, 0], []),
        (t[2], [0, 1], [0, 0], [(2, 2, "absent")]),
        (t[3], [0, 1, 2], [0, 0, 0], [(2, 3, "absent")]),
    ]
    assert got == derive([2, 2, 2], 8, fixed_duration(timing), 1 / 16, {(2, 2), (2, 3)}, set())


@pytest.mark.parametrize(
    "events",
    [
        ["2:0:leave", "4:0:rejoin", "3:1:miss"],  # the fast replica away, the other misses once
        ["2:2:leave", "3:1:miss", "5:1:miss"],  # the slow one leaves for good; its absences trail
        ["1:0:leave", "1:1:leave", "1:2:leave", "3:0:rejoin"],  # nothing arrives before replica 0 is back
    ],
)
def test_one_slow_replica_with_absences_and_misses_follows_the_rules(events):
    """R = 3, speeds (1, 1, 0.5), H = 2, 8 steps (4 jobs each): every update's replicas, staleness,
    clock and the jobs that did not arrive equal the event walk's; the schedule ends."""
    timing = FixedTiming((1.0, 1.0, 0.5))
    churn = statuses(events, 3, 4)
    absent = {(m, j) for m in range(3) for j in range(1, 5) if churn.absent(j, m)}
    dropped = {(m, j) for m in range(3) for j in range(1, 5) if not churn.absent(j, m)} - {
        (m, j) for m in range(3) for j in range(1, 5) if churn.contributes(j, m)
    }
    got = walked(schedule(async_cfg().outer, 2, 8, timing, lambda k, m: 16, churn))
    assert got == derive([2, 2, 2], 8, fixed_duration(timing), 1 / 16, absent, dropped)
    assert sum(len(row[3]) for row in got) == len(absent) + len(dropped) > 0


def test_a_phase_where_nothing_arrives_has_no_server_update():
    """One replica absent for its whole phase: the walk ends with no update (nothing to apply)."""
    churn = statuses(["1:0:leave"], 1, 4)
    assert schedule(async_cfg().outer, 2, 8, FixedTiming((1.0,)), lambda k, m: 16, churn) == []


# -- a run ------------------------------------------------------------------------------------------

EVENTS = ["2:1:leave", "4:1:rejoin", "4:0:miss"]  # replica 1 away for its jobs 2-3; replica 0 misses job 4


def churn_cfg(events=EVENTS, engine="loop", rejoin="reset", **outer):
    """async_cfg's R = 2, speeds (1, 0.5), H = 2, 12 steps a replica (6 jobs), with churn `events`."""
    base = async_cfg(engine=engine, updates=12, **outer)
    return replace(base, churn=ChurnConfig(events=list(events), rejoin_state=RejoinState[rejoin]))


def run_async(cfg, engine=None):
    """The run's server updates, each (update, its deltas as applied, the flat weights after), the
    (step, replica) of every batch trained, and the final weights."""
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    trained, batch = [], run.batch
    run.batch = lambda k, m, share=None: (trained.append((k, m)), batch(k, m, share))[1]
    seen, apply = [], state.asynchronous.server.apply

    def recording(theta, deltas, tokens):
        mean = apply(theta, deltas, tokens)
        seen.append((deltas.clone(), torch.cat([t.reshape(-1) for t in theta.values()]).clone()))
        return mean

    state.asynchronous.server.apply = recording
    theta0 = torch.cat([t.reshape(-1) for t in state.theta.values()]).clone()
    updates = [applied.update for applied in server_updates(run, state, engine)]
    return run, updates, seen, theta0, trained, state.theta


@pytest.fixture(scope="module")
def dn_run():
    return run_async(churn_cfg(rule="delayed_nesterov", dn_activation=0.25))


def test_a_runs_arrivals_follow_the_rules_on_its_own_clock(dn_run):
    run, updates, *_ = dn_run
    timing = Timing.of(run.cfg)

    def duration(m, j, first, n):
        compute = 0.0
        for k in range(first, first + n):
            compute += timing.step_s(targets_of(run.dataset, run.replica_ids(k, m)), m, j)
        return compute

    want = derive([2, 2], 12, duration, timing.message_s, {(1, 2), (1, 3)}, {(0, 4)})
    assert walked(updates) == want
    assert sum(len(u.jobs) for u in updates) == 12 - 3  # 12 jobs, two absent and one dropped


def test_the_server_applies_delayed_nesterov_to_the_arrivals_that_arrived_only(dn_run):
    """Every update is one arrival: Algorithm 3 over the arrived pseudo-gradients (float64, the bound of
    tests/test_async.py) holds at every update; counting the absent jobs as zero arrivals does not."""
    run, updates, seen, theta0, *_ = dn_run
    cfg = run.cfg
    assert all(len(u.jobs) == 1 for u in updates)
    deltas = [d[0] for d, _ in seen]
    record = [(None, theta0), *seen]
    lr, beta = cfg.outer.lr, cfg.outer.momentum
    assert excess(record, reference_dn(theta0, deltas, lr, beta, N=2, c=0.25)) <= 0
    # negative control: each absence counted as an arrival of zero where it was listed (its count in
    # the buffer then shifts the momentum's updates), compared after each real arrival
    padded, after = [], []
    for u, g in zip(updates, deltas, strict=True):
        padded += [torch.zeros_like(g) for j in u.away if j.absent] + [g]
        after.append(len(padded) - 1)
    wrong = reference_dn(theta0, padded, lr, beta, N=2, c=0.25)
    assert excess(record, [wrong[i] for i in after]) > 0


def test_the_steps_trained_are_the_plans_less_the_absent_jobs(dn_run):
    """Replica 1's jobs 2 and 3 (H = 2: its steps 2..5) trained nothing; every other step of both
    replicas was trained once, the dropped job's included."""
    _, _, _, _, trained, _ = dn_run
    assert sorted(trained) == sorted(
        {(k, m) for k in range(12) for m in (0, 1)} - {(k, 1) for k in (2, 3, 4, 5)}
    )
    assert len(trained) == len(set(trained))


def test_a_rejoining_job_trains_from_a_fresh_state_with_reset_and_its_own_with_carry():
    """Replica 1's job 4 (steps 6, 7) rejoins: with reset the engine gets a zero state (step 0) and its
    pseudo-gradient equals the engine's from a state made fresh by `init_state`; with carry the state is
    the one it left with (not zero), and the final weights differ."""
    seen = {}

    def engine_of(mode):
        engine = engine_for("loop")

        def watching(cfg, theta, assigns, states, average=None, stop=None):
            fresh = None
            for a, s in zip(assigns, states, strict=True):
                if (a.replica, a.global_step0) == (1, 6):
                    seen[mode] = (int(s.step.sum()), float(sum(t.abs().sum() for t in s.m.values())))
                    one = {n: t.unsqueeze(0) for n, t in theta.items()}
                    fresh = engine(cfg, theta, [a], [init_state(cfg.inner, one, param_roles(cfg.model))])
            results = engine(cfg, theta, assigns, states, average, stop)
            if fresh is not None and mode == "reset":
                got = results[[a.replica for a in assigns].index(1)].params
                assert all(torch.equal(got[n], fresh[0].params[n]) for n in got)
            return results

        return watching

    reset = run_async(churn_cfg(rejoin="reset"), engine_of("reset"))[-1]
    carry = run_async(churn_cfg(rejoin="carry"), engine_of("carry"))[-1]
    assert seen["reset"] == (0, 0.0)
    assert seen["carry"][0] > 0 and seen["carry"][1] > 0
    assert any(not torch.equal(reset[n], carry[n]) for n in reset)


def test_the_loop_and_stacked_engines_agree_bitwise_with_churn():
    """Four replicas, one half as fast, DyLU, an absence and a miss: every weight equal."""
    base = churn_cfg(events=["2:1:leave", "4:1:rejoin", "2:3:miss", "3:0:leave", "4:0:rejoin"], dylu=True)
    got = []
    for engine in ("stacked", "loop"):
        cfg = four_one_slow(base, engine)
        got.append(run_async(cfg)[-1])
    assert all(torch.equal(got[0][n], got[1][n]) for n in got[1])


def test_drawn_churn_with_async_is_a_pure_function_of_the_config():
    """Drawn leaves and misses (mean absence 2 jobs): two runs apply the same jobs in the same order, list
    the same absences and end on the same weights."""
    cfg = replace(churn_cfg(events=[]), churn=ChurnConfig(p_leave=0.3, p_miss=0.2, mean_absence=2.0, seed=3))
    a, b = run_async(cfg), run_async(cfg)
    assert a[1] == b[1]
    assert any(j.absent for u in a[1] for j in u.away) and any(j.dropped for u in a[1] for j in u.away)
    assert all(torch.equal(a[-1][n], b[-1][n]) for n in a[-1])


REPO = Path(__file__).resolve().parents[1]


# -- records -----------------------------------------------------------------------------------------

CHURN = [*ASYNC, "churn.events=[2:1:leave,4:1:rejoin,4:0:miss]"]


def summary_of(run_dir) -> dict:
    out = {}
    for r in read_records(run_dir / "metrics.jsonl"):
        if r.kind == "summary":
            out |= r.values
    return out


def test_the_docs_churn_example_reaches_every_job_its_events_name(tmp_path):
    """docs/async.md's "Churn with async" command, read from the page and run as written (its two hand
    events past `experiment=quick`'s 2 jobs a replica never happened, issue 48 item 18): replica 1 away
    for its jobs 2 and 3, replica 0's job 3 dropped; goodput = steps that reached the server / steps
    computed, 3 steps a job: (24 - 2 * 3 - 3) / (24 - 2 * 3)."""
    page = (REPO / "docs" / "async.md").read_text()
    command = page[page.index("## Churn with async") :].split("python -m hypertrain.train", 1)[1]
    command = command.split("\n\n", 1)[0].replace("\\\n", " ")
    overrides = [arg.strip('"') for arg in shlex.split(command, posix=False)]
    run_dir = ReferenceRuns.beside(tmp_path)([*overrides, "logger=none"])
    rows = arrivals(run_dir)
    absent = sorted((a["replica"], a["job"]) for r in rows for a in r["absent"])
    dropped = [(a["replica"], a["job"]) for r in rows for a in r["dropped"]]
    assert absent == [(1, 2), (1, 3)] and dropped == [(0, 3)]
    summary = summary_of(run_dir)
    assert (summary["async/absent_jobs"], summary["async/dropped_jobs"]) == (2, 1)
    assert summary["churn/goodput"] == pytest.approx((24 - 6 - 3) / (24 - 6), rel=1e-12)


def test_the_rows_list_each_absence_and_drop_and_the_summary_counts_them(tmp_path):
    """The entry's run (R 2, 6 jobs each): the rows' absent and dropped jobs are replica 1's jobs 2 and 3
    (steps 2..5) and replica 0's job 4 (steps 6, 7); the summary's counts, goodput (steps that reached
    the server / steps computed: (24 - 4 - 2) / (24 - 4)) and the ids digest, chained here over each
    update's arrivals and the plan's ids."""
    run_dir = ReferenceRuns.beside(tmp_path)(CHURN)
    rows = arrivals(run_dir)
    absent = [(a["replica"], a["job"], a["first"], a["steps"]) for r in rows for a in r["absent"]]
    dropped = [(a["replica"], a["job"], a["first"], a["steps"]) for r in rows for a in r["dropped"]]
    assert sorted(absent) == [(1, 2, 2, 2), (1, 3, 4, 2)] and dropped == [(0, 4, 6, 2)]
    summary = summary_of(run_dir)
    assert summary["async/absent_jobs"] == 2 and summary["async/dropped_jobs"] == 1
    assert summary["async/arrivals"] == 9 and summary["churn/goodput"] == 18 / 20
    run = prepare(compose_cfg(CHURN))
    digest = ""
    for r in rows:
        h = hashlib.sha256(digest.encode())
        h.update(f"update {r['update']}".encode())
        for m, first, steps in sorted(zip(r["replicas"], r["first"], r["steps"], strict=True)):
            h.update(f"replica {m}".encode())
            for k in range(first, first + steps):
                h.update(np.asarray(run.replica_ids(k, m), dtype=np.int64).tobytes() + b"|")
        digest = h.hexdigest()
    assert summary["churn/contributed_ids_sha256"] == digest
    # the report's updates done count the absent and dropped jobs' steps as taken: every replica its 12
    from hypertrain.report.runs import load_run
    from hypertrain.report.table import figures

    assert figures(load_run(run_dir))["updates"] == "12/12"
    # outer bytes (docs/async.md, Records): replica 0 sent 5 of its 6 jobs (job 4 dropped), replica 1 4
    # (jobs 2 and 3 absent); each job pulled the weights after it, 4 N, arrived or not, and each arrived
    # one an fp32 upload, 4 N
    n = summary["model/params"]
    moved = [5 * 8 * n + 4 * n, 4 * 8 * n + 2 * 4 * n]
    assert summary["comm/outer_total_bytes"] == max(moved) == load_run(run_dir).outer_total_bytes()
    assert summary["comm/outer_replica_bits"] == [5 * 32 * n, 4 * 32 * n]


@pytest.mark.slow
def test_a_run_killed_while_a_replica_is_away_resumes_to_the_uninterrupted_one(tmp_path):
    """SIGKILL before server update 4, replica 1 away (its absent job 3 started after update 3 and
    returns after update 4: listed on update 5's row), resume=true: every row and the weights equal
    the uninterrupted run's."""
    rows = arrivals(ReferenceRuns.beside(tmp_path)(CHURN))
    assert [(a["replica"], a["job"]) for a in rows[3]["absent"]] == [(1, 2)]
    assert [(a["replica"], a["job"]) for a in rows[4]["absent"]] == [(1, 3)]
    run_dir, reference = killed_beside_uninterrupted(CHURN, tmp_path, "0:4:kill")
    resumed(CHURN, run_dir, tmp_path)
    assert arrivals(run_dir) == arrivals(reference)
    assert_same_weights(torch.load(run_dir / "weights.pt"), torch.load(reference / "weights.pt"))


@pytest.mark.slow
def test_real_processes_with_churn_equal_the_simulation_bitwise(tmp_path):
    """torchrun, 2 processes of two replicas (R 4, one twice as slow), an absence on each process and a
    miss: every arrival row (absences included) and weights.pt equal the one-process simulation's."""
    from test_async_dist import LAYOUTS, SLOW, assert_equal_runs, both

    events = "churn.events=[2:1:leave,4:1:rejoin,3:3:miss,3:2:leave,5:2:rejoin]"
    sim, real = both([*QUICK, *SLOW, *LAYOUTS["replicas"], events], tmp_path)
    assert_equal_runs(real, sim)
    assert any(r.get("absent") for r in arrivals(sim)) and any(r.get("dropped") for r in arrivals(sim))


def test_the_churn_draws_cover_every_replicas_jobs():
    """The statuses are drawn for the most jobs a replica takes, ceil(updates / min H_m) (DyLU: 10 / 2)."""
    from hypertrain.diloco.asynchrony.arrivals import jobs_per_replica

    outer = async_cfg(dylu=True).outer
    assert job_steps(outer, 4, [1.0, 0.5]) == [4, 2] and jobs_per_replica(outer, 4, 10, [1.0, 0.5]) == 5


def test_the_reports_updates_done_count_a_jobs_steps_absent_or_dropped_as_taken():
    """A replica whose last job was away has taken its steps all the same (the phase ends after every
    replica's phase.updates): replica 1's only job absent, replica 2's dropped, both at step 2."""
    from hypertrain.records.rows import ArrivalRow
    from hypertrain.report.table import async_steps_done

    def away(m):
        return [{"replica": m, "job": 1, "first": 0, "steps": 2}]

    row = ArrivalRow(update=1, replicas=[0], first=[0], steps=[2], absent=away(1), dropped=away(2))
    assert async_steps_done([row], 3) == 2
    assert async_steps_done([replace(row, absent=None, dropped=None)], 3) == 0
