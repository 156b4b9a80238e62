"""The run report (issue 14): `python -m hypertrain.report` on real runs, checked against their records.

The module's runs are made through the entry, as a user makes them (world 2, engine=stacked, a
32-wide model, logger=none): a Hydra sweep of the smoke phase over R in 1, 2 and H in 1, 3; one run
with another `data.shuffle_seed` (the same ids, other examples under them: another data
fingerprint); one run hung by the test-only fault hook at update 4, read while it hangs and then
SIGKILLed; a small `experiment=phases` sweep (the smoke phase at worlds 1 and 2); and a sweep of
Streaming DiLoCo's outer.fragments and outer.delay (issue 23; `experiment=quick`). Every figure
of the table is recomputed here from metrics.jsonl and config.yaml by its definition (docs/report.md),
not read back from the report's own code; the page is loaded in headless Chromium.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    CHROMIUM,
    FAULT_ENV,
    MARK,
    QUICK,
    ReferenceRuns,
    entry,
    finish,
    load_in_chromium,
    start_entry,
    tree,
)
from matplotlib.image import imread
from omegaconf import OmegaConf

from hypertrain.config import ModelConfig
from hypertrain.model.shapes import param_specs
from hypertrain.report import cli as report
from hypertrain.report.clock import retime
from hypertrain.report.runs import load_run, read_rows, run_status
from hypertrain.report.table import DIFFERENT_DATA, OTHER_ORDER
from hypertrain.rundir.records import read_metrics

SMALL = ["phase=smoke", "model.d_model=32", "data.seq_len=32", "data.heldout=64", "logger=none"]
RUN = [*SMALL, "world=2"]  # world 2: with R = 1 a replica's 2 ranks all-reduce every update
SWEEP = {(r, h) for r in (1, 2) for h in (1, 3)}
HANG_AT = 4  # R = 2, H = 1: rounds 1-3 are logged, the fault hangs the run as round 4 starts
TIMEOUT = 120


def _wait_for_sync(metrics: Path, update: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        # read_rows: the file is being written, its last line may be cut short for a moment.
        if metrics.exists() and any(
            r["kind"] == "sync" and r["update"] == update for r in read_rows(metrics)[0]
        ):
            return
        if proc.poll() is not None:
            pytest.fail(f"the hung run exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"the run did not log the sync of update {update} within {TIMEOUT} s")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The runs, and what the hung run's status read while its process was alive."""
    tmp = tmp_path_factory.mktemp("report")
    runs = tmp / "runs"
    hung_dir = runs / "killed"
    hung = start_entry(
        [*RUN, "replicas=2", "inner.H=1", f"hydra.run.dir={hung_dir}"], tmp, {FAULT_ENV: f"0:{HANG_AT}:sleep"}
    )
    try:
        sweep = finish(
            start_entry(["-m", *RUN, "replicas=1,2", "inner.H=1,3", f"hydra.sweep.dir={runs / 'sweep'}"], tmp)
        )
        assert sweep.returncode == 0, sweep.stderr[-3000:]
        other = finish(
            start_entry(
                [*RUN, "replicas=2", "inner.H=3", "data.shuffle_seed=1", f"hydra.run.dir={runs / 'seed1'}"],
                tmp,
            )
        )
        assert other.returncode == 0, other.stderr[-3000:]
        _wait_for_sync(hung_dir / "metrics.jsonl", HANG_AT - 1, hung)
        alive = load_run(hung_dir).status
    finally:
        with contextlib.suppress(ProcessLookupError):  # its own session: the entry we started, nothing else
            os.killpg(hung.pid, signal.SIGKILL)
        hung.communicate()
    phases = finish(
        start_entry(["experiment=phases", *SMALL, "world=1,2", f"hydra.sweep.dir={tmp / 'phases'}"], tmp), 300
    )
    assert phases.returncode == 0, phases.stderr[-3000:]
    return {"runs": runs, "killed": hung_dir, "pid": hung.pid, "alive": alive, "phases": tmp / "phases"}


def _report(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = report.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def made_report(made):
    code, stdout, stderr = _report([str(made["runs"])])
    assert code == 0, stderr
    out = made["runs"] / "report"
    return out, json.loads((out / "report.json").read_text()), stdout


# -- status ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_hung_run_reads_running_and_after_sigkill_crashed(made):
    (start,) = [r for r in read_metrics(made["killed"] / "metrics.jsonl") if r["kind"] == "start"]
    assert start["pid"] == made["pid"] and start["host"] == socket.gethostname()
    assert made["alive"] == "running"
    assert load_run(made["killed"]).status == "crashed"


@pytest.mark.slow
def test_a_last_row_cut_short_by_a_crash_is_left_out(made, tmp_path):
    run = tmp_path / "cut"
    shutil.copytree(made["killed"], run, ignore=shutil.ignore_patterns("checkpoints", "report"))
    updates = len([r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "update"])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "update", "update": 4, "round": 4, "loss": [5.4')  # SIGKILL mid-write
    code, _, stderr = _report([str(run)])
    assert code == 0, stderr
    (row,) = json.loads((run / "report" / "report.json").read_text())["runs"]
    assert row["status"] == "crashed" and row["updates_run"] == updates
    assert row["status_note"] == "crashed (last row cut short)"


def test_a_session_without_an_end_row_is_judged_by_its_own_start_row():
    now = time.time()
    me = {"kind": "start", "time": now, "pid": os.getpid(), "host": socket.gethostname()}
    assert run_status([me, {"kind": "update"}]) == "running"
    assert run_status([me | {"host": "another-node"}]) == "unknown"  # cannot look at its process
    assert run_status([{k: v for k, v in me.items() if k != "pid"}]) == "unknown"  # a file from before pids
    # This pid, but a start row older than this process: the pid was reused, the run is gone.
    assert run_status([me | {"time": now - 10 * 365 * 86400}]) == "crashed"
    # A resumed run: its first session's end row was superseded; the last session decides.
    dead = {"kind": "start", "time": now, "pid": 2**22 + 1, "host": me["host"]}  # above Linux's pid_max
    assert run_status([dead, {"kind": "update"}]) == "crashed"
    assert run_status([dead, {"kind": "update"}, me, {"kind": "end", "status": "finished"}]) == "finished"
    assert run_status([me, {"kind": "end", "status": "failed"}]) == "failed"


# -- the table against the runs' own records -----------------------------------------------------


def _expected(run_dir: Path) -> dict:
    """The table's figures, recomputed from metrics.jsonl and config.yaml by their definitions."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    evals = [r["eval_loss"] for r in rows if r["kind"] in ("eval", "sync")]
    updates = [r for r in rows if r["kind"] == "update"]
    syncs = [r for r in rows if r["kind"] == "sync"]
    summary = {k: v for r in rows if r["kind"] == "summary" for k, v in r.items()}
    last = [x for x in updates[-1]["loss"] if x is not None]
    timed = [r for r in updates if r["update"] > cfg.phase.timing_warmup]
    finished = rows[-1]["kind"] == "end"
    return {
        "heldout_final": evals[-1],
        "heldout_best": min(evals),
        "train_loss_final": math.fsum(last) / len(last),
        "updates_run": len(updates),
        "updates_planned": cfg.phase.updates,
        "comm_inner_bytes": sum(r["comm_inner_bytes"] for r in syncs),
        "comm_outer_bytes": sum(r["comm_outer_bytes"] for r in syncs),
        "wall_s": summary["train/wall_s"] if finished else updates[-1]["wall"],
        "status": "finished" if finished else "crashed",
        "config": {
            "inner.H": cfg.inner.H,
            "replicas": cfg.replicas,
            "data.shuffle_seed": cfg.data.shuffle_seed,
        },
        "replica_steps": sum(len([x for x in r["loss"] if x is not None]) for r in timed),
        "timed": timed,
        "summary": summary if finished else {},
        "syncs": len(syncs),
        "params": summary["model/params"],
    }


@pytest.mark.slow
def test_the_table_equals_what_each_runs_records_say(made_report):
    _, record, _ = made_report
    assert set(record["keys"]) == {"inner.H", "replicas", "data.shuffle_seed"}  # what the runs were given
    by_config = {}
    for row in record["runs"]:
        want = _expected(Path(row["path"]))
        for key in ("heldout_final", "heldout_best", "train_loss_final", "updates_run", "updates_planned"):
            assert row[key] == want[key], (row["run"], key)
        for key in ("comm_inner_bytes", "comm_outer_bytes", "wall_s", "status", "config"):
            assert row[key] == want[key], (row["run"], key)
        # The ring formula: 2 (n-1)/n x params x 4 bytes; inner among L = W/R ranks every update, outer
        # among the R replicas every sync.
        R, L = row["config"]["replicas"], 2 // row["config"]["replicas"]
        assert row["comm_inner_bytes"] == want["updates_run"] * 2 * (L - 1) * want["params"] * 4 // L
        assert row["comm_outer_bytes"] == want["syncs"] * 2 * (R - 1) * want["params"] * 4 // R
        if want["status"] == "crashed":
            assert row["replica_steps_per_s"] is None and row["tokens_per_s"] is None
            assert row["updates_run"] == HANG_AT - 1
            continue
        summary = want["summary"]
        # Replica-steps after the warm-up over the timed seconds: the same integer over the same float.
        assert row["replica_steps_per_s"] == want["replica_steps"] / summary["train/timed_s"]
        # Supervised tokens of the timed updates over the slowest process's seconds for them: the same
        # float64 quotient, its sums taken in another order (a few terms, each within 2**-53 relative).
        seconds = max(
            sum(r["rank_seconds"][k] for r in want["timed"])
            for k in range(len(want["timed"][0]["rank_seconds"]))
        )
        assert math.isclose(
            row["tokens_per_s"], sum(r["tokens"] for r in want["timed"]) / seconds, rel_tol=1e-9
        )
        if row["config"]["data.shuffle_seed"] == 0:
            by_config[(R, row["config"]["inner.H"])] = row
    assert set(by_config) == SWEEP  # every sweep job has its own finished row


@pytest.mark.slow
def test_only_the_run_that_saw_other_data_is_flagged(made, made_report):
    _, record, stdout = made_report
    flagged = [row["run"] for row in record["runs"] if row["data"]]
    assert flagged == ["seed1"]
    assert record["runs"][[r["run"] for r in record["runs"]].index("seed1")]["data"] == DIFFERENT_DATA
    # The data-order digest depends on R, so it differs between R = 1 and R = 2 runs on the same data;
    # they must not be flagged for it.
    orders = {}
    for row in record["runs"]:
        plan = json.loads((Path(row["path"]) / "plan.json").read_text())
        orders.setdefault(row["config"]["replicas"], set()).add(plan["plan/data_order_sha256"])
    assert len(orders[1]) == len(orders[2]) == 1 and orders[1] != orders[2]
    # seed1 differs from sweep R = 2, H = 3 only in data.shuffle_seed: one line of the plot (one entry per
    # group of runs over seeds), whose entry counts the flag; the killed run, unfinished, is one alone.
    (heldout,) = [p for p in record["plots"] if p["file"] == "heldout.png"]
    assert [DIFFERENT_DATA in label for label in heldout["series"]] == [
        "seed1" in group["runs"] for group in record["groups"]
    ]
    (pair,) = [group["runs"] for group in record["groups"] if "seed1" in group["runs"]]
    assert pair[0] == "seed1" and len(pair) == 2 and pair[1].startswith("sweep/3")  # the sweep's R 2, H 3
    assert any(f"({DIFFERENT_DATA}: 1 of 2)" in label for label in heldout["series"])
    assert ["[crashed]" in label for label in heldout["series"]] == [
        group["runs"] == ["killed"] for group in record["groups"]
    ]
    assert f"seed1: {DIFFERENT_DATA}" in stdout


def _hand_run(path: Path, phase: str, world: int, replicas: int, data: str, union: str, order: str) -> None:
    """A finished run's three files, written by hand in the format a run writes them (one round of
    one update), with the plan facts the data flags compare; `data`, `union`, `order` name the data
    fingerprint, union hash and data-order digest."""
    path.mkdir(parents=True)
    facts = {
        "plan/check": "PASS",
        "plan/union_sha256": union * 4,
        "plan/data_order_sha256": order * 4,
        "plan/rank_sha256": f"{order}-w{world}" * 4,  # changes with the world: never compared
        "data/fingerprint": data * 4,
        "plan/updates_run": 1,
    }
    (path / "plan.json").write_text(json.dumps(facts))
    config = {
        "experiment": "hand",
        "replicas": replicas,
        "world": {"size": world},
        "phase": {"name": phase, "kind": phase.split("_")[1]},
        "data": {"shuffle_seed": 0},
    }
    (path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    losses = [5.0 + 0.1 * m for m in range(replicas)]
    rows = [
        {"kind": "start", "time": 0.0, "replicas": replicas},
        {"kind": "summary"} | facts,
        {"kind": "eval", "update": 0, "round": 0, "eval_loss": 5.5},
        {"kind": "update", "update": 1, "round": 1, "loss": losses, "tokens": 64, "wall": 0.5}
        | {"rank_seconds": [0.1] * world, "loss_mean": sum(losses) / replicas},
        {"kind": "sync", "update": 1, "round": 1, "eval_loss": 5.25, "comm_inner_total": 0}
        | {"comm_outer_total": 0, "comm_inner_bytes": 0, "comm_outer_bytes": 0},
        {"kind": "summary", "train/wall_s": 0.5, "train/replica_steps_per_s": 2.0 * replicas},
        {"kind": "end", "time": 1.0, "status": "finished"},
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_runs_are_compared_with_runs_of_their_own_phase_only(tmp_path):
    # An experiment=phases sweep: a strong and a weak phase have different ids by design (another union
    # hash, another data order), so neither is flagged for the other's data. Within each phase a run
    # that truly saw other data (another union hash; another fingerprint) or, at equal R, another data
    # order still is; the weak phase's R = 2 run has another data-order digest by definition (not flagged).
    runs = tmp_path / "runs"
    hand = {  # name: phase, world, R, data fingerprint, union hash, data-order digest
        "strong-w1": ("cpu_strong", 1, 1, "F", "S", "s1"),
        "strong-w2": ("cpu_strong", 2, 1, "F", "S", "s1"),
        "strong-w4": ("cpu_strong", 4, 1, "F", "S", "s1"),
        "strong-offset": ("cpu_strong", 2, 1, "F", "S2", "s9"),  # another phase.offset: other ids
        "weak-w2": ("cpu_weak", 2, 1, "F", "W", "w1"),
        "weak-w4": ("cpu_weak", 4, 1, "F", "W", "w1"),
        "weak-w4-r2": ("cpu_weak", 4, 2, "F", "W", "w2"),
        "weak-order": ("cpu_weak", 2, 1, "F", "W", "w9"),  # the same data in another order at R = 1
        "weak-seed1": ("cpu_weak", 2, 1, "G", "W", "w1"),  # another data fingerprint
    }
    for name, (phase, world, replicas, data, union, order) in hand.items():
        _hand_run(runs / name, phase, world, replicas, data, union, order)
    code, stdout, stderr = _report([str(runs)])
    assert code == 0, stderr
    record = json.loads((runs / "report" / "report.json").read_text())
    flags = {row["run"]: row["data"] for row in record["runs"] if row["data"]}
    assert flags == {
        "strong-offset": DIFFERENT_DATA,
        "weak-order": OTHER_ORDER,
        "weak-seed1": DIFFERENT_DATA,
    }
    assert sorted(line for line in stdout.splitlines() if line.endswith(("data", "order"))) == [
        f"{name}: {flag}" for name, flag in sorted(flags.items())
    ]
    page = (runs / "report" / "report.md").read_text()
    assert "most runs of phase cpu_strong saw data fingerprint `FFFF`" in page
    assert "most runs of phase cpu_weak saw data fingerprint `FFFF`" in page


def _decimals(cell: str) -> int:
    return len(cell.split(".")[1]) if "." in cell else 0


@pytest.mark.slow
def test_markdown_and_terminal_tables_show_the_recorded_values(made_report):
    out, record, stdout = made_report
    runs_section = (out / "report.md").read_text().split("## Runs\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in runs_section.splitlines() if line.startswith("| ")]
    stdout = stdout.split("Over seeds:", 1)[0]  # the runs' table; the groups' follows it
    titles = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = {
        row[0]: dict(zip(titles, row, strict=True))
        for row in ([c.strip() for c in l.strip("|").split("|")] for l in lines[1:])
    }
    numbers = {
        "held-out final": "heldout_final",
        "held-out best": "heldout_best",
        "train loss final": "train_loss_final",
        "replica-steps/s": "replica_steps_per_s",
        "tokens/s": "tokens_per_s",
        "wall s": "wall_s",
    }
    for row in record["runs"]:
        shown = cells[row["run"]]
        for title, key in numbers.items():
            if row[key] is None:
                assert shown[title] == "-"
                continue
            # The cell is the value rounded to the digits it shows.
            assert abs(float(shown[title]) - row[key]) <= 0.5 * 10 ** -_decimals(shown[title]) * (1 + 1e-9)
        assert int(shown["inner bytes/rank"].replace(",", "")) == row["comm_inner_bytes"]
        assert int(shown["outer bytes/replica"].replace(",", "")) == row["comm_outer_bytes"]
        assert shown["updates"] == f"{row['updates_run']}/{row['updates_planned']}"
        assert shown["status"] == row["status"] and shown["data"] == row["data"]
        for key, value in row["config"].items():
            assert shown[key] == str(value)
        printed = [line for line in stdout.splitlines() if line.startswith(f"| {row['run']} ")]
        assert len(printed) == 1 and [c.strip() for c in printed[0].strip("|").split("|")] == list(
            shown.values()
        )


# -- plots and the page ------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_png_decodes_at_its_stated_size(made_report):
    out, record, _ = made_report
    assert {p.name for p in out.glob("*.png")} == {p["file"] for p in record["plots"]}
    spreads = [p for p in record["plots"] if p["file"].startswith("spread-")]
    assert len(spreads) == sum(r["config"]["replicas"] > 1 for r in record["runs"])  # never across R
    page = (out / "report.html").read_text()
    markdown = (out / "report.md").read_text()
    for plot in record["plots"]:
        image = imread(out / plot["file"])
        assert image.shape[:2] == (plot["height"], plot["width"]), plot["file"]
        assert f"({plot['width']} x {plot['height']} px)" in markdown
        assert f'width="{plot["width"]}" height="{plot["height"]}"' in page


@pytest.mark.slow
def test_the_page_loads_in_chromium_with_every_image_and_no_console_message(made_report, tmp_path):
    out, record, _ = made_report
    page = (out / "report.html").read_text()
    # Self-contained: every image is a data URL, nothing is fetched.
    assert re.findall(r'src="([^"]*)"', page) and all(
        s.startswith("data:image/png;base64,") for s in re.findall(r'src="([^"]*)"', page)
    )
    assert not re.search(r'(src|href)="(?!data:)', page) and "<link" not in page and "url(" not in page
    # A set-up machine has it: a missing browser is a failure of the set-up, not a reason to skip.
    assert CHROMIUM, "no chromium on PATH: Debian's `chromium`, installed by `scripts/setup --dev`"
    marked = tmp_path / "report.html"
    marked.write_text(page.replace("</body>", MARK))
    images, console = load_in_chromium(marked, tmp_path / "profile")
    assert images == ["ok"] * len(record["plots"]) and not console, (images, console)
    # The same check on a page with one image cut short and one console message must fail.
    first = page.index("base64,") + len("base64,")
    broken = tmp_path / "broken.html"
    broken.write_text(
        page[:first]
        + "AAAA"
        + page[first + 4000 :].replace("</body>", "<script>console.error('x')</script>" + MARK)
    )
    images, console = load_in_chromium(broken, tmp_path / "profile")
    assert images.count("broken") == 1 and len(console) == 1


@pytest.mark.slow
def test_a_phases_sweep_gets_the_phases_table_and_its_plot(made):
    code, stdout, stderr = _report([str(made["phases"])])
    assert code == 0, stderr
    out = made["phases"] / "report"
    record = json.loads((out / "report.json").read_text())
    written = json.loads((made["phases"] / "phases.json").read_text())  # by the sweep's own callback
    (rows,) = record["phases"].values()
    assert [(r["phase"], r["world"], r["samples_per_s"], r["scaling_efficiency"]) for r in rows] == [
        (r["phase"], r["world"], r["samples_per_s"], r["scaling_efficiency"]) for r in written
    ]
    (plot,) = [p for p in record["plots"] if p["file"].startswith("phases-")]
    assert imread(out / plot["file"]).shape[:2] == (plot["height"], plot["width"])
    assert "world.size" in record["keys"] and "| smoke | 2 |" in (out / "report.md").read_text()


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("missing", "PATH={tmp}/nowhere does not exist"),
        ("empty", "PATH={tmp}/empty holds no metrics.jsonl"),
        ("not-json", "{tmp}/bad/run/metrics.jsonl cannot be read ({tmp}/bad/run/metrics.jsonl:2 is not"),
        ("not-a-row", "{tmp}/bad/run/metrics.jsonl: row 2 (sync) lacks eval_loss"),
        ("not-yaml", "{tmp}/bad/run/config.yaml cannot be read"),
        ("no-config", "{tmp}/bad/run/config.yaml is missing"),
        ("two-paths", "2 PATHs and no --out"),
        ("out-is-a-file", "--out={tmp}/file is a file"),
    ],
)
@pytest.mark.slow
def test_bad_input_is_one_line_exit_2_and_writes_nothing(made, tmp_path, case, named):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    run = tmp_path / "bad" / "run"
    shutil.copytree(made["runs"] / "seed1", run, ignore=shutil.ignore_patterns("checkpoints", "report"))
    if case == "not-json":  # a line cut short
        (run / "metrics.jsonl").write_text('{"kind": "start"}\n{"kind": "upd\n')
    if case == "not-a-row":
        (run / "metrics.jsonl").write_text('{"kind": "start"}\n{"kind": "sync", "update": 1}\n')
    if case == "not-yaml":
        (run / "config.yaml").write_text(": [\n")
    if case == "no-config":
        (run / "config.yaml").unlink()
    argv = {
        "missing": [str(tmp_path / "nowhere")],
        "empty": [str(tmp_path / "empty")],
        "not-json": [str(tmp_path / "bad")],
        "not-a-row": [str(tmp_path / "bad")],
        "not-yaml": [str(tmp_path / "bad")],
        "no-config": [str(tmp_path / "bad")],
        "two-paths": [str(tmp_path / "bad"), str(made["runs"] / "seed1")],
        "out-is-a-file": [str(tmp_path / "bad"), "--out", str(tmp_path / "file")],
    }[case]
    before = tree(tmp_path)
    code, stdout, stderr = _report(argv)
    assert code == 2 and not stdout
    assert stderr.splitlines() == [stderr.strip()] and stderr.startswith("hypertrain.report: error: ")
    assert named.format(tmp=tmp_path) in stderr and "valid: " in stderr
    assert tree(tmp_path) == before


def test_the_command_line_reports_bad_input_without_a_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hypertrain.report", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "nowhere does not exist" in done.stderr and not list(tmp_path.iterdir())
    no_path = subprocess.run(
        [sys.executable, "-m", "hypertrain.report"], capture_output=True, text=True, timeout=60
    )
    assert no_path.returncode == 2 and no_path.stderr.strip().count("\n") == 0 and "PATH" in no_path.stderr


# -- the command lines (report and clock): a reader that leaves early, bad arguments ---------------


@pytest.fixture(scope="module")
def one_run(tmp_path_factory) -> Path:
    """One finished run (the quick phase: seconds), read by the command-line tests; none writes into it
    (the session's reference of the quick run, `ReferenceRuns`)."""
    return ReferenceRuns.beside(tmp_path_factory.mktemp("one_run"))([*QUICK, "logger=none"])


@pytest.mark.parametrize(("module", "wrote"), [("report", "report.html"), ("clock", "clock.md")])
def test_a_reader_that_closes_stdout_early_ends_the_command_quietly(one_run, tmp_path, module, wrote):
    # `python -m ... | head -1` once head has read its line and gone. The reading end is closed before
    # the command prints, so its first write to stdout fails (EPIPE: Python ignores SIGPIPE) every
    # time; a reader closing after one line would race the command's single write of its short table.
    before = tree(one_run)
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", f"hypertrain.{module}", str(one_run), "--out", str(tmp_path / "out")],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    # Python's recipe (docs.python.org/3/library/signal.html#note-on-sigpipe): exit 1, not a word.
    assert done.returncode == 1 and done.stderr == "", done.stderr[-3000:]
    assert (tmp_path / "out" / wrote).is_file() and tree(one_run) == before  # written before printing


def _command_line(main, argv: list[str]) -> tuple[int, str, str]:
    """`main(argv)`'s exit code, stdout and stderr; argparse's exit (SystemExit) read as the code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


NOT_WRITABLE = "not writable by this user"
BELOW_RO = f"--out={{tmp}}/ro/x cannot be made (under {{tmp}}/ro), which is {NOT_WRITABLE}"
# name: the command, its arguments ({run}: one_run, {tmp}: the test's folder), what its one line says
BAD_ARGUMENTS = {
    "report-out-below-a-file": (
        "report",
        ["{run}", "--out", "{tmp}/file/report"],
        "--out={tmp}/file/report cannot be made (under {tmp}/file), which is a file",
    ),
    "report-out-through-a-file": (
        "report",
        ["{run}", "--out={tmp}/file/../x"],
        "--out={tmp}/file/../x cannot be made (under {tmp}/file)",
    ),
    "report-out-is-a-file": ("report", ["{run}", "--out", "{tmp}/file"], "--out={tmp}/file is a file"),
    "report-out-is-a-link-to-nothing": (
        "report",
        ["{run}", "--out", "{tmp}/link"],
        "--out={tmp}/link is a link to nothing",
    ),
    "report-out-below-a-link-to-nothing": (
        "report",
        ["{run}", "--out", "{tmp}/link/x"],
        "--out={tmp}/link/x cannot be made (under {tmp}/link)",
    ),
    "report-out-not-writable": (
        "report",
        ["{run}", "--out", "{tmp}/ro"],
        f"--out={{tmp}}/ro is {NOT_WRITABLE}",
    ),
    "report-out-below-a-folder-not-writable": ("report", ["{run}", "--out", "{tmp}/ro/x"], BELOW_RO),
    "report-out-empty": ("report", ["{run}", "--out="], "--out='' is not valid"),
    "report-out-without-value": ("report", ["{run}", "--out"], "argument --out: expected one argument"),
    "report-default-out-is-a-file": (
        "report",
        ["{tmp}/copy"],
        "{tmp}/copy/report (the default --out) is a file",
    ),
    "report-path-empty": ("report", [""], "PATH='' is not valid"),
    "report-path-is-a-file": ("report", ["{tmp}/file"], "PATH={tmp}/file is not a directory"),
    "report-path-missing": (
        "report",
        ["{tmp}/nowhere", "--out", "{tmp}/out"],
        "PATH={tmp}/nowhere does not exist",
    ),
    "report-no-path": ("report", [], "the following arguments are required: PATH"),
    "report-target-not-a-number": (
        "report",
        ["{run}", "--out", "{tmp}/out", "--target-loss", "abc"],
        "--target-loss='abc' is not valid",
    ),
    "report-target-without-value": (
        "report",
        ["{run}", "--out", "{tmp}/out", "--target-loss"],
        "argument --target-loss: expected one argument",
    ),
    "report-unknown-option": (
        "report",
        ["{run}", "--outdir", "{tmp}/out"],
        "unrecognized arguments: --outdir",
    ),
    "clock-run-dir-empty": ("clock", [""], "RUN_DIR='' is not valid"),
    "clock-out-is-a-link-to-nothing": (
        "clock",
        ["{run}", "--out", "{tmp}/link"],
        "--out={tmp}/link is a link to nothing",
    ),
    "clock-out-below-a-folder-not-writable": ("clock", ["{run}", "--out", "{tmp}/ro/x"], BELOW_RO),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_a_bad_argument_is_one_line_exit_2_and_writes_nothing(one_run, tmp_path, case):
    command, argv, named = BAD_ARGUMENTS[case]
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    if "{tmp}/copy" in argv:  # a run whose default --out, its report/, is a file
        shutil.copytree(
            one_run, tmp_path / "copy", ignore=shutil.ignore_patterns("checkpoints", "weights.pt")
        )
        (tmp_path / "copy" / "report").write_text("x")
    if NOT_WRITABLE in named:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder: the permission check needs another user")
        (tmp_path / "ro").mkdir(mode=0o555)
    main = {"report": report.main, "clock": retime.main}[command]
    before, run_before = tree(tmp_path), tree(one_run)
    code, stdout, stderr = _command_line(main, [arg.format(run=one_run, tmp=tmp_path) for arg in argv])
    assert code == 2 and stdout == "", stderr
    assert stderr.splitlines() == [stderr.strip()] and stderr.startswith(f"hypertrain.{command}: error: ")
    assert named.format(tmp=tmp_path) in stderr and "valid: " in stderr
    assert tree(tmp_path) == before and tree(one_run) == run_before


# -- Streaming DiLoCo (issue 23): fragment syncs, eval rows, peak outer bytes ------------------------

STREAMING = [*QUICK, "logger=none", "inner.H=4"]  # R = 2 at world 8; 6 updates: one round and a short one
STREAMING_SWEEP = {(p, tau) for p in (1, 2) for tau in (0, 1)}


@pytest.fixture(scope="module")
def streaming(tmp_path_factory):
    """A sweep over outer.fragments = 1, 2 and outer.delay = 0, 1 (one entry, four jobs): plain DiLoCo,
    DiLoCo with a delayed reduction, and two streaming runs."""
    tmp = tmp_path_factory.mktemp("streaming")
    sweep = tmp / "sweep"
    done = entry(
        ["-m", *STREAMING, "outer.fragments=1,2", "outer.delay=0,1", f"hydra.sweep.dir={sweep}"], tmp
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return sweep


def _fragment_params(model: dict, P: int) -> list[int]:
    """Each fragment's parameter count by the design's rule (layer i in fragment i mod P, the
    embeddings in fragment 0, the final norm and the head in fragment P - 1)."""
    counts = [0] * P
    for name, (shape, _) in param_specs(ModelConfig(**model)).items():
        where = int(name.split(".")[1]) % P if name.startswith("layers.") else 0 if name == "emb" else P - 1
        counts[where] += math.prod(shape)
    return counts


def _table_cells(out: Path) -> dict[str, dict[str, str]]:
    """report.md's runs table (its first; the Pareto table follows): run name -> column title -> cell."""
    text = (out / "report.md").read_text()
    lines = [
        line
        for line in text[: text.index("\n## ", text.index("## Runs"))].splitlines()
        if line.startswith("| ")
    ]
    titles = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])
    return {row[0]: dict(zip(titles, row, strict=True)) for row in rows}


@pytest.mark.slow
def test_a_streaming_run_reports_its_eval_rows_and_its_peak_outer_bytes(streaming):
    code, _, stderr = _report([str(streaming)])
    assert code == 0, stderr
    out = streaming / "report"
    record = json.loads((out / "report.json").read_text())
    # The swept keys are the run's config columns; the fragments' assignment follows from them.
    assert record["keys"] == ["outer.fragments", "outer.delay"]
    cells = _table_cells(out)
    seen = set()
    for row in record["runs"]:
        rows = read_metrics(Path(row["path"]) / "metrics.jsonl")
        cfg = OmegaConf.to_container(OmegaConf.load(Path(row["path"]) / "config.yaml"))
        P, tau, R = cfg["outer"]["fragments"], cfg["outer"]["delay"], cfg["replicas"]
        seen.add((P, tau))
        assert row["config"] == {"outer.fragments": P, "outer.delay": tau}
        syncs = [r for r in rows if r["kind"] == "sync"]
        evals = [r for r in rows if r["kind"] == "eval"]
        if P > 1:  # every sync is a fragment's, without a held-out loss; the curve is the eval rows
            assert all("fragment" in r and "eval_loss" not in r for r in syncs)
            curve = [r["eval_loss"] for r in evals]
            assert len(evals) > 1 and rows.index(evals[-1]) > rows.index(syncs[-1])  # after the flush
        else:  # one eval row before training, the held-out loss in each sync row
            assert len(evals) == 1 and all("eval_loss" in r for r in syncs)
            curve = [evals[0]["eval_loss"]] + [r["eval_loss"] for r in syncs]
        assert row["heldout_final"] == curve[-1] and row["heldout_best"] == min(curve)
        summary = {k: v for r in rows if r["kind"] == "summary" for k, v in r.items()}
        sent = [r["comm_outer_bytes"] for r in syncs]
        assert row["comm_outer_peak_bytes"] == max(sent) == summary["comm/outer_peak_bytes"]
        assert row["comm_outer_bytes"] == sum(sent) == summary["comm/outer_total_bytes"]
        # The ring formula per sync: 2 (R-1)/R x 4 bytes x the synced fragment's parameters.
        params = _fragment_params(cfg["model"], P)
        assert sum(params) == summary["model/params"]
        formula = [2 * (R - 1) * 4 * n // R for n in params]
        assert sent == [formula[r.get("fragment", 0)] for r in syncs]
        assert row["comm_outer_peak_bytes"] == max(formula)
        shown = cells[row["run"]]
        assert int(shown["outer peak bytes/sync"].replace(",", "")) == row["comm_outer_peak_bytes"]
        assert int(shown["outer bytes/replica"].replace(",", "")) == row["comm_outer_bytes"]
        assert (shown["outer.fragments"], shown["outer.delay"]) == (str(P), str(tau))
        # the table prints 4 decimals: rounding errs by at most half a unit in the 4th place
        assert abs(float(shown["held-out final"]) - curve[-1]) <= 0.5e-4 * (1 + 1e-9)
    assert seen == STREAMING_SWEEP
    peaks = {tuple(r["config"].values()): r["comm_outer_peak_bytes"] for r in record["runs"]}
    assert peaks[(2, 1)] < peaks[(1, 0)]  # what streaming is for: a fragment's sync sends less
    (heldout,) = [p for p in record["plots"] if p["file"] == "heldout.png"]
    assert imread(out / "heldout.png").shape[:2] == (heldout["height"], heldout["width"])
    assert "peak outer bytes per sync" in heldout["title"]


@pytest.mark.slow
def test_a_run_from_before_streaming_still_reads(streaming, tmp_path):
    # The plain run as the code before Streaming DiLoCo wrote it: no outer.fragments, delay, merge_alpha
    # or assignment in its config, no peak or total outer bytes in its summary.
    (plain,) = [p for p in streaming.iterdir() if (p / "config.yaml").is_file() and _is(p, 1, 0)]
    old = tmp_path / "runs" / "old"
    shutil.copytree(plain, old, ignore=shutil.ignore_patterns("checkpoints", "report"))
    shutil.copytree(plain, tmp_path / "runs" / "new", ignore=shutil.ignore_patterns("checkpoints", "report"))
    config = OmegaConf.to_container(OmegaConf.load(old / "config.yaml"))
    for key in ("fragments", "delay", "merge_alpha", "assignment"):
        del config["outer"][key]
    config.pop("schema_version", None)  # a file of then holds no version (records/formats.py)
    (old / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    gone = ("comm/outer_total_bytes", "comm/outer_peak_bytes")
    rows = [{k: v for k, v in r.items() if k not in gone} for r in read_metrics(old / "metrics.jsonl")]
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, stderr = _report([str(tmp_path / "runs")])
    assert code == 0, stderr
    record = json.loads((tmp_path / "runs" / "report" / "report.json").read_text())
    assert record["keys"] == []  # the old run trained with one fragment and no delay: nothing differs
    by_name = {row["run"]: row for row in record["runs"]}
    before, now = by_name["old"], by_name["new"]
    syncs = [r for r in rows if r["kind"] == "sync"]
    assert before["comm_outer_peak_bytes"] == max(r["comm_outer_bytes"] for r in syncs)  # derived
    assert before["comm_outer_bytes"] == syncs[-1]["comm_outer_total"]
    for key in ("heldout_final", "heldout_best", "comm_outer_bytes", "comm_outer_peak_bytes"):
        assert before[key] == now[key], key


def _is(run_dir: Path, fragments: int, delay: int) -> bool:
    outer = OmegaConf.load(run_dir / "config.yaml").outer
    return (outer.fragments, outer.delay) == (fragments, delay)


@pytest.mark.slow
def test_a_fragment_sync_row_needs_no_heldout_loss_but_its_bytes(streaming, tmp_path):
    (run,) = [p for p in streaming.iterdir() if (p / "config.yaml").is_file() and _is(p, 2, 1)]
    bad = tmp_path / "bad"
    shutil.copytree(run, bad, ignore=shutil.ignore_patterns("checkpoints", "report"))
    rows = read_metrics(bad / "metrics.jsonl")
    number = next(i for i, r in enumerate(rows, 1) if r["kind"] == "sync")
    del rows[number - 1]["comm_outer_bytes"]
    (bad / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = tree(tmp_path)
    code, stdout, stderr = _report([str(bad)])
    assert code == 2 and not stdout and tree(tmp_path) == before
    assert stderr.strip() == (
        f"hypertrain.report: error: {bad}/metrics.jsonl: row {number} (sync) lacks comm_outer_bytes; "
        f"valid: a run directory holds metrics.jsonl, config.yaml and plan.json as a run writes them"
    )
