"""Which replicas a process trains, and the collectives a round needs; one process is the simulation.

The round loop (`hypertrain.trainer`) asks its processes for five things, whatever their number:
which replicas this process trains (`replicas`) and, under the benchmark layout, which plan rank
it is (`rank_share`); averaging a replica's gradients and loss over its ranks every update
(`average_in_replica`); summing a per-replica quantity over all replicas at a sync
(`sum_over_replicas`, `max_over_replicas`); every replica's per-update records on the writer
once per round (`gather_round`); and whether this process writes the run (`is_writer`).
`ReplicaGroups` is the one-process case, where every collective is the identity; the real
processes of `engine=dist` (`hypertrain.dist`) subclass it with torch.distributed collectives.
"""

from __future__ import annotations

import os
import signal
import time

from torch import Tensor

from hypertrain.model import Params


class ReplicaGroups:
    """P = 1: this process trains all R replicas, each on its whole share (`world` = 1)."""

    layout = "simulation"
    backend = "none"  # torch.distributed's backend (gloo, nccl) when there are several processes
    rank, size = 0, 1  # this process among the P processes

    def __init__(self, replicas: int):
        self.total_replicas = replicas
        self.replicas = list(range(replicas))  # global indices of the replicas this process trains

    @property
    def is_writer(self) -> bool:
        """Rank 0 alone writes the run directory, metrics.jsonl and W&B."""
        return self.rank == 0

    def rank_share(self) -> tuple[int, int, int] | None:
        """(plan rank, world W, ranks per replica L) when this process is one plan rank (benchmark
        layout); None when it trains whole replicas."""
        return None

    def average_in_replica(self, grads: Params, loss: Tensor) -> None:
        """In place: the mean over the replica's ranks of their gradients and losses (DDP's average)."""

    def sum_over_replicas(self, flat: Tensor) -> Tensor:
        """The sum over all R replicas of a flat per-replica quantity; this process passes the sum over
        its own replicas (under the benchmark layout every rank of a replica passes the same value)."""
        return flat

    def max_over_replicas(self, value: Tensor) -> Tensor:
        return value

    def gather_round(self, table: Tensor) -> Tensor:
        """[updates, local replicas, k] per process -> [updates, R, k] on the writer (columns: loss or
        NaN when skipped, the replica's targets, this share's microbatches, maxed over a replica's ranks)."""
        return table

    def gather_ranks(self, table: Tensor) -> Tensor:
        """[updates, k] per process -> [P, updates, k] (per-process timings and token counts)."""
        return table.unsqueeze(0)

    def gather_inner(self, states: list) -> list | None:
        """Every replica's inner state (a list of `OptState`, replica order) on the writer, None
        elsewhere: what a checkpoint saves."""
        return states

    def check_replicas_identical(self, params: Params) -> None:
        """Raise if the ranks of a replica hold different weights (they must be bitwise equal)."""

    def before_round(self, updates: range) -> None:
        """Called as a round starts: real processes wait for each other here; the test-only fault
        point of every engine."""
        inject_fault(self.rank, updates)

    def comm_stats(self) -> dict:
        """Measured payload bytes handed to collectives and seconds spent in them, since the last call."""
        return {}


FAULT_ENV = "HYPERTRAIN_FAULT"  # tests only: "RANK:UPDATE:kill" or "RANK:UPDATE:sleep"


def inject_fault(rank: int, updates: range) -> None:
    """Tests only: `HYPERTRAIN_FAULT=RANK:UPDATE:kill|sleep` kills or hangs rank RANK at the start of
    the round that holds the 1-based UPDATE, so a test names the point instead of racing a clock."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    target, update, action = spec.split(":")
    if int(target) == rank and int(update) - 1 in updates:
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)
