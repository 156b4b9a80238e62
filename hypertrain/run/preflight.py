"""Checks a run before anything is written: a user mistake exits 2 with one line, nothing created.

Hydra creates the run directory, its `.hydra/` files and the log file before the task function
runs, so a mistake found there would leave a directory behind, or touch an earlier run's files.
`Preflight` is a Hydra callback (registered in `conf/train.yaml`); its `on_run_start` sees the
composed config before Hydra creates anything: it builds the typed config, validates it,
prepares the run (data and plan) and checks the run directory, and on a mistake prints one line
and exits 2. The prepared run is handed to the task function (`take_prepared`), so the data is
built once. Under torchrun, or as one of a SLURM job step's tasks, every rank runs the entry; only
rank 0 lets Hydra create anything (`write_nothing`; `hypertrain.slurm` does the same for the
submitit launcher's multi-task jobs). Multirun jobs are checked the same way by `check_job` inside
the task function (Hydra has made the job's directory by then); a rejected job's directory is
removed again.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import fcntl
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hypertrain.config import ConfigError, TrainConfig, upgrade_resolved
from hypertrain.distributed.layouts import choose_layout, launched_rank, process_count
from hypertrain.failures import DiskFull
from hypertrain.plan.sampling import PlanError
from hypertrain.run import checkpoint, memory
from hypertrain.run.checks import validate
from hypertrain.run.records import METRICS_FILE, check_wandb

# Groups whose `name` field only labels the option chosen; the option is chosen with `group=option`.
LABELLED_GROUPS = ("model", "outer", "phase")

CONF = Path(__file__).resolve().parents[2] / "conf"
_prepared: dict[str, object] = {}  # resolved task config (as YAML) -> the PreparedRun built for it


def fail(message: str, code: int = 2) -> None:
    """The entry's one line for a mistake (`hypertrain: error: ...`), then exit (2 = a user mistake).
    One of several ranks (torchrun's, srun's) leaves a mistake's line to rank 0 (`after_rank_0`)."""
    launched = launched_rank()
    if code == 2 and launched is not None and launched.rank != 0:
        message = after_rank_0(message, launched.rank)
    print(f"hypertrain: error: {message}", file=sys.stderr)
    sys.exit(code)


# Every rank finds the same mistake after the same work (imports, composition: about 3 CPU seconds
# here), started together by the launcher: rank 0 is at most that far behind, several times over on
# a loaded machine. Only a mistake that rank 0 does not see (this machine's own) waits this long.
REFUSAL_GRACE_S = 10.0


def after_rank_0(message: str, rank: int) -> str:
    """A rank other than 0 found a mistake: rank 0 finds it too and prints it once, and its exit makes
    the launcher stop this rank (torchrun's agent: SIGTERM), which then exits 2 without a line. Exiting
    at once instead would make the launcher stop rank 0 before its line. A mistake still unseen by
    rank 0 after REFUSAL_GRACE_S is this rank's own: its line, naming the rank, is returned."""
    import signal
    import time

    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    time.sleep(REFUSAL_GRACE_S)
    return f"rank {rank}: {message}"


def check_experiment(choices: dict) -> None:
    """`experiment` is an optional group: Hydra silently ignores an option that does not exist."""
    chosen = choices.get("experiment")
    options = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
    if chosen is not None and chosen not in options:
        raise ConfigError(f"experiment={chosen!r} is not an experiment; valid: {', '.join(options)}")


def check_fields(node: DictConfig, schema: type, prefix: str = "") -> None:
    """`+key=value` adds a key the run would never read: every key must be a field of the schema."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        if key not in fields:
            raise ConfigError(f"{prefix}{key} is not a config field; valid: {', '.join(sorted(fields))}")
        kind = fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(kind) and isinstance(node[key], DictConfig):
            check_fields(node[key], kind, f"{prefix}{key}.")


def check_labels(cfg: TrainConfig, choices: dict) -> None:
    """`outer.name=average` only relabels the Nesterov option: a label that disagrees with the
    option Hydra composed is a mistake, not a silent choice of the composed option's values."""
    for group in LABELLED_GROUPS:
        chosen, label = choices.get(group), getattr(cfg, group).name
        if chosen is not None and label != chosen:
            raise ConfigError(
                f"{group}.name={label!r} only labels the run; the {group} is chosen with {group}=... "
                f"(now {group}={chosen}); valid: {group}={label} to use that option, or {group}.name={chosen}"
            )


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
    }
)
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
        raise ConfigError(
            f"hydra.run.dir={run_dir} lies under {existing}, which is a file; valid: a path under a directory"
        )
    try:  # permission bits do not tell for root or special filesystems: try, and leave nothing
        os.rmdir(tempfile.mkdtemp(prefix=".hypertrain-probe-", dir=existing))
    except OSError as e:
        raise ConfigError(
            f"hydra.run.dir={run_dir}: nothing can be created in {existing} ({e.strerror}); "
            "valid: a writable directory"
        ) from None


def _in_use_error(run_dir: Path) -> ConfigError:
    return ConfigError(
        f"hydra.run.dir={run_dir} is in use: another process holds {run_dir / LOCK_FILE} and writes there; "
        "valid: another hydra.run.dir, or wait until that run has ended"
    )


def _no_locks_error(run_dir: Path, e: OSError) -> ConfigError:
    return ConfigError(
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


def check_run_dir(run_dir: Path, own: frozenset[str] = frozenset()) -> None:
    """A new run's directory: it can be created here, and it does not exist, is empty, or holds only
    this run's own files (`own`: Hydra's of this very launch, the lock file)."""
    if (run_dir / METRICS_FILE).exists():
        raise ConfigError(
            f"hydra.run.dir={run_dir} already holds a run ({METRICS_FILE}); valid: a new directory"
        )
    others = foreign(run_dir, own)
    if others:
        named = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ConfigError(
            f"hydra.run.dir={run_dir} holds files that are not this run's ({named}); valid: a new or "
            "empty directory"
        )
    check_place(run_dir)


def check_own_session(run_dir: Path, own: frozenset[str], resolved: dict) -> None:
    """resume=auto without a checkpoint: `run_dir` may hold only what an earlier session of this same
    run wrote before its first checkpoint (its config.yaml is this run's, beyond what may change)."""
    metrics = (run_dir / METRICS_FILE).exists()
    # A session writes config.yaml and plan.json, then metrics.jsonl, then the rest: without its
    # records, anything more is not the start of a run that stopped, but a run whose records are gone.
    others = foreign(run_dir, own | (SESSION_FILES if metrics else {"config.yaml", "plan.json"}))
    if others:
        raise ConfigError(
            f"hydra.run.dir={run_dir} holds files that are not this run's ({', '.join(others[:3])}); "
            "valid: a new or empty directory, or the directory of this run"
        )
    written = run_dir / "config.yaml"
    if not written.is_file():
        if metrics:
            raise ConfigError(
                f"hydra.run.dir={run_dir} holds a run's {METRICS_FILE} without its config.yaml, so it cannot "
                "be told to be this run's; valid: a new directory"
            )
        return
    try:
        before = OmegaConf.to_container(OmegaConf.load(written), resolve=True)
    except Exception:  # not YAML, or not a mapping: not this run's
        before = None
    if not isinstance(before, dict):
        raise ConfigError(
            f"hydra.run.dir={run_dir} holds a config.yaml that is not a run's; valid: a new directory"
        )
    was, now = checkpoint._flat(upgrade_resolved(before)), checkpoint._flat(resolved)
    changed = sorted(
        k
        for k in was.keys() | now.keys()
        if was.get(k) != now.get(k) and k.split(".")[0] not in checkpoint.MAY_CHANGE
    )
    if changed:
        key = changed[0]
        raise ConfigError(
            f"hydra.run.dir={run_dir} holds another run that stopped before its first checkpoint ({key}="
            f"{was.get(key)!r} there, {now.get(key)!r} here); valid: {key}={was.get(key)!r}, "
            "or a new directory"
        )


def finished_updates(run_dir: Path) -> int | None:
    """The last update of a run whose records end with a `finished` end row; None otherwise."""
    from hypertrain.run.records import read_metrics

    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        return None
    try:
        rows = read_metrics(metrics)
    except (ValueError, UnicodeDecodeError):
        return None
    if not (rows and rows[-1].get("kind") == "end" and rows[-1].get("status") == "finished"):
        return None
    return max((int(r["update"]) for r in rows if r.get("kind") == "update"), default=0)


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


_held: list[RunLock] = []  # the locks this process holds (released when its run ends)


def acquire(run_dir: Path, fresh: bool = False) -> RunLock:
    """Create `run_dir` if need be and take its lock; ConfigError (one line) when another process
    holds it or the filesystem cannot lock, with whatever this call made removed again. `fresh`: a
    new run's directory (`abandon_unstarted` may empty it)."""
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
                raise ConfigError(
                    f"hydra.run.dir={run_dir}: {path} cannot be opened read-write to lock it ({e.strerror}); "
                    "valid: a run directory this user can write"
                ) from None
        except OSError as e:
            for made_dir in missing:
                try:
                    made_dir.rmdir()
                except OSError:
                    pass
            raise ConfigError(
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
            _held.append(lock)
            return lock
        os.close(fd)


def release_all() -> None:
    """Drop the locks this process holds (the end of a run; a multirun's next job takes its own)."""
    while _held:
        _held.pop().release()


def abandon_unstarted() -> list[Path]:
    """The run this process claimed ended before its first record (a stop signal, a full disk, W&B
    that could not start): a new run's directory held only this run's own files when it was claimed,
    so what it holds now is this launch's: removed, with the lock and the folders the claim made, so
    the same hydra.run.dir is accepted again. A resumed run's directory stays (its rerun resumes), as
    does a run with a record (its records end with its end row). Returns the directories emptied."""
    emptied = []
    for lock in list(_held):
        run_dir = lock.path.parent
        metrics = run_dir / METRICS_FILE
        if not lock.fresh or (metrics.exists() and metrics.stat().st_size > 0):
            continue
        import logging

        logging.shutdown()  # Hydra's log file handler: closed before its file goes
        for entry in run_dir.iterdir():
            if entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        _held.remove(lock)
        lock.release(undo=True)
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


def grammar_error(error: Exception) -> str | None:
    """An override Hydra's grammar cannot read (`hydra.run.dir=~/x`: a leading ~) as one line naming
    the value, where it stops and what would be valid; None for any other error."""
    from hydra.errors import OverrideParseException

    if not isinstance(error, OverrideParseException):
        return None
    text = error.override
    key, sep, value = text.partition("=")
    lines = str(error).splitlines()
    prefix = "LexerNoViableAltException: "
    where = ""
    if len(lines) > 1 and lines[0].startswith(prefix) and "^" in lines[1]:
        at = lines[1].index("^") - len(prefix)
        if 0 <= at < len(text):
            where = f" (at {text[at]!r}, character {at + 1})"
    if not sep:
        return f"{text!r} cannot be read by Hydra's override grammar{where}; valid: key=value"
    quote = '"' if "'" in value else "'"
    quoted = f"{key}={quote}{value}{quote}"
    if value.startswith("~"):
        hint = (
            f"valid: an absolute path, {key}={os.path.expanduser(value)} (Hydra does not expand ~), or "
            f"the value quoted, {quoted}, for a folder named ~"
        )
    else:
        hint = f"valid: the value quoted for Hydra, {quoted} (on a shell, quote the whole argument)"
    return f"{key}={value} cannot be read by Hydra's override grammar{where}; {hint}"


def composition_error(error: Exception) -> str:
    """Hydra's own composition error as one line: its first line, with the cause or the options."""
    unreadable = grammar_error(error)
    if unreadable is not None:
        return unreadable
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    options = getattr(error, "options", None)
    if options:  # an option of a group that does not exist
        return f"{first}; valid: {', '.join(sorted(options))}"
    cause = error.__cause__
    detail = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    return f"{first} {detail}".strip() if detail and detail not in first else first


SWEEP_ROOT_ENV = "HYPERTRAIN_SWEEP_ROOT"  # the deepest folder above the sweep directory that existed


def check_composition(args: list[str]) -> None:
    """Compose the command line's overrides as Hydra will, before Hydra runs: an unknown option,
    a misspelled key or a value of the wrong type exits 2 with one line (Hydra's own wording),
    nothing created. In a multirun every value of every sweep is composed (with the other sweeps'
    first values), before Hydra writes the sweep directory; every job is then checked in full when
    it starts. Hydra's flags (--help, --cfg, ...) are left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in args):
        return
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    multirun = len(overrides) < len(args)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        first, sweeps, others = [], [], []  # others: (position in first, the sweep's other values)
        for override, text in zip(parsed, overrides, strict=True):
            if override.is_sweep_override():
                sweeps.append(text)
                key = override.get_key_element()
                try:
                    values = [f"{key}={v}" for v in override.sweep_string_iterator()]
                except Exception:  # a sweep Hydra enumerates only later (glob, interval): the jobs check it
                    continue
                if not values:
                    continue
                text = values[0]
                others.append((len(first), values[1:]))
            first.append(text)
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            composed = compose("train", overrides=first, return_hydra_config=True)
            sweeping = multirun or str(composed.hydra.mode) == "RunMode.MULTIRUN"
            jobs = [composed]
            if sweeping:  # each value once: time in proportion to the values given, not their product
                for at, values in others:
                    for value in values:
                        jobs.append(
                            compose(
                                "train",
                                overrides=[*first[:at], value, *first[at + 1 :]],
                                return_hydra_config=True,
                            )
                        )
    except Exception as e:  # Hydra's errors have no common base class beyond Exception
        fail(composition_error(e))
    if sweeping and (launched := launched_rank()) is not None:
        fail(
            f"a multirun (-m) under {launched.launcher} is not supported: every rank would run the whole "
            "sweep; valid: python -m hypertrain.train -m processes=dist ... (each job starts its own "
            "processes), or -m hydra/launcher=slurm_dist (each job's SLURM tasks are its ranks)"
        )
    if sweeps and not sweeping:
        fail(
            f"Ambiguous value for argument '{sweeps[0]}'; valid: -m to sweep over the values, "
            "or key=[a,b] for a list"
        )
    if sweeping:
        for job in jobs:
            check_sweep_memory(job)
        note_sweep_root(composed)


def check_sweep_memory(composed: DictConfig) -> None:
    """A sweep's value fits this machine's memory (hypertrain.memory), checked before Hydra writes the
    sweep directory: one line, exit 2. A value that is not valid is left to its own job's checks."""
    try:
        cfg = OmegaConf.to_object(_task_part(composed))
        validate(cfg)
    except Exception:  # not valid (or not typed): its job says what is wrong, in its turn
        return
    try:
        memory.check(cfg)
    except ConfigError as e:
        fail(str(e))


def note_sweep_root(composed: DictConfig) -> None:
    """Remember (for the jobs, in the environment) the deepest folder above the sweep directory that
    exists before Hydra makes it: a sweep whose first job is rejected removes what Hydra made below."""
    try:
        sweep_dir = Path(str(OmegaConf.select(composed, "hydra.sweep.dir"))).absolute()
    except Exception:  # a sweep directory that only resolves inside Hydra's run: nothing is removed
        return
    existing = sweep_dir
    while not existing.exists():
        existing = existing.parent
    os.environ[SWEEP_ROOT_ENV] = str(existing)


def with_layout(cfg: TrainConfig) -> TrainConfig:
    """processes=dist's process count and layout decided (validate() has checked that one fits)."""
    chosen = cfg.processes
    count = process_count(chosen.nproc, cfg.world.size)
    layout = choose_layout(count, cfg.world.size, cfg.replicas, chosen.layout)
    return replace(cfg, processes=replace(chosen, nproc=layout.processes, layout=layout.kind))


def resume_target(resume: str, run_dir: Path) -> tuple[Path, tuple[Path, dict] | None]:
    """(the run directory, the checkpoint to resume from or None to start) for `resume`."""
    mode = resume.strip()
    if mode.lower() in ("", "false"):
        return run_dir, None
    if mode.lower() in ("true", "auto"):
        found = checkpoint.find(run_dir)
        if found is None and mode.lower() == "true":
            raise ConfigError(
                f"resume=true but {run_dir} holds no checkpoint; valid: hydra.run.dir=<an earlier run's "
                "directory>, or resume=<a checkpoint file or run directory>"
            )
        return run_dir, found
    path = Path(mode).expanduser().absolute()
    if path.is_file():
        check_checkpoint_place(mode, path)
        return path.parent.parent, (path, checkpoint.load(path))
    found = checkpoint.find(path) if path.is_dir() else None
    if found is None:
        raise ConfigError(
            f"resume={mode!r} is no checkpoint file and no run directory holding one; valid: true, auto, "
            "a checkpoint file, or a run directory with checkpoints/"
        )
    return path, found


def check_checkpoint_place(mode: str, path: Path) -> None:
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
    raise ConfigError(
        f"resume={mode!r} is a file, but {where}; valid: a run directory, or a checkpoint inside "
        f"RUN/{checkpoint.FOLDER}/ of a run that has its {METRICS_FILE}"
    )


@dataclass
class Checked:
    """What the preflight decided: the prepared run, its directory, and where it resumes from."""

    run: object  # diloco.state.PreparedRun
    run_dir: Path | None
    resume: tuple[Path, dict] | None
    restart: bool = False  # resume=auto on a run stopped before its first checkpoint: start over
    finished: int | None = None  # resumed, but the run has finished all its updates: nothing to do
    own: frozenset[str] = frozenset()  # the entries of run_dir that are this run's (besides the lock)
    session: bool = False  # resume=auto without a checkpoint in a directory an earlier session wrote
    lock: RunLock | None = None  # held once `claim` has taken it


def prepare_checked(
    task_cfg: DictConfig,
    choices: dict,
    run_dir: Path | None,
    hydra: frozenset[str] = frozenset(),
    hydra_written: bool = False,
) -> Checked:
    """The typed, validated, prepared run; ConfigError/PlanError (one line) on any user mistake.
    `run_dir` None: this process writes nothing (a torchrun rank other than 0). `hydra`: the names of
    Hydra's own files in a run directory; `hydra_written`: Hydra has written them for this very launch
    (a multirun job), so they are this run's. A directory is written only when it does not exist, is
    empty, holds only this run's own files, or is resumed (its checkpoint and records belonging together)."""
    from hypertrain.run.prepare import check_device, prepare  # torch and data once the config is sane

    check_experiment(choices)
    check_fields(task_cfg, TrainConfig)
    cfg: TrainConfig = OmegaConf.to_object(task_cfg)
    check_labels(cfg, choices)
    validate(cfg)
    if run_dir is not None:  # the process that writes the run (rank 0) starts its W&B run
        check_wandb(cfg.logger)
    if cfg.processes.name == "dist":
        from hypertrain.run.processes import check_backend

        cfg = with_layout(cfg)
        launched = launched_rank()  # the ranks on this machine: the launcher's, else the self-launch's
        check_backend(cfg, cfg.processes.nproc if launched is None else launched.local_processes)
    elif (launched := launched_rank()) is not None:
        raise ConfigError(
            f"processes={cfg.processes.name} runs in one process, but {launched.launcher} started this "
            f"one as one of {launched.processes} ranks; valid: processes=dist (the ranks are its processes), "
            "or a single process"
        )
    check_device(cfg.engine.device)  # a device this process lacks, before the memory check asks it
    memory.check(cfg)  # before anything is built: the sizes the config asks for fit this machine
    found, session = None, False
    auto = cfg.resume.strip().lower() == "auto"
    # Hydra's files are this run's when Hydra wrote them for this launch; under resume=auto also an
    # earlier launch's of the same job (a requeued job: Hydra writes them again).
    own = hydra if hydra_written or auto else frozenset()
    if run_dir is not None:
        run_dir, found = resume_target(cfg.resume, run_dir)
        check_not_in_use(run_dir)
        session = found is None and auto and bool(foreign(run_dir, own))
        if found is None and not session:
            check_run_dir(run_dir, own)
    run = prepare(cfg)
    memory.check(run.cfg, run.dataset.max_length)  # again with the data's longest example (speech's)
    checked = Checked(run, run_dir, found, own=own, session=session)
    if found is not None:
        path, saved = found
        checkpoint.compatible(saved, resolved_config(run.cfg), run.plan_facts)
        checkpoint.records_match(run_dir, path, saved)
        newest = checkpoint.checkpoints(run_dir)
        if newest and newest[-1] == path:  # resume=PATH to an older checkpoint goes back: never a no-op
            checked.finished = finished_of(run_dir, run.updates)
    elif session:
        check_own_session(run_dir, own, resolved_config(run.cfg))
        checked.finished = finished_of(run_dir, run.updates)
        checked.restart = checked.finished is None and (run_dir / METRICS_FILE).exists()
    return checked


def finished_of(run_dir: Path, updates: int) -> int | None:
    """`updates` when the run in `run_dir` has finished them all (its records say so), else None."""
    done = finished_updates(run_dir)
    return updates if done is not None and done >= updates else None


def recheck(checked: Checked) -> None:
    """The directory checks again, now that this process holds the lock (another run may have written
    there between the first checks and the lock)."""
    run_dir = checked.run_dir
    if checked.resume is not None:
        path, saved = checked.resume
        if not path.is_file():
            raise ConfigError(f"checkpoint {path} is gone; valid: resume from a checkpoint that exists")
        checkpoint.records_match(run_dir, path, saved)
    elif checked.session:
        check_own_session(run_dir, checked.own, resolved_config(checked.run.cfg))
        if finished_updates(run_dir) is not None:
            raise ConfigError(f"hydra.run.dir={run_dir} has just finished; valid: a new directory")
    else:
        check_run_dir(run_dir, checked.own)


def claim(checked: Checked) -> None:
    """Rank 0 takes the run directory's lock (creating the directory), then checks it again; on a
    refusal whatever the lock made is removed again. DiskFull when the disk has no room for a start."""
    check_room(checked.run_dir)
    lock = acquire(checked.run_dir, fresh=checked.resume is None and not checked.session)
    try:
        recheck(checked)
    except ConfigError:
        _held.remove(lock)
        lock.release(undo=True)
        raise
    checked.lock = lock


def finished_notice(checked: Checked) -> str:
    """The one line of a resumed run that has nothing left to do."""
    n = checked.finished
    return (
        f"hypertrain: {checked.run_dir} has finished (update {n} of {n}); nothing was run or written "
        "(a longer phase.updates with the same explicit inner.decay_steps extends it: docs/resume.md)"
    )


def resolved_config(cfg: TrainConfig) -> dict:
    """The run's config as plain containers, derived fields filled: config.yaml, W&B, checkpoints."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def _task_part(config: DictConfig) -> DictConfig:
    """The run's config without Hydra's node, as Hydra hands it to the task function (still typed)."""
    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


def _key(task_cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(task_cfg, resolve=True)


def write_nothing(config: DictConfig) -> None:
    """For a rank other than 0 (torchrun's or srun's): Hydra makes no directory, writes no `.hydra/`
    and no log file (rank 0 decides and writes the run; its directory name holds a time, so each
    rank's would differ)."""
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.run.dir = os.getcwd()  # exists already: Hydra's mkdir does nothing
        config.hydra.output_subdir = None
        logging_cfg = config.hydra.job_logging
        if "handlers" in logging_cfg and "file" in logging_cfg.handlers:
            del logging_cfg.handlers["file"]
            logging_cfg.root.handlers = [h for h in logging_cfg.root.handlers if h != "file"]


class Preflight(Callback):
    """Hydra callback: check a single run before Hydra creates its directory."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        task = _task_part(config)
        run_dir = Path(OmegaConf.select(config, "hydra.run.dir")).absolute()
        launched = launched_rank()
        if launched is not None and launched.rank != 0:
            write_nothing(config)
            run_dir = None  # rank 0 alone checks and writes the run directory
        try:
            checked = prepare_checked(task, dict(config.hydra.runtime.choices), run_dir, hydra_files(config))
            if checked.finished is not None:  # before Hydra writes anything: a no-op, exit 0
                print(finished_notice(checked), file=sys.stderr)
                sys.exit(0)
            if checked.run_dir is not None:
                claim(checked)  # before Hydra creates the directory or writes .hydra/ there
        except (ConfigError, PlanError) as e:
            fail(str(e))
        except DiskFull as e:
            fail(str(e), code=e.exit_code)
        if checked.run_dir is not None and checked.run_dir != run_dir:  # resume=PATH: that run's directory
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.run.dir = str(checked.run_dir)
        _prepared[_key(task)] = checked


def take_prepared(task_cfg: DictConfig) -> Checked | None:
    """What `Preflight` decided for this config, or None (a multirun job, or no callback)."""
    return _prepared.pop(_key(task_cfg), None)


def check_job(
    task_cfg: DictConfig,
    choices: dict,
    job_dir: Path | None,
    hydra: frozenset[str] = frozenset(),
    sweep_dir: Path | None = None,
) -> Checked:
    """A multirun job's checks, inside the task function (Hydra has written `hydra`, its own files,
    into the job's directory for this launch); a rejected job leaves no directory, and when no job
    of the sweep has left one, no sweep directory (`sweep_dir`) either."""
    try:
        checked = prepare_checked(task_cfg, choices, job_dir, hydra, hydra_written=True)
        if checked.run_dir is not None and checked.finished is None:
            claim(checked)
        return checked
    except (ConfigError, PlanError, DiskFull) as e:
        if job_dir is not None:  # None: a rank other than 0, which made nothing
            remove_rejected_job_dir(job_dir)
            if sweep_dir is not None:
                remove_rejected_sweep_dir(sweep_dir)
        fail(str(e), code=getattr(e, "exit_code", 2))


SWEEP_FILE = "multirun.yaml"  # what Hydra writes into a sweep directory before its first job


def remove_rejected_sweep_dir(sweep_dir: Path) -> None:
    """A sweep whose jobs so far were all rejected: remove its directory when it holds only Hydra's
    multirun.yaml, and the empty folders Hydra made above it (below the one noted before, if any)."""
    sweep_dir = sweep_dir.absolute()
    if not sweep_dir.is_dir() or {p.name for p in sweep_dir.iterdir()} != {SWEEP_FILE}:
        return
    (sweep_dir / SWEEP_FILE).unlink(missing_ok=True)
    noted = os.environ.get(SWEEP_ROOT_ENV)
    root = Path(noted) if noted else None
    folder = sweep_dir
    while root is None or root in folder.parents:  # below the folder that existed before, if noted
        try:
            folder.rmdir()
        except OSError:  # not empty: not only Hydra's
            return
        if root is None:
            return
        folder = folder.parent


def remove_rejected_job_dir(job_dir: Path) -> None:
    """Remove what Hydra wrote for a job that never started (`.hydra/`, its log), if that is all."""
    if not job_dir.is_dir() or (job_dir / METRICS_FILE).exists():
        return
    hydra_files = {".hydra", "train.log"}
    if {p.name for p in job_dir.iterdir()} <= hydra_files:
        import logging

        logging.shutdown()  # close the job's log file before removing it
        shutil.rmtree(job_dir, ignore_errors=True)
