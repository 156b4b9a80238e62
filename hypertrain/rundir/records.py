"""Run records: `metrics.jsonl` in the run directory is the source of truth; W&B mirrors it.

`RunLogger` appends one JSON object per line to `run_dir/metrics.jsonl` (never truncating it) and,
with `logger.name == "wandb"`, logs the same numbers to a Weights & Biases run (offline by default)
plotted against the update. `read_metrics` reads the file back. Imports wandb only when it is used.

The rows are `hypertrain.records.rows`' types (their fields, JSON form and W&B keys; the tables in
docs/interfaces.md, "Records", are made from them): `RunLogger` takes a row as its type, or as the dict
of its fields, and writes `to_json()` and logs `wandb()`. W&B's step metric is `update`; a summary row's
values go to W&B's run summary as they are.

W&B that cannot start is refused before anything is written where that can be known (`check_wandb`:
the mode, the project's name, credentials for an online mode); where `wandb.init` still fails,
`RunLogger` removes what it made and raises `WandbFailed` (the entry removes the rest of a new run).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hypertrain.failures import NonFiniteError, WandbFailed, fault_points
from hypertrain.records.files import (  # noqa: F401  (read back here too, as before the records' layer)
    METRICS_FILE,
    read_metrics,
    readable_rows,
    session_end,
    session_rows,
)
from hypertrain.records.rows import (
    CheckpointRow,
    EndRow,
    EvalRow,
    RestartRow,
    ResumeRow,
    Row,
    StartRow,
    SummaryRow,
    SyncRow,
    UpdateRow,
    loss_mean,  # noqa: F401  (as above)
    non_finite,
    plain,
)
from hypertrain.rundir.wandb_settings import quiet_wandb, wandb_is_set_up, wandb_mode

if TYPE_CHECKING:
    from hypertrain.config import LoggerConfig

WANDB_ID_RETRIES = 15  # seconds to wait for a killed session's wandb service to let its run id go


def no_space(error: BaseException) -> OSError | None:
    """The ENOSPC OSError behind `error` (itself, or its cause or context: torch.save reports one as
    a RuntimeError), None when there is none."""
    cause: BaseException | None = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno == errno.ENOSPC):
        cause = cause.__cause__ or cause.__context__
    return cause


def non_finite_line(row: dict, key: str, value: float) -> str:
    """The one line of a run stopped by `row` holding `value`, nan or an infinity, at `key`."""
    where = f" of update {row['update']}" if "update" in row else ""
    return (
        f"the {row['kind']} row{where} holds {key}={value}, a number JSON cannot hold (metrics.jsonl's rows "
        "are JSON); the run stops"
    )


class Records(Protocol):
    """What training hands its records, row by row as the row types (`run.trainer`, the checkpointer,
    the session): `RunLogger` writes the rows, `NoLog` drops them (tests/test_interfaces.py holds both
    to these methods)."""

    def write(self, row: Row) -> None: ...


class NoLog:
    """The records of a process that does not write the run (every rank but 0): rows go nowhere."""

    def write(self, row: Row) -> None:
        pass


class RunLogger:
    """Context manager recording one run to `run_dir/metrics.jsonl` and, optionally, to W&B.

    `config` is the resolved config as plain containers (W&B's run config). `replicas` is R: every
    update row must carry R losses. On exit, W&B's run is finished with exit code 1 if the block
    raised (0 otherwise) and the file is closed; `close()` may also be called directly, and twice.
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
        replicas: int,
        wandb_id: str | None = None,
        run_id: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.config = config
        self.logger_cfg = logger_cfg
        self.name, self.group, self.job_type, self.tags = name, group, job_type, list(tags)
        self.replicas = replicas
        self.wandb_id = wandb_id  # a resumed run keeps its W&B run id
        self.run_id = run_id or uuid.uuid4().hex  # a resumed run keeps its own id too
        self._sha = hashlib.sha256()  # of every byte of metrics.jsonl so far (checkpoints record it)
        self._file = None
        self._run = None
        self._owns_wandb = False  # this run started wandb's service (`_init_wandb`)
        self._mode: str | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> RunLogger:
        """Open the records and write the `start` row. On any failure before that row is whole (no
        space, W&B that cannot start: `WandbFailed`, a stop at once) nothing this call made is left:
        metrics.jsonl if it made it, the wandb folder if it made it, a W&B run finished."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        made = [p for p in (self.metrics_path, self.run_dir / "wandb") if not p.exists()]
        try:
            self._open()
        except BaseException:
            self._undo_open(made)
            raise
        return self

    def _undo_open(self, made: list[Path]) -> None:
        """What a failed `__enter__` made, removed again; the file closed, a W&B run finished."""
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._run is not None:
            run, self._run = self._run, None
            try:
                run.finish(exit_code=1)
            except Exception:  # W&B's own failure to finish changes nothing: its folder goes
                pass
        for path in made:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _open(self) -> None:
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        if self._file.tell() > 0:
            with open(self.metrics_path, "rb") as earlier:  # the sessions before this one
                for block in iter(lambda: earlier.read(1 << 20), b""):
                    self._sha.update(block)
            if not self._ends_with_newline():
                self._append("\n")  # a line cut short by a crash stays its own (unreadable) line
        if self.logger_cfg.name == "wandb":
            try:
                self._run = self._init_wandb()
            except Exception as e:  # wandb's errors have no common base class beyond Exception
                if no_space(e) is not None:
                    raise
                said = str(e).strip().splitlines()
                raise WandbFailed(
                    f"W&B could not start ({type(e).__name__}{': ' + said[0] if said else ''}); "
                    "valid: run again, or logger.mode=offline"
                ) from None
        self._write(
            StartRow(
                time=time.time(),
                run_id=self.run_id,
                name=self.name,
                group=self.group,
                job_type=self.job_type,
                tags=self.tags,
                replicas=self.replicas,
                wandb_run_id=self.wandb_run_id,
                pid=os.getpid(),
                host=socket.gethostname(),
            )
        )

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(error=exc)

    def close(self, error: BaseException | None = None) -> None:
        """Write the `end` row, close the file, finish W&B and wait for its run file; idempotent.

        With `error` the run failed: the end row holds its one-line message and the exit code the
        entry leaves with (the error's `exit_code`, else 1), and W&B's run finishes with that code.
        """
        if self._closed:
            return
        self._closed = True
        exit_code = 0 if error is None else int(getattr(error, "exit_code", 1))
        try:
            if self._file is not None and not self._file.closed:
                end = EndRow(
                    time=time.time(),
                    status="finished" if error is None else getattr(error, "status", "failed"),
                )
                if error is not None:
                    end.error = str(error).splitlines()[0] if str(error) else type(error).__name__
                    end.exit_code = exit_code
                try:
                    self._write(end)
                except OSError:  # a full disk: the rows before it are flushed; the error is reported
                    pass
        finally:
            if self._file is not None:
                try:
                    self._file.close()  # flushes what a full disk refused: it fails again, and closes
                except OSError:
                    if error is None:  # nothing else to report: the entry's disk-full handling does
                        raise
            if self._run is not None:
                run, self._run = self._run, None
                run_file = None if self._mode == "disabled" else Path(run.settings.sync_file)
                run.finish(exit_code=exit_code)
                if run_file is not None and run_file.exists():
                    self._wait_for_run_file(run_file)
                if self._owns_wandb:
                    import wandb

                    wandb.teardown()  # the service this run started, whose log is in the run's folder

    @staticmethod
    def _wait_for_run_file(run_file: Path) -> None:
        """Return once the run file is complete, so it can be read (or synced) as soon as we exit."""
        from hypertrain.rundir.wandb_offline import wait_for_exit_record

        if not wait_for_exit_record(run_file, timeout=30.0):
            warnings.warn(f"{run_file} has no exit record 30 s after wandb's finish()", stacklevel=3)

    def _ends_with_newline(self) -> bool:
        with open(self.metrics_path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _init_wandb(self):
        quiet_wandb()
        import wandb

        self._mode = wandb_mode(self.logger_cfg)
        settings = lambda: dict(  # noqa: E731  (fresh per attempt: wandb.init writes the id into Settings)
            project=self.logger_cfg.project,
            entity=self.logger_cfg.entity or None,
            dir=str(self.run_dir),
            mode=self._mode,
            config=self.config,
            name=self.name,
            group=self.group,
            job_type=self.job_type,
            tags=self.tags,
            # Several loggers may live in one process (a multirun); each owns its own run object.
            reinit="create_new",
            # Console capture and the system monitor cost start-up time and add nothing offline.
            settings=wandb.Settings(console="off", x_disable_stats=True, quiet=True, silent=True),
        )
        # wandb's service writes its debug log to $WANDB_CACHE_DIR/wandb/logs/ (~/.cache by default):
        # a service this run starts puts it in the run's own wandb/ folder, and is stopped at close so
        # the next run of a multirun starts its own (a WANDB_CACHE_DIR of the user's stays theirs).
        self._owns_wandb = not wandb_is_set_up()
        own_cache = self._owns_wandb and "WANDB_CACHE_DIR" not in os.environ
        if own_cache:
            os.environ["WANDB_CACHE_DIR"] = str(self.run_dir)
        try:
            run = self._start_wandb(wandb, settings)
        finally:
            if own_cache:  # the service has it now; the process's environment is as it was
                os.environ.pop("WANDB_CACHE_DIR", None)
        run.define_metric("update")
        run.define_metric("*", step_metric="update")
        return run

    def _start_wandb(self, wandb, settings):
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

    # -- rows ------------------------------------------------------------------------------------

    @property
    def wandb_run_dir(self) -> Path | None:
        """The W&B run folder (`run_dir/wandb/offline-run-*` offline); None without a W&B run."""
        if self._run is None or self._mode == "disabled":
            return None
        return Path(self._run.settings.sync_dir)

    # -- a row as the dict of its fields (tests, notebooks): the row's type, written -------------

    def log_eval(self, update: int, eval_loss: float, round: int = 0, **extra: Any) -> None:
        """A held-out loss in its own `eval` row, `eval/loss`: the starting weights' (before any update),
        and with Streaming DiLoCo's fragments the global weights' after every round (`extra`: the
        running byte totals, the clock, a multistream model's per-channel losses)."""
        self.write(EvalRow.of({"update": update, "round": round, "eval_loss": eval_loss, **extra}))

    def log_update(self, row: UpdateRow | dict) -> None:
        """One update: `update`, `round`, `lr`, `loss` (R entries, None = skipped), `tokens`, `wall`, ..."""
        self.write(UpdateRow.of(row))

    def log_sync(self, row: SyncRow | dict) -> None:
        """One sync (end of a round): held-out loss, pseudo-gradient norm, communicated bytes, extras."""
        self.write(SyncRow.of(row))

    def position(self) -> int:
        """Bytes written to metrics.jsonl so far (every row is flushed as it is written)."""
        return self._file.tell()

    def digest(self) -> str:
        """sha256 of metrics.jsonl's first `position()` bytes (what a checkpoint records with it)."""
        return self._sha.hexdigest()

    @property
    def wandb_run_id(self) -> str | None:
        return self._run.id if self._run is not None and self._mode != "disabled" else None

    def log_checkpoint(self, row: CheckpointRow | dict) -> None:
        """A checkpoint written: `update` (the next to run), `round`, `path`, `bytes`, `seconds`."""
        self.write(CheckpointRow.of(row))

    def log_resume(self, row: ResumeRow | dict) -> None:
        """This session resumes: from which checkpoint, at which update, what was superseded."""
        self.write(ResumeRow.of(row))

    def log_restart(self, row: RestartRow | dict) -> None:
        """This session was restarted by torch's agent: its count, where it goes on, what runs again."""
        self.write(RestartRow.of(row))

    def summary(self, values: SummaryRow | dict) -> None:
        """Run-level facts (`plan/union_sha256`, `plan/data_order_sha256`, `data/fingerprint`, ...)."""
        self.write(SummaryRow.of(values))

    def write(self, row: Row) -> None:
        """`row` to metrics.jsonl and, where it has W&B keys, to W&B (a summary row's values: to W&B's
        run summary). An update row must hold R losses."""
        if isinstance(row, UpdateRow) and len(row.loss) != self.replicas:
            raise ValueError(
                f"log_update: loss has {len(row.loss)} entries at update {row.update}; "
                f"valid: one per replica ({self.replicas})"
            )
        self._write(row)
        if self._run is None:
            return
        if isinstance(row, SummaryRow):
            for key, value in row.values.items():
                self._run.summary[key] = value
        data = row.wandb()
        if data is not None:
            self._run.log(data, commit=True)

    def _write(self, typed: Row) -> None:
        if self._file is None or self._file.closed:
            raise RuntimeError("RunLogger is not open; use it as a context manager (with RunLogger(...))")
        row = typed.to_json()
        try:
            line = json.dumps(row, default=plain, allow_nan=False) + "\n"
        except ValueError:  # nan or an infinity: JSON has no number for it, and a reader would refuse it
            found = non_finite(row)
            if found is None:
                raise
            raise NonFiniteError(non_finite_line(row, *found)) from None
        at = range(row["update"] - 1, row["update"]) if row["kind"] == "update" else range(0)
        if fault_points.due(0, "metrics", at):
            self._append(line[: len(line) // 2])  # tests only: die half-way through the row
            fault_points.act(0, "metrics", at)
        self._append(line)

    def _append(self, text: str) -> None:
        self._file.write(text)
        self._file.flush()
        self._sha.update(text.encode("utf-8"))
