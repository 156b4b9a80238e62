"""The inner and outer optimizers against torch's own optimizers and float64 references.

Tolerances: fp32 AdamW vs torch.optim.AdamW rtol 1e-6 (both compute the same fp32 formula; only the
placement of the bias-correction division differs, a few ulps). Muon in bf16 vs torch.optim.Muon:
relative 2e-2 of the update (bf16 keeps 8 mantissa bits, ~4e-3 per rounding, and NS has 15 matmuls).
Stacked vs per-replica (R = 1) and masked vs unmasked: rtol 1e-6 (the same kernels on differently
shaped batches; in practice bitwise on CPU). Outer step vs float64: rtol 1e-5 over several syncs.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.optim._muon import Muon

from hypertrain.config import InnerConfig, OuterConfig
from hypertrain.optim import (
    OptState,
    OuterState,
    grad_norms,
    init_outer_state,
    init_state,
    inner_step,
    lr_at,
    newton_schulz,
    outer_step,
    pseudo_gradient,
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


def assert_close(actual, expected, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("R", [1, 3])
def test_adamw_matches_torch_adamw_per_replica(R):
    inner = inner_cfg()
    params = make_params(R)
    state = init_state(inner, params)
    torch_params, torch_opts = [], []
    for r in range(R):
        ps = {n: p[r].clone().requires_grad_(True) for n, p in params.items()}
        matrices = [p for p in ps.values() if p.ndim >= 2]
        vectors = [p for p in ps.values() if p.ndim < 2]
        groups = [{"params": matrices, "weight_decay": inner.wd}, {"params": vectors, "weight_decay": 0.0}]
        torch_opts.append(
            torch.optim.AdamW(groups, lr=LRS[0], betas=(inner.beta1, inner.beta2), eps=inner.eps)
        )
        torch_params.append(ps)
    for step, lr in enumerate(LRS):
        grads = make_grads(R, step)
        inner_step(inner, params, grads, state, lr)
        for r in range(R):
            for n, p in torch_params[r].items():
                p.grad = grads[n][r].clone()
            for group in torch_opts[r].param_groups:
                group["lr"] = lr
            torch_opts[r].step()
    assert state.step.tolist() == [len(LRS)] * R
    for r in range(R):
        for n, p in torch_params[r].items():
            assert_close(params[n][r], p.detach())
            assert_close(state.m[n][r], torch_opts[r].state[p]["exp_avg"])
            assert_close(state.v[n][r], torch_opts[r].state[p]["exp_avg_sq"])


def _newton_schulz_fp32_like_torch(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's 2-D Newton-Schulz, but in fp32 (torch's runs in bf16)."""
    a, b, c = ns_coefficients
    x = grad.float().T if grad.size(0) > grad.size(1) else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_muon_matches_torch_muon(ns_dtype, monkeypatch):
    mu, wd, ns_steps = 0.95, 0.1, 5
    if ns_dtype == "fp32":
        monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _newton_schulz_fp32_like_torch)
    inner = inner_cfg(name="muon", muon_momentum=mu, wd=wd, ns_steps=ns_steps, ns_dtype=ns_dtype)
    shapes = {n: s for n, s in SHAPES.items() if uses_muon(inner, n)}
    params = make_params(1, shapes=shapes)
    start = rows(params, 0)
    state = init_state(inner, params)
    assert state.v == {}
    ref = {n: p.clone().requires_grad_(True) for n, p in start.items()}
    opt = Muon(
        list(ref.values()),
        lr=LRS[0],
        weight_decay=wd,
        momentum=mu,
        nesterov=True,
        ns_steps=ns_steps,
        adjust_lr_fn="match_rms_adamw",
    )
    for step, lr in enumerate(LRS):
        grads = make_grads(1, step, shapes)
        inner_step(inner, params, grads, state, lr)
        for n, p in ref.items():
            p.grad = grads[n][0].clone()
        opt.param_groups[0]["lr"] = lr
        opt.step()
    tolerance = 2e-5 if ns_dtype == "fp32" else 3e-2
    for n, p in ref.items():
        ours, theirs = params[n][0] - start[n], p.detach() - start[n]
        assert (ours - theirs).norm() <= tolerance * theirs.norm(), n
        # torch's buffer is the EMA (1 - mu) * ours; NS normalisation makes the scale irrelevant
        assert_close(state.m[n][0] * (1 - mu), opt.state[p]["momentum_buffer"], rtol=1e-5, atol=1e-7)


def test_bf16_newton_schulz_is_torch_muons():
    gen = torch.Generator().manual_seed(0)
    for shape in [(8, 8), (8, 12), (12, 8), (64, 172)]:
        G = torch.randn(*shape, generator=gen)
        theirs = torch.optim._muon._zeropower_via_newtonschulz(G, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert_close(newton_schulz(G, 5, torch.bfloat16), theirs.float(), rtol=0, atol=0)


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_stacked_replicas_equal_separate_single_replica_steps(ns_dtype):
    R = 4
    inner = inner_cfg(name="muon", ns_dtype=ns_dtype, grad_clip=1.0)
    stacked = make_params(R)
    singles = [rows(stacked, slice(r, r + 1)) for r in range(R)]
    stacked_state = init_state(inner, stacked)
    single_states = [init_state(inner, p) for p in singles]
    for step, lr in enumerate(LRS):
        grads = make_grads(R, step)
        norms = inner_step(inner, stacked, grads, stacked_state, lr)
        for r in range(R):
            single_norm = inner_step(inner, singles[r], rows(grads, slice(r, r + 1)), single_states[r], lr)
            assert_close(norms[r : r + 1], single_norm)
    for r in range(R):
        for n in SHAPES:
            assert_close(stacked[n][r : r + 1], singles[r][n])
            assert_close(stacked_state.m[n][r : r + 1], single_states[r].m[n])
        for n in stacked_state.v:
            assert_close(stacked_state.v[n][r : r + 1], single_states[r].v[n])


def test_clipping_is_per_replica():
    inner = inner_cfg(name="muon", grad_clip=5.0)
    params = make_params(2)
    alone = rows(params, slice(0, 1))
    state, alone_state = init_state(inner, params), init_state(inner, alone)
    grads = make_grads(2, 0)
    grads = {n: torch.cat([g[:1], g[1:] * 1e4]) for n, g in grads.items()}  # replica 1 explodes
    expected = torch.stack([torch.cat([g[r].flatten() for g in grads.values()]).norm() for r in (0, 1)])
    norms = inner_step(inner, params, grads, state, 1e-2)
    assert_close(norms, expected, rtol=1e-6, atol=0)
    assert norms[0] < inner.grad_clip < norms[1]  # replica 0 is not clipped, replica 1 is
    inner_step(inner, alone, rows(grads, slice(0, 1)), alone_state, 1e-2)
    for n in SHAPES:
        assert_close(params[n][:1], alone[n])
    # replica 1 stepped exactly as with its gradient pre-scaled to the clip norm and clipping off
    scaled_params = rows(make_params(2), slice(1, 2))
    scaled_state = init_state(inner, scaled_params)
    coefficient = inner.grad_clip / (norms[1] + 1e-6)
    scaled = {n: g[1:] * coefficient for n, g in grads.items()}
    inner_step(dataclasses.replace(inner, grad_clip=0.0), scaled_params, scaled, scaled_state, 1e-2)
    for n in SHAPES:
        assert_close(params[n][1:], scaled_params[n])


def test_inactive_replicas_are_bitwise_unchanged_and_active_ones_step_as_alone():
    inner = inner_cfg(name="muon", grad_clip=1.0)
    active = torch.tensor([True, False, True])
    params = make_params(3)
    state = init_state(inner, params)
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
    inner_step(inner, params, grads, state, LRS[2], active=active)
    inner_step(inner, kept, rows(grads, slice(0, 3, 2)), kept_state, LRS[2])

    assert state.step.tolist() == [3, 2, 3]
    for now, then in zip((params, state.m, state.v), before, strict=True):
        for n, t in then.items():
            assert torch.equal(now[n][1], t), n
    for n in SHAPES:
        assert_close(params[n][::2], kept[n])
        assert_close(state.m[n][::2], kept_state.m[n])


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
    G = torch.randn(3, 2, 12, 8, generator=torch.Generator().manual_seed(0))
    batched = newton_schulz(G, 5)
    for i in range(3):
        for j in range(2):
            assert_close(batched[i, j], newton_schulz(G[i, j], 5))
    assert newton_schulz(G.double(), 5, torch.bfloat16).dtype == torch.float64
    # quintic NS leaves singular values roughly in (0.5, 1.5), not exactly 1
    singular = torch.linalg.svdvals(batched)
    assert singular.min() > 0.3 and singular.max() < 1.3


def test_grad_norms_are_per_replica_global_norms():
    grads = make_grads(3, 0)
    expected = [torch.cat([g[r].double().flatten() for g in grads.values()]).norm() for r in range(3)]
    assert_close(grad_norms(grads), torch.stack(expected).float())


def test_uses_muon_only_for_hidden_matrices():
    muon = inner_cfg(name="muon")
    assert [n for n in SHAPES if uses_muon(muon, n)] == [
        "layers.000.wq",
        "layers.000.wk",
        "layers.000.w1",
        "layers.000.w2",
    ]
    assert not any(uses_muon(inner_cfg(), n) for n in SHAPES)


def _states_for_sync(inner):
    one, two = make_params(1, seed=1), make_params(2, seed=2)
    states = [init_state(inner, one), init_state(inner, two)]
    for s, p in zip(states, (one, two), strict=True):
        R = next(iter(p.values())).shape[0]
        for step in range(R + 1):  # different counts per state
            inner_step(inner, p, make_grads(R, step), s, 1e-2)
    return states


@pytest.mark.parametrize("policy", ["carry", "reset", "average"])
def test_sync_inner_state_policies(policy):
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
                    mean = torch.cat([getattr(x, moments)[n] for x in before]).double().mean(0)
                    for row in t:
                        assert_close(row, mean.float())
        assert s.step.tolist() == ([0] * len(step) if policy == "reset" else step.tolist())


def _replicas_around(global_params, R, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        n: p.unsqueeze(0) + 0.01 * torch.randn(R, *p.shape, generator=gen) for n, p in global_params.items()
    }


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_float64_momentum_sgd_over_several_syncs(nesterov):
    outer = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    R = 3
    global_params = rows(make_params(1), 0)
    state = init_outer_state(global_params)
    ref_global = {n: p.double() for n, p in global_params.items()}
    ref_buf = {n: torch.zeros_like(p) for n, p in ref_global.items()}
    masks = [None, torch.tensor([True, False, True]), None, torch.tensor([False, True, False])]
    for sync, active in enumerate(masks):
        # two sub-round groups, like the stacked engine with stack 2; the loop engine passes R = 1 each
        replicas = _replicas_around(global_params, R, seed=sync)
        groups = [rows(replicas, slice(0, 2)), rows(replicas, slice(2, 3))]
        global_before = rows(global_params, slice(None))
        delta = pseudo_gradient(global_params, groups, active)
        outer_step(outer, global_params, delta, state)

        keep = torch.ones(R, dtype=torch.bool) if active is None else active
        for n, theta in ref_global.items():
            # the pseudo-gradient of the weights we hold is exact to fp32 rounding ...
            ours = (global_before[n].double().unsqueeze(0) - replicas[n].double())[keep].mean(0)
            assert_close(delta[n].double(), ours, rtol=1e-6, atol=1e-9)
            # ... and the trajectory follows the float64 one within a few ulps of |theta| ~ 3
            ref_delta = (theta.unsqueeze(0) - replicas[n].double())[keep].mean(0)
            assert_close(delta[n].double(), ref_delta, rtol=1e-5, atol=1e-6)
            ref_buf[n] = 0.9 * ref_buf[n] + ref_delta
            update = ref_delta + 0.9 * ref_buf[n] if nesterov else ref_buf[n]
            ref_global[n] = theta - 0.7 * update
            assert_close(global_params[n].double(), ref_global[n], rtol=1e-5, atol=1e-6)
            assert_close(state.momentum[n].double(), ref_buf[n], rtol=1e-5, atol=1e-6)
            assert delta[n].abs().max() > 0  # the outer step still sees the replicas' moves


@pytest.mark.parametrize("nesterov", [True, False])
def test_averaging_outer_step_gives_the_replica_mean(nesterov):
    outer = OuterConfig(lr=1.0, momentum=0.0, nesterov=nesterov)
    global_params = rows(make_params(1), 0)
    state: OuterState = init_outer_state(global_params)
    for sync in range(2):
        replicas = _replicas_around(global_params, 4, seed=sync)
        outer_step(outer, global_params, pseudo_gradient(global_params, replicas), state)
        for n, p in global_params.items():
            assert_close(p, replicas[n].double().mean(0).float(), rtol=1e-6, atol=1e-6)


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
