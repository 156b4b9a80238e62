"""Tuning as a sweep (docs/sweeps.md): `hydra/sweeper=optuna` through the command line, every trial an
ordinary run directory, the best trial's value its run's final held-out loss, seeded proposals, and a
diverging trial failed alone while the study goes on."""

import math

import pytest
import yaml
from helpers import QUICK, entry, stderr_lines

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
