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
- The divergence guard: a run whose numbers stay finite but whose global weights diverge (a huge
  inner lr) stops at the sync where it shows, on every engine, real processes included (all ranks
  stop together): exit 1, one line naming the update and the figure, records closed, earlier
  checkpoints intact, no final weights.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    BASE,
    ENGINES,
    KILLED,
    ReferenceRuns,
    ckpt,
    entry,
    error_lines,
    finish,
    start_entry,
    stderr_lines,
    tree,
)

from hypertrain.config import UserError
from hypertrain.rundir.records import METRICS_FILE, read_metrics

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
    """The session's finished BASE run (`ReferenceRuns`): the tests copy it before they change it."""
    return ReferenceRuns.beside(tmp_path_factory.mktemp("finished"))(BASE)


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
    kept = (ckpt(run_dir, 6).name, ckpt(run_dir, 8).name)
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} == {*kept, *(f"{k}.sha256" for k in kept)}


@pytest.mark.slow  # the quick loop's lock: two runs started together, above
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
    from hypertrain.rundir import directory

    def no_locks(fd, op):
        raise OSError(code, "not supported")

    monkeypatch.setattr(directory.fcntl, "flock", no_locks)
    run_dir = tmp_path / "new" / "run"
    with pytest.raises(UserError) as refused:
        directory.acquire(run_dir)
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
    newest = ckpt(run_dir, 8).name
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        mine.name,
        newest,
        f"{newest}.sha256",
    ]


PSEUDO_GRAD_LINE = (
    r"diverged: the pseudo-gradient norm at the sync at update (\d+) is ([0-9.e+]+), more than "
    r"guard\.pseudo_grad_ratio=1000 times the global weights' norm ([0-9.e+]+); the run stops"
)
HELDOUT_LINE = (
    r"diverged: the held-out loss of the global weights after the sync at update (\d+) is ([0-9.]+), more "
    r"than guard\.heldout_margin=1 nats above the uniform prediction's 5\.5452 \(ln 256\); the run stops"
)


def assert_stopped_by_the_guard(done, run_dir: Path, line: str, engine: str) -> re.Match:
    """Exit 1; the one line (processes=dist: each rank's, rank 0's naming the figure, and the parent's);
    metrics.jsonl: the updates up to the sync that tripped, its sync row, a failed end row; the
    checkpoints of earlier syncs only; no weights.pt. Returns the end row's match of `line`."""
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    rows = read_metrics(run_dir / METRICS_FILE)
    end = rows[-1]
    assert end["kind"] == "end" and end["status"] == "failed" and end["exit_code"] == 1, end
    found = re.fullmatch(line, end["error"])
    assert found, end["error"]
    update = int(found.group(1))
    if engine == "dist":
        lines = [x for x in error_lines(done.stderr) if x.startswith("hypertrain: error: ")]
        assert f"hypertrain: error: run failed on rank 0: {end['error']}" in lines, done.stderr
        parent = [x for x in lines if x.startswith("hypertrain: error: run failed: ")]
        assert len(parent) == 1 and "exited with code 1" in parent[0], done.stderr
    else:
        assert stderr_lines(done.stderr) == [f"hypertrain: error: run failed: {end['error']} ({run_dir})"]
    assert [r["update"] for r in rows if r["kind"] == "update"] == list(range(1, update + 1))
    syncs = [r for r in rows if r["kind"] == "sync"]
    assert syncs[-1]["update"] == update  # the sync that tripped is recorded with its figures
    if "pseudo-gradient" in line:
        assert syncs[-1]["pseudo_grad_norm"] == pytest.approx(float(found.group(2)), rel=1e-3)
    else:
        assert syncs[-1]["eval_loss"] == pytest.approx(float(found.group(2)), abs=1e-4)
    saved = sorted((run_dir / "checkpoints").glob("ckpt-u*.pt"))
    assert saved == [ckpt(run_dir, u) for u in range(2, update, 2)][-2:]  # BASE syncs every 2; keep 2
    assert not (run_dir / "weights.pt").exists()
    return found


# inner.lr=300 on the quick model: every number finite at the first sync (update 2), but the held-out
# loss ~2e5 nats and the pseudo-gradient ~1e3 x the weights' norm; inner.lr=10: held-out 28 nats there.
LIMITS = {
    "held-out": (["inner.lr=300"], HELDOUT_LINE),
    "pseudo-gradient": (["inner.lr=300", "guard.heldout_margin=1e9"], PSEUDO_GRAD_LINE),
}


@pytest.mark.parametrize("limit", list(LIMITS))
@pytest.mark.parametrize(
    "engine", [pytest.param(e, marks=() if e == "stacked" else pytest.mark.slow) for e in ENGINES]
)
def test_a_run_whose_weights_diverge_without_nan_stops_at_the_sync(tmp_path, engine, limit):
    """Every engine stops at the sync where a limit is passed, real processes all together (processes=dist:
    only rank 0 evaluates the held-out loss; every rank stops on its verdict)."""
    run_dir = tmp_path / "run"
    overrides, line = LIMITS[limit]
    done = entry([*BASE, *ENGINES[engine], *overrides, f"hydra.run.dir={run_dir}"], tmp_path)
    found = assert_stopped_by_the_guard(done, run_dir, line, engine)
    if limit == "held-out":
        assert float(found.group(2)) > math.log(256) + 1
    else:
        assert float(found.group(2)) > 1000 * float(found.group(3))


def test_the_guard_off_trains_a_diverging_run_to_its_end(tmp_path):
    """guard.enabled=false: inner.lr=10 trains on to a held-out loss of hundreds of nats, exit 0."""
    run_dir = tmp_path / "run"
    done = entry([*BASE, "inner.lr=10", "guard.enabled=false", f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = read_metrics(run_dir / METRICS_FILE)
    assert rows[-1]["status"] == "finished"
    assert [r["eval_loss"] > math.log(256) + 1 for r in rows if r["kind"] == "sync"] == [True] * 4


# -- Run-start failures (issue 21): W&B that cannot start, a disk full before the first record. A new
# run that fails before its first record leaves nothing, so the same command runs again as is.


def test_wandb_that_cannot_reach_its_server_fails_in_one_line_and_leaves_nothing(tmp_path):
    """Online, with credentials of the right form, against a server nobody listens on (port 9,
    discard): wandb.init fails at run start after WANDB_INIT_TIMEOUT. Exit 1, one line, no
    directory; the same hydra.run.dir then runs offline to its end."""
    run_dir = tmp_path / "new" / "run"
    online = {
        "WANDB_MODE": "online",
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_API_KEY": "k" * 40,  # wandb's form: 40 characters (never sent anywhere that answers)
        "WANDB_INIT_TIMEOUT": "2",  # nobody listens: every try is refused at once
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
    }
    args = [*BASE, "logger=wandb", "logger.progress=never", f"hydra.run.dir={run_dir}"]
    done = entry(args, tmp_path, env=online)
    assert done.returncode == 1, done.stderr
    lines = stderr_lines(done.stderr)
    assert len(lines) == 1, lines
    assert lines[0].startswith("hypertrain: error: run failed: W&B could not start ("), lines
    assert not (tmp_path / "new").exists(), "a run W&B could not start left its directory"
    again = entry(args, tmp_path)  # offline (helpers' environment)
    assert again.returncode == 0, again.stderr
    assert read_metrics(run_dir / METRICS_FILE)[-1]["status"] == "finished"


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB tmpfs (room for BASE's run: two 1 MiB checkpoints and its files), unmounted after."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        why = made.stderr.decode().strip()
        pytest.skip(f"cannot mount a tmpfs here (root with CAP_SYS_ADMIN needed): {why}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill_leaving(mount: Path, left: int) -> Path:
    """Fill the filesystem at `mount` until `left` bytes (whole pages) stay free; the filler file."""
    filler = mount / "filler"
    stats = os.statvfs(mount)
    with open(filler, "wb") as f:
        f.write(b"\0" * (stats.f_bavail * stats.f_frsize - left))
    return filler


@pytest.mark.parametrize(
    "left", [0, pytest.param(4096, marks=pytest.mark.slow), pytest.param(64 * 1024, marks=pytest.mark.slow)]
)
def test_a_disk_full_before_the_first_record_is_exit_4_one_line_and_nothing_made(small_disk, left):
    """0 bytes, a page and 64 KiB free (under what a run writes before its first record): exit 4, one
    line naming the directory, nothing created; with the filler gone the same command runs."""
    filler = fill_leaving(small_disk, left)
    run_dir = small_disk / "runs" / "run"
    args = [*BASE, f"hydra.run.dir={run_dir}"]
    before = tree(small_disk)
    done = entry(args, small_disk.parent)
    assert done.returncode == 4, done.stderr
    lines = stderr_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        f"hypertrain: error: no space left on the device for hydra.run.dir={run_dir}: "
    ), lines
    assert tree(small_disk) == before, "a run on a full disk created files"
    filler.unlink()
    again = entry(args, small_disk.parent)
    assert again.returncode == 0, again.stderr


@pytest.mark.slow  # a few hundred updates to fill the disk with rows
def test_a_disk_that_fills_while_rows_are_written_is_exit_4_and_one_line(small_disk):
    """No checkpoints (checkpoint.every=0), 160 KiB free: the rows fill the disk mid-run. The run stops
    with one line and the documented disk-full code, 4 (it was a 38-line OSError traceback from the
    records' close, exit 1); every whole row written before is JSON (the last may be torn)."""
    fill_leaving(small_disk, 160 * 1024)
    run_dir = small_disk / "run"
    args = [*BASE, "inner.H=5", "phase.updates=2000", "checkpoint.every=0", f"hydra.run.dir={run_dir}"]
    done = entry(args, small_disk.parent)
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr
    assert stderr_lines(done.stderr) == [
        f"hypertrain: error: run failed: no space left on the device writing the run's records ({run_dir})"
    ]
    lines = (run_dir / METRICS_FILE).read_bytes().split(b"\n")
    rows = [json.loads(line) for line in lines[:-1]]  # the whole lines; the tail after them may be torn
    assert sum(r["kind"] == "update" for r in rows) > 100
