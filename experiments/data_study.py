"""Replicas on different data (docs/data.md, "Study: replicas on different data"; issue 38): DiLoCo with
R = 4 on two sources of different text made from this Python's standard library, each replica sampling
both sources (`data.replica_split=iid`) against each replica trained on one source only (`by_source`:
replicas 0 and 2 on prose, 1 and 3 on code), at H = 5 and H = 20 on a phase of 240 updates (12 rounds at
H = 20). Source 0 (prose) is the docstrings (`ast.get_docstring` of each module, class and function) of
the stdlib's .py files, one document per distinct docstring; source 1 (code) is the source text of every
14th of those files (sorted), one document per file, about the prose's size; the two come from disjoint
files. They are written as JSONL into OUT/ and prepared once into OUT/corpus (`python -m hypertrain.data
prepare ... --tokenizer train:1024`). The runs train the default model at `phase.global_batch=64` (each
source holds about 0.85 M tokens: the default 256 windows of 65 tokens per update would need 2 M per
source for 240 updates) and `data.heldout=1024` (512 windows of each source, whole documents: a code file
is about 7 k tokens, so the default 128 per source would be one or two files), `logger=none`. Prints one
markdown table: per (H, split), the held-out loss on each source and their mean after updates 20, 60,
120 and 240 (round ends at both H, where the held-out loss is evaluated).

    python experiments/data_study.py OUT [--dry-run] [EXTRA OVERRIDES ...]

OUT/h{H}_{split}/ holds a run. A failing run is reported, the others go on. The same command again keeps
what OUT holds (the sources, the corpus, the finished runs: `resume=auto`) and prints the table again.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import sysconfig
import tokenize
from pathlib import Path

from studies import study_parser

UPDATES = 240
HS = (5, 20)
SPLITS = ("iid", "by_source")
POINTS = (20, 60, 120, 240)  # updates after which both H's evaluate (multiples of 20)
SOURCES = ("prose", "code")
STRIDE = 14  # every 14th stdlib file is code (about the prose's characters), the rest give the prose
# resume=auto: a run that finished in OUT is kept (nothing run), one that was stopped goes on
TRAIN = ["phase.global_batch=64", f"phase.updates={UPDATES}", "data.heldout=1024", "logger=none"]
TRAIN.append("resume=auto")


def stdlib_files() -> list[Path]:
    """This Python's standard-library .py files, sorted (site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def read_source(path: Path) -> str | None:
    """A file's text, decoded as Python reads it (its coding cookie); None when it cannot be read."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def docstrings(text: str) -> list[str]:
    """The docstrings of a module, its classes and functions, in the order `ast.walk` meets them."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for n in ast.walk(tree) if isinstance(n, kinds) and (d := ast.get_docstring(n))]


def write_sources(out: Path) -> list[Path]:
    """OUT/prose.jsonl and OUT/code.jsonl (field `text`), distinct documents only; kept when present."""
    paths = [out / f"{name}.jsonl" for name in SOURCES]
    if all(p.exists() for p in paths):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    docs: dict[str, dict[str, None]] = {name: {} for name in SOURCES}  # ordered sets
    for i, path in enumerate(stdlib_files()):
        text = read_source(path)
        if text is None or not text.strip():
            continue
        if i % STRIDE == 0:
            docs["code"][text] = None
        else:
            docs["prose"].update(dict.fromkeys(docstrings(text)))
    for path, name in zip(paths, SOURCES, strict=True):
        with open(path, "w", encoding="utf-8") as f:
            for text in docs[name]:
                f.write(json.dumps({"text": text}) + "\n")
    return paths


def commands(out: Path, extra: list[str]) -> list[list[str]]:
    """The prepare command, then one training run per (H, split)."""
    py = sys.executable
    inputs = [str(out / f"{name}.jsonl") for name in SOURCES]
    prepare = [py, "-m", "hypertrain.data", "prepare", *inputs, "--field", "text"]
    cmds = [[*prepare, "--tokenizer", "train:1024", "--out", str(out / "corpus")]]
    for H in HS:
        for split in SPLITS:
            run = [py, "-m", "hypertrain.train", "data=prepared", f"data.path={out / 'corpus'}"]
            run += [f"data.replica_split={split}", f"inner.H={H}", *TRAIN, *extra]
            cmds.append([*run, f"hydra.run.dir={out / f'h{H}_{split}'}"])
    return cmds


def heldout(run: Path) -> dict[int, list[float]]:
    """Update -> each source's held-out loss, from the run's sync and eval rows."""
    from hypertrain.rundir.records import METRICS_FILE, read_metrics

    return {
        row["update"]: row["eval_loss_sources"]
        for row in read_metrics(run / METRICS_FILE)
        if row["kind"] in ("sync", "eval") and row.get("eval_loss_sources")
    }


def table(out: Path) -> list[str]:
    """Rows (H, split); per point the held-out loss on prose, on code, and their mean."""
    head = ["H", "split"]
    for u in POINTS:
        head += [f"prose @{u}", f"code @{u}", f"mean @{u}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for H in HS:
        for split in SPLITS:
            got = heldout(out / f"h{H}_{split}")
            cells = [str(H), split]
            for u in POINTS:
                a, b = got[u]
                cells += [f"{a:.3f}", f"{b:.3f}", f"{(a + b) / 2:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = study_parser(__doc__)
    args = parser.parse_intermixed_args()
    out = args.out.resolve()
    if not args.dry_run:
        write_sources(out)
    failed = []
    for i, cmd in enumerate(commands(out, args.extra)):
        print(" ".join(cmd), flush=True)
        if args.dry_run:
            continue
        if subprocess.run(cmd, stdout=None if i == 0 else subprocess.DEVNULL).returncode:
            failed.append(" ".join(cmd))
            if i == 0:  # no corpus, no runs
                break
    if not args.dry_run and not failed:
        print("\n".join(table(out)), flush=True)
    for cmd in failed:
        print(f"failed: {cmd}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
