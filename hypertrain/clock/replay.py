"""The network clock of a finished run: its `metrics.jsonl` rows and resolved config replayed through
the running clock (`timeline.Clock`) on any cluster, as training computed it on its own. It reads the
schedule and the bytes the records hold, never the engine's timings unless compute is `measured`, so
loop, stacked and real processes give one clock for one run (DESIGN.md invariant 11); docs/clock.md.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from hypertrain.clock.timeline import Clock, Shape
from hypertrain.config import ClusterConfig, UserError
from hypertrain.records import formats
from hypertrain.records.rows import ArrivalRow, EvalRow, Row, SummaryRow, SyncRow, UpdateRow, parse
from hypertrain.schedule_table import recorded_entry

_ORDER = {UpdateRow.kind: 0, SyncRow.kind: 1, EvalRow.kind: 2}  # within one update, as training writes them


def in_order(rows: list[Row | dict]) -> list[UpdateRow | SyncRow | EvalRow]:
    """A run's update, sync and eval rows, as their types, in the order training writes them, each once
    (the last written: a resumed run writes again the updates after its checkpoint): by update, then an
    update's row, the syncs landing after it (a flush's fragments in the order written; with outer.overlap
    a fragment's two landings at the phase's end), its evaluation."""
    found: dict[tuple, UpdateRow | SyncRow | EvalRow] = {}
    landed: dict[tuple[int, int], int] = {}  # outer.overlap's flush: a fragment lands twice at the end
    for row in map(parse, rows):
        if row is not None and row.kind in _ORDER:
            fragment = (row.fragment or 0) if isinstance(row, SyncRow) else 0
            nth = 0
            if isinstance(row, UpdateRow):  # an update written again: its syncs are counted again
                landed = {k: n for k, n in landed.items() if k[0] != row.update}
            elif isinstance(row, SyncRow):
                nth = landed.get((row.update, fragment), 0)
                landed[(row.update, fragment)] = nth + 1
            found[(row.kind, row.update, fragment, nth)] = row
    written = {key: i for i, key in enumerate(found)}
    return [found[k] for k in sorted(found, key=lambda k: (k[1], _ORDER[k[0]], written[k]))]


def _summary_value(rows: list[Row | dict], key: str):
    """`key` of the first summary row that holds it; None when none does."""
    for row in map(parse, rows):
        if isinstance(row, SummaryRow) and key in row.values:
            return row.values[key]
    return None


def run_params(rows: list[Row | dict]) -> int:
    """The run's parameter count, from its summary (`model/params`)."""
    params = _summary_value(rows, "model/params")
    if params is not None:
        return int(params)
    raise UserError("the run's metrics.jsonl has no summary with model/params; valid: a run's records")


def run_active_params(rows: list[Row | dict]) -> int | None:
    """The parameters a token of the run used (`model/active_params`); None for a run recorded before
    (the models then were dense: all of them)."""
    active = _summary_value(rows, "model/active_params")
    return None if active is None else int(active)


def run_cluster(resolved: dict) -> ClusterConfig:
    """The cluster a run recorded in its config.yaml (the default, cpu_here, for one written before)."""
    if "cluster" not in resolved:
        return ClusterConfig()
    cluster = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig), resolved["cluster"]))
    cluster.check()
    return cluster


def decided_by_clock(resolved: dict) -> str | None:
    """The setting with which the run's own clock decided its numbers (`churn.deadline`: which replicas
    were late, so which pseudo-gradients its weights hold; `outer.schedule=async`: the order its
    pseudo-gradients arrived in), as `key=value`; None for a run whose numbers no clock touched. Such a
    run timed on another cluster or size is a clock that never was."""
    schedule = recorded_entry(resolved.get("outer"))
    if schedule.arrival_clock:
        return f"outer.schedule={schedule.name}"
    deadline = (resolved.get("churn") or {}).get("deadline") or 0.0
    return f"churn.deadline={deadline:g}" if deadline > 0 else None


def clock_of(
    rows: list[Row | dict], resolved: dict, cluster: ClusterConfig, model_params: int | None = None
) -> dict:
    """The simulated clock of a run (its `metrics.jsonl` rows, its resolved config) on `cluster`,
    `model_params` N rescaling as `Clock` says (None: the size the run's own clock timed,
    `cluster.model_params`, else its model's); an outer.schedule=async run's own clock (`arrival_clock`).
    UserError (one line) when the cluster's speeds are not one per replica of the run.

    Returns `updates` ({update, clock_s}: the clock at the end of each update, before the syncs
    landing after it), `syncs` (per sync row: update, fragment and `Clock.sync`'s split), `heldout`
    ({update, clock_s, eval_loss}: the held-out curve, from eval rows, each at the clock after the syncs
    of its update, and DiLoCo's sync rows, each at the clock after its own landing, whose weights'
    loss it holds) and `Clock.summary`'s totals without their `clock/`."""
    resolved = formats.upgrade_config(resolved)
    if recorded_entry(resolved.get("outer")).arrival_clock:
        return arrival_clock(rows, cluster, resolved)
    if model_params is None:  # the size the run's own clock timed (cluster.model_params), else its model's
        model_params = int((resolved.get("cluster") or {}).get("model_params") or 0) or None
    shape, params = Shape.of(resolved), run_params(rows)
    cluster.check_replicas(shape.replicas)  # speeds given for another R: training refuses them too
    clock = Clock(shape, cluster, params, model_params, run_active_params(rows))
    updates, syncs, heldout = [], [], []
    for row in in_order(rows):
        u = row.update
        if isinstance(row, UpdateRow):
            updates.append({"update": u, "clock_s": clock.update(row)})
            continue
        if isinstance(row, SyncRow):
            row = formats.upgrade_sync_row(row, resolved, params)
            syncs.append({"update": u, "fragment": row.fragment or 0} | clock.sync(row))
        if isinstance(row, EvalRow) or row.eval_loss is not None:  # DiLoCo's sync row holds one
            heldout.append({"update": u, "clock_s": clock.heldout(row.eval_loss), "eval_loss": row.eval_loss})
    totals = {key.removeprefix("clock/"): value for key, value in clock.summary().items()}
    return totals | {"updates": updates, "syncs": syncs, "heldout": heldout}


def arrival_clock(rows: list[Row | dict], cluster: ClusterConfig, resolved: dict) -> dict:
    """An outer.schedule=async run's own clock (docs/async.md), which decided its arrivals and is only
    read back here (`check_clock_decided` refuses another cluster), fed to `Clock` as training fed it
    (`Clock.arrival`): the held-out curve from its first eval row (clock 0) and its arrival rows (each
    the last written: a resumed run writes some again), the total the last arrival's clock. Compute and
    communication overlap across replicas there, so no split of the total is given (None)."""
    parsed = [row for row in map(parse, rows) if row is not None]
    first = next((row for row in parsed if isinstance(row, EvalRow) and row.update == 0), None)
    arrivals = {row.update: row for row in parsed if isinstance(row, ArrivalRow)}
    size = int((resolved.get("cluster") or {}).get("model_params") or 0) or None
    clock = Clock(Shape.of(resolved), cluster, run_params(rows), size, run_active_params(rows))
    heldout = []
    if first is not None:
        heldout.append({"update": 0, "clock_s": clock.heldout(first.eval_loss), "eval_loss": first.eval_loss})
    for u, row in sorted(arrivals.items()):
        clock.arrival(row.clock_s)
        if row.eval_loss is not None:
            heldout.append({"update": u, "clock_s": clock.heldout(row.eval_loss), "eval_loss": row.eval_loss})
    totals = {key.removeprefix("clock/"): value for key, value in clock.summary().items()}
    return totals | {"updates": [], "syncs": [], "heldout": heldout}


def time_to_loss(heldout: list[dict], target: float) -> float | None:
    """The clock at the first held-out loss at or below `target` (`clock_of`'s `heldout`); None when
    the run never reached it."""
    for point in heldout:
        loss = point["eval_loss"]
        if loss is not None and loss <= target:
            return point["clock_s"]
    return None
