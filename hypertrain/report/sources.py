"""The report's section on the data of runs on a prepared corpus: each run's corpus (its tokenizer,
vocabulary, sizes and sources: `data/corpus` of its plan facts) and, for a corpus of several sources, the
share of each source in the target tokens every replica trained on (`data/source_tokens`)."""

from __future__ import annotations

from hypertrain.report.render import Section
from hypertrain.report.runs import Run


def source_rows(runs: list[Run], names: list[str]) -> list[dict]:
    """One row per replica of each run that logged its sources' tokens: the run, the replica, and per
    source its target tokens and share of the replica's."""
    rows = []
    for run, name in zip(runs, names, strict=True):
        sources, tokens = run.plan.get("data/sources"), run.plan.get("data/source_tokens")
        if not sources or not tokens:
            continue
        for m, counts in enumerate(tokens):
            total = sum(counts)
            pairs = zip(sources, counts, strict=True)
            shares = {s: {"tokens": t, "share": t / total if total else None} for s, t in pairs}
            rows.append({"run": name, "replica": m, "tokens": total, "sources": shares})
    return rows


def data_section(runs: list[Run], names: list[str]) -> tuple[Section | None, list[dict]]:
    """The section (None when no run is on a prepared corpus) and its rows for report.json."""
    corpora = [
        f"{name}: {run.plan['data/corpus']}"
        for run, name in zip(runs, names, strict=True)
        if run.plan.get("data/corpus")
    ]
    if not corpora:
        return None, []
    rows = source_rows(runs, names)
    paragraphs = ["Each run's prepared corpus: " + "; ".join(corpora) + "."]
    if not rows:
        return Section("Data", paragraphs), rows
    sources = list(dict.fromkeys(s for row in rows for s in row["sources"]))
    cells = []
    for row in rows:
        shares = [row["sources"].get(s) for s in sources]
        cells.append(
            [row["run"], str(row["replica"]), f"{row['tokens']:,}"]
            + ["-" if x is None or x["share"] is None else f"{x['share']:.1%}" for x in shares]
        )
    paragraphs.append(
        "Each source's share of the target tokens every replica trained on (the ids the plan gave it in "
        "the updates run; data.replica_split=by_source gives replica m only source m mod S)."
    )
    return Section("Data", paragraphs, (["run", "replica", "tokens", *sources], cells)), rows
