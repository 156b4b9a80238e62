"""outer.codec.tile: the order and the chunks of the block codecs (hypertrain/codecs/tiles.py), against
SparseLoCo's production rule (templar's `src/tplr/compress.py`, written independently in
tests/references.py: each side of a tensor cut at its largest divisor <= T, a matrix read chunk after
chunk, a 1-D tensor in runs), by indexing the tensors themselves, not from the permutation the module
builds; and `outer.codec.block` beyond every tensor: each tensor one block. Every check of an order is exact:
a permutation moves values and does no arithmetic.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from references import templar_chunks, templar_k, templar_topk

from hypertrain.codecs.kernels import Blocks, payload_size
from hypertrain.codecs.tiles import blocks_and_order, from_tiles, tile_order, to_tiles

# T = 4: sides that are multiples of 4; a 1-D tensor of a prime 5 (runs of 1); a stack of 3 matrices; a
# matrix of sides 6 and 7 (chunks of 3 x 1); one of 12 x 6 (4 x 3); one narrower than T (2 x 3, whole)
SHAPES = [(8, 12), (5,), (3, 4, 8), (6, 7), (12, 6), (2, 3)]
T = 4


def _tensors(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def test_a_block_of_the_tiled_vector_is_one_of_templars_chunks():
    tensors = _tensors(SHAPES)
    flat = torch.cat([t.reshape(-1) for t in tensors])[None]
    blocks, order = blocks_and_order(SHAPES, T * T, T)
    got = to_tiles(flat, order)[0]
    want = [t.reshape(-1)[torch.from_numpy(c)] for t in tensors for c in templar_chunks(tuple(t.shape), T)]
    assert len(want) == blocks.count
    cut, start = [], 0
    for size, chunk in zip(blocks.sizes, blocks.cuts, strict=True):  # blocks never cross a tensor
        cut += [got[start + a : start + min(a + chunk, size)] for a in range(0, size, chunk)]
        start += size
    assert all(torch.equal(a, b) for a, b in zip(cut, want, strict=True))
    assert blocks.block == max(len(c) for c in want) == T * T  # padded to the longest block there is


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


def test_no_tile_or_chunks_of_whole_rows_is_the_identity():
    assert tile_order(SHAPES, 0) is None
    assert tile_order([(6, 4), (2, 3), (9,)], T) is None  # every chunk spans its rows: runs in order
    assert tile_order([(6, 7)], T) is not None  # 3 x 1 chunks: a column at a time
    x = torch.arange(10.0)[None]
    assert to_tiles(x, None) is x and from_tiles(x, None) is x


def test_a_tiled_top_k_sync_sends_each_chunks_largest_and_keeps_the_buffers_in_parameter_order():
    """The compressed stage with outer.codec.tile (`compressed_mean`, gather, error feedback): each replica's
    contribution is, per chunk of each tensor (templar's: 4 x 4 tiles of the 8 x 12 matrix, runs of 4
    of the 1-D tensor of 20, 3 x 1 chunks of the 6 x 7 matrix), its `templar_k(k, length)` largest
    magnitudes (k = 4 of a whole tile: all 4 of a run, 2 of a 3-value chunk), the rest zero, in the
    tensors' own positions; the buffer keeps what was left, in parameter order; the mean is the replicas'
    contributions averaged. Ties are avoided by distinct magnitudes; the mean of R = 2 fp32 values is one
    fp32 addition and an exact halving, so it is within u |a + b| / 2 of the float64 mean (u = 2^-24)."""
    from hypertrain.config import CodecConfig, OuterConfig, TopKConfig
    from hypertrain.diloco.exchange.communication import compressed_mean
    from hypertrain.distributed.groups import ReplicaGroups

    shapes, R, k = [(8, 12), (20,), (6, 7)], 2, 4
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)
    gen = torch.Generator().manual_seed(2)
    # distinct magnitudes: a permutation of 1..n scaled, random signs
    deltas = torch.stack([torch.randperm(n, generator=gen) + 1.0 for _ in range(R)]) / n
    deltas *= torch.randint(0, 2, (R, n), generator=gen) * 2 - 1
    errors = torch.zeros(R, n)
    outer = OuterConfig(
        compress="topk",
        codec=CodecConfig(block=T * T, tile=T),
        topk=TopKConfig(fraction=k / (T * T)),
        error_feedback=True,
    )
    blocks, order = blocks_and_order(shapes, T * T, T)
    active = torch.tensor([True] * R)
    got = compressed_mean(outer, deltas, errors, active, blocks, ReplicaGroups(R), order=order).wait()

    def reference(row: torch.Tensor) -> torch.Tensor:
        x, out, start = row.double().numpy(), np.zeros(n), 0
        for shape, size in zip(shapes, sizes, strict=True):
            for keep in templar_topk(x[start : start + size], shape, T, k):
                out[start + keep] = x[start + keep]
            start += size
        return torch.from_numpy(out)

    sent = torch.stack([reference(row) for row in deltas])
    assert int((sent[0] != 0).sum()) == 6 * 4 + 20 + 14 * 2  # 6 tiles, 5 runs kept whole, 14 chunks of 3
    assert torch.equal(errors.double(), deltas.double() - sent)  # what was not sent, exactly, in place
    want = sent.mean(0)
    assert float((got.mean.double() - want).abs().max()) <= 2.0**-24 * float(want.abs().max())
    flat = OuterConfig(
        compress="topk",
        codec=CodecConfig(block=T * T),
        topk=TopKConfig(fraction=k / (T * T)),
        error_feedback=True,
    )
    plain_blocks = Blocks(tuple(sizes), T * T)
    plain = compressed_mean(flat, deltas, torch.zeros(R, n), active, plain_blocks, ReplicaGroups(R)).wait()
    assert not torch.equal(plain.mean, got.mean)  # the flat blocks choose other values


def test_templars_count_is_kept_of_every_chunk_shorter_or_not():
    """k = 64 of a 64 x 64 tile (SparseLoCo's 1/64), of a 64 x 44 chunk (the tiny model's FFN side 176)
    too, all 64 of a 1-D tensor of 64 (one chunk), 2 of a chunk of 3, 1 of a chunk of 1: the payload is
    templar's count of kept values whatever the chunk's length (`templar_k`), in fewer bytes than the
    share of each chunk would keep for the 1-D tensor and more for the 64 x 44 chunks."""
    from hypertrain.config import CodecConfig, OuterConfig, TopKConfig
    from hypertrain.diloco.exchange.communication import topk

    shapes = [(64, 64), (64, 176), (64,), (3,), (1,)]
    codec = CodecConfig(block=4096, tile=64)
    outer = OuterConfig(compress="topk", codec=codec, topk=TopKConfig(fraction=1 / 64, index_bits=12))
    blocks, _ = blocks_and_order(shapes, 4096, 64)
    chunks = [len(c) for s in shapes for c in templar_chunks(s, 64)]
    assert list(blocks.cuts) == [4096, 2816, 64, 3, 1] and blocks.count == len(chunks) == 1 + 4 + 1 + 1 + 1
    counts = [templar_k(64, length) for length in chunks]
    assert counts == [64, 64, 64, 64, 64, 64, 2, 1]
    # fp32 values and 12-bit indices: 4 + ceil(3k / 2) bytes a kept value's pair, per block
    assert payload_size("topk", blocks, topk(outer)) == sum(4 * c + math.ceil(3 * c / 2) for c in counts)


def test_a_block_beyond_every_tensor_is_each_tensor_one_block():
    """outer.codec.block larger than the largest tensor is capped at it (issue 48 item 12): the same Blocks,
    so the same bytes and values, as outer.codec.block = the largest tensor's size, each tensor one block
    (int8: n + 4 bytes per tensor), padded to that size, never to the size written (2^62 once raised
    torch's storage overflow, 2,000,000 padded every tensor of a 133k-parameter model to it)."""
    shapes = [(32, 96), (96,), (7, 5), (1,)]
    largest = 32 * 96
    capped = {blocks_and_order(shapes, block, 0)[0] for block in (largest, largest + 1, 2_000_000, 2**62)}
    assert capped == {Blocks((3072, 96, 35, 1), largest)}
    (blocks,) = capped
    assert payload_size("int8", blocks) == 3072 + 96 + 35 + 1 + 4 * 4
