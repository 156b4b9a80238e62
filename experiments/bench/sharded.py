"""What `processes.shard=true` saves per rank (issue 51, "Memory"): one replica (R = 1) of `model=small`
at d_model 198 (MODEL) trained by L = 1 (unsharded), 2 and 4 ranks (real processes under torchrun,
gloo, one torch thread each).

Each rank runs the entry in this file's worker (`--worker`), which records, per rank: the bytes of the
run state's tensors this rank holds, taken by a hook on `memory_facts` (called on every rank with the
run state, before the first update: `ShardedReplicaGroups.memory_facts`' own accounting of the local
tensors, applied to the unsharded run too); and its peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`
in the worker after the run: not in the run's records). Seconds per update are rank 0's
`train/timed_s / train/timed_updates` (the summary row). The check (issue 51's Proof): each rank's bytes
at L are at most 1/L of L = 1's plus, per tensor, one dim-0 slice (FSDP2's padding).

    .venv/bin/python experiments/bench/sharded.py [--updates 6]

Exits 1 if a run fails or a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# model=small widened to d_model 198 (3 heads of 66, one key/value head): 198 rows cut into 4 are
# 50, 50, 50, 48, so L = 4 pads (rank 0 holds more than 1/4) and the check's slice allowance is exercised.
MODEL = ["model=small", "model.d_model=198", "model.n_heads=3", "model.n_kv_heads=1"]
PARTS = ("weights", "gradients", "inner_state", "outer_state")
# Tensors per parameter in each part: weights; gradients; AdamW's m, v; the global weights, outer momentum.
PER_PARAM = {"weights": 1, "gradients": 1, "inner_state": 2, "outer_state": 2}


def worker(out: Path, argv: list[str]) -> int:
    """One rank: the entry on `argv`, its per-rank bytes (hooked) and peak RSS written to out/rank<r>.json."""
    import torch

    torch.set_num_threads(1)
    from hypertrain import train
    from hypertrain.distributed.groups import ReplicaGroups
    from hypertrain.distributed.sharded import ShardedReplicaGroups

    seen: dict = {}
    facts = ShardedReplicaGroups.__dict__["memory_facts"]  # only reads the state's tensors
    for cls in (ReplicaGroups, ShardedReplicaGroups):
        original = cls.__dict__["memory_facts"]

        def hooked(self, state, original=original):
            seen.update(facts(self, state))
            return original(self, state)

        cls.memory_facts = hooked
    code = train.cli(argv)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps({"bytes": seen, "peak_rss": rss}))
    return code


def launch(L: int, updates: int, root: Path) -> dict:
    run_dir, out = root / f"L{L}", root / f"L{L}-ranks"
    out.mkdir()
    args = [
        "experiment=quick",
        *MODEL,
        "logger=none",
        "processes=dist",
        f"world={L}",
        "replicas=1",
        f"processes.shard={'true' if L > 1 else 'false'}",
        "engine.threads=1",
        "checkpoint.every=0",
        f"phase.updates={updates}",
        f"hydra.run.dir={run_dir}",
    ]
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(L), __file__, "--worker", str(out), *args]
    env = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"L = {L} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "summary":
            summary |= row
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(L)]
    import torch

    weights = torch.load(run_dir / "weights.pt")
    return {"summary": summary, "ranks": ranks, "weights": weights}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=6)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {L: launch(L, a.updates, Path(tmp)) for L in (1, 2, 4)}
    whole = runs[1]["ranks"][0]["bytes"]
    tensors = [t for t in runs[1]["weights"].values() if t.dim() > 0]
    slice_bytes = sum(t[0].numel() * t.element_size() for t in tensors)  # one dim-0 slice per parameter
    print(
        f"{' '.join(MODEL)}: {sum(t.numel() for t in tensors):,} parameters in {len(tensors)} tensors (fp32)"
    )
    head = "| L | rank | weights B | gradients B | inner state B | outer state B | peak RSS MiB | s/update |"
    head += " ratio to L=1 (w, g, in, out) | check |"
    print(head)
    print("|" + "---|" * 10)
    failed = False
    for L, run in runs.items():
        s = run["summary"]
        per_update = s["train/timed_s"] / max(s["train/timed_updates"], 1)
        for r, rank in enumerate(run["ranks"]):
            got = rank["bytes"]
            ok = all(
                got[f"memory/rank_{k}_bytes"]
                <= whole[f"memory/rank_{k}_bytes"] / L + PER_PARAM[k] * slice_bytes
                for k in PARTS
            )
            failed |= not ok
            cells = [f"{got[f'memory/rank_{k}_bytes']:,}" for k in PARTS]
            ratios = ", ".join(
                f"{got[f'memory/rank_{k}_bytes'] / whole[f'memory/rank_{k}_bytes']:.3f}" for k in PARTS
            )
            check = "-" if L == 1 else ("PASS" if ok else "FAIL")
            rss = rank["peak_rss"] / 2**20
            print(f"| {L} | {r} | {' | '.join(cells)} | {rss:.0f} | {per_update:.3f} | {ratios} | {check} |")
        recorded = {k: v for k, v in run["summary"].items() if k.startswith("memory/rank_")}
        if L > 1 and recorded != run["ranks"][0]["bytes"]:  # the run's own record holds rank 0's
            print(f"L = {L}: the summary's {recorded} differ from rank 0's hooked bytes")
            failed = True
    print(f"check: bytes(L) <= bytes(1) / L + per tensor one dim-0 slice ({slice_bytes:,} B per tensor set)")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(worker(Path(sys.argv[2]), sys.argv[3:]))
    sys.exit(main())
