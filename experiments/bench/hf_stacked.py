"""model=hf's stacked step (vmap over the replicas' parameters) against its loop, and against the own
decoder's stacked engine at the same shape.

A Hugging Face Llama of model=tiny's shape (d 64, 2 layers, 4 heads, SwiGLU 176, byte vocabulary),
R = 16 replicas of 16 rows of 64 tokens (the default workload's per-replica batch at R = 16), one
training step each (forward, hypertrain's loss from the logits, backward, AdamW), timed side by side in
one run, calls interleaved (the machine is shared), medians after warm-up:

- hf loop: 16 calls of one replica (`torch.func.functional_call`, the loop engine's path);
- hf stacked: one call of `torch.vmap(functional_call)` over [16, ...] parameters (the stacked
  engine's), with the module's SDPA attention and with its eager attention (`attn_implementation`);
- own stacked: the hand-written decoder (`model=tiny`) at R = 16, the same shapes and weights' count.

    .venv/bin/python experiments/bench/hf_stacked.py [--repeats 7]
"""

from __future__ import annotations

import argparse

import torch
from stacked_vs_loop import interleaved

from hypertrain.config import InnerConfig, ModelConfig
from hypertrain.model.shapes import count_params, param_roles
from hypertrain.model.transformer import forward, init_params
from hypertrain.optim.inner import init_state, inner_step

SEQ, ROWS, R = 64, 16, 16
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2)
LLAMA |= dict(num_attention_heads=4, num_key_value_heads=4, vocab_size=256, rms_norm_eps=1e-6)
MODELS = {
    "hf sdpa": ModelConfig(name="hf", arch="hf", config=LLAMA),
    "hf eager": ModelConfig(name="hf", arch="hf", config=LLAMA | {"attn_implementation": "eager"}),
    "own": ModelConfig(),
}


def training_step(m: ModelConfig, replicas: int):
    """One inner step of `replicas` stacked replicas (1: one replica of the loop), as the engines take it."""
    inner = InnerConfig()
    theta = init_params(m, 0)
    params = {
        n: t.unsqueeze(0).expand(replicas, *t.shape).clone().requires_grad_(True) for n, t in theta.items()
    }
    state = init_state(inner, params, param_roles(m))
    gen = torch.Generator().manual_seed(replicas)
    tokens = torch.randint(0, 256, (replicas, ROWS, SEQ + 1), generator=gen)

    def step() -> None:
        forward(m, params, tokens)[:, 0].sum().backward()
        inner_step(inner, params, {n: p.grad for n, p in params.items()}, state, 1e-3)
        for p in params.values():
            p.grad = None

    return step


def loop_of(m: ModelConfig):
    steps = [training_step(m, 1) for _ in range(R)]

    def step() -> None:
        for s in steps:
            s()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, cpu, "
        f"{torch.get_num_threads()} threads; R = {R}, {ROWS} rows of {SEQ} tokens per replica; "
        f"{count_params(MODELS['hf sdpa']):,} parameters (own tiny {count_params(MODELS['own']):,})\n"
    )
    fns = {
        "hf loop (sdpa)": loop_of(MODELS["hf sdpa"]),
        "hf stacked (sdpa)": training_step(MODELS["hf sdpa"], R),
        "hf stacked (eager)": training_step(MODELS["hf eager"], R),
        "own stacked": training_step(MODELS["own"], R),
    }
    t = interleaved(fns, args.repeats)
    print("one training step at R = 16 (ms, median)")
    for name, seconds in t.items():
        print(f"  {name:<20} {seconds * 1e3:9.1f}")
    loop = t["hf loop (sdpa)"]
    print("\nratios")
    print(f"  hf stacked (sdpa) / hf loop      {t['hf stacked (sdpa)'] / loop:.2f}")
    print(f"  hf stacked (eager) / hf loop     {t['hf stacked (eager)'] / loop:.2f}")
    print(f"  hf stacked (sdpa) / own stacked  {t['hf stacked (sdpa)'] / t['own stacked']:.2f}")
    print(f"  hf stacked (eager) / own stacked {t['hf stacked (eager)'] / t['own stacked']:.2f}")


if __name__ == "__main__":
    main()
