"""Tuning as a sweep (docs/sweeps.md): `hydra/sweeper=optuna` through the command line, every trial an
ordinary run directory, the best trial's value its run's final held-out loss, seeded proposals, and a
diverging trial failed alone while the study goes on."""

import json
import math
import shlex
import statistics
import sys
from types import SimpleNamespace

import pytest
import yaml
from helpers import QUICK, REPO, compose_cfg, entry, stderr_lines

from hypertrain.preflight.checks import validate
from hypertrain.records.files import read_records
from hypertrain.records.rows import EndRow, StartRow, SummaryRow

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


@pytest.mark.slow
def test_the_tuned_table_is_recomputed_from_the_run_directories(tmp_path):
    """A tiny study of two schemes (2 trials, 2 seeds each) through the entry, then its table against
    one computed here from the runs' metrics.jsonl alone, digit for digit."""
    out = tmp_path / "out"
    tiny = [
        *QUICK[1:],
        "phase.global_batch=32",
    ]  # QUICK's model and data sizes (experiment=quick is COMMON's)
    args = SimpleNamespace(out=out, schemes=["diloco", "int8"], trials=2, seeds=2, updates=4, H=2, extra=tiny)
    assert tuned_study.run_study(args, lambda entry_args: entry(entry_args, tmp_path).returncode) == []
    got = tuned_study.table(tuned_study.tuned_rows(out, args.schemes))
    want = []
    for scheme in args.schemes:
        best = yaml.safe_load((out / scheme / "tune" / "optimization_results.yaml").read_text())[
            "best_params"
        ]
        losses, bits = [], set()
        for metrics in sorted((out / scheme / "seeds").glob("*/metrics.jsonl")):
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            summary = {k: v for row in rows if row["kind"] == "summary" for k, v in row.items()}
            assert rows[-1]["status"] == "finished"
            assert next(r for r in rows if r["kind"] == "start")  # a run's own records
            losses.append(summary["eval/final_loss"])
            bits.add(summary["comm/outer_total_bits"])
        seeds = [
            yaml.safe_load(p.read_text()) for p in (out / scheme / "seeds").glob("*/.hydra/overrides.yaml")
        ]
        assert sorted(o for over in seeds for o in over if o.startswith("seed=")) == ["seed=1", "seed=2"]
        setting = ", ".join(f"{k.removeprefix('outer.')} {v:.4g}" for k, v in best.items())
        mean, lo, hi, std = statistics.fmean(losses), min(losses), max(losses), statistics.stdev(losses)
        (only,) = bits
        want.append(
            f"| {scheme} | {setting} | 2/2 | {mean:.4f} ({lo:.4f} to {hi:.4f}) | {std:.4f} | {only:,} |"
        )
    assert got[2:] == want
    # int8 sends a quarter of fp32's bits, or a little more (the scales): the bits column is each scheme's
    assert got[2] != got[3]
