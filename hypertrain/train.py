"""The single entry: `python -m hypertrain.train [group=option ...] [field=value ...]` (Hydra 1.3),
which is `cli(argv) -> exit code`, a function that can be called many times in one process (tests,
a notebook: `run_entry` also returns the run directory and the error line).

Composes `conf/train.yaml` over the typed `TrainConfig`; `hypertrain.preflight` validates it and
prepares the run before Hydra creates anything (a user mistake prints one line
`hypertrain: error: ...` and exits with code 2, nothing written, torch not imported when the config
alone shows it). A run that fails (a non-finite loss) prints one line and exits 1, its metrics.jsonl
and W&B run closed. Then config -> plan -> data -> engine -> log: writes `config.yaml`, `plan.json`
and `metrics.jsonl` in Hydra's run directory and mirrors the metrics to Weights & Biases (offline by
default). Multirun (`-m`) sweeps run each job as its own W&B run in one group; the task function
`main` returns the job's held-out loss to sweepers (NaN for a trial of an optimizing sweeper,
`hydra/sweeper=optuna`, that diverged: the study goes on; docs/sweeps.md). A run that ends before
its first record (a stop signal, a full disk, W&B that cannot start) prints one line, exits with its code
(hypertrain/failures/__init__.py) and leaves nothing of a new run behind. Under
`torchrun --max-restarts N` a restarted worker resumes the run in its `hydra.run.dir`, which must be
given (`torchrun_restarts`; docs/resume.md, "Restarts").
"""

from __future__ import annotations

if __name__ == "__main__":  # first of all: a Ctrl-C during the seconds of imports below is one line too
    from hypertrain.failures.signals import guard_start

    guard_start()

import contextvars
import hashlib
import io
import json
import logging
import math
import os
import re
import sys
from contextlib import redirect_stderr
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hypertrain.config import MAY_CHANGE, ResumeMode, TrainConfig
from hypertrain.distributed.layouts import launched_rank
from hypertrain.failures import DiskFull, Diverged, NonFiniteError, RankFailed, RunFailure, restarts
from hypertrain.failures.signals import Preempted, StopSignals, guard_start
from hypertrain.preflight import checked as preflight
from hypertrain.preflight import composition, refusal
from hypertrain.preflight.schema import register_configs
from hypertrain.records import formats
from hypertrain.run import invocation
from hypertrain.rundir import directory
from hypertrain.schedule_table import schedule_entry

register_configs()
logger = logging.getLogger("hypertrain")


def config_hash(resolved: dict) -> str:
    """A short stable hash of the resolved config: two runs of one config share it (where and how
    they log and checkpoint, whether they resume, and the divergence guard, which changes no number,
    are left out: a resumed run keeps its name)."""
    kept = {k: v for k, v in resolved.items() if k not in MAY_CHANGE}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:8]


def run_identity(cfg: TrainConfig, resolved: dict) -> dict:
    """W&B name, group, job type and tags for this run."""
    hydra_cfg = HydraConfig.get()
    group = cfg.logger.group or cfg.experiment
    if not cfg.logger.group and hydra_cfg.mode == RunMode.MULTIRUN:
        group = f"{cfg.experiment}-{Path(hydra_cfg.sweep.dir).name}"
    tag = f"w{cfg.world.size}-r{cfg.replicas}-h{cfg.inner.H}"
    streaming = []
    if cfg.outer.fragments > 1 or cfg.outer.delay:  # Streaming DiLoCo: its fragments and delay
        tag += f"-p{cfg.outer.fragments}-d{cfg.outer.delay}"
        streaming = [f"P={cfg.outer.fragments}", f"delay={cfg.outer.delay}"]
    if cfg.outer.overlap != "none":  # an outer step overlapping a whole round (docs/overlap.md)
        tag += f"-{cfg.outer.overlap}"
        streaming.append(f"overlap={cfg.outer.overlap}")
    return {
        "name": f"{cfg.experiment}-{cfg.phase.name}-{tag}-{config_hash(resolved)}",
        "group": group,
        "job_type": cfg.phase.name,
        "tags": [
            f"world={cfg.world.size}",
            f"R={cfg.replicas}",
            f"H={cfg.inner.H}",
            f"engine={cfg.engine.name}",
            f"processes={cfg.processes.name}",
            f"inner={cfg.inner.name}",
            *streaming,
        ],
    }


def quote_numeric_choices(argv: list[str], groups: tuple[str, ...] = ("world",)) -> list[str]:
    """`world=8,16` -> `world='8','16'`: Hydra reads a bare 8 as an int, but group options are names."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in groups and re.fullmatch(r"\d+(,\d+)*", value):
            arg = key + "=" + ",".join(f"'{v}'" for v in value.split(","))
        out.append(arg)
    return out


def multirun_first(argv: list[str]) -> list[str]:
    """`experiment=quick -m inner.H=1,2` -> `-m experiment=quick inner.H=1,2`: Hydra's parser takes
    -m/--multirun before or after the overrides, not between them (argparse's usage dump)."""
    flags = [a for a in argv[1:] if a in ("-m", "--multirun")]
    return [argv[0], *flags, *(a for a in argv[1:] if a not in flags)]


def log_only(lines: tuple[str, ...]) -> None:
    """Each of `lines` as a note in the run's log file (the root logger's file handlers: train.log), not
    on the terminal: a retired spelling that still works is no news to the person who typed it."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for line in lines:
        record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, "note: %s", (line,), None)
        for handler in files:
            handler.handle(record)


# Under torchrun with restarts: the run directory every restart resumes in (one call's own: `cli`).
_restart_dir: ContextVar[Path | None] = ContextVar("hypertrain_restart_dir", default=None)


def torchrun_restarts(argv: list[str]) -> list[str]:
    """Under `torchrun --max-restarts N` (N > 0) every restart of the workers resumes the run where
    the first start wrote it: that directory must be named, `hydra.run.dir=DIR` (Hydra's default is
    named by the time of each start, so a restart would start another run), and `resume` may not name
    a checkpoint of its own; on a restart (`TORCHELASTIC_RESTART_COUNT` > 0) `resume=auto` replaces
    the command's resume. `processes.max_restarts` is the self-launch's: under torchrun 0 or torchrun's
    own number. A mistake is one line from rank 0 on the first start, exit 2 (the same mistake on a
    restart the agent still makes exits 2 without repeating it). Other argv is returned as it is."""
    launched = launched_rank()
    allowed = restarts.allowed()
    if launched is None or launched.launcher != "torchrun" or not allowed:
        return argv
    if any(a in ("-m", "--multirun") for a in argv[1:]):  # refused as a multirun under torchrun
        return argv
    given = {}
    for arg in argv[1:]:
        key, sep, value = arg.partition("=")
        if sep:
            given[key.lstrip("+")] = value.strip()
    mistake = None
    run_dir, resume = given.get("hydra.run.dir", ""), given.get("resume", "")
    mine = given.get("processes.max_restarts")
    if mine is not None and mine not in ("0", str(allowed)):
        mistake = (
            f"processes.max_restarts={mine} but torchrun's --max-restarts is {allowed}; valid: "
            f"processes.max_restarts=0 (torchrun's --max-restarts decides) or {allowed}"
        )
    elif not run_dir or "${now:" in run_dir:
        mistake = (
            f"torchrun --max-restarts {allowed} needs hydra.run.dir=<a directory>: every restart resumes the "
            "run where the first start wrote it, and Hydra's default directory is named by the time of "
            "each start; valid: hydra.run.dir=DIR"
        )
    elif ResumeMode.of(resume) is ResumeMode.PATH:
        mistake = (
            f"resume={resume!r} names a checkpoint, but under torchrun --max-restarts {allowed} every "
            "restart resumes from the newest checkpoint of hydra.run.dir; valid: hydra.run.dir=<its run "
            "directory> resume=true"
        )
    if mistake is not None:
        if restarts.count():
            sys.exit(2)
        refusal.fail(mistake)
    _restart_dir.set(Path(run_dir).absolute())
    if not restarts.count():
        return argv
    kept = [a for a in argv[1:] if a.partition("=")[0].lstrip("+~") != "resume"]
    return [argv[0], *kept, "resume=auto"]


def stopped(stop: Preempted, signals: StopSignals, run_dir: Path) -> None:
    """A stop signal ended the run at an update boundary, checkpointed and flushed: say so in one
    line, hand over to the launcher's handler (submitit requeues the job), else exit 143."""
    print(f"hypertrain: {stop} ({run_dir})", file=sys.stderr)
    sys.stderr.flush()
    signals.hand_over()
    sys.exit(stop.exit_code)


@hydra.main(version_base="1.3", config_path=str(composition.CONF), config_name="train")
def main(dict_cfg: DictConfig) -> float:
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    launched = launched_rank()  # one rank of several that torchrun or srun started: rank 0 writes
    writer = launched is None or launched.rank == 0
    checked = preflight.take_prepared(dict_cfg)
    if checked is None:  # a multirun job: Hydra has made its directory; a rejected job removes it again
        hydra_files = frozenset({hydra_cfg.output_subdir or ".hydra", f"{hydra_cfg.job.name}.log"})
        job_dir = run_dir if writer else None
        sweep_dir = Path(hydra_cfg.sweep.dir) if hydra_cfg.mode == RunMode.MULTIRUN else None
        choices = dict(hydra_cfg.runtime.choices)
        checked = preflight.check_job(dict_cfg, choices, job_dir, hydra_files, sweep_dir)
    if checked.finished is not None:  # a multirun job resumed after its run finished: nothing to do
        print(preflight.finished_notice(checked), file=sys.stderr)
        return finished_loss(run_dir)
    if writer:
        log_only(composition.retired_notes.get() + checked.notes)
    try:  # rank 0 holds the run directory's lock (preflight.claim) until the run ends
        return run_checked(checked, run_dir, launched, writer)
    except BaseException:  # before its first record, a new run leaves nothing (after: its records)
        directory.abandon_unstarted()
        raise
    finally:
        directory.release_all()


def _finished_here(run) -> bool:
    """A rank other than 0 of a restart under torchrun: whether the run in the restart's directory
    has finished (rank 0 then says so and exits 0, as resume=auto does; a node that does not see the
    directory cannot tell, and waits for rank 0 until processes.timeout_s)."""
    restart_dir = _restart_dir.get()
    return restart_dir is not None and directory.finished_of(restart_dir, run.updates) is not None


def finished_loss(run_dir: Path) -> float:
    """The final held-out loss a finished run's records hold (NaN when they hold none)."""
    from hypertrain.records.files import read_records
    from hypertrain.records.rows import SummaryRow

    rows = read_records(run_dir)
    losses = [
        r.values["eval/final_loss"]
        for r in rows
        if isinstance(r, SummaryRow) and "eval/final_loss" in r.values
    ]
    return losses[-1] if losses else math.nan


def write_whole(path: Path, text: str) -> None:
    """`path` holds `text` whole or keeps what it held: a kill mid-write never leaves a torn file
    (a torn config.yaml would make resume=auto refuse the run's own directory)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_start(checked: preflight.Checked, run_dir: Path, run, identity: dict) -> tuple:
    """Rank 0, before the session: rewind a resumed run's records, write config.yaml and plan.json,
    say what runs. Where the session goes on from (None: a new run), and, when torchrun's agent
    restarted this session, the restart (it goes on from the newest checkpoint, or from the start
    under the same run id: `session.restart_here`): (Resume | None, Restart | None)."""
    from hypertrain.run.session import Resume, restart_here
    from hypertrain.rundir import checkpoint

    resume = restart = None
    if restarts.count():  # torchrun restarted every rank after one failed (resume=auto, torchrun_restarts)
        resume, restart = restart_here(run_dir, checked.resume, schedule_entry(run.cfg.outer.schedule).server)
        logger.info(
            "restart %d of %d: going on from %s", restart.count, restart.allowed, restart.path or "the start"
        )
    elif checked.restart:  # resume=auto, stopped before its first checkpoint: start over here
        moved = checkpoint.rewind_metrics(run_dir, 0)
        logger.info("resume=auto: no checkpoint yet, starting over (%d bytes superseded)", moved)
    if checked.resume is not None and restart is None:  # only now, every check passed: rewind the records
        path, saved = checked.resume
        checkpoint.drop_later(run_dir, saved["state"]["next_update"])
        moved = checkpoint.rewind_metrics(run_dir, saved["metrics_bytes"])
        resume = Resume(str(path), saved, moved)
        logger.info("resuming from %s at update %d", path, saved["state"]["next_update"] + 1)
    config_yaml = formats.config_yaml(OmegaConf.to_yaml(OmegaConf.structured(run.cfg)))
    write_whole(run_dir / "config.yaml", config_yaml)
    write_whole(run_dir / "plan.json", json.dumps(run.plan_facts, indent=2) + "\n")
    logger.info("run %s: %s", identity["name"], run.dataset.description)
    from hypertrain.preflight.prepare import source_shares  # imported by the preflight already

    for line in source_shares(run.plan_facts):  # a prepared corpus of several sources
        logger.info("%s", line)
    if run.cfg.processes.name == "dist":
        processes = run.cfg.processes
        logger.info(
            "processes=dist: %d processes, %s layout, engine=%s",
            processes.nproc,
            processes.layout,
            "sharded replicas (FSDP2)" if processes.shard else run.cfg.engine.name,
        )
    if run.cfg.engine.compile:
        logger.info("engine.compile=true: the first updates and held-out eval include compilation")
    return resume, restart


def run_checked(checked: preflight.Checked, run_dir: Path, launched, writer: bool) -> float:
    """The run the preflight checked (and whose directory rank 0 has locked): records, engine, log."""
    from hypertrain.run.session import disk_full_as_failure, train_session

    run = checked.run
    resolved = preflight.resolved_config(run.cfg)
    identity = run_identity(run.cfg, resolved)
    resume = restart = None
    if writer:
        try:
            with disk_full_as_failure():
                resume, restart = write_start(checked, run_dir, run, identity)
        except DiskFull as e:
            refusal.fail(f"run failed: {e} ({run_dir})", code=e.exit_code)
    if run.cfg.processes.name == "dist":
        from hypertrain.launchers import local as dist

        job = dist.WorkerJob(
            run.cfg,
            run.decided,
            str(run_dir) if writer else None,
            resolved,
            identity,
            None if resume is None else resume.path,
            None if resume is None else resume.superseded,
            restart=restart,
        )
        if not writer and restarts.count() and _finished_here(run):
            return math.nan  # rank 0 found the run finished (a worker died in its teardown) and left
        if launched is not None:  # this process is one rank; a failure ends it inside run_worker
            summary = dist.run_worker(job, run)
        else:
            with StopSignals() as signals:  # torch's agent replaces them while it runs the ranks
                try:
                    summary = dist.launch(job)
                except Preempted as e:
                    stopped(e, signals, run_dir)
                except RankFailed as e:
                    if failed_trial(e):  # rank 0's end row: the guard stopped it
                        print(
                            f"hypertrain: trial failed: {e.writer_error} ({run_dir}); the study goes on",
                            file=sys.stderr,
                        )
                        return math.nan
                    refusal.fail(f"run failed: {e} ({run_dir})", code=e.exit_code)
        if not writer:
            return math.nan
    else:
        with engine_threads(run.cfg.engine.threads), StopSignals() as signals:
            try:
                summary = train_session(run, run_dir, resolved, identity, resume=resume)
            except Preempted as e:
                stopped(e, signals, run_dir)
            except RunFailure as e:
                # metrics.jsonl is flushed row by row and W&B finished with the code by RunLogger's exit.
                if failed_trial(e):
                    print(f"hypertrain: trial failed: {e} ({run_dir}); the study goes on", file=sys.stderr)
                    return math.nan
                refusal.fail(f"run failed: {e} ({run_dir})", code=e.exit_code)
    logger.info(
        "done: held-out loss %.4f, %.1f replica-steps/s, %s",
        summary["eval/final_loss"],
        summary["train/replica_steps_per_s"],
        run_dir,
    )
    return summary["eval/final_loss"]


def failed_trial(failure: RunFailure) -> bool:
    """Whether the run is a trial of a sweeper that optimizes its value (hydra/sweeper=optuna) and
    diverged (the guard, a non-finite number; under processes=dist the guard, as rank 0's end row says):
    the task function then returns NaN, which the study records as a failed trial and goes on; the run
    directory ends `failed` as any failed run's does.
    Anything else that fails a run (a full disk, a dead rank, W&B) still ends the sweep."""
    from hypertrain.launchers.sweepers import optimizing

    hydra_cfg = HydraConfig.get()
    diverged = isinstance(failure, Diverged | NonFiniteError)
    diverged = diverged or (isinstance(failure, RankFailed) and failure.diverged)  # processes=dist
    return diverged and hydra_cfg.mode == RunMode.MULTIRUN and optimizing(hydra_cfg.sweeper)


class engine_threads:
    """torch's thread count set to engine.threads (0: left as it is) for the run, and put back after."""

    def __init__(self, threads: int):
        self.threads, self.before = threads, None

    def __enter__(self):
        if self.threads:
            import torch

            self.before = torch.get_num_threads()
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc):
        if self.before is not None:
            import torch

            torch.set_num_threads(self.before)


def cli(argv: list[str] | None = None) -> int:
    """`python -m hypertrain.train ARGV` as a function: runs the entry on `argv` (the command line's
    when None) and returns its exit code (0, 2 for a user mistake, the codes of
    hypertrain/failures/__init__.py), with what it printed on this process's stdout and stderr.

    Hydra has no public entry that takes an argv: `cli` sets `sys.argv` for the Hydra app and puts it
    back. Every call runs in a fresh `contextvars` context (a call's prepared run, locks and stop
    signals are its own) and inside `invocation.restored()`, which puts back the environment, signal
    handlers, logging handlers, Hydra's singletons and torch's settings as they were."""
    args = list(sys.argv[1:] if argv is None else argv)
    with invocation.restored():
        return contextvars.copy_context().run(_entry, args)


def _entry(args: list[str]) -> int:
    try:
        # A W&B service token inherited from the parent process (wandb keeps it in WANDB_SERVICE) would
        # make this run a client of the parent's service: a run of a killed earlier session would still
        # hold its id there ("run ID is in use") when this session resumes it. Each entry starts its own.
        os.environ.pop("WANDB_SERVICE", None)
        argv = quote_numeric_choices(multirun_first(["hypertrain.train", *args]))
        given = tuple(k for a in argv if (k := a.partition("=")[0]) in formats.RETIRED)
        argv, notices, logged = formats.modern_spelling(argv)
        if notices and (launched_rank() is None or launched_rank().rank == 0):  # once, not per rank
            print("\n".join(notices), file=sys.stderr)
        composition.retired_notes.set(tuple(logged))  # train.log alone says them (`log_only`)
        composition.retired_given.set(given)  # a codec's field another codec ignored: dropped, noted
        argv = torchrun_restarts(argv)  # a restart by torchrun's agent resumes (resume=auto)
        guard_start(directory.abandon_unstarted)  # a stop before training: what a new run made goes again
        composition.check_composition(argv[1:])  # Hydra's own mistakes: one line, exit 2, nothing made
        sys.argv[:] = argv
        main()
    except SystemExit as e:
        return exit_code(e)
    return 0


def exit_code(e: SystemExit) -> int:
    """The exit status a process ending with `e` has: None is 0, an int itself, anything else 1 (the
    interpreter prints it)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


@dataclass
class EntryResult:
    """What one call of the entry left: its exit code, its run directory (None when it made none:
    a refusal, a sweep), the one `hypertrain: error:` line when it refused or failed, and its stderr."""

    code: int
    run_dir: Path | None
    error: str | None
    stderr: str


def run_entry(argv: list[str]) -> EntryResult:
    """`cli(argv)` for tests and notebooks, its stderr captured (and not printed): the exit code, the
    run directory (`hydra.run.dir=` of `argv`, when it holds a run's records), the error line."""
    err = io.StringIO()
    with redirect_stderr(err):
        code = cli(argv)
    text = err.getvalue()
    given = [a.partition("=")[2] for a in argv if a.partition("=")[0].lstrip("+") == "hydra.run.dir"]
    run_dir = Path(given[-1]).absolute() if given else None
    if run_dir is not None and not (run_dir / "metrics.jsonl").is_file():
        run_dir = None
    errors = [line for line in text.splitlines() if line.startswith("hypertrain: error: ")]
    return EntryResult(code, run_dir, errors[-1] if errors else None, text)


if __name__ == "__main__":
    # The importable module's cli, so that a sweeper's launcher (submitit, joblib) pickles the task
    # function `main` by reference, as hypertrain.train.main, not by value from this __main__
    # (importlib: the module is not its own import).
    import importlib

    sys.exit(importlib.import_module("hypertrain.train").cli())
