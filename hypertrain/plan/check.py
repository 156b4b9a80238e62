"""The plan's self-check (the seed's `check_plan`, for any worlds and replica counts) and its command line.

`check_plan` proves the plan's properties against the public id functions and returns the seed's JSON;
a broken property raises `PlanCheckFailed` naming it. `main` is `python -m hypertrain.plan check|show`:
exit 0 on success, 1 when a property fails, 2 with a one-line error for bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from hypertrain.plan.sampling import (
    PRESETS,
    Phase,
    PlanError,
    StrongPhase,
    WeakPhase,
    _integer,
    channel_coefficients,
    dynamic_weights,
    preset,
    rank_ids,
    replica_ids,
    union_sha256,
    update_ids,
    updates_run,
    validate_run,
)

EXHAUSTIVE_UPDATES = 1000  # up to this many run updates, every update is checked one by one
# ... and only while updates x ranks (over the worlds and replica counts checked) stays below this: each
# checked update looks at every rank, so a large world checks the distinct update shapes only.
EXHAUSTIVE_RANK_UPDATES = 200_000
SEED_WEAK_RULE = (
    "Exact same eight real per-GPU streams, replicated once across the additional eight GPUs at four "
    "nodes. Benchmark-only repetitions, explicitly counted as presentations."
)
SEED_LOSS_RULE = (
    "Exact global per-channel supervised-token mean, independent of rank and microbatch partition."
)


class PlanCheckFailed(AssertionError):
    """A plan property does not hold; `.property` names it."""

    def __init__(self, property_name: str, detail: str):
        super().__init__(f"{property_name}: {detail}")
        self.property = property_name


def _require(holds: bool, property_name: str, detail: str) -> None:
    if not holds:
        raise PlanCheckFailed(property_name, detail)


def _check_update(phase: Phase, update: int, world: int, replicas: int, samples: int) -> np.ndarray:
    """Every property of one update at one (world, R), from the public functions; returns U."""
    ids = update_ids(phase, update, samples)
    where = f"phase {phase.name}, update {update}, world {world}, replicas {replicas}"
    ranks = [rank_ids(phase, update, r, world, replicas, samples) for r in range(world)]
    local_ranks = world // replicas
    copies = world // phase.base_world if isinstance(phase, WeakPhase) else 1
    presented = np.sort(np.concatenate(ranks))
    _require(np.array_equal(presented, np.repeat(ids, copies)), "no_drop_no_duplicate", where)
    for m in range(replicas):
        own = replica_ids(phase, update, m, replicas, samples)
        _require(np.array_equal(own, ids[m::replicas]), "replica_ids_every_Rth", f"{where}, replica {m}")
        seen = np.sort(np.concatenate(ranks[m * local_ranks : (m + 1) * local_ranks]))
        # Strong: the replica's ranks cover V_m once; weak: k times. V_m never depends on the world.
        rule = "weak_replication_exact" if copies > 1 else "replica_ids_independent_of_world"
        _require(np.array_equal(seen, np.repeat(own, copies)), rule, f"{where}, replica {m}")
    if isinstance(phase, WeakPhase):
        base_streams = phase.base_world // replicas
        for r in range(world):
            m, j = divmod(r, local_ranks)
            base_rank = m * base_streams + j % base_streams
            same = rank_ids(phase, update, base_rank, phase.base_world, replicas, samples)
            _require(np.array_equal(ranks[r], same), "weak_rank_streams_replicated", f"{where}, rank {r}")
    return ids


def verify_phase(
    phase: Phase,
    worlds: Sequence[int],
    replicas: Sequence[int] = (1,),
    samples: int = 16384,
    exhaustive: bool | None = None,
) -> dict:
    """Prove the phase's plan at every world and replica count; returns its union's size and hash.

    Exhaustive (default up to EXHAUSTIVE_UPDATES run updates, and EXHAUSTIVE_RANK_UPDATES updates x
    ranks): every update, rank and replica. Otherwise every distinct update shape (first, second,
    middle, last full and tail update): rank_ids is one layout per update size shifted by the update's
    start, so equal shapes give equal verdicts.
    """
    for world in worlds:
        for r in replicas:
            validate_run(phase, world, r, samples)
    count = updates_run(phase, samples)
    size = phase.update_size
    end = min(samples, phase.offset + phase.updates * size)
    if exhaustive is None:
        rank_updates = count * sum(worlds) * len(replicas)
        exhaustive = count <= EXHAUSTIVE_UPDATES and rank_updates <= EXHAUSTIVE_RANK_UPDATES
    inspect = (
        range(count) if exhaustive else sorted({0, 1, count // 2, count - 2, count - 1} & set(range(count)))
    )
    union = []
    for update in inspect:
        expected_start = phase.offset + update * size
        for world in worlds:
            for r in replicas:
                ids = _check_update(phase, update, world, r, samples)
        tiles = ids.size > 0 and ids[0] == expected_start and ids[-1] == min(end, expected_start + size) - 1
        _require(bool(tiles) and ids.size == ids[-1] - ids[0] + 1, "updates_tile_stream", f"update {update}")
        if exhaustive:
            union.append(ids)
    last = update_ids(phase, count - 1, samples)
    _require(last[-1] == end - 1, "tail_kept", f"phase {phase.name}: last id {last[-1]}, stream end {end}")
    if count < phase.updates:
        past = update_ids(phase, count, samples)
        _require(past.size == 0, "past_end_updates_empty", f"phase {phase.name}, update {count}")
    digest = union_sha256(phase, samples)
    if exhaustive:
        ids = np.concatenate(union)
        _require(np.array_equal(ids, np.arange(phase.offset, end)), "union_is_phase_range", phase.name)
        _require(
            hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest() == digest, "union_sha256", phase.name
        )
    return {"updates_run": count, "unique_ids": end - phase.offset, "union_sha256": digest}


def _check_loss_weighting() -> None:
    """The seed's check of the channel weights, then the same with microbatches without audio frames."""
    rng = np.random.default_rng(71)
    channels = rng.normal(size=(263, 13))
    frame_groups, sample_groups = [13, 49, 81, 120], [1, 3, 5, 7]
    actual, start = np.zeros(13), 0
    for frames, sample_count in zip(frame_groups, sample_groups, strict=True):
        weights, scale = dynamic_weights(frames, sample_count, sum(frame_groups), sum(sample_groups), 4)
        actual[1:] += (
            channels[start : start + frames, 1:].mean(axis=0) * weights[1] / sum(weights) * scale / 4
        )
        start += frames
    seed_rule = np.allclose(actual[1:], channels.mean(axis=0)[1:] * (32 / 12) / 33)
    _require(seed_rule, "loss_weighting_exact", "the seed's four-rank partition")

    # Two channels (text k 1, audio k 2), 3 microbatches; the middle one has no audio tokens.
    text, audio = rng.normal(size=30), rng.normal(size=12)
    text_cuts, audio_cuts = [0, 10, 18, 30], [0, 5, 5, 12]
    total = 0.0
    for b in range(3):
        local = [text_cuts[b + 1] - text_cuts[b], audio_cuts[b + 1] - audio_cuts[b]]
        c = channel_coefficients(local, [30, 12], [1.0, 2.0])
        parts = [text[text_cuts[b] : text_cuts[b + 1]], audio[audio_cuts[b] : audio_cuts[b + 1]]]
        total += sum(c_i * part.mean() for c_i, part in zip(c, parts, strict=True) if part.size)
    exact = np.isclose(total, (text.mean() + 2 * audio.mean()) / 3)
    _require(bool(exact), "loss_weighting_exact", "a microbatch without audio frames")


def _positive_list(name: str, values) -> list[int]:
    values = sorted({_integer(name, v, 1) for v in values})
    if not values:
        raise PlanError(f"{name}=[] is empty; valid: one or more integers >= 1")
    return values


def check_plan(samples: int = 16384, worlds: Sequence[int] = (8, 16), replicas: Sequence[int] = (1,)) -> dict:
    """The seed's `check_plan` for any worlds and replica counts; the seed's JSON at its defaults.

    The strong phase is the seed's; the weak phase's base world is the smallest world.
    """
    worlds, replica_counts = _positive_list("worlds", worlds), _positive_list("replicas", replicas)
    samples = _integer("samples", samples, 1)
    base = worlds[0]
    strong = PRESETS["strong"]
    weak = replace(PRESETS["weak"], base_world=base)
    strong_plan = verify_phase(strong, worlds, replica_counts, samples)
    verify_phase(weak, worlds, replica_counts, samples)
    _check_loss_weighting()
    if base == 8 and worlds == [8, 16]:
        weak_rule = SEED_WEAK_RULE
    else:
        weak_rule = (
            f"Exact same {base} real per-GPU streams, presented W/{base} times at world W in {worlds}. "
            "Benchmark-only repetitions, explicitly counted as presentations."
        )
    result = {
        "status": "PASS",
        "strong_unique_samples": strong_plan["unique_ids"],
        "strong_union_sha256": strong_plan["union_sha256"],
        "worlds": worlds,
        "global_batch_strong": strong.global_batch,
        "per_gpu_weak": weak.per_rank_batch,
        "strong_warmup_updates": strong.timing_warmup,
        "strong_steady_updates": strong.updates - strong.timing_warmup,
        "weak_warmup_updates": weak.timing_warmup,
        "weak_steady_updates": weak.updates - weak.timing_warmup,
        "weak_input_rule": weak_rule,
        "loss_weighting": SEED_LOSS_RULE,
    }
    if replica_counts != [1]:
        result["replicas"] = replica_counts
    return result


def _describe(phase: Phase) -> str:
    if isinstance(phase, StrongPhase):
        return f"strong, global_batch {phase.global_batch}"
    return f"weak, base_world {phase.base_world} x per_rank_batch {phase.per_rank_batch}"


def _format_ids(ids: np.ndarray, every: bool) -> str:
    if every or ids.size <= 12:
        shown = " ".join(map(str, ids.tolist()))
    else:
        shown = " ".join(map(str, ids[:6].tolist())) + " ... " + " ".join(map(str, ids[-3:].tolist()))
    return f"{ids.size:>6} ids" + (f": {shown}" if ids.size else "")


def show(phase: Phase, world: int, replicas: int, update: int, samples: int, every: bool = False) -> str:
    """A person's view of one update: the ids of every replica and of its ranks."""
    validate_run(phase, world, replicas, samples)
    if _integer("update", update, 0) >= phase.updates:
        raise PlanError(
            f"update={update} is out of range; valid: 0..{phase.updates - 1} (phase {phase.name})"
        )
    ids = update_ids(phase, update, samples)
    local_ranks = world // replicas
    lines = [
        f"phase {phase.name} ({_describe(phase)}, offset {phase.offset}, updates {phase.updates}, "
        f"timing_warmup {phase.timing_warmup}); samples {samples}; world {world}, replicas {replicas}",
        f"update {update}: " + (f"ids [{ids[0]}, {ids[-1] + 1})" if ids.size else "no ids (past the end)"),
    ]
    for m in range(replicas):
        own = replica_ids(phase, update, m, replicas, samples)
        ranks = f"ranks {m * local_ranks}..{(m + 1) * local_ranks - 1}"
        lines.append(f"replica {m} ({ranks}) {_format_ids(own, every)}")
        for r in range(m * local_ranks, (m + 1) * local_ranks):
            lines.append(
                f"  rank {r:>3} {_format_ids(rank_ids(phase, update, r, world, replicas, samples), every)}"
            )
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2: the project's rule for user mistakes
        self.exit(2, f"error: {self.prog}: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="python -m hypertrain.plan", description="Check or show the sample plan.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="prove the plan's properties; print the seed's JSON")
    check.add_argument("--samples", type=int, default=16384, help="stream length N")
    check.add_argument("--worlds", type=int, nargs="+", default=[8, 16], help="the smallest is the weak base")
    check.add_argument("--replicas", type=int, nargs="+", default=[1], help="replica counts R")
    view = commands.add_parser("show", help="print one update's ids per replica and rank")
    view.add_argument("--phase", default="strong", help=f"a preset: {', '.join(PRESETS)}")
    view.add_argument("--world", type=int, default=8)
    view.add_argument("--replicas", type=int, default=1)
    view.add_argument("--update", type=int, default=0)
    view.add_argument("--samples", type=int, default=16384, help="stream length N")
    view.add_argument("--all", action="store_true", help="print every id")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            print(json.dumps(check_plan(args.samples, args.worlds, args.replicas), indent=2))
        else:
            print(show(preset(args.phase), args.world, args.replicas, args.update, args.samples, args.all))
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PlanCheckFailed as e:
        print(f"FAIL: property {e}", file=sys.stderr)
        return 1
    return 0
