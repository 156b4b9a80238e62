"""experiment=phases: the seed's benchmark phases on real ranks, one table per sweep (issue: phases).

Runs the CPU phases at worlds 2 and 4 through the entry (4 processes=dist jobs, 2-4 processes each,
one torch thread per process on 2 cores: the figures are not a benchmark here, only checked for
consistency with each run's own records).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import entry

from hypertrain import plan
from hypertrain.report.phases import TABLE_JSON, TABLE_MD
from hypertrain.report.phases import main as phases_main
from hypertrain.rundir.records import read_metrics

# The tests on `sweep` are slow: one experiment=phases sweep of real processes (~40 s).

SMALL = ["model.d_model=32", "data.seq_len=32", "data.heldout=64", "logger=none"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("phases")
    done = entry(
        ["experiment=phases", "world=2,4", *SMALL, f"hydra.sweep.dir={tmp / 'sweep'}"], tmp, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return tmp / "sweep", done


@pytest.mark.slow
def test_the_table_has_every_phase_and_world_and_every_cell(sweep):
    sweep_dir, done = sweep
    rows = json.loads((sweep_dir / TABLE_JSON).read_text())
    assert sorted((r["phase"], r["world"]) for r in rows) == [
        ("cpu_strong", 2),
        ("cpu_strong", 4),
        ("cpu_weak", 2),
        ("cpu_weak", 4),
    ]
    for r in rows:
        missing = [k for k, v in r.items() if v is None]
        assert not missing, (r["phase"], r["world"], missing)
        assert r["status"] == "finished" and r["processes"] == r["world"] and r["layout"] == "benchmark"
        assert r["backend"] == "gloo" and r["torch"] and r["device"].startswith("cpu")
        assert 0 < r["allreduce_share"] < 1 and r["padding_efficiency"] == 1.0  # windows: no padding
    assert {r["scaling_efficiency"] for r in rows if r["world"] == 2} == {1.0}
    markdown = (sweep_dir / TABLE_MD).read_text()
    assert markdown in done.stdout  # printed at the end of the sweep
    assert markdown.count("| cpu_") == 4 and "union " in markdown


@pytest.mark.slow
def test_the_timed_window_leaves_out_the_warm_up_updates(sweep):
    sweep_dir, _ = sweep
    for r in json.loads((sweep_dir / TABLE_JSON).read_text()):
        phase = plan.PRESETS[r["phase"]]
        assert r["timing_warmup"] == phase.timing_warmup
        assert r["timed_updates"] == phase.updates - phase.timing_warmup


@pytest.mark.slow
def test_the_weak_phase_at_twice_its_base_world_presents_each_id_twice(sweep):
    sweep_dir, _ = sweep
    weak = {r["world"]: r for r in json.loads((sweep_dir / TABLE_JSON).read_text()) if r["kind"] == "weak"}
    phase = plan.PRESETS["cpu_weak"]
    ids = phase.updates * phase.base_world * phase.per_rank_batch
    assert weak[2]["unique_ids"] == weak[4]["unique_ids"] == ids
    assert weak[2]["presentations"] == ids and weak[4]["presentations"] == 2 * ids
    strong = [r for r in json.loads((sweep_dir / TABLE_JSON).read_text()) if r["kind"] == "strong"]
    assert all(r["presentations"] == r["unique_ids"] for r in strong)


@pytest.mark.slow
def test_throughput_agrees_with_each_runs_own_records(sweep):
    """examples/s and tokens/s = what the timed updates presented / the slowest rank's timed seconds,
    both from metrics.jsonl (per-rank seconds of every update; ranks move in lockstep)."""
    sweep_dir, _ = sweep
    for r in json.loads((sweep_dir / TABLE_JSON).read_text()):
        rows = read_metrics(sweep_dir / r["job"] / "metrics.jsonl")
        phase = plan.PRESETS[r["phase"]]
        timed = [u for u in rows if u["kind"] == "update" and u["update"] > phase.timing_warmup]
        assert len(timed) == r["timed_updates"]
        seconds = max(sum(u["rank_seconds"][k] for u in timed) for k in range(r["processes"]))
        # Presented per update: G examples (strong), or W * b (weak: base streams k = W/B times).
        k = 1 if r["kind"] == "strong" else r["world"] // phase.base_world
        examples = sum(u["tokens"] for u in timed) * k // 32  # data.seq_len=32 targets per window
        # The same float64 quotient, its sums taken in another order (a few dozen terms, each
        # addition within 2**-53): any difference is far below 1e-9; a wrong count or window is not.
        assert math.isclose(r["samples_per_s"], examples / seconds, rel_tol=1e-9)
        assert math.isclose(r["tokens_per_s"], 32 * examples / seconds, rel_tol=1e-9)


def _job(sweep: Path, name: str, metrics: str) -> None:
    (sweep / name).mkdir(parents=True)
    (sweep / name / "metrics.jsonl").write_text(metrics)


@pytest.mark.parametrize(
    ("layout", "says"),
    [
        (None, "SWEEP_DIR='{sweep}' is not a directory; valid: the sweep directory of an experiment=phases"),
        ({}, "{sweep} holds no job (no */metrics.jsonl); valid: the sweep directory"),
        (
            {"0_w2": '{"kind": "start"}\n{"kind": "upd\n'},
            "{sweep}: a job's records cannot be read ({sweep}/0_w2/",
        ),
    ],
    ids=["missing", "empty", "malformed"],
)
def test_the_table_command_refuses_what_it_cannot_read_with_one_line(tmp_path, capsys, layout, says):
    """`python -m hypertrain.report.phases SWEEP_DIR` on a folder that is missing, holds no job, or holds a
    job whose metrics.jsonl is not JSON lines: one line, exit 2, nothing written."""
    sweep = tmp_path / "sweep"
    if layout is not None:
        sweep.mkdir()
        for name, metrics in layout.items():
            _job(sweep, name, metrics)
    before = sorted(tmp_path.rglob("*"))
    assert phases_main([str(sweep)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("hypertrain: error: " + says.format(sweep=sweep)), err
    assert sorted(tmp_path.rglob("*")) == before
