"""The report's text: its sections rendered as markdown and as one self-contained HTML page.

`markdown(title, sections)` links the PNGs beside it; `html(title, sections, folder)` embeds them as
base64 data URLs (no script, no external resource), so the page opens from disk as the markdown reads.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from hypertrain.report.phases import markdown_table
from hypertrain.report.plots import Plot


@dataclass
class Section:
    heading: str
    paragraphs: list[str] = field(default_factory=list)
    table: tuple[list[str], list[list[str]]] | None = None  # titles, cells (already formatted)
    marked: list[bool] = field(default_factory=list)  # per table row: drawn attention to
    bullets: list[str] = field(default_factory=list)
    plots: list[Plot] = field(default_factory=list)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(title: str, sections: list[Section]) -> str:
    lines = [f"# {title}", ""]
    for section in sections:
        lines += [f"## {section.heading}", ""]
        for paragraph in section.paragraphs:
            lines += [paragraph, ""]
        if section.table is not None:
            titles, body = section.table
            lines += markdown_table(
                [_md_cell(t) for t in titles], [[_md_cell(c) for c in row] for row in body]
            )
            lines.append("")
        if section.bullets:
            lines += [f"- {bullet}" for bullet in section.bullets] + [""]
        for plot in section.plots:
            lines += [
                f"![{plot.title}]({plot.file})",
                "",
                f"*{plot.caption}* ({plot.width} x {plot.height} px)",
                "",
            ]
    return "\n".join(lines)


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1280px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; white-space: nowrap; }
th { background: #f3f3f3; }
td { font-variant-numeric: tabular-nums; }
tr.marked td { background: #fff1d6; }
.scroll { overflow-x: auto; }
figure { margin: 1.5em 0; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; }
code { background: #f3f3f3; padding: 0 0.2em; }
"""


def _table_html(table: tuple[list[str], list[list[str]]], marked: list[bool]) -> list[str]:
    titles, body = table
    out = ['<div class="scroll"><table>', "<tr>" + "".join(f"<th>{escape(t)}</th>" for t in titles) + "</tr>"]
    for i, row in enumerate(body):
        attr = ' class="marked"' if i < len(marked) and marked[i] else ""
        out.append(f"<tr{attr}>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>")
    return [*out, "</table></div>"]


def _code_spans(text: str) -> str:
    """Escape `text` and turn markdown's `code` spans into <code> elements."""
    parts = escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def html(title: str, sections: list[Section], folder: Path) -> str:
    """One page; each plot's PNG (read from `folder`) embedded with its stated width and height."""
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
    ]
    for section in sections:
        out.append(f"<h2>{escape(section.heading)}</h2>")
        out += [f"<p>{_code_spans(p)}</p>" for p in section.paragraphs]
        if section.table is not None:
            out += _table_html(section.table, section.marked)
        if section.bullets:
            out += ["<ul>", *(f"<li>{_code_spans(b)}</li>" for b in section.bullets), "</ul>"]
        for plot in section.plots:
            data = base64.b64encode((folder / plot.file).read_bytes()).decode("ascii")
            out += [
                "<figure>",
                f'<img src="data:image/png;base64,{data}" width="{plot.width}" height="{plot.height}" '
                f'alt="{escape(plot.title)}">',
                f"<figcaption>{_code_spans(plot.caption)}</figcaption>",
                "</figure>",
            ]
    out.append("</body></html>")
    return "\n".join(out) + "\n"
