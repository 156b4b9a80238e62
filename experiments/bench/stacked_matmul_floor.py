"""Where a training step's time goes: the matmul share of the loop and the stacked step.

Stacking R replicas runs the same matmuls as R separate steps (a batched GEMM over R problems
computes the same R problems); what it can save is the rest: kernel launches, Python, and
elementwise work. This times one eager training step (forward, backward, clip, AdamW) of the
benchmark's model (2 layers, seq 64, micro-batch 8, R = 16) for the loop and the stacked engine
side by side (unprofiled, interleaved medians), profiles each engine's matmul time (aten::bmm,
mm, addmm, baddbmm), and prints the matmul share and the floor `loop matmul / loop step`: the
best stacked/loop ratio reachable if stacking made every non-matmul cost free.

    .venv/bin/python experiments/bench/stacked_matmul_floor.py [--repeats 5]
"""

from __future__ import annotations

import argparse

from stacked_vs_loop import interleaved, make_loop, make_step, model_cfg
from torch.profiler import ProfilerActivity, profile

from hypertrain.config import InnerConfig
from hypertrain.runtime import keep_freed_memory

MATMULS = {"aten::bmm", "aten::mm", "aten::addmm", "aten::baddbmm"}


def matmul_seconds(step, repeats: int) -> float:
    """Seconds per step spent inside matmul kernels (the profiler's self time of those ops).

    The profiler adds a fixed cost to every op, which would inflate the loop's wall time (many
    small ops) far more than the stacked step's, so wall times are measured without it.
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMULS) / 1e6 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    keep_freed_memory()  # as the trainer does (hypertrain/runtime.py)
    print("d    engine    step ms  matmul ms  matmul share")
    for d in (64, 128):
        m, inner = model_cfg(d), InnerConfig()
        loop, stacked = make_loop(m, inner, 16, False), make_step(m, inner, 16, False)
        walls = interleaved({"loop": loop, "stacked": stacked}, args.repeats * 2)
        loop_s, stacked_s = walls["loop"], walls["stacked"]
        # Alternate the profiled rounds too; keep each engine's smallest matmul time.
        rounds = [
            (matmul_seconds(loop, args.repeats), matmul_seconds(stacked, args.repeats)) for _ in range(3)
        ]
        loop_mm, stacked_mm = (min(r[i] for r in rounds) for i in (0, 1))
        for name, (wall, mm) in (("loop", (loop_s, loop_mm)), ("stacked", (stacked_s, stacked_mm))):
            print(f"{d:<4} {name:<9} {wall * 1e3:7.1f}  {mm * 1e3:9.1f}  {mm / wall:12.0%}")
        print(
            f"d {d}: measured stacked/loop {stacked_s / loop_s:.2f}; "
            f"floor (loop matmul / loop step) {loop_mm / loop_s:.2f}"
        )


if __name__ == "__main__":
    main()
