"""The one round loop of every engine and process layout: `rounds(run, state)` yields a phase's rounds
as `Segment`s, advancing the run's state; a round is H updates by an engine on this process's replicas,
then the sync that steps the global weights (`diloco.sync.FragmentSync`, one per fragment). With
Streaming DiLoCo's fragments a round holds P syncs, each taken tau updates before it lands
(`diloco.fragments.Schedule`).
A segment ends wherever the schedule, a checkpoint or a stop cuts; cuts change no number. The
one-process simulation is the case of one process holding every replica.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hypertrain.data.batches import ReplicaBatch, targets_of
from hypertrain.diloco import churn
from hypertrain.diloco.asynchrony import server
from hypertrain.diloco.fragments import FLUSH, TAKE, Schedule, members
from hypertrain.diloco.state import PreparedRun, RunState
from hypertrain.diloco.sync import Landing
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.engines import engine_for
from hypertrain.engines.columns import PROCESS_COLUMNS, REPLICA_COLUMNS
from hypertrain.engines.contract import (
    Assignment,
    Engine,
    ReplicaResult,
    StopAfter,
)
from hypertrain.engines.throughput import process_table
from hypertrain.failures import fault_points, signals
from hypertrain.model.spec import MODEL_COLUMNS, ModelSpec, model_spec


def assignments(
    run: PreparedRun,
    updates: range,
    groups: Collectives | None = None,
    state: RunState | None = None,
    idle: frozenset[tuple[int, int]] = frozenset(),
) -> list[Assignment]:
    """This process's replicas' batches for `updates` (a round, or the rest of one), as the plan
    assigns them: each replica's whole share, or (benchmark layout) this rank's share weighted over its
    replica's ranks; none for the (update, replica) pairs churn made `idle` (they train nothing, as a
    replica without ids). With `state` in the middle of a round, each starts from the weights it reached."""
    cfg = run.cfg
    groups = groups or ReplicaGroups(cfg.replicas)
    share = groups.rank_share()

    def batch(u: int, m: int) -> ReplicaBatch:
        return run.batch(u, m, share, idle=(u, m) in idle)

    if cfg.outer.fragments > 1:  # each fragment's step counted from its own last sync
        since: int | tuple[int, ...] = Schedule.of(cfg, run.updates).since_land(updates[0])
    else:
        since = updates[0] - (updates[0] if state is None else state.round_first)
    reached = state.round_params if state is not None and state.round_params is not None else None
    reached = reached or [None] * len(groups.replicas)
    return [
        Assignment(m, updates[0], [batch(u, m) for u in updates], since, start)
        for m, start in zip(groups.replicas, reached, strict=True)
    ]


@dataclass
class Segment:
    """A finished round, or the part of one that the schedule, a checkpoint or a stop cut off: its
    updates, what this process's replicas were given and did, every replica's and every process's
    per-update records (gathered once per segment for the writer, read by column name), the syncs
    that landed after its last update and whether it ends a round."""

    index: int  # the 1-based round it belongs to
    updates: range  # the plan's update indices of the segment
    assigns: list[Assignment]  # this process's replicas
    results: list[ReplicaResult]
    table: Tensor  # float64 [updates, R, len(REPLICA_COLUMNS)]
    ranks: Tensor  # float64 [P, updates, len(PROCESS_COLUMNS)]: each process's work and seconds
    ends_round: bool = False  # a round (H updates, or the phase's last) ended here
    syncs: list[Landing] = field(default_factory=list)  # the syncs that landed, in order

    def replica_column(self, name: str) -> Tensor:
        """[updates, R]: every replica's `name` (REPLICA_COLUMNS) per update."""
        return REPLICA_COLUMNS.of(self.table, name)

    def process_column(self, name: str) -> Tensor:
        """[P, updates]: every process's `name` (PROCESS_COLUMNS) per update."""
        return PROCESS_COLUMNS.of(self.ranks, name)

    def stepped(self, t: int) -> Tensor:
        """bool [R]: which replicas took update `t`'s step (churn keeps the others out)."""
        return self.replica_column("stepped")[t].bool()

    def losses(self, t: int) -> list[float | None]:
        """Update `t`'s loss of every replica; None for one that did not step."""
        losses = self.replica_column("loss")[t].tolist()
        return [x if took else None for x, took in zip(losses, self.stepped(t).tolist(), strict=True)]


def local_table(assigns: list[Assignment], results: list[ReplicaResult], model: ModelSpec) -> Tensor:
    """float64 [updates, local replicas, len(REPLICA_COLUMNS)]: this process's replicas' records; the
    columns the model entry adds (`model.spec`) are its `replica_values`, the others' NaN."""
    unused = dict.fromkeys(MODEL_COLUMNS, math.nan)

    def row(a: Assignment, res: ReplicaResult, t: int) -> list[float]:
        means = res.channel_losses[t] if res.channel_losses else None
        routing = res.routing[t] if res.routing else None
        return REPLICA_COLUMNS.row(
            stepped=float(res.losses[t] is not None),
            loss=math.nan if res.losses[t] is None else res.losses[t],
            targets=a.batches[t].replica_total,
            microbatches=len(a.batches[t].microbatches),
            **(unused | model.replica_values(means, routing)),
        )

    rows = [
        [row(a, res, t) for a, res in zip(assigns, results, strict=True)]
        for t in range(len(assigns[0].batches))
    ]
    return torch.tensor(rows, dtype=torch.float64)


def rounds(
    run: PreparedRun,
    state: RunState,
    engine: Engine | None = None,
    groups: Collectives | None = None,
    stop: StopAfter | None = None,
    every_updates: int = 0,
) -> Iterator[Segment]:
    """The phase's rounds from `state.next_update` on (the rest of a round first when `state` is in
    the middle of one): this process's replicas' inner steps, then the sync that steps `state.theta`
    in place; `state` is advanced past each segment before it is yielded. A round is cut into
    segments where `next_update` reaches a multiple of `every_updates`, and after the update at which
    `stop` says so. Cuts change no number: a replica goes on from the weights and state it reached.
    With `groups` of several processes every process runs this same loop on its own replicas."""
    cfg = run.cfg
    groups = groups or ReplicaGroups(cfg.replicas)
    engine = engine or groups.engine or engine_for(cfg.engine.name)  # sharded replicas impose theirs
    average = groups.average_in_replica if groups.rank_share() is not None else None
    schedule = Schedule.of(cfg, run.updates)
    fragments = members(cfg)
    # DiLoCo (one fragment, no merge alpha): after a sync every replica restarts from the global weights.
    # Eager: each restarts from its own outer weights (kept in `round_params`).
    restart = cfg.outer.fragments == 1 and cfg.outer.merge_alpha == 0.0 and cfg.outer.overlap != "eager"
    churned = churn.Churn.of(run)  # None without churn
    # DiLoCo's sync rows hold the held-out loss of the weights each landing leaves: every process keeps
    # its copy (a sharded run's writer evaluates them gathered from every rank's shards)
    evaluated = cfg.outer.fragments == 1
    while state.next_update < run.updates:
        end = schedule.next_cut(state.next_update)
        if every_updates:
            end = min(end, (state.next_update // every_updates + 1) * every_updates)
        updates = range(state.next_update, end)
        groups.before_round(updates)
        idle = churned.round_start(state, groups.replicas, updates) if churned else frozenset()
        assigns = assignments(run, updates, groups, state, idle)
        results = engine(cfg, state.theta, assigns, state.inner, average, stop)
        updates = updates[: len(results[0].losses)]  # a stop ends every replica after the same update
        assigns = [a.first(len(updates)) for a in assigns]
        before = state.round_stepped or [[False] * len(fragments) for _ in results]
        state.round_stepped = [
            [was or res.stepped for was in flags] for flags, res in zip(before, results, strict=True)
        ]
        state.round_params = [res.params for res in results]
        state.inner = [res.state for res in results]
        part = Segment(
            state.rounds_done + 1,
            updates,
            assigns,
            results,
            groups.gather_round(local_table(assigns, results, model_spec(cfg.model))),
            groups.gather_ranks(process_table(assigns, results)),
        )
        state.next_update = count = updates.stop
        events = schedule.events(count)
        last_landing = max((i for i, (kind, _) in enumerate(events) if kind != TAKE), default=-1)
        for i, (kind, p) in enumerate(events):
            if kind == TAKE:
                _take(run, state, schedule, groups, churned, part.index, p, fragments[p], count)
            else:  # LAND, or FLUSH (outer.overlap: the phase's last reduction)
                keep = evaluated and i < last_landing  # the next landing changes the weights in place
                landing = _land(
                    run, state, schedule, groups, churned, part.index, p, fragments[p], kind, restart, keep
                )
                part.syncs.append(landing)
                for flags in state.round_stepped:
                    flags[p] = False
        if schedule.is_period_end(count):
            part.ends_round = True
            state.round_first, state.rounds_done = count, state.rounds_done + 1
        if restart and part.syncs:
            state.round_params = state.round_stepped = None
        yield part


def _take(
    run: PreparedRun,
    state: RunState,
    schedule: Schedule,
    groups: Collectives,
    churned: churn.Churn | None,
    index: int,
    p: int,
    names: list[str],
    count: int,
) -> None:
    """Fragment `p`'s (parameters `names`) sync takes the replicas' round weights after update `count`
    (round `index`): only the contributors' pseudo-gradients with churn, token-weighted under
    outer.mean_weights=tokens."""
    cfg = run.cfg
    params = state.round_params
    groups.check_replicas_identical({n: torch.cat([q[n] for q in params]) for n in names})
    stepped, facts = state.stepped_in(p), None
    if churned is not None:  # only the contributors' pseudo-gradients reach the sync
        window = schedule.window(p, count)  # the updates its pseudo-gradient holds
        facts = churned.facts(index, window, p)
        contributors = facts.contributors
        stepped = [s and m in contributors for s, m in zip(stepped, groups.replicas, strict=True)]
    weights = None
    if cfg.outer.mean_weights == "tokens":
        weights = token_weights(run, schedule.window(p, count), facts)
    state.syncs[p].take(params, stepped, count, groups, facts, weights)


def _land(
    run: PreparedRun,
    state: RunState,
    schedule: Schedule,
    groups: Collectives,
    churned: churn.Churn | None,
    index: int,
    p: int,
    names: list[str],
    kind: str,
    restart: bool,
    keep: bool,
) -> Landing:
    """Fragment `p`'s (parameters `names`) LAND or FLUSH event in round `index`: lands its pending sync
    into `state` (merging into the round weights unless `restart`); returns the landing, holding a copy
    of the global weights when `keep`."""
    cfg = run.cfg
    sync = state.syncs[p]
    # outer.overlap: a landing lands the sync taken a period earlier (`due`)
    pending = sync.due if schedule.overlap and kind != FLUSH else sync.pending
    if churned is not None and pending is not None and pending.churn is None:  # from a checkpoint
        k = (pending.taken_at - 1) // cfg.inner.H + 1 if schedule.overlap else index
        pending.churn = churned.facts(k, schedule.window(p, pending.taken_at), p)
    merged = None if restart else state.round_params
    landing = (sync.flush if kind == FLUSH else sync.land)(state.inner, merged, groups)
    landing.measured = groups.comm_stats()  # this landing's (and the updates' before it)
    if landing.churn is not None and merged is not None:
        # who did not contribute restarts from the global weights
        churn.restart_others(landing.churn, state.theta, names, merged, groups.replicas)
    if keep:
        landing.weights = {n: t.detach().clone() for n, t in state.theta.items()}
    return landing


def token_weights(run: PreparedRun, window: range, facts) -> list[float] | None:
    """outer.mean_weights=tokens (docs/async.md, "Weighted mean"): the weights of every replica's
    pseudo-gradient in a sync whose pseudo-gradients hold the updates `window` (a fragment's own, since
    its last landing: `fragments.Schedule.window`), by the rule of the asynchronous server
    (`server.token_weights`): w_m = the target tokens replica m trained on in the window (with churn,
    `facts`: its ids there, 0 for a non-contributor), normalized over all R replicas. Every process
    computes the same R from the plan and the data's lengths. None: uniform."""
    R = run.cfg.replicas

    def ids(m: int) -> list:
        if facts is not None:
            return facts.ids.get(m, [])
        return [run.replica_ids(u, m) for u in window]

    tokens = [sum(targets_of(run.dataset, x) for x in ids(m)) for m in range(R)]
    w = server.token_weights(tokens, "tokens", torch.float32)
    return None if w is None else w.tolist()


class StopCheck:
    """The engines' `stop`: after every update, whether some process of the run got a stop signal
    (one agreement per update, so every process stops after the same one); `signum` is the signal
    (the largest number when processes got different ones). The test-only fault point `after`
    (failures.fault_points) fires first."""

    def __init__(self, groups: Collectives):
        self.groups, self.signum = groups, 0

    def __call__(self, update: int) -> bool:
        fault_points.act(self.groups.rank, "after", range(update, update + 1))
        self.signum = self.groups.max_over_processes(signals.requested() or 0)
        return self.signum > 0
