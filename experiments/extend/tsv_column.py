"""A data source that lives outside the package: one column of a TSV file (a header row, then one
record a row; Python's csv dialect with tab delimiters, so a quoted cell may hold tabs and newlines),
byte-level, each cell one document. Named on the command line by its import path
(data.name=tsv_column.TEXT data.path=FILE; docs/extending.md, "A data source").

The token stream is the column's cells in file order, UTF-8, joined by a blank line ("\\n\\n"), so that
data.examples=documents reads a cell's paragraphs; the other columns are never read into it.
"""

from __future__ import annotations

import csv
import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hypertrain.config import DataConfig, UserError
from hypertrain.data import BYTE_VOCAB, DataSource
from hypertrain.data.sources import Source, megabytes

SEPARATOR = "\n\n"  # between two cells: a paragraph break


@dataclass(frozen=True)
class TsvColumn(DataSource):
    """The cells of the column named `column` of the TSV file at data.path."""

    column: str = "text"

    def read(self, d: DataConfig) -> Source:
        path = Path(d.path).expanduser()
        try:
            with path.open(newline="", encoding="utf-8") as file:
                rows = csv.DictReader(file, delimiter="\t")
                if self.column not in (rows.fieldnames or []):
                    raise UserError(
                        f"data.path={d.path!r} has no column {self.column!r} (its header: "
                        f"{rows.fieldnames}); valid: a TSV file whose header row names {self.column!r}"
                    )
                cells = [row[self.column] or "" for row in rows]  # a short row: an empty cell
        except (OSError, UnicodeDecodeError, csv.Error) as error:
            reason = " ".join(str(error).split())
            raise UserError(
                f"data.path={d.path!r} cannot be read ({reason}); valid: a UTF-8 TSV file"
            ) from None
        text = SEPARATOR.join(cells).encode()
        digest = hashlib.sha256(self.column.encode() + b"\0" + text).hexdigest()
        tokens = np.frombuffer(text, dtype=np.uint8)
        source = Source(tokens, np.array([0, len(tokens)], dtype=np.int64), digest, "", vocab=BYTE_VOCAB)
        label = f"{path.name}: column {self.column!r}, {len(cells)} rows, {megabytes(source)}"
        return replace(source, label=label)


TEXT = TsvColumn("tsv_text", path="a TSV file with a header row", tokenizer="bytes", column="text")
