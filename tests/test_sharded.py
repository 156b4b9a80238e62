"""Sharded replicas (`processes.shard=true`, docs/distributed.md "Sharded replicas") on real processes.

Parity. W = 4, R = 2 (L = 2 ranks per replica), the tiny decoder with AdamW and its gradient clip,
variable-length documents, H = 2, 5 updates (3 syncs), the last a tail of one id (replica 1 skips it,
rank 1 of replica 0 has none: it adds FSDP2's zeros). The sharded run must equal the unsharded
benchmark-layout run of the same config **bitwise** (per-replica losses, held-out losses, weights.pt):
- a block's forward and backward are the same code on the same (all-gathered) weights and the same
  microbatches; a rank's gradient sums its microbatches in the same order (FSDP2 reduces once, at the
  last microbatch);
- FSDP2 on gloo reduces by a sum, then divides by L (`set_force_sum_reduction_for_comms`), as layout (a)'s
  all-reduce and `/ L`: with L = 2 the sum is one addition of two terms (commutative, so exact whatever
  the order) and the division by 2 exact;
- AdamW is elementwise, so its step on a shard is the step on those elements of the whole tensor;
- the sync's sum over the R = 2 replicas is per element, as in layout (a)'s sharded sync;
- the one reordering is the clip's float64 sum of squares (per shard, then over the L ranks), which
  rounds to a float32 norm: that is where the two runs could differ by one float32 ulp of the norm, and
  did not here (a deterministic difference would fail this test every time, not now and then).
The same for Streaming DiLoCo (two fragments, outer.delay 1: the sync's reduction in flight while the
replica trains), and for Muon (each shape's matrices all-gathered for its Newton-Schulz step, the same
batched call on the same matrices as unsharded) with torch.optim.Adam as the outer optimizer and the
averaged inner state; and for outer.overlap, delayed with churn and eager (each replica's own outer
weights per shard; their mean on the cross-replica group's twin sums the same R terms as the unsharded
benchmark layout does on its own); and for the codecs on the gather path (top-k with tiles, top-k on DCT
coefficients: every tensor gathered whole and encoded as unsharded). The first case also equals the
simulation within test_dist's bound (twice the fp32 simulation's own error against the float64
reference, or its floor), which is how layout (a) is proved equal to the simulation.

Checkpoints: a sharded run killed mid-round restarts bitwise from its DCP checkpoint (one shard file per
rank), which also resumes unsharded bitwise, and at another world.size (L = 4) within the simulation's
bound; so does one killed with Streaming DiLoCo's reduction in flight and Adam's outer state (both
written as shards), and the unsharded run's single file of that moment resumes sharded bitwise; and one
with outer.overlap=eager's terms in flight, its replicas' own outer weights and Adam state as shards.

Refusals: what is not built with processes.shard is one line, exit 2, naming the option.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import (
    DIST,
    compose_cfg,
    entry,
    finish,
    rounding_floors,
    shard_norm_bound,
    simulated_beside,
    start_entry,
)
from references import assert_losses_within_rounding, assert_within_rounding
from test_dist import tail_offset

from hypertrain.distributed import dcp_shards
from hypertrain.preflight import memory
from hypertrain.rundir import checkpoint
from hypertrain.rundir.records import read_metrics

SHARDED = [
    *DIST,
    "world=4",
    "replicas=2",
    "data.examples=documents",
    "data.max_len=64",
    "data.max_examples=4",
    "inner.H=2",
    "phase.updates=5",
    "checkpoint.every=0",
]


def _records(run_dir):
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "finished", rows[-1]
    losses = [r["loss"] for r in rows if r["kind"] == "update"]
    evals = [r["eval_loss"] for r in rows if r["kind"] in ("eval", "sync") and r.get("eval_loss") is not None]
    syncs = [r for r in rows if r["kind"] == "sync"]
    return losses, evals, syncs, torch.load(run_dir / "weights.pt")


def assert_update_figures_equal(tmp_path, figures: tuple[str, ...], updates: int) -> None:
    """The update rows' `figures` of the sharded run (`s`) and the unsharded one (`w`): bitwise equal,
    `updates` of them."""
    rows = [
        [
            [r[k] for k in figures]
            for r in read_metrics(tmp_path / where / "metrics.jsonl")
            if r["kind"] == "update"
        ]
        for where in ("s", "w")
    ]
    assert rows[0] == rows[1] and len(rows[0]) == updates, rows


def equal_side_by_side(tmp_path, overrides, while_running=None):
    """The sharded run of `overrides` and the unsharded one side by side, their per-replica and held-out
    losses and weights.pt bitwise equal: each one's `_records`, and what `while_running(sharded)` gave
    meanwhile (the simulation beside it), or None."""
    sharded = start_entry([*overrides, "processes.shard=true", f"hydra.run.dir={tmp_path / 's'}"], tmp_path)
    whole = start_entry([*overrides, f"hydra.run.dir={tmp_path / 'w'}"], tmp_path)
    meanwhile = None if while_running is None else while_running(sharded)
    for proc in (sharded, whole):
        done = finish(proc)
        assert done.returncode == 0, done.stderr[-3000:]
    mine, theirs = _records(tmp_path / "s"), _records(tmp_path / "w")
    assert mine[:2] == theirs[:2]  # the per-replica losses, the held-out losses
    weights, w_weights = mine[3], theirs[3]
    assert set(weights) == set(w_weights) and all(torch.equal(weights[n], w_weights[n]) for n in w_weights)
    return mine, theirs, meanwhile


# Streaming DiLoCo on shards: two fragments, each pseudo-gradient taken one update before it lands (its
# all-reduce over the cross-replica group in flight while FSDP2 trains on the replica group), H 4, 8 updates.
STREAMING = [
    *SHARDED[:-4],
    "inner.H=4",
    "outer.fragments=2",
    "outer.delay=1",
    "phase.updates=8",
    "checkpoint.every=0",
]
# Muon (its matrices gathered, one shape at a time, for the step), a torch.optim outer optimizer stepping
# the shards (.grad on the local shard) and the averaged inner state (moments summed per shard).
MUON = [
    *DIST,
    "world=4",
    "replicas=2",
    "inner.H=2",
    "phase.updates=4",
    "checkpoint.every=0",
    "inner=muon",
    "outer.optimizer=torch.optim.Adam",
    "outer.lr=0.01",
    "inner.state_policy=average",
]
# The tail case: 3 ids a replica an update, microbatches of at most 65 padded ids, so one rank of a replica
# cuts two microbatches where the other cuts one (layout (a) lets counts differ; FSDP2's all-gathers are
# collectives: the ranks run the most, the other a zero-weight one; without it the run timed out here), and
# the stream's end leaves 1 id for the last update (a replica that skips it, a rank without ids).
UNEVEN = [*SHARDED, "phase.global_batch=6", "data.max_padded_tokens=65"]
# outer.overlap on shards (docs/overlap.md): each sync's reduction in flight a whole round over the
# cross-replica group; delayed with churn (replica 0's two ranks idle through round 2, replica 1 misses
# round 3: who contributes is the plan's, the same on a replica's every rank); eager (each replica's own
# outer weights, their mean taken per shard on the cross-replica group's twin beside the reduction).
OVERLAP = [*SHARDED[:-2], "phase.updates=8", "checkpoint.every=0"]
DELAYED_CHURN = [*OVERLAP, "outer.overlap=delayed", "churn.events=[2:0:leave,3:0:rejoin,3:1:miss]"]
# ... of the mixture of experts (model=moe_tiny: 4 experts a layer, top 2): each expert tensor [E, ...] cut
# along its experts by FSDP2, the router's columns averaged over the replica's ranks with the loss (layout
# (a)'s), so its update rows' router figures are the unsharded run's.
DELAYED_CHURN_MOE = [*DELAYED_CHURN, "model=moe_tiny"]
EAGER = [*OVERLAP[:-2], "phase.updates=4", "checkpoint.every=0", "outer.overlap=eager"]
# A codec whose blocks shards cannot cut, on the gather path: every tensor all-gathered in the replica,
# encoded whole as unsharded (the same blocks, tile order and DCT), each of a replica's L ranks sending the
# whole payload over its cross-replica group (so L times the unsharded run's bytes), its own values kept of
# the decoded mean and of the error-feedback update. SparseLoCo's 4 x 4 tiles with top-k and error feedback;
# top-k on the DCT's coefficients (DeMo's).
TOPK_TILES = [*SHARDED[:-2], "phase.updates=4", "checkpoint.every=0", "outer.compress=topk"]
TOPK_TILES += [
    "outer.codec.tile=4",
    "outer.codec.block=16",
    "outer.topk.fraction=0.125",
    "outer.error_feedback=true",
]
DCT_TOPK = [*SHARDED[:-2], "phase.updates=4", "checkpoint.every=0", "outer.compress=topk"]
DCT_TOPK += ["outer.codec.transform=dct", "outer.topk.fraction=0.05", "outer.error_feedback=true"]
CASES = {  # name: (kind, overrides; None: the tail case's, with its offset)
    "documents-tail": ("tail", None),
    "fragments2-delay1": ("streaming", STREAMING),
    "muon-adam-average": ("muon", MUON),
    "overlap-delayed-churn-moe": ("delayed-churn-moe", DELAYED_CHURN_MOE),
    "overlap-eager": ("eager", EAGER),
    "topk-tiles-ef": ("gathered", TOPK_TILES),
    "dct-topk-ef": ("gathered", DCT_TOPK),
}


@pytest.mark.slow  # two 4-process runs on real processes, 64-90 s each case on 2 cores (measured)
@pytest.mark.parametrize("name", list(CASES))
def test_a_sharded_run_equals_the_unsharded_benchmark_layout_run_bitwise(tmp_path, name):
    kind, overrides = CASES[name]
    streaming = kind != "tail"  # compared with the unsharded run alone
    overrides = overrides or [*UNEVEN, tail_offset(UNEVEN, 1)]
    cfg = compose_cfg(overrides)
    (losses, evals, syncs, weights), (_, _, w_syncs, w_weights), simulated = equal_side_by_side(
        tmp_path, overrides, None if streaming else lambda sharded: simulated_beside(sharded, cfg)
    )
    # the sync rows' figures are the whole replica's (norms over the shards; bytes per replica)
    for mine, theirs in zip(syncs, w_syncs, strict=True):
        for key in ("params", "replicas_synced"):
            assert mine[key] == theirs[key], key
        L = 2 if kind == "gathered" else 1  # the gather path: each of the L ranks sends the whole payload
        for key in ("comm_outer_bytes", "payload_bytes"):
            assert mine.get(key) == (None if theirs.get(key) is None else L * theirs[key]), key
        bound = shard_norm_bound(theirs["params"])
        assert mine["pseudo_grad_norm"] == pytest.approx(theirs["pseudo_grad_norm"], rel=bound, abs=0)
        if theirs.get("outer_spread") is not None:  # eager: a ratio of two such norms, each within `bound`
            assert mine["outer_spread"] == pytest.approx(theirs["outer_spread"], rel=2 * bound, abs=0)
    if kind == "delayed-churn-moe":  # the router's figures of every update, bitwise (averaged as the loss)
        figures = ("loss/router_aux", "experts/min_fraction", "experts/max_fraction")
        assert_update_figures_equal(tmp_path, figures, 8)
        # the churn was exercised: a sync that replica 0 sat out
        assert any(row["replicas_synced"] == 1 for row in w_syncs), [r["replicas_synced"] for r in w_syncs]
    # The summary's per-rank bytes (rank 0's): 1/L of the whole, plus at most one dim-0 slice per tensor
    # (FSDP2's uneven cut); the gradients as the weights, AdamW's m and v twice them (Muon keeps no v).
    summary = {
        k: v
        for r in read_metrics(tmp_path / "s" / "metrics.jsonl")
        if r["kind"] == "summary"
        for k, v in r.items()
    }
    whole_bytes = 4 * sum(t.numel() for t in w_weights.values())
    slices = 4 * sum(t.numel() // t.shape[0] for t in w_weights.values())
    assert whole_bytes / 2 <= summary["memory/rank_weights_bytes"] <= whole_bytes / 2 + slices
    # the preflight's estimate counts the same shards from the shapes (preflight/memory.py)
    estimate = memory.estimate(compose_cfg([*overrides, "processes.shard=true"]))
    assert estimate.rank_weights == summary["memory/rank_weights_bytes"]
    assert summary["memory/rank_gradients_bytes"] == summary["memory/rank_weights_bytes"]
    if kind != "muon":
        assert summary["memory/rank_inner_state_bytes"] == 2 * summary["memory/rank_weights_bytes"]
    if kind == "streaming":  # the held-out losses are the eval rows' (2 rounds x 2 fragments)
        assert len(syncs) >= 4 and len(evals) == 3, (len(syncs), len(evals))
    if streaming:
        return
    assert sum(x is not None for x in losses[-1]) == 1  # the tail was exercised

    assert_equals_the_simulation(cfg, simulated, losses, evals, weights)


def assert_equals_the_simulation(cfg, simulated, losses, evals, weights) -> None:
    """Equal to the simulation as layout (a) is (tests/test_dist.py's bound)."""
    batches, ref, sim, run = simulated
    ref_losses, ref_evals, ref_theta = ref
    sim_losses, sim_evals, sim_theta = sim
    loss_floor, weight_floor = rounding_floors(cfg, batches, len(ref_losses))
    heldout_floor = rounding_floors(cfg, [run.heldout], 1)[0]
    assert_losses_within_rounding(losses, sim_losses, ref_losses, loss_floor)
    rows = lambda xs: [[x] for x in xs]  # noqa: E731
    assert_losses_within_rounding(rows(evals), rows(sim_evals), rows(ref_evals), heldout_floor)
    for n, t in ref_theta.items():
        assert_within_rounding(weights[n], sim_theta[n], t, weight_floor * float(t.norm()), n)


# Checkpoints: H 2, 6 updates, a checkpoint after every update (the mid-round ones hold the round's
# weights too), all kept; rank 1 (replica 0's second shard) killed (SIGKILL) as the second half of round 2
# starts, after the mid-round checkpoint of update 3; the run restarts its ranks itself (max_restarts).
RESUMED = [
    *SHARDED[:-3],
    "inner.H=2",
    "phase.updates=6",
    "processes.timeout_s=5",
    "checkpoint.every_updates=1",
    "checkpoint.keep=10",
    "processes.max_restarts=1",
]
SHARD_FILES = [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "run.pt"]
# A Hugging Face Llama (model=hf_llama_tiny: d 64, 2 layers, SwiGLU 176) with int8 and error feedback: the
# tail config, 4 updates (2 syncs), a checkpoint after each. Its norms (64 values: one int8 block of the
# 128-value width) are cut 32 + 32 at L = 2, so both ranks gather them and encode the straddling block;
# every matrix's shard boundary (2048, 5632, 8192 values) is a block's. One case for both (the budget).
HF_INT8 = [
    *SHARDED[:-2],
    "model=hf_llama_tiny",
    "phase.updates=4",
    "checkpoint.every=1",
    "outer.compress=int8",
    "outer.error_feedback=true",
]


@pytest.mark.slow  # two 4-process runs side by side, about 60 s on 2 cores (measured)
def test_a_sharded_hf_llama_with_int8_and_error_feedback_equals_the_unsharded_run_bitwise(tmp_path):
    """The Llama sharded per decoder layer then the root: its forward and backward are the module's own
    code on the same all-gathered weights (`hf.logits` calls the same module with the same weights
    unsharded), the rest as for the own decoder above (the same reduce-scatter of two terms at L = 2).
    int8 stays bitwise because every block holds the same values in both runs: a shard boundary on a
    block boundary leaves the block whole in one shard, and a block it cuts is encoded whole from the
    gathered tensor by each rank holding part of it (the same kernel on the same values: the same scale
    and codes); the decoded values, the error feedback e <- x - d and the mean over the replicas (summed
    per element in replica order, over the cross-replica group) are elementwise, the same operations on
    the same numbers. The compression error's two norms are summed over the shards (a float64
    reordering, then rounded to fp32), hence approx at fp32's 2^-23. The sharded run's DCP checkpoint
    holds the error-feedback buffers as shards: read whole (`dcp_shards.load_whole`), equal to the
    unsharded run's bitwise, and not zero (they are used)."""
    (_, _, syncs, _), (_, _, w_syncs, w_weights), _ = equal_side_by_side(
        tmp_path, [*HF_INT8, tail_offset(HF_INT8, 1)]
    )
    assert len(syncs) == 2
    for mine, theirs in zip(syncs, w_syncs, strict=True):
        bound = shard_norm_bound(theirs["params"])
        assert mine["pseudo_grad_norm"] == pytest.approx(theirs["pseudo_grad_norm"], rel=bound, abs=0)
        assert mine["compress_error"] == pytest.approx(theirs["compress_error"], rel=2**-23)
        # the replica's ranks send the straddling blocks twice: more bytes, at most a block per tensor
        extra = mine["payload_bytes"] - theirs["payload_bytes"]
        assert 0 < extra <= len(w_weights) * (4 + 128), extra
    (s_last,) = checkpoint.checkpoints(tmp_path / "s")[-1:]
    (w_last,) = checkpoint.checkpoints(tmp_path / "w")[-1:]
    assert (s_last.name, w_last.name) == ("ckpt-u0000004.dcp", "ckpt-u0000004.pt")
    mine = dcp_shards.load_whole(s_last, checkpoint.load(s_last)["state"])["errors"]
    theirs = checkpoint.load(w_last)["state"]["errors"]
    for m, (e, w_e) in enumerate(zip(mine, theirs, strict=True)):
        assert set(e) == set(w_e)
        assert all(torch.equal(e[n], w_e[n]) for n in w_e), m
        assert any(bool(w_e[n].any()) for n in w_e)


@pytest.mark.slow  # four 4-process runs (one restarted) and one of 8: 229-283 s on 2 shared cores (load 13)
def test_a_killed_sharded_run_resumes_bitwise_and_reshards_to_four_ranks_per_replica(tmp_path):
    """The sharded checkpoint is torch.distributed.checkpoint's folder, one shard file per rank
    (`ckpt-u0000003.dcp`). The killed run, restarted from its mid-round checkpoint, finishes bitwise the
    uninterrupted sharded run; that checkpoint resumed unsharded (processes.shard=false: its tensors read
    whole) too, since the two runs are bitwise equal (above).

    Resumed at world.size=8 (L = 4, R = 2: DCP reads the shards written at L = 2 as four; the reshard
    itself is bitwise, tests/test_sharded_checkpoint.py) it is not bitwise: the sums of four ranks' terms
    are ordered differently by gloo's reduce-scatter (and the loss's one-number all-reduce) than by layout
    (a)'s all-reduce of one long buffer (measured on a fresh W = 8 run: one loss's last bit, weights within
    6e-8). It equals the simulation within test_dist's bound, whose argument holds for any L a power of
    two (the same count of roundings, in another order), over the whole run: the updates before the
    checkpoint at L = 2, the ones after at L = 4."""
    whole = start_entry([*RESUMED, "processes.shard=true", f"hydra.run.dir={tmp_path / 'full'}"], tmp_path)
    killed = entry(
        [*RESUMED, "processes.shard=true", f"hydra.run.dir={tmp_path / 'k'}"],
        tmp_path,
        fault="1:4:kill",
    )
    assert killed.returncode == 0, killed.stderr[-2000:]
    mid = tmp_path / "k" / "checkpoints" / "ckpt-u0000003.dcp"
    (restart,) = [r for r in read_metrics(tmp_path / "k" / "metrics.jsonl") if r["kind"] == "restart"]
    assert restart["from"] == str(mid), restart
    assert sorted(p.name for p in mid.iterdir()) == SHARD_FILES
    assert checkpoint.load(mid)["state"]["round_params"] is not None  # mid-round: the round's weights
    shutil.copytree(tmp_path / "k", tmp_path / "u")
    shutil.copytree(tmp_path / "k", tmp_path / "r")
    assert finish(whole).returncode == 0
    expected = torch.load(tmp_path / "full" / "weights.pt")
    got = torch.load(tmp_path / "k" / "weights.pt")
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    done = entry(
        [
            *RESUMED,
            "processes.shard=false",
            f"hydra.run.dir={tmp_path / 'u'}",
            f"resume={tmp_path / 'u' / mid.relative_to(tmp_path / 'k')}",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = torch.load(tmp_path / "u" / "weights.pt")
    assert all(torch.equal(got[n], expected[n]) for n in expected)

    eight = [x if x != "world=4" else "world=8" for x in RESUMED]
    at = tmp_path / "r" / mid.relative_to(tmp_path / "k")
    resumed = start_entry(
        [*eight, "processes.shard=true", f"hydra.run.dir={tmp_path / 'r'}", f"resume={at}"], tmp_path
    )
    cfg = compose_cfg(eight)
    simulated = simulated_beside(resumed, cfg)
    done = finish(resumed)
    assert done.returncode == 0, done.stderr[-3000:]
    losses, evals, _, weights = _records(tmp_path / "r")
    assert len(losses) == 6
    assert_equals_the_simulation(cfg, simulated, losses, evals, weights)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["outer.compress=lowrank"], "outer.compress=lowrank (its factors of each matrix"),
        (["outer.schedule=async"], "outer.schedule=async is not built with processes.shard=true"),
        (["engine.compile=true"], "engine.compile=true is not built with processes.shard=true"),
        (["world=2"], "processes.shard=true with world.size=2 and replicas=2 shards nothing"),
    ],
)
def test_what_sharding_does_not_build_is_one_line(tmp_path, extra, says):
    done = entry([*SHARDED, "processes.shard=true", *extra], tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"hypertrain: error: {says}"), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.soak  # a further case of the kill family above: four 4-process runs, 137 s on 2 loaded cores
@pytest.mark.slow
def test_a_killed_sharded_run_with_int8_error_feedback_resumes_bitwise_sharded_or_not(tmp_path):
    """The error-feedback buffers are per shard: the DCP checkpoint holds them as shards (as the inner
    moments), read back as this run's shards, or whole by an unsharded run, so the resumed run, sharded or not
    (the unsharded run is bitwise the sharded one, above), finishes bitwise the uninterrupted one."""
    codec = [*SHARDED[:-3], "inner.H=2", "phase.updates=6", "processes.timeout_s=5"]
    codec += ["outer.compress=int8", "outer.error_feedback=true"]
    whole = start_entry([*codec, "processes.shard=true", f"hydra.run.dir={tmp_path / 'full'}"], tmp_path)
    killed = entry(
        [*codec, "processes.shard=true", f"hydra.run.dir={tmp_path / 'k'}"], tmp_path, fault="1:3:kill"
    )
    assert killed.returncode == 3, killed.stderr[-2000:]
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "k")] == ["ckpt-u0000002.dcp"]
    shutil.copytree(tmp_path / "k", tmp_path / "u")
    assert finish(whole).returncode == 0
    expected = torch.load(tmp_path / "full" / "weights.pt")
    for where, shard in (("k", "true"), ("u", "false")):
        args = [*codec, f"processes.shard={shard}", f"hydra.run.dir={tmp_path / where}", "resume=true"]
        done = entry(args, tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        got = torch.load(tmp_path / where / "weights.pt")
        assert all(torch.equal(got[n], expected[n]) for n in expected), where


def killed_beside_unsharded(tmp_path, overrides: list[str], kill: int) -> tuple[dict, dict]:
    """The sharded and the unsharded run of `overrides` side by side, weights.pt bitwise equal; then the
    sharded run with rank 1 killed (SIGKILL) as update `kill` starts: it restarts itself from its
    checkpoint of update `kill - 1` and finishes bitwise the uninterrupted run. That checkpoint's state
    read whole (`dcp_shards.load_whole`), and the unsharded run's checkpoint of the same update."""
    runs = {
        where: start_entry(
            [*overrides, f"processes.shard={shard}", f"hydra.run.dir={tmp_path / where}"], tmp_path
        )
        for where, shard in (("full", "true"), ("w", "false"))
    }
    for proc in runs.values():
        done = finish(proc)
        assert done.returncode == 0, done.stderr[-2000:]
    expected = torch.load(tmp_path / "full" / "weights.pt")
    unsharded = torch.load(tmp_path / "w" / "weights.pt")
    assert all(torch.equal(unsharded[n], expected[n]) for n in expected)
    killed = entry(
        [*overrides, "processes.shard=true", f"hydra.run.dir={tmp_path / 'k'}"],
        tmp_path,
        fault=f"1:{kill}:kill",
    )
    assert killed.returncode == 0, killed.stderr[-2000:]
    mid = tmp_path / "k" / "checkpoints" / f"ckpt-u{kill - 1:07d}.dcp"
    (restart,) = [r for r in read_metrics(tmp_path / "k" / "metrics.jsonl") if r["kind"] == "restart"]
    assert restart["from"] == str(mid), restart
    got = torch.load(tmp_path / "k" / "weights.pt")
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    state = dcp_shards.load_whole(mid, checkpoint.load(mid)["state"])
    return state, checkpoint.load(tmp_path / "w" / "checkpoints" / f"ckpt-u{kill - 1:07d}.pt")["state"]


# Streaming DiLoCo's reduction in flight (outer.delay 1) and a torch.optim outer optimizer (Adam's moments),
# a checkpoint after every update (all kept), 6 updates; rank 1 killed as update 6 starts, so the run
# restarts itself from ckpt-u0000005, taken with a fragment's reduction in flight and Adam's state on both.
# Adam as the outer optimizer; a checkpoint after every update, all kept; the run restarts itself once
RESTARTED_WITH_ADAM = [
    "outer.optimizer=torch.optim.Adam",
    "outer.lr=0.01",
    "processes.timeout_s=5",
    "checkpoint.every_updates=1",
    "checkpoint.keep=10",
    "processes.max_restarts=1",
]
IN_FLIGHT = [
    *(x if x != "phase.updates=8" else "phase.updates=6" for x in STREAMING[:-1]),
    *RESTARTED_WITH_ADAM,
]


@pytest.mark.slow  # three 4-process runs of 6 updates (two side by side), about 55 s on 2 cores (measured)
def test_a_killed_sharded_run_with_a_reduction_in_flight_and_adams_state_resumes_bitwise(tmp_path):
    """A pending reduction's mean is written as shards of its fragment's parameters (`pending/INDEX`) and
    Adam's moments as shards of theirs (`outer_optimizer/FRAGMENT/INDEX/KEY`; its step count in run.pt),
    so no rank holds a whole one. The killed run, restarted from the checkpoint taken with the reduction
    in flight, finishes bitwise the uninterrupted sharded run, which is bitwise the unsharded one (the
    same operations on the same numbers: the module docstring). Read whole, that checkpoint is the
    unsharded run's of the same update, bitwise: what an unsharded run resuming from it reads (the soak
    tier's kill-and-reshard test above resumes one), and what the unsharded run's single file is cut from
    for a sharded one (`dcp_shards.cut`, bitwise: tests/test_sharded_checkpoint.py)."""
    # what it holds, read whole, is the unsharded run's checkpoint of the same update, bitwise
    state, theirs = killed_beside_unsharded(tmp_path, IN_FLIGHT, 6)
    assert state["pending"]["mean"] is not None and torch.equal(
        state["pending"]["mean"], theirs["pending"]["mean"]
    )
    for mine, kept in zip(state["outer_optimizer"], theirs["outer_optimizer"], strict=True):
        assert mine["state"].keys() == kept["state"].keys() and kept["state"]
        for i, per in kept["state"].items():
            assert all(torch.equal(mine["state"][i][k], t) for k, t in per.items()), i


# outer.overlap=eager with torch.optim.Adam as each replica's outer optimizer and SparseLoCo's top-k tiles
# with error feedback (the gather path),
# a checkpoint after every update: rank 1 killed as update 4 starts, so the run restarts itself from
# ckpt-u0000003, taken mid-round with round 1's reduction in flight (what each replica took and its error
# buffers before the take) and each replica's own outer weights and Adam state.
EAGER_KILLED = [
    *SHARDED[:-3],
    "inner.H=2",
    "phase.updates=4",
    "outer.overlap=eager",
    *TOPK_TILES[-5:],
    *RESTARTED_WITH_ADAM,
]


@pytest.mark.slow  # three 4-process runs of 4 updates (two side by side), about 45 s on 2 cores (measured)
def test_a_killed_sharded_eager_run_with_its_terms_in_flight_resumes_bitwise(tmp_path):
    """outer.overlap's state on the shards: what each replica took for the reduction in flight and its
    error buffers before the take (`taken/...`, `errors_before/...`: flat over the parameters, cut back
    into their shards) and eager's own outer weights, momentum and Adam state per replica
    (`replica_outer/...`), with top-k's tiles on the gather path (every tensor gathered whole, encoded
    as unsharded). The killed run, restarted from the checkpoint of update 3 (a reduction in flight),
    issues that reduction again from its shards and finishes bitwise the uninterrupted sharded run, which
    is bitwise the unsharded one. The reshards of these tensors, read whole and cut from a
    single file, are tests/test_sharded_checkpoint.py's."""
    # read whole, it holds the unsharded run's state of the same update bitwise, the terms in flight too
    state, theirs = killed_beside_unsharded(tmp_path, EAGER_KILLED, 4)
    (flight,), (kept,) = state["in_flight"], theirs["in_flight"]
    for part in ("taken", "errors_before"):
        assert all(torch.equal(a, b) for a, b in zip(flight[part], kept[part], strict=True)), part
    for mine, own in zip(state["outer_replicas"], theirs["outer_replicas"], strict=True):
        assert all(torch.equal(mine["theta"][n], t) for n, t in own["theta"].items())
        (adam,), (their_adam,) = mine["optimizer"], own["optimizer"]
        for i, per in their_adam["state"].items():
            assert all(torch.equal(adam["state"][i][k], t) for k, t in per.items()), i


class _ReplicaOf:
    """The replica group's gather (`groups.whole`) in one process: the whole tensors, known here."""

    def __init__(self, whole):
        self.whole_tensors = whole

    def whole(self, part):
        return {n: self.whole_tensors[n] for n in part}


@pytest.mark.slow  # in-process, well under a second
@pytest.mark.parametrize("L", [2, 3, 4])
@pytest.mark.parametrize("codec", ["int8", "fp4_e2m1", "uint8"])
def test_a_shards_window_decodes_to_its_values_of_the_whole_tensors_encoding_bitwise(L, codec):
    """Each rank's window (the whole blocks its FSDP2 shard touches) encoded alone and decoded gives, on
    the rank's own values, the bits of the whole vector's encoding: every block is the same block. The
    shapes mix cuts on block boundaries, cuts inside a block (a 64-value norm, 33 rows of 8), rows that
    do not divide by L, an empty last shard (2 rows at L = 3, 4) and a tensor smaller than a block."""
    from hypertrain.codecs import kernels
    from hypertrain.codecs.tiles import blocks_and_order
    from hypertrain.diloco.exchange.shard_windows import Windows
    from hypertrain.distributed.fsdp_engine import shard_of

    shapes = {"a": (64,), "b": (33, 8), "c": (256, 32), "d": (2, 5), "e": (96, 16)}
    gen = torch.Generator().manual_seed(0)
    whole = {n: torch.randn(s, generator=gen) * (1 + i) for i, (n, s) in enumerate(shapes.items())}
    blocks, _ = blocks_and_order(list(shapes.values()), 128, 0)
    flat = torch.cat([t.reshape(-1) for t in whole.values()])[None]
    expected = kernels.decode(codec, kernels.encode(codec, flat, blocks), blocks)[0]
    expected = dict(zip(shapes, expected.split([t.numel() for t in whole.values()]), strict=True))
    groups, straddled = _ReplicaOf(whole), set()
    for j in range(L):
        windows = Windows.of(shapes, blocks.block, j, L)
        own = {n: shard_of(t, j, L) for n, t in whole.items()}  # FSDP2's cut, as the run holds it
        x = torch.cat([t.reshape(-1) for t in own.values()])[None]
        wide = windows.widen(x, groups)
        got = windows.own(kernels.decode(codec, kernels.encode(codec, wide, windows.blocks), windows.blocks))[
            0
        ]
        mine = dict(zip(shapes, got.split([t.numel() for t in own.values()]), strict=True))
        for n, t in own.items():
            want = shard_of(expected[n].view(shapes[n]), j, L)
            assert torch.equal(mine[n].view(t.shape), want), (n, j)
        straddled |= windows.gathered
    # 64 = 32 + 32 inside one block at L = 2; c's cuts (every 8192 / L values) on boundaries at L = 2, 4,
    # and at L = 3 after 86 rows (2752 values, inside block 22)
    assert "a" in straddled and ("c" in straddled) == (L == 3)
