"""outer.mean_weights=tokens in synchronous rounds (issue 39, docs/async.md "Weighted mean"): each
replica's pseudo-gradient weighs by the target tokens it trained on since the last sync,
g = sum_m w_m delta_m / sum_m w_m, the asynchronous server's rule (`server.token_weights`). Here: the
reducer's weighted sum is the server's `contribution` bitwise; with churn.deadline (replicas stopped
after unequal steps) every sync equals the float64 weighted step from the tokens written out from the
deadline rule, and differs from the uniform mean; loop = stacked; without a deadline, documents of
unequal length weigh too (tokens from the plan differ), and fixed-length text weighs every replica
alike. Codecs, fragments and overlap: tests/test_token_weights_schemes.py; eager overlap, not built, is
one line, exit 2 (tests/test_bad_input.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from helpers import assert_engines_agree, cfg_for, observe
from references import assert_outer_step
from test_churn_deadline import UPDATES, H, R, deadline_cfg, finished_by_rule

from hypertrain.diloco.asynchrony.server import contribution
from hypertrain.diloco.asynchrony.server import token_weights as rule
from hypertrain.diloco.outer import pseudo_gradient_sum
from hypertrain.diloco.rounds import rounds, token_weights
from hypertrain.diloco.state import RunState
from hypertrain.preflight.checks import validate
from hypertrain.preflight.prepare import initial_weights, prepare


def weighted(cfg):
    cfg = replace(cfg, outer=replace(cfg.outer, mean_weights="tokens"))
    validate(cfg)
    return cfg


def test_the_reducers_weighted_sum_is_the_servers_contribution_bitwise():
    torch.manual_seed(0)
    theta = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    replicas = {n: t[None] + 0.1 * torch.randn(4, *t.shape) for n, t in theta.items()}
    tokens = [7, 0, 130, 41]
    deltas = torch.cat([(theta[n][None] - replicas[n]).reshape(4, -1) for n in theta], dim=1)
    _, mean = contribution(deltas, tokens, "tokens")
    w = rule(tokens, "tokens", torch.float32)
    got = pseudo_gradient_sum(theta, replicas, torch.tensor([True, False, True, True]), w)
    assert torch.equal(got[:-1], mean) and got[-1] == 3
    _, uniform = contribution(deltas, tokens, "uniform")
    assert not torch.allclose(mean, uniform)  # negative control: the weights matter


def test_each_sync_with_a_deadline_is_the_float64_token_weighted_step():
    """Fixed-length text: a replica's tokens in round k are its finished steps times global_batch / R
    windows of seq_len targets; the reference weighs the run's reached weights by them (bounds as
    tests/test_churn.py's `check_syncs`, the spread weighted)."""
    cfg = weighted(deadline_cfg())
    per_step = cfg.phase.global_batch // R * cfg.data.seq_len
    want = finished_by_rule(cfg)
    _, theta0, before, after, _ = observe(cfg)
    theta = {x: t.double() for x, t in theta0.items()}
    buf = {x: torch.zeros_like(t) for x, t in theta.items()}
    for k in range(1, UPDATES // H + 1):
        tokens = torch.tensor([n * per_step for n in want[k]], dtype=torch.float64)
        w = tokens / tokens.sum()
        assert len(set(want[k])) > 1  # unequal steps: the weights differ from uniform
        replicas = [{x: t.double() for x, t in r.items()} for r in before[k * H]]
        run_theta, run_buf, _ = after[k * H]
        for x in theta:
            delta = sum(w[m] * (theta[x] - replicas[m][x]) for m in range(R))
            spread = sum(w[m] * (theta[x] - replicas[m][x]).abs() for m in range(R))
            uniform = sum(theta[x] - replicas[m][x] for m in range(R)) / R
            assert not torch.allclose(delta, uniform)
            assert_outer_step(cfg.outer, theta[x], buf[x], delta, spread, R, run_theta[x], run_buf[x], (k, x))
            theta[x], buf[x] = run_theta[x].double(), run_buf[x].double()


def test_stacked_equals_the_loop_with_token_weights_and_a_deadline():
    assert_engines_agree(weighted(deadline_cfg()))


def final(cfg) -> dict:
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    for _ in rounds(run, state):
        pass
    return state.theta


def test_without_a_deadline_documents_of_unequal_length_weigh_and_fixed_text_weighs_alike():
    """No churn: every replica trains every update, but documents give them unequal tokens, the plan's
    targets (each update's `replica_total`); fixed-length text gives R equal weights, 1 / R each."""
    base = cfg_for(R=2, H=2)
    cfg = weighted(replace(base, data=replace(base.data, examples="documents", max_len=48, max_examples=4)))
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    targets = [[0, 0] for _ in range(cfg.phase.updates // 2)]
    for part in rounds(run, state):
        for t, u in enumerate(part.updates):
            for m, total in enumerate(part.replica_column("targets")[t].tolist()):
                targets[u // 2][m] += int(total)
    assert any(a != b for a, b in targets), targets
    for i, tokens in enumerate(targets):
        got = token_weights(run, range(2 * i, 2 * i + 2), None)
        assert got == rule(tokens, "tokens", torch.float32).tolist()
    uniform = final(replace(cfg, outer=replace(cfg.outer, mean_weights="uniform")))
    assert any(not torch.equal(state.theta[n], t) for n, t in uniform.items())
    text = weighted(cfg_for(R=2, H=2))
    assert token_weights(prepare(text), range(0, 2), None) == [0.5, 0.5]
