"""The network clock's formulas: seconds of a collective over a link (alpha-beta), the overlap rule and
modelled compute. Plain arithmetic on floats, each formula with its source (docs/clock.md)."""

from __future__ import annotations

from dataclasses import dataclass

from hypertrain.config import LinkConfig


@dataclass(frozen=True)
class Link:
    bandwidth: float  # beta, bytes per second one way, per participant
    latency: float  # alpha, seconds per message

    @classmethod
    def of(cls, link: LinkConfig) -> Link:
        """The config's link (Gbit/s and microseconds) in bytes per second and seconds."""
        return cls(link.bandwidth, link.latency)


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of `nbytes` on each of `n` participants: n-1 reduce-scatter steps and n-1
    all-gather steps, each one message of nbytes/n, `2(n-1)(alpha + nbytes/(n*beta))` (Thakur,
    Rabenseifner & Gropp 2005, "Optimization of collective communication operations in MPICH"); 0 for
    n <= 1."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * (link.latency + nbytes / (n * link.bandwidth))


def all_gather_s(nbytes_each: float, n: int, link: Link) -> float:
    """A ring all-gather of `nbytes_each` from each of `n` participants: n-1 steps of one whole payload,
    `(n-1)(alpha + b/beta)` (Thakur et al. 2005); 0 for n <= 1."""
    if n <= 1:
        return 0.0
    return (n - 1) * (link.latency + nbytes_each / link.bandwidth)


def reduce_scatter_s(nbytes: float, n: int, link: Link) -> float:
    """A ring reduce-scatter of `nbytes` on each of `n` participants, each left with the sum of one nth:
    n-1 steps of one message of nbytes/n, `(n-1)(alpha + nbytes/(n*beta))` (Thakur et al. 2005: the
    first half of the ring all-reduce); 0 for n <= 1."""
    if n <= 1:
        return 0.0
    return (n - 1) * (link.latency + nbytes / (n * link.bandwidth))


def sharded_inner_s(
    root_bytes: float, block_bytes: float, blocks: int, microbatches: int, n: int, link: Link
) -> float:
    """One update's collectives of a replica sharded over `n` ranks by FSDP2, one unit per block, then
    the root (distributed/fsdp_engine.py): per microbatch, each block's weights all-gathered (1/n from
    each rank) for its forward and again for its backward, the root's once (FSDP2 keeps the root
    gathered from its forward to its backward); once per update, each unit's gradient reduce-scattered.
    Each collective is one unit's, so its latency counts per unit; 0 for n <= 1."""
    root, block = all_gather_s(root_bytes / n, n, link), all_gather_s(block_bytes / n, n, link)
    per_microbatch = root + 2 * blocks * block
    once = reduce_scatter_s(root_bytes, n, link) + blocks * reduce_scatter_s(block_bytes, n, link)
    return max(int(microbatches), 1) * per_microbatch + once


def all_to_all_s(nbytes_each: float, n: int, link: Link) -> float:
    """An all-to-all of one payload of `nbytes_each` cut into n shards: n-1 steps of one shard,
    `(n-1)(alpha + b/(n*beta))` (pairwise exchange, Thakur et al. 2005); 0 for n <= 1."""
    if n <= 1:
        return 0.0
    return (n - 1) * (link.latency + nbytes_each / (n * link.bandwidth))


def two_phase_s(nbytes_each: float, n: int, link: Link) -> float:
    """The compressed two-phase exchange (docs/compression.md): an all-to-all of the payload's n shards,
    then an all-gather of the n re-encoded shard means, `2(n-1)(alpha + b/(n*beta))`; 0 for n <= 1."""
    return 2 * all_to_all_s(nbytes_each, n, link)


def exposed_s(comm_s: float, hidden_by_s: float) -> float:
    """The seconds of a communication started `hidden_by_s` seconds of compute before it is needed that
    the compute does not hide, `max(0, comm - hidden)` (Streaming DiLoCo, Douillard et al. 2025)."""
    return max(0.0, comm_s - hidden_by_s)


def modelled_compute_s(
    active_params: int, tokens: int, peak_flops: float, mfu: float, attention_flops: float = 0.0
) -> float:
    """Seconds of a forward and backward pass over `tokens` tokens: `(6*N*tokens + attention) /
    (peak * mfu)` (6 FLOPs per parameter and token: Kaplan et al. 2020, "Scaling laws for neural
    language models", section 2.1)."""
    return (6 * active_params * tokens + attention_flops) / (peak_flops * mfu)
