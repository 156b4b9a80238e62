"""The own decoders under Hugging Face's names: `architecture(cfg)` is the transformers architecture a model
entry matches (the decoder: Llama's `LlamaForCausalLM`; the mixture of experts: Mixtral's), its config
fields from `cfg`, and `hf_weights` maps one replica's weights to its parameter names and layouts (ours are
input-major `[in, out]`, theirs out-major). A model with no matching architecture: UserError, one line.
No torch and no transformers at import; the proof is tests/test_export.py (logits equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypertrain.config import ModelConfig, UserError
from hypertrain.model.spec import DECODER, MOE, ffn_width, model_spec

_ATTENTION = (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
_SWIGLU = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


@dataclass(frozen=True)
class Architecture:
    """A Hugging Face causal LM an own model entry is, parameter for parameter."""

    model_type: str  # transformers' config `model_type` ("llama")
    class_name: str  # its causal-LM class ("LlamaForCausalLM")
    fields: Callable[[ModelConfig], dict]  # the config's own fields, from ours
    mlp: Callable[[dict, str, str], dict]  # one layer's MLP: (weights, our prefix, theirs) -> theirs


def _common(cfg: ModelConfig) -> dict:
    """The fields a Llama and a Mixtral share: our decoder's sizes, RMSNorm's eps, RoPE's base (the
    half-split rotation both write), untied head, no biases, no dropout."""
    return {
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_model // cfg.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
    }


def _llama_fields(cfg: ModelConfig) -> dict:
    return _common(cfg) | {"intermediate_size": ffn_width(cfg), "attention_bias": False, "mlp_bias": False}


def _mixtral_fields(cfg: ModelConfig) -> dict:
    return _common(cfg) | {
        "intermediate_size": cfg.expert_ffn,
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": cfg.router_aux_weight,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def _swiglu(theta: dict, ours: str, theirs: str) -> dict:
    return {f"{theirs}mlp.{hf}.weight": theta[ours + name].T for name, hf in _SWIGLU}


def _experts(theta: dict, ours: str, theirs: str) -> dict:
    """Mixtral's sparse block: the router `gate` [E, d], the experts' gate and up fused ([E, 2f, d],
    gate first), down [E, d, f] (transformers 5's layout, tests/test_moe.py)."""
    import torch

    gate_up = torch.cat([theta[ours + "experts.w1"], theta[ours + "experts.w3"]], dim=-1)
    return {
        f"{theirs}mlp.gate.weight": theta[ours + "router"].T,
        f"{theirs}mlp.experts.gate_up_proj": gate_up.transpose(1, 2),
        f"{theirs}mlp.experts.down_proj": theta[ours + "experts.w2"].transpose(1, 2),
    }


LLAMA = Architecture("llama", "LlamaForCausalLM", _llama_fields, _swiglu)
MIXTRAL = Architecture("mixtral", "MixtralForCausalLM", _mixtral_fields, _experts)
# Model entry -> the architecture it matches; an entry not here (the multistream model) has none.
ARCHITECTURES = {DECODER: LLAMA, MOE: MIXTRAL}
SUPPORTED = (
    "the own decoder (model=tiny|small|base: Llama's LlamaForCausalLM) or its mixture of experts "
    "(model=moe_tiny|moe_small: Mixtral's MixtralForCausalLM)"
)


def architecture(cfg: ModelConfig) -> Architecture:
    """The Hugging Face architecture of the run's model; UserError (one line) where none matches."""
    entry = model_spec(cfg)
    found = ARCHITECTURES.get(entry)
    if found is None:
        raise UserError(
            f"a {entry.kind} model has no Hugging Face architecture to export to; valid: {SUPPORTED}"
        )
    return found


def hf_weights(cfg: ModelConfig, theta: dict) -> dict:
    """One replica's weights (our names, no replica axis) under the architecture's names and layouts,
    contiguous (safetensors stores no views)."""
    arch = architecture(cfg)
    out = {"model.embed_tokens.weight": theta["emb"], "lm_head.weight": theta["head"].T}
    out["model.norm.weight"] = theta["norm"]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i:03d}.", f"model.layers.{i}."
        for name, hf in _ATTENTION:
            out[f"{theirs}self_attn.{hf}.weight"] = theta[ours + name].T
        out[theirs + "input_layernorm.weight"] = theta[ours + "attn_norm"]
        out[theirs + "post_attention_layernorm.weight"] = theta[ours + "mlp_norm"]
        out |= arch.mlp(theta, ours, theirs)
    return {name: tensor.contiguous() for name, tensor in out.items()}
