"""The model's sizes without torch: every parameter's name, shape and role, and the counts built on
them (all, active per token, in matmuls). The refusals, the memory check, the fragments and the clock
read them before torch is imported; `model.transformer` builds its weights from the same specs.
"""

from __future__ import annotations

import math

from hypertrain.config import ModelConfig


def ffn_width(cfg: ModelConfig) -> int:
    """SwiGLU hidden width: `d_ff`, or 8/3 * d_model rounded up to a multiple of 16."""
    return cfg.d_ff or 16 * math.ceil(8 * cfg.d_model / 3 / 16)


# What a parameter is for; the inner optimizer picks its rule by role (Muon takes `hidden`; a mixture
# of experts' router is AdamW's, as the embeddings and heads are).
ROLES = ("embedding", "head", "norm", "hidden", "router")


def param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, role) of one replica's parameters, in a fixed (sorted) order. Every parameter
    is given its role where it is declared, so a new one cannot fall to the wrong optimizer rule."""
    d, hd, f = cfg.d_model, cfg.d_model // cfg.n_heads, ffn_width(cfg)
    specs = {"norm": ((d,), "norm")}
    if cfg.arch == "multistream":
        for c, vocab in enumerate(cfg.channel_vocabs):
            specs |= {f"emb.{c:02d}": ((vocab, d), "embedding"), f"head.{c:02d}": ((d, vocab), "head")}
    else:
        specs |= {"emb": ((cfg.vocab, d), "embedding"), "head": ((d, cfg.vocab), "head")}
    for i in range(cfg.n_layers):
        pre = f"layers.{i:03d}."
        specs |= {
            pre + "attn_norm": ((d,), "norm"),
            pre + "wq": ((d, cfg.n_heads * hd), "hidden"),
            pre + "wk": ((d, cfg.n_kv_heads * hd), "hidden"),
            pre + "wv": ((d, cfg.n_kv_heads * hd), "hidden"),
            pre + "wo": ((cfg.n_heads * hd, d), "hidden"),
            pre + "mlp_norm": ((d,), "norm"),
        }
        if cfg.is_moe:
            specs |= {pre + n: spec for n, spec in expert_specs(d, cfg.n_experts, cfg.expert_ffn).items()}
        else:
            specs |= {
                pre + "w1": ((d, f), "hidden"),
                pre + "w3": ((d, f), "hidden"),
                pre + "w2": ((f, d), "hidden"),
            }
    return dict(sorted(specs.items()))


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one replica's parameters, in a fixed (sorted) order."""
    return {name: shape for name, (shape, _) in param_specs(cfg).items()}


def param_roles(cfg: ModelConfig) -> dict[str, str]:
    """Name -> role (`ROLES`) of every parameter."""
    return {name: role for name, (_, role) in param_specs(cfg).items()}


def expert_specs(d: int, n_experts: int, width: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """One layer's mixture parameters (names after the layer's prefix) -> (shape, role). The router is
    `router` (AdamW's, also under Muon); each expert's matrices are `hidden` (Muon's)."""
    return {
        "router": ((d, n_experts), "router"),
        "experts.w1": ((n_experts, d, width), "hidden"),
        "experts.w3": ((n_experts, d, width), "hidden"),
        "experts.w2": ((n_experts, width, d), "hidden"),
    }


def count_params(cfg: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in param_shapes(cfg).values())


def active_params(cfg: ModelConfig) -> int:
    """The parameters a token uses (what `6 N` counts in a step's FLOPs): all of a dense model's; of a
    mixture of experts, every parameter but the experts', and top_k / n_experts of those."""
    return _used_per_token(cfg)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters used in matmuls per token (everything but the embedding lookups and norms); of a
    mixture of experts the router and a token's top_k experts (its active parameters)."""
    return _used_per_token(cfg, ("hidden", "head", "router"))


def _used_per_token(cfg: ModelConfig, roles: tuple[str, ...] | None = None) -> int:
    """The parameters of `roles` (all without) a token uses: of a mixture's experts top_k / n_experts."""
    total = 0
    for name, (shape, role) in param_specs(cfg).items():
        if roles is None or role in roles:
            share = cfg.top_k / cfg.n_experts if ".experts." in name else 1
            total += round(math.prod(shape) * share)
    return total
