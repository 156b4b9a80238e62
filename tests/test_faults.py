"""Faults around a run's directory while runs are going on: two writers, a lock the filesystem cannot
take, and pruning beside checkpoints the run did not write (issue 21, "a run directory is sacred").

- Rank 0 holds an exclusive flock on `run_dir/.lock` while the run writes there. A second run on
  the same `hydra.run.dir` (a new run, or a resume of a finished or stopped one) while another
  process holds it: one line naming the directory, exit 2, nothing created or changed. Two runs
  started together on one new directory: one finishes (one `start` row, every update once, a
  finished `end` row, its checkpoints), the other is refused with one line and exit 2.
- The lock is released however its holder ends: after a SIGKILL, `resume=auto` goes on and finishes.
- A filesystem that cannot lock (ENOLCK, ENOSYS): refused with one line naming it; nothing made.
- Pruning (`checkpoint.keep`) removes only checkpoints this run wrote: a file of the user's named like
  a checkpoint, in a resumed run's checkpoints/, stays.
"""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BASE, KILLED, ckpt, entry, finish, start_entry, stderr_lines, tree

from hypertrain.config import ConfigError
from hypertrain.log import METRICS_FILE, read_metrics

HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "time.sleep(120)\n"
)


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process holding run_dir/.lock, as a run writing there does."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir / ".lock")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def assert_refused_in_use(done, run_dir: Path) -> None:
    assert done.returncode == 2, done.stderr
    lines = stderr_lines(done.stderr)
    assert lines == [
        f"hypertrain: error: hydra.run.dir={run_dir} is in use: another process holds {run_dir / '.lock'} "
        "and writes there; valid: another hydra.run.dir, or wait until that run has ended"
    ], done.stderr


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("finished")
    done = entry([*BASE, f"hydra.run.dir={where / 'run'}"], where)
    assert done.returncode == 0, done.stderr
    return where / "run"


@pytest.mark.parametrize("how", ["new", "resume-true", "resume-auto"])
def test_a_directory_another_process_writes_is_refused_and_touched_nothing(tmp_path, finished, how):
    """A second writer: a new run into a directory whose lock is held (it holds nothing else yet), or
    a resume of a run while another process holds its lock."""
    if how == "new":
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        args = [*BASE, f"hydra.run.dir={run_dir}"]
    else:
        import shutil

        run_dir = Path(shutil.copytree(finished, tmp_path / "run"))
        args = [*BASE, f"hydra.run.dir={run_dir}", f"resume={how.split('-')[1]}"]
    holder = hold_lock(run_dir)
    try:
        before = tree(tmp_path)
        done = entry(args, tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert_refused_in_use(done, run_dir)
    assert tree(tmp_path) == before, "a refused second writer created or changed files"


def test_two_runs_started_together_on_one_directory_one_runs_one_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    args = [*BASE, f"hydra.run.dir={run_dir}"]
    procs = [start_entry(args, tmp_path) for _ in range(2)]
    done = [finish(p) for p in procs]
    codes = sorted(d.returncode for d in done)
    assert codes == [0, 2], [d.stderr for d in done]
    refused = next(d for d in done if d.returncode == 2)
    lines = stderr_lines(refused.stderr)
    # Which line depends on how far the first had got: its lock held, or its records already there.
    assert len(lines) == 1 and lines[0].startswith(f"hypertrain: error: hydra.run.dir={run_dir} "), lines
    rows = read_metrics(run_dir / METRICS_FILE)
    kinds = [r["kind"] for r in rows]
    assert kinds.count("start") == 1 and kinds.count("end") == 1 and rows[-1]["status"] == "finished"
    assert [r["update"] for r in rows if r["kind"] == "update"] == list(range(1, 9))
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} == {
        ckpt(run_dir, 6).name,
        ckpt(run_dir, 8).name,
    }


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    """SIGKILL while the run holds the lock: the kernel drops it; resume=auto goes on and finishes."""
    run_dir = tmp_path / "run"
    args = [*BASE, f"hydra.run.dir={run_dir}"]
    killed = entry(args, tmp_path, "0:5:kill")
    assert killed.returncode == KILLED, killed.stderr
    assert (run_dir / ".lock").exists()
    done = entry([*args, "resume=auto"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = read_metrics(run_dir / METRICS_FILE)
    assert [r["update"] for r in rows if r["kind"] == "update"] == list(range(1, 9))
    assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "finished"


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS])
def test_a_filesystem_without_locks_is_refused_with_one_line_and_nothing_made(tmp_path, monkeypatch, code):
    from hypertrain import preflight

    def no_locks(fd, op):
        raise OSError(code, "not supported")

    monkeypatch.setattr(preflight.fcntl, "flock", no_locks)
    run_dir = tmp_path / "new" / "run"
    with pytest.raises(ConfigError) as refused:
        preflight.acquire(run_dir)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"hydra.run.dir={run_dir}: its filesystem does not support locking {run_dir / '.lock'} "
        f"({errno.errorcode[code]}"
    ), message
    assert "valid: " in message
    assert list(tmp_path.iterdir()) == [], "a refused lock left files or folders behind"


def test_pruning_removes_only_the_checkpoints_this_run_wrote(tmp_path):
    """A run killed as round 3 starts (its checkpoint after update 4); the user puts a file of theirs
    named like a checkpoint beside it; the resumed run (checkpoint.keep=1) prunes its own older
    checkpoint only."""
    run_dir = tmp_path / "run"
    args = [*BASE, "checkpoint.keep=1", f"hydra.run.dir={run_dir}"]
    killed = entry(args, tmp_path, "0:5:kill")
    assert killed.returncode == KILLED, killed.stderr
    mine = ckpt(run_dir, 1)
    mine.write_bytes(b"the user's own file")
    done = entry([*args, "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert mine.read_bytes() == b"the user's own file"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [mine.name, ckpt(run_dir, 8).name]
