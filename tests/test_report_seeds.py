"""The report over seeds and its plots' legends (issue 35, item 7).

Runs written by hand in the format a run writes them (metrics.jsonl, config.yaml, plan.json; on the
h100 cluster, whose modelled compute the clock times without measurements), so each case takes a
second: runs that differ only in `seed`, `data.shuffle_seed` or `churn.seed` are one row of the
report's "Over seeds" table, their mean and spread recomputed here in float64 from the losses written;
a sweep's jobs read in the order of their numbers; a third differing key is drawn and labelled; a
legend of long entries lies inside its PNG.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from omegaconf import OmegaConf

from hypertrain.report import cli as report
from hypertrain.report.plots import labels, line_styles
from hypertrain.report.runs import find_runs, load_run
from hypertrain.report.seeds import band

CONFIG = {  # what the report and the clock read of a run's config.yaml
    "experiment": "hand",
    "seed": 0,
    "replicas": 1,
    "world": {"size": 1},
    "phase": {"name": "cpu_strong", "kind": "strong"},
    "data": {"shuffle_seed": 0},
    "churn": {"seed": 0},
    "inner": {"H": 1},
    "outer": {"fragments": 1, "delay": 0, "merge_alpha": 0.0, "compress": "none", "reduce": "gather"},
    "cluster": {"name": "h100", "compute": "modelled"},
}


def _hand_run(path: Path, losses: list[float], status: str = "finished", **config) -> None:
    """A run of len(losses) - 1 updates, one sync each, whose held-out losses are `losses` (the first
    before training) and whose config is CONFIG with `config`'s dotted keys set."""
    path.mkdir(parents=True)
    facts = {"plan/check": "PASS", "data/fingerprint": "F" * 16, "plan/union_sha256": "U" * 16}
    facts |= {"plan/data_order_sha256": "O" * 16, "plan/updates_run": len(losses) - 1}
    (path / "plan.json").write_text(json.dumps(facts))
    tree = OmegaConf.create(CONFIG)
    for key, value in config.items():
        OmegaConf.update(tree, key.replace("__", "."), value)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(tree))
    rows = [
        {"kind": "start", "time": 0.0, "replicas": 1},
        {"kind": "summary", "model/params": 1000} | facts,
        {"kind": "eval", "update": 0, "round": 0, "eval_loss": losses[0]},
    ]
    for update, loss in enumerate(losses[1:], 1):
        rows += [
            {"kind": "update", "update": update, "round": update, "loss": [loss], "loss_mean": loss}
            | {"tokens": 64, "wall": 0.5 * update, "rank_seconds": [0.1]},
            {"kind": "sync", "update": update, "round": update, "eval_loss": loss, "comm_inner_total": 0}
            | {"comm_outer_total": 0, "comm_inner_bytes": 0, "comm_outer_bytes": 0},
        ]
    rows += [
        {"kind": "summary", "train/wall_s": 0.5 * update},
        {"kind": "end", "time": 1.0, "status": status},
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def _report(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = report.main(argv)
    return code, out.getvalue(), err.getvalue()


def _section_table(markdown: str, heading: str) -> list[dict[str, str]]:
    """The rows of the markdown table under `heading`, as {title: cell}."""
    section = markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    split = lambda line: [cell.strip() for cell in line.strip("|").split("|")]  # noqa: E731
    return [dict(zip(split(lines[0]), split(line), strict=True)) for line in lines[1:]]


def test_runs_that_differ_only_in_their_seeds_are_one_row_with_their_mean_and_spread(tmp_path):
    runs = tmp_path / "runs"
    finals = {"a0": 3.1234, "a1": 3.1291, "a2": 3.1178}  # H 2, three seeds (each of a seed key)
    seeds = {"a0": {}, "a1": {"seed": 1, "data__shuffle_seed": 1}, "a2": {"seed": 2, "churn__seed": 5}}
    for name, final in finals.items():
        _hand_run(runs / name, [5.5, 4.0 + (final - 3.1), final], inner__H=2, **seeds[name])
    _hand_run(runs / "b", [5.5, 4.2, 3.2], inner__H=3)  # another config, one seed
    _hand_run(runs / "c", [5.5, 4.1], status="crashed", inner__H=2, seed=3)  # never averaged
    code, stdout, stderr = _report([str(runs)])
    assert code == 0, stderr
    record = json.loads((runs / "report" / "report.json").read_text())

    groups = {tuple(group["runs"]): group for group in record["groups"]}
    assert list(groups) == [("a0", "a1", "a2"), ("b",), ("c",)]
    three = groups["a0", "a1", "a2"]
    losses = np.array(list(finals.values()), dtype=np.float64)
    final = three["heldout_final"]
    assert three["n"] == final["n"] == 3 and three["config"] == {"inner.H": 2}
    assert three["seeds"] == {"seed": [0, 1, 2], "data.shuffle_seed": [0, 1, 0], "churn.seed": [0, 0, 5]}
    assert final["mean"] == pytest.approx(losses.mean(), rel=0, abs=1e-12)
    assert final["std"] == pytest.approx(losses.std(ddof=1), rel=0, abs=1e-12)
    assert (final["min"], final["max"]) == (losses.min(), losses.max())
    assert groups["b",]["heldout_final"] == {"mean": 3.2, "min": 3.2, "max": 3.2, "std": 0.0, "n": 1}

    rows = _section_table((runs / "report" / "report.md").read_text(), "Over seeds")
    assert [row["runs"] for row in rows] == ["a0, a1, a2", "b", "c"]
    assert rows[0]["n"] == "3" and rows[0]["seed"] == "0,1,2"
    assert rows[0]["held-out final: mean (min to max)"] == (
        f"{losses.mean():.4f} ({losses.min():.4f} to {losses.max():.4f})"
    )
    assert rows[1]["held-out final: mean (min to max)"] == "3.2000"
    assert rows[2]["status"] == "crashed"
    assert "Over seeds:" in stdout

    # The plots draw a line per group: the three seeds as one entry, the crashed run alone.
    for plot in record["plots"]:
        if plot["file"] in ("heldout.png", "heldout-clock.png"):
            assert plot["series"][:3] == ["inner.H=2 (mean of 3 seeds)", "inner.H=3", "inner.H=2 [crashed]"]


def test_a_groups_curve_is_the_mean_and_the_extremes_at_the_updates_every_run_has():
    curves = [[(0, 0.0, 5.5), (1, 1.0, 4.0), (2, 2.0, 3.0)], [(0, 0.0, 5.5), (2, 4.0, 3.6)]]
    assert band(curves) == ([0.0, 3.0], [5.5, 3.3], [5.5, 3.0], [5.5, 3.6])


def test_a_sweeps_jobs_read_in_the_order_of_their_numbers(tmp_path):
    sweep = tmp_path / "sweep"
    for job in (0, 1, 2, 10, 11):
        _hand_run(sweep / str(job), [5.5, 5.0 - 0.01 * job], inner__H=job + 1)
    assert [path.name for path in find_runs([sweep])] == ["0", "1", "2", "10", "11"]
    code, _, stderr = _report([str(sweep)])
    assert code == 0, stderr
    record = json.loads((sweep / "report" / "report.json").read_text())
    assert [row["run"] for row in record["runs"]] == ["0", "1", "2", "10", "11"]


def test_runs_that_differ_in_a_third_key_are_drawn_apart_and_labelled_with_it(tmp_path):
    # outer.fragments x outer.delay x outer.merge_alpha: alpha 0 and 0.5 must not look alike.
    grid = [(P, tau, alpha) for P in (1, 4) for tau in (0, 1) for alpha in (0.0, 0.5)]
    for i, (P, tau, alpha) in enumerate(grid):
        _hand_run(
            tmp_path / f"run{i}", [5.5, 5.0], outer__fragments=P, outer__delay=tau, outer__merge_alpha=alpha
        )
    runs = [load_run(tmp_path / f"run{i}") for i in range(len(grid))]
    keys = ["outer.fragments", "outer.delay", "outer.merge_alpha"]
    drawn, lines = line_styles(runs, keys)
    assert drawn == keys
    assert len({json.dumps(line, sort_keys=True) for line in lines}) == len(grid)
    series = labels(runs, [f"run{i}" for i in range(len(grid))], keys, [""] * len(grid))
    assert series == [f"outer.fragments={P}, outer.delay={tau}, outer.merge_alpha={a}" for P, tau, a in grid]


def _border_is_blank(png: Path) -> bool:
    """Whether the two outermost pixel columns on either side are the figure's white (nothing drawn
    there: a legend wider than its figure is cut off on both sides, through its text and frame)."""
    image = imread(png)[..., :3]
    return bool((image[:, :2] == 1.0).all() and (image[:, -2:] == 1.0).all())


@pytest.mark.parametrize("count", [2, 8])
def test_a_legend_of_long_entries_lies_inside_its_figure(tmp_path, count):
    # 2 runs: one column, wider than the 1000 px time plot; 8: two columns wider than either plot.
    runs = tmp_path / "runs"
    policy = "reset_the_fragment_state_and_rewarm_the_outer_learning_rate_from_zero" * (
        3 if count == 2 else 1
    )
    for job in range(count):
        _hand_run(
            runs / str(job),
            [5.5, 5.0 - 0.01 * job],
            inner__H=job + 1,
            outer__merge_alpha=0.25 * (job % 3),
            outer__delay=job % 2,
            churn__state_policy=f"{policy}_{job}",
        )
    code, _, stderr = _report([str(runs)])
    assert code == 0, stderr
    record = json.loads((runs / "report" / "report.json").read_text())
    plots = {plot["file"]: plot for plot in record["plots"]}
    assert set(plots) == {"heldout.png", "heldout-clock.png"}
    for file, plot in plots.items():
        png = runs / "report" / file
        assert imread(png).shape[:2] == (plot["height"], plot["width"]), file
        assert _border_is_blank(png), f"{file}: something is drawn at its left or right edge"
