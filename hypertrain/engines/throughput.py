"""What each process did and how long it took, per update, and the benchmark's figures from it.

`process_table(assigns, results)` is one process's record of a round, float64 [updates, 6]:
examples, supervised target tokens, padded target positions (rows x width: what the model
computed; times the channels for multistream), wall seconds of the update (forward, backward,
gradient all-reduce, step) and of its gradient all-reduce alone, and the positions read (frames
for multistream, tokens otherwise). The round loop gathers it from every process once per round
([P, updates, 6]); `Throughput` adds up the updates after the phase's `timing_warmup` and gives
the steady-state figures the seed's data-parallel benchmark reports: examples/s, supervised and
padded tokens/s per rank and in total, compute and all-reduce seconds per update, the all-reduce's
share, and the padding efficiency. Data loading happens before a round's first update and is
outside these timings. A weak phase presents its base streams W/B times; each presentation counts
as an example, as the seed says ("explicitly counted as presentations").
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypertrain.engines.contract import Assignment, ReplicaResult

COLUMNS = ("samples", "tokens", "padded", "seconds", "allreduce_seconds", "frames")


def process_table(assigns: list[Assignment], results: list[ReplicaResult]) -> Tensor:
    """[updates, 6] float64 for this process: its replicas' (or rank's) shares summed; the seconds
    of replicas stacked together counted once (they share one timing)."""
    steps = len(assigns[0].batches)
    table = torch.zeros(steps, len(COLUMNS), dtype=torch.float64)
    timings = {id(res.seconds): res for res in results if res.seconds}  # one per stacked group
    for t in range(steps):
        batches = [a.batches[t] for a in assigns]
        table[t, 0] = sum(b.samples for b in batches)
        table[t, 1] = sum(b.targets for b in batches)
        table[t, 2] = sum(b.padded for b in batches)
        table[t, 3] = sum(res.seconds[t] for res in timings.values())
        table[t, 4] = sum(res.allreduce_seconds[t] for res in timings.values())
        table[t, 5] = sum(b.frames for b in batches)
    return table


class Throughput:
    """Sums of every process's updates from update `warmup` (0-based) on: the timed window."""

    def __init__(self, processes: int, warmup: int):
        self.warmup = warmup
        self.sums = torch.zeros(processes, len(COLUMNS), dtype=torch.float64)
        self.updates = 0
        self.presentations = 0  # examples over every update and process, warm-up included

    def add(self, updates: range, table: Tensor) -> None:
        """`table` [P, len(updates), 6] for the plan's `updates`."""
        self.presentations += int(table[:, :, 0].sum())
        timed = [t for t, u in enumerate(updates) if u >= self.warmup]
        if timed:
            self.sums += table[:, timed].sum(1)
            self.updates += len(timed)

    def summary(self) -> dict:
        """bench/* figures; per-rank ones as lists in rank order. Empty before any timed update."""
        if not self.updates:
            return {"train/presentations": self.presentations}
        samples, tokens, padded, seconds, allreduce, frames = self.sums.T
        wall = float(seconds.max())  # ranks advance in lockstep: the slowest rank's time is the run's
        per_rank = lambda x: (x / seconds.clamp(min=1e-12)).tolist()  # noqa: E731
        return {
            "bench/timed_updates": self.updates,
            "bench/samples_per_s": float(samples.sum()) / wall,
            "bench/tokens_per_s": float(tokens.sum()) / wall,
            "bench/padded_tokens_per_s": float(padded.sum()) / wall,
            "bench/frames_per_s": float(frames.sum()) / wall,
            "bench/samples_per_s_per_rank": per_rank(samples),
            "bench/tokens_per_s_per_rank": per_rank(tokens),
            "bench/padded_tokens_per_s_per_rank": per_rank(padded),
            "bench/presentations": int(samples.sum()),  # in the timed window
            "bench/compute_s_per_update": float((seconds - allreduce).mean()) / self.updates,
            "bench/allreduce_s_per_update": float(allreduce.mean()) / self.updates,
            "bench/allreduce_share": float(allreduce.sum() / seconds.sum()),
            "bench/padding_efficiency": float(tokens.sum() / padded.sum()),
            "bench/timed_s": wall,
            "train/presentations": self.presentations,
        }
