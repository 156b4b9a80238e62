"""`JsonlWriter`: the run's rows appended to metrics.jsonl, the source of truth, with a running sha256.

The file is opened for appending and never truncated: a resumed run's earlier sessions stay byte for
byte, their bytes are hashed first, and a line a crash cut short is ended so it stays its own
(unreadable) line. Every row is flushed as it is written; one holding nan or an infinity is refused
before a byte of it is (`NonFiniteError`). Closing writes the `end` row: the status, and with an error
its one line and exit code.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from hypertrain.failures import NonFiniteError, fault_points
from hypertrain.records.rows import EndRow, Row, non_finite, plain
from hypertrain.rundir.logger import exit_code


def non_finite_line(row: dict, key: str, value: float) -> str:
    """The one line of a run stopped by `row` holding `value`, nan or an infinity, at `key`."""
    where = f" of update {row['update']}" if "update" in row else ""
    return (
        f"the {row['kind']} row{where} holds {key}={value}, a number JSON cannot hold (metrics.jsonl's rows "
        "are JSON); the run stops"
    )


class JsonlWriter:
    """Rows to `path`, one JSON object a line, between `open()` and `close()`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._sha = hashlib.sha256()  # of every byte of the file so far (checkpoints record it)
        self._file = None

    def open(self) -> None:
        """Open the file for appending: hash what earlier sessions wrote, end a torn last line."""
        self._file = open(self.path, "a", encoding="utf-8")
        if self._file.tell() > 0:
            with open(self.path, "rb") as earlier:
                for block in iter(lambda: earlier.read(1 << 20), b""):
                    self._sha.update(block)
            if not self._ends_with_newline():
                self._append("\n")  # a line cut short by a crash stays its own (unreadable) line

    @property
    def is_open(self) -> bool:
        return self._file is not None and not self._file.closed

    def write(self, row: Row) -> None:
        """`row`'s JSON form as one line, flushed; one holding nan or an infinity: `NonFiniteError`,
        nothing written."""
        if not self.is_open:
            raise RuntimeError(f"{self.path} is not open for rows (JsonlWriter.open() first)")
        fields = row.to_json()
        try:
            line = json.dumps(fields, default=plain, allow_nan=False) + "\n"
        except ValueError:  # nan or an infinity: JSON has no number for it, and a reader would refuse it
            found = non_finite(fields)
            if found is None:
                raise
            raise NonFiniteError(non_finite_line(fields, *found)) from None
        at = range(fields["update"] - 1, fields["update"]) if fields["kind"] == "update" else range(0)
        if fault_points.due(0, "metrics", at):
            self._append(line[: len(line) // 2])  # tests only: die half-way through the row
            fault_points.act(0, "metrics", at)
        self._append(line)

    def position(self) -> int:
        """Bytes in the file so far (every row is flushed as it is written)."""
        return self._file.tell()

    def digest(self) -> str:
        """sha256 of the file's first `position()` bytes (what a checkpoint records with it)."""
        return self._sha.hexdigest()

    def close(self, error: BaseException | None = None) -> None:
        """Write the `end` row and close the file; again, nothing. A full disk that refuses the end row
        leaves the rows before it; one that also fails the close's flush raises only when there is no
        `error` to report (the entry's disk-full handling reports that one)."""
        try:
            if self.is_open:
                end = EndRow(
                    time=time.time(),
                    status="finished" if error is None else getattr(error, "status", "failed"),
                )
                if error is not None:
                    end.error = str(error).splitlines()[0] if str(error) else type(error).__name__
                    end.exit_code = exit_code(error)
                try:
                    self.write(end)
                except OSError:  # a full disk: the rows before it are flushed; the error is reported
                    pass
        finally:
            if self._file is not None:
                try:
                    self._file.close()  # flushes what a full disk refused: it fails again, and closes
                except OSError:
                    if error is None:  # nothing else to report: the entry's disk-full handling does
                        raise

    def abandon(self) -> None:
        """Close the file without an end row (a start that failed; its maker removes the file)."""
        if self._file is not None:
            self._file.close()

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _append(self, text: str) -> None:
        self._file.write(text)
        self._file.flush()
        self._sha.update(text.encode("utf-8"))
