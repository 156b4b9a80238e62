"""One replica's share of one update, cut into weighted microbatches.

`replica_batch(dataset, ids, data, micro_batch)` turns the plan's ids `V_m` for one update into
microbatch tensors: fixed-length windows in `V_m` order, chunks of at most `micro_batch` rows;
variable-length documents by the plan's length-sorted rule, each padded to its own longest row.
Each microbatch carries the plan's channel coefficient (its share of the replica's target
tokens, `world` = 1 in simulation), so the weighted sum of microbatch mean losses is the exact
token mean of the replica batch whatever the split. Both engines use it; the stacked engine
stacks the j-th microbatch of several replicas with `stacked_microbatches`.

A multistream dataset (a `datasets.MultistreamDataset`: examples `[C, L]`, a negative id = no
token) gives microbatches `[B, C, L]` padded with -1, each with per-token channel weights
`channel_weights[c] = coef_c / count_c` from `plan.channel_coefficients` (counts of the channel's
targets in the microbatch; the replica's totals), so `sum_c channel_weights[c] * (sum of channel
c's losses)` summed over microbatches (and averaged over a replica's L ranks) is exactly `sum_c k_c
* mean_c / sum_{c with targets} k_c` over the replica batch. A channel without targets in a
microbatch weighs 0 there; without targets in the whole replica batch it leaves the objective and
the normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from hypertrain import plan
from hypertrain.config import DataConfig
from hypertrain.data.datasets import Dataset, MultistreamDataset
from hypertrain.data.text import load_batch, pad_batch


@dataclass
class Microbatch:
    tokens: Tensor  # int64 [B, T+1]; multistream [B, C, T+1], -1 where a channel has no token
    mask: Tensor | None  # bool [B, T+1] of real positions; None = every position is real
    weight: float  # this microbatch's share of the replica's target tokens (multistream: 1)
    targets: int  # real target tokens in this microbatch (multistream: summed over channels)
    channel_weights: Tensor | None = None  # multistream: float64 [C], each channel's per-token weight
    # float64 [C], each channel's targets here (C = 0 for one stream: `model.forward`'s channel sums)
    channel_counts: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))

    @property
    def frames(self) -> int:
        """Positions the model reads (each row's real length - 1): a token each for one stream, a
        frame (all its channels) for multistream."""
        if self.mask is None:
            return self.tokens.shape[0] * (self.tokens.shape[-1] - 1)
        return int((self.mask.sum(1) - 1).clamp(min=0).sum())


@dataclass
class ReplicaBatch:
    """One process's share of a replica's update: the whole replica batch in simulation, one rank's
    share of it under the benchmark layout (where `replica_targets` counts the whole replica's)."""

    microbatches: list[Microbatch]
    targets: int  # real target tokens in these microbatches
    replica_targets: int | None = None  # the replica's targets for the update; None = `targets`

    @property
    def samples(self) -> int:
        """Examples in these microbatches."""
        return sum(mb.tokens.shape[0] for mb in self.microbatches)

    @property
    def padded(self) -> int:
        """Target positions computed, padding included (rows x (width - 1) per microbatch; times the
        channels for multistream, whose every channel has a head: supervised / padded <= 1)."""
        return sum(
            mb.tokens.shape[0]
            * (mb.tokens.shape[-1] - 1)
            * (mb.tokens.shape[1] if mb.tokens.ndim == 3 else 1)
            for mb in self.microbatches
        )

    @property
    def frames(self) -> int:
        """Positions read (frames for multistream, tokens otherwise), padding excluded."""
        return sum(mb.frames for mb in self.microbatches)

    @property
    def replica_total(self) -> int:
        return self.targets if self.replica_targets is None else self.replica_targets

    @property
    def empty(self) -> bool:
        """The replica has no ids in this update and skips the step (a rank of a replica that has
        ids may hold none itself: it still steps, with a zero gradient, in its replica's group)."""
        return self.replica_total == 0


def replica_batch(
    dataset: Dataset,
    ids: np.ndarray,
    data: DataConfig,
    micro_batch: int,
    replica_ids: np.ndarray | None = None,
    world: int = 1,
) -> ReplicaBatch:
    """The microbatches of `ids` for one update (none when `ids` is empty), weighted as the plan says.

    Simulation: `ids` are the replica's `V_m`, `world` 1. Benchmark layout: `ids` are one rank's
    share, `replica_ids` its replica's `V_m` (whose lengths give the totals) and `world` the
    replica's distinct streams (L ranks; L/k in a weak phase at W = kB, where each id lies on k of
    them: `rank_streams`), so the average of the L ranks' losses is the replica batch's
    token mean.
    """
    if is_multistream(dataset):
        return _multistream_batch(dataset, ids, data, replica_ids, world)
    total = None if replica_ids is None else _targets(dataset, replica_ids)
    if len(ids) == 0:
        return ReplicaBatch([], 0, total)
    if dataset.fixed_length:
        groups = plan.fixed_microbatches(len(ids), micro_batch)
        parts = [(load_batch(dataset, ids[g]), None) for g in groups]
        counts = [rows.shape[0] * (rows.shape[1] - 1) for rows, _ in parts]
    else:
        lengths = dataset.lengths(ids)
        groups = plan.length_microbatches(lengths, data.max_padded_tokens, data.max_examples)
        parts = [pad_batch([dataset.get(int(i)) for i in ids[g]]) for g in groups]
        counts = [int(lengths[g].sum()) - len(g) for g in groups]
    share = sum(counts)
    micro = []
    for (tokens, mask), count in zip(parts, counts, strict=True):
        weight = float(plan.channel_coefficients([count], [total or share], [1.0], world=world)[0])
        micro.append(Microbatch(tokens, mask, weight, count))
    return ReplicaBatch(micro, share, total)


def rank_streams(phase: plan.Phase, world: int, ranks_per_replica: int) -> int:
    """The `world` a rank's loss weights use under the benchmark layout: the replica's distinct
    streams. A strong phase's L ranks split the replica's ids, so L. A weak phase at W = kB presents
    each of the replica's ids on k of its L ranks (docs/design.md, "Rank ids"): their shares cover the
    batch k times, so each rank weighs its share as one of L/k = B/R streams. The average of the L
    ranks' losses (and gradients) is then the replica batch's token mean, as in the simulation, not k
    times it."""
    repeats = world // phase.base_world if isinstance(phase, plan.WeakPhase) else 1
    return ranks_per_replica // repeats


def update_batch(
    phase: plan.Phase,
    samples: int,
    dataset: Dataset,
    data: DataConfig,
    micro_batch: int,
    replicas: int,
    update: int,
    replica: int,
    share: tuple[int, int, int] | None = None,
    idle: bool = False,
) -> ReplicaBatch:
    """Replica `replica`'s batch at `update`, from the plan's ids: its whole `V_m` (one process
    simulates it), or with `share` (rank, world, ranks per replica: the benchmark layout) this rank's
    ids weighted over its replica's streams (`rank_streams`). `idle` (churn: the replica trains
    nothing this update) gives no microbatches, its totals kept."""
    ids = plan.replica_ids(phase, update, replica, replicas, samples)
    if idle:
        ids = ids[:0]
    if share is None:
        return replica_batch(dataset, ids, data, micro_batch)
    rank, world, per_replica = share
    mine = plan.rank_ids(phase, update, rank, world, replicas, samples)
    if idle:
        mine = mine[:0]
    return replica_batch(dataset, mine, data, micro_batch, ids, rank_streams(phase, world, per_replica))


def is_multistream(dataset: Dataset) -> bool:
    """Whether the dataset's examples hold several token channels (`[C, L]` arrays)."""
    return isinstance(dataset, MultistreamDataset)


def pad_channels(rows: list[np.ndarray]) -> tuple[Tensor, Tensor]:
    """Examples `[C, L_i]` right-padded with -1 (no token) to the longest: int64 [n, C, L] and the
    bool mask [n, L] of real positions."""
    lengths = np.array([row.shape[1] for row in rows], dtype=np.int64)
    tokens = np.full((len(rows), rows[0].shape[0], int(lengths.max())), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        tokens[i, :, : row.shape[1]] = row
    mask = np.arange(tokens.shape[2]) < lengths[:, None]
    return torch.from_numpy(tokens), torch.from_numpy(mask)


def channel_targets(tokens: Tensor) -> np.ndarray:
    """Targets per channel [C] of multistream rows [B, C, L]: the tokens after each row's first."""
    return (tokens[:, :, 1:] >= 0).sum((0, 2)).numpy().astype(np.int64)


def _multistream_batch(
    dataset: MultistreamDataset, ids: np.ndarray, data: DataConfig, replica_ids, world: int
) -> ReplicaBatch:
    scales = np.asarray(dataset.channel_scales, dtype=np.float64)
    totals = None if replica_ids is None else dataset.channel_counts(replica_ids).sum(0)
    if len(ids) == 0:
        return ReplicaBatch([], 0, None if totals is None else int(totals.sum()))
    groups = plan.length_microbatches(dataset.lengths(ids), data.max_padded_tokens, data.max_examples)
    parts = [pad_channels([dataset.get(int(i)) for i in ids[g]]) for g in groups]
    counts = [channel_targets(tokens) for tokens, _ in parts]
    share = np.sum(counts, axis=0)
    total = share if totals is None else totals
    micro = []
    for (tokens, mask), count in zip(parts, counts, strict=True):
        coef = plan.channel_coefficients(count, total, scales, world=world)
        per_token = np.divide(coef, count, out=np.zeros_like(coef), where=count > 0)
        counted = torch.from_numpy(count.astype(np.float64))
        micro.append(Microbatch(tokens, mask, 1.0, int(count.sum()), torch.from_numpy(per_token), counted))
    return ReplicaBatch(micro, int(share.sum()), None if totals is None else int(total.sum()))


def _targets(dataset: Dataset, ids: np.ndarray) -> int:
    """Real target tokens of examples `ids` (each example of n ids has n - 1), from lengths only."""
    return int(dataset.lengths(ids).sum()) - len(ids)


def targets_of(dataset: Dataset, ids: np.ndarray) -> int:
    """The target tokens a replica's update on `ids` trains on (its `replica_total`; every channel's
    for multistream), without reading the tokens."""
    if len(ids) == 0:
        return 0
    if is_multistream(dataset):
        return int(dataset.channel_counts(ids).sum())
    return _targets(dataset, ids)


def stack_microbatches(
    parts: list[Microbatch | None], device: torch.device
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """Microbatch j of several replicas as one stacked batch.

    Rows are padded to the longest row and the largest row count across the replicas (a replica
    with fewer rows, or none, gets masked rows). Returns tokens [R, B, T+1] (multistream [R, B, C,
    T+1], padded with -1), mask [R, B, T+1] (None when nothing is padded, and always for
    multistream, whose padding holds no tokens), the per-replica weights [R] (0 for a missing part)
    and the multistream channel weights [R, C] (0 for a missing part; None for one channel).
    The parts' channel counts are `stacked_channel_counts`.
    """
    present = [p for p in parts if p is not None]
    rows = max(p.tokens.shape[0] for p in present)
    length = max(p.tokens.shape[-1] for p in present)
    multi = present[0].channel_weights is not None
    channel_weights = None
    if multi:
        C = present[0].tokens.shape[1]
        tokens = torch.full((len(parts), rows, C, length), -1, dtype=torch.int64)
        channel_weights = torch.zeros(len(parts), C, dtype=torch.float64)
        padded = False
    else:
        padded = any(p is None or p.mask is not None or p.tokens.shape != (rows, length) for p in parts)
        tokens = torch.zeros(len(parts), rows, length, dtype=torch.int64)
    mask = torch.zeros(len(parts), rows, length, dtype=torch.bool) if padded else None
    weights = torch.zeros(len(parts))
    for r, p in enumerate(parts):
        if p is None:
            continue
        b, t = p.tokens.shape[0], p.tokens.shape[-1]
        tokens[r, :b, ..., :t] = p.tokens
        if mask is not None:
            mask[r, :b, :t] = True if p.mask is None else p.mask
        weights[r] = p.weight
        if multi:
            channel_weights[r] = p.channel_weights
    return (
        tokens.to(device),
        None if mask is None else mask.to(device),
        weights.to(device),
        None if channel_weights is None else channel_weights.to(device),
    )


def stacked_channel_counts(parts: list[Microbatch | None], device: torch.device) -> Tensor:
    """Each replica's targets per channel in microbatch j, float64 [R, C] (0 if missing; C = 0 for one
    stream)."""
    C = next(p for p in parts if p is not None).channel_counts.numel()
    counts = torch.zeros(len(parts), C, dtype=torch.float64)
    for r, p in enumerate(parts):
        if p is not None:
            counts[r] = p.channel_counts
    return counts.to(device)


def _row_lengths(part: Microbatch) -> Tensor:
    """Real ids in each row of a microbatch, int64 [B]."""
    if part.mask is None:
        return torch.full((part.tokens.shape[0],), part.tokens.shape[1], dtype=torch.int64)
    return part.mask.sum(1)


def _row_slice(part: Microbatch, lengths: Tensor, start: int, stop: int) -> Microbatch | None:
    """Rows [start, stop) of a microbatch, trimmed to their longest row, with their share of its weight."""
    rows = lengths[start:stop]
    if rows.numel() == 0:
        return None
    width = int(rows.max())
    mask = None if part.mask is None else part.mask[start:stop, :width]
    tokens = part.tokens[start:stop, ..., :width]
    if part.channel_weights is not None:  # per-token weights: a piece keeps them as they are
        count = channel_targets(tokens)
        counted = torch.from_numpy(count.astype(np.float64))
        return Microbatch(tokens, mask, part.weight, int(count.sum()), part.channel_weights, counted)
    targets = int((rows - 1).clamp(min=0).sum())
    # The microbatch's weight is its share of the replica's targets; a piece keeps its own share of it.
    weight = part.weight * targets / part.targets if part.targets else 0.0
    return Microbatch(tokens, mask, weight, targets)


def stacked_microbatches(
    batches: list[ReplicaBatch], max_padded_tokens: int = 0
) -> list[list[Microbatch | None]]:
    """The microbatches of several replicas for one update, grouped for stacking (j-th with j-th).

    Group j holds every replica's j-th microbatch (None where a replica has fewer). Stacked, a group
    is padded to its longest row and largest row count across the replicas; with `max_padded_tokens`
    > 0 (variable-length documents) a group whose padded size rows * longest row would exceed it is
    cut into row ranges that fit, each weighted by its share of the microbatch's targets, so every
    replica's slice of a stacked batch stays within the bound the plan gives a microbatch.
    """
    groups: list[list[Microbatch | None]] = []
    for j in range(max((len(b.microbatches) for b in batches), default=0)):
        parts = [b.microbatches[j] if j < len(b.microbatches) else None for b in batches]
        present = [p for p in parts if p is not None]
        rows = max(p.tokens.shape[0] for p in present)
        width = max(p.tokens.shape[-1] for p in present)
        if not max_padded_tokens or rows * width <= max_padded_tokens:
            groups.append(parts)
            continue
        lengths = [None if p is None else _row_lengths(p) for p in parts]
        # Longest row at each row index across the replicas (rows are length-sorted in each part).
        longest = torch.zeros(rows, dtype=torch.int64)
        for row_lengths in lengths:
            if row_lengths is not None:
                longest[: row_lengths.numel()] = torch.maximum(longest[: row_lengths.numel()], row_lengths)
        start, piece_width = 0, 0
        for i, n in enumerate(longest.tolist() + [None]):
            if n is not None and (i == start or (i - start + 1) * max(piece_width, n) <= max_padded_tokens):
                piece_width = max(piece_width, n)
                continue
            groups.append(
                [
                    None if p is None else _row_slice(p, row_lengths, start, i)
                    for p, row_lengths in zip(parts, lengths, strict=True)
                ]
            )
            start, piece_width = i, n or 0
    return groups
