"""A sharded run's checkpoint tensors through `torch.distributed.checkpoint` (DCP): `save` has every
rank write its shards of the global weights, the outer momentum, its replica's inner moments, mid-round
weights and error-feedback buffers as DTensors (`Shard(0)` over the replica's L ranks, the whole
tensor's shape), no rank holding a whole tensor; `load_shards` reads them cut for the run's own L (DCP
reshards: the chunks written at one L are read into the shards of another), `load_whole` whole (an
unsharded run going on from a sharded run's checkpoint). Keys: `theta/NAME`, `outer_momentum/NAME`,
`inner/REPLICA/m/NAME`, `inner/REPLICA/v/NAME`, `round_params/REPLICA/NAME`, `errors/REPLICA/NAME`;
the replicas' tensors without their replica axis.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor

GLOBAL = ("theta", "outer_momentum")  # the same on every replica: DCP writes one copy of each chunk
PER_REPLICA = ("round_params", "errors")  # None (or absent), or one {name: [1, ...]} per replica


def _keys(saved: dict, replicas: list[int]) -> dict[str, Tensor]:
    """The sharded tensors of `saved` (a `RunState.state_dict`) by key; `replicas`: the global index of
    each of its `inner` (and `round_params`) entries."""
    out = {f"{part}/{n}": t for part in GLOBAL for n, t in saved[part].items()}
    for r, inner in zip(replicas, saved["inner"], strict=True):
        out |= {f"inner/{r}/{m}/{n}": t[0] for m in ("m", "v") for n, t in inner[m].items()}
    for part in PER_REPLICA:
        for r, params in zip(replicas, saved.get(part) or [], strict=False):
            out |= {f"{part}/{r}/{n}": t[0] for n, t in params.items()}
    return out


def _filled(saved: dict, tensors: dict[str, Tensor]) -> dict:
    """`saved` (a checkpoint's state without its sharded tensors) with `tensors` (by key) put back."""
    out = dict(saved, **{part: {} for part in GLOBAL})
    where = {r: i for i, r in enumerate(saved["replicas"])}
    out["inner"] = [dict(x, m={}, v={}) for x in saved["inner"]]
    for part in PER_REPLICA:
        out[part] = None if saved.get(part) is None else [{} for _ in saved[part]]
    for key, t in tensors.items():
        part, *rest = key.split("/")
        if part in GLOBAL:
            out[part][rest[0]] = t
        elif part == "inner":
            out["inner"][where[int(rest[0])]][rest[1]][rest[2]] = t.unsqueeze(0)
        else:
            out[part][where[int(rest[0])]][rest[1]] = t.unsqueeze(0)
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
    tensors = {
        key: _as_dtensor(t.detach().contiguous(), groups.whole_shape(key.rsplit("/", 1)[1], t), groups.mesh)
        for key, t in _keys(local, local["replicas"]).items()
    }
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder))


def _wanted(folder: Path, replicas: list[int]) -> dict:
    """DCP's record of every tensor key this process reads: the global ones and its replicas'."""
    from torch.distributed.checkpoint import FileSystemReader

    mine = {str(r) for r in replicas}
    found = FileSystemReader(folder).read_metadata().state_dict_metadata
    return {k: meta for k, meta in found.items() if k.split("/")[0] in GLOBAL or k.split("/")[1] in mine}


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
