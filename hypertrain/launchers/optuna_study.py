"""The study loop of `hydra/sweeper=optuna` (hydra_plugins/hypertrain_optuna): hydra-optuna-sweeper 1.2.0's,
but a trial whose run returns NaN (the entry's value for a run the divergence guard or a non-finite
number stopped under a sweeper) is told to Optuna as failed and the study goes on, where the plugin's
raises and ends the study. A job that raises still ends it (told failed first), as in the plugin.

Writes the plugin's `optimization_results.yaml` and `trials.yaml`: every trial this sweep ran (number,
state, value, parameters, run directory relative to the sweep directory), rewritten after each batch.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Any

import optuna
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

RESULTS_FILE = "optimization_results.yaml"  # the plugin's: the best trial's parameters and value
TRIALS_FILE = "trials.yaml"


def trial_values(ret, n_objectives: int) -> list[float] | None:
    """The job's return value as Optuna's values; None when any is NaN (the trial failed). A job that
    raised re-raises here (`ret.return_value`); a value that is no float is a ValueError, as in the plugin."""
    value = ret.return_value
    try:
        values = [float(value)] if n_objectives == 1 else [float(v) for v in value]
    except (ValueError, TypeError) as e:
        raise ValueError(f"the task function returned {value!r}; valid: a float per objective") from e
    if len(values) != n_objectives:
        raise ValueError(f"the task function returned {len(values)} values for {n_objectives} objectives")
    return None if any(math.isnan(v) for v in values) else values


def tell(study: optuna.Study, trial: optuna.Trial, values: list[float] | None, grid: bool) -> None:
    """COMPLETE with `values`, FAIL without (NaN). The grid sampler stops the study itself once every
    point is taken (a RuntimeError from tell, which the plugin passes over too)."""
    if values is None:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return
    try:
        study.tell(trial, values=values)
    except RuntimeError as e:
        if not (grid and "`Study.stop` is supposed to be invoked" in str(e)):
            raise


def _search_space(impl: OptunaSweeperImpl, arguments: list[str]) -> tuple[dict, dict, bool]:
    """The distributions to sample, the fixed parameters, and whether the sampler is the grid's (whose
    sampler is built here from the space, the trials capped at the grid's size), as the plugin does."""
    impl._process_searchspace_config()
    distributions, fixed = create_params_from_overrides([*impl._parse_sweeper_params_config(), *arguments])
    grid = isinstance(impl.sampler, functools.partial) and impl.sampler.func == optuna.samplers.GridSampler
    if grid:
        choices = {name: impl._to_grid_sampler_choices(d) for name, d in distributions.items()}
        impl.sampler = impl.sampler(choices)
        impl.n_trials = min(impl.n_trials, math.prod(len(v) for v in choices.values()))
    for name in fixed:
        distributions.pop(name, None)
    return distributions, fixed, grid


def trial_row(trial: optuna.Trial, ret, values: list[float] | None, sweep_dir: Path) -> dict[str, Any]:
    """One trial as trials.yaml lists it."""
    run_dir = Path(ret.hydra_cfg.hydra.runtime.output_dir)
    try:
        run_dir = run_dir.relative_to(sweep_dir.absolute())
    except ValueError:
        pass
    return {
        "number": trial.number,
        "state": "complete" if values is not None else "failed",
        "values": values,
        "params": dict(trial.params),
        "run_dir": str(run_dir),
    }


def sweep(impl: OptunaSweeperImpl, arguments: list[str]) -> None:
    """The study: `impl.n_trials` trials in batches of `impl.n_jobs`, each launched by Hydra's launcher
    as an ordinary job (its own run directory), then the results files."""
    distributions, fixed, grid = _search_space(impl, list(arguments))
    directions = impl._get_directions()
    study = optuna.create_study(
        study_name=impl.study_name,
        storage=impl.storage,
        sampler=impl.sampler,
        directions=directions,
        load_if_exists=True,
    )
    log.info(f"Study {study.study_name}: storage {impl.storage}, sampler {type(impl.sampler).__name__}")
    sweep_dir = Path(impl.config.hydra.sweep.dir)
    rows: list[dict] = []
    to_go = impl.n_trials
    while to_go > 0:
        trials = [study.ask() for _ in range(min(to_go, impl.n_jobs))]
        returns = impl.launcher.launch(impl._configure_trials(trials, distributions, fixed), impl.job_idx)
        impl.job_idx += len(returns)
        for trial, ret in zip(trials, returns, strict=True):
            try:
                values = trial_values(ret, len(directions))
            except Exception:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            if values is None:
                log.warning(f"trial {trial.number} failed (its run returned NaN); the study goes on")
            tell(study, trial, values, grid)
            rows.append(trial_row(trial, ret, values, sweep_dir))
        OmegaConf.save(OmegaConf.create(rows), sweep_dir / TRIALS_FILE)
        to_go -= len(trials)
    write_results(study, directions, sweep_dir)


def write_results(study: optuna.Study, directions: list[str], sweep_dir: Path) -> None:
    """optimization_results.yaml as the plugin writes it; a study with no completed trial ends the
    sweep with one line, exit 1 (trials.yaml lists the failures)."""
    if not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
        from hypertrain.preflight.refusal import fail

        fail(f"every trial of the study failed; see {sweep_dir / TRIALS_FILE}", code=1)
    if len(directions) < 2:
        best = study.best_trial
        results = {"name": "optuna", "best_params": best.params, "best_value": best.value}
        log.info(f"Best parameters: {best.params}")
        log.info(f"Best value: {best.value}")
    else:
        front = [{"params": t.params, "values": t.values} for t in study.best_trials]
        results = {"name": "optuna", "solutions": front}
        log.info(f"Number of Pareto solutions: {len(front)}")
    OmegaConf.save(OmegaConf.create(results), sweep_dir / RESULTS_FILE)
