"""A sharded run's checkpoint tensors through torch.distributed.checkpoint (`distributed.dcp_shards`):
written by 4 gloo processes as 2 replicas of L = 2 shards; read back by the same 4 processes as one
replica of L = 4 (each replica's state in turn: a run at world.size 8 holds two such replicas, each
reading its own, as here), and as replicas of L = 1 (each rank's shard is the whole tensor); read
whole by one process with no process group (how an unsharded run reads it); and a single file's whole
state cut to the shards of L = 2 and 4 (how a sharded run resumes from an unsharded run's checkpoint).

The expected shards are cut here, independently of the code under test, as FSDP2 cuts a parameter:
rows [j * ceil(n / L), (j + 1) * ceil(n / L)) of the whole tensor, empty past its end; a flat vector
over a fragment's parameters (a reduction's mean, what a replica took) is each parameter's shard,
flattened, in the fragment's order. Every tensor kind a checkpoint holds is there: the global weights,
the outer momentum, a torch.optim outer optimizer's moments per fragment (its step count a scalar), a
pending reduction's mean (outer.delay), each replica's inner moments, mid-round weights and
error-feedback buffers, and outer.overlap's state: what each replica took for a reduction in flight and
its error buffers before, and eager's own outer weights, momentum and Adam state per replica. Rows that
L = 2 and L = 4 cut unevenly (7 rows: 4 + 3 and 2 + 2 + 2 + 1; 3 rows at L = 4: 1 + 1 + 1 and an empty
shard). Only bytes move, so bitwise: every tensor of the expected state, and no other, is compared.
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
FRAGMENTS = [["emb", "norm"], ["head"]]  # each fragment's parameters, in order
PENDING = 1  # the fragment whose reduction is in flight (outer.delay)
FLIGHT = 0  # the fragment whose reduction is in flight a whole round (outer.overlap)


def _whole(part: str, replica: int | None = None) -> dict[str, torch.Tensor]:
    """The whole tensors of `part` (of `replica`), distinct for each: what the checkpoint must hold."""
    gen = torch.Generator().manual_seed(sum(map(ord, part)) + 1000 * (0 if replica is None else replica + 1))
    return {n: torch.randn(shape, generator=gen) for n, shape in ROWS.items()}


def _cut(t: torch.Tensor, j: int, L: int) -> torch.Tensor:
    per = -(-t.shape[0] // L)
    return t[j * per : (j + 1) * per].clone()  # an empty slice past the end, as FSDP2's last chunks


def _adam(part: str, shard, replica: int | None, axis: bool) -> list[dict]:
    """Adam's state per fragment as `state_dict()` gives it (parameters by index), each moment `shard`
    cut (with a replica axis of 1 when `axis`); its step count a scalar."""
    moments = {k: _whole(f"{part}-{k}", replica) for k in ("exp_avg", "exp_avg_sq")}

    def one(t):
        return shard(t).unsqueeze(0) if axis else shard(t)

    return [
        {
            "state": {
                i: {"step": torch.tensor(5.0), **{k: one(m[n]) for k, m in moments.items()}}
                for i, n in enumerate(names)
            },
            "param_groups": [{"lr": 0.01, "params": list(range(len(names)))}],
        }
        for names in FRAGMENTS
    ]


def _flat(part: str, fragment: int, shard, replica: int | None = None) -> torch.Tensor:
    """A flat vector over `fragment`'s parameters: each one's `shard`, flattened, in order."""
    whole = _whole(part, replica)
    return torch.cat([shard(whole[n]).reshape(-1) for n in FRAGMENTS[fragment]])


def _state(shard, mine: list[int]) -> dict:
    """The run state (`RunState.state_dict`'s form, R replicas) with every sharded tensor `shard` cut;
    the replicas not in `mine` as a rank that does not read them holds them: no tensors but the scalars."""

    def part(name, r=None, axis=False):
        return {n: shard(t).unsqueeze(0) if axis else shard(t) for n, t in _whole(name, r).items()}

    def scalars_only(states):
        return [dict(s, state={i: {"step": per["step"]} for i, per in s["state"].items()}) for s in states]

    def own(r):
        kept = {"theta": part("own-theta", r, True), "momentum": part("own-momentum", r, True)}
        return kept | {"optimizer": _adam("own", shard, r, True)}

    def other(r):
        return {"theta": {}, "momentum": {}, "optimizer": scalars_only(_adam("own", shard, r, True))}

    return {
        "theta": part("theta"),
        "outer_momentum": part("outer_momentum"),
        "outer_optimizer": _adam("outer", shard, None, False),
        "pending": {"fragment": PENDING, "mean": _flat("pending", PENDING, shard)},
        "inner": [
            {"m": part("m", r, True), "v": part("v", r, True), "step": torch.tensor(3)}
            if r in mine
            else {"m": {}, "v": {}, "step": torch.tensor(3)}
            for r in range(R)
        ],
        "round_params": [part("params", r, True) if r in mine else {} for r in range(R)],
        "errors": [part("errors", r, True) if r in mine else {} for r in range(R)],
        "in_flight": [
            {
                "fragment": FLIGHT,
                "taken_at": 2,
                "stepped": [True] * R,
                "taken": [_flat("taken", FLIGHT, shard, r) if r in mine else None for r in range(R)],
                "errors_before": [_flat("before", FLIGHT, shard, r) if r in mine else None for r in range(R)],
            }
        ],
        "outer_replicas": [own(r) if r in mine else other(r) for r in range(R)],
        "replicas": list(range(R)),
    }


def _local(state: dict, replica: int) -> dict:
    """What a rank of `replica` holds of `state` (`RunState.state_dict()` without gathered records)."""
    per_replica = ("inner", "round_params", "errors", "outer_replicas")
    local = dict(state, **{k: [state[k][replica]] for k in per_replica}, replicas=[replica])
    local["in_flight"] = [
        dict(x, stepped=[True], taken=[x["taken"][replica]], errors_before=[x["errors_before"][replica]])
        for x in state["in_flight"]
    ]
    return local


def _stub() -> dict:
    """A checkpoint's state as `checkpoint.load` gives it for a DCP folder: the run.pt the writer wrote."""
    from hypertrain.distributed import dcp_shards

    state = _state(lambda t: t, list(range(R)))
    records = [
        dcp_shards.light_record(
            {
                "inner": state["inner"][r],
                "params": state["round_params"][r],
                "errors": state["errors"][r],
                "in_flight": {
                    FLIGHT: {
                        "taken": state["in_flight"][0]["taken"][r],
                        "errors_before": state["in_flight"][0]["errors_before"][r],
                        "stepped": True,
                    }
                },
                "outer": state["outer_replicas"][r],
            }
        )
        for r in range(R)
    ]
    light = dcp_shards.without_shards(state)
    light["inner"] = [x["inner"] for x in records]
    light["round_params"], light["errors"] = [x["params"] for x in records], [x["errors"] for x in records]
    light["outer_replicas"] = [x["outer"] for x in records]
    (flight,) = state["in_flight"]
    mine = [x["in_flight"][FLIGHT] for x in records]
    light["in_flight"] = [
        dict(flight, taken=[x["taken"] for x in mine], errors_before=[x["errors_before"] for x in mine])
    ]
    return light


def _tensors(tree, path=()) -> dict:
    """Every tensor of a nested state, by its path."""
    if torch.is_tensor(tree):
        return {path: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    return {p: t for k, v in items for p, t in _tensors(v, (*path, str(k))).items()}


def _assert_same(got: dict, expected: dict, what) -> None:
    mine, theirs = _tensors(got), _tensors(expected)
    assert mine.keys() == theirs.keys(), (what, sorted(mine.keys() ^ theirs.keys()))
    for path, t in theirs.items():
        assert torch.equal(mine[path], t), (what, path)


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


def _write(rank: int, folder: Path) -> None:
    """4 ranks as R = 2 replicas of L = 2 write their shards."""
    from hypertrain.distributed import dcp_shards

    groups = _groups(rank, 2, rank // 2)
    j, (replica,) = groups.local_rank, groups.replicas
    local = _local(_state(lambda t: _cut(t, j, 2), [replica]), replica)
    syncs = [SimpleNamespace(names=names) for names in FRAGMENTS]
    dcp_shards.save(folder, SimpleNamespace(state_dict=lambda: local, syncs=syncs), groups)


def _read(rank: int, folder: Path, L: int, replica: int) -> None:
    """The ranks cut into replicas of L read `replica`'s state and the global one: each its shard."""
    from hypertrain.distributed import dcp_shards

    got = dcp_shards.load_shards(folder, _stub(), _groups(rank, L, replica))
    _assert_same(got, _state(lambda t: _cut(t, rank % L, L), [replica]), (rank, L, replica))


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
    _assert_same(got, _state(lambda t: t, list(range(R))), "whole")


@pytest.mark.parametrize("L", [2, 4])
def test_a_single_files_whole_state_is_cut_to_each_ranks_shards(L):
    """`dcp_shards.cut`: what a sharded run of L ranks a replica holds on resuming from an unsharded
    run's single file, every replica's state cut (the run then reads its own)."""
    from hypertrain.distributed import dcp_shards

    whole = _state(lambda t: t, list(range(R)))
    for j in range(L):
        got = dcp_shards.cut(whole, FRAGMENTS, j, L)
        _assert_same(got, _state(lambda t, j=j: _cut(t, j, L), list(range(R))), (j, L))
