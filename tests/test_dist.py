"""processes=dist on real processes (gloo, CPU), run through the entry as a user runs it.

docs/design.md, "Real processes" and invariant 7.

Parity. Each case runs `python -m hypertrain.train processes=dist ...` (self-launched workers,
or `torchrun`) in a subprocess and compares what rank 0 wrote (per-replica losses at every update from
metrics.jsonl, the held-out losses of the eval and sync rows, the final global weights in weights.pt)
with the simulation of the same TrainConfig (composed with the same overrides, as the entry composes
it), run in this process by the per-replica loop: the float64 reference and the fp32 peer, with the
bound of test_stacked: the dist run's error against the float64 reference stays within twice the fp32
simulation's own error, or twice its floor (`rounding_floors`, references.py). The factor-2 argument
holds for dist because the two fp32 paths evaluate the same real-number expression with roundings of
the same number and size, only in another order:
- benchmark layout: a replica's gradient is the average of its L ranks' gradients, each the gradient of
  its share weighted with the plan's `world = L` coefficients. Summing a replica's N targets as L
  partial sums of N/L, then the L partials in the all-reduce, is log2(N/L) + log2(L) = log2(N) levels of
  addition, as in the single pass of the simulation; the factor L in the rank weights and the division
  by L in the average are exact for L a power of two (the cases use L = 1, 2). A rank's share is cut
  into at most as many microbatches as the replica's, so the loss floor's microbatch count covers it.
  A weak phase at W = kB presents each id on k of the L ranks, weighted with `world = L/k`: the k equal
  partials of a stream add exactly to k times one (k = 2 in the cases), so its sums have the same
  levels as a strong phase's at L/k ranks, and the factor L/k and the division by L are powers of two.
- the sync's all-reduce sums the R replicas' pseudo-gradients (HSDP-sharded, or once over the stacked
  layout's processes) like the simulation's torch.sum, in another order: R terms, the same count of
  roundings of a pseudo-gradient, far below U32 of the weights (references.py, `float64_arithmetic`).
- replicas layout: each process trains its R/P replicas with its engine, each on its whole share
  (`world` = 1), as `engine=stacked` does (invariant 6); only the sync's sum differs, as above.
- the held-out loss is the same code on the global weights (rank 0), a loss of the same form as a
  training loss: its floor is `rounding_floors`' loss floor for the held-out batch.

Failures: the test-only fault hook (`HYPERTRAIN_FAULT=RANK:UPDATE:kill|sleep`) kills
or hangs rank 1 at the start of a known round (H = 1, so round U holds update U); the run must stop with
exit code 1, one line per rank that failed plus the parent's, rank 0's records flushed up to the last
finished round and closed with a failed `end` row, within processes.timeout_s plus an allowance for rank 0's
own work and the launcher's poll (derived in `test_a_dead_or_hung_rank_stops_the_run_within_the_timeout`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

import pytest
import torch
from helpers import (
    DIST,
    FAULT_ENV,
    QUICK,
    compose_cfg,
    entry,
    error_lines,
    finish,
    rounding_floors,
    simulate_streaming,
    simulated_beside,
    start_entry,
    streaming_bounds_used,
    tree,
)
from omegaconf import OmegaConf
from references import assert_losses_within_rounding, assert_within_rounding

from hypertrain.failures import RankFailed
from hypertrain.preflight.checks import validate
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.rundir.records import read_metrics
from hypertrain.rundir.wandb_offline import read_run

# -- the simulation ------------------------------------------------------------------------------


# -- parity --------------------------------------------------------------------------------------


@dataclass
class Case:
    overrides: list[str]
    layout: str  # what the run must record
    nproc: int
    tail: int = 0  # > 0: the last update holds only this many ids (fewer than replicas)
    torchrun: int = 0  # > 0: started by torchrun with this many processes, else self-launched


# churn (docs/churn.md), replicas layout: 2 processes of 2 replicas each; replica 1 absent in rounds 2-3
# (its process idles through them, contributing nothing), replica 2 missing round 3, replica 1 rejoining
# in round 4 with a fresh inner state; a deadline (modelled compute, stragglers) stops replicas after 1
# of the round's 2 steps in every round (replica 0 in rounds 1 and 4, ...).
CHURN_P2_R4 = [
    "world=4",
    "replicas=4",
    "processes.nproc=2",
    "inner.H=2",
    "phase.updates=8",
    "churn.events=[2:1:leave,4:1:rejoin,3:2:miss]",
    "cluster=h100",
    "cluster.straggler.sigma=0.5",
    "churn.deadline=3e-7",
]
CASES = {
    # benchmark, L = 2 ranks average every update; R = 1, so the sync is the replica's all-gather alone.
    "w2-r1-adamw-torchrun": Case(["world=2", "replicas=1"], "benchmark", 2, torchrun=2),
    # benchmark, L = 1: no inner all-reduce, the sync one all-reduce over 2 replicas; 4 microbatches each.
    "w2-r2-muon-microbatches": Case(
        ["world=2", "replicas=2", "inner=muon", "inner.micro_batch=4"], "benchmark", 2
    ),
    # benchmark, L = 2, R = 2 on 4 processes: HSDP sync (cross-replica groups, then all-gather);
    # variable-length documents cut by the length rule; the last round is a tail update of 1 id: replica
    # 1 skips it (the sync averages replica 0 alone) and rank 1 of replica 0 has no ids (zero gradient).
    "w4-r2-adamw-documents-tail": Case(
        [
            "world=4",
            "replicas=2",
            "data.examples=documents",
            "data.max_len=64",
            "data.max_examples=4",
            "inner.H=2",
            "phase.updates=5",
        ],
        "benchmark",
        4,
        tail=1,
    ),
    # benchmark, weak phase at W = 2 = k*B (base world B = 1, k = 2), R = 1, L = 2: both ranks present
    # all of V_0 (every id twice); the logged loss must still be the replica's token mean, as in the
    # simulation. The quick loop's weak case: two processes.
    "w2-r1-weak-k2": Case(
        [
            "phase=cpu_weak",
            "phase.base_world=1",
            "world=2",
            "replicas=1",
            "inner.H=1",
            "phase.updates=2",
            "phase.timing_warmup=1",
        ],
        "benchmark",
        2,
    ),
    # benchmark, cpu_weak itself at W = 4 = k*B (B = 2, k = 2), R = 2, L = 2: each replica has one base
    # stream, presented by both of its ranks; 2 rounds of 2 updates, HSDP syncs across the replicas.
    "w4-r2-weak-k2": Case(
        ["phase=cpu_weak", "world=4", "replicas=2", "inner.H=2", "phase.updates=4", "phase.timing_warmup=1"],
        "benchmark",
        4,
    ),
    # replicas layout: 2 processes of 2 replicas each, stacked (P = 2 != W = 4, P divides R = 4); the last
    # round is a tail update of 1 id, so process 1 has no replica that steps in it.
    "stacked-p2-r4-muon-tail": Case(
        ["world=4", "replicas=4", "processes.nproc=2", "inner=muon", "inner.H=3", "phase.updates=7"],
        "replicas",
        2,
        tail=1,
    ),
    # The engine is its own choice under real processes: each process runs the loop reference.
    # benchmark, W = 2, R = 1, L = 2, engine=loop: the replica's two ranks average their gradients.
    "loop-w2-r1": Case(
        ["engine=loop", "world=2", "replicas=1", "inner.H=2", "phase.updates=4"], "benchmark", 2
    ),
    # churn, replicas layout (CHURN_P2_R4)
    "churn-replicas-p2-r4": Case(CHURN_P2_R4, "replicas", 2),
    # the same with outer.mean_weights=tokens (docs/async.md, "Weighted mean"): each process weighs its
    # replicas by the tokens all R trained on (the deadline's unequal steps), one all-reduce of the sums.
    "tokens-churn-replicas-p2-r4": Case([*CHURN_P2_R4, "outer.mean_weights=tokens"], "replicas", 2),
    # churn, benchmark layout (W 4, R 2, L 2): replica 0's two ranks idle through round 2, replica 1
    # misses round 3.
    "churn-benchmark-w4-r2": Case(
        [
            "world=4",
            "replicas=2",
            "inner.H=2",
            "phase.updates=8",
            "churn.events=[2:0:leave,3:0:rejoin,3:1:miss]",
        ],
        "benchmark",
        4,
    ),
    # replicas layout, engine=loop: 2 processes of 2 replicas each, one after another.
    "loop-replicas-p2-r4": Case(
        ["engine=loop", "world=4", "replicas=4", "processes.nproc=2", "inner.H=2", "phase.updates=4"],
        "replicas",
        2,
    ),
}


def tail_offset(overrides: list[str], tail: int) -> str:
    """phase.offset that leaves `tail` ids for the phase's last update (the stream's end cuts it)."""
    cfg = compose_cfg(overrides)
    samples = prepare(cfg).samples
    return f"phase.offset={samples - (cfg.phase.updates - 1) * cfg.phase.global_batch - tail}"


# The quick loop (`pytest -m 'not slow'`) keeps one case of each kind; the rest are slow.
SLOW_CASES = {
    "churn-replicas-p2-r4",  # churn on real processes: the fragments-delay-churn case below
    "w2-r1-weak-k2",  # the weak phase's ids: the plan's and the simulation's tests
    "churn-benchmark-w4-r2",
    "tokens-churn-replicas-p2-r4",  # outer.mean_weights=tokens on real processes
    "w4-r2-adamw-documents-tail",
    "w4-r2-weak-k2",
    "stacked-p2-r4-muon-tail",
    "w2-r2-muon-microbatches",
    "loop-replicas-p2-r4",
    "loop-w2-r1",  # the loop engine is the simulation's reference (tests/test_engines.py, test_stacked.py)
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW_CASES else ()) for n in CASES]
)
def test_real_processes_equal_the_simulation_within_rounding(tmp_path, name):
    case = CASES[name]
    overrides = [*DIST, *case.overrides]
    if case.tail:
        overrides.append(tail_offset(overrides, case.tail))
    args = overrides if case.torchrun else [*overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    proc = start_entry(args, tmp_path, torchrun=case.torchrun)  # runs while the simulation runs here

    cfg = compose_cfg(overrides)
    batches, (ref_losses, ref_evals, ref_theta), (sim_losses, sim_evals, sim_theta), run = simulated_beside(
        proc, cfg
    )
    done = finish(proc)
    assert done.returncode == 0, done.stderr

    if case.torchrun:  # rank 0's run directory alone: rank 1 made none (Hydra's default dir has a time)
        (metrics,) = tmp_path.rglob("metrics.jsonl")
        run_dir = metrics.parent
        assert [p.name for p in tmp_path.iterdir()] == ["outputs"]
        mine = {run_dir, *run_dir.parents}
        stray = [p for p in tmp_path.rglob("*") if p.is_dir() and p not in mine and run_dir not in p.parents]
        assert stray == [], f"directories besides rank 0's run: {stray}"
    else:
        run_dir = tmp_path / "run"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "finished"

    # The chosen layout is written to the run's config and summary.
    written = OmegaConf.load(run_dir / "config.yaml")
    assert (written.processes.name, written.processes.layout, written.processes.nproc) == (
        "dist",
        case.layout,
        case.nproc,
    )
    assert written.engine.name == cfg.engine.name  # the engine each process ran: its own choice
    summary = {k: v for r in rows if r["kind"] == "summary" for k, v in r.items()}
    assert summary["engine/layout"] == case.layout

    updates = [r for r in rows if r["kind"] == "update"]
    syncs = [r for r in rows if r["kind"] == "sync"]
    assert [r["update"] for r in updates] == list(range(1, len(ref_losses) + 1))
    losses = [r["loss"] for r in updates]
    evals = [r["eval_loss"] for r in rows if r["kind"] == "eval"] + [r["eval_loss"] for r in syncs]
    weights = torch.load(run_dir / "weights.pt")
    assert set(weights) == set(ref_theta)

    # Every sync moved the global weights, and the run ends away from where it started.
    assert all(r["pseudo_grad_norm"] > 0 for r in syncs), [r["pseudo_grad_norm"] for r in syncs]
    initial = initial_weights(run)
    assert all(not torch.equal(weights[n], initial[n]) for n in initial)
    # Measured communication beside the formula: a replica group all-reduces every update exactly when
    # the formula counts inner bytes (L > 1); every sync of P > 1 processes hands bytes to a collective.
    # (Measured on rank 0: with churn, when its replica was absent all round it sent nothing.)
    for r in syncs:
        idle = 0 in r.get("absent", []) and case.layout == "benchmark"
        assert (r["comm_measured_inner_bytes"] > 0) == (r["comm_inner_bytes"] > 0 and not idle), r
        assert r["comm_measured_outer_bytes"] > 0 and r["comm_measured_outer_s"] >= 0, r
    if "churn.deadline=3e-7" in case.overrides:  # the deadline stopped someone in every round
        assert [r["late"] for r in syncs] == [[0], [3], [2, 3], [0, 2, 3]]  # 1 absent in 3
    if case.tail:  # the tail was exercised: the last update leaves replicas out, and so does its sync
        stepped = sum(x is not None for x in losses[-1])
        assert stepped == case.tail < cfg.replicas and syncs[-1]["replicas_synced"] == stepped

    # Parity: losses, held-out losses and weights within twice the fp32 simulation's error (or floor).
    loss_floor, weight_floor = rounding_floors(cfg, batches, len(ref_losses))
    heldout_floor = rounding_floors(cfg, [run.heldout], 1)[0]
    used = [("losses", assert_losses_within_rounding(losses, sim_losses, ref_losses, loss_floor))]
    as_rows = lambda xs: [[x] for x in xs]  # noqa: E731
    used.append(
        (
            "held-out",
            assert_losses_within_rounding(
                as_rows(evals), as_rows(sim_evals), as_rows(ref_evals), heldout_floor
            ),
        )
    )
    used.append(
        (
            "weights",
            max(
                assert_within_rounding(weights[n], sim_theta[n], t, weight_floor * float(t.norm()), n)
                for n, t in ref_theta.items()
            ),
        )
    )
    print(f"{name}: fraction of the bound used", {k: round(v, 3) for k, v in used})


# Churn with Streaming DiLoCo (docs/churn.md; tests/test_churn.py, section 4): replicas layout, 2 processes
# of 2 replicas each, two fragments, the pseudo-gradient taken one update before each landing, H 4, 12
# updates (3 rounds). Round 2: replica 1 absent (process 0 runs replica 0 alone) and replicas 2 and 3
# missing (process 1 trains, contributes nothing): below the quorum of 2, both of its fragment syncs are
# skipped; replica 1 rejoins in round 3, whose fragment 0 window (updates 6-8) reaches back into round 2.
CHURN_STREAM = [
    "world=4",
    "replicas=4",
    "processes.nproc=2",
    "inner.H=4",
    "phase.updates=12",
    "outer.fragments=2",
    "outer.delay=1",
    "churn.events=[2:1:leave,3:1:rejoin,2:2:miss,2:3:miss]",
    "churn.min_quorum=2",
]


def test_real_processes_equal_the_simulation_with_fragments_delay_and_churn(tmp_path):
    """Invariant 7 with churn, fragments and a delay: `python -m hypertrain.train processes=dist ...`
    against the simulation of the same config (`simulate_streaming`, fp32 and float64), as
    tests/test_streaming_engines.py's fragment cases: per-replica losses (null where a replica is absent),
    the held-out losses of the eval rows and the final global weights within twice the fp32 simulation's
    error against the float64 one, or twice the floor (`streaming_rounding_floors`). The factor-2 argument
    above holds unchanged: churn decides from the config alone which replicas train and contribute, the
    same on every process and in the simulation (an absent replica gets no batches, a non-contributor a
    count of 0 in the sum). The sync rows: a landing per fragment in the paper's order and the flush
    (fragment 0 after 2, 6, 10 and in the flush at 12, fragment 1 after 4, 8, 12), round 2's two skipped
    with no replica synced, every other one synced by all four."""
    overrides = [*DIST, *CHURN_STREAM]
    proc = start_entry([*overrides, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    cfg = compose_cfg(overrides)
    batches, ref, sim, run = simulated_beside(proc, cfg, simulate_streaming)
    ref_losses = ref[0]
    done = finish(proc)
    assert done.returncode == 0, done.stderr
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "finished"
    summary = {k: v for r in rows if r["kind"] == "summary" for k, v in r.items()}
    assert summary["engine/layout"] == "replicas"

    syncs = [r for r in rows if r["kind"] == "sync"]
    everyone, skipped = [0, 1, 2, 3], {6, 8}
    landings = [(2, 0), (4, 1), (6, 0), (8, 1), (10, 0), (12, 1), (12, 0)]
    assert [(r["update"], r["fragment"]) for r in syncs] == landings
    assert [r["contributors"] for r in syncs] == [[] if r["update"] in skipped else everyone for r in syncs]
    assert [r["skipped"] for r in syncs] == [r["update"] in skipped for r in syncs]
    assert [r["replicas_synced"] for r in syncs] == [0 if r["update"] in skipped else 4 for r in syncs]
    updates = [r for r in rows if r["kind"] == "update"]
    losses = [r["loss"] for r in updates]
    assert [r["update"] for r in updates] == list(range(1, len(ref_losses) + 1))
    assert [x is None for r in losses[4:8] for x in r] == [False, True, False, False] * 4  # replica 1 absent
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["update"] for r in evals] == [0, 4, 8, 12]

    weights = torch.load(tmp_path / "run" / "weights.pt")
    got = (losses, [r["eval_loss"] for r in evals], weights)
    used = streaming_bounds_used(cfg, run, batches, got, sim, ref)
    print("fragments, delay and churn: fraction of the bound used", {k: round(v, 3) for k, v in used.items()})


# -- sweeps --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_sweep_of_dist_jobs_runs_each_as_its_own_wandb_run_in_one_group(tmp_path):
    sweep = tmp_path / "sweep"
    done = entry(
        [
            "-m",
            *QUICK,
            "logger=wandb",
            "processes=dist",
            "world=2",
            "replicas=1,2",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    jobs = sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").exists())
    assert [p.name for p in jobs] == ["0_w2_r1_h3", "1_w2_r2_h3"]
    ids, groups = set(), set()
    for job, replicas in zip(jobs, (1, 2), strict=True):
        rows = read_metrics(job / "metrics.jsonl")
        assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "finished"
        (wandb_dir,) = (job / "wandb").glob("offline-run-*")
        wandb_run = read_run(wandb_dir)
        assert wandb_run["exit_code"] == 0
        assert wandb_run["config"]["replicas"] == replicas
        assert (
            wandb_run["config"]["processes"]["layout"] == "benchmark"
            and wandb_run["config"]["processes"]["nproc"] == 2
        )
        assert wandb_run["summary"]["engine/layout"] == "benchmark"
        start = next(r for r in rows if r["kind"] == "start")
        assert wandb_run["run"]["id"] == start["wandb_run_id"]
        ids.add(wandb_run["run"]["id"])
        groups |= {wandb_run["run"]["group"], start["group"]}
        logged = [h for h in wandb_run["history"] if "train/loss_mean" in h]
        for row, h in zip([r for r in rows if r["kind"] == "update"], logged, strict=True):
            assert [h[f"train/loss/replica_{m}"] for m in range(replicas)] == row["loss"]
    assert len(ids) == 2
    assert len(groups) == 1 and groups.pop() == f"quick-{sweep.name}"


# -- failures ------------------------------------------------------------------------------------

FAULT_UPDATE = 3  # with H = 1, rounds 1 and 2 finish and the fault lands as round 3 starts
FAULT_TIMEOUT_S = 5.0
LAUNCHER_POLL_S = 0.1  # the self-launch's monitor_interval (hypertrain/launchers/local.py, launch)
SCHEDULING_S = 1.0  # a process of a 2-core machine shared by parallel tests may wait this long to run


@pytest.mark.slow  # a rank's death under real processes: the full suite's
@pytest.mark.parametrize("action", ["kill", "sleep"])
def test_a_dead_or_hung_rank_stops_the_run_within_the_timeout(tmp_path, action):
    """Rank 1 dies (SIGKILL) or hangs as round 3 starts. Exit code 1; one line from each rank that failed
    and the parent's; rank 0's metrics.jsonl holds rounds 1-2 and ends with a failed `end` row.

    The time bound. The fault's time is estimated from rank 0's own rows: its `start` row's time plus
    the `wall` of round 2's rows (rank 1 faults as it leaves round 2's last collective, which rank 0
    leaves at the same moment; `start` is written before `wall`'s clock starts, so the estimate is
    early, which only lengthens the measured interval). From there to the `end` row rank 0:
    (a) finishes its own work up to its next collective (logs round 2, evaluates the held-out loss, at
        most reads and steps round 3's first update): at most one round, whose length the run logs
        (the difference of two rounds' `wall`, which holds all of that);
    (b) waits in that collective: at once for a dead peer (gloo sees the closed connection), at most
        processes.timeout_s for a silent one; or the launcher, which polls every 0.1 s, stops it first;
    (c) writes the end row (one line).
    The estimate's early start adds what rank 0 did before `wall`'s clock started (the first held-out
    eval): at most one more round. So end - fault <= timeout_s + 2 * longest round + 0.1 s + 1 s, the
    last second for being scheduled on a 2-core machine that parallel tests share.
    """
    args = [
        *DIST,
        "world=2",
        "replicas=1",
        "inner.H=1",
        f"processes.timeout_s={FAULT_TIMEOUT_S}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    done = entry(args, tmp_path, env={FAULT_ENV: f"1:{FAULT_UPDATE}:{action}"})
    assert done.returncode == RankFailed.exit_code, done.stderr  # a rank died or hung (docs/errors.md)
    assert "Traceback" not in done.stderr, done.stderr

    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    finished = list(range(1, FAULT_UPDATE))
    assert [r["update"] for r in rows if r["kind"] == "update"] == finished
    assert [r["update"] for r in rows if r["kind"] == "sync"] == finished
    end = rows[-1]
    assert end["kind"] == "end" and end["status"] == "failed", end
    assert not (tmp_path / "run" / "weights.pt").exists()  # a failed run leaves no final weights

    # The error lines (a rank the launcher stops also notes the SIGTERM it got, not an error).
    lines = [x for x in error_lines(done.stderr) if x.startswith("hypertrain: error: ")]
    rank0 = [x for x in lines if x.startswith("hypertrain: error: run failed on rank 0: ")]
    rank1 = [x for x in lines if x.startswith("hypertrain: error: run failed on rank 1: ")]
    parent = [x for x in lines if x.startswith("hypertrain: error: run failed: ")]
    assert len(rank0) == 1 and len(parent) == 1 and len(lines) == 2 + len(rank1), done.stderr
    assert rank0[0] == f"hypertrain: error: run failed on rank 0: {end['error']}"
    stopped = "stopped by SIGTERM"
    if action == "kill":
        assert rank1 == []  # SIGKILL leaves no last words
        assert parent[0].startswith("hypertrain: error: run failed: rank 1 died of SIGKILL;"), parent
        # Rank 0 notices the dead peer in its next collective, unless the launcher's SIGTERM comes first.
        assert (end["exit_code"], end["error"].startswith(stopped)) in ((3, False), (143, True)), end
    else:
        assert "timed out" in end["error"].lower() and end["exit_code"] == 3, end
        assert parent[0].startswith("hypertrain: error: run failed: rank 0 exited with code 3;"), parent
        assert len(rank1) == 1 and stopped in rank1[0], done.stderr  # the launcher stops the hung rank

    start = rows[0]
    assert start["kind"] == "start"
    walls = sorted({r["wall"] for r in rows if r["kind"] == "update"})
    longest_round = max(b - a for a, b in zip([0.0, *walls], walls, strict=False))
    fault = start["time"] + walls[-1]
    allowance = 2 * longest_round + LAUNCHER_POLL_S + SCHEDULING_S
    elapsed = end["time"] - fault
    bound = FAULT_TIMEOUT_S + allowance
    assert 0 <= elapsed <= bound, f"{elapsed:.2f} s from the fault to the end row > {bound:.2f} s"
    print(f"{action}: fault -> end row {elapsed:.3f} s of {bound:.3f} s ({elapsed / bound:.3f})")


# -- layouts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["world.size=8", "replicas=4", "processes.nproc=3"],
            "processes=dist with 3 processes, world.size=8 and replicas=4 fits no layout",
        ),
        (
            ["world=4", "processes.layout=benchmark", "processes.nproc=2"],
            "processes=dist with 2 processes, world.size=4 and replicas=2 does not fit "
            "processes.layout=benchmark",
        ),
    ],
)
def test_processes_that_fit_no_layout_fail_with_one_line_and_create_nothing(tmp_path, overrides, named):
    done = entry([*DIST, *overrides], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"hypertrain: error: {named}; valid: "), done.stderr
    assert (
        "benchmark (processes = world.size" in lines[0] and "replicas (processes divide replicas" in lines[0]
    )
    assert tree(tmp_path) == {}, "a rejected run left files behind"
    # The command it offers is one that fits, with the rest of the user's config.
    command = re.search(r"e\.g\. (python -m hypertrain\.train .*)$", lines[0])
    assert command, lines[0]
    words = shlex.split(command.group(1))
    assert words[:3] == ["python", "-m", "hypertrain.train"]
    offered = dict(w.split("=", 1) for w in words[3:])
    mine = {k: v for k, v in (o.split("=", 1) for o in [*DIST, *overrides]) if k not in offered}
    validate(compose_cfg([f"{k}={v}" for k, v in (mine | offered).items()]))


# -- refusals under torchrun ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["processes.nproc=4"], "processes.nproc=4 but torchrun started 2 processes; valid: "),
        pytest.param(
            ["-m", "replicas=1,2"],
            "a multirun (-m) under torchrun is not supported: ",
            marks=pytest.mark.slow,  # the quick loop's refusal under torchrun: nproc's
        ),
    ],
    ids=["nproc", "multirun"],
)
def test_a_mistake_under_torchrun_is_one_line_from_rank_0_and_creates_nothing(tmp_path, overrides, says):
    """Every rank finds the mistake; rank 0 alone prints it and exits 2, the other ranks wait for the
    launcher to stop them (docs/distributed.md). What follows is torchrun's own: its log lines, its
    ChildFailedError summary naming rank 0's exit code 2 as the root cause, and its exit code 1."""
    args = ["processes=dist", "world=2", "replicas=1", *QUICK, "logger=none", *overrides]
    done = entry(args, tmp_path, torchrun=2)
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"hypertrain: error: {says}"), done.stderr
    assert done.returncode == 1, done.stderr  # torchrun's: the ChildFailedError it raises
    root_cause = done.stderr[done.stderr.index("Root Cause") :]
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\n\s*exitcode\s*: 2 ", root_cause), done.stderr
    assert tree(tmp_path) == {}, "a rejected run left files behind"
