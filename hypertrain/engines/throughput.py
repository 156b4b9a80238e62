"""What each process did and how long it took, per update (`process_table`, columns `PROCESS_COLUMNS`),
and the benchmark's steady-state figures over the updates after the phase's `timing_warmup`
(`Throughput`). Data loading happens before a round's first update and is outside these timings.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypertrain.engines.columns import PROCESS_COLUMNS
from hypertrain.engines.contract import Assignment, ReplicaResult


def process_table(assigns: list[Assignment], results: list[ReplicaResult]) -> Tensor:
    """float64 [updates, len(PROCESS_COLUMNS)] for this process: its replicas' (or rank's) shares
    summed; the seconds of replicas stacked together counted once (they share one timing). The round
    loop gathers it from every process once per round ([P, updates, len(PROCESS_COLUMNS)])."""
    timings = list({id(res.seconds): res for res in results if res.seconds}.values())  # one per stacked group

    def row(t: int) -> list[float]:
        batches = [a.batches[t] for a in assigns]
        return PROCESS_COLUMNS.row(
            samples=sum(b.samples for b in batches),
            tokens=sum(b.targets for b in batches),
            padded=sum(b.padded for b in batches),
            seconds=sum(res.seconds[t] for res in timings),
            allreduce_seconds=sum(res.allreduce_seconds[t] for res in timings),
            frames=sum(b.frames for b in batches),
        )

    rows = [row(t) for t in range(len(assigns[0].batches))]
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, len(PROCESS_COLUMNS))  # [0, k] when empty


class Throughput:
    """A session's updates from update `warmup` (0-based) on: the timed window. `summary` gives the
    replica-steps per second of that window on the writer's clock (syncs and held-out evals included)
    and the figures the seed's data-parallel benchmark reports from every process's own seconds:
    examples/s, supervised and padded tokens/s per rank and in total, compute and all-reduce seconds
    per update, the all-reduce's share, and the padding efficiency."""

    def __init__(self, processes: int, warmup: int, start: float):
        """`start`: when the session's first segment started (time.perf_counter)."""
        self.warmup = warmup
        self.sums = torch.zeros(processes, len(PROCESS_COLUMNS), dtype=torch.float64)
        self.updates = 0  # this session's timed updates
        self.replica_steps = 0  # the replica-steps of those updates
        self.presentations = 0  # examples over every update and process, warm-up included
        self.timed_from = self.segment_start = start

    def add(self, updates: range, table: Tensor, steps: list[int]) -> None:
        """A segment's `table` [P, len(updates), len(PROCESS_COLUMNS)] for the plan's `updates`, and
        the replica-steps taken at each of them."""
        self.presentations += int(PROCESS_COLUMNS.of(table, "samples").sum())
        timed = [t for t, u in enumerate(updates) if u >= self.warmup]
        if timed:
            self.sums += table[:, timed].sum(1)
            self.updates += len(timed)
            self.replica_steps += sum(steps[t] for t in timed)
        if self.warmup in updates and self.warmup > 0:
            # The window opens where the first timed update started: its segment's start plus the
            # updates before it (the writer's own seconds; rows are only written at a segment's end).
            before = updates.index(self.warmup)
            self.timed_from = self.segment_start + float(
                PROCESS_COLUMNS.of(table, "seconds")[0, :before].sum()
            )

    def next_segment(self, start: float) -> None:
        self.segment_start = start

    def window(self, end: float) -> dict:
        """The writer's figures of the timed window ending at `end` (time.perf_counter)."""
        timed = end - self.timed_from
        return {
            "train/replica_steps_per_s": self.replica_steps / timed if timed else 0.0,
            "train/timed_updates": self.updates,  # the updates the throughput counts
            "train/timed_s": timed,
        }

    def summary(self) -> dict:
        """bench/* figures; per-rank ones as lists in rank order. Empty before any timed update, counts
        only (no rates) when no replica computed in the timed window."""
        if not self.updates:
            return {"train/presentations": self.presentations}
        samples, tokens, padded, seconds, allreduce, frames = (
            PROCESS_COLUMNS.of(self.sums, name)
            for name in ("samples", "tokens", "padded", "seconds", "allreduce_seconds", "frames")
        )
        wall = float(seconds.max())  # ranks advance in lockstep: the slowest rank's time is the run's
        if not wall:  # no replica computed in the window (churn: every one absent or late): no rates
            return {
                "bench/timed_updates": self.updates,
                "bench/presentations": 0,
                "bench/timed_s": 0.0,
                "train/presentations": self.presentations,
            }
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
