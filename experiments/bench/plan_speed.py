"""Speed of the sample plan against the user's seed, side by side; exits 1 if a target is missed.

(a) the seed's check_plan against ours at its defaults (figures only);
(b) a strong phase covering a whole stream of N = 10^7 ids (G 256, worlds 8 and 16): the seed's
    functions driven over every update and rank with its checks (no drop, no duplicate, unions equal
    across worlds, sha256 of the union) against `verify_phase`; target >= 10x, and no Python object
    per id (peak traced memory < 64 MiB); the ordered data-order digest timed on its own;
(c) the ids of one update of a 10^9-id stream: target < 1 ms.
Each measurement runs in a fresh process, so peak RSS is its own.

The seed is ../shared/seeds/plan.py.txt next to the repository (--seed PATH, or the environment
variable PLAN_SPEED_SEED, names another). Without it (a user's clone has no ../shared) the targets
against the seed, (b)'s speedup and its equal union hashes, are not measured: they are reported as
"not measured", never as met.

Exit status: 0 every target measured and met; 1 a target missed; 3 none missed, but a target could
not be measured (the seed file is absent); 2 bad arguments.

    .venv/bin/python experiments/bench/plan_speed.py [--samples 10000000] [--seed PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SEED = Path(os.environ.get("PLAN_SPEED_SEED") or REPO.parent / "shared" / "seeds" / "plan.py.txt")
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # hypertrain; the seed's loader

import record_seed_plan  # noqa: E402

from hypertrain import plan  # noqa: E402
from hypertrain.plan.check import verify_phase  # noqa: E402

SPEEDUP_TARGET = 10.0
MEMORY_TARGET_MIB = 64.0
ONE_UPDATE_TARGET_S = 1e-3
EXIT_MISSED, EXIT_NOT_MEASURED = 1, 3


def load_seed(path: Path = SEED) -> dict | None:
    """The seed's functions, exec'd from `path` by the fixture recorder's loader; None if absent."""
    return record_seed_plan.load_seed(path) if path.is_file() else None


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def seed_at_scale(samples: int, global_batch: int, seed_path: Path) -> str:
    """The seed's check, driven by its own step_indices over every update and rank of the stream."""
    step_indices = load_seed(seed_path)["step_indices"]
    updates = -(-samples // global_batch)
    phase = {"name": "strong", "offset": 0, "global_batch": global_batch, "updates": updates, "warmup": 0}
    unions = {}
    for world in (8, 16):
        seen = []
        for step in range(updates):
            ids = sorted(i for rank in range(world) for i in step_indices(phase, step, rank, world, samples))
            start = step * global_batch
            assert ids == list(range(start, min(samples, start + global_batch)))
            seen.extend(ids)
        assert len(seen) == len(set(seen))
        unions[world] = seen
    assert unions[8] == unions[16]
    return hashlib.sha256(np.asarray(unions[8], dtype="<i8").tobytes()).hexdigest()


def whole_stream_phase(samples: int, global_batch: int) -> plan.StrongPhase:
    return plan.StrongPhase(
        "stream", offset=0, global_batch=global_batch, updates=-(-samples // global_batch)
    )


def ours_at_scale(samples: int, global_batch: int) -> str:
    return verify_phase(whole_stream_phase(samples, global_batch), (8, 16), (1,), samples)["union_sha256"]


def job(name: str, samples: int, global_batch: int, queue, seed_path: Path = SEED) -> None:
    """One measurement in a fresh process: (seconds, peak RSS MiB, traced peak MiB, result)."""
    if name == "seed_scale":
        start = time.perf_counter()
        result = seed_at_scale(samples, global_batch, seed_path)
        seconds = time.perf_counter() - start
        queue.put((seconds, peak_rss_mib(), float("nan"), result))
        return
    phase = whole_stream_phase(samples, global_batch)
    work = {
        "ours_scale": lambda: ours_at_scale(samples, global_batch),
        "ours_digest": lambda: plan.data_order_digest(phase, 1, samples),
    }[name]
    result = work()  # warm-up, then the best of three
    seconds = best_of(3, work)
    tracemalloc.start()
    work()
    traced = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    queue.put((seconds, peak_rss_mib(), traced, result))


def in_fresh_process(name: str, samples: int, global_batch: int, seed_path: Path = SEED):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=job, args=(name, samples, global_batch, queue, seed_path))
    process.start()
    message = queue.get()
    process.join()
    return message


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000, help="stream length for part (b)")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument(
        "--seed", type=Path, default=SEED, help=f"the seed file (default $PLAN_SPEED_SEED or {SEED})"
    )
    args = parser.parse_args()
    seed = load_seed(args.seed)
    missed, not_measured = [], []
    print(f"numpy {np.__version__}, python {sys.version.split()[0]}")

    print("\n(a) check_plan at the seed's defaults (N = 16384, worlds 8 and 16)")
    ours = best_of(5, plan.check_plan)
    if seed is None:
        print(f"  seed: not measured, {args.seed} is absent; ours {ours * 1e3:.1f} ms")
    else:
        assert seed["check_plan"]() == plan.check_plan()
        theirs = best_of(5, seed["check_plan"])
        print(f"  seed {theirs * 1e3:.1f} ms, ours {ours * 1e3:.1f} ms, ratio {theirs / ours:.2f}x")

    n, g = args.samples, args.global_batch
    print(
        f"\n(b) strong phase over the whole stream: N = {n:,}, G = {g}, {-(-n // g):,} updates, worlds 8, 16"
    )
    ours_s, ours_rss, ours_traced, ours_hash = in_fresh_process("ours_scale", n, g)
    print(f"  ours: {ours_s * 1e3:.1f} ms, peak RSS {ours_rss:.0f} MiB, traced peak {ours_traced:.1f} MiB")
    if ours_traced > MEMORY_TARGET_MIB:
        missed.append(f"(b) traced memory {ours_traced:.1f} MiB > {MEMORY_TARGET_MIB} MiB")
    if seed is None:
        print(f"  seed: not measured, {args.seed} is absent")
        print(f"  ratio: not measured (target >= {SPEEDUP_TARGET:.0f}x); union sha256 equal: not measured")
        not_measured.append(f"(b) speedup >= {SPEEDUP_TARGET:.0f}x and equal union hashes")
    else:
        seed_s, seed_rss, _, seed_hash = in_fresh_process("seed_scale", n, g, args.seed)
        ratio = seed_s / ours_s
        print(f"  seed: {seed_s * 1e3:.0f} ms, peak RSS {seed_rss:.0f} MiB")
        same = seed_hash == ours_hash
        print(f"  ratio {ratio:.1f}x (target >= {SPEEDUP_TARGET:.0f}x, aim 20x); union sha256 equal: {same}")
        if seed_hash != ours_hash:
            missed.append("(b) the union hashes differ")
        if ratio < SPEEDUP_TARGET:
            missed.append(f"(b) speedup {ratio:.1f}x < {SPEEDUP_TARGET:.0f}x")
    digest_s, digest_rss, digest_traced, _ = in_fresh_process("ours_digest", n, g)
    print(
        f"  data-order digest (R = 1, every update in order): {digest_s * 1e3:.1f} ms, "
        f"peak RSS {digest_rss:.0f} MiB, traced peak {digest_traced:.1f} MiB"
    )
    if digest_traced > MEMORY_TARGET_MIB:
        missed.append(f"(b) digest traced memory {digest_traced:.1f} MiB > {MEMORY_TARGET_MIB} MiB")

    print("\n(c) one update of a 10^9-id stream (G 256, world 16, R 2): U, both V_m, all 16 rank ids")
    huge, phase = 10**9, plan.StrongPhase("huge", offset=0, global_batch=256, updates=10**9 // 256)
    update = phase.updates - 1

    def one_update():
        plan.update_ids(phase, update, huge)
        for m in range(2):
            plan.replica_ids(phase, update, m, 2, huge)
        for r in range(16):
            plan.rank_ids(phase, update, r, 16, 2, huge)

    seconds = best_of(200, one_update)
    print(f"  {seconds * 1e6:.1f} us (target < {ONE_UPDATE_TARGET_S * 1e3:.0f} ms)")
    if seconds >= ONE_UPDATE_TARGET_S:
        missed.append(f"(c) {seconds * 1e3:.2f} ms >= 1 ms")

    print()
    if missed:
        print("MISSED: " + "; ".join(missed))
    if not_measured:
        print(f"NOT MEASURED: {'; '.join(not_measured)} (the seed file {args.seed} is absent)")
    if not missed and not not_measured:
        print("all targets met")
    elif not missed:
        print("the targets measured are met; not all targets were measured")
    return EXIT_MISSED if missed else EXIT_NOT_MEASURED if not_measured else 0


if __name__ == "__main__":
    raise SystemExit(main())
