"""A run directory is its run's own: a new run writes only into a directory that does not exist, is
empty or holds only this run's files; rank 0 holds an exclusive lock on it while the run writes; a
resume names a checkpoint that belongs to the records beside it. Each refusal is one UserError line.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import tempfile
from contextvars import ContextVar
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hypertrain.config import ResumeMode, ResumeRequest, UserError, changed_fields, flatten, setting
from hypertrain.failures import DiskFull
from hypertrain.failures.signals import STOP_SIGNALS
from hypertrain.records import formats
from hypertrain.rundir import checkpoint
from hypertrain.rundir.records import METRICS_FILE

# Groups whose `name` field only labels the option chosen; the option is chosen with `group=option`.


LOCK_FILE = ".lock"  # rank 0 holds an exclusive flock on it while the run writes its directory


# What a session of a run writes before its first checkpoint: a restart (resume=auto) may find these.
SESSION_FILES = frozenset(
    {
        METRICS_FILE,
        checkpoint.SUPERSEDED_FILE,
        "config.yaml",
        "plan.json",
        "wandb",
        checkpoint.FOLDER,
        "weights.pt",
        "hf",  # model=hf: the final weights save_pretrained wrote (model.hf_export.HF_FOLDER)
    }
)


# What `python -m hypertrain.report RUN` and `python -m hypertrain.clock RUN` write by default into the
# run directory they read: the run's own report, so a resume leaves it as it is (docs/report.md).
REPORT_FOLDER = "report"
REPORT_FILES = frozenset({"report.md", "report.html", "report.json"})  # and the plots, *.png
CLOCK_PREFIX = "clock-"  # the clock's folder in it: clock-<cluster name>/, its CLOCK_MD and plot
CLOCK_MD = "clock.md"


_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def hydra_files(config: DictConfig) -> frozenset[str]:
    """What Hydra itself writes into a run directory: its `.hydra/` folder and the job's log file."""
    subdir = OmegaConf.select(config, "hydra.output_subdir")
    job = OmegaConf.select(config, "hydra.job.name") or "train"
    return frozenset({str(subdir or ".hydra"), f"{job}.log"})


def check_place(run_dir: Path) -> None:
    """The run directory can be created here: not under a file, somewhere writable."""
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(
            f"hydra.run.dir={run_dir} lies under {existing}, which is a file; valid: a path under a directory"
        )
    try:  # permission bits do not tell for root or special filesystems: try, and leave nothing
        os.rmdir(tempfile.mkdtemp(prefix=".hypertrain-probe-", dir=existing))
    except OSError as e:
        raise UserError(
            f"hydra.run.dir={run_dir}: nothing can be created in {existing} ({e.strerror}); "
            "valid: a writable directory"
        ) from None


def _in_use_error(run_dir: Path) -> UserError:
    return UserError(
        f"hydra.run.dir={run_dir} is in use: another process holds {run_dir / LOCK_FILE} and writes there; "
        "valid: another hydra.run.dir, or wait until that run has ended"
    )


def _no_locks_error(run_dir: Path, e: OSError) -> UserError:
    return UserError(
        f"hydra.run.dir={run_dir}: its filesystem does not support locking {run_dir / LOCK_FILE} "
        f"({errno.errorcode.get(e.errno, e.errno)}: {e.strerror}), so two runs could write it at once; "
        "valid: a run directory on a filesystem with flock (a local disk, NFS with locking)"
    )


def check_not_in_use(run_dir: Path) -> None:
    """No other process holds the run directory's lock (a probe: it takes and drops it, creates nothing)."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
    except OSError:  # no lock file (no run has written here), or none we could open
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise _in_use_error(run_dir) from None
        if e.errno in _NO_LOCKS:
            raise _no_locks_error(run_dir, e) from None
        raise
    finally:
        os.close(fd)  # closing drops a lock it took


def foreign(run_dir: Path, own: frozenset[str]) -> list[str]:
    """The entries of `run_dir` that are not this run's own (`own`, and the lock file)."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name not in own and p.name != LOCK_FILE)


def is_report(path: Path) -> bool:
    """Whether `path` is a folder of what the report and the clock write (REPORT_FOLDER): the report's
    files and plots, and clock-<cluster>/ folders of clock.md and plots; nothing else, no links."""

    def written(entry: Path, names: frozenset[str]) -> bool:
        return entry.is_file() and not entry.is_symlink() and (entry.name in names or entry.suffix == ".png")

    if not path.is_dir() or path.is_symlink():
        return False
    for entry in path.iterdir():
        if entry.name.startswith(CLOCK_PREFIX) and entry.is_dir() and not entry.is_symlink():
            if not all(written(inner, frozenset({CLOCK_MD})) for inner in entry.iterdir()):
                return False
        elif not written(entry, REPORT_FILES):
            return False
    return True


def check_run_dir(run_dir: Path, own: frozenset[str] = frozenset()) -> None:
    """A new run's directory: it can be created here, and it does not exist, is empty, or holds only
    this run's own files (`own`: Hydra's of this very launch, the lock file)."""
    if (run_dir / METRICS_FILE).exists():
        raise UserError(
            f"hydra.run.dir={run_dir} already holds a run ({METRICS_FILE}); valid: a new directory"
        )
    others = foreign(run_dir, own)
    if others:
        named = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise UserError(
            f"hydra.run.dir={run_dir} holds files that are not this run's ({named}); valid: a new or "
            "empty directory"
        )
    check_place(run_dir)


def check_own_session(run_dir: Path, own: frozenset[str], resolved: dict) -> None:
    """resume=auto without a checkpoint: `run_dir` may hold only what an earlier session of this same
    run wrote before its first checkpoint (its config.yaml is this run's, beyond what may change), and
    the report and clock of it in their default folder (`is_report`), which it leaves as they are."""
    metrics = (run_dir / METRICS_FILE).exists()
    # A session writes config.yaml and plan.json, then metrics.jsonl, then the rest: without its
    # records, anything more is not the start of a run that stopped, but a run whose records are gone.
    # With them, a report of the run (its default folder, REPORT_FOLDER) is the run's own.
    others = [
        name
        for name in foreign(run_dir, own | (SESSION_FILES if metrics else {"config.yaml", "plan.json"}))
        if not (metrics and name == REPORT_FOLDER and is_report(run_dir / name))
    ]
    if others:
        raise UserError(
            f"hydra.run.dir={run_dir} holds files that are not this run's ({', '.join(others[:3])}); "
            "valid: a new or empty directory, or the directory of this run"
        )
    written = run_dir / "config.yaml"
    if not written.is_file():
        if metrics:
            raise UserError(
                f"hydra.run.dir={run_dir} holds a run's {METRICS_FILE} without its config.yaml, so it cannot "
                "be told to be this run's; valid: a new directory"
            )
        return
    try:
        before = OmegaConf.to_container(OmegaConf.load(written), resolve=True)
    except Exception:  # not YAML, or not a mapping: not this run's
        before = None
    if not isinstance(before, dict):
        raise UserError(
            f"hydra.run.dir={run_dir} holds a config.yaml that is not a run's; valid: a new directory"
        )
    was, now = flatten(formats.upgrade_config(before, what=str(written))), flatten(resolved)
    changed = changed_fields(was, now)
    if changed:
        key = changed[0]  # what the user changed, not a field derived from it
        there = setting(key, was.get(key))
        raise UserError(
            f"hydra.run.dir={run_dir} holds another run that stopped before its first checkpoint ({there} "
            f"there, {setting(key, now.get(key))} here); valid: resume with {there}, or a new directory"
        )


def finished_updates(run_dir: Path) -> int | None:
    """The last update of a run whose records end with a `finished` end row; None otherwise."""
    from hypertrain.records.files import read_records
    from hypertrain.records.rows import EndRow, UpdateRow

    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        return None
    try:
        rows = read_records(metrics)
    except (ValueError, UnicodeDecodeError):
        return None
    if not (rows and isinstance(rows[-1], EndRow) and rows[-1].status == "finished"):
        return None
    return max((int(r.update) for r in rows if isinstance(r, UpdateRow)), default=0)


class RunLock:
    """Rank 0's exclusive flock on `run_dir/.lock` (opened read-write) while the run writes there.
    The kernel drops it when the process ends however it ends, so a dead holder leaves no stale lock
    (the file stays; it is not a PID file). `release(undo=True)` also removes what `acquire` made."""

    def __init__(self, path: Path, fd: int, made: list[Path]):
        self.path, self.fd, self.made = path, fd, made
        self.fresh = False  # a new run's directory (claim): it held only this run's own files

    def release(self, undo: bool = False) -> None:
        if self.fd is None:
            return
        if undo:  # while still held: nobody else can be using the file
            for made in self.made:
                try:
                    made.unlink() if made == self.path else made.rmdir()
                except OSError:
                    pass
        os.close(self.fd)
        self.fd = None


# The locks this call of the entry holds (released when its run ends; hypertrain.train.cli runs each
# call in a context of its own).
_held: ContextVar[tuple[RunLock, ...]] = ContextVar("hypertrain_held_locks", default=())


def release(lock: RunLock, undo: bool = False) -> None:
    """Give `lock` back (with `undo`, removing what taking it made)."""
    _held.set(tuple(held for held in _held.get() if held is not lock))
    lock.release(undo=undo)


def acquire(run_dir: Path, fresh: bool = False) -> RunLock:
    """Create `run_dir` if need be and take its lock; UserError (one line) when another process
    holds it or the filesystem cannot lock, with whatever this call made removed again. `fresh`: a
    new run's directory (`abandon_unstarted` may empty it). A stop signal that arrives meanwhile is
    held until the lock is taken and known, so the stop removes what this call made."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return _acquire(run_dir, fresh)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _acquire(run_dir: Path, fresh: bool) -> RunLock:
    missing = []
    parent = run_dir
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    while True:
        made = list(missing)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            made.insert(0, path)
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:  # removed in between by a process that gave up: again
                continue
            except OSError as e:
                raise UserError(
                    f"hydra.run.dir={run_dir}: {path} cannot be opened read-write to lock it ({e.strerror}); "
                    "valid: a run directory this user can write"
                ) from None
        except OSError as e:
            for made_dir in missing:
                try:
                    made_dir.rmdir()
                except OSError:
                    pass
            raise UserError(
                f"hydra.run.dir={run_dir}: {path} cannot be created ({e.strerror}); "
                "valid: a writable directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _NO_LOCKS:
                RunLock(path, fd, made).release(undo=True)
                raise _no_locks_error(run_dir, e) from None
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise _in_use_error(run_dir) from None
            raise
        try:  # the file we locked must still be the one at the path (not removed by one that gave up)
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            lock = RunLock(path, fd, made)
            lock.fresh = fresh
            _held.set((*_held.get(), lock))
            return lock
        os.close(fd)


def release_all() -> None:
    """Drop the locks this process holds (the end of a run; a multirun's next job takes its own)."""
    held = _held.get()
    _held.set(())
    for lock in reversed(held):
        lock.release()


def close_log_files(folder: Path) -> None:
    """Close and detach the logging handlers that write a file under `folder` (Hydra's job log), and
    only those: the caller's own handlers (a test's, a notebook's) stay as they are."""
    import logging

    folder = folder.absolute()
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", ())):
            name = getattr(handler, "baseFilename", None)
            if name is not None and folder in Path(name).parents:
                logger.removeHandler(handler)
                handler.close()


def abandon_unstarted() -> list[Path]:
    """The run this process claimed ended before its first record (a stop signal, a full disk, W&B
    that could not start): a new run's directory held only this run's own files when it was claimed,
    so what it holds now is this launch's: removed, with the lock and the folders the claim made, so
    the same hydra.run.dir is accepted again. A resumed run's directory stays (its rerun resumes), as
    does a run with a record (its records end with its end row). Returns the directories emptied."""
    emptied = []
    for lock in _held.get():
        run_dir = lock.path.parent
        metrics = run_dir / METRICS_FILE
        if not lock.fresh or (metrics.exists() and metrics.stat().st_size > 0):
            continue
        close_log_files(run_dir)  # Hydra's log file handler: closed before its file goes
        for entry in run_dir.iterdir():
            if entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        release(lock, undo=True)
        emptied.append(run_dir)
    return emptied


# What a run writes before its first record: Hydra's three .hydra/ files and its log, config.yaml,
# plan.json, the lock, metrics.jsonl and W&B's first files (about 16 files and 8 folders), each
# taking at least one block (4 KiB on the usual filesystems) and none over 16 KiB: 128 KiB holds
# them, so a disk with less is full for this run before it starts.
START_BYTES = 128 * 1024


def check_room(run_dir: Path) -> None:
    """DiskFull (exit 4) before anything is written when the run directory's filesystem has less than
    START_BYTES free for this user (a disk full before the first record would leave partial files)."""
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    stats = os.statvfs(existing)
    free = stats.f_bavail * stats.f_frsize
    if free < START_BYTES:
        raise DiskFull(
            f"no space left on the device for hydra.run.dir={run_dir}: {free} bytes free, a run writes "
            f"about {START_BYTES // 1024} KiB before its first record; nothing was written; valid: a "
            "run directory on a filesystem with room"
        )


def resume_target(asked: ResumeRequest, run_dir: Path) -> tuple[Path, tuple[Path, dict] | None]:
    """(the run directory, the checkpoint to resume from or None to start) for what `resume` asked."""
    if asked.mode is ResumeMode.START:
        return run_dir, None
    if asked.mode in (ResumeMode.LATEST, ResumeMode.AUTO):
        found = checkpoint.find(run_dir)
        if found is None and asked.mode is ResumeMode.LATEST:
            raise UserError(
                f"resume=true but {run_dir} holds no checkpoint; valid: hydra.run.dir=<an earlier run's "
                "directory>, or resume=<a checkpoint file or run directory>"
            )
        return run_dir, found
    path = asked.path
    if checkpoint.is_checkpoint(path):  # a file, or a sharded run's folder
        check_checkpoint_place(asked.given, path)
        return path.parent.parent, (path, checkpoint.load(path))
    found = checkpoint.find(path) if path.is_dir() else None
    if found is None:
        raise UserError(
            f"resume={asked.given!r} is no checkpoint file and no run directory holding one; valid: true, "
            "auto, a checkpoint file, or a run directory with checkpoints/"
        )
    return path, found


def check_checkpoint_place(given: str, path: Path) -> None:
    """resume=FILE: the file lies in RUN/checkpoints/ of a run that has its metrics.jsonl, since RUN
    becomes the run directory (Hydra writes there, the records are rewound there)."""
    run_dir = path.parent.parent
    if path.parent.name == checkpoint.FOLDER and (run_dir / METRICS_FILE).is_file():
        return
    where = (
        f"{run_dir} holds no {METRICS_FILE}"
        if path.parent.name == checkpoint.FOLDER
        else f"it lies outside a run's {checkpoint.FOLDER}/ folder"
    )
    raise UserError(
        f"resume={given!r} is a file, but {where}; valid: a run directory, or a checkpoint inside "
        f"RUN/{checkpoint.FOLDER}/ of a run that has its {METRICS_FILE}"
    )


def finished_of(run_dir: Path, updates: int) -> int | None:
    """`updates` when the run in `run_dir` has finished them all (its records say so), else None."""
    done = finished_updates(run_dir)
    return updates if done is not None and done >= updates else None
