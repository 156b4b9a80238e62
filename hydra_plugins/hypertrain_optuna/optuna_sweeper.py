"""hypertrain's Optuna sweeper: hydra-optuna-sweeper's, with a failed trial failing alone.

Selected by `hydra/sweeper=optuna` (`conf/hydra/sweeper/optuna.yaml` takes the name over from the
plugin's own config, for hypertrain's entry only); the study's loop is `hypertrain/launchers/optuna_study.py`
(imported only when a study runs: Hydra imports this module at every start). Without the tune extra
(hydra-optuna-sweeper) there is no sweeper here.
"""

from __future__ import annotations

import logging

try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper as PluginOptunaSweeper
except ImportError:  # the tune extra is not installed: hydra/sweeper=optuna is unavailable, nothing else
    PluginOptunaSweeper = None

if PluginOptunaSweeper is not None:

    class OptunaSweeper(PluginOptunaSweeper):
        """A trial whose run returns NaN (a run the divergence guard stopped) is told to Optuna as
        failed and the study goes on (the plugin's own loop ends the study there); every trial's
        number, state, value, parameters and run directory go to the sweep directory's trials.yaml."""

        def __init__(self, *args, **kwargs):
            # optuna imports alembic, which logs a line per plugin it sets up (30 lines) at Hydra's INFO
            logging.getLogger("alembic").setLevel(logging.WARNING)
            super().__init__(*args, **kwargs)

        def sweep(self, arguments):
            from hypertrain.launchers import optuna_study

            return optuna_study.sweep(self.sweeper, arguments)
