"""Runs that differ only in their seeds, as one group: its mean and spread (docs/report.md, "Over seeds").

`seed_groups(runs, keys)` groups the finished runs whose differing config values (`keys`) are the same
but for SEED_KEYS; a run that did not finish is a group of its own. `group_rows` gives each group's
mean, min, max and standard deviation of the figures that vary with a seed, `band` a group's curve.
"""

from __future__ import annotations

import json
import statistics

from hypertrain.report.runs import Run

SEED_KEYS = (
    "seed",
    "data.shuffle_seed",
    "churn.seed",
)  # the initial weights, the data order, the churn draws
# (key, title, format) per figure a group averages: those that move with a seed (bytes and updates do not).
AVERAGED = (
    ("heldout_final", "held-out final", "{:.4f}"),
    ("heldout_best", "held-out best", "{:.4f}"),
    ("train_loss_final", "train loss final", "{:.4f}"),
    ("time_to_target_s", "time to target s", "{:.4g}"),
    ("simulated_s", "simulated s", "{:.4g}"),
    ("wall_s", "wall s", "{:.2f}"),
    ("goodput", "goodput", "{:.3f}"),
)
SPREAD = "mean (min to max)"  # what a group's cell shows; the header says so


def seed_groups(runs: list[Run], keys: list[str]) -> list[list[int]]:
    """The runs' indices grouped: finished runs with the same values of every key in `keys` (the
    differing keys) but SEED_KEYS form one group; a run that did not finish is one of its own (its last
    figures are not a result). In the order of each group's first run."""
    groups: dict[str, list[int]] = {}
    for i, run in enumerate(runs):
        same = json.dumps([run.config.get(key) for key in keys if key not in SEED_KEYS], sort_keys=True)
        groups.setdefault(same if run.status == "finished" else f"{i} alone", []).append(i)
    return list(groups.values())


def grouped(groups: list[list[int]]) -> bool:
    """Whether some group holds more than one run (else the report reads as it did before groups)."""
    return any(len(group) > 1 for group in groups)


def stats(values: list[float | None]) -> dict | None:
    """Mean, min, max, standard deviation (n - 1 in the denominator; 0 for one value) and n of `values`,
    in float64; None when a run lacks the figure (a mean over the runs that have it would hide those
    that do not: a run that never reached the target)."""
    if not values or any(value is None for value in values):
        return None
    values = [float(value) for value in values]
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "std": spread,
        "n": len(values),
    }


def cell(figure: dict | None, form: str) -> str:
    """A group's figure as the table shows it: `mean (min to max)`, the value alone for one run, `-` for
    none."""
    if figure is None:
        return "-"
    mean = form.format(figure["mean"])
    if figure["n"] == 1:
        return mean
    return f"{mean} ({form.format(figure['min'])} to {form.format(figure['max'])})"


def group_rows(runs: list[Run], rows: list[dict], groups: list[list[int]], keys: list[str]) -> list[dict]:
    """One row per group: `runs` (its runs' names), `n`, `config` (the differing keys but seeds),
    `seeds` (each seed key's values, in its runs' order), each AVERAGED figure's `stats` (of `rows`:
    table.table_rows'), `status` and `data` (its runs' flags, counted)."""
    out = []
    for group in groups:
        members = [rows[i] for i in group]
        first = runs[group[0]]
        flags = [row["data"] for row in members if row["data"]]
        data = ", ".join(f"{flag} ({flags.count(flag)} of {len(group)})" for flag in dict.fromkeys(flags))
        out.append(
            {
                "runs": [row["run"] for row in members],
                "n": len(group),
                "config": {key: first.config.get(key) for key in keys if key not in SEED_KEYS},
                "seeds": {key: [runs[i].config.get(key) for i in group] for key in keys if key in SEED_KEYS},
                "status": members[0]["status_note"] if len(group) == 1 else "finished",
                "data": data if len(group) > 1 else members[0]["data"],
            }
            | {key: stats([row.get(key) for row in members]) for key, _, _ in AVERAGED}
        )
    return out


def group_columns(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The groups' table: titles and formatted cells (goodput only when some group has it)."""
    config = list(rows[0]["config"]) if rows else []
    seeds = list(rows[0]["seeds"]) if rows else []
    shown = [f for f in AVERAGED if f[0] != "goodput" or any(row["goodput"] for row in rows)]
    titles = [
        "runs",
        *config,
        "n",
        *seeds,
        *(f"{title}: {SPREAD}" for _, title, _ in shown),
        "status",
        "data",
    ]
    body = [
        [
            ", ".join(row["runs"]),
            *("-" if row["config"][key] is None else str(row["config"][key]) for key in config),
            str(row["n"]),
            *(",".join(str(value) for value in row["seeds"][key]) for key in seeds),
            *(cell(row[key], form) for key, _, form in shown),
            row["status"],
            row["data"],
        ]
        for row in rows
    ]
    return titles, body


def band(
    curves: list[list[tuple[int, float, float]]],
) -> tuple[list[float], list[float], list[float], list[float]]:
    """A group's curve from its runs' `(update, x, y)` points: at each update every run has (in the
    first run's order; a run's last point of an update counts), the mean x, and the mean, min and max y."""
    points = [{update: (x, y) for update, x, y in curve} for curve in curves]
    common = [update for update in points[0] if all(update in run for run in points[1:])]
    xs, mean, low, high = [], [], [], []
    for update in common:
        at = [run[update] for run in points]
        ys = [y for _, y in at]
        xs.append(statistics.fmean(x for x, _ in at))
        mean.append(statistics.fmean(ys))
        low.append(min(ys))
        high.append(max(ys))
    return xs, mean, low, high
