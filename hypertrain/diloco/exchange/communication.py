"""The sync's communication stage: how the replicas' pseudo-gradients become the one the outer step
uses, and what that costs on the wire.

`exact_mean` is today's stage: the sum of every process's replicas' pseudo-gradients over all
processes (`Collectives.start_sum_over_replicas`, asynchronous under real processes), divided by the
replicas that stepped. A stage takes this process's `[n_params + 1]` sum (the count last) and starts
a `Reduction` whose `wait()` gives the mean, or None when no replica stepped.
`inner_bytes` and `ring_allreduce_bytes` are what an ideal ring all-reduce sends (the `comm_*_bytes`
records; a codec's `Reduced` reports its own), `round_bytes` both for a round.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypertrain.codec_table import codec_entry
from hypertrain.codecs import kernels as codecs
from hypertrain.codecs.kernels import Blocks
from hypertrain.codecs.tiles import from_tiles, to_tiles
from hypertrain.config import OuterConfig, TopKConfig, TrainConfig
from hypertrain.diloco.pending import Reduced, Reduction
from hypertrain.distributed.groups import Collectives, InFlight
from hypertrain.failures import NonFiniteError


class ExactMean:
    """The mean pseudo-gradient over every replica that stepped, flat, and their count; None when
    none did. Every process gets the same numbers (one all-reduce of the sums and the count).
    `weighted` (outer.mean_weights=tokens): the sums are already weighted by weights that sum to 1 over
    the replicas that stepped (`server.token_weights`), so their sum is the mean, not divided by the count."""

    def __init__(self, total: InFlight, weighted: bool = False):
        self.total, self.result, self.weighted = total, None, weighted
        self.done = False

    def wait(self) -> Reduced | None:
        if not self.done:
            total = self.total.wait()
            synced = int(total[-1])
            mean = total[:-1] if self.weighted else total[:-1] / total[-1]
            self.result = None if synced == 0 else Reduced(mean, synced)
            self.done = True
        return self.result

    def is_completed(self) -> bool:
        return self.done or self.total.is_completed()


def exact_mean(local_sum: Tensor, groups: Collectives, weighted: bool = False) -> Reduction:
    """Start the sum over all processes of `local_sum` ([n_params + 1], the count last); `weighted`: the
    sums are weighted by weights summing to 1 (`ExactMean`)."""
    return ExactMean(groups.start_sum_over_replicas(local_sum), weighted)


def ring_allreduce_bytes(participants: int, params: int, bytes_per_element: int = 4) -> int:
    """Bytes one participant sends in a ring all-reduce of `params` elements."""
    if participants <= 1:
        return 0
    return int(2 * (participants - 1) / participants * params * bytes_per_element)


def inner_bytes(cfg: TrainConfig, params: int, updates: int) -> int:
    """Bytes one rank sends for `updates` updates' gradient all-reduces among the L = W/R ranks of a
    replica, as an ideal ring would."""
    return ring_allreduce_bytes(cfg.world.size // cfg.replicas, params) * updates


def round_bytes(
    cfg: TrainConfig, params: int, updates: int, synced: int, synced_params: int | None = None
) -> tuple[int, int]:
    """Bytes one participant sends for `updates` updates and the sync after them, as an ideal ring
    all-reduce would.

    Inner: every update, among the L = W/R ranks of a replica. Outer: once, among all R replicas
    whenever some replica stepped (`synced` > 0; one that did not sends zeros), 0 when none did; over
    `synced_params` parameters (a fragment's) or all `params`.
    """
    inner = inner_bytes(cfg, params, updates)
    outer = (
        ring_allreduce_bytes(cfg.replicas, params if synced_params is None else synced_params)
        if synced
        else 0
    )
    return inner, outer


# -- compressed pseudo-gradients (outer.compress) ----------------------------------------------------

HEADER_BYTES = 8  # per replica message: whether it took part and its compression error, two fp32


def contribution_bits(
    compress: str, reduce: str, replicas: int, params: int, payload_bytes: int | None
) -> int:
    """The bits one replica's contribution to a sync of `params` parameters puts on the wire
    (docs/compression.md, "Bits"): fp32 (`compress` none) 32 a parameter; a codec its messages, each
    HEADER_BYTES and its payload (`payload_bytes`, the whole pseudo-gradient's): one message under
    `gather`, one per shard (`replicas` of them) under `two_phase`. 0 with one replica: nothing leaves
    it. The exchange's zero padding and two_phase's way back (the re-encoded mean) are the reduction's,
    not a contribution's: `comm_outer_bytes` counts them."""
    if replicas <= 1:
        return 0
    codec = codec_entry(compress)
    if codec.lossless:
        return codec.value_bits * params
    messages = 1 if reduce == "gather" else replicas
    return 8 * (int(payload_bytes) + messages * HEADER_BYTES)


def _message(payload: Tensor, active: Tensor, errors: Tensor) -> Tensor:
    """uint8 [R_local, HEADER_BYTES + b]: each replica's header, then its payload."""
    header = torch.stack([active.float(), errors.float()], dim=1).contiguous().view(torch.uint8)
    return torch.cat([header, payload], dim=1)


def _header(rows: Tensor) -> tuple[list[bool], list[float]]:
    """The headers of messages [R, ...] in replica order: who took part, and each one's error."""
    header = codecs.raw_floats(rows[:, :HEADER_BYTES]).cpu()
    return [bool(x) for x in header[:, 0].tolist()], header[:, 1].tolist()


def mean_in_replica_order(decoded: Tensor, active: list[bool], weights: Tensor | None = None) -> Tensor:
    """The sum of the rows that took part, added in replica order (the same additions on every
    process and in the simulation), over their count; with `weights` (fp32 [R], outer.mean_weights=
    tokens' `server.token_weights`, summing to 1 over the rows that took part) `sum_m w_m row_m` in
    replica order instead, not divided."""
    total = torch.zeros_like(decoded[0])
    for m, (row, took_part) in enumerate(zip(decoded, active, strict=True)):
        if took_part:
            total = total + (row if weights is None else weights[m] * row)
    return total if weights is not None else total / sum(active)


def _padded(parts: list[Tensor], width: int) -> Tensor:
    """Byte rows [k, b_i] of different widths, zero-padded to `width`: [k, len(parts), width]."""
    out = parts[0].new_zeros(parts[0].shape[0], len(parts), width)
    for i, part in enumerate(parts):
        out[:, i, : part.shape[1]] = part
    return out


class CompressedMean:
    """Compressed pseudo-gradients, reduced by `gather` or `two_phase` (docs/compression.md): every
    process encodes its replicas' contributions x_m; `wait()` gives the mean of the decoded ones of the
    replicas that took part (gather), or that mean per block decoded, re-encoded and decoded again
    (two_phase), the same numbers on every process and in the simulation. With token weights the mean is
    their weighted sum (`mean_in_replica_order`): `sum_m w_m d_m` (gather), that per block re-encoded
    and decoded (two_phase)."""

    def __init__(
        self,
        outer,
        x: Tensor,
        blocks: Blocks,
        active: Tensor,
        errors: Tensor,
        groups,
        order=None,
        weights=None,
    ):
        """`x` in the blocks' order (`tiles.to_tiles` by `order`); the mean comes back in parameter order.
        `weights`: every replica's token weight, fp32 [R] (None: uniform)."""
        self.outer, self.blocks, self.groups, self.order = outer, blocks, groups, order
        self.weights = weights
        self.replicas, self.result, self.done = groups.total_replicas, None, False
        codec, fraction, transform = outer.compress, topk(outer), outer.codec.transform
        if outer.codec.reduce == "gather":
            payload = codecs.encode(codec, x, blocks, fraction, transform)
            self.b = payload.shape[1]
            self.flight = groups.start_all_gather_replicas(_message(payload, active, errors))
            return
        # two_phase: shard j (blocks dealt in order) goes to the replica of index j
        self.shards = blocks.shards(self.replicas)
        parts = [codecs.encode(codec, x[:, a:z], own, fraction, transform) for a, z, own in self.shards]
        self.b = sum(part.shape[1] for part in parts)
        self.width = max(part.shape[1] for part in parts) + HEADER_BYTES
        messages = _padded([_message(part, active, errors) for part in parts], self.width)
        self.flight = groups.start_exchange_shards(messages)

    def is_completed(self) -> bool:
        return self.done or self.flight.is_completed()

    def wait(self) -> Reduced | None:
        if self.done:
            return self.result
        self.done = True
        codec, fraction, R = self.outer.compress, topk(self.outer), self.replicas
        transform = self.outer.codec.transform
        if self.outer.codec.reduce == "gather":
            rows = self.flight.wait()  # [R, header + b] in replica order
            active, errors = _header(rows)
            if not any(active):
                return None
            payloads = rows[:, HEADER_BYTES:].contiguous()
            mean = mean_in_replica_order(
                codecs.decode(codec, payloads, self.blocks, fraction, transform), active, self.weights
            )
            sent = (R - 1) * self.b  # received per participant, (n - 1) * b
        else:
            rows = self.flight.wait()  # [R senders, this process's shards, width]
            active, errors = _header(rows[:, 0])
            if not any(active):
                return None
            means = []
            for i, j in enumerate(self.groups.replicas):  # the shards this process owns
                _, _, own = self.shards[j]
                size = codecs.payload_size(codec, own, fraction)
                received = rows[:, i, HEADER_BYTES : HEADER_BYTES + size].contiguous()
                decoded = codecs.decode(codec, received, own, fraction, transform)
                means.append(
                    codecs.encode(
                        codec,
                        mean_in_replica_order(decoded, active, self.weights)[None],
                        own,
                        fraction,
                        transform,
                    )
                )
            widths = [codecs.payload_size(codec, own, fraction) for _, _, own in self.shards]
            gathered = self.groups.start_all_gather_replicas(_padded(means, max(widths))[0]).wait()
            mean = torch.cat(
                [
                    codecs.decode(
                        codec, gathered[j : j + 1, : widths[j]].contiguous(), own, fraction, transform
                    )[0]
                    for j, (_, _, own) in enumerate(self.shards)
                ]
            )
            sent = int(2 * (R - 1) / R * self.b)  # each payload shard out, each mean shard back
        taken = [e if a else None for a, e in zip(active, errors, strict=True)]
        self.result = Reduced(from_tiles(mean, self.order), sum(active), sent, self.b, taken)
        return self.result


def topk(outer: OuterConfig) -> codecs.TopK:
    """Top-k's settings of `outer` (what the codecs take where a fraction goes; other codecs ignore it):
    with outer.codec.tile T every chunk keeps what a whole T x T tile does (`codecs.kept`, templar's
    count)."""
    chunk, own = outer.codec.tile * outer.codec.tile, outer.topk or TopKConfig()  # None under another codec
    return codecs.TopK(own.fraction, own.index_bits, str(own.values), chunk)


def contribution_payload(outer: OuterConfig, x_tiled: Tensor, blocks: Blocks) -> Tensor:
    """Rows [R, n] in the blocks' order (`tiles.to_tiles`) -> their payloads, uint8 [R, b] (outer's codec
    and transform): what a replica's contribution to a round, or an arrival, encodes to; `payload_decoded`
    gives back d, the value the sender keeps (PCCL's self-quantize rule: d = decode(encode(x)))."""
    return codecs.encode(outer.compress, x_tiled, blocks, topk(outer), outer.codec.transform)


def payload_decoded(outer: OuterConfig, payload: Tensor, blocks: Blocks, order: Tensor | None) -> Tensor:
    """Payloads uint8 [R, b] -> each one decoded, in parameter order (the inverse of `tiles.to_tiles`)."""
    return from_tiles(
        codecs.decode(outer.compress, payload, blocks, topk(outer), outer.codec.transform), order
    )


def fed_back(deltas: Tensor, errors: Tensor | None, decay: float) -> Tensor:
    """What a replica compresses: its pseudo-gradient plus its error buffer decayed by `decay` (beta,
    outer.codec.error_decay; SparseLoCo's u = beta * e + delta), the pseudo-gradient alone without
    feedback."""
    if errors is None:
        return deltas
    if decay == 1.0:
        return deltas + errors  # plain error feedback's expression, bitwise
    return deltas + errors * decay


def refuse_non_finite(x: Tensor, active: Tensor, groups: Collectives, update: int | None) -> None:
    """NonFiniteError on every process (agreed) when a row of `x` that would be sent is not finite,
    naming the replica (the highest-numbered, when several are) and the sync's `update`."""
    finite = torch.isfinite(x).all(dim=1) | ~active
    local_bad = [m for m, ok in zip(groups.replicas, finite.tolist(), strict=True) if not ok]
    bad = groups.max_over_processes(max(local_bad, default=-1) + 1)
    if bad:
        at = "" if update is None else f" at the sync at update {update}"
        raise NonFiniteError(
            f"the pseudo-gradient of replica {bad - 1}{at} is not finite; the run stops before sending it"
        )


def compressed_mean(
    outer: OuterConfig,
    deltas: Tensor,
    errors: Tensor | None,
    active: Tensor,
    blocks: Blocks,
    groups: Collectives,
    update: int | None = None,
    order: Tensor | None = None,
    weights: Tensor | None = None,
) -> CompressedMean:
    """Start a compressed sync of this process's replicas' pseudo-gradients `deltas` [R_local, n]
    (with error feedback, `errors` [R_local, n] is added first and updated in place). Each replica's
    contribution is its own decoded payload (PCCL's self-quantize rule): d_m = decode(encode(x_m)),
    x_m = delta_m + beta * e_m (beta = outer.codec.error_decay; at 1, delta_m + e_m); then e_m <- x_m - d_m
    for the replicas that took part (error feedback), the others keep theirs, undecayed. With
    outer.codec.transform=dct the codec sees each block's DCT coefficients and d_m is their inverse, so e_m
    stays in the parameter domain (as DeMo's momentum residual), and two_phase's shard means are summed
    there and re-transformed. Returns the started `CompressedMean`; raises NonFiniteError (every process,
    agreed) when a pseudo-gradient that would be sent is not finite, before anything is sent, naming the
    replica (the highest-numbered, when several are) and the sync's `update`. `order` (outer.codec.tile):
    the blocks' order, `tiles.tile_order` (None: the parameters' own); the buffers and the mean stay in
    parameter order. `weights` (outer.mean_weights=tokens): every replica's token weight, fp32 [R]: the
    mean is `sum_m w_m d_m`; the buffers stay each replica's own, unweighted (e_m <- x_m - d_m).
    """
    x = fed_back(deltas, errors, outer.codec.error_decay)
    refuse_non_finite(x, active, groups, update)
    x_tiled = to_tiles(x, order)
    decoded = payload_decoded(outer, contribution_payload(outer, x_tiled, blocks), blocks, order)
    norms = deltas.double().norm(dim=1)
    error = (decoded.double() - deltas.double()).norm(dim=1) / torch.where(norms > 0, norms, 1.0)
    if errors is not None:
        errors.copy_(torch.where(active[:, None], x - decoded, errors))
    reduction = CompressedMean(outer, x_tiled, blocks, active, error.float(), groups, order, weights)
    reduction.own = torch.where(active[:, None], decoded, 0.0)  # each replica's d_m (outer.overlap=eager)
    return reduction
