"""An arrival's payload under a codec (docs/async.md "Codecs"): `payload_bits` is what one arrival puts on
the wire; `Wire` encodes an arriving replica's pseudo-gradient (its error feedback added) to those bytes,
decodes them the same way on every process, and keeps the replica's error. The round's own encodings
(`communication`, `lowrank`), applied to one replica at a time.
"""

from __future__ import annotations

import math

import torch

from hypertrain.codec_table import codec_entry
from hypertrain.codecs import kernels as codecs
from hypertrain.codecs.tiles import blocks_and_order, to_tiles
from hypertrain.diloco.exchange.communication import contribution_payload, fed_back, payload_decoded, topk
from hypertrain.diloco.exchange.lowrank import Factors, from_power_step, power_step
from hypertrain.model.transformer import Params


def payload_bits(outer, shapes: tuple[tuple[int, ...], ...]) -> int:
    """The bits one arrival's payload puts on the wire, a pseudo-gradient of tensors of `shapes`: fp32
    (outer.compress=none) 32 a parameter; lowrank its factors P and Q and its 1-D tensors in fp32
    (`lowrank.Factors.payload_bytes`, a round's replica's payload); a codec its payload's
    (`codecs.payload_size` of `tiles.blocks_and_order`'s blocks; the transform changes no byte), as a
    round's contribution under `gather`, less the round's header bytes (an arrival sends no header)."""
    codec = codec_entry(outer.compress)
    if codec.lossless:
        return codec.value_bits * sum(math.prod(shape) for shape in shapes)
    if codec.factored:
        return 8 * arrival_factors(outer, shapes).payload_bytes
    blocks, _ = blocks_and_order(list(shapes), outer.codec.block, outer.codec.tile)
    return 8 * codecs.payload_size(outer.compress, blocks, topk(outer))


def arrival_factors(outer, shapes: tuple[tuple[int, ...], ...]) -> Factors:
    """outer.compress=lowrank: which of the tensors of `shapes` (the model's, in order) are matrices."""
    return Factors.of({str(i): shape for i, shape in enumerate(shapes)}, outer.lowrank.rank)


class Wire:
    """How arrivals travel under a codec (docs/async.md "Codecs"): the arriving replica's process forms
    x = delta + beta e (`fed_back`, its buffer in `errors`) and `encode`s it to the payload's bytes, uint8
    [payload_bits / 8]; every process `decode`s those bytes to d, the same bits everywhere; the replica's
    process then keeps e <- x - d (`keep_error`). An elementwise codec is a round's contribution's
    encoding (`communication.contribution_payload`, `payload_decoded`: the tiles, the codec, the
    transform); lowrank is one worker's step of PowerSGD's Algorithm 1 from the server's Q
    (`lowrank.power_step`, `from_power_step`; decoding moves Q, on every process)."""

    def __init__(self, outer, theta: Params, errors: list[Params] | None, replicas: list[int], q=None):
        """`theta`: the model's tensors (their names and shapes); `errors`: each local replica's buffer
        (None without error feedback); `replicas`: their global indices; `q`: lowrank's warm starts."""
        self.outer, self.errors, self.q = outer, errors, q
        self.factored = codec_entry(outer.compress).factored
        self.local = {m: i for i, m in enumerate(replicas)}
        shapes = tuple(tuple(t.shape) for t in theta.values())
        self.nbytes = payload_bits(outer, shapes) // 8
        self.numel = sum(t.numel() for t in theta.values())
        if self.factored:
            self.factors = Factors.of({n: tuple(t.shape) for n, t in theta.items()}, outer.lowrank.rank)
        else:
            self.blocks, self.order = blocks_and_order(list(shapes), outer.codec.block, outer.codec.tile)

    def fed_back(self, replica: int, delta: torch.Tensor) -> torch.Tensor:
        """x [1, n]: `delta` plus the replica's buffer decayed by outer.codec.error_decay (delta alone
        without)."""
        return fed_back(delta[None], self._flat(replica), self.outer.codec.error_decay)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, n], finite -> the payload's bytes, uint8 [`nbytes`]."""
        if self.factored:
            return power_step(self.factors, x[0], self.q).view(torch.uint8)
        return contribution_payload(self.outer, to_tiles(x, self.order), self.blocks)[0]

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The payload's bytes -> d [n], fp32, in parameter order (lowrank: each Q moves to its Q')."""
        if self.factored:
            return from_power_step(self.factors, payload.view(torch.float32), self.q)
        return payload_decoded(self.outer, payload[None], self.blocks, self.order)[0]

    def keep_error(self, replica: int, x: torch.Tensor, decoded: torch.Tensor) -> None:
        """With error feedback, the replica's buffer becomes x - d (per parameter, in place)."""
        if self.errors is None:
            return
        flat, start = x[0] - decoded, 0
        for t in self.errors[self.local[replica]].values():
            t.copy_(flat[start : start + t.numel()].view(t.shape))
            start += t.numel()

    def _flat(self, replica: int) -> torch.Tensor | None:
        if self.errors is None:
            return None
        return torch.cat([t.reshape(1, -1).float() for t in self.errors[self.local[replica]].values()], dim=1)
