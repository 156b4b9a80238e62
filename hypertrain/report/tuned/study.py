"""The tuned table of an experiments/tuned_study.py output folder (docs/sweeps.md, "The report's tuned
table"): per scheme its tuned setting, the final held-out loss over its seeds (mean, min, max, standard
deviation), the bits one replica sent, and the network clock's time to the reference scheme's (DiLoCo's)
mean final loss on each of LINKS, read off the scheme's mean held-out curve over its seeds.

A study is found by its manifest (MANIFEST: the schemes in order and the reference), its scheme's seeds
under `<study>/<scheme>/seeds/`, its tuned setting in `<study>/<scheme>/tune/optimization_results.yaml`.
A figure over seeds is given only when every seed finished (a mean over those that did hides the others).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from hypertrain.clock.replay import clock_of, decided_by_clock, run_cluster
from hypertrain.config import LINKS, UserError
from hypertrain.report.bits import run_bits
from hypertrain.report.runs import ReportInputError, Run
from hypertrain.report.seeds import band, cell, stats

MANIFEST = "tuned_study.json"  # written by experiments/tuned_study.py into its output folder
TIMED_ON = ("datacenter_100g", "cross_region_10g", "internet_1g")  # the links of docs/clock.md's study
NOT_REACHED = "not reached"


VALID_MANIFEST = (
    'valid: a JSON object {"schemes": [names], "reference": name}, as experiments/tuned_study.py writes'
)


def study_roots(runs: list[Run]) -> list[Path]:
    """The tuned studies the runs belong to (a seed run's `<study>/<scheme>/seeds/<job>`, with the
    study's MANIFEST), each once, in the runs' order; ReportInputError for a manifest that is not one."""
    roots = [
        p.parents[2] for p in (run.path for run in runs) if p.parent.name == "seeds" and len(p.parents) > 2
    ]
    found = [root for root in dict.fromkeys(roots) if (root / MANIFEST).is_file()]
    for root in found:
        manifest(root)
    return found


def manifest(root: Path) -> dict:
    """The study's MANIFEST; ReportInputError naming it when it is not one."""
    path = root / MANIFEST
    try:
        about = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportInputError(
            f"{path} cannot be read ({' '.join(str(e).split())[:120]}); {VALID_MANIFEST}"
        ) from None
    names = about.get("schemes") if isinstance(about, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ReportInputError(f"{path} has no list of schemes; {VALID_MANIFEST}")
    if not isinstance(about.get("reference"), str):
        raise ReportInputError(f"{path} names no reference scheme; {VALID_MANIFEST}")
    return about


def tuned_setting(scheme_dir: Path) -> dict | None:
    """The study's best trial's parameters (the Optuna plugin's optimization_results.yaml; None without)."""
    results = scheme_dir / "tune" / "optimization_results.yaml"
    return yaml.safe_load(results.read_text())["best_params"] if results.is_file() else None


def link_clock(run: Run, link: str) -> tuple[dict | None, str | None]:
    """The run's clock on its own cluster with `link` between replicas, or None and why: a run whose own
    clock decided its weights (`replay.decided_by_clock`: async arrivals) is timed on its own link only."""
    try:
        own = run_cluster(run.resolved)
        cluster = dataclasses.replace(own, inter=dataclasses.replace(LINKS[link]))
        decided = decided_by_clock(run.resolved)
        if decided is not None and cluster.inter != own.inter:
            return None, f"trained with {decided}: timed on its own link ({own.inter.name}) only"
        return clock_of(run.rows, run.resolved, cluster), None
    except (UserError, KeyError, ValueError, TypeError) as e:
        return None, " ".join(str(e).split())[:200] or type(e).__name__


def time_to(curve: tuple[list, list, list, list], target: float | None) -> float | None:
    """The mean clock at the first point of a mean curve (`seeds.band`) whose mean loss is at or below
    `target`; None when it never is (or there is no target)."""
    if target is None:
        return None
    xs, mean, _, _ = curve
    return next((x for x, y in zip(xs, mean, strict=True) if y <= target), None)


def bits_curve(run: Run) -> list[tuple[int, int, float]]:
    """The run's held-out curve as (update, bits one replica had sent so far, loss): a sync's running
    `bits_total` (the most any replica), or the payload bits of the jobs an async server applied."""
    points, sent, by_replica = [], 0, {}
    held = {id(row) for row in run.heldout()}
    for row in run.rows:
        if row.kind == "sync" and row.bits_total:
            sent = max(sent, *row.bits_total)
        elif row.kind == "arrival":
            bits = row.payload_bits or [32 * (run.params() or 0)] * len(row.replicas)
            for replica, b in zip(row.replicas, bits, strict=True):
                by_replica[replica] = by_replica.get(replica, 0) + b
            sent = max(by_replica.values(), default=0)
        if id(row) in held and row.eval_loss is not None:
            points.append((row.update, sent, row.eval_loss))
    return points


def scheme_row(scheme: str, scheme_dir: Path, seeds: list[Run]) -> dict:
    """One scheme's figures over its seed runs (`curves`: its mean bands against bits and per link; the
    times are filled in by `study_rows` once the reference's loss is known)."""
    finished = [run for run in seeds if run.status == "finished"]
    complete = bool(seeds) and len(finished) == len(seeds)
    finals = [run.summary().get("eval/final_loss") for run in seeds]
    bits = [run_bits(run)[0] for run in seeds]
    clocks = {link: [link_clock(run, link) for run in seeds] for link in TIMED_ON}
    curves = {"bits": band([bits_curve(run) for run in seeds])} if complete else {}
    why = {}
    for link, timed in clocks.items():
        if complete and all(clock is not None for clock, _ in timed):
            heldout = [[(p["update"], p["clock_s"], p["eval_loss"]) for p in c["heldout"]] for c, _ in timed]
            curves[link] = band(heldout)
        else:
            why[link] = next((reason for _, reason in timed if reason), "not every seed finished")
    return {
        "scheme": scheme,
        "tuned": tuned_setting(scheme_dir),
        "seeds": [run.config.get("seed") for run in seeds],
        "finished": f"{len(finished)}/{len(seeds)}",
        "heldout_final": stats(finals) if complete else None,
        "bits": stats(bits) if complete else None,
        "untimed": why,
        "curves": curves,
    }


def study_rows(root: Path, runs: list[Run]) -> tuple[list[dict], float | None, str]:
    """The study's rows (its manifest's schemes that have seed runs among `runs`), the target (the
    reference scheme's mean final held-out loss; None when it has none) and the reference's name."""
    about = manifest(root)
    rows = []
    for scheme in about["schemes"]:
        seeds = [run for run in runs if run.path.parent == (root / scheme / "seeds").resolve()]
        if seeds:
            rows.append(scheme_row(scheme, root / scheme, seeds))
    reference = about["reference"]
    figure = next((row["heldout_final"] for row in rows if row["scheme"] == reference), None)
    target = None if figure is None else figure["mean"]
    for row in rows:
        row["time_to_reference_s"] = {
            link: time_to(row["curves"][link], target) if link in row["curves"] else None for link in TIMED_ON
        }
    return rows, target, reference


def _value(value) -> str:
    """A tuned parameter: a number to 4 significant digits, anything else (a `choice` of names) as it is."""
    return f"{value:.4g}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def _time_cell(row: dict, link: str, target: float | None) -> str:
    if link in row["untimed"] or target is None:
        return "-"
    seconds = row["time_to_reference_s"][link]
    return NOT_REACHED if seconds is None else f"{seconds:.4g}"


def tuned_cells(rows: list[dict], target: float | None, reference: str) -> tuple[list[str], list[list[str]]]:
    """The tuned table: titles and formatted cells."""
    titles = ["scheme", "tuned setting", "seeds", "held-out final: mean (min to max)", "std", "bits/replica"]
    titles += [f"{link} s to {reference}'s loss" for link in TIMED_ON]
    body = []
    for row in rows:
        setting = ", ".join(
            f"{k.removeprefix('outer.')} {_value(v)}" for k, v in (row["tuned"] or {}).items()
        )
        loss, bits = row["heldout_final"], row["bits"]
        body.append(
            [
                row["scheme"],
                setting or "-",
                f"{row['finished']} ({','.join(str(s) for s in row['seeds'])})",
                cell(loss, "{:.4f}"),
                "-" if loss is None else f"{loss['std']:.4f}",
                "-"
                if bits is None
                else cell(bits | {"n": 1} if bits["min"] == bits["max"] else bits, "{:,.0f}"),
                *(_time_cell(row, link, target) for link in TIMED_ON),
            ]
        )
    return titles, body
