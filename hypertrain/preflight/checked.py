"""Checks a run before anything is written, then hands it to the entry: `Preflight` (a Hydra callback,
conf/train.yaml) builds the typed config, validates it, prepares the run and checks its directory before
Hydra creates anything; `check_job` does the same for each multirun job; `take_prepared` hands the
prepared run to the task function, so the data is built once (docs/errors.md, docs/resume.md).
"""

from __future__ import annotations

import os
import sys
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hypertrain.choices import ProcessLayout
from hypertrain.config import ResumeMode, ResumeRequest, TrainConfig, UserError
from hypertrain.distributed.layouts import Layout, launched_rank
from hypertrain.failures import DiskFull, fault_points
from hypertrain.plan.sampling import PlanError
from hypertrain.preflight import memory
from hypertrain.preflight.checks import check_backend, check_device, validate
from hypertrain.preflight.composition import (
    check_experiment,
    check_fields,
    check_labels,
    drop_unread,
    remove_rejected_job_dir,
    remove_rejected_sweep_dir,
    task_part,
)
from hypertrain.preflight.refusal import fail
from hypertrain.rundir import checkpoint
from hypertrain.rundir.directory import (
    RunLock,
    acquire,
    check_not_in_use,
    check_own_session,
    check_room,
    check_run_dir,
    finished_of,
    finished_updates,
    foreign,
    hydra_files,
    release,
    resume_target,
)
from hypertrain.rundir.records import METRICS_FILE
from hypertrain.rundir.wandb_settings import check_wandb

# The run `Preflight` prepared, for the task function of the same call (hypertrain.train.cli runs each
# call in a context of its own): (the resolved task config as YAML, the Checked built for it).
_prepared: ContextVar[tuple[str, Checked] | None] = ContextVar("hypertrain_prepared", default=None)


def with_layout(cfg: TrainConfig, layout: Layout) -> TrainConfig:
    """processes=dist's process count and layout, as decided (`validate`), written into the config."""
    return replace(
        cfg, processes=replace(cfg.processes, nproc=layout.processes, layout=ProcessLayout(layout.kind))
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
    notes: tuple[str, ...] = ()  # for train.log alone: retired spellings dropped (`drop_unread`)


def prepare_checked(
    task_cfg: DictConfig,
    choices: dict,
    run_dir: Path | None,
    hydra: frozenset[str] = frozenset(),
    hydra_written: bool = False,
) -> Checked:
    """The typed, validated, prepared run; UserError/PlanError (one line) on any user mistake.
    `run_dir` None: this process writes nothing (a torchrun rank other than 0). `hydra`: the names of
    Hydra's own files in a run directory; `hydra_written`: Hydra has written them for this very launch
    (a multirun job), so they are this run's. A directory is written only when it does not exist, is
    empty, holds only this run's own files, or is resumed (its checkpoint and records belonging together)."""
    check_experiment(choices)
    fault_points.check()
    check_fields(task_cfg, TrainConfig)
    unread, notes = drop_unread(task_cfg)
    cfg: TrainConfig = OmegaConf.to_object(unread)
    check_labels(cfg, choices)
    decided = validate(cfg)  # the layout, device, backend and reduction, decided once: read after
    asked = ResumeRequest.of(cfg.resume)  # the one reading of `resume`
    if run_dir is not None:  # the process that writes the run (rank 0) starts its W&B run
        check_wandb(cfg.logger)
    if cfg.processes.name == "dist":
        cfg = with_layout(cfg, decided.layout)
        launched = launched_rank()  # the ranks on this machine: the launcher's, else the self-launch's
        check_backend(cfg, decided, cfg.processes.nproc if launched is None else launched.local_processes)
    elif (launched := launched_rank()) is not None:
        raise UserError(
            f"processes={cfg.processes.name} runs in one process, but {launched.launcher} started this "
            f"one as one of {launched.processes} ranks; valid: processes=dist (the ranks are its processes), "
            "or a single process"
        )
    check_device(decided.device)  # a device this process lacks, before the memory check asks it
    memory.check(cfg, decided=decided)  # before anything is built: the sizes asked for fit this machine
    found, session = None, False
    auto = asked.mode is ResumeMode.AUTO
    # Hydra's files are this run's when Hydra wrote them for this launch; under resume=auto also an
    # earlier launch's of the same job (a requeued job: Hydra writes them again).
    own = hydra if hydra_written or auto else frozenset()
    if run_dir is not None:
        run_dir, found = resume_target(asked, run_dir)
        check_not_in_use(run_dir)
        session = found is None and auto and bool(foreign(run_dir, own))
        if found is None and not session:
            check_run_dir(run_dir, own)
    from hypertrain.preflight.prepare import prepare  # torch and the data, once every other check passed

    run = prepare(cfg, decided)
    memory.check(run.cfg, run.dataset.max_length, decided)  # again with the data's longest example (speech's)
    checked = Checked(run, run_dir, found, own=own, session=session, notes=notes)
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


def recheck(checked: Checked) -> None:
    """The directory checks again, now that this process holds the lock (another run may have written
    there between the first checks and the lock)."""
    run_dir = checked.run_dir
    if checked.resume is not None:
        path, saved = checked.resume
        if not checkpoint.is_checkpoint(path):
            raise UserError(f"checkpoint {path} is gone; valid: resume from a checkpoint that exists")
        checkpoint.records_match(run_dir, path, saved)
    elif checked.session:
        check_own_session(run_dir, checked.own, resolved_config(checked.run.cfg))
        if finished_updates(run_dir) is not None:
            raise UserError(f"hydra.run.dir={run_dir} has just finished; valid: a new directory")
    else:
        check_run_dir(run_dir, checked.own)


def claim(checked: Checked) -> None:
    """Rank 0 takes the run directory's lock (creating the directory), then checks it again; on a
    refusal whatever the lock made is removed again. DiskFull when the disk has no room for a start."""
    check_room(checked.run_dir)
    lock = acquire(checked.run_dir, fresh=checked.resume is None and not checked.session)
    try:
        recheck(checked)
    except UserError:
        release(lock, undo=True)
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
    """The run's config as plain containers (a choice as its str), derived fields filled: config.yaml, W&B,
    checkpoints."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)


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
        task = task_part(config)
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
        except (UserError, PlanError) as e:
            fail(str(e))
        except DiskFull as e:
            fail(str(e), code=e.exit_code)
        if checked.run_dir is not None and checked.run_dir != run_dir:  # resume=PATH: that run's directory
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.run.dir = str(checked.run_dir)
        _prepared.set((_key(task), checked))


def take_prepared(task_cfg: DictConfig) -> Checked | None:
    """What `Preflight` decided for this config, or None (a multirun job, or no callback)."""
    handed = _prepared.get()
    if handed is None or handed[0] != _key(task_cfg):
        return None
    _prepared.set(None)
    return handed[1]


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
    except (UserError, PlanError, DiskFull) as e:
        if job_dir is not None:  # None: a rank other than 0, which made nothing
            remove_rejected_job_dir(job_dir)
            if sweep_dir is not None:
                remove_rejected_sweep_dir(sweep_dir)
        fail(str(e), code=getattr(e, "exit_code", 2))
