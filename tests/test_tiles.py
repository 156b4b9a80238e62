"""outer.tile: the tiled order of the block codecs (hypertrain/diloco/tiles.py), against the definition.

The reference is written from SparseLoCo's chunking (a T x T tile of a matrix is one block of T * T
values; the tiles of a matrix in row-major order of its tile grid, each tile row-major), by slicing
the matrices themselves in float64, not from the permutation the module builds. Every check is exact:
a permutation moves values and does no arithmetic.
"""

from __future__ import annotations

import math

import torch

from hypertrain.diloco.codecs import Blocks
from hypertrain.diloco.tiles import from_tiles, tile_order, to_tiles

SHAPES = [(8, 12), (5,), (3, 4, 8), (6, 7)]  # tiled (T = 4), 1-D, a stack of 3 tiled matrices, not tiled
T = 4


def _tensors(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _reference_blocks(tensors, tile):
    """The blocks a tiled vector is cut into, from the tensors: each tiled matrix's tiles in grid order
    (T * T values each), every other tensor's values in order, cut in blocks of T * T."""
    blocks = []
    for t in tensors:
        if t.dim() >= 2 and t.shape[-2] % tile == 0 and t.shape[-1] % tile == 0:
            for m in t.reshape(-1, *t.shape[-2:]):
                for i in range(0, m.shape[0], tile):
                    for j in range(0, m.shape[1], tile):
                        blocks.append(m[i : i + tile, j : j + tile].reshape(-1))
        else:
            flat = t.reshape(-1)
            blocks += [flat[k : k + tile * tile] for k in range(0, flat.numel(), tile * tile)]
    return blocks


def test_a_block_of_the_tiled_vector_is_one_tile():
    tensors = _tensors(SHAPES)
    flat = torch.cat([t.reshape(-1) for t in tensors])[None]
    order = tile_order(SHAPES, T)
    got = to_tiles(flat, order)[0]
    blocks = Blocks(tuple(math.prod(s) for s in SHAPES), T * T)
    want = _reference_blocks(tensors, T)
    assert len(want) == blocks.count
    cut, start = [], 0
    for size in blocks.sizes:  # the codecs' blocks: runs of T * T that never cross a tensor
        for k in range(0, size, T * T):
            cut.append(got[start + k : start + min(k + T * T, size)])
        start += size
    assert all(torch.equal(a, b) for a, b in zip(cut, want, strict=True))


def test_the_inverse_restores_every_value_and_a_transposed_tiling_differs():
    tensors = _tensors(SHAPES, seed=1)
    flat = torch.cat([t.reshape(-1) for t in tensors])[None].repeat(2, 1)
    order = tile_order(SHAPES, T)
    assert torch.equal(from_tiles(to_tiles(flat, order), order), flat)
    assert sorted(order.tolist()) == list(range(flat.shape[1]))  # a permutation
    # a broken tiling (tiles in column-major grid order) is not the reference's
    m = tensors[0]
    wrong = torch.cat([m[i : i + T, j : j + T].reshape(-1) for j in range(0, 12, T) for i in range(0, 8, T)])
    assert not torch.equal(to_tiles(flat, order)[0, : m.numel()], wrong)


def test_no_tile_or_no_divisible_side_is_the_identity():
    assert tile_order(SHAPES, 0) is None
    assert tile_order([(6, 7), (9,)], T) is None
    x = torch.arange(10.0)[None]
    assert to_tiles(x, None) is x and from_tiles(x, None) is x
