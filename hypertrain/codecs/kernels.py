"""Codecs for pseudo-gradients: each row of a float32 [R, n] matrix is encoded on its own into a uint8 [R, b]
payload whose size depends only on the blocks (runs of `block` values that never cross a tensor's boundary),
and decoded back. Pure tensor functions: deterministic, vectorised over rows and blocks, on any device.
What each codec is and sends is its entry of `hypertrain.codec_table`, which picks its kernels here.

Every payload is block-major: block after block, each block's bytes are its header (fp32 scale, or fp32
minimum then fp32 scale; top-k's: `encode_topk`) then its body, with fp32/int32 fields as native-endian raw
bytes. So the payload of a vector cut along block boundaries is the concatenation of its pieces' payloads
(but top-k's two_bit values, whose statistics are per tensor).

A transform (`transform="dct"`) is applied around any codec: each block is replaced by its orthonormal
DCT-II coefficients before encoding and decoded values are inverted blockwise (DCT-III), bytes unchanged.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from hypertrain.codec_table import BLOCK_CODECS, Codec, codec_entry
from hypertrain.config import topk_kept  # one rule for k, which the config's checks need too
from hypertrain.import_path import is_import_path

CODECS = BLOCK_CODECS  # the table's block codecs (`codec_table`), in its order
TRANSFORMS = ("none", "dct")
TOPK_VALUES = ("fp32", "fp16", "int8", "two_bit")  # how top-k's kept values travel (TopK.values)
TOPK_INDEX_BITS = (32, 12)  # int32 indices in the vector, or 12-bit indices within the block
TWO_BIT_SIGMAS = 6.0  # two_bit's 4 bins span 6 standard deviations: templar's quantization_range=6
TWO_BIT_HEADER = 20  # two_bit's per-tensor header: fp32 shift, then the four fp32 reconstruction values
# This module as the kernels the table's entries pick from (`Codec.encode(kernels, ...)`): the table, a
# layer below, imports nothing of hypertrain.
KERNELS = sys.modules[__name__]


@dataclass(frozen=True)
class Blocks:
    """A flat vector made of tensors of `sizes` elements, concatenated, each cut into blocks of its
    `chunks` value (None: `block` for every tensor) that never cross a tensor's boundary (a tensor's last
    block may be shorter); `block` is the longest a block may be (`tiles.blocks_and_order` makes it the
    longest there is: the width every block is padded to while encoding)."""

    sizes: tuple[int, ...]
    block: int
    chunks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Kept as a tuple of Python ints (a list or numpy ints given), so that Blocks hashes and compares.
        object.__setattr__(self, "block", _whole("block", self.block, 1))
        object.__setattr__(self, "sizes", tuple(_whole("sizes", s, 0) for s in self.sizes))
        if self.chunks is not None:
            chunks = tuple(_whole("chunks", c, 1) for c in self.chunks)
            if len(chunks) != len(self.sizes) or max(chunks, default=1) > self.block:
                raise ValueError(
                    f"chunks={self.chunks!r} is not valid; valid: one per tensor ({len(self.sizes)}), "
                    f"each 1..block ({self.block})"
                )
            object.__setattr__(self, "chunks", chunks)

    @property
    def numel(self) -> int:
        """Elements of the whole vector."""
        return sum(self.sizes)

    @property
    def count(self) -> int:
        """Number of blocks."""
        return sum(-(-s // c) for s, c in zip(self.sizes, self.cuts, strict=True))

    @property
    def cuts(self) -> tuple[int, ...]:
        """Each tensor's block length (a whole block; its last may be shorter)."""
        return (self.block,) * len(self.sizes) if self.chunks is None else self.chunks

    def shards(self, n: int) -> list[tuple[int, int, Blocks]]:
        """The vector cut into n contiguous shards along block boundaries (blocks dealt as evenly as
        possible, the first shards taking one more when they do not divide; a shard may be empty when
        there are fewer blocks than n): (start, stop, the shard's own Blocks) each.

        A shard's sizes are the pieces of tensors it covers; each piece starts on one of its tensor's
        block boundaries, so the shard's own blocks are exactly the whole's blocks it holds.
        """
        n = _whole("n", n, 1)
        each, extra = divmod(self.count, n)
        bounds = [i * each + min(i, extra) for i in range(n + 1)]
        return [self._cut(bounds[i], bounds[i + 1]) for i in range(n)]

    def _cut(self, first: int, stop: int) -> tuple[int, int, Blocks]:
        """Blocks [first, stop) as (element start, element stop, their own Blocks)."""
        sizes, chunks, start, end = [], [], None, None
        block_offset = element_offset = 0
        for size, cut in zip(self.sizes, self.cuts, strict=True):
            blocks_here = -(-size // cut)
            lo, hi = max(first, block_offset), min(stop, block_offset + blocks_here)
            if lo < hi:
                piece_start = element_offset + (lo - block_offset) * cut
                piece_stop = element_offset + min((hi - block_offset) * cut, size)
                start = piece_start if start is None else start
                end = piece_stop
                sizes.append(piece_stop - piece_start)
                chunks.append(cut)
            elif start is None and block_offset + blocks_here > first:
                start = end = element_offset + (first - block_offset) * cut  # empty, inside
            block_offset += blocks_here
            element_offset += size
        if start is None:  # an empty shard after the last block
            start = end = element_offset
        return start, end, Blocks(tuple(sizes), self.block, None if self.chunks is None else tuple(chunks))


@dataclass(frozen=True)
class TopK:
    """Top-k's settings, given where a fraction goes (a bare fraction means TopK(fraction): today's fp32
    values and int32 indices): the fraction of each block kept, the index width (32: int32 index in the
    vector; 12: the index within its block, two per three bytes, blocks of at most 4096), how the
    kept values travel (fp32, fp16, int8 with one fp32 scale per block, two_bit: templar's per tensor),
    and `chunk`: 0 (each block keeps its fraction) or a whole tile's values (outer.codec.tile's T * T: each
    block keeps what a whole tile does, templar's count; `kept`)."""

    fraction: float
    index_bits: int = 32
    values: str = "fp32"
    chunk: int = 0


def kept(spec: TopK, length: int) -> int:
    """k_b, the entries top-k keeps of a block of `length` values. chunk 0: topk_kept(fraction, length).
    chunk > 0: K = topk_kept(fraction, chunk) of every block (templar's `topk_compression`, a count per
    chunk, not a share: src/tplr/compress.py `TopKCompressor.compress`), or of a block shorter than K
    all its values, one less when that is odd (templar's `_clamp_topk` makes k even for its 12-bit
    pairs); a block of one value keeps it (templar's asks for 2 of 1). k_b grows with the length."""
    if not spec.chunk:
        return topk_kept(spec.fraction, length)
    whole = topk_kept(spec.fraction, spec.chunk)
    return whole if length >= whole else max(1, length - length % 2)


def payload_size(codec: str, blocks: Blocks, fraction: float = 1.0) -> int:
    """Bytes of one replica's payload (codes, scales, minimums, indices: everything sent).

    With L_b the length of block b and C = blocks.count: int8, fp8_*: n + 4C; uint8: n + 8C;
    fp4_e2m1, e3m0: sum_b ceil(L_b / 2) + 4C (codes packed per block); topk, with k_b =
    `kept`(fraction, L_b): sum_b (V(k_b) + I(k_b)), values V(k) = 4k (fp32), 2k (fp16), 4 + k (int8: the
    block's scale), ceil(k / 4) (two_bit, plus 20 bytes per non-empty tensor: its header); indices
    I(k) = 4k (32 bits), ceil(3k / 2) (12). A transform changes no byte count.
    """
    entry, fraction = _check(codec, blocks, fraction)
    return sum(int(length.sum()) for _, length in _fields(entry, blocks, fraction))


def encode(codec: str, x: Tensor, blocks: Blocks, fraction: float = 1.0, transform: str = "none") -> Tensor:
    """x float32 [R, n] (n = blocks.numel) -> uint8 [R, payload_size]: each row encoded on its own.

    Per block (scale = amax / M, amax the block's largest magnitude; a zero scale divides as 1, so an
    all-zero block encodes to zero bytes):
    - int8: M = 127, codes round-half-even(x / scale) clamped to [-127, 127], as int8 bytes;
    - uint8: fp32 minimum and scale = (max - min) / 255, codes round-half-even((x - min) / scale);
    - fp8_e4m3 / fp8_e5m2: M = 448 / 57344, codes (x / scale) clamped to [-M, M] and cast (nearest even);
    - fp4_e2m1: M = 6, codes sign << 3 | index of the magnitude in (0, .5, 1, 1.5, 2, 3, 4, 6), nearest,
      ties to the even index; two per byte, element 2i of the block in the low nibble, 2i + 1 in the high
      one (an odd block's last high nibble is 0);
    - e3m0: M = 1 (scale = amax), codes sign << 3 | e, the magnitude's nearest of 0 (e = 0) and 2^(e - 7)
      (e = 1..7: 1/64 .. 1) in the linear domain, ties to the even e (so |x| / scale <= 2^-7 is 0, and 3/4 of
      a power of two goes to the even of its two neighbours); packed as fp4_e2m1. Sign bit kept for zeros;
    - topk: the `kept`(fraction, L_b) largest magnitudes of each block, in order of magnitude
      (descending, ties by ascending index): their values, then their indices (`fraction` a TopK: see
      `encode_topk`; a bare fraction: fp32 values, then int32 indices in the vector).

    transform="dct" encodes each block's orthonormal DCT-II coefficients in its place (`_dct`).
    """
    entry, fraction = _check(codec, blocks, fraction, transform)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != blocks.numel:
        raise ValueError(
            f"x {x.dtype} {tuple(x.shape)} is not valid; valid: float32 [R, {blocks.numel}] (R rows, numel)"
        )
    if blocks.count == 0:
        return torch.zeros(x.shape[0], 0, dtype=torch.uint8, device=x.device)
    if transform == "dct":
        x = _dct(x, blocks, inverse=False)
    fields = entry.encode(KERNELS, spread(x, blocks), blocks, fraction)
    return _pack(fields, entry, blocks, fraction)


def decode(
    codec: str, payload: Tensor, blocks: Blocks, fraction: float = 1.0, transform: str = "none"
) -> Tensor:
    """uint8 [R, payload_size] -> float32 [R, n]: the dequantized values (top-k: zeros but the kept).

    int8, fp8_*, fp4_e2m1, e3m0: code value * scale; uint8: minimum + code * scale (two fp32 roundings, so a
    block's minimum and a constant block come back exactly). transform="dct": those values are each block's
    DCT-II coefficients, and their inverse (DCT-III) is returned.
    """
    decoded = _decode(codec, payload, blocks, fraction, transform)
    return decoded if transform == "none" else _dct(decoded, blocks, inverse=True)


def _decode(codec: str, payload: Tensor, blocks: Blocks, fraction: float, transform: str) -> Tensor:
    entry, fraction = _check(codec, blocks, fraction, transform)
    size = payload_size(codec, blocks, fraction)
    if payload.dtype != torch.uint8 or payload.dim() != 2 or payload.shape[1] != size:
        raise ValueError(
            f"payload {payload.dtype} {tuple(payload.shape)} is not valid; valid: uint8 [R, {size}]"
        )
    if blocks.count == 0:
        return torch.zeros(payload.shape[0], blocks.numel, dtype=torch.float32, device=payload.device)
    return entry.decode(KERNELS, payload, blocks, fraction)


# --- the quantizers and top-k, on the padded block layout [R, C, block]: the kernels of the table's
# entries (`codec_table`), which pick them -----------------------------------------------------------


def _amax(values: Tensor) -> Tensor:
    """[R, C, B] -> [R, C, 1] the largest magnitude per block, +0.0 for an all-zero block."""
    amax = torch.maximum(values.amax(-1, keepdim=True), values.amin(-1, keepdim=True).neg())
    return torch.where(amax > 0, amax, 0.0)  # +0.0, never -0.0, so a zero block's header is zero bytes


def _divisor(scale: Tensor) -> Tensor:
    """A zero scale divides as 1: an all-zero block's values stay zeros, never NaN."""
    return torch.where(scale > 0, scale, 1.0)


def _bytes(t: Tensor) -> Tensor:
    """[R, C, k] fp32 or int32 -> [R, C, 4k] uint8, the raw bytes."""
    return t.contiguous().view(torch.uint8)


def dtype(name: str) -> torch.dtype:
    """The torch dtype of that name (an entry's codes: int8, float8_e4m3fn, ...)."""
    return getattr(torch, name)


def raw_floats(t: Tensor) -> Tensor:
    """[..., 4k] uint8 -> [..., k] fp32, the raw bytes read back (a fresh copy: a slice's strides, even
    of a size-1 dim, may not divide by 4; `.contiguous()` keeps such a slice as it is)."""
    return t.clone(memory_format=torch.contiguous_format).view(torch.float32)


def encode_int8(values: Tensor) -> list[Tensor]:
    scale = _amax(values) / 127
    codes = (values / _divisor(scale)).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    return [_bytes(scale), codes]


def encode_uint8(values: Tensor) -> list[Tensor]:
    minimum, maximum = values.amin(-1, keepdim=True), values.amax(-1, keepdim=True)
    scale = (maximum - minimum) / 255
    codes = (values - minimum).div_(_divisor(scale)).round_().clamp_(0, 255).to(torch.uint8)
    return [_bytes(torch.cat([minimum, scale], dim=-1)), codes]


def encode_fp8(values: Tensor, dtype: torch.dtype, largest: float) -> list[Tensor]:
    scale = _amax(values) / largest
    # The clamp only matters when a subnormal amax makes the scale inexact enough to overshoot largest.
    codes = (values / _divisor(scale)).clamp_(-largest, largest).to(dtype).view(torch.uint8)
    return [_bytes(scale), codes]


def encode_nibbles(
    values: Tensor, blocks: Blocks, magnitudes: tuple[float, ...], midpoints: tuple[tuple[float, bool], ...]
) -> list[Tensor]:
    """A 4-bit format of 8 `magnitudes` (ascending, the last the largest) and a sign: scale = amax / largest,
    codes sign << 3 | the nearest magnitude's index (`midpoints`: each with whether its tie goes up), two per
    byte."""
    scale = _amax(values) / magnitudes[-1]
    magnitude = (values / _divisor(scale)).abs_()
    # The index is the number of midpoints below the magnitude, a tie counted when it goes up (so above the
    # largest, reachable only through an inexact subnormal scale, saturates). Comparisons, not
    # torch.bucketize: a few vectorised passes into one reused bool buffer are several times faster on CPU.
    hit = torch.empty_like(magnitude, dtype=torch.bool)
    codes = torch.zeros_like(magnitude, dtype=torch.uint8)
    for midpoint, tie_up in midpoints:
        (torch.ge if tie_up else torch.gt)(magnitude, midpoint, out=hit)
        codes += hit.view(torch.uint8)
    torch.signbit(values, out=hit)  # x / scale has x's sign bit
    codes.add_(hit.view(torch.uint8), alpha=8)
    layout = _layout(blocks, values.device)
    if layout.pad_slots is not None:
        codes.flatten(1).index_fill_(1, layout.pad_slots, 0)
    if blocks.block % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return [_bytes(scale), packed]


@functools.lru_cache(maxsize=8)
def _nibble_pairs(magnitudes: tuple[float, ...], device: torch.device) -> Tensor:
    """[256, 2] fp32: a packed byte's two values at scale 1, the low nibble's first."""
    signed = magnitudes + tuple(-m for m in magnitudes)
    return torch.tensor([[signed[byte & 15], signed[byte >> 4]] for byte in range(256)], device=device)


def decode_nibbles(packed: Tensor, block: int, magnitudes: tuple[float, ...]) -> Tensor:
    """[R, C, ceil(B / 2)] packed codes -> [R, C, B] their values at scale 1 (one table row per byte)."""
    pairs = torch.nn.functional.embedding(packed.int(), _nibble_pairs(magnitudes, packed.device))
    return pairs.flatten(-2)[..., :block]  # [R, C, B / 2, 2] flattened


def encode_topk(values: Tensor, blocks: Blocks, spec: TopK) -> list[Tensor]:
    """Per block, the k_b largest magnitudes (descending, ties by ascending index), then:

    - values: fp32; fp16 (round to nearest even, saturating at +-65504); int8 (an fp32 scale = the kept
      values' amax / 127, then round-half-even(v / scale) in [-127, 127]); two_bit (`_two_bit`: per tensor a
      20-byte header before its first block's codes, then 2-bit codes, four a byte, value 4i + j in bits
      2j, 2j + 1 of byte i);
    - indices: int32 in the vector (32), or 12-bit within the block (12): indices 2i and 2i + 1 as three
      bytes a & 255, a >> 8 | (b & 15) << 4, b >> 4 (an odd k's last index in two bytes, b = 0).
    """
    rows, count, block = values.shape
    layout = _layout(blocks, values.device)
    # One int64 key per entry, unique within its block: magnitude's bits (monotonic for magnitudes >= 0),
    # then block - 1 - position, so the largest keys are the largest magnitudes, ties to the lower index.
    # torch.topk leaves the order of equal keys undefined; unique keys leave it nothing to decide.
    keys = values.abs().view(torch.int32).to(torch.int64).bitwise_left_shift_(32)
    keys += torch.arange(block - 1, -1, -1, device=values.device)
    if layout.pad_slots is not None:
        keys.flatten(1).index_fill_(1, layout.pad_slots, -1)  # below every real key: never kept
    position = keys.topk(kept(spec, block), dim=-1, sorted=True).indices
    chosen = values.gather(-1, position)
    # a shorter block keeps fewer: its slots from k_b on hold padding, left out of every statistic
    real = _topk_real(blocks, spec, values.device)  # [C, kmax]
    if spec.values == "fp32":
        fields = [_bytes(chosen)]
    elif spec.values == "fp16":
        fields = [_bytes(chosen.clamp(-65504.0, 65504.0).to(torch.float16))]
    elif spec.values == "int8":
        scale = _amax(torch.where(real, chosen, 0.0)) / 127
        codes = (chosen / _divisor(scale)).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        fields = [_bytes(scale), codes]
    else:
        header, codes = _two_bit(chosen, real, blocks)
        codes = torch.nn.functional.pad(codes, (0, -codes.shape[-1] % 4))
        packed = codes[..., 0::4] | codes[..., 1::4] << 2 | codes[..., 2::4] << 4 | codes[..., 3::4] << 6
        fields = [header, packed]
    if spec.index_bits == 32:
        return [*fields, _bytes((position + layout.starts.view(1, count, 1)).to(torch.int32))]
    index = torch.nn.functional.pad(position, (0, position.shape[-1] % 2))
    a, b = index[..., 0::2], index[..., 1::2]
    triples = torch.stack([a & 255, (a >> 8) | ((b & 15) << 4), b >> 4], dim=-1)
    return [*fields, triples.flatten(-2).to(torch.uint8)]


def _two_bit(chosen: Tensor, real: Tensor, blocks: Blocks) -> tuple[Tensor, Tensor]:
    """templar's `_quantize_values` with 4 bins, per tensor over its kept values v (n of them): shift =
    mean(v), c = v - shift, scale = 6 std / 4 (std = ||c|| / sqrt(n - 1), 0 for n = 1; a zero scale is 1),
    code = round-half-even(c / scale + 2) in [0, 3], reconstruction value r_q = the mean of the c coded q
    (0 for an empty bin: such a code decodes to the shift). Computed in float64, sent as fp32: the header
    (shift, r_0..r_3) [R, C, 20] (meaningful at each tensor's first block) and the codes [R, C, kmax]."""
    rows, count, width = chosen.shape
    header = chosen.new_zeros(rows, count, 5)
    codes = torch.zeros(rows, count, width, dtype=torch.uint8, device=chosen.device)
    first = 0
    for blocks_here in _tensor_blocks(blocks):
        part = slice(first, first + blocks_here)
        mask = real[part]  # [b, kmax]
        v = chosen[:, part][:, mask].double()  # [R, n], the tensor's kept values in block order
        shift = v.mean(dim=1, keepdim=True)
        centred = v - shift
        n = v.shape[1]
        std = centred.norm(dim=1, keepdim=True) / math.sqrt(n - 1) if n > 1 else torch.zeros_like(shift)
        scale = TWO_BIT_SIGMAS * std / 4
        scale = torch.where(scale > 0, scale, 1.0)
        code = (centred / scale + 2).round_().clamp_(0, 3).long()
        reconstruction = torch.stack(
            [torch.where(code == q, centred, 0.0).sum(dim=1) for q in range(4)], dim=1
        ) / torch.stack([(code == q).sum(dim=1) for q in range(4)], dim=1).clamp_(min=1)
        header[:, first] = torch.cat([shift, reconstruction], dim=1).float()
        codes[:, part][:, mask] = code.to(torch.uint8)
        first += blocks_here
    return _bytes(header), codes


def decode_topk(entry: Codec, payload: Tensor, blocks: Blocks, spec: TopK) -> Tensor:
    rows, count = payload.shape[0], blocks.count
    fields = unpack(payload, entry, blocks, spec)  # [R, C, width] each, junk past each block's bytes
    width = kept(spec, blocks.block)
    if spec.values == "fp32":
        values = raw_floats(fields[0])
    elif spec.values == "fp16":
        values = fields[0].contiguous().view(torch.float16).float()
    elif spec.values == "int8":
        values = fields[1].contiguous().view(torch.int8).float().mul_(raw_floats(fields[0]))
    else:
        first = _tensor_first_block(blocks, payload.device)  # [C] the first block of each block's tensor
        header = raw_floats(fields[0]).index_select(1, first)  # [R, C, 5]: shift, r_0..r_3
        codes = (fields[1][..., None] >> torch.tensor([0, 2, 4, 6], device=payload.device)) & 3
        codes = codes.flatten(-2)[..., :width].long()
        values = header[..., 1:].gather(-1, codes).add_(header[..., :1])
    index = fields[-1]
    if spec.index_bits == 32:
        index = raw_floats(index).view(torch.int32).long()
    else:
        triples = index.long().view(rows, count, -1, 3)
        a = triples[..., 0] | (triples[..., 1] & 15) << 8
        b = triples[..., 1] >> 4 | triples[..., 2] << 4
        index = torch.stack([a, b], dim=-1).flatten(-2)[..., :width]
        index = index + _layout(blocks, payload.device).starts.view(1, count, 1)
    # slots past a block's k_b hold junk: they write to a spare last element, dropped
    real = _topk_real(blocks, spec, payload.device)
    index = torch.where(real, index, blocks.numel)
    out = torch.zeros(rows, blocks.numel + 1, dtype=torch.float32, device=payload.device)
    out.scatter_(1, index.flatten(1), values.flatten(1))  # real indices are distinct within a row
    return out[:, : blocks.numel]


@functools.lru_cache(maxsize=64)
def _topk_real(blocks: Blocks, spec: TopK, device: torch.device) -> Tensor:
    """[C, kmax] bool: the slots of each block that hold one of its k_b kept values."""
    counts = _kept_counts(blocks, spec)
    slots = torch.arange(kept(spec, blocks.block))
    return (slots[None, :] < counts[:, None]).to(device)


def _kept_counts(blocks: Blocks, spec: TopK) -> Tensor:
    """[C] int64 on CPU: each block's k_b (`kept`), computed once per distinct length."""
    distinct, which = torch.unique(_lengths(blocks), return_inverse=True)
    return torch.tensor([kept(spec, int(n)) for n in distinct], dtype=torch.int64)[which]


def _tensor_blocks(blocks: Blocks) -> list[int]:
    """The number of blocks of each non-empty tensor, in order."""
    return [-(-size // cut) for size, cut in zip(blocks.sizes, blocks.cuts, strict=True) if size]


@functools.lru_cache(maxsize=64)
def _tensor_first_block(blocks: Blocks, device: torch.device) -> Tensor:
    """[C] int64: for each block, the first block of its tensor."""
    firsts, start = [], 0
    for blocks_here in _tensor_blocks(blocks):
        firsts += [start] * blocks_here
        start += blocks_here
    return torch.tensor(firsts, dtype=torch.int64, device=device)


# --- the transform: each block <-> its orthonormal DCT-II coefficients ----------------------------------


@functools.lru_cache(maxsize=16)
def _dct_matrix(length: int, device: torch.device) -> Tensor:
    """[L, L] fp32, the orthonormal DCT-II: row k is s_k cos(pi (2j + 1) k / (2L)) over j, s_0 = sqrt(1/L),
    s_k = sqrt(2/L); its transpose is its inverse (the DCT-III). Made in float64 on the CPU and rounded once,
    so every device multiplies by the same numbers."""
    j = torch.arange(length, dtype=torch.float64)
    matrix = torch.cos(math.pi * (2 * j[None, :] + 1) * j[:, None] / (2 * length))
    matrix[0] *= math.sqrt(1 / length)
    matrix[1:] *= math.sqrt(2 / length)
    return matrix.float().to(device)


@functools.lru_cache(maxsize=64)
def _length_groups(blocks: Blocks) -> tuple[tuple[int, Tensor | None], ...]:
    """(length, the blocks of that length [k] on the CPU) per distinct length; (block, None) when every
    block is full."""
    lengths = _lengths(blocks)
    distinct = sorted(set(lengths.tolist()), reverse=True)
    if distinct == [blocks.block]:
        return ((blocks.block, None),)
    return tuple((length, (lengths == length).nonzero().squeeze(1)) for length in distinct)


def _dct(x: Tensor, blocks: Blocks, inverse: bool) -> Tensor:
    """[R, n] -> [R, n]: each block of x replaced by its DCT-II coefficients y = D x (inverse: by D^T y), D
    the orthonormal matrix of the block's own length (a tensor's shorter last block uses its length's: no
    padding, so the coefficients are as many as the values and decoding is exact up to rounding).

    One matrix product per row and block length: a row's result never depends on how many rows share the
    call, so each process and the simulation compute the same bits (one process holds some replicas)."""
    if blocks.count == 0:
        return x
    values = spread(x, blocks)  # [R, C, block]
    out = torch.empty_like(values)
    for length, which in _length_groups(blocks):
        matrix = _dct_matrix(length, x.device)
        matrix = matrix if inverse else matrix.T  # row vectors: y = x D^T, x = y D
        if which is None:
            for row in range(values.shape[0]):
                torch.matmul(values[row], matrix, out=out[row])
            continue
        which = which.to(x.device)
        for row in range(values.shape[0]):
            out[row, which, :length] = values[row].index_select(0, which)[:, :length] @ matrix
    return unspread(out, blocks)


# --- layouts: the vector <-> padded blocks, and per-block fields <-> the payload ------------------------


@dataclass(frozen=True)
class _Layout:
    """A Blocks on a device: block starts [C], and for ragged blocks the maps between the vector [n] and the
    padded layout [C * block] (None when every block is full: the vector is then a view of the layout)."""

    starts: Tensor  # [C] each block's first element
    spread: Tensor | None  # [C * block] the element in each slot; padding repeats the block's last element
    unspread: Tensor | None  # [n] the slot of each element
    pad_slots: Tensor | None  # the slots that hold padding


@functools.lru_cache(maxsize=64)
def _lengths(blocks: Blocks) -> Tensor:
    """[C] int64 on CPU: each block's length."""
    parts = []
    for size, cut in zip(blocks.sizes, blocks.cuts, strict=True):
        full, rest = divmod(size, cut)
        parts.append(torch.full((full,), cut, dtype=torch.int64))
        if rest:
            parts.append(torch.tensor([rest], dtype=torch.int64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@functools.lru_cache(maxsize=64)
def _layout(blocks: Blocks, device: torch.device) -> _Layout:
    lengths = _lengths(blocks)
    starts = torch.cumsum(lengths, 0) - lengths
    if bool((lengths == blocks.block).all()):
        return _Layout(starts.to(device), None, None, None)
    slot = torch.arange(blocks.block)
    spread = starts[:, None] + torch.minimum(slot[None, :], lengths[:, None] - 1)
    real = (slot[None, :] < lengths[:, None]).flatten()
    return _Layout(
        starts.to(device),
        spread.flatten().to(device),
        real.nonzero().squeeze(1).to(device),
        (~real).nonzero().squeeze(1).to(device),
    )


def spread(x: Tensor, blocks: Blocks) -> Tensor:
    """[R, n] -> [R, C, block] (a view when every block is full)."""
    layout = _layout(blocks, x.device)
    if layout.spread is None:
        return x.reshape(x.shape[0], blocks.count, blocks.block)
    return x.index_select(1, layout.spread).view(x.shape[0], blocks.count, blocks.block)


def unspread(values: Tensor, blocks: Blocks) -> Tensor:
    """[R, C, block] -> [R, n], padding dropped."""
    layout = _layout(blocks, values.device)
    flat = values.flatten(1)
    return flat if layout.unspread is None else flat.index_select(1, layout.unspread)


@functools.lru_cache(maxsize=64)
def _fields(entry: Codec, blocks: Blocks, fraction: float) -> list[tuple[int, Tensor]]:
    """Each block's fields in payload order: (padded width in bytes, [C] bytes each block sends), as
    the entry's wire format lays them out (`Codec.fields`)."""
    return entry.fields(KERNELS, _lengths(blocks), blocks, fraction)


def topk_fields(lengths: Tensor, blocks: Blocks, spec: TopK) -> list[tuple[int, Tensor]]:
    """Top-k's fields: its values (`spec.values`: per block fp32 or fp16 each, an int8 block's fp32 scale
    then a byte each, two_bit's per-tensor header then 2 bits each), then its indices (`spec.index_bits`)."""
    counts, most = _kept_counts(blocks, spec), kept(spec, blocks.block)
    if spec.values == "two_bit":  # a tensor's header before its first block's codes
        first = torch.zeros_like(lengths)
        starts = [0, *itertools.accumulate(_tensor_blocks(blocks))][:-1]
        first[torch.tensor(starts, dtype=torch.int64)] = 1
        values = [(TWO_BIT_HEADER, TWO_BIT_HEADER * first), ((most + 3) // 4, (counts + 3) // 4)]
    elif spec.values == "int8":
        values = [(4, torch.full_like(lengths, 4)), (most, counts)]
    else:
        each = 4 if spec.values == "fp32" else 2
        values = [(each * most, each * counts)]
    if spec.index_bits == 32:
        return [*values, (4 * most, 4 * counts)]
    return [*values, (3 * ((most + 1) // 2), (3 * counts + 1) // 2)]


@dataclass(frozen=True)
class _Packing:
    """Where a codec's padded fields [R, C, total width] sit in the payload. None maps: no padding."""

    keep: Tensor | None  # [payload bytes] the padded slot each payload byte comes from
    place: Tensor | None  # [C * total width] the payload byte each slot reads (padding: an earlier byte)
    field_bytes: list[Tensor]  # per field, the payload bytes that hold it, block after block


@functools.lru_cache(maxsize=64)
def _packing(entry: Codec, blocks: Blocks, fraction: float, device: torch.device) -> _Packing:
    fields = _fields(entry, blocks, fraction)
    total = sum(width for width, _ in fields)
    slot = torch.arange(total)
    real, members, offset = torch.zeros(blocks.count, total, dtype=torch.bool), [], 0
    for width, length in fields:
        member = (slot[None, :] >= offset) & (slot[None, :] < offset + length[:, None])
        real |= member
        members.append(member)
        offset += width
    byte = real.flatten().cumsum(0) - 1  # every block's first slot is real, so padding reads its block
    field_bytes = [byte[member.flatten()].to(device) for member in members]
    if bool(real.all()):
        return _Packing(None, None, field_bytes)
    return _Packing(real.flatten().nonzero().squeeze(1).to(device), byte.to(device), field_bytes)


def _pack(fields: list[Tensor], entry: Codec, blocks: Blocks, fraction: float) -> Tensor:
    """Per-block fields [R, C, width] each -> the payload [R, payload_size]."""
    padded = torch.cat(fields, dim=-1)
    flat = padded.flatten(1)
    packing = _packing(entry, blocks, fraction, padded.device)
    return flat if packing.keep is None else flat.index_select(1, packing.keep)


def unpack(payload: Tensor, entry: Codec, blocks: Blocks, fraction: float) -> list[Tensor]:
    """The payload [R, payload_size] -> per-block fields [R, C, width] each (padding holds junk)."""
    packing = _packing(entry, blocks, fraction, payload.device)
    padded = payload if packing.place is None else payload.index_select(1, packing.place)
    widths = [width for width, _ in _fields(entry, blocks, fraction)]
    return list(padded.reshape(payload.shape[0], blocks.count, sum(widths)).split(widths, dim=-1))


def _whole(name: str, value, least: int) -> int:
    """An integer >= least, or a one-line ValueError."""
    try:
        whole = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        whole = None
    if whole is None or whole < least:
        raise ValueError(f"{name}={value!r} is not valid; valid: an integer >= {least}")
    return whole


def _check(
    codec: str, blocks: Blocks, fraction: float | TopK, transform: str = "none"
) -> tuple[Codec, float | TopK]:
    """Refuse a bad argument in one line; the codec's table entry and what matters of `fraction` (1.0 for
    a codec that keeps no indices; top-k's TopK, a bare fraction given as TopK(fraction))."""
    entry = codec_entry(codec) if str(codec) in CODECS or is_import_path(codec) else None
    if entry is None or not entry.blocks:  # an import path names an entry outside the table (`codec_table`)
        raise ValueError(f"codec={codec!r} is not valid; valid: {', '.join(CODECS)}, or a block codec's path")
    if transform not in TRANSFORMS:
        raise ValueError(f"transform={transform!r} is not valid; valid: {', '.join(TRANSFORMS)}")
    if not isinstance(blocks, Blocks):
        raise ValueError(f"blocks={blocks!r} is not valid; valid: a Blocks")
    if not entry.indexed:
        return entry, 1.0
    spec = fraction if isinstance(fraction, TopK) else TopK(fraction)
    if not 0 < spec.fraction <= 1:
        raise ValueError(f"fraction={spec.fraction!r} is not valid; valid: 0 < fraction <= 1")
    if spec.index_bits not in TOPK_INDEX_BITS:
        raise ValueError(f"index_bits={spec.index_bits!r} is not valid; valid: 32 or 12")
    if spec.values not in TOPK_VALUES:
        raise ValueError(f"values={spec.values!r} is not valid; valid: {', '.join(TOPK_VALUES)}")
    if spec.index_bits == 12 and blocks.block > 4096:
        raise ValueError(f"index_bits=12 with block={blocks.block} is not valid; valid: block <= 4096")
    return entry, TopK(
        float(spec.fraction), spec.index_bits, str(spec.values), _whole("chunk", spec.chunk, 0)
    )
