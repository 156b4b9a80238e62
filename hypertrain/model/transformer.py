"""The decoder, written once for parameters that carry a leading replica axis.

`init_params(cfg, seed)` gives one replica's weights (a dict of tensors, names in
docs/interfaces.md). `forward(cfg, params, tokens, mask, channel_weights)` runs R replicas at
once: every parameter is `[R, ...]`; the per-replica loop engine calls it with R = 1, the stacked
engine with R = many. Architecture: pre-norm RMSNorm, RoPE, causal attention with grouped-query
heads (torch's scaled-dot-product attention, replica axis folded into its batch), SwiGLU MLP, or with
`is_moe` a mixture of SwiGLU experts and a router per layer (`hypertrain.model.moe`, docs/moe.md).

- `arch=decoder`: tokens `[R, B, T+1]`, one embedding and one untied head; the loss is each
  replica's mean next-token cross-entropy over its real target positions.
- `arch=multistream`: tokens `[R, B, C, T+1]`, C channels per position (text and audio codebooks
  per frame), a negative id meaning "no token". The input at a position is the sum of its
  channels' embeddings (`emb.<c>`, one table per channel); each channel has its own head
  (`head.<c>`) predicting its token at the next position. `channel_sums` gives the per-channel sums
  of cross-entropy `[R, C]` over the targets that exist; the loss is `sum_c w_c * sum_c` with the
  per-token channel weights `[R, C]` the plan's coefficients give (`hypertrain.data.batches`).
Either way `forward` returns `[R, 1 + C + M]`: the loss, then the channel sums (C = 0 for a decoder),
then a mixture of experts' router columns (M = `router_columns(cfg)`: its load-balancing loss, the
tokens each layer sent to each expert, its real tokens; M = 0 for a dense model); `objective` is what
the engines differentiate. No Hydra here: `cfg` is a plain `ModelConfig`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor

from hypertrain.config import ModelConfig
from hypertrain.model import moe
from hypertrain.model.shapes import param_specs
from hypertrain.model.spec import model_spec

Params = dict[str, Tensor]


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """One replica's fp32 weights from `seed`: normal(0, init_std), residual outputs scaled down (a
    Hugging Face model's: `model.hf.init_params`)."""
    if model_spec(cfg).module:  # imported here: model.hf imports torch._dynamo (runs without it do not)
        from hypertrain.model import hf

        return hf.init_params(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, (shape, role) in param_specs(cfg).items():
        if role == "norm":
            params[name] = torch.ones(shape)
            continue
        std = cfg.init_std
        if name.endswith(("wo", "w2")):
            std /= math.sqrt(2 * cfg.n_layers)
        params[name] = torch.randn(shape, generator=gen) * std
    return params


def embed(weight: Tensor, tokens: Tensor) -> Tensor:
    """weight [R, V, d], tokens [R, B, T] -> [R, B, T, d]: each replica looks up its own table."""
    R, V, d = weight.shape
    offsets = (torch.arange(R, device=tokens.device) * V).view(R, 1, 1)
    return F.embedding(tokens + offsets, weight.reshape(R * V, d))


def _rope(cfg: ModelConfig, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin [T, 1, head_dim] for rotary embeddings (half-split convention), broadcast over heads.

    Both halves of the last dim hold the same angles; sin's first half is negated so that
    `x * cos + rotate_half(x) * sin` with rotate_half(x) = (x2, x1) rotates each (x1, x2) pair.
    """
    hd = cfg.d_model // cfg.n_heads
    inv_freq = cfg.rope_theta ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
    angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., T, heads, hd] (contiguous) rotated pairwise (first half, second half) by position:
    (x1 cos - x2 sin, x2 cos + x1 sin), in four kernels on contiguous memory."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((x2, x1), dim=-1) * sin).type_as(x)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [R, N, d], weight [R, d]."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight[:, None, :]


def _attention(cfg: ModelConfig, p: Params, pre: str, x: Tensor, B: int, T: int) -> Tensor:
    """Causal grouped-query attention; x [R, B*T, d] -> [R, B*T, d]."""
    R = x.shape[0]
    h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads
    # Fold the replica axis into SDPA's batch: [R*B, heads, T, hd].
    # RoPE on the contiguous [R*B, T, heads, hd] layout, then SDPA's [R*B, heads, T, hd] view.
    cos, sin = _rope(cfg, T, x.device)
    q = _apply_rope(torch.bmm(x, p[pre + "wq"]).view(R * B, T, h, hd), cos, sin).transpose(1, 2)
    k = _apply_rope(torch.bmm(x, p[pre + "wk"]).view(R * B, T, kv, hd), cos, sin).transpose(1, 2)
    v = torch.bmm(x, p[pre + "wv"]).view(R * B, T, kv, hd).transpose(1, 2)
    # Rows are right-padded, so causal masking alone keeps real tokens from seeing padding.
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
    return torch.bmm(o.transpose(1, 2).reshape(R, B * T, h * hd), p[pre + "wo"])


def _mlp(p: Params, pre: str, x: Tensor) -> Tensor:
    return torch.bmm(F.silu(torch.bmm(x, p[pre + "w1"])) * torch.bmm(x, p[pre + "w3"]), p[pre + "w2"])


def hidden(
    cfg: ModelConfig, p: Params, x: Tensor, B: int, T: int, tally: moe.RouterTally | None = None
) -> Tensor:
    """The layers and the final norm: x [R, B*T, d] -> [R, B*T, d]; a mixture of experts records its
    routing in `tally` when given."""
    eps, experts = cfg.norm_eps, model_spec(cfg).experts
    for i in range(cfg.n_layers):
        pre = f"layers.{i:03d}."
        x = x + _attention(cfg, p, pre, _rms_norm(x, p[pre + "attn_norm"], eps), B, T)
        h = _rms_norm(x, p[pre + "mlp_norm"], eps)
        x = x + (moe.mixture(p, pre, h, cfg.top_k, tally) if experts else _mlp(p, pre, h))
    return _rms_norm(x, p["norm"], eps)


def logits(cfg: ModelConfig, p: Params, inputs: Tensor, tally: moe.RouterTally | None = None) -> Tensor:
    """inputs int64 [R, B, T] -> logits [R, B*T, vocab] (`tally`: as in `hidden`; a Hugging Face model's
    are its module's, `model.hf.logits`)."""
    if model_spec(cfg).module:
        from hypertrain.model import hf

        return hf.logits(cfg, p, inputs)
    R, B, T = inputs.shape
    x = embed(p["emb"], inputs).view(R, B * T, cfg.d_model)
    return torch.bmm(hidden(cfg, p, x, B, T, tally), p["head"])


def _autocast(cfg: ModelConfig, device: torch.device):
    if cfg.compute_dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def forward(
    cfg: ModelConfig,
    p: Params,
    tokens: Tensor,
    mask: Tensor | None = None,
    channel_weights: Tensor | None = None,
) -> Tensor:
    """[R, 1 + C + M] per replica (in the weights' dtype): the loss, then the per-channel sums it weighed
    (`channel_sums`, for the per-channel losses the run logs; C = `loss_channels(cfg)`, 0 for a
    decoder), then a mixture of experts' router columns (`moe.RouterTally.columns` over the real input
    positions; M = `router_columns(cfg)`, 0 for a dense model). The loss is the cross-entropy alone:
    `objective` adds the load-balancing loss.

    decoder: the mean cross-entropy over real targets. tokens int64 [R, B, T+1]; mask bool
    [R, B, T+1] marks real positions (None = all real). A target counts when it and its input are
    real. A replica with no real target gets loss 0, never NaN, so stacked replicas with empty rows
    are safe. multistream: `sum_c channel_weights[:, c] * channel_sums[:, c]` (see `channel_sums`;
    the mask is not needed: padding holds no tokens).
    """
    spec = model_spec(cfg)
    if spec.channels:
        sums = channel_sums(cfg, p, tokens)
        loss = (sums * channel_weights.to(sums.dtype)).sum(-1, keepdim=True)
        return torch.cat([loss, sums], dim=-1)
    R = tokens.shape[0]
    inputs, targets = tokens[:, :, :-1], tokens[:, :, 1:]
    tally = None
    if spec.experts:
        tally = moe.RouterTally(None if mask is None else mask[:, :, :-1].reshape(R, -1))
    with _autocast(cfg, tokens.device):
        out = logits(cfg, p, inputs, tally)
    # Under bf16 autocast the logits are bf16; the loss is taken in the weights' dtype.
    dtype = next(iter(p.values())).dtype  # every weight's
    ce = F.cross_entropy(
        out.to(dtype).reshape(-1, out.shape[-1]), targets.reshape(-1), reduction="none"
    ).view(R, -1)
    if mask is None:
        loss = ce.mean(1)
    else:
        real = (mask[:, :, 1:] & mask[:, :, :-1]).reshape(R, -1).to(ce.dtype)
        loss = (ce * real).sum(1) / real.sum(1).clamp(min=1.0)
    if tally is None:
        return loss.unsqueeze(1)  # [R, 1 + 0]: one stream, no channel sums
    return torch.cat([loss.unsqueeze(1), tally.columns(cfg.n_experts).to(loss.dtype)], dim=1)


def objective(cfg: ModelConfig, out: Tensor) -> Tensor:
    """[R]: what the engines differentiate per replica from `forward`'s `out` [R, 1 + C + M] (before
    the microbatch's weight): the loss, plus `router_aux_weight` times a mixture of experts'
    load-balancing loss."""
    if not router_columns(cfg) or cfg.router_aux_weight == 0:
        return out[:, 0]
    return out[:, 0] + cfg.router_aux_weight * out[:, 1 + loss_channels(cfg)]


def router_columns(cfg: ModelConfig) -> int:
    """M: the router columns `forward` returns after the channel sums (0 for a dense model)."""
    return model_spec(cfg).router_columns(cfg)


def loss_channels(cfg: ModelConfig) -> int:
    """C: the per-channel sums `forward` returns beside each replica's loss (0 for a decoder)."""
    return model_spec(cfg).loss_channels(cfg)


def channel_sums(cfg: ModelConfig, p: Params, tokens: Tensor) -> Tensor:
    """multistream: sums of next-position cross-entropy per replica and channel [R, C] (in the
    weights' dtype) over the targets that exist. tokens int64 [R, B, C, T+1]; a negative id is no
    token: it adds nothing to the input and is no target. A channel without targets sums to 0."""
    R, B, C, T1 = tokens.shape
    with _autocast(cfg, tokens.device):
        x = channel_inputs(cfg, p, tokens)
        return channel_heads(p, hidden(cfg, p, x, B, T1 - 1), tokens)


def channel_inputs(cfg: ModelConfig, p: Params, tokens: Tensor) -> Tensor:
    """multistream: the layers' input [R, B*T, d], each channel's embedding of its present ids summed."""
    R, B, C, T1 = tokens.shape
    inputs = tokens[..., :-1]
    x = torch.zeros(R, B * (T1 - 1), cfg.d_model, device=tokens.device, dtype=p["norm"].dtype)
    for c in range(C):
        present = (inputs[:, :, c] >= 0).reshape(R, B * (T1 - 1), 1)
        looked_up = embed(p[f"emb.{c:02d}"], inputs[:, :, c].clamp(min=0)).view(R, B * (T1 - 1), -1)
        x = x + looked_up * present
    return x


def channel_heads(p: Params, h: Tensor, tokens: Tensor) -> Tensor:
    """multistream: from the layers' normed output h [R, B*T, d], each channel's head's cross-entropy
    summed over its targets that exist: [R, C] in the weights' dtype."""
    R, C, dtype = tokens.shape[0], tokens.shape[2], p["norm"].dtype
    targets, sums = tokens[..., 1:], []
    for c in range(C):
        out = torch.bmm(h, p[f"head.{c:02d}"]).to(dtype)
        ce = F.cross_entropy(
            out.reshape(-1, out.shape[-1]),
            targets[:, :, c].clamp(min=-1).reshape(-1),
            ignore_index=-1,
            reduction="none",
        )
        sums.append(ce.view(R, -1).sum(1))
    return torch.stack(sums, dim=1)
