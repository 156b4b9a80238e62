"""Every scheme at its own tuned outer step, over seeds (docs/sweeps.md, issue 52): for each scheme, an Optuna
study (`hydra/sweeper=optuna`) of N trials over its outer step on seed 0, then its best setting on K other
seeds (1..K: the tuning seed's luck is not reported as the scheme's). Prints the report's tuned table
(`hypertrain.report.tuned.study`; `python -m hypertrain.report OUT` shows it with its plot): per scheme
its tuned setting, the final held-out loss over the K seeds as mean (min to max) and standard deviation,
the bits one replica sent (`comm/outer_total_bits`), and the network clock's time to DiLoCo's mean final
loss on three links.

    python experiments/tuned_study.py OUT [--schemes diloco,eager,...] [--trials 20] [--seeds 3]
        [--updates 240] [--H 8] [--corpus docstrings] [--dry-run] [EXTRA OVERRIDES ...]

OUT/tuned_study.json names the schemes and the reference (diloco) for the report; OUT/{scheme}/tune/ holds
the study (a run per trial, trials.yaml, optimization_results.yaml),
OUT/{scheme}/seeds/ the K runs of its best setting. --dry-run prints the runs and their count (the seeds'
runs with the tuned values as `<tuned>`). The divergence guard stays on: a trial that diverges fails
alone and the study goes on. A failing study or seed sweep is reported, the other schemes go on.
`--corpus docstrings` trains every run on English text instead of the stdlib's source as bytes: the stdlib's
docstrings (`stdlib_docstrings`, which tests/test_prepared_learns.py reads too) prepared once into
OUT/corpus with a byte-level BPE of 512 tokens (`python -m hypertrain.data prepare`, docs/data.md).
"""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Callable
from pathlib import Path

from studies import study_parser

# R = 2, world 8, the tiny model (--updates and --H set the phase and the round); the clock of a 1B model on
# h100 over cross_region_10g, which changes no weight but under async, where it decides the arrival order
COMMON = [
    "experiment=quick",
    "logger=none",
    "cluster=h100",
    "cluster/inter=cross_region_10g",
    "cluster.model_params=1000000000",
]
BUILT_IN = ["outer.lr=tag(log, interval(0.05, 3.0))", "outer.momentum=interval(0.0, 0.95)"]
SCHEMES = {  # name: (the scheme's overrides, its outer step's search space)
    "diloco": ([], BUILT_IN),
    "delayed": (["outer.overlap=delayed"], BUILT_IN),
    "eager": (["outer.overlap=eager"], BUILT_IN),
    "streaming": (["outer.fragments=2"], BUILT_IN),
    # SparseLoCo's error feedback stands in for the momentum (conf/outer/sparseloco.yaml): the lr alone
    "sparseloco": (["outer=sparseloco"], ["outer.lr=tag(log, interval(0.1, 3.0))"]),
    "int8": (["outer.compress=int8"], BUILT_IN),
    "lowrank": (["outer.compress=lowrank", "outer.lowrank.rank=4", "outer.error_feedback=true"], BUILT_IN),
    "async_dn_dylu": (
        [
            "outer.schedule=async",
            "outer.arrivals.rule=delayed_nesterov",
            "outer.arrivals.dylu=true",
            "cluster.replica_speeds=[1,0.5]",
        ],
        BUILT_IN,
    ),
    "adam": (["outer.optimizer=torch.optim.Adam"], ["outer.lr=tag(log, interval(0.0001, 0.3))"]),
}
REFERENCE = "diloco"  # the scheme whose mean final loss the report times the others to
TUNING_SEED = 0
TUNED = "<tuned>"  # a tuned value in a dry run's printed seeds command
DOCSTRINGS_MB = 2.5  # of text: ~0.9 M tokens of the BPE, a run of 192 updates reads ~0.4 M


def space_keys(scheme: str) -> list[str]:
    return [spec.partition("=")[0] for spec in SCHEMES[scheme][1]]


def tune_args(out: Path, scheme: str, trials: int, run: list[str]) -> list[str]:
    """The entry's arguments of the scheme's study: N trials, seeded sampler, on the tuning seed (`run`:
    the overrides of every run, `run_overrides`)."""
    overrides, space = SCHEMES[scheme]
    return [
        "-m",
        *run,
        *overrides,
        f"seed={TUNING_SEED}",
        "hydra/sweeper=optuna",
        f"hydra.sweeper.n_trials={trials}",
        "hydra.sweeper.sampler.seed=0",
        *space,
        f"hydra.sweep.dir={out / scheme / 'tune'}",
    ]


def seeds_args(out: Path, scheme: str, best: dict, seeds: int, run: list[str]) -> list[str]:
    """The entry's arguments of the best setting on seeds 1..K (a basic multirun)."""
    overrides, _ = SCHEMES[scheme]
    tuned = [f"{key}={best[key]!r}" if key in best else f"{key}={TUNED}" for key in space_keys(scheme)]
    return [
        "-m",
        *run,
        *overrides,
        *tuned,
        "seed=" + ",".join(str(s) for s in range(1, seeds + 1)),
        f"hydra.sweep.dir={out / scheme / 'seeds'}",
    ]


def run_overrides(updates: int, H: int, extra: list[str]) -> list[str]:
    """What every run of the study has: COMMON, the phase's updates, H, the command line's extra."""
    return [*COMMON, f"phase.updates={updates}", f"inner.H={H}", *extra]


def best_params(out: Path, scheme: str) -> dict:
    """The study's best trial's parameters (the plugin's optimization_results.yaml)."""
    import yaml

    return yaml.safe_load((out / scheme / "tune" / "optimization_results.yaml").read_text())["best_params"]


def write_manifest(args, every: list[str]) -> None:
    """OUT/tuned_study.json: what the report reads the study by (`hypertrain.report.tuned.study`): the
    schemes in order, the reference whose loss the others are timed to, and the study's settings."""
    from hypertrain.report.tuned.study import MANIFEST

    args.out.mkdir(parents=True, exist_ok=True)
    about = {"schemes": args.schemes, "reference": REFERENCE, "trials": args.trials, "seeds": args.seeds}
    (args.out / MANIFEST).write_text(json.dumps(about | {"overrides": every}, indent=2) + "\n")


def run_study(args, run: Callable[[list[str]], int]) -> list[str]:
    """Every scheme's study, then its seeds, each through `run` (the entry's arguments -> exit code):
    the failed commands."""
    failed = []
    every = run_overrides(args.updates, args.H, args.extra)
    write_manifest(args, every)
    for scheme in args.schemes:
        tune = tune_args(args.out, scheme, args.trials, every)
        if run(tune):
            failed.append(shlex.join(tune))
            continue
        best = best_params(args.out, scheme)
        seeds = seeds_args(args.out, scheme, best, args.seeds, every)
        if run(seeds):
            failed.append(shlex.join(seeds))
    return failed


def stdlib_docstrings(megabytes: float) -> list[str]:
    """The docstrings (module, class, function; of >= 40 characters) of the stdlib's .py files outside its
    tests, in sorted path order, until `megabytes` of text; a file that does not parse is skipped."""
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old modules
                tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]:
            text = ast.get_docstring(node)
            if text and len(text) >= 40:
                texts.append(text)
                size += len(text.encode())
                if size >= megabytes * 1e6:
                    return texts
    return texts


def prepare_command(out: Path) -> list[str]:
    """The command that prepares the docstrings (OUT/docstrings.jsonl) into OUT/corpus."""
    inputs, corpus = out.resolve() / "docstrings.jsonl", out.resolve() / "corpus"
    prepare = [sys.executable, "-m", "hypertrain.data", "prepare", str(inputs)]
    return [*prepare, "--tokenizer=train:512", f"--out={corpus}"]


def prepare_docstrings(out: Path) -> int:
    """Write the docstrings as JSONL and prepare them (a second time: prepare's 'nothing to do')."""
    out.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"text": text}) + "\n" for text in stdlib_docstrings(DOCSTRINGS_MB))
    (out / "docstrings.jsonl").write_text("".join(lines))
    return subprocess.run(prepare_command(out)).returncode


def corpus_overrides(out: Path) -> list[str]:
    """What every run on the prepared docstrings adds (its vocab the corpus's, from its meta.json)."""
    return ["data=prepared", f"data.path={out.resolve() / 'corpus'}"]


def tuned_table(out: Path) -> list[str]:
    """The report's tuned table of the study in `out` (`python -m hypertrain.report OUT` shows it too)."""
    from hypertrain.report.phases import markdown_table
    from hypertrain.report.runs import find_runs, load_run
    from hypertrain.report.tuned.study import study_rows, tuned_cells

    runs = [load_run(path) for path in find_runs([out])]
    rows, target, reference = study_rows(out.resolve(), runs)
    return markdown_table(*tuned_cells(rows, target, reference))


def schemes_arg(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown or not names:
        raise ValueError(f"unknown scheme {unknown}; valid: {', '.join(SCHEMES)}")
    return names


def main() -> int:
    parser = study_parser(__doc__)
    parser.add_argument("--schemes", type=schemes_arg, default=list(SCHEMES), help=", ".join(SCHEMES))
    parser.add_argument("--trials", type=int, default=20, help="the trials of each scheme's study")
    parser.add_argument("--seeds", type=int, default=3, help="the seeds its best setting runs on")
    parser.add_argument("--updates", type=int, default=240, help="the phase's updates (phase.updates)")
    parser.add_argument("--H", type=int, default=8, help="inner steps per round (inner.H)")
    parser.add_argument("--corpus", choices=["docstrings"], help="BPE text (default: bytes)")
    args = parser.parse_intermixed_args()
    train = [sys.executable, "-m", "hypertrain.train"]
    if args.corpus:
        args.extra = [*corpus_overrides(args.out), *args.extra]
    if args.dry_run:
        if args.corpus:
            print(shlex.join(prepare_command(args.out)))
        every = run_overrides(args.updates, args.H, args.extra)
        for scheme in args.schemes:
            print(shlex.join(train + tune_args(args.out, scheme, args.trials, every)))
            print(shlex.join(train + seeds_args(args.out, scheme, {}, args.seeds, every)))
        n = len(args.schemes) * (args.trials + args.seeds)
        print(f"{n} runs: {len(args.schemes)} schemes x ({args.trials} trials + {args.seeds} seeds)")
        return 0

    def run(entry_args: list[str]) -> int:
        print(shlex.join(train + entry_args), flush=True)
        return subprocess.run(train + entry_args, stdout=subprocess.DEVNULL).returncode

    if args.corpus and prepare_docstrings(args.out):
        print(f"failed: {shlex.join(prepare_command(args.out))}", file=sys.stderr)
        return 1
    failed = run_study(args, run)
    if any((args.out / s / "seeds").is_dir() for s in args.schemes):
        print("\n".join(tuned_table(args.out)), flush=True)
    for cmd in failed:
        print(f"failed: {cmd}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
