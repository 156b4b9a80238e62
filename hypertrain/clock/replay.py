"""The network clock of a finished run: from its `metrics.jsonl` rows and resolved config alone, the
simulated seconds of every update and sync on a cluster (`ClusterConfig`). It reads the schedule and
the bytes the records hold, never the engine's timings unless compute is `measured`, so loop, stacked
and real processes give one clock for one run (DESIGN.md invariant 11). docs/clock.md has the rules.
"""

from __future__ import annotations

import math

import numpy as np

from hypertrain.clock.formulas import (
    Link,
    all_gather_s,
    all_to_all_s,
    exposed_s,
    modelled_compute_s,
    ring_allreduce_s,
)
from hypertrain.config import ClusterConfig, ConfigError, StragglerConfig, upgrade_resolved

FP32_BYTES = 4


def straggler_factor(straggler: StragglerConfig, round_index: int, replicas: int) -> float:
    """The slowest replica's slowdown in round `round_index`: max over the R replicas of
    `exp(sigma * z)`, z standard normals from `default_rng([seed, round])`; exactly 1 when sigma = 0."""
    if straggler.sigma == 0:
        return 1.0
    z = np.random.default_rng([straggler.seed, round_index]).standard_normal(replicas)
    return float(np.exp(straggler.sigma * z).max())


def taken_at(count: int, fragment: int, H: int, P: int, tau: int) -> int:
    """The update count after which the pseudo-gradient landing after `count` was taken (the streaming
    schedule, docs/streaming.md): tau earlier at its scheduled landing `k*H + (p+1)*H/P`; at the phase's
    final flush, when it was in flight, at its scheduled take; otherwise at the landing itself."""
    if tau == 0:
        return count
    stride = H // P
    if (count % H or H) == (fragment + 1) * stride:
        return count - tau
    k = (count - 1) // H
    for period in (k, k + 1):
        land = period * H + (fragment + 1) * stride
        if land - tau < count < land:
            return land - tau
    return count


def _last_of_each(rows: list[dict], kind: str, key) -> list[dict]:
    """The rows of `kind`, one per key (the last written: a resumed run writes again the updates after
    its checkpoint), by update, in the order written within one update (a flush's fragments)."""
    found = {}
    for row in rows:
        if row.get("kind") == kind:
            found[key(row)] = row
    return sorted(found.values(), key=lambda row: row["update"])


def run_params(rows: list[dict]) -> int:
    """The run's parameter count, from its summary (`model/params`)."""
    for row in rows:
        if row.get("kind") == "summary" and "model/params" in row:
            return int(row["model/params"])
    raise ConfigError("the run's metrics.jsonl has no summary with model/params; valid: a run's records")


def clock_of(
    rows: list[dict], resolved: dict, cluster: ClusterConfig, model_params: int | None = None
) -> dict:
    """The simulated clock of a run (its `metrics.jsonl` rows, its resolved config) on `cluster`.

    Per update: compute (modelled: `6 * N * tokens of one replica / (peak * mfu)`; measured: the row's
    slowest `rank_seconds`) times the round's slowest straggler factor, plus the inner ring all-reduce
    of the fp32 gradient among the L = world/R ranks of a replica (intra link). Per sync row: the outer
    exchange among the R replicas (inter link) by scheme: fp32 ring all-reduce of the synced parameters,
    or the compressed payload's `gather` (all-gather) or `two_phase` (all-to-all, then an all-gather of
    shard means at the landing); a reduction taken tau updates before its landing exposes only what
    those updates' compute did not hide. `model_params` N rescales: every byte by N / the run's
    parameters, modelled compute to `6 * N * tokens`, measured compute by N / the run's parameters.

    Returns `updates` ({update, clock_s} per update), `syncs` (per sync row: update, fragment, the
    compute and inner seconds since the previous landing, outer exposed and hidden seconds, clock_s),
    the totals, `compute_utilization` (compute / total), the best held-out loss and `time_to_best_s`.
    """
    resolved = upgrade_resolved(resolved)
    R = int(resolved["replicas"])
    L = int(resolved["world"]["size"]) // R
    H, P, tau = (
        int(resolved["inner"]["H"]),
        int(resolved["outer"]["fragments"]),
        int(resolved["outer"]["delay"]),
    )
    compress, reduce = resolved["outer"]["compress"], resolved["outer"]["reduce"]
    base_params = run_params(rows)
    params = base_params if model_params is None else int(model_params)
    scale = params / base_params
    intra, inter = Link.of(cluster.intra), Link.of(cluster.inter)

    compute, inner, clock = {}, {}, {}
    for row in _last_of_each(rows, "update", lambda r: r["update"]):
        u = row["update"]
        losses = row.get("loss")
        stepped = sum(x is not None for x in losses) if isinstance(losses, list) else R
        if cluster.compute == "modelled":
            seconds = modelled_compute_s(
                params, row["tokens"] / max(stepped, 1), cluster.peak_flops, cluster.mfu
            )
        else:
            seconds = max(row["rank_seconds"]) * scale
        compute[u] = seconds * straggler_factor(cluster.straggler, row["round"], R)
        inner[u] = ring_allreduce_s(FP32_BYTES * params, L, intra)

    syncs_at: dict[int, list[dict]] = {}
    for row in _last_of_each(rows, "sync", lambda r: (r["update"], r.get("fragment", 0))):
        u, p = row["update"], row.get("fragment", 0)
        if not row.get("comm_outer_bytes"):  # R = 1, or no replica stepped: nothing was exchanged
            hideable = at_landing = 0.0
        elif compress == "none":
            synced = (
                FP32_BYTES * base_params
                if P == 1
                else row["comm_outer_bytes"] * R / (2 * (R - 1))  # the fragment's: the ring formula inverted
            )
            hideable, at_landing = ring_allreduce_s(synced * scale, R, inter), 0.0
        elif reduce == "two_phase" and compress != "topk":
            b = row["payload_bytes"] * scale
            hideable, at_landing = all_to_all_s(b, R, inter), all_to_all_s(b, R, inter)
        else:
            hideable, at_landing = all_gather_s(row["payload_bytes"] * scale, R, inter), 0.0
        hidden_by = sum(compute.get(v, 0.0) for v in range(taken_at(u, p, H, P, tau) + 1, u + 1))
        exposed = exposed_s(hideable, hidden_by)
        syncs_at.setdefault(u, []).append(
            {
                "update": u,
                "fragment": p,
                "outer_exposed_s": exposed + at_landing,
                "outer_hidden_s": hideable - exposed,
            }
        )

    total = 0.0
    split, previous = [], 0
    for u in sorted(compute):
        total += compute[u] + inner[u]
        for i, sync in enumerate(syncs_at.get(u, [])):
            since = range(previous + 1, u + 1) if i == 0 else range(0)
            total += sync["outer_exposed_s"]
            split.append(
                sync
                | {
                    "compute_s": sum(compute[v] for v in since if v in compute),
                    "inner_s": sum(inner[v] for v in since if v in inner),
                    "clock_s": total,
                }
            )
        if u in syncs_at:
            previous = u
        clock[u] = total

    curve = [(r["update"], r["eval_loss"]) for r in _last_of_each(rows, "eval", lambda r: r["update"])]
    curve += [(r["update"], r["eval_loss"]) for r in heldout_sync_rows(rows)]
    finite = [(loss, u) for u, loss in curve if loss is not None and math.isfinite(loss)]
    best_loss, best_update = min(finite) if finite else (None, None)
    compute_total = sum(compute.values())
    return {
        "cluster": cluster.name,
        "params": params,
        "updates": [{"update": u, "clock_s": clock[u]} for u in sorted(clock)],
        "syncs": split,
        "total_s": total,
        "compute_s": compute_total,
        "inner_s": sum(inner.values()),
        "outer_exposed_s": sum(s["outer_exposed_s"] for s in split),
        "outer_hidden_s": sum(s["outer_hidden_s"] for s in split),
        "compute_utilization": compute_total / total if total > 0 else 1.0,
        "best_heldout_loss": best_loss,
        "time_to_best_s": None if best_update is None else clock.get(best_update, 0.0),
    }


def heldout_sync_rows(rows: list[dict]) -> list[dict]:
    """DiLoCo's sync rows, which hold the held-out loss of the global weights after them."""
    return [
        r
        for r in _last_of_each(rows, "sync", lambda r: (r["update"], r.get("fragment", 0)))
        if "eval_loss" in r
    ]
