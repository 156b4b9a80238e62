"""The mixture-of-experts model (docs/moe.md): equal to an implementation nobody here wrote, stacked
replicas equal to the loop with routing's discrete choices checked token by token, Muon on each
expert, and the configuration's mistakes refused in one line.

- Against Hugging Face's `MixtralForCausalLM` (transformers 5.23.0, a test-only dependency) on the
  same weights in float64: logits, the gradient of the objective (cross-entropy plus the weighted
  load-balancing loss) and the load-balancing loss against `load_balancing_loss_func`. Our model is
  float64 throughout; Hugging Face's rounds to fp32 in some steps even in a float64 model, so the
  bound is counted from those steps (`HF_FP32_STEPS`), not from float64: each RMSNorm (its input cast
  to fp32, squared, averaged, rsqrt, multiplied: about 4 U32 relative), each router softmax and its
  renormalised top k (fp32: about 4 U32), RoPE's fp32 tables (computed by a different formula here,
  each angle within U32 of the other's: 4 U32 allowed), and the load-balancing loss's fp32
  probabilities and sums (one rounding each, and ceil(log2(rows)) for the pairwise sums). A
  gradient passes those casts twice (forward and backward): twice the logits' bound.
- Routing is discrete (docs/design.md invariant 10): the stacked-vs-loop runs recompute, at every
  update and for every replica's tokens, the router probabilities under each path's weights (loop,
  stacked, and the float64 loop that gives the rounding bound), check the top-k margin of every token,
  count the tokens whose margin is a near-tie and the tokens whose chosen experts differ (flips), and
  prove the paths' probabilities differ by less than half the near-tie bound, so a flip can only sit
  at a near-tie. Without a flip the runs must agree within float rounding as in tests/test_stacked.py
  (`assert_engines_agree`'s rule, against the float64 loop); after a flip only the updates before it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DIST,
    QUICK,
    cfg_for,
    compose_cfg,
    entry,
    error_lines,
    finish,
    rounding_floors,
    run_losses,
    start_entry,
    stderr_lines,
)
from references import (
    U32,
    assert_losses_within_rounding,
    assert_within_rounding,
    float64_arithmetic,
)

from hypertrain.clock.replay import clock_of
from hypertrain.config import ClusterConfig, ModelConfig, UserError
from hypertrain.diloco.rounds import assignments, rounds
from hypertrain.diloco.state import RunState
from hypertrain.engines import loop, stacked
from hypertrain.model import moe
from hypertrain.model.shapes import param_roles
from hypertrain.model.spec import check_model
from hypertrain.model.transformer import forward, init_params, logits, objective
from hypertrain.optim.inner import init_state, inner_step, newton_schulz, uses_muon
from hypertrain.preflight.checks import validate
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.rundir.records import read_metrics

EXPERTS = dict(is_moe=True, n_experts=4, top_k=2, expert_ffn=32)


def moe_cfg(R: int, H: int, stack: int = 0, model: dict | None = None, **inner):
    """tests/helpers.py's `cfg_for` (d 32, the small strong phase of 2H updates) with two MoE layers."""
    cfg = cfg_for(R, H, stack, **inner)
    cfg = replace(cfg, model=replace(cfg.model, n_layers=2, **(EXPERTS | (model or {}))))
    validate(cfg)
    return cfg


# -- the configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,says",
    [
        ({"top_k": 0}, "model.top_k=0 is out of range; valid: 1..model.n_experts=4"),
        ({"top_k": 5}, "model.top_k=5 is out of range; valid: 1..model.n_experts=4"),
        ({"n_experts": 1, "top_k": 1}, "model.n_experts=1 is too small; valid: >= 2"),
        ({"expert_ffn": 0}, "model.expert_ffn=0 is not valid with model.is_moe=true; valid: >= 1"),
        ({"d_model": 0}, "model.d_model=0 is too small; valid: >= 1"),
        ({"router_aux_weight": -0.1}, "model.router_aux_weight=-0.1 is not valid; valid: finite, >= 0"),
        ({"router_aux_weight": math.nan}, "model.router_aux_weight=nan is not valid; valid: finite, >= 0"),
        ({"router_aux_weight": math.inf}, "model.router_aux_weight=inf is not valid; valid: finite, >= 0"),
        ({"norm_eps": 0.0}, "model.norm_eps=0.0 is not valid; valid: finite, > 0"),
        (
            {"arch": "multistream"},
            "model.is_moe=true with model.arch='multistream' is not built; valid: model.arch=decoder",
        ),
    ],
)
def test_a_bad_mixture_is_one_line_naming_the_value_and_what_is_valid(fields, says):
    model = ModelConfig(**(EXPERTS | fields))
    with pytest.raises(UserError) as err:
        check_model(model)  # what model.arch's entry takes (is_moe), then the section's own fields
        model.check()
    assert str(err.value) == says


def test_the_entry_refuses_a_bad_mixture_in_one_line_with_exit_2(tmp_path):
    done = entry([*QUICK, "logger=none", "model=moe_tiny", "model.top_k=5"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert error_lines(done.stderr) == stderr_lines(done.stderr)
    assert stderr_lines(done.stderr) == [
        "hypertrain: error: model.top_k=5 is out of range; valid: 1..model.n_experts=4"
    ]
    assert not (tmp_path / "outputs").exists()


# -- against Hugging Face's Mixtral ----------------------------------------------------------------


HF_CFG = ModelConfig(
    **EXPERTS | {"expert_ffn": 24, "router_aux_weight": 0.01},
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,  # grouped-query attention, as moe_small
    vocab=64,
    norm_eps=1e-5,  # Mixtral's rms_norm_eps, not our dense default: the field is matched, not assumed
)
# fp32 steps of Hugging Face's forward on the way to the logits: 2 RMSNorms and a router per layer,
# the final RMSNorm, RoPE's tables; about 4 U32 each (module docstring).
HF_FP32_STEPS = 3 * HF_CFG.n_layers + 2
LOGITS_REL = 4 * HF_FP32_STEPS * U32  # 32 U32 ~ 1.9e-6


def _mixtral(cfg: ModelConfig, theta: dict):
    """transformers' MixtralForCausalLM in float64 holding our weights `theta` (no replica axis)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.expert_ffn,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=64,
        tie_word_embeddings=False,
        router_aux_loss_coef=cfg.router_aux_weight,
        router_jitter_noise=0.0,
        sliding_window=None,
    )
    # The default experts kernel refuses float64 on CPU; eager is the reference loop over experts.
    model = MixtralForCausalLM._from_config(
        config, experts_implementation="eager", attn_implementation="sdpa", dtype=torch.float64
    )
    weights = _in_their_names(cfg, theta)
    model.load_state_dict({n: t.contiguous() for n, t in weights.items()}, strict=True)
    return model


def _in_their_names(cfg: ModelConfig, grads: dict) -> dict:
    """Every parameter (or its gradient) under Hugging Face's name and layout: ours are input-major
    ([in, out]), theirs out-major, the experts' gate and up fused ([E, 2f, d], gate first), down [E, d, f]."""
    out = {"model.embed_tokens.weight": grads["emb"], "lm_head.weight": grads["head"].T}
    out["model.norm.weight"] = grads["norm"]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i:03d}.", f"model.layers.{i}."
        for name, hf in [("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")]:
            out[f"{theirs}self_attn.{hf}.weight"] = grads[ours + name].T
        out[theirs + "input_layernorm.weight"] = grads[ours + "attn_norm"]
        out[theirs + "post_attention_layernorm.weight"] = grads[ours + "mlp_norm"]
        out[theirs + "mlp.gate.weight"] = grads[ours + "router"].T
        gate_up = torch.cat([grads[ours + "experts.w1"], grads[ours + "experts.w3"]], dim=-1)
        out[theirs + "mlp.experts.gate_up_proj"] = gate_up.transpose(1, 2)
        out[theirs + "mlp.experts.down_proj"] = grads[ours + "experts.w2"].transpose(1, 2)
    return out


def _margins(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's top-k margin: its k-th largest router probability minus its (k+1)-th."""
    top = probs.topk(k + 1, dim=-1).values
    return top[..., k - 1] - top[..., k]


def test_logits_gradient_and_load_balancing_loss_equal_hugging_face_mixtral():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = HF_CFG
    theta = {n: t.double() for n, t in init_params(cfg, 3).items()}
    theirs = _mixtral(cfg, theta)
    tokens = torch.randint(0, cfg.vocab, (3, 17), generator=torch.Generator().manual_seed(0))
    params = {n: t.unsqueeze(0).clone().requires_grad_(True) for n, t in theta.items()}

    out = theirs(input_ids=tokens[:, :-1], output_router_logits=True)
    tally = moe.RouterTally(None, keep=True)
    with torch.no_grad():
        ours = logits(cfg, params, tokens[None, :, :-1], tally)[0]
    # Routing is discrete: the comparison holds only if no token's top k is within the bound of a tie.
    rows = tokens[:, :-1].numel()
    margin = float(_margins(torch.stack(tally.probs), cfg.top_k).min())
    assert margin > 4 * LOGITS_REL, f"a token's top-k margin {margin:.3g} is within rounding of a tie"
    want = out.logits.detach().reshape(rows, cfg.vocab)
    assert float((ours - want).norm() / want.norm()) <= LOGITS_REL

    # The load-balancing loss: fp32 probabilities (U32), their pairwise sums over L * rows (log2), the
    # product and its sum over E (2 + log2 E); from our forward's router columns.
    aux_rel = (4 + math.ceil(math.log2(cfg.n_layers * rows)) + math.ceil(math.log2(cfg.n_experts))) * U32
    result = forward(cfg, params, tokens[None])
    want_aux = float(load_balancing_loss_func(out.router_logits, cfg.n_experts, cfg.top_k).detach())
    assert abs(float(result[0, 1].detach()) - want_aux) <= aux_rel * want_aux
    assert float(out.aux_loss.detach()) == want_aux

    # One gradient of the objective: mean cross-entropy + router_aux_weight * load-balancing loss.
    objective(cfg, result)[0].backward()
    ce = F.cross_entropy(out.logits.reshape(rows, cfg.vocab), tokens[:, 1:].reshape(-1))
    (ce + cfg.router_aux_weight * out.aux_loss).backward()
    theirs_grads = dict(theirs.named_parameters())
    mapped = _in_their_names(cfg, {n: p.grad[0] for n, p in params.items()})
    assert set(mapped) == set(theirs_grads)  # every parameter's gradient
    for name, grad in mapped.items():
        want_grad = theirs_grads[name].grad
        rel = float((grad - want_grad).norm() / want_grad.norm())
        assert rel <= 2 * LOGITS_REL, f"{name}: relative gradient difference {rel:.3g}"


def test_the_load_balancing_loss_counts_real_tokens_as_hugging_face_masks_them():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = HF_CFG
    theta = {n: t.double() for n, t in init_params(cfg, 5).items()}
    tokens = torch.randint(0, cfg.vocab, (3, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(13)[None, :] < torch.tensor([13, 7, 4])[:, None]  # right-padded rows
    params = {n: t.unsqueeze(0) for n, t in theta.items()}
    tally = moe.RouterTally(mask[None, :, :-1].reshape(1, -1), keep=True)
    with torch.no_grad():
        logits(cfg, params, tokens[None, :, :-1], tally)
        ours = forward(cfg, params, tokens[None], mask[None])[0]
    router_logits = tuple(torch.log(p[0]) for p in tally.probs)  # softmax(log p) = p
    want = load_balancing_loss_func(router_logits, cfg.n_experts, cfg.top_k, mask[:, :-1].long())
    rows = int(mask[:, :-1].sum())
    aux_rel = (4 + math.ceil(math.log2(cfg.n_layers * rows)) + math.ceil(math.log2(cfg.n_experts))) * U32
    assert abs(float(ours[1]) - float(want)) <= aux_rel * float(want)
    assert float(ours[-1]) == rows  # the real tokens the router columns counted


# -- stacked against the loop, routing checked token by token ------------------------------------


# A near-tie: a token whose k-th and (k+1)-th router probabilities are closer than this. 2^-16 is 256
# U32: room for the rounding of fp32 forwards through the layers and of the few fp32 optimizer steps
# between the paths' weights; the test proves it rather than assumes it, by asserting that every
# path's probabilities stay within half of it of the loop's, so a flip can only sit at a near-tie.
NEAR_TIE = 2.0**-16


def _replica_weights(state: RunState, R: int) -> list[dict]:
    """Each replica's weights [1, ...] at the start of the next update (copies)."""
    if state.round_params is None:
        return [{n: t.unsqueeze(0).clone() for n, t in state.theta.items()} for _ in range(R)]
    return [{n: t.clone() for n, t in p.items()} for p in state.round_params]


@torch.no_grad()
def _router_probs(cfg, params: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Every layer's router probabilities [L, N, E] for one microbatch's rows under `params`."""
    tally = moe.RouterTally(None, keep=True)
    logits(cfg.model, params, tokens[None, :, :-1].to(torch.int64), tally)
    return torch.stack(tally.probs)[:, 0].double()


def _lockstep(cfg) -> dict:
    """The loop, the stacked engine and the float64 loop through the trainer's rounds one update at a
    time, with every replica's routing at every update compared token by token (module docstring).
    Returns per path its losses [update][replica], routing figures [update][replica][3] and final
    global weights, and the counts: routing decisions (a token in a layer), near-ties, the smallest
    margin, per path its flips and its largest probability gap to the loop, and the first update with a
    flip (None without)."""
    R = cfg.replicas
    paths = {}
    for name, engine, dtype in [
        ("loop", loop.train_replicas, torch.float32),
        ("stacked", stacked.train_replicas, torch.float32),
        ("float64", loop.train_replicas, torch.float64),
    ]:
        run = prepare(cfg)
        state = RunState.start(run.cfg, {n: t.to(dtype) for n, t in initial_weights(run).items()})
        paths[name] = {"state": state, "rounds": rounds(run, state, engine, every_updates=1), "dtype": dtype}
        paths[name] |= {"losses": [], "routing": []}
    counts = {"decisions": 0, "near_ties": 0, "margin": math.inf}
    counts |= {"flips": {"stacked": 0, "float64": 0}, "gap": {"stacked": 0.0, "float64": 0.0}}
    first_flip = None
    for update in range(cfg.phase.updates):
        starts = {name: _replica_weights(p["state"], R) for name, p in paths.items()}
        segments = {}
        for name, p in paths.items():
            with float64_arithmetic() if p["dtype"] == torch.float64 else nullcontext():
                segments[name] = next(p["rounds"])
        for name, segment in segments.items():
            paths[name]["losses"].append([r.losses[0] for r in segment.results])
            paths[name]["routing"].append([r.routing[0] for r in segment.results])
        for m, assign in enumerate(segments["loop"].assigns):
            for mb in assign.batches[0].microbatches:
                probs = {name: _router_probs(cfg, starts[name][m], mb.tokens) for name in paths}
                margin = _margins(probs["loop"], cfg.model.top_k)
                chosen = probs["loop"].topk(cfg.model.top_k, dim=-1).indices.sort(-1).values
                counts["decisions"] += margin.numel()
                counts["near_ties"] += int((margin < NEAR_TIE).sum())
                counts["margin"] = min(counts["margin"], float(margin.min()))
                for name in ("stacked", "float64"):
                    gap = float((probs[name] - probs["loop"]).abs().max())
                    counts["gap"][name] = max(counts["gap"][name], gap)
                    assert gap <= NEAR_TIE / 2, (
                        f"{name} at update {update + 1}: probabilities differ by {gap:.3g}"
                    )
                    theirs = probs[name].topk(cfg.model.top_k, dim=-1).indices.sort(-1).values
                    flipped = (theirs != chosen).any(-1)
                    assert bool((margin[flipped] < NEAR_TIE).all())  # follows from the gap; checked anyway
                    counts["flips"][name] += int(flipped.sum())
                    if bool(flipped.any()) and first_flip is None:
                        first_flip = update
    counts["first_flip"] = first_flip
    return {
        name: {k: p[k] for k in ("losses", "routing")} | {"theta": p["state"].theta}
        for name, p in paths.items()
    } | {"counts": counts}


def _assert_paths_agree(cfg, got: dict) -> None:
    """Stacked against the loop, each against the float64 loop, as `assert_engines_agree` rules
    (tests/helpers.py), over the updates before the first flip (all of them without one): losses, the
    load-balancing loss of every update and, without a flip, the final weights; and the fractions of
    tokens per expert exactly (the counts are integers and the choices agree)."""
    counts = got["counts"]
    print(f"routing: {counts}")  # shown with -s: the margins and flips the run met
    updates = counts["first_flip"] if counts["first_flip"] is not None else len(got["loop"]["losses"])
    assert updates >= 1, "a flip at the first update leaves nothing to compare"
    run = prepare(cfg)
    batches = [b for u in range(updates) for a in assignments(run, range(u, u + 1)) for b in a.batches]
    loss_floor, weight_floor = rounding_floors(cfg, batches, len(got["loop"]["losses"]))
    part = {
        name: {k: v[:updates] for k, v in p.items() if k != "theta"}
        for name, p in got.items()
        if name != "counts"
    }
    assert_losses_within_rounding(
        part["stacked"]["losses"], part["loop"]["losses"], part["float64"]["losses"], loss_floor
    )
    aux = {
        name: [[None if f is None else f[0] for f in row] for row in p["routing"]] for name, p in part.items()
    }
    assert_losses_within_rounding(aux["stacked"], aux["loop"], aux["float64"], loss_floor)
    fractions = {
        name: [[None if f is None else f[1:] for f in row] for row in p["routing"]]
        for name, p in part.items()
    }
    assert fractions["stacked"] == fractions["loop"]
    if counts["first_flip"] is None:
        for n, ref in got["float64"]["theta"].items():
            floor = weight_floor * float(ref.norm())
            assert_within_rounding(got["stacked"]["theta"][n], got["loop"]["theta"][n], ref, floor, n)


@pytest.mark.parametrize(
    "optimizer,R,H,stack,micro_batch",
    [("adamw", 3, 2, 0, 0), ("muon", 3, 2, 2, 3)],  # Muon: sub-rounds of 2 and 1, 2 microbatches a replica
)
def test_stacked_equals_loop_with_every_tokens_routing_checked(optimizer, R, H, stack, micro_batch):
    cfg = moe_cfg(R, H, stack, name=optimizer, micro_batch=micro_batch)
    assert cfg.model.router_aux_weight > 0  # loop and stacked split a replica's batch alike
    got = _lockstep(cfg)
    assert got["counts"]["decisions"] > 0 and got["counts"]["flips"]["stacked"] <= got["counts"]["near_ties"]
    _assert_paths_agree(cfg, got)


# -- the pieces: grouped experts, Muon on experts, the router's optimizer, the aux loss's weighting --


def test_the_grouped_experts_equal_each_tokens_own_top_k_mixture():
    """`moe.mixture` (slots grouped by replica and expert) against Mixtral's definition written per
    token, in float64 over three stacked replicas: only the order of sums differs (d or f terms, then
    k), so the bound is (d + f + k) u64 relative to the largest output."""
    R, N, d, E, f, k = 3, 11, 8, 4, 6, 2
    gen = torch.Generator().manual_seed(0)
    p = {
        "router": torch.randn(R, d, E, generator=gen, dtype=torch.float64),
        "experts.w1": torch.randn(R, E, d, f, generator=gen, dtype=torch.float64),
        "experts.w3": torch.randn(R, E, d, f, generator=gen, dtype=torch.float64),
        "experts.w2": torch.randn(R, E, f, d, generator=gen, dtype=torch.float64),
    }
    x = torch.randn(R, N, d, generator=gen, dtype=torch.float64)
    got = moe.mixture(p, "", x, k, None)
    want = torch.zeros_like(got)
    for r in range(R):
        for n in range(N):
            probs = torch.softmax(x[r, n] @ p["router"][r], -1)
            top, chosen = probs.topk(k)
            for weight, e in zip(top / top.sum(), chosen.tolist(), strict=True):
                h = F.silu(x[r, n] @ p["experts.w1"][r, e]) * (x[r, n] @ p["experts.w3"][r, e])
                want[r, n] += weight * (h @ p["experts.w2"][r, e])
    assert float((got - want).abs().max()) <= (d + f + k) * 2.0**-53 * float(want.abs().max())


def test_muon_orthogonalises_each_expert_and_adamw_steps_the_router():
    cfg = moe_cfg(2, 1, name="muon")
    roles = param_roles(cfg.model)
    assert roles["layers.000.router"] == "router" and not uses_muon(cfg.inner, "router")
    assert roles["layers.000.experts.w1"] == "hidden" and uses_muon(cfg.inner, "hidden")
    theta = init_params(cfg.model, 0)
    params = {n: t.unsqueeze(0).expand(2, *t.shape).clone() for n, t in theta.items()}
    state = init_state(cfg.inner, params, roles)
    assert "layers.000.router" in state.v and "layers.000.experts.w1" not in state.v
    gen = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(t.shape, generator=gen) * 1e-3 for n, t in params.items()}
    inner = replace(cfg.inner, grad_clip=0.0)
    name, lr = "layers.001.experts.w2", 1e-2
    before = params[name].clone()
    inner_step(inner, params, grads, state, lr)
    # The first Muon step from zero momentum: NS((1 + mu) g) of each [f, d] expert matrix on its own.
    R, E, rows, cols = before.shape
    scale = 0.2 * math.sqrt(max(rows, cols))
    for r in range(R):
        for e in range(E):
            want = before[r, e] * (1 - lr * inner.wd) - lr * scale * newton_schulz(
                (1 + inner.muon_momentum) * grads[name][r, e], inner.ns_steps
            )
            rel = float((params[name][r, e] - want).norm() / want.norm())
            assert rel <= 16 * U32, (r, e, rel)
    # Not one matrix over the experts: NS of the stacked [E*f, d] differs at the update's own scale.
    whole = newton_schulz((1 + inner.muon_momentum) * grads[name][0].reshape(E * rows, cols), inner.ns_steps)
    step = params[name][0] - before[0] * (1 - lr * inner.wd)
    assert float((step.reshape(E * rows, cols) + lr * scale * whole).norm()) > 0.1 * float(step.norm())


def test_cross_entropy_is_split_invariant_and_the_load_balancing_loss_is_not():
    """One replica batch of 8 rows whole and in two halves (token-weighted, as training sums
    microbatches), in float64: the cross-entropy agrees within the rounding of a mean over 128 targets
    and two weighted adds, (3 + 7 + 4) u64; the load-balancing loss of the halves is another number, a
    million times further off (docs/moe.md measures it on the default workload)."""
    cfg = moe_cfg(1, 1).model
    params = {n: t.unsqueeze(0).double() for n, t in init_params(cfg, 0).items()}
    tokens = torch.randint(0, cfg.vocab, (1, 8, 17), generator=torch.Generator().manual_seed(2))
    whole = forward(cfg, params, tokens)[0]
    halves = [forward(cfg, params, part)[0] for part in tokens.split(4, dim=1)]
    split = [sum(0.5 * h[i] for h in halves) for i in (0, 1)]  # each half holds half the targets
    u64 = 2.0**-53
    assert abs(float(split[0] - whole[0])) <= (3 + 7 + 4) * u64 * float(whole[0])
    assert abs(float(split[1] - whole[1])) > 1e6 * (3 + 7 + 4) * u64 * float(whole[1])
    # Each half's routed counts add up to the whole's: only the aux loss's products of means differ.
    assert torch.equal(halves[0][2:] + halves[1][2:], whole[2:])


def test_bf16_autocast_trains_a_mixture_as_it_trains_the_dense_model():
    cfg = moe_cfg(2, 1, model={"compute_dtype": "bf16"})
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    segment = next(rounds(run, state, stacked.train_replicas))
    assert all(math.isfinite(x) for r in segment.results for x in r.losses)
    assert all(0 <= f[1] <= 0.5 <= f[2] <= 1 for r in segment.results for f in r.routing)


# -- whole runs ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_processes_equal_the_simulation_with_no_routing_near_a_tie(tmp_path):
    """The benchmark layout (2 ranks share one replica's batch, so the load-balancing loss is taken
    per rank's half: weight 0, as its splits differ from the simulation's) against the simulated loop
    and the float64 loop. The processes' per-update routing is not observable from outside, so the
    simulation's is counted: near-ties are a few in a thousand decisions at most (the only places a
    flip could sit), and a flip, which moves a token's whole expert output, would show in that
    update's loss beyond the rounding bound checked here."""
    overrides = [*DIST, "model=moe_tiny", "world=2", "replicas=1", "model.router_aux_weight=0"]
    overrides += ["inner.H=2", "phase.updates=4"]
    proc = start_entry([*overrides, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    try:
        cfg = compose_cfg(overrides)
        got = _lockstep(cfg)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # the entry and its workers; the test fails with the error
        raise
    done = finish(proc)
    assert done.returncode == 0, done.stderr
    counts = got["counts"]
    print(f"routing: {counts}")
    assert counts["near_ties"] <= counts["decisions"] / 1000 and counts["flips"]["float64"] == 0, counts
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [r["loss"] for r in rows if r["kind"] == "update"]
    weights = torch.load(tmp_path / "run" / "weights.pt")
    run = prepare(cfg)
    batches = [b for u in range(len(losses)) for a in assignments(run, range(u, u + 1)) for b in a.batches]
    loss_floor, weight_floor = rounding_floors(cfg, batches, len(losses))
    assert_losses_within_rounding(losses, got["loop"]["losses"], got["float64"]["losses"], loss_floor)
    for n, ref in got["float64"]["theta"].items():
        assert_within_rounding(weights[n], got["loop"]["theta"][n], ref, weight_floor * float(ref.norm()), n)


@pytest.mark.slow
def test_moe_tiny_learns_on_the_default_workload(tmp_path):
    """The default run's first two rounds (10 updates of the strong phase, R 4, H 5) with moe_tiny:
    the held-out loss falls at every sync (measured: 5.56, 4.96, 3.93; docs/moe.md compares tiny)."""
    done = entry(["model=moe_tiny", "logger=none", "phase.updates=10", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = read_metrics(tmp_path / "metrics.jsonl")
    heldout = [r["eval_loss"] for r in rows if r["kind"] in ("eval", "sync")]
    assert len(heldout) == 3 and heldout[0] > heldout[1] > heldout[2], heldout
    assert heldout[-1] < heldout[0] - 1.0


def test_the_update_rows_carry_the_router_figures(tmp_path):
    """A routed run's update rows hold `loss/router_aux` (Mixtral's load-balancing loss, unweighted,
    averaged over the replicas that stepped: finite and positive) and the least and most used expert's
    fraction of a replica-update's routing slots (the k choices counted, so they sum to k over the
    experts: the least is at most, the most at least, the balanced k / E = 2 / 4 of moe_tiny)."""
    run_dir = tmp_path / "run"
    done = entry([*QUICK, "logger=none", "model=moe_tiny", f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr
    updates = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    assert updates
    for row in updates:
        assert math.isfinite(row["loss/router_aux"]) and row["loss/router_aux"] > 0
        low, high = row["experts/min_fraction"], row["experts/max_fraction"]
        assert 0 <= low <= 2 / 4 <= high <= 1, row  # k / E between the least and the most used expert


# -- the network clock counts a token's active parameters -------------------------------------------------


def test_the_modelled_clock_counts_the_experts_a_token_uses(tmp_path):
    """DESIGN.md's modelled compute is `6 * active params * tokens / (peak * mfu)`: of a mixture of experts
    a token uses every parameter but the experts', and top_k / n_experts of those (here 2 of 4). The
    count is written out from the weights' shapes; the run's `clock/compute_s` is the sum over its
    updates of that formula on one replica's tokens (the update's over the replicas that stepped), rel
    1e-12 (fp64 sums of positive terms), far from the all-parameters figure; the replay of the records
    (`clock_of`) gives the same."""
    cluster = ClusterConfig(name="test", compute="modelled", peak_tflops=1e-3, mfu=0.5)
    cfg = replace(moe_cfg(2, 2), cluster=cluster)
    validate(cfg)
    weights = initial_weights(prepare(cfg))
    every = sum(t.numel() for t in weights.values())
    experts = sum(t.numel() for n, t in weights.items() if "experts" in n)
    active = every - experts + experts * 2 // 4
    rows = run_losses(cfg, tmp_path)
    updates = [r for r in rows if r["kind"] == "update"]
    tokens = [r["tokens"] / sum(x is not None for x in r["loss"]) for r in updates]
    want = sum(6 * active * t / (1e9 * 0.5) for t in tokens)
    summary = {k: v for r in rows if r["kind"] == "summary" for k, v in r.items()}
    assert summary["model/active_params"] == active < every
    assert summary["clock/compute_s"] == pytest.approx(want, rel=1e-12)
    assert want < 0.8 * sum(6 * every * t / (1e9 * 0.5) for t in tokens)
    replay = clock_of(rows, dataclasses.asdict(cfg), cluster)
    assert replay["compute_s"] == pytest.approx(want, rel=1e-12)
