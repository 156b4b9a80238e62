"""The sync of a sharded run (`processes.shard=true`) against a float64 reference of per-shard DiLoCo
written here (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1: the outer gradient
Delta = theta - mean_m theta_m, then the outer optimizer; its Nesterov momentum as torch.optim.SGD's,
b <- beta b + Delta, theta <- theta - lr (Delta + beta b)).

4 gloo processes as R = 2 replicas of L = 2 ranks (`ShardedReplicaGroups`): each rank holds only its
dim-0 shard of the global weights and of its replica's weights, and `diloco.sync.sync` runs two rounds,
every parameter synced each round. A replica's "inner training" is a fixed step s_{m,k} per round
(seeded here): its weights are theta - s_{m,k} on its shard. The global weights are gathered only at the
end, to compare. The reference steps the whole tensors in float64 from the same fp32 start.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import QUICK, compose_cfg

ROUNDS, R, L = 2, 2, 2
U = 2.0**-24  # fp32's unit roundoff


def _steps(shapes: dict, m: int, k: int) -> dict[str, torch.Tensor]:
    """Replica m's inner step in round k (what it moved away from the global weights), fp32."""
    gen = torch.Generator().manual_seed(100 * m + k)
    return {n: 0.05 * torch.randn(shape, generator=gen) for n, shape in shapes.items()}


def _start(shapes: dict) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {n: torch.randn(shape, generator=gen) for n, shape in shapes.items()}


def _worker(rank: int, cfg, store: str, out: str) -> None:
    from hypertrain.diloco.state import RunState
    from hypertrain.diloco.sync import sync
    from hypertrain.distributed.fsdp_engine import shard_of
    from hypertrain.distributed.layouts import choose_layout
    from hypertrain.distributed.sharded import ShardedReplicaGroups
    from hypertrain.model.shapes import param_shapes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=R * L)
    groups = ShardedReplicaGroups(choose_layout(R * L, R * L, R), rank, torch.device("cpu"), 60.0)
    shapes = {n: tuple(s) for n, s in param_shapes(cfg.model).items()}
    state = RunState.start(cfg, groups.local_part(_start(shapes)), groups.replicas, None)
    (m,), j = groups.replicas, groups.local_rank
    held = {n: t.numel() for n, t in state.theta.items()}
    for k in range(1, ROUNDS + 1):
        step = _steps(shapes, m, k)
        replica = {n: (t - shard_of(step[n], j, L)).unsqueeze(0) for n, t in state.theta.items()}
        sync(cfg, state, [replica], [True], groups)
    whole = groups.whole(state.theta)
    if rank == 0:
        Path(out).write_bytes(pickle.dumps({"theta": whole, "held": held}))
    dist.barrier()
    dist.destroy_process_group()


def _reference(cfg, shapes: dict) -> tuple[dict, float]:
    """Per-shard DiLoCo in float64 (the module docstring), run on whole tensors (each element's arithmetic
    is its shard's); and the largest magnitude any of its intermediates reaches."""
    lr, beta = cfg.outer.lr, cfg.outer.momentum
    theta = {n: t.double() for n, t in _start(shapes).items()}
    b = {n: torch.zeros_like(t) for n, t in theta.items()}
    largest = max(float(t.abs().max()) for t in theta.values())
    for k in range(1, ROUNDS + 1):
        steps = [_steps(shapes, m, k) for m in range(R)]
        for n in theta:
            replicas = [theta[n] - s[n].double() for s in steps]
            delta = theta[n] - sum(replicas) / R
            b[n] = beta * b[n] + delta
            update = delta + beta * b[n]
            theta[n] = theta[n] - lr * update
            for t in (*replicas, delta, b[n], update, theta[n]):
                largest = max(largest, float(t.abs().max()))
    return theta, largest


@pytest.mark.slow  # 4 gloo processes, one thread each: 11 s on 2 cores (measured)
def test_per_shard_diloco_equals_a_float64_reference_of_it(tmp_path):
    """Bound, per element (derived): each round an element goes through 9 fp32 roundings (the replica's
    weights, its pseudo-gradient, the sum over the R = 2 replicas, beta b, + Delta, beta b again, Delta +
    beta b, lr times it, theta minus it), each of at most U times the largest intermediate magnitude M
    (`_reference`'s); an error made in a round reaches the weights amplified by at most
    A = 1 + lr (1 + beta)^2 (through the update and the momentum it joins). Over 2 rounds:
    |fp32 - float64| <= 2 * 9 * A * U * M. The sum of two terms is exact in order, and each element is
    computed by one rank only, so the shards change nothing else."""
    from hypertrain.model.shapes import param_shapes

    cfg = compose_cfg([*QUICK, "logger=none", "processes=dist", "world=4", "replicas=2", "outer=nesterov"])
    assert cfg.outer.nesterov and cfg.outer.momentum > 0  # the reference's Nesterov momentum
    out = tmp_path / "theta.pkl"
    mp.spawn(_worker, args=(cfg, str(tmp_path / "store"), str(out)), nprocs=R * L)  # 4 processes, 1 thread
    got = pickle.loads(out.read_bytes())
    shapes = {n: tuple(s) for n, s in param_shapes(cfg.model).items()}
    # no rank held a whole tensor of more than one row: rank 0 held its shard, ceil(rows / 2) rows
    for n, shape in shapes.items():
        if shape[0] > 1:
            assert got["held"][n] < torch.Size(shape).numel(), n
    ref, largest = _reference(cfg, shapes)
    amplification = 1 + cfg.outer.lr * (1 + cfg.outer.momentum) ** 2
    bound = 2 * 9 * amplification * U * largest
    for n, t in ref.items():
        err = float((got["theta"][n].double() - t).abs().max())
        assert err <= bound, (n, err, bound)
    # and the steps were not trivial: the weights moved far beyond the bound
    moved = max(float((ref[n] - _start(shapes)[n].double()).abs().max()) for n in ref)
    assert moved > 1e4 * bound, (moved, bound)
