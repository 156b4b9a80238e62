"""Independent references that several tests share: torch's own AdamW and the schedule's formula."""

from __future__ import annotations

import math

import torch

from hypertrain.config import InnerConfig


def torch_adamw(inner: InnerConfig, params: list[torch.Tensor], matrix_ndim: int = 2) -> torch.optim.AdamW:
    """torch.optim.AdamW with decay on matrices only (tensors of at least `matrix_ndim` dims)."""
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= matrix_ndim], "weight_decay": inner.wd},
            {"params": [p for p in params if p.ndim < matrix_ndim], "weight_decay": 0.0},
        ],
        lr=inner.lr,
        betas=(inner.beta1, inner.beta2),
        eps=inner.eps,
    )


def schedule_lr(inner: InnerConfig, update: int) -> float:
    """Linear warmup, then cosine from lr to lr * min_lr_ratio between warmup_steps and decay_steps."""
    if update < inner.warmup_steps:
        return inner.lr * (update + 1) / inner.warmup_steps
    progress = min(1.0, (update - inner.warmup_steps) / (inner.decay_steps - inner.warmup_steps))
    return inner.lr * (
        inner.min_lr_ratio + (1 - inner.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )
