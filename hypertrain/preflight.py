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
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hypertrain import checkpoint
from hypertrain.config import ConfigError, TrainConfig, validate
from hypertrain.layouts import choose_layout, launched_rank, process_count
from hypertrain.log import METRICS_FILE
from hypertrain.plan import PlanError

# Groups whose `name` field only labels the option chosen; the option is chosen with `group=option`.
LABELLED_GROUPS = ("model", "outer", "phase")

CONF = Path(__file__).resolve().parent.parent / "conf"
_prepared: dict[str, object] = {}  # resolved task config (as YAML) -> the PreparedRun built for it


def fail(message: str, code: int = 2) -> None:
    """The entry's one line for a mistake (`hypertrain: error: ...`), then exit (2 = a user mistake)."""
    print(f"hypertrain: error: {message}", file=sys.stderr)
    sys.exit(code)


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


def check_run_dir(run_dir: Path) -> None:
    """The run directory can be created here and holds no earlier run."""
    if (run_dir / METRICS_FILE).exists():
        raise ConfigError(
            f"hydra.run.dir={run_dir} already holds a run ({METRICS_FILE}); valid: a new directory"
        )
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


def composition_error(error: Exception) -> str:
    """Hydra's own composition error as one line: its first line, with the cause or the options."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    options = getattr(error, "options", None)
    if options:  # an option of a group that does not exist
        return f"{first}; valid: {', '.join(sorted(options))}"
    cause = error.__cause__
    detail = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    return f"{first} {detail}".strip() if detail and detail not in first else first


def check_composition(args: list[str]) -> None:
    """Compose the command line's overrides as Hydra will, before Hydra runs: an unknown option,
    a misspelled key or a value of the wrong type exits 2 with one line (Hydra's own wording),
    nothing created. In a multirun each sweep is checked at its first value (every job is then
    checked in full when it starts). Hydra's flags (--help, --cfg, ...) are left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in args):
        return
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    multirun = len(overrides) < len(args)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        first, sweeps = [], []
        for override, text in zip(parsed, overrides, strict=True):
            if override.is_sweep_override():
                sweeps.append(text)
                text = f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}"
            first.append(text)
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            composed = compose("train", overrides=first, return_hydra_config=True)
    except Exception as e:  # Hydra's errors have no common base class beyond Exception
        fail(composition_error(e))
    sweeping = multirun or str(composed.hydra.mode) == "RunMode.MULTIRUN"
    if sweeping and (launched := launched_rank()) is not None:
        fail(
            f"a multirun (-m) under {launched.launcher} is not supported: every rank would run the whole "
            "sweep; valid: python -m hypertrain.train -m engine=dist ... (each job starts its own "
            "processes), or -m hydra/launcher=slurm_dist (each job's SLURM tasks are its ranks)"
        )
    if sweeps and not sweeping:
        fail(
            f"Ambiguous value for argument '{sweeps[0]}'; valid: -m to sweep over the values, "
            "or key=[a,b] for a list"
        )


def with_layout(cfg: TrainConfig) -> TrainConfig:
    """engine=dist's process count and layout decided (validate() has checked that one fits)."""
    engine = cfg.engine
    processes = process_count(engine.nproc, cfg.world.size)
    layout = choose_layout(processes, cfg.world.size, cfg.replicas, engine.layout)
    return replace(cfg, engine=replace(engine, nproc=layout.processes, layout=layout.kind))


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
        return path.parent.parent, (path, checkpoint.load(path))
    found = checkpoint.find(path) if path.is_dir() else None
    if found is None:
        raise ConfigError(
            f"resume={mode!r} is no checkpoint file and no run directory holding one; valid: true, auto, "
            "a checkpoint file, or a run directory with checkpoints/"
        )
    return path, found


@dataclass
class Checked:
    """What the preflight decided: the prepared run, its directory, and where it resumes from."""

    run: object  # trainer.PreparedRun
    run_dir: Path | None
    resume: tuple[Path, dict] | None
    restart: bool = False  # resume=auto on a run stopped before its first checkpoint


def prepare_checked(task_cfg: DictConfig, choices: dict, run_dir: Path | None) -> Checked:
    """The typed, validated, prepared run; ConfigError/PlanError (one line) on any user mistake.
    `run_dir` None: this process writes nothing (a torchrun rank other than 0)."""
    from hypertrain.trainer import prepare  # torch and data only once the config is known to be sane

    check_experiment(choices)
    check_fields(task_cfg, TrainConfig)
    cfg: TrainConfig = OmegaConf.to_object(task_cfg)
    check_labels(cfg, choices)
    validate(cfg)
    if cfg.engine.name == "dist":
        cfg = with_layout(cfg)
    elif (launched := launched_rank()) is not None:
        raise ConfigError(
            f"engine={cfg.engine.name} runs in one process, but {launched.launcher} started this one as "
            f"one of {launched.processes} ranks; valid: engine=dist (the ranks are its processes), "
            "or a single process"
        )
    found, restart = None, False
    if run_dir is not None:
        run_dir, found = resume_target(cfg.resume, run_dir)
        restart = found is None and cfg.resume.strip().lower() == "auto" and stopped_early(run_dir)
        if found is None and not restart:
            check_run_dir(run_dir)
    run = prepare(cfg)
    if found is not None:
        checkpoint.compatible(found[1], resolved_config(run.cfg), run.plan_facts)
    return Checked(run, run_dir, found, restart)


def stopped_early(run_dir: Path) -> bool:
    """run_dir holds a run that stopped before it finished (no `end` row saying so)."""
    from hypertrain.log import read_metrics

    metrics = run_dir / METRICS_FILE
    if not metrics.exists():
        return False
    try:
        rows = read_metrics(metrics)
    except ValueError:  # a line cut short by the stop
        return True
    return not (rows and rows[-1].get("kind") == "end" and rows[-1].get("status") == "finished")


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
            checked = prepare_checked(task, dict(config.hydra.runtime.choices), run_dir)
        except (ConfigError, PlanError) as e:
            fail(str(e))
        if checked.run_dir is not None and checked.run_dir != run_dir:  # resume=PATH: that run's directory
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.run.dir = str(checked.run_dir)
        _prepared[_key(task)] = checked


def take_prepared(task_cfg: DictConfig) -> Checked | None:
    """What `Preflight` decided for this config, or None (a multirun job, or no callback)."""
    return _prepared.pop(_key(task_cfg), None)


def check_job(task_cfg: DictConfig, choices: dict, job_dir: Path | None) -> Checked:
    """A multirun job's checks, inside the task function; a rejected job leaves no directory."""
    try:
        return prepare_checked(task_cfg, choices, job_dir)
    except (ConfigError, PlanError) as e:
        if job_dir is not None:  # None: a rank other than 0, which made nothing
            remove_rejected_job_dir(job_dir)
        fail(str(e))


def remove_rejected_job_dir(job_dir: Path) -> None:
    """Remove what Hydra wrote for a job that never started (`.hydra/`, its log), if that is all."""
    if not job_dir.is_dir() or (job_dir / METRICS_FILE).exists():
        return
    hydra_files = {".hydra", "train.log"}
    if {p.name for p in job_dir.iterdir()} <= hydra_files:
        import logging

        logging.shutdown()  # close the job's log file before removing it
        shutil.rmtree(job_dir, ignore_errors=True)
