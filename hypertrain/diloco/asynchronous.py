"""The asynchronous run loop (outer.schedule=async, docs/async.md): `server_updates(run, state)` walks the
arrival schedule (`diloco.arrivals`), applies each server update (`diloco.server`) and runs the next job
of every replica that pulled, on the engine, from the weights it pulled; it yields an `Applied` per update,
`state` advanced past it (its `asynchronous` part: `server.AsyncState`, what a checkpoint saves).

On real processes (`processes=dist`, docs/async.md "Real processes") every process walks the same schedule
and holds the server's state; it runs the jobs of its own replicas only, and each arrival reaches every
process from its replica's (`Collectives.share_arrival`, a broadcast), so every process applies the same
server update to the same bits as the simulation.

With a codec (outer.compress, docs/async.md "Codecs") an arriving job's pseudo-gradient is compressed by
its replica's process as a round compresses it (`compress_arrival`, with the transform and tiles;
`lowrank_arrival`, one power iteration from the server's Q: its error-feedback buffer added first and
updated), and what is applied and broadcast is the decoded payload, the same bits everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hypertrain.data.batches import targets_of
from hypertrain.diloco import codecs
from hypertrain.diloco.arrivals import Job, ServerUpdate, Timing, schedule
from hypertrain.diloco.communication import fed_back, self_decoded, topk
from hypertrain.diloco.lowrank import Factors, LowRankMean
from hypertrain.diloco.outer import pseudo_gradients
from hypertrain.diloco.state import PreparedRun, RunState
from hypertrain.diloco.tiles import tile_order, to_tiles
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.engines import engine_for
from hypertrain.engines.contract import Assignment, Engine
from hypertrain.failures import fault_points


@dataclass
class Applied:
    """One server update (`arrivals.ServerUpdate`) as applied: each job's losses, in its order."""

    update: ServerUpdate
    losses: list[list[float | None]]
    last: bool  # the phase's last server update
    bits: list[int]  # each job's payload bits (`payload_bits`)


def payload_bits(outer, shapes: tuple[tuple[int, ...], ...]) -> int:
    """The bits one arrival's payload puts on the wire, a pseudo-gradient of tensors of `shapes`: fp32
    (outer.compress=none) 32 a parameter; lowrank its factors P and Q and its 1-D tensors in fp32
    (`lowrank.Factors.payload_bytes`, a round's replica's payload); a codec its payload's
    (`codecs.payload_size`, which neither the transform nor the tiles change), as a round's contribution
    under `gather`, less the round's header bytes (an arrival sends no header)."""
    sizes = tuple(math.prod(shape) for shape in shapes)
    if outer.compress == "none":
        return 32 * sum(sizes)
    if outer.compress == "lowrank":
        return 8 * arrival_factors(outer, shapes).payload_bytes
    return 8 * codecs.payload_size(outer.compress, codecs.Blocks(sizes, outer.block), topk(outer))


def arrival_factors(outer, shapes: tuple[tuple[int, ...], ...]) -> Factors:
    """outer.compress=lowrank: which of the tensors of `shapes` (the model's, in order) are matrices."""
    return Factors.of({str(i): shape for i, shape in enumerate(shapes)}, outer.lowrank_rank)


def compress_arrival(
    outer, delta: torch.Tensor, errors: torch.Tensor | None, shapes: tuple[tuple[int, ...], ...]
) -> torch.Tensor:
    """One replica's arriving pseudo-gradient `delta` [n] (the tensors of `shapes`, flat) as the server
    applies it: its decoded payload d = decode(encode(x)), x = delta + beta * e (`communication.fed_back`,
    beta = outer.error_decay; the pseudo-gradient alone without feedback), a round's contribution's
    rule (`communication.self_decoded`: with outer.tile the blocks read in tiles, with outer.transform=dct
    the codec sees each block's DCT coefficients and d is their inverse); with error feedback its buffer
    `errors` [1, n] becomes x - d in place. A non-finite x is returned as it is, the buffer unchanged:
    the server applies it as it applies an uncompressed one, and the held-out guard stops the run on
    every process (a codec's bytes would hide it)."""
    blocks = codecs.Blocks(tuple(math.prod(shape) for shape in shapes), outer.block)
    x = fed_back(delta[None], errors, outer.error_decay)
    if not torch.isfinite(x).all():
        return x[0]
    order = tile_order(list(shapes), outer.tile)
    _, decoded = self_decoded(outer, to_tiles(x, order), blocks, order)
    if errors is not None:
        errors.copy_(x - decoded)
    return decoded[0]


def lowrank_arrival(
    outer, delta: torch.Tensor, errors: torch.Tensor | None, q: dict[str, torch.Tensor], factors: Factors
) -> torch.Tensor:
    """outer.compress=lowrank: one replica's arriving `delta` [n] as the server applies it, PowerSGD's
    Algorithm 1 (Vogels et al. 2019) with one worker, warm-started from the server's Q (`q`, each
    matrix's [cols, r] keyed as `factors` names it, updated in place): x = delta + beta * e; per matrix
    M of x, P = orthogonalize(M Q), Q' = M^T P, d = P Q'^T; the 1-D tensors exact; Q <- Q' (a column of
    Q' all zero keeps Q's); with error feedback e <- x - d in place. It is a round's `LowRankMean` over
    this one replica (its means over one row are the row), so the rule is the rounds' code. A non-finite
    x is returned as it is, Q and the buffer unchanged (`compress_arrival`)."""
    x = fed_back(delta[None], errors, outer.error_decay)
    if not torch.isfinite(x).all():
        return x[0]
    one = torch.ones(1, dtype=torch.bool, device=x.device)
    reduction = LowRankMean(factors, x, delta[None], one, q, errors, lambda _: None, ReplicaGroups(1))
    return reduction.wait().mean


def compressor(run: PreparedRun, state: RunState):
    """`(replica, delta) -> the decoded delta` for this process's replicas, their error buffers (the run
    state's `errors`, per parameter) updated, and with lowrank the server's warm start (the run state's
    `lowrank_q`); None with outer.compress=none."""
    outer = run.cfg.outer
    if outer.compress == "none":
        return None
    shapes = tuple(tuple(t.shape) for t in state.theta.values())
    local = {m: i for i, m in enumerate(state.replicas)}
    if outer.compress == "lowrank":
        factors = Factors.of({n: tuple(t.shape) for n, t in state.theta.items()}, outer.lowrank_rank)

        def encode(delta, flat):
            return lowrank_arrival(outer, delta, flat, state.lowrank_q, factors)
    else:

        def encode(delta, flat):
            return compress_arrival(outer, delta, flat, shapes)

    def compress(replica: int, delta: torch.Tensor) -> torch.Tensor:
        if state.errors is None:
            return encode(delta, None)
        buffers = state.errors[local[replica]]
        flat = torch.cat([t.reshape(1, -1).float() for t in buffers.values()], dim=1)
        decoded = encode(delta, flat)
        start = 0
        for t in buffers.values():
            t.copy_(flat[0, start : start + t.numel()].view(t.shape))
            start += t.numel()
        return decoded

    return compress


def arrival_schedule(run: PreparedRun) -> list[ServerUpdate]:
    """The run's server updates (`arrivals.schedule`): a replica's step k trains the plan's ids of
    update k for it, and its tokens are their targets."""
    cfg = run.cfg

    def targets(k: int, m: int) -> int:
        return targets_of(run.dataset, run.replica_ids(k, m))

    return schedule(cfg.outer, cfg.inner.H, run.updates, Timing.of(cfg), targets)


def job_updates(job: Job) -> range:
    """The updates whose plan ids `job` trains: its replica's steps `first .. first + steps - 1`."""
    return range(job.first, job.first + job.steps)


def run_jobs(
    run: PreparedRun, state: RunState, jobs: list[Job], engine: Engine, groups: Collectives | None = None
) -> None:
    """Run `jobs` (replicas that pulled the global weights `state.theta` now) on the engine, the jobs of
    the same first step and length in one call (the stacked engine stacks them: its replicas share the
    lr schedule's steps), and keep each one's pseudo-gradient. Under the benchmark layout of L > 1
    processes per replica (`groups`) this process trains its share of each step, its replica's ranks
    averaging their gradients (as in rounds): every rank of a replica holds the same job."""
    cfg = run.cfg
    share = groups.rank_share() if groups is not None else None
    share = share if share is not None and share[2] > 1 else None  # L = 1: the replica's whole batch
    average = groups.average_in_replica if share is not None else None
    for span in sorted({(job.first, job.steps) for job in jobs}):
        todo = [job for job in jobs if (job.first, job.steps) == span]
        assigns = [
            Assignment(job.replica, job.first, [run.batch(k, job.replica, share) for k in job_updates(job)])
            for job in todo
        ]
        local = {m: i for i, m in enumerate(state.replicas)}  # a replica's index in `state.inner`
        states = [state.inner[local[job.replica]] for job in todo]
        results = engine(cfg, state.theta, assigns, states, average)
        for job, res in zip(todo, results, strict=True):
            state.inner[local[job.replica]] = res.state
            state.asynchronous.flying[job.replica] = {
                "delta": pseudo_gradients(state.theta, res.params)[0],
                "losses": list(res.losses),
            }


def arrived(
    job: Job, flying: dict[int, dict], groups: Collectives, theta: dict[str, torch.Tensor], compress=None
) -> dict:
    """The arriving `job`'s pseudo-gradient and losses, taken from `flying` by the process that trained
    it (decoded from its payload by `compress` there, `compressor`'s) and shared with every process
    (`Collectives.share_arrival`; one process: as it is)."""
    mine = flying.pop(job.replica, None)
    if mine is not None and compress is not None:
        mine = {**mine, "delta": compress(job.replica, mine["delta"])}
    if groups.size == 1:
        return mine
    device = next(iter(theta.values())).device
    if mine is None:
        numel = sum(t.numel() for t in theta.values())
        delta = torch.empty(numel, dtype=torch.float32, device=device)
        losses = torch.empty(job.steps, dtype=torch.float64, device=device)
    else:
        delta = mine["delta"].to(device)
        losses = torch.tensor([math.nan if x is None else x for x in mine["losses"]], dtype=torch.float64)
        losses = losses.to(device)
    delta, losses = groups.share_arrival(job.replica, delta, losses)
    return {"delta": delta, "losses": [None if math.isnan(x) else x for x in losses.tolist()]}


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
    updates = arrival_schedule(run)
    starts: dict[int, list[Job]] = {}  # the jobs started after each server update (0: at the start)
    for update in updates:
        for job in update.jobs:
            if job.replica in ours:
                starts.setdefault(job.pulled, []).append(job)
    now = state.asynchronous
    compress = compressor(run, state)
    bits = payload_bits(cfg.outer, tuple(tuple(t.shape) for t in state.theta.values()))
    if now.applied == 0 and not now.flying:
        run_jobs(run, state, starts.get(0, []), engine, groups)
    for update in updates[now.applied :]:
        fault_points.act(groups.rank, "round", range(update.index - 1, update.index))  # tests: a kill here
        shared = [arrived(job, now.flying, groups, state.theta, compress) for job in update.jobs]
        deltas = torch.stack([job["delta"] for job in shared])
        now.server.apply(state.theta, deltas, [job.tokens for job in update.jobs])
        # every server update is a boundary: no replica's weights beside the global ones to save
        now.applied = state.next_update = state.rounds_done = state.round_first = update.index
        state.totals.tokens += sum(job.tokens for job in update.jobs)
        state.totals.replica_steps += sum(job.steps for job in update.jobs)
        run_jobs(run, state, sorted(starts.get(update.index, []), key=lambda j: j.replica), engine, groups)
        stale = update.staleness
        state.totals.async_jobs += len(stale)
        state.totals.async_staleness_sum += sum(stale)
        state.totals.async_staleness_max = max(state.totals.async_staleness_max, *stale)
        state.totals.async_payload_bits += bits * len(update.jobs)
        losses = [job["losses"] for job in shared]
        yield Applied(update, losses, update.index == len(updates), [bits] * len(update.jobs))
