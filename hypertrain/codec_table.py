"""The codec table (docs/compression.md): every `outer.compress` value is one entry, registered once in
`TABLE`, declaring what it can do (its scope, two_phase, error feedback, overlap, its wire format) and
holding its encode/decode; `choices.Compressor` and `codecs.kernels.CODECS` are read from it, and the rest
of the code asks an entry (`codec_entry(name)`), never compares a name. An entry may also live outside the
package: `outer.compress=module.NAME` names a `Codec` by its import path (docs/extending.md, "A codec"),
imported once per process; `codec_entry` returns it under that path as its name.

Imports nothing of hypertrain and no torch (but the module an import path names; the config's enum comes
from here, and a refusal made from the config alone stays torch-free): an entry's encode/decode pick
`codecs.kernels`'s kernels and their parameters, the kernels handed to them by that module (`kernels`, a
layer above). Low rank (PowerSGD) is
its own reduction (`diloco.exchange.lowrank`): an entry that declares it (`factored`), with no encode/decode
here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from hypertrain.import_path import entry_at, is_import_path

# What an entry's payload is made of, and so what may go around it:
IDENTITY = "identity"  # none: the fp32 values, summed by an all-reduce (exact)
ELEMENTWISE = "elementwise"  # each value coded on its own against its block's scale (a quantizer)
BLOCKWISE = "blockwise"  # what a block sends depends on all of its values (top-k: their ranking)
WHOLE_TENSOR = "whole_tensor"  # each tensor as a whole (low rank's factors of a matrix)

# fp4 e2m1: code = sign << 3 | index, index = exponent << 1 | mantissa = the magnitude's place here.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# e3m0 (Streaming DiLoCo's 4-bit format, eXmY with no mantissa): code = sign << 3 | e, e in 0..7; e = 0 is
# zero and e >= 1 is 2^(e - 7), so the magnitudes are 0, 1/64, ..., 1/2, 1 and the block's amax is 1.
E3M0 = (0.0,) + tuple(2.0 ** (e - 7) for e in range(1, 8))


def _midpoints(magnitudes: tuple[float, ...]) -> tuple[tuple[float, bool], ...]:
    """The midpoints between neighbouring magnitudes, each with whether a tie there goes up: round to
    nearest in the linear domain, ties to the even index (up where the lower neighbour's index is odd)."""
    pairs = zip(magnitudes[:-1], magnitudes[1:], strict=True)
    return tuple(((a + b) / 2, i % 2 == 1) for i, (a, b) in enumerate(pairs))


@dataclass(frozen=True)
class Codec:
    """A table entry: `name` (its `outer.compress` value) and what it can do.

    - `scope`: IDENTITY, ELEMENTWISE, BLOCKWISE or WHOLE_TENSOR (above);
    - `two_phase`: outer.codec.reduce=two_phase can decode, sum and re-encode a shard of its payloads (else
      `gather_only` says why not);
    - `error_feedback`: what it leaves out can be fed back (none leaves nothing out);
    - `overlap`: it runs under outer.overlap (else not built);
    - wire format: `value_bits` (32: fp32; 8 or 4: a code a value, packed per block; 0: set by other
      fields: top-k's outer.topk.values, low rank's fp32 factors), `header_bytes` per block (fp32 scale,
      or minimum and scale), `indexed` (it sends the indices of what it keeps: outer.topk.index_bits and
      outer.topk.values shape its payload);
    - `sends`: what travels, for a refusal that needs blocks (a WHOLE_TENSOR entry's);
    - `node`: the outer field holding its own typed config (`config.OUTER_NODES`), which exists with it
      alone: None under another codec, and a field of it set there is one that codec lacks;
    - `takes`: the fields of outer.codec (`config.CodecConfig`, the node the codecs share) it reads, from
      what it is: a block codec the blocks' size, order, transform and reduction, a codec that feeds back
      what it leaves out the buffers' decay; under it the others stay at their defaults.
    """

    name: str
    scope: str
    two_phase: bool = False
    gather_only: str = ""
    error_feedback: bool = True
    overlap: bool = True
    value_bits: int = 0
    header_bytes: int = 0
    indexed: bool = False
    sends: str = ""
    node: str = ""

    @property
    def lossless(self) -> bool:
        """It sends the values themselves (fp32, summed exactly): no payload, no header, nothing lost."""
        return self.scope == IDENTITY

    @property
    def factored(self) -> bool:
        """It sends factors of each tensor, its own reduction (low rank: `diloco.exchange.lowrank`,
        warm-started
        from the run state's `lowrank_q`), not payloads of blocks."""
        return self.scope == WHOLE_TENSOR

    @property
    def takes(self) -> tuple[str, ...]:
        """The fields of outer.codec this codec reads (`config.CodecConfig`; the class docstring)."""
        return ("block", "tile", "transform", "reduce") * self.blocks + ("error_decay",) * self.error_feedback

    @property
    def blocks(self) -> bool:
        """A block codec (`codecs.kernels`): it cuts the pseudo-gradient in blocks (outer.codec.block, tile
        and transform; the memory estimate's padded blocks)."""
        return self.scope in (ELEMENTWISE, BLOCKWISE)

    def windowed(self, codec) -> bool:
        """Whether sharded replicas encode it on windows of whole blocks around each shard (an
        elementwise quantizer without tiles or a transform, `codec` the outer.codec node: a block's values
        coded against its own scale alone); otherwise every tensor is gathered whole to be encoded."""
        return self.scope == ELEMENTWISE and codec.tile == 0 and codec.transform == "none"

    def fields(self, kernels, lengths, blocks, spec) -> list:
        """Each block's fields in payload order: (padded width in bytes, [C] bytes each block sends), the
        blocks of `lengths` ([C] int64) padded to `blocks.block`: a header of `header_bytes`, then the
        codes, `value_bits` each, packed per block."""

        def packed(n):
            return (n * self.value_bits + 7) // 8

        header = (self.header_bytes, lengths.new_full(lengths.shape, self.header_bytes))
        return [header, (packed(blocks.block), packed(lengths))]

    def encode(self, kernels, values, blocks, spec) -> list:
        """values fp32 [R, C, block] (the padded blocks) -> its fields [R, C, width] each, payload order."""
        raise NotImplementedError(f"outer.compress={self.name} sends no blocks")

    def decode(self, kernels, payload, blocks, spec):
        """uint8 [R, payload bytes] -> fp32 [R, n], the decoded values."""
        raise NotImplementedError(f"outer.compress={self.name} sends no blocks")


@dataclass(frozen=True)
class Quantizer(Codec):
    """An ELEMENTWISE codec: each block an fp32 header (`header_bytes`), then a code a value; decoded
    as the code's value (`values`) times the block's scale."""

    def decode(self, kernels, payload, blocks, spec):
        header, codes = kernels.unpack(payload, self, blocks, spec)
        return kernels.unspread(
            self.values(kernels, codes, blocks.block).mul_(kernels.raw_floats(header)), blocks
        )

    def values(self, kernels, codes, block: int):
        """The codes [R, C, packed bytes] -> their values at scale 1, fp32 [R, C, block]."""
        raise NotImplementedError


@dataclass(frozen=True)
class Int8(Quantizer):
    """int8: scale = amax / 127, codes round half even of x / scale clamped to [-127, 127]."""

    def encode(self, kernels, values, blocks, spec) -> list:
        return kernels.encode_int8(values)

    def values(self, kernels, codes, block: int):
        return codes.view(kernels.dtype("int8")).float()


@dataclass(frozen=True)
class Float8(Quantizer):
    """fp8: scale = amax / `largest`, codes x / scale clamped to [-largest, largest] and cast to the
    torch dtype named `dtype` (nearest even)."""

    dtype: str = ""
    largest: float = 0.0

    def encode(self, kernels, values, blocks, spec) -> list:
        return kernels.encode_fp8(values, kernels.dtype(self.dtype), self.largest)

    def values(self, kernels, codes, block: int):
        return codes.view(kernels.dtype(self.dtype)).float()


@dataclass(frozen=True)
class MinMax(Quantizer):
    """uint8: a block's fp32 minimum and scale (max - min) / 255, codes round half even of (x - min) /
    scale; decoded minimum + code * scale (two fp32 roundings: a block's minimum comes back exactly)."""

    def encode(self, kernels, values, blocks, spec) -> list:
        return kernels.encode_uint8(values)

    def decode(self, kernels, payload, blocks, spec):
        header, codes = kernels.unpack(payload, self, blocks, spec)
        minimum, scale = kernels.raw_floats(header).split(1, dim=-1)
        return kernels.unspread(codes.float().mul_(scale).add_(minimum), blocks)


@dataclass(frozen=True)
class Nibbles(Quantizer):
    """A 4-bit format: a sign and one of 8 `magnitudes` (ascending, the last the largest: scale = amax /
    it), the nearest by `midpoints` (each with whether its tie goes up); two codes a byte."""

    magnitudes: tuple[float, ...] = ()
    midpoints: tuple[tuple[float, bool], ...] = ()

    def encode(self, kernels, values, blocks, spec) -> list:
        return kernels.encode_nibbles(values, blocks, self.magnitudes, self.midpoints)

    def values(self, kernels, codes, block: int):
        return kernels.decode_nibbles(codes, block, self.magnitudes)


@dataclass(frozen=True)
class TopK(Codec):
    """Top-k: each block's largest magnitudes, their values (outer.topk.values) and indices
    (outer.topk.index_bits); `spec` is a `codecs.kernels.TopK`."""

    def fields(self, kernels, lengths, blocks, spec) -> list:
        return kernels.topk_fields(lengths, blocks, spec)

    def encode(self, kernels, values, blocks, spec) -> list:
        return kernels.encode_topk(values, blocks, spec)

    def decode(self, kernels, payload, blocks, spec):
        return kernels.decode_topk(self, payload, blocks, spec)


ENTRIES = (
    Codec("none", IDENTITY, error_feedback=False, value_bits=32),
    Int8("int8", ELEMENTWISE, two_phase=True, value_bits=8, header_bytes=4),
    MinMax("uint8", ELEMENTWISE, two_phase=True, value_bits=8, header_bytes=8),
    Float8("fp8_e4m3", ELEMENTWISE, True, value_bits=8, header_bytes=4, dtype="float8_e4m3fn", largest=448.0),
    Float8("fp8_e5m2", ELEMENTWISE, True, value_bits=8, header_bytes=4, dtype="float8_e5m2", largest=57344.0),
    Nibbles(
        "fp4_e2m1",
        ELEMENTWISE,
        two_phase=True,
        value_bits=4,
        header_bytes=4,
        magnitudes=E2M1,
        midpoints=_midpoints(E2M1),
    ),
    Nibbles(
        "e3m0",
        ELEMENTWISE,
        two_phase=True,
        value_bits=4,
        header_bytes=4,
        magnitudes=E3M0,
        midpoints=_midpoints(E3M0),
    ),
    TopK(
        "topk",
        BLOCKWISE,
        gather_only="top-k payloads cannot be summed shard by shard",
        indexed=True,
        node="topk",
    ),
    Codec(
        "lowrank",
        WHOLE_TENSOR,
        gather_only="PowerSGD's factors are all-gathered and summed in replica order",
        overlap=False,
        value_bits=32,
        sends="low rank sends factors of matrices",
        node="lowrank",
    ),
)
TABLE: dict[str, Codec] = {entry.name: entry for entry in ENTRIES}
BLOCK_CODECS = tuple(entry.name for entry in ENTRIES if entry.blocks)


IMPORTED = "the import path (module.NAME) of a hypertrain.codec_table.Codec entry"


class NotACodec(ValueError):
    """outer.compress names no codec (one line; the config's check gives it as a UserError)."""


def codec_entry(name: str) -> Codec:
    """The entry of `outer.compress=name` (a str or a `choices.Compressor`): the table's entry of that
    name, or the entry at the import path `name` (a dot in it; `imported`); NotACodec for neither."""
    entry = TABLE.get(str(name))
    if entry is not None:
        return entry
    if is_import_path(name):
        return imported(str(name))
    raise NotACodec(f"outer.compress={str(name)!r} is not a codec; valid: {', '.join(TABLE)}, or {IMPORTED}")


@functools.cache
def imported(path: str) -> Codec:
    """The `Codec` at the import path `path` (module.NAME), its `name` made `path` (what the config and
    the records say); NotACodec (one line) when the path does not import or names no `Codec`."""
    entry = entry_at("outer.compress", path, Codec, "a codec entry", IMPORTED, NotACodec)
    return dataclasses.replace(entry, name=path)
