"""The report's section per tuned study among its runs (`python -m hypertrain.report OUT`, docs/sweeps.md):
the tuned table (`study.tuned_cells`), what it compares, and the loss bands (`plot.tuned_plot`); and the
study's record for report.json (the rows without their curves).
"""

from __future__ import annotations

from pathlib import Path

from hypertrain.report.phases import markdown_table
from hypertrain.report.render import Section
from hypertrain.report.runs import Run
from hypertrain.report.tuned.plot import tuned_plot
from hypertrain.report.tuned.study import NOT_REACHED, TIMED_ON, study_roots, study_rows, tuned_cells


def intro(target: float | None, reference: str) -> str:
    aim = "it has none (not in the study, or a seed did not finish)" if target is None else f"{target:.4f}"
    return (
        "Each scheme at its own tuned outer step (experiments/tuned_study.py: the best of its Optuna trials "
        "on seed 0), run on the seeds listed. held-out final: the seeds' final held-out losses, mean (min to "
        "max) and standard deviation (n - 1); `-` unless every seed finished. bits/replica: the bits one "
        f"replica sent in the run (`comm/outer_total_bits`). s to {reference}'s loss: the network clock "
        "(docs/clock.md) of each seed on its own cluster with that link between replicas; on the scheme's "
        "mean curve over its seeds (the mean clock and loss at each evaluation), the clock at the first "
        f"evaluation at or below {reference}'s mean final held-out loss, {aim}; `{NOT_REACHED}` when the "
        f"mean curve stays above it, `-` when the scheme cannot be timed on the link. Links: "
        f"{', '.join(TIMED_ON)}."
    )


def tuned_sections(runs: list[Run], out: Path) -> tuple[list[Section], dict, str]:
    """One section per tuned study the runs belong to, per study its rows for report.json, and the
    tables for the terminal."""
    sections, record, text = [], {}, ""
    for root in study_roots(runs):
        rows, target, reference = study_rows(root, runs)
        bullets = [
            f"{row['scheme']} on {link}: {why}" for row in rows for link, why in row["untimed"].items()
        ]
        plot = tuned_plot(root.name, rows, target, reference, out)
        sections.append(
            Section(
                f"Tuned study: {root.name}",
                [intro(target, reference)],
                tuned_cells(rows, target, reference),
                [row["heldout_final"] is None for row in rows],
                bullets,
                [plot],
            )
        )
        record[str(root)] = {
            "target": target,
            "reference": reference,
            "rows": [{k: v for k, v in row.items() if k != "curves"} for row in rows],
        }
        table = tuned_cells(rows, target, reference)
        text += f"\n\nTuned study {root.name}:\n" + "\n".join(markdown_table(*table, pad=True))
    return sections, record, text
