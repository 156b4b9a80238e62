"""The tuned study's plot: each scheme's held-out loss over its seeds against the bits one replica sent
and against the network clock's simulated seconds on each of `study.TIMED_ON`, one band per scheme (the
mean over the seeds at each evaluation, from the lowest to the highest seed's loss), drawn as the
report's other plots are (`plots`: off-screen, exactly the stated pixel size).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from hypertrain.report.plots import COLOURS, DPI, LOSS_UNIT, Plot, _band, _place_legend, _save, file_safe
from hypertrain.report.tuned.study import TIMED_ON

TUNED_SIZE = (1200, 860)  # pixels, plus the legend's rows below the four panels


def tuned_plot(study: str, rows: list[dict], target: float | None, reference: str, out_dir: Path) -> Plot:
    """Four panels (loss against bits; against seconds on each link), a band per scheme whose seeds all
    finished (`rows`: `study.study_rows`'), the target as a dotted line on the clock panels."""
    fig = Figure(figsize=(TUNED_SIZE[0] / DPI, TUNED_SIZE[1] / DPI), dpi=DPI, layout="constrained")
    axes = list(fig.subplots(2, 2, sharey=True).flat)
    panels = ["bits", *TIMED_ON]
    series = []
    for i, row in enumerate(rows):
        colour, label = COLOURS[i % len(COLOURS)], f"{row['scheme']} ({row['finished']} seeds)"
        drawn = [
            (ax, row["curves"][panel])
            for ax, panel in zip(axes, panels, strict=True)
            if panel in row["curves"]
        ]
        for k, (ax, curve) in enumerate(drawn):  # the legend's entry once, from the first panel drawn
            ax.plot(curve[0], curve[1], color=colour, marker="o", markersize=3, label=None if k else label)
            _band(ax, curve, colour)
        series += [label] if drawn else []
    for k, (ax, panel) in enumerate(zip(axes, panels, strict=True)):
        ax.grid(alpha=0.3)
        ax.set_ylabel(f"held-out loss ({LOSS_UNIT})")
        if panel == "bits":
            ax.set_xlabel("outer bits sent per replica, cumulative")
            ax.xaxis.set_major_formatter(EngFormatter(unit="b"))
            continue
        ax.set_xlabel(f"simulated seconds, inter-replica link {panel}")
        ax.xaxis.set_major_formatter(EngFormatter(unit="s"))
        if target is not None:
            text = f"{reference}'s mean final loss {target:.4f}"
            ax.axhline(target, color="grey", linestyle=":", linewidth=1.5, label=None if k > 1 else text)
            series += [] if k > 1 else [text]
    fig.suptitle(f"Tuned study {study}: held-out loss over seeds against bits and simulated seconds")
    size = _place_legend(fig, len(series), TUNED_SIZE) if series else TUNED_SIZE
    return _save(
        fig,
        out_dir,
        f"tuned-{file_safe(study)}.png",
        size,
        title=f"Tuned study {study}: held-out loss against bits and simulated seconds",
        caption="Each scheme at its tuned outer step: the mean over its seeds of the held-out loss at each "
        "evaluation, in a band from the lowest to the highest seed's, against the bits one replica had sent "
        "(top left) and the network clock's simulated seconds on its cluster with each link between "
        f"replicas. Dotted: {reference}'s mean final loss, the target of the table's times. A scheme with a "
        "seed that did not finish, or a run timed on its own link only (async), is left out of a panel.",
        series=series,
    )
