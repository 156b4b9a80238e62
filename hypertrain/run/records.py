"""Run records: `metrics.jsonl` in the run directory is the source of truth; W&B mirrors it.

`RunLogger` appends one JSON object per line to `run_dir/metrics.jsonl` (never truncating it) and,
with `logger.name == "wandb"`, logs the same numbers to a Weights & Biases run (offline by default)
plotted against the update. `read_metrics` reads the file back. Imports wandb only when it is used.

Rows, by `kind` (JSON has no NaN; Python's json writes and reads `NaN`/`Infinity` tokens):
- `start`: one per `RunLogger`, `{"kind", "time", "run_id", "name", "group", "job_type", "tags",
  "replicas", "wandb_run_id", "pid", "host"}` (`run_id`: the run's own id, kept by every session of
  it and by its checkpoints, which must match their records to be resumed; `pid` and `host`: the
  writing process and `socket.gethostname()`, so a file without an `end` row tells a running
  session from a dead one); a resumed run appends a second one, so
  every session of a file is visible.
- `eval`: the held-out loss before training, `{"kind", "update", "round", "eval_loss"}` (`log_eval`).
- `update`: `{"kind", "update", "round", "lr", "loss": [per replica, null = skipped], "tokens", "wall",
  "rank_seconds", "clock_s", ..., "loss_mean"}` (`log_update`; `clock_s`: the network clock at the
  update's end, docs/clock.md).
- `sync`: `{"kind", "update", "round", "eval_loss", "pseudo_grad_norm", "comm_inner_bytes",
  "comm_outer_bytes", "comm_inner_total", "comm_outer_total", ...}` (`log_sync`).
- `summary`: `{"kind", ...values}` (`summary`).
- `restart`: a session torch's agent started again after a worker failed (`torchrun --max-restarts`,
  `processes.max_restarts`), written by its rank 0 after its `start` row (and its `resume` row when it
  goes on from a checkpoint): `{"kind", "count", "max_restarts", "update", "recomputed", "from",
  "superseded_bytes"}` (`log_restart`; `count`: the agent's restart count, 1 for the first restart;
  `update`: the update the run goes on from, 0 from the start; `recomputed`: the updates after it that
  the failed session had recorded, which this session runs again; `from`: the checkpoint, null from
  the start; docs/resume.md, "Restarts").
- `end`: the last row of a session, `{"kind", "time", "status": "finished" | "failed" | "preempted" |
  "interrupted"}`, and for a run that did not finish `"error"` (its one line) and `"exit_code"`, the
  code the entry exits with (`preempted`: SIGTERM or SIGUSR2, 143; `interrupted`: SIGINT 130, SIGHUP
  129; failures.signals); written by `close`. A file that ends without one is a run that was
  killed or is still running. `session_end` reads it back: the entry of a self-launched
  `processes=dist` run exits as its rank 0's end row says.

W&B keys: `update` (the step metric of every other key), `round`, `train/loss/replica_<m>`,
`train/loss_mean`, `train/lr`, `train/tokens`, `train/wall`, `train/<extra>`, `eval/loss`,
`sync/pseudo_grad_norm`, `sync/<extra>`, `comm/inner_bytes`, `comm/outer_bytes`, `comm/inner_total`,
`comm/outer_total`, `clock/seconds` (every update's and sync's `clock_s`), `clock/compute_s`,
`clock/inner_s`, `clock/outer_exposed_s`, `clock/outer_hidden_s` (a sync's split); summary keys as given
(the clock's totals under `clock/`, docs/clock.md).

W&B that cannot start is refused before anything is written where that can be known (`check_wandb`:
the mode, the project's name, credentials for an online mode); where `wandb.init` still fails,
`RunLogger` removes what it made and raises `WandbFailed` (the entry removes the rest of a new run).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import socket
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hypertrain.failures import WandbFailed, fault_points
from hypertrain.run.wandb_settings import quiet_wandb, wandb_mode

if TYPE_CHECKING:
    from hypertrain.config import LoggerConfig

METRICS_FILE = "metrics.jsonl"
WANDB_ID_RETRIES = 15  # seconds to wait for a killed session's wandb service to let its run id go

# The sync row's fields that W&B gets under their own names; any other field goes to `sync/<key>`.
_SYNC_KEYS = {
    "eval_loss": "eval/loss",
    "pseudo_grad_norm": "sync/pseudo_grad_norm",
    "comm_inner_bytes": "comm/inner_bytes",
    "comm_outer_bytes": "comm/outer_bytes",
    "comm_inner_total": "comm/inner_total",
    "comm_outer_total": "comm/outer_total",
}
_UPDATE_KEYS = ("lr", "tokens", "wall")


def no_space(error: BaseException) -> OSError | None:
    """The ENOSPC OSError behind `error` (itself, or its cause or context: torch.save reports one as
    a RuntimeError), None when there is none."""
    cause: BaseException | None = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno == errno.ENOSPC):
        cause = cause.__cause__ or cause.__context__
    return cause


def _plain(value: Any) -> Any:
    """JSON fallback for numpy / torch scalars and arrays, without importing either."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"metrics.jsonl cannot hold a {type(value).__name__}: {value!r}")


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def loss_mean(losses: list[float | None]) -> float | None:
    """Mean of the replicas that stepped (None entries left out); None when no replica stepped."""
    stepped = [float(loss) for loss in losses if loss is not None]
    return math.fsum(stepped) / len(stepped) if stepped else None


class Records(Protocol):
    """What training hands its records, row by row (`run.trainer`): `RunLogger` writes the rows,
    `NoLog` drops them (tests/test_interfaces.py holds both to these methods)."""

    def log_eval(self, update: int, eval_loss: float, round: int = 0, **extra: Any) -> None: ...

    def log_update(self, row: dict) -> None: ...

    def log_sync(self, row: dict) -> None: ...

    def log_checkpoint(self, row: dict) -> None: ...

    def summary(self, values: dict) -> None: ...


class NoLog:
    """The records of a process that does not write the run (every rank but 0): rows go nowhere."""

    def log_eval(self, update: int, eval_loss: float, round: int = 0, **extra: Any) -> None:
        pass

    def log_update(self, row: dict) -> None:
        pass

    def log_sync(self, row: dict) -> None:
        pass

    def log_checkpoint(self, row: dict) -> None:
        pass

    def summary(self, values: dict) -> None:
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
            {
                "kind": "start",
                "time": time.time(),
                "run_id": self.run_id,
                "name": self.name,
                "group": self.group,
                "job_type": self.job_type,
                "tags": self.tags,
                "replicas": self.replicas,
                "wandb_run_id": self._run.id if self._run is not None and self._mode != "disabled" else None,
                "pid": os.getpid(),
                "host": socket.gethostname(),
            }
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
                end = {
                    "kind": "end",
                    "time": time.time(),
                    "status": "finished" if error is None else getattr(error, "status", "failed"),
                }
                if error is not None:
                    end |= {"error": str(error).splitlines()[0] if str(error) else type(error).__name__}
                    end |= {"exit_code": exit_code}
                try:
                    self._write(end)
                except OSError:  # a full disk: the rows before it are flushed; the error is reported
                    pass
        finally:
            if self._file is not None:
                self._file.close()
            if self._run is not None:
                run, self._run = self._run, None
                run_file = None if self._mode == "disabled" else Path(run.settings.sync_file)
                run.finish(exit_code=exit_code)
                if run_file is not None and run_file.exists():
                    self._wait_for_run_file(run_file)

    @staticmethod
    def _wait_for_run_file(run_file: Path) -> None:
        """Return once the run file is complete, so it can be read (or synced) as soon as we exit."""
        from hypertrain.run.wandb_offline import wait_for_exit_record

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
        # A resumed run keeps its id; right after a kill, wandb's service of the killed session may
        # still hold it ("run ID ... is in use") for a few seconds: wait for it, then, if it still
        # does, go on under a new id (metrics.jsonl is the record; the resume row says where).
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
        run.define_metric("update")
        run.define_metric("*", step_metric="update")
        return run

    # -- rows ------------------------------------------------------------------------------------

    @property
    def wandb_run_dir(self) -> Path | None:
        """The W&B run folder (`run_dir/wandb/offline-run-*` offline); None without a W&B run."""
        if self._run is None or self._mode == "disabled":
            return None
        return Path(self._run.settings.sync_dir)

    def log_eval(self, update: int, eval_loss: float, round: int = 0, **extra: Any) -> None:
        """A held-out loss in its own `eval` row, `eval/loss`: the starting weights' (before any update),
        and with Streaming DiLoCo's fragments the global weights' after every round (`extra`: the
        running byte totals, a multistream model's per-channel losses)."""
        row = {"kind": "eval", "update": update, "round": round, "eval_loss": float(eval_loss), **extra}
        self._write(row)
        self._wandb_log({"update": update, "round": round, "eval/loss": row["eval_loss"]}, extra, "eval/")

    def log_update(self, row: dict) -> None:
        """One update: `update`, `round`, `lr`, `loss` (R entries, None = skipped), `tokens`, `wall`, ..."""
        losses = [None if loss is None else float(loss) for loss in row["loss"]]
        if len(losses) != self.replicas:
            raise ValueError(
                f"log_update: loss has {len(losses)} entries at update {row['update']}; "
                f"valid: one per replica ({self.replicas})"
            )
        mean = loss_mean(losses)
        self._write({"kind": "update", **row, "loss": losses, "loss_mean": mean})
        data: dict[str, Any] = {"update": row["update"], "round": row["round"]}
        data.update({f"train/loss/replica_{m}": loss for m, loss in enumerate(losses) if loss is not None})
        if mean is not None:
            data["train/loss_mean"] = mean
        data.update({f"train/{key}": row[key] for key in _UPDATE_KEYS if key in row})
        extra = {k: v for k, v in row.items() if k not in ("update", "round", "loss", *_UPDATE_KEYS)}
        self._wandb_log(data, extra, "train/")

    def log_sync(self, row: dict) -> None:
        """One sync (end of a round): held-out loss, pseudo-gradient norm, communicated bytes, extras."""
        self._write({"kind": "sync", **row})
        data: dict[str, Any] = {"update": row["update"], "round": row["round"]}
        data.update({wandb_key: row[key] for key, wandb_key in _SYNC_KEYS.items() if key in row})
        extra = {k: v for k, v in row.items() if k not in ("update", "round", *_SYNC_KEYS)}
        self._wandb_log(data, extra, "sync/")

    def position(self) -> int:
        """Bytes written to metrics.jsonl so far (every row is flushed as it is written)."""
        return self._file.tell()

    def digest(self) -> str:
        """sha256 of metrics.jsonl's first `position()` bytes (what a checkpoint records with it)."""
        return self._sha.hexdigest()

    @property
    def wandb_run_id(self) -> str | None:
        return self._run.id if self._run is not None and self._mode != "disabled" else None

    def log_checkpoint(self, row: dict) -> None:
        """A checkpoint written: `update` (the next to run), `round`, `path`, `bytes`, `seconds`."""
        self._write({"kind": "checkpoint", **row})
        self._wandb_log(
            {"update": row["update"], "round": row["round"]},
            {k: row[k] for k in ("bytes", "seconds")},
            "checkpoint/",
        )

    def log_resume(self, row: dict) -> None:
        """This session resumes: from which checkpoint, at which update, what was superseded."""
        self._write({"kind": "resume", **row})

    def log_restart(self, row: dict) -> None:
        """This session was restarted by torch's agent: its count, where it goes on, what runs again."""
        self._write({"kind": "restart", **row})

    def summary(self, values: dict) -> None:
        """Run-level facts (`plan/union_sha256`, `plan/data_order_sha256`, `data/fingerprint`, ...)."""
        self._write({"kind": "summary", **values})
        if self._run is not None:
            for key, value in values.items():
                self._run.summary[key] = value

    def _write(self, row: dict) -> None:
        if self._file is None or self._file.closed:
            raise RuntimeError("RunLogger is not open; use it as a context manager (with RunLogger(...))")
        line = json.dumps(row, default=_plain) + "\n"
        at = range(row["update"] - 1, row["update"]) if row["kind"] == "update" else range(0)
        if fault_points.due(0, "metrics", at):
            self._append(line[: len(line) // 2])  # tests only: die half-way through the row
            fault_points.act(0, "metrics", at)
        self._append(line)

    def _append(self, text: str) -> None:
        self._file.write(text)
        self._file.flush()
        self._sha.update(text.encode("utf-8"))

    def _wandb_log(self, data: dict, extra: dict, prefix: str) -> None:
        if self._run is None:
            return
        for key, value in extra.items():
            value = _plain(value) if hasattr(value, "item") else value
            if _scalar(value):  # lists and strings stay in metrics.jsonl only
                data[_clock_key(key) or f"{prefix}{key}"] = value
        self._run.log(data, commit=True)


def _clock_key(key: str) -> str | None:
    """The network clock's W&B keys: `clock_s` (an update's or a sync's, the clock at its end) is
    `clock/seconds`, a sync's `clock_<part>` is `clock/<part>`; None for any other field."""
    if key == "clock_s":
        return "clock/seconds"
    return f"clock/{key.removeprefix('clock_')}" if key.startswith("clock_") else None


def read_metrics(path: Path | str) -> list[dict]:
    """The rows of a `metrics.jsonl` (a file, or a run directory holding one), in order."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not a JSON line ({e.msg}): {line[:80]!r}") from None
    return rows


def session_rows(path: Path | str, since: int = 0) -> list[dict]:
    """The rows of a `metrics.jsonl` (a file, or a run directory holding one) from byte `since` on,
    leaving out a line that is not JSON (a row cut short by a kill); [] when there is no file."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    try:
        with open(path, "rb") as f:
            f.seek(since)
            data = f.read()
    except FileNotFoundError:
        return []
    return readable_rows(data)


def readable_rows(data: bytes) -> list[dict]:
    """The rows among `data`'s lines (metrics.jsonl bytes), leaving out a line that is not JSON (a row
    cut short by a kill)."""
    rows = []
    for line in data.splitlines():
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def session_end(rows: list[dict]) -> dict | None:
    """The session's `end` row among `rows` (`session_rows`), None when it has none; its exit code is
    `end.get("exit_code", 0)`."""
    ends = [r for r in rows if r.get("kind") == "end"]
    return ends[-1] if ends else None
