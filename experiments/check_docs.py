"""The tables of numbers in docs/, re-run and compared with their printed digits, so a page cannot drift
from the code (issue 35, item 7). Each table is registered below: its page, its header line (which finds
it on the page), the commands that give its numbers, and how each printed cell is read from their
records. A check runs the commands of the cheap tables (every command well under a minute on the
2-core development CPU; `--all` adds the expensive ones, `NAME ...` picks tables), prints a verdict per
table and exits 1 when a printed cell differs from what its command gives, at the printed precision.
`--write` puts the commands' numbers into the page instead and stamps the table with the command that
wrote it and the commit.

    python experiments/check_docs.py [NAME ...] [--all] [--write] [--runs DIR] [--list]

`--runs DIR` keeps the runs (a finished run whose overrides are the same is reused), so a check then a
`--write` trains once.

Tables of figures that depend on the machine that measured them (the timings of docs/performance.md,
docs/moe.md, docs/resume.md and the README, the real link's seconds in docs/clock.md, the rounding
differences of docs/parity.md) cannot be compared digit for digit: each is listed in MEASURED with the
machine and the command its page names, and `--list` prints them as not comparable. Where such a table
also holds cells that do not depend on the machine (payload bytes, the ring's formula), those cells are
registered as a table of their own (compression-sizes, performance-dist-bytes, checkpoint-size).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Output:
    """What a command left: a training run's rows and its train.log, or a script's stdout."""

    rows: list[dict] = field(default_factory=list)
    stdout: str = ""
    log: str = ""

    @property
    def summary(self) -> dict:
        merged: dict = {}
        for row in self.rows:
            if row["kind"] == "summary":
                merged |= {k: v for k, v in row.items() if k != "kind"}
        return merged

    def heldout(self) -> list[dict]:
        """The held-out loss after each sync (DiLoCo's sync rows), or each later eval row (streaming)."""
        synced = [r for r in self.rows if r["kind"] == "sync" and r.get("eval_loss") is not None]
        return synced or [r for r in self.rows if r["kind"] == "eval" and r["update"] > 0]

    def best(self) -> float:
        return min(r["eval_loss"] for r in self.rows if r.get("eval_loss") is not None)


Cell = Callable[[dict[str, Output]], str]  # the printed cell, from the outputs of the table's commands


@dataclass(frozen=True)
class Table:
    name: str
    doc: str  # the page, from the repository's root
    header: str  # the table's header line as printed: finds the table on its page
    commands: dict[str, tuple[str, ...]]  # name -> `python -m hypertrain.train` overrides, or a script's
    cells: dict[tuple[str, str], Cell]  # (the row's key, the column's header) -> the printed cell
    key_columns: int = 1  # the leading cells that name a row, joined with " | "
    cheap: bool = True  # every command well under a minute on the 2-core CPU
    below: str = ""  # a line above it (its heading) that picks it where its page has two with its header

    def run_names(self) -> list[str]:
        return list(self.commands)


SCRIPT = "script:"  # a command that starts so is a script (its path follows), not a training run


def train_command(name: str, overrides: tuple[str, ...], run_dir: Path) -> list[str]:
    if overrides and overrides[0].startswith(SCRIPT):
        return [sys.executable, overrides[0].removeprefix(SCRIPT), *overrides[1:]]
    return [sys.executable, "-m", "hypertrain.train", *overrides, "logger=none", f"hydra.run.dir={run_dir}"]


def printed(command: tuple[str, ...]) -> str:
    """The command as a shell takes it ("{NAME}", another command's run directory, as RUN_DIR)."""
    words = [re.sub(r"\{[\w-]+\}", "RUN_DIR", shlex.quote(w)) for w in command]
    if command and command[0].startswith(SCRIPT):
        return " ".join(["python", words[0].removeprefix(SCRIPT), *words[1:]])
    return " ".join(["python -m hypertrain.train", *words, "logger=none"])


# ---------------------------------------------------------------- what a cell is read from


def final(run: str, digits: int = 4) -> Cell:
    return lambda out: f"{out[run].summary['eval/final_loss']:.{digits}f}"


def best(run: str) -> Cell:
    return lambda out: f"{out[run].best():.4f}"


def count(run: str, key: str) -> Cell:
    return lambda out: str(int(out[run].summary.get(key, 0)))


def number(run: str, key: str, spec: str) -> Cell:
    return lambda out: format(out[run].summary[key], spec)


def after_sync(run: str, k: int, clock: bool = False) -> Cell:
    def cell(out: dict[str, Output]) -> str:
        point = out[run].heldout()[k - 1]
        return f"{point['eval_loss']:.4f}" + (f" ({point['clock_s']:.2f})" if clock else "")

    return cell


def goodput(run: str) -> Cell:
    def cell(out: dict[str, Output]) -> str:
        value = out[run].summary.get("churn/goodput")
        return "(1)" if value is None else f"{value:.3f}"

    return cell


def time_to(run: str, target: float) -> Cell:
    def cell(out: dict[str, Output]) -> str:
        reached = [p["clock_s"] for p in out[run].heldout() if p["eval_loss"] <= target]
        return f"{reached[0]:.3f}" if reached else "never"

    return cell


def script_figure(run: str, pattern: str) -> Cell:
    """The first group of `pattern` in a script's output."""

    def cell(out: dict[str, Output]) -> str:
        found = re.search(pattern, out[run].stdout, re.S)
        if found is None:
            raise ValueError(f"{run}'s output has no {pattern!r}")
        return found.group(1)

    return cell


# ---------------------------------------------------------------- the tables

LEAVE_REJOIN = "churn.events=[2:3:leave,4:3:rejoin,3:5:leave,5:5:rejoin,3:6:leave,4:6:rejoin]"
CHURN = {
    "none": ("replicas=8", "churn.p_miss=0"),
    "p_miss 0.1": ("replicas=8", "churn.p_miss=0.1"),
    "p_miss 0.3": ("replicas=8", "churn.p_miss=0.3"),
    "leave/rejoin, rejoin_state=reset": ("replicas=8", LEAVE_REJOIN),
    "leave/rejoin, rejoin_state=carry": ("replicas=8", "churn.rejoin_state=carry", LEAVE_REJOIN),
}
CHURN_RUNS = {row: f"churn-{i}" for i, row in enumerate(CHURN)}


def churn_study() -> Table:
    cells: dict[tuple[str, str], Cell] = {}
    for row, run in CHURN_RUNS.items():
        cells[row, "held-out final"] = final(run)
        cells[row, "held-out best"] = best(run)
        cells[row, "missed replica-rounds"] = count(run, "churn/missed_replica_rounds")
        cells[row, "absent replica-rounds"] = count(run, "churn/absent_replica_rounds")
        cells[row, "goodput"] = goodput(run)
    header = (
        "| churn | held-out final | held-out best | missed replica-rounds | absent replica-rounds | goodput |"
    )
    commands = {CHURN_RUNS[row]: overrides for row, overrides in CHURN.items()}
    return Table("churn-study", "docs/churn.md", header, commands, cells)


def churn_curve() -> Table:
    rows = {
        "none": "none",
        "p_miss 0.3": "p_miss 0.3",
        "leave/rejoin, reset": "leave/rejoin, rejoin_state=reset",
        "leave/rejoin, carry": "leave/rejoin, rejoin_state=carry",
    }
    cells = {(row, str(k)): after_sync(CHURN_RUNS[of], k) for row, of in rows.items() for k in range(1, 9)}
    commands = {CHURN_RUNS[of]: CHURN[of] for of in rows.values()}
    return Table("churn-curve", "docs/churn.md", "| churn | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |", commands, cells)


DEADLINES = {"0 (none)": "0", "0.33": "0.33", "0.273": "0.273", "0.2": "0.2"}
DEADLINE_RUNS = {row: f"deadline-{value}" for row, value in DEADLINES.items()}
DEADLINE_COMMANDS = {
    DEADLINE_RUNS[row]: (
        "replicas=8",
        "cluster.compute=modelled",
        "cluster.straggler.sigma=0.5",
        f"churn.deadline={value}",
    )
    for row, value in DEADLINES.items()
}
TARGET = 3.0467  # the report's --target-loss in docs/churn.md's command


def churn_deadline() -> Table:
    cells: dict[tuple[str, str], Cell] = {}
    for row, run in DEADLINE_RUNS.items():
        cells[row, "held-out final"] = final(run)
        cells[row, "late replica-rounds (of 64)"] = count(run, "churn/late_replica_rounds")
        cells[row, "simulated s"] = number(run, "clock/total_s", ".3f")
        cells[row, f"time to {TARGET} (s)"] = time_to(run, TARGET)
    header = (
        "| churn.deadline (s) | held-out final | late replica-rounds (of 64) | simulated s | "
        f"time to {TARGET} (s) |"
    )
    return Table("churn-deadline", "docs/churn.md", header, DEADLINE_COMMANDS, cells)


def churn_deadline_curve() -> Table:
    rows = {"none": "0 (none)", "0.273": "0.273", "0.2": "0.2"}
    cells = {
        (row, str(k)): after_sync(DEADLINE_RUNS[of], k, clock=True)
        for row, of in rows.items()
        for k in range(1, 9)
    }
    commands = {DEADLINE_RUNS[of]: DEADLINE_COMMANDS[DEADLINE_RUNS[of]] for of in rows.values()}
    header = "| deadline | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |"
    return Table("churn-deadline-curve", "docs/churn.md", header, commands, cells)


def streaming_study() -> Table:
    cells: dict[tuple[str, str], Cell] = {}
    commands = {}
    for alpha in ("0", "0.5"):
        for fragments in ("1", "2", "4"):
            for delay in ("0", "1"):
                run = f"streaming/p{fragments}-tau{delay}-alpha{alpha}"  # a sweep folder: clock-study's
                commands[run] = (
                    "inner.H=8",
                    "model.n_layers=4",
                    f"outer.fragments={fragments}",
                    f"outer.delay={delay}",
                    f"outer.merge_alpha={alpha}",
                )
                row = f"{fragments} | {delay} | {alpha}"
                cells[row, "held-out final"] = final(run)
                cells[row, "held-out best"] = best(run)
                cells[row, "outer bytes/replica"] = number(run, "comm/outer_total_bytes", ",")
                cells[row, "peak bytes/sync"] = number(run, "comm/outer_peak_bytes", ",")
    header = "| P | tau | alpha | held-out final | held-out best | outer bytes/replica | peak bytes/sync |"
    return Table("streaming-study", "docs/streaming.md", header, commands, cells, key_columns=3, cheap=False)


def moe_aux_split() -> Table:
    commands = {
        "moe-default": ("model=moe_tiny",),
        "moe-aux-split": ("script:experiments/bench/moe_stacked.py", "--aux-split", "{moe-default}"),
    }
    cells: dict[tuple[str, str], Cell] = {}
    for row, name in (("initial", "initial"), ("after the default run", "trained")):
        block = name + r" weights, \d+ windows whole: load-balancing loss {aux}, cross-entropy {ce}"
        cells[row, "whole"] = script_figure("moe-aux-split", block.format(aux="([\\d.]+)", ce="[\\d.]+"))
        cells[row, "cross-entropy (all three)"] = script_figure(
            "moe-aux-split", block.format(aux="[\\d.]+", ce="([\\d.]+)")
        )
        for pieces in (2, 8):
            cells[row, f"{pieces} microbatches"] = script_figure(
                "moe-aux-split",
                rf"{name} weights.*?in {pieces} microbatches, token-weighted: load-balancing loss ([\d.]+)",
            )
    header = "| moe_tiny weights | whole | 2 microbatches | 8 microbatches | cross-entropy (all three) |"
    return Table("moe-aux-split", "docs/moe.md", header, commands, cells)


def markdown_cell(run: str, key: str, column: str, key_columns: int = 2) -> Cell:
    """A cell of the markdown table a script printed, its row named by its first cells joined by " | "."""

    def cell(out: dict[str, Output]) -> str:
        lines = [line for line in out[run].stdout.splitlines() if line.startswith("|")]
        header = split_row(lines[0])
        for line in lines[2:]:
            row = split_row(line)
            if " | ".join(row[:key_columns]) == key:
                return row[header.index(column)]
        raise ValueError(f"{run}'s table has no row {key!r}")

    return cell


COMPRESSORS = {  # docs/compression.md's rows: the compressor's overrides, and its runs' folder
    "none": ("none", ("outer.compress=none",)),
    "int8": ("int8", ("outer.compress=int8",)),
    "fp8_e4m3": ("fp8_e4m3", ("outer.compress=fp8_e4m3",)),
    "fp4_e2m1": ("fp4_e2m1", ("outer.compress=fp4_e2m1",)),
    "topk 1%, error feedback": ("topk-ef", ("outer.compress=topk", "outer.error_feedback=true")),
}


def compression_run(row: str, fragments: str) -> str:
    return f"compression/{COMPRESSORS[row][0]}-p{fragments}"  # a sweep folder: clock-study's


def vs_none(run: str, plain: str) -> Cell:
    return lambda out: f"{out[run].summary['eval/final_loss'] - out[plain].summary['eval/final_loss']:+.4f}"


def compression_study() -> Table:
    cells: dict[tuple[str, str], Cell] = {}
    commands = {}
    for fragments in ("1", "2"):
        for row, (_, overrides) in COMPRESSORS.items():
            run = compression_run(row, fragments)
            commands[run] = ("inner.H=8", *overrides, f"outer.fragments={fragments}")
            key = f"{row} | {fragments}"
            cells[key, "held-out final"] = final(run)
            cells[key, "outer bytes/replica"] = number(run, "comm/outer_total_bytes", ",")
            cells[key, "peak bytes/sync"] = number(run, "comm/outer_peak_bytes", ",")
            if row != "none":
                cells[key, "vs none"] = vs_none(run, compression_run("none", fragments))
    header = "| compress | P | held-out final | outer bytes/replica | peak bytes/sync | vs none |"
    return Table("compression-study", "docs/compression.md", header, commands, cells, key_columns=2)


CLOCK_LINKS = ("datacenter_100g", "cross_region_10g", "internet_1g")
CLOCK_COLUMNS = ["target", "held-out final", *(f"{link} s (vs plain)" for link in CLOCK_LINKS)]


def clock_study(sweep: str, study: Table, settings: list[str]) -> Table:
    """docs/clock.md's study: the rows of one sweep (its runs are those of `study`, in its folder)."""
    commands = dict(study.commands)
    commands[f"clock-study-{sweep}"] = (
        "script:experiments/clock_study.py",
        "{" + sweep + "}",
        "--model-params",
        "1000000000",
        "--device",
        "h100",
        "--links",
        *CLOCK_LINKS,
    )
    cells: dict[tuple[str, str], Cell] = {}
    for setting in settings:
        key = f"{sweep} | {setting}"
        cells |= {(key, c): markdown_cell(f"clock-study-{sweep}", key, c) for c in CLOCK_COLUMNS}
    header = "| " + " | ".join(["sweep", "setting", *CLOCK_COLUMNS]) + " |"
    return Table(
        f"clock-study-{sweep}", "docs/clock.md", header, commands, cells, key_columns=2, cheap=study.cheap
    )


def clock_study_streaming() -> Table:
    settings = [
        f"P={fragments} tau={delay} alpha={alpha}"
        for alpha in ("0.0", "0.5")
        for fragments in ("1", "2", "4")
        for delay in ("0", "1")
    ]
    return clock_study("streaming", streaming_study(), settings)


def clock_study_compression() -> Table:
    labels = {"none": "", "int8": " int8", "fp8_e4m3": " fp8_e4m3", "fp4_e2m1": " fp4_e2m1"}
    labels["topk 1%, error feedback"] = " topk +EF"
    settings = [
        f"P={fragments} tau=0 alpha=0.0{labels[row]}" for row in COMPRESSORS for fragments in ("1", "2")
    ]
    return clock_study("compression", compression_study(), settings)


def overlap_study() -> Table:
    """docs/overlap.md's study: experiments/overlap_study.py trains its 24 runs into one folder and
    prints the clock's replay of them (experiments/clock_study.py's table)."""
    commands = {"overlap-study": ("script:experiments/overlap_study.py", "{overlap-study-runs}")}
    plain = "P=1 tau=0 alpha=0.0"
    settings = [plain, *(f"{plain} {scheme} outer lr={lr}" for scheme, lr in OVERLAP_SETTINGS)]
    cells: dict[tuple[str, str], Cell] = {}
    for sweep in (f"r{R}-h{H}" for R in (2, 4) for H in (4, 8, 16)):
        for setting in settings:
            key = f"{sweep} | {setting}"
            cells |= {(key, c): markdown_cell("overlap-study", key, c) for c in CLOCK_COLUMNS}
    header = "| " + " | ".join(["sweep", "setting", *CLOCK_COLUMNS]) + " |"
    return Table("overlap-study", "docs/overlap.md", header, commands, cells, key_columns=2, cheap=False)


def codec_study() -> Table:
    """docs/compression.md's study of loss against bits: experiments/codec_study.py trains its 20 runs
    and prints its table (then the clock's replay, a second table, not compared here)."""
    commands = {"codec-study": ("script:experiments/codec_study.py", "{codec-study-runs}")}
    settings = ("none", "int8", "fp4_e2m1", "e3m0", "topk 1% +EF", "sparseloco 1.6%", "sparseloco 3.1%")
    settings += ("dct topk 1% +EF", "lowrank r1 +EF", "lowrank r4 +EF")
    columns = ("held-out final", "bits/replica", "x below fp32")  # Pareto follows from them
    cells: dict[tuple[str, str], Cell] = {}
    for H in (8, 30):
        for setting in settings:
            key = f"{H} | {setting}"
            cells |= {(key, c): markdown_cell("codec-study", key, c) for c in columns}
    header = "| H | setting | held-out final | bits/replica | x below fp32 | Pareto |"
    return Table("codec-study", "docs/compression.md", header, commands, cells, key_columns=2, cheap=False)


OVERLAP_SETTINGS = (("delayed", "0.7"), ("eager", "0.7"), ("delayed", "0.35"))  # overlap_study.py's runs


# experiments/bench/compression.py's settings, the rows of docs/performance.md's codec table
COMPRESSION_SETTINGS = ("int8", "uint8", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "e3m0", "topk", "sparseloco")
COMPRESSION_SETTINGS += ("sparseloco-3%", "dct-topk", "lowrank-r1", "lowrank-r4")


def sweeps_study() -> Table:
    """docs/sweeps.md's Optuna study: experiments/optuna_example.py runs its 8 trials (seeded: the same
    proposals every time) and prints its table."""
    commands = {"sweeps-study": ("script:experiments/optuna_example.py", "{sweeps-study-runs}")}
    columns = ("outer.lr", "outer.momentum", "inner.H", "held-out final")  # a state follows from its loss
    cells: dict[tuple[str, str], Cell] = {}
    for trial in map(str, range(8)):
        cells |= {(trial, c): markdown_cell("sweeps-study", trial, c, key_columns=1) for c in columns}
    header = "| trial | outer.lr | outer.momentum | inner.H | state | held-out final |"
    return Table("sweeps-study", "docs/sweeps.md", header, commands, cells, cheap=False)


TUNED_SCHEMES = ("diloco", "eager", "int8")
TUNED_EXAMPLE = (
    "script:experiments/tuned_study.py",
    "{tuned-example-runs}",
    "--schemes",
    ",".join(TUNED_SCHEMES),
)
TUNED_EXAMPLE += ("--trials", "6", "--seeds", "3", "--updates", "8", "--H", "2", "model.d_model=32")
TUNED_EXAMPLE += ("data.seq_len=32", "data.heldout=64", "phase.global_batch=32")
TUNED_LINKS = ("datacenter_100g", "cross_region_10g", "internet_1g")  # hypertrain.report.tuned.study's
TUNED_COLUMNS = ("tuned setting", "seeds", "held-out final: mean (min to max)", "std", "bits/replica")
TUNED_COLUMNS += tuple(f"{link} s to diloco's loss" for link in TUNED_LINKS)
# The three studies re-done tuned (issue 52): one study per corpus, its rows shown where their scheme is
TUNED_ALL = "diloco,delayed,eager,streaming,sparseloco,int8,lowrank,async_dn_dylu,adam"
TUNED_STUDY = ("--schemes", TUNED_ALL, "--trials", "6", "--seeds", "3", "--updates", "192", "--H", "8")
TUNED_CORPORA = {  # name: the study's extra options, the heading above its table on each page
    "bytes": ((), "### The stdlib's source as bytes"),
    "docstrings": (("--corpus", "docstrings"), "### The stdlib's docstrings, a BPE of 512 tokens"),
}
TUNED_PAGES = {  # name: the page, its schemes (the reference first)
    "overlap": ("docs/overlap.md", ("diloco", "delayed", "eager", "streaming")),
    "codecs": ("docs/compression.md", ("diloco", "sparseloco", "int8", "lowrank")),
    "async": ("docs/async.md", ("diloco", "async_dn_dylu")),
}


def tuned_table(name: str, doc: str, schemes: tuple, run: str, command: tuple, below: str = "") -> Table:
    """The report's tuned table that tuned_study.py prints (`run`: the command's name), its rows of
    `schemes`: every cell but an async scheme's time on the links its clock did not run on (`-`)."""
    cells = {
        (s, c): markdown_cell(run, s, c, key_columns=1)
        for s in schemes
        for c in TUNED_COLUMNS
        if not (s.startswith("async") and c.endswith("s to diloco's loss") and "cross_region_10g" not in c)
    }
    header = "| " + " | ".join(("scheme", *TUNED_COLUMNS)) + " |"
    return Table(name, doc, header, {run: command}, cells, cheap=False, below=below)


def tuned_example() -> Table:
    """docs/sweeps.md's tuned study: experiments/tuned_study.py's 27 runs (seeded studies, deterministic
    runs) and the report's tuned table it prints: every cell."""
    return tuned_table("tuned-example", "docs/sweeps.md", TUNED_SCHEMES, "tuned-example", TUNED_EXAMPLE)


def tuned_studies() -> list[Table]:
    """The overlap, codec and async studies re-done tuned: tuned_study.py's 81 runs on each corpus (about
    35 minutes each here), each page the rows of its schemes under the corpus's heading."""
    tables = []
    for corpus, (options, heading) in TUNED_CORPORA.items():
        run = f"tuned-{corpus}"
        command = ("script:experiments/tuned_study.py", f"{{{run}-runs}}", *TUNED_STUDY, *options)
        for page, (doc, schemes) in TUNED_PAGES.items():
            tables.append(tuned_table(f"tuned-{page}-{corpus}", doc, schemes, run, command, below=heading))
    return tables


def data_study() -> Table:
    """docs/data.md's study of replicas on different data: experiments/data_study.py prepares its corpus,
    trains its 4 runs (iid and by_source at H = 5 and 20) and prints the held-out loss per source."""
    commands = {"data-study": ("script:experiments/data_study.py", "{data-study-runs}")}
    columns = [f"{what} @{u}" for u in (20, 60, 120, 240) for what in ("prose", "code", "mean")]
    cells: dict[tuple[str, str], Cell] = {}
    for H in (5, 20):
        for split in ("iid", "by_source"):
            key = f"{H} | {split}"
            cells |= {(key, c): markdown_cell("data-study", key, c) for c in columns}
    header = "| H | split | " + " | ".join(columns) + " |"
    return Table("data-study", "docs/data.md", header, commands, cells, key_columns=2, cheap=False)


def prepare_line(run: str, k: int) -> Cell:
    """The k-th line a script printed, in backticks, less the seconds and tokens/s of prepare's end line
    (the machine's: the page prints them as "in … s (… tokens/s)" after it)."""

    def cell(out: dict[str, Output]) -> str:
        line = out[run].stdout.splitlines()[k]
        timed = re.search(r" in [\d.]+ s \([\d,]+ tokens/s\)$", line)
        return f"`{line[: timed.start()]}` in … s (… tokens/s)" if timed else f"`{line}`"

    return cell


def prepare_example() -> Table:
    """docs/data.md's example of prepare's end line: the standard library's email and json packages with
    a trained BPE, then the same command again (experiments/prepare_example.py runs both)."""
    commands = {"prepare-example": ("script:experiments/prepare_example.py",)}
    cells = {
        ("the first time", "prints"): prepare_line("prepare-example", 0),
        ("again", "prints"): prepare_line("prepare-example", 1),
    }
    header = "| `prepare 'email/**/*.py' 'json/*.py' --out corpora/mine --tokenizer train:2048` | prints |"
    return Table("prepare-example", "docs/data.md", header, commands, cells)


def compression_sizes() -> Table:
    """docs/performance.md's codec table: its byte counts only (its seconds are timings: MEASURED)."""
    commands = {"compression-sizes": ("script:experiments/bench/compression.py", "--sizes")}
    cells: dict[tuple[str, str], Cell] = {}
    for codec in COMPRESSION_SETTINGS:
        line = rf"(?m)^{re.escape(codec)} +([\d,]+) +([\d.]+)"
        cells[codec, "payload B/replica (default)"] = script_figure("compression-sizes", line)
        cells[codec, "x below fp32"] = script_figure(
            "compression-sizes", line.replace("([\\d,]+)", "[\\d,]+")
        )
    header = (
        "| codec | payload B/replica (default) | x below fp32 | enc+dec s (default) | % of round | "
        "enc+dec s (base) | % of round |"
    )
    return Table("compression-sizes", "docs/performance.md", header, commands, cells)


def heldout_line(run: str) -> Cell:
    """The held-out loss at the start and after each sync, 3 decimals, the last in bold."""

    def cell(out: dict[str, Output]) -> str:
        start = [r["eval_loss"] for r in out[run].rows if r["kind"] == "eval" and r["update"] == 0]
        losses = [f"{loss:.3f}" for loss in start + [p["eval_loss"] for p in out[run].heldout()]]
        return ", ".join([*losses[:-1], f"**{losses[-1]}**"])

    return cell


def moe_heldout() -> Table:
    commands = {"tiny-default": ("model=tiny",), "moe-default": ("model=moe_tiny",)}
    cells = {
        ("tiny", "held-out"): heldout_line("tiny-default"),
        ("moe_tiny", "held-out"): heldout_line("moe-default"),
    }
    return Table("moe-heldout", "docs/moe.md", "| model | held-out |", commands, cells)


def deduplicated(run: str, column: str) -> Cell:
    """The examples before de-duplication, the distinct ones or the dropped ones, from the run's data line
    in train.log ("488,316 windows of 65 (4,265 duplicates dropped)")."""

    def cell(out: dict[str, Output]) -> str:
        found = re.search(
            r"([\d,]+) (?:windows|paragraphs) of .*?([\d,]+) duplicates dropped\)", out[run].log
        )
        if found is None:
            raise ValueError(f"{run}'s train.log has no line of its examples")
        distinct, dropped = (int(n.replace(",", "")) for n in found.groups())
        return f"{ {'examples': distinct + dropped, 'distinct': distinct, 'dropped': dropped}[column]:,}"

    return cell


def concepts_duplicates() -> Table:
    commands = {
        "data-windows": ("phase.updates=1", "phase.timing_warmup=0", "checkpoint.every=0"),
        "data-documents": (
            "data.examples=documents",
            "data.max_len=256",
            "phase.updates=1",
            "phase.timing_warmup=0",
            "checkpoint.every=0",
        ),
    }
    rows = {
        "`data.examples=windows`, `seq_len=64`": "data-windows",
        "`data.examples=documents`, `max_len=256`": "data-documents",
    }
    cells = {
        (row, c): deduplicated(run, c)
        for row, run in rows.items()
        for c in ("examples", "distinct", "dropped")
    }
    header = "| stdlib, Python 3.11.7 | examples | distinct | dropped |"
    return Table("concepts-duplicates", "docs/concepts.md", header, commands, cells)


def checkpoint_size() -> Table:
    """docs/resume.md's checkpoint sizes: the parameters and the file (its write seconds are the disk's)."""
    commands = {"checkpoint-size": ("script:experiments/bench/checkpoint_size.py", "--repeats", "1")}
    rows = {  # the page's row -> the script's, and the file's digits as printed
        "default (`model=tiny`, R 4)": ("default (model=tiny, R 4)", 1),
        "`model=base`, R 16": ("model=base, R 16", 0),
    }
    cells: dict[tuple[str, str], Cell] = {}
    for row, (case, digits) in rows.items():
        line = rf"(?m)^{re.escape(case)} +([\d,]+) +([\d.]+) "
        cells[row, "parameters"] = script_figure("checkpoint-size", line)
        mib = script_figure("checkpoint-size", line.replace("([\\d,]+)", "[\\d,]+"))
        cells[row, "file"] = lambda out, mib=mib, digits=digits: f"{float(mib(out)):.{digits}f} MiB"
    header = "| config | parameters | file | write (median, min-max) |"
    return Table("checkpoint-size", "docs/resume.md", header, commands, cells, cheap=False)  # 582 MiB written


DIST_CASES = {  # experiments/bench/dist_overhead.py's case -> its row's label in docs/distributed.md
    "benchmark W2 R1 (L 2)": "benchmark W2 R1 (L 2)",
    "benchmark W4 R2 (L 2)": "benchmark W4 R2 (L 2)",
    "replicas P2 W4 R4": "replicas P2 W4 R4",
}


def dist_collective_bytes(case: str, k: int) -> Cell:
    """The k-th byte count (inner payload, its formula, outer payload, its formula) of a case's row in
    dist_overhead's table of collectives (the seconds between them are the machine's)."""
    row = rf"(?m)^{re.escape(case)} +([\d,]+) +([\d,]+) .*?% +([\d,]+) +([\d,]+) "

    def cell(out: dict[str, Output]) -> str:
        collectives = out["dist-overhead"].stdout.split("dist's collectives", 1)[1]
        found = re.search(row, collectives)
        if found is None:
            raise ValueError(f"dist-overhead's table of collectives has no row {case!r}")
        return found.group(k)

    return cell


def dist_bytes(name: str, doc: str, header: str, labels: dict[str, str], names: list[str]) -> Table:
    """A table of the bytes rank 0 hands to collectives under processes=dist, beside the ring's formula:
    the same in every repeat (one is run; the pages' commands repeat 5 times for the seconds)."""
    commands = {"dist-overhead": ("script:experiments/bench/dist_overhead.py", "--repeats", "1")}
    cells = {
        (labels[case], column): dist_collective_bytes(case, k + 1)
        for case in DIST_CASES
        for k, column in enumerate(names)
    }
    return Table(name, doc, header, commands, cells, cheap=False)


def distributed_bytes() -> Table:
    header = "| run | inner payload / update | formula | outer payload / sync | formula | why they differ |"
    names = ["inner payload / update", "formula", "outer payload / sync", "formula 2"]
    return dist_bytes("distributed-bytes", "docs/distributed.md", header, DIST_CASES, names)


def performance_dist_bytes() -> Table:
    labels = {
        "benchmark W2 R1 (L 2)": "benchmark W2 R1",
        "benchmark W4 R2 (L 2)": "benchmark W4 R2",
        "replicas P2 W4 R4": "replicas layout P2 W4 R4",
    }
    header = (
        "| case | inner payload / update | formula | inner ms / update | share of update | "
        "outer payload / sync | formula | outer ms / sync |"
    )
    names = ["inner payload / update", "formula", "outer payload / sync", "formula 2"]
    return dist_bytes("performance-dist-bytes", "docs/performance.md", header, labels, names)


TABLES = {
    t.name: t
    for t in (
        churn_study(),
        churn_curve(),
        churn_deadline(),
        churn_deadline_curve(),
        streaming_study(),
        moe_aux_split(),
        moe_heldout(),
        clock_study_streaming(),
        compression_study(),
        clock_study_compression(),
        overlap_study(),
        codec_study(),
        sweeps_study(),
        tuned_example(),
        *tuned_studies(),
        data_study(),
        prepare_example(),
        compression_sizes(),
        distributed_bytes(),
        performance_dist_bytes(),
        concepts_duplicates(),
        checkpoint_size(),
    )
}


@dataclass(frozen=True)
class Measured:
    """A table of figures that depend on the machine that measured them (timings, page faults, rounding
    differences of one CPU's torch build): never compared digit for digit. Its page names the machine and
    the command; `--list` prints them as not comparable. Cells of such a table that do not depend on the
    machine (byte and parameter counts) are registered in TABLES where a cheap command gives them."""

    doc: str
    header: str  # the table's header line as printed (tests/test_check_docs.py finds it on its page)
    machine: str
    command: str


PERFORMANCE = "docs/performance.md"
XEON = "the 2-vCPU Intel Xeon (performance.md's machine table)"
EPYC = "the 2-core AMD EPYC (performance.md's machine table)"
UNNAMED = "a 2-core CPU whose model was not recorded"
MEASURED = (
    Measured(
        PERFORMANCE,
        "| measurement | seed | ours | ratio | target |",
        XEON + ", a3bdf44",
        "python experiments/bench/plan_speed.py",
    ),
    Measured(
        PERFORMANCE,
        "| mode | opt | d | R | loop ms | stacked ms | stacked/loop | loop r-s/s | stacked r-s/s | "
        "stacked % peak |",
        XEON + ", e2bcefd",
        "python experiments/bench/stacked_vs_loop.py --repeats 9",
    ),
    Measured(
        PERFORMANCE,
        "| R = 16, AdamW | run 1 (peak 251.6) | run 2 (peak 293.0) | run 3 (peak 223.9, table above) | "
        "target |",
        XEON + ", e2bcefd",
        "python experiments/bench/stacked_vs_loop.py --repeats 9",
    ),
    Measured(
        PERFORMANCE,
        "| target | measured (runs 2 and 3) | verdict |",
        XEON + ", e2bcefd",
        "python experiments/bench/stacked_vs_loop.py --repeats 9",
    ),
    Measured(
        PERFORMANCE,
        "| d | run | loop eager | loop compiled | stacked eager | stacked compiled | "
        "stacked matmul + attention | floor | rest (compiled) | target |",
        XEON,
        "python experiments/bench/stacked_floor.py",
    ),
    Measured(
        PERFORMANCE,
        "| recorded | default glibc | kept |",
        EPYC + ", c6d17dd (the docstring's row: not recorded)",
        "python -c \"from test_runtime import faults_per_step as f; print('default', f('default'), 'keep', "
        "f('keep'))\" (in tests/)",
    ),
    Measured(
        PERFORMANCE,
        "| case | P | dist | stacked | stacked-1t | run wall s, dist / stacked |",
        UNNAMED + ", 7729e1e",
        "python experiments/bench/dist_overhead.py --repeats 5",
    ),
    Measured(
        PERFORMANCE,
        "| case | dist / stacked, median | best/best | dist / stacked-1t, median | best/best |",
        UNNAMED + ", 7733dec to 7729e1e",
        "python experiments/bench/dist_overhead.py --repeats 5",
    ),
    Measured(  # its byte columns are compared: performance-dist-bytes
        PERFORMANCE,
        "| case | inner payload / update | formula | inner ms / update | share of update | "
        "outer payload / sync | formula | outer ms / sync |",
        UNNAMED + ", 7729e1e",
        "python experiments/bench/dist_overhead.py --repeats 5",
    ),
    Measured(  # its presentations and distinct ids do not depend on the machine (a sweep of 4 dist runs)
        PERFORMANCE,
        "| phase | world | examples/s | examples/s per rank | tokens/s | compute ms/update | "
        "all-reduce ms/update | all-reduce share | presentations | distinct ids | scaling efficiency |",
        EPYC + ", c8c8043",
        "python -m hypertrain.train experiment=phases logger=none",
    ),
    Measured(
        PERFORMANCE,
        "| phase | world | examples/s | examples/s per rank | frames/s | tokens/s | padded tokens/s | "
        "compute ms/update | all-reduce ms/update | all-reduce share | padding efficiency | presentations | "
        "distinct ids | scaling efficiency | status |",
        EPYC + ", 0ca656b",
        "python -m hypertrain.train experiment=audio_phases data.speech_sentences=6000 logger=none",
    ),
    Measured(  # its byte columns are compared: compression-sizes
        PERFORMANCE,
        "| codec | payload B/replica (default) | x below fp32 | enc+dec s (default) | % of round | "
        "enc+dec s (base) | % of round |",
        "a 2-core CPU shared with other work, 2026-12-02",
        "python experiments/bench/compression.py",
    ),
    Measured(
        "docs/moe.md",
        "| | grouped | dense masked | grouped / dense |",
        "the 2-core development CPU, 95b27de",
        "python experiments/bench/moe_stacked.py --repeats 5",
    ),
    Measured(
        "docs/moe.md",
        "| optimizer | model | loop ms | stacked ms | stacked / loop |",
        "the 2-core development CPU, 95b27de",
        "python experiments/bench/moe_stacked.py --repeats 5",
    ),
    Measured(  # its parameters and file sizes are compared: checkpoint-size
        "docs/resume.md",
        "| config | parameters | file | write (median, min-max) |",
        "the 2-core development machine's disk",
        "python experiments/bench/checkpoint_size.py",
    ),
    Measured(
        "docs/data.md",
        "| 50 MB of the standard library's `.py` text (49,964,730 characters), a `train:4096` tokenizer.json "
        "| peak resident | bytes a character |",
        XEON + ", 1764e4d (the last row at ea3682b, --mb 10)",
        "python experiments/bench/prepare_memory.py --mb 50",
    ),
    Measured(
        "README.md",
        "| run | eager | compiled, empty cache | compiled, cache filled |",
        "the 2-core development CPU, ed7eaa4",
        "python -m hypertrain.train logger=none [engine.compile=true]",
    ),
    Measured(
        "docs/clock.md",
        "| rate | world | collective | formula | measured median | difference |",
        "the 2-core development machine's network namespaces (as root), 2026-12-02",
        "python -m pytest -s tests/test_clock_link.py",
    ),
    Measured(
        "docs/parity.md",
        "| case | stack | loss rel | weight rel (norm) | weight max rel (per entry) |",
        "torch 2.13 CPU, 2 threads (rounding differences of that build)",
        "python experiments/sim/parity_equiv.py",
    ),
    Measured(
        "docs/parity.md",
        "| dist run | layout | losses bitwise | max rel loss diff | final held-out, dist / simulation | "
        "max rel held-out diff | weights max rel (norm) |",
        "the 2-core development CPU (rounding differences of its torch build)",
        "python -m hypertrain.train experiment=quick logger=none processes=dist world=2 replicas=1 (and the "
        "rest of the page's commands, one pair per row)",
    ),
)


# ---------------------------------------------------------------- reading and comparing a page


def split_row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def columns(table: Table) -> list[str]:
    """The table's column headers, a repeated one numbered from its second ("formula", "formula 2")."""
    named, seen = [], {}
    for column in split_row(table.header):
        seen[column] = seen.get(column, 0) + 1
        named.append(column if seen[column] == 1 else f"{column} {seen[column]}")
    return named


def find_table(text: str, table: Table) -> tuple[int, int]:
    """The lines [first, end) of the table's rows below its header (and the rule under it)."""
    lines = text.splitlines()
    below = getattr(table, "below", "")  # a Measured table has none
    if below and below not in lines:
        raise ValueError(f"{table.doc}: no line {below!r} above the table {table.header!r}")
    after = lines.index(below) if below else -1
    starts = [i for i, line in enumerate(lines) if line.strip() == table.header and i > after]
    if not starts or (len(starts) > 1 and not below):  # below one: the first after it
        raise ValueError(
            f"{table.doc}: {len(starts)} tables with the header {table.header!r}; valid: exactly one"
        )
    first = starts[0] + 2
    end = first
    while end < len(lines) and lines[end].lstrip().startswith("|"):
        end += 1
    return first, end


def printed_cells(text: str, table: Table) -> dict[tuple[str, str], str]:
    """The table's cells as printed: (the row's key, the column's header) -> the cell."""
    first, end = find_table(text, table)
    names = columns(table)
    cells = {}
    for line in text.splitlines()[first:end]:
        row = split_row(line)
        key = " | ".join(row[: table.key_columns])
        cells |= {(key, column): cell for column, cell in zip(names, row, strict=True)}
    return cells


def compare(text: str, table: Table, computed: dict[tuple[str, str], str]) -> list[str]:
    """Each registered cell whose printed digits differ from the computed ones, as a line."""
    cells = printed_cells(text, table)
    wrong = []
    for key in table.cells:
        if key not in cells:
            wrong.append(f"{key[0]} / {key[1]}: not in the table")
        elif cells[key] != computed[key]:
            wrong.append(f"{key[0]} / {key[1]}: printed {cells[key]}, the commands give {computed[key]}")
    return wrong


STAMP = "Written by `python experiments/check_docs.py --write "


def stamp(table: Table, commit: str) -> str:
    """The line under a table; one that registers some of its columns names them (the others are figures
    of the machine that measured them, MEASURED)."""
    named = list(zip(columns(table), split_row(table.header), strict=True))[table.key_columns :]
    registered = [header for column, header in named if any(key[1] == column for key in table.cells)]
    which = ""
    if len(registered) < len(named):
        which = f" (its columns {', '.join(dict.fromkeys(registered))}"
        machine = any(m.doc == table.doc and m.header == table.header for m in MEASURED)
        which += "; the others are the machine's, `--list`)" if machine else ")"
    return (
        f"{STAMP}{table.name}` at {commit} from its commands{which}, "
        f"one run each (`--list` prints them); `python experiments/check_docs.py "
        f"{table.name}` checks them."
    )


def written(text: str, table: Table, computed: dict[tuple[str, str], str], commit: str) -> str:
    """The page with the table's registered cells set to the computed ones, stamped below the table."""
    first, end = find_table(text, table)
    lines = text.splitlines()
    names = columns(table)
    for i in range(first, end):
        row = split_row(lines[i])
        key = " | ".join(row[: table.key_columns])
        row = [computed.get((key, column), cell) for column, cell in zip(names, row, strict=True)]
        lines[i] = "| " + " | ".join(row) + " |"
    line = stamp(table, commit)
    # The stamps below a table, one a line after a blank one (a table registered in parts has several).
    stamps = end + 1
    while stamps < len(lines) and lines[stamps].startswith(STAMP):
        stamps += 1
    own = [i for i in range(end + 1, stamps) if lines[i].startswith(f"{STAMP}{table.name}`")]
    if own:
        lines[own[0]] = line
    elif stamps > end + 1:
        lines[stamps:stamps] = [line]
    else:
        lines[end:end] = ["", line]
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


# ---------------------------------------------------------------- running the commands


def run(name: str, command: tuple[str, ...], runs: Path, outputs: dict[str, Output]) -> Output:
    run_dir = runs / name
    # "{NAME}" in a command: the directory of the command NAME (or the folder of the commands NAME/...)
    command = tuple(re.sub(r"\{([\w/-]+)\}", lambda m: str(runs / m.group(1)), part) for part in command)
    script = bool(command) and command[0].startswith(SCRIPT)
    done = run_dir / ("stdout.txt" if script else "metrics.jsonl")
    same = run_dir / "command.json"
    if done.exists() and same.exists() and json.loads(same.read_text()) == list(command):
        print(f"  {name}: reused {run_dir}", flush=True)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        same.unlink(missing_ok=True)
        print(f"  {name}: {printed(command)}", flush=True)
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        finished = subprocess.run(
            train_command(name, command, run_dir), cwd=REPO, env=env, capture_output=True, text=True
        )
        if finished.returncode != 0:
            raise RuntimeError(
                f"{name} failed (exit {finished.returncode}): {finished.stderr.strip()[-500:]}"
            )
        if script:
            done.write_text(finished.stdout)
        same.write_text(json.dumps(list(command)))
    if script:
        return Output(stdout=done.read_text())
    log = run_dir / "train.log"
    return Output(
        rows=[json.loads(line) for line in done.read_text().splitlines() if line.strip()],
        log=log.read_text() if log.exists() else "",
    )


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "hypertrain", "conf", "experiments/bench"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="tables to check (default: the cheap ones)")
    parser.add_argument("--all", action="store_true", help="the expensive tables too")
    parser.add_argument("--write", action="store_true", help="write the numbers into the pages instead")
    parser.add_argument("--runs", type=Path, default=None, help="keep the runs here (reused when the same)")
    parser.add_argument("--list", action="store_true", help="list the tables and their commands")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in TABLES]
    if unknown:
        print(f"check_docs: error: no table {unknown[0]!r}; valid: {', '.join(TABLES)}", file=sys.stderr)
        return 2
    chosen = [TABLES[n] for n in args.names] or [t for t in TABLES.values() if t.cheap or args.all]
    if args.list:
        for t in TABLES.values():
            print(f"{t.name} ({t.doc}, {'cheap' if t.cheap else 'expensive'}):")
            for c in t.commands.values():
                print(f"    {printed(c)}")
        print("not comparable (figures of the machine that measured them; the page names it):")
        for m in MEASURED:
            print(f"  {m.doc}: {m.header[:60]}{'...' if len(m.header) > 60 else ''}")
            print(f"    measured on {m.machine}: {m.command}")
        return 0
    runs = args.runs or Path(tempfile.mkdtemp(prefix="check_docs-"))
    outputs: dict[str, Output] = {}
    failed = 0
    for table in chosen:
        print(f"{table.name} ({table.doc}):", flush=True)
        for name, command in table.commands.items():
            if name not in outputs:
                outputs[name] = run(name, command, runs, outputs)
        computed = {key: cell(outputs) for key, cell in table.cells.items()}
        page = REPO / table.doc
        text = page.read_text()
        if args.write:
            page.write_text(written(text, table, computed, commit()))
            print(f"{table.name}: written ({len(computed)} cells)")
            continue
        wrong = compare(text, table, computed)
        for line in wrong:
            print(f"  {line}")
        print(
            f"{table.name}: {'FAIL, ' + str(len(wrong)) + ' of ' if wrong else 'ok, '}{len(computed)} cells"
        )
        failed += bool(wrong)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
