"""The stacked-vs-loop training step on a GPU: d_model 512, R = 16, fp32 (TF32 matmuls) and bf16, for
the dense model and a mixture of experts (8 experts of half the dense MLP's width, top 2: docs/moe.md).

The same step as `stacked_vs_loop.py` (2 layers, seq 64, micro-batch 8 rows, AdamW; forward,
backward, per-replica clip, optimizer), timed side by side with the device synchronised around
every call: the loop (16 separate R = 1 replicas) against the stacked engine (one model with a
leading replica axis), eager (and with `--compile` also both compiled, as `engine.compile=true`),
for fp32 with TF32 matmuls allowed and for bf16 autocast. Prints
the stacked/loop step-time ratio, replica-steps per second, the share of this GPU's measured
matmul peak (TF32 or bf16, an 8192^2 matmul) and the peak memory of each step. Figures only: no
targets; record them in docs/performance.md.

    python experiments/bench/stacked_gpu.py [--device cuda] [--d 512] [--replicas 16] [--repeats 20]
                                            [--compile] [--models dense moe]

Exits 2 with one line when the device is not available.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch
from stacked_vs_loop import flops_per_replica_step, interleaved, make_loop, make_step

from hypertrain.config import InnerConfig, ModelConfig
from hypertrain.model.shapes import ffn_width


def matmul_peak(device: str, dtype: torch.dtype, sync, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / interleaved({"mm": lambda: a @ b}, 10, sync=sync)["mm"] / 1e9


def peak_memory_mib(step, device: str) -> float:
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="also time both steps compiled")
    parser.add_argument("--models", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        print(f"stacked_gpu: error: --device {args.device} but torch sees no CUDA device", file=sys.stderr)
        return 2
    sync = (lambda: torch.cuda.synchronize(args.device)) if on_gpu else (lambda: None)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(args.device) if on_gpu else "cpu"
    print(f"torch {torch.__version__}, {name}")
    dense = ModelConfig(d_model=args.d, n_layers=2, n_heads=args.d // 64, n_kv_heads=args.d // 64)
    bases = {
        "dense": dense,
        "moe": replace(dense, is_moe=True, n_experts=8, top_k=2, expert_ffn=ffn_width(dense) // 2),
    }
    inner, R = InnerConfig(), args.replicas
    print(
        f"{'model':<6} {'mode':<8} {'dtype':<6} {'loop ms':>8} {'stacked ms':>10} {'ratio':>6} "
        f"{'loop r-s/s':>10} {'stk r-s/s':>9} "
        f"{'stk %peak':>9} {'peak GF/s':>9} {'loop MiB':>8} {'stk MiB':>8}"
    )
    for kind, mode in (
        (k, m) for k in args.models for m in (("eager", "compiled") if args.compile else ("eager",))
    ):
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            m = replace(bases[kind], compute_dtype=label)
            compiled = mode == "compiled"
            steps = {
                "loop": make_loop(m, inner, R, compiled, args.device),
                "stacked": make_step(m, inner, R, compiled, args.device),
            }
            t = interleaved(steps, args.repeats, sync=sync)
            peak = matmul_peak(args.device, dtype, sync, n=8192 if on_gpu else 1024)
            share = flops_per_replica_step(m) * R / t["stacked"] / 1e9 / peak
            memory = {
                k: peak_memory_mib(f, args.device) if on_gpu else float("nan") for k, f in steps.items()
            }
            print(
                f"{kind:<6} {mode:<8} {label:<6} {t['loop'] * 1e3:>8.2f} {t['stacked'] * 1e3:>10.2f} "
                f"{t['stacked'] / t['loop']:>6.2f} "
                f"{R / t['loop']:>10.1f} {R / t['stacked']:>9.1f} {share:>9.0%} {peak:>9.0f} "
                f"{memory['loop']:>8.0f} {memory['stacked']:>8.0f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
