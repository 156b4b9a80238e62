"""The network clock in the report and the time plots of `python -m hypertrain.clock` (issue 25).

Three short runs on the h100 cluster (modelled compute: a clock that reads no timing), trained once
through the entry: the quick DiLoCo run (H 3), the same with H 2, and with an int8 outer exchange.
Every expected figure is recomputed here from the runs' own records: the simulated seconds and
compute utilization from the summary's `clock/` totals that training wrote, and the clock of each run
replayed by `clock_of` on a cluster built here from the presets' numbers (docs/clock.md); the time to
the target from the first held-out row (the eval row before training at 0 s, then the `clock_s` of
each eval row and DiLoCo sync row holding an `eval_loss`) at or below it; the default target from the
rows' held-out losses. Bad input is one line, exit 2, nothing written.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import QUICK, REPO, entry, finish, start_entry, tree
from matplotlib.image import imread
from omegaconf import OmegaConf

from hypertrain.clock.replay import clock_of
from hypertrain.config import LINKS, ClusterConfig
from hypertrain.report import cli as report
from hypertrain.report.clock import retime
from hypertrain.rundir.records import read_metrics

RUNS = {
    "h3": ["cluster=h100"],
    "h2": ["cluster=h100", "inner.H=2"],
    "int8": ["cluster=h100", "outer.compress=int8"],
}
PLOT = "heldout-clock.png"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The three runs, started at once, in one folder."""
    tmp = tmp_path_factory.mktemp("report_clock")
    folder = tmp / "runs"
    started = [
        start_entry(
            [*QUICK, "logger=none", "logger.progress=never", f"hydra.run.dir={folder / name}", *extra], tmp
        )
        for name, extra in RUNS.items()
    ]
    for proc in started:
        done = finish(proc)
        assert done.returncode == 0, done.stderr[-3000:]
    return folder


def _heldout(rows: list[dict]) -> list[tuple[float, float]]:
    """The run's held-out curve as (clock, loss) from its own rows: the eval row before training at
    0 s (it carries no clock), then each eval row and each sync row holding an eval_loss at its `clock_s`."""
    curve = []
    for row in rows:
        if row["kind"] == "eval" or (row["kind"] == "sync" and "eval_loss" in row):
            clock = row["clock_s"] if row["update"] > 0 else 0.0
            assert row["update"] > 0 or "clock_s" not in row
            curve.append((clock, row["eval_loss"]))
    return curve


def _first_at_or_below(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((clock for clock, loss in curve if loss <= target), None)


def _summary(rows: list[dict]) -> dict:
    return {k: v for r in rows if r["kind"] == "summary" for k, v in r.items()}


def _report(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = report.main(argv)
    return code, out.getvalue(), err.getvalue()


def _table(markdown: str) -> dict[str, dict[str, str]]:
    """The first markdown table's rows: run name -> column title -> cell."""
    first = markdown[markdown.index("\n| ") + 1 :]
    lines = [
        line for line in first[: first.find("\n\n")].splitlines() if line.startswith("| ")
    ]  # to a blank line
    titles = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])
    return {row[0]: dict(zip(titles, row, strict=True)) for row in rows}


def _check_plot(out: Path, plot: dict) -> None:
    assert imread(out / plot["file"]).shape[:2] == (plot["height"], plot["width"])


def test_the_report_times_each_run_on_its_recorded_cluster_to_the_loss_every_run_reached(runs):
    code, stdout, stderr = _report([str(runs)])
    assert code == 0, stderr
    out = runs / "report"
    record = json.loads((out / "report.json").read_text())
    records = {name: read_metrics(runs / name / "metrics.jsonl") for name in RUNS}
    curves = {name: _heldout(rows) for name, rows in records.items()}
    # the default target: the largest of the runs' best held-out losses (every run reached it)
    target = max(min(loss for _, loss in curve) for curve in curves.values())
    assert record["target_loss"] == target
    assert (
        f"held-out loss {target:.4f}" in stdout
        and f"target, {target:.4f} nats/token" in (out / "report.md").read_text()
    )
    cells = _table((out / "report.md").read_text())
    reached = []
    for row in record["runs"]:
        rows = records[row["run"]]
        summary = _summary(rows)  # what training recorded of its own clock
        assert row["cluster"] == summary["clock/cluster"] == "h100"
        assert row["simulated_s"] == summary["clock/total_s"] > 0
        assert row["compute_util"] == summary["clock/compute_utilization"]
        assert 0 < row["compute_util"] < 1
        want = _first_at_or_below(curves[row["run"]], target)
        assert want is not None and row["time_to_target_s"] == want  # every run reached the target
        reached.append(want)
        shown = cells[row["run"]]
        assert shown["simulated s"] == f"{summary['clock/total_s']:.4g}"
        assert shown["compute util"] == f"{summary['clock/compute_utilization']:.3f}"
        assert shown["time to target s"] == f"{want:.4g}"
    # the run whose best is the target reaches it at the clock of that best
    assert any(
        want == _summary(records[r["run"]])["clock/time_to_best_s"]
        for r, want in zip(record["runs"], reached, strict=True)
    )
    (plot,) = [p for p in record["plots"] if p["file"] == PLOT]
    heldout = next(p for p in record["plots"] if p["file"] == "heldout.png")
    assert plot["series"] == [*heldout["series"], f"target {target:.4f}"]  # the same legend entries
    assert "simulated seconds" in plot["title"]
    _check_plot(out, plot)
    assert f"]({PLOT})" in (out / "report.md").read_text()
    assert {p.name for p in out.glob("*.png")} == {p["file"] for p in record["plots"]}


@pytest.mark.slow  # the quick loop's target: the default one, above
def test_a_given_target_times_each_run_to_it_and_a_run_that_never_reached_it_shows_a_dash(runs, tmp_path):
    records = {name: read_metrics(runs / name / "metrics.jsonl") for name in RUNS}
    curves = {name: _heldout(rows) for name, rows in records.items()}
    lowest = min(loss for curve in curves.values() for _, loss in curve)  # one run reached it, at its end
    middle = curves["h2"][2][1]  # the H 2 run's loss at its second sync (of three): reached mid-run
    for target in (lowest, middle):
        out = tmp_path / f"report-{target}"
        code, stdout, stderr = _report([str(runs), "--out", str(out), "--target-loss", repr(target)])
        assert code == 0, stderr
        record = json.loads((out / "report.json").read_text())
        assert record["target_loss"] == target and "--target-loss" in record["target_rule"]
        cells = _table((out / "report.md").read_text())
        times = {}
        for row in record["runs"]:
            want = _first_at_or_below(curves[row["run"]], target)
            assert row["time_to_target_s"] == want, (row["run"], target)
            assert cells[row["run"]]["time to target s"] == ("-" if want is None else f"{want:.4g}")
            times[row["run"]] = want
        if target == lowest:
            assert sum(t is not None for t in times.values()) == 1
        else:
            assert 0 < times["h2"] < _summary(records["h2"])["clock/total_s"]
        (plot,) = [p for p in record["plots"] if p["file"] == PLOT]
        _check_plot(out, plot)


A100_INTERNET = ClusterConfig(
    name="a100",
    compute="modelled",
    peak_tflops=312.0,
    mfu=0.4,
    intra=LINKS["nvlink"],
    inter=LINKS["internet_1g"],
)


def _clock_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "hypertrain.clock", *map(str, args)], cwd=REPO, capture_output=True, text=True
    )


def test_the_clock_command_writes_the_time_plot_and_clock_md(runs, tmp_path):
    names = ["h2", "int8"]
    out = tmp_path / "clock"
    done = _clock_cli(*(runs / n for n in names), "cluster=a100", "cluster/inter=internet_1g", "--out", out)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert (
        len(lines) == 3
        and lines[0].startswith("run")
        and lines[0].split()[-4:] == ["time", "to", "target", "s"]
    )
    assert str(out / "clock.md") in done.stderr
    expected = {}
    for name in names:
        rows = read_metrics(runs / name / "metrics.jsonl")
        resolved = OmegaConf.to_container(OmegaConf.load(runs / name / "config.yaml"), resolve=True)
        expected[name] = clock_of(rows, resolved, A100_INTERNET)
    # the target: the largest of the two runs' best held-out losses, from their rows
    target = max(
        min(r["eval_loss"] for r in read_metrics(runs / n / "metrics.jsonl") if "eval_loss" in r)
        for n in names
    )
    page = (out / "clock.md").read_text()
    cells = _table(page)
    for name in names:
        clock = expected[name]
        curve = [(h["clock_s"], h["eval_loss"]) for h in clock["heldout"]]
        want = _first_at_or_below(curve, target)
        shown = cells[str(runs / name)]
        assert shown["cluster"] == "a100"
        assert shown["simulated s"] == f"{clock['total_s']:.4g}"
        assert shown["compute util"] == f"{clock['compute_utilization']:.3f}"
        assert shown["time to target s"] == f"{want:.4g}"
        printed = next(line for line in lines if line.startswith(str(runs / name)))
        assert printed.split() == [c.replace(" ", "") for c in shown.values()]
    assert f"{target:.4f}" in page and f"]({PLOT})" in page
    width, height = map(int, re.search(r"\((\d+) x (\d+) px\)", page).groups())
    assert imread(out / PLOT).shape[:2] == (height, width)
    assert "internet_1g" in page
    # by default: report/clock-a100/ under the runs' common folder; --model-params in the plot's title
    default = runs / "report" / "clock-a100"
    done = _clock_cli(*(runs / n for n in names), "cluster=a100", "--model-params", "1000000000")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 3 and str(default / "clock.md") in done.stderr
    assert "timed at 1,000,000,000 parameters" in (default / "clock.md").read_text()
    assert (default / PLOT).is_file()


def _clock(*args) -> tuple[int, str, str]:
    """`python -m hypertrain.clock ARGS` in this process: its code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = retime.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def test_a_run_whose_own_clock_decided_its_weights_is_timed_only_on_its_own_cluster_and_size(tmp_path):
    """churn.deadline: the run's clock chose which replicas were late, so its weights are its cluster's.
    Timed on another cluster, other values of its own, or another parameter count, it would be a clock
    that never happened: one line naming the setting, exit 2, nothing written; on its own, timed."""
    run = tmp_path / "deadline"
    overrides = [*QUICK, "logger=none", "cluster=h100", "churn.deadline=1e-3", f"hydra.run.dir={run}"]
    done = entry(overrides, tmp_path)
    assert done.returncode == 0, done.stderr
    before = tree(tmp_path)
    for other in (["cluster=a100"], ["cluster=h100", "cluster.mfu=0.3"], ["--model-params", "1000000"]):
        code, out, err = _clock(run, *other)
        assert (code, out) == (2, ""), (other, err)
        assert len(err.splitlines()) == 1 and "churn.deadline=0.001" in err and "never happened" in err
        assert tree(tmp_path) == before
    code, out, err = _clock(run, "cluster=h100")  # its own cluster, named
    assert code == 0 and len(out.splitlines()) == 2, err


def test_the_clock_of_several_runs_times_the_whole_ones_and_names_the_one_it_cannot(runs, tmp_path):
    """A run killed before its first summary (its records: the start row only) among whole ones: the
    others are timed, one line names it; alone, it is one line naming it, exit 2, nothing written."""
    half = shutil.copytree(runs / "h3", tmp_path / "half", ignore=shutil.ignore_patterns("report"))
    metrics = half / "metrics.jsonl"
    metrics.write_text(metrics.read_text().splitlines(keepends=True)[0])
    code, out, err = _clock(runs / "h2", half, "--out", tmp_path / "both")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()] == ["run", str(runs / "h2")]
    assert [line for line in err.splitlines() if "skipped" in line] == [
        f"hypertrain.clock: skipped {half}: the run's metrics.jsonl has no summary with model/params; "
        "valid: a run's records"
    ]
    code, out, err = _clock(half, "--out", tmp_path / "alone")
    assert (code, out) == (2, "") and len(err.splitlines()) == 1 and f"error: {half}: " in err
    assert not (tmp_path / "alone").exists()


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf", ""])
def test_a_bad_target_loss_is_one_line_exit_2_and_writes_nothing(runs, tmp_path, value):
    before, runs_before = tree(tmp_path), tree(runs)
    code, stdout, stderr = _report([str(runs), "--out", str(tmp_path / "out"), f"--target-loss={value}"])
    assert code == 2 and not stdout and stderr.splitlines() == [stderr.strip()]
    assert (
        stderr.startswith("hypertrain.report: error: --target-loss=") and "valid: a finite positive" in stderr
    )
    done = _clock_cli(runs / "h2", f"--target-loss={value}")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("hypertrain.clock: error: --target-loss=") and "valid: a finite positive" in line
    assert tree(tmp_path) == before and tree(runs) == runs_before


@pytest.mark.parametrize(
    "out, message",
    [
        ("{tmp}/file", "--out={tmp}/file is a file"),
        ("{tmp}/file/below", "--out={tmp}/file/below cannot be made (under {tmp}/file)"),
        ("", "--out='' is not valid"),
    ],
)
def test_a_bad_out_for_the_clock_command_is_one_line_exit_2_and_writes_nothing(runs, tmp_path, out, message):
    (tmp_path / "file").write_text("x")
    before, runs_before = tree(tmp_path), tree(runs)
    done = _clock_cli(runs / "h2", "cluster=a100", f"--out={out.format(tmp=tmp_path)}")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"hypertrain.clock: error: {message.format(tmp=tmp_path)}") and "valid: " in line
    assert tree(tmp_path) == before and tree(runs) == runs_before
