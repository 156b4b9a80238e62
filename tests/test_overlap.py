"""An outer step overlapping a whole round (outer.overlap, docs/overlap.md): one-outer-step delayed and
eager updates (Kale, Douillard, Donchev 2025, arXiv:2502.12996, Algorithms 2 and 3).

The float64 reference below is written from the algorithms' text (issue 36), not from the code: round
t ends after update tH, theta_out are the weights a replica started the period from, Delta_m(t) =
theta_out - theta_m(tH), A(t) the mean of the Delta_m(t). Delayed: at the end of round t the global
weights take the outer step with A(t-1) (none at t = 1); eager: each replica m steps its own outer
weights and momentum with A(t-1) + (Delta_m(t) - Delta_m(t-1)) / M (a term before round 1 is zero).
The phase's end applies the last one: A(T) (delayed), A(T) - Delta_m(T) / M (eager). With fragments
each fragment does so at its own sync points. With a codec Delta_m is what the replica sends, its own
decoded payload (the codec is a discrete stage, compared exactly on identical fp32 inputs: invariant 10).

The reference is fed the run's own replica weights and re-anchored at every sync on the run's weights
and outer momentum before it (so rounding does not accumulate); it keeps its own A and Delta between
syncs. Its bound is derived from the fp32 operation count of one sync (`step_bound`).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import (
    KILLED,
    RUN,
    assert_identical,
    assert_identical_streaming,
    ckpt,
    entry,
    killed_beside_uninterrupted,
    recorded_clock,
    resumed,
    small_cfg,
)
from omegaconf import OmegaConf
from references import ROUNDING_FACTOR

from hypertrain.clock.replay import clock_of, run_cluster
from hypertrain.codecs import kernels as codecs
from hypertrain.codecs.kernels import Blocks
from hypertrain.config import OuterConfig, TopKConfig
from hypertrain.diloco.fragments import members
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.engines import engine_for
from hypertrain.failures import RankFailed
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.records import formats
from hypertrain.records.files import read_metrics

U32 = 2.0**-24


def overlap_cfg(overlap: str, P: int, compress: str = "none", R: int = 2, engine: str = "stacked", updates=8):
    cfg = small_cfg(replicas=R)
    outer = OuterConfig(overlap=overlap, fragments=P, compress=compress)
    return small_cfg(
        replicas=R,
        outer=outer,
        phase=replace(cfg.phase, updates=updates),
        engine=replace(cfg.engine, name=engine),
    )


def _flat(params: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([params[n].reshape(-1) for n in names])


def _snapshot(state: RunState, results=None) -> dict:
    """The run's weights and outer state now (float64 copies of fp32: exact), with each replica's
    weights from the engine's `results`."""

    def copy(params: dict) -> dict:
        return {
            n: t.detach().double().clone().reshape(t.shape[1:] if t.dim() and t.shape[0] == 1 else t.shape)
            for n, t in params.items()
        }

    own = state.outer_replicas
    return {
        "theta": {n: t.detach().double().clone() for n, t in state.theta.items()},
        "momentum": {n: t.detach().double().clone() for n, t in state.outer.momentum.items()},
        "replica_theta": None if own is None else [copy(o["theta"]) for o in own],
        "replica_momentum": None if own is None else [copy(o["momentum"]) for o in own],
        "X": None if results is None else [copy(r.params) for r in results],
    }


def run_syncs(cfg):
    """Train `cfg` in this process; for every segment ending in syncs: the run before them (weights,
    outer states, the replicas' weights), the landings' fragments, in order, and the run after them."""
    run = prepare(cfg)
    state = RunState.start(cfg, initial_weights(run))
    real = engine_for(cfg.engine.name)
    before: list[dict] = []

    def engine(*args):
        results = real(*args)
        before.append(_snapshot(state, results))
        return results

    out = []
    for part in rounds(run, state, engine):
        if part.syncs:
            out.append((before[-1], [s.fragment for s in part.syncs], _snapshot(state), part.syncs))
    return out, state


def _codec(cfg, names, like, x64: torch.Tensor) -> torch.Tensor:
    """What a replica sends of its fp32 pseudo-gradient x (rows), decoded."""
    if cfg.outer.compress == "none":
        return x64
    x = x64.float()
    blocks = Blocks(tuple(like[n].numel() for n in names), cfg.outer.codec.block)
    fraction = (cfg.outer.topk or TopKConfig()).fraction  # top-k's node: None under another codec
    code = codecs.encode(cfg.outer.compress, x, blocks, fraction)
    return codecs.decode(cfg.outer.compress, code, blocks, fraction).double()


def _nesterov(outer, theta, buf, g):
    """Algorithm 1's outer step (SGD, Nesterov momentum), float64."""
    buf = outer.momentum * buf + g
    update = g + outer.momentum * buf if outer.nesterov else buf
    return theta - outer.lr * update, buf


def step_bound(outer, R: int, theta, buf, g, d) -> float:
    """What fp32 rounding can move one outer step's result by, in norm: the pseudo-gradients (one
    subtraction each), their sum over R and the division (R roundings, on terms of at most ||d||), eager's
    combination (3: a difference, a division, a sum), the momentum (2), the Nesterov update (2), the
    learning rate and the subtraction (2): each at most U32 relative to its operands' norms."""
    terms = (R + 3) * float(d.norm()) + 3 * float(g.norm()) + 4 * float(buf.norm())
    return U32 * (2 * float(theta.norm()) + outer.lr * (1 + outer.momentum) * 2 * terms)


def reference_errors(cfg, syncs, variant: str = "paper") -> list[tuple[float, float]]:
    """(error, bound) of every fragment's result after every sync of the run, against the reference.
    `variant`: "paper"; the negative controls "half" (eager's own terms weighted 1/2, not 1/M) and
    "fresh" (delayed steps with the fresh mean A(t), not A(t-1))."""
    outer, R = cfg.outer, cfg.replicas
    eager = outer.overlap == "eager"
    frags = members(cfg)
    flight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # fragment -> (A, Delta rows)
    out = []
    for before, landed, after, _ in syncs:
        current: dict[int, tuple] = {}  # fragment -> the reference's weights and momentum after its steps
        for p in landed:
            names = frags[p]
            if p not in current:  # the fragment's sync point: Delta(t) taken, the stale term applied
                if eager:
                    theta = [_flat(w, names) for w in before["replica_theta"]]
                    buf = [_flat(w, names) for w in before["replica_momentum"]]
                    origin = torch.stack(theta)
                else:
                    theta, buf = _flat(before["theta"], names), _flat(before["momentum"], names)
                    origin = theta[None]
                X = torch.stack([_flat(x, names) for x in before["X"]])
                d = _codec(cfg, names, before["theta"], origin - X)
                A_fresh = d.mean(0)
                stale = flight.get(p)
                A = None if stale is None else stale[0]
                if eager:
                    weight = 0.5 if variant == "half" else 1.0 / R
                    g = [
                        (0.0 if A is None else A) + weight * (d[m] - (0.0 if stale is None else stale[1][m]))
                        for m in range(R)
                    ]
                    pairs = [_nesterov(outer, theta[m], buf[m], g[m]) for m in range(R)]
                    bound = max(step_bound(outer, R, theta[m], buf[m], g[m], d) for m in range(R))
                    current[p] = ([x for x, _ in pairs], [b for _, b in pairs], bound)
                else:
                    g = A_fresh if variant == "fresh" else A
                    if g is None:
                        current[p] = (theta, buf, step_bound(outer, R, theta, buf, 0 * theta, d))
                    else:
                        new, newbuf = _nesterov(outer, theta, buf, g)
                        current[p] = (new, newbuf, step_bound(outer, R, theta, buf, g, d))
                flight[p] = (A_fresh, d)
            else:  # the phase's end: the last reduction applied
                A, d = flight.pop(p)
                theta, buf, bound = current[p]
                if eager:
                    weight = 0.5 if variant == "half" else 1.0 / R
                    g = [A - weight * d[m] for m in range(R)]
                    pairs = [_nesterov(outer, theta[m], buf[m], g[m]) for m in range(R)]
                    bound += max(step_bound(outer, R, theta[m], buf[m], g[m], d) for m in range(R))
                    current[p] = ([x for x, _ in pairs], [b for _, b in pairs], bound)
                else:
                    new, newbuf = _nesterov(outer, theta, buf, A)
                    current[p] = (new, newbuf, bound + step_bound(outer, R, theta, buf, A, d))
        for p, (theta, _, bound) in current.items():
            names = frags[p]
            if eager:
                for m in range(R):
                    got = _flat(after["replica_theta"][m], names)
                    out.append((float((got - theta[m]).norm()), bound))
                mean = torch.stack(theta).mean(0)  # the evaluated weights: the replicas' mean
                got = _flat(after["theta"], names)
                out.append((float((got - mean).norm()), bound + (R + 1) * U32 * float(mean.norm())))
            else:
                out.append((float((_flat(after["theta"], names) - theta).norm()), bound))
    return out


MATRIX = [
    (P, overlap, compress)
    for P in (1, 2)
    for overlap in ("delayed", "eager")
    for compress in ("none", "int8")
]
QUICK = {(1, "delayed", "none"), (2, "eager", "int8")}


@pytest.mark.parametrize(
    "P, overlap, compress",
    [pytest.param(*c, marks=() if c in QUICK else pytest.mark.slow) for c in MATRIX],
)
def test_every_sync_matches_a_float64_reference_of_the_algorithm(P, overlap, compress):
    cfg = overlap_cfg(overlap, P, compress)
    syncs, _ = run_syncs(cfg)
    assert len(syncs) == 4 * P  # H = 2, 8 updates: a segment ends at each fragment's sync point
    checked = reference_errors(cfg, syncs)
    assert checked and all(err <= bound for err, bound in checked), checked


@pytest.mark.parametrize("overlap, variant", [("eager", "half"), ("delayed", "fresh")])
def test_the_reference_fails_a_wrong_algorithm_at_four_replicas(overlap, variant):
    """Negative controls at R = 4 (at R = 2, 1/2 is 1/M): the right reference passes, the wrong one
    (eager's own terms weighted 1/2; delayed applying the fresh mean) does not."""
    cfg = overlap_cfg(overlap, 1, R=4)
    syncs, _ = run_syncs(cfg)
    assert all(err <= bound for err, bound in reference_errors(cfg, syncs))
    assert any(err > bound for err, bound in reference_errors(cfg, syncs, variant))


def test_eager_records_the_replicas_spread_and_evaluates_their_mean():
    """Each sync row of an eager run records how far the replicas' outer weights are from their mean
    (> 0: each stepped with its own fresh term), a delayed run's none; the global weights are the mean."""
    cfg = overlap_cfg("eager", 1)
    syncs, state = run_syncs(cfg)
    spreads = [s.outer_spread for _, _, _, landed in syncs for s in landed]
    assert all(x is not None and 0 < x < 0.5 for x in spreads), spreads
    for n, t in state.theta.items():
        mean = torch.stack([o["theta"][n][0].double() for o in state.outer_replicas]).mean(0)
        assert float((t.double() - mean).norm()) <= 3 * U32 * float(mean.norm()), n
    syncs, _ = run_syncs(overlap_cfg("delayed", 1))
    assert all(s.outer_spread is None for _, _, _, landed in syncs for s in landed)


@pytest.mark.parametrize("overlap", [pytest.param("delayed", marks=pytest.mark.slow), "eager"])
def test_loop_equals_stacked(overlap):
    """The loop engine and the stacked one within rounding: P = 2, int8 (the same codes on both, on these
    runs: a flip would show as a difference far above the bound)."""
    a, sa = run_syncs(overlap_cfg(overlap, 2, "int8", engine="loop"))
    b, sb = run_syncs(overlap_cfg(overlap, 2, "int8", engine="stacked"))
    updates = 8
    for n, t in sb.theta.items():  # every inner step and sync rounds a weight a few times
        bound = 4 * (2 * updates + 8) * U32 * float(t.norm())
        assert float((sa.theta[n].double() - t.double()).norm()) <= bound, n


KILL = [*RUN, "inner.H=2", "phase.updates=6", "checkpoint.every_updates=3", "checkpoint.keep=10"]
KILLS = {
    "eager-int8-feedback": ["outer.overlap=eager", "outer.compress=int8", "outer.error_feedback=true"],
    "delayed-fragments": ["outer.overlap=delayed", "outer.fragments=2"],
    "dist-eager-fragments": ["outer.overlap=eager", "outer.fragments=2", "processes=dist", "world=2"],
}
# a process of a real-process run is killed (rank 1) and the run fails; the bytes a session measured are
# its own (test_compression.py's MEASURED)
MEASURED = ("comm_measured_inner_bytes", "comm_measured_outer_bytes")


@pytest.mark.parametrize(
    "name",
    [
        "eager-int8-feedback",
        pytest.param("delayed-fragments", marks=pytest.mark.slow),
        pytest.param("dist-eager-fragments", marks=pytest.mark.slow),
    ],
)
def test_killed_with_a_whole_round_reduction_in_flight_resumes_bit_identically(tmp_path, name):
    """SIGKILL after update 4's inner step: the newest checkpoint is the mid-round one at 3, written while
    the reduction taken at 2 (and, with P = 2, fragment 0's taken at 3) was in flight; it holds what was
    taken, not its result, and the resumed run issues it again: every row, the held-out losses, the
    summary and weights.pt equal the uninterrupted run's exactly."""
    args = [*KILL, *KILLS[name]]
    dist = "processes=dist" in args
    fault, rc = ("1:4:kill:after", RankFailed.exit_code) if dist else ("0:4:kill:after", KILLED)
    run_dir, reference = killed_beside_uninterrupted(args, tmp_path, fault, rc)
    saved = torch.load(ckpt(run_dir, 3), weights_only=True)["state"]
    assert saved["pending"] is None and saved["in_flight"], "the checkpoint waited for the reduction"
    P = 2 if "outer.fragments=2" in args else 1
    assert [f["fragment"] for f in saved["in_flight"]] == list(range(P))
    assert all(0 < f["taken_at"] <= 3 for f in saved["in_flight"])
    resumed(args, run_dir, tmp_path)
    assert [r["from"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "resume"] == [
        str(ckpt(run_dir, 3))
    ]
    if P > 1:
        assert_identical_streaming(run_dir, reference, skip=MEASURED if dist else ())
    else:
        assert_identical(run_dir, reference)


@pytest.mark.slow
def test_the_clock_hides_the_outer_exchange_behind_the_next_round_and_replays_as_recorded(tmp_path):
    """Modelled compute (cluster=h100): a delayed sync's exchange, started a round before it lands, is
    hidden by that round's compute (`clock_outer_hidden_s` > 0) and exposed only by what exceeds it; the
    last one, waited for at the phase's end, is exposed whole. The run's own clock equals the replay of
    its records (the report's), and it exposes less of the exchange than the same run without overlap."""
    args = [*RUN, "cluster=h100", "inner.H=2", "phase.updates=6"]
    clocks = {}
    for overlap in ("none", "delayed"):
        run_dir = tmp_path / overlap
        done = entry([*args, f"outer.overlap={overlap}", f"hydra.run.dir={run_dir}"], tmp_path)
        assert done.returncode == 0, done.stderr
        clocks[overlap] = recorded_clock(run_dir)
        rows = read_metrics(run_dir / "metrics.jsonl")
        resolved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
        replay = clock_of(rows, formats.upgrade_config(resolved), run_cluster(resolved))
        syncs = [f for kind, _, f in clocks[overlap]["rows"] if kind == "sync"]
        assert syncs == [{k: v for k, v in s.items() if k.startswith("clock_")} for s in replay["syncs"]]
    syncs = [f for kind, _, f in clocks["delayed"]["rows"] if kind == "sync"]
    assert len(syncs) == 4  # round 1 lands nothing; the end lands round 2's and then round 3's
    assert syncs[0]["clock_outer_exposed_s"] == syncs[0]["clock_outer_hidden_s"] == 0
    assert all(s["clock_outer_hidden_s"] > 0 for s in syncs[1:3])
    assert syncs[3]["clock_outer_hidden_s"] == 0 < syncs[3]["clock_outer_exposed_s"]
    exposed = {k: c["summary"]["clock/outer_exposed_s"] for k, c in clocks.items()}
    assert exposed["delayed"] < exposed["none"], exposed


HELD_OUT = {("delayed", 5), ("eager", 5), ("delayed", 1)}  # 1 < H: the first round is the last, cut short


@pytest.mark.parametrize(
    "overlap, updates",
    sorted(HELD_OUT),
)
def test_each_sync_row_holds_the_heldout_loss_of_the_weights_that_exist_at_its_clock(
    tmp_path, monkeypatch, overlap, updates
):
    """Issue 48: an overlap run ends on two landings after its last update, the one due (or none, in a
    first round cut short: "no replica synced") and the flush. Each sync row, and so the summary's
    `clock/best_heldout_loss` and `clock/time_to_best_s`, the clock command's replay and the report's time
    to target, holds the held-out loss of the global weights its own landing left, kept here as each
    landing returns and evaluated here; never the final weights' one landing early. Equal (==): the same
    evaluation of the same fp32 weights. With the target the final loss (below every earlier one), the
    time to target is the flush's clock: never before the last landing."""
    from hypertrain.diloco.sync import FragmentSync
    from hypertrain.report.clock.clocks import run_clock
    from hypertrain.report.runs import load_run
    from hypertrain.report.table import table_rows
    from hypertrain.run import session
    from hypertrain.run.evaluation import heldout_eval

    landed, prepared = [], []  # the global weights after each landing, in order; the run

    def keeping(method):
        def land(self, *args):
            landing = method(self, *args)
            landed.append({n: t.detach().clone() for n, t in self.theta.items()})
            return landing

        return land

    def train(run, *args, **kwargs):
        prepared.append(run)
        return real_train(run, *args, **kwargs)

    real_train = session.train
    monkeypatch.setattr(FragmentSync, "land", keeping(FragmentSync.land))
    monkeypatch.setattr(FragmentSync, "flush", keeping(FragmentSync.flush))
    monkeypatch.setattr(session, "train", train)
    run_dir = tmp_path / "run"
    args = [*RUN, "cluster=h100", "inner.H=2", f"phase.updates={updates}", f"outer.overlap={overlap}"]
    done = entry([*args, "checkpoint.every=0", f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr

    rows = read_metrics(run_dir / "metrics.jsonl")
    (first,) = [r for r in rows if r["kind"] == "eval"]
    syncs = [r for r in rows if r["kind"] == "sync"]
    assert [r["update"] for r in syncs][-2:] == [updates, updates]  # the one due (or none), the flush
    assert len(syncs) == len(landed)
    want = [heldout_eval(prepared[0], weights)[0] for weights in landed]
    assert [r["eval_loss"] for r in syncs] == want
    assert want[-2] != want[-1]  # the flush moves the weights: the bug gave both rows the last
    # the held-out curve as the rows' clock holds it: the loss before training at 0 s, then each landing's
    curve = [(0.0, first["eval_loss"])] + [(r["clock_s"], loss) for r, loss in zip(syncs, want, strict=True)]
    best = min(loss for _, loss in curve)
    summary = {k: v for r in rows if r["kind"] == "summary" for k, v in r.items()}
    assert summary["clock/best_heldout_loss"] == best
    assert summary["clock/time_to_best_s"] == next(clock for clock, loss in curve if loss == best)
    resolved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    replay = clock_of(rows, formats.upgrade_config(resolved), run_cluster(resolved))  # the clock command's
    assert [(p["clock_s"], p["eval_loss"]) for p in replay["heldout"]] == curve
    # the report's table: the first clock at or below the target, from the rows' curve
    run = load_run(run_dir, need_plan=False)
    clock, why = run_clock(run)
    assert why is None
    final = want[-1]
    assert all(loss > final for _, loss in curve[:-1])  # so only the final weights reach it
    for target in [loss for _, loss in curve] + [(final + want[-2]) / 2]:
        (row,) = table_rows([run], ["run"], [clock], target)
        assert row["time_to_target_s"] == next(clock for clock, loss in curve if loss <= target)
        if target < want[-2]:  # only the flush's weights reach it
            assert row["time_to_target_s"] == curve[-1][0] == summary["clock/total_s"]
            assert row["time_to_target_s"] > syncs[-2]["clock_s"]  # after the landing before the flush


# the replicas layout with int8 and error feedback (its sums are the simulation's, so are its codes); the
# benchmark layout in fp32: its gradients differ from the simulation's by rounding, which may flip an int8
# code (invariant 10: whole runs on different engines may flip a choice within rounding of a boundary)
LAYOUTS = {
    "replicas": (["world=2", "outer.compress=int8", "outer.error_feedback=true"], []),
    "benchmark": (["world=4"], ["processes.layout=benchmark"]),
}
DIST_CASES = [(layout, overlap) for layout in LAYOUTS for overlap in ("eager", "delayed")]


@pytest.mark.parametrize(
    "layout, overlap",
    [pytest.param(*c, marks=() if c == ("replicas", "eager") else pytest.mark.slow) for c in DIST_CASES],
)
def test_real_processes_equal_the_simulation(tmp_path, layout, overlap):
    """Two processes (the reduction on the outer group, in flight while the next round's collectives
    run; eager's mean of the outer weights on the default group beside it) against the one-process
    simulation of the same run, P = 2 (LAYOUTS): every held-out loss and weights.pt
    within rounding. Bound: the simulation's and the processes' own rounding add (x 2), each at most
    `helpers.rounding_floors`' (2 updates + syncs) U32 per weight relative to its norm, x ROUNDING_FACTOR;
    the replicas layout sums the same numbers in the same order (exact), the benchmark layout averages
    each gradient over a replica's 2 ranks."""
    updates, H = 6, 2
    args = [
        *RUN,
        f"inner.H={H}",
        f"phase.updates={updates}",
        "replicas=2",
        f"outer.overlap={overlap}",
        "outer.fragments=2",
        *LAYOUTS[layout][0],
    ]
    sim, real = tmp_path / "sim", tmp_path / "dist"
    done = entry([*args, f"hydra.run.dir={sim}"], tmp_path)
    assert done.returncode == 0, done.stderr
    done = entry([*args, *LAYOUTS[layout][1], "processes=dist", f"hydra.run.dir={real}"], tmp_path)
    assert done.returncode == 0, done.stderr
    relative = 2 * ROUNDING_FACTOR * (2 * updates + 2 * updates // H) * U32
    got, want = torch.load(real / "weights.pt"), torch.load(sim / "weights.pt")
    for n, t in want.items():
        assert float((got[n].double() - t.double()).norm()) <= relative * float(t.norm()), n
    losses = [
        [r["eval_loss"] for r in read_metrics(d / "metrics.jsonl") if r["kind"] == "eval"]
        for d in (real, sim)
    ]
    assert len(losses[0]) == len(losses[1]) == 1 + updates // H
    assert losses[0] == pytest.approx(losses[1], rel=relative * 10)
    if layout == "replicas":
        assert got == {n: t for n, t in got.items() if torch.equal(t, want[n])}  # the same sums: exact


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_a_mixture_of_experts_follows_the_algorithm(overlap):
    """The overlap composes with the stacked mixture of experts (issue 36): every sync of a run of
    model.is_moe=true (4 experts, top-2, the router and the experts synced as any parameter) within the
    reference's bound; P = 2 puts the router and the experts of each layer in its layer's fragment."""
    cfg = overlap_cfg(overlap, 2)
    cfg = replace(cfg, model=replace(cfg.model, is_moe=True, n_experts=4, top_k=2, expert_ffn=32))
    syncs, _ = run_syncs(cfg)
    assert len(syncs) == 8
    assert any("router" in n for n in syncs[0][2]["theta"]), "not a mixture"
    checked = reference_errors(cfg, syncs)
    assert checked and all(err <= bound for err, bound in checked), checked
