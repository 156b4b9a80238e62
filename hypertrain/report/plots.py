"""The report's plots: matplotlib figures drawn off-screen (Agg) into PNGs of exactly the stated pixel size.

`heldout_plot` (every run's held-out loss against the update, the outer bytes and the peak outer bytes
per sync), `clock_plot` (every run's held-out loss against its simulated seconds; also drawn by
`python -m hypertrain.clock`), `spread_plot` (one run's per-replica losses), `phases_plot` (a phases
sweep's throughput and scaling): docs/report.md, "The plots". The first two draw a group of runs that
differ only in their seeds (`seeds.seed_groups`) as its mean and a min-max band, and widen a figure
whose legend would not fit it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator

from hypertrain.records.rows import ArrivalRow
from hypertrain.report.runs import Run
from hypertrain.report.seeds import band

DPI = 100
HELDOUT_SIZE = (1500, 480)  # pixels, plus LEGEND_ROW_PX per row of the legend below the panels
LEGEND_ROW_PX = 22
LEGEND_MARGIN_PX = 8  # the least room beside the legend: a wider one gets fewer columns, then a wider figure
CLOCK_SIZE = (1000, 480)  # pixels (wider when the legend needs it), plus LEGEND_ROW_PX per row of the legend
SPREAD_SIZE = (900, 420)
PHASES_SIZE = (1100, 420)
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")  # a one-point series shows no line (the peak panel)
BAND_ALPHA = 0.2  # a seed group's min-max band, in its line's colour
LOSS_UNIT = "nats/token"


@dataclass
class Plot:
    """A PNG the report wrote, and what it shows."""

    file: str  # name inside the report folder
    title: str
    caption: str
    width: int  # pixels
    height: int
    series: list[str] = field(default_factory=list)  # legend entries, in order


def _figure(size: tuple[int, int], panels: int) -> tuple[Figure, list]:
    fig = Figure(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig, list(axes)


def _save(fig: Figure, out_dir: Path, file: str, size: tuple[int, int], **what) -> Plot:
    """The figure as `file` in `out_dir`, exactly `size` pixels (no tight bounding box: sizes are stated)."""
    fig.savefig(out_dir / file, dpi=DPI, format="png")
    return Plot(file, width=size[0], height=size[1], **what)


def _value(run: Run, key: str | None) -> str:
    """The run's value of `key` as JSON (its folder's name without a key): what colours and styles go by."""
    return json.dumps(run.config.get(key) if key else run.path.name)


def _value_index(runs: list[Run], key: str | None) -> dict[str, int]:
    """Each distinct value of `key` -> its position in the order the runs first show it."""
    index: dict[str, int] = {}
    for run in runs:
        index.setdefault(_value(run, key), len(index))
    return index


def _singles(runs: list[Run], groups: list[list[int]] | None) -> list[list[int]]:
    return groups if groups is not None else [[i] for i in range(len(runs))]


def labels(
    runs: list[Run],
    names: list[str],
    keys: list[str],
    flags: list[str],
    groups: list[list[int]] | None = None,
) -> list[str]:
    """Legend entries, one per group of runs (`seeds.seed_groups`; default: one per run): every
    differing value of `keys` (its runs' names when there are none), `mean of N seeds` for a group of
    several runs, a run's status when it did not finish, the data flags; groups that would share an
    entry get their names appended."""
    out, group_names = [], []
    for group in _singles(runs, groups):
        run, name = runs[group[0]], ", ".join(names[i] for i in group)
        text = ", ".join(f"{key}={run.config.get(key)}" for key in keys) or name
        if len(group) > 1:
            text += f" (mean of {len(group)} seeds)"
        if run.status != "finished":
            text += f" [{run.status}]"
        marks = [flags[i] for i in group if flags[i]]
        for flag in dict.fromkeys(marks):
            text += f" ({flag}: {marks.count(flag)} of {len(group)})" if len(group) > 1 else f" ({flag})"
        out.append(text)
        group_names.append(name)
    repeated = {text for text in out if out.count(text) > 1}
    return [
        f"{text} - {name}" if text in repeated else text for text, name in zip(out, group_names, strict=True)
    ]


def _bytes_axis(ax, most: int, label: str) -> None:
    """An x axis of whole bytes from 0 to `most` (a margin keeps the R = 1 runs' points off the spine)."""
    ax.set_xlabel(label)
    ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))  # labels that fit a third of the width
    span = most or 1
    ax.set_xlim(-0.03 * span, 1.05 * span)
    if not most:
        ax.text(0.5, 0.5, "no outer bytes sent (R = 1, or no sync yet)", transform=ax.transAxes, ha="center")


def _place_legend(fig: Figure, n: int, base: tuple[int, int]) -> tuple[int, int]:
    """The figure's legend of `n` entries below its panels, and the figure's size in pixels: `base`
    plus LEGEND_ROW_PX per row, in as many columns (up to 3) as fit its width with LEGEND_MARGIN_PX
    either side; a legend too wide in one column widens the figure (a legend wider than its figure
    loses the ends of its entries on both sides)."""
    for columns in range(1 if n <= 3 else 2 if n <= 12 else 3, 0, -1):
        size = (base[0], base[1] + LEGEND_ROW_PX * math.ceil(n / columns))
        fig.set_size_inches(size[0] / DPI, size[1] / DPI)
        legend = fig.legend(loc="outside lower center", ncols=columns, fontsize="small")
        fig.draw_without_rendering()
        width = legend.get_window_extent().width
        if width + 2 * LEGEND_MARGIN_PX <= size[0]:
            return size
        if columns > 1:
            legend.remove()
    size = (math.ceil(width) + 2 * LEGEND_MARGIN_PX, size[1])
    fig.set_size_inches(size[0] / DPI, size[1] / DPI)
    return size


def line_styles(runs: list[Run], keys: list[str]) -> tuple[list[str | None], list[dict]]:
    """Each run's line: colour by the first of `keys`, line style by the second, marker by the rest (by
    the second when there are only two), so runs that differ in any key are drawn apart; the keys each
    of colour, line style and marker go by, and per run matplotlib's `color`, `linestyle`, `marker` (and
    for a run that did not finish, hollow markers: `fillstyle`, `alpha`). The held-out plots against the
    update and against simulated seconds draw every run alike."""
    colour_key = keys[0] if keys else None
    style_key = keys[1] if len(keys) > 1 else None
    marker_keys = keys[2:]
    colours, styles = _value_index(runs, colour_key), _value_index(runs, style_key)
    markers: dict[str, int] = {}
    lines = []
    for run in runs:
        style = styles[_value(run, style_key)] if style_key else 0
        marker = style
        if marker_keys:
            marker = markers.setdefault(
                json.dumps([run.config.get(key) for key in marker_keys]), len(markers)
            )
        colour = COLOURS[colours[_value(run, colour_key)] % len(COLOURS)]
        line = dict(
            color=colour, linestyle=STYLES[style % len(STYLES)], marker=MARKERS[marker % len(MARKERS)]
        )
        # a run that did not finish: hollow markers (it may differ from a finished run only in a seed)
        lines.append(line | (dict(fillstyle="none", alpha=0.7) if run.status != "finished" else {}))
    return [colour_key, style_key, ", ".join(marker_keys) or None], lines


def _keys_note(colour_key: str | None, style_key: str | None, marker_key: str | None) -> str:
    style_note = f", line style and marker: {style_key}" if style_key and not marker_key else ""
    if marker_key:
        style_note = f", line style: {style_key}, marker: {marker_key}"
    return f"colour: {colour_key or 'run'}{style_note}"


def _band(ax, curve: tuple[list, list, list, list], colour: str) -> None:
    """A group's min-max band (no band for one run, whose min and max are its line)."""
    xs, _, low, high = curve
    if low != high:
        ax.fill_between(xs, low, high, color=colour, alpha=BAND_ALPHA, linewidth=0)


def update_axis(runs: list[Run]) -> str:
    """The held-out curve's x axis: updates (rounds), server updates (outer.schedule=async: arrival
    rows), or both named where the runs mix them."""
    asynchronous = [bool(run.of_kind("arrival")) for run in runs]
    if all(asynchronous) and runs:
        return "server update (async)"
    return "update (async runs: server update)" if any(asynchronous) else "update"


def _sent(row, bytes_at: dict[int, int]) -> int:
    """The outer bytes one replica had sent at a held-out row: a sync's running total, an arrival's
    bytes moved (`Run.async_bytes`), 0 before training."""
    if isinstance(row, ArrivalRow):
        return bytes_at.get(row.update, 0)
    return getattr(row, "comm_outer_total", None) or 0


def heldout_plot(
    runs: list[Run],
    names: list[str],
    keys: list[str],
    flags: list[str],
    out_dir: Path,
    groups: list[list[int]] | None = None,
) -> Plot:
    """The held-out loss of every run against the update and the outer bytes, and its last held-out
    loss against its peak outer bytes per sync (one PNG, three panels); a group of several runs
    (`groups`, `seeds.seed_groups`; default: each run alone) as its mean with a min-max band, its last
    point with a min-max error bar."""
    groups = _singles(runs, groups)
    fig, (by_update, by_bytes, by_peak) = _figure(HELDOUT_SIZE, 3)
    by_bytes.sharey(by_update)
    by_peak.sharey(by_update)
    drawn, lines = line_styles([runs[group[0]] for group in groups], keys)
    series = labels(runs, names, keys, flags, groups)
    for group, label, style in zip(groups, series, lines, strict=True):
        evals = [runs[i].heldout() for i in group]
        # the eval row before training has no outer bytes: 0; an arrival row (async): the bytes moved
        by_count = band([[(row.update, row.update, row.eval_loss) for row in run] for run in evals])
        moved = [runs[i].async_bytes() for i in group]
        by_sent = band(
            [
                [(row.update, _sent(row, bytes_at), row.eval_loss) for row in run]
                for run, bytes_at in zip(evals, moved, strict=True)
            ]
        )
        line = style | dict(markersize=3)
        by_update.plot(by_count[0], by_count[1], label=label, **line)
        by_bytes.plot(by_sent[0], by_sent[1], **line)
        _band(by_update, by_count, style["color"])
        _band(by_bytes, by_sent, style["color"])
        if all(evals):  # one point: the last held-out loss at the peak bytes per sync (a group's mean)
            last = [run[-1].eval_loss for run in evals]
            mean = sum(last) / len(last)
            by_peak.errorbar(
                [sum(runs[i].outer_peak_bytes() for i in group) / len(group)],
                [mean],
                yerr=[[mean - min(last)], [max(last) - mean]] if len(group) > 1 else None,
                **{key: value for key, value in style.items() if key != "linestyle"},
                markersize=7,
                capsize=4,
            )
    by_update.set_xlabel(update_axis(runs))
    by_update.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_update.set_ylabel(f"held-out loss of the global weights ({LOSS_UNIT})")
    most = max((row.comm_outer_total or 0 for run in runs for row in run.of_kind("sync")), default=0)
    most = max([most, *(run.outer_total_bytes() for run in runs if run.of_kind("arrival"))])
    _bytes_axis(by_bytes, most, "outer (cross-replica) bytes sent per replica, cumulative")
    peak = max((run.outer_peak_bytes() for run in runs), default=0)
    _bytes_axis(by_peak, peak, "peak outer bytes per sync and replica (last held-out loss)")
    fig.suptitle(f"Held-out loss ({_keys_note(*drawn)})")
    size = _place_legend(fig, len(series), HELDOUT_SIZE)
    return _save(
        fig,
        out_dir,
        "heldout.png",
        size,
        title="Held-out loss against the update, the outer bytes and the peak outer bytes per sync",
        caption="The global weights' held-out loss before training and after every sync (with fragments: "
        "after every round of H updates and at the end). Outer bytes: what one replica sends in the ring "
        "all-reduces of the syncs (0 with R = 1), cumulative (middle), and the most it sent in one sync "
        "(right: one point per run, at its last held-out loss; a fragment's sync sends that fragment)."
        + (SEEDS_NOTE if any(len(group) > 1 for group in groups) else ""),
        series=series,
    )


SEEDS_NOTE = (
    " Runs that differ only in their seeds: one line, their mean at each update, in a band from their "
    "lowest to their highest loss (the peak panel: an error bar from their lowest to highest last loss)."
)
CLOCK_FILE = "heldout-clock.png"
LOG_SPAN = 100  # runs whose simulated totals differ by more than this factor get a log time axis


def clock_plot(
    runs: list[Run],
    names: list[str],
    keys: list[str],
    flags: list[str],
    clocks: list[dict | None],
    target: float | None,
    where: str,
    out_dir: Path,
    params: int | None = None,
    groups: list[list[int]] | None = None,
) -> Plot:
    """The held-out loss of every run against its simulated seconds (`clocks`: each run's
    `replay.clock_of`, None for a run that could not be timed: left out), drawn as `heldout_plot`
    draws the run (a group of runs as their mean clock and loss at each update, with a min-max band of
    the loss), and a dotted line at the `target` loss. `where`: the cluster(s), for the axis;
    `params`: the parameter count the runs were timed at (`--model-params`), for the title. The report
    and `python -m hypertrain.clock` both draw it."""
    groups = _singles(runs, groups)
    drawn, lines = line_styles([runs[group[0]] for group in groups], keys)
    every = labels(runs, names, keys, flags, groups)
    timed, log = _timed_groups(groups, every, lines, clocks)
    fig, (ax,) = _figure(CLOCK_SIZE, 1)
    series = _draw_clock_curves(ax, timed, clocks, log)
    if target is not None:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1.5, label=f"target {target:.4f}")
        series.append(f"target {target:.4f}")
    if log:
        ax.set_xscale("log")
    else:
        ax.xaxis.set_major_formatter(EngFormatter(unit="s"))
    ax.set_xlabel(f"simulated seconds{' (log)' if log else ''} on {where}")
    ax.set_ylabel(f"held-out loss of the global weights ({LOSS_UNIT})")
    if not timed:
        ax.text(0.5, 0.5, "no run could be timed", transform=ax.transAxes, ha="center")
    at = f", timed at {params:,} parameters" if params else ""
    heading, note = f"Held-out loss against simulated seconds{at}", f"({_keys_note(*drawn)})"
    fig.suptitle(heading + ("\n" if len(heading) + len(note) > 90 else " ") + note)
    size = _place_legend(fig, len(series), CLOCK_SIZE) if series else CLOCK_SIZE
    return _save(
        fig,
        out_dir,
        CLOCK_FILE,
        size,
        title=f"Held-out loss against simulated seconds{at}",
        caption=_clock_caption(where, log, timed),
        series=series,
    )


def _timed_groups(
    groups: list[list[int]], every: list[str], lines: list[dict], clocks: list[dict | None]
) -> tuple[list[tuple[list[int], str, dict]], bool]:
    """Each group's runs the clock could time with its legend entry and line (groups with none left
    out), and whether time goes on a log axis (the timed runs' nonzero totals differ by > LOG_SPAN)."""
    timed = []  # (a group's runs the clock could time, its legend entry, its line)
    for group, label, style in zip(groups, every, lines, strict=True):
        members = [i for i in group if clocks[i] is not None]
        if members:
            timed.append((members, label, style))
    ends = [
        max((p["clock_s"] for p in clocks[i]["heldout"]), default=0.0) for group, _, _ in timed for i in group
    ]
    spread = [end for end in ends if end > 0]
    log = bool(spread) and max(spread) > LOG_SPAN * min(spread)
    return timed, log


def _draw_clock_curves(ax, timed: list[tuple[list[int], str, dict]], clocks: list[dict | None], log: bool):
    """Draw each timed group's mean held-out loss against its mean clock with its min-max band on `ax`
    (points at 0 s left out on a log axis); returns the legend entries drawn, in order."""
    series = []
    for group, label, style in timed:
        curves = [
            [
                (p["update"], p["clock_s"], p["eval_loss"])
                for p in clocks[i]["heldout"]
                if p["eval_loss"] is not None
            ]
            for i in group
        ]
        xs, mean, low, high = band(curves)
        kept = [k for k, x in enumerate(xs) if x > 0 or not log]
        curve = tuple([values[k] for k in kept] for values in (xs, mean, low, high))
        ax.plot(curve[0], curve[1], label=label, markersize=3, **style)
        _band(ax, curve, style["color"])
        series.append(label)
    return series


def _clock_caption(where: str, log: bool, timed: list[tuple[list[int], str, dict]]) -> str:
    """The clock plot's caption: what is drawn on `where`, plus the log-axis and seeds notes if any."""
    return (
        "The global weights' held-out loss (the curve of the held-out plot) at the network "
        f"clock's simulated seconds on {where} (docs/clock.md): before training at 0 s, after every sync "
        "or evaluation at the clock after the syncs of its update. Dotted: the target loss of `time to "
        "target s`."
        + (
            " Time on a log axis (the runs' totals differ by more than 100x): the points at 0 s left out."
            if log
            else ""
        )
        + (
            SEEDS_NOTE.replace(" at each update", " clock and loss at each update")
            if any(len(g) > 1 for g, _, _ in timed)
            else ""
        )
    )


def spread_plot(run: Run, name: str, number: int, out_dir: Path) -> Plot:
    """One run's per-replica training loss: min-max band over the replicas that stepped, their mean,
    and the held-out loss of the global weights at its evaluations (Run.heldout)."""
    fig, (ax,) = _figure(SPREAD_SIZE, 1)
    updates = [row for row in run.of_kind("update") if any(row.stepped)]
    steps = [row.update for row in updates]
    stepped = [[loss for loss in row.loss if loss is not None] for row in updates]
    ax.fill_between(steps, [min(x) for x in stepped], [max(x) for x in stepped], alpha=0.3, label="min-max")
    ax.plot(steps, [row.loss_mean for row in updates], label="mean over replicas")
    evals = run.heldout()
    ax.plot(
        [row.update for row in evals],
        [row.eval_loss for row in evals],
        "o--",
        markersize=3,
        label="held-out loss of the global weights",
    )
    ax.set_xlabel("update")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"loss ({LOSS_UNIT})")
    ax.set_title(f"{name}: training loss of its R = {run.replicas} replicas ({run.status})")
    ax.legend(fontsize="small")
    safe = file_safe(name)
    return _save(
        fig,
        out_dir,
        f"spread-{number:02d}-{safe}.png",
        SPREAD_SIZE,
        title=f"{name}: per-replica training loss",
        caption=f"Each replica's loss on its own batch (R = {run.replicas}); within this run only: "
        "per-replica batches shrink as R grows, so compare runs by the held-out loss.",
        series=["min-max", "mean over replicas", "held-out loss of the global weights"],
    )


def file_safe(name: str) -> str:
    """`name` with every run of characters a file name should not hold replaced by `_`."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def phases_plot(rows: list[dict], sweep: str, out_dir: Path) -> Plot:
    """Throughput and scaling efficiency per phase against the world (rows: phases.with_scaling's)."""
    fig, (speed, scaling) = _figure(PHASES_SIZE, 2)
    phases = list(dict.fromkeys(row["phase"] for row in rows))
    worlds = sorted({row["world"] for row in rows})
    for i, phase in enumerate(phases):
        mine = [row for row in rows if row["phase"] == phase]
        nan = float("nan")
        line = dict(color=COLOURS[i % len(COLOURS)], marker="o", label=phase)
        speed.plot([r["world"] for r in mine], [r["samples_per_s"] or nan for r in mine], **line)
        scaling.plot([r["world"] for r in mine], [r["scaling_efficiency"] or nan for r in mine], **line)
    scaling.axhline(1.0, color="grey", linestyle=":", label="ideal")
    for ax in (speed, scaling):
        ax.set_xlabel("world (ranks)")
        ax.set_xticks(worlds)
    speed.set_ylabel("examples/s, all ranks")
    speed.set_ylim(bottom=0)
    scaling.set_ylabel("scaling efficiency (1 = ideal)")
    scaling.set_ylim(bottom=0)
    speed.legend(fontsize="small")
    scaling.legend(fontsize="small")
    fig.suptitle(f"experiment=phases: {sweep}")
    safe = file_safe(sweep)
    return _save(
        fig,
        out_dir,
        f"phases-{safe}.png",
        PHASES_SIZE,
        title=f"Benchmark phases: {sweep}",
        caption="Throughput after each phase's timing_warmup updates, and scaling efficiency against the "
        "phase's smallest world (strong: throughput ratio / world ratio; weak: per-rank throughput ratio).",
        series=[*phases, "ideal"],
    )
