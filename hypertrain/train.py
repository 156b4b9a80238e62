"""The single entry: `python -m hypertrain.train [group=option ...] [field=value ...]` (Hydra 1.3).

Composes `conf/train.yaml` over the typed `TrainConfig`; `hypertrain.preflight` validates it and
prepares the run before Hydra creates anything (a user mistake prints one line
`hypertrain: error: ...` and exits with code 2, nothing written). A run that fails (a non-finite
loss) prints one line and exits 1, its metrics.jsonl and W&B run closed. Then
config -> plan -> data -> engine -> log: writes `config.yaml`, `plan.json` and `metrics.jsonl`
in Hydra's run directory and mirrors the metrics to Weights & Biases (offline by default).
Multirun (`-m`) sweeps run each job as its own W&B run in one group.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hypertrain import preflight
from hypertrain.config import TrainConfig, register_configs
from hypertrain.engines import NonFiniteError
from hypertrain.layouts import choose_layout, launched_by_torchrun, process_count
from hypertrain.log import RunLogger
from hypertrain.trainer import train

register_configs()
logger = logging.getLogger("hypertrain")


def config_hash(resolved: dict) -> str:
    """A short stable hash of the resolved config: two runs of one config share it."""
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:8]


def run_identity(cfg: TrainConfig, resolved: dict) -> dict:
    """W&B name, group, job type and tags for this run."""
    hydra_cfg = HydraConfig.get()
    group = cfg.logger.group or cfg.experiment
    if not cfg.logger.group and hydra_cfg.mode == RunMode.MULTIRUN:
        group = f"{cfg.experiment}-{Path(hydra_cfg.sweep.dir).name}"
    tag = f"w{cfg.world.size}-r{cfg.replicas}-h{cfg.inner.H}"
    return {
        "name": f"{cfg.experiment}-{cfg.phase.name}-{tag}-{config_hash(resolved)}",
        "group": group,
        "job_type": cfg.phase.name,
        "tags": [
            f"world={cfg.world.size}",
            f"R={cfg.replicas}",
            f"H={cfg.inner.H}",
            f"engine={cfg.engine.name}",
            f"inner={cfg.inner.name}",
        ],
    }


def quote_numeric_choices(argv: list[str], groups: tuple[str, ...] = ("world",)) -> list[str]:
    """`world=8,16` -> `world='8','16'`: Hydra reads a bare 8 as an int, but group options are names."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in groups and re.fullmatch(r"\d+(,\d+)*", value):
            arg = key + "=" + ",".join(f"'{v}'" for v in value.split(","))
        out.append(arg)
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(dict_cfg: DictConfig) -> float:
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    run = preflight.take_prepared(dict_cfg)
    if run is None:  # a multirun job: Hydra has made its directory; a rejected job removes it again
        run = preflight.check_job(dict_cfg, dict(hydra_cfg.runtime.choices), run_dir)
    if run.cfg.engine.name == "dist":
        run = replace(run, cfg=with_layout(run.cfg))
    writer = not launched_by_torchrun() or os.environ["RANK"] == "0"
    resolved = OmegaConf.to_container(OmegaConf.structured(run.cfg), resolve=True)
    identity = run_identity(run.cfg, resolved)
    if writer:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(run.cfg)))
        (run_dir / "plan.json").write_text(json.dumps(run.plan_facts, indent=2) + "\n")
        logger.info("run %s: %s", identity["name"], run.dataset.description)
        if run.cfg.engine.name == "dist":
            engine = run.cfg.engine
            logger.info("engine=dist: %d processes, %s layout", engine.nproc, engine.layout)
        if run.cfg.engine.compile:
            logger.info(
                "engine.compile=true: the first updates and the first held-out eval include compilation"
            )
    if run.cfg.engine.name == "dist":
        from hypertrain import dist

        job = dist.WorkerJob(run.cfg, str(run_dir) if writer else None, resolved, identity)
        if launched_by_torchrun():  # this process is one rank; a failure ends it inside run_worker
            summary = dist.run_worker(job, run)
        else:
            try:
                summary = dist.launch(job)
            except dist.RunFailed as e:
                preflight.fail(f"run failed: {e} ({run_dir})", code=e.exit_code)
        if not writer:
            return math.nan
    else:
        summary = train_here(run, run_dir, resolved, identity)
    logger.info(
        "done: held-out loss %.4f, %.1f replica-steps/s, %s",
        summary["eval/final_loss"],
        summary["train/replica_steps_per_s"],
        run_dir,
    )
    return summary["eval/final_loss"]


def with_layout(cfg: TrainConfig) -> TrainConfig:
    """engine=dist's process count and layout decided (validate() has checked that one fits)."""
    engine = cfg.engine
    layout = choose_layout(
        process_count(engine.nproc, cfg.world.size), cfg.world.size, cfg.replicas, engine.layout
    )
    return replace(cfg, engine=replace(engine, nproc=layout.processes, layout=layout.kind))


def train_here(run, run_dir: Path, resolved: dict, identity: dict) -> dict:
    """Train in this process (engine=loop or stacked); the global weights end in weights.pt."""
    import torch

    if run.cfg.engine.threads:
        torch.set_num_threads(run.cfg.engine.threads)
    try:
        with RunLogger(run_dir, resolved, run.cfg.logger, replicas=run.cfg.replicas, **identity) as log:
            summary, state = train(run, log)
    except NonFiniteError as e:
        # metrics.jsonl is flushed row by row and W&B finished with the code by RunLogger's exit.
        preflight.fail(f"run failed: {e} ({run_dir})", code=NonFiniteError.exit_code)
    torch.save({n: t.cpu() for n, t in state.theta.items()}, run_dir / "weights.pt")
    return summary


if __name__ == "__main__":
    sys.argv = quote_numeric_choices(sys.argv)
    main()
