"""One rank of the real-link clock check (tests/test_clock_link.py), run inside its own network namespace.

All `--world` ranks join one gloo group at `--init` (tcp://rank 0's bridge address:port) over their
namespace's rate-limited interface (GLOO_SOCKET_IFNAME, set by the test). The test sets the link's rate,
then writes one line to every rank's stdin: a phase starts. In each of `--phases` phases, for each world
size in `--worlds` (the first that many ranks; the others wait):
- one untimed one-element all-reduce, then `--latency-reps` timed (the latency microbenchmark);
- `--reps` fp32 all-reduces of `--numel` elements (the uncompressed outer sync);
- `--reps` all-gathers into one tensor of `--gather-bytes` uint8 per rank (a compressed `gather` sync);
each preceded by a barrier of that group. Every rank records when each collective started and returned
on CLOCK_MONOTONIC, which all processes on one host share (network namespaces do not separate clocks),
so the test can tell when the last rank started and the last rank returned. At the end of a phase every
rank prints one line, rank 0 the phase's JSON: `{"<world>": {"<collective>": {"start": [[rank 0's
reps], [rank 1's], ...], "end": [...]}}}`, the others `{}`.
"""

import argparse
import datetime
import json
import os
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads at import)
import torch.distributed as dist  # noqa: E402

# torch >= 2.12 renames all_gather_into_tensor (and warns at every call of the old name).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _timed(collective, reps: int, group) -> tuple[list[float], list[float]]:
    starts, ends = [], []
    for _ in range(reps):
        dist.barrier(group=group)
        starts.append(_now())
        collective()
        ends.append(_now())
    return starts, ends


def _everyone(seconds: list[float], world: int, group) -> list[list[float]]:
    """Every rank's `seconds` in rank order (a tiny all-gather, after the timed collectives)."""
    mine = torch.tensor(seconds, dtype=torch.float64)
    every = torch.empty(world * len(seconds), dtype=torch.float64)
    _all_gather(every, mine, group=group)
    return every.view(world, len(seconds)).tolist()


def _measure(args, world: int, group) -> dict:
    generator = torch.Generator().manual_seed(args.rank)
    tiny = torch.ones(1)
    fp32 = torch.randn(args.numel, generator=generator)
    payload = torch.randint(0, 256, (args.gather_bytes,), dtype=torch.uint8, generator=generator)
    gathered = torch.empty(world * args.gather_bytes, dtype=torch.uint8)

    dist.all_reduce(tiny, group=group)  # warm-up, untimed
    collectives = {
        "latency": (lambda: dist.all_reduce(tiny, group=group), args.latency_reps),
        "allreduce": (lambda: dist.all_reduce(fp32, group=group), args.reps),
        "allgather": (lambda: _all_gather(gathered, payload, group=group), args.reps),
    }
    report = {}
    for name, (collective, reps) in collectives.items():
        starts, ends = _timed(collective, reps, group)
        report[name] = {"start": _everyone(starts, world, group), "end": _everyone(ends, world, group)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--worlds", type=int, nargs="+", required=True, help="group sizes to measure")
    parser.add_argument("--init", required=True, help="tcp://ADDR:PORT of rank 0")
    parser.add_argument("--numel", type=int, required=True, help="fp32 elements of the all-reduce")
    parser.add_argument(
        "--gather-bytes", type=int, required=True, help="uint8 bytes per rank of the all-gather"
    )
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--latency-reps", type=int, default=20)
    parser.add_argument("--phases", type=int, default=1, help="one per rate the test sets")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=args.init,
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=120),
    )
    groups = {}
    for world in args.worlds:  # every rank creates every group, as torch requires
        groups[world] = dist.group.WORLD if world == args.world else dist.new_group(list(range(world)))
    for _ in range(args.phases):
        sys.stdin.readline()  # the test has set the phase's rate
        dist.barrier()
        report = {}
        for world, group in groups.items():
            if args.rank < world:
                report[str(world)] = _measure(args, world, group)
            dist.barrier()
        print(json.dumps(report if args.rank == 0 else {}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
