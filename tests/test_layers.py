"""The house's one rule: imports point one way, down the layers below, and no modules import each other
in a circle. `LAYERS` is the order, written once (docs/design.md, "The house"); a module's layer is its
package (or, for a top-level module, the module) under `hypertrain/`, and a package's `__main__` is an
entry. Imports are read with `ast` from every file, those inside functions too, so a lazy import cannot
hide an upward one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from helpers import REPO

# Lowest first: a module may import its own package and the layers before it, never one after it.
LAYERS = (
    "errors",  # UserError, a user's mistake (one line, exit 2): imports nothing
    "import_path",  # a component named by its import path (module.NAME): imports nothing of hypertrain
    "codec_table",  # the codecs, one entry each, and what each can do: imports nothing but import_path
    "schedule_table",  # the schedules, one entry each, and what each is: imports errors, import_path
    "choices",  # the config's string choices as enums: imports nothing of hypertrain but the two tables
    "config",  # the schema: imports nothing of hypertrain but its choices
    "codecs",  # the codecs' kernels and their blocks: torch, the codec table and the config
    "records",  # the rows a run writes (metrics.jsonl): their fields, JSON form and W&B keys
    "failures",  # how a run fails: exit codes, stop signals, the test-only fault points
    "plan",  # the sample plan: numpy only
    "data",  # datasets and the batches an update trains on
    "model",  # parameters and the forward pass
    "optim",  # the inner optimizers
    "engines",  # how one process computes its replicas' inner steps
    "distributed",  # process layouts, groups and collectives, launchers' environments
    "clock",  # the network clock: a run's simulated seconds on a named cluster, row by row
    "diloco",  # rounds, the sync pipeline, the outer step, the run's state
    "rundir",  # what a run leaves on disk: its directory and lock, records, checkpoints
    "preflight",  # everything that refuses a run before anything is written; the data and plan prepared
    "run",  # the training session: rounds with records, held-out losses, checkpoints, the stop
    "launchers",  # real processes (torch's agent, the worker) and what Hydra loads to launch sweeps
    "report",  # reading and comparing runs, on the measured and the simulated clock
    "sample",  # python -m hypertrain.sample: text from a run's weights (an entry)
    "export",  # python -m hypertrain.export: a run's weights as a Hugging Face model (reads runs as sample)
    "train",  # the entries: hypertrain.train and every package's __main__ (python -m ...)
)
# Third-party packages a layer must not load (the plan is numpy only; the model needs no Hydra).
FORBIDDEN = {
    "records": ("torch", "numpy", "hydra", "omegaconf", "wandb"),
    "plan": ("torch", "hydra", "omegaconf", "wandb"),
    "model": ("hydra", "omegaconf", "wandb"),
}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> set[str]:
    """Every module `path` imports, absolute, resolved to a module file where a name is one."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            for alias in node.names:  # `from pkg import module` imports the module, else a name of pkg
                candidate = root.parent / Path(*f"{base}.{alias.name}".split("."))
                if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
                    found.add(f"{base}.{alias.name}")
                else:
                    found.add(base)
    return found


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports."""
    top = root.name
    edges = {}
    for path in sorted(root.rglob("*.py")):
        edges[module_name(path, root)] = {
            m for m in imports(path, root) if m == top or m.startswith(top + ".")
        }
    return edges


def layer(module: str) -> str:
    """A module's layer: its package under `hypertrain/`, or the entries' (`train`) for a package's
    `__main__`, which is a command (`python -m hypertrain.clock`) and may import any layer."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "train"
    return parts[1] if len(parts) > 1 else ""


def upward_imports(edges: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """`a -> b` for every import from a layer into a later one (or into a part no layer names)."""
    found = []
    for a, targets in edges.items():
        for b in sorted(targets):
            la, lb = layer(a), layer(b)
            if la == lb or lb == "":
                continue
            if la not in layers or lb not in layers or layers.index(lb) > layers.index(la):
                found.append(f"{a} -> {b}")
    return found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected modules (Tarjan), each as a sorted list."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1 or v in edges.get(v, ()):
                out.append(sorted(part))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges) + 100))
    for v in edges:
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def house() -> dict[str, set[str]]:
    """hypertrain's import graph (read when a test asks for it, not at collection)."""
    return graph(REPO / "hypertrain")


def test_every_part_of_the_package_has_a_layer(house):
    assert {layer(m) for m in house if layer(m)} <= set(LAYERS)


def test_no_module_imports_a_layer_above_its_own(house):
    assert upward_imports(house) == []


def test_no_modules_import_each_other_in_a_circle(house):
    assert circles(house) == []


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_a_low_layer_loads_none_of_the_libraries_it_must_not(part):
    loaded = set()
    for path in (REPO / "hypertrain" / part).rglob("*.py"):
        loaded |= {m.split(".")[0] for m in imports(path, REPO / "hypertrain")}
    assert loaded.isdisjoint(FORBIDDEN[part])


def test_the_checks_find_a_planted_circle_and_an_upward_import(tmp_path):
    """The checks can fail: a tree with one circle (a <-> b in `plan`) and one upward import
    (`plan.a` importing `run.c`) is caught by both."""
    pkg = tmp_path / "hypertrain"
    for folder in ("plan", "run"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "a.py").write_text("from hypertrain.plan import b\nfrom hypertrain.run.c import x\n")
    (pkg / "plan" / "b.py").write_text("def f():\n    from hypertrain.plan.a import y\n")
    (pkg / "run" / "c.py").write_text("x = 1\n")
    edges = graph(pkg)
    assert upward_imports(edges) == ["hypertrain.plan.a -> hypertrain.run.c"]
    assert circles(edges) == [["hypertrain.plan.a", "hypertrain.plan.b"]]
