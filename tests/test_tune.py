"""Tuning as a sweep (docs/sweeps.md): `hydra/sweeper=optuna` through the command line, every trial an
ordinary run directory, the best trial's value its run's final held-out loss, seeded proposals, and a
diverging trial failed alone while the study goes on."""

import json
import math
import shlex
import shutil
import statistics
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import yaml
from helpers import (
    CHROMIUM,
    MARK,
    QUICK,
    REPO,
    compose_cfg,
    entry,
    in_process,
    load_in_chromium,
    stderr_lines,
)
from matplotlib.image import imread
from omegaconf import OmegaConf

from hypertrain.clock.replay import clock_of, run_cluster
from hypertrain.config import LINKS
from hypertrain.preflight.checks import validate
from hypertrain.records.files import read_records
from hypertrain.records.rows import EndRow, StartRow, SummaryRow
from hypertrain.report.cli import main as report_main
from hypertrain.report.tuned.study import time_to

# Seed 9 of the TPE sampler (its first 10 trials are random, whatever the values told) proposes, over
# outer.lr log-uniform in [0.1, 3000] and inner.H in {1, 2}: lr 0.11, 0.40, 7.5, 3.5, 1810, 36.7. At lr
# 1810 the held-out loss after the first sync is far above the guard's ln 256 + 1 nats (a run at lr 300
# already stops there, at 7.8 nats): trial 4 diverges, and trial 5 runs after it.
STUDY = [
    "-m",
    *QUICK,
    "logger=none",
    "phase.updates=4",
    "phase.global_batch=32",
    "hydra/sweeper=optuna",
    "hydra.sweeper.n_trials=6",
    "hydra.sweeper.sampler.seed=9",
    "outer.lr=tag(log, interval(0.1, 3000))",
    "inner.H=choice(1, 2)",
]
DIVERGING = 4


def final_loss(run_dir) -> float:
    """The final held-out loss the run's records hold (its summary row)."""
    summaries = [r.values for r in read_records(run_dir) if isinstance(r, SummaryRow)]
    return [s["eval/final_loss"] for s in summaries if "eval/final_loss" in s][-1]


def study(tmp_path, name: str) -> tuple[list[dict], dict]:
    sweep = tmp_path / name
    done = entry([*STUDY, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = yaml.safe_load((sweep / "trials.yaml").read_text())
    for trial in trials:
        rows = read_records(sweep / trial["run_dir"])
        trial["end"] = rows[-1]
        trial["groups"] = {r.group for r in rows if isinstance(r, StartRow)}
    failed = [line for line in stderr_lines(done.stderr) if line.startswith("hypertrain: trial failed: ")]
    assert len(failed) == 1 and "diverged" in failed[0], done.stderr[-3000:]
    return trials, yaml.safe_load((sweep / "optimization_results.yaml").read_text())


@pytest.mark.slow
def test_an_optuna_study_tunes_the_outer_step_and_goes_on_past_a_diverging_trial(tmp_path):
    trials, results = study(tmp_path, "first")
    assert [t["number"] for t in trials] == list(range(6))
    assert {t["params"]["inner.H"] for t in trials} == {1, 2}
    for trial in trials:  # every trial an ordinary run directory, ended as its trial
        end = trial["end"]
        assert isinstance(end, EndRow)
        assert trial["groups"] == {"quick-first"}  # W&B's group: the study's (experiment-sweep folder)
        if trial["number"] == DIVERGING:
            assert (trial["state"], trial["values"], end.status) == ("failed", None, "failed")
            assert end.error.startswith("diverged: ")
        else:
            assert (trial["state"], end.status) == ("complete", "finished")
            # the value told to Optuna is the run's final held-out loss, as the records hold it
            assert trial["values"] == [final_loss(tmp_path / "first" / trial["run_dir"])]
    complete = [t for t in trials if t["state"] == "complete"]
    best = min(complete, key=lambda t: t["values"][0])
    assert results["best_params"] == best["params"]
    assert results["best_value"] == final_loss(tmp_path / "first" / best["run_dir"])
    assert math.isfinite(results["best_value"])

    again, results_again = study(tmp_path, "second")  # the same seeded study twice
    assert [t["params"] for t in again] == [t["params"] for t in trials]
    # runs are deterministic (the regression fixtures), so the values and the best trial are the same too
    assert [t["values"] for t in again] == [t["values"] for t in trials]
    assert results_again == results


# The same under processes=dist (world 2: two self-launched ranks per trial), as cheap as it goes: two
# trials, two updates of H 1. Seed 0 of the TPE sampler proposes lr 3000, then 0.7 (its first trials are
# random); at 3000 the held-out loss after the first sync is far above the guard's ln 256 + 1 nats (the
# study above: 300 already stops). Rank 0 ends the run's records `failed` on the guard's line, the
# self-launching entry returns NaN for it, and the second trial runs and completes.
DIST_STUDY = [
    "-m",
    *QUICK,
    "logger=none",
    "processes=dist",
    "world=2",
    "phase.updates=2",
    "inner.H=1",
    "hydra/sweeper=optuna",
    "hydra.sweeper.n_trials=2",
    "hydra.sweeper.sampler.seed=0",
    "outer.lr=choice(0.7, 3000)",
]


@pytest.mark.slow
def test_a_diverging_trial_of_a_processes_dist_study_fails_alone_and_the_study_goes_on(tmp_path):
    sweep = tmp_path / "study"
    done = entry([*DIST_STUDY, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = yaml.safe_load((sweep / "trials.yaml").read_text())
    assert [(t["number"], t["params"]["outer.lr"]) for t in trials] == [(0, 3000), (1, 0.7)]
    diverged, went_on = trials
    assert (diverged["state"], diverged["values"]) == ("failed", None)
    end = read_records(sweep / diverged["run_dir"])[-1]
    assert isinstance(end, EndRow) and end.status == "failed" and end.error.startswith("diverged: "), end
    assert went_on["state"] == "complete"
    assert went_on["values"] == [final_loss(sweep / went_on["run_dir"])]
    failed = [line for line in stderr_lines(done.stderr) if line.startswith("hypertrain: trial failed: ")]
    assert len(failed) == 1 and failed[0].startswith("hypertrain: trial failed: diverged: "), done.stderr


# -- experiments/tuned_study.py ------------------------------------------------------------------------

sys.path.insert(0, str(REPO / "experiments"))
import tuned_study  # noqa: E402  (a script beside studies.py, which it imports by name)


@pytest.mark.parametrize("scheme", list(tuned_study.SCHEMES))
def test_every_schemes_runs_are_valid_configs(scheme):
    """Each scheme's seeds run (its overrides, the search space's keys at a value) composes and passes
    the config's checks: the study's commands are not refused after hours of others."""
    overrides, space = tuned_study.SCHEMES[scheme]
    tuned = [f"{spec.partition('=')[0]}=0.5" for spec in space]
    validate(compose_cfg([*tuned_study.run_overrides(240, 8, []), *overrides, *tuned, "seed=1"]))


def test_the_dry_run_prints_the_runs_and_their_count(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "out")
    argv = ["tuned_study.py", out, "--schemes", "diloco,eager", "--trials", "5", "--seeds", "3", "--dry-run"]
    monkeypatch.setattr(sys, "argv", argv)
    assert tuned_study.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "16 runs: 2 schemes x (5 trials + 3 seeds)"
    commands = [shlex.split(line) for line in lines[:-1]]
    assert len(commands) == 4  # a study and a seeds sweep per scheme
    assert "hydra.sweeper.n_trials=5" in commands[0] and "outer.overlap=eager" in commands[2]
    assert "seed=1,2,3" in commands[1] and "outer.lr=<tuned>" in commands[1]
    assert not (tmp_path / "out").exists()  # nothing run, nothing made


def test_the_docstrings_corpus_is_prepared_first_and_read_by_every_run(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    argv = ["tuned_study.py", str(out), "--schemes", "diloco", "--trials", "2", "--corpus", "docstrings"]
    monkeypatch.setattr(sys, "argv", [*argv, "--dry-run"])
    assert tuned_study.main() == 0
    prepare, *runs = [shlex.split(line) for line in capsys.readouterr().out.splitlines()[:-1]]
    assert prepare[2:4] == ["hypertrain.data", "prepare"] and f"--out={out.resolve() / 'corpus'}" in prepare
    assert len(runs) == 2 and all(f"data.path={out.resolve() / 'corpus'}" in run for run in runs)
    assert all("data=prepared" in run for run in runs) and not out.exists()
    texts = tuned_study.stdlib_docstrings(0.01)  # the first 10 kB of docstrings, each >= 40 characters
    assert texts and all(len(t) >= 40 for t in texts) and sum(len(t.encode()) for t in texts) >= 1e4


LINKS_TIMED = ("datacenter_100g", "cross_region_10g", "internet_1g")  # docs/sweeps.md: the report's three


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    """A tiny study through the entry: two schemes (int8 sends about a quarter of DiLoCo's bits), 2
    trials each, their best setting on 2 seeds; 4 updates at H = 2 of QUICK's model and data."""
    tmp = tmp_path_factory.mktemp("tuned")
    out = tmp / "out"
    tiny = [
        *QUICK[1:],
        "phase.global_batch=32",
    ]  # QUICK's model and data sizes (experiment=quick is COMMON's)
    args = SimpleNamespace(out=out, schemes=["diloco", "int8"], trials=2, seeds=2, updates=4, H=2, extra=tiny)
    assert tuned_study.run_study(args, lambda entry_args: entry(entry_args, tmp).returncode) == []
    return out, args.schemes


def seed_runs(folder) -> list[dict]:
    """A scheme's seed runs as their files say: rows of metrics.jsonl, the summary, the resolved config."""
    runs = []
    for metrics in sorted(folder.glob("*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "finished"
        summary = {k: v for row in rows if row["kind"] == "summary" for k, v in row.items()}
        resolved = OmegaConf.to_container(OmegaConf.load(metrics.parent / "config.yaml"), resolve=True)
        runs.append({"rows": rows, "summary": summary, "resolved": resolved})
    return runs


def recomputed_table(out, schemes: list[str]) -> list[str]:
    """The tuned table's rows from the run directories alone: the seeds' final held-out losses
    (`eval/final_loss`: mean, min, max, stdev with n - 1), their bits (`comm/outer_total_bits`), and per
    link the mean over the seeds of the clock and of the held-out loss at each evaluation (the clock
    itself is `replay.clock_of`'s on the run's cluster with the link swapped in: tests/test_clock.py
    checks it), the mean clock at the first mean loss at or below DiLoCo's mean final loss."""
    runs = {scheme: seed_runs(out / scheme / "seeds") for scheme in schemes}
    target = statistics.fmean(run["summary"]["eval/final_loss"] for run in runs["diloco"])
    lines = []
    for scheme in schemes:
        best = yaml.safe_load((out / scheme / "tune" / "optimization_results.yaml").read_text())[
            "best_params"
        ]
        setting = ", ".join(f"{k.removeprefix('outer.')} {v:.4g}" for k, v in best.items())
        losses = [run["summary"]["eval/final_loss"] for run in runs[scheme]]
        mean, lo, hi, std = statistics.fmean(losses), min(losses), max(losses), statistics.stdev(losses)
        (bits,) = {run["summary"]["comm/outer_total_bits"] for run in runs[scheme]}
        seeds = ",".join(str(run["resolved"]["seed"]) for run in runs[scheme])
        times = []
        for link in LINKS_TIMED:
            curves = []
            for run in runs[scheme]:
                cluster = replace(run_cluster(run["resolved"]), inter=replace(LINKS[link]))
                curves.append(clock_of(run["rows"], run["resolved"], cluster)["heldout"])
            assert len({tuple(p["update"] for p in curve) for curve in curves}) == 1  # the same evaluations
            points = [
                (statistics.fmean(p["clock_s"] for p in at), statistics.fmean(p["eval_loss"] for p in at))
                for at in zip(*curves, strict=True)
            ]
            reached = [seconds for seconds, loss in points if loss <= target]
            times.append(f"{reached[0]:.4g}" if reached else "not reached")
            if (
                scheme == "diloco"
            ):  # its mean curve ends at its mean final loss: reached at its last evaluation
                assert reached[0] == points[-1][0]
        cells = [scheme, setting, f"2/2 ({seeds})", f"{mean:.4f} ({lo:.4f} to {hi:.4f})", f"{std:.4f}"]
        lines.append("| " + " | ".join([*cells, f"{bits:,}", *times]) + " |")
    return lines


@pytest.mark.slow
def test_the_reports_tuned_table_is_recomputed_from_the_run_directories(tiny_study, tmp_path):
    """`python -m hypertrain.report OUT` on a tiny study: its tuned table (report.md, and the table
    tuned_study.py prints) against one computed here from the runs' files, digit for digit; its plot a
    PNG of the stated size that loads in Chromium with the page."""
    out, schemes = tiny_study
    done = in_process([str(out)], tmp_path, main=report_main, module="hypertrain.report")
    assert done.returncode == 0, done.stderr[-3000:]
    markdown = (out / "report" / "report.md").read_text().splitlines()
    heading = markdown.index("## Tuned study: out")
    end = heading + 6 + len(schemes)  # the heading, a blank, the intro, a blank, titles, rule, a row each
    table = markdown[heading + 4 : end]
    assert markdown[end] == ""
    want = recomputed_table(out, schemes)
    assert table[2:] == want and tuned_study.tuned_table(out)[2:] == want
    assert "not reached" not in want[0] and want[0] != want[1]  # int8's bits and times are its own
    record = json.loads((out / "report" / "report.json").read_text())
    (plot,) = [p for p in record["plots"] if p["file"] == "tuned-out.png"]
    assert imread(out / "report" / plot["file"]).shape[:2] == (plot["height"], plot["width"])
    assert plot["series"][: len(schemes)] == [f"{scheme} (2/2 seeds)" for scheme in schemes]
    assert CHROMIUM, "no chromium on PATH: Debian's `chromium`, installed by `scripts/setup --dev`"
    page = tmp_path / "report.html"
    page.write_text((out / "report" / "report.html").read_text().replace("</body>", MARK))
    images, console = load_in_chromium(page, tmp_path / "profile")
    assert images == ["ok"] * len(record["plots"]) and not console, (images, console)


def test_a_mean_curve_reaches_the_target_at_its_first_point_at_or_below_it():
    curve = ([0.0, 1.5, 3.0], [5.0, 4.0, 3.0], [5.0, 3.9, 2.9], [5.0, 4.1, 3.1])  # seeds.band's shape
    assert [time_to(curve, target) for target in (5.0, 4.5, 4.0, 3.0, 2.99, None)] == [
        0.0, 1.5, 1.5, 3.0, None, None,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("manifest", "says"),
    [
        ("{not json", "cannot be read"),
        ('{"schemes": "diloco", "reference": "diloco"}', "has no list of schemes"),
    ],
)
def test_a_study_whose_manifest_is_not_one_is_refused_in_one_line_with_nothing_written(
    tiny_study, tmp_path, manifest, says
):
    out, schemes = tiny_study
    study = tmp_path / "study"
    for scheme in schemes:  # the seed runs alone, and the manifest spoilt
        shutil.copytree(
            out / scheme / "seeds", study / scheme / "seeds", ignore=shutil.ignore_patterns("report")
        )
    (study / "tuned_study.json").write_text(manifest)
    report = tmp_path / "report"
    done = in_process(
        [str(study), "--out", str(report)], tmp_path, main=report_main, module="hypertrain.report"
    )
    assert (done.returncode, done.stdout) == (2, "")
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"hypertrain.report: error: {study / 'tuned_study.json'} {says}")
    assert line.endswith("as experiments/tuned_study.py writes") and not report.exists()
