"""The collectives of one process of a sharded run (`processes.shard=true`, benchmark layout):
`ShardedReplicaGroups` is `DistReplicaGroups` where this process holds, of every parameter, only its
replica's dim-0 shard `fsdp_engine.shard_of` (FSDP2's cut: `torch.chunk` into L, the last ones possibly
empty).

The run's state (global weights, outer state, the replica's weights and inner state) holds local shards
(`local_part`); the sync's sum is the all-reduce of this rank's shard over its cross-replica group (the R
ranks holding the same shard), never gathered; the inner step is `distributed.fsdp_engine`'s. Only the
held-out evaluation and weights.pt gather the global weights (`whole`); norms are taken over the shards
(`norm_over_shards`); a checkpoint's tensors are written and read as shards with
torch.distributed.checkpoint (`checkpoint_shards`, `local_state`: `dcp_shards`). docs/distributed.md,
"Sharded replicas".
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from hypertrain.distributed import dcp_shards
from hypertrain.distributed.collectives import DistReplicaGroups, _all_gather, _Flight, collective
from hypertrain.distributed.fsdp_engine import ShardedEngine, shard_of
from hypertrain.distributed.groups import Done, InFlight
from hypertrain.distributed.layouts import Layout
from hypertrain.model.transformer import Params


class ShardedReplicaGroups(DistReplicaGroups):
    """The collectives of a sharded run (see the module docstring)."""

    checkpoints_by_shard = True

    def __init__(self, layout: Layout, rank: int, device: torch.device, timeout_s: float):
        super().__init__(layout, rank, device, timeout_s)
        self.engine = ShardedEngine(self)  # the engine this layout imposes
        self._mesh: DeviceMesh | None = None

    def local_part(self, theta: Params) -> Params:
        self._rows = {n: t.shape[0] for n, t in theta.items()}  # `whole` cuts the padding off with it
        return {n: shard_of(t, self.local_rank, self.L) for n, t in theta.items()}

    def whole(self, theta: Params) -> Params:
        """The whole tensors from every rank's shards: one all-gather per tensor in the replica group."""
        out = {}
        with collective("the global weights' gather"):
            for name, local in theta.items():
                rows = local.shape[0]
                per = -(-self._rows[name] // self.L)
                padded = local.new_zeros((per, *local.shape[1:]))
                padded[:rows] = local
                gathered = local.new_empty((per * self.L, *local.shape[1:]))
                _all_gather(gathered, padded, group=self.replica_group)
                out[name] = gathered[: self._rows[name]]
        return out

    def norm_over_shards(self, norm: float) -> float:
        """The norm of the whole vector from each rank's norm of its shard (one all-reduce in the replica)."""
        square = torch.tensor([norm * norm], dtype=torch.float64, device=self.device)
        with collective("the norm's all-reduce"):
            dist.all_reduce(square, group=self.replica_group)
        return math.sqrt(float(square))

    def most_in_replica(self, count: int) -> int:
        """The largest `count` over the replica's ranks (one all-reduce in the replica); at least 1."""
        most = torch.tensor([max(count, 1)], dtype=torch.int64, device=self.device)
        with collective("the microbatch count's all-reduce"):
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.replica_group)
        return int(most)

    def average_in_replica(self, grads: Params, loss: Tensor) -> None:
        """The update's loss and statistics averaged over the replica's ranks (FSDP2 reduce-scatters the
        gradients itself, `fsdp_engine`)."""
        flat = loss.reshape(-1).clone()
        self._timed("inner", flat, lambda: dist.all_reduce(flat, group=self.replica_group))
        flat /= self.L
        loss.copy_(flat.view_as(loss))

    def start_sum_over_replicas(self, flat: Tensor) -> InFlight:
        """This rank's shard of the sum, summed over its cross-replica group only: nothing is gathered."""
        if self.total_replicas == 1:
            return Done(flat)
        out = flat.clone()
        return _Flight(
            self, out, self._start(out, lambda: dist.all_reduce(out, group=self.cross_group, async_op=True))
        )

    def gather_replicas(self, records: list) -> list | None:
        """A checkpoint's replica records without the tensors each rank writes as its shards
        (`checkpoint_shards`; `dcp_shards.light_record`)."""
        return super().gather_replicas([dcp_shards.light_record(r) for r in records])

    def checkpoint_shards(self, folder: Path, state) -> None:
        """Every rank writes its shards of `state` into `folder` with DCP (`dcp_shards.save`)."""
        with collective("the checkpoint's shards' write"):
            dcp_shards.save(folder, state, self)

    @property
    def mesh(self) -> DeviceMesh:
        """The replica's ranks as a 1-D mesh: its checkpoint tensors are DTensors sharded over it."""
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.replica_group, self.device.type)
        return self._mesh

    def whole_shape(self, name: str, local: Tensor) -> tuple[int, ...]:
        """The whole tensor's shape of which `local` (no replica axis) is this rank's shard."""
        return (self._rows[name], *local.shape[1:])

    def local_state(self, saved: dict, fragments: list[list[str]]) -> dict:
        """A checkpoint's state cut to this rank's shards: a sharded run's (DCP) read as shards for this
        run's L, whatever L wrote it (`dcp_shards.load_shards`); a single file's (an unsharded run's) whole
        tensors cut here, every one a sharded run writes as shards (`dcp_shards.cut`; `fragments`: each
        fragment's parameter names, by which a flat vector over a fragment is cut)."""
        if saved.get("shards_at") is not None:
            with collective("the checkpoint's shards' read"):
                return dcp_shards.load_shards(Path(saved["shards_at"]), saved, self)
        return dcp_shards.cut(saved, fragments, self.local_rank, self.L)

    def without_shards(self, saved: dict) -> dict:
        return dcp_shards.without_shards(saved)

    def memory_facts(self, state) -> dict:
        """This rank's bytes of its replica's weights (and as many of gradients), of its inner optimizer
        state and of the global weights and outer state: its shards (rank 0's, the largest: FSDP2's first
        chunks are the longest)."""

        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        inner = state.inner[0]
        weights = size(state.theta.values())
        return {
            "memory/rank_weights_bytes": weights,
            "memory/rank_gradients_bytes": weights,
            "memory/rank_inner_state_bytes": size([*inner.m.values(), *inner.v.values()]),
            "memory/rank_outer_state_bytes": weights + size(state.outer.momentum.values()),
        }

    def check_replicas_identical(self, params: Params) -> None:
        """The ranks of a replica hold different shards by design: nothing to compare."""
