"""The smoke run against its regression fixture, and its first steps against an independent float64 model.

The fixture (`tests/assets/smoke_losses.json`, regenerate with `.venv/bin/python tests/smoke_fixture.py
--write`) only catches unintended change. The independent check is the float64 decoder below: written
from the architecture's definition (explicit per-head softmax attention, complex-number RoPE, repeated
key/value heads for GQA), trained with torch's own AdamW and clipping. It shares nothing with
`hypertrain.model` or `hypertrain.optim` but the initial weights.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import rounding_floors
from references import assert_losses_within_rounding, schedule_lr, torch_adamw
from smoke_fixture import FIXTURE, smoke_config, smoke_losses

from hypertrain import plan
from hypertrain.diloco.rounds import assignments
from hypertrain.model.transformer import init_params
from hypertrain.preflight.prepare import prepare


def reference_loss(cfg, w: dict, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of the independent decoder (in the weights' dtype) on rows [B, T+1],
    one sequence at a time."""
    m = cfg.model
    hd, h, kv = m.d_model // m.n_heads, m.n_heads, m.n_kv_heads
    T, dtype = rows.shape[1] - 1, w["emb"].dtype
    freqs = m.rope_theta ** (-torch.arange(0, hd, 2, dtype=dtype) / hd)
    rotation = torch.polar(torch.ones(T, hd // 2, dtype=dtype), torch.arange(T, dtype=dtype)[:, None] * freqs)

    def rope(x):  # x [T, hd]: pairs (x_i, x_{i + hd/2}) rotate as complex numbers
        z = torch.complex(x[:, : hd // 2], x[:, hd // 2 :]) * rotation
        return torch.cat([z.real, z.imag], dim=-1)

    def rms(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * g

    total = 0.0
    for row in rows:
        x = w["emb"][row[:-1]]
        for i in range(m.n_layers):
            layer = {name.split(".")[-1]: t for name, t in w.items() if name.startswith(f"layers.{i:03d}.")}
            p = layer.__getitem__
            a = rms(x, p("attn_norm"))
            q, k, v = a @ p("wq"), a @ p("wk"), a @ p("wv")
            heads = []
            for head in range(h):
                g = head // (h // kv)  # the key/value head this query head shares
                qh = rope(q[:, head * hd : (head + 1) * hd])
                kh = rope(k[:, g * hd : (g + 1) * hd])
                scores = qh @ kh.T / math.sqrt(hd)
                scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
                heads.append(torch.softmax(scores, -1) @ v[:, g * hd : (g + 1) * hd])
            x = x + torch.cat(heads, -1) @ p("wo")
            a = rms(x, p("mlp_norm"))
            gate = a @ p("w1")
            x = x + (gate * torch.sigmoid(gate) * (a @ p("w3"))) @ p("w2")
        logits = rms(x, w["norm"]) @ w["head"]
        total = total + torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum")
    return total / (rows.shape[0] * T)


def independent_losses(cfg, run, dtype: torch.dtype) -> list[float]:
    """Replica 0's first round (no sync involved yet) with the independent decoder and torch's AdamW."""
    c = run.cfg.inner
    weights = {n: t.to(dtype).requires_grad_(True) for n, t in init_params(cfg.model, cfg.seed).items()}
    opt = torch_adamw(c, list(weights.values()))
    losses = []
    for u in range(c.H):
        for group in opt.param_groups:
            group["lr"] = schedule_lr(c, u)
        rows = torch.from_numpy(
            run.dataset.get_many(plan.replica_ids(run.phase, u, 0, cfg.replicas, run.samples))
        )
        loss = reference_loss(cfg, weights, rows)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(weights.values()), c.grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_smoke_runs_first_steps_match_an_independent_float64_model():
    """hypertrain's fp32 losses and the independent decoder's fp32 losses are two fp32 paths to the
    same numbers: each within twice the other's error against the independent float64 run, or twice
    the rounding floor of a loss (references.py, test_stacked.rounding_floors)."""
    cfg = smoke_config()
    run = prepare(cfg)
    ref = independent_losses(cfg, run, torch.float64)
    peer = independent_losses(cfg, run, torch.float32)
    live = smoke_losses(cfg)["losses"]
    H = run.cfg.inner.H
    loss_floor, _ = rounding_floors(cfg, assignments(run, range(H))[0].batches, H)
    assert_losses_within_rounding(
        [[row[0]] for row in live[:H]], [[x] for x in peer], [[x] for x in ref], loss_floor
    )


def test_the_smoke_run_matches_its_regression_fixture():
    fixture = json.loads(FIXTURE.read_text())
    live = smoke_losses()
    for key in ("data_fingerprint", "torch"):
        if live[key] != fixture[key]:
            pytest.skip(
                f"fixture made with {key}={fixture[key]}, this machine has {live[key]}; regenerate with "
                f"`{fixture['regenerate']}`"
            )
    np.testing.assert_allclose(live["losses"], fixture["losses"], **fixture["tolerance"])
    np.testing.assert_allclose(live["eval_losses"], fixture["eval_losses"], **fixture["tolerance"])
