"""A checkpoint written by an earlier commit resumes today (issue 34's proof: moving hypertrain's modules
must not break the checkpoints users hold).

The regression fixture tests/assets/checkpoint_fixture/ (recorded by tests/record_checkpoint_fixture.py;
its README names the commit) is a small run killed after update 6: Streaming DiLoCo with a fragment's
sync in flight, int8 pseudo-gradients with error feedback, churn, a mid-round checkpoint after update 5.
Its checkpoint unpickles with torch's weights_only loader, which admits builtins, tensors and a few torch
types only: no hypertrain class path is pickled in it, so no move of a class can break it. Copied and
resumed (resume=true), the run equals an uninterrupted run of the same args made now, by today's code
(the independent check: every update and sync row but timings, the held-out losses, the summary and
weights.pt, exactly), and the uninterrupted outcome recorded with the fixture. The checkpoint the
resumed session writes loads the same way, so today's form stays the fixture's.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import ReferenceRuns, assert_identical_streaming, resumed, untimed
from record_checkpoint_fixture import CHECKPOINT_AT, FIXTURE, outcome_json

from hypertrain.rundir.checkpoint import checkpoints
from hypertrain.rundir.records import METRICS_FILE, read_metrics

ABOUT = json.loads((FIXTURE / "reference.json").read_text())


def test_the_fixture_checkpoint_unpickles_with_builtins_and_tensors_only():
    saved = torch.load(FIXTURE / ABOUT["checkpoint"], map_location="cpu", weights_only=True)
    state = saved["state"]
    assert state["next_update"] == CHECKPOINT_AT
    # what the fixture is for: the parts of the state only a mid-round streaming checkpoint holds
    assert state["pending"]["fragment"] == 0 and state["pending"]["taken_at"] == CHECKPOINT_AT
    assert state["round_params"] is not None and state["errors"] is not None


# Fields rows gained after the fixture was recorded (issue 34: a sync row's `taken_at` and `params`),
# left out of the comparison with its records; the fixture stays as recorded.
ADDED = ("taken_at", "params")


def _as_recorded(row: dict) -> dict:
    return {k: v for k, v in untimed(row).items() if k not in ADDED}


def _early(row: dict) -> bool:
    """An update or sync row of the updates the checkpoint holds (before CHECKPOINT_AT)."""
    return row["kind"] in ("update", "sync") and row["update"] < CHECKPOINT_AT


def test_the_fixture_run_resumed_today_equals_an_uninterrupted_run_of_today(tmp_path):
    args = ABOUT["args"]
    reference = ReferenceRuns.beside(tmp_path)(args)
    now = {
        "data_fingerprint": json.loads((reference / "plan.json").read_text())["data/fingerprint"],
        "torch": torch.__version__,
    }
    for key, value in now.items():
        if value != ABOUT[key]:
            pytest.skip(
                f"fixture recorded with {key}={ABOUT[key]}, this machine has {value}; regenerate with "
                f"`{ABOUT['regenerate']}`"
            )
    # The fixture's state was computed by the recording machine: bitwise equality with a run made here
    # holds only where this machine computes the same float32 numbers (another CPU or BLAS may round
    # otherwise). The rows up to the checkpoint, the fixture's and the fresh run's, say whether it does.
    before = [_as_recorded(r) for r in read_metrics(FIXTURE / "run" / METRICS_FILE) if _early(r)]
    here = [_as_recorded(r) for r in read_metrics(reference / METRICS_FILE) if _early(r)]
    if before != here:
        pytest.skip(
            "this machine's float32 arithmetic differs from the recording machine's before the checkpoint: "
            f"the fixture's format is checked (the test above), its numbers need `{ABOUT['regenerate']}`"
        )
    run_dir = shutil.copytree(FIXTURE / "run", tmp_path / "run")
    resumed(args, run_dir, tmp_path)

    rows = read_metrics(run_dir / METRICS_FILE)
    froms = [(r["from"], r["update"]) for r in rows if r["kind"] == "resume"]
    assert froms == [(str(tmp_path / ABOUT["checkpoint"]), CHECKPOINT_AT)]
    assert_identical_streaming(run_dir, reference, skip=ADDED)
    got = json.loads(json.dumps(outcome_json(run_dir)))
    got["syncs"] = [{k: v for k, v in r.items() if k not in ADDED} for r in got["syncs"]]
    assert got == ABOUT["uninterrupted"]
    for path in checkpoints(run_dir):  # today's checkpoints keep the fixture's form
        torch.load(path, map_location="cpu", weights_only=True)
