"""The runs a report reads: find them on disk, read each one's records, tell whether it is alive.

`find_runs(paths)` gives every run directory (one holding metrics.jsonl) at or under the paths;
`load_run(run_dir)` reads one into a `Run` or raises `ReportInputError`, one line. A run's status is
its last session's (docs/report.md, "Status"). Its held-out curve and outer bytes (`Run.heldout`,
`Run.outer_total_bytes`, `Run.outer_peak_bytes`) read alike for plain and Streaming DiLoCo runs and for
runs written before streaming (no `eval` rows after training, no outer bytes in the summary).
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hypertrain.config import UserError, flatten
from hypertrain.records import formats
from hypertrain.records.files import json_row, merged_summary
from hypertrain.records.rows import ArrivalRow, EndRow, EvalRow, Row, StartRow, SyncRow, parse
from hypertrain.rundir.directory import REPORT_FOLDER
from hypertrain.rundir.records import METRICS_FILE, read_metrics

VALID_PATH = "valid: a run directory (holding metrics.jsonl), a sweep directory, or a folder above them"
SKIPPED = {"wandb", "checkpoints", REPORT_FOLDER, ".hydra"}  # folders that never hold a run's metrics.jsonl
PROCESS_START_SLACK_S = 2.0  # /proc's boot time is whole seconds; clocks drift a little


class ReportInputError(ValueError):
    """A path or a run's file the report cannot use; its message is the one line the user sees."""


@dataclass
class Run:
    """One run directory's records, read once."""

    path: Path
    rows: list[Row]  # metrics.jsonl, in order, as the row types (a kind no type names left out)
    config: dict  # config.yaml flattened to dotted keys ("inner.H": 5)
    plan: dict  # plan.json: the plan check, the hashes, the data fingerprint, updates run
    status: str  # one of STATUSES, or the `end` row's own word (e.g. `preempted`)
    cut_short: bool = False  # its last line was cut short (a crash mid-write, or a row being written)
    resolved: dict = field(default_factory=dict)  # config.yaml as nested containers (the clock reads it)

    @property
    def replicas(self) -> int:
        return self.config["replicas"]

    def of_kind(self, kind: str) -> list[Row]:
        return [row for row in self.rows if row.kind == kind]

    @property
    def resumed(self) -> int:
        """How many times the run was resumed (one `resume` row per resumed session)."""
        return len(self.of_kind("resume"))

    def sessions(self) -> list[list[Row]]:
        """The rows split at each `start` row (a resumed run has several sessions)."""
        return sessions(self.rows)

    def summary(self) -> dict:
        """The last session's summary rows merged (a resumed run: what it ran last; {} without any)."""
        return merged_summary((self.sessions() or [[]])[-1])

    def heldout(self) -> list[EvalRow | SyncRow | ArrivalRow]:
        """The held-out curve of the global weights, in order: every `eval` row (the one before
        training; with fragments, one after every round of H updates and at the end) and every `sync`
        or `arrival` row that holds an `eval_loss` (DiLoCo's one sync per round; a fragment's sync holds
        none; outer.schedule=async: every outer.arrivals.eval_every arrivals, `update` counting server
        updates)."""
        return [
            row
            for row in self.rows
            if isinstance(row, EvalRow)
            or (isinstance(row, SyncRow | ArrivalRow) and row.eval_loss is not None)
        ]

    def params(self) -> int | None:
        """The trained model's parameters (the summary's `model/params`, from any session; None without)."""
        given = [row.values.get("model/params") for row in self.rows if row.kind == "summary"]
        given = [value for value in given if value is not None]
        return given[-1] if given else None

    def async_jobs_bytes(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """outer.schedule=async (docs/async.md, "The schedule" and "Codecs"): per arrival row, its `update`
        and each job's (replica, bytes moved), `ArrivalRow.moved` of the trained model's N parameters."""
        n = self.params() or 0
        return [(row.update, row.moved(n)) for row in self.of_kind("arrival")]

    def async_bytes(self) -> dict[int, int]:
        """Per server update (each arrival row's `update`), the outer bytes moved so far by the replica
        that moved most (`async_jobs_bytes`). {} for a run without arrival rows."""
        moved: dict[int, int] = {}
        by_replica: dict[int, int] = {}
        for update, jobs in self.async_jobs_bytes():
            for replica, sent in jobs:
                by_replica[replica] = by_replica.get(replica, 0) + sent
            moved[update] = max(by_replica.values(), default=0)
        return moved

    def outer_total_bytes(self) -> int:
        """Outer bytes one replica sent in all its syncs (the ideal ring all-reduce's): the summary's
        `comm/outer_total_bytes`, or, in a run without it (written before it, or with no final summary),
        the last sync row's running total `comm_outer_total` (0 before the first sync). An async run
        (arrival rows): the most one replica moved, uploads and downloads (`async_bytes`)."""
        moved = self.async_bytes()
        if moved:
            return list(moved.values())[-1]
        total = self.summary().get("comm/outer_total_bytes")
        if total is not None:
            return total
        syncs = self.of_kind("sync")
        return syncs[-1].comm_outer_total if syncs else 0

    def outer_peak_bytes(self) -> int:
        """The most outer bytes one replica sent in one sync (a fragment's sync with fragments): the
        summary's `comm/outer_peak_bytes`, or, in a run without it, the largest `comm_outer_bytes` of
        its sync rows (0 before the first sync). An async run: the most one job moved, its upload and
        download (`async_jobs_bytes`: 8 N bytes without a codec)."""
        jobs = self.async_jobs_bytes()
        if jobs:
            return max(sent for _, moved in jobs for _, sent in moved)
        peak = self.summary().get("comm/outer_peak_bytes")
        if peak is not None:
            return peak
        return max((row.comm_outer_bytes for row in self.of_kind("sync")), default=0)


def sessions(rows: list[Row]) -> list[list[Row]]:
    """`rows` split at each `start` row; rows before the first start row form a session of their own."""
    out: list[list[Row]] = []
    for row in rows:
        if isinstance(row, StartRow) or not out:
            out.append([])
        out[-1].append(row)
    return out


def natural(path: Path) -> list:
    """`path` as a sort key that orders its numbers by value: a sweep's jobs 0, 1, 2, 10, 11."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def find_runs(paths: list[Path]) -> list[Path]:
    """Every run directory at or under `paths`, each once, in natural order (`natural`: a sweep's job
    10 after its job 9); ReportInputError for a path that does not exist or holds no run."""
    found: set[Path] = set()
    for path in paths:
        if not path.exists():
            raise ReportInputError(f"PATH={path} does not exist; {VALID_PATH}")
        if not path.is_dir():
            raise ReportInputError(f"PATH={path} is not a directory; {VALID_PATH}")
        runs = [path] if (path / METRICS_FILE).is_file() else _runs_under(path)
        if not runs:
            raise ReportInputError(f"PATH={path} holds no {METRICS_FILE}; {VALID_PATH}")
        found.update(run.resolve() for run in runs)
    return sorted(found, key=natural)


def _runs_under(folder: Path) -> list[Path]:
    runs = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED)
        if METRICS_FILE in filenames:
            runs.append(Path(dirpath))
            dirnames[:] = []  # a run directory holds no other run
    return runs


# The fields of each row kind the report reads (run.records writes them all). A fragment's sync row
# (Streaming DiLoCo: it holds `fragment`) has no held-out loss: that has its own `eval` row.
REQUIRED = {
    "eval": ("update", "eval_loss"),
    "sync": ("update", "eval_loss", "comm_inner_total", "comm_outer_total", "comm_outer_bytes"),
    "fragment sync": ("update", "comm_inner_total", "comm_outer_total", "comm_outer_bytes"),
    "update": ("update", "loss", "loss_mean"),
}
VALID_FILES = f"valid: a run directory holds {METRICS_FILE}, config.yaml and plan.json as a run writes them"


def _read(path: Path, parse):
    """`parse(path)`, or ReportInputError naming the file: missing, unreadable, not JSON or YAML."""
    try:
        return parse(path)
    except FileNotFoundError:
        raise ReportInputError(f"{path} is missing; {VALID_FILES}") from None
    except (OSError, ValueError, UnicodeDecodeError, yaml.YAMLError, OmegaConfBaseException) as e:
        why = " ".join(str(e).split())[:200] or type(e).__name__
        raise ReportInputError(f"{path} cannot be read ({why}); {VALID_FILES}") from None


def _check_rows(path: Path, rows: list) -> None:
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or "kind" not in row:
            raise ReportInputError(f"{path}: row {number} is not a metrics row (no kind); {VALID_FILES}")
        kind = "fragment sync" if row["kind"] == "sync" and "fragment" in row else row["kind"]
        missing = [key for key in REQUIRED.get(kind, ()) if key not in row]
        if missing:
            raise ReportInputError(
                f"{path}: row {number} ({row['kind']}) lacks {', '.join(missing)}; {VALID_FILES}"
            )


def read_rows(path: Path) -> tuple[list[dict], bool]:
    """metrics.jsonl's rows, and whether its last line was cut short: a last line with no newline
    that is not JSON (a crash mid-write, or a row being written now) is left out; any other line
    that is not JSON is an error (read_metrics')."""
    try:
        return read_metrics(path), False
    except ValueError as error:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.endswith("\n"):
            raise
        try:
            return [
                json_row(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()
            ], True
        except ValueError:
            raise error from None


def load_run(run_dir: Path, host: str | None = None, need_plan: bool = True) -> Run:
    """Read one run directory; ReportInputError naming the file that is missing or unreadable. Without
    `need_plan` a missing plan.json reads as no plan facts (`python -m hypertrain.clock` needs none)."""
    metrics, config, plan = run_dir / METRICS_FILE, run_dir / "config.yaml", run_dir / "plan.json"
    rows, cut_short = _read(metrics, read_rows)
    _check_rows(metrics, rows)
    tree = _read(config, lambda path: OmegaConf.to_container(OmegaConf.load(path), resolve=True))
    if not isinstance(tree, dict) or "replicas" not in tree:
        raise ReportInputError(f"{config} is not a run's resolved config (no replicas); {VALID_FILES}")
    if need_plan or plan.exists():
        facts = _read(plan, lambda path: json.loads(path.read_text(encoding="utf-8")))
    else:
        facts = {}
    if not isinstance(facts, dict):
        raise ReportInputError(f"{plan} is not a run's plan facts (not a JSON object); {VALID_FILES}")
    # A config written before today's fields reads in today's shape (a run from before Streaming DiLoCo
    # as the plain DiLoCo it ran), so it differs from today's runs only where it truly does.
    try:
        config = flatten(formats.upgrade_config(tree, what=str(config)))
    except UserError as e:  # a newer hypertrain's run
        raise ReportInputError(str(e)) from None
    typed = [row for row in map(parse, rows) if row is not None]
    return Run(run_dir, typed, config, facts, run_status(typed, host), cut_short, tree)


def run_status(rows: list[Row | dict], host: str | None = None) -> str:
    """The status of the run's last session (see the module docstring); `host` defaults to this one."""
    rows = [row for row in map(parse, rows) if row is not None]
    last = sessions(rows)[-1] if rows else []
    ends = [row for row in last if isinstance(row, EndRow)]
    if ends:
        return "unknown" if ends[-1].status is None else ends[-1].status
    start = last[0] if last and isinstance(last[0], StartRow) else StartRow()
    if start.pid is None or start.host is None:
        return "unknown"
    if start.host != (host or socket.gethostname()):
        return "unknown"
    return "running" if process_alive(int(start.pid), float(start.time)) else "crashed"


def process_alive(pid: int, started_by: float) -> bool:
    """Whether process `pid` lives (not a zombie) and started no later than `started_by` (epoch
    seconds): a pid reused by a newer process is not the run's. Without /proc, liveness alone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return True
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, starttime 22
    if fields[0] in ("Z", "X"):
        return False
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return started <= started_by + PROCESS_START_SLACK_S
