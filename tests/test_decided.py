"""What a config decides is decided in one place (`hypertrain.distributed.decided`): the layout, the
device, torch.distributed's backend and the sync's reduction; the preflight's `validate` returns it,
and nothing after chooses a layout again."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from helpers import REPO

from hypertrain.config import CodecConfig, OuterConfig, ProcessesConfig, TrainConfig, WorldConfig
from hypertrain.distributed.decided import decide
from hypertrain.distributed.layouts import LayoutError
from hypertrain.preflight.checks import validate


def dist(world: int, replicas: int, nproc: int = 0, **processes) -> TrainConfig:
    return TrainConfig(
        world=WorldConfig(size=world),
        replicas=replicas,
        processes=ProcessesConfig(name="dist", nproc=nproc, **processes),
    )


def test_one_process_decides_no_layout_and_no_backend():
    decided = decide(TrainConfig())
    assert (decided.layout, decided.backend) == (None, None)
    assert (decided.device, decided.reduction) == ("cpu", "exact")
    assert decided.processes == 1


def test_the_layout_holds_the_world_and_replica_arithmetic():
    assert decide(dist(4, 2)).layout.kind == "benchmark"  # P = W
    replicas = decide(dist(4, 4, nproc=2)).layout
    assert (replicas.kind, replicas.processes, replicas.replicas_of(1)) == ("replicas", 2, [2, 3])
    assert decide(dist(4, 4), processes=2).layout.processes == 2  # a SLURM job's tasks as P
    with pytest.raises(LayoutError, match="fits no layout"):
        decide(dist(4, 4, nproc=3))


def test_auto_backend_is_nccl_on_cuda_else_gloo_and_a_chosen_one_is_kept():
    cfg = dist(2, 2)
    cuda = replace(cfg, engine=replace(cfg.engine, device="cuda"))
    assert decide(cfg).backend == "gloo"
    assert decide(cuda).backend == "nccl"
    assert decide(replace(cuda, processes=replace(cuda.processes, backend="gloo"))).backend == "gloo"


def test_a_worker_takes_its_local_ranks_device():
    cfg = dist(2, 2)
    assert decide(cfg).on_rank(1).device == "cpu"
    assert decide(replace(cfg, engine=replace(cfg.engine, device="cuda"))).on_rank(1).device == "cuda:1"


@pytest.mark.parametrize(
    ("compress", "reduce", "reduction"),
    [("none", "gather", "exact"), ("int8", "gather", "gather"), ("int8", "two_phase", "two_phase")],
)
def test_the_reduction_is_exact_without_a_codec_else_outer_codec_reduce(compress, reduce, reduction):
    outer = OuterConfig(compress=compress, codec=CodecConfig(reduce=reduce))
    assert decide(TrainConfig(outer=outer)).reduction == reduction


def test_validate_returns_what_the_config_decides():
    cfg = dist(4, 4, nproc=2)
    assert validate(cfg) == decide(cfg)


def test_a_layout_is_chosen_in_one_place():
    calls = {
        str(path.relative_to(REPO))
        for path in (REPO / "hypertrain").rglob("*.py")
        if re.search(r"(?<!def )\bchoose_layout\(", path.read_text())
    }
    assert calls == {"hypertrain/distributed/decided.py"}
