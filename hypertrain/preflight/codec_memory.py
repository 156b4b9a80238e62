"""The bytes a block codec's sync holds (an outer.compress whose entry cuts blocks), estimated from the
config before anything is allocated, for `memory.estimate`: the padded blocks every replica's
pseudo-gradient is spread into, the cached index maps and the DCT's matrices. Counted from one layer's
shapes times the layers, never a loop over a size; tests/test_memory.py holds it against a measured peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hypertrain.choices import Transform
from hypertrain.codec_table import BLOCKWISE, codec_entry
from hypertrain.codecs.chunks import block_length
from hypertrain.config import ModelConfig, OuterConfig, TrainConfig
from hypertrain.model.shapes import param_specs

# Bytes per padded slot of the blocks (C blocks of the longest block's W values, tiles.blocks_and_order),
# read from hypertrain/codecs/kernels.py:
# - once, the cached int64 maps: `_layout`'s slot of each element and padding (16) and `_packing`'s
#   payload byte of each slot and slot of each byte (32, for a quantizer's one byte a value);
INDEX_BYTES = 48
# - per row encoded or decoded at once: the spread values and their quotient (fp32, 8), the codes, the
#   packed fields and their payload, the unpacked bytes (1 each) and the decoded values (fp32, 4);
ROW_BYTES = 16
# - a BLOCKWISE codec's (top-k's) instead: the spread values and their magnitudes (fp32, 8), and the
#   int64 keys it ranks (8), then the kept values' fields (a fraction of a slot);
TOPK_ROW_BYTES = 24
# - the DCT's besides: the transform's spread values and its output (fp32, 8).
DCT_ROW_BYTES = 8
# Per parameter and row (communication.compressed_mean): beside the encoding, x, its tiled copy and the
# decoded values (fp32, 12); after it, those and d in the parameters' order (16), the compression error's
# float64 copies of delta and d and their difference (24), then x - d, the buffers' update and each
# replica's own d (fp32, 12): 52 as if all coexisted, 56 with what the allocator keeps of the freed
# (measured 49 a parameter a row: top-k on tiles with error feedback, R = 16 and 32, issue 48).
BESIDE_PARAM_BYTES = 12
AFTER_PARAM_BYTES = 56
# Each distinct block length L's DCT matrix is cached in fp32 (4 L^2) and built in float64, where two
# L x L temporaries are alive at once (16 L^2, once: the longest).
DCT_CACHED, DCT_BUILD = 4, 16


def codec_shapes(model: ModelConfig) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(the shapes outside the layers, one layer's shapes): the model's tensors are the first and
    n_layers times the second (the layers are alike)."""
    outside = [shape for shape, _ in param_specs(replace(model, n_layers=0)).values()]
    with_one = [shape for shape, _ in param_specs(replace(model, n_layers=1)).values()]
    layer = list(with_one)
    for shape in outside:
        layer.remove(shape)
    return outside, layer


@dataclass(frozen=True)
class CodecLayout:
    """The blocks a block codec cuts the whole model into (tiles.blocks_and_order's), counted."""

    slots: int  # the padded slots: the blocks times the longest block
    params: int  # the values
    longest: int  # the longest block, the width every block is padded to
    lengths: frozenset[int]  # the distinct block lengths (a DCT matrix each)


def codec_layout(outer: OuterConfig, model: ModelConfig) -> CodecLayout:
    """`model`'s tensors cut by outer.codec.block and tile, from the shapes outside the layers and one
    layer's, the latter counted n_layers times."""
    outside, layer = codec_shapes(model)
    blocks = params = longest = 0
    lengths: set[int] = set()
    for shapes, times in ((outside, 1), (layer, model.n_layers)):
        for shape in shapes if times else []:
            size, length = math.prod(shape), block_length(shape, outer.codec.block, outer.codec.tile)
            blocks += times * -(-size // length)
            params += times * size
            longest = max(longest, length)
            lengths |= {length} | ({size % length} if size % length else set())
    return CodecLayout(blocks * longest, params, longest, frozenset(lengths))


def codec_bytes(cfg: TrainConfig, model: ModelConfig) -> int:
    """Bytes a block codec's sync of the whole model holds at its peak (0 for none and lowrank), all R
    rows at once (a gather decodes every replica's payload on every process): the index maps, then the
    larger of the encoding (rows x (slot bytes x slots + BESIDE_PARAM_BYTES x params)) and the
    compression error after it (rows x AFTER_PARAM_BYTES x params), and the DCT's matrices. A
    fragment's sync holds less: the whole model bounds every fragment's."""
    outer = cfg.outer
    codec = codec_entry(outer.compress)
    if not codec.blocks:
        return 0
    layout, rows = codec_layout(outer, model), cfg.replicas
    transformed = Transform(outer.codec.transform) == Transform.dct
    per_slot = (TOPK_ROW_BYTES if codec.scope == BLOCKWISE else ROW_BYTES) + (
        DCT_ROW_BYTES if transformed else 0
    )
    encoding = rows * (per_slot * layout.slots + BESIDE_PARAM_BYTES * layout.params)
    after = rows * AFTER_PARAM_BYTES * layout.params
    matrices = DCT_CACHED * sum(n * n for n in layout.lengths) + DCT_BUILD * layout.longest**2
    return INDEX_BYTES * layout.slots + max(encoding, after) + (matrices if transformed else 0)
