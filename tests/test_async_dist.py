"""Asynchronous replicas on real processes (outer.schedule=async with processes=dist, docs/async.md "Real
processes"): every process walks the same arrival schedule and holds the server's state, runs its own
replicas' jobs, and receives each arrival by a broadcast from its replica's process, so the run equals the
one-process simulation bit for bit: every arrival row and weights.pt, for both server rules where a
process trains whole replicas (the replicas layout with two replicas a process, the benchmark layout with
one process per replica), and with int8, top-k with error feedback and low rank with error feedback (the
broadcast carries the payload's bytes, every process decodes them); a run stopped by SIGTERM on rank 1
resumes to it. Under the benchmark layout of
two processes a replica (each trains half of every step, their gradients averaged, as in rounds) the run
equals the simulation within rounding, and a run stopped on rank 3 resumes to it bitwise.

Every test here starts several processes (torchrun's agent and 2 or 4 workers, and the simulation beside
them) on the machine's 2 cores, one torch thread each: each is slow (over 5 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import QUICK, assert_same_weights, entry, resumed
from references import ROUNDING_FACTOR, U32
from test_async import arrivals

SLOW = ["logger=none", "outer.schedule=async", "cluster=h100", "phase.updates=12", "inner.H=2"]
LAYOUTS = {
    # P = 2 does not equal W = 8, and divides R = 4: each process trains two whole replicas (one of them
    # the slow one on rank 1); the loop engine, as the stacked one stacks per process
    "replicas": ["replicas=4", "cluster.replica_speeds=[1,1,1,0.5]", "engine=loop"],
    # P = W = R = 2: one process per replica (L = 1), the default (stacked) engine
    "benchmark": ["world.size=2", "replicas=2", "cluster.replica_speeds=[1,0.5]"],
}


def both(args: list[str], tmp_path: Path, torchrun: int = 2) -> tuple[Path, Path]:
    """The run `args` in one process (tmp_path/sim) and on 2 real processes under torchrun
    (tmp_path/dist); both must finish."""
    sim, real = tmp_path / "sim", tmp_path / "dist"
    done = entry([*args, f"hydra.run.dir={sim}"], tmp_path)
    assert done.returncode == 0, done.stderr
    done = entry([*args, "processes=dist", f"hydra.run.dir={real}"], tmp_path, torchrun=torchrun)
    assert done.returncode == 0, done.stderr
    return sim, real


def assert_equal_runs(got: Path, want: Path, updates: int | None = None) -> None:
    rows = arrivals(want)
    assert len(rows) == (updates or len(rows)) and arrivals(got) == rows
    assert_same_weights(torch.load(got / "weights.pt"), torch.load(want / "weights.pt"))


@pytest.mark.slow
# each rule on one layout: both rules and both layouts are covered in two runs of about 20 s (the rule is
# the server's arithmetic, the same on every process; the layout is who trains and who broadcasts)
@pytest.mark.parametrize(("rule", "layout"), [("naive", "benchmark"), ("delayed_nesterov", "replicas")])
def test_real_processes_equal_the_simulation_bitwise(tmp_path, rule, layout):
    """torchrun, 2 processes, against the one-process simulation of the same run: every arrival row
    (replicas, steps, staleness, losses, clock, held-out losses) and the final weights, exactly."""
    args = [*QUICK, *SLOW, f"outer.arrivals.rule={rule}", *LAYOUTS[layout]]
    sim, real = both(args, tmp_path)
    assert_equal_runs(real, sim)
    assert any(len(r["replicas"]) > 1 for r in arrivals(sim)) == (layout == "replicas")  # ties: a mean
    assert any(max(r["staleness"]) > 0 for r in arrivals(sim))  # the slow replica's jobs are stale


@pytest.mark.slow
def test_two_processes_a_replica_equal_the_simulation_within_rounding_and_resume_bitwise(tmp_path):
    """The benchmark layout with W = 4, R = 2 (L = 2 processes a replica, torchrun's 4 workers): the
    arrival schedule (replicas, steps, first steps, tokens, staleness, clock) exactly, the losses and
    weights within rounding: each step's gradient is the mean of the 2 ranks' halves, not the whole
    batch's. Bound: both paths' rounding (x 2), each at most one U32 per weight relative to its norm
    per inner step (12 a replica, 2 replicas) and per server update (12), x ROUNDING_FACTOR. Then the
    same run on the local launcher's 4 processes, stopped by SIGTERM on rank 3 (the slow replica's
    second rank) before server update 7, resumes to the torchrun run bitwise."""
    args = [*QUICK, *SLOW, "world.size=4", "replicas=2", "cluster.replica_speeds=[1,0.5]"]
    sim, real = both(args, tmp_path, torchrun=4)
    got, want = arrivals(real), arrivals(sim)
    schedule = ("update", "replicas", "steps", "first", "tokens", "staleness", "staleness_mean", "clock_s")
    assert [[r[k] for k in schedule] for r in got] == [[r[k] for k in schedule] for r in want]
    relative = 2 * ROUNDING_FACTOR * (2 * 12 + 12) * U32
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=relative * 10)
        assert ("eval_loss" in a) == ("eval_loss" in b)
        if "eval_loss" in b:
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=relative * 10)
    weights, reference = torch.load(real / "weights.pt"), torch.load(sim / "weights.pt")
    for n, t in reference.items():
        assert float((weights[n].double() - t.double()).norm()) <= relative * float(t.norm()), n
    dist_args = [*args, "processes=dist"]
    run_dir = tmp_path / "run"
    stopped = entry([*dist_args, f"hydra.run.dir={run_dir}"], tmp_path, "3:7:term")
    assert stopped.returncode == 143, stopped.stderr
    resumed(dist_args, run_dir, tmp_path)
    assert_equal_runs(run_dir, real, 12)


CODECS = {
    # int8 travels as top-k does (the payload's bytes, decoded on every process): top-k with its error
    # buffers and low rank with its Q cover the wire
    "topk-ef": ["outer.compress=topk", "outer.topk.fraction=0.125", "outer.error_feedback=true"]
    + ["outer.codec.block=32"],
    "lowrank-ef": ["outer.compress=lowrank", "outer.lowrank.rank=2", "outer.error_feedback=true"],
}


@pytest.mark.slow
@pytest.mark.parametrize("codec", CODECS)
def test_real_processes_with_a_codec_equal_the_simulation_and_resume_from_sigterm_bitwise(tmp_path, codec):
    """docs/async.md "Codecs": torchrun, 2 processes of two replicas each (their error buffers on their
    own process), top-k with error feedback and low rank with error feedback (the server's Q on every
    process, moved by each arrival's decode): every arrival row (payload bits included) and the final
    weights equal the one-process simulation's exactly (the broadcast carries the payload's bytes, which
    every process decodes). Low rank then on the local launcher's 2 processes, SIGTERM to rank 1 before
    server update 7: every process stops after update 7 (exit 143) with a checkpoint holding every
    replica's job in flight and error buffer, gathered from both processes, and the server's Q; resume=true
    ends with the simulation's arrival rows and weights, exactly."""
    args = [*QUICK, *SLOW, *LAYOUTS["replicas"], *CODECS[codec]]
    sim, real = both(args, tmp_path)
    assert_equal_runs(real, sim, updates=12)
    n = sum(t.numel() for t in torch.load(sim / "weights.pt").values())
    assert all(0 < bits < 32 * n for r in arrivals(sim) for bits in r["payload_bits"])  # compressed
    if codec != "lowrank-ef":
        return
    dist_args = [*args, "processes=dist", "processes.nproc=2"]
    run_dir = tmp_path / "run"
    stopped = entry([*dist_args, f"hydra.run.dir={run_dir}"], tmp_path, "1:7:term")
    assert stopped.returncode == 143, stopped.stderr
    assert not (run_dir / "weights.pt").exists()
    saved = torch.load(run_dir / "checkpoints" / "ckpt-u0000007.pt", weights_only=False)["state"]
    assert saved["async"]["applied"] == 7 and len(saved["async"]["flying"]) == 4
    assert len(saved["errors"]) == 4 and all(any(t.any() for t in e.values()) for e in saved["errors"])
    assert saved.get("lowrank_q") is not None
    resumed(dist_args, run_dir, tmp_path)
    assert_equal_runs(run_dir, sim, 12)
