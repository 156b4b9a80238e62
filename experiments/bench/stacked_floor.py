"""How low the stacked/loop ratio can go: the kernels no stacked step can skip, against the loop.

Stacking R replicas runs the same matmuls as R separate steps (one batched GEMM computes the same R
problems) and the same attention (replicas folded into the batch of torch's SDPA, as the issue
prescribes). So the stacked step's own matmul and attention kernel time is a floor under any
stacked step built on those kernels, eager or compiled (the compiled step calls the same
`extern_kernels.bmm` and flash-attention kernels; only the elementwise work between them is fused).
For the benchmark's model (2 layers, 4 heads, seq 64, micro-batch 8, AdamW) at R = 16 this times,
side by side (unprofiled, interleaved medians), the loop and the stacked step, eager and compiled;
profiles each engine's matmul (aten::bmm, mm, addmm, baddbmm) and attention (SDPA forward and
backward) self time; and prints the floor ratio `stacked kernel time / best loop step` next to the
issue's target. A floor above the target means no stacked step on torch's kernels reaches it here.
First, the premise: the model's GEMM shapes as one `bmm` over 16 replicas against 16 `mm` calls.

torch's profiler backend (kineto) writes a `USDT:... profiler_start` and a `... profiler_stop` line to
the process's stderr (file descriptor 2, from C++) at every start and stop of a profile. Only
KINETO_LOG_LEVEL=6 drops them, and that level drops kineto's errors (level 3) too; so `QuietProfile`
lets those two calls write to a temporary file and passes every other line on to stderr.

    .venv/bin/python experiments/bench/stacked_floor.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile

import torch
from stacked_vs_loop import ROWS, SEQ, interleaved, make_loop, make_step, model_cfg
from torch.profiler import ProfilerActivity, profile

from hypertrain.config import InnerConfig
from hypertrain.model.shapes import ffn_width
from hypertrain.run.runtime import keep_freed_memory

MATMULS = {"aten::bmm", "aten::mm", "aten::addmm", "aten::baddbmm"}
ATTENTION = {
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}
TARGETS = {64: 0.5, 128: 0.7}  # the stacked/loop targets at R = 16
# e.g. "USDT:2026-12-01 22:12:59 5112:5112 SyncActivityProfilerHandler.cpp:52] profiler_start"
KINETO_NOTICE = re.compile(r"USDT:[^\n\]]*\] profiler_(start|stop)\n?")


@contextlib.contextmanager
def without_kineto_notices():
    """Send file descriptor 2 to a temporary file; then write back each line but kineto's notices.

    Only around the profiler's start and stop: whatever else is written there (a warning, an error)
    still reaches stderr, in order, once the call returns or raises.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not KINETO_NOTICE.fullmatch(line)))
            sys.stderr.flush()


class QuietProfile(profile):
    """torch.profiler.profile without kineto's profiler_start / profiler_stop lines on stderr."""

    def start(self) -> None:
        with without_kineto_notices():
            super().start()

    def stop(self) -> None:
        with without_kineto_notices():
            super().stop()


def kernel_seconds(step, repeats: int) -> tuple[float, float]:
    """Seconds per step inside matmul kernels and inside attention kernels (profiler self time).

    The profiler adds a fixed cost to every op, which would inflate the loop's wall time (many
    small ops) far more than the stacked step's, so wall times are measured without it; the
    kernels here take milliseconds each, so the fixed cost barely moves their self time.
    """
    with QuietProfile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
    events = prof.key_averages()
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION)
    return mm / 1e6 / repeats, attention / 1e6 / repeats


def gemm_comparison(repeats: int, R: int = 16) -> None:
    """ms of each of the model's forward GEMM shapes: one bmm over R replicas against R mm calls."""
    print(f"GEMM [tokens, in] @ [in, out], {R} replicas: one bmm against {R} mm (ms, interleaved medians)")
    for d in (64, 128):
        f = ffn_width(model_cfg(d))
        for k, n in ((d, d), (d, f), (f, d)):
            a, b = torch.randn(R, ROWS * SEQ, k), torch.randn(R, k, n)
            singles = [(a[r].clone(), b[r].clone()) for r in range(R)]
            t = interleaved(
                {"bmm": lambda a=a, b=b: torch.bmm(a, b), "mm": lambda s=singles: [x @ w for x, w in s]},
                repeats * 3,
            )
            shape = f"[{ROWS * SEQ}, {k}] @ [{k}, {n}]"
            print(f"  d {d:<4} {shape}: bmm {t['bmm'] * 1e3:.2f}, mm x {R} {t['mm'] * 1e3:.2f}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    keep_freed_memory()  # as the trainer does (hypertrain/run/runtime.py)
    gemm_comparison(args.repeats)
    print("d    engine    eager ms  compiled ms  matmul ms  attention ms  kernels/step")
    for d in (64, 128):
        m, inner = model_cfg(d), InnerConfig()
        steps = {
            (engine, compiled): make(m, inner, 16, compiled)
            for engine, make in (("loop", make_loop), ("stacked", make_step))
            for compiled in (False, True)
        }
        walls = interleaved(steps, args.repeats * 2)
        kernels = {}
        for engine in ("loop", "stacked"):
            # Alternate profiled rounds; keep each engine's smallest kernel times.
            rounds = [kernel_seconds(steps[(engine, False)], args.repeats) for _ in range(3)]
            kernels[engine] = (min(r[0] for r in rounds), min(r[1] for r in rounds))
            eager, compiled = walls[(engine, False)], walls[(engine, True)]
            mm, attention = kernels[engine]
            print(
                f"{d:<4} {engine:<9} {eager * 1e3:8.1f}  {compiled * 1e3:11.1f}  {mm * 1e3:9.1f}  "
                f"{attention * 1e3:12.1f}  {(mm + attention) / min(eager, compiled):12.0%}"
            )
        best_loop = min(walls[("loop", False)], walls[("loop", True)])
        best_stacked = min(walls[("stacked", False)], walls[("stacked", True)])
        floor = sum(kernels["stacked"]) / best_loop
        target = TARGETS[d]
        verdict = "above the target: unreachable on these kernels" if floor > target else "below the target"
        print(
            f"d {d}: best stacked / best loop {best_stacked / best_loop:.2f} (eager/eager "
            f"{walls[('stacked', False)] / walls[('loop', False)]:.2f}, compiled/compiled "
            f"{walls[('stacked', True)] / walls[('loop', True)]:.2f}); floor (stacked matmul + attention "
            f"kernels / best loop) {floor:.2f}, target <= {target}: floor {verdict}"
        )


if __name__ == "__main__":
    main()
