"""A sharded run's checkpoint tensors through `torch.distributed.checkpoint` (DCP): `save` has every
rank write its shards of the global weights, the outer momentum, its replica's inner moments, mid-round
weights and error-feedback buffers as DTensors (`Shard(0)` over the replica's L ranks, the whole
tensor's shape), no rank holding a whole tensor; `load_shards` reads them cut for the run's own L (DCP
reshards: the chunks written at one L are read into the shards of another), `load_whole` whole (an
unsharded run going on from a sharded run's checkpoint). Keys: `theta/NAME`, `outer_momentum/NAME`,
`inner/REPLICA/m/NAME`, `inner/REPLICA/v/NAME`, `round_params/REPLICA/NAME`, `errors/REPLICA/NAME`
(the replicas' tensors without their replica axis), `outer_optimizer/FRAGMENT/INDEX/KEY` (a
torch.optim outer optimizer's state), `pending/INDEX` (outer.delay: the mean of the reduction in
flight, per parameter of its fragment); outer.overlap's `taken/REPLICA/FLIGHT/INDEX` and
`errors_before/REPLICA/FLIGHT/INDEX` (what each replica took for a reduction in flight, and its error
buffers before) and eager's `replica_outer/REPLICA/theta/NAME`, `.../momentum/NAME` and
`.../optimizer/FRAGMENT/INDEX/KEY` (each replica's own outer weights and state). The rest of the state
is the writer's run.pt (`without_shards`, `light_record`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor

GLOBAL = ("theta", "outer_momentum")  # the same on every replica: DCP writes one copy of each chunk
PER_REPLICA = ("round_params", "errors")  # None (or absent), or one {name: [1, ...]} per replica
SHARED = (*GLOBAL, "outer_optimizer", "pending")  # keys every replica reads
IN_SHARDS = "in the shards"  # what run.pt holds in place of a flat tensor DCP holds as shards


def _pieces(flat: Tensor, names: list[str], params: dict[str, Tensor]):
    """(index, name, piece) of a flat vector over `names` (a fragment's), each piece shaped as `params`'."""
    sizes = [params[n].numel() for n in names]
    for i, (n, piece) in enumerate(zip(names, flat.split(sizes), strict=True)):
        yield i, n, piece.view_as(params[n])


def _optimizer_keys(prefix: str, states, fragments, params: dict[str, Tensor], axis: bool) -> dict:
    """`prefix/FRAGMENT/INDEX/KEY` for each torch.optim state tensor shaped as its parameter (`params`;
    `axis`: both hold a replica axis of 1, dropped here)."""
    out = {}
    for f, kept in enumerate(states or []):
        for i, per in (kept or {}).get("state", {}).items():
            name = fragments[f][int(i)]
            for k, t in per.items():
                if is_sharded_state(t, params[name], f"{k!r} of {name}"):
                    out[f"{prefix}/{f}/{i}/{k}"] = (name, t[0] if axis else t)
    return out


def _keys(saved: dict, replicas: list[int], fragments: list[list[str]]) -> dict[str, tuple[str, Tensor]]:
    """The sharded tensors of `saved` (a `RunState.state_dict`) by key, each with its parameter's name;
    `replicas`: the global index of each of its `inner` (and `round_params`) entries; `fragments`: each
    fragment's parameter names, in its order. The keys of the module docstring: per replica, REPLICA
    second; the tensors without their replica axis; a flat vector over a fragment cut back into its
    parameters (INDEX: their place in it)."""
    theta = saved["theta"]
    out = {f"{part}/{n}": (n, t) for part in GLOBAL for n, t in saved[part].items()}
    for r, inner in zip(replicas, saved["inner"], strict=True):
        out |= {f"inner/{r}/{m}/{n}": (n, t[0]) for m in ("m", "v") for n, t in inner[m].items()}
    for part in PER_REPLICA:
        for r, params in zip(replicas, saved.get(part) or [], strict=False):
            out |= {f"{part}/{r}/{n}": (n, t[0]) for n, t in params.items()}
    out |= _optimizer_keys("outer_optimizer", saved.get("outer_optimizer"), fragments, theta, axis=False)
    pending = saved.get("pending")
    if pending is not None and pending["mean"] is not None:
        names = fragments[pending["fragment"]]
        out |= {f"pending/{i}": (n, t) for i, n, t in _pieces(pending["mean"], names, theta)}
    for k, flight in enumerate(saved.get("in_flight") or []):
        names = fragments[flight["fragment"]]
        for part in ("taken", "errors_before"):
            for r, flat in zip(replicas, flight[part] or [], strict=flight[part] is not None):
                out |= {f"{part}/{r}/{k}/{i}": (n, t) for i, n, t in _pieces(flat, names, theta)}
    for r, own in zip(
        replicas, saved.get("outer_replicas") or [], strict=saved.get("outer_replicas") is not None
    ):
        for part in ("theta", "momentum"):
            out |= {f"replica_outer/{r}/{part}/{n}": (n, t[0]) for n, t in own[part].items()}
        one = {n: t.unsqueeze(0) for n, t in theta.items()}
        out |= _optimizer_keys(
            f"replica_outer/{r}/optimizer", own.get("optimizer"), fragments, one, axis=True
        )
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


def _scalars(states):
    """Optimizer states (a list per fragment) with only what is not sharded: the step counts."""
    if states is None:
        return None
    return [
        None
        if kept is None
        else dict(
            kept,
            state={
                i: {k: t for k, t in per.items() if not (torch.is_tensor(t) and t.dim() > 0)}
                for i, per in kept["state"].items()
            },
        )
        for kept in states
    ]


def light_record(record: dict) -> dict:
    """A replica's record (`RunState.replica_records`) as rank 0 gathers it for run.pt: the tensors this
    rank writes as shards left out (`{}`, or `IN_SHARDS` for a flat one)."""
    inner = dict(record["inner"], m={}, v={})
    empty = {k: None if record[k] is None else {} for k in ("params", "errors")}
    flights = {
        f: dict(x, taken=IN_SHARDS, errors_before=None if x["errors_before"] is None else IN_SHARDS)
        for f, x in record["in_flight"].items()
    }
    own = record["outer"]
    if own is not None:
        own = dict(own, theta={}, momentum={}) | (
            {"optimizer": _scalars(own["optimizer"])} if "optimizer" in own else {}
        )
    return dict(record, inner=inner, in_flight=flights, outer=own, **empty)


def without_shards(saved: dict) -> dict:
    """`saved` as the writer's run.pt holds it beside the shards: no global weights, outer momentum or
    sharded outer optimizer state, a pending mean marked `IN_SHARDS` (the replicas' parts are left out
    by `light_record`)."""
    out = dict(saved, theta={}, outer_momentum={}, outer_optimizer=_scalars(saved.get("outer_optimizer")))
    if saved.get("pending") is not None and saved["pending"]["mean"] is not None:
        out["pending"] = dict(saved["pending"], mean=IN_SHARDS)
    return out


def _copied(states):
    """Optimizer states copied down to each parameter's entries (filled in place by `_filled`)."""
    if states is None:
        return None
    return [
        None if kept is None else dict(kept, state={i: dict(per) for i, per in kept["state"].items()})
        for kept in states
    ]


def _put_state(states: list[dict], rest: list[str], t: Tensor) -> None:
    state = states[int(rest[0])]["state"]
    state[next(i for i in state if str(i) == rest[1])][rest[2]] = t


def _filled(saved: dict, tensors: dict[str, Tensor]) -> dict:
    """`saved` (a checkpoint's state without its sharded tensors) with `tensors` (by key) put back."""
    out = dict(saved, **{part: {} for part in GLOBAL}, outer_optimizer=_copied(saved.get("outer_optimizer")))
    where = {r: i for i, r in enumerate(saved["replicas"])}
    out["inner"] = [dict(x, m={}, v={}) for x in saved["inner"]]
    for part in PER_REPLICA:
        out[part] = None if saved.get(part) is None else [{} for _ in saved[part]]
    if saved.get("in_flight") is not None:
        out["in_flight"] = [
            dict(
                x,
                taken=[None] * len(x["taken"]),
                errors_before=None if x["errors_before"] is None else [None] * len(x["taken"]),
            )
            for x in saved["in_flight"]
        ]
    if saved.get("outer_replicas") is not None:
        out["outer_replicas"] = [
            dict(own, theta={}, momentum={})
            | ({"optimizer": _copied(own["optimizer"])} if "optimizer" in own else {})
            for own in saved["outer_replicas"]
        ]
    flat: dict[tuple, dict[int, Tensor]] = {}  # (part, replica, flight) -> pieces by index
    for key, t in tensors.items():
        part, *rest = key.split("/")
        if part in GLOBAL:
            out[part][rest[0]] = t
        elif part == "outer_optimizer":
            _put_state(out["outer_optimizer"], rest, t)
        elif part == "pending":
            flat.setdefault(("pending",), {})[int(rest[0])] = t
        elif part in ("taken", "errors_before"):
            flat.setdefault((part, where[int(rest[0])], int(rest[1])), {})[int(rest[2])] = t
        elif part == "inner":
            out["inner"][where[int(rest[0])]][rest[1]][rest[2]] = t.unsqueeze(0)
        elif part == "replica_outer":
            own = out["outer_replicas"][where[int(rest[0])]]
            if rest[1] == "optimizer":
                _put_state(own["optimizer"], rest[2:], t.unsqueeze(0))
            else:
                own[rest[1]][rest[2]] = t.unsqueeze(0)
        else:
            out[part][where[int(rest[0])]][rest[1]] = t.unsqueeze(0)
    for (part, *at), pieces in flat.items():
        joined = torch.cat([pieces[i].reshape(-1) for i in sorted(pieces)])
        if part == "pending":
            out["pending"] = dict(saved["pending"], mean=joined)
        else:
            replica, k = at
            out["in_flight"][k][part][replica] = joined
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


def cut(saved: dict, fragments: list[list[str]], local_rank: int, L: int) -> dict:
    """`saved` (a single file's state: whole tensors, every replica) with each tensor a sharded run holds
    as shards cut to rank `local_rank`'s of L (FSDP2's dim-0 cut)."""
    from hypertrain.distributed.fsdp_engine import shard_of

    whole = _keys(saved, saved["replicas"], fragments)
    return _filled(saved, {key: shard_of(t, local_rank, L) for key, (_, t) in whole.items()})


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
