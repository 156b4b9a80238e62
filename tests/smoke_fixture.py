"""The smoke run behind the regression fixture `tests/assets/smoke_losses.json`.

REGRESSION FIXTURE: the per-replica losses of this run as this code produced them, to catch
unintended changes. It proves nothing on its own; `tests/test_regression.py` checks its first
steps against an independent float64 implementation. Regenerate (after an intended change) with:

    .venv/bin/python tests/smoke_fixture.py --write
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from hypertrain import plan
from hypertrain.config import DataConfig, InnerConfig, LoggerConfig, ModelConfig, PhaseConfig, TrainConfig
from hypertrain.preflight.prepare import prepare
from hypertrain.run.trainer import train
from hypertrain.rundir.records import RunLogger, read_metrics

FIXTURE = Path(__file__).parent / "assets" / "smoke_losses.json"
TOLERANCE = {"rtol": 1e-5, "atol": 0.0}  # same machine kind: float32 reductions, threads may reorder


def smoke_config() -> TrainConfig:
    smoke = plan.PRESETS["smoke"]
    return TrainConfig(
        model=ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1),
        inner=InnerConfig(H=3, warmup_steps=2),
        phase=PhaseConfig(
            name=smoke.name,
            kind="strong",
            global_batch=smoke.global_batch,
            updates=smoke.updates,
            timing_warmup=smoke.timing_warmup,
        ),
        data=DataConfig(seq_len=32, heldout=64),
        logger=LoggerConfig(name="none", progress="never"),
        replicas=2,
    )


def smoke_losses(cfg: TrainConfig | None = None) -> dict:
    cfg = cfg or smoke_config()
    run = prepare(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        with RunLogger(
            Path(tmp),
            {},
            cfg.logger,
            name="smoke",
            group="smoke",
            job_type="smoke",
            tags=[],
            replicas=cfg.replicas,
        ) as log:
            train(run, log)
        rows = read_metrics(Path(tmp) / "metrics.jsonl")
    return {
        "data_fingerprint": run.dataset.fingerprint,
        "torch": torch.__version__,
        "losses": [r["loss"] for r in rows if r["kind"] == "update"],
        "eval_losses": [r["eval_loss"] for r in rows if r["kind"] in ("eval", "sync")],
    }


if __name__ == "__main__":
    if "--write" not in sys.argv:
        print(json.dumps(smoke_losses(), indent=1))
        sys.exit(0)
    record = {"regenerate": ".venv/bin/python tests/smoke_fixture.py --write", "tolerance": TOLERANCE}
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(record | smoke_losses(), indent=1) + "\n")
    print(f"wrote {FIXTURE}")
