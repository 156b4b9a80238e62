"""The collectives of one process of a run on real processes (torch.distributed), for the layout
`distributed.layouts` chose: `DistReplicaGroups` is `ReplicaGroups` over process groups, each failure of
a collective one line naming it (`RankFailed`).

Under the benchmark layout (a) a replica's L ranks average their gradients and loss every update (one
all-reduce in the replica group, as DDP does) and a sync is sharded as hybrid-sharded data parallel does
(local rank j all-reduces its 1/L shard of the pseudo-gradient sum in cross-replica group j, then the
replica all-gathers the shards); under the replicas layout (b) a sync is one all-reduce over the P
processes. The ranks of a replica check at every sync that their weights are bitwise equal.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from hypertrain.distributed.groups import InFlight, ReplicaGroups
from hypertrain.distributed.layouts import Layout
from hypertrain.engines.columns import REPLICA_COLUMNS
from hypertrain.failures import RankFailed, RunFailure, fault_points
from hypertrain.model.transformer import Params

# torch >= 2.12 renames all_gather_into_tensor (and warns at every call of the old name).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_WHAT = {
    "inner": "the replica's gradient all-reduce",
    "outer": "the sync's all-reduce across replicas",
    "arrival": "the arrival's broadcast from its replica's process",
}


def first_line(error: BaseException) -> str:
    """The error's first line without gloo's source location ("[.../pair.cc:534] ")."""
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)


@contextmanager
def collective(what: str) -> Iterator[None]:
    """A collective's failure (a peer died, hung past the timeout) as one line naming the collective."""
    try:
        yield
    except RunFailure:  # SIGTERM's Terminated, raised while waiting in the collective: as it is
        raise
    except (RuntimeError, dist.DistBackendError) as e:
        raise RankFailed(f"{what} failed: {first_line(e)}") from None


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _checksum(params: Params) -> int:
    """A sum of the weights' bit patterns: equal weights, equal sums (any difference almost surely shows)."""
    return int(
        sum(t.detach().float().contiguous().view(torch.int32).to(torch.int64).sum() for t in params.values())
    )


class _Flight:
    """A sync's collective in flight: `wait()` (the seconds it blocks counted as the outer seconds)
    gives its result `out`, passed through `then` (the benchmark layout's all-gather inside the
    replica after the shard's all-reduce; a reshape)."""

    def __init__(self, groups: DistReplicaGroups, out: Tensor, work, then=None):
        self.groups, self.out, self.work, self.then, self.value = groups, out, work, then, None

    def is_completed(self) -> bool:
        return self.value is not None or self.work is None or self.work.is_completed()

    def wait(self) -> Tensor:
        if self.value is None:
            if self.work is not None:
                self.groups._timed("outer", self.out[:0], self.work.wait)
            self.value = self.out if self.then is None else self.then(self.out)
        return self.value


class DistReplicaGroups(ReplicaGroups):
    """The collectives of one process of an `processes=dist` run (see the module docstring)."""

    def __init__(self, layout: Layout, rank: int, device: torch.device, timeout_s: float):
        self.layout_plan, self.layout, self.backend = layout, layout.kind, dist.get_backend()
        self.rank, self.size, self.device = rank, layout.processes, device
        self.total_replicas, self.replicas = layout.replicas, layout.replicas_of(rank)
        L = layout.ranks_per_replica
        self.L, self.local_rank = L, rank % L
        self.replica_group = self.cross_group = self.beside_group = None
        timeout = timedelta(seconds=timeout_s)
        # The sync's reduction has its own group, so that it can be in flight while the replicas
        # train on (outer.delay): the stop check and the gathers on the default group never queue
        # behind it (under the benchmark layout with L > 1, the cross-replica groups are that group).
        self.outer_group = None
        if layout.kind != "benchmark" or L == 1:
            self.outer_group = dist.new_group(list(range(layout.processes)), timeout=timeout)
        if layout.kind == "benchmark" and L > 1:
            # Every process creates every group, in the same order (torch.distributed's rule); a new
            # group does not inherit the default group's timeout, so each is given it.
            for m in range(layout.replicas):
                group = dist.new_group(layout.replica_group(m), timeout=timeout)
                if m == self.replicas[0]:
                    self.replica_group = group
            for j in range(L):
                group = dist.new_group(layout.cross_group(j), timeout=timeout)
                if j == self.local_rank:
                    self.cross_group = group
            # outer.overlap=eager's mean of the replicas' own outer weights runs beside the sync's
            # reduction in flight on `cross_group`: on its twin, a second group of the same R ranks
            for j in range(L):
                group = dist.new_group(layout.cross_group(j), timeout=timeout)
                if j == self.local_rank:
                    self.beside_group = group
        self._stats = dict.fromkeys(("inner_bytes", "inner_s", "outer_bytes", "outer_s"), 0.0)
        # outer.schedule=async: the process that sends each replica's arrivals (its replica group's first)
        self.owners = {m: r for r in reversed(range(layout.processes)) for m in layout.replicas_of(r)}

    # -- bookkeeping ---------------------------------------------------------------------------

    def _timed(self, kind: str, payload: Tensor, op, what: str | None = None) -> None:
        start = time.perf_counter()
        with collective(_WHAT[what or kind]):
            op()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self._stats[f"{kind}_s"] += time.perf_counter() - start
        self._stats[f"{kind}_bytes"] += payload.numel() * payload.element_size()

    def before_round(self, updates: range) -> None:
        """Start the round together: rank 0's held-out eval and logging stay out of the next
        update's timing (the other ranks would otherwise wait for it inside their first all-reduce)."""
        fault_points.act(self.rank, "round", updates)
        with collective("the round's start barrier"):
            dist.barrier()

    def measured_since_sync(self) -> dict:
        return dict(self._stats)

    def restore_measured(self, saved: dict) -> None:
        for key in self._stats:
            self._stats[key] += float(saved.get(key, 0.0))

    def comm_stats(self) -> dict:
        stats = {
            "comm_measured_inner_bytes": int(self._stats["inner_bytes"]),
            "comm_measured_inner_s": self._stats["inner_s"],
            "comm_measured_outer_bytes": int(self._stats["outer_bytes"]),
            "comm_measured_outer_s": self._stats["outer_s"],
        }
        self._stats = dict.fromkeys(self._stats, 0.0)
        return stats

    # -- the collectives the round loop asks for ----------------------------------------------

    def rank_share(self) -> tuple[int, int, int] | None:
        if self.layout != "benchmark":
            return None
        return self.rank, self.layout_plan.world, self.L

    def average_in_replica(self, grads: Params, loss: Tensor) -> None:
        if self.replica_group is None:
            return
        names = list(grads)
        flat = _flat([grads[n] for n in names] + [loss.to(grads[names[0]].dtype)])
        self._timed("inner", flat, lambda: dist.all_reduce(flat, group=self.replica_group))
        flat /= self.L
        start = 0
        for n in names:
            grads[n].copy_(flat[start : start + grads[n].numel()].view_as(grads[n]))
            start += grads[n].numel()
        loss.copy_(flat[start:].view_as(loss))

    def sum_over_replicas(self, flat: Tensor) -> Tensor:
        return self.start_sum_over_replicas(flat).wait()

    def sum_over_replicas_beside(self, flat: Tensor) -> Tensor:
        """Beside the outer group's reduction in flight: on the default group, where every process passes
        its replicas' sum; under the benchmark layout with L > 1, on `beside_group` (the R ranks of the
        same local rank: a replica counted once, the sum of R terms as the simulation's; a sharded run's
        ranks pass their shards)."""
        out = flat.clone()
        group = None if self.replica_group is None else self.beside_group
        self._timed("outer", out, lambda: dist.all_reduce(out, group=group))
        return out

    def start_sum_over_replicas(self, flat: Tensor) -> InFlight:
        """The sync's sum, started asynchronously on the outer process group(s) (async_op=True); the
        replicas train on while it is in flight. Benchmark layout: the shard's all-reduce across
        replicas is the part in flight; the all-gather inside the replica follows it in `wait()`."""
        if self.replica_group is None:  # replicas layout, or one rank per replica: one all-reduce
            out = flat.clone()
            return _Flight(
                self,
                out,
                self._start(out, lambda: dist.all_reduce(out, group=self.outer_group, async_op=True)),
            )
        n, L = flat.numel(), self.L
        shard = -(-n // L)
        padded = torch.zeros(shard * L, dtype=flat.dtype, device=flat.device)
        padded[:n] = flat
        mine = padded[self.local_rank * shard : (self.local_rank + 1) * shard].clone()
        work = None
        if self.total_replicas > 1:
            work = self._start(mine, lambda: dist.all_reduce(mine, group=self.cross_group, async_op=True))

        def gather(_: Tensor) -> Tensor:
            gathered = torch.empty_like(padded)
            group = self.replica_group
            self._timed("outer", mine, lambda: _all_gather(gathered, mine, group=group))
            return gathered[:n]

        return _Flight(self, mine, work, gather)

    def _exchange_group(self):
        """The processes a compressed sync's messages go between, one per replica or per R/P replicas:
        every process (replicas layout, or one rank per replica), or this rank's cross-replica group
        (benchmark layout: each of a replica's L ranks exchanges the whole message in its own group)."""
        return self.cross_group if self.replica_group is not None else self.outer_group

    def start_all_gather_replicas(self, local: Tensor) -> InFlight:
        local = local.contiguous()
        group = self._exchange_group()
        size = (dist.get_world_size(group) * local.shape[0], *local.shape[1:])
        out = torch.empty(size, dtype=local.dtype, device=local.device)  # [R, ...], replica order
        work = self._start(local, lambda: _all_gather(out, local, group=group, async_op=True))
        return _Flight(self, out, work)

    def start_exchange_shards(self, local: Tensor) -> InFlight:
        group = self._exchange_group()
        n = dist.get_world_size(group)
        mine, R, k = local.shape
        # to process q: each local replica's messages for the shards q's replicas own
        send = local.reshape(mine, n, R // n, k).permute(1, 0, 2, 3).contiguous()
        out = torch.empty((n, mine, R // n, k), dtype=local.dtype, device=local.device)
        work = self._start(send, lambda: dist.all_to_all_single(out, send, group=group, async_op=True))
        # from process p: its replicas' messages for this process's shards -> [R senders, my shards, k]
        return _Flight(self, out, work, lambda value: value.reshape(R, R // n, k))

    def _start(self, payload: Tensor, op):
        """Launch an asynchronous collective (its launch counted in the outer seconds and bytes)."""
        start = time.perf_counter()
        with collective(_WHAT["outer"]):
            work = op()
        self._stats["outer_s"] += time.perf_counter() - start
        self._stats["outer_bytes"] += payload.numel() * payload.element_size()
        return work

    def share_arrival(self, replica: int, delta: Tensor, losses: Tensor) -> tuple[Tensor, Tensor]:
        """Two broadcasts on the default group from the replica's process (its replica group's first
        rank): the pseudo-gradient (or a codec's payload bytes), counted as the outer bytes and seconds,
        then its losses; a broadcast copies the bits, so every process applies the same numbers
        (docs/async.md, "Real processes")."""
        owner = self.owners[replica]
        delta, losses = delta.contiguous(), losses.contiguous()
        self._timed("outer", delta, lambda: dist.broadcast(delta, src=owner), "arrival")
        with collective(_WHAT["arrival"]):
            dist.broadcast(losses, src=owner)
        return delta, losses

    def max_over_replicas(self, value: Tensor) -> Tensor:
        out = value.clone()
        self._timed("outer", out, lambda: dist.all_reduce(out, op=dist.ReduceOp.MAX))
        return out

    def _gather_all(self, table: Tensor, what: str) -> list[Tensor]:
        table = table.to(self.device)
        parts = [torch.empty_like(table) for _ in range(self.size)]
        with collective(what):
            dist.all_gather(parts, table)
        return parts

    def gather_round(self, table: Tensor) -> Tensor:
        parts = self._gather_all(table, "the round's gather of losses")
        if self.layout == "replicas":
            return torch.cat(parts, dim=1).cpu()
        # Benchmark: [P, H, 1, k] -> [R, L, H, k]; a replica's ranks share its loss and targets.
        k = table.shape[-1]
        per_rank = torch.stack(parts)[:, :, 0, :].reshape(self.total_replicas, self.L, -1, k)
        merged = per_rank[:, 0].clone()
        most = REPLICA_COLUMNS.index("microbatches")  # a replica's ranks may cut different counts
        merged[..., most] = per_rank[..., most].amax(dim=1)
        return merged.permute(1, 0, 2).cpu()

    def gather_ranks(self, table: Tensor) -> Tensor:
        return torch.stack(self._gather_all(table, "the round's gather of timings")).cpu()

    def gather_replicas(self, records: list) -> list | None:
        """Rank 0 gathers one copy of every replica's record (a replica's ranks hold the same one)."""
        mine = records if self.local_rank == 0 else None  # one rank per replica sends
        gathered = [None] * self.size if self.rank == 0 else None
        with collective("the checkpoint's gather"):
            dist.gather_object(mine, gathered, dst=0)
        if self.rank != 0:
            return None
        return [record for part in gathered if part is not None for record in part]

    def max_over_processes(self, value: int) -> int:
        """One all-reduce (MAX) of one number over every process: 4 bytes per update for the stop
        check, not counted as the run's communication (it carries no training data)."""
        out = torch.tensor([value], dtype=torch.int32, device=self.device)
        with collective("the stop check's all-reduce"):
            dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return int(out.item())

    def check_replicas_identical(self, params: Params) -> None:
        if self.replica_group is None:
            return
        local = _checksum(params)
        bounds = torch.tensor([local, -local], dtype=torch.int64, device=self.device)
        with collective("the replica's weight check"):
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.replica_group)
        if int(bounds[0]) != -int(bounds[1]):
            raise RankFailed(
                f"the {self.L} ranks of replica {self.replicas[0]} hold different weights at a sync "
                "(they must be bitwise equal: every rank averages the same gradients)"
            )
