"""The sync's communication stage: how the replicas' pseudo-gradients become the one the outer step
uses, and what that costs on the wire.

`exact_mean` is today's stage: the sum of every process's replicas' pseudo-gradients over all
processes (`Collectives.start_sum_over_replicas`, asynchronous under real processes), divided by the
replicas that stepped. A stage takes this process's `[n_params + 1]` sum (the count last) and starts
a `Reduction` whose `wait()` gives the mean, or None when no replica stepped.
`round_bytes` is what an ideal ring all-reduce sends for a round (the `comm_*_bytes` records).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from hypertrain.config import TrainConfig
from hypertrain.diloco.pending import Reduction
from hypertrain.distributed.groups import Collectives, InFlight

Communicate = Callable[[Tensor, Collectives], Reduction]


class ExactMean:
    """The mean pseudo-gradient over every replica that stepped, flat, and their count; None when
    none did. Every process gets the same numbers (one all-reduce of the sums and the count)."""

    def __init__(self, total: InFlight):
        self.total, self.result = total, None
        self.done = False

    def wait(self) -> tuple[Tensor, int] | None:
        if not self.done:
            total = self.total.wait()
            synced = int(total[-1])
            self.result = None if synced == 0 else (total[:-1] / total[-1], synced)
            self.done = True
        return self.result

    def is_completed(self) -> bool:
        return self.done or self.total.is_completed()


def exact_mean(local_sum: Tensor, groups: Collectives) -> Reduction:
    """Start the sum over all processes of `local_sum` ([n_params + 1], the count last)."""
    return ExactMean(groups.start_sum_over_replicas(local_sum))


def ring_allreduce_bytes(participants: int, params: int, bytes_per_element: int = 4) -> int:
    """Bytes one participant sends in a ring all-reduce of `params` elements."""
    if participants <= 1:
        return 0
    return int(2 * (participants - 1) / participants * params * bytes_per_element)


def round_bytes(
    cfg: TrainConfig, params: int, updates: int, synced: int, synced_params: int | None = None
) -> tuple[int, int]:
    """Bytes one participant sends for `updates` updates and the sync after them, as an ideal ring
    all-reduce would.

    Inner: every update, among the L = W/R ranks of a replica. Outer: once, among all R replicas
    whenever some replica stepped (`synced` > 0; one that did not sends zeros), 0 when none did; over
    `synced_params` parameters (a fragment's) or all `params`.
    """
    inner = ring_allreduce_bytes(cfg.world.size // cfg.replicas, params) * updates
    outer = (
        ring_allreduce_bytes(cfg.replicas, params if synced_params is None else synced_params)
        if synced
        else 0
    )
    return inner, outer
