"""`hydra/sweeper=optuna` runs hypertrain's Optuna sweeper (hydra_plugins/hypertrain_optuna): the Hydra
callback `OptunaStudy` (conf/train.yaml) swaps the plugin's sweeper class for it before Hydra builds the
sweeper, for this entry only; every setting of the plugin's config stays as the user composed it.
Imported at every start: nothing here imports optuna.
"""

from __future__ import annotations

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

PLUGIN_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
STUDY_SWEEPER = "hydra_plugins.hypertrain_optuna.optuna_sweeper.OptunaSweeper"


def optimizing(sweeper: DictConfig) -> bool:
    """Whether a multirun's sweeper (`hydra.sweeper`) optimizes the value the task function returns
    (Optuna's, or any but Hydra's basic sweeper, which only lists jobs)."""
    return not str(sweeper.get("_target_", "")).endswith("BasicSweeper")


class OptunaStudy(Callback):
    """Before the sweeper is built: the plugin's Optuna sweeper becomes hypertrain's, whose study goes
    on past a trial whose run returned NaN (a run the divergence guard stopped)."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        sweeper = config.hydra.sweeper
        if sweeper.get("_target_") == PLUGIN_SWEEPER:
            with read_write(sweeper), open_dict(sweeper):
                sweeper._target_ = STUDY_SWEEPER
