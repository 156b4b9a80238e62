"""The outer optimizer as a component (issue 49; `hypertrain.optim.outer`): any torch.optim.Optimizer by
its import path as the outer step, the pseudo-gradient handed over as its parameters' `.grad`.

torch.optim.SGD with Nesterov arguments is the built-in step, number for number, wherever the step is
taken (a sync, a codec with churn, eager overlap with fragments, the asynchronous naive rule).
torch.optim.Adam equals a float64 reference of Adam (Kingma & Ba 2015, Algorithm 1, written out here:
torch's bias corrections, eps added to sqrt(v_hat)) on the mean pseudo-gradient the test forms itself
from the replicas' weights, over every sync of runs on both engines, with two fragments and with eager
overlap (each replica's own optimizer), the reference keeping its own moments from the first sync on.
Real processes equal the simulation, a SIGKILLed run resumes bit-identically from Adam's state in its
checkpoint, and the memory estimate's bytes per parameter are a hand count.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import (
    KILLED,
    RUN,
    assert_identical_streaming,
    assert_same_weights,
    ckpt,
    entry,
    killed_beside_uninterrupted,
    resumed,
    small_cfg,
)
from references import U32
from test_async import async_cfg, trained
from test_overlap import _flat, run_syncs

from hypertrain.choices import Schedule
from hypertrain.config import ArrivalsConfig, ChurnConfig, OuterConfig, UserError
from hypertrain.diloco.fragments import members
from hypertrain.diloco.state import RunState
from hypertrain.preflight import memory
from hypertrain.preflight.checks import validate
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.records.files import read_metrics

SGD_NESTEROV = {"momentum": 0.9, "nesterov": True}
# Adam's arguments in the runs below: betas as the example, and eps near the size of sqrt(v_hat)
# (the pseudo-gradients are about 1e-3 here), so that where eps is added shows far above rounding
ADAM = {"betas": [0.8, 0.9], "eps": 1e-3}
ADAM_LR = 0.01


def cfg_with(
    optimizer: str, args: dict, lr: float, *, P: int = 1, overlap: str = "none", engine="stacked", **more
):
    """`small_cfg`, R = 2, H = 2, 8 updates (4 rounds), with this outer optimizer; `more`: outer fields
    (and `churn`, a ChurnConfig)."""
    base = small_cfg()
    churn = more.pop("churn", base.churn)
    outer = OuterConfig(
        optimizer=optimizer, optimizer_args=dict(args), lr=lr, fragments=P, overlap=overlap, **more
    )
    return small_cfg(
        outer=outer,
        churn=churn,
        phase=replace(base.phase, updates=8),
        engine=replace(base.engine, name=engine),
    )


# Where the outer step is called from: DiLoCo's sync; with int8 and error feedback and churn (replica 0
# misses round 2's sync, both miss round 3's: no step at all); eager overlap with two fragments (each
# replica's own optimizer per fragment, and the phase's end)
WIRING = {
    "sync": {},
    "int8-churn": dict(
        compress="int8", error_feedback=True, churn=ChurnConfig(events=["2:0:miss", "3:0:miss", "3:1:miss"])
    ),
    "eager-fragments": dict(P=2, overlap="eager"),
}


@pytest.mark.parametrize("wiring", list(WIRING))
def test_torch_sgd_with_nesterov_arguments_is_the_built_in_step(wiring):
    """Both steps make the same fp32 operations in the same order (buf = mu buf + g, u = g + mu buf,
    theta - lr u; SGD's first buf = clone(g) is the built-in's 0 + g), each correctly rounded, so the
    bound derived is zero: every sync's weights (eager: every replica's own too) are equal bitwise, and
    the momentum buffers equal as numbers (==; a -0.0 of g is +0.0 in the built-in's buffer, 0 + -0.0).
    So the torch optimizer is handed what the built-in is, wherever the step is taken."""
    builtin, b = run_syncs(cfg_with("nesterov", {}, 0.7, **WIRING[wiring]))
    sgd, s = run_syncs(cfg_with("torch.optim.SGD", SGD_NESTEROV, 0.7, **WIRING[wiring]))
    assert len(builtin) == len(sgd) >= 4
    for (_, _, want, _), (_, _, got, _) in zip(builtin, sgd, strict=True):
        for key in ("theta", "replica_theta"):
            pairs = (
                [(got[key], want[key])]
                if key == "theta"
                else zip(got[key] or [], want[key] or [], strict=True)
            )
            for mine, theirs in pairs:
                assert all(torch.equal(mine[n], t) for n, t in theirs.items()), key
    synced = [landing.synced for _, _, _, landings in sgd for landing in landings]
    if wiring == "int8-churn":  # rounds 1 to 4 (the last landing is the phase's end)
        assert synced == [2, 1, 0, 2], synced
    assert s.outer.momentum == {}  # a torch optimizer keeps its state itself
    if wiring == "eager-fragments":
        stepped = [
            (sync.replica_steppers[i], own["momentum"])
            for sync in s.syncs
            for i, own in enumerate(b.outer_replicas)
        ]
    else:
        stepped = [(stepper, b.outer.momentum) for stepper in s.outer_steppers]
    for stepper, momentum in stepped:
        for p, n in zip(stepper.theta.values(), stepper.theta, strict=True):
            assert torch.equal(stepper.optimizer.state[p]["momentum_buffer"], momentum[n]), n  # -0.0 == 0.0


# -- Adam against a float64 reference ----------------------------------------------------------------


class Adam64:
    """Kingma & Ba 2015, Algorithm 1 in float64, with the bound on how far the run's fp32 Adam, fed a
    g_run within err_g of g, may be from it (per entry). torch's form: m_hat = m / (1 - b1^t), v_hat =
    v / (1 - b2^t), theta - lr m_hat / (sqrt(v_hat) + eps).

    Bounds, per entry, first order in U32 (fp32's unit roundoff; every fp32 operation errs by at most U32
    relative to its result): the run's m = lerp(m, g, 1 - b1) rounds three times (g - m, the product, the
    sum) and inherits b1 E_m + (1 - b1) err_g; v = b2 v + (1 - b2) g^2 rounds four times (two products,
    the scalar, the sum) and inherits b2 E_v + (1 - b2) (2 |g| err_g + err_g^2). The step: sqrt(v),
    / sqrt(1 - b2^t), + eps, m / denom, x -lr/(1 - b1^t) (the scalar rounded to fp32 too) and the sum:
    6 U32 of |u| beside the sum's U32 |theta_new|; an error E_v moves sqrt(v) by at most E_v / (sqrt(v) +
    sqrt(v - E_v)), and never by more than sqrt(E_v)."""

    def __init__(self, lr: float, betas, eps: float, variant: str = "torch"):
        self.lr, (self.b1, self.b2), self.eps, self.variant = lr, betas, eps, variant
        self.m = self.v = self.Em = self.Ev = 0.0
        self.t = 0

    def step(self, theta, g, err_g):
        """(theta_new, bound): one step from the run's own theta (float64) on the reference mean g,
        the run's mean within err_g of it."""
        b1, b2, eps = self.b1, self.b2, self.eps
        m_old, v_old = self.m, self.v
        self.t += 1
        self.m = b1 * m_old + (1 - b1) * g
        self.v = b2 * v_old + (1 - b2) * g * g
        self.Em = b1 * self.Em + (1 - b1) * err_g + 3 * U32 * (b1 * abs(m_old) + (1 - b1) * g.abs())
        dv = (1 - b2) * (2 * g.abs() * err_g + err_g**2)
        self.Ev = b2 * self.Ev + dv + 4 * U32 * (b2 * abs(v_old) + (1 - b2) * g * g)
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        if self.variant == "no-bias-correction":  # negative controls: what the reference must not accept
            bc1 = bc2 = 1.0
        root = self.v.sqrt()
        if self.variant == "eps-hat":  # Algorithm 1's "efficient" form: eps added before the correction
            denom = (root + eps) / bc2**0.5
        else:
            denom = root / bc2**0.5 + eps
        new = theta - self.lr / bc1 * self.m / denom
        floor = (self.v - self.Ev).clamp_min(0).sqrt()
        E_root = torch.minimum(self.Ev / (root + floor).clamp_min(1e-300), self.Ev.sqrt())
        E_denom = E_root / bc2**0.5
        low = (denom - E_denom).clamp_min(eps)
        m_high = self.m.abs() + self.Em
        propagated = self.lr / bc1 * (self.Em / low + m_high * E_denom / (low * denom))
        rounding = 6 * U32 * self.lr / bc1 * m_high / low + U32 * (new.abs() + propagated)
        return new, propagated + rounding


def adam_excess(cfg, syncs, variant: str = "torch") -> list[float]:
    """For every fragment's landings in each part of the run (`test_overlap.run_syncs`): the largest
    distance of a stepped weight from the reference less its bound (<= 0 where the run is within it).

    The mean pseudo-gradient is formed here in float64 from the run's own fp32 weights before the part
    (re-anchored: the weights before each part's first step are the run's), the reference keeping its
    own Adam moments per fragment (under eager per fragment and replica) from the first sync on. Without
    overlap g = mean_m (theta - X_m), which the run forms with (R + 1) roundings of the mean |theta - X_m|
    (`references.assert_outer_step`). Eager (Kale et al. 2025, Algorithm 3, as tests/test_overlap.py
    reads it): at a fragment's sync point each replica m steps its own weights with A(t-1) + (d_m(t) -
    d_m(t-1)) / M (a term before the first sync is 0), at the phase's end once more with A(T) - d_m(T) /
    M; the run's A has the mean's (R + 1) roundings, its d_m one each, the combination three more (a
    difference, a division, a sum). A weight stepped twice in a part carries the first step's bound."""
    o, R = cfg.outer, cfg.replicas
    betas, eps = o.optimizer_args["betas"], o.optimizer_args["eps"]
    eager = o.overlap == "eager"
    frags = members(cfg)
    optimizers: dict = {}
    flight: dict[int, tuple] = {}  # eager: fragment -> (A, its error bound, the rows d_m)
    out = []

    def adam(key):
        return optimizers.setdefault(key, Adam64(o.lr, betas, eps, variant))

    for before, landed, after, _ in syncs:
        current: dict[int, tuple[list, list]] = {}  # fragment -> each stepped copy's weights, bounds
        for p in landed:
            names = frags[p]
            X = torch.stack([_flat(x, names) for x in before["X"]])
            if not eager:
                assert p not in current, "a fragment lands once a part without overlap"
                theta = _flat(before["theta"], names)
                d = theta - X
                new, bound = adam(p).step(theta, d.mean(0), (R + 1) * U32 * d.abs().mean(0))
                current[p] = ([new], [bound])
            elif p not in current:  # its sync point: d_m(t) taken, the stale term applied
                theta = [_flat(w, names) for w in before["replica_theta"]]
                fresh = torch.stack(theta) - X
                A, err_A, stale = flight.get(p, (0.0, 0.0, torch.zeros_like(fresh)))
                steps = []
                for m in range(R):
                    g = A + (fresh[m] - stale[m]) / R
                    err = err_A + 3 * U32 * (fresh[m].abs() + stale[m].abs()) / R + U32 * g.abs()
                    steps.append(adam((p, m)).step(theta[m], g, err))
                current[p] = ([x for x, _ in steps], [b for _, b in steps])
                flight[p] = (fresh.mean(0), (R + 1) * U32 * fresh.abs().mean(0), fresh)
            else:  # the phase's end: the last reduction applied
                A, err_A, d = flight.pop(p)
                thetas, bounds = current[p]
                steps = []
                for m in range(R):
                    g = A - d[m] / R
                    err = err_A + 3 * U32 * d[m].abs() / R + U32 * g.abs()
                    new, bound = adam((p, m)).step(thetas[m], g, err)
                    steps.append((new, bound + bounds[m]))
                current[p] = ([x for x, _ in steps], [b for _, b in steps])
        for p, (thetas, bounds) in current.items():
            names = frags[p]
            got = (
                [_flat(after["theta"], names)]
                if not eager
                else [_flat(w, names) for w in after["replica_theta"]]
            )
            out.append(
                max(float(((g - t).abs() - b).max()) for g, t, b in zip(got, thetas, bounds, strict=True))
            )
    return out


CASES = {
    "loop": dict(engine="loop"),
    "stacked-fragments": dict(P=2),
    "eager": dict(overlap="eager"),
    "eager-fragments": dict(P=2, overlap="eager"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_adam_is_a_float64_adam_on_the_mean_pseudo_gradient(case):
    """Every landing of a run with torch.optim.Adam as the outer optimizer is within the bound of the
    float64 reference (`Adam64`, `adam_excess`), over four syncs of each fragment (each replica's own
    optimizer under eager); the references without the bias correction, or with eps added before it,
    are far outside it (the runs steer their numbers: a reference of the wrong algorithm must fail)."""
    cfg = cfg_with("torch.optim.Adam", ADAM, ADAM_LR, **CASES[case])
    syncs, _ = run_syncs(cfg)
    excess = adam_excess(cfg, syncs)
    for p in range(cfg.outer.fragments):  # at least 4 syncs of each fragment (8 updates, H = 2)
        assert sum(landed.count(p) for _, landed, _, _ in syncs) >= 4, p
    assert max(excess) <= 0, excess
    for variant in ("no-bias-correction", "eps-hat"):
        assert max(adam_excess(cfg, syncs, variant)) > 0, variant


# -- asynchronous replicas: the naive rule's step on the optimizer -------------------------------------


def test_under_async_a_torch_optimizer_is_the_naive_rules_step_on_each_server_updates_mean():
    """outer.async_rule=naive with torch.optim.SGD's Nesterov arguments is the built-in naive rule,
    bitwise (the same operations as above); with torch.optim.Adam every server update (one arrival
    each: speeds 1 and 0.5, so the mean is the arrival itself, exact) is one step of the float64 Adam,
    the reference's moments carried from the first update, within `Adam64`'s bound; with equal speeds
    (both arrive together, one update a round, their mean summed and divided as a round's) Adam's
    asynchronous run is its rounds run, bitwise."""
    cfg = async_cfg(rule="naive", updates=6)
    builtin = trained(cfg)
    sgd = replace(cfg.outer, optimizer="torch.optim.SGD", optimizer_args=dict(SGD_NESTEROV))
    got = trained(replace(cfg, outer=sgd))
    assert all(torch.equal(got[n], t) for n, t in builtin.items())
    adam = replace(cfg.outer, optimizer="torch.optim.Adam", optimizer_args=dict(ADAM), lr=ADAM_LR)
    record: list = []
    trained(replace(cfg, outer=adam), record)
    assert len(record) == 1 + 6 and all(len(deltas) == 1 for deltas, _ in record[1:])
    reference = Adam64(ADAM_LR, ADAM["betas"], ADAM["eps"])
    for (_, before), (deltas, after) in zip(record[:-1], record[1:], strict=True):
        want, bound = reference.step(before.double(), deltas[0].double(), 0.0)
        assert float(((after.double() - want).abs() - bound).max()) <= 0
    equal = replace(cfg, outer=adam, cluster=replace(cfg.cluster, replica_speeds=[]))
    rounds = replace(equal, outer=replace(adam, schedule=Schedule["rounds"]))
    got, want = trained(equal), trained(rounds)
    assert all(torch.equal(got[n], t) for n, t in want.items())


def test_delayed_nesterov_with_a_torch_optimizer_is_refused_in_one_line():
    cfg = async_cfg(rule="naive")
    outer = replace(cfg.outer, arrivals=ArrivalsConfig(rule="delayed_nesterov"), optimizer="torch.optim.Adam")
    with pytest.raises(UserError) as e:
        validate(replace(cfg, outer=outer))
    assert str(e.value).startswith(
        "outer.arrivals.rule=delayed_nesterov with outer.optimizer=torch.optim.Adam"
    )


# -- the memory estimate ----------------------------------------------------------------------------


class Noisy(torch.optim.SGD):
    """An optimizer that draws random numbers as it steps (as some do): measuring it must not move the
    run's generator."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(torch.randn_like(p), alpha=1e-9)
        return super().step(closure)


@pytest.mark.parametrize(
    "optimizer, args, per_param",
    [
        # exp_avg and exp_avg_sq, each fp32 like the parameter: 2 x 4 bytes (the step count is per tensor)
        ("torch.optim.Adam", ADAM, 8),
        ("torch.optim.Adam", {"amsgrad": True}, 12),  # and max_exp_avg_sq
        ("torch.optim.SGD", SGD_NESTEROV, 4),  # momentum_buffer
        ("torch.optim.SGD", {}, 0),  # no momentum: no buffer
        ("nesterov", {}, 4),  # the built-in's momentum, fp32
    ],
)
def test_the_memory_estimate_counts_an_outer_optimizers_state_as_a_hand_count(optimizer, args, per_param):
    cfg = cfg_with(optimizer, args, ADAM_LR)
    by_role = memory.params_by_role(cfg.model)
    params = sum(by_role.values())
    assert memory.outer_state_bytes(cfg, by_role) == per_param * params
    builtin = cfg_with("nesterov", {}, ADAM_LR)
    grows = memory.model_state_bytes(cfg, by_role, 2, 2) - memory.model_state_bytes(builtin, by_role, 2, 2)
    assert grows == (per_param - 4) * params


def test_delayed_nesterov_keeps_its_momentum_and_a_buffer():
    cfg = async_cfg()  # the default rule, delayed Nesterov
    by_role = memory.params_by_role(cfg.model)
    assert memory.outer_state_bytes(cfg, by_role) == 8 * sum(by_role.values())
    state = RunState.start(cfg, initial_weights(prepare(cfg)))
    kept = [*state.outer.momentum.values(), state.asynchronous.server.rule.buffer]
    assert sum(t.numel() * t.element_size() for t in kept) == 8 * sum(by_role.values())


def test_a_runs_adam_state_is_what_the_estimate_measured_and_measuring_draws_nothing_from_the_run():
    """After the syncs of a run, the tensors Adam keeps shaped like its parameters hold 8 bytes a
    parameter, what the estimate measured on its dummy; measuring an optimizer that draws random numbers
    leaves torch's generator where it was (the run's initial weights are drawn from it)."""
    cfg = cfg_with("torch.optim.Adam", ADAM, ADAM_LR, P=2)
    _, state = run_syncs(cfg)
    kept = 0
    for stepper in state.outer_steppers:
        for p, held in stepper.optimizer.state.items():
            kept += sum(t.numel() * t.element_size() for t in held.values() if t.shape == p.shape)
    by_role = memory.params_by_role(cfg.model)
    assert kept == memory.outer_state_bytes(cfg, by_role) == 8 * sum(by_role.values())
    noisy = cfg_with(f"{__name__}.Noisy", {"momentum": 0.5}, 0.123)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    assert memory.outer_state_bytes(noisy, by_role) == 4 * sum(by_role.values())
    assert torch.equal(torch.get_rng_state(), before)


# -- real processes, and SIGKILL and resume (slow: each starts the entry) -----------------------------

ADAM_ARGS = [
    "outer.optimizer=torch.optim.Adam",
    f"outer.lr={ADAM_LR}",
    "outer.optimizer_args={betas:[0.8,0.9]}",
]
MEASURED = ("comm_measured_inner_bytes", "comm_measured_outer_bytes")  # what only real processes measure
EAGER_FRAGMENTS = ["outer.overlap=eager", "outer.fragments=2"]


@pytest.mark.slow
def test_torchrun_two_processes_equal_the_simulation_bitwise(tmp_path):
    """torchrun, 2 processes of one replica each (the replicas layout), eager with two fragments: each
    process steps its replica's own Adam per fragment on the same sums the simulation forms (a + b
    either way), so every row but the measured bytes, the held-out losses and weights.pt are equal."""
    args = [*RUN, "replicas=2", "world=2", "inner.H=2", "phase.updates=6", *EAGER_FRAGMENTS, *ADAM_ARGS]
    sim, real = tmp_path / "sim", tmp_path / "dist"
    done = entry([*args, f"hydra.run.dir={sim}"], tmp_path)
    assert done.returncode == 0, done.stderr
    done = entry([*args, "processes=dist", f"hydra.run.dir={real}"], tmp_path, torchrun=2)
    assert done.returncode == 0, done.stderr
    assert_identical_streaming(real, sim, skip=MEASURED)


KILL = [*RUN, "inner.H=2", "phase.updates=6", "checkpoint.every_updates=3", "checkpoint.keep=10", *ADAM_ARGS]
ASYNC_ADAM = [*RUN, "outer.schedule=async", "cluster=h100", "cluster.replica_speeds=[1,0.5]", "inner.H=2"]
ASYNC_ADAM += ["phase.updates=8", "outer.arrivals.rule=naive", *ADAM_ARGS]
KILLS = {  # args, fault, the checkpoint the resume reads, where Adam's states are in it
    "fragments": ([*KILL, "outer.fragments=2"], "0:4:kill:after", 3, "outer_optimizer"),
    "eager-fragments": ([*KILL, *EAGER_FRAGMENTS], "0:4:kill:after", 3, "outer_replicas"),
    "async": (ASYNC_ADAM, "0:5:kill", 4, "async"),
}


def adam_states(saved: dict, where: str) -> list[dict]:
    """The Adam states a checkpoint's run state holds: per fragment; under eager per replica and
    fragment; under async the server's."""
    if where == "outer_optimizer":
        return saved["outer_optimizer"]
    if where == "outer_replicas":
        return [state for own in saved["outer_replicas"] for state in own["optimizer"]]
    return [saved["async"]["server"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KILLS))
def test_killed_with_adams_state_in_the_checkpoint_resumes_bit_identically(tmp_path, name):
    """SIGKILL mid-run: the newest checkpoint holds every Adam's step count and moments (after at least
    one step), and resume=true equals the uninterrupted run exactly (every row, the held-out losses,
    the summary and weights.pt; under async every arrival row and the weights)."""
    args, fault, at, where = KILLS[name]
    run_dir, reference = killed_beside_uninterrupted(args, tmp_path, fault, KILLED)
    saved = torch.load(ckpt(run_dir, at), weights_only=True)["state"]
    states = adam_states(saved, where)
    assert states and all(s["state"] for s in states), "a checkpoint without Adam's moments"
    assert all(set(kept) == {"step", "exp_avg", "exp_avg_sq"} for s in states for kept in s["state"].values())
    assert saved["outer_momentum"] == {}  # the built-in's buffers are not allocated beside it
    resumed(args, run_dir, tmp_path)
    assert [r["from"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "resume"] == [
        str(ckpt(run_dir, at))
    ]
    if name == "async":
        rows = lambda d: [r for r in read_metrics(d / "metrics.jsonl") if r["kind"] == "arrival"]  # noqa: E731
        assert len(rows(reference)) == 8 and rows(run_dir) == rows(reference)
        assert_same_weights(torch.load(run_dir / "weights.pt"), torch.load(reference / "weights.pt"))
    else:
        assert_identical_streaming(run_dir, reference)
