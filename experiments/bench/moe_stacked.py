"""The mixture-of-experts step, stacked against the loop, and the experts' two batched forms.

At moe_tiny (d 64, 2 layers, 4 experts of width 88, top 2) and moe_small (d 128, 4 layers, GQA, 8
experts of width 176, top 2), R = 16 replicas of 16 rows of 64 tokens (the default workload's
per-replica batch at R = 16), all timed side by side in one run, calls interleaved (the machine is
shared), medians after warm-up:

1. the experts of one layer, forward and backward, the form the model uses (`model.moe.mixture`:
   slots grouped by replica and expert, one batched matmul per expert matrix over all R * E groups)
   against the dense masked form (every expert on every token, the unchosen weighted 0: two batched
   matmuls, no gather, E/k times the multiply-adds), written here;
2. one training step (forward with the load-balancing loss, backward, clip, AdamW or Muon): the
   loop's (16 separate R = 1 replicas) against the stacked engine's (one model, every parameter
   [16, ...]), and the same for the dense model of the same attention and active width (tiny, small)
   for comparison. The ratio stacked/loop of each is printed from this one run;
3. where moe_small's step goes: one layer's experts (forward and backward) and the inner step alone,
   stacked against the loop of 16 R = 1 calls.

    .venv/bin/python experiments/bench/moe_stacked.py [--repeats 7] [--device cpu|cuda]
    .venv/bin/python experiments/bench/moe_stacked.py --aux-split [RUN_DIR]

`--aux-split` prints instead the load-balancing loss of the default run's first replica batch (update
1, replica 0: 64 windows) whole and in 2 and 8 microbatches weighted by their tokens, with moe_tiny's initial
weights and, given a finished moe_tiny run's directory, its final weights (docs/moe.md). Figures only:
no targets; docs/moe.md records them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from stacked_vs_loop import interleaved

from hypertrain.config import InnerConfig, ModelConfig
from hypertrain.model import moe, shapes
from hypertrain.model.shapes import param_roles
from hypertrain.model.transformer import forward, init_params, objective
from hypertrain.optim.inner import init_state, inner_step

SEQ, ROWS, R = 64, 16, 16
MODELS = {
    "moe_tiny": ModelConfig(is_moe=True, n_experts=4, top_k=2, expert_ffn=88),
    "moe_small": ModelConfig(
        is_moe=True, n_experts=8, top_k=2, expert_ffn=176, d_model=128, n_layers=4, n_kv_heads=2
    ),
    "tiny": ModelConfig(),
    "small": ModelConfig(d_model=128, n_layers=4, n_kv_heads=2),
}


def dense_masked(p: dict, pre: str, x: torch.Tensor, top_k: int, tally) -> torch.Tensor:
    """The experts in the dense masked form: every expert on every token, weighted by its gate (0
    off the token's top k); the experts' matrices side by side so each is one matmul."""
    probs, weights, chosen = moe.route(p[pre + "router"], x, top_k)
    gates = torch.zeros_like(probs).scatter(-1, chosen, weights)  # [R, N, E]
    w1, w3, w2 = p[pre + "experts.w1"], p[pre + "experts.w3"], p[pre + "experts.w2"]
    R_, N, d = x.shape
    E, f = w1.shape[1], w1.shape[-1]
    up = torch.bmm(x, w1.transpose(1, 2).reshape(R_, d, E * f))
    gate_in = torch.bmm(x, w3.transpose(1, 2).reshape(R_, d, E * f))
    h = (F.silu(up) * gate_in).view(R_, N, E, f) * gates.unsqueeze(-1).to(up.dtype)
    return torch.bmm(h.view(R_, N, E * f), w2.reshape(R_, E * f, d))


def experts_step(m: ModelConfig, form, device: str, replicas: int = R):
    """Forward and backward of one layer's experts for `replicas` stacked replicas."""
    gen = torch.Generator().manual_seed(0)
    specs = shapes.expert_specs(m.d_model, m.n_experts, m.expert_ffn)
    p = {
        n: (torch.randn(replicas, *shape, generator=gen) * 0.02).to(device).requires_grad_(True)
        for n, (shape, _) in specs.items()
    }
    x = torch.randn(replicas, ROWS * SEQ, m.d_model, generator=gen).to(device).requires_grad_(True)

    def step() -> None:
        form(p, "", x, m.top_k, None).square().sum().backward()
        for t in [*p.values(), x]:
            t.grad = None

    return step


def training_step(m: ModelConfig, inner: InnerConfig, replicas: int, device: str):
    """One inner step of `replicas` stacked replicas (1: one replica of the loop), as the engines take
    it: the objective (loss and weighted load-balancing loss) per replica, summed, backward, the step."""
    theta = init_params(m, 0)
    params = {
        n: t.unsqueeze(0).expand(replicas, *t.shape).clone().to(device).requires_grad_(True)
        for n, t in theta.items()
    }
    state = init_state(inner, params, param_roles(m))
    gen = torch.Generator().manual_seed(replicas)
    tokens = torch.randint(0, m.vocab, (replicas, ROWS, SEQ + 1), generator=gen).to(device)

    def step() -> None:
        objective(m, forward(m, params, tokens)).sum().backward()
        inner_step(inner, params, {n: p.grad for n, p in params.items()}, state, 1e-3)
        for p in params.values():
            p.grad = None

    return step


def optimizer_step(m: ModelConfig, inner: InnerConfig, replicas: int, device: str):
    """The inner step alone, on `replicas` stacked replicas' weights and fixed gradients."""
    params = {
        n: t.unsqueeze(0).expand(replicas, *t.shape).clone().to(device) for n, t in init_params(m, 0).items()
    }
    grads = {n: torch.randn_like(t) * 1e-3 for n, t in params.items()}
    state = init_state(inner, params, param_roles(m))
    return lambda: inner_step(inner, params, grads, state, 1e-3)


def loop_of(m: ModelConfig, inner: InnerConfig, device: str):
    steps = [training_step(m, inner, 1, device) for _ in range(R)]

    def step() -> None:
        for s in steps:
            s()

    return step


def aux_split(run_dir: str | None) -> None:
    from hypertrain.config import TrainConfig
    from hypertrain.diloco.rounds import assignments
    from hypertrain.preflight.prepare import prepare

    m = MODELS["moe_tiny"]
    run = prepare(TrainConfig(model=m, replicas=4))
    batch = assignments(run, range(0, 1))[0].batches[0]
    (mb,) = batch.microbatches
    weights = {"initial": init_params(m, 0)}
    if run_dir:
        weights["trained"] = torch.load(Path(run_dir) / "weights.pt")
    for name, theta in weights.items():
        params = {n: t.unsqueeze(0) for n, t in theta.items()}
        with torch.no_grad():
            whole = forward(m, params, mb.tokens[None])[0]
            print(
                f"{name} weights, {len(mb.tokens)} windows whole: load-balancing loss {float(whole[1]):.6f}, "
                f"cross-entropy {float(whole[0]):.6f}"
            )
            for pieces in (2, 8):
                parts = [forward(m, params, part[None])[0] for part in mb.tokens.chunk(pieces)]
                aux = sum(h[1] / pieces for h in parts)
                ce = sum(h[0] / pieces for h in parts)
                print(
                    f"  in {pieces} microbatches, token-weighted: load-balancing loss {float(aux):.6f}, "
                    f"cross-entropy {float(ce):.6f}"
                )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--aux-split", nargs="?", const="", default=None, metavar="RUN_DIR")
    args = parser.parse_args()
    if args.aux_split is not None:
        aux_split(args.aux_split or None)
        return 0
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        print(f"moe_stacked: error: --device {args.device} but torch sees no CUDA device", file=sys.stderr)
        return 2
    sync = (lambda: torch.cuda.synchronize(args.device)) if on_gpu else (lambda: None)
    where = torch.cuda.get_device_name(args.device) if on_gpu else f"cpu, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}; R = {R}, {ROWS} rows of {SEQ} tokens per replica\n")

    print("1. one layer's experts, forward + backward (ms)")
    for name in ("moe_tiny", "moe_small"):
        m = MODELS[name]
        t = interleaved(
            {
                "grouped": experts_step(m, moe.mixture, args.device),
                "dense": experts_step(m, dense_masked, args.device),
            },
            args.repeats,
            sync=sync,
        )
        print(
            f"  {name:<9} grouped {t['grouped'] * 1e3:8.1f}  dense masked {t['dense'] * 1e3:8.1f}  "
            f"grouped/dense {t['grouped'] / t['dense']:.2f}"
        )

    print("\n2. one training step at R = 16, loop (16 x R = 1) and stacked (ms)")
    for optimizer in ("adamw", "muon"):
        inner = InnerConfig(name=optimizer)
        for name in ("moe_tiny", "tiny", "moe_small", "small"):
            m = MODELS[name]
            t = interleaved(
                {"loop": loop_of(m, inner, args.device), "stacked": training_step(m, inner, R, args.device)},
                args.repeats,
                sync=sync,
            )
            print(
                f"  {optimizer:<6} {name:<9} loop {t['loop'] * 1e3:8.1f}  stacked {t['stacked'] * 1e3:8.1f}  "
                f"stacked/loop {t['stacked'] / t['loop']:.2f}  stacked replica-steps/s {R / t['stacked']:.1f}"
            )

    print("\n3. moe_small's parts at R = 16, loop (16 x R = 1) and stacked (ms)")
    m = MODELS["moe_small"]
    parts = {"experts of one layer": lambda n: experts_step(m, moe.mixture, args.device, n)}
    for optimizer in ("adamw", "muon"):
        inner = InnerConfig(name=optimizer)
        parts[f"{optimizer} step"] = lambda n, inner=inner: optimizer_step(m, inner, n, args.device)
    for name, make in parts.items():
        ones = [make(1) for _ in range(R)]
        t = interleaved(
            {"loop": lambda ones=ones: [s() for s in ones], "stacked": make(R)}, args.repeats, sync=sync
        )
        print(
            f"  {name:<21} loop {t['loop'] * 1e3:8.1f}  stacked {t['stacked'] * 1e3:8.1f}  "
            f"stacked/loop {t['stacked'] / t['loop']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
