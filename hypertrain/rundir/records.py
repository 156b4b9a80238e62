"""Run records: `metrics.jsonl` in the run directory is the source of truth; W&B mirrors it.

`RunLogger` is what the rest of the code opens: it holds the loggers of `logger.Logger`, a
`jsonl.JsonlWriter` (metrics.jsonl, appended to, never truncated) and, with `logger.name == "wandb"`,
a `wandb_mirror.WandbMirror` (a W&B run, offline by default, plotted against the update), in the shape
of torchtitan's `LoggerContainer`. It writes the `start` row, checks what the row types cannot (an
update row's R losses), hands each row to the writer and then to the mirror, and closes both with the
run's error. `read_metrics` reads the file back.

The rows are `hypertrain.records.rows`' types (their fields, JSON form and W&B keys; the tables in
docs/interfaces.md, "Records", are made from them): `RunLogger` takes a row as its type, or as the dict
of its fields. A row the writer refuses (nan, a full disk) reaches no mirror.

W&B that cannot start is refused before anything is written where that can be known (`check_wandb`:
the mode, the project's name, credentials for an online mode); where `wandb.init` still fails,
`RunLogger` removes what it made and raises `WandbFailed` (the entry removes the rest of a new run).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hypertrain.records.files import (  # noqa: F401  (read back here too, as before the records' layer)
    METRICS_FILE,
    read_metrics,
    readable_rows,
    session_end,
    session_rows,
)
from hypertrain.records.rows import (
    CheckpointRow,
    EvalRow,
    RestartRow,
    ResumeRow,
    Row,
    StartRow,
    SummaryRow,
    SyncRow,
    UpdateRow,
    loss_mean,  # noqa: F401  (as above)
)
from hypertrain.rundir.jsonl import JsonlWriter
from hypertrain.rundir.wandb_mirror import WandbMirror

if TYPE_CHECKING:
    from hypertrain.config import LoggerConfig


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
        self.jsonl = JsonlWriter(self.metrics_path)
        self.mirror: WandbMirror | None = None  # started on entry with logger.name == "wandb"
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

    def _open(self) -> None:
        self.jsonl.open()
        if self.logger_cfg.name == "wandb":
            self.mirror = WandbMirror(
                self.run_dir,
                self.config,
                self.logger_cfg,
                name=self.name,
                group=self.group,
                job_type=self.job_type,
                tags=self.tags,
                wandb_id=self.wandb_id,
            )
        self.jsonl.write(  # metrics.jsonl's alone: W&B's run config holds the same
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

    def _undo_open(self, made: list[Path]) -> None:
        """What a failed `__enter__` made, removed again; the file closed, a W&B run finished."""
        self._closed = True
        self.jsonl.abandon()
        if self.mirror is not None:
            self.mirror.abandon()
        for path in made:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

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
        try:
            self.jsonl.close(error)
        finally:  # W&B finishes even where metrics.jsonl's close fails (a full disk, no error to report)
            if self.mirror is not None:
                self.mirror.close(error)

    # -- rows ------------------------------------------------------------------------------------

    def write(self, row: Row) -> None:
        """`row` to metrics.jsonl and, where it has W&B keys, to W&B (a summary row's values: to W&B's
        run summary). An update row must hold R losses."""
        if isinstance(row, UpdateRow) and len(row.loss) != self.replicas:
            raise ValueError(
                f"log_update: loss has {len(row.loss)} entries at update {row.update}; "
                f"valid: one per replica ({self.replicas})"
            )
        if not self.jsonl.is_open:
            raise RuntimeError("RunLogger is not open; use it as a context manager (with RunLogger(...))")
        self.jsonl.write(row)  # first: a row it refuses (nan, no space) is mirrored nowhere
        if self.mirror is not None:
            self.mirror.write(row)

    @property
    def wandb_run_dir(self) -> Path | None:
        """The W&B run folder (`run_dir/wandb/offline-run-*` offline); None without a W&B run."""
        return None if self.mirror is None else self.mirror.sync_dir

    @property
    def wandb_run_id(self) -> str | None:
        return None if self.mirror is None else self.mirror.run_id

    def position(self) -> int:
        """Bytes written to metrics.jsonl so far (every row is flushed as it is written)."""
        return self.jsonl.position()

    def digest(self) -> str:
        """sha256 of metrics.jsonl's first `position()` bytes (what a checkpoint records with it)."""
        return self.jsonl.digest()

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
