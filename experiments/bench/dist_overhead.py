"""What real processes cost: per-update time of processes=dist against engine=stacked of the same config.

Each case is one config (phase, model, world, replicas) run through the entry in subprocesses
(`python -m hypertrain.train ... logger=none checkpoint.every=0`) three ways, in one run, the order
rotated every repeat so the shared machine's load falls on all alike:
- dist: `processes=dist` (self-launched workers; the benchmark layout at world 2 and 4, the replicas
  layout with processes.nproc=2), each worker at engine.threads=0 = cores / processes (at least 1);
- stacked: `engine=stacked` in one process at torch's default threads (every core);
- stacked-1t: `engine=stacked engine.threads=1`, the same single process on one core.
Per-update time is rank 0's `train/timed_s / train/timed_updates` (the summary row of metrics.jsonl:
the updates after `phase.timing_warmup`, syncs and rank 0's held-out evals included; process start,
rendezvous and data building are not). The tables give the median and the range over repeats, the
ratio dist/peer formed per repeat, and best/best (the fastest run of each: the least disturbed).
From dist's sync rows: rank 0's payload bytes handed to collectives and seconds in them
(`comm_measured_*`), beside the ideal ring's bytes (`comm_*_bytes`). The final held-out losses of
dist and stacked are printed as a sanity check (equal within rounding, docs/parity.md).

    .venv/bin/python experiments/bench/dist_overhead.py [--repeats 5] [--updates 20] [--save runs.json]

Exits 1 if a run fails; there is no target, only figures (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("dist", "stacked", "stacked-1t")


@dataclass(frozen=True)
class Case:
    label: str
    config: tuple[str, ...]  # overrides every variant shares
    dist: tuple[str, ...]  # overrides that make it processes=dist (process count, layout)
    processes: int


CASES = (
    Case("benchmark W2 R1 (L 2)", ("world=2", "replicas=1"), ("processes.layout=benchmark",), 2),
    Case("benchmark W4 R2 (L 2)", ("world=4", "replicas=2"), ("processes.layout=benchmark",), 4),
    Case(
        "replicas P2 W4 R4", ("world=4", "replicas=4"), ("processes.nproc=2", "processes.layout=replicas"), 2
    ),
)


def overrides(case: Case, variant: str, updates: int, warmup: int) -> list[str]:
    common = [
        "phase=cpu_strong",
        f"phase.updates={updates}",
        f"phase.timing_warmup={warmup}",
        "inner.H=5",
        "logger=none",
        "checkpoint.every=0",  # training only: no checkpoint writes or state gathers in the timing
        *case.config,
    ]
    if variant == "dist":
        return [*common, "processes=dist", *case.dist]
    return [*common, "engine=stacked", *(["engine.threads=1"] if variant == "stacked-1t" else [])]


def run_once(args: list[str], run_dir: Path, warmup: int) -> dict:
    """One run through the entry: its per-update time, final held-out loss, the subprocess's wall
    seconds, and the sync rows' communication summed over the rounds that lie wholly in the timed window."""
    command = [sys.executable, "-m", "hypertrain.train", *args, f"hydra.run.dir={run_dir}"]
    env = os.environ | {"WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "0"}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in rows if r["kind"] == "summary" and "train/timed_s" in r)
    timed, first = [], 1  # (sync row, updates in its round) for rounds that start after the warm-up
    for row in (r for r in rows if r["kind"] == "sync"):
        if first > warmup:
            timed.append((row, row["update"] - first + 1))
        first = row["update"] + 1
    keys = ("comm_inner_bytes", "comm_outer_bytes") + tuple(
        f"comm_measured_{k}_{u}" for k in ("inner", "outer") for u in ("bytes", "s")
    )
    return {
        "update_s": summary["train/timed_s"] / summary["train/timed_updates"],
        "wall_s": wall,
        "final_loss": summary["eval/final_loss"],
        "updates": sum(n for _, n in timed),
        "syncs": len(timed),
        **{k: sum(row.get(k, 0) for row, _ in timed) for k in keys},
    }


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """median [min-max]"""
    return (
        f"{statistics.median(values) * scale:.{digits}f} "
        f"[{min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f}]"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--updates", type=int, default=20, help="phase.updates (cpu_strong: 64 ids each)")
    parser.add_argument("--warmup", type=int, default=5, help="phase.timing_warmup: updates not timed")
    parser.add_argument("--save", default="", help="also write every run's figures to this JSON file")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    over = sorted({c.processes for c in CASES if c.processes > cores})
    print(
        f"{cores} cores, shared by every process of a run: dist's P workers run at max(1, {cores} // P) "
        "thread(s) each"
        + (f" (P = {', '.join(map(str, over))} oversubscribes the cores)" if over else "")
        + ", stacked at torch's default threads in one process, stacked-1t at 1 thread; so P "
        "single-threaded processes and one process compete for the cores differently, and the "
        "machine's other load moves all of them."
    )
    print(
        f"config: phase=cpu_strong (64 ids per update) phase.updates={args.updates} "
        f"phase.timing_warmup={args.warmup} inner.H=5, model tiny, logger=none checkpoint.every=0; "
        f"{args.repeats} repeats, the variants' order rotated every repeat\n"
    )
    load_before = os.getloadavg()
    results: dict[tuple[str, str], list[dict]] = {(c.label, v): [] for c in CASES for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="dist_overhead_") as tmp:
        for repeat in range(args.repeats):
            for case in CASES:
                k = repeat % len(VARIANTS)
                for variant in VARIANTS[k:] + VARIANTS[:k]:
                    run_dir = Path(tmp) / f"{repeat}-{CASES.index(case)}-{variant}"
                    out = run_once(overrides(case, variant, args.updates, args.warmup), run_dir, args.warmup)
                    results[(case.label, variant)].append(out)
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    print(
        "load average (1, 5, 15 min) before: {:.1f} {:.1f} {:.1f}, after: {:.1f} {:.1f} {:.1f}".format(
            *load_before, *os.getloadavg()
        )
    )
    if args.save:
        Path(args.save).write_text(json.dumps({f"{c} | {v}": r for (c, v), r in results.items()}, indent=1))

    print("\nms per update, median [min-max] over repeats; wall: median seconds of a whole run (startup too)")
    print(f"{'case':<22} {'P':>2} {'dist':>19} {'stacked':>19} {'stacked-1t':>19} {'wall dist, stacked':>19}")
    times = {}
    for case in CASES:
        runs = {v: results[(case.label, v)] for v in VARIANTS}
        times[case] = t = {v: [r["update_s"] for r in runs[v]] for v in VARIANTS}
        walls = [statistics.median(r["wall_s"] for r in runs[v]) for v in ("dist", "stacked")]
        print(
            f"{case.label:<22} {case.processes:>2} {spread(t['dist'], 1e3):>19} "
            f"{spread(t['stacked'], 1e3):>19} {spread(t['stacked-1t'], 1e3):>19} "
            f"{walls[0]:>11.1f}, {walls[1]:>5.1f}"
        )
    print(
        "\nratio of per-update times: median [min-max] of the per-repeat ratios; best/best = the fastest "
        "dist run over the fastest peer run (the least disturbed of each)"
    )
    print(f"{'case':<22} {'dist/stacked':>18} {'best/best':>10} {'dist/stacked-1t':>18} {'best/best':>10}")
    for case in CASES:
        t = times[case]
        row = f"{case.label:<22}"
        for peer in ("stacked", "stacked-1t"):
            ratios = [d / s for d, s in zip(t["dist"], t[peer], strict=True)]
            row += f" {spread(ratios, digits=2):>18} {min(t['dist']) / min(t[peer]):>10.2f}"
        print(row)

    print(
        "\ndist's collectives, rank 0 (measured: payload bytes handed to collectives, seconds in them; "
        "formula: bytes an ideal ring all-reduce sends per participant)"
    )
    print(
        f"{'case':<22} {'inner B/update':>15} {'formula':>9} {'inner ms/update':>17} {'% of update':>11} "
        f"{'outer B/sync':>13} {'formula':>9} {'outer ms/sync':>15} {'held-out dist - stacked':>24}"
    )
    for case in CASES:
        runs = results[(case.label, "dist")]
        first = runs[0]
        per_update = lambda r, key: r[key] / r["updates"]  # noqa: E731
        per_sync = lambda r, key: r[key] / r["syncs"]  # noqa: E731
        inner_ms = [per_update(r, "comm_measured_inner_s") for r in runs]
        share = [per_update(r, "comm_measured_inner_s") / r["update_s"] for r in runs]
        outer_ms = [per_sync(r, "comm_measured_outer_s") for r in runs]
        losses = [
            d["final_loss"] - s["final_loss"]
            for d, s in zip(runs, results[(case.label, "stacked")], strict=True)
        ]
        print(
            f"{case.label:<22} {per_update(first, 'comm_measured_inner_bytes'):>15,.0f} "
            f"{per_update(first, 'comm_inner_bytes'):>9,.0f} {spread(inner_ms, 1e3, 2):>17} "
            f"{statistics.median(share):>10.0%} "
            f"{per_sync(first, 'comm_measured_outer_bytes'):>13,.0f} "
            f"{per_sync(first, 'comm_outer_bytes'):>9,.0f} "
            f"{spread(outer_ms, 1e3, 2):>15} {max(losses, key=abs):>+24.2e}"
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        print(f"dist_overhead: a run failed: {e}", file=sys.stderr)
        sys.exit(1)
