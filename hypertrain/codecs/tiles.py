"""2-D tiles for the block codecs (`outer.codec.tile`): how a flat pseudo-gradient's values are ordered, cut
into blocks, as SparseLoCo chunks its tensors (Sarfi et al. 2025, arXiv 2508.15706, section 3; its
production code, templar's `src/tplr/compress.py`: `ChunkingTransformer` and `_get_smaller_split`).
With tile T each side of a tensor is cut at its largest divisor <= T (a side of 64 at 64, of 176 at 44):
a matrix (the last two sides of a tensor of more dimensions, each leading index its own matrix) of
h x w chunks is read chunk after chunk, the chunk grid row-major and each chunk's values row-major, one
chunk a block of h * w values; a 1-D tensor is cut in runs of w. `blocks_and_order` gives the Blocks
and the order for any `outer.codec.block` and tile (docs/compression.md, "Tiles").

The order is a permutation inside each tensor, so applying it and its inverse moves values without
arithmetic (bitwise); the blocks never cross a tensor's boundary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hypertrain.codecs.chunks import block_length, chunk_sides
from hypertrain.codecs.kernels import Blocks


def tile_order(shapes: list[tuple[int, ...]], tile: int) -> Tensor | None:
    """The flat vector's indices in tiled order (int64 [n]): position i of the tiled vector holds the
    value at index order[i] of the tensors concatenated in `shapes`' order; None when it is the
    identity (`tile` 0, or no matrix has a chunk narrower than its rows)."""
    parts, offset, any_moved = [], 0, False
    for shape in shapes:
        n = math.prod(shape)
        index = torch.arange(offset, offset + n)
        if tile and len(shape) >= 2 and n:
            (h, w), (rows, cols) = chunk_sides(tuple(shape), tile), shape[-2:]
            grid = index.view(-1, rows // h, h, cols // w, w)
            index = grid.permute(0, 1, 3, 2, 4).reshape(-1)  # matrix, chunk row, chunk column, in-chunk r, c
            any_moved |= w < cols  # chunks as wide as the matrix are runs of whole rows: in order
        parts.append(index)
        offset += n
    return torch.cat(parts) if any_moved else None


def blocks_and_order(shapes: list[tuple[int, ...]], block: int, tile: int) -> tuple[Blocks, Tensor | None]:
    """The Blocks and the order (`tile_order`) of the tensors of `shapes` under outer.codec.block and
    outer.codec.tile: tile 0, each tensor cut in runs of `block`; tile T, each tensor in its chunks (T * T
    values for a matrix whose sides are multiples of T). The Blocks' width is the longest block there is:
    `block` at most, and no longer than the largest tensor (a larger outer.codec.block is that tensor's size,
    each tensor one block: a block never crosses a tensor, so the bytes and values are the same, without
    padding every block to the size written)."""
    sizes = tuple(math.prod(shape) for shape in shapes)
    chunks = tuple(block_length(tuple(shape), block, tile) for shape in shapes)
    width = max(chunks, default=1)
    return Blocks(sizes, width, chunks if tile else None), tile_order(list(shapes), tile)


def to_tiles(x: Tensor, order: Tensor | None) -> Tensor:
    """Rows [R, n] in parameter order -> rows in tiled order."""
    return x if order is None else x[:, order.to(x.device)]


def from_tiles(x: Tensor, order: Tensor | None) -> Tensor:
    """Rows [..., n] in tiled order -> rows in parameter order (the inverse of `to_tiles`)."""
    if order is None:
        return x
    out = torch.empty_like(x)
    out[..., order.to(x.device)] = x
    return out
