"""A model that lives outside the package: a gated causal-convolution language model (no attention), in
the spirit of Dauphin et al. 2017, "Language Modeling with Gated Convolutional Networks"
(arXiv:1612.08083): each layer is h + W_o (conv_a(x) * sigmoid(conv_b(x))), x = RMSNorm(h), with causal
(left-padded) convolutions of width KERNEL over the time axis. Named on the command line by its import
path (model.arch=gated_conv.MODEL; docs/extending.md, "A model"); its sizes are the model section's
`vocab`, `d_model` and `n_layers`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hypertrain.config import ModelConfig
from hypertrain.model.spec import ModuleModel

KERNEL = 4  # each convolution sees this token and the 3 before it


class GatedBlock(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=eps)
        self.conv = nn.Conv1d(d, 2 * d, KERNEL)  # the value and the gate, one convolution
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, d]
        x = F.pad(self.norm(h).transpose(1, 2), (KERNEL - 1, 0))  # left padding: causal
        a, b = self.conv(x).transpose(1, 2).chunk(2, dim=-1)
        return h + self.out(a * torch.sigmoid(b))


class GatedConvLM(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, vocab: int, d: int, n_layers: int, eps: float):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(GatedBlock(d, eps) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d, eps=eps)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def build(cfg: ModelConfig) -> nn.Module:
    return GatedConvLM(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.norm_eps)


MODEL = ModuleModel(build, layers="layers", head="head")
