"""The asynchronous study (docs/async.md, "Study"; issue 39): four replicas, one twice as slow as the rest
(`cluster.replica_speeds=[1,1,1,0.5]`, Liu et al. 2024's setting), on a phase of 60 inner steps per
replica at H = 5 (12 jobs a replica; 24 for the slow one under DyLU): synchronous DiLoCo (rounds: every
sync waits for the slow replica), naive asynchronous, delayed Nesterov (N = R, c = 0) and delayed
Nesterov with dynamic local updates. The clock times a 1B-parameter model on h100 over cross_region_10g
(`cluster.model_params`), which under async decides the arrival order. Prints one markdown table: each
run's server updates, its final held-out loss and clock, and its held-out loss at a quarter, a half and
three quarters of the synchronous run's clock (the last evaluation by then).

    python experiments/async_study.py OUT [--dry-run] [EXTRA OVERRIDES ...]

OUT/{job}/ holds each run. A failing run is reported, the others go on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from studies import study_parser

UPDATES, H = 60, 5
COMMON = [
    "experiment=quick",
    "replicas=4",
    f"inner.H={H}",
    f"phase.updates={UPDATES}",
    "logger=none",
    "guard.enabled=false",
    "cluster=h100",
    "cluster/inter=cross_region_10g",
    "cluster.model_params=1000000000",
    "cluster.replica_speeds=[1,1,1,0.5]",
]
ASYNC = ["outer.schedule=async"]  # the held-out loss every R = 4 arrivals (outer.arrivals.eval_every=0)
SETTINGS = {  # the study's rows: each setting's overrides
    "synchronous DiLoCo": [],
    "naive async": [*ASYNC, "outer.arrivals.rule=naive"],
    "delayed Nesterov": [*ASYNC, "outer.arrivals.rule=delayed_nesterov"],
    "DN + DyLU": [*ASYNC, "outer.arrivals.rule=delayed_nesterov", "outer.arrivals.dylu=true"],
}


def commands(out: Path, extra: list[str]) -> list[list[str]]:
    train = [sys.executable, "-m", "hypertrain.train", *COMMON, *extra]
    return [
        [*train, *overrides, f"hydra.run.dir={out / str(job)}"]
        for job, overrides in enumerate(SETTINGS.values())
    ]


def curve(run: Path) -> tuple[list[tuple[int, float, float]], dict]:
    """(server update, clock seconds, held-out loss) at every evaluation after the start, and the summary."""
    from hypertrain.records.files import read_records
    from hypertrain.records.rows import ArrivalRow, SummaryRow, SyncRow

    points, summary = [], {}
    for row in read_records(run / "metrics.jsonl"):
        if isinstance(row, SummaryRow):
            summary |= row.values
        elif isinstance(row, SyncRow) and row.eval_loss is not None:
            points.append((row.round, row.figures["clock_s"], row.eval_loss))
        elif isinstance(row, ArrivalRow) and row.eval_loss is not None:
            points.append((row.update, row.clock_s, row.eval_loss))
    return points, summary


def at_clock(points: list[tuple[int, float, float]], seconds: float) -> str:
    """The held-out loss of the last evaluation by `seconds` of the clock."""
    before = [loss for _, clock, loss in points if clock <= seconds]
    return f"{before[-1]:.4f}" if before else "-"


def table(out: Path) -> list[str]:
    runs = {name: curve(out / str(job)) for job, name in enumerate(SETTINGS)}
    sync_end = runs["synchronous DiLoCo"][0][-1][1]
    marks = [sync_end * f for f in (0.25, 0.5, 0.75)]
    lines = [
        "| run | server updates | held-out final | clock end (s) | at 1/4 | at 1/2 | at 3/4 "
        "| staleness mean / max |",
        "|" + "---|" * 8,
    ]
    for name, (points, summary) in runs.items():
        updates, clock, loss = points[-1]
        stale = "-"
        if "async/staleness_mean" in summary:
            stale = f"{summary['async/staleness_mean']:.2f} / {summary['async/staleness_max']}"
        cells = [at_clock(points, t) for t in marks]
        lines.append(f"| {name} | {updates} | {loss:.4f} | {clock:.1f} | {' | '.join(cells)} | {stale} |")
    lines.append("")
    lines.append(f"(the quarters of the synchronous run's clock: {', '.join(f'{t:.1f} s' for t in marks)})")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = study_parser(__doc__).parse_intermixed_args(argv)
    extra = args.extra
    failed = 0
    for cmd in commands(args.out, extra):
        if args.dry_run:
            print(" ".join(cmd))
            continue
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            failed += 1
            print(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}", file=sys.stderr)
    if not args.dry_run and not failed:
        print("\n".join(table(args.out)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
