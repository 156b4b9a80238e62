"""Which replicas a process trains, and the collectives a round needs (`Collectives`); one process is
the simulation (`ReplicaGroups`).

The round loop (`diloco.rounds`) asks its processes for five things, whatever their number:
which replicas this process trains (`replicas`) and, under the benchmark layout, which plan rank
it is (`rank_share`); averaging a replica's gradients and loss over its ranks every update
(`average_in_replica`); summing a per-replica quantity over all replicas at a sync
(`sum_over_replicas`, `max_over_replicas`; `start_sum_over_replicas` starts the sync's sum and
returns an `InFlight` to wait for); every replica's per-update records on the writer
once per round (`gather_round`); whether some process was asked to stop (`max_over_processes`), and
every replica's state for a checkpoint (`gather_replicas`); and whether this process writes the
run (`is_writer`). An asynchronous run (`diloco.asynchrony.asynchronous`) asks besides for each arrival, from
its replica's process to every process (`share_arrival`).
`ReplicaGroups` is the one-process case, where every collective is the identity; the real
processes of `processes=dist` (`distributed.collectives`) subclass it with torch.distributed collectives.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from hypertrain.failures import fault_points
from hypertrain.model.transformer import Params


class InFlight(Protocol):
    """A collective started and not yet waited for: `wait()` gives its result (once done, again)."""

    def wait(self) -> Tensor: ...

    def is_completed(self) -> bool: ...


class Done:
    """A collective's result known at once (one process)."""

    def __init__(self, value: Tensor):
        self.value = value

    def wait(self) -> Tensor:
        return self.value

    def is_completed(self) -> bool:
        return True


class Collectives(Protocol):
    """What the round loop, the sync and the checkpoints ask of the run's processes (see above)."""

    layout: str  # "simulation", or the process layout: "benchmark" or "replicas"
    backend: str
    rank: int
    size: int  # P
    total_replicas: int  # R
    replicas: list[int]  # the replicas this process trains
    checkpoints_by_shard: bool  # each process writes its shards of a checkpoint (sharded replicas)

    @property
    def is_writer(self) -> bool: ...

    def rank_share(self) -> tuple[int, int, int] | None: ...

    def average_in_replica(self, grads: Params, loss: Tensor) -> None: ...

    def sum_over_replicas(self, flat: Tensor) -> Tensor: ...

    def sum_over_replicas_beside(self, flat: Tensor) -> Tensor: ...

    def start_sum_over_replicas(self, flat: Tensor) -> InFlight: ...

    def start_all_gather_replicas(self, local: Tensor) -> InFlight: ...

    def start_exchange_shards(self, local: Tensor) -> InFlight: ...

    def max_over_replicas(self, value: Tensor) -> Tensor: ...

    def gather_round(self, table: Tensor) -> Tensor: ...

    def gather_ranks(self, table: Tensor) -> Tensor: ...

    def gather_replicas(self, records: list) -> list | None: ...

    def max_over_processes(self, value: int) -> int: ...

    def share_arrival(self, replica: int, delta: Tensor, losses: Tensor) -> tuple[Tensor, Tensor]: ...

    def check_replicas_identical(self, params: Params) -> None: ...

    def local_part(self, theta: Params) -> Params: ...

    def whole(self, theta: Params) -> Params: ...

    def norm_over_shards(self, norm: float) -> float: ...

    def local_state(self, saved: dict, fragments: list[list[str]]) -> dict: ...

    def checkpoint_shards(self, folder, state) -> None: ...

    def without_shards(self, saved: dict) -> dict: ...

    def memory_facts(self, state) -> dict: ...

    def before_round(self, updates: range) -> None: ...

    def comm_stats(self) -> dict: ...

    def measured_since_sync(self) -> dict: ...

    def restore_measured(self, saved: dict) -> None: ...


class ReplicaGroups:
    """P = 1: this process trains all R replicas, each on its whole share (`world` = 1)."""

    layout = "simulation"
    backend = "none"  # torch.distributed's backend (gloo, nccl) when there are several processes
    rank, size = 0, 1  # this process among the P processes
    engine = None  # the engine a layout imposes (sharded replicas: `distributed.fsdp_engine`), else None
    checkpoints_by_shard = False  # sharded replicas: each rank writes its shards (`checkpoint_shards`)

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

    def sum_over_replicas_beside(self, flat: Tensor) -> Tensor:
        """`sum_over_replicas`, not queued behind a reduction in flight on the outer group (eager's mean
        of the replicas' outer weights, while the reduction of the round just trained is in flight)."""
        return self.sum_over_replicas(flat)

    def start_sum_over_replicas(self, flat: Tensor) -> InFlight:
        """`sum_over_replicas` started now and waited for later (the sync's reduction, which the
        replicas' next updates overlap with outer.delay > 0)."""
        return Done(self.sum_over_replicas(flat))

    def start_all_gather_replicas(self, local: Tensor) -> InFlight:
        """[local replicas, ...] rows (a compressed sync's messages) -> [R, ...], every replica's in
        replica order, on every process."""
        return Done(local)

    def start_exchange_shards(self, local: Tensor) -> InFlight:
        """A two-phase sync's all-to-all: `local` [local replicas, R, k] holds each local replica's
        message for every shard j (shard j belongs to replica j); the result [R, local replicas, k]
        holds, for each shard this process's replicas own, every replica's message, in replica order."""
        return Done(local)

    def max_over_replicas(self, value: Tensor) -> Tensor:
        return value

    def gather_round(self, table: Tensor) -> Tensor:
        """[updates, local replicas, k] per process -> [updates, R, k] on the writer (columns: loss or
        NaN when skipped, the replica's targets, this share's microbatches, maxed over a replica's
        ranks, then the multistream channel losses: `diloco.rounds.local_table`)."""
        return table

    def gather_ranks(self, table: Tensor) -> Tensor:
        """[updates, k] per process -> [P, updates, k] (per-process timings and token counts)."""
        return table.unsqueeze(0)

    def gather_replicas(self, records: list) -> list | None:
        """One record per local replica (CPU tensors) -> every replica's, in replica order, on the
        writer; None elsewhere: what a checkpoint saves of the replicas."""
        return records

    def max_over_processes(self, value: int) -> int:
        """The largest of every process's `value` (every process asks at the same point): whether,
        and by which signal, some process was asked to stop."""
        return value

    def share_arrival(self, replica: int, delta: Tensor, losses: Tensor) -> tuple[Tensor, Tensor]:
        """outer.schedule=async: an arriving job of `replica` (its flat fp32 pseudo-gradient, or with a
        codec its payload's bytes, uint8; and its losses, float64, NaN where a step trained nothing, then
        a flag) from the process that trained it to every process, bit for bit; the others pass tensors
        of the same shapes and dtypes, overwritten (one process: the job's own)."""
        return delta, losses

    def check_replicas_identical(self, params: Params) -> None:
        """Raise if the ranks of a replica hold different weights (they must be bitwise equal)."""

    def local_part(self, theta: Params) -> Params:
        """What of the whole global weights this process holds (sharded replicas: its shards; else all)."""
        return theta

    def whole(self, theta: Params) -> Params:
        """The whole global weights from what each process holds (every process calls it together)."""
        return theta

    def norm_over_shards(self, norm: float) -> float:
        """The whole vector's norm from this process's norm of what it holds of it."""
        return norm

    def local_state(self, saved: dict, fragments: list[list[str]]) -> dict:
        """A checkpoint's run state (`RunState.state_dict`) as this process holds it: whole tensors (a
        sharded run's checkpoint, `checkpoint.load` left them in its folder, read whole here).
        `fragments`: each fragment's parameter names (a sharded run cuts a pending mean by them)."""
        if saved.get("shards_at") is not None:
            from pathlib import Path

            from hypertrain.distributed.dcp_shards import load_whole

            return load_whole(Path(saved["shards_at"]), saved)
        return saved

    def checkpoint_shards(self, folder, state) -> None:
        """Sharded replicas only (`checkpoints_by_shard`): write this process's shards into `folder`."""
        raise NotImplementedError("a checkpoint of whole tensors is written by rank 0 alone")

    def without_shards(self, saved: dict) -> dict:
        """Sharded replicas only: the writer's run.pt part of a checkpoint's state (`dcp_shards`)."""
        raise NotImplementedError("a checkpoint of whole tensors is written by rank 0 alone")

    def memory_facts(self, state) -> dict:
        """The run summary's per-process bytes of the run state's tensors, where a layout reports them
        (sharded replicas); none here."""
        return {}

    def before_round(self, updates: range) -> None:
        """Called as a round (or the part of one up to a checkpoint) starts: real processes wait for
        each other here; the test-only fault point `round` (failures.fault_points)."""
        fault_points.act(self.rank, "round", updates)

    def comm_stats(self) -> dict:
        """Measured payload bytes handed to collectives and seconds spent in them, since the last call."""
        return {}

    def measured_since_sync(self) -> dict:
        """What `comm_stats` would report now, without resetting it: a checkpoint keeps it, so a
        resumed run's next sync row counts what the stopped session measured before the checkpoint
        (a reduction launched before it, the updates' all-reduces)."""
        return {}

    def restore_measured(self, saved: dict) -> None:
        """Add a checkpoint's `measured_since_sync` to the counters (a resumed session's start)."""
