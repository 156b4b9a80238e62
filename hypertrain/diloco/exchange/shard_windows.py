"""A quantizer codec on dim-0 shards (`processes.shard=true`, docs/distributed.md "Sharded replicas"): each
rank encodes the whole blocks its shard touches, so every block is the unsharded run's block and decodes
to the same values.

`Windows.of(shapes, width, local_rank, L)`: each tensor's shard (FSDP2's cut, `fsdp_engine.shard_of`: rows
in chunks of ceil(rows / L)) widened to its window, the whole blocks of `width` it touches. A tensor whose
shard begins and ends on block boundaries is its own window (nothing gathered); one whose shard ends
inside a block (a 32-value norm at L = 2: 16 + 16 inside one block) is gathered whole in the replica
group (`groups.whole`) and its window cut out, so its straddling block is encoded by both neighbours, the
same values twice. `Windows.gathered_whole` is the gather path of a codec whose blocks shards cannot
cut (top-k's ranking, outer.codec.tile's tiles, the DCT's blocks): every tensor gathered whole, every
rank's window the fragment's whole tensors, encoded as the unsharded run encodes them (its blocks and
tile order), so each of a replica's L ranks sends the whole payload over its own cross-replica group.
`windowed_mean` is `communication.compressed_mean` on the windows: the payload exchanged over the
cross-replica group, this rank's own values kept of the decoded mean and of the error-feedback update,
the compression error's norms taken over the replica's shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hypertrain.codecs import kernels as codecs
from hypertrain.codecs.kernels import Blocks
from hypertrain.codecs.tiles import to_tiles
from hypertrain.config import OuterConfig
from hypertrain.diloco.exchange.communication import (
    CompressedMean,
    contribution_payload,
    fed_back,
    payload_decoded,
    refuse_non_finite,
    topk,
)
from hypertrain.diloco.pending import Reduced


@dataclass(frozen=True)
class Piece:
    """One tensor on one rank, in the whole tensor's flat elements: the shard [start, stop) and its window
    [first, last), the whole blocks of `width` it touches."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    first: int
    last: int

    @property
    def straddles(self) -> bool:
        """The shard begins or ends inside a block: its window needs a neighbour's values."""
        return (self.first, self.last) != (self.start, self.stop)

    def rows(self, flat: Tensor) -> Tensor:
        """This rank's flat values of the tensor in the shard's shape (`groups.whole` cuts along dim 0)."""
        return flat.view(flat.numel() // math.prod(self.shape[1:]), *self.shape[1:])


def _piece(name: str, shape: tuple[int, ...], width: int, j: int, L: int) -> Piece:
    rows, size = shape[0], math.prod(shape)
    per, row = -(-rows // L), size // rows if rows else 0
    start, stop = min(j * per, rows) * row, min((j + 1) * per, rows) * row
    if start == stop:
        return Piece(name, shape, start, stop, start, stop)
    return Piece(name, shape, start, stop, start // width * width, min(-(-stop // width) * width, size))


@dataclass(frozen=True)
class Windows:
    """Rank `local_rank`'s pieces of the tensors of a fragment, in its order, its window Blocks, every
    rank's (rank j's payload bytes count in the replica's) and the tensors gathered whole (those where
    some rank's shard straddles a block: every rank of the replica takes part in their gather)."""

    pieces: tuple[Piece, ...]
    blocks: Blocks
    every: tuple[Blocks, ...]
    gathered: frozenset[str]
    order: Tensor | None = None  # the blocks' tile order over the windows (`tiles.tile_order`; None: theirs)

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]], width: int, local_rank: int, L: int) -> Windows:
        """`shapes`: the whole tensors' shapes in the fragment's order; `width`: the unsharded run's block
        (`tiles.blocks_and_order`'s, of the whole shapes)."""
        ranks = [[_piece(n, tuple(s), width, j, L) for n, s in shapes.items()] for j in range(L)]
        every = tuple(Blocks(tuple(p.last - p.first for p in pieces), width) for pieces in ranks)
        gathered = frozenset(p.name for pieces in ranks for p in pieces if p.straddles)
        return cls(tuple(ranks[local_rank]), every[local_rank], every, gathered)

    @classmethod
    def gathered_whole(
        cls, shapes: dict[str, tuple[int, ...]], blocks: Blocks, order: Tensor | None, local_rank: int, L: int
    ) -> Windows:
        """Every tensor gathered whole: each rank's window the fragment's whole tensors in order, its
        `blocks` and `order` the unsharded run's (`tiles.blocks_and_order` of the whole shapes)."""
        ranks = []
        for j in range(L):
            cut = [_piece(n, tuple(s), max(math.prod(s), 1), j, L) for n, s in shapes.items()]
            ranks.append(tuple(Piece(p.name, p.shape, p.start, p.stop, 0, math.prod(p.shape)) for p in cut))
        return cls(ranks[local_rank], blocks, (blocks,) * L, frozenset(shapes), order)

    def widen(self, x: Tensor, groups) -> Tensor:
        """This rank's flat values [1, n_local] (its shards in order) -> its windows' [1, n_window]: the
        straddling tensors all-gathered whole in the replica group (every rank of it gathers the same)."""
        sizes = [p.stop - p.start for p in self.pieces]
        own = dict(zip((p.name for p in self.pieces), x[0].split(sizes), strict=True))
        gathered = groups.whole({p.name: p.rows(own[p.name]) for p in self.pieces if p.name in self.gathered})
        parts = []
        for p in self.pieces:
            whole = gathered.get(p.name)
            parts.append(own[p.name] if whole is None else whole.reshape(-1)[p.first : p.last])
        return torch.cat(parts)[None]

    def own(self, x: Tensor) -> Tensor:
        """Values over the windows [k, n_window] -> this rank's own [k, n_local]."""
        widths = [p.last - p.first for p in self.pieces]
        windows = x.split(widths, dim=1)
        kept = [w[:, p.start - p.first : p.stop - p.first] for p, w in zip(self.pieces, windows, strict=True)]
        return torch.cat(kept, dim=1)

    def payload_bytes(self, outer: OuterConfig) -> int:
        """The bytes a replica's L ranks' payloads hold together (a straddling block counted twice)."""
        return sum(codecs.payload_size(outer.compress, b, topk(outer)) for b in self.every)


class OwnPart:
    """A windowed reduction: `wait()` gives this rank's own values of the mean over the windows, the
    payload bytes the replica's ranks sent together and what one participant sent for them; `own`: each
    local replica's decoded contribution d_m, its own values [R_local, n_local] (outer.overlap=eager)."""

    def __init__(self, reduction: CompressedMean, windows: Windows, outer: OuterConfig, own: Tensor):
        self.reduction, self.windows, self.outer, self.own = reduction, windows, outer, own

    def is_completed(self) -> bool:
        return self.reduction.is_completed()

    def wait(self) -> Reduced | None:
        done = self.reduction.wait()
        if done is None:
            return None
        b, mine = self.windows.payload_bytes(self.outer), self.reduction.b
        sent = round(done.sent_bytes * b / mine) if mine else 0  # (R - 1) b, or 2 (R - 1) / R b
        mean = self.windows.own(done.mean[None])[0]
        return Reduced(mean, done.synced, sent, b, done.compress_error)


def windowed_mean(
    outer: OuterConfig,
    deltas: Tensor,
    errors: Tensor | None,
    active: Tensor,
    windows: Windows,
    groups,
    update: int | None = None,
    weights: Tensor | None = None,
) -> OwnPart:
    """`communication.compressed_mean` of this rank's shards `deltas` [1, n_local] (its error buffer
    `errors` [1, n_local] updated in place) over `windows`: x = delta + beta e on the windows, d =
    decode(encode(x)) per block as unsharded, e <- x - d on this rank's own values; the compression error
    ||d - delta|| / ||delta|| with both norms over the replica's shards (`groups.norm_over_shards`)."""
    x = fed_back(deltas, errors, outer.codec.error_decay)
    refuse_non_finite(x, active, groups, update)
    wide = to_tiles(windows.widen(x, groups), windows.order)
    blocks, order = windows.blocks, windows.order
    decoded = windows.own(payload_decoded(outer, contribution_payload(outer, wide, blocks), blocks, order))
    norm = groups.norm_over_shards(float(deltas.double().norm()))
    off = groups.norm_over_shards(float((decoded.double() - deltas.double()).norm()))
    error = torch.tensor([off / norm if norm > 0 else off], device=deltas.device)
    if errors is not None:
        errors.copy_(torch.where(active[:, None], x - decoded, errors))
    reduction = CompressedMean(outer, wide, blocks, active, error.float(), groups, order, weights)
    return OwnPart(reduction, windows, outer, torch.where(active[:, None], decoded, 0.0))
