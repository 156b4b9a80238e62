"""Size and write time of a checkpoint, for the default run and for model=base with R = 16.

Builds the run state a checkpoint holds (global weights, outer momentum, every replica's AdamW
moments and step counts) for each config, with the state's real shapes, and writes it with
`hypertrain.rundir.checkpoint.write` (temporary file, fsync, rename, folder fsync) into a temporary
directory, several times; prints the file size and the median and spread of the write time.
Measured on the machine it runs on (its disk and page cache); the gather of the replicas' states
under processes=dist is not included.

    .venv/bin/python experiments/bench/checkpoint_size.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from hypertrain.config import ModelConfig, TrainConfig
from hypertrain.diloco.state import RunState
from hypertrain.model.shapes import count_params
from hypertrain.model.transformer import init_params
from hypertrain.rundir import checkpoint

CASES = {
    "default (model=tiny, R 4)": (ModelConfig(), 4),
    "model=base, R 16": (ModelConfig(name="base", d_model=256, n_layers=6, n_heads=8, n_kv_heads=4), 16),
}


def payload(model: ModelConfig, replicas: int) -> dict:
    cfg = TrainConfig(model=model, replicas=replicas)
    state = RunState.start(cfg, init_params(model, 0))
    return {
        "format": checkpoint.FORMAT,
        "state": state.state_dict(),
        "config": {},
        "plan": {},
        "metrics_bytes": 0,
        "wandb_run_id": None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'config':<28} {'params':>10} {'file MiB':>9} {'write s (median, min-max)':>28}")
    for name, (model, replicas) in CASES.items():
        data = payload(model, replicas)
        with tempfile.TemporaryDirectory() as tmp:
            times, size = [], 0
            for i in range(args.repeats):
                size, seconds = checkpoint.write(checkpoint.path_for(Path(tmp), i), data, keep=1)
                times.append(seconds)
        spread = f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"
        print(f"{name:<28} {count_params(model):>10,} {size / 2**20:>9.1f} {spread:>28}")


if __name__ == "__main__":
    main()
