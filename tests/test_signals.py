"""The exit code and the records are one decision; Ctrl-C, a second Ctrl-C and a hangup (issue 21).

test_preemption.py stops runs with SIGTERM, SIGUSR2, SIGINT and SIGHUP after an update and resumes
them; here what is particular to the interrupts and to how the self-launched `processes=dist` ends:

- A second Ctrl-C stops at once (the fault hook's `int2`: SIGINT to the run's process group twice,
  as a terminal sends it, `REPEAT_S` + 0.5 s apart, during update 6, inside round 2): exit 130,
  one line, an `interrupted` end row with exit code 130 naming the checkpoint that is intact (the
  sync's after update 4), no checkpoint of its own; `resume=auto` finishes the run identically to
  an uninterrupted one. For engine=stacked and processes=dist (every process gets both signals; torch's
  agent forwards the first one too, which the workers take for the same Ctrl-C).
- processes=dist: a worker killed after rank 0 wrote the `finished` end row (the fault point `end`)
  leaves the run finished: exit 0, weights.pt, one warning line naming the worker.
- Under torchrun, Ctrl-C to torchrun's process group (its workers are in sessions of their own, so
  torchrun forwards it): torchrun ends as torch makes it (non-zero, its own lines,
  docs/distributed.md); the workers' records are consistent: an `interrupted` end row with exit code
  130 after the update every rank stopped after, a checkpoint there, rank 0's one line, and
  `resume=auto` finishes the run identically.
- In this process: a second SIGINT raises `StoppedAtOnce`; under a launcher, not within `REPEAT_S`
  of the first (one Ctrl-C reaches a worker twice: from the terminal and from the agent).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers import BASE, ENGINES, assert_identical, ckpt, entry, finish, start_entry, stderr_lines

from hypertrain.failures.signals import EXIT_CODES, REPEAT_S, StoppedAtOnce, StopSignals, ctrl_c_after_imports
from hypertrain.rundir.checkpoint import checkpoints
from hypertrain.rundir.records import METRICS_FILE, read_metrics

H4 = [*BASE, "inner.H=4"]  # syncs (and checkpoints) after updates 4 and 8
INTERRUPTED = EXIT_CODES[signal.SIGINT]  # 130


def rows_of(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / METRICS_FILE)


def resume_auto_identically(run_dir: Path, overrides: list[str], reference: Path, cwd: Path) -> None:
    done = entry([*overrides, f"hydra.run.dir={run_dir}", "resume=auto"], cwd)
    assert done.returncode == 0, done.stderr
    rows = rows_of(run_dir)
    assert [r["update"] for r in rows if r["kind"] == "update"] == list(range(1, 9))
    assert rows[-1]["status"] == "finished"
    assert_identical(run_dir, reference)


@pytest.mark.parametrize(
    ("engine", "fault"),
    [
        pytest.param("stacked", "0:6:int2:after", id="stacked", marks=pytest.mark.slow),
        pytest.param("dist", "1:6:int2:after", id="dist", marks=pytest.mark.slow),
    ],
)
def test_a_second_ctrl_c_stops_at_once_with_one_line_and_the_last_checkpoint_intact(tmp_path, engine, fault):
    overrides = [*H4, *ENGINES[engine]]
    reference = start_entry([*overrides, f"hydra.run.dir={tmp_path / 'reference'}"], tmp_path)
    run_dir = tmp_path / "run"
    done = entry([*overrides, f"hydra.run.dir={run_dir}"], tmp_path, fault)
    assert finish(reference).returncode == 0
    assert done.returncode == INTERRUPTED, done.stderr
    lines = stderr_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("hypertrain: stopped at once by a second SIGINT"), (
        done.stderr
    )
    intact = ckpt(run_dir, 4)
    assert checkpoints(run_dir) == [intact]  # the stop wrote none of its own
    rows = rows_of(run_dir)
    assert [r["update"] for r in rows if r["kind"] == "update"] == [1, 2, 3, 4]
    end = rows[-1]
    assert end["kind"] == "end" and end["status"] == "interrupted" and end["exit_code"] == INTERRUPTED, end
    assert f"checkpoint {intact} is intact" in end["error"], end
    assert lines[0].startswith(f"hypertrain: {end['error']}"), (lines, end)
    resume_auto_identically(run_dir, overrides, tmp_path / "reference", tmp_path)


@pytest.mark.slow
def test_dist_a_worker_that_dies_after_the_finished_end_row_leaves_the_run_finished(tmp_path):
    """Rank 1 SIGKILLed in its teardown, once rank 0's `finished` end row is written: exit 0 (it
    was 3: the launcher's failure overrode the records), one warning line naming rank 1."""
    run_dir = tmp_path / "run"
    done = entry([*H4, *ENGINES["dist"], f"hydra.run.dir={run_dir}"], tmp_path, "1:8:kill:end")
    assert done.returncode == 0, done.stderr
    lines = stderr_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("hypertrain: warning: rank 1 died of SIGKILL in its teardown"), lines
    end = rows_of(run_dir)[-1]
    assert end["kind"] == "end" and end["status"] == "finished" and "exit_code" not in end, end
    assert (run_dir / "weights.pt").exists()


@pytest.mark.slow
def test_ctrl_c_under_torchrun_leaves_consistent_records_and_resumes_the_same_run(tmp_path):
    overrides = [*H4, *ENGINES["dist"]]
    reference = start_entry([*overrides, f"hydra.run.dir={tmp_path / 'reference'}"], tmp_path)
    run_dir = tmp_path / "run"
    proc = start_entry([*overrides, f"hydra.run.dir={run_dir}"], tmp_path, torchrun=2)
    metrics, deadline = run_dir / METRICS_FILE, time.monotonic() + 120
    while not (metrics.exists() and b'"kind": "eval"' in metrics.read_bytes()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first rows"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: torchrun, which forwards it
    done = finish(proc)
    assert finish(reference).returncode == 0
    assert done.returncode != 0  # torchrun's own: it ends on a signal (docs/distributed.md)
    rows = rows_of(run_dir)
    end = rows[-1]
    assert end["kind"] == "end" and end["status"] == "interrupted" and end["exit_code"] == INTERRUPTED, end
    stopped = [r["update"] for r in rows if r["kind"] == "update"][-1]
    if stopped < 8:  # a stop after the last update is no stop: the run finished
        assert end["error"].startswith(f"stopped by SIGINT after update {stopped};"), end
        assert checkpoints(run_dir)[-1] == ckpt(run_dir, stopped)
    assert [x for x in stderr_lines(done.stderr) if x.startswith("hypertrain:")] == [
        f"hypertrain: {end['error']}"
    ]
    resume_auto_identically(run_dir, overrides, tmp_path / "reference", tmp_path)


# -- the handler itself -----------------------------------------------------------------------------


def test_a_second_sigint_raises_at_once_but_not_the_same_ctrl_c_delivered_twice(monkeypatch):
    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as stops:
        os.kill(os.getpid(), signal.SIGINT)
        assert stops.received == signal.SIGINT
        os.kill(os.getpid(), signal.SIGTERM)  # another signal changes nothing
        with pytest.raises(StoppedAtOnce) as raised:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        assert raised.value.exit_code == INTERRUPTED and raised.value.status == "interrupted"
        os.kill(os.getpid(), signal.SIGINT)  # once stopping at once, nothing more
    monkeypatch.setenv("RANK", "1")  # a worker: one Ctrl-C comes from the terminal and the agent
    with StopSignals() as stops:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C, forwarded
        stops.at -= REPEAT_S  # a second later: a second Ctrl-C
        with pytest.raises(StoppedAtOnce):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_during_a_commands_lazy_imports_comes_after_them():
    """`ctrl_c_after_imports`: a SIGINT while the block runs is held (raised inside torch's import, a
    KeyboardInterrupt was swallowed, or ended `hypertrain.sample` by SIGINT after it returned 130), then
    the handler before it (Python's: KeyboardInterrupt) takes it; the handler is what it was before."""
    before, held = signal.getsignal(signal.SIGINT), False
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_after_imports():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the interpreter runs Python's handlers between bytecodes: none raises here
            held = True
    assert held
    assert signal.getsignal(signal.SIGINT) is before


# -- a stop before training starts, and SIGQUIT (issue 21) ------------------------------------------


def wait_for(path: Path, proc, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"the run ended before {path} appeared"
        time.sleep(0.005)


@pytest.mark.parametrize(
    ("when", "signum"),
    [
        ("importing", signal.SIGINT),
        ("importing", signal.SIGQUIT),
        ("claimed", signal.SIGINT),
        # slow: the quick loop's claimed case is SIGINT's; SIGQUIT takes the same path
        pytest.param("claimed", signal.SIGQUIT, marks=pytest.mark.slow),
    ],
    ids=["importing-2", "importing-3", "claimed-2", "claimed-3"],
)
def test_a_stop_before_training_is_one_line_its_code_and_leaves_nothing(tmp_path, when, signum):
    """`importing`: 0.5 s after start, inside the entry's imports (they take seconds: torch), where
    Python's own Ctrl-C was a traceback and SIGQUIT a core dump. `claimed`: as soon as the run
    directory's lock exists (Hydra then writes .hydra/, the entry config.yaml): the directory goes
    again. Either way: one line, 130 / 131, nothing left, and the same command then runs."""
    run_dir = tmp_path / "new" / "run"
    args = [*BASE, f"hydra.run.dir={run_dir}"]
    proc = start_entry(args, tmp_path)
    if when == "importing":
        time.sleep(0.5)
    else:
        wait_for(run_dir / ".lock", proc)
    os.kill(proc.pid, signum)
    done = finish(proc)
    assert done.returncode == EXIT_CODES[signum], done.stderr
    lines = stderr_lines(done.stderr)
    name = signal.Signals(signum).name
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"hypertrain: stopped by {name} while no update was running"), lines
    assert not (tmp_path / "new").exists(), "a run stopped before training left its directory"
    if when == "claimed":
        assert entry(args, tmp_path).returncode == 0


@pytest.mark.slow  # the quick loop's stop during training: tests/test_preemption.py's SIGTERM case
def test_sigquit_during_training_stops_after_the_update_checkpointed(tmp_path):
    """Ctrl-\\ stops as Ctrl-C does (not a core dump): after the update in flight, a checkpoint, an
    `interrupted` end row with exit code 131, one line; resume=auto finishes the run."""
    run_dir = tmp_path / "run"
    proc = start_entry([*H4, f"hydra.run.dir={run_dir}"], tmp_path)
    metrics, deadline = run_dir / METRICS_FILE, time.monotonic() + 120
    while not (metrics.exists() and b'"kind": "update"' in metrics.read_bytes()):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first update"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGQUIT)
    done = finish(proc)
    assert done.returncode == EXIT_CODES[signal.SIGQUIT] == 131, done.stderr
    rows = rows_of(run_dir)
    end = rows[-1]
    assert end["kind"] == "end" and end["status"] == "interrupted" and end["exit_code"] == 131, end
    stopped = [r["update"] for r in rows if r["kind"] == "update"][-1]
    if stopped < 8:  # a stop after the last update is no stop: the run finished
        assert checkpoints(run_dir)[-1] == ckpt(run_dir, stopped)
    assert stderr_lines(done.stderr) == [f"hypertrain: {end['error']} ({run_dir})"], done.stderr
    again = entry([*H4, f"hydra.run.dir={run_dir}", "resume=auto"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert rows_of(run_dir)[-1]["status"] == "finished"
