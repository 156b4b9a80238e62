"""Stops in the middle of a round: a stop signal, a mid-round checkpoint, a crash while writing.

The run is BASE of test_resume with H = 4 (2 rounds of 4 updates, syncs after updates 4 and 8), so
most stops land inside a round, where the replicas' own weights and the round's progress must be
saved and restored. Every case resumes and must equal the uninterrupted run exactly (test_resume's
`assert_identical`: ==, torch.equal, no tolerance; the same machine runs the same arithmetic).

- A stop signal (SIGTERM, or SIGUSR2, submitit's warning; SIGINT, Ctrl-C; SIGHUP, a hangup) sent
  at a named update by the test-only fault hook (`HYPERTRAIN_FAULT=RANK:UPDATE:term|usr2|int|hup:after`,
  the signal sent to the process right after that update's step): the run stops after that same
  update in every process, writes a checkpoint there, closes its records with an end row whose
  status and exit code are the process's (`preempted` 143 for SIGTERM and SIGUSR2, `interrupted`
  130 for SIGINT, 129 for SIGHUP), says so in exactly one line (nothing else on stderr) and exits
  with that code; `resume=auto` goes on from it. For engine=stacked, engine=loop and processes=dist
  (the signal to rank 1 only: rank 0 must stop after the same update).
- The same with the signal sent from outside at a moment the test does not choose (to the
  process group, as SLURM and a terminal do), for engine=stacked and processes=dist.
- `checkpoint.every_updates=3`: checkpoints after updates 3 and 6 inside the rounds besides the
  syncs'; SIGKILL after update 7 resumes from the one after update 6.
- SIGKILL while a checkpoint is written (its temporary file whole, not yet renamed) and while an
  update row is half written: the previous checkpoint is used, the torn row is superseded.
- Slow: more of engine x optimizer x data stopped mid-round by SIGTERM (the default cases are
  stacked-AdamW-windows, loop-AdamW-windows, dist-AdamW-windows).
- Negative control: a mid-round checkpoint whose replica 1 weights were replaced by the global
  weights resumes to a different run, first at the next update (so the comparison can fail).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    BASE,
    DATA,
    ENGINES,
    INNERS,
    KILLED,
    ReferenceRuns,
    assert_identical,
    ckpt,
    entry,
    finish,
    outcome,
    start_entry,
    stderr_lines,
)

from hypertrain.failures.signals import EXIT_CODES, STATUSES, Preempted, StopSignals, requested
from hypertrain.rundir.checkpoint import SUPERSEDED_FILE, checkpoints, seal
from hypertrain.rundir.records import METRICS_FILE, read_metrics

H4 = [*BASE, "inner.H=4"]  # syncs after updates 4 and 8
STOPPED = Preempted.exit_code  # 143, docs/errors.md


class References(dict):
    """The uninterrupted H4 run per engine, each run the first time a test asks for it (the quick
    loop asks for one engine's only)."""

    def __init__(self, where: Path):
        super().__init__()
        self.where = where

    def __missing__(self, engine: str) -> Path:
        self[engine] = ReferenceRuns.beside(self.where)([*H4, *ENGINES[engine]])
        return self[engine]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> References:
    return References(tmp_path_factory.mktemp("references"))


def rows_of(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / METRICS_FILE)


def assert_stopped_after(run_dir: Path, update: int, done, name: str) -> None:
    """A run stopped by `name` after `update`: the signal's exit code (143, 130, 129), one line and
    nothing else on stderr, a checkpoint there, update rows 1..update, an end row with the same code."""
    signum = signal.Signals[name]
    code, status = EXIT_CODES[signum], STATUSES.get(signum, "interrupted")
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = stderr_lines(done.stderr)
    assert len(lines) == 1 and f"hypertrain: stopped by {name} after update {update};" in lines[0], (
        done.stderr
    )
    assert checkpoints(run_dir)[-1] == ckpt(run_dir, update)
    rows = rows_of(run_dir)
    assert [r["update"] for r in rows if r["kind"] == "update"] == list(range(1, update + 1))
    end = rows[-1]
    assert end["kind"] == "end" and end["status"] == status and end["exit_code"] == code, end
    assert lines[0].startswith(f"hypertrain: {end['error']}"), (lines, end)  # the line is the record's
    saved = torch.load(ckpt(run_dir, update), weights_only=False)
    assert saved["state"]["next_update"] == update
    assert (saved["state"]["round_params"] is not None) == (update % 4 != 0)  # mid-round: replica weights


def resume_auto(run_dir: Path, overrides: list[str], cwd: Path) -> None:
    done = entry([*overrides, f"hydra.run.dir={run_dir}", "resume=auto"], cwd)
    assert done.returncode == 0, done.stderr
    rows = rows_of(run_dir)
    assert [r["update"] for r in rows if r["kind"] == "update"] == list(range(1, 9))
    assert rows[-1]["status"] == "finished"


# -- a stop signal at a named update ----------------------------------------------------------------

SIGNALLED = [
    pytest.param("stacked", "0:3:term:after", "SIGTERM", id="stacked-sigterm"),
    pytest.param("loop", "0:6:usr2:after", "SIGUSR2", id="loop-sigusr2", marks=pytest.mark.slow),
    # slow: the quick loop's signal to one process is SIGTERM's case, above
    pytest.param("stacked", "0:3:int:after", "SIGINT", id="stacked-sigint", marks=pytest.mark.slow),
    pytest.param("loop", "0:6:hup:after", "SIGHUP", id="loop-sighup", marks=pytest.mark.slow),
    pytest.param("dist", "1:3:usr2:after", "SIGUSR2", id="dist-sigusr2-to-rank-1", marks=pytest.mark.slow),
    pytest.param("dist", "1:5:int:after", "SIGINT", id="dist-sigint-to-rank-1", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("engine", "fault", "name"), SIGNALLED)
def test_a_stop_signal_stops_after_the_update_checkpointed_and_resume_auto_finishes_the_same_run(
    tmp_path, references, engine, fault, name
):
    overrides = [*H4, *ENGINES[engine]]
    run_dir = tmp_path / "run"
    done = entry([*overrides, f"hydra.run.dir={run_dir}"], tmp_path, fault)
    update = int(fault.split(":")[1])
    assert_stopped_after(run_dir, update, done, name)
    resume_auto(run_dir, overrides, tmp_path)
    assert_identical(run_dir, references[engine])


MATRIX = [("loop", "adamw", "documents"), ("stacked", "muon", "documents"), ("dist", "muon", "windows")]


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "inner", "data"), MATRIX, ids=["-".join(c) for c in MATRIX])
def test_the_other_optimizers_and_data_stop_and_resume_the_same(tmp_path, engine, inner, data):
    """SIGTERM after update 3 (mid-round) for more of engine x optimizer x data, each against its own
    uninterrupted run started beside it."""
    overrides = [*H4, *ENGINES[engine], *INNERS[inner], *DATA[data]]
    reference = start_entry([*overrides, f"hydra.run.dir={tmp_path / 'reference'}"], tmp_path)
    run_dir = tmp_path / "run"
    rank = "1" if engine == "dist" else "0"
    done = entry([*overrides, f"hydra.run.dir={run_dir}"], tmp_path, f"{rank}:3:term:after")
    assert finish(reference).returncode == 0
    assert_stopped_after(run_dir, 3, done, "SIGTERM")
    resume_auto(run_dir, overrides, tmp_path)
    assert_identical(run_dir, tmp_path / "reference")


OUTSIDE = [
    ("stacked", "SIGUSR2"),
    ("dist", "SIGUSR2"),
    ("stacked", "SIGINT"),
    ("dist", "SIGINT"),
    ("dist", "SIGHUP"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "name"), OUTSIDE, ids=["-".join(c).lower() for c in OUTSIDE])
def test_a_stop_signal_from_outside_at_any_moment_resumes_to_the_same_run(tmp_path, references, engine, name):
    """The signal to the run's process group (the entry and, for dist, the workers torch's agent
    started: a terminal's Ctrl-C and hangup reach them all so) once the held-out loss before
    training is written; the stop lands wherever the run then is (8 updates remain)."""
    overrides = [*H4, *ENGINES[engine]]
    run_dir = tmp_path / "run"
    proc = start_entry([*overrides, f"hydra.run.dir={run_dir}"], tmp_path)
    metrics, deadline = run_dir / METRICS_FILE, time.monotonic() + 120
    while not (metrics.exists() and b'"kind": "eval"' in metrics.read_bytes()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first rows"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.Signals[name])
    done = finish(proc)
    assert done.returncode == EXIT_CODES[signal.Signals[name]], done.stderr
    stopped_after = [r["update"] for r in rows_of(run_dir) if r["kind"] == "update"][-1]
    assert_stopped_after(run_dir, stopped_after, done, name)
    resume_auto(run_dir, overrides, tmp_path)
    assert_identical(run_dir, references[engine])


# -- mid-round checkpoints, and crashes while writing ------------------------------------------------


@pytest.mark.slow
def test_checkpoints_every_few_updates_inside_a_round_resume_exactly(tmp_path, references):
    overrides = [*H4, "checkpoint.every_updates=3", "checkpoint.keep=10"]
    run_dir = tmp_path / "run"
    killed = entry([*overrides, f"hydra.run.dir={run_dir}"], tmp_path, "0:7:kill:after")
    assert killed.returncode == KILLED, killed.stderr
    assert checkpoints(run_dir) == [ckpt(run_dir, u) for u in (3, 4, 6)]  # 3, 6 mid-round; 4 a sync's
    rows = [r for r in rows_of(run_dir) if r["kind"] == "checkpoint"]
    assert [(r["update"], r["mid_round"]) for r in rows] == [(3, True), (4, False), (6, True)]
    done = entry([*overrides, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr
    resumed = [r for r in rows_of(run_dir) if r["kind"] == "resume"]
    assert [r["update"] for r in resumed] == [6]
    assert_identical(run_dir, references["stacked"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "newest"),
    [
        pytest.param("0:8:kill:checkpoint", 4, id="killed-writing-a-checkpoint"),
        pytest.param("0:6:kill:metrics", 4, id="killed-writing-a-row"),
    ],
)
def test_killed_while_writing_resumes_from_the_previous_checkpoint_exactly(
    tmp_path, references, fault, newest
):
    """A checkpoint is written to a temporary file and renamed: killed before the rename, the run
    has the previous one. A row is appended: killed half-way, the torn row lies past the
    checkpoint's length and moves to metrics.superseded.jsonl."""
    run_dir = tmp_path / "run"
    killed = entry([*H4, f"hydra.run.dir={run_dir}"], tmp_path, fault)
    assert killed.returncode == KILLED, killed.stderr
    assert checkpoints(run_dir)[-1] == ckpt(run_dir, newest)
    before = (run_dir / METRICS_FILE).read_bytes()
    if "metrics" in fault:
        assert not before.endswith(b"\n")  # the torn row
    else:
        assert ckpt(run_dir, 8).with_name(ckpt(run_dir, 8).name + ".tmp").exists()
    done = entry([*H4, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr
    saved = torch.load(ckpt(run_dir, newest), weights_only=False)
    assert (run_dir / SUPERSEDED_FILE).read_bytes() == before[saved["metrics_bytes"] :]
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # the next write replaced it
    assert_identical(run_dir, references["stacked"])


@pytest.mark.slow
def test_a_mid_round_checkpoint_without_the_replica_weights_resumes_to_another_run(tmp_path, references):
    """Negative control: the global weights in place of replica 1's weights inside the round."""
    run_dir = tmp_path / "run"
    stopped = entry([*H4, f"hydra.run.dir={run_dir}"], tmp_path, "0:2:term:after")
    assert stopped.returncode == STOPPED, stopped.stderr
    path = ckpt(run_dir, 2)
    saved = torch.load(path, weights_only=False)
    theta = saved["state"]["theta"]
    saved["state"]["round_params"][1] = {n: t.unsqueeze(0).clone() for n, t in theta.items()}
    torch.save(saved, path)
    seal(path)
    resume_auto(run_dir, H4, tmp_path)
    got, want = outcome(run_dir), outcome(references["stacked"])
    assert got.updates[:2] == want.updates[:2]
    assert got.updates[2]["loss"][1] != want.updates[2]["loss"][1]  # replica 1, at update 3
    assert got.updates[2]["loss"][0] == want.updates[2]["loss"][0]  # the others as before
    with pytest.raises(AssertionError):
        assert_identical(run_dir, references["stacked"])


# -- the handler itself -----------------------------------------------------------------------------


def test_stop_signals_set_a_flag_and_hand_over_to_the_handler_that_was_there():
    """In this process: a launcher's Python handler (submitit installs one for SIGUSR2) is replaced
    while the run trains, sees nothing until the stop is done, then is called with the signal."""
    seen: list[int] = []
    before = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        with StopSignals() as stops:
            assert requested() is None
            os.kill(os.getpid(), signal.SIGUSR2)
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
            assert requested() == signal.SIGUSR2 and seen == []
            stops.hand_over()
            assert seen == [signal.SIGUSR2]
        assert requested() is None
        assert signal.getsignal(signal.SIGTERM) is not stops._handle
    finally:
        signal.signal(signal.SIGUSR2, before)
