"""The arrival schedule of asynchronous replicas (docs/async.md): a pure function of the config and the
tokens each replica's inner steps train on. `schedule(...)` gives the server's updates in clock order,
each with the jobs (replica, its first inner step, steps, tokens, staleness) it applies together.
No torch: plain arithmetic on floats, the clock's formulas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hypertrain.clock.formulas import modelled_compute_s
from hypertrain.clock.timeline import FP32_BYTES, replica_speeds, straggler_factors
from hypertrain.config import ClusterConfig, OuterConfig, TrainConfig
from hypertrain.model.shapes import active_params, count_params


def job_steps(outer: OuterConfig, H: int, speeds: list[float]) -> list[int]:
    """Each replica's inner steps per job: H, or with outer.dylu Liu et al.'s Eq. 6,
    `H_m = max(1, floor(v_m / max_j v_j * H))`."""
    if not outer.dylu:
        return [H] * len(speeds)
    fastest = max(speeds)
    return [max(1, math.floor(v / fastest * H)) for v in speeds]


@dataclass(frozen=True)
class Job:
    """Replica `replica`'s inner steps `first` .. `first + steps - 1` (its own count: step k trains the
    plan's ids of update k for it) from the weights of server update `pulled`, arriving at `arrive_s`."""

    replica: int
    index: int  # the replica's 1-based job number (its stragglers' round)
    first: int
    steps: int
    tokens: int  # the targets its steps trained on
    pulled: int  # the server updates applied when it pulled its weights
    start_s: float
    arrive_s: float


@dataclass(frozen=True)
class ServerUpdate:
    """The server's `index`-th update (1-based), at `clock_s`: the jobs applied together (in replica order)
    and each one's staleness (server updates applied since it pulled)."""

    index: int
    clock_s: float
    jobs: tuple[Job, ...]

    @property
    def staleness(self) -> list[int]:
        return [self.index - 1 - job.pulled for job in self.jobs]


@dataclass(frozen=True)
class Timing:
    """What the clock charges (docs/async.md): a step of `targets` tokens on replica m in its job j takes
    `modelled_compute_s(N_active, targets) / v_m * f_j[m]` (f: the cluster's stragglers, drawn per job
    index as per round); a pseudo-gradient's upload and a pull's download are one fp32 message of the
    N timed parameters over the inter link, `alpha + 4 N / beta`."""

    cluster: ClusterConfig
    speeds: tuple[float, ...]
    active_params: float  # the parameters a token uses, at the timed size
    params: float  # the timed size (cluster.model_params, or the trained model's)

    @classmethod
    def of(cls, cfg: TrainConfig) -> Timing:
        """The config's: its speeds, and its model at the size the clock times (cluster.model_params)."""
        run = count_params(cfg.model)
        params = cfg.cluster.model_params or run
        speeds = tuple(replica_speeds(cfg.cluster, cfg.replicas))
        return cls(cfg.cluster, speeds, params * active_params(cfg.model) / run, params)

    def step_s(self, targets: int, replica: int, job: int) -> float:
        c = self.cluster
        factor = float(straggler_factors(c.straggler, job, len(self.speeds))[replica])
        return (
            modelled_compute_s(self.active_params, targets, c.peak_flops, c.mfu)
            / self.speeds[replica]
            * factor
        )

    @property
    def message_s(self) -> float:
        link = self.cluster.inter
        return link.latency + FP32_BYTES * self.params / link.bandwidth


def schedule(
    outer: OuterConfig, H: int, updates: int, timing: Timing, targets: Callable[[int, int], int]
) -> list[ServerUpdate]:
    """The server's updates of a phase of `updates` inner steps per replica, in clock order.

    Every replica starts its first job at 0 from the initial weights. A job of `min(H_m, left)` steps
    arrives when its compute and upload end; the server takes the earliest arrival (ties by replica
    index) and every arrival within `outer.grace_s` of it as one update at the latest of their times;
    those replicas pull its weights (a download) and start their next jobs. `targets(k, m)` is the
    tokens of replica m's step k."""
    R = len(timing.speeds)
    steps = job_steps(outer, H, list(timing.speeds))
    done, count = [0] * R, [0] * R

    def start(m: int, pulled: int, at: float) -> Job | None:
        if done[m] >= updates:
            return None
        count[m] += 1
        n = min(steps[m], updates - done[m])
        tokens = [targets(k, m) for k in range(done[m], done[m] + n)]
        compute = 0.0
        for t in tokens:  # in step order: one float sum, the same on every call
            compute += timing.step_s(t, m, count[m])
        job = Job(m, count[m], done[m], n, sum(tokens), pulled, at, at + compute + timing.message_s)
        done[m] += n
        return job

    flying = {m: start(m, 0, 0.0) for m in range(R)}
    out: list[ServerUpdate] = []
    while any(job is not None for job in flying.values()):
        waiting = sorted((job.arrive_s, m) for m, job in flying.items() if job is not None)
        first = waiting[0][0]
        group = sorted(m for arrive, m in waiting if arrive <= first + outer.grace_s)
        at = max(flying[m].arrive_s for m in group)
        update = ServerUpdate(len(out) + 1, at, tuple(flying[m] for m in group))
        out.append(update)
        for m in group:
            flying[m] = start(m, update.index, at + timing.message_s)
    return out
