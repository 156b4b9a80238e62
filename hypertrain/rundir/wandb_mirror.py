"""`WandbMirror`: a Weights & Biases run (offline by default) that mirrors metrics.jsonl's rows.

Built, it starts the run: `wandb.init` with the run's id (retried while a killed session's service
still holds it), every number plotted against `update`; a start that fails raises `WandbFailed` in one
line (a full disk behind it stays an OSError). A row is logged in its W&B form (`Row.wandb()`; a summary
row's values also go to the run's summary). Closing finishes the run with the run's exit code, waits
for an offline run's file to be complete, and stops the wandb service the run started. Imports wandb
only when built.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from hypertrain.failures import WandbFailed
from hypertrain.records.rows import Row, SummaryRow
from hypertrain.rundir.logger import exit_code, no_space
from hypertrain.rundir.wandb_settings import quiet_wandb, wandb_is_set_up, wandb_mode

if TYPE_CHECKING:
    from hypertrain.config import LoggerConfig

WANDB_ID_RETRIES = 15  # seconds to wait for a killed session's wandb service to let its run id go


class WandbMirror:
    """The W&B run of one session of a run in `run_dir` (its folder: `run_dir/wandb`).

    `config` is W&B's run config (the resolved config as plain containers); `wandb_id` a resumed run's
    W&B id, kept where wandb lets it go in time.
    """

    def __init__(
        self,
        run_dir: Path,
        config: dict,
        logger_cfg: LoggerConfig,
        *,
        name: str,
        group: str,
        job_type: str,
        tags: list[str],
        wandb_id: str | None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.mode: str | None = None  # wandb's mode, decided as it starts
        self.wandb_id = wandb_id
        self.owns_service = False  # this run started wandb's service (`_start`)
        self._run = None
        try:
            self._run = self._start(config, logger_cfg, name=name, group=group, job_type=job_type, tags=tags)
        except Exception as e:  # wandb's errors have no common base class beyond Exception
            if no_space(e) is not None:
                raise
            said = str(e).strip().splitlines()
            raise WandbFailed(
                f"W&B could not start ({type(e).__name__}{': ' + said[0] if said else ''}); "
                "valid: run again, or logger.mode=offline"
            ) from None

    @property
    def run_id(self) -> str | None:
        """The W&B run's id; None once closed, or with W&B disabled."""
        return self._run.id if self._run is not None and self.mode != "disabled" else None

    @property
    def sync_dir(self) -> Path | None:
        """The W&B run folder (`run_dir/wandb/offline-run-*` offline); None once closed, or disabled."""
        if self._run is None or self.mode == "disabled":
            return None
        return Path(self._run.settings.sync_dir)

    def write(self, row: Row) -> None:
        """`row`'s W&B form, logged against `update`; a summary row's values to the run's summary too."""
        if self._run is None:
            return
        if isinstance(row, SummaryRow):
            for key, value in row.values.items():
                self._run.summary[key] = value
        data = row.wandb()
        if data is not None:
            self._run.log(data, commit=True)

    def close(self, error: BaseException | None = None) -> None:
        """Finish the run with the run's exit code, wait for its run file, stop the service it started."""
        if self._run is None:
            return
        run, self._run = self._run, None
        run_file = None if self.mode == "disabled" else Path(run.settings.sync_file)
        run.finish(exit_code=exit_code(error))
        if run_file is not None and run_file.exists():
            self._wait_for_run_file(run_file)
        if self.owns_service:
            import wandb

            wandb.teardown()  # the service this run started, whose log is in the run's folder

    def abandon(self) -> None:
        """Finish the run as failed, whatever wandb says (a start that failed: its maker removes the
        folder)."""
        if self._run is None:
            return
        run, self._run = self._run, None
        try:
            run.finish(exit_code=1)
        except Exception:  # W&B's own failure to finish changes nothing: its folder goes
            pass

    def _start(self, config: dict, logger_cfg: LoggerConfig, **identity):
        quiet_wandb()
        import wandb

        self.mode = wandb_mode(logger_cfg)
        settings = lambda: dict(  # noqa: E731  (fresh per attempt: wandb.init writes the id into Settings)
            project=logger_cfg.project,
            entity=logger_cfg.entity or None,
            dir=str(self.run_dir),
            mode=self.mode,
            config=config,
            **identity,
            # Several loggers may live in one process (a multirun); each owns its own run object.
            reinit="create_new",
            # Console capture and the system monitor cost start-up time and add nothing offline.
            settings=wandb.Settings(console="off", x_disable_stats=True, quiet=True, silent=True),
        )
        # wandb's service writes its debug log to $WANDB_CACHE_DIR/wandb/logs/ (~/.cache by default):
        # a service this run starts puts it in the run's own wandb/ folder, and is stopped at close so
        # the next run of a multirun starts its own (a WANDB_CACHE_DIR of the user's stays theirs).
        self.owns_service = not wandb_is_set_up()
        own_cache = self.owns_service and "WANDB_CACHE_DIR" not in os.environ
        if own_cache:
            os.environ["WANDB_CACHE_DIR"] = str(self.run_dir)
        try:
            run = self._init(wandb, settings)
        finally:
            if own_cache:  # the service has it now; the process's environment is as it was
                os.environ.pop("WANDB_CACHE_DIR", None)
        run.define_metric("update")
        run.define_metric("*", step_metric="update")
        return run

    def _init(self, wandb, settings):
        """wandb.init with this run's id. A resumed run keeps its id; right after a kill, wandb's
        service of the killed session may still hold it ("run ID ... is in use") for a few seconds:
        wait for it, then, if it still does, go on under a new id (metrics.jsonl is the record; the
        resume row says where)."""
        for attempt in range(WANDB_ID_RETRIES + 1):
            try:
                run = wandb.init(id=self.wandb_id, **settings())
                break
            except Exception as e:  # wandb's ServerResponseError has no stable import path
                if self.wandb_id is None or "in use" not in str(e):
                    raise
                if attempt == WANDB_ID_RETRIES:
                    warnings.warn(
                        f"W&B run id {self.wandb_id} still in use; this session logs under a new id",
                        stacklevel=2,
                    )
                    self.wandb_id = None
                    run = wandb.init(id=None, **settings())
                    break
                time.sleep(1.0)
        return run

    @staticmethod
    def _wait_for_run_file(run_file: Path) -> None:
        """Return once the run file is complete, so it can be read (or synced) as soon as we exit."""
        from hypertrain.rundir.wandb_offline import wait_for_exit_record

        if not wait_for_exit_record(run_file, timeout=30.0):
            warnings.warn(f"{run_file} has no exit record 30 s after wandb's finish()", stacklevel=4)
