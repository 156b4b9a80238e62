"""The network clock (docs/clock.md): every formula against hand-computed seconds; a finished run's
clock replayed from its records equals the hand-added formulas; one run's clock is the same whatever
engine or processes computed it (DESIGN.md invariant 11); a delayed fragment hides what the compute of
its updates covers; a compressed run is timed by its payload; bad input is one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from helpers import QUICK, REPO, entry, error_lines, finish, recorded_clock, start_entry
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from hypertrain.clock import timeline
from hypertrain.clock.formulas import (
    Link,
    all_gather_s,
    all_to_all_s,
    exposed_s,
    modelled_compute_s,
    ring_allreduce_s,
    two_phase_s,
)
from hypertrain.clock.replay import clock_of, in_order, run_cluster, time_to_loss
from hypertrain.clock.timeline import Clock, Shape, straggler_factors
from hypertrain.config import (
    INT64_MAX,
    LINKS,
    MAX_STRAGGLER_SIGMA,
    MIN_MFU,
    MIN_PEAK_TFLOPS,
    MIN_REPLICA_SPEED,
    ClusterConfig,
    LinkConfig,
    StragglerConfig,
    UserError,
)
from hypertrain.records import formats
from hypertrain.records.rows import UpdateRow
from hypertrain.report.clock import retime
from hypertrain.rundir.records import read_metrics

GIGABIT = 1e9 / 8  # bytes per second


def test_ring_allreduce_is_two_n_minus_one_steps_of_one_nth():
    link = Link(bandwidth=1000.0, latency=0.5)
    # n = 4, 4000 bytes: 6 steps of (0.5 s + 1000 bytes / 1000 B/s) = 9 s
    assert ring_allreduce_s(4000, 4, link) == pytest.approx(9.0)
    assert ring_allreduce_s(4000, 2, link) == pytest.approx(2 * (0.5 + 2.0))
    assert ring_allreduce_s(4000, 1, link) == 0.0


def test_all_gather_all_to_all_and_two_phase():
    link = Link(bandwidth=100.0, latency=0.25)
    assert all_gather_s(200, 3, link) == pytest.approx(2 * (0.25 + 2.0))  # 4.5 s
    assert all_to_all_s(300, 3, link) == pytest.approx(2 * (0.25 + 1.0))  # 2.5 s
    assert two_phase_s(300, 3, link) == pytest.approx(4 * (0.25 + 1.0))  # 5 s
    assert all_gather_s(200, 1, link) == two_phase_s(300, 1, link) == 0.0


def test_exposed_is_what_compute_does_not_hide():
    assert exposed_s(3.0, 1.0) == 2.0
    assert exposed_s(1.0, 3.0) == 0.0


def test_modelled_compute_is_six_n_d_over_the_achieved_peak():
    # 1e9 params, 1e3 tokens: 6e12 FLOPs at 1e15 * 0.5 FLOP/s = 12 ms; attention adds its FLOPs
    assert modelled_compute_s(10**9, 1000, 1e15, 0.5) == pytest.approx(0.012)
    assert modelled_compute_s(10**9, 1000, 1e15, 0.5, attention_flops=5e11) == pytest.approx(0.013)


def test_config_units_convert_to_bytes_and_seconds():
    link = Link.of(LinkConfig("x", bandwidth_gbit=8.0, latency_us=250.0))
    assert (link.bandwidth, link.latency) == (1e9, 250e-6)
    assert LINKS["internet_1g"].bandwidth == GIGABIT


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"intra": LinkConfig("x", 0.0, 1.0)},
            r"cluster.intra.bandwidth_gbit=0.0 is out of range; valid: >= 1e-09",
        ),
        (
            {"inter": LinkConfig("x", 1.0, -1.0)},
            r"cluster.inter.latency_us=-1.0 is out of range; valid: \[0, 1e\+12\]",
        ),
        ({"mfu": 1.5}, r"cluster.mfu=1.5 is out of range; valid: \[1e-06, 1\]"),
        ({"mfu": 0.0}, r"cluster.mfu=0.0 is out of range; valid: \[1e-06, 1\]"),
        ({"peak_tflops": -1.0}, "cluster.peak_tflops=-1.0 is out of range; valid: >= 1e-06"),
        (
            {"straggler": StragglerConfig(sigma=-0.1)},
            r"cluster.straggler.sigma=-0.1 is out of range; valid: \[0, 10\]",
        ),
        # beyond these the clock's seconds overflow float64 (hypertrain.config, MAX_STRAGGLER_SIGMA)
        ({"straggler": StragglerConfig(sigma=1e6)}, r"cluster.straggler.sigma=1000000.0 is out of range"),
        ({"inter": LinkConfig("x", 5e-324, 1.0)}, "cluster.inter.bandwidth_gbit=5e-324 is out of range"),
        ({"intra": LinkConfig("x", 1.0, 1e300)}, r"cluster.intra.latency_us=1e\+300 is out of range"),
        ({"peak_tflops": 1e-300}, "cluster.peak_tflops=1e-300 is out of range"),
        ({"mfu": 1e-300}, "cluster.mfu=1e-300 is out of range"),
        (
            {"straggler": StragglerConfig(sigma=math.nan)},
            "cluster.straggler.sigma=nan is not a finite number",
        ),
        ({"inter": LinkConfig("x", 1.0, math.inf)}, "cluster.inter.latency_us=inf is not a finite number"),
        # 1 / 1e-320 overflows (issue 48: training stopped mid-run at clock_s=inf, the clock printed nan)
        ({"replica_speeds": [1.0, 1e-320]}, r"cluster.replica_speeds=\[1.0, 1e-320\] is out of range"),
        ({"replica_speeds": [1.0, 0.0]}, "valid: finite numbers >= 1e-54"),
    ],
)
def test_a_bad_cluster_is_one_line_naming_field_value_and_what_is_valid(change, message):
    with pytest.raises(UserError, match=message):
        dataclasses.replace(ClusterConfig(), **change).check()


def test_the_slowest_speed_allowed_keeps_the_clock_finite_at_every_other_extreme(monkeypatch):
    """A replica's speed divides its steps' seconds. At the extremes of every other range (1 FLOP/s,
    int64-many parameters and tokens, the largest straggler factor numpy's normals can give at
    MAX_STRAGGLER_SIGMA) a step of a replica at MIN_REPLICA_SPEED, taken int64-many times, is finite
    (hypertrain.config's bound: below 1e174 s); at a subnormal speed one step is already infinite."""
    # numpy's standard normals stay below its ziggurat's tail, 3.65 + sqrt(2 * 53 ln 2) (hypertrain.config)
    largest = math.exp(MAX_STRAGGLER_SIGMA * (3.65 + math.sqrt(2 * 53 * math.log(2))))
    monkeypatch.setattr(timeline, "straggler_factors", lambda straggler, k, R: np.full(R, largest))
    cluster = ClusterConfig(
        compute="modelled",
        peak_tflops=MIN_PEAK_TFLOPS,
        mfu=MIN_MFU,
        straggler=StragglerConfig(sigma=MAX_STRAGGLER_SIGMA),
        replica_speeds=[1.0, MIN_REPLICA_SPEED],
    )
    cluster.check()
    row = UpdateRow(update=1, round=1, loss=[1.0, 1.0], tokens=INT64_MAX, rank_seconds=[0.0])
    shape = Shape(2, 1, 1, 1, 0, "none", "gather")
    step = Clock(shape, cluster, 1, model_params=INT64_MAX).update(row)
    # 6 N D / (1 FLOP/s) with N = 2^63 and D = 2^63 / 2 tokens a replica, the factor, over the speed
    assert step == pytest.approx(6 * INT64_MAX * (INT64_MAX / 2) * largest / MIN_REPLICA_SPEED, rel=1e-12)
    assert step * INT64_MAX < 1e174
    subnormal = dataclasses.replace(cluster, replica_speeds=[1.0, 1e-320])  # what check() refuses
    assert Clock(shape, subnormal, 1, model_params=INT64_MAX).update(row) == math.inf


def test_stragglers_are_seeded_lognormal_and_none_at_sigma_zero():
    assert straggler_factors(StragglerConfig(0.0, 1), 3, 4).tolist() == [1.0] * 4
    a = straggler_factors(StragglerConfig(0.5, 1), 3, 4).tolist()
    assert a == straggler_factors(StragglerConfig(0.5, 1), 3, 4).tolist()
    assert a != straggler_factors(StragglerConfig(0.5, 1), 4, 4).tolist()


def test_an_old_rows_take_follows_the_streaming_schedule():
    taken_at = formats.streaming_take  # what a sync row written before it held `taken_at` is given
    # H 8, P 2, tau 1: fragment 0 lands after 4 (taken after 3), fragment 1 after 8 (taken after 7); at
    # the end of an 8-update phase fragment 0 is flushed: taken and landed at 8.
    assert [taken_at(4, 0, 8, 2, 1), taken_at(8, 1, 8, 2, 1), taken_at(8, 0, 8, 2, 1)] == [3, 7, 8]
    assert taken_at(12, 0, 8, 2, 1) == 11
    # tau 2, a phase ending at 7: fragment 1 (due to land after 8) was taken after 6 and is flushed at 7
    # with what it took; fragment 0, landed after 4, is taken and lands at 7
    assert taken_at(7, 1, 8, 2, 2) == 6 and taken_at(7, 0, 8, 2, 2) == 7


def _args(tmp_path, name: str, extra: list[str]) -> list[str]:
    return [*QUICK, "logger=none", "logger.progress=never", f"hydra.run.dir={tmp_path / name}", *extra]


STREAMING = ["world=2", "replicas=2", "inner.H=4", "phase.updates=8", "outer.fragments=2", "outer.delay=1"]
COMPRESSED = ["outer.compress=int8", "outer.codec.reduce=two_phase"]
MODELLED = ["cluster=h100", "cluster.straggler.sigma=0.3"]  # a clock that reads no timing


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four short runs: the quick DiLoCo run (on the default cluster, cpu_here: measured compute), and
    one streaming compressed run on h100 (modelled compute, stragglers) on the stacked engine, the loop
    engine (both in this process) and two real processes (started first, trained meanwhile)."""
    tmp = tmp_path_factory.mktemp("clock")
    dist = _args(tmp, "dist", [*STREAMING, *COMPRESSED, *MODELLED, "processes=dist"])
    started = start_entry(dist, tmp)
    done = {
        "quick": entry(_args(tmp, "quick", []), tmp),
        "stacked": entry(_args(tmp, "stacked", [*STREAMING, *COMPRESSED, *MODELLED, "engine=stacked"]), tmp),
        "loop": entry(_args(tmp, "loop", [*STREAMING, *COMPRESSED, *MODELLED, "engine=loop"]), tmp),
        "dist": finish(started),
    }
    out = {}
    for name, result in done.items():
        run = tmp / name
        assert result.returncode == 0, result.stderr[-2000:]
        resolved = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=True)
        out[name] = (run, read_metrics(run), resolved)
    return out


def _modelled(**links) -> ClusterConfig:
    cluster = ClusterConfig(name="test", compute="modelled", peak_tflops=1e-3, mfu=0.5, **links)
    cluster.check()
    return cluster


def _params(rows) -> int:
    return next(r["model/params"] for r in rows if r.get("kind") == "summary" and "model/params" in r)


def test_a_runs_clock_is_its_formulas_added_by_hand(runs):
    """The quick run: world 8, R 2 (L 4 ranks a replica), H 3, 6 updates of 1024 tokens a replica, 2
    fp32 syncs. Every update: compute and the inner ring all-reduce; every sync: the outer one."""
    _, rows, resolved = runs["quick"]
    cluster = _modelled()
    n = _params(rows)
    tokens = next(r["tokens"] for r in rows if r.get("kind") == "update") / 2
    compute = 6 * n * tokens / (1e9 * 0.5)
    intra, inter = cluster.intra, cluster.inter
    inner = 2 * 3 * (intra.latency + 4 * n / (4 * intra.bandwidth))
    outer = 2 * 1 * (inter.latency + 4 * n / (2 * inter.bandwidth))
    clock = clock_of(rows, resolved, cluster)
    assert clock["total_s"] == pytest.approx(6 * (compute + inner) + 2 * outer, rel=1e-12)
    assert clock["compute_s"] == pytest.approx(6 * compute, rel=1e-12)
    # an update's clock is at its end, before the sync landing after it; the sync's after it
    assert [u["clock_s"] for u in clock["updates"]][:4] == pytest.approx(
        [compute + inner, 2 * (compute + inner), 3 * (compute + inner), 4 * (compute + inner) + outer],
        rel=1e-12,
    )
    assert [(s["update"], s["clock_outer_hidden_s"]) for s in clock["syncs"]] == [(3, 0.0), (6, 0.0)]
    assert clock["syncs"][0]["clock_s"] == pytest.approx(3 * (compute + inner) + outer, rel=1e-12)
    assert clock["syncs"][1]["clock_compute_s"] == pytest.approx(3 * compute, rel=1e-12)
    assert clock["syncs"][1]["clock_inner_s"] == pytest.approx(3 * inner, rel=1e-12)
    assert clock["compute_utilization"] == pytest.approx(6 * compute / clock["total_s"])
    # the best held-out loss is the last sync's here, reached when the run ends
    assert clock["time_to_best_s"] == pytest.approx(clock["total_s"])
    # scaled to 1000x the parameters: compute and every byte scale, latencies do not
    big = clock_of(rows, resolved, cluster, model_params=1000 * n)
    inner_big = 2 * 3 * (intra.latency + 1000 * 4 * n / (4 * intra.bandwidth))
    outer_big = 2 * (inter.latency + 1000 * 4 * n / (2 * inter.bandwidth))
    assert big["total_s"] == pytest.approx(6 * (1000 * compute + inner_big) + 2 * outer_big, rel=1e-12)


def test_the_clock_depends_on_schedule_and_bytes_never_on_the_engine(runs):
    cluster = _modelled(straggler=StragglerConfig(sigma=0.3, seed=7))
    clocks = {name: clock_of(runs[name][1], runs[name][2], cluster) for name in ("stacked", "loop", "dist")}
    assert clocks["stacked"] == clocks["loop"] == clocks["dist"]


def test_a_delayed_fragment_exposes_only_what_compute_did_not_hide_and_is_timed_by_its_payload(runs):
    """The streaming run (H 4, P 2, tau 1, 8 updates, int8 two_phase, R 2): each scheduled landing was
    taken one update earlier, so its all-to-all hides behind one update's compute and its all-gather of
    shard means runs at the landing; the final flush of fragment 0 hides nothing."""
    _, rows, resolved = runs["stacked"]
    slow = LinkConfig("slow", bandwidth_gbit=1e-4, latency_us=1000.0)  # 12,500 bytes/s
    cluster = _modelled(inter=slow)
    n = _params(rows)
    tokens = next(r["tokens"] for r in rows if r.get("kind") == "update") / 2  # over 2 replicas
    compute = 6 * n * tokens / (1e9 * 0.5)
    link = Link.of(slow)
    syncs = [r for r in rows if r.get("kind") == "sync"]
    clock = clock_of(rows, resolved, cluster)
    assert [(s["update"], s["fragment"]) for s in clock["syncs"]] == [(2, 0), (4, 1), (6, 0), (8, 1), (8, 0)]
    for row, sync in zip(syncs, clock["syncs"], strict=True):
        a2a = all_to_all_s(row["payload_bytes"], 2, link)  # the payload's bytes, not fp32's
        assert a2a > compute  # the link is slow enough that something shows
        hidden = 0.0 if (sync["update"], sync["fragment"]) == (8, 0) else compute
        assert sync["clock_outer_hidden_s"] == pytest.approx(hidden, rel=1e-12)
        assert sync["clock_outer_exposed_s"] == pytest.approx(2 * a2a - hidden, rel=1e-12)
        assert sync["clock_outer_hidden_s"] + sync["clock_outer_exposed_s"] == pytest.approx(
            two_phase_s(row["payload_bytes"], 2, link)
        )


def test_training_records_its_clock_the_same_on_every_engine_and_as_the_replay(runs):
    """With modelled compute the records of one run hold one clock whatever computed it (==): every
    update's `clock_s`, every sync's split, every eval's `clock_s` and the summary's totals; each equals
    the replay of the same records on the run's own cluster exactly (one arithmetic, `timeline.Clock`)."""
    recorded = {name: recorded_clock(runs[name][0]) for name in ("stacked", "loop", "dist")}
    assert recorded["stacked"] == recorded["loop"] == recorded["dist"]
    _, rows, resolved = runs["stacked"]
    cluster = run_cluster(resolved)
    assert cluster.name == "h100" and cluster.compute == "modelled" and cluster.straggler.sigma == 0.3
    replay = clock_of(rows, resolved, cluster)
    got = recorded["stacked"]
    assert [f["clock_s"] for kind, _, f in got["rows"] if kind == "update"] == [
        u["clock_s"] for u in replay["updates"]
    ]
    syncs = [f for kind, _, f in got["rows"] if kind == "sync"]
    assert syncs == [{k: v for k, v in s.items() if k.startswith("clock_")} for s in replay["syncs"]]
    evals = [(u, f["clock_s"]) for kind, u, f in got["rows"] if kind == "eval"]
    assert evals == [(h["update"], h["clock_s"]) for h in replay["heldout"] if h["update"] > 0]
    assert got["summary"] == {
        f"clock/{k}": replay[k] for k in (s.removeprefix("clock/") for s in got["summary"])
    }
    assert got["summary"]["clock/total_s"] == syncs[-1]["clock_s"] > 0
    assert 0 < got["summary"]["clock/compute_utilization"] < 1
    # the time to the best held-out loss is the clock of the eval row that holds it
    best = min((h for h in replay["heldout"]), key=lambda h: h["eval_loss"])
    assert got["summary"]["clock/time_to_best_s"] == best["clock_s"] > 0
    assert time_to_loss(replay["heldout"], best["eval_loss"]) == best["clock_s"]
    assert time_to_loss(replay["heldout"], best["eval_loss"] - 1e-9) is None


def test_a_measured_clock_is_the_runs_own_rank_seconds(runs):
    """On the default cluster (cpu_here, measured) each update's compute is its row's slowest
    `rank_seconds`: the recorded clock equals the replay of the records, and the first update's clock is
    that update's seconds plus the inner all-reduce."""
    _, rows, resolved = runs["quick"]
    replay = clock_of(rows, resolved, run_cluster(resolved))
    updates = [r for r in rows if r.get("kind") == "update"]
    assert [r["clock_s"] for r in updates] == [u["clock_s"] for u in replay["updates"]]
    inner = clock_of(rows, resolved, run_cluster(resolved))["inner_s"] / len(updates)
    assert updates[0]["clock_s"] == pytest.approx(max(updates[0]["rank_seconds"]) + inner, rel=1e-12)


def _before_take_and_size(rows: list[dict]) -> list[dict]:
    """The rows as a run wrote them before a sync row held its `taken_at` and `params`."""
    return [{k: v for k, v in r.items() if k not in ("taken_at", "params")} for r in rows]


def test_sync_rows_hold_their_take_and_size_and_older_rows_replay_the_same(runs, tmp_path):
    """A sync row records when its pseudo-gradient was taken and how many parameters it synced (the
    landing's own: the clock never re-derives them); records written before they did are given them
    by `formats.upgrade_sync_row` and replay the same clock, for fp32 fragments (the ring's bytes
    inverted) and a codec's (timed by its payload)."""
    fp32 = tmp_path / "fp32"
    assert entry(_args(tmp_path, "fp32", [*STREAMING, *MODELLED]), tmp_path).returncode == 0
    written = OmegaConf.to_container(OmegaConf.load(fp32 / "config.yaml"), resolve=True)
    for rows, resolved in ((read_metrics(fp32), written), runs["stacked"][1:]):
        syncs = [r for r in rows if r.get("kind") == "sync"]
        # H 4, P 2, tau 1 over 8 updates: each fragment lands H/P apart, taken one update before; the
        # last flush of fragment 0 at 8 is taken there (docs/streaming.md)
        assert [(r["update"], r["fragment"], r["taken_at"]) for r in syncs][:4] == [
            (2, 0, 1), (4, 1, 3), (6, 0, 5), (8, 1, 7),
        ]  # fmt: skip
        assert syncs[0]["params"] + syncs[1]["params"] == _params(rows)  # the two fragments: the model
        cluster = run_cluster(resolved)
        older = _before_take_and_size(rows)
        assert clock_of(older, resolved, cluster) == clock_of(rows, resolved, cluster)
        params = _params(rows)
        upgraded = [
            formats.upgrade_sync_row(r, resolved, params) for r in in_order(older) if r.kind == "sync"
        ]
        assert [r.taken_at for r in upgraded] == [r["taken_at"] for r in syncs]
        if resolved["outer"]["compress"] == "none":
            assert [r.params for r in upgraded] == [r["params"] for r in syncs]


def _clock_cli(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "hypertrain.clock", *map(str, args)], cwd=cwd, capture_output=True, text=True
    )


def test_the_command_prints_a_line_per_run_and_takes_cluster_overrides(runs):
    run = runs["quick"][0]
    done = _clock_cli(
        run,
        runs["stacked"][0],
        "cluster=h100",
        "cluster/inter=internet_1g",
        "--model-params",
        "1000000000",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert (
        len(lines) == 3 and lines[0].startswith("run") and "h100" in lines[1] and "1,000,000,000" in lines[1]
    )
    resolved = runs["quick"][2]
    assert resolved["cluster"]["name"] == "cpu_here"  # a new run records its cluster, the default one


@pytest.mark.parametrize(
    "args, message",
    [
        (["{missing}"], "is not a run directory"),
        (["{run}", "cluster=h200"], "Could not find 'cluster/h200'; valid: a100, cpu_here, h100"),
        (["{run}", "cluster/inter=modem"], "Could not find 'cluster/inter/modem'; valid: cross_region_10g"),
        (["{run}", "cluster.inter.bandwidth_gbit=0"], "cluster.inter.bandwidth_gbit=0.0 is out of range"),
        (["{run}", "cluster.intra.latency_us=-5"], "cluster.intra.latency_us=-5.0 is out of range"),
        (["{run}", "cluster.mfu=2"], r"cluster.mfu=2.0 is out of range; valid: [1e-06, 1]"),
        (["{run}", "cluster.mfu=abc"], "could not be converted to Float"),
        (["{run}", "inner.H=3"], "'inner.H=3' is not a cluster override"),
        (["{run}", "--model-params", "-3"], "--model-params='-3' is not valid"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, args, message):
    run = runs["quick"][0]
    done = _clock_cli(*[a.format(run=run, missing=tmp_path / "none") for a in args])
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("hypertrain.clock: error: ") and message in line, line


@pytest.mark.parametrize(
    "override",
    [
        "cluster.straggler.sigma=nan",  # the clock said nan seconds, exit 0
        "cluster.inter.latency_us=inf",
        "cluster.compute=guessed",  # a choice: OmegaConf refuses it as either entry composes
    ],
)
def test_the_clock_command_refuses_a_cluster_number_with_trainings_own_line(tmp_path, capsys, override):
    """One validation for both entries (`ClusterConfig.check`, the choices' enums): a cluster value
    training refuses, the clock command refuses with the same line, exit 2 (both in this process)."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "config.yaml"):  # refused before either is read
        (run / name).write_text("")
    assert retime.main([str(run), "cluster=h100", override]) == 2
    clock_lines = capsys.readouterr().err.splitlines()
    trained = entry([*QUICK, "logger=none", "cluster=h100", override], tmp_path, process=False)
    assert trained.returncode == 2, trained.stderr
    (line,) = trained.stderr.splitlines()
    assert line.startswith(f"hypertrain: error: {override.partition('=')[0]}="), line
    assert clock_lines == [line.replace("hypertrain:", "hypertrain.clock:", 1)]
    assert not GlobalHydra.instance().is_initialized()  # the entry put Hydra back as the clock left it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # neither wrote anything


def test_the_clock_command_refuses_speeds_not_one_per_replica_with_trainings_own_line(runs, tmp_path, capsys):
    """`ClusterConfig.check_replicas`, asked by training's preflight and by the clock for each run it
    times (by that run's R): the same line, the clock's naming the run, exit 2, nothing written. Fewer
    speeds than replicas were an IndexError traceback (more, cut silently: the catalogue's
    clock-speeds-more-than-replicas; a subnormal speed there too)."""
    run, _, resolved = runs["quick"]
    override = "cluster.replica_speeds=[1]"
    assert retime.main([str(run), override, "--out", str(tmp_path / "out")]) == 2
    clock_lines = capsys.readouterr().err.splitlines()
    trained = entry([*QUICK, "logger=none", override], tmp_path, process=False)
    assert trained.returncode == 2, trained.stderr
    (line,) = trained.stderr.splitlines()
    assert line == (
        "hypertrain: error: cluster.replica_speeds=[1.0] has 1 speeds; valid: one per replica "
        f"({resolved['replicas']}), or []"
    )
    assert clock_lines == [line.replace("hypertrain: error: ", f"hypertrain.clock: error: {run}: ", 1)]
    assert list(tmp_path.iterdir()) == []  # neither wrote anything


def test_a_clock_that_overflowed_would_stop_the_run_in_one_line_never_writing_a_non_json_row(
    tmp_path, monkeypatch
):
    """The ranges keep the clock finite; were a factor still infinite, the records' writer stops the run
    (NonFiniteError, exit 1) before metrics.jsonl holds Infinity, and every line it wrote is JSON."""
    monkeypatch.setattr(timeline, "straggler_factors", lambda straggler, k, R: np.full(R, np.inf))
    done = entry([*QUICK, "logger=none", f"hydra.run.dir={tmp_path / 'run'}", "cluster=h100"], tmp_path)
    assert done.returncode == 1, done.stderr
    line = (
        "hypertrain: error: run failed: the update row of update 1 holds clock_s=inf, a number JSON cannot "
        f"hold (metrics.jsonl's rows are JSON); the run stops ({tmp_path / 'run'})"
    )
    assert error_lines(done.stderr) == [line] and "Traceback" not in done.stderr
    rows = read_metrics(tmp_path / "run")  # strictly: NaN and Infinity are refused
    assert [r["kind"] for r in rows][-1] == "end" and rows[-1]["exit_code"] == 1
    assert "update" not in [r["kind"] for r in rows]


def test_the_clock_command_refuses_a_parameter_count_its_arithmetic_cannot_hold(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "config.yaml"):
        (run / name).write_text("")
    assert retime.main([str(run), "--model-params", "1" + "0" * 400]) == 2  # was an OverflowError traceback
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("hypertrain.clock: error: --model-params='1000") and line.endswith(
        "is not valid; valid: a whole number from 1 to 10^15"
    )


def test_a_run_written_before_the_clock_replays_on_the_default_cluster(runs, tmp_path):
    run, rows, resolved = runs["quick"]
    older = tmp_path / "older"
    older.mkdir()
    (older / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    OmegaConf.save(
        OmegaConf.create({k: v for k, v in resolved.items() if k != "cluster"}), older / "config.yaml"
    )
    done, now = _clock_cli(older), _clock_cli(run)
    assert (
        done.returncode == 0
        and done.stdout.splitlines()[1].split()[1:] == now.stdout.splitlines()[1].split()[1:]
    )
