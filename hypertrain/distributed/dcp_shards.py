"""A sharded run's checkpoint tensors through `torch.distributed.checkpoint` (DCP): `save` has every
rank write its shards of the global weights, the outer momentum, its replica's inner moments, mid-round
weights and error-feedback buffers as DTensors (`Shard(0)` over the replica's L ranks, the whole
tensor's shape), no rank holding a whole tensor; `load_shards` reads them cut for the run's own L (DCP
reshards: the chunks written at one L are read into the shards of another), `load_whole` whole (an
unsharded run going on from a sharded run's checkpoint). Keys: `theta/NAME`, `outer_momentum/NAME`,
`inner/REPLICA/m/NAME`, `inner/REPLICA/v/NAME`, `round_params/REPLICA/NAME`, `errors/REPLICA/NAME`
(the replicas' tensors without their replica axis), `outer_optimizer/FRAGMENT/INDEX/KEY` (a
torch.optim outer optimizer's state) and `pending/INDEX` (outer.delay: the mean of the reduction in
flight, per parameter of its fragment); the rest of the state is the writer's run.pt (`without_shards`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor

GLOBAL = ("theta", "outer_momentum")  # the same on every replica: DCP writes one copy of each chunk
PER_REPLICA = ("round_params", "errors")  # None (or absent), or one {name: [1, ...]} per replica
SHARED = (*GLOBAL, "outer_optimizer", "pending")  # keys every replica reads
IN_SHARDS = "in the shards"  # a pending reduction's mean, in the checkpoint's run.pt: read from DCP


def _keys(saved: dict, replicas: list[int], fragments: list[list[str]]) -> dict[str, tuple[str, Tensor]]:
    """The sharded tensors of `saved` (a `RunState.state_dict`) by key, each with its parameter's name;
    `replicas`: the global index of each of its `inner` (and `round_params`) entries; `fragments`: each
    fragment's parameter names, in its order. A torch.optim outer optimizer's state tensors shaped as
    their parameter (`outer_optimizer/FRAGMENT/INDEX/KEY`, its scalars stay in run.pt) and a pending
    reduction's flat mean cut back into its parameters' shards (`pending/INDEX`) are sharded too."""
    out = {f"{part}/{n}": (n, t) for part in GLOBAL for n, t in saved[part].items()}
    for r, inner in zip(replicas, saved["inner"], strict=True):
        out |= {f"inner/{r}/{m}/{n}": (n, t[0]) for m in ("m", "v") for n, t in inner[m].items()}
    for part in PER_REPLICA:
        for r, params in zip(replicas, saved.get(part) or [], strict=False):
            out |= {f"{part}/{r}/{n}": (n, t[0]) for n, t in params.items()}
    for f, kept in enumerate(saved.get("outer_optimizer") or []):
        for i, per in (kept or {}).get("state", {}).items():
            name = fragments[f][int(i)]
            for k, t in per.items():
                if is_sharded_state(t, saved["theta"][name], f"{k!r} of {name}"):
                    out[f"outer_optimizer/{f}/{i}/{k}"] = (name, t)
    pending = saved.get("pending")
    if pending is not None and pending["mean"] is not None:
        names = fragments[pending["fragment"]]
        sizes = [saved["theta"][n].numel() for n in names]
        for i, (n, piece) in enumerate(zip(names, pending["mean"].split(sizes), strict=True)):
            out[f"pending/{i}"] = (n, piece.view_as(saved["theta"][n]))
    return out


def is_sharded_state(t, param: Tensor, what: str) -> bool:
    """Whether `t` (an entry of an outer optimizer's state for `param`) is sharded as its parameter: a
    tensor of its shape; a scalar (a step count) is not; anything else cannot be cut (ValueError)."""
    if not torch.is_tensor(t) or t.dim() == 0:
        return False
    if t.shape != param.shape:
        raise ValueError(
            f"the outer optimizer's state {what} has shape {tuple(t.shape)}, not its parameter's "
            f"{tuple(param.shape)}: it cannot be cut into shards (processes.shard=true)"
        )
    return True


def without_shards(saved: dict) -> dict:
    """`saved` as the writer's run.pt holds it beside the shards: no global weights, outer momentum or
    sharded outer optimizer state, a pending mean marked `IN_SHARDS` (the replicas' parts are left out
    by `ShardedReplicaGroups.gather_replicas`)."""
    out = dict(saved, theta={}, outer_momentum={})
    if saved.get("outer_optimizer") is not None:
        out["outer_optimizer"] = [
            None
            if kept is None
            else dict(
                kept,
                state={
                    i: {k: t for k, t in per.items() if not (torch.is_tensor(t) and t.dim() > 0)}
                    for i, per in kept["state"].items()
                },
            )
            for kept in saved["outer_optimizer"]
        ]
    if saved.get("pending") is not None and saved["pending"]["mean"] is not None:
        out["pending"] = dict(saved["pending"], mean=IN_SHARDS)
    return out


def _filled(saved: dict, tensors: dict[str, Tensor]) -> dict:
    """`saved` (a checkpoint's state without its sharded tensors) with `tensors` (by key) put back."""
    out = dict(saved, **{part: {} for part in GLOBAL})
    where = {r: i for i, r in enumerate(saved["replicas"])}
    out["inner"] = [dict(x, m={}, v={}) for x in saved["inner"]]
    for part in PER_REPLICA:
        out[part] = None if saved.get(part) is None else [{} for _ in saved[part]]
    if saved.get("outer_optimizer") is not None:
        out["outer_optimizer"] = [
            None if kept is None else dict(kept, state={i: dict(per) for i, per in kept["state"].items()})
            for kept in saved["outer_optimizer"]
        ]
    pieces = {}
    for key, t in tensors.items():
        part, *rest = key.split("/")
        if part in GLOBAL:
            out[part][rest[0]] = t
        elif part == "inner":
            out["inner"][where[int(rest[0])]][rest[1]][rest[2]] = t.unsqueeze(0)
        elif part == "outer_optimizer":
            state = out["outer_optimizer"][int(rest[0])]["state"]
            index = next(i for i in state if str(i) == rest[1])
            state[index][rest[2]] = t
        elif part == "pending":
            pieces[int(rest[0])] = t
        else:
            out[part][where[int(rest[0])]][rest[1]] = t.unsqueeze(0)
    if pieces:
        out["pending"] = dict(
            saved["pending"], mean=torch.cat([pieces[i].reshape(-1) for i in sorted(pieces)])
        )
    return out


def _as_dtensor(local: Tensor, whole_shape: tuple[int, ...], mesh) -> Tensor:
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(whole_shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=whole_shape, stride=stride)


def save(folder: Path, state, groups) -> None:
    """Every rank writes its shards of `state` (a `RunState`) into `folder` (one `__RANK_0.distcp` file
    each, and rank 0 DCP's `.metadata`); a collective over every process."""
    import torch.distributed.checkpoint as dcp

    local = state.state_dict()
    fragments = [sync.names for sync in state.syncs]
    tensors = {
        key: _as_dtensor(t.detach().contiguous(), groups.whole_shape(name, t), groups.mesh)
        for key, (name, t) in _keys(local, local["replicas"], fragments).items()
    }
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder))


def _wanted(folder: Path, replicas: list[int]) -> dict:
    """DCP's record of every tensor key this process reads: the global ones and its replicas'."""
    from torch.distributed.checkpoint import FileSystemReader

    mine = {str(r) for r in replicas}
    found = FileSystemReader(folder).read_metadata().state_dict_metadata
    return {k: meta for k, meta in found.items() if k.split("/")[0] in SHARED or k.split("/")[1] in mine}


def load_shards(folder: Path, saved: dict, groups) -> dict:
    """`saved` (a checkpoint's state read by `checkpoint.load`) with this rank's shards for the run's L,
    read from `folder` (written at any L); a collective over every process."""
    import torch.distributed.checkpoint as dcp

    from hypertrain.distributed.fsdp_engine import shard_of

    tensors = {}
    for key, meta in _wanted(folder, groups.replicas).items():
        whole = torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device="meta")
        local = torch.zeros_like(shard_of(whole, groups.local_rank, groups.L), device=groups.device)
        tensors[key] = _as_dtensor(local, tuple(meta.size), groups.mesh)
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(folder))
    return _filled(saved, {k: t.to_local() for k, t in tensors.items()})


def load_whole(folder: Path, saved: dict) -> dict:
    """`saved` with every tensor of `folder` read whole, by this process alone (no collective)."""
    import torch.distributed.checkpoint as dcp

    tensors = {
        key: torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in _wanted(folder, saved["replicas"]).items()
    }
    with warnings.catch_warnings():  # DCP warns that it reads in one process: it is asked to
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return _filled(saved, tensors)
