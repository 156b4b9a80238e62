"""The field tables of docs/interfaces.md ("Records"), made from the row types (`rows.ROWS`): one table
per kind, its fields in the order the row holds them, each with its type, its W&B key and its meaning.
`tests/test_records.py` checks the page holds `markdown()` (and, run as a script, writes it there).
"""

from __future__ import annotations

from dataclasses import fields

from hypertrain.records.rows import NULL, OPEN, ROWS, Row, SummaryRow, UpdateRow, json_name

HEADING = "## Records (records/rows.py)"
INTRO = """\
Every row of `metrics.jsonl` is one of these types (`hypertrain.records.rows`), written by
`rundir.records.RunLogger` and read back by the clock's replay, resume and the report through
`rows.parse`. A row is a JSON object: `kind` first, then its fields in the order below. A field that
is None is left out of the row, unless its meaning says null; an open field (`...`) is the row's own
keys, in the order the run adds them. "Did not step" is None in memory (`UpdateRow.loss`), null in
JSON. JSON has no nan or infinity (Python's json would write `NaN` and `Infinity`): a row that would
hold one stops the run instead (`NonFiniteError`, exit 1), and `read_metrics` refuses such a line.
W&B logs a row's numbers against `update` (its step metric); lists and strings stay in metrics.jsonl
only, and a `clock_<part>` key is `clock/<part>` (`clock_s`: `clock/seconds`). This section is made
from the types (`hypertrain.records.tables`; `python tests/test_records.py` rewrites it)."""


def _wandb_key(cls: type[Row], name: str, annotation: str, open_field: bool) -> str:
    if cls.wandb is Row.wandb:
        return "run summary, the key itself" if cls is SummaryRow else "-"
    if open_field:
        return f"`{cls.wandb_prefix}<key>` (numbers)"
    if name in cls.wandb_keys:
        return f"`{cls.wandb_keys[name]}`"
    if name in ("update", "round"):
        return f"`{name}`"
    if annotation.startswith("list"):
        return "-"
    return f"`{cls.wandb_prefix}{name}`"


def table(cls: type[Row]) -> str:
    """The markdown of one row kind: a heading, its docstring, its fields."""
    lines = [f"### `{cls.kind}` ({cls.__name__})", "", " ".join(cls.__doc__.split()), ""]
    lines += ["| field | type | W&B | meaning |", "|---|---|---|---|"]
    for f in fields(cls):
        open_field = bool(f.metadata.get(OPEN))
        name = "..." if open_field else json_name(f.name)
        doc = f.metadata.get("doc", "") + (" (written as null)" if f.metadata.get(NULL) else "")
        annotation = str(f.type)
        wandb = _wandb_key(cls, json_name(f.name), annotation, open_field)
        lines.append(f"| `{name}` | `{annotation}` | {wandb} | {doc} |")
    if cls is UpdateRow:
        mean = "the mean over the replicas that stepped; null when none did (made from `loss`)"
        lines.append(f"| `loss_mean` | `float | None` | `{cls.wandb_keys['loss_mean']}` | {mean} |")
    return "\n".join(line.replace("| None", "\\| None") if line.startswith("| `") else line for line in lines)


def markdown() -> str:
    """The whole section, heading first, ending in a newline."""
    return "\n\n".join([HEADING, INTRO, *(table(cls) for cls in ROWS.values())]) + "\n"
