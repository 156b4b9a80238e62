"""One replica's share of one update, cut into weighted microbatches.

`replica_batch(dataset, ids, data, micro_batch)` turns the plan's ids `V_m` for one update into
microbatch tensors: fixed-length windows in `V_m` order, chunks of at most `micro_batch` rows;
variable-length documents by the plan's length-sorted rule, each padded to its own longest row.
Each microbatch carries the plan's channel coefficient (its share of the replica's target
tokens, `world` = 1 in simulation), so the weighted sum of microbatch mean losses is the exact
token mean of the replica batch whatever the split. Both engines use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hypertrain import plan
from hypertrain.config import DataConfig
from hypertrain.data import Dataset, load_batch, pad_batch


@dataclass
class Microbatch:
    tokens: Tensor  # int64 [B, T+1]
    mask: Tensor | None  # bool [B, T+1] of real positions; None = every position is real
    weight: float  # this microbatch's share of the replica's target tokens
    targets: int  # real target tokens in this microbatch


@dataclass
class ReplicaBatch:
    microbatches: list[Microbatch]
    targets: int  # real target tokens in the replica's whole share of the update

    @property
    def empty(self) -> bool:
        return not self.microbatches


def replica_batch(dataset: Dataset, ids: np.ndarray, data: DataConfig, micro_batch: int) -> ReplicaBatch:
    """The microbatches of one replica for one update (no microbatches when `ids` is empty)."""
    if len(ids) == 0:
        return ReplicaBatch([], 0)
    if dataset.fixed_length:
        groups = plan.fixed_microbatches(len(ids), micro_batch)
        parts = [(load_batch(dataset, ids[g]), None) for g in groups]
        counts = [rows.shape[0] * (rows.shape[1] - 1) for rows, _ in parts]
    else:
        lengths = dataset.lengths(ids)
        groups = plan.length_microbatches(lengths, data.max_padded_tokens, data.max_examples)
        parts = [pad_batch([dataset.get(int(i)) for i in ids[g]]) for g in groups]
        counts = [int(lengths[g].sum()) - len(g) for g in groups]
    total = sum(counts)
    micro = []
    for (tokens, mask), count in zip(parts, counts, strict=True):
        weight = float(plan.channel_coefficients([count], [total], [1.0], world=1)[0])
        micro.append(Microbatch(tokens, mask, weight, count))
    return ReplicaBatch(micro, total)


def stack_microbatches(parts: list[Microbatch | None], device: torch.device) -> tuple[Tensor, Tensor | None, Tensor]:
    """Microbatch j of several replicas as one stacked batch.

    Rows are padded to the longest row and the largest row count across the replicas (a replica
    with fewer rows, or none, gets masked rows). Returns tokens [R, B, T+1], mask [R, B, T+1]
    (None when nothing is padded) and the per-replica weights [R] (0 for a missing part).
    """
    present = [p for p in parts if p is not None]
    rows = max(p.tokens.shape[0] for p in present)
    length = max(p.tokens.shape[1] for p in present)
    padded = any(p is None or p.mask is not None or p.tokens.shape != (rows, length) for p in parts)
    tokens = torch.zeros(len(parts), rows, length, dtype=torch.int64)
    mask = torch.zeros(len(parts), rows, length, dtype=torch.bool) if padded else None
    weights = torch.zeros(len(parts))
    for r, p in enumerate(parts):
        if p is None:
            continue
        b, t = p.tokens.shape
        tokens[r, :b, :t] = p.tokens
        if mask is not None:
            mask[r, :b, :t] = True if p.mask is None else p.mask
        weights[r] = p.weight
    return (
        tokens.to(device),
        None if mask is None else mask.to(device),
        weights.to(device),
    )
