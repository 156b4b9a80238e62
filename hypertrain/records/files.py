"""`metrics.jsonl` read back: its rows as JSON objects (`read_metrics`, `session_rows`, `readable_rows`)
or as their types (`read_records`, `rows.parse`); a session's `end` row and summary (`session_end`,
`merged_summary`). The writer is
`rundir.records.RunLogger` (its `rundir.jsonl.JsonlWriter`); it appends one row per line and never
truncates the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypertrain.records.rows import EndRow, Row, SummaryRow, parse

METRICS_FILE = "metrics.jsonl"


def _file(path: Path | str) -> Path:
    path = Path(path)
    return path / METRICS_FILE if path.is_dir() else path


def _not_a_number(token: str):
    raise ValueError(f"{token} is not a JSON number")


def json_row(line: str | bytes):
    """One line of metrics.jsonl as JSON, strictly: `NaN`, `Infinity` and `-Infinity`, which Python's json
    would read but JSON has not (the writer never writes them), are a ValueError."""
    return json.loads(line, parse_constant=_not_a_number)


def read_metrics(path: Path | str) -> list[dict]:
    """The rows of a `metrics.jsonl` (a file, or a run directory holding one), in order; ValueError naming
    the first line that is not JSON (`json_row`)."""
    path = _file(path)
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json_row(line))
            except ValueError as e:
                why = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                raise ValueError(f"{path}:{number} is not a JSON line ({why}): {line[:80]!r}") from None
    return rows


def read_records(path: Path | str) -> list[Row]:
    """`read_metrics`' rows as their types, leaving out a kind no type names."""
    return [typed for typed in map(parse, read_metrics(path)) if typed is not None]


def session_rows(path: Path | str, since: int = 0) -> list[dict]:
    """The rows of a `metrics.jsonl` (a file, or a run directory holding one) from byte `since` on,
    leaving out a line that is not JSON (a row cut short by a kill); [] when there is no file."""
    try:
        with open(_file(path), "rb") as f:
            f.seek(since)
            data = f.read()
    except FileNotFoundError:
        return []
    return readable_rows(data)


def readable_rows(data: bytes) -> list[dict]:
    """The rows among `data`'s lines (metrics.jsonl bytes), leaving out a line that is not JSON (a row
    cut short by a kill). What a resume reads its own records with: it takes `NaN` and `Infinity` as
    Python's json does (never written since the writer refuses them, but a run written before may hold
    one, and must still resume); the report and the clock read with the strict `read_metrics`."""
    rows = []
    for line in data.splitlines():
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def session_end(rows: list[dict | Row]) -> EndRow | None:
    """The session's `end` row among `rows` (`session_rows`), None when it has none; its exit code is
    `code`."""
    ends = [row for row in map(parse, rows) if isinstance(row, EndRow)]
    return ends[-1] if ends else None


def merged_summary(rows: list[dict | Row]) -> dict:
    """The values of `rows`' summary rows, merged in order (a later value of a key wins)."""
    merged: dict = {}
    for row in map(parse, rows):
        if isinstance(row, SummaryRow):
            merged |= row.values
    return merged
