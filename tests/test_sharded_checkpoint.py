"""A sharded run's checkpoint tensors through torch.distributed.checkpoint (`distributed.dcp_shards`):
written by 4 gloo processes as 2 replicas of L = 2 shards; read back by the same 4 processes as one
replica of L = 4 (each replica's state in turn: a run at world.size 8 holds two such replicas, each
reading its own, as here), and as replicas of L = 1 (each rank's shard is the whole tensor); and read
whole by one process with no process group (how an unsharded run reads it). The expected shards are cut
here, independently of the code under test, as FSDP2 cuts a parameter: rows [j * ceil(n / L),
(j + 1) * ceil(n / L)) of the whole tensor, empty past its end. Every tensor kind a checkpoint holds is
there (the global weights, the outer momentum, a torch.optim outer optimizer's moments per fragment, a
pending reduction's flat mean over its fragment's parameters, each replica's inner moments and mid-round
weights), with rows that L = 2 and L = 4 cut unevenly (7 rows: 4 + 3 and 2 + 2 + 2 + 1; 3 rows at
L = 4: 1 + 1 + 1 and an empty shard). Only bytes move, so bitwise.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS = {"emb": (7, 5), "norm": (3,), "head": (10, 4)}  # whole shapes
R = 2
GLOBAL = ("theta", "outer_momentum")
FRAGMENTS = [["emb", "norm"], ["head"]]  # each fragment's parameters, in order
PENDING = 1  # the fragment whose reduction is in flight


def _outer_optimizer(cut) -> list[dict]:
    """Adam's state per fragment as `state_dict()` gives it (parameters by index), `cut` applied to each
    moment; its step count a scalar (run.pt's)."""
    moments = {k: cut(_whole(k)) for k in ("exp_avg", "exp_avg_sq")}
    return [
        {
            "state": {
                i: {"step": torch.tensor(5.0), **{k: m[n] for k, m in moments.items()}}
                for i, n in enumerate(names)
            },
            "param_groups": [{"lr": 0.01, "params": list(range(len(names)))}],
        }
        for names in FRAGMENTS
    ]


def _pending_mean(cut) -> torch.Tensor:
    """The pending fragment's flat mean: each of its parameters (cut) flattened, in order."""
    whole = _whole("pending")
    return torch.cat([cut({n: whole[n]})[n].reshape(-1) for n in FRAGMENTS[PENDING]])


def _whole(part: str, replica: int | None = None) -> dict[str, torch.Tensor]:
    """The whole tensors of `part` (of `replica`), distinct for each: what the checkpoint must hold."""
    gen = torch.Generator().manual_seed(sum(map(ord, part)) + 1000 * (0 if replica is None else replica + 1))
    return {n: torch.randn(shape, generator=gen) for n, shape in ROWS.items()}


def _cut(t: torch.Tensor, j: int, L: int) -> torch.Tensor:
    per = -(-t.shape[0] // L)
    return t[j * per : (j + 1) * per].clone()  # an empty slice past the end, as FSDP2's last chunks


def _groups(rank: int, L: int, replica: int) -> SimpleNamespace:
    """What `dcp_shards` asks of a sharded run's collectives, for ranks cut into replicas of L: the
    replica this rank reads, its place among the L ranks, their 1-D mesh, the whole shapes. Every rank
    makes every group (`new_group` is a collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    ranks = [dist.new_group(list(range(first, first + L))) for first in range(0, world, L)]
    return SimpleNamespace(
        replicas=[replica],
        local_rank=rank % L,
        L=L,
        device=torch.device("cpu"),
        mesh=DeviceMesh.from_group(ranks[rank // L], "cpu"),
        whole_shape=lambda name, local: ROWS[name],
    )


def _stub() -> dict:
    """A checkpoint's state as `checkpoint.load` gives it for a DCP folder: the tensors left empty."""
    return {
        "theta": {},
        "outer_momentum": {},
        "inner": [{"m": {}, "v": {}, "step": torch.tensor(3)} for _ in range(R)],
        "round_params": [{} for _ in range(R)],
        "replicas": list(range(R)),
        "outer_optimizer": [
            dict(kept, state={i: {"step": per["step"]} for i, per in kept["state"].items()})
            for kept in _outer_optimizer(lambda part: {n: None for n in part})
        ],
        "pending": {"fragment": PENDING, "mean": "in the shards"},
    }


def _write(rank: int, folder: Path) -> None:
    """4 ranks as R = 2 replicas of L = 2 write their shards."""
    from hypertrain.distributed import dcp_shards

    groups = _groups(rank, 2, rank // 2)
    j, (replica,) = groups.local_rank, groups.replicas

    def cut(part, r=None, axis=False):
        return {n: _cut(t, j, 2).unsqueeze(0) if axis else _cut(t, j, 2) for n, t in _whole(part, r).items()}

    def shard(tensors):
        return {n: _cut(t, j, 2) for n, t in tensors.items()}

    local = {
        "theta": cut("theta"),
        "outer_momentum": cut("outer_momentum"),
        "inner": [{"m": cut("m", replica, True), "v": cut("v", replica, True), "step": torch.tensor(3)}],
        "round_params": [cut("params", replica, True)],
        "replicas": [replica],
        "outer_optimizer": _outer_optimizer(shard),
        "pending": {"fragment": PENDING, "mean": _pending_mean(shard)},
    }
    syncs = [SimpleNamespace(names=names) for names in FRAGMENTS]
    dcp_shards.save(folder, SimpleNamespace(state_dict=lambda: local, syncs=syncs), groups)


def _read(rank: int, folder: Path, L: int, replica: int) -> None:
    """The ranks cut into replicas of L read `replica`'s state and the global one: each its shard."""
    from hypertrain.distributed import dcp_shards

    got = dcp_shards.load_shards(folder, _stub(), _groups(rank, L, replica))
    held = {part: got[part] for part in GLOBAL} | {
        "m": {n: t[0] for n, t in got["inner"][replica]["m"].items()},
        "v": {n: t[0] for n, t in got["inner"][replica]["v"].items()},
        "params": {n: t[0] for n, t in got["round_params"][replica].items()},
    }
    for part, tensors in held.items():
        whole = _whole(part, None if part in GLOBAL else replica)
        assert tensors.keys() == whole.keys(), (part, tensors.keys())
        for n, t in whole.items():
            assert torch.equal(tensors[n], _cut(t, rank % L, L)), (rank, L, part, n)

    def shard(tensors):
        return {n: _cut(t, rank % L, L) for n, t in tensors.items()}

    _assert_outer_optimizer(got["outer_optimizer"], _outer_optimizer(shard))
    assert torch.equal(got["pending"]["mean"], _pending_mean(shard)), (rank, L)
    other = 1 - replica  # the other replica's state: not read
    assert got["inner"][other]["m"] == {} and got["round_params"][other] == {}


def _assert_outer_optimizer(got: list[dict], expected: list[dict]) -> None:
    for mine, kept in zip(got, expected, strict=True):
        assert mine["state"].keys() == kept["state"].keys()
        for i, per in kept["state"].items():
            assert mine["state"][i].keys() == per.keys(), i
            assert all(torch.equal(mine["state"][i][k], t) for k, t in per.items()), i


def _worker(rank: int, folder: str, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    _write(rank, Path(folder))
    dist.barrier()
    for L in (4, 1):  # 4 ranks as one replica of 4 (either replica's state), as four replicas of 1
        for replica in range(R):
            _read(rank, Path(folder), L, replica)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # 4 gloo processes: 29-41 s measured on 2 cores shared at a load average of 13-15
def test_a_dcp_checkpoint_written_at_two_shards_reads_bitwise_at_four_one_and_whole(tmp_path):
    from hypertrain.distributed import dcp_shards

    folder = tmp_path / "ckpt-u0000003.dcp"
    mp.spawn(_worker, args=(str(folder), str(tmp_path / "store")), nprocs=4)  # asserts in every process
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    got = dcp_shards.load_whole(folder, _stub())  # one process, no process group: an unsharded run's read
    for part in GLOBAL:
        assert all(torch.equal(got[part][n], t) for n, t in _whole(part).items()), part
    for r in range(R):
        for moment in ("m", "v"):
            assert all(torch.equal(got["inner"][r][moment][n][0], t) for n, t in _whole(moment, r).items())
        assert all(torch.equal(got["round_params"][r][n][0], t) for n, t in _whole("params", r).items())
        assert got["inner"][r]["step"] == 3
    _assert_outer_optimizer(got["outer_optimizer"], _outer_optimizer(lambda tensors: tensors))
    assert torch.equal(got["pending"]["mean"], _pending_mean(lambda tensors: tensors))
