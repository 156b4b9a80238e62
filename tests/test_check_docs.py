"""experiments/check_docs.py, the docs' tables against their commands: every registered table is found on
its page with every registered cell, the comparison passes on the printed digits and fails when one digit
is changed, and a written table passes its own check, stamped once. No training here: the numbers come
from stubs of the runs' records (the checker itself re-runs the commands)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_docs", REPO / "experiments" / "check_docs.py")
check_docs = sys.modules["check_docs"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
spec.loader.exec_module(check_docs)
TABLES = check_docs.TABLES


@pytest.mark.parametrize("name", list(TABLES))
def test_every_registered_table_is_on_its_page_with_every_registered_cell(name):
    table = TABLES[name]
    cells = check_docs.printed_cells((REPO / table.doc).read_text(), table)
    assert [key for key in table.cells if key not in cells] == []
    assert all(re.search(r"\d|never|not reached|\(1\)", cells[key]) for key in table.cells)


@pytest.mark.parametrize("name", list(TABLES))
def test_the_check_passes_on_the_printed_digits_and_fails_when_one_digit_is_changed(name):
    table = TABLES[name]
    text = (REPO / table.doc).read_text()
    printed = check_docs.printed_cells(text, table)
    recorded = {key: printed[key] for key in table.cells}  # a stub: the commands give what is printed
    assert check_docs.compare(text, table, recorded) == []

    key = next(k for k in table.cells if re.search(r"\d", printed[k]))
    first, end = check_docs.find_table(text, table)
    lines = text.splitlines()
    row = next(
        i
        for i in range(first, end)
        if " | ".join(check_docs.split_row(lines[i])[: table.key_columns]) == key[0]
    )
    cells = check_docs.split_row(lines[row])
    column = check_docs.columns(table).index(key[1])
    digit = re.search(r"\d(?=\D*$)", cells[column])  # the cell's last digit, changed by one
    changed = str((int(digit.group()) + 1) % 10)
    cells[column] = cells[column][: digit.start()] + changed + cells[column][digit.end() :]
    lines[row] = "| " + " | ".join(cells) + " |"
    edited = "\n".join(lines) + "\n"

    wrong = check_docs.compare(edited, table, recorded)
    assert wrong == [f"{key[0]} / {key[1]}: printed {cells[column]}, the commands give {printed[key]}"]


@pytest.mark.parametrize("measured", check_docs.MEASURED, ids=lambda m: f"{m.doc}:{m.header[:30]}")
def test_every_table_of_the_machine_is_on_its_page_naming_the_command_that_measures_it(measured):
    """The tables `--list` prints as not comparable are on their pages (a renamed header is found here), and
    each page names the command that measured them."""
    text = (REPO / measured.doc).read_text()
    first, end = check_docs.find_table(text, measured)
    assert end > first
    command = measured.command.split(" (")[0]  # what follows in parentheses is a note
    assert command in " ".join(text.split())


def test_a_repeated_column_is_named_by_its_place():
    table = TABLES["distributed-bytes"]
    assert check_docs.columns(table)[1:5] == [
        "inner payload / update",
        "formula",
        "outer payload / sync",
        "formula 2",
    ]


def sync_rows(losses: list[float]) -> list[dict]:
    return [
        {"kind": "sync", "update": 5 * (k + 1), "eval_loss": loss, "clock_s": 0.5 * (k + 1)}
        for k, loss in enumerate(losses)
    ]


def test_cells_are_read_from_the_records_at_the_printed_precision_and_a_written_table_passes():
    """Stub records of the deadline runs: the cells the checker computes from them, written into the page,
    pass the check; a second write replaces the stamp instead of adding one."""
    table = TABLES["churn-deadline"]
    losses = [4.5, 3.9, 3.5, 3.2, 3.1, 3.05, 3.04661, 3.0401496]
    summary = {
        "kind": "summary",
        "eval/final_loss": losses[-1],
        "churn/late_replica_rounds": 16,
        "clock/total_s": 4.0004,
    }
    outputs = {run: check_docs.Output(rows=[*sync_rows(losses), summary]) for run in table.commands}
    computed = {key: cell(outputs) for key, cell in table.cells.items()}
    assert computed["0.33", "held-out final"] == "3.0401"
    assert computed["0.33", "late replica-rounds (of 64)"] == "16"
    assert computed["0.33", "simulated s"] == "4.000"
    assert computed["0.33", "time to 3.0467 (s)"] == "3.500"  # the 7th sync, 3.04661 <= 3.0467

    text = (REPO / table.doc).read_text()
    once = check_docs.written(text, table, computed, "abc1234")
    assert check_docs.compare(once, table, computed) == []
    twice = check_docs.written(once, table, computed, "def5678")
    assert twice.count("check_docs.py --write churn-deadline`") == 1 and "at def5678" in twice
    assert len(twice.splitlines()) == len(once.splitlines())


def test_a_table_registered_in_parts_keeps_one_stamp_per_part():
    """docs/clock.md's study is two registered tables under one header: each write replaces its own stamp
    and leaves the other's."""
    text = (REPO / "docs" / "clock.md").read_text()
    for name in ("clock-study-compression", "clock-study-streaming", "clock-study-compression"):
        table = TABLES[name]
        printed = check_docs.printed_cells(text, table)
        text = check_docs.written(text, table, {key: printed[key] for key in table.cells}, "abc1234")
        assert check_docs.compare(text, table, {key: printed[key] for key in table.cells}) == []
    assert text.count("--write clock-study-streaming`") == 1
    assert text.count("--write clock-study-compression`") == 1


def test_the_stamp_of_a_table_of_the_machine_names_the_columns_it_wrote():
    """performance.md's codec table: its byte columns are written and checked, its seconds are listed as
    the machine's (MEASURED), and its stamp says which are which."""
    table = TABLES["compression-sizes"]
    line = check_docs.stamp(table, "abc1234")
    assert "(its columns payload B/replica (default), x below fp32; the others are the machine's" in line
    assert any(m.header == table.header for m in check_docs.MEASURED)
    assert "(its columns" not in check_docs.stamp(TABLES["compression-study"], "abc1234")
