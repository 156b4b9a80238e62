"""The network clock's study (docs/clock.md, "Study"): which setting of finished sweeps reaches plain
DiLoCo's final held-out loss first, in simulated time, scaled to a model of N parameters on a modelled
device, on several links between replicas. No retraining: every run is replayed from its records
(`hypertrain.clock.replay.clock_of`). Prints one markdown table; draws one plot (log-scale bars of the
simulated seconds to the target, one group per run, one bar per link; "never" where a run does not reach it).

    python experiments/clock_study.py SWEEP [SWEEP ...] [--model-params N] [--device h100]
        [--links datacenter_100g cross_region_10g internet_1g] [--out PLOT.png]

In each SWEEP (a folder of runs) the target is the final held-out loss of its plain DiLoCo run (one
fragment, no delay, no merge alpha, no compression); each run's columns name what differs from it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from hypertrain.clock.replay import clock_of, time_to_loss
from hypertrain.records.formats import upgrade_config
from hypertrain.report.clock.retime import compose_cluster
from hypertrain.rundir.records import METRICS_FILE, read_metrics

SETTINGS = (("outer.fragments", "P"), ("outer.delay", "tau"), ("outer.merge_alpha", "alpha"))
SETTINGS += (("outer.compress", "compress"), ("outer.error_feedback", "error feedback"))
SETTINGS += (("outer.overlap", "overlap"), ("outer.lr", "outer lr"))
SETTINGS += (
    ("outer.codec.transform", "transform"),
    ("outer.topk.fraction", "k"),
    ("outer.lowrank.rank", "rank"),
)
SETTINGS += (("outer.name", "outer"),)
PLAIN = {"outer.fragments": 1, "outer.delay": 0, "outer.merge_alpha": 0.0, "outer.compress": "none"}
PLAIN |= {"outer.overlap": "none"}


def setting(resolved: dict) -> dict:
    outer = resolved["outer"]
    values = {key: outer.get(key.split(".")[1]) for key, _ in SETTINGS}
    values["outer.lowrank.rank"] = (outer.get("lowrank") or {}).get("rank")  # a node: low rank's alone
    return values


def label(values: dict) -> str:
    parts = [f"P={values['outer.fragments']}", f"tau={values['outer.delay']}"]
    parts.append(f"alpha={values['outer.merge_alpha']}")
    if values["outer.compress"] not in (None, "none"):
        codec = values["outer.compress"]
        if values.get("outer.codec.transform") not in (None, "none"):  # docs/compression.md, issue 37
            codec = f"{values['outer.codec.transform']} {codec}"
        if codec.endswith("topk") and values.get("outer.topk.fraction") not in (None, 0.01):
            codec += f" {values['outer.topk.fraction']:g}"
        if codec.endswith("lowrank"):
            codec += f" r={values['outer.lowrank.rank']}"
        parts.append(codec + (" +EF" if values["outer.error_feedback"] else ""))
    if values.get("outer.name") not in (None, "nesterov", "average"):  # a preset: outer=sparseloco
        parts.append(f"({values['outer.name']})")
    if values["outer.overlap"] not in (None, "none"):  # docs/overlap.md
        parts.append(f"{values['outer.overlap']} outer lr={values['outer.lr']}")
    return " ".join(parts)


def sweep_runs(sweep: Path) -> list[tuple[Path, list[dict], dict]]:
    runs = []

    def job_order(metrics: Path) -> tuple:  # a multirun's jobs in their number's order (0_..., 1_..., 10_...)
        return tuple(int(part) if part.isdigit() else part for part in metrics.parent.name.split("_"))

    for metrics in sorted(sweep.rglob(METRICS_FILE), key=lambda p: (str(p.parent.parent), job_order(p))):
        run = metrics.parent
        resolved = upgrade_config(OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=True))
        runs.append((run, read_metrics(run), resolved))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    parser.add_argument("--model-params", type=int, default=1_000_000_000)
    parser.add_argument("--device", default="h100")
    parser.add_argument("--links", nargs="+", default=["datacenter_100g", "cross_region_10g", "internet_1g"])
    parser.add_argument("--out", type=Path, default=None, help="the plot (PNG); none when not given")
    args = parser.parse_args()
    clusters = {
        link: compose_cluster([f"cluster={args.device}", f"cluster/inter={link}"]) for link in args.links
    }

    table = []  # (sweep, label, final held-out, {link: (seconds to target | None, vs plain)})
    for sweep in args.sweeps:
        runs = sweep_runs(sweep)
        plain = [r for r in runs if all(setting(r[2])[k] == v for k, v in PLAIN.items())]
        if len(plain) != 1:
            print(f"{sweep}: {len(plain)} plain DiLoCo runs, need exactly one", file=sys.stderr)
            return 2
        timed = {
            run: {link: clock_of(rows, resolved, c, args.model_params) for link, c in clusters.items()}
            for run, rows, resolved in runs
        }
        target = timed[plain[0][0]][args.links[0]]["heldout"][-1]["eval_loss"]
        base = {link: time_to_loss(timed[plain[0][0]][link]["heldout"], target) for link in args.links}
        for run, _, resolved in runs:
            final = timed[run][args.links[0]]["heldout"][-1]["eval_loss"]
            times = {link: time_to_loss(timed[run][link]["heldout"], target) for link in args.links}
            table.append((sweep.name, label(setting(resolved)), target, final, times, base))

    head = ["sweep", "setting", "target", "held-out final"]
    head += [f"{link} s (vs plain)" for link in args.links]
    print(f"simulated seconds to the target on {args.device}, {args.model_params:,} parameters")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for sweep, name, target, final, times, base in table:
        cells = [sweep, name, f"{target:.4f}", f"{final:.4f}"]
        for link in args.links:
            t = times[link]
            cells.append("never" if t is None else f"{t:.4g} ({base[link] / t:.2f}x)")
        print("| " + " | ".join(cells) + " |")
    if args.out is not None:
        plot(table, args, args.out)
        print(f"plot: {args.out}")
    return 0


def plot(table: list, args, out: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(args.links)
    names = [f"{sweep}: {name}" for sweep, name, *_ in table]
    for i, link in enumerate(args.links):
        xs = [x + (i - (len(args.links) - 1) / 2) * width for x in range(len(table))]
        seconds = [row[4][link] for row in table]
        reached = [(x, t) for x, t in zip(xs, seconds, strict=True) if t is not None]
        ax.bar([x for x, _ in reached], [t for _, t in reached], width, label=link)
        for x, t in zip(xs, seconds, strict=True):
            if t is None:  # at the bottom of the axes, whatever the scale
                ax.text(
                    x,
                    0.02,
                    "never",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    transform=ax.get_xaxis_transform(),
                )
    ax.set_yscale("log")
    ax.set_xticks(range(len(table)), names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("simulated s to the target")
    ax.set_title(
        f"Simulated seconds to plain DiLoCo's final held-out loss: {args.model_params:,} parameters on "
        f"{args.device} (modelled), by link between replicas"
    )
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


if __name__ == "__main__":
    sys.exit(main())
