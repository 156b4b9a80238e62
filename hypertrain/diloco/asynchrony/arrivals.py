"""The arrival schedule of asynchronous replicas (docs/async.md): a pure function of the config and the
tokens each replica's inner steps train on. `schedule(...)` gives the server's updates in clock order,
each with the jobs (replica, its first inner step, steps, tokens, staleness) it applies together, and
with churn (docs/async.md, "Churn with async") the jobs that did not arrive since the previous update.
No torch: plain arithmetic on floats, the clock's formulas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from hypertrain.clock.formulas import modelled_compute_s
from hypertrain.clock.timeline import FP32_BYTES, replica_speeds, straggler_factors
from hypertrain.config import ClusterConfig, OuterConfig, TrainConfig
from hypertrain.model.shapes import active_params, count_params


def job_steps(outer: OuterConfig, H: int, speeds: list[float]) -> list[int]:
    """Each replica's inner steps per job: H, or with outer.arrivals.dylu Liu et al.'s Eq. 6,
    `H_m = max(1, floor(v_m / max_j v_j * H))`."""
    if not outer.arrivals.dylu:
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
    arrive_s: float  # absent or dropped: when it returns (and pulls) instead
    absent: bool = False  # churn: it trains nothing and pushes nothing
    dropped: bool = False  # churn's miss: it trains, and its push is dropped at its arrival

    @property
    def arrives(self) -> bool:
        return not (self.absent or self.dropped)

    @property
    def updates(self) -> range:
        """The updates whose plan ids it trains: its replica's steps `first .. first + steps - 1`."""
        return range(self.first, self.first + self.steps)


@dataclass(frozen=True)
class ServerUpdate:
    """The server's `index`-th update (1-based), at `clock_s`: the jobs applied together (in replica order)
    and each one's staleness (server updates applied since it pulled). With churn, `away`: the jobs that
    did not arrive (absent, or dropped) and returned since the previous update, in the order they
    returned; the phase's last update also holds those returning after it."""

    index: int
    clock_s: float
    jobs: tuple[Job, ...]
    away: tuple[Job, ...] = ()

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


class Statuses(Protocol):
    """Churn's statuses (`diloco.churn.Schedule`), read here by job number: `absent(j, m)` and
    `contributes(j, m)` (present) for replica m's j-th job; neither is a miss."""

    def absent(self, k: int, m: int) -> bool: ...

    def contributes(self, k: int, m: int) -> bool: ...


def jobs_per_replica(outer: OuterConfig, H: int, updates: int, speeds: list[float]) -> int:
    """The most jobs any replica takes in a phase of `updates` inner steps: ceil(updates / min H_m)."""
    return -(-updates // min(job_steps(outer, H, speeds)))


def schedule(
    outer: OuterConfig,
    H: int,
    updates: int,
    timing: Timing,
    targets: Callable[[int, int], int],
    churn: Statuses | None = None,
) -> list[ServerUpdate]:
    """The server's updates of a phase of `updates` inner steps per replica, in clock order.

    Every replica starts its first job at 0 from the initial weights. A job of `min(H_m, left)` steps
    arrives when its compute and upload end; the server takes the earliest arrival (ties by replica
    index) and every arrival within `outer.arrivals.grace_s` of it as one update at the latest of their times;
    those replicas pull its weights (a download) and start their next jobs. `targets(k, m)` is the
    tokens of replica m's step k.

    With `churn`, replica m's j-th job is absent when `churn.absent(j, m)` and dropped (a miss) when it
    is neither absent nor `churn.contributes(j, m)`. Such a job does not arrive: it takes the steps and
    the seconds it would have (compute and upload), and at that time it returns: it pulls the weights
    of the updates applied by then, an update at the same time included (a download), and starts its
    next job. Returns are taken in clock order (ties by replica index) before any update at a later
    time, so a job started by one may still join that update's grace window. Every job takes at least
    one step, so the walk ends."""
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
        absent = churn is not None and churn.absent(count[m], m)
        dropped = churn is not None and not absent and not churn.contributes(count[m], m)
        arrive = at + compute + timing.message_s
        job = Job(m, count[m], done[m], n, sum(tokens), pulled, at, arrive, absent, dropped)
        done[m] += n
        return job

    flying = {m: start(m, 0, 0.0) for m in range(R)}
    out: list[ServerUpdate] = []
    away: list[Job] = []  # returned since the last update
    while any(job is not None for job in flying.values()):
        waiting = sorted((job.arrive_s, m) for m, job in flying.items() if job is not None and job.arrives)
        at = math.inf
        if waiting:
            first = waiting[0][0]
            group = sorted(m for arrive, m in waiting if arrive <= first + outer.arrivals.grace_s)
            at = max(flying[m].arrive_s for m in group)
        back = sorted((job.arrive_s, m) for m, job in flying.items() if job is not None and not job.arrives)
        if back and back[0][0] < at:  # a return before the update: it pulls the weights before it
            returned, m = back[0]
            away.append(flying[m])
            flying[m] = start(m, len(out), returned + timing.message_s)
            continue
        update = ServerUpdate(len(out) + 1, at, tuple(flying[m] for m in group), tuple(away))
        out.append(update)
        away = []
        for m in group:
            flying[m] = start(m, update.index, at + timing.message_s)
    if away and out:  # returns after the last update: its row lists them
        out[-1] = replace(out[-1], away=out[-1].away + tuple(away))
    return out
