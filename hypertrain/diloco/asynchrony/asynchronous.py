"""The asynchronous run loop (outer.schedule=async, docs/async.md): `server_updates(run, state)` walks the
arrival schedule (`diloco.asynchrony.arrivals`), applies each server update (`diloco.asynchrony.server`) and
runs the next job
of every replica that pulled, on the engine, from the weights it pulled; it yields an `Applied` per update,
`state` advanced past it (its `asynchronous` part: `server.AsyncState`, what a checkpoint saves).

On real processes (`processes=dist`, docs/async.md "Real processes") every process walks the same schedule
and holds the server's state; it runs the jobs of its own replicas only, and each arrival reaches every
process from its replica's (`Collectives.share_arrival`, a broadcast), so every process applies the same
server update to the same bits as the simulation.

With a codec (outer.compress, docs/async.md "Codecs") an arriving job's pseudo-gradient is encoded by its
replica's process as a round encodes a replica's contribution (`diloco.exchange.wire.Wire`: its error-feedback
buffer added first; the tiles, the codec and the transform, or lowrank's one power iteration from the
server's Q), the broadcast carries the payload's bytes, and every process decodes them: the same bits
everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hypertrain.codec_table import codec_entry
from hypertrain.data.batches import targets_of
from hypertrain.diloco.asynchrony.arrivals import Job, ServerUpdate, Timing, jobs_per_replica, schedule
from hypertrain.diloco.churn import Schedule, count_arrivals, reset_inner_state
from hypertrain.diloco.exchange.wire import Wire, payload_bits
from hypertrain.diloco.outer import pseudo_gradients, weights_norm
from hypertrain.diloco.state import PreparedRun, RunState
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.engines import engine_for
from hypertrain.engines.contract import Assignment, Engine
from hypertrain.failures import fault_points
from hypertrain.model.transformer import Params


@dataclass
class Applied:
    """One server update (`arrivals.ServerUpdate`) as applied: each job's losses, in its order."""

    update: ServerUpdate
    losses: list[list[float | None]]
    last: bool  # the phase's last server update
    bits: list[int]  # each job's payload bits (`payload_bits`)
    delta_norm: float  # the norm of the pseudo-gradient applied (the jobs' mean, `server.contribution`)
    theta_norm: float  # the global weights' norm before it was applied


def compressor(run: PreparedRun, state: RunState) -> Wire | None:
    """The run's `Wire` for this process's replicas (their buffers the run state's `errors`, lowrank's
    warm start the run state's `lowrank_q`, the server's); None with outer.compress=none."""
    if codec_entry(run.cfg.outer.compress).lossless:
        return None
    return Wire(run.cfg.outer, state.theta, state.errors, state.replicas, state.lowrank_q)


def statuses(run: PreparedRun) -> Schedule | None:
    """Churn's statuses keyed by job number (docs/async.md, "Churn with async"): replica m's j-th job
    has round j's status of `churn.Schedule`, over the most jobs a replica takes; None without churn."""
    cfg = run.cfg
    if not cfg.churn.enabled:
        return None
    jobs = jobs_per_replica(cfg.outer, cfg.inner.H, run.updates, list(Timing.of(cfg).speeds))
    return Schedule.of(cfg.churn, cfg.replicas, jobs)


def arrival_schedule(run: PreparedRun, churn: Schedule | None = None) -> list[ServerUpdate]:
    """The run's server updates (`arrivals.schedule`, with `churn`'s statuses): a replica's step k
    trains the plan's ids of update k for it, and its tokens are their targets."""
    cfg = run.cfg

    def targets(k: int, m: int) -> int:
        return targets_of(run.dataset, run.replica_ids(k, m))

    return schedule(cfg.outer, cfg.inner.H, run.updates, Timing.of(cfg), targets, churn)


def run_jobs(
    run: PreparedRun,
    state: RunState,
    jobs: list[Job],
    engine: Engine,
    groups: Collectives | None = None,
    churn: Schedule | None = None,
) -> None:
    """Run `jobs` (replicas that pulled the global weights `state.theta` now) on the engine, the jobs of
    the same first step and length in one call (the stacked engine stacks them: its replicas share the
    lr schedule's steps), and keep each one's pseudo-gradient. Under the benchmark layout of L > 1
    processes per replica (`groups`) this process trains its share of each step, its replica's ranks
    averaging their gradients (as in rounds): every rank of a replica holds the same job.

    With churn (docs/async.md, "Churn with async"): an absent job trains nothing (its replica's job
    before it, a dropped one, leaves `flying`); a job rejoining after an absent one (`churn`'s
    `rejoining`, by job number) starts from a zero inner state with churn.rejoin_state=reset. One
    replica's jobs pulled at one update (after absent ones) run in job order."""
    cfg = run.cfg
    share = groups.rank_share() if groups is not None else None
    share = share if share is not None and share[2] > 1 else None  # L = 1: the replica's whole batch
    average = groups.average_in_replica if share is not None else None
    local = {m: i for i, m in enumerate(state.replicas)}  # a replica's index in `state.inner`
    reset = churn is not None and cfg.churn.rejoin_state == "reset"
    for span in sorted({(job.first, job.steps) for job in jobs}):
        todo = [job for job in jobs if (job.first, job.steps) == span]
        for job in todo:
            if job.absent:
                state.asynchronous.flying.pop(job.replica, None)
            elif reset and churn.rejoining(job.index, job.replica):
                reset_inner_state(state.inner[local[job.replica]])
        todo = [job for job in todo if not job.absent]
        if not todo:
            continue
        assigns = [
            Assignment(job.replica, job.first, [run.batch(k, job.replica, share) for k in job.updates])
            for job in todo
        ]
        states = [state.inner[local[job.replica]] for job in todo]
        results = engine(cfg, state.theta, assigns, states, average)
        for job, res in zip(todo, results, strict=True):
            state.inner[local[job.replica]] = res.state
            state.asynchronous.flying[job.replica] = {
                "delta": pseudo_gradients(state.theta, res.params)[0],
                "losses": list(res.losses),
            }


def arrived(
    job: Job,
    flying: dict[int, dict],
    groups: Collectives,
    theta: dict[str, torch.Tensor],
    wire: Wire | None = None,
) -> dict:
    """The arriving `job`'s pseudo-gradient and losses, taken from `flying` by the process that trained it
    and shared with every process (`Collectives.share_arrival`, a broadcast; one process: as it is): its
    fp32 pseudo-gradient, or with a codec (`wire`) its payload's bytes, which every process decodes. A
    non-finite x is not encoded: a flag after the losses says so, and every process applies NaN (the
    held-out guard stops the run; a codec's bytes would hide it), the buffer and Q unchanged."""
    mine = flying.pop(job.replica, None)
    device = next(iter(theta.values())).device
    if mine is None:
        sent = torch.empty(_sent_numel(wire, theta), dtype=torch.float32 if wire is None else torch.uint8)
        losses = torch.empty(job.steps + 1, dtype=torch.float64)
    else:
        flag = 0.0
        if wire is None:
            sent = mine["delta"]
        else:
            x = wire.fed_back(job.replica, mine["delta"])
            flag = 0.0 if bool(torch.isfinite(x).all()) else 1.0
            sent = wire.encode(x) if flag == 0.0 else torch.zeros(wire.nbytes, dtype=torch.uint8)
        losses = torch.tensor(
            [math.nan if v is None else v for v in mine["losses"]] + [flag], dtype=torch.float64
        )
    sent, losses = groups.share_arrival(job.replica, sent.to(device), losses.to(device))
    *steps, flag = losses.tolist()
    if wire is None:
        delta = sent
    elif flag:
        delta = torch.full((wire.numel,), math.nan, dtype=torch.float32, device=device)
    else:
        delta = wire.decode(sent)
        if mine is not None:
            wire.keep_error(job.replica, x, delta)
    return {"delta": delta, "losses": [None if math.isnan(v) else v for v in steps]}


def _sent_numel(wire: Wire | None, theta: Params) -> int:
    """What an arrival's broadcast holds: the payload's bytes, or the fp32 pseudo-gradient's elements."""
    return sum(t.numel() for t in theta.values()) if wire is None else wire.nbytes


def server_updates(
    run: PreparedRun, state: RunState, engine: Engine | None = None, groups: Collectives | None = None
) -> Iterator[Applied]:
    """The phase's server updates from `state.asynchronous.applied` on (the first jobs first, on a fresh
    state); `state.theta` is stepped in place and `state` advanced before each is yielded. With `groups`
    (real processes) this process runs its replicas' jobs only."""
    cfg = run.cfg
    engine = engine or engine_for(cfg.engine.name)
    groups = groups or ReplicaGroups(cfg.replicas)
    ours = set(groups.replicas)
    churn = statuses(run)
    updates = arrival_schedule(run, churn)
    starts: dict[int, list[Job]] = {}  # the jobs started after each server update (0: at the start)
    for update in updates:
        for job in (*update.jobs, *update.away):
            if job.replica in ours:
                starts.setdefault(job.pulled, []).append(job)
    now = state.asynchronous
    compress = compressor(run, state)
    bits = payload_bits(cfg.outer, tuple(tuple(t.shape) for t in state.theta.values()))
    if now.applied == 0 and not now.flying:
        run_jobs(run, state, starts.get(0, []), engine, groups, churn)
    for update in updates[now.applied :]:
        fault_points.act(groups.rank, "round", range(update.index - 1, update.index))  # tests: a kill here
        shared = [arrived(job, now.flying, groups, state.theta, compress) for job in update.jobs]
        deltas = torch.stack([job["delta"] for job in shared])
        theta_norm = weights_norm(state.theta)
        mean = now.server.apply(state.theta, deltas, [job.tokens for job in update.jobs])
        delta_norm = math.sqrt(float(mean.double().pow(2).sum()))
        # every server update is a boundary: no replica's weights beside the global ones to save
        now.applied = state.next_update = state.rounds_done = state.round_first = update.index
        state.totals.tokens += sum(job.tokens for job in update.jobs)
        state.totals.replica_steps += sum(job.steps for job in update.jobs)
        if churn is not None:
            count_arrivals(state.totals, update, run.replica_ids)
        mine = sorted(starts.get(update.index, []), key=lambda j: j.replica)
        run_jobs(run, state, mine, engine, groups, churn)
        stale = update.staleness
        state.totals.async_jobs += len(stale)
        state.totals.async_staleness_sum += sum(stale)
        state.totals.async_staleness_max = max(state.totals.async_staleness_max, *stale)
        state.totals.async_payload_bits += bits * len(update.jobs)
        losses = [job["losses"] for job in shared]
        last = update.index == len(updates)
        yield Applied(update, losses, last, [bits] * len(update.jobs), delta_norm, theta_norm)
