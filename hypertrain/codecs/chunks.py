"""The sides of the chunks a tensor is cut into by the block codecs (`outer.codec.block` and `tile`), as
SparseLoCo's production code cuts them (templar's `src/tplr/compress.py`, `_get_smaller_split`): plain
integer arithmetic on shapes, no torch, so the memory estimate reads the same geometry `tiles` applies.
"""

from __future__ import annotations

import math


def largest_divisor(side: int, most: int) -> int:
    """The largest divisor of `side` that is at most `most` (templar's `_get_smaller_split`: `side` itself
    when it is at most `most`, 1 for a prime above it); 1 for an empty side. min(most, sqrt(side)) steps:
    down from `most`, or through the divisor pairs (d, side / d) with d <= sqrt(side)."""
    if side <= most:
        return max(side, 1)
    root = math.isqrt(side)
    if most <= root:
        return next(d for d in range(most, 0, -1) if side % d == 0)
    pairs = ((d, side // d) for d in range(1, root + 1) if side % d == 0)
    return max(c for pair in pairs for c in pair if c <= most)


def chunk_sides(shape: tuple[int, ...], tile: int) -> tuple[int, ...]:
    """The sides of one chunk of a tensor of `shape` under tile T > 0: (h, w) of a matrix (its last two
    sides each cut at their largest divisor <= T), (w,) of a 1-D tensor, () of a scalar."""
    return tuple(largest_divisor(side, tile) for side in shape[-2:])


def block_length(shape: tuple[int, ...], block: int, tile: int) -> int:
    """The length of a whole block of a tensor of `shape` (its last block may be shorter): its chunk's
    under tile T > 0, else outer.codec.block; never more than the tensor holds (at least 1)."""
    size = math.prod(shape)
    return math.prod(chunk_sides(tuple(shape), tile)) if tile else max(1, min(block, size))
