"""`python -m hypertrain.clock RUN_DIR [RUN_DIR ...] [cluster overrides] [--model-params N]`: the network
clock of finished runs on a cluster, one line per run. Overrides compose as the training entry's do
(`cluster=h100 cluster/inter=internet_1g cluster.inter.bandwidth_gbit=1`); with none, each run's own
`cluster` (its config.yaml; cpu_here for a run written before the clock). Bad input: one line, exit 2.
The implementation of `python -m hypertrain.clock` (hypertrain/clock/__main__.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from hypertrain.clock.replay import clock_of, run_cluster
from hypertrain.config import ClusterConfig, ConfigError
from hypertrain.run.records import METRICS_FILE, read_metrics

PROG = "hypertrain.clock"
USAGE = "valid: RUN_DIR ... [cluster=NAME cluster/inter=LINK cluster.FIELD=VALUE ...] [--model-params N]"


def parse(argv: list[str]) -> tuple[list[Path], list[str], int | None]:
    """Run directories, cluster overrides and --model-params from the command line."""
    runs, overrides, model_params = [], [], None
    args = iter(argv)
    for arg in args:
        if arg == "--model-params" or arg.startswith("--model-params="):
            value = arg.partition("=")[2] if "=" in arg else next(args, "")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--model-params={value!r} is not valid; valid: a positive whole number")
            model_params = int(value)
        elif arg.startswith("-"):
            raise ConfigError(f"{arg} is not an option; {USAGE}")
        elif "=" in arg:
            if not arg.startswith(("cluster=", "cluster.", "cluster/")):
                raise ConfigError(f"{arg!r} is not a cluster override; {USAGE}")
            overrides.append(arg)
        else:
            runs.append(Path(arg))
    if not runs:
        raise ConfigError(f"no RUN_DIR given; {USAGE}")
    for run in runs:
        if not (run / METRICS_FILE).is_file() or not (run / "config.yaml").is_file():
            raise ConfigError(f"{run} is not a run directory (no {METRICS_FILE} and config.yaml); {USAGE}")
    return runs, overrides, model_params


def compose_cluster(overrides: list[str]) -> ClusterConfig:
    """The cluster the overrides compose, through Hydra as the training entry composes it, checked."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from hypertrain.run.composition import CONF, composition_error
    from hypertrain.run.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        cluster = OmegaConf.to_object(cfg.cluster)
    except ConfigError:
        raise
    except Exception as e:  # Hydra's and OmegaConf's own errors (an unknown preset, a bad number)
        raise ConfigError(composition_error(e)) from None
    cluster.check()
    return cluster


def table(results: list[tuple[Path, dict]]) -> str:
    """One line per run: the totals a reader compares."""
    head = (
        "run",
        "cluster",
        "params",
        "simulated s",
        "compute util",
        "outer exposed s",
        "best held-out",
        "time to best s",
    )
    lines = [head]
    for run, c in results:
        best = "-" if c["best_heldout_loss"] is None else f"{c['best_heldout_loss']:.4f}"
        to_best = "-" if c["time_to_best_s"] is None else f"{c['time_to_best_s']:.4g}"
        lines.append(
            (
                str(run),
                c["cluster"],
                f"{c['params']:,}",
                f"{c['total_s']:.4g}",
                f"{c['compute_utilization']:.3f}",
                f"{c['outer_exposed_s']:.4g}",
                best,
                to_best,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def main(argv: list[str] | None = None) -> int:
    try:
        runs, overrides, model_params = parse(sys.argv[1:] if argv is None else argv)
        chosen = compose_cluster(overrides) if overrides else None
        results = []
        for run in runs:
            resolved = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=True)
            rows = read_metrics(run)
            cluster = chosen or run_cluster(resolved)
            results.append((run, clock_of(rows, resolved, cluster, model_params)))
    except (ConfigError, ValueError, KeyError) as e:
        message = str(e) if not isinstance(e, KeyError) else f"a record lacks {e}; valid: a run's records"
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    print(table(results))
    return 0
