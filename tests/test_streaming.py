"""Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512; torchft's `DiLoCo(model_fragments=...,
fragment_sync_delay=..., fragment_update_alpha=...)`): the schedule, the fragment split, and every
fragment sync of a real run against a float64 reference of the paper's algorithm written here.

The reference is fed what the run's replicas hold after every update (the round loop cut after each
update, which changes no number) and decides on its own, from the paper's schedule, when each fragment's
pseudo-gradient is taken (tau updates before its sync point), when it lands, the outer Nesterov step
(DiLoCo, Douillard et al. 2023, Algorithm 1 lines 10-12, torch.optim.SGD's momentum form) and the merge
`local <- lerp(global_new, local, alpha)`; it then checks the run's global weights, outer momentum and
replica weights after every landing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import observe, streaming_cfg
from references import U32, assert_outer_step

from hypertrain.config import UserError
from hypertrain.diloco.fragments import Schedule, fragment_of
from hypertrain.preflight.checks import validate


def stream_cfg(P: int, tau: int, alpha: float, updates: int = 19):
    """Three layers (so four fragments hold parameters), H = 8, R = 2, the loop engine."""
    return streaming_cfg(P, tau, alpha, updates, engine="loop")


# -- the schedule and the split, from the paper's rule written out ----------------------------------------


def paper_events(H: int, P: int, tau: int, N: int) -> dict[int, list[tuple[str, int]]]:
    """torchft's schedule (fragment p synced after updates k*H + (p+1)*H/P, prepared tau earlier) and our
    flush: at the phase's end every fragment not synced at that count lands, in fragment order, the one
    in flight with what it took, the others taken then."""
    out: dict[int, list[tuple[str, int]]] = {}
    in_flight: set[int] = set()
    for c in range(1, N + 1):
        events = []
        for p in range(P):
            point = (p + 1) * H // P
            if c % H == point % H:  # point == H lands at multiples of H
                if tau == 0:
                    events.append(("take", p))
                events.append(("land", p))
                in_flight.discard(p)
        if c == N:  # the flush, in fragment order; a take due at the end is made just before its landing
            landed = {p for kind, p in events if kind == "land"}
            for p in range(P):
                if p in landed:
                    continue
                if p not in in_flight:
                    events.append(("take", p))
                events.append(("land", p))
            out[c] = events
            break
        for p in range(P):
            if tau and c % H == ((p + 1) * H // P - tau) % H:
                events.append(("take", p))
                in_flight.add(p)
        if events:
            out[c] = events
    return out


@pytest.mark.parametrize(
    "H,P,tau,N", [(8, 1, 0, 19), (8, 2, 0, 19), (8, 2, 1, 19), (8, 4, 1, 21), (8, 4, 1, 24)]
)
def test_the_schedule_is_the_papers_with_a_flush_at_the_end(H, P, tau, N):
    schedule = Schedule(H, P, tau, N)
    got = {c: schedule.events(c) for c in range(1, N + 1) if schedule.events(c)}
    assert got == paper_events(H, P, tau, N)
    # segments are cut exactly at the counts where something happens
    cuts, c = [], 0
    while c < N:
        c = schedule.next_cut(c)
        cuts.append(c)
    assert cuts == sorted(got)


def test_layers_are_strided_over_fragments_embeddings_first_head_last():
    where = fragment_of(stream_cfg(P=2, tau=0, alpha=0.0))
    assert where["emb"] == 0 and where["head"] == 1 and where["norm"] == 1
    assert {where[f"layers.{i:03d}.wq"] for i in range(3)} == {0, 1}
    assert [where[f"layers.{i:03d}.w1"] for i in range(3)] == [0, 1, 0]
    four = fragment_of(stream_cfg(P=4, tau=0, alpha=0.0))
    assert [four[f"layers.{i:03d}.wo"] for i in range(3)] == [0, 1, 2] and four["head"] == 3


@pytest.mark.parametrize(
    "change,message",
    [
        ({"fragments": 3}, "outer.fragments=3 does not divide inner.H=8"),
        ({"fragments": 8}, "outer.fragments=8 leaves a fragment without parameters"),
        ({"fragments": 2, "delay": 4}, "outer.delay=4 is out of range; valid: 0..3"),
        ({"delay": -1}, "outer.delay=-1 is too small"),
        ({"merge_alpha": 1.5}, "outer.merge_alpha=1.5 is out of range; valid: [0, 1]"),
        ({"merge_alpha": float("nan")}, "outer.merge_alpha=nan is not a finite number"),
        ({"assignment": ["everything"]}, "outer.assignment=['everything'] is derived"),
    ],
)
def test_bad_fragment_settings_are_one_line(change, message):
    cfg = stream_cfg(P=1, tau=0, alpha=0.0)
    with pytest.raises(UserError) as e:
        validate(replace(cfg, outer=replace(cfg.outer, **change)))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


# -- every fragment sync of a run against the float64 reference -------------------------------------------


def check_against_reference(cfg, relabel=lambda p: p) -> int:
    """Replay the paper's algorithm in float64 on the run's observed weights; assert the run's global
    weights, outer momentum and replica weights after every update count. `relabel` maps the paper's
    fragment to the one the reference syncs (the negative control). Returns the landings checked.

    Each landing is checked as a function of the run's own state before it (its global weights and
    momentum after the previous count, its replicas' weights at the take), so no error carries from one
    landing to the next. Bounds, per entry: the run forms d = sum_m fl(theta - w_m) / n in fp32 ((n + 1)
    roundings, each within U32 of the mean |theta - w_m|, `spread`), then buf = mu*buf + d (2 roundings),
    u = d + mu*buf (2) and theta - lr*u (2): |err(buf)| <= (n + 3) U32 (spread + mu |buf_old|), |err(theta)|
    <= 2 U32 |theta_new| + lr (1 + mu) (n + 5) U32 (spread + mu |buf_old|). The merge lerp(g, w, alpha) in
    fp32 errs by <= 3 U32 (|g| + |w|); at alpha = 0 it is the global weights exactly."""
    o = cfg.outer
    where, theta0, before, after, _ = observe(cfg)
    n = cfg.replicas
    names = list(theta0)
    frag = [[x for x in names if where[x] == p] for p in range(o.fragments)]
    events = paper_events(cfg.inner.H, o.fragments, o.delay, cfg.phase.updates)
    prev_theta = {x: t.double() for x, t in theta0.items()}
    prev_buf = {x: torch.zeros_like(t) for x, t in prev_theta.items()}
    taken: dict[int, tuple[dict, dict]] = {}
    landed = 0
    for count in sorted(before):
        replicas = [{x: t.double() for x, t in w.items()} for w in before[count]]
        run_theta, run_buf, run_replicas = after[count]
        moved = set()
        for kind, paper_p in events.get(count, []):
            p = relabel(paper_p)
            if kind == "take":  # fragment p's pseudo-gradient from the replicas' weights now
                deltas = {x: sum(prev_theta[x] - w[x] for w in replicas) / n for x in frag[p]}
                spread = {x: sum((prev_theta[x] - w[x]).abs() for w in replicas) / n for x in frag[p]}
                taken[p] = (deltas, spread)
                continue
            deltas, spread = taken.pop(p)
            for x in frag[p]:
                args = (prev_theta[x], prev_buf[x], deltas[x], spread[x], n, run_theta[x], run_buf[x])
                assert_outer_step(o, *args, (count, p, x))
                g = run_theta[x].double()
                for m, w in enumerate(replicas):  # the merge, on the run's replicas
                    want = g + o.merge_alpha * (w[x] - g)
                    if run_replicas is not None:
                        bound = 3 * U32 * (g.abs() + w[x].abs()) if o.merge_alpha else 0.0
                        assert ((run_replicas[m][x].double() - want).abs() <= bound).all(), (count, p, x, m)
                moved.add(x)
            landed += 1
        for x in names:  # what did not land is untouched, globally and in every replica
            if x not in moved:
                assert torch.equal(run_theta[x].double(), prev_theta[x]), (count, x)
                assert torch.equal(run_buf[x].double(), prev_buf[x]), (count, x)
                if run_replicas is not None:
                    for m in range(n):
                        assert torch.equal(run_replicas[m][x], before[count][m][x]), (count, x, m)
        prev_theta = {x: t.double() for x, t in run_theta.items()}
        prev_buf = {x: t.double() for x, t in run_buf.items()}
    assert not taken  # every pseudo-gradient taken has landed: the run ends on synced weights
    return landed


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("tau", [0, 1])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_every_fragment_sync_equals_the_float64_reference(P, tau, alpha):
    cfg = stream_cfg(P, tau, alpha)
    landed = check_against_reference(cfg)
    # a landing every H/P updates up to 19, then the flush of every fragment at 19
    assert landed == 19 // (8 // P) + P


def test_fragments_synced_in_the_wrong_order_are_caught():
    """The negative control: a reference that syncs the fragments in reverse order (the head's first)
    differs from the run at the first landing."""
    cfg = stream_cfg(P=2, tau=1, alpha=0.0)
    with pytest.raises(AssertionError) as e:
        check_against_reference(cfg, relabel=lambda p: 1 - p)
    assert str(e.value).startswith("(4, 1, ")  # count 4: the reference moved fragment 1, the run fragment 0
