"""The inner and outer optimizers against torch's own optimizers and float64 references.

No bound here is a measured difference. Two kinds (docs/design.md, "Within float rounding"):
- Two fp32 paths of the same arithmetic (ours and torch's, stacked and per-replica, batched and
  single Newton-Schulz): both against a float64 reference, ours within twice the other's error or
  twice a floor of k roundings of the stored values (tests/references.py, `assert_within_rounding`).
  Newton-Schulz's amplification of rounding (a ~ 3.44 per iteration on small singular values, a^5 ~
  485 over five) and bf16's 8-bit mantissa then enter through the other path's own error, never
  through a picked number.
- A short fp32 computation with a known count of roundings (grad norms, pseudo-gradient, the
  outer step, the state average): per entry, U32 times the magnitudes of the values rounded.
Bitwise checks are kept only where bitwise holds by construction, each saying why.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from helpers import pseudo_gradient
from references import (
    U32,
    U_BF16,
    assert_entries_within,
    assert_within_rounding,
    float64_inner_step,
    float64_state,
    to_float64,
)
from torch.optim._muon import Muon

from hypertrain.config import InnerConfig, OuterConfig
from hypertrain.diloco.outer import OuterState, init_outer_state, outer_step
from hypertrain.optim.inner import (
    OptState,
    grad_norms,
    init_state,
    inner_step,
    lr_at,
    newton_schulz,
    sync_inner_states,
    uses_muon,
)

# Per-replica shapes following docs/interfaces.md: AdamW vectors and matrices, Muon matrices
# (wide, square and tall, so Newton-Schulz's transpose is exercised).
SHAPES = {
    "emb": (11, 8),
    "head": (8, 11),
    "norm": (8,),
    "layers.000.attn_norm": (8,),
    "layers.000.wq": (8, 8),
    "layers.000.wk": (8, 8),
    "layers.000.w1": (8, 12),
    "layers.000.w2": (12, 8),
}
# Each test parameter's role, as a model declares it (model.param_specs).
ROLES = {n: "norm" if n.endswith("norm") else "hidden" for n in SHAPES} | {"emb": "embedding", "head": "head"}
LRS = [3e-3, 1e-2, 5e-3, 2e-3, 7e-3]  # a changing lr, one per step


def make_params(R: int, seed: int = 0, shapes=SHAPES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(R, *s, generator=gen) for n, s in shapes.items()}


def make_grads(R: int, step: int, shapes=SHAPES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(R, *s, generator=gen) * 0.1 for n, s in shapes.items()}


def rows(params, index):
    return {n: p[index].clone() for n, p in params.items()}


def inner_cfg(**kw) -> InnerConfig:
    base = dict(name="adamw", beta1=0.9, beta2=0.95, eps=1e-8, wd=0.1, grad_clip=0.0)
    base.update(kw)
    return InnerConfig(**base)


# Floors of `assert_within_rounding`, per step, in roundings of a stored value (each within U32 per
# entry): a weight is rounded twice (w * (1 - lr*wd), then + update); a moment at most three times
# (lerp: end - start, times the weight, plus start; or mul, then add of a rounded product).
WEIGHT_ROUNDINGS, MOMENT_ROUNDINGS = 2, 3


def floor(ref: torch.Tensor, roundings: int) -> float:
    return roundings * U32 * float(ref.double().norm())


def float64_steps(inner, params, state, steps) -> tuple[dict, OptState]:
    """The float64 reference (references.py) of `inner_step` from fp32 params and state, for the
    (grads, lr) of `steps` in order."""
    params, state = to_float64(params), float64_state(state)
    for grads, lr in steps:
        float64_inner_step(inner, params, grads, state, lr)
    return params, state


def torch_adamw_for(inner, params: dict, dtype) -> tuple[dict, torch.optim.AdamW]:
    ps = {n: p.detach().to(dtype).clone().requires_grad_(True) for n, p in params.items()}
    matrices = [p for p in ps.values() if p.ndim >= 2]
    vectors = [p for p in ps.values() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": inner.wd}, {"params": vectors, "weight_decay": 0.0}]
    return ps, torch.optim.AdamW(groups, lr=LRS[0], betas=(inner.beta1, inner.beta2), eps=inner.eps)


@pytest.mark.parametrize("R", [1, 3])
def test_adamw_matches_torch_adamw_per_replica(R):
    """Ours and torch.optim.AdamW in fp32, each against torch.optim.AdamW in float64: the same
    elementwise formula with its divisions and scalar casts placed differently, so errors of the same
    size; floors 2 U32 per step of ||w||, 3 U32 per step of ||m|| and ||v|| (their rounding errors
    decay with beta < 1, so the count over the steps is an upper bound). AdamW has no amplifying
    step here (eps is far below sqrt(v) for these gradients)."""
    inner = inner_cfg()
    params = make_params(R)
    state = init_state(inner, params, ROLES)
    runs = [
        [torch_adamw_for(inner, rows(params, r), dtype) for r in range(R)]
        for dtype in (torch.float32, torch.float64)
    ]
    for step, lr in enumerate(LRS):
        grads = make_grads(R, step)
        inner_step(inner, params, grads, state, lr)
        for run in runs:
            for r, (ps, opt) in enumerate(run):
                for n, p in ps.items():
                    p.grad = grads[n][r].to(p.dtype)
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
    assert state.step.tolist() == [len(LRS)] * R
    steps = len(LRS)
    for r in range(R):
        (theirs, opt), (ref, ref_opt) = runs[0][r], runs[1][r]
        for n, p in ref.items():
            t, want = theirs[n], p.detach()
            assert_within_rounding(params[n][r], t.detach(), want, floor(want, WEIGHT_ROUNDINGS * steps), n)
            for ours, key in ((state.m, "exp_avg"), (state.v, "exp_avg_sq")):
                want = ref_opt.state[p][key]
                got_peer = ours[n][r], opt.state[t][key]
                assert_within_rounding(*got_peer, want, floor(want, MOMENT_ROUNDINGS * steps), f"{n} {key}")


def _newton_schulz_like_torch(grad, ns_coefficients, ns_steps, eps, dtype=torch.float32):
    """torch.optim.Muon's 2-D Newton-Schulz, but in `dtype` (torch's runs in bf16)."""
    a, b, c = ns_coefficients
    x = grad.to(dtype).T if grad.size(0) > grad.size(1) else grad.to(dtype)
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def torch_muon_run(start, shapes, inner, newton_schulz_fn, dtype, monkeypatch) -> tuple[dict, dict]:
    """torch.optim.Muon's weights and momentum buffers after the LRS steps, with its Newton-Schulz
    replaced by `newton_schulz_fn` (None: torch's own bf16 one), params and grads in `dtype`."""
    with monkeypatch.context() as patch:
        if newton_schulz_fn is not None:
            patch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", newton_schulz_fn)
        ps = {n: p.detach().to(dtype).clone().requires_grad_(True) for n, p in start.items()}
        opt = Muon(
            list(ps.values()),
            lr=LRS[0],
            weight_decay=inner.wd,
            momentum=inner.muon_momentum,
            nesterov=True,
            ns_steps=inner.ns_steps,
            adjust_lr_fn="match_rms_adamw",
        )
        for step, lr in enumerate(LRS):
            grads = make_grads(1, step, shapes)
            for n, p in ps.items():
                p.grad = grads[n][0].to(dtype)
            opt.param_groups[0]["lr"] = lr
            opt.step()
    return {n: p.detach() for n, p in ps.items()}, {n: opt.state[p]["momentum_buffer"] for n, p in ps.items()}


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_muon_matches_torch_muon(ns_dtype, monkeypatch):
    """Ours and torch.optim.Muon (its Newton-Schulz in fp32, or its own bf16 one), each against
    torch.optim.Muon in float64 (float64 Newton-Schulz). Both run the same iteration in the same
    dtype, batched (ours) or 2-D (torch's), so Newton-Schulz's amplification of rounding and, in bf16,
    its 8-bit mantissa reach both errors alike: ours within twice torch's, floors 2 U32 of ||w|| per
    step and 3 U32 of ||buffer|| per step. torch's buffer is the EMA, (1 - mu) times our sum-form
    buffer (Newton-Schulz's normalisation makes the scale irrelevant to the update)."""
    mu, wd, ns_steps = 0.95, 0.1, 5
    inner = inner_cfg(name="muon", muon_momentum=mu, wd=wd, ns_steps=ns_steps, ns_dtype=ns_dtype)
    shapes = {n: s for n, s in SHAPES.items() if uses_muon(inner, ROLES[n])}
    params = make_params(1, shapes=shapes)
    start = rows(params, 0)
    state = init_state(inner, params, ROLES)
    assert state.v == {}
    for step, lr in enumerate(LRS):
        inner_step(inner, params, make_grads(1, step, shapes), state, lr)
    peer_ns = _newton_schulz_like_torch if ns_dtype == "fp32" else None
    theirs, their_buffers = torch_muon_run(start, shapes, inner, peer_ns, torch.float32, monkeypatch)
    exact_ns = functools.partial(_newton_schulz_like_torch, dtype=torch.float64)
    ref, ref_buffers = torch_muon_run(start, shapes, inner, exact_ns, torch.float64, monkeypatch)
    for n, want in ref.items():
        assert_within_rounding(params[n][0], theirs[n], want, floor(want, WEIGHT_ROUNDINGS * len(LRS)), n)
        buffer, want = state.m[n][0].double() * (1 - mu), ref_buffers[n]
        assert_within_rounding(buffer, their_buffers[n], want, floor(want, MOMENT_ROUNDINGS * len(LRS)), n)


def test_bf16_newton_schulz_matches_torch_muons():
    """Ours and torch.optim.Muon's bf16 Newton-Schulz, each against torch's iteration in float64: the
    same bf16 roundings, batched (bmm) or 2-D (mm), whose kernels need not round alike, so ours
    within twice torch's error, floor one bf16 rounding of the result (U_BF16 ||ref||)."""
    gen = torch.Generator().manual_seed(0)
    coefficients = (3.4445, -4.7750, 2.0315)
    for shape in [(8, 8), (8, 12), (12, 8), (64, 172)]:
        G = torch.randn(*shape, generator=gen)
        theirs = torch.optim._muon._zeropower_via_newtonschulz(G, coefficients, 5, 1e-7)
        ref = _newton_schulz_like_torch(G, coefficients, 5, 1e-7, dtype=torch.float64)
        ours = newton_schulz(G, 5, torch.bfloat16)
        assert_within_rounding(ours, theirs, ref, U_BF16 * float(ref.norm()), str(shape))


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_stacked_replicas_equal_separate_single_replica_steps(ns_dtype):
    """Stacked (R = 4) and per-replica (R = 1) steps, each against the stacked steps in float64: the
    same per-replica arithmetic on differently shaped batches (bmm batch counts, vector tails), so
    errors of the same size, bf16 Newton-Schulz's included; floors 2 U32 of ||w|| and 3 U32 of
    ||m||, ||v|| per step. Grad norms: each is its float64 sum rounded once to fp32 (within U32 of
    the exact norm; the float64 sum's error is ~1e-16), so the two are within 2 U32 / (1 - U32)."""
    R = 4
    inner = inner_cfg(name="muon", ns_dtype=ns_dtype, grad_clip=1.0)
    stacked = make_params(R)
    singles = [rows(stacked, slice(r, r + 1)) for r in range(R)]
    stacked_state = init_state(inner, stacked, ROLES)
    single_states = [init_state(inner, p, ROLES) for p in singles]
    ref, ref_state = float64_steps(
        inner, stacked, stacked_state, [(make_grads(R, s), lr) for s, lr in enumerate(LRS)]
    )
    for step, lr in enumerate(LRS):
        grads = make_grads(R, step)
        norms = inner_step(inner, stacked, grads, stacked_state, lr)
        for r in range(R):
            single_norm = inner_step(inner, singles[r], rows(grads, slice(r, r + 1)), single_states[r], lr)
            torch.testing.assert_close(norms[r : r + 1], single_norm, rtol=2.0001 * U32, atol=0)
    steps = len(LRS)
    for r in range(R):
        one = slice(r, r + 1)
        for n in SHAPES:
            want = ref[n][one]
            assert_within_rounding(
                stacked[n][one], singles[r][n], want, floor(want, WEIGHT_ROUNDINGS * steps), n
            )
        for moments in ("m", "v"):
            for n, t in getattr(stacked_state, moments).items():
                want, peer = getattr(ref_state, moments)[n][one], getattr(single_states[r], moments)[n]
                assert_within_rounding(
                    t[one], peer, want, floor(want, MOMENT_ROUNDINGS * steps), f"{n} {moments}"
                )


def test_clipping_is_per_replica():
    """Norms: our float64 sum rounded once to fp32 against the float64 norm, within U32 (the float64
    sum's own error ~1e-16 is the 1e-12 of room). Weights: one step, stacked (R = 2) against alone
    (R = 1) and against clipping off with the gradient pre-scaled by the same fp32 coefficient (the
    same fp32 division and multiply as inner_step, so the scaled gradient is bitwise ours), each
    against the float64 step of the same inputs; floor 2 U32 ||w||."""
    inner = inner_cfg(name="muon", grad_clip=5.0)
    params = make_params(2)
    alone = rows(params, slice(0, 1))
    state, alone_state = init_state(inner, params, ROLES), init_state(inner, alone, ROLES)
    grads = make_grads(2, 0)
    grads = {n: torch.cat([g[:1], g[1:] * 1e4]) for n, g in grads.items()}  # replica 1 explodes
    expected = torch.stack(
        [torch.cat([g[r].double().flatten() for g in grads.values()]).norm() for r in (0, 1)]
    )
    ref, _ = float64_steps(inner, params, state, [(grads, 1e-2)])
    norms = inner_step(inner, params, grads, state, 1e-2)
    torch.testing.assert_close(norms.double(), expected, rtol=U32 + 1e-12, atol=0)
    assert norms[0] < inner.grad_clip < norms[1]  # replica 0 is not clipped, replica 1 is
    inner_step(inner, alone, rows(grads, slice(0, 1)), alone_state, 1e-2)
    for n in SHAPES:
        assert_within_rounding(params[n][:1], alone[n], ref[n][:1], floor(ref[n][:1], WEIGHT_ROUNDINGS), n)
    # replica 1 stepped as with its gradient pre-scaled to the clip norm and clipping off
    unclipped = dataclasses.replace(inner, grad_clip=0.0)
    scaled_params = rows(make_params(2), slice(1, 2))
    scaled_state = init_state(inner, scaled_params, ROLES)
    coefficient = inner.grad_clip / (norms[1] + 1e-6)
    scaled = {n: g[1:] * coefficient for n, g in grads.items()}
    ref, _ = float64_steps(unclipped, scaled_params, scaled_state, [(scaled, 1e-2)])
    inner_step(unclipped, scaled_params, scaled, scaled_state, 1e-2)
    for n in SHAPES:
        assert_within_rounding(params[n][1:], scaled_params[n], ref[n], floor(ref[n], WEIGHT_ROUNDINGS), n)


def test_inactive_replicas_are_bitwise_unchanged_and_active_ones_step_as_alone():
    """Inactive rows bitwise: inner_step restores them from a copy with torch.where, by construction.
    Active rows against the same step taken alone (R = 2), each against that step in float64 (the
    same arithmetic on differently shaped batches); floors 2 U32 of ||w||, 3 U32 of ||m||."""
    inner = inner_cfg(name="muon", grad_clip=1.0)
    active = torch.tensor([True, False, True])
    params = make_params(3)
    state = init_state(inner, params, ROLES)
    for step in range(2):  # non-zero moments and counts before the masked step
        inner_step(inner, params, make_grads(3, step), state, LRS[step])
    kept = rows(params, slice(0, 3, 2))
    kept_state = OptState(
        rows(state.m, slice(0, 3, 2)), rows(state.v, slice(0, 3, 2)), state.step[::2].clone()
    )
    before = (rows(params, 1), rows(state.m, 1), rows(state.v, 1))

    grads = make_grads(3, 2)
    for g in grads.values():
        g[1] = float("nan")  # a skipped replica's garbage must not leak anywhere
    ref, ref_state = float64_steps(inner, kept, kept_state, [(rows(grads, slice(0, 3, 2)), LRS[2])])
    inner_step(inner, params, grads, state, LRS[2], active=active)
    inner_step(inner, kept, rows(grads, slice(0, 3, 2)), kept_state, LRS[2])

    assert state.step.tolist() == [3, 2, 3]
    for now, then in zip((params, state.m, state.v), before, strict=True):
        for n, t in then.items():
            assert torch.equal(now[n][1], t), n
    for n in SHAPES:
        assert_within_rounding(params[n][::2], kept[n], ref[n], floor(ref[n], WEIGHT_ROUNDINGS), n)
        want = ref_state.m[n]
        assert_within_rounding(state.m[n][::2], kept_state.m[n], want, floor(want, MOMENT_ROUNDINGS), n)


def test_lr_schedule_warmup_cosine_and_rewarmup():
    inner = inner_cfg(lr=2.0, warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)
    # warmup: 2 * (s + 1) / 4; cosine over steps 4..14: 2 * (0.1 + 0.9 * (1 + cos(pi * (s - 4) / 10)) / 2)
    expected = {0: 0.5, 3: 2.0, 4: 2.0, 9: 2.0 * 0.55, 14: 0.2, 30: 0.2}
    for s, value in expected.items():
        assert lr_at(inner, s, 0) == pytest.approx(value, rel=1e-12), s
    assert lr_at(inner, 6, 0) == pytest.approx(2.0 * (0.1 + 0.45 * (1 + math.cos(math.pi * 0.2))))
    assert lr_at(dataclasses.replace(inner, decay_steps=0), 100, 0) == 2.0
    rewarm = dataclasses.replace(inner, rewarmup_steps=4)
    assert lr_at(rewarm, 9, 0) == pytest.approx(2.0 * 0.55 / 4)
    assert lr_at(rewarm, 9, 1) == pytest.approx(2.0 * 0.55 / 2)
    assert lr_at(rewarm, 9, 3) == pytest.approx(2.0 * 0.55)
    assert lr_at(rewarm, 9, 7) == pytest.approx(2.0 * 0.55)


def test_newton_schulz_is_batched_over_leading_dims():
    """Batched and single fp32 Newton-Schulz, each against float64: the same iteration per matrix,
    but bmm over 6 matrices against bmm over 1 need not round alike (another GEMM blocking), and the
    iteration amplifies rounding (a^5 ~ 485 over five iterations for small singular values), which
    reaches both errors alike; floor one fp32 rounding of the result (U32 ||ref||)."""
    G = torch.randn(3, 2, 12, 8, generator=torch.Generator().manual_seed(0))
    batched = newton_schulz(G, 5)
    ref = newton_schulz(G.double(), 5, torch.float64)
    for i in range(3):
        for j in range(2):
            want = ref[i, j]
            assert_within_rounding(batched[i, j], newton_schulz(G[i, j], 5), want, floor(want, 1), f"{i},{j}")
    assert newton_schulz(G.double(), 5, torch.bfloat16).dtype == torch.float64
    # quintic NS leaves singular values roughly in (0.5, 1.5), not exactly 1
    singular = torch.linalg.svdvals(batched)
    assert singular.min() > 0.3 and singular.max() < 1.3


def test_grad_norms_are_per_replica_global_norms():
    """A float64 sum rounded once to fp32: within U32 of the float64 norm (whose own error, ~1e-16,
    is the 1e-12 of room)."""
    grads = make_grads(3, 0)
    expected = [torch.cat([g[r].double().flatten() for g in grads.values()]).norm() for r in range(3)]
    torch.testing.assert_close(grad_norms(grads).double(), torch.stack(expected), rtol=U32 + 1e-12, atol=0)


def test_uses_muon_only_for_hidden_matrices():
    muon = inner_cfg(name="muon")
    assert [n for n in SHAPES if uses_muon(muon, ROLES[n])] == [
        "layers.000.wq",
        "layers.000.wk",
        "layers.000.w1",
        "layers.000.w2",
    ]
    assert not any(uses_muon(inner_cfg(), ROLES[n]) for n in SHAPES)


def _states_for_sync(inner):
    one, two = make_params(1, seed=1), make_params(2, seed=2)
    states = [init_state(inner, one, ROLES), init_state(inner, two, ROLES)]
    for s, p in zip(states, (one, two), strict=True):
        R = next(iter(p.values())).shape[0]
        for step in range(R + 1):  # different counts per state
            inner_step(inner, p, make_grads(R, step), s, 1e-2)
    return states


@pytest.mark.parametrize("policy", ["carry", "reset", "average"])
def test_sync_inner_state_policies(policy):
    """carry and reset bitwise (nothing computed). average: an fp32 mean of n rows rounds n - 1
    partial sums (each within U32 of sum |x|) and one quotient, so per entry it is within
    n U32 mean|x| of the exact mean."""
    inner = inner_cfg(name="muon", state_policy=policy)
    states = _states_for_sync(inner)
    before = [dataclasses.replace(s, m=rows(s.m, slice(None)), v=rows(s.v, slice(None))) for s in states]
    steps = [s.step.clone() for s in states]
    sync_inner_states(inner, states)
    for s, b, step in zip(states, before, steps, strict=True):
        for moments in ("m", "v"):
            for n, t in getattr(s, moments).items():
                if policy == "carry":
                    assert torch.equal(t, getattr(b, moments)[n])
                elif policy == "reset":
                    assert not t.any()
                else:
                    values = torch.cat([getattr(x, moments)[n] for x in before]).double()
                    bound = len(values) * U32 * values.abs().mean(0)
                    for row in t:
                        assert ((row.double() - values.mean(0)).abs() <= bound).all(), n
        # average: every replica leaves with the largest count, as its moments are that old.
        largest = max(int(x.max()) for x in steps)
        expected = {"carry": step.tolist(), "reset": [0] * len(step), "average": [largest] * len(step)}
        assert s.step.tolist() == expected[policy]


def _replicas_around(global_params, R, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        n: p.unsqueeze(0) + 0.01 * torch.randn(R, *p.shape, generator=gen) for n, p in global_params.items()
    }


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_float64_momentum_sgd_over_several_syncs(nesterov):
    """Per entry, bounds carried from sync to sync, to first order in U32 (R replica rows, the kept
    ones averaged, d_r = theta - w_r):
    - the pseudo-gradient rounds each kept difference once (U32 |d_r|), R - 1 partial sums over the
      rows (U32 sum |d_r| each) and the quotient once: within (R + 1) U32 mean |d_r| of the exact mean
      of the weights we hold; the float64 trajectory's also differs by theta's error E_theta;
    - buf' = mu buf + delta rounds twice, the Nesterov update delta + mu buf' twice, theta - lr update
      twice (each within U32 of the rounded value); errors carried in propagate with the absolute
      values of their coefficients (cancellation ignored, so the bound grows with the syncs, to
      ~25 U32 |theta| after four, against a contraction of the true error)."""
    mu, lr = 0.9, 0.7
    outer = OuterConfig(lr=lr, momentum=mu, nesterov=nesterov)
    R = 3
    global_params = rows(make_params(1), 0)
    state = init_outer_state(global_params)
    ref_global = {n: p.double() for n, p in global_params.items()}
    ref_buf = {n: torch.zeros_like(p) for n, p in ref_global.items()}
    e_theta = {n: torch.zeros_like(p) for n, p in ref_global.items()}  # bounds on |ours - float64|
    e_buf = {n: torch.zeros_like(p) for n, p in ref_global.items()}
    masks = [None, torch.tensor([True, False, True]), None, torch.tensor([False, True, False])]
    for sync, active in enumerate(masks):
        # two sub-round groups, like the stacked engine with stack 2; the loop engine passes R = 1 each
        replicas = _replicas_around(global_params, R, seed=sync)
        groups = [rows(replicas, slice(0, 2)), rows(replicas, slice(2, 3))]
        global_before = rows(global_params, slice(None))
        buf_before = {n: b.double().abs() for n, b in state.momentum.items()}
        delta = pseudo_gradient(global_params, groups, active)
        outer_step(outer, global_params, delta, state)

        keep = torch.ones(R, dtype=torch.bool) if active is None else active
        for n, theta in ref_global.items():
            # the pseudo-gradient of the weights we hold, to its own rounding ...
            d = (global_before[n].double().unsqueeze(0) - replicas[n].double())[keep]
            rounding = (R + 1) * U32 * d.abs().mean(0)
            assert_entries_within(delta[n], d.mean(0), rounding, n)
            # ... and the trajectory against the float64 one, within the bounds carried along
            ref_delta = (theta.unsqueeze(0) - replicas[n].double())[keep].mean(0)
            e_delta = e_theta[n] + rounding
            assert_entries_within(delta[n], ref_delta, e_delta, n)
            ref_buf[n] = mu * ref_buf[n] + ref_delta
            update = ref_delta + mu * ref_buf[n] if nesterov else ref_buf[n]
            ref_global[n] = theta - lr * update
            buf = state.momentum[n].double().abs()
            ours_update = (delta[n].double() + mu * state.momentum[n].double()).abs() if nesterov else buf
            e_buf[n] = mu * e_buf[n] + e_delta + U32 * (mu * buf_before[n] + buf)
            e_update = e_delta + mu * e_buf[n] + U32 * (mu * buf + ours_update) if nesterov else e_buf[n]
            e_theta[n] = (
                e_theta[n] + lr * e_update + U32 * (lr * ours_update + global_params[n].double().abs())
            )
            assert_entries_within(global_params[n], ref_global[n], e_theta[n], n)
            assert_entries_within(state.momentum[n], ref_buf[n], e_buf[n], n)
            assert delta[n].abs().max() > 0  # the outer step still sees the replicas' moves


@pytest.mark.parametrize("nesterov", [True, False])
def test_averaging_outer_step_gives_the_replica_mean(nesterov):
    """theta - mean(theta - w_r) = mean(w_r) exactly. In fp32 the pseudo-gradient is within
    (R + 1) U32 mean|theta - w_r| (see above); with momentum 0 the buffer and update are that
    pseudo-gradient exactly (a product with 0, a sum with 0), and theta - update rounds once more
    (U32 |theta'|)."""
    R = 4
    outer = OuterConfig(lr=1.0, momentum=0.0, nesterov=nesterov)
    global_params = rows(make_params(1), 0)
    state: OuterState = init_outer_state(global_params)
    for sync in range(2):
        replicas = _replicas_around(global_params, R, seed=sync)
        before = rows(global_params, slice(None))
        outer_step(outer, global_params, pseudo_gradient(global_params, replicas), state)
        for n, p in global_params.items():
            spread = (before[n].double().unsqueeze(0) - replicas[n].double()).abs().mean(0)
            bound = (R + 1) * U32 * spread + U32 * p.double().abs()
            assert_entries_within(p, replicas[n].double().mean(0), bound, n)


def test_pseudo_gradient_and_outer_step_never_alias_global_weights():
    global_params = rows(make_params(1), 0)
    ptrs = {n: p.untyped_storage().data_ptr() for n, p in global_params.items()}
    single = {n: p.unsqueeze(0).clone() for n, p in global_params.items()}  # a replica that did not move
    for replicas in ([single], single, [_replicas_around(global_params, 2, seed=0)]):
        delta = pseudo_gradient(global_params, replicas)
        for n, d in delta.items():
            assert d.untyped_storage().data_ptr() != ptrs[n]
            groups = replicas if isinstance(replicas, list) else [replicas]
            assert all(d.untyped_storage().data_ptr() != g[n].untyped_storage().data_ptr() for g in groups)
    state = init_outer_state(global_params)
    outer_step(OuterConfig(), global_params, delta, state)
    for n, p in global_params.items():
        assert p.untyped_storage().data_ptr() == ptrs[n]  # updated in place
        assert state.momentum[n].untyped_storage().data_ptr() != ptrs[n]
        assert state.momentum[n].untyped_storage().data_ptr() != delta[n].untyped_storage().data_ptr()
