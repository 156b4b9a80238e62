"""The sample plan: the seed's recorded outputs against ours; properties, hashes, errors, CLI."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypertrain import plan
from hypertrain.plan import check as plan_check
from hypertrain.plan.sampling import PlanError, StrongPhase, WeakPhase

REPO = Path(__file__).resolve().parents[1]
# What the seed (the user's reference implementation, ../shared/seeds/plan.py.txt, absent from a user's
# clone) returned when its own functions ran: recorded by tests/record_seed_plan.py, which says how.
REFERENCE = json.loads((REPO / "tests" / "assets" / "seed_plan_reference.json").read_text())
SEED_JSON = REFERENCE["check_plan"]  # the seed's `check_plan()` output
SAMPLES = REFERENCE["samples"]  # 16384, the seed's default stream length


# Our channel weights against the reference's recorded ones, in float64 (unit roundoff u = 2^-53,
# about 1.1e-16). A weight is at most 4 roundings (two products, a quotient, the 32/12 constant) and
# the scale a 13-term sum and a quotient, at most 15; two implementations that order these
# differently differ by at most 2 * 15 u, about 3.3e-15, so 1e-14 holds on any IEEE machine.
WEIGHTS_RTOL = 1e-14


def seed_phase_dicts(world: int) -> list[dict]:
    """The seed's `benchmark_phases(world)` dicts, as it returned them."""
    return REFERENCE["benchmark_phases"][str(world)]


def case_bytes(world: int, samples: int, step: int, rank: int, ids) -> bytes:
    """One case of the fixture's digests (its digest_rule): int64s world, samples, step, rank, n, ids."""
    head = np.array([world, samples, step, rank, len(ids)], dtype="<i8").tobytes()
    return head + np.asarray(ids, dtype="<i8").tobytes()


def seed_weights(args) -> tuple[list[float], float]:
    """The seed's `dynamic_weights(*args)`, recorded."""
    records = REFERENCE["dynamic_weights"] + REFERENCE["check_plan_dynamic_weights"]
    (record,) = {json.dumps(r): r for r in records if r["args"] == list(args)}.values()
    return record["weights"], record["scale"]


# ---------------------------------------------------------------------------------------- the seed


def test_the_seed_reference_is_a_labelled_fixture_of_a_passing_seed():
    assert REFERENCE["about"].startswith("Regression fixture: outputs of the user's reference implementation")
    assert "python tests/record_seed_plan.py" in REFERENCE["about"]
    assert SEED_JSON["status"] == "PASS" and SAMPLES == 16384


def test_check_plan_reproduces_the_seed_json():
    assert plan.check_plan() == SEED_JSON
    assert plan.check_plan(16384, (16, 8), (1,)) == SEED_JSON


def test_our_functions_give_the_seed_outputs_its_check_plan_uses():
    """The seed's `check_plan()` with our functions in place of its own, without the seed's code.

    Its check calls only `step_indices` (the two benchmark phase dicts at worlds 8 and 16, every update
    and rank, N = 16384) and `dynamic_weights` (four rank cells), and passed on the seed's own outputs
    (the fixture's check_plan is its JSON, status PASS). Ours return the same outputs for every one of
    those calls, so its check run on ours sees the same values, passes, and returns the same JSON; our
    own `check_plan` returns that JSON too.
    """
    visited = REFERENCE["check_plan_step_indices"]["digests"]
    assert sorted(visited) == ["16 strong", "16 weak", "8 strong", "8 weak"]
    for world in (8, 16):
        for phase in seed_phase_dicts(world):
            digest, count = hashlib.sha256(), 0
            for step in range(phase["updates"]):
                for rank in range(world):
                    ids = plan.step_indices(phase, step, rank, world, SAMPLES)
                    digest.update(case_bytes(world, SAMPLES, step, rank, ids))
                    count += len(ids)
            expect = visited[f"{world} {phase['name']}"]
            assert {"ids": count, "sha256": digest.hexdigest()} == expect, (world, phase["name"])
    assert len(REFERENCE["check_plan_dynamic_weights"]) == 4
    for record in REFERENCE["check_plan_dynamic_weights"]:
        weights, scale = plan.dynamic_weights(*record["args"])
        assert np.allclose(weights, record["weights"], rtol=WEIGHTS_RTOL, atol=0), record["args"]
        assert np.isclose(scale, record["scale"], rtol=WEIGHTS_RTOL, atol=0), record["args"]
    assert plan.check_plan() == SEED_JSON


def test_benchmark_phases_are_the_seed_numbers():
    for world in (8, 16):
        strong, weak = plan.benchmark_phases(world)
        assert strong == StrongPhase("strong", offset=0, global_batch=256, updates=40, timing_warmup=10)
        assert weak == WeakPhase(
            "weak", offset=10240, base_world=8, per_rank_batch=32, updates=12, timing_warmup=4
        )
        assert (strong.update_size, weak.update_size) == (256, 256)
        seed_strong, seed_weak = seed_phase_dicts(world)
        assert seed_strong == {
            "name": "strong",
            "offset": 0,
            "global_batch": 256,
            "updates": 40,
            "warmup": 10,
        }
        assert seed_weak == {
            "name": "weak",
            "offset": 10240,
            "global_batch": world * weak.per_rank_batch,
            "updates": 12,
            "warmup": 4,
            "replicated_base_world": weak.base_world,
        }


def test_seed_phase_dicts_give_the_seed_step_indices():
    entries = {
        (e["world"], e["phase"], e["step"]): e["ids_by_rank"]
        for e in REFERENCE["phase_dict_step_indices"]["entries"]
    }
    compared = 0
    for world in (8, 16):
        for phase in seed_phase_dicts(world):
            for step in (0, 3, phase["updates"] - 1, phase["updates"] + 30):
                inside = phase["offset"] + (step + 1) * 256 <= 16384
                if phase["name"] == "weak" and not inside:  # the seed's weak phase ignores N; we cut
                    assert plan.step_indices(phase, step, 0, world, 16384) == []
                    continue
                expect = entries[(world, phase["name"], step)]
                assert len(expect) == world
                for rank in range(world):
                    assert plan.step_indices(phase, step, rank, world, 16384) == expect[rank]
                compared += 1
    assert compared == len(entries)


def test_one_replica_rank_ids_are_the_seed_step_indices_on_a_grid():
    """R = 1: our rank ids, and our step_indices of the seed's phase dicts, against the seed's.

    Strong and weak phase dicts (offsets, batch sizes, base worlds, worlds, updates, every rank) at
    stream lengths that cut an update, end on a boundary, or lie before the phase; weak updates only
    where whole (the seed's weak phase ignores N; ours cuts at N).
    """
    grid = REFERENCE["step_indices_grid"]
    updates, steps = grid["updates"], grid["steps"]

    def strong_cases(offset, g):
        samples = sorted({0} | {offset + d for d in (0, 1, g - 1, g, g + g // 2, 2 * g, 3 * g + 5)})
        phase = StrongPhase("s", offset, g, updates)
        as_dict = {"name": "s", "offset": offset, "global_batch": g, "updates": updates, "warmup": 0}
        for world in grid["strong_worlds"]:
            for n in samples:
                for step in steps:
                    yield phase, as_dict, world, n, step

    def weak_cases(offset, base, per_rank):
        size = base * per_rank
        phase = WeakPhase("w", offset, base, per_rank, updates)
        for world in (base * k for k in grid["weak_world_multiples"]):
            as_dict = {"name": "w", "offset": offset, "global_batch": per_rank * world, "updates": updates}
            as_dict |= {"warmup": 0, "replicated_base_world": base}
            for n in (offset + size, offset + 2 * size + 1, offset + 4 * size, offset + 4 * size + 5):
                for step in steps:
                    if offset + (step + 1) * size <= n:
                        yield phase, as_dict, world, n, step

    expected_groups = [
        {"kind": "strong", "offset": o, "global_batch": g}
        for o in grid["offsets"]
        for g in grid["strong_global_batches"]
    ] + [
        {"kind": "weak", "offset": o, "base_world": b, "per_rank_batch": p}
        for o in grid["offsets"]
        for b in grid["weak_base_worlds"]
        for p in grid["weak_per_rank_batches"]
    ]
    groups = grid["groups"]
    assert [{k: v for k, v in g.items() if k not in ("cases", "sha256")} for g in groups] == expected_groups
    wrong, total = [], 0
    for group in groups:
        if group["kind"] == "strong":
            cases = strong_cases(group["offset"], group["global_batch"])
        else:
            cases = weak_cases(group["offset"], group["base_world"], group["per_rank_batch"])
        digests = [hashlib.sha256() for _ in range(2)]
        count = 0
        for phase, as_dict, world, n, step in cases:
            for r in range(world):
                ours = plan.rank_ids(phase, step, r, world, 1, n).tolist()
                seed_api = plan.step_indices(as_dict, step, r, world, n)
                for digest, ids in zip(digests, (ours, seed_api), strict=True):
                    digest.update(case_bytes(world, n, step, r, ids))
                count += 1
        total += count
        if count != group["cases"] or any(d.hexdigest() != group["sha256"] for d in digests):
            wrong.append(group)
    assert not wrong, f"{len(wrong)} groups differ from the seed's step_indices, first: {wrong[0]}"
    assert total > 30_000


@pytest.mark.parametrize("n", [0, 1, 7, 50, 200])
@pytest.mark.parametrize("bounds", [(12000, 16), (2000, 4), (900, 1)])
def test_microbatches_on_examples_equal_the_seed_cuts(n, bounds):
    lengths = REFERENCE["microbatches"]["lengths"][str(n)]
    assert len(lengths) == n
    examples = [{"input_ids": [0] * length, "tag": i} for i, length in enumerate(lengths)]
    cuts = REFERENCE["microbatches"]["cuts"][f"{n} {bounds[0]} {bounds[1]}"]
    assert plan.microbatches(examples, *bounds) == [[examples[tag] for tag in batch] for batch in cuts]


@pytest.mark.parametrize(
    "case", [(13, 1, 263, 16, 4), (120, 7, 263, 16, 4), (1, 0, 1, 0, 1), (5, 5, 50, 5, 8)]
)
def test_dynamic_weights_equal_the_seed(case):
    expect_weights, expect_scale = seed_weights(case)
    weights, scale = plan.dynamic_weights(*case)
    assert np.allclose(weights, expect_weights, rtol=WEIGHTS_RTOL, atol=0)
    assert np.isclose(scale, expect_scale, rtol=WEIGHTS_RTOL, atol=0)


def test_cpu_presets_pass_the_check_at_worlds_2_and_4():
    for world in (2, 4):
        for phase in plan.cpu_phases(world):
            plan.validate_run(phase, world, 1, 16384)
            plan.validate_run(phase, world, 2, 16384)
    plan.validate_run(plan.preset("smoke"), 1, 1, 1000)
    result = plan.check_plan(16384, (2, 4), (1, 2))
    assert result["status"] == "PASS" and result["replicas"] == [1, 2]


@pytest.mark.parametrize(
    ("samples", "worlds", "replicas"),
    [
        (10300, (3, 6), (1, 3)),
        (12000, (4, 8, 12), (1, 2, 4)),
        (16384, (1, 5), (1,)),
        (10**6, (8, 16), (2, 8)),
    ],
)
def test_check_plan_passes_for_other_worlds_replicas_and_tails(samples, worlds, replicas):
    result = plan.check_plan(samples, worlds, replicas)
    assert result["status"] == "PASS" and result["worlds"] == sorted(worlds)
    assert result["strong_unique_samples"] == min(samples, 10240)
    assert result["strong_union_sha256"] == plan.union_sha256(plan.PRESETS["strong"], samples)


# ----------------------------------------------------------------------------------------- properties


@st.composite
def runs(draw):
    """A random phase, world and R, with N giving whole updates, a tail, or a phase past the end."""
    replicas = draw(st.integers(1, 4))
    offset = draw(st.integers(0, 300))
    updates = draw(st.integers(1, 10))
    if draw(st.booleans()):
        world = replicas * draw(st.integers(1, 4))
        phase = StrongPhase("s", offset=offset, global_batch=draw(st.integers(1, 70)), updates=updates)
    else:
        base = replicas * draw(st.integers(1, 3))
        world = base * draw(st.integers(1, 3))
        phase = WeakPhase(
            "w", offset, base_world=base, per_rank_batch=draw(st.integers(1, 9)), updates=updates
        )
    samples = draw(st.integers(0, offset + (updates + 1) * phase.update_size + 5))
    return phase, world, replicas, samples


def copies(phase, world):
    return world // phase.base_world if isinstance(phase, WeakPhase) else 1


@given(runs())
@settings(max_examples=150, deadline=None)
def test_every_update_is_presented_once_per_base_stream(run):
    phase, world, replicas, samples = run
    for update in range(phase.updates + 2):
        ids = plan.update_ids(phase, update, samples)
        start = phase.offset + update * phase.update_size
        assert np.array_equal(ids, np.arange(start, max(start, min(samples, start + phase.update_size))))
        presented = np.concatenate(
            [plan.rank_ids(phase, update, r, world, replicas, samples) for r in range(world)]
        )
        assert np.array_equal(np.sort(presented), np.repeat(ids, copies(phase, world)))


@given(runs(), st.integers(1, 3))
@settings(max_examples=150, deadline=None)
def test_replica_ids_are_its_ranks_and_do_not_depend_on_the_world(run, other_local_ranks):
    phase, world, replicas, samples = run
    other_world = world * other_local_ranks  # keeps R | W and, for weak, B | W
    for update in range(phase.updates + 1):
        ids = plan.update_ids(phase, update, samples)
        for w in (world, other_world):
            local_ranks = w // replicas
            for m in range(replicas):
                own = plan.replica_ids(phase, update, m, replicas, samples)
                assert np.array_equal(own, ids[m::replicas])
                block = range(m * local_ranks, (m + 1) * local_ranks)
                seen = np.concatenate([plan.rank_ids(phase, update, r, w, replicas, samples) for r in block])
                # weak k-fold replication per replica: the replica's world-B ids, W/B times each
                assert np.array_equal(np.sort(seen), np.repeat(own, copies(phase, w)))


@given(runs())
@settings(max_examples=100, deadline=None)
def test_weak_rank_streams_repeat_the_base_world(run):
    phase, world, replicas, samples = run
    if not isinstance(phase, WeakPhase):
        return
    local_ranks, base_streams = world // replicas, phase.base_world // replicas
    for update in range(phase.updates):
        for r in range(world):
            m, j = divmod(r, local_ranks)
            base_rank = m * base_streams + j % base_streams
            here = plan.rank_ids(phase, update, r, world, replicas, samples)
            there = plan.rank_ids(phase, update, base_rank, phase.base_world, replicas, samples)
            assert np.array_equal(here, there)


@given(runs())
@settings(max_examples=100, deadline=None)
def test_one_replica_rank_ids_are_our_step_indices(run):
    phase, world, _, samples = run
    if isinstance(phase, WeakPhase):
        as_dict = {"name": "w", "offset": phase.offset, "global_batch": phase.per_rank_batch * world}
        as_dict |= {"updates": phase.updates, "warmup": 0, "replicated_base_world": phase.base_world}
    else:
        as_dict = {"name": "s", "offset": phase.offset, "global_batch": phase.global_batch}
        as_dict |= {"updates": phase.updates, "warmup": 0}
    for update in range(phase.updates + 1):
        for r in range(world):
            ours = plan.rank_ids(phase, update, r, world, 1, samples).tolist()
            assert plan.step_indices(phase, update, r, world, samples) == ours
            assert plan.step_indices(as_dict, update, r, world, samples) == ours


@given(runs())
@settings(max_examples=100, deadline=None)
def test_updates_run_counts_the_leading_updates_with_ids(run):
    phase, _, _, samples = run
    count = plan.updates_run(phase, samples)
    sizes = [plan.update_ids(phase, u, samples).size for u in range(phase.updates)]
    assert all(sizes[:count]) and not any(sizes[count:])


def test_id_functions_return_no_ids_past_the_end_of_the_stream():
    phase = StrongPhase("far", offset=10**15, global_batch=256, updates=3)
    assert plan.update_ids(phase, 0, 1000).size == 0
    assert plan.rank_ids(phase, 2, 7, 8, 2, 1000).size == 0
    assert plan.step_indices(plan.PRESETS["strong"], 10**12, 3, 8, 16384) == []
    assert plan.updates_run(phase, 1000) == 0


def test_ids_of_one_update_of_a_billion_id_stream():
    phase = StrongPhase("huge", offset=0, global_batch=256, updates=10**9 // 256)
    ids = plan.rank_ids(phase, phase.updates - 1, 5, 16, 2, 10**9)
    assert ids.dtype == np.int64 and ids.size == 16
    # rank 5 = replica 0, local rank 5: V_0[5::8] = U[0 + 2*5::16]
    assert ids[0] == 10**9 - 256 + 10 and np.all(np.diff(ids) == 16)


# --------------------------------------------------------------------------------------------- hashes


def reference_digest(groups_per_update) -> str:
    digest = hashlib.sha256()
    for groups in groups_per_update:
        for ids in groups:
            digest.update(
                np.array([len(ids)], dtype="<i8").tobytes() + np.asarray(ids, dtype="<i8").tobytes()
            )
    return digest.hexdigest()


@given(runs())
@settings(max_examples=100, deadline=None)
def test_digests_follow_their_byte_definition(run):
    phase, world, replicas, samples = run
    run_updates = range(plan.updates_run(phase, samples))
    by_replica = [
        [plan.replica_ids(phase, u, m, replicas, samples) for m in range(replicas)] for u in run_updates
    ]
    by_rank = [
        [plan.rank_ids(phase, u, r, world, replicas, samples) for r in range(world)] for u in run_updates
    ]
    assert plan.data_order_digest(phase, replicas, samples) == reference_digest(by_replica)
    assert plan.rank_digest(phase, world, replicas, samples) == reference_digest(by_rank)
    union = np.unique(np.concatenate([np.zeros(0, np.int64)] + [ids for groups in by_rank for ids in groups]))
    assert plan.union_sha256(phase, samples) == hashlib.sha256(union.astype("<i8").tobytes()).hexdigest()


def test_digest_bytes_are_the_documented_example():
    # docs/plan.md: offset 0, G 4, one update, R 2, N 3 -> int64s 2, 0, 2, 1, 1
    phase = StrongPhase("x", offset=0, global_batch=4, updates=1)
    expect = hashlib.sha256(np.array([2, 0, 2, 1, 1], dtype="<i8").tobytes()).hexdigest()
    assert plan.data_order_digest(phase, 2, 3) == expect


def test_data_order_digest_is_shared_by_worlds_and_the_rank_digest_is_not():
    strong = plan.PRESETS["strong"]
    assert plan.union_sha256(strong, 16384, world=8) == SEED_JSON["strong_union_sha256"]
    assert plan.union_sha256(strong, 16384, world=16) == SEED_JSON["strong_union_sha256"]
    assert plan.rank_digest(strong, 8, 2, 16384) != plan.rank_digest(strong, 16, 2, 16384)
    assert plan.data_order_digest(strong, 2, 16384) != plan.data_order_digest(strong, 4, 16384)
    shifted = StrongPhase("strong", offset=1, global_batch=256, updates=40)
    assert plan.data_order_digest(strong, 2, 16384) != plan.data_order_digest(shifted, 2, 16384)


def test_hashes_hold_no_python_object_per_id():
    samples = 4_000_000  # 32 MB as one int64 array
    phase = StrongPhase("stream", offset=0, global_batch=256, updates=-(-samples // 256))
    tracemalloc.start()
    plan.union_sha256(phase, samples)
    plan.data_order_digest(phase, 2, samples)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 24 * 2**20


# --------------------------------------------------------------------------------------------- errors

BAD_INPUTS = [
    (lambda: StrongPhase("s", offset=0, global_batch=0, updates=4), "global_batch=0"),
    (lambda: StrongPhase("s", offset=-1, global_batch=8, updates=4), "offset=-1"),
    (lambda: StrongPhase("s", offset=0, global_batch=8, updates=1.5), "updates=1.5"),
    (lambda: StrongPhase("s", offset=0, global_batch=8, updates=4, timing_warmup=5), "timing_warmup=5"),
    (lambda: WeakPhase("w", offset=0, base_world=0, per_rank_batch=8, updates=4), "base_world=0"),
    (lambda: StrongPhase("", offset=0, global_batch=8, updates=4), "name=''"),
    (lambda: plan.validate_run(plan.PRESETS["strong"], 0, 1, 16384), "world=0"),
    (lambda: plan.validate_run(plan.PRESETS["strong"], 8, 3, 16384), "replicas=3"),
    (lambda: plan.validate_run(plan.PRESETS["weak"], 16, 16, 16384), "replicas=16"),
    (lambda: plan.validate_run(plan.PRESETS["weak"], 12, 1, 16384), "world=12"),
    (lambda: plan.validate_run(plan.PRESETS["weak"], 8, 1, 10240), "offset=10240"),
    (lambda: plan.validate_run(plan.PRESETS["weak"], 8, 1, 0), "samples=0"),
    (lambda: plan.rank_ids(plan.PRESETS["strong"], 0, 8, 8, 1, 16384), "rank=8"),
    (lambda: plan.replica_ids(plan.PRESETS["strong"], 0, 2, 2, 16384), "replica=2"),
    (lambda: plan.update_ids(plan.PRESETS["strong"], -1, 16384), "update=-1"),
    (lambda: plan.benchmark_phases(4), "world=4"),
    (lambda: plan.preset("huge"), "phase='huge'"),
    (lambda: plan.fixed_microbatches(10, -1), "micro_batch=-1"),
    (lambda: plan.length_microbatches([5, 300, 7], 100, 16), "max_padded_tokens=100"),
    (lambda: plan.length_microbatches([5, 7], 100, 0), "max_examples=0"),
    (lambda: plan.channel_coefficients([3, 1], [2, 1], [1.0, 1.0]), "[3.0, 1.0]"),
    (lambda: plan.channel_coefficients([1, 1], [2, 1], [1.0, 0.0]), "scales=[1.0, 0.0]"),
    (lambda: plan.check_plan(16384, (8, 12)), "world=12"),
]


@pytest.mark.parametrize(("call", "value"), BAD_INPUTS, ids=[value for _, value in BAD_INPUTS])
def test_bad_input_is_a_one_line_plan_error_naming_the_value(call, value):
    with pytest.raises(PlanError, match=re.escape(value)) as error:
        call()
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)


def test_a_broken_property_is_named(monkeypatch):
    honest = plan_check.rank_ids
    monkeypatch.setattr(plan_check, "rank_ids", lambda *args: honest(*args)[1:])
    with pytest.raises(plan_check.PlanCheckFailed) as failure:
        plan.check_plan()
    assert failure.value.property == "no_drop_no_duplicate"


# ------------------------------------------------------------------------------------------------ CLI


def cli(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "hypertrain.plan", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_cli_check_prints_the_seed_json():
    done = cli("check")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == SEED_JSON


def test_cli_show_prints_every_replica_and_rank():
    done = cli("show", "--phase", "strong", "--world", "8", "--replicas", "2", "--update", "0")
    assert done.returncode == 0, done.stderr
    assert "replica 1 (ranks 4..7)" in done.stdout and "rank   7" in done.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("check", "--samples", "5000"),
        ("check", "--worlds", "0"),
        ("show", "--world", "8", "--replicas", "3"),
        ("show", "--phase", "weak", "--world", "12"),
        ("show", "--update", "40"),
        ("show", "--world", "x"),
        ("frobnicate",),
        (),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args):
    done = cli(*args)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_cli_failed_property_exits_1_naming_it():
    code = (
        "import sys; from hypertrain.plan import check as c; honest = c.rank_ids; "
        "c.rank_ids = lambda *a: honest(*a)[1:]; sys.exit(c.main(['check']))"
    )
    done = cli(code=code)
    assert done.returncode == 1 and "no_drop_no_duplicate" in done.stderr
