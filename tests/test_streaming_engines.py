"""Streaming DiLoCo on every engine (issue 23, "Proof"; docs/design.md invariants 6, 7, 9 and 10 for the
fragments, the delay and the merge): the stacked engine equals the loop, real processes equal the
simulation, a run killed while a fragment's reduction is in flight resumes bit-identically, the neutral
settings spelled out are today's run, and the inner state and the lr's re-warmup act per fragment.

All runs use inner.H = 8 (so P = 2 and 4 divide it) and are a few periods long. Bounds are derived,
never measured ("Within float rounding", references.py): a fp32 path's error against the float64
reference within twice its fp32 peer's error, or twice a floor counted from the roundings of the stored
values (`streaming_rounding_floors`, helpers.py); resumed runs are compared with ==.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import (
    DIST,
    KILLED,
    RUN,
    ReferenceRuns,
    assert_identical,
    assert_identical_streaming,
    assert_streaming_engines_agree,
    ckpt,
    compose_cfg,
    entry,
    finish,
    fragment_landings,
    killed_beside_uninterrupted,
    recorded_clock,
    resumed,
    simulate_streaming,
    simulated_beside,
    start_entry,
    streaming_bounds_used,
    streaming_cfg,
    streaming_outcome,
)
from omegaconf import OmegaConf
from references import U32

from hypertrain.diloco.fragments import LAND, Schedule, fragment_of, members
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.engines import loop
from hypertrain.failures import RankFailed
from hypertrain.model.shapes import param_roles
from hypertrain.model.transformer import init_params
from hypertrain.optim.inner import OptState, init_state, inner_step, sync_inner_states
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.rundir.checkpoint import seal
from hypertrain.rundir.records import read_metrics

H = 8  # every run's inner.H: P = 2 and P = 4 divide it

# -- 1. stacked = loop, within the derived bounds --------------------------------------------------------

ENGINE_CASES = {
    # two fragments, the pseudo-gradient taken one update early, replicas take the global weights
    "p2-tau1-alpha0-adamw": (2, 1, 0.0, {}),
    # four fragments (three layers: each fragment holds parameters), a half-way merge, and the inner
    # state averaged per fragment at its sync with the lr re-warmed from each fragment's own sync
    "p4-tau1-alpha0.5-adamw-average-rewarmup": (4, 1, 0.5, {"state_policy": "average", "rewarmup_steps": 2}),
    # Muon once, with the per-fragment reset of its momentum and of AdamW's moments and step counts
    "p2-tau1-alpha0.5-muon-reset": (2, 1, 0.5, {"name": "muon", "state_policy": "reset"}),
}


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_stacked_equals_loop_with_fragments_and_delay(name):
    """Invariant 6 with fragments, delay and merge: 19 updates (two periods of H = 8 and a short one
    ending in the flush), R = 2; per-replica losses at every update and the final global weights.

    Bound (helpers.assert_streaming_engines_agree): the stacked engine's error against the float64 loop
    (the same code in float64 from the same fp32 initial weights) within twice the fp32 loop's own
    error, or twice the floor of `streaming_rounding_floors`. The floor is `rounding_floors`' with the
    syncs counted per fragment: every parameter is still synced once per period of H updates (by its
    fragment, at the fragment's offset), but the end-of-phase flush can sync a fragment once more than
    ceil(updates/H) (P = 4, 19 updates: fragment 0 after 2, 10, 18 and 19), and a merge with alpha > 0
    rounds the replicas' weights up to 3 times per sync (lerp); at alpha = 0 the merge is a copy. The
    two engines evaluate the same real-number expressions (the take, the outer step, the merge and the
    state policy are one code path on the same tensors; only the inner steps are batched differently),
    so the factor-2 argument of references.py holds as for DiLoCo."""
    P, tau, alpha, inner = ENGINE_CASES[name]
    cfg = streaming_cfg(P, tau, alpha, **inner)
    # The floor's sync count is the run's: the landings of each fragment in the schedule the rounds follow.
    schedule = Schedule.of(cfg, cfg.phase.updates)
    events = [e for c in range(1, cfg.phase.updates + 1) for e in schedule.events(c)]
    assert [events.count((LAND, p)) for p in range(P)] == fragment_landings(H, P, cfg.phase.updates)
    used = assert_streaming_engines_agree(cfg)
    print(f"{name}: fraction of the bound used", {k: round(v, 3) for k, v in used.items()})


# -- 2. real processes = the simulation, within the derived bounds ------------------------------------------

STREAM = [f"inner.H={H}", "phase.updates=12", "outer.fragments=2", "outer.delay=1"]


def paper_landings(P: int, updates: int) -> list[tuple[int, int]]:
    """(count, fragment) of every landing, in order, from the paper's schedule (fragment p after counts
    k*H + (p+1)*H/P) and our flush (every fragment not landed at the phase's end, in fragment order)."""
    out = [(c, p) for c in range(1, updates + 1) for p in range(P) if c % H == (p + 1) * H // P % H]
    return out + [(updates, p) for p in range(P) if (updates, p) not in out]


@dataclass
class DistCase:
    overrides: list[str]
    layout: str  # what the run must record
    nproc: int


DIST_CASES = {
    # benchmark, W = R = 2, L = 1: a rank per replica, the sync one asynchronous all-reduce on the outer
    # group, in flight over the update after each take; the replicas take the global weights.
    "w2-r2-benchmark-p2-d1": DistCase(["world=2", "replicas=2"], "benchmark", 2),
    # benchmark, W = 4, R = 2, L = 2 on 4 processes: every update averages a replica's two ranks'
    # gradients, and the sync is HSDP's two stages (the shard's asynchronous all-reduce across the
    # replicas, in flight; the all-gather inside the replica when it is waited for); a half-way merge.
    "w4-r2-benchmark-hsdp-p2-d1-alpha0.5": DistCase(
        ["world=4", "replicas=2", "outer.merge_alpha=0.5"], "benchmark", 4
    ),
    # replicas layout, W = 4, R = 4 on 2 processes of two stacked replicas each; four fragments of a
    # three-layer model, a half-way merge.
    "replicas-p2-w4-r4-p4-d1-alpha0.5": DistCase(
        [
            "world=4",
            "replicas=4",
            "processes.nproc=2",
            "model.n_layers=3",
            "outer.fragments=4",
            "outer.merge_alpha=0.5",
        ],
        "replicas",
        2,
    ),
}
# Every case is slow: the quick loop's fragments on real processes are tests/test_dist.py's
# fragments-delay-churn case.
SLOW_DIST = set(DIST_CASES)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW_DIST else ()) for n in DIST_CASES]
)
def test_real_processes_equal_the_simulation_with_fragments_and_delay(tmp_path, name):
    """Invariant 7 with fragments, delay and merge: `python -m hypertrain.train processes=dist ...`
    (self-launched gloo workers, 12 updates: one period of H = 8 and a short one whose fragment 0 is
    in flight when the phase ends and lands in the flush) against the simulation of the same config
    (`simulate_streaming`: the trainer's rounds by the loop in this process, fp32 and float64).

    What rank 0 wrote: a sync row per landing, with its fragment, in the paper's order and our flush;
    an `eval` row before training and after each period (updates 0, 8, 12); the layout and the
    fragments' assignment in config.yaml. Parity: per-replica losses, held-out losses and the final
    global weights within twice the fp32 simulation's error against the float64 one, or twice the floor
    (`streaming_rounding_floors`, the held-out loss's from `rounding_floors` of the held-out batch).
    The factor-2 argument of tests/test_dist.py holds unchanged: the processes evaluate the same
    real-number expressions as the simulation with roundings of the same number and size in another
    order (a replica's gradient averaged over its L = 1 or 2 ranks, exact for L a power of two; the
    sync's sum of R pseudo-gradients in the all-reduce instead of torch.sum). The asynchronous
    collective sums exactly what the synchronous one did, only later; the merge and the inner state
    policy run on each process's own replicas, as in the simulation. The floor counts each parameter's
    syncs per fragment (`fragment_landings`; P = 2: fragment 0 after 4 and 12, fragment 1 after 8 and
    in the flush at 12; P = 4: fragment 0 after 2, 10 and in the flush at 12, one more than
    ceil(12/8) = 2)."""
    case = DIST_CASES[name]
    overrides = [*DIST, *STREAM, *case.overrides]
    proc = start_entry([*overrides, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    cfg = compose_cfg(overrides)
    batches, ref, sim, run = simulated_beside(proc, cfg, simulate_streaming)
    ref_losses = ref[0]
    done = finish(proc)
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "run"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "finished"

    written = OmegaConf.load(run_dir / "config.yaml")
    assert (written.processes.layout, written.processes.nproc) == (case.layout, case.nproc)
    o = cfg.outer
    assert (written.outer.fragments, written.outer.delay, written.outer.merge_alpha) == (
        o.fragments,
        o.delay,
        o.merge_alpha,
    )
    assert (
        list(written.outer.assignment) == list(run.cfg.outer.assignment)
        and len(run.cfg.outer.assignment) == o.fragments
    )

    updates = [r for r in rows if r["kind"] == "update"]
    syncs = [r for r in rows if r["kind"] == "sync"]
    assert [r["update"] for r in updates] == list(range(1, len(ref_losses) + 1))
    assert [(r["update"], r["fragment"]) for r in syncs] == paper_landings(o.fragments, cfg.phase.updates)
    assert all(r["pseudo_grad_norm"] > 0 and r["replicas_synced"] == cfg.replicas for r in syncs), syncs
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["update"] for r in evals] == [0, H, cfg.phase.updates]
    # every landing's reduction was handed to a collective: each row that carries the measured figures
    # (a landing's own, or the first of a count's) has outer bytes, and every count with a landing has one
    assert all(r["comm_measured_outer_bytes"] > 0 for r in syncs if "comm_measured_outer_bytes" in r)
    assert sum("comm_measured_outer_bytes" in r for r in syncs) >= len({r["update"] for r in syncs})

    losses = [r["loss"] for r in updates]
    weights = torch.load(run_dir / "weights.pt")
    got = (losses, [r["eval_loss"] for r in evals], weights)
    used = streaming_bounds_used(cfg, run, batches, got, sim, ref)
    print(f"{name}: fraction of the bound used", {k: round(v, 3) for k, v in used.items()})


# -- 3. killed while a reduction is in flight, resumed: bit-identical ---------------------------------------

# P = 2, H = 8, tau = 1: fragment 0 is taken after update 3 and lands after update 4. A checkpoint every
# 3 updates falls right after the take (and at 6 and 9; the periods' ends, 8 and 12, checkpoint too).
MEASURED = "comm_measured_outer_bytes"
# cluster=h100: modelled compute, so the network clock is a number of the run, compared exactly on resume
KILL_RUN = [*RUN, *STREAM, "checkpoint.every_updates=3", "checkpoint.keep=10", "cluster=h100"]
KILL_ENGINES = {
    "stacked": ([], "0:4:kill:after", KILLED),  # the entry itself
    "dist": (["processes=dist", "world=2", "replicas=2"], "1:4:kill:after", RankFailed.exit_code),  # rank 1
}


def check_pending_checkpoint(path: Path, cfg) -> dict:
    """The checkpoint taken at count 3 holds fragment 0's sync in flight, its reduction waited for: the
    fragment, the count it was taken at, every replica's flag, the mean pseudo-gradient (fragment 0's
    elements, flat) and the replicas that took part."""
    saved = torch.load(path, weights_only=False)
    state = saved["state"]
    assert state["next_update"] == 3 and state["round_first"] == 0
    pending = state["pending"]
    assert (pending["fragment"], pending["taken_at"]) == (0, 3)
    assert pending["stepped"] == [True] * cfg.replicas and pending["synced"] == cfg.replicas
    size = sum(t.numel() for n, t in initial_weights(prepare(cfg)).items() if n in members(cfg)[0])
    assert pending["mean"] is not None and pending["mean"].shape == (size,) and bool(pending["mean"].any())
    assert state["round_params"] is not None  # the replicas' own weights, mid-round
    return saved


# Slow: the quick loop kills a run with a fragment in flight in tests/test_churn.py (mid-absence too).
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["stacked", "dist"])
def test_killed_while_a_reduction_is_in_flight_resumes_bit_identically(tmp_path, engine):
    """Invariant 9 with a reduction in flight: SIGKILL right after update 4's inner step (the fault hook's
    `after` point: fragment 0 was taken after update 3, its landing after update 4 not yet made; under
    processes=dist rank 1 dies and the run fails), the newest checkpoint the mid-round one at count 3,
    taken right after the take; `resume=true` goes on from it and the run equals an uninterrupted run of
    the same config exactly (==, torch.equal: the same machine runs the same arithmetic in the same
    order): every update row, every sync row (fragment, norm, bytes), every eval row's held-out loss,
    the summary's final figures and weights.pt (`assert_identical_streaming`), and the network clock
    (modelled compute: every row's clock fields and the summary's totals, `recorded_clock`). The
    checkpoint stores the waited-for mean (`check_pending_checkpoint`).

    Under processes=dist the sync rows also hold the measured payload bytes handed to the outer
    collectives (`comm_measured_outer_bytes`); the landing after update 4, whose reduction the killed
    session launched at update 3, counts them because the checkpoint carries what was measured since
    the last sync (`Collectives.measured_since_sync`): they are compared on their own, exactly.

    One-process engine only, the negative control: the same checkpoint with its stored mean doubled,
    resumed, gives the same update 4 (trained before the landing) but another landing after it and other
    losses from update 5: the resumed run lands what the checkpoint stored; it does not take again."""
    extra, fault, killed_rc = KILL_ENGINES[engine]
    overrides = [*KILL_RUN, *extra]
    run_dir, reference = killed_beside_uninterrupted(overrides, tmp_path, fault, killed_rc)
    assert sorted((run_dir / "checkpoints").glob("ckpt-u*.pt")) == [ckpt(run_dir, 3)]
    cfg = compose_cfg(overrides)
    check_pending_checkpoint(ckpt(run_dir, 3), cfg)
    resumed(overrides, run_dir, tmp_path)
    assert_identical_streaming(run_dir, reference, skip=(MEASURED,))
    assert recorded_clock(run_dir) == recorded_clock(reference)  # the clock goes on from the checkpoint
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["from"] for r in rows if r["kind"] == "resume"] == [str(ckpt(run_dir, 3))]
    if engine != "stacked":
        # Real processes also record the payload bytes handed to the outer collectives (MEASURED, on a
        # landing's row: its reduction's, launched at its take, carried over the stop by the checkpoint).
        got, want = streaming_outcome(run_dir).syncs, streaming_outcome(reference).syncs
        assert [a.get(MEASURED) for a in got] == [b.get(MEASURED) for b in want]
        return

    # The uninterrupted run's checkpoints (3, 6, 8, 9, 12: keep=10), its checkpoint at 3 edited; resume=PATH
    # to an older checkpoint than the newest goes back to it (docs/resume.md).
    edited = shutil.copytree(reference, tmp_path / "edited")
    saved = torch.load(ckpt(edited, 3), weights_only=False)
    saved["state"]["pending"]["mean"] *= 2
    torch.save(saved, ckpt(edited, 3))
    seal(ckpt(edited, 3))  # a whole checkpoint whose stored mean is wrong
    done = entry([*overrides, f"resume={ckpt(edited, 3)}"], tmp_path)
    assert done.returncode == 0, done.stderr
    resumes = [r for r in read_metrics(edited / "metrics.jsonl") if r["kind"] == "resume"]
    assert [r["from"] for r in resumes] == [str(ckpt(edited, 3))]
    got, want = streaming_outcome(edited), streaming_outcome(reference)
    assert got.updates[:4] == want.updates[:4]
    assert got.syncs[0]["update"] == want.syncs[0]["update"] == 4
    # exactly twice: doubling is exact in fp32, and so is the float64 norm of twice a vector
    assert got.syncs[0]["pseudo_grad_norm"] == 2 * want.syncs[0]["pseudo_grad_norm"]
    assert all(a["loss"] != b["loss"] for a, b in zip(got.updates[4:], want.updates[4:], strict=True))
    assert got.heldout[0] == want.heldout[0] and got.heldout[1:] != want.heldout[1:]


# -- 4. the neutral settings spelled out are today's run -----------------------------------------------------


def test_fragments_1_delay_0_alpha_0_spelled_out_is_the_default_run_bitwise(tmp_path):
    """Invariant 10's neutral setting through the entry: `outer.fragments=1 outer.delay=0
    outer.merge_alpha=0` written on the command line gives the same resolved config (config.yaml), the
    same run name (its config hash; no streaming tag) and the same run as leaving them out, exactly
    (`assert_identical`: update rows, sync rows, held-out losses in the sync rows as DiLoCo writes
    them, the summary's final figures, weights.pt): two runs of 2 rounds of 2 updates, side by side."""
    plain = [*RUN, "inner.H=2", "phase.updates=4"]
    spelled = [*plain, "outer.fragments=1", "outer.delay=0", "outer.merge_alpha=0"]
    runs = {"plain": ReferenceRuns.beside(tmp_path)(plain), "spelled": tmp_path / "spelled"}
    done = entry([*spelled, f"hydra.run.dir={runs['spelled']}"], tmp_path)
    assert done.returncode == 0, done.stderr
    configs = {name: OmegaConf.load(run / "config.yaml") for name, run in runs.items()}
    assert configs["spelled"] == configs["plain"]
    assert (configs["plain"].outer.fragments, configs["plain"].outer.delay) == (1, 0)
    assert configs["plain"].outer.merge_alpha == 0.0 and list(configs["plain"].outer.assignment) == []
    names = {
        name: [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "start"]
        for name, run in runs.items()
    }
    assert names["spelled"][0]["name"] == names["plain"][0]["name"]
    assert "-p1-" not in names["plain"][0]["name"] and not any("P=" in t for t in names["plain"][0]["tags"])
    assert_identical(runs["spelled"], runs["plain"])
    syncs = [r for r in read_metrics(runs["plain"] / "metrics.jsonl") if r["kind"] == "sync"]
    assert [r["update"] for r in syncs] == [2, 4] and all(
        "fragment" not in r and "eval_loss" in r for r in syncs
    )


# -- 5. the inner state and the lr per fragment ------------------------------------------------------------


def fragment_states(cfg, rows: int, seed: int = 0):
    """`rows` one-replica inner states (as the engines keep them) with random moments and distinct step
    counts per fragment, the fragment split and its members."""
    where = fragment_of(cfg)
    one = {n: t.unsqueeze(0) for n, t in init_params(cfg.model, seed=0).items()}
    gen = torch.Generator().manual_seed(seed)
    states = []
    for r in range(rows):
        s = init_state(cfg.inner, one, param_roles(cfg.model), where, cfg.outer.fragments)
        assert s.step.shape == (1, cfg.outer.fragments)
        for moments in (s.m, s.v):
            for t in moments.values():
                t.copy_(torch.rand(t.shape, generator=gen))
        s.step.copy_(torch.arange(cfg.outer.fragments).view(1, -1) * 10 + r + 1)
        states.append(s)
    return states, where, members(cfg)


def snapshot(states: list[OptState]) -> list[dict]:
    return [
        {
            "m": {n: t.clone() for n, t in s.m.items()},
            "v": {n: t.clone() for n, t in s.v.items()},
            "step": s.step.clone(),
        }
        for s in states
    ]


@pytest.mark.parametrize("p", [0, 1])
def test_a_fragments_reset_zeroes_only_its_moments_and_its_step_count(p):
    """state_policy=reset at fragment p's sync (`sync_inner_states(..., names=members[p], fragment=p)`):
    fragment p's m and v are zero and its step-count column is 0 in every replica; every other
    fragment's moments and step counts are untouched, bitwise. OptState.step is [R, P] with fragments."""
    cfg = streaming_cfg(2, 1, 0.0, state_policy="reset")
    states, where, names = fragment_states(cfg, rows=3)
    before = snapshot(states)
    sync_inner_states(cfg.inner, states, torch.tensor([True, False, True]), names=names[p], fragment=p)
    for s, old in zip(states, before, strict=True):
        for moments in ("m", "v"):
            for n, t in getattr(s, moments).items():
                if where[n] == p:
                    assert not t.any(), (moments, n)
                else:
                    assert torch.equal(t, old[moments][n]), (moments, n)
        assert int(s.step[0, p]) == 0
        assert torch.equal(s.step[0, 1 - p], old["step"][0, 1 - p])


@pytest.mark.parametrize("p", [0, 1])
def test_a_fragments_average_averages_only_its_moments_over_the_replicas_that_stepped(p):
    """state_policy=average at fragment p's sync: fragment p's m and v become, in every replica, the mean
    over the replicas that stepped (active), and its step count their largest; every other fragment's
    moments and counts are untouched, bitwise.

    Bound: the mean of k fp32 values summed in fp32 (k - 1 roundings of a partial sum, each within U32
    of the sum of the |values|) and divided by k (1 rounding): |got - mean| <= k U32 * mean|x| per entry
    (k = 2 active replicas here), against the mean in float64."""
    cfg = streaming_cfg(2, 1, 0.0, state_policy="average")
    states, where, names = fragment_states(cfg, rows=3, seed=p)
    before = snapshot(states)
    active = torch.tensor([True, False, True])
    sync_inner_states(cfg.inner, states, active, names=names[p], fragment=p)
    k = int(active.sum())
    took_part = [b for b, a in zip(before, active, strict=True) if a]
    for s, old in zip(states, before, strict=True):
        for moments in ("m", "v"):
            for n, t in getattr(s, moments).items():
                if where[n] == p:
                    values = [b[moments][n].double() for b in took_part]
                    mean = sum(values) / k
                    bound = k * U32 * sum(x.abs() for x in values) / k
                    assert ((t.double() - mean).abs() <= bound).all(), (moments, n)
                else:
                    assert torch.equal(t, old[moments][n]), (moments, n)
        assert int(s.step[0, p]) == max(int(b["step"][0, p]) for b in took_part)
        assert torch.equal(s.step[0, 1 - p], old["step"][0, 1 - p])


def test_an_inner_step_uses_each_fragments_own_rate_and_step_count():
    """`inner_step` with fragments reads fragment f's lr (a tuple, one per fragment) and fragment f's
    step count for AdamW's bias correction: with lr (0, x) fragment 0's weights stay bitwise (a rate of
    0 moves nothing, the decay factor 1 - 0 * wd is 1) while fragment 1's equal, bitwise, an unfragmented
    AdamW step at rate x from fragment 1's step count (AdamW is elementwise, and the global-norm clip
    sees the same gradients); with counts (5, 0) and lr (x, x) fragment 0 equals an unfragmented step
    from count 5 and fragment 1 one from count 0."""
    cfg = streaming_cfg(2, 1, 0.0)
    where = fragment_of(cfg)
    roles = param_roles(cfg.model)
    params = {n: t.unsqueeze(0) for n, t in init_params(cfg.model, seed=0).items()}
    gen = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(t.shape, generator=gen) * 1e-2 for n, t in params.items()}

    def step(lr, counts, fragmented: bool):
        w = {n: t.clone() for n, t in params.items()}
        if fragmented:
            s = init_state(cfg.inner, w, roles, where, 2)
            s.step.copy_(torch.tensor([counts]))
        else:
            s = init_state(cfg.inner, w, roles)
            s.step.fill_(counts)
        inner_step(cfg.inner, w, grads, s, lr)
        return w, s

    x = 2e-3
    got, s = step((0.0, x), (3, 0), True)
    plain, _ = step(x, 0, False)
    for n in params:
        want = params[n] if where[n] == 0 else plain[n]
        assert torch.equal(got[n], want), n
    assert s.step.tolist() == [[4, 1]]  # every fragment's count advances with the replica's step
    got, _ = step((x, x), (5, 0), True)
    from_five, _ = step(x, 5, False)
    for n in params:
        assert torch.equal(got[n], (from_five if where[n] == 0 else plain)[n]), n


def test_the_lr_rewarms_from_each_fragments_own_sync():
    """inner.rewarmup_steps > 0 with fragments: the lr the engines get for update u (0-based) is, per
    fragment p, the schedule's lr(u) (linear warmup over warmup_steps, then the cosine to lr *
    min_lr_ratio at decay_steps) times min(1, (u - last_p(u) + 1) / rewarmup_steps), where last_p(u) is
    the count of fragment p's last landing at or before u (counts c = k*H + (p+1)*H/P; 0 before the
    first): each fragment re-warms from its own sync, not from the period's start. Recorded from the
    assignments the round loop hands the engine (`Assignment.lr`), every update of a 19-update run with
    P = 2, tau = 1; the formula is written here. `Assignment.lr` gives a float where every fragment's
    rate is equal. Bound: the formula and `optim.inner.lr_at` evaluate the same handful of float64
    operations (each within 2^-53 relative) grouped differently, so 4 * 2^-52 relative."""
    P, rewarm = 2, 3
    cfg = streaming_cfg(P, 1, 0.0, rewarmup_steps=rewarm, warmup_steps=2, decay_steps=19)
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    seen: dict[int, tuple[float, ...]] = {}

    def recording(cfg, theta, assigns, states, average=None, stop=None):
        for t in range(len(assigns[0].batches)):
            rates = {a.lr(cfg, t) for a in assigns}
            assert len(rates) == 1  # every replica of a step gets the same rates
            (rate,) = rates
            seen[assigns[0].global_step0 + t] = rate if isinstance(rate, tuple) else (rate,) * P
        return loop.train_replicas(cfg, theta, assigns, states, average, stop)

    for _ in rounds(run, state, recording):
        pass
    inner = cfg.inner

    def base(u: int) -> float:
        if u < inner.warmup_steps:
            return inner.lr * (u + 1) / inner.warmup_steps
        progress = min(1.0, (u - inner.warmup_steps) / (inner.decay_steps - inner.warmup_steps))
        return inner.lr * (
            inner.min_lr_ratio + (1 - inner.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        )

    def last_landing(p: int, u: int) -> int:
        points = [c for c in range(1, u + 1) if c % H == (p + 1) * H // P % H]
        return points[-1] if points else 0

    assert sorted(seen) == list(range(cfg.phase.updates))
    differ = 0
    for u, rates in seen.items():
        want = tuple(base(u) * min(1.0, (u - last_landing(p, u) + 1) / rewarm) for p in range(P))
        assert rates == pytest.approx(want, rel=4 * 2.0**-52, abs=0), u
        differ += len(set(want)) > 1
    assert differ > 0  # the fragments' rates did differ somewhere (fragment 1 lands 4 updates later)
