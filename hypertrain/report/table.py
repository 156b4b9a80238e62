"""The comparison table: one row per run, with the config values that differ between the runs.

`differing_keys(runs)` finds the keys that differ (those that change no number left out),
`data_flags(runs)` the runs that saw other data or another order than their peers, `table_rows` each
run's figures (docs/report.md, "The table" and "Comparing honestly").
"""

from __future__ import annotations

import json
from collections import Counter

from hypertrain.clock.replay import time_to_loss
from hypertrain.config import MAY_CHANGE
from hypertrain.records.rows import Row, SummaryRow, UpdateRow
from hypertrain.report.runs import Run

NOT_COMPARED = MAY_CHANGE  # config sections that may differ without changing a run's numbers
# Keys a run derives from others and writes to its config: they differ only where those do.
DERIVED = {"outer.assignment"}  # the fragments' parameters: from outer.fragments and the model
DIFFERENT_DATA = "saw different data"
OTHER_ORDER = "saw another data order"

# (key, title, format) per figure column, after the run's name and its differing config values.
FIGURES = (
    ("heldout_final", "held-out final", "{:.4f}"),
    ("heldout_best", "held-out best", "{:.4f}"),
    ("train_loss_final", "train loss final", "{:.4f}"),
    ("updates", "updates", "{}"),
    ("replica_steps_per_s", "replica-steps/s", "{:.1f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("comm_inner_bytes", "inner bytes/rank", "{:,}"),
    ("comm_outer_bytes", "outer bytes/replica", "{:,}"),
    ("comm_outer_peak_bytes", "outer peak bytes/sync", "{:,}"),
    ("arrivals", "arrivals", "{}"),
    ("server_updates", "server updates", "{}"),
    ("staleness_mean", "staleness mean", "{:.2f}"),
    ("staleness_max", "staleness max", "{}"),
    ("async_clock_s", "async clock s", "{:.4g}"),
    ("wall_s", "wall s", "{:.2f}"),
    ("simulated_s", "simulated s", "{:.4g}"),
    ("compute_util", "compute util", "{:.3f}"),
    ("time_to_target_s", "time to target s", "{:.4g}"),
    ("goodput", "goodput", "{:.3f}"),
    ("status_note", "status", "{}"),
    ("data", "data", "{}"),
)


def _same(value) -> str:
    return json.dumps(value, sort_keys=True)


def differing_keys(runs: list[Run]) -> list[str]:
    """Config keys whose value is not the same in every run (a key some runs lack counts; DERIVED
    keys left out), ordered by how many runs leave the key's most common value (swept keys before a
    single hand-made difference), then by their order in the config."""
    order: dict[str, int] = {}
    for run in runs:
        for key in run.config:
            order.setdefault(key, len(order))
    keys = [k for k in order if k.split(".")[0] not in NOT_COMPARED and k not in DERIVED]
    spread = {}
    for key in keys:
        values = Counter(_same(run.config.get(key)) for run in runs)
        if len(values) > 1:
            spread[key] = len(runs) - values.most_common(1)[0][1]
    return sorted(spread, key=lambda k: (-spread[k], order[k]))


def phase_of(run: Run):
    """The phase a run trained (its `phase.name`): runs of different phases are meant to see
    different data (a strong and a weak phase have different ids, so different union hashes)."""
    return run.config.get("phase.name")


def _data(run: Run) -> tuple:
    return run.plan.get("data/fingerprint"), run.plan.get("plan/union_sha256")


def data_flags(runs: list[Run]) -> list[str]:
    """Per run: '' (saw what most runs of its phase saw; ties go to the earlier run), DIFFERENT_DATA
    (another data fingerprint or union hash than most runs of its phase), or OTHER_ORDER (the same
    data, and among the runs of its phase with its R, another data-order digest than most of them).
    Runs of different phases are never compared."""
    flags = [""] * len(runs)
    for phase in dict.fromkeys(phase_of(run) for run in runs):
        same_phase = [i for i, run in enumerate(runs) if phase_of(run) == phase]
        data = {i: _data(runs[i]) for i in same_phase}
        reference = Counter(data.values()).most_common(1)[0][0]
        for i in same_phase:
            if data[i] != reference:
                flags[i] = DIFFERENT_DATA
        for replicas in dict.fromkeys(runs[i].replicas for i in same_phase):
            same_r = [i for i in same_phase if runs[i].replicas == replicas and not flags[i]]
            if not same_r:
                continue
            orders = [runs[i].plan.get("plan/data_order_sha256") for i in same_r]
            usual = Counter(orders).most_common(1)[0][0]
            for i, order in zip(same_r, orders, strict=True):
                if order != usual:
                    flags[i] = OTHER_ORDER
    return flags


def _last(values: list):
    given = [value for value in values if value is not None]
    return given[-1] if given else None


def session_seconds(session: list[Row]) -> float:
    """A session's training seconds: its final summary's `train/wall_s`, or, when it stopped before
    writing one, the `wall` of its last update row (the end of the last round it logged)."""
    wall = _last([row.values.get("train/wall_s") for row in session if isinstance(row, SummaryRow)])
    if wall is None:
        wall = _last([row.wall for row in session if isinstance(row, UpdateRow)])
    return float(wall or 0.0)


def async_steps_done(arrivals: list, replicas: int) -> int:
    """outer.schedule=async (docs/async.md): the updates a run has done are the inner steps of its
    slowest replica, counted from the jobs its arrival rows applied (a job ends at its replica's step
    `first + steps`), and with churn the jobs they list absent or dropped (their steps are taken too);
    a replica none of whose jobs arrived yet has done 0."""
    reached = dict.fromkeys(range(replicas), 0)
    for row in arrivals:
        jobs = list(zip(row.replicas, row.first, row.steps, strict=True))
        jobs += [(j["replica"], j["first"], j["steps"]) for j in row.away]
        for replica, first, steps in jobs:
            reached[replica] = max(reached.get(replica, 0), first + steps)
    return min(reached.values())


def async_figures(run: Run) -> dict:
    """outer.schedule=async (docs/report.md, "Async runs"): from the arrival rows, the jobs applied
    (`arrivals`), the server updates, the staleness's mean and max over the jobs and the clock at the
    last update; `tokens_per_s`: the jobs' tokens arrived in the last session over its seconds. A run
    without arrival rows: all None, its `tokens_per_s` left as the summary gives it."""
    arrivals = run.of_kind("arrival")
    if not arrivals:
        return dict.fromkeys(ASYNC_COLUMNS)
    staleness = [value for row in arrivals for value in row.staleness]
    last = [row for row in run.sessions()[-1] if row.kind == "arrival"]
    seconds = session_seconds(run.sessions()[-1])
    tokens = sum(sum(row.tokens) for row in last)
    return {
        "arrivals": len(staleness),
        "server_updates": arrivals[-1].update,
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(staleness),
        "async_clock_s": arrivals[-1].clock_s,
        "tokens_per_s": tokens / seconds if seconds else None,
    }


ASYNC_COLUMNS = ("arrivals", "server_updates", "staleness_mean", "staleness_max", "async_clock_s")


def figures(run: Run) -> dict:
    """One run's figures from its metrics.jsonl (see docs/report.md for each one's definition)."""
    evals = [row.eval_loss for row in run.heldout()]
    syncs, updates = run.of_kind("sync"), run.of_kind("update")
    summary = run.summary()  # the last session's (a resumed run: what it ran last)
    arrivals = run.of_kind("arrival")
    done = async_steps_done(arrivals, run.replicas) if arrivals else len({row.update for row in updates})
    planned = run.plan.get("plan/updates_run")
    return {
        "heldout_final": evals[-1] if evals else None,
        "heldout_best": min(evals) if evals else None,
        "train_loss_final": _last([row.loss_mean for row in updates]),
        "updates_run": done,
        "updates_planned": planned,
        "updates": f"{done}/{planned if planned is not None else '?'}",
        "replica_steps_per_s": summary.get("train/replica_steps_per_s"),
        "tokens_per_s": summary.get("bench/tokens_per_s"),
        "comm_inner_bytes": syncs[-1].comm_inner_total if syncs else 0,
        "comm_outer_bytes": run.outer_total_bytes(),
        "comm_outer_peak_bytes": run.outer_peak_bytes(),
        "wall_s": sum(session_seconds(session) for session in run.sessions()),
        "goodput": summary.get("churn/goodput"),  # with churn: replica-steps that reached a sync, a fraction
        "status": run.status,
        "resumed": run.resumed,
    } | async_figures(run)


def clock_figures(clock: dict | None, target: float | None) -> dict:
    """A run's network-clock figures (`replay.clock_of`'s dict, None for a run that cannot be timed):
    its cluster, simulated seconds, compute utilization and the clock at its first held-out loss at or
    below `target` (None: never reached, or no target)."""
    if clock is None:
        return dict.fromkeys(("cluster", "simulated_s", "compute_util", "time_to_target_s"))
    return {
        "cluster": clock["cluster"],
        "simulated_s": clock["total_s"],
        "compute_util": clock["compute_utilization"],
        "time_to_target_s": None if target is None else time_to_loss(clock["heldout"], target),
    }


def table_rows(
    runs: list[Run], names: list[str], clocks: list[dict | None] | None = None, target: float | None = None
) -> list[dict]:
    """One row per run: `run` (its name), `config` (the differing keys' values), the figures, the
    clock's (`clocks`: each run's `clock_of`, None where it has none), `status_note` (the status; how
    often it was resumed; a last row cut short) and `data` (its flag)."""
    keys = differing_keys(runs)
    flags = data_flags(runs)
    clocks = clocks if clocks is not None else [None] * len(runs)
    rows = []
    for run, name, flag, clock in zip(runs, names, flags, clocks, strict=True):
        row = {"run": name, "config": {key: run.config.get(key) for key in keys}} | figures(run)
        row |= clock_figures(clock, target)
        notes = [f"resumed {row['resumed']}x"] * bool(row["resumed"]) + ["last row cut short"] * run.cut_short
        note = f" ({', '.join(notes)})" if notes else ""
        rows.append(row | {"status_note": row["status"] + note, "data": flag})
    return rows


# figures shown only when some run has them (churn's; async's)
OPTIONAL = {"goodput", *ASYNC_COLUMNS}


def columns(keys: list[str], rows: list[dict] | None = None) -> tuple:
    """The table's (key, title, format) columns: the run, each differing key, the figures (an OPTIONAL
    one only when some of `rows` has it)."""
    shown = [f for f in FIGURES if f[0] not in OPTIONAL or any(r.get(f[0]) is not None for r in rows or [])]
    return (("run", "run", "{}"), *((key, key, "{}") for key in keys), *shown)


def flat(row: dict) -> dict:
    """A table row with its config values beside its figures, as `columns` reads them."""
    return {k: v for k, v in row.items() if k != "config"} | row["config"]
