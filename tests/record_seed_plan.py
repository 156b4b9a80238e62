"""Record the seed's outputs as a regression fixture: tests/assets/seed_plan_reference.json.

The seed is the user's reference implementation of the sample plan, ../shared/seeds/plan.py.txt (next
to the repository; its first line is a path header, not Python). A user's clone has no ../shared, and
the project carries none of the seed's code, so tests/test_plan.py compares our plan with what the
seed's own functions returned when this script ran them, stored here as data:

  benchmark_phases            the seed's phase dicts for worlds 8 and 16
  check_plan                  the seed's `check_plan()` JSON (its own functions; it must pass)
  check_plan_step_indices     a digest of `step_indices` for every phase, update and rank that the
                              seed's `check_plan()` visits (N = 16384, worlds 8 and 16)
  check_plan_dynamic_weights  `dynamic_weights` for the four rank cells `check_plan()` weighs
  phase_dict_step_indices     `step_indices` (ids per rank) of the seed's phase dicts at updates 0, 3,
                              last and last + 30, N = 16384
  step_indices_grid           digests of `step_indices` over a grid of strong and weak phase dicts,
                              worlds, updates, ranks and stream lengths (tails, past the end)
  microbatches                the seed's microbatch cuts (as example tags) of random example lengths
  dynamic_weights             `dynamic_weights` for the cases the tests name

A digest is the sha256 of, for each case in the listed order, the little-endian int64s
[world, samples, step, rank, n] followed by the n ids; tests/test_plan.py computes the same over ours.

    python tests/record_seed_plan.py            # (re)write the fixture; run from the repository root
    python tests/record_seed_plan.py --check    # regenerate in memory and compare with the file
    python tests/record_seed_plan.py --seed PATH

Exit status: 0 written / matches; 1 (--check) the file differs from the seed's outputs; 2 the seed file
is absent. numpy only (no torch). Not a test module: pytest collects test_*.py only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SEED = Path(__file__).resolve().parents[2] / "shared" / "seeds" / "plan.py.txt"
FIXTURE = REPO / "tests" / "assets" / "seed_plan_reference.json"

ABOUT = (
    "Regression fixture: outputs of the user's reference implementation of the sample plan (the seed, "
    "../shared/seeds/plan.py.txt), recorded by running the seed's own functions; it holds none of the "
    "seed's code. Read by tests/test_plan.py. Regenerate, from the repository root (needs "
    "../shared/seeds/plan.py.txt): python tests/record_seed_plan.py; verify: python "
    "tests/record_seed_plan.py --check"
)
DIGEST_RULE = (
    "sha256 over the cases in order: per case the little-endian int64s [world, samples, step, rank, n], "
    "then the n ids"
)

SAMPLES = 16384  # the seed's default stream length
# The cases of the tests: phase-dict steps, microbatch inputs, dynamic_weights arguments.
PHASE_DICT_STEPS = "0, 3, updates - 1, updates + 30"
MICROBATCH_SIZES = (0, 1, 7, 50, 200)
MICROBATCH_BOUNDS = ((12000, 16), (2000, 4), (900, 1))
DYNAMIC_WEIGHTS_CASES = ((13, 1, 263, 16, 4), (120, 7, 263, 16, 4), (1, 0, 1, 0, 1), (5, 5, 50, 5, 8))
# check_plan's loss-weighting cells: frames and samples per rank, 4 ranks
CHECK_FRAMES, CHECK_SAMPLE_COUNTS = (13, 49, 81, 120), (1, 3, 5, 7)
# The step_indices grid (R = 1): strong phase dicts, and weak ones (replicated_base_world) compared
# only where the update is whole (the seed's weak phase ignores N; ours cuts at N).
GRID = {
    "updates": 4,
    "steps": [0, 1, 2, 3],
    "offsets": [0, 3, 300],
    "strong_global_batches": [1, 2, 3, 7, 16, 70],
    "strong_worlds": [1, 2, 3, 4, 6, 8, 16],
    "strong_samples": "offset + [0, 1, G-1, G, G+G//2, 2G, 3G+5], and 0",
    "weak_base_worlds": [1, 2, 3, 8, 12],
    "weak_per_rank_batches": [1, 3, 9],
    "weak_world_multiples": [1, 2, 3],
    "weak_samples": "offset + [S, 2S+1, 4S, 4S+5], S = base_world * per_rank_batch; whole updates only",
}


def load_seed(path: Path) -> dict:
    """A fresh namespace of the seed module (its first line is a path header, not Python)."""
    lines = path.read_text().splitlines()
    if lines and lines[0].strip().endswith(".py") and not lines[0].lstrip().startswith(("#", '"')):
        lines = lines[1:]
    namespace: dict = {"__name__": "seed_plan"}
    exec(compile("\n".join(lines), str(path), "exec"), namespace)
    return namespace


def case_bytes(world: int, samples: int, step: int, rank: int, ids) -> bytes:
    head = np.array([world, samples, step, rank, len(ids)], dtype="<i8").tobytes()
    return head + np.asarray(ids, dtype="<i8").tobytes()


def strong_samples(offset: int, size: int) -> list[int]:
    return sorted(
        {0} | {offset + d for d in (0, 1, size - 1, size, size + size // 2, 2 * size, 3 * size + 5)}
    )


def weak_samples(offset: int, size: int) -> list[int]:
    return [offset + size, offset + 2 * size + 1, offset + 4 * size, offset + 4 * size + 5]


def strong_dict(offset: int, global_batch: int) -> dict:
    return {
        "name": "s",
        "offset": offset,
        "global_batch": global_batch,
        "updates": GRID["updates"],
        "warmup": 0,
    }


def weak_dict(offset: int, base: int, per_rank: int, world: int) -> dict:
    return {
        "name": "w",
        "offset": offset,
        "global_batch": per_rank * world,
        "updates": GRID["updates"],
        "warmup": 0,
        "replicated_base_world": base,
    }


def grid_groups():
    """(group description, [(phase dict, world, samples, step, rank), ...]) in the recorded order."""
    for offset in GRID["offsets"]:
        for g in GRID["strong_global_batches"]:
            cases = [
                (strong_dict(offset, g), world, samples, step, rank)
                for world in GRID["strong_worlds"]
                for samples in strong_samples(offset, g)
                for step in GRID["steps"]
                for rank in range(world)
            ]
            yield {"kind": "strong", "offset": offset, "global_batch": g}, cases
    for offset in GRID["offsets"]:
        for base in GRID["weak_base_worlds"]:
            for per_rank in GRID["weak_per_rank_batches"]:
                size, cases = base * per_rank, []
                for world in (base * k for k in GRID["weak_world_multiples"]):
                    for samples in weak_samples(offset, size):
                        for step in GRID["steps"]:
                            if offset + (step + 1) * size > samples:  # not whole: not compared
                                continue
                            cases += [
                                (weak_dict(offset, base, per_rank, world), world, samples, step, r)
                                for r in range(world)
                            ]
                yield (
                    {"kind": "weak", "offset": offset, "base_world": base, "per_rank_batch": per_rank},
                    cases,
                )


def microbatch_lengths() -> dict[str, list[int]]:
    rng = np.random.default_rng(9)
    return {str(n): [int(x) for x in rng.integers(1, 900, n)] for n in MICROBATCH_SIZES}


def weights_record(args, result) -> dict:
    weights, scale = result
    return {"args": list(args), "weights": [float(w) for w in weights], "scale": float(scale)}


def record(seed: dict, seed_path: Path) -> dict:
    step_indices = seed["step_indices"]
    out: dict = {"about": ABOUT, "seed_sha256": hashlib.sha256(seed_path.read_bytes()).hexdigest()}
    out["digest_rule"] = DIGEST_RULE
    out["samples"] = SAMPLES

    phases = {str(w): seed["benchmark_phases"](w) for w in (8, 16)}
    out["benchmark_phases"] = phases
    out["check_plan"] = seed["check_plan"]()
    if out["check_plan"].get("status") != "PASS":
        raise SystemExit(f"the seed's own check_plan() does not pass: {out['check_plan']}")

    visited = {}
    for world in (8, 16):
        for phase in phases[str(world)]:
            digest, count = hashlib.sha256(), 0
            for step in range(phase["updates"]):
                for rank in range(world):
                    ids = step_indices(phase, step, rank, world, SAMPLES)
                    digest.update(case_bytes(world, SAMPLES, step, rank, ids))
                    count += len(ids)
            visited[f"{world} {phase['name']}"] = {"ids": count, "sha256": digest.hexdigest()}
    out["check_plan_step_indices"] = {
        "cases": "world 8 and 16 x the seed's benchmark phases x steps range(updates) x ranks range(world)",
        "digests": visited,
    }
    total_frames, total_samples = sum(CHECK_FRAMES), sum(CHECK_SAMPLE_COUNTS)
    out["check_plan_dynamic_weights"] = [
        weights_record(args, seed["dynamic_weights"](*args))
        for args in (
            (f, s, total_frames, total_samples, 4)
            for f, s in zip(CHECK_FRAMES, CHECK_SAMPLE_COUNTS, strict=True)
        )
    ]

    entries = []
    for world in (8, 16):
        for phase in phases[str(world)]:
            for step in (0, 3, phase["updates"] - 1, phase["updates"] + 30):
                inside = phase["offset"] + (step + 1) * 256 <= SAMPLES
                if phase["name"] == "weak" and not inside:  # the seed's weak phase ignores N; not compared
                    continue
                ids = [step_indices(phase, step, rank, world, SAMPLES) for rank in range(world)]
                entries.append({"world": world, "phase": phase["name"], "step": step, "ids_by_rank": ids})
    out["phase_dict_step_indices"] = {"steps": PHASE_DICT_STEPS, "entries": entries}

    groups = []
    for description, cases in grid_groups():
        digest = hashlib.sha256()
        for phase, world, samples, step, rank in cases:
            digest.update(
                case_bytes(world, samples, step, rank, step_indices(phase, step, rank, world, samples))
            )
        groups.append({**description, "cases": len(cases), "sha256": digest.hexdigest()})
    out["step_indices_grid"] = {**GRID, "groups": groups}

    lengths = microbatch_lengths()
    cuts = {}
    for n, row_lengths in lengths.items():
        examples = [{"input_ids": [0] * length, "tag": i} for i, length in enumerate(row_lengths)]
        for bounds in MICROBATCH_BOUNDS:
            batches = seed["microbatches"](examples, *bounds)
            cuts[f"{n} {bounds[0]} {bounds[1]}"] = [[row["tag"] for row in batch] for batch in batches]
    out["microbatches"] = {
        "examples": "{'input_ids': [0] * length, 'tag': i} for lengths[n]; lengths: numpy default_rng(9), "
        "integers(1, 900, n) for n in order",
        "lengths": lengths,
        "cuts_key": "n max_padded_tokens max_examples; value: the tags of each microbatch, in order",
        "cuts": cuts,
    }
    out["dynamic_weights"] = [
        weights_record(args, seed["dynamic_weights"](*args)) for args in DYNAMIC_WEIGHTS_CASES
    ]
    return out


def render(value, indent: int = 0, width: int = 200) -> str:
    """JSON, diffable: a list of scalars, or a nested value of <= width characters, takes one line."""
    flat = json.dumps(value)
    if not isinstance(value, dict | list):
        return flat
    if isinstance(value, list) and not any(isinstance(v, dict | list) for v in value):
        return flat
    if indent and len(flat) <= width:
        return flat
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {render(v, indent + 1, width)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    return "[\n" + ",\n".join(f"{inner}{render(v, indent + 1, width)}" for v in value) + f"\n{pad}]"


def differences(old, new, path: str = "", depth: int = 3) -> list[str]:
    """Where `old` and `new` differ: paths such as check_plan.status or step_indices_grid.groups[5]."""
    if old == new:
        return []
    if depth and isinstance(old, dict) and isinstance(new, dict):
        keys = dict.fromkeys([*old, *new])
        return [d for k in keys for d in differences(old.get(k), new.get(k), f"{path}.{k}", depth - 1)]
    if depth and isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        pairs = enumerate(zip(old, new, strict=True))
        return [d for i, (a, b) in pairs for d in differences(a, b, f"{path}[{i}]", depth - 1)]
    return [path.lstrip(".") or "the whole file"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=Path, default=SEED, help=f"the seed file (default {SEED})")
    parser.add_argument("--check", action="store_true", help="compare with the fixture; write nothing")
    parser.add_argument("--out", type=Path, default=FIXTURE, help=f"the fixture (default {FIXTURE})")
    args = parser.parse_args(argv)
    if not args.seed.is_file():
        print(f"seed absent: {args.seed} (needs ../shared/seeds/plan.py.txt next to the repository)")
        return 2
    text = render(record(load_seed(args.seed), args.seed)) + "\n"
    if not args.check:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out} ({len(text):,} bytes) from {args.seed}")
        return 0
    if not args.out.is_file():
        print(f"DIFFERS: {args.out} is absent; run python tests/record_seed_plan.py")
        return 1
    current = args.out.read_text()
    if current == text:
        print(f"match: {args.out} holds the outputs of {args.seed}")
        return 0
    try:
        names = differences(json.loads(current), json.loads(text))
    except json.JSONDecodeError as error:
        names = [f"the file is not valid JSON ({error})"]
    what = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    what = what or "formatting only (same values)"
    print(f"DIFFERS: {args.out} against {args.seed}: {what}; regenerate: python tests/record_seed_plan.py")
    return 1


if __name__ == "__main__":
    sys.exit(main())
