"""The network clock in the report and in `python -m hypertrain.clock` (docs/clock.md, docs/report.md):
each run's clock (`replay.clock_of`), the held-out target both compare the runs at, and how a cluster
is named on a plot.

`run_clock(run, cluster)` times one run (on the cluster it recorded unless told another);
`target_loss(given, clocks)` is `--target-loss` when given, else the largest of the runs' best
held-out losses (the lowest loss every timed run reached); `parse_target` checks `--target-loss`.
"""

from __future__ import annotations

import math

from hypertrain.clock.replay import clock_of, run_cluster
from hypertrain.config import ClusterConfig, UserError
from hypertrain.report.runs import ReportInputError, Run

VALID_TARGET = "valid: a finite positive number (a held-out loss in nats/token)"
GIVEN = "given by --target-loss"
LARGEST_BEST = "the largest of the runs' best held-out losses: the lowest loss every run reached"


def parse_target(text: str | None) -> float | None:
    """`--target-loss`'s value as a float (None when not given); ReportInputError when it is not a
    finite positive number."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ReportInputError(f"--target-loss={text!r} is not valid; {VALID_TARGET}")
    return value


def run_clock(
    run: Run, cluster: ClusterConfig | None = None, model_params: int | None = None
) -> tuple[dict | None, str | None]:
    """The run's clock (`clock_of`) on `cluster` (default: the one its config.yaml records), and None;
    or None and why it cannot be timed (its records or config lack what the clock reads: a file
    written by hand, or before a field the clock needs)."""
    try:
        where = cluster if cluster is not None else run_cluster(run.resolved)
        return clock_of(run.rows, run.resolved, where, model_params), None
    except KeyError as e:
        return None, f"its records or config lack {e}"
    except (UserError, ValueError, TypeError) as e:
        return None, " ".join(str(e).split())[:200] or type(e).__name__


def target_loss(given: float | None, clocks: list[dict | None]) -> tuple[float | None, str]:
    """The held-out loss the runs are timed to, and the rule that chose it: `given`, or the largest of
    the timed runs' best held-out losses (None when no run has one)."""
    if given is not None:
        return given, GIVEN
    bests = [c["best_heldout_loss"] for c in clocks if c is not None and c["best_heldout_loss"] is not None]
    return (max(bests) if bests else None), LARGEST_BEST


def cluster_text(cluster: ClusterConfig) -> str:
    """A cluster in a few words: its name, how compute is timed, its inter-replica link."""
    inter = cluster.inter
    latency = f"{inter.latency_us / 1000:g} ms" if inter.latency_us >= 1000 else f"{inter.latency_us:g} us"
    link = f"{inter.name}: {inter.bandwidth_gbit:g} Gbit/s, {latency}"
    return f"{cluster.name} ({cluster.compute} compute; inter {link})"
