"""One full training step (forward, backward, clip, optimizer), per-replica loop against stacked.

For d_model 64 and 128 (2 layers, 4 heads, seq 64, micro-batch 8 rows, vocab 256), R = 1, 4, 16,
AdamW and Muon, it times side by side, interleaved in one run (the machine is shared):
- loop: R separate R = 1 replicas, each `model.forward` on its own [1, 8, 65] batch, backward,
  `optim.inner_step` (foreach kernels, torch's fused CPU SDPA): the loop engine's own step;
- stacked: one `model.forward` on [R, 8, 65] with every parameter [R, ...], one backward, one
  `inner_step` for all R.
Eager for every configuration; compiled (`torch.compile` of the loss and of `inner_step`, per shape)
for R = 16 and its R = 1 loop. Medians over interleaved repeats after warm-up. Model FLOPs per
replica-step = 6 * matmul params * tokens + attention (3 * 4 * B * T^2 * d per layer, causal not
discounted); the peak is this machine's fp32 GFLOP/s on a 2048^2 matmul.
Also: Muon's batched bf16 Newton-Schulz over all [R, ...] stacked matrices against
`torch.optim.Muon` applied replica by replica (time and bf16 agreement), and peak memory (RSS
high-water mark delta of a fresh subprocess per configuration, see docs/performance.md).

    .venv/bin/python experiments/bench/stacked_vs_loop.py [--repeats 9] [--no-compile]

Prints PASS/MISS per target and exits 1 if one is missed.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch.optim._muon import Muon

from hypertrain.config import InnerConfig, ModelConfig
from hypertrain.model.shapes import matmul_params, param_roles
from hypertrain.model.transformer import forward as model_forward
from hypertrain.model.transformer import init_params, objective
from hypertrain.optim.inner import init_state, inner_step, uses_muon
from hypertrain.run.runtime import keep_freed_memory

SEQ, ROWS, LAYERS = 64, 8, 2


def model_cfg(d: int) -> ModelConfig:
    return ModelConfig(d_model=d, n_layers=LAYERS, n_heads=4, n_kv_heads=4)


def flops_per_replica_step(m: ModelConfig) -> float:
    tokens = ROWS * SEQ
    attention = 3 * 4 * ROWS * SEQ * SEQ * m.d_model * m.n_layers
    return 6 * matmul_params(m) * tokens + attention


def make_step(
    m: ModelConfig, inner: InnerConfig, R: int, compiled: bool, device: str = "cpu"
) -> Callable[[], None]:
    """One training step of R stacked replicas (R = 1 is one loop replica)."""
    theta = init_params(m, 0)
    params = {
        n: t.unsqueeze(0).expand(R, *t.shape).clone().to(device).requires_grad_(True)
        for n, t in theta.items()
    }
    state = init_state(inner, params, param_roles(m))
    tokens = torch.randint(0, m.vocab, (R, ROWS, SEQ + 1), generator=torch.Generator().manual_seed(R)).to(
        device
    )

    def loss_of(p, batch):  # per-replica objective (a mixture's: with its load-balancing loss), summed
        return objective(m, model_forward(m, p, batch)).sum()

    loss_fn = torch.compile(loss_of, dynamic=False) if compiled else loss_of
    opt_fn = torch.compile(inner_step, dynamic=False) if compiled else inner_step

    def step() -> None:
        loss_fn(params, tokens).backward()
        opt_fn(inner, params, {n: p.grad for n, p in params.items()}, state, 1e-3)
        for p in params.values():
            p.grad = None

    return step


def make_loop(
    m: ModelConfig, inner: InnerConfig, R: int, compiled: bool, device: str = "cpu"
) -> Callable[[], None]:
    steps = [make_step(m, inner, 1, compiled, device) for _ in range(R)]

    def step() -> None:
        for s in steps:
            s()

    return step


def interleaved(
    fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 2, sync: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved so machine noise hits all alike.

    `sync` waits for queued device work (torch.cuda.synchronize on a GPU) before each clock read.
    """
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            sync()
            start = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_peak(n: int = 2048, repeats: int = 9) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / interleaved({"mm": lambda: a @ b}, repeats)["mm"] / 1e9


def muon_compare(d: int, R: int, repeats: int) -> dict:
    """Our batched bf16 NS step on [R, ...] hidden matrices vs torch.optim.Muon replica by replica."""
    m = model_cfg(d)
    inner = InnerConfig(name="muon", ns_dtype="bf16", grad_clip=0.0, wd=0.1)
    gen = torch.Generator().manual_seed(1)
    roles = param_roles(m)
    hidden = {n: t for n, t in init_params(m, 0).items() if uses_muon(inner, roles[n])}
    ours = {n: t.unsqueeze(0).expand(R, *t.shape).clone() for n, t in hidden.items()}
    grads = {n: torch.randn(R, *t.shape, generator=gen) * 0.01 for n, t in hidden.items()}
    state = init_state(inner, ours, roles)
    theirs = [{n: t[r].clone() for n, t in ours.items()} for r in range(R)]
    optimizers = []
    for r in range(R):
        params = [torch.nn.Parameter(t) for t in theirs[r].values()]
        for p, n in zip(params, theirs[r], strict=True):
            p.grad = grads[n][r].clone()
        theirs[r] = dict(zip(theirs[r], params, strict=True))
        optimizers.append(
            Muon(
                params,
                lr=inner.lr,
                weight_decay=inner.wd,
                momentum=inner.muon_momentum,
                nesterov=True,
                ns_steps=inner.ns_steps,
                adjust_lr_fn="match_rms_adamw",
            )
        )
    before = {n: t.clone() for n, t in ours.items()}
    reference = {n: t.clone() for n, t in ours.items()}
    fp32 = InnerConfig(name="muon", ns_dtype="fp32", grad_clip=0.0, wd=0.1)
    inner_step(
        fp32, reference, grads, init_state(fp32, reference, {n: "hidden" for n in reference}), inner.lr
    )
    inner_step(inner, ours, grads, state, inner.lr)
    with torch.no_grad():
        for opt in optimizers:
            opt.step()
    worst = {"ours_vs_torch": 0.0, "ours_vs_fp32": 0.0, "torch_vs_fp32": 0.0}
    for n in ours:
        update = {
            "ours": ours[n] - before[n],
            "torch": torch.stack([theirs[r][n].detach() for r in range(R)]) - before[n],
            "fp32": reference[n] - before[n],
        }
        for pair in worst:
            a, b = pair.split("_vs_")
            worst[pair] = max(worst[pair], float((update[a] - update[b]).norm() / update[b].norm()))

    def torch_step() -> None:
        with torch.no_grad():
            for opt in optimizers:
                opt.step()

    times = interleaved(
        {"ours": lambda: inner_step(inner, ours, grads, state, inner.lr), "torch": torch_step}, repeats
    )
    return {"ours_ms": times["ours"] * 1e3, "torch_ms": times["torch"] * 1e3} | worst


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def minor_faults_per_step(step: Callable[[], None], repeats: int = 3) -> float:
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / repeats


def memory_child(d: int, R: int, optimizer: str) -> None:
    """In a fresh process: peak RSS added by building and running the stacked step (Linux /proc)."""
    torch.randn(8) @ torch.randn(8)  # load torch's kernels before the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the RSS high-water mark (VmHWM) to the current RSS
    base = _status_kib("VmRSS")
    step_fn = make_step(model_cfg(d), InnerConfig(name=optimizer), R, compiled=False)
    for _ in range(3):
        step_fn()
    print(json.dumps({"delta_kib": _status_kib("VmHWM") - base}))


def memory_delta(d: int, R: int, optimizer: str) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", f"{d},{R},{optimizer}"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["delta_kib"] / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--memory-child", default="")
    args = parser.parse_args()
    # The trainer's own process setting (hypertrain/run/runtime.py); without it glibc page-faults every
    # large activation of the stacked step anew. The loop's tensors are unaffected either way.
    print(f"keep_freed_memory: {keep_freed_memory()}")
    if args.memory_child:
        d, R, optimizer = args.memory_child.split(",")
        memory_child(int(d), int(R), optimizer)
        return 0

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    peak = matmul_peak()
    print(f"measured fp32 matmul peak (2048^2): {peak:.1f} GFLOP/s\n")
    rows = {}
    print(
        f"{'mode':<8} {'opt':<6} {'d':>4} {'R':>3} {'loop ms':>9} {'stacked ms':>10} {'ratio':>6} "
        f"{'loop r-s/s':>10} {'stk r-s/s':>10} {'stk %peak':>9}"
    )
    modes = ["eager"] + ([] if args.no_compile else ["compiled"])
    for mode in modes:
        for optimizer in ("adamw", "muon"):
            for d in (64, 128):
                m = model_cfg(d)
                inner = InnerConfig(name=optimizer)
                for R in (1, 4, 16) if mode == "eager" else (16,):
                    compiled = mode == "compiled"
                    t = interleaved(
                        {
                            "loop": make_loop(m, inner, R, compiled),
                            "stacked": make_step(m, inner, R, compiled),
                        },
                        args.repeats,
                    )
                    share = flops_per_replica_step(m) * R / t["stacked"] / 1e9 / peak
                    rows[(mode, optimizer, d, R)] = t | {"share": share}
                    print(
                        f"{mode:<8} {optimizer:<6} {d:>4} {R:>3} "
                        f"{t['loop'] * 1e3:>9.1f} {t['stacked'] * 1e3:>10.1f} "
                        f"{t['stacked'] / t['loop']:>6.2f} {R / t['loop']:>10.1f} {R / t['stacked']:>10.1f} "
                        f"{share:>8.0%}"
                    )

    def best(optimizer: str, d: int, R: int, engine: str) -> float:
        return min(rows[(mode, optimizer, d, R)][engine] for mode in modes if (mode, optimizer, d, R) in rows)

    print(
        "\nMuon step only (hidden matrices, bf16 NS; norm-wise relative differences of the update):\n"
        "  ours batched over [R, ...] vs torch.optim.Muon replica by replica"
    )
    muon = {d: muon_compare(d, 16, args.repeats) for d in (64, 128)}
    for d, r in muon.items():
        print(
            f"  d {d} R 16: ours {r['ours_ms']:.1f} ms, torch {r['torch_ms']:.1f} ms, "
            f"speed-up {r['torch_ms'] / r['ours_ms']:.2f}x; update rel diff ours-torch "
            f"{r['ours_vs_torch']:.1e}, ours-fp32NS {r['ours_vs_fp32']:.1e}, "
            f"torch-fp32NS {r['torch_vs_fp32']:.1e}"
        )

    m, inner = model_cfg(128), InnerConfig()
    faults = {
        name: minor_faults_per_step(make(m, inner, 16, False))
        for name, make in (("loop", make_loop), ("stacked", make_step))
    }
    print(
        "\nMinor page faults per step, d 128 AdamW R=16: "
        f"loop {faults['loop']:.0f}, stacked {faults['stacked']:.0f}"
    )

    print("\nPeak memory of the stacked step (RSS high-water delta, fresh process each)")
    mem = {R: memory_delta(128, R, "adamw") for R in (1, 16)}
    print(f"  d 128 AdamW: R=1 {mem[1]:.1f} MiB, R=16 {mem[16]:.1f} MiB, 16 x R=1 {16 * mem[1]:.1f} MiB")

    # The loop baseline of a target is the faster of its eager and compiled forms; so is the stacked time.
    targets = [
        (
            "R=16 d64 AdamW stacked <= 0.5x loop",
            best("adamw", 64, 16, "stacked") / best("adamw", 64, 16, "loop"),
            0.5,
            "<=",
        ),
        (
            "R=16 d128 AdamW stacked <= 0.7x loop",
            best("adamw", 128, 16, "stacked") / best("adamw", 128, 16, "loop"),
            0.7,
            "<=",
        ),
        (
            "R=16 d128 AdamW >= 60% of matmul peak",
            max(rows[(mo, "adamw", 128, 16)]["share"] for mo in modes),
            0.6,
            ">=",
        ),
        (
            "Muon R=16 d128 bf16 NS >= 1.8x torch Muon per replica",
            muon[128]["torch_ms"] / muon[128]["ours_ms"],
            1.8,
            ">=",
        ),
        (
            "Muon update equal to torch's within bf16 (3e-2)",
            max(r["ours_vs_torch"] for r in muon.values()),
            3e-2,
            "<=",
        ),
        ("stacked R=16 memory <= 1.2 x 16 x R=1", mem[16] / (16 * mem[1]), 1.2, "<="),
    ]
    print()
    if "compiled" in modes:
        # For reference, not a verdict: the engine=stacked engine.compile=true step against the plain
        # engine=loop step (eager), the loop a user gets without asking for compilation.
        for d in (64, 128):
            ratio = rows[("compiled", "adamw", d, 16)]["stacked"] / rows[("eager", "adamw", d, 16)]["loop"]
            print(f"info  R=16 d{d} AdamW compiled stacked / eager loop: {ratio:.3g}")
    missed = 0
    for name, value, bound, op in targets:
        ok = value <= bound if op == "<=" else value >= bound
        missed += not ok
        print(f"{'PASS' if ok else 'MISS'}  {name}: {value:.3g} (target {op} {bound})")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
