"""The network clock of a sharded replica (`processes.shard=true`, docs/clock.md): FSDP2's per-unit
all-gathers and reduce-scatters on the intra link, against a float64 statement of the formula written
here from the model's parameter names; the outer sync timed as the benchmark layout's (one model's
bytes per replica, 1/L per rank); a config without `processes.shard` unsharded. All in-process.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from hypertrain.clock.formulas import Link, reduce_scatter_s, ring_allreduce_s, sharded_inner_s
from hypertrain.clock.replay import clock_of
from hypertrain.clock.timeline import FP32_BYTES, Clock, Shape
from hypertrain.config import ClusterConfig, LinkConfig, TrainConfig
from hypertrain.model.shapes import count_params, param_shapes
from hypertrain.preflight.checked import resolved_config
from hypertrain.records.rows import SyncRow, UpdateRow

# Each clock value is a sum of at most ~20 float64 terms, each a product/quotient of a few numbers,
# computed here in another order: every operation rounds by at most 2^-53 relative, so the two
# statements differ by at most ~(20 + 4 * 20) * 2^-53 ~ 1.1e-14 relative; 1e-13 bounds it.
REL = 1e-13


def _cfg(layers: int = 3, world: int = 8, replicas: int = 2, shard: bool = True) -> TrainConfig:
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, replicas=replicas, model=dataclasses.replace(cfg.model, n_layers=layers))
    cfg = dataclasses.replace(cfg, world=dataclasses.replace(cfg.world, size=world))
    return dataclasses.replace(cfg, processes=dataclasses.replace(cfg.processes, shard=shard))


def _cluster(model_params: int = 0) -> ClusterConfig:
    """Measured compute fed zero seconds: the clock of an update is its communication alone."""
    intra = LinkConfig("test", bandwidth_gbit=8e-6, latency_us=3000.0)  # 1000 B/s, 3 ms a message
    cluster = ClusterConfig(name="test", intra=intra, model_params=model_params)
    cluster.check()
    return cluster


def _units(cfg: TrainConfig) -> tuple[int, int]:
    """(root, block) parameters from the parameter names: the root every name outside `layers.`, a
    block layer 0's names."""
    shapes = param_shapes(cfg.model)
    root = sum(math.prod(s) for n, s in shapes.items() if not n.startswith("layers."))
    block = sum(math.prod(s) for n, s in shapes.items() if n.startswith("layers.000."))
    return root, block


def _by_hand(root: float, block: float, layers: int, K: int, L: int, alpha: float, beta: float) -> float:
    """FSDP2 with one unit per layer, then the root: every message of a ring collective over L ranks is
    one rank's 1/L of its unit's bytes (Thakur et al. 2005), L - 1 of them per collective. Per
    microbatch: each block gathered twice (forward, backward), the root once; per update: one
    reduce-scatter per unit."""
    messages = []  # (collectives, bytes of a unit)
    messages += [(K * 1, root), (K * 2 * layers, block)]  # all-gathers
    messages += [(1, root), (layers, block)]  # reduce-scatters
    return sum(count * (L - 1) * (alpha + (FP32_BYTES * b / L) / beta) for count, b in messages)


def test_reduce_scatter_and_the_sharded_inner_step_by_hand():
    link = Link(bandwidth=100.0, latency=0.25)
    assert reduce_scatter_s(400, 4, link) == pytest.approx(3 * (0.25 + 1.0))  # 3 steps of 100 bytes
    assert reduce_scatter_s(400, 1, link) == sharded_inner_s(400, 800, 2, 3, 1, link) == 0.0
    # root 400 B, 2 blocks of 800 B, L 2, K 3: gathers 3 * (1 * (0.25 + 2) + 4 * (0.25 + 4)) = 57.75;
    # reduce-scatters (0.25 + 2) + 2 * (0.25 + 4) = 10.75
    assert sharded_inner_s(400, 800, 2, 3, 2, link) == pytest.approx(57.75 + 10.75)


@pytest.mark.parametrize("model_params", [0, 10**9])
def test_a_sharded_updates_clock_is_fsdp2s_collectives_per_unit(model_params):
    """L = 4, 3 layers, 5 microbatches; at the trained size and rescaled to 1e9 parameters (every
    byte times N / the run's parameters, latencies not)."""
    cfg, cluster = _cfg(layers=3), _cluster(model_params)
    shape = Shape.of(dataclasses.asdict(cfg))
    n = count_params(cfg.model)
    root, block = _units(cfg)
    assert root + 3 * block == n and root > 0 and block > 0
    clock = Clock(shape, cluster, n, model_params or None)
    row = UpdateRow(update=1, round=0, loss=[1.0, 1.0], tokens=64, grad_accum=5, rank_seconds=[0.0] * 8)
    scale = (model_params or n) / n
    alpha, beta = 3e-3, 1000.0
    expected = _by_hand(root * scale, block * scale, 3, 5, 4, alpha, beta)
    assert clock.update(row) == pytest.approx(expected, rel=REL)
    assert clock.inner_s == clock.total_s
    unsharded = ring_allreduce_s(FP32_BYTES * n * scale, 4, Link(beta, alpha))
    assert expected != pytest.approx(unsharded, rel=1e-3)  # the formula chosen is told apart


def test_a_config_without_processes_shard_is_unsharded_and_keeps_the_ring():
    resolved = dataclasses.asdict(_cfg(shard=False))
    assert Shape.of(resolved).blocks == 0
    del resolved["processes"]["shard"]  # written before the field
    shape = Shape.of(resolved)
    assert (shape.blocks, shape.block_params) == (0, 0)
    n = count_params(_cfg().model)
    clock = Clock(shape, _cluster(), n)
    row = UpdateRow(update=1, round=0, loss=[1.0, 1.0], tokens=64, grad_accum=5, rank_seconds=[0.0] * 8)
    # the ring's 2(L-1) messages of 4N/L bytes, L = 4
    assert clock.update(row) == pytest.approx(6 * (3e-3 + FP32_BYTES * n / 4 / 1000.0), rel=REL)


def test_the_sharded_sync_is_timed_as_the_benchmark_layouts_and_the_replay_reads_the_shard():
    """A sharded run's sync row holds the whole replica's `params` (its L ranks each all-reduce 1/L over
    its cross-replica group): the same seconds as the unsharded benchmark layout's row. The replay
    from config.yaml's containers (strings for enums) times its updates as the running clock does."""
    n = count_params(_cfg().model)
    sync = SyncRow(update=1, round=0, taken_at=1, params=n, comm_outer_bytes=1)
    splits = []
    for shard in (True, False):
        clock = Clock(Shape.of(dataclasses.asdict(_cfg(shard=shard))), _cluster(), n)
        splits.append(clock.sync(sync))
    assert splits[0] == splits[1]
    inter = ClusterConfig().inter  # R = 2: 2 messages of 4N/2 bytes
    assert splits[0]["clock_outer_exposed_s"] == pytest.approx(
        2 * (inter.latency + FP32_BYTES * n / 2 / inter.bandwidth), rel=REL
    )
    update = {"kind": "update", "update": 1, "round": 0, "loss": [1.0, 1.0], "tokens": 64, "grad_accum": 2}
    rows = [update | {"rank_seconds": [0.0] * 8}, {"kind": "summary", "model/params": n}]
    replayed = clock_of(rows, resolved_config(_cfg()), _cluster())
    root, block = _units(_cfg())
    assert replayed["total_s"] == pytest.approx(_by_hand(root, block, 3, 2, 4, 3e-3, 1000.0), rel=REL)
