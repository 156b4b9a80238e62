"""A row of metrics.jsonl is its type: every kind reads back as the row it was written from, field by field
and key by key, a run's own file included, and docs/interfaces.md's field tables are the types' own
(`.venv/bin/python tests/test_records.py` rewrites them; a test fails when they differ)."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
from helpers import QUICK, ReferenceRuns

from hypertrain.records import tables
from hypertrain.records.rows import (
    ROWS,
    CheckpointRow,
    EndRow,
    EvalRow,
    RestartRow,
    ResumeRow,
    StartRow,
    SummaryRow,
    SyncRow,
    UpdateRow,
    parse,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "interfaces.md"

# One row of each kind as a run writes it (key order included), the optional fields both ways.
WRITTEN = [
    {"kind": "start", "time": 1.5, "run_id": "ab", "name": "n", "group": "g", "job_type": "train",
     "tags": ["t"], "replicas": 2, "wandb_run_id": None, "pid": 7, "host": "h"},
    {"kind": "eval", "update": 0, "round": 0, "eval_loss": 5.5},
    {"kind": "eval", "update": 4, "round": 1, "eval_loss": 5.0, "comm_inner_total": 10,
     "comm_outer_total": 20, "clock_s": 1.25, "loss/text": 4.0},
    {"kind": "update", "update": 1, "round": 0, "lr": 0.001, "loss": [5.5, None], "tokens": 64,
     "grad_accum": 1, "wall": 0.5, "rank_seconds": [0.5], "loss/router_aux": 0.25, "clock_s": 2.0,
     "loss_mean": 5.5},
    {"kind": "update", "update": 2, "round": 0, "lr": 0.001, "loss": [None, None], "tokens": 0,
     "grad_accum": 0, "wall": 0.75, "rank_seconds": [0.25], "loss_mean": None},
    {"kind": "sync", "update": 3, "round": 0, "eval_loss": 5.25, "pseudo_grad_norm": 0.5,
     "replicas_synced": 2, "comm_inner_bytes": 8, "comm_outer_bytes": 16, "comm_inner_total": 8,
     "comm_outer_total": 16, "comm_measured_outer_s": 0.1, "clock_s": 3.0},
    {"kind": "sync", "update": 2, "round": 0, "fragment": 1, "pseudo_grad_norm": 0.5,
     "replicas_synced": 2, "comm_inner_bytes": 0, "comm_outer_bytes": 4, "comm_inner_total": 8,
     "comm_outer_total": 20, "payload_bytes": 4, "contributors": [0, 1], "skipped": False},
    {"kind": "checkpoint", "update": 3, "round": 1, "mid_round": False, "path": "c.pt", "bytes": 9,
     "seconds": 0.1},
    {"kind": "resume", "from": "c.pt", "update": 3, "round": 1, "superseded_bytes": 100},
    {"kind": "restart", "count": 1, "max_restarts": 2, "update": 0, "recomputed": 3, "from": None,
     "superseded_bytes": 0},
    {"kind": "summary", "plan/union_sha256": "bb", "model/params": 10},
    {"kind": "end", "time": 2.5, "status": "finished"},
    {"kind": "end", "time": 2.5, "status": "failed", "error": "boom", "exit_code": 1},
    {"kind": "arrival", "update": 2, "replicas": [0, 1], "steps": [3, 1], "first": [3, 0],
     "tokens": [96, 32], "staleness": [1, 0], "loss": [5.0, 5.5], "staleness_mean": 0.5, "clock_s": 2.5,
     "eval_loss": 5.25},
]  # fmt: skip


@pytest.mark.parametrize("row", WRITTEN, ids=lambda r: r["kind"])
def test_every_kind_reads_back_as_the_row_it_was_written_from(row):
    typed = parse(row)
    assert type(typed) is ROWS[row["kind"]]
    assert list(typed.to_json().items()) == list(row.items())
    assert json.dumps(typed.to_json()) == json.dumps(row)


def test_every_kind_a_run_writes_has_a_type():
    kinds = ("start", "eval", "update", "sync", "arrival", "checkpoint", "resume", "restart", "summary")
    kinds += ("end",)
    assert set(ROWS) == set(kinds)
    assert {row["kind"] for row in WRITTEN} == set(ROWS)


def test_did_not_step_is_none_in_memory_and_null_in_json():
    row = UpdateRow(update=1, round=0, lr=0.1, loss=[2, None, 4.0])
    assert row.loss == [2.0, None, 4.0] and row.stepped == [True, False, True]
    assert row.loss_mean == 3.0 and json.dumps(row.to_json()["loss"]) == "[2.0, null, 4.0]"
    assert UpdateRow(update=1, round=0, loss=[None]).loss_mean is None
    nan = UpdateRow(update=1, round=0, loss=[math.nan, 1.0])  # a step that diverged did step
    assert nan.stepped == [True, True] and math.isnan(nan.loss_mean)


def test_w_and_b_gets_each_rows_numbers_under_its_keys():
    update = parse(WRITTEN[3]).wandb()
    assert update == {
        "update": 1, "round": 0, "train/loss/replica_0": 5.5, "train/loss_mean": 5.5, "train/lr": 0.001,
        "train/tokens": 64, "train/wall": 0.5, "train/grad_accum": 1, "train/loss/router_aux": 0.25,
        "clock/seconds": 2.0,
    }  # fmt: skip
    sync = parse(WRITTEN[6]).wandb()
    assert sync == {
        "update": 2, "round": 0, "sync/pseudo_grad_norm": 0.5, "comm/inner_bytes": 0, "comm/outer_bytes": 4,
        "comm/inner_total": 8, "comm/outer_total": 20, "sync/fragment": 1, "sync/replicas_synced": 2,
        "sync/payload_bytes": 4,
    }  # fmt: skip
    assert parse(WRITTEN[2]).wandb() == {
        "update": 4, "round": 1, "eval/loss": 5.0, "eval/comm_inner_total": 10,
        "eval/comm_outer_total": 20, "clock/seconds": 1.25, "eval/loss/text": 4.0,
    }  # fmt: skip
    assert parse(WRITTEN[7]).wandb() == {
        "update": 3,
        "round": 1,
        "checkpoint/bytes": 9,
        "checkpoint/seconds": 0.1,
    }
    assert parse(WRITTEN[-1]).wandb() == {
        "update": 2, "async/staleness": 0.5, "clock/seconds": 2.5, "eval/loss": 5.25,
    }  # fmt: skip
    for kind in (StartRow, ResumeRow, RestartRow, SummaryRow, EndRow):
        assert kind.wandb(parse(next(r for r in WRITTEN if r["kind"] == kind.kind))) is None


def test_a_row_without_an_open_field_refuses_a_field_it_has_not():
    with pytest.raises(ValueError, match="a checkpoint row has no field colour"):
        CheckpointRow.of({"update": 1, "round": 0, "colour": "red"})
    assert SyncRow.of({"update": 1, "round": 0, "colour": "red"}).figures == {"colour": "red"}
    assert EvalRow.of({"update": 1, "eval_loss": 2}).to_json() == {
        "kind": "eval", "update": 1, "round": 0, "eval_loss": 2.0
    }  # fmt: skip


def test_a_runs_own_records_read_back_as_written(tmp_path):
    """The quick run's rows (the session's reference, the report's too), line for line."""
    run_dir = ReferenceRuns.beside(tmp_path)([*QUICK, "logger=none"])
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert json.dumps(parse(row).to_json()) == line


def test_every_field_has_a_meaning():
    for cls in ROWS.values():
        assert cls.__doc__ and all(f.metadata.get("doc") for f in fields(cls)), cls.__name__


def section(text: str) -> str:
    return text[text.index(tables.HEADING) :] if tables.HEADING in text else ""


def test_the_interfaces_page_holds_the_types_field_tables():
    assert section(DOCS.read_text()) == tables.markdown(), (
        "docs/interfaces.md's Records differ: run .venv/bin/python tests/test_records.py"
    )


if __name__ == "__main__":
    text = DOCS.read_text()
    old = section(text)
    DOCS.write_text((text[: len(text) - len(old)] if old else text.rstrip("\n") + "\n\n") + tables.markdown())
