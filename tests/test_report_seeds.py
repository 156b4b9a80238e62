"""The report's order of runs (issue 35, item 7).

Runs written by hand in the format a run writes them (metrics.jsonl, config.yaml, plan.json; on the
h100 cluster, whose modelled compute the clock times without measurements), so each case takes a
second: a sweep's jobs read in the order of their numbers.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from omegaconf import OmegaConf

from hypertrain.report import cli as report
from hypertrain.report.runs import find_runs

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


def test_a_sweeps_jobs_read_in_the_order_of_their_numbers(tmp_path):
    sweep = tmp_path / "sweep"
    for job in (0, 1, 2, 10, 11):
        _hand_run(sweep / str(job), [5.5, 5.0 - 0.01 * job], inner__H=job + 1)
    assert [path.name for path in find_runs([sweep])] == ["0", "1", "2", "10", "11"]
    code, _, stderr = _report([str(sweep)])
    assert code == 0, stderr
    record = json.loads((sweep / "report" / "report.json").read_text())
    assert [row["run"] for row in record["runs"]] == ["0", "1", "2", "10", "11"]
