"""2-D tiles for the block codecs (`outer.tile`): the order in which a flat pseudo-gradient's values are
cut into blocks. With tile T a matrix whose two sides are multiples of T (the last two sides of a
tensor of more dimensions, each leading index its own matrix) is read tile after tile, the tile grid
in row-major order and each tile's T * T values row-major, so that a block of T * T values is one
T x T tile, as SparseLoCo chunks a weight matrix (64 x 64 tiles of 4096 values; Sarfi et al. 2025,
arXiv 2508.15706, section 3, and templar's chunking). Every other tensor keeps its own order.

The order is a permutation inside each tensor: the tensors' boundaries, the blocks' sizes and so the
payload's size are unchanged, and applying it and its inverse moves values without arithmetic (bitwise).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def tiled(shape: tuple[int, ...], tile: int) -> bool:
    """Whether a tensor of `shape` is read in `tile` x `tile` tiles."""
    return tile > 0 and len(shape) >= 2 and shape[-2] % tile == 0 and shape[-1] % tile == 0


def tile_order(shapes: list[tuple[int, ...]], tile: int) -> Tensor | None:
    """The flat vector's indices in tiled order (int64 [n]): position i of the tiled vector holds the
    value at index order[i] of the tensors concatenated in `shapes`' order; None when no tensor is
    tiled (`tile` 0, or no side divisible), the identity."""
    parts, offset, any_tiled = [], 0, False
    for shape in shapes:
        n = math.prod(shape)
        index = torch.arange(offset, offset + n)
        if tiled(tuple(shape), tile):
            rows, cols = shape[-2], shape[-1]
            grid = index.view(-1, rows // tile, tile, cols // tile, tile)
            index = grid.permute(0, 1, 3, 2, 4).reshape(-1)  # matrix, tile row, tile column, in-tile r, c
            any_tiled = True
        parts.append(index)
        offset += n
    return torch.cat(parts) if any_tiled and parts else None


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
