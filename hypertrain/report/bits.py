"""The report's bits (docs/report.md, "Bits and the Pareto front"): each run's outer bits per replica
(`run_bits`: its summary's total, or the sum of its sync rows' bits, derived from their bytes for a run
written before rows held them), the runs on the Pareto front of final held-out loss against those bits
(`pareto_front`), and the plot of one against the other (`bits_plot`, a log bits axis).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.ticker import LogLocator

from hypertrain.clock.replay import run_params
from hypertrain.config import UserError
from hypertrain.records import formats
from hypertrain.report.plots import (
    CLOCK_SIZE,
    LOSS_UNIT,
    Plot,
    _figure,
    _keys_note,
    _place_legend,
    _save,
    labels,
    line_styles,
)
from hypertrain.report.render import Section
from hypertrain.report.runs import Run

BITS_FILE = "heldout-bits.png"
RECORDED, SUMMED = "recorded", "summed from its sync rows"


def run_bits(run: Run) -> tuple[int | None, str]:
    """The most bits one replica of `run` sent in its syncs, and where the number comes from: its
    summary's `comm/outer_total_bits` (RECORDED), else the last running total of its sync rows with their
    bits (`formats.sync_bits`: rows written before they held them get theirs from their parameters and
    payload bytes; SUMMED), else None and why (the rows do not say who took part, or no summary gives the
    parameter count). A run without a sync sent nothing: 0."""
    recorded = run.summary().get("comm/outer_total_bits")
    if recorded is not None:
        return int(recorded), RECORDED
    syncs = run.of_kind("sync")
    if not syncs:
        return 0, "no sync"
    try:
        resolved = formats.upgrade_config(run.resolved)
        params = run_params(run.rows)
        rows = formats.sync_bits([formats.upgrade_sync_row(row, resolved, params) for row in syncs], resolved)
    except (UserError, KeyError, TypeError, ValueError) as e:
        return None, f"its bits cannot be derived ({' '.join(str(e).split())[:80]})"
    if rows[-1].bits_total is None:
        return None, "its sync rows do not say which replicas sent what"
    return max(rows[-1].bits_total), SUMMED


def pareto_front(points: list[tuple[float, float]]) -> list[bool]:
    """Per point (loss, bits): whether it is on the Pareto front, i.e. no other point has a loss as low
    or lower and bits as few or fewer, and is lower in one of them (equal points are both on it)."""
    return [
        not any(other_loss <= loss and other_bits <= bits and (other_loss, other_bits) != (loss, bits)
                for other_loss, other_bits in points)
        for loss, bits in points
    ]  # fmt: skip


def bits_figures(runs: list[Run], rows: list[dict]) -> list[dict]:
    """Per run (`rows`: the report's table rows, for the final held-out loss): `outer_bits` (per
    replica, `run_bits`), `bits_source`, and `pareto` (on the front among the runs with both a loss and
    bits; None for a run without one of them)."""
    out = []
    for run, row in zip(runs, rows, strict=True):
        bits, source = run_bits(run)
        out.append({"run": row["run"], "heldout_final": row["heldout_final"], "outer_bits": bits,
                    "bits_source": source, "pareto": None})  # fmt: skip
    placed = [i for i, x in enumerate(out) if x["outer_bits"] is not None and x["heldout_final"] is not None]
    front = pareto_front([(out[i]["heldout_final"], out[i]["outer_bits"]) for i in placed])
    for i, on in zip(placed, front, strict=True):
        out[i]["pareto"] = on
    return out


def bits_plot(
    runs: list[Run], names: list[str], keys: list[str], flags: list[str], bits: list[dict], out_dir: Path
) -> Plot:
    """Each run's final held-out loss against its outer bits per replica (`bits_figures`), one point per
    run on a log bits axis, the Pareto front joined by a dotted line; runs with no bits, no held-out
    loss, or 0 bits (R = 1: nothing is sent; a log axis has no 0) are left out, the caption says which."""
    fig, (ax,) = _figure(CLOCK_SIZE, 1)
    drawn, lines = line_styles(runs, keys)
    every = labels(runs, names, keys, flags)
    series, left_out = [], []
    for b, label, style in zip(bits, every, lines, strict=True):
        if not b["outer_bits"] or b["heldout_final"] is None:
            left_out.append(b["run"])
            continue
        point = {key: value for key, value in style.items() if key != "linestyle"}
        ax.plot([b["outer_bits"]], [b["heldout_final"]], linestyle="none", markersize=7, label=label, **point)
        series.append(label)
    front = sorted((b["outer_bits"], b["heldout_final"]) for b in bits if b["pareto"] and b["outer_bits"])
    if len(front) > 1:
        ax.plot(*zip(*front, strict=True), color="grey", linestyle=":", linewidth=1.5, label="Pareto front")
        series.append("Pareto front")
    if series:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10))
    else:
        ax.text(0.5, 0.5, "no run sent bits and has a held-out loss", transform=ax.transAxes, ha="center")
    ax.set_xlabel("outer bits sent per replica, the whole run (log)")
    ax.set_ylabel(f"final held-out loss of the global weights ({LOSS_UNIT})")
    fig.suptitle(f"Final held-out loss against outer bits ({_keys_note(*drawn)})")
    size = _place_legend(fig, len(series), CLOCK_SIZE) if series else CLOCK_SIZE
    missing = (
        f" Left out: {', '.join(left_out)} (no bits, no held-out loss, or none sent)." if left_out else ""
    )
    return _save(
        fig,
        out_dir,
        BITS_FILE,
        size,
        title="Final held-out loss against outer bits per replica",
        caption="One point per run: its last held-out loss against the bits one replica sent in all its "
        'syncs (the most any replica sent; docs/compression.md, "Bits"), on a log axis. Dotted: the '
        "Pareto front, the runs no other run beats on both." + missing,
        series=series,
    )


PARETO_NOTE = (
    "The Pareto front of final held-out loss against outer bits per replica: a run is on it when no other "
    "run has a held-out loss as low or lower with as few bits or fewer (and less of one); ordered by bits. "
    "Going down the table each run buys a lower loss with more bits; a run not listed is beaten on both "
    "by one that is. bits from: recorded (the run's summary), or summed from its sync rows (a run written "
    "before the bits, derived from its parameters and payload bytes)."
)


def bits_section(
    runs: list[Run], names: list[str], keys: list[str], flags: list[str], bits: list[dict], out_dir: Path
) -> Section:
    """The Pareto table (the front's runs, fewest bits first), a bullet per run left out of it, and the
    plot (`bits_plot`; none when no run sent bits)."""
    front = sorted(
        (i for i, b in enumerate(bits) if b["pareto"]),
        key=lambda i: (bits[i]["outer_bits"], bits[i]["heldout_final"]),
    )
    titles = ["run", "held-out final", "outer bits/replica", "bits/parameter/replica-sync", "bits from"]
    body = [
        [b["run"], f"{b['heldout_final']:.4f}", f"{b['outer_bits']:,}", _per_param(runs[i]), b["bits_source"]]
        for i in front
        for b in [bits[i]]
    ]
    bullets = [
        f"{b['run']}: not placed, "
        + (f"no outer bits ({b['bits_source']})" if b["outer_bits"] is None else "no held-out loss")
        for b in bits
        if b["pareto"] is None
    ]
    if any(b["outer_bits"] and b["heldout_final"] is not None for b in bits):
        plots = [bits_plot(runs, names, keys, flags, bits, out_dir)]
    else:
        plots, bullets = [], [*bullets, "no plot: no run sent outer bits (R = 1 runs send none)"]
    return Section(
        "Held-out loss against outer bits (Pareto front)", [PARETO_NOTE], (titles, body), [], bullets, plots
    )


def _per_param(run: Run) -> str:
    """The bits per parameter a replica's contribution sent at its syncs (`-` where no row holds them;
    a range where syncs differ)."""
    values = {x for row in run.of_kind("sync") for x in (row.bits_per_param or []) if x is not None}
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:.4g}" if low == high else f"{low:.4g}-{high:.4g}"
