"""The benchmark phases' table: one row per phase and world from the runs of an `experiment=phases` sweep.

`PhasesTable` (a Hydra callback) writes `phases.md` and `phases.json` into the sweep directory when
the sweep ends, and prints the markdown; `python -m hypertrain.report.phases SWEEP_DIR` rebuilds it.
docs/report.md, "The phases table", says what each column is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from hypertrain.model.spec import model_spec
from hypertrain.records.files import METRICS_FILE, merged_summary, read_records
from hypertrain.records.rows import EndRow

TABLE_MD, TABLE_JSON = "phases.md", "phases.json"


def job_row(job_dir: Path) -> dict:
    """One run's figures: its summary rows merged, its phase and world, its end status."""
    rows = read_records(job_dir / METRICS_FILE)
    summary = merged_summary(rows)
    cfg = OmegaConf.load(job_dir / "config.yaml")
    end = rows[-1] if rows and isinstance(rows[-1], EndRow) else EndRow(status="crashed")
    per_rank = summary.get("bench/samples_per_s_per_rank", [])
    return {
        "job": job_dir.name,
        "phase": cfg.phase.name,
        "kind": cfg.phase.kind,
        "world": cfg.world.size,
        "processes": summary.get("env/processes"),
        "layout": summary.get("engine/layout"),
        "timed_updates": summary.get("bench/timed_updates"),
        "timing_warmup": cfg.phase.timing_warmup,
        "samples_per_s": summary.get("bench/samples_per_s"),
        "samples_per_s_per_rank": sum(per_rank) / len(per_rank) if per_rank else None,
        "tokens_per_s": summary.get("bench/tokens_per_s"),
        "padded_tokens_per_s": summary.get("bench/padded_tokens_per_s"),
        "compute_ms_per_update": 1e3 * summary["bench/compute_s_per_update"]
        if "bench/compute_s_per_update" in summary
        else None,
        "allreduce_ms_per_update": 1e3 * summary["bench/allreduce_s_per_update"]
        if "bench/allreduce_s_per_update" in summary
        else None,
        "allreduce_share": summary.get("bench/allreduce_share"),
        "padding_efficiency": summary.get("bench/padding_efficiency"),
        "presentations": summary.get("train/presentations"),
        "unique_ids": summary.get("plan/unique_ids"),
        "device": summary.get("env/device"),
        "torch": summary.get("env/torch"),
        "backend": summary.get("env/backend"),
        "union_sha256": summary.get("plan/union_sha256"),
        "data_order_sha256": summary.get("plan/data_order_sha256"),
        "rank_sha256": summary.get("plan/rank_sha256"),
        "status": end.status,
    } | {column: summary.get(key) for column, key in model_spec(cfg.model).report_figures.items()}


def with_scaling(rows: list[dict]) -> list[dict]:
    """Scaling efficiency of each row against the smallest world of its phase (1.0 there)."""
    out = []
    for row in sorted(rows, key=lambda r: (r["phase"], r["world"])):
        base = min((r for r in rows if r["phase"] == row["phase"]), key=lambda r: r["world"])
        ratio = None
        if row["kind"] == "strong" and base["samples_per_s"] and row["samples_per_s"]:
            ratio = (row["samples_per_s"] / base["samples_per_s"]) / (row["world"] / base["world"])
        elif row["kind"] == "weak" and base["samples_per_s_per_rank"] and row["samples_per_s_per_rank"]:
            ratio = row["samples_per_s_per_rank"] / base["samples_per_s_per_rank"]
        out.append(row | {"scaling_efficiency": ratio, "scaling_base_world": base["world"]})
    return out


COLUMNS = (
    ("phase", "phase", "{}"),
    ("world", "world", "{}"),
    ("samples_per_s", "examples/s", "{:.1f}"),
    ("samples_per_s_per_rank", "examples/s per rank", "{:.1f}"),
    ("frames_per_s", "frames/s", "{:.0f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("padded_tokens_per_s", "padded tokens/s", "{:.0f}"),
    ("compute_ms_per_update", "compute ms/update", "{:.1f}"),
    ("allreduce_ms_per_update", "all-reduce ms/update", "{:.1f}"),
    ("allreduce_share", "all-reduce share", "{:.1%}"),
    ("padding_efficiency", "padding efficiency", "{:.1%}"),
    ("presentations", "presentations", "{}"),
    ("unique_ids", "distinct ids", "{}"),
    ("scaling_efficiency", "scaling efficiency", "{:.2f}"),
    ("status", "status", "{}"),
)


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def cells(rows: list[dict], columns) -> tuple[list[str], list[list[str]]]:
    """A table's titles and each row's cells, formatted by `columns` ((key, title, format) triples);
    a missing value is `-`. The phases table and the run report (hypertrain/report/cli.py) share it."""
    return [title for _, title, _ in columns], [
        [_cell(r.get(key), fmt) for key, _, fmt in columns] for r in rows
    ]


def markdown_table(titles: list[str], body: list[list[str]], pad: bool = False) -> list[str]:
    """A markdown table's lines; with `pad`, each column padded to its widest cell (for a terminal)."""
    widths = (
        [max(len(c) for c in column) for column in zip(titles, *body, strict=True)]
        if pad
        else [0] * len(titles)
    )
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|" if pad else "|" + "---|" * len(titles)
    return [line(titles), rule, *(line(row) for row in body)]


SCALING_NOTE = (
    "Strong: scaling efficiency = throughput ratio / world ratio; weak: per-rank throughput ratio; "
    "both against the phase's smallest world. Throughput after each phase's timing_warmup updates."
)


def measured_on(rows: list[dict]) -> list[str]:
    """One line per run: what it was measured on, its timed window and its plan hashes."""
    return [
        f"{r['phase']} world {r['world']}: {r['processes']} processes ({r['layout']} layout), "
        f"{r['device']}, torch {r['torch']}, {r['backend']}; {r['timed_updates']} timed updates after "
        f"{r['timing_warmup']}; union {r['union_sha256']}, data order {r['data_order_sha256']}, "
        f"ranks {r['rank_sha256']}"
        for r in rows
    ]


def columns_for(rows: list[dict]) -> tuple:
    """The table's columns: frames/s only where some run is multistream (frames of audio)."""
    if any(r.get("frames_per_s") is not None for r in rows):
        return COLUMNS
    return tuple(c for c in COLUMNS if c[0] != "frames_per_s")


def markdown(rows: list[dict]) -> str:
    """The table, then one line per run of what it was measured on and its plan hashes."""
    lines = markdown_table(*cells(rows, columns_for(rows)))
    lines += ["", SCALING_NOTE, ""]
    lines += [f"- {line}" for line in measured_on(rows)]
    return "\n".join(lines) + "\n"


def write_table(sweep_dir: Path) -> str:
    """Read every job of the sweep, write phases.md and phases.json beside them; return the markdown."""
    sweep_dir = Path(sweep_dir)
    jobs = sorted(p.parent for p in sweep_dir.glob(f"*/{METRICS_FILE}"))
    rows = with_scaling([job_row(job) for job in jobs])
    text = markdown(rows)
    (sweep_dir / TABLE_MD).write_text(text)
    (sweep_dir / TABLE_JSON).write_text(json.dumps(rows, indent=2) + "\n")
    return text


class PhasesTable(Callback):
    """Hydra callback of `experiment=phases`: the table once every job of the sweep has run."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(OmegaConf.select(config, "hydra.sweep.dir"))
        if sweep_dir.is_dir():
            print(write_table(sweep_dir), end="")


def main(argv: list[str]) -> int:
    """`python -m hypertrain.report.phases SWEEP_DIR`: the table of a finished sweep, or one line and exit 2
    (nothing written) for a folder that is missing, holds no job, or holds a job whose records
    cannot be read."""
    if len(argv) != 1:
        print("usage: python -m hypertrain.report.phases SWEEP_DIR", file=sys.stderr)
        return 2
    sweep_dir = Path(argv[0])
    valid = "valid: the sweep directory of an experiment=phases run (it holds one folder per job)"
    if not sweep_dir.is_dir():
        return _fail(f"SWEEP_DIR={str(sweep_dir)!r} is not a directory; {valid}")
    if not list(sweep_dir.glob(f"*/{METRICS_FILE}")):
        return _fail(f"{sweep_dir} holds no job (no */{METRICS_FILE}); {valid}")
    try:
        text = write_table(sweep_dir)
    except (ValueError, OSError) as e:  # a job's metrics.jsonl not JSON lines, a file unreadable
        return _fail(f"{sweep_dir}: a job's records cannot be read ({e}); valid: the jobs' own records")
    print(text, end="")
    return 0


def _fail(line: str) -> int:
    print(f"hypertrain: error: {line}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
