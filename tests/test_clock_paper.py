"""The network clock's formulas against a published table (issue 25).

Paper: Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
Lunch", arXiv 2501.18512v1. Table: Table 4 (appendix), "Simulation: we estimate the step time (pure compute)
of 10B and 100B based on the required flops using Kaplan et al. (2020) rule and using a MFU of 60%. For all
DiLoCo and Streaming DiLoCo-variants, we use H=100. For all Streaming DiLoCo-variants, we use a fragment size
of 3 layers." Each cell is the bandwidth (Gbit/s) between workers needed to reach a compute utilization CU
(compute time / total time, section 3.1 and Figure 4). Row reproduced: "Streaming DiLoCo w/ overlapped com.";
entries: 1B at CU 50% (1.4 Gbit/s), 10B at CU 95% (6.2 Gbit/s), 100B at CU 99% (5.2 Gbit/s).

The paper's assumptions, as used here:
- model sizes, layer counts and step times from the table's own columns: 1B / 24 layers / 0.1 s, 10B / 48 /
  0.8 s, 100B / 108 / 4.9 s (step time = pure compute of one inner step);
- H = 100 inner steps per fragment, fragments of 3 layers, so P = layers / 3 fragments, one sent every H / P
  steps, each carrying 3 / layers of the parameters (section 2.2);
- overlap tau = 1 inner step: the table does not print tau, but Kale, Douillard & Donchev 2025 (arXiv
  2502.12996, Table 5) reprint the same simulation's FP4 row, with the same numbers, as "Streaming DiLoCo with
  1-inner-step overlapped FP4 com.", and Table 1 of the paper allows "communication to be as long as a full
  compute step";
- the simulator is a DAG whose per-layer reduction starts once that layer's backward is done (section 3.1,
  Figure 3), so the exchange also hides behind the sending step's backward pass: 2/3 of a step (backward = 4N
  of the 6N FLOPs per token, Kaplan et al. 2020, the rule the caption cites);
- only the bandwidth between workers (datacenters) counts (section 3.1, "Remark").

What the paper does not state, and what is assumed here:
- the bytes per parameter of the non-FP4 rows: bf16 (2 bytes). The table's FP4 row needs about 1/4 of this
  row's bandwidth at every size and CU (e.g. 1B: 0.4 vs 1.4, 3.0 vs 11.0), consistent with 16-bit, not 32-bit,
  outer gradients;
- the number of workers: 2, the replicas of the paper's own experiments (section 3.2), so the ring all-reduce
  moves 2(n-1)/n = 1 payload per worker;
- latency: none is given (Figure 4's axis is bandwidth only), so alpha = 0.

What cannot be matched with these formulas, and why:
- the per-layer DAG itself: the clock has one overlap number per exchange (`exposed_s`), not a schedule of
  per-layer reductions against per-layer forward and backward nodes. Rows whose value hinges on that schedule
  fall outside 10%: Data-Parallel at CU 99% (1B: 569.0 published, 236 here) and vanilla DiLoCo at CU 50%
  (1B: 1.4 published, 1.59 here; 10B: 1.7 vs 1.99);
- the step times cannot be recomputed with `modelled_compute_s`: the tokens per step and the accelerator are
  not given, and the MFU is 40% in section 3.1's text but 60% in the caption; the published step times are
  used as they stand;
- the published cells are points of a log-spaced bandwidth grid (consecutive values differ by a factor of
  about 1.207; they sit on numpy.logspace(-1, 3, 50) up to rounding, an inference, not stated): a cell is the
  first grid point whose simulated CU reaches the target, so the true threshold can lie up to ~17% below it.
  A 10% tolerance is therefore at the table's own resolution; the comparison is against the printed value,
  not a snapped one.
"""

from __future__ import annotations

import math

import pytest

from hypertrain.clock.formulas import Link, exposed_s, ring_allreduce_s

# arXiv 2501.18512v1, Table 4, row "Streaming DiLoCo w/ overlapped com." (Gbit/s for CU = 50/80/90/95/99%):
#   1B   (24 layers, 0.1 s): 1.4  4.3  6.2  9.1  11.0
#   10B  (48 layers, 0.8 s): 1.7  3.6  5.2  6.2  7.5
#   100B (108 layers, 4.9 s): 1.7  3.6  4.3  5.2  5.2
# The three entries checked (label, parameters, layers, step seconds, CU, published Gbit/s):
ENTRIES = [
    ("1B CU50", 1e9, 24, 0.1, 0.50, 1.4),
    ("10B CU95", 10e9, 48, 0.8, 0.95, 6.2),
    ("100B CU99", 100e9, 108, 4.9, 0.99, 5.2),
]

H = 100  # inner steps between two syncs of one fragment (Table 4 caption)
FRAGMENT_LAYERS = 3  # layers per fragment (Table 4 caption)
TAU = 1  # inner steps the exchange overlaps (Kale et al. 2025, Table 5: "1-inner-step overlapped")
BACKWARD_SHARE = 2 / 3  # backward = 4N of 6N FLOPs per token (Kaplan et al. 2020)
BYTES_PER_PARAM = 2  # bf16 outer gradients: assumed, not stated (the FP4 row is ~1/4 of this one)
WORKERS = 2  # assumed: the paper's experiments use 2 DiLoCo replicas (section 3.2)
TOLERANCE = 0.10


def utilization(
    gbit: float,
    params: float,
    layers: int,
    step_s: float,
    *,
    bytes_per_param: float = BYTES_PER_PARAM,
    tau: int = TAU,
    backward_share: float = BACKWARD_SHARE,
    workers: int = WORKERS,
) -> float:
    """The paper's compute utilization, compute / (compute + exposed communication), over one fragment
    period of H/P inner steps, with the clock's formulas for the fragment's exchange and its overlap."""
    fragments = layers // FRAGMENT_LAYERS
    payload = params * FRAGMENT_LAYERS / layers * bytes_per_param
    comm = ring_allreduce_s(payload, workers, Link(bandwidth=gbit * 1e9 / 8, latency=0.0))
    compute = H / fragments * step_s
    return compute / (compute + exposed_s(comm, (tau + backward_share) * step_s))


def required_gbit(cu: float, params: float, layers: int, step_s: float, **assumption) -> float:
    """The smallest bandwidth (Gbit/s) at which `utilization` reaches `cu` (bisection on a log scale; the
    utilization rises with bandwidth)."""
    lo, hi = 1e-4, 1e5
    assert utilization(lo, params, layers, step_s, **assumption) < cu
    assert utilization(hi, params, layers, step_s, **assumption) >= cu
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if utilization(mid, params, layers, step_s, **assumption) >= cu:
            hi = mid
        else:
            lo = mid
    return hi


def test_required_bandwidth_by_hand():
    # 1B, CU 50%: a fragment (3/24 of 1e9 bf16 parameters = 2.5e8 bytes = 2 Gbit) is sent every 100/8 = 12.5
    # steps of 0.1 s = 1.25 s of compute; CU 50% allows 1.25 s exposed; the exchange hides behind
    # (1 + 2/3) * 0.1 s; so 2 Gbit / (1.25 + 1/6) s = 1.41176 Gbit/s.
    assert required_gbit(0.50, 1e9, 24, 0.1) == pytest.approx(2 / (1.25 + 1 / 6), rel=1e-9)
    # 100B, CU 99%: 3/108 of 1e11 bf16 parameters = 44.44 Gbit every 100/36 steps of 4.9 s (13.61 s); 1% of
    # the total is 13.61 * (1/0.99 - 1) = 0.1375 s exposed, plus (1 + 2/3) * 4.9 s hidden.
    compute = 100 / 36 * 4.9
    expected = (1e11 * 3 / 108 * 2 * 8 / 1e9) / (compute * (1 / 0.99 - 1) + 5 / 3 * 4.9)
    assert required_gbit(0.99, 100e9, 108, 4.9) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("label", "params", "layers", "step_s", "cu", "published"), ENTRIES)
def test_published_entry_within_10_percent(label, params, layers, step_s, cu, published):
    # Here: 1B CU50 1.412 (+0.8%), 10B CU95 6.26 (+1.0%), 100B CU99 5.35 (+2.9%).
    ours = required_gbit(cu, params, layers, step_s)
    assert abs(ours - published) / published <= TOLERANCE, (label, ours, published)
    # The one-exchange model holds only if a fragment's exchange ends before the next fragment is sent, one
    # fragment period (compute / CU) later: no two exchanges share the link.
    fragments = layers // FRAGMENT_LAYERS
    payload = params * FRAGMENT_LAYERS / layers * BYTES_PER_PARAM
    comm = ring_allreduce_s(payload, WORKERS, Link(bandwidth=ours * 1e9 / 8, latency=0.0))
    assert comm <= H / fragments * step_s / utilization(ours, params, layers, step_s)


# Wrong assumptions, each of which the check rejects (largest relative miss over the three entries):
# fp32 outer gradients: +106% (every entry doubles); no overlap of the next step (tau = 0): +151% (100B CU99:
# 13.1 Gbit/s); overlap of the next step only, not the sending step's backward: +70% (100B CU99: 8.8); eight
# workers on the ring (2*7/8 = 1.75 payloads each): +80%.
WRONG = {
    "fp32 outer gradients": {"bytes_per_param": 4},
    "no overlap (tau=0)": {"tau": 0},
    "no backward overlap": {"backward_share": 0.0},
    "eight workers": {"workers": 8},
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_wrong_assumption_misses_the_table(name):
    misses = [
        abs(required_gbit(cu, params, layers, step_s, **WRONG[name]) - published) / published
        for _, params, layers, step_s, cu, published in ENTRIES
    ]
    assert max(misses) > TOLERANCE, (name, misses)
