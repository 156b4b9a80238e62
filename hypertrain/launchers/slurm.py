"""Sweeps on SLURM: Hydra's submitit launcher, with what hypertrain's runs need (docs/slurm.md).

The presets (`conf/hydra/launcher/slurm.yaml`, `slurm_dist.yaml`) select
`hydra_plugins.hypertrain_slurm.slurm_launcher.SlurmLauncher` (Hydra loads launchers only from the
hydra_plugins namespace), the plugin's submitit launcher changed in three places, coded here:
- every job runs with `resume=auto` unless the command line gives `resume`, so a job that SLURM
  requeues after a preemption or a time limit goes on from its checkpoint in its own directory (the
  preset cannot set the run's key itself: Hydra merges the run's schema after the launcher's config);
- the sweep directory is pinned, resolved and absolute, in the overrides every job (and every
  requeued job, which composes its config again) is built from, so it never moves;
- in a job of several tasks (srun's tasks are the ranks of one processes=dist run) only task 0 lets
  Hydra create the job's directory, `.hydra/` and log file, as under torchrun.
While the submitting process waits for the jobs, submitit's polls of `sacct` go through `SacctWatcher`:
a failing `sacct` (a cluster without accounting fails every call) is reported once per sweep and
error, not three times per poll.
`SlurmPreflight` (a Hydra callback the presets register) checks every job of the sweep before
anything is created or submitted: the run's config, for several tasks per job that the run is
processes=dist and the tasks fit a layout, and that `sbatch` is installed and a SLURM controller answers
`scontrol ping`. A mistake prints one line and exits 2. An `sbatch` that refuses the submission all
the same (`refused_submission`) is one line too, exit 2, with what the launcher made removed again.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hypertrain.config import TrainConfig, UserError
from hypertrain.distributed.decided import decide
from hypertrain.distributed.layouts import LayoutError, launched_rank
from hypertrain.plan.sampling import PlanError
from hypertrain.preflight import checked as preflight
from hypertrain.preflight import composition, refusal
from hypertrain.preflight.checks import validate

RESUME = "auto"  # what a job's `resume` is unless the command line says: a requeued job goes on
# `scontrol ping` answers at once from a live controller and reports a dead one (refused, or no
# answer within SLURM's MessageTimeout, 10 s by default, per controller: a primary and a backup)
# itself; this bound only stops an scontrol that retries on its own, as it does for 60 s when
# SLURM_CONF names a file that does not exist.
PING_TIMEOUT_S = 30.0

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
    """The run's config is valid, and a job of `tasks` > 1 SLURM tasks is one processes=dist run whose
    processes are the tasks (processes.nproc 0 or the tasks; the tasks fit a layout, one that
    processes.shard=true is built for)."""
    e = cfg.processes
    if tasks > 1 and e.name != "dist":
        raise UserError(
            f"each job of this launcher is {tasks} SLURM tasks, the ranks of one processes=dist run, but "
            f"processes={e.name}; valid: processes=dist, or hydra/launcher=slurm (one process per job)"
        )
    if tasks > 1 and e.nproc not in (0, tasks):
        raise UserError(
            f"processes.nproc={e.nproc} but each job is {tasks} SLURM tasks (hydra.launcher.nodes x "
            f"tasks_per_node); valid: processes.nproc=0 (the tasks) or {tasks}"
        )
    validate(cfg)
    if tasks == 1:
        return
    try:
        decided = decide(cfg, processes=tasks)  # as each task's own preflight will, the job's tasks as P
    except LayoutError as error:
        raise UserError(
            f"{str(error).split('; valid:')[0]} (the job's {tasks} SLURM tasks); valid: "
            f"world.size={tasks} (benchmark layout), or replicas a multiple of {tasks} (stacked), "
            "or hydra.launcher.tasks_per_node/nodes to match"
        ) from None
    if e.shard and decided.layout.kind != "benchmark":  # validate took processes.nproc's layout
        raise UserError(
            f"processes.shard=true needs the benchmark layout (processes = world.size = {cfg.world.size}), "
            f"but the job's {tasks} SLURM tasks make the {decided.layout.kind} layout; valid: "
            f"hydra.launcher.nodes x tasks_per_node = {cfg.world.size}, or processes.shard=false"
        )


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


def slurm_said(text: str) -> str:
    """The one line of a SLURM command's output that says why it failed: its `fatal:` line, else its
    last `error:` line, else a line saying a controller is DOWN, else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pick in (
        lambda line: " fatal: " in f" {line}",
        lambda line: " error: " in f" {line}",
        lambda line: " is DOWN" in line,
    ):
        found = [line for line in lines if pick(line)]
        if found:
            return found[-1]
    return lines[-1] if lines else "no message"


def _what_to_do(launcher: str) -> str:
    return (
        "valid: submit where a SLURM controller answers `scontrol ping` (SLURM_CONF names the "
        f"cluster's slurm.conf), or drop hydra/launcher={launcher} to run the sweep on this machine"
    )


def controller_problem(launcher: str) -> str | None:
    """Why `sbatch` cannot submit from here, found without submitting: it is not installed, or no
    SLURM controller answers `scontrol ping`. None when one answers (scontrol missing: sbatch tells)."""
    if shutil.which("sbatch") is None:
        said = "sbatch is not installed on this machine"
    elif shutil.which("scontrol") is None:
        return None
    else:
        try:
            done = subprocess.run(
                ["scontrol", "ping"], capture_output=True, text=True, timeout=PING_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            said = f"scontrol ping: no answer within {PING_TIMEOUT_S:.0f} s"
        else:
            # A controller that answers says "is UP" (a backup's answer is enough to submit); the exit
            # status alone would also fail a cluster whose backup controller is down.
            if "is UP" in done.stdout:
                return None
            said = "scontrol ping: " + slurm_said(done.stdout + "\n" + done.stderr)
    return (
        f"hydra/launcher={launcher}: no SLURM controller can be reached from here ({said}); nothing was "
        f"submitted; {_what_to_do(launcher)}"
    )


class SubmissionRefused(RuntimeError):
    """`sbatch` refused the sweep's submission (its message): no job was submitted."""


def _made_since(folders: list[Path]) -> dict[Path, set[Path] | None]:
    """What each folder holds now (None: it does not exist), to remove later what came after."""
    return {f: set(f.rglob("*")) if f.is_dir() else None for f in folders}


def _remove_made(before: dict[Path, set[Path] | None]) -> None:
    """Remove what appeared in the folders since `before` (deepest first), and a folder made since."""
    for folder, held in before.items():
        if not folder.is_dir():
            continue
        new = set(folder.rglob("*")) - (held or set())
        if held is None:
            new.add(folder)
        for path in sorted(new, key=lambda p: len(p.parts), reverse=True):
            try:
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
            except OSError:  # not empty: something else wrote there; left alone
                pass


@contextlib.contextmanager
def refused_submission(config: DictConfig) -> Iterator[None]:
    """While the launcher submits the sweep: an `sbatch` that fails (a controller gone since the
    preflight's ping, a partition the cluster lacks) is one line and exit 2, not submitit's
    traceback after sbatch's own lines, and what the launcher made (the sweep directory, submitit's
    pickles and submission script) is removed again. The jobs of a sweep go in one array: one sbatch,
    so either every job was submitted or none."""
    from submitit.core.utils import FailedJobError
    from submitit.slurm.slurm import SlurmExecutor

    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    folder = Path(str(config.hydra.launcher.submitit_folder)).absolute()
    while "%" in str(folder):  # submitit's per-job folder (%j): the folder made before any job id
        folder = folder.parent
    before = _made_since([folder, sweep_dir])
    submit = SlurmExecutor._submit_command

    def submit_or_refuse(self, command: str):
        said = io.StringIO()  # submitit prints sbatch's stderr itself before raising it
        try:
            with contextlib.redirect_stderr(said):
                return submit(self, command)
        except FailedJobError as e:
            raise SubmissionRefused(slurm_said(f"{said.getvalue()}\n{e}")) from None

    SlurmExecutor._submit_command = submit_or_refuse
    try:
        yield
    except SubmissionRefused as e:
        _remove_made(before)
        composition.remove_rejected_sweep_dir(sweep_dir)
        launcher = config.hydra.runtime.choices.get("hydra/launcher", "slurm")
        refusal.fail(
            f"hydra/launcher={launcher}: sbatch refused the sweep ({e}); nothing was submitted; "
            f"{_what_to_do(launcher)}, or change what sbatch names (hydra.launcher.*)"
        )
    finally:
        SlurmExecutor._submit_command = submit


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
                refusal.fail(composition.composition_error(e) + where)
            choices = dict(task.hydra.runtime.choices)
            with read_write(task), open_dict(task):
                del task["hydra"]  # the run's config, as the task function gets it
            try:
                composition.check_experiment(choices)
                composition.check_fields(task, TrainConfig)
                cfg: TrainConfig = OmegaConf.to_object(task)
                composition.check_labels(cfg, choices)
                check_job(cfg, tasks)
            except (UserError, PlanError) as e:
                refusal.fail(f"{e}{where}")
        problem = controller_problem(config.hydra.runtime.choices.get("hydra/launcher", "slurm"))
        if problem is not None:
            refusal.fail(problem)
