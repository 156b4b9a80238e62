"""`python -m hypertrain.report PATH [PATH ...] [--out DIR] [--target-loss X]`: compare runs at a glance.

Reads every run at or under the PATHs, writes `report.md`, `report.html`, `report.json` and the plots
into `PATH/report/` or `--out DIR`, and prints the table; bad input is one line, exit 2, nothing
written; a reader that closes stdout early (`| head -1`) ends it quietly, exit 1. Each run is also
timed by the network clock on the cluster it recorded (docs/clock.md), to `--target-loss` or, without
it, to the largest of the runs' best held-out losses. docs/report.md says what every file, column and
plot shows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from hypertrain.records.rows import EndRow
from hypertrain.report import phases
from hypertrain.report.bits import bits_figures, bits_section
from hypertrain.report.clock.clocks import parse_target, run_clock, target_loss
from hypertrain.report.command import VALID_OUT, check_out, print_out
from hypertrain.report.plots import clock_plot, heldout_plot, phases_plot, spread_plot
from hypertrain.report.render import Section, html, markdown
from hypertrain.report.runs import VALID_PATH, ReportInputError, Run, find_runs, load_run
from hypertrain.report.seeds import SEED_KEYS, SPREAD, group_columns, group_rows, grouped, seed_groups
from hypertrain.report.sources import data_section
from hypertrain.report.table import (
    DIFFERENT_DATA,
    OTHER_ORDER,
    columns,
    data_flags,
    differing_keys,
    flat,
    phase_of,
    table_rows,
)
from hypertrain.report.tuned.section import tuned_sections
from hypertrain.report.tuned.study import study_roots
from hypertrain.rundir.directory import REPORT_FOLDER

PROG = "python -m hypertrain.report"
ERROR = "hypertrain.report: error:"  # every bad input's one line starts so
USAGE = "valid: PATH [PATH ...] [--out DIR] [--target-loss X]"
TITLE = "hypertrain run report"

NOTES = [
    "held-out: the global weights' loss on the held-out slice (nats/token), at the last evaluation "
    "(final: after the last sync; with fragments, after the end's flush of every fragment) and the lowest "
    "of every evaluation (best); the number that compares runs across R and H.",
    "train loss final: the mean over the replicas of their loss at the last update; their batches "
    "shrink as R grows, so it does not compare runs across R.",
    "updates: run / planned. replica-steps/s: the run's `train/replica_steps_per_s` (after the "
    "phase's timing_warmup updates, syncs and evaluations included); tokens/s: its `bench/tokens_per_s` "
    "(supervised tokens per second of update time, the slowest process); a resumed run's last session.",
    "inner bytes/rank and outer bytes/replica: the ring all-reduce formula's totals at the last sync "
    "(inner: within a replica's ranks, every update; outer: across the replicas, every sync). "
    "outer peak bytes/sync: the most one replica sent in one sync (with fragments, one fragment's sync: "
    "about 1/outer.fragments of a whole sync).",
    "wall s: seconds of training (from after the first evaluation to the end of the last round), "
    "summed over a resumed run's sessions.",
    "status: its `end` row's (finished, failed, preempted); without one, running (its process is "
    "alive on this host), crashed (it is not), or unknown (it started on another host).",
    "outer.overlap (a column where runs differ in it): none, delayed (the outer step one round late) or "
    "eager (each replica's own fresh pseudo-gradient in place of its stale one; docs/overlap.md); with an "
    "overlap the clock hides a sync's exchange behind the next round's compute.",
    "simulated s, compute util: the network clock (docs/clock.md) of the run replayed from its records on "
    "the cluster its config.yaml records (cpu_here, measured compute, for a run written before the clock): "
    "its total simulated seconds, and compute / total.",
]

ASYNC_NOTE = (
    "outer.schedule=async runs (docs/async.md; their rows are arrival rows): updates, the slowest "
    "replica's inner steps; the held-out curve's x axis counts server updates; replica-steps/s: the last "
    "session's inner steps over its seconds; tokens/s: the tokens of the jobs that arrived in the last "
    "session over its wall seconds; outer bytes/replica: the most one replica moved, per job its "
    "pseudo-gradient's upload (its payload_bits / 8: 4 N without a codec) and one fp32 download of the "
    "weights (4 N, N the model's parameters); outer peak bytes/sync: the most one job moved; arrivals: "
    "jobs applied; server updates; staleness mean and max over the jobs; async clock s: the network "
    "clock at the last server update (all from the arrival rows)."
)


def clock_notes(target: float | None, rule: str, clusters: list[str]) -> list[str]:
    """The notes on the clock's columns: the target `time to target s` was timed to, and why."""
    if target is None:
        return ["time to target s: no run has a held-out loss, so there is no target."]
    return [
        f"time to target s: the simulated seconds at the run's first held-out loss at or below the target, "
        f"{target:.4f} nats/token ({rule}); - when the run never reached it. Clusters: "
        f"{', '.join(clusters) or 'none'}."
    ]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        print(f"{ERROR} {message}; {USAGE}", file=sys.stderr)
        sys.exit(2)


def _paths(given: list[str]) -> list[Path]:
    """The PATHs; ReportInputError for an empty one (an unset shell variable), which would be `.`."""
    if "" in given:
        raise ReportInputError(f"PATH='' is not valid; {VALID_PATH}")
    return [Path(path) for path in given]


def _out(given: str | None, paths: list[Path]) -> Path:
    """Where the report goes, checked before anything is written: `--out`, else the one PATH's
    `report/` (a run's own: a resume leaves it as it is, `run.directory.is_report`); ReportInputError
    when it cannot be a directory this user writes into."""
    if given is None:
        if len(paths) > 1:
            raise ReportInputError(f"{len(paths)} PATHs and no --out; valid: one PATH, or --out DIR")
        out = paths[0] / REPORT_FOLDER
        check_out(out, f"{out} (the default --out)")
        return out
    if not given:
        raise ReportInputError(f"--out={given!r} is not valid; {VALID_OUT}")
    check_out(Path(given))
    return Path(given)


def run_names(runs: list[Run]) -> list[str]:
    """Each run's path below the folder all of them share (a single run: its folder's name)."""
    if len(runs) == 1:
        return [runs[0].path.name]
    base = Path(os.path.commonpath([run.path for run in runs]))
    return [str(run.path.relative_to(base)) for run in runs]


def data_note(runs: list[Run], flags: list[str]) -> str:
    """What the data flags compare against: per phase, the data most of its runs saw."""
    references: dict = {}  # phase -> its first run that saw the reference data
    for run, flag in zip(runs, flags, strict=True):
        if flag != DIFFERENT_DATA:
            references.setdefault(phase_of(run), run)
    saw = []
    for phase, reference in references.items():
        fingerprint = reference.plan.get("data/fingerprint") or "-"
        union = reference.plan.get("plan/union_sha256") or "-"
        where = f"of phase {phase} " if len(references) > 1 else ""
        saw.append(
            f"most runs {where}saw data fingerprint `{fingerprint[:16]}` with union hash `{union[:16]}`"
        )
    return (
        f"data: {'; '.join(saw)}; "
        f"'{DIFFERENT_DATA}': another fingerprint or union hash than most runs of its phase (runs of "
        f"different phases are not compared: their ids differ by design); '{OTHER_ORDER}': the same "
        "data, but another data-order digest than most runs of its phase with the same R (the digest "
        "depends on R, so runs with another R are not compared; the rank digest, which depends on the "
        "world, never is)."
    )


def seeds_section(groups: list[dict]) -> Section:
    """The table of the runs grouped over their seeds: one row per group, its figures' mean and spread."""
    notes = [
        f"runs that differ only in {', '.join(f'`{key}`' for key in SEED_KEYS)} form one row: n runs, "
        f"each figure's {SPREAD} over them (report.json also holds their standard deviation, n - 1 in "
        "the denominator); a run that did not finish is a row of its own; `-` where a run of the group "
        "lacks the figure (a run that never reached the target).",
    ]
    return Section("Over seeds", [], group_columns(groups), [bool(row["data"]) for row in groups], notes)


def phases_sections(runs: list[Run], out: Path) -> tuple[list[Section], dict]:
    """One section per experiment=phases sweep among the runs: phases.py's table and a plot."""
    sweeps: dict[Path, list[Run]] = {}
    for run in runs:
        if run.config.get("experiment") == "phases":
            sweeps.setdefault(run.path.parent, []).append(run)
    sections, tables = [], {}
    for sweep, group in sweeps.items():
        status = {run.path.name: run.status for run in group}
        rows = phases.with_scaling([phases.job_row(run.path) for run in group])
        rows = [row | {"status": status[row["job"]]} for row in rows]
        plot = phases_plot(rows, sweep.name, out)
        tables[sweep.name] = rows
        sections.append(
            Section(
                f"Benchmark phases: {sweep.name}",
                paragraphs=[phases.SCALING_NOTE],
                table=phases.cells(rows, phases.columns_for(rows)),
                bullets=phases.measured_on(rows),
                plots=[plot],
            )
        )
    return sections, tables


def run_notes(runs: list[Run], rows: list[dict], untimed: tuple) -> list[str]:
    """A note per run that ended with an error, and per run the clock could not time."""
    ends = [run.rows[-1] if run.rows else None for run in runs]  # an end row is a session's last
    failures = [
        f"{row['run']} {row['status']}: {end.error}"
        for row, end in zip(rows, ends, strict=True)
        if isinstance(end, EndRow) and end.error is not None
    ]
    cannot = [
        f"{row['run']}: no simulated clock ({why})" for row, why in zip(rows, untimed, strict=True) if why
    ]
    return failures + cannot


def build(
    runs: list[Run], out: Path, command: str, given_target: float | None = None
) -> tuple[list[Section], dict, str]:
    """Draw the plots into `out`; return the report's sections, its JSON record, and the terminal table.
    `given_target`: `--target-loss` (None: the largest of the runs' best held-out losses)."""
    names = run_names(runs)
    keys = differing_keys(runs)
    flags = data_flags(runs)
    clocks, untimed = zip(*(run_clock(run) for run in runs), strict=True) if runs else ((), ())
    target, rule = target_loss(given_target, list(clocks))
    clusters = list(dict.fromkeys(clock["cluster"] for clock in clocks if clock is not None))
    rows = table_rows(runs, names, list(clocks), target)
    groups = seed_groups(runs, keys)
    group_table = group_rows(runs, rows, groups, keys)
    plot_keys = [key for key in keys if key not in SEED_KEYS] if grouped(groups) else keys
    table = phases.cells([flat(row) for row in rows], columns(keys, rows))
    marked = [bool(row["data"]) or row["status"] != "finished" for row in rows]
    differ = ", ".join(f"`{key}`" for key in keys) or "nothing"
    intro = f"{len(runs)} runs, made by `{command}`. Config values that differ between them: {differ}."
    notes = [*NOTES, *([ASYNC_NOTE] if any(run.of_kind("arrival") for run in runs) else [])]
    notes += [*clock_notes(target, rule, clusters), data_note(runs, flags), *run_notes(runs, rows, untimed)]
    sections = [Section("Runs", [intro], table, marked, notes)]
    if grouped(groups):
        sections.append(seeds_section(group_table))
    plots = [heldout_plot(runs, names, plot_keys, flags, out, groups)]
    sections.append(Section("Held-out loss", plots=plots))
    if clusters:
        where = f"each run's own cluster ({', '.join(clusters)})"
        timed = clock_plot(runs, names, plot_keys, flags, list(clocks), target, where, out, groups=groups)
        sections.append(Section("Held-out loss against simulated seconds", plots=[timed]))
    data, source_table = data_section(runs, names)
    if data is not None:  # runs on a prepared corpus: its description and the sources' shares
        sections.append(data)
    bits = bits_figures(runs, rows)
    sections.append(bits_section(runs, names, keys, flags, bits, out))
    spreads = [
        spread_plot(run, name, i, out)
        for i, (run, name) in enumerate(zip(runs, names, strict=True))
        if run.replicas > 1
    ]
    if spreads:
        sections.append(Section("Per-replica training loss (runs with R > 1)", plots=spreads))
    phase_sections, phase_tables = phases_sections(runs, out)
    sections += phase_sections
    tuned, tuned_record, tuned_text = tuned_sections(runs, out)
    sections += tuned
    record = {
        "command": command,
        "keys": keys,
        "target_loss": target,
        "target_rule": rule,
        "runs": [
            row | {"path": str(run.path), "clock_error": why}
            for row, run, why in zip(rows, runs, untimed, strict=True)
        ],
        "seed_keys": list(SEED_KEYS),
        "groups": group_table,
        "bits": bits,
        "plots": [asdict(plot) for section in sections for plot in section.plots],
        "phases": phase_tables,
        "sources": source_table,
        "tuned": tuned_record,
    }
    terminal = "\n".join(phases.markdown_table(*table, pad=True))
    if grouped(groups):
        terminal += "\n\nOver seeds:\n" + "\n".join(
            phases.markdown_table(*group_columns(group_table), pad=True)
        )
    terminal += tuned_text
    if target is not None:
        terminal += f"\ntime to target s: to held-out loss {target:.4f} ({rule})"
    return sections, record, terminal


def _remove_stale(out: Path, kept: set[str]) -> None:
    """Remove the plots an earlier report listed in `out` that this one did not draw again."""
    try:
        earlier = json.loads((out / "report.json").read_text())
        for plot in earlier.get("plots", []):
            if plot["file"] not in kept and "/" not in plot["file"]:
                (out / plot["file"]).unlink(missing_ok=True)
    except (OSError, ValueError, KeyError, TypeError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog=PROG, description="Compare runs: a table, plots and a one-page HTML report.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="run, sweep, or a folder above them")
    parser.add_argument("--out", help="where to write the report (default: PATH/report)")
    parser.add_argument(
        "--target-loss",
        metavar="X",
        help="held-out loss the runs are timed to (default: the largest of the runs' best held-out losses)",
    )
    args = parser.parse_args(argv)
    command = " ".join([PROG, *(argv if argv is not None else sys.argv[1:])])
    try:
        paths = _paths(args.paths)
        given_target = parse_target(args.target_loss)
        found = find_runs(paths)
        out = _out(args.out, paths)
        runs = [load_run(path) for path in found]
        study_roots(runs)  # a tuned study's manifest that cannot be read: one line before anything is written
    except ReportInputError as e:
        print(f"{ERROR} {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    sections, record, terminal = build(runs, out, command, given_target)
    _remove_stale(out, {plot["file"] for plot in record["plots"]})
    (out / "report.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "report.md").write_text(markdown(TITLE, sections))
    (out / "report.html").write_text(html(TITLE, sections, out))
    flagged = [f"{row['run']}: {row['data']}" for row in record["runs"] if row["data"]]
    return print_out([terminal, *flagged, f"report: {out / 'report.html'} ({len(record['plots'])} plots)"])
