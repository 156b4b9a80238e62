"""`python -m hypertrain.clock RUN_DIR [RUN_DIR ...] [cluster overrides] [--model-params N] [--out DIR]
[--target-loss X]`: the network clock of finished runs on a cluster, one line per run. Overrides compose
as the training entry's do (`cluster=h100 cluster/inter=internet_1g cluster.inter.bandwidth_gbit=1`);
with none, each run's own `cluster` (its config.yaml; cpu_here for a run written before the clock).

It also writes, into `--out DIR` (default: `report/clock-<cluster name>/` under the deepest directory
holding every RUN_DIR), the report's plot of the held-out loss against simulated seconds
(`plots.clock_plot`) and `clock.md`: the printed table, the target and the plot. The table goes to
stdout, the path written to stderr. The target of `time to target s` is `--target-loss`, else the
largest of the runs' best held-out losses. Bad input: one line, exit 2, nothing written. Of several
runs, one that cannot be timed is skipped with one line naming it; a run whose own clock decided its
weights (`replay.decided_by_clock`) is timed only on its own cluster and size. A reader that
closes stdout early (`| head -1`) ends it quietly, exit 1 (`command.print_out`).
The implementation of `python -m hypertrain.clock` (hypertrain/clock/__main__.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from hypertrain.clock.replay import clock_of, decided_by_clock, run_cluster, run_params, time_to_loss
from hypertrain.config import ClusterConfig, UserError
from hypertrain.report.clock.clocks import cluster_text, parse_target, target_loss
from hypertrain.report.command import VALID_OUT, check_out, print_out
from hypertrain.report.plots import clock_plot, file_safe
from hypertrain.report.render import Section, markdown
from hypertrain.report.runs import Run, load_run
from hypertrain.report.table import data_flags, differing_keys
from hypertrain.rundir.directory import CLOCK_MD, CLOCK_PREFIX, REPORT_FOLDER
from hypertrain.rundir.records import METRICS_FILE
from hypertrain.schedule_table import recorded_entry

PROG = "hypertrain.clock"
USAGE = (
    "valid: RUN_DIR ... [cluster=NAME cluster/inter=LINK cluster.FIELD=VALUE ...] [--model-params N] "
    "[--out DIR] [--target-loss X]"
)
# The clock scales a run's bytes and compute by N / its own count: up to 10^15 parameters its seconds stay
# finite within the cluster's ranges (hypertrain.config, MAX_STRAGGLER_SIGMA's comment); far beyond,
# the scale itself overflows a float.
MAX_MODEL_PARAMS = 10**15


@dataclass
class Args:
    runs: list[Path]
    overrides: list[str]
    model_params: int | None = None
    out: Path | None = None
    target: float | None = None


def _value(arg: str, args) -> str:
    """An option's value: after its `=`, or the next argument ("" when there is none)."""
    return arg.partition("=")[2] if "=" in arg else next(args, "")


def _is(arg: str, option: str) -> bool:
    return arg == option or arg.startswith(f"{option}=")


def parse(argv: list[str]) -> Args:
    """Run directories, cluster overrides, --model-params, --out and --target-loss from the command line."""
    parsed = Args([], [])
    args = iter(argv)
    for arg in args:
        if _is(arg, "--model-params"):
            value = _value(arg, args)
            whole = value.isascii() and value.isdigit() and len(value.lstrip("0")) <= 16
            if not (whole and 1 <= int(value) <= MAX_MODEL_PARAMS):
                raise UserError(
                    f"--model-params={value!r} is not valid; valid: a whole number from 1 to 10^15"
                )
            parsed.model_params = int(value)
        elif _is(arg, "--out"):
            value = _value(arg, args)
            if not value:
                raise UserError(f"--out={value!r} is not valid; {VALID_OUT}")
            parsed.out = Path(value)
        elif _is(arg, "--target-loss"):
            parsed.target = parse_target(_value(arg, args))
        elif not arg:  # an unset shell variable: Path("") would be the working directory
            raise UserError(f"RUN_DIR='' is not valid; {USAGE}")
        elif arg.startswith("-"):
            raise UserError(f"{arg} is not an option; {USAGE}")
        elif "=" in arg:
            if not arg.startswith(("cluster=", "cluster.", "cluster/")):
                raise UserError(f"{arg!r} is not a cluster override; {USAGE}")
            parsed.overrides.append(arg)
        else:
            parsed.runs.append(Path(arg))
    if not parsed.runs:
        raise UserError(f"no RUN_DIR given; {USAGE}")
    for run in parsed.runs:
        if not (run / METRICS_FILE).is_file() or not (run / "config.yaml").is_file():
            raise UserError(f"{run} is not a run directory (no {METRICS_FILE} and config.yaml); {USAGE}")
    return parsed


def default_out(runs: list[Path], clusters: list[str]) -> Path:
    """`report/clock-<cluster name>/` under the deepest directory holding every run (a single run: its
    own folder, where it is the run's own: a resume leaves it as it is, `run.directory.is_report`);
    several clusters (each run on its own) named together, joined by `-`."""
    base = Path(os.path.commonpath([run.resolve() for run in runs]))
    return base / REPORT_FOLDER / f"{CLOCK_PREFIX}{'-'.join(file_safe(name) for name in clusters)}"


def compose_cluster(overrides: list[str]) -> ClusterConfig:
    """The cluster the overrides compose, through Hydra as the training entry composes it, checked."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from hypertrain.preflight.composition import CONF, composition_error
    from hypertrain.preflight.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        cluster = OmegaConf.to_object(cfg.cluster)
    except UserError:
        raise
    except Exception as e:  # Hydra's and OmegaConf's own errors (an unknown preset, a bad number)
        raise UserError(composition_error(e)) from None
    cluster.check()
    return cluster


def cells(results: list[tuple[Path, dict]], target: float | None) -> tuple[list[str], list[list[str]]]:
    """The table's titles and one row of cells per run: the totals a reader compares, and the clock at
    the run's first held-out loss at or below `target` (`-`: never reached, or no target)."""
    head = [
        "run",
        "cluster",
        "params",
        "simulated s",
        "compute util",
        "outer exposed s",
        "best held-out",
        "time to best s",
        "time to target s",
    ]
    body = []
    for run, c in results:
        best = "-" if c["best_heldout_loss"] is None else f"{c['best_heldout_loss']:.4f}"
        to_best = "-" if c["time_to_best_s"] is None else f"{c['time_to_best_s']:.4g}"
        reached = None if target is None else time_to_loss(c["heldout"], target)
        body.append(
            [
                str(run),
                c["cluster"],
                f"{c['params']:,}",
                f"{c['total_s']:.4g}",
                "-" if c["compute_utilization"] is None else f"{c['compute_utilization']:.3f}",
                "-" if c["outer_exposed_s"] is None else f"{c['outer_exposed_s']:.4g}",
                best,
                to_best,
                "-" if reached is None else f"{reached:.4g}",
            ]
        )
    return head, body


def table(results: list[tuple[Path, dict]], target: float | None = None) -> str:
    """One line per run, the columns padded (the printed table)."""
    head, body = cells(results, target)
    lines = [head, *body]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _names(runs: list[Path]) -> list[str]:
    """Each run's path below the folder all of them share (a single run: its folder's name)."""
    if len(runs) == 1:
        return [runs[0].resolve().name]
    base = Path(os.path.commonpath([run.resolve() for run in runs]))
    return [str(run.resolve().relative_to(base)) for run in runs]


def write(
    out: Path,
    loaded: list[Run],
    paths: list[Path],
    results: list[tuple[Path, dict]],
    target: float | None,
    rule: str,
    where: str,
    model_params: int | None,
    command: str,
) -> Path:
    """The held-out-loss-against-simulated-seconds plot and clock.md into `out` (made if missing);
    returns the plot's path."""
    out.mkdir(parents=True, exist_ok=True)
    names, keys, flags = _names(paths), differing_keys(loaded), data_flags(loaded)
    clocks = [clock for _, clock in results]
    plot = clock_plot(loaded, names, keys, flags, clocks, target, where, out, model_params)
    aim = "no run has a held-out loss" if target is None else f"{target:.4f} nats/token ({rule})"
    intro = [
        f"{len(loaded)} runs timed by the network clock (docs/clock.md) on {where}, made by `{command}`.",
        f"time to target s: the simulated seconds at the run's first held-out loss at or below the target, "
        f"{aim}; - when the run never reached it.",
    ]
    if model_params:
        intro.append(
            f"Timed at {model_params:,} parameters (`--model-params`): every byte and compute rescaled."
        )
    section = Section("Runs", intro, cells(results, target), plots=[plot])
    (out / CLOCK_MD).write_text(markdown(f"Network clock: {where}", [section]))
    return out / plot.file


def _reason(error: Exception) -> str:
    """A run's records that cannot be timed, in words (a KeyError is a record missing a field)."""
    if isinstance(error, KeyError):
        return f"a record lacks {error}; valid: a run's records"
    return " ".join(str(error).split())


def check_clock_decided(path: Path, run: Run, cluster: ClusterConfig, own: ClusterConfig, params) -> None:
    """UserError when the run's own clock decided its numbers (`replay.decided_by_clock`) and it is to
    be timed on another cluster or parameter count: its weights hold what that other cluster would
    have made late, so the clock would time a run that never happened."""
    decided = decided_by_clock(run.resolved)
    if decided is None:
        return
    other = []
    if cluster != own:
        changed = " with other values" if cluster.name == own.name else ""
        other.append(f"cluster {cluster.name}{changed} (its own: {own.name})")
    size = own.model_params or run_params(run.rows)  # cluster.model_params: the size its clock timed
    if params is not None and params != size:
        other.append(f"--model-params {params:,} (its own {size:,})")
    if other:
        arrived = recorded_entry(run.resolved.get("outer")).arrival_clock  # else churn.deadline's
        why = "the order its replicas arrived in" if arrived else "which replicas were late"
        raise UserError(
            f"{path} was trained with {decided}: its own clock chose {why}, so its "
            f"weights are that cluster's; timed on {' and '.join(other)} it would be a run that never "
            "happened; valid: its own cluster and size (no cluster overrides or --model-params), or a "
            "run trained on that cluster"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
        chosen = compose_cluster(args.overrides) if args.overrides else None
        timed, results, clusters, skipped = [], [], [], []
        for path in args.runs:
            run = load_run(path, need_plan=False)
            own = run_cluster(run.resolved)
            cluster = chosen or own
            check_clock_decided(path, run, cluster, own, args.model_params)
            try:
                results.append((path, clock_of(run.rows, run.resolved, cluster, args.model_params)))
            except (UserError, ValueError, KeyError) as e:
                if len(args.runs) == 1:
                    raise UserError(f"{path}: {_reason(e)}") from None
                skipped.append(f"{PROG}: skipped {path}: {_reason(e)}")
                continue
            timed.append(run)
            clusters.append(cluster)
        if not results:
            raise UserError(f"none of the runs can be timed ({skipped[0].split(': ', 1)[1]})")
        loaded, paths = timed, [path for path, _ in results]
        target, rule = target_loss(args.target, [clock for _, clock in results])
        names = list(dict.fromkeys(cluster.name for cluster in clusters))
        out = args.out if args.out is not None else default_out(paths, names)
        check_out(out)
        where = cluster_text(chosen) if chosen else f"each run's own cluster ({', '.join(names)})"
        command = " ".join(["python -m hypertrain.clock", *argv])
        png = write(out, loaded, paths, results, target, rule, where, args.model_params, command)
    except (UserError, ValueError, KeyError, OSError) as e:
        message = str(e) if not isinstance(e, KeyError) else f"a record lacks {e}; valid: a run's records"
        print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2
    for line in skipped:
        print(line, file=sys.stderr)
    if print_out([table(results, target)]):
        return 1  # the reader is gone: quietly, as Python's note on SIGPIPE does
    print(f"{PROG}: wrote {out / CLOCK_MD} and {png}", file=sys.stderr)
    return 0
