"""The report reads an outer.schedule=async run fully (docs/report.md, "Async runs"): its throughput,
its outer bytes from the arrival rows (8 N bytes per job: one fp32 upload, one download), its arrivals,
staleness, server updates and clock, and its held-out curve against server updates; a rounds run beside
it keeps its own figures. Every number is recomputed here from the run's own rows."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
from helpers import ReferenceRuns
from omegaconf import OmegaConf
from test_async import ASYNC

from hypertrain.clock.replay import clock_of, run_cluster
from hypertrain.report import cli as report
from hypertrain.report.plots import update_axis
from hypertrain.report.runs import load_run
from hypertrain.rundir.records import read_metrics

ROUNDS = [arg for arg in ASYNC if arg != "outer.schedule=async"]


def _rows(run) -> list[dict]:
    return read_metrics(run / "metrics.jsonl")


def _summary(rows: list[dict]) -> dict:
    merged = {}
    for row in rows:
        if row["kind"] == "summary":
            merged |= row
    return merged


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One report over the async run and the rounds run, each copied from the session's references."""
    tmp_path = tmp_path_factory.mktemp("async-report")
    runs = ReferenceRuns.beside(tmp_path)
    folder = tmp_path / "runs"
    ignore = shutil.ignore_patterns("checkpoints", "report", "weights.pt")
    shutil.copytree(runs(ASYNC), folder / "async", ignore=ignore)
    shutil.copytree(runs(ROUNDS), folder / "rounds", ignore=ignore)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = report.main([str(folder)])
    assert code == 0, err.getvalue()
    record = json.loads((folder / "report" / "report.json").read_text())
    by_name = {row["path"].rsplit("/", 1)[-1]: row for row in record["runs"]}
    return folder, by_name, (folder / "report" / "report.md").read_text()


def test_the_report_reads_an_async_run_from_its_arrival_rows(made):
    folder, rows, text = made
    metrics = _rows(folder / "async")
    arrivals = [row for row in metrics if row["kind"] == "arrival"]
    summary = _summary(metrics)
    n = summary["model/params"]
    jobs = {}
    for row in arrivals:
        for replica in row["replicas"]:
            jobs[replica] = jobs.get(replica, 0) + 1
    staleness = [s for row in arrivals for s in row["staleness"]]
    tokens = sum(t for row in arrivals for t in row["tokens"])
    got = rows["async"]
    assert len(jobs) == 2
    assert got["comm_outer_bytes"] == 2 * 4 * n * max(jobs.values()) > 0
    assert got["comm_outer_peak_bytes"] == 2 * 4 * n
    # the run counts the same bytes as it goes (run.asynchronous.moved_bytes): its summary agrees
    assert summary["comm/outer_total_bytes"] == 2 * 4 * n * max(jobs.values())
    assert summary["comm/outer_peak_bytes"] == 2 * 4 * n
    assert summary["comm/outer_replica_bits"] == [32 * n * jobs[m] for m in (0, 1)]
    assert got["arrivals"] == len(staleness) == summary["async/arrivals"]
    assert got["server_updates"] == arrivals[-1]["update"] == summary["async/server_updates"]
    assert got["staleness_mean"] == sum(staleness) / len(staleness)
    assert got["staleness_max"] == max(staleness) == summary["async/staleness_max"]
    assert got["async_clock_s"] == arrivals[-1]["clock_s"] == summary["async/clock_s"]
    assert got["replica_steps_per_s"] == summary["train/replica_steps_per_s"] > 0
    assert tokens == summary["train/tokens_total"]
    assert got["tokens_per_s"] == tokens / summary["train/wall_s"]
    for title in ("arrivals", "server updates", "staleness mean", "staleness max", "async clock s"):
        assert title in text
    runs = [load_run(folder / "async"), load_run(folder / "rounds")]
    assert update_axis(runs[:1]) == "server update (async)"
    assert update_axis(runs[1:]) == "update"
    assert update_axis(runs) == "update (async runs: server update)"


def test_an_async_runs_summary_clock_is_the_replay_of_its_own_rows(made):
    """Issue 48: the summary's `clock/` totals of an async run are its own arrival clock's, the same as
    the clock command's replay of its rows (`clock_of`), both derived here from the rows: the total the
    last arrival's `clock_s`, no split (compute and communication overlap across replicas), the lowest
    held-out loss of the eval row before training (0 s) and of the arrival rows holding one, at its first
    clock. The bug: a summary of 0 s with the loss before training as the best."""
    folder, _, _ = made
    metrics = _rows(folder / "async")
    summary = _summary(metrics)
    arrivals = [row for row in metrics if row["kind"] == "arrival"]
    (first,) = [row for row in metrics if row["kind"] == "eval"]
    curve = [(0.0, first["eval_loss"])]
    curve += [(row["clock_s"], row["eval_loss"]) for row in arrivals if "eval_loss" in row]
    best = min(loss for _, loss in curve)
    want = {
        "clock/cluster": "h100",
        "clock/params": summary["model/params"],
        "clock/total_s": arrivals[-1]["clock_s"],
        **dict.fromkeys(
            ["clock/compute_s", "clock/inner_s", "clock/outer_exposed_s", "clock/outer_hidden_s"]
            + ["clock/compute_utilization"]
        ),
        "clock/best_heldout_loss": best,
        "clock/time_to_best_s": next(clock for clock, loss in curve if loss == best),
    }
    assert len(curve) > 2 and want["clock/time_to_best_s"] > 0  # trained: the best is not the start
    assert {k: v for k, v in summary.items() if k.startswith("clock/")} == want
    assert want["clock/total_s"] == summary["async/clock_s"]
    resolved = OmegaConf.to_container(OmegaConf.load(folder / "async" / "config.yaml"))
    replay = clock_of(metrics, resolved, run_cluster(resolved))  # what the clock command prints
    assert {f"clock/{k}": v for k, v in replay.items() if k not in ("updates", "syncs", "heldout")} == want
    assert [(p["clock_s"], p["eval_loss"]) for p in replay["heldout"]] == curve


def test_a_rounds_run_beside_an_async_run_keeps_its_figures(made, tmp_path):
    folder, rows, _ = made
    metrics = _rows(folder / "rounds")
    summary = _summary(metrics)
    got = rows["rounds"]
    assert not any(row["kind"] == "arrival" for row in metrics)
    assert got["comm_outer_bytes"] == summary["comm/outer_total_bytes"] > 0
    assert got["comm_outer_peak_bytes"] == summary["comm/outer_peak_bytes"] > 0
    assert got["tokens_per_s"] == summary.get("bench/tokens_per_s")
    assert got["replica_steps_per_s"] == summary["train/replica_steps_per_s"]
    for key in ("arrivals", "server_updates", "staleness_mean", "staleness_max", "async_clock_s"):
        assert got[key] is None
    # alone, the rounds run's report row is the same (its columns, less the async ones)
    alone = tmp_path / "alone"
    shutil.copytree(folder / "rounds", alone / "rounds", ignore=shutil.ignore_patterns("report"))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert report.main([str(alone)]) == 0
    (solo,) = json.loads((alone / "report" / "report.json").read_text())["runs"]
    other = ("path", "run", "config", "data")
    same = [k for k in solo if k not in other and not k.startswith("clock")]
    assert {k: solo[k] for k in same} == {k: got[k] for k in same}
    assert "arrivals" not in (alone / "report" / "report.md").read_text()
