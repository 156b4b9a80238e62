"""The model's sizes without torch: every parameter's name, shape and role, and the counts built on
them (all, active per token, in matmuls), from the model entry (`model.spec`). The refusals, the memory
check and the clock read them before torch is imported; `model.transformer` builds its weights from them.
"""

from __future__ import annotations

import math

from hypertrain.config import ModelConfig
from hypertrain.model.spec import ROLES, Spec, expert_specs, ffn_width, model_spec

__all__ = ["ROLES", "expert_specs", "ffn_width", "param_specs", "param_shapes", "param_roles"]


def param_specs(cfg: ModelConfig) -> dict[str, Spec]:
    """Name -> (shape, role) of one replica's parameters, in a fixed (sorted) order: the model entry's
    (`model.spec`), where each is declared with its role and place."""
    return model_spec(cfg).param_specs(cfg)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one replica's parameters, in a fixed (sorted) order."""
    return {name: shape for name, (shape, _) in param_specs(cfg).items()}


def param_roles(cfg: ModelConfig) -> dict[str, str]:
    """Name -> role (`ROLES`) of every parameter."""
    return {name: role for name, (_, role) in param_specs(cfg).items()}


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
