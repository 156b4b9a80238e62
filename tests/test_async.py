"""Asynchronous replicas (outer.schedule=async, docs/async.md): the arrival schedule is a pure function of
the config, worked out here by hand on exact binary fractions; the server's rules equal float64
references written here from Liu et al. 2024 (the naive outer Nesterov step, and Algorithm 3), driven by
the run's own arrival order and pseudo-gradients, at every arrival within a bound derived beside them
(and a wrong activation c falls outside it); equal speeds are DiLoCo's rounds, bitwise; the loop and
stacked engines agree bitwise; a run killed between server updates resumes to the uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import pytest
import torch
from helpers import (
    QUICK,
    ReferenceRuns,
    assert_same_weights,
    compose_train,
    killed_beside_uninterrupted,
    resumed,
    small_cfg,
)
from omegaconf import OmegaConf

from hypertrain.choices import Schedule
from hypertrain.config import OUTER_NODES, ArrivalsConfig, CodecConfig
from hypertrain.diloco.asynchrony.arrivals import job_steps, replica_speeds, schedule
from hypertrain.diloco.asynchrony.asynchronous import server_updates
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.preflight.checks import validate
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.records.files import read_records
from hypertrain.records.rows import ArrivalRow
from hypertrain.report.runs import load_run
from hypertrain.report.table import async_steps_done, figures
from hypertrain.schedule_table import ENTRIES, schedule_entry

U = 2.0**-24  # fp32's unit roundoff


ARRIVAL_FIELDS = {f.name for f in fields(ArrivalsConfig)}
CODEC_FIELDS = {f.name for f in fields(CodecConfig)}


def async_cfg(speeds=(1.0, 0.5), engine="stacked", updates=8, **outer):
    """small_cfg (R = 2, H = 2) under outer.schedule=async on modelled compute (an H100's); a field of
    async's node (`rule`, `dylu`, ...: ArrivalsConfig) goes under outer.arrivals, a field the codecs share
    (`block`, `tile`, ...: CodecConfig) under outer.codec."""
    base = small_cfg()
    own = ArrivalsConfig(**{k: outer.pop(k) for k in list(outer) if k in ARRIVAL_FIELDS})
    codec = CodecConfig(**{k: outer.pop(k) for k in list(outer) if k in CODEC_FIELDS})
    return small_cfg(
        outer=replace(base.outer, schedule=Schedule["async"], arrivals=own, codec=codec, **outer),
        cluster=replace(
            base.cluster, compute="modelled", peak_tflops=989.0, mfu=0.4, replica_speeds=list(speeds)
        ),
        phase=replace(base.phase, updates=updates),
        engine=replace(base.engine, name=engine),
    )


def trained(cfg, record: list | None = None) -> dict[str, torch.Tensor]:
    """The run's final global weights; with `record`, every server update's (deltas [k, n] as applied,
    the weights after it), from the server itself."""
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    if not schedule_entry(cfg.outer.schedule).server:
        for _ in rounds(run, state):
            pass
        return state.theta
    server = state.asynchronous.server
    apply = server.apply

    def recording(theta, deltas, tokens):
        mean = apply(theta, deltas, tokens)
        flat = torch.cat([t.reshape(-1) for t in theta.values()])
        record.append((deltas.clone(), flat.clone()))
        return mean

    if record is not None:
        record.append((None, torch.cat([t.reshape(-1) for t in state.theta.values()]).clone()))
        server.apply = recording
    for _ in server_updates(run, state):
        pass
    return state.theta


# -- the schedule ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixedTiming:
    """A clock of exact binary fractions: every step S / v_m seconds, every message M seconds."""

    speeds: tuple[float, ...]
    S: float = 0.25
    M: float = 0.0625

    def step_s(self, targets: int, replica: int, job: int) -> float:
        return self.S / self.speeds[replica]

    @property
    def message_s(self) -> float:
        return self.M


def test_dylu_gives_each_replica_its_share_of_h_by_its_speed_eq_6():
    outer = async_cfg().outer
    assert job_steps(outer, 4, [1.0, 1.0, 1.0, 0.5]) == [4, 4, 4, 4]
    dylu = replace(outer, arrivals=ArrivalsConfig(dylu=True))
    assert job_steps(dylu, 4, [1.0, 1.0, 1.0, 0.5]) == [4, 4, 4, 2]
    assert job_steps(dylu, 2, [3.0, 1.0]) == [2, 1]  # floor(2/3 * 2) = 1
    assert job_steps(dylu, 2, [10.0, 1.0]) == [2, 1]  # floor(0.2) = 0, at least 1


def test_a_schedules_fields_written_at_their_defaults_are_accepted_under_the_other():
    """Each schedule's own fields (its node's) set away from their defaults under the other are refused
    (tests/test_bad_input.py); written out at their defaults on the command line (as a preset or a copied
    config.yaml holds them) they pass, under rounds and under async alike."""
    base = compose_train([*QUICK, "cluster=h100"])
    for entry in ENTRIES:
        other = next(e.name for e in ENTRIES if e is not entry)
        written = []
        if entry.node:  # its node's fields at their defaults: the node is dropped under the other
            node = OUTER_NODES[entry.node]()
            written += [f"outer.{entry.node}.{f.name}={getattr(node, f.name)}" for f in fields(node)]
        validate(
            OmegaConf.to_object(
                OmegaConf.merge(base, OmegaConf.from_dotlist([f"outer.schedule={other}", *written]))
            )
        )


def test_drawn_speeds_are_a_seeded_lognormal_drawn_once():
    cluster = replace(async_cfg().cluster, replica_speeds=[], speed_sigma=0.5, speed_seed=3)

    z = np.random.default_rng(3).standard_normal(4)
    assert replica_speeds(cluster, 4) == [float(x) for x in np.exp(0.5 * z)]
    assert replica_speeds(replace(cluster, speed_sigma=0.0), 3) == [1.0, 1.0, 1.0]


def test_a_replica_twice_as_slow_arrives_by_the_clock_and_its_staleness_counts_the_updates_between():
    """R = 2, speeds (1, 0.5), H = 2, 4 steps each: step S = 1/4 (replica 1: 1/2), message M = 1/16.
    Replica 0's jobs arrive at 2S+M, then (pulled at 2S+M, download M) 4S+3M; replica 1's at 4S+M,
    then 8S+3M, each job waiting for one update of the other's."""
    updates = schedule(async_cfg().outer, 2, 4, FixedTiming((1.0, 0.5)), lambda k, m: 16)
    S, M = 0.25, 0.0625
    got = [
        (u.index, u.clock_s, [j.replica for j in u.jobs], [j.first for j in u.jobs], u.staleness)
        for u in updates
    ]
    assert got == [
        (1, 2 * S + M, [0], [0], [0]),
        (2, 4 * S + M, [1], [0], [1]),
        (3, 4 * S + 3 * M, [0], [2], [1]),
        (4, 8 * S + 3 * M, [1], [2], [1]),
    ]


def test_equal_speeds_tie_and_arrive_as_one_update_per_round():
    outer = async_cfg().outer
    updates = schedule(outer, 2, 6, FixedTiming((1.0, 1.0, 1.0)), lambda k, m: 16)
    assert [[j.replica for j in u.jobs] for u in updates] == [[0, 1, 2]] * 3
    assert [u.staleness for u in updates] == [[0, 0, 0]] * 3


def test_the_grace_window_gathers_arrivals_close_to_the_first():
    """Speeds (1, 0.9): replica 1 arrives 2S/0.9 - 2S = 1/18 s after replica 0: apart with no grace,
    together with a grace of 0.06 s (the update at the later one's time)."""
    timing = FixedTiming((1.0, 0.9))
    apart = schedule(async_cfg().outer, 2, 2, timing, lambda k, m: 16)
    assert [[j.replica for j in u.jobs] for u in apart] == [[0], [1]]
    together = schedule(async_cfg(grace_s=0.06).outer, 2, 2, timing, lambda k, m: 16)
    assert [[j.replica for j in u.jobs] for u in together] == [[0, 1]]
    assert together[0].clock_s == apart[1].clock_s


def test_a_last_job_is_cut_to_the_steps_left():
    updates = schedule(async_cfg().outer, 3, 4, FixedTiming((1.0,)), lambda k, m: 16)
    assert [u.jobs[0].steps for u in updates] == [3, 1]


def test_the_arrival_order_is_a_pure_function_of_the_config(tmp_path):
    from hypertrain.diloco.asynchrony.asynchronous import arrival_schedule

    cfg = async_cfg(speeds=(1.0, 0.7), dylu=True)
    assert arrival_schedule(prepare(cfg)) == arrival_schedule(prepare(cfg))


# -- the rules against float64 references from the paper ------------------------------------------


def reference_naive(theta0, deltas, lr, beta):
    """Liu et al. 2024's asynchronous baseline: on each arrival g, the outer Nesterov step
    b <- beta b + g; theta <- theta - lr (g + beta b) (DiLoCo's outer optimizer), in float64, with the
    rounding bound of the fp32 code (derived in `reference_dn`)."""
    theta, b = theta0.double(), torch.zeros_like(theta0, dtype=torch.float64)
    err_b, err = torch.zeros_like(b), torch.zeros_like(b)
    out = []
    for g in deltas:
        g = g.double()
        err_b = beta * err_b + 3 * U * (beta * b.abs() + g.abs())
        b = beta * b + g
        upd = g + beta * b
        err_upd = beta * err_b + 3 * U * upd.abs()
        theta = theta - lr * upd
        err = err + lr * err_upd + 3 * U * (theta.abs() + lr * upd.abs())
        out.append((theta, err))
    return out


def reference_dn(theta0, deltas, lr, beta, N, c):
    """Liu et al. 2024, Algorithm 3 (delayed Nesterov), in float64, one arrival g_t at a time:
    Delta <- Delta + g_t; if t mod N == 0: m <- beta m + Delta / N, theta <- theta - lr ((1 - cN + c)
    beta m + g_t / N), Delta <- 0; else theta <- theta - lr (c beta m + g_t / N).

    The bound beside each theta: fp32 rounds each of the code's operations to within U of its result
    (relative); an operation on a rounded input carries that input's error forward. So the momentum's
    error grows as e_m <- beta e_m + 3U (beta |m| + |Delta| / N) (a scale, an add, the division), the
    update's as w e_m + 3U |update| (w the momentum's weight: the scale, the add, the cast), the weights'
    as e <- e + lr e_update + 3U (|theta| + lr |update|) (the lr's scale, the subtraction, the final
    rounding): the recorded deltas are the code's own, exact in float64, so nothing else differs."""
    theta, m = theta0.double(), torch.zeros_like(theta0, dtype=torch.float64)
    buffer = torch.zeros_like(m)
    err_m, err = torch.zeros_like(m), torch.zeros_like(m)
    out = []
    for t, g in enumerate(deltas, start=1):
        g = g.double()
        buffer = buffer + g
        if t % N == 0:
            err_m = beta * err_m + 3 * U * (beta * m.abs() + buffer.abs() / N)
            m = beta * m + buffer / N
            w = (1 - c * N + c) * beta
            buffer = torch.zeros_like(buffer)
        else:
            w = c * beta
        upd = w * m + g / N
        err_upd = w * err_m + 3 * U * (upd.abs() + w * m.abs())
        theta = theta - lr * upd
        err = err + lr * err_upd + 3 * U * (theta.abs() + lr * upd.abs())
        out.append((theta, err))
    return out


def excess(record, reference) -> float:
    """The largest amount by which the run's weights after any arrival leave the reference's bound."""
    worst = 0.0
    for (_, got), (want, bound) in zip(record[1:], reference, strict=True):
        worst = max(worst, float(((got.double() - want).abs() - bound).max()))
    return worst


@pytest.fixture(scope="module")
def naive_record():
    record: list = []
    trained(async_cfg(rule="naive", updates=12), record)
    return record


@pytest.fixture(scope="module")
def dn_record():
    record: list = []
    trained(async_cfg(rule="delayed_nesterov", dn_activation=0.25, updates=12), record)
    return record


def test_naive_is_the_outer_nesterov_step_on_every_arrival(naive_record):
    assert all(len(deltas) == 1 for deltas, _ in naive_record[1:])  # no ties: one arrival an update
    cfg = async_cfg()
    deltas = [d[0] for d, _ in naive_record[1:]]
    assert len(deltas) == 12  # 6 jobs a replica
    assert (
        excess(naive_record, reference_naive(naive_record[0][1], deltas, cfg.outer.lr, cfg.outer.momentum))
        <= 0
    )


def test_delayed_nesterov_is_algorithm_3_at_every_arrival_and_a_wrong_activation_is_not(dn_record):
    cfg = async_cfg()
    deltas = [d[0] for d, _ in dn_record[1:]]
    theta0, lr, beta = dn_record[0][1], cfg.outer.lr, cfg.outer.momentum
    assert excess(dn_record, reference_dn(theta0, deltas, lr, beta, N=2, c=0.25)) <= 0
    # the negative controls: the momentum applied between updates (c = 0), or the arrivals' order swapped
    assert excess(dn_record, reference_dn(theta0, deltas, lr, beta, N=2, c=0.0)) > 0
    swapped = [deltas[i ^ 1] for i in range(len(deltas))]
    assert excess(dn_record, reference_dn(theta0, swapped, lr, beta, N=2, c=0.25)) > 0


# -- the neutral settings, the engines -----------------------------------------------------------


@pytest.mark.parametrize("rule", ["delayed_nesterov", "naive"])
def test_equal_speeds_are_diloco_rounds_bitwise(rule):
    """Equal speeds, no stragglers: both replicas arrive together (equal tokens, equal arithmetic), one
    update per round of their mean; delayed Nesterov with N = R, c = 0 then computes DiLoCo's step with
    the same operations in the same order (the sum over replicas in replica order, divided by R; the
    momentum's scale and add; the update's add), so it equals outer.schedule=rounds bitwise, as naive
    does (DiLoCo's own `outer_step` on the same mean)."""
    want = trained(replace(async_cfg(), outer=replace(async_cfg().outer, schedule=Schedule["rounds"]),
                           cluster=replace(async_cfg().cluster, replica_speeds=[])))  # fmt: skip
    got = trained(async_cfg(speeds=(), rule=rule))
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def four_one_slow(cfg, engine: str):
    """`cfg` with four replicas, the last half as fast (with DyLU the three fast ones' jobs start together
    and the stacked engine computes them in one call), H = 4, 8 updates of 32, on `engine`: the setting
    of every loop = stacked test of async."""
    return replace(
        cfg,
        cluster=replace(cfg.cluster, replica_speeds=[1.0, 1.0, 1.0, 0.5]),
        replicas=4,
        inner=replace(cfg.inner, H=4),
        phase=replace(cfg.phase, updates=8, global_batch=32),
        engine=replace(cfg.engine, name=engine),
    )


def test_the_loop_and_stacked_engines_agree_bitwise():
    """Four replicas, one half as fast, with DyLU: the three fast ones' jobs start together and the stacked
    engine computes them in one call; every number equals the loop engine's."""
    base = async_cfg(dylu=True)
    stacked, loop = (trained(four_one_slow(base, engine)) for engine in ("stacked", "loop"))
    for name, t in loop.items():
        assert torch.equal(stacked[name], t), name


# -- records, resume ------------------------------------------------------------------------------

ASYNC = [*QUICK, "logger=none", "outer.schedule=async", "cluster=h100", "cluster.replica_speeds=[1,0.5]"]
ASYNC += ["phase.updates=12", "inner.H=2"]


def arrivals(run_dir) -> list[dict]:
    return [r.to_json() for r in read_records(run_dir / "metrics.jsonl") if isinstance(r, ArrivalRow)]


@pytest.mark.slow
def test_a_run_killed_between_server_updates_resumes_to_the_uninterrupted_one(tmp_path):
    """SIGKILL before server update 6 (delayed Nesterov's buffer holding one arrival, a job in flight),
    resume=true: every arrival row and the weights equal the uninterrupted run's."""
    run_dir, reference = killed_beside_uninterrupted(ASYNC, tmp_path, "0:6:kill")
    resumed(ASYNC, run_dir, tmp_path)
    want = arrivals(reference)
    assert len(want) == 12 and arrivals(run_dir) == want
    assert_same_weights(torch.load(run_dir / "weights.pt"), torch.load(reference / "weights.pt"))


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_checkpoints_and_resumes_to_the_uninterrupted_one(tmp_path):
    """SIGTERM before server update 7: the run stops after update 7 with a checkpoint (exit 143);
    resume=true ends where the uninterrupted run does."""
    run_dir, reference = killed_beside_uninterrupted(ASYNC, tmp_path, "0:7:term", killed_rc=143)
    resumed(ASYNC, run_dir, tmp_path)
    assert arrivals(run_dir) == arrivals(reference)
    assert_same_weights(torch.load(run_dir / "weights.pt"), torch.load(reference / "weights.pt"))


def test_a_run_records_an_arrival_per_server_update_and_the_async_summary(tmp_path):
    run_dir = ReferenceRuns.beside(tmp_path)(ASYNC)
    rows = arrivals(run_dir)
    assert [r["update"] for r in rows] == list(range(1, 13))
    assert sorted(r["replicas"][0] for r in rows) == [0] * 6 + [1] * 6
    assert [r.get("eval_loss") is not None for r in rows] == [i % 2 == 1 for i in range(12)]
    assert all(r["clock_s"] > 0 for r in rows) and [r["clock_s"] for r in rows] == sorted(
        r["clock_s"] for r in rows
    )
    summary = {}
    for r in read_records(run_dir / "metrics.jsonl"):
        if r.kind == "summary":
            summary |= r.values
    stale = [s for r in rows for s in r["staleness"]]
    assert summary["async/arrivals"] == 12 and summary["async/staleness_max"] == max(stale)
    assert summary["async/staleness_mean"] == sum(stale) / 12
    # the report's updates done: the slowest replica's inner steps whose jobs arrived (12/12 at the end),
    # checked against each prefix of the rows as the sum of each replica's jobs' steps
    run = load_run(run_dir)
    assert figures(run)["updates"] == "12/12"
    typed = run.of_kind("arrival")
    for k in range(len(rows) + 1):
        jobs = [(m, s) for r in rows[:k] for m, s in zip(r["replicas"], r["steps"], strict=True)]
        sums = [sum(s for m, s in jobs if m == i) for i in (0, 1)]
        assert async_steps_done(typed[:k], 2) == min(sums)


def test_arrivals_applied_together_are_one_mean_uniform_or_weighted_by_tokens():
    """g = sum_i w_i delta_i / sum_i w_i, and S = k g: worked out by hand on exact numbers."""
    from hypertrain.diloco.asynchrony.server import contribution

    deltas = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    total, mean = contribution(deltas, [1, 3], "uniform")
    assert total.tolist() == [4.0, 6.0] and mean.tolist() == [2.0, 3.0]
    total, mean = contribution(deltas, [1, 3], "tokens")
    assert mean.tolist() == [2.5, 3.5] and total.tolist() == [5.0, 7.0]


def test_under_rounds_a_slow_replica_slows_the_clock_and_changes_no_weight():
    """Speeds (1, 0.5) in rounds: every update waits for the slow replica (twice the step's seconds)."""
    from hypertrain.clock.timeline import Clock, Shape
    from hypertrain.config import ClusterConfig
    from hypertrain.records.rows import UpdateRow

    cluster = ClusterConfig(compute="modelled", replica_speeds=[1.0, 0.5])
    shape = Shape(2, 1, 2, 1, 0, "none", "gather")
    slow, even = Clock(shape, cluster, 1000), Clock(shape, replace(cluster, replica_speeds=[]), 1000)
    row = UpdateRow(update=1, round=1, loss=[1.0, 1.0], tokens=64, rank_seconds=[0.0])
    assert slow.update(row) == 2 * even.update(row) > 0
    base = async_cfg()
    rounds_cfg = replace(base, outer=replace(base.outer, schedule=Schedule["rounds"]))
    want = trained(replace(rounds_cfg, cluster=replace(base.cluster, replica_speeds=[])))
    got = trained(rounds_cfg)
    assert all(torch.equal(got[n], t) for n, t in want.items())


def test_the_clock_command_refuses_to_retime_an_async_run_on_another_cluster_or_size(tmp_path):
    """Its own clock chose the arrival order, so its weights are its cluster's: one line naming
    outer.schedule=async, exit 2, nothing written."""
    import contextlib
    import io

    from helpers import tree

    from hypertrain.report.clock import retime

    run = ReferenceRuns.beside(tmp_path)(ASYNC)
    before = tree(run)
    for other in (
        ["cluster=a100"],
        ["cluster=h100", "cluster/inter=internet_1g"],
        ["--model-params", "1000000"],
    ):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = retime.main([str(run), *other])
        assert (code, out.getvalue()) == (2, ""), (other, err.getvalue())
        line = err.getvalue()
        assert len(line.splitlines()) == 1 and "outer.schedule=async" in line and "arrived in" in line
        assert tree(run) == before


def test_the_clock_command_reads_an_async_runs_own_clock_back(tmp_path):
    """On its own cluster the replay is the run's own arrival clock: the held-out curve at the arrival
    rows' clocks (from 0 at the first eval), the total the last arrival's, the size cluster.model_params."""
    from hypertrain.clock.replay import clock_of
    from hypertrain.records.files import read_metrics

    run = ReferenceRuns.beside(tmp_path)([*ASYNC, "cluster.model_params=1000000000"])
    rows = arrivals(run)
    resolved = yaml_config(run)
    from hypertrain.clock.replay import run_cluster

    got = clock_of(read_metrics(run / "metrics.jsonl"), resolved, run_cluster(resolved))
    assert got["total_s"] == rows[-1]["clock_s"] and got["params"] == 1_000_000_000
    assert [p["clock_s"] for p in got["heldout"][1:]] == [r["clock_s"] for r in rows if "eval_loss" in r]
    assert got["heldout"][0]["clock_s"] == 0.0


def test_a_rounds_run_timed_at_cluster_model_params_replays_to_its_own_clock(tmp_path):
    from hypertrain.clock.replay import clock_of, run_cluster
    from hypertrain.records.files import read_metrics

    args = [*QUICK, "logger=none", "cluster=h100", "cluster.model_params=1000000000"]
    run = ReferenceRuns.beside(tmp_path)(args)
    resolved = yaml_config(run)
    rows = read_metrics(run / "metrics.jsonl")
    trained = {}
    for row in rows:
        if row["kind"] == "summary":
            trained |= row
    got = clock_of(rows, resolved, run_cluster(resolved))
    assert trained["clock/params"] == got["params"] == 1_000_000_000
    assert trained["clock/total_s"] == got["total_s"] > 0


def yaml_config(run) -> dict:
    from omegaconf import OmegaConf

    from hypertrain.records import formats

    return formats.upgrade_config(OmegaConf.to_container(OmegaConf.load(run / "config.yaml")))


def test_a_jobs_seconds_are_the_modelled_steps_over_its_speed_times_its_jobs_straggler_factor():
    """Timing.of(cfg): a step of t tokens takes 6 N t / (peak * mfu) / v_m * exp(sigma z), z the
    standard normals of default_rng([seed, j]) for the replica's j-th job; a message alpha + 4 N / beta."""

    from hypertrain.diloco.asynchrony.arrivals import Timing
    from hypertrain.model.shapes import count_params

    base = async_cfg()
    cfg = replace(
        base, cluster=replace(base.cluster, straggler=replace(base.cluster.straggler, sigma=0.5, seed=7))
    )
    timing = Timing.of(cfg)
    N = count_params(cfg.model)
    z = np.random.default_rng([7, 3]).standard_normal(2)
    want = 6 * N * 100 / (989e12 * 0.4) / 0.5 * float(np.exp(0.5 * z[1]))
    assert timing.step_s(100, 1, 3) == pytest.approx(want, rel=1e-12)
    link = cfg.cluster.inter
    assert timing.message_s == pytest.approx(link.latency_us * 1e-6 + 4 * N / (link.bandwidth_gbit * 1e9 / 8))


def test_the_divergence_guard_stops_an_async_run_at_the_server_update_whose_heldout_loss_diverged(tmp_path):
    from helpers import entry

    from hypertrain.failures import Diverged

    run_dir = tmp_path / "run"
    args = [  # the server's fields in their older spellings: read as outer.arrivals.*, noted in train.log
        *ASYNC,
        "outer.async_rule=naive",
        "outer.lr=20",
        "guard.heldout_margin=0",
        "outer.async_eval_every=1",
    ]
    done = entry([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == Diverged.exit_code, done.stderr
    assert "diverged: the held-out loss of the global weights after server update " in done.stderr
    last = arrivals(run_dir)[-1]
    assert last["eval_loss"] > 5.5452  # ln 256, the margin 0
    resolved = OmegaConf.load(run_dir / "config.yaml").outer
    assert (resolved.arrivals.rule, resolved.arrivals.eval_every) == ("naive", 1)
    assert "async_rule" not in resolved and "is now spelled" not in done.stderr  # the terminal: no notice
    log = (run_dir / "train.log").read_text()
    for old, new in (("async_rule", "rule"), ("async_eval_every", "eval_every")):
        assert f"note: outer.{old}= is now spelled outer.arrivals.{new}= " in log


def test_the_divergence_guard_stops_an_async_run_whose_pseudo_gradient_outgrows_the_weights(tmp_path):
    """guard.pseudo_grad_ratio under async: the applied pseudo-gradient's norm (the jobs' mean) against
    the global weights' before it. A ratio of 1e-9 trips at server update 1 (a job of two Adam steps
    moves the weights by far more than 1e-9 of their norm); the row of that update is written first."""
    from helpers import entry

    from hypertrain.failures import Diverged

    run_dir = tmp_path / "run"
    done = entry([*ASYNC, "guard.pseudo_grad_ratio=1e-9", f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == Diverged.exit_code, done.stderr
    assert "diverged: the pseudo-gradient norm at server update 1 is " in done.stderr
    assert "guard.pseudo_grad_ratio=1e-09 times the global weights' norm" in done.stderr
    rows = arrivals(run_dir)
    assert [r["update"] for r in rows] == [1] and rows[0]["pseudo_grad_norm"] > 0


def test_an_arrival_rows_pseudo_gradient_norm_is_the_applied_means(naive_record):
    """Each server update's `Applied.delta_norm` (an arrival row's `pseudo_grad_norm`) against the norm
    of the pseudo-gradient the server was handed, taken here in numpy's float64: one arrival an update,
    so the mean is the delta itself; the two float64 sums of n squares differ by at most n ulps of
    float64 (2^-53 each, relative), the bound below."""
    cfg = async_cfg(rule="naive", updates=12)
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    got = [(applied.delta_norm, applied.theta_norm) for applied in server_updates(run, state)]
    deltas = [d[0].double().numpy() for d, _ in naive_record[1:]]
    weights = [w.double().numpy() for _, w in naive_record[:-1]]
    n = deltas[0].size
    for (delta_norm, theta_norm), delta, theta in zip(got, deltas, weights, strict=True):
        assert delta_norm == pytest.approx(float(np.linalg.norm(delta)), rel=n * 2.0**-53)
        assert theta_norm == pytest.approx(float(np.linalg.norm(theta)), rel=n * 2.0**-53)


def test_documents_of_unequal_length_weigh_each_job_by_the_tokens_it_trained_on():
    """Equal speeds on documents: the replicas' jobs differ in tokens, so in seconds; a grace window
    gathers each pair. The tokens the server weighs are the targets each job's batches held, and the
    token-weighted run differs from the uniform one."""
    from hypertrain.data.batches import update_batch

    base = async_cfg(speeds=(), grace_s=1.0, mean_weights="tokens")
    cfg = replace(base, data=replace(base.data, examples="documents", max_len=48, max_examples=4))
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    seen, apply = [], state.asynchronous.server.apply
    state.asynchronous.server.apply = lambda theta, deltas, tokens: (
        seen.append(tokens),
        apply(theta, deltas, tokens),
    )[1]
    updates = [applied.update for applied in server_updates(run, state)]
    assert [len(u.jobs) for u in updates] == [2] * 4

    def targets(job) -> int:
        batches = [
            update_batch(
                run.phase, run.samples, run.dataset, cfg.data, cfg.inner.micro_batch, 2, k, job.replica
            )
            for k in range(job.first, job.first + job.steps)
        ]
        return sum(b.replica_total for b in batches)

    assert seen == [[targets(job) for job in u.jobs] for u in updates]
    assert any(len(set(tokens)) > 1 for tokens in seen), seen  # unequal: the weights matter
    uniform = trained(replace(cfg, outer=replace(cfg.outer, mean_weights="uniform")))
    assert any(not torch.equal(state.theta[n], t) for n, t in uniform.items())


@pytest.mark.parametrize("engine", ["stacked", "loop"])
def test_jobs_pulled_together_from_different_steps_run_apart_and_as_the_loop_engine_runs_them(engine):
    """Two jobs of one length pulled at one update, at different steps of their replicas (their lr
    differs): the stacked engine stacks only replicas at one step, so they run in two calls, each as the
    loop engine runs it."""
    from hypertrain.diloco.asynchrony.arrivals import Job
    from hypertrain.diloco.asynchrony.asynchronous import run_jobs
    from hypertrain.engines import engine_for

    def deltas(name: str) -> list[torch.Tensor]:
        cfg = async_cfg(engine=name)
        run = prepare(cfg)
        state = RunState.start(run.cfg, initial_weights(run))
        jobs = [Job(0, 1, 0, 2, 32, 0, 0.0, 1.0), Job(1, 1, 2, 2, 32, 0, 0.0, 1.0)]
        run_jobs(run, state, jobs, engine_for(name))
        return [state.asynchronous.flying[m]["delta"] for m in (0, 1)]

    got, want = deltas(engine), deltas("loop")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# outer.arrivals' fields as schema 7 spelled them, flat in outer (written out here, not read from formats)
SCHEMA_7_NAMES = {"rule": "async_rule", "eval_every": "async_eval_every", "dn_buffer": "dn_buffer"}
SCHEMA_7_NAMES |= {"dn_activation": "dn_activation", "grace_s": "grace_s", "dylu": "dylu"}


def test_an_async_runs_config_and_checkpoint_as_schema_7_wrote_them_read_as_todays(tmp_path):
    """config.yaml and the checkpoint of a finished async run, rewritten as schema 7 wrote them (the
    server's fields flat in outer under their older names), upgrade to the run's own config today, so
    the report, the clock and resume read such a run as it ran."""
    from helpers import ReferenceRuns

    from hypertrain.records.formats import upgrade_checkpoint, upgrade_config
    from hypertrain.rundir import checkpoint

    run = ReferenceRuns.beside(tmp_path)(ASYNC)
    today = upgrade_config(OmegaConf.to_container(OmegaConf.load(run / "config.yaml")))
    outer = dict(today["outer"])
    own = outer.pop("arrivals")
    assert own["rule"] == "delayed_nesterov" and set(own) == set(SCHEMA_7_NAMES)
    flat = {**today, "outer": outer | {SCHEMA_7_NAMES[k]: v for k, v in own.items()}}
    assert upgrade_config({**flat, "schema_version": 7}) == today
    saved = checkpoint.load(checkpoint.checkpoints(run)[-1])
    older = {**saved, "schema_version": 7, "config": flat}
    assert upgrade_checkpoint(older)["config"] == saved["config"] == today


def test_an_async_run_directory_of_schema_7_resumed_with_the_older_spellings_is_its_own_run(tmp_path):
    """The finished async reference run rewritten as schema 7 wrote it (config.yaml and every checkpoint:
    the server's fields flat, older names; checkpoints resealed), resumed by the command line of then
    (outer.async_rule=..., outer.async_eval_every=...): accepted as the same run (a changed field would
    be refused, exit 2), exit 0, with no notice of the spelling on the terminal, each in train.log."""
    import shutil

    import yaml
    from helpers import ReferenceRuns, entry

    from hypertrain.rundir import checkpoint

    run_dir = tmp_path / "run"
    shutil.copytree(ReferenceRuns.beside(tmp_path)(ASYNC), run_dir)

    def as_schema_7(config: dict) -> dict:
        outer = dict(config["outer"])
        own = outer.pop("arrivals")
        return {**config, "outer": outer | {SCHEMA_7_NAMES[k]: v for k, v in own.items()}}

    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    text = yaml.safe_dump({**as_schema_7(written), "schema_version": 7}, sort_keys=False)
    (run_dir / "config.yaml").write_text(text)
    for path in checkpoint.checkpoints(run_dir):
        saved = torch.load(path, weights_only=False)
        torch.save({**saved, "schema_version": 7, "config": as_schema_7(saved["config"])}, path)
        checkpoint.seal(path)
    older = ["outer.async_rule=delayed_nesterov", "outer.async_eval_every=0", "outer.dylu=false"]
    done = entry([*ASYNC, *older, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr and "spelled" not in done.stderr + done.stdout
    log = (run_dir / "train.log").read_text()
    assert "note: outer.async_rule= is now spelled outer.arrivals.rule= " in log
    assert "note: outer.dylu= is now spelled outer.arrivals.dylu= " in log
