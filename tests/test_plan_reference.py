"""The vectorised plan against plain-Python references written from docs/design.md; the channel weights."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hypertrain import plan
from hypertrain.plan.sampling import StrongPhase, WeakPhase

# ------------------------------------------------------------------- ids: the definitions, one by one


def reference_update(offset: int, size: int, update: int, samples: int) -> list[int]:
    return [i for i in range(offset + update * size, offset + (update + 1) * size) if i < samples]


def reference_rank(
    update_list: list[int], rank: int, world: int, replicas: int, base: int | None
) -> list[int]:
    local_ranks = world // replicas
    replica, local = rank // local_ranks, rank - (rank // local_ranks) * local_ranks
    own = update_list[replica::replicas]
    if base is None:
        return own[local::local_ranks]
    base_streams = base // replicas
    return own[local % base_streams :: base_streams]


def small_runs():
    """Every small strong and weak phase shape, world, R and stream length (tails, past the end)."""
    for offset, size, updates in itertools.product((0, 3), range(1, 9), (1, 3)):
        for replicas, local_ranks in itertools.product((1, 2, 3), (1, 2, 4)):
            world = replicas * local_ranks
            yield StrongPhase("s", offset, size, updates), world, replicas, None
        for per_rank in (1, 3):
            for replicas, streams, k in itertools.product((1, 2), (1, 2, 3), (1, 2)):
                base = replicas * streams
                if size == 1:  # size plays no part for weak phases: B*b is the update size
                    yield WeakPhase("w", offset, base, per_rank, updates), base * k, replicas, base


def test_ids_equal_the_plain_python_definitions_on_a_dense_grid():
    cases = 0
    for phase, world, replicas, base in small_runs():
        size = phase.update_size
        for samples in range(0, phase.offset + (phase.updates + 1) * size + 2):
            for update in range(phase.updates + 1):
                expect = reference_update(phase.offset, size, update, samples)
                assert plan.update_ids(phase, update, samples).tolist() == expect
                for m in range(replicas):
                    assert (
                        plan.replica_ids(phase, update, m, replicas, samples).tolist() == expect[m::replicas]
                    )
                for r in range(world):
                    got = plan.rank_ids(phase, update, r, world, replicas, samples).tolist()
                    assert got == reference_rank(expect, r, world, replicas, base)
                    cases += 1
    assert cases > 20_000


# ------------------------------------------------------------------------------------------ microbatches


def reference_length_microbatches(
    lengths: list[int], max_padded_tokens: int, max_examples: int
) -> list[list[int]]:
    """The seed's rule on (index, length) pairs: Python's stable sort, then greedy."""
    batches, current = [], []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = lengths[index]
        if current and (n * (len(current) + 1) > max_padded_tokens or len(current) >= max_examples):
            batches.append(current)
            current = []
        current.append(index)
    return batches + [current] if current else batches


def test_length_microbatches_equal_the_seed_rule_on_a_dense_grid():
    rng = np.random.default_rng(5)
    for n, max_length, max_padded_tokens, max_examples in itertools.product(
        (0, 1, 2, 5, 17, 40), (1, 3, 9, 40), (40, 41, 100, 12000), (1, 2, 3, 16)
    ):
        for _ in range(3):
            lengths = rng.integers(0, max_length + 1, size=n).tolist()  # many equal lengths: stability
            got = [g.tolist() for g in plan.length_microbatches(lengths, max_padded_tokens, max_examples)]
            assert got == reference_length_microbatches(lengths, max_padded_tokens, max_examples)


def test_fixed_microbatches_are_in_order_chunks():
    for n_rows, micro_batch in itertools.product(range(0, 23), range(0, 9)):
        step = micro_batch or max(n_rows, 1)
        expect = [list(range(i, min(n_rows, i + step))) for i in range(0, n_rows, step)]
        assert [g.tolist() for g in plan.fixed_microbatches(n_rows, micro_batch)] == expect


# ------------------------------------------------------------------------------------- channel weights


@st.composite
def partitions(draw):
    """Token losses per channel, cut into world ranks x microbatches; cells may hold no tokens at all."""
    channels = draw(st.integers(1, 5))
    world, micro = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    cells = world * micro
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scales = rng.uniform(0.1, 3.0, channels)
    tokens, counts = [], np.zeros((cells, channels), dtype=np.int64)
    for c in range(channels):
        total = int(rng.integers(0, 40)) if draw(st.booleans()) else 0  # some channels absent
        cuts = np.sort(rng.integers(0, total + 1, cells - 1))
        counts[:, c] = np.diff(np.concatenate([[0], cuts, [total]]))
        tokens.append(rng.normal(size=total) * 3 + c)
    return tokens, counts, scales, world


def cell_tokens(tokens, counts, cell: int, c: int) -> np.ndarray:
    start = counts[:cell, c].sum()
    return tokens[c][start : start + counts[cell, c]]


def objective(tokens, scales) -> float:
    active = [c for c in range(len(tokens)) if tokens[c].size]
    if not active:
        return 0.0
    return sum(scales[c] * tokens[c].mean() for c in active) / sum(scales[c] for c in active)


@given(partitions())
@settings(max_examples=200, deadline=None)
def test_channel_coefficients_give_the_one_batch_objective_under_any_partition(case):
    tokens, counts, scales, world = case
    totals = counts.sum(axis=0)
    coefficient_total, weight_total = 0.0, 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 0/0 anywhere
        coefficients = plan.channel_coefficients(counts, totals, scales, world)  # every cell at once
        for cell in range(counts.shape[0]):
            weights, scale = plan.channel_weights(counts[cell], totals, scales, world)
            assert np.all(np.isfinite(coefficients[cell])) and np.all(np.isfinite(weights))
            means = {
                c: cell_tokens(tokens, counts, cell, c).mean() for c in range(len(tokens)) if counts[cell, c]
            }
            assert all(coefficients[cell][c] == 0 for c in range(len(tokens)) if c not in means)
            coefficient_total += sum(coefficients[cell][c] * mean for c, mean in means.items())
            if weights.sum() > 0:  # the seed's inherited loss: sum_c w_c mean_c / sum(w), times scale
                weight_total += sum(weights[c] * mean for c, mean in means.items()) / weights.sum() * scale
    # DDP averages the world's gradients; microbatches are summed.
    assert np.isclose(coefficient_total / world, objective(tokens, scales), rtol=1e-12, atol=1e-12)
    assert np.isclose(weight_total / world, objective(tokens, scales), rtol=1e-12, atol=1e-12)


def test_a_mean_of_microbatch_means_fails_the_same_check():
    rng = np.random.default_rng(3)
    text, audio = rng.normal(size=50), rng.normal(size=20) + 2.0
    counts = np.array([[5, 0], [15, 12], [30, 8]])  # unequal, and one microbatch without audio
    scales = np.array([1.0, 2.0])
    totals = counts.sum(axis=0)
    starts = np.vstack([[0, 0], np.cumsum(counts, axis=0)[:-1]])
    parts = [
        [channel[s : s + n] for channel, s, n in zip((text, audio), start, row, strict=True)]
        for start, row in zip(starts, counts, strict=True)
    ]
    exact = objective([text, audio], scales)
    weighted = sum(
        sum(
            c * p.mean()
            for c, p in zip(plan.channel_coefficients(row, totals, scales), cell, strict=True)
            if p.size
        )
        for row, cell in zip(counts, parts, strict=True)
    )
    naive = np.mean([objective(cell, scales) for cell in parts])
    assert np.isclose(weighted, exact, rtol=1e-12)
    assert not np.isclose(naive, exact, rtol=1e-3)


def test_zero_counts_never_give_nan():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.array_equal(plan.channel_coefficients([0, 0], [0, 0], [1.0, 2.0], 4), [0.0, 0.0])
        weights, scale = plan.channel_weights([0, 0], [0, 0], [1.0, 2.0], 4)
        assert np.array_equal(weights, [0.0, 0.0]) and scale == 0.0
        # audio absent from the whole batch: it leaves the normaliser (text alone has k = 1)
        assert np.allclose(plan.channel_coefficients([3, 0], [6, 0], [1.0, 2.0]), [0.5, 0.0])
        # audio absent from this microbatch only: weight 0 here, normaliser 1 + 2
        assert np.allclose(plan.channel_coefficients([3, 0], [6, 4], [1.0, 2.0]), [0.5 / 3, 0.0])
        weights, scale = plan.dynamic_weights(0, 2, 0, 10, 2)
        assert np.allclose(weights, [0.4] + [0.0] * 12) and np.isclose(scale, 0.4)
