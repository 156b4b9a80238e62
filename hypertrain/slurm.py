"""Sweeps on SLURM: Hydra's submitit launcher, with what hypertrain's runs need (docs/slurm.md).

The presets (`conf/hydra/launcher/slurm.yaml`, `slurm_dist.yaml`) select
`hydra_plugins.hypertrain_slurm.slurm_launcher.SlurmLauncher` (Hydra loads launchers only from the
hydra_plugins namespace), the plugin's submitit launcher changed in three places, coded here:
- every job runs with `resume=auto` unless the command line gives `resume`, so a job that SLURM
  requeues after a preemption or a time limit goes on from its checkpoint in its own directory (the
  preset cannot set the run's key itself: Hydra merges the run's schema after the launcher's config);
- the sweep directory is pinned, resolved and absolute, in the overrides every job (and every
  requeued job, which composes its config again) is built from, so it never moves;
- in a job of several tasks (srun's tasks are the ranks of one engine=dist run) only task 0 lets
  Hydra create the job's directory, `.hydra/` and log file, as under torchrun.
While the submitting process waits for the jobs, submitit's polls of `sacct` go through `SacctWatcher`:
a failing `sacct` (a cluster without accounting fails every call) is reported once per sweep and
error, not three times per poll.
`SlurmPreflight` (a Hydra callback the presets register) checks every job of the sweep before
anything is created or submitted: the run's config, and for several tasks per job that the run is
engine=dist and the tasks fit a layout. A mistake prints one line and exits 2.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hypertrain import preflight
from hypertrain.config import ConfigError, TrainConfig, validate
from hypertrain.layouts import LayoutError, choose_layout, launched_rank
from hypertrain.plan import PlanError

RESUME = "auto"  # what a job's `resume` is unless the command line says: a requeued job goes on

log = logging.getLogger(__name__)


def _override_value(text: str) -> str:
    """`text` as one quoted value of a Hydra override (a path may hold spaces, commas, '=')."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def prepare_sweep(config: DictConfig, job_overrides) -> list[list[str]]:
    """In the submitting process, before submitit pickles the launcher: pin the sweep directory in
    the overrides every job is composed from, and give each job resume=auto unless it has a resume."""
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    with read_write(config.hydra.overrides):
        config.hydra.overrides.hydra.append(f"hydra.sweep.dir={_override_value(str(sweep_dir))}")
    return [
        list(o) if any(_key(x) == "resume" for x in o) else [*o, f"resume={RESUME}"] for o in job_overrides
    ]


def sacct_watcher_class():
    """`SacctWatcher`, built on submitit's `SlurmInfoWatcher` (imported only when a SLURM sweep runs)."""
    from submitit.core import logger as submitit_logger
    from submitit.slurm.slurm import SlurmInfoWatcher

    class SacctWatcher(SlurmInfoWatcher):
        """submitit's watcher of job states, but for what a failing `sacct` prints: submitit lets
        sacct's stderr through and logs its own warning on every poll, which its logger prints twice
        (its stdout and stderr handlers) and Hydra's root logger a third time. Here sacct's stderr is
        captured and each distinct failure (exit status and message) is logged once, as one warning
        through this module's logger; a repeat goes to submitit's debug log. A new error (another
        message, another status, sacct missing) is a new warning."""

        def __init__(self, delay_s: int = 60) -> None:
            super().__init__(delay_s=delay_s)
            self.reported: set[str] = set()

        def _report(self, problem: str, meaning: str = "") -> None:
            if problem in self.reported:
                submitit_logger.get_logger().debug(f"Call #{self.num_calls} - {problem} (again)")
                return
            self.reported.add(problem)
            log.warning(f"{problem}{meaning}; said once per sweep, submitit's polls go on")

        def update(self) -> None:
            command = self._make_command()
            if command is None:
                return
            self._num_calls += 1
            submitit_logger.get_logger().debug(f"Call #{self.num_calls} - Command {' '.join(command)}")
            blind = (
                ": submitit reads the jobs' states from their result files only, so a job that ends "
                "without one is not seen to end (squeue and scontrol show job tell)"
            )
            try:
                done = subprocess.run(command, capture_output=True, check=False)
            except OSError as e:
                self._report(f"sacct could not run ({e})", blind)
            else:
                said = done.stderr.decode(errors="replace").strip()
                if done.returncode != 0:
                    self._report(f"sacct failed (exit {done.returncode}: {said or 'no message'})", blind)
                else:
                    if said:  # a warning beside a result
                        self._report(f"sacct: {said}")
                    self._output = done.stdout
                    self._info_dict.update(self.read_info(self._output))
            self._last_status_check = time.time()
            for job_id in self._registered - self._finished:  # as submitit's: note the finished jobs
                if self.is_done(job_id, mode="cache"):
                    self._finished.add(job_id)

    return SacctWatcher


@contextlib.contextmanager
def sacct_reported_once() -> Iterator[None]:
    """While a sweep is submitted and waited for: submitit's SLURM jobs poll `SacctWatcher` (a
    fresh one per sweep), not submitit's own watcher, which is put back afterwards."""
    from submitit.slurm.slurm import SlurmJob

    before = SlurmJob.watcher
    SlurmJob.watcher = sacct_watcher_class()(delay_s=before._delay_s)
    try:
        yield
    finally:
        SlurmJob.watcher = before


def writes_the_job() -> bool:
    """Whether this SLURM task lets Hydra write the job: the only task, or task 0 of several."""
    me = launched_rank()
    return me is None or me.rank == 0


def run_silent_task(launcher, sweep_overrides, job_dir_key, job_num, singleton_state):
    """A task other than 0 of a multi-task job: the job's config composed as Hydra's submitit launcher
    composes it, then `preflight.write_nothing` (no directory, no `.hydra/`, no log file), then the task
    function, whose process is one rank of the run (rank 0 writes the run)."""
    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import run_job, setup_globals

    Singleton.set_state(singleton_state)
    setup_globals()
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(sweep_overrides))
    with open_dict(config.hydra.job):
        config.hydra.job.id = submitit.JobEnvironment().job_id
        config.hydra.job.num = job_num
    preflight.write_nothing(config)
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.sweep.dir, config.hydra.sweep.subdir = os.getcwd(), "."  # exists: nothing made
    return run_job(
        hydra_context=launcher.hydra_context,
        task_function=launcher.task_function,
        config=config,
        job_dir_key=job_dir_key,
        job_subdir_key="hydra.sweep.subdir",
    )


def job_tasks(launcher: DictConfig) -> int:
    """The SLURM tasks of one job: nodes x tasks_per_node."""
    return int(launcher.nodes) * int(launcher.tasks_per_node)


def check_job(cfg: TrainConfig, tasks: int) -> None:
    """The run's config is valid, and a job of `tasks` > 1 SLURM tasks is one engine=dist run whose
    processes are the tasks (engine.nproc 0 or the tasks; the tasks fit a layout)."""
    e = cfg.engine
    if tasks > 1 and e.name != "dist":
        raise ConfigError(
            f"each job of this launcher is {tasks} SLURM tasks, the ranks of one engine=dist run, but "
            f"engine={e.name}; valid: engine=dist, or hydra/launcher=slurm (one process per job)"
        )
    if tasks > 1 and e.nproc not in (0, tasks):
        raise ConfigError(
            f"engine.nproc={e.nproc} but each job is {tasks} SLURM tasks (hydra.launcher.nodes x "
            f"tasks_per_node); valid: engine.nproc=0 (the tasks) or {tasks}"
        )
    validate(cfg)
    if tasks == 1:
        return
    try:
        choose_layout(tasks, cfg.world.size, cfg.replicas, e.layout)
    except LayoutError as error:
        raise ConfigError(
            f"{str(error).split('; valid:')[0]} (the job's {tasks} SLURM tasks); valid: "
            f"world.size={tasks} (benchmark layout), or replicas a multiple of {tasks} (stacked), "
            "or hydra.launcher.tasks_per_node/nodes to match"
        ) from None


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The task overrides of every job the basic sweeper will launch (its params, then the command
    line's, expanded as it expands them); the command line's alone for another sweeper."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    arguments = list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return [arguments]
    params = config.hydra.sweeper.get("params") or {}
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + arguments)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


class SlurmPreflight(Callback):
    """Checks every job of a SLURM sweep before Hydra creates the sweep directory or submits a job."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra import compose

        tasks = job_tasks(config.hydra.launcher)
        hydra_overrides = list(OmegaConf.to_container(config.hydra.overrides.hydra, resolve=False))
        for number, overrides in enumerate(sweep_jobs(config)):
            where = f" (sweep job {number}: {' '.join(overrides)})" if overrides else ""
            try:
                task = compose(
                    config.hydra.job.config_name, [*hydra_overrides, *overrides], return_hydra_config=True
                )
            except Exception as e:  # Hydra's composition errors share no base class; its wording, one line
                preflight.fail(preflight.composition_error(e) + where)
            choices = dict(task.hydra.runtime.choices)
            with read_write(task), open_dict(task):
                del task["hydra"]  # the run's config, as the task function gets it
            try:
                preflight.check_experiment(choices)
                preflight.check_fields(task, TrainConfig)
                cfg: TrainConfig = OmegaConf.to_object(task)
                preflight.check_labels(cfg, choices)
                check_job(cfg, tasks)
            except (ConfigError, PlanError) as e:
                preflight.fail(f"{e}{where}")
