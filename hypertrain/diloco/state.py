"""The run's state: what was decided before training (`PreparedRun`) and what training changes
(`RunState`, one object: what a checkpoint saves and a resumed run restores).

`RunState` holds the global weights and the outer optimizer's state (the built-in's momentum, or each
fragment's optimizer's `state_dict`: `outer_steppers`), the inner optimizer
state of every replica this process trains (moments and per-replica step counts, per fragment with
Streaming DiLoCo), the position in the phase (next update, the current round's first update, rounds
done), the running totals, and what lies between syncs: the replicas' own weights when they differ
from the global ones (`round_params`: in the middle of a round, or always with fragments or a merge
alpha), whether each has stepped since each fragment's last sync (`round_stepped`), and a fragment's
sync in flight (`pending`, its result stored). Nothing in training draws random numbers after the
initial weights (the plan and the data order are pure functions of the config), so there is no RNG
state to carry. The network clock (`clock`) is the writer's running sum of simulated seconds. Under
outer.schedule=async, `asynchronous` holds the server's buffer and each replica's job in flight, and
`next_update` counts server updates (docs/async.md).
`state_dict()` gives plain tensors and numbers; `load_state_dict` puts them back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from hypertrain import plan
from hypertrain.clock.timeline import Clock, Shape
from hypertrain.codec_table import codec_entry
from hypertrain.config import TrainConfig
from hypertrain.data.batches import ReplicaBatch, update_batch
from hypertrain.data.datasets import Dataset
from hypertrain.diloco.asynchrony.server import AsyncServer, AsyncState
from hypertrain.diloco.exchange.lowrank import initial_q
from hypertrain.diloco.fragments import fragment_of, members
from hypertrain.diloco.outer import OuterState, OuterStep
from hypertrain.diloco.pending import Pending
from hypertrain.diloco.sync import FragmentSync
from hypertrain.distributed.decided import Decided
from hypertrain.model.shapes import active_params, count_params, param_roles
from hypertrain.model.transformer import Params
from hypertrain.optim.inner import OptState, init_state
from hypertrain.optim.outer import outer_optimizer
from hypertrain.schedule_table import schedule_entry


@dataclass
class PreparedRun:
    """Everything decided before training: the config with derived fields filled, data, plan facts,
    and what the config decides (`decided`: the layout, device, backend and the sync's reduction)."""

    cfg: TrainConfig
    dataset: Dataset
    phase: plan.StrongPhase | plan.WeakPhase
    samples: int  # N: the plan's stream, the dataset without its held-out slice
    updates: int  # updates that have ids (the rest of the phase is past the end of the stream)
    plan_facts: dict  # union hash, data-order digest, rank digest, data fingerprint
    heldout: ReplicaBatch  # the held-out ids (the last data.heldout), read and cut once
    decided: Decided  # the preflight's (a dist worker's: its own device, `Decided.on_rank`)
    # a prepared corpus of several sources: the source of each of `heldout`'s microbatches (each holds
    # one source's examples); [] otherwise
    heldout_sources: list[int] = field(default_factory=list)

    @property
    def sources(self) -> int:
        """The data's sources the held-out loss is split by (0: not split)."""
        return len(getattr(self.dataset, "source_names", ())) if self.heldout_sources else 0

    def replica_ids(self, update: int, replica: int):
        """The plan's ids of `replica` at `update` (`plan.replica_ids` of this run's phase and stream)."""
        return plan.replica_ids(self.phase, update, replica, self.cfg.replicas, self.samples)

    def batch(self, update: int, replica: int, share=None, idle: bool = False) -> ReplicaBatch:
        """Replica `replica`'s batch at `update` (`batches.update_batch`): its whole share, or with
        `share` (the benchmark layout) this rank's; none with `idle` (churn)."""
        cfg = self.cfg
        return update_batch(
            self.phase,
            self.samples,
            self.dataset,
            cfg.data,
            cfg.inner.micro_batch,
            cfg.replicas,
            update,
            replica,
            share,
            idle=idle,
        )


@dataclass
class Totals:
    """Running sums since the phase's first update."""

    tokens: int = 0  # target tokens trained on, all replicas
    replica_steps: int = 0  # inner steps taken, summed over replicas
    comm_inner_bytes: int = 0  # the ideal ring's bytes per participant (communication.inner_bytes)
    comm_outer_bytes: int = 0
    comm_outer_peak: int = 0  # the most one sync sent (the ideal ring's bytes per participant)
    # the bits each replica's contributions sent (`communication.contribution_bits`), per replica; None
    # for the rest of a run resumed from a checkpoint written before them (the report sums its rows)
    comm_outer_bits: list[int] | None = None
    # churn (docs/churn.md): replica-rounds that missed their sync, that were absent; syncs skipped below
    # the quorum; replica-steps whose pseudo-gradients reached the global weights (counted once per
    # fragment sync they reached: P times with P fragments); the running sha256 of
    # the ids they trained on (`churn.chain_digest`)
    churn_missed: int = 0
    churn_absent: int = 0
    churn_skipped: int = 0
    churn_late: int = 0  # replica-rounds the deadline stopped before the round's last update
    replica_steps_reached: int = 0
    contributed_sha256: str = ""
    # outer.schedule=async: the jobs applied, and the sum and largest of their staleness
    async_jobs: int = 0
    async_staleness_sum: int = 0
    async_staleness_max: int = 0
    async_payload_bits: int = 0  # the bits of the payloads applied (`wire.payload_bits`)
    # each replica's uploads and downloads in bytes (`run.asynchronous.moved_bytes`); None for a run
    # resumed from a checkpoint written before them (the report sums its rows)
    async_moved_bytes: list[int] | None = None


@dataclass
class RunState:
    theta: Params  # global weights, no replica axis
    # the outer momentum of the built-in outer optimizers, fp32 per parameter; {} for one that keeps its
    # state itself (a torch optimizer: `outer_steppers`)
    outer: OuterState
    inner: list[OptState]  # per local replica, each with a leading replica axis of 1
    replicas: list[int]  # the global index of each local replica, in `inner`'s order
    next_update: int = 0  # the plan's 0-based update to run next
    rounds_done: int = 0
    totals: Totals = field(default_factory=Totals)
    round_first: int = 0  # the first update of the round `next_update` is in (== it at a boundary)
    # None when every replica sits at the global weights (a round's start in DiLoCo): each local
    # replica's weights [1, ...], and per fragment whether it has stepped since that fragment's last
    # sync (a replica that has not sits the fragment's next sync out).
    round_params: list[Params] | None = None
    round_stepped: list[list[bool]] | None = None
    # outer.error_feedback: each local replica's error buffer [1, ...] per parameter (fp32): what
    # compression left out of its pseudo-gradients so far, added to its next one
    errors: list[Params] | None = None
    # the network clock (docs/clock.md), fed by the writer with the rows it writes; None for the rest of
    # a run resumed from a checkpoint written before the clock
    clock: Clock | None = None
    # one sync per fragment (`diloco.sync.FragmentSync`): views of its part of the state above, its
    # reducer, and its sync taken and not landed yet (outer.delay > 0; at most one fragment's at a time)
    syncs: list[FragmentSync] = field(default_factory=list)
    # outer.overlap=eager: each local replica's own outer weights and momentum ({"theta", "momentum"},
    # each [1, ...]; the momentum {} as `outer`'s); `theta` is then their mean over every replica (what is
    # evaluated and saved); each replica's outer optimizers are its syncs' `replica_steppers`
    outer_replicas: list[dict] | None = None
    # outer.compress=lowrank: each matrix's warm start Q [cols, r] fp32 (PowerSGD's), the same on every
    # process: drawn from the run's seed, then the Q of every sync
    lowrank_q: Params | None = None
    # outer.schedule=async: the server's buffer and each replica's job in flight (`server.AsyncState`);
    # `next_update` and `rounds_done` then count server updates
    asynchronous: AsyncState | None = None

    @property
    def overlapped(self) -> bool:
        """outer.overlap is on: every fragment's reduction is in flight a whole period (`in_flight`)."""
        return bool(self.syncs) and self.syncs[0].overlap != "none"

    @property
    def in_flight(self) -> list[Pending]:
        """outer.overlap: the reductions in flight, one per fragment taken, in fragment order."""
        return [s.pending for s in self.syncs if s.pending is not None] if self.overlapped else []

    @property
    def pending(self) -> Pending | None:
        """The fragment's sync in flight, if one is (what a checkpoint saves); None with outer.overlap,
        whose reductions are `in_flight`."""
        if self.overlapped:
            return None
        return next((s.pending for s in self.syncs if s.pending is not None), None)

    @pending.setter
    def pending(self, pending: Pending | None) -> None:
        for s in self.syncs:
            s.pending = None
        if pending is not None:
            self.syncs[pending.fragment].pending = pending

    @property
    def outer_steppers(self) -> list[OuterStep]:
        """The outer optimizers of the global weights, one per fragment (under async the server's, whose
        state the server saves)."""
        return [s.stepper for s in self.syncs]

    @property
    def mid_round(self) -> bool:
        """Between two round boundaries (a checkpoint here holds the replicas' weights)."""
        return self.next_update != self.round_first

    @classmethod
    def start(
        cls,
        cfg: TrainConfig,
        theta: Params,
        replicas: list[int] | None = None,
        decided: Decided | None = None,
    ) -> RunState:
        """The state before the first update: `theta` (owned by the state), zero optimizer state; its
        syncs reduce as `decided` says (None: as `cfg.outer` says, `decided.reduction`)."""
        local = list(range(cfg.replicas)) if replicas is None else list(replicas)
        one = {n: t.unsqueeze(0) for n, t in theta.items()}
        roles = param_roles(cfg.model)
        where = fragment_of(cfg) if cfg.outer.fragments > 1 else None
        states = [init_state(cfg.inner, one, roles, where, cfg.outer.fragments) for _ in local]
        errors = None
        if cfg.outer.error_feedback:
            errors = [{n: torch.zeros_like(t, dtype=torch.float32) for n, t in one.items()} for _ in local]
        shape, model = Shape.of(dataclasses.asdict(cfg)), cfg.model
        n, timed = count_params(model), cfg.cluster.model_params or None  # the size the clock times
        clock = Clock(shape, cfg.cluster, n, timed, active_params=active_params(model))
        optimizer = outer_optimizer(cfg.outer)
        state = cls(theta, OuterState(optimizer.buffers(theta)), states, local, errors=errors, clock=clock)
        state.totals.comm_outer_bits = [0] * cfg.replicas
        reduction = None if decided is None else decided.reduction
        if codec_entry(cfg.outer.compress).factored:
            state.lowrank_q = initial_q(state.theta, cfg.outer.lowrank.rank, cfg.seed)
        if cfg.outer.overlap == "eager":
            state.outer_replicas = [
                {"theta": {n: t.detach().clone() for n, t in one.items()}, "momentum": optimizer.buffers(one)}
                for _ in local
            ]
        state.syncs = [
            FragmentSync(
                cfg,
                p,
                names,
                state.theta,
                state.outer,
                state.errors,
                state.outer_replicas,
                reduction,
                state.lowrank_q,
            )
            for p, names in enumerate(members(cfg))
        ]
        if schedule_entry(cfg.outer.schedule).server:  # one fragment (async refuses more): the server steps
            (whole,) = state.syncs
            assert list(whole.theta) == list(theta), "the server's flat order is the weights'"
            state.asynchronous = AsyncState(AsyncServer(cfg.outer, whole.stepper))
            state.totals.async_moved_bytes = [0] * cfg.replicas
        return state

    def reissue(self, groups) -> None:
        """outer.overlap, after `load_state_dict`: start again the reductions a checkpoint stored taken
        (every process, in fragment order: the same numbers as the first time)."""
        for pending in self.in_flight:
            self.syncs[pending.fragment].issue(pending, groups)

    def stepped_in(self, fragment: int) -> list[bool]:
        """Whether each local replica has stepped since `fragment`'s last sync."""
        if self.round_stepped is None:
            return [False] * len(self.replicas)
        return [flags[fragment] for flags in self.round_stepped]

    def replica_records(self) -> list[dict]:
        """Each local replica's part of the state, in `replicas` order: its inner optimizer state,
        its weights and stepped flags when kept, and its flag in a pending sync (what a checkpoint
        gathers from every process). A pending sync's reduction is waited for here, on every process."""
        if self.pending is not None:
            self.pending.settle()
        kept = self.round_params is not None
        flights = self.in_flight  # outer.overlap: what was taken, not waited for
        return [
            {
                "in_flight": {
                    p.fragment: {
                        "stepped": p.stepped[i],
                        "taken": p.taken[i],
                        "errors_before": None if p.errors_before is None else p.errors_before[i],
                    }
                    for p in flights
                },
                "outer": self._replica_outer(i) if self.outer_replicas is not None else None,
                "inner": {"m": s.m, "v": s.v, "step": s.step},
                "params": self.round_params[i] if kept else None,
                "stepped": _flags_out(self.round_stepped[i]) if kept and self.round_stepped else None,
                "pending_stepped": self.pending.stepped[i] if self.pending is not None else None,
                "errors": self.errors[i] if self.errors is not None else None,
                # outer.schedule=async: the replica's job in flight (this process ran it)
                "flying": self.asynchronous.flying.get(self.replicas[i]) if self.asynchronous else None,
            }
            for i, s in enumerate(self.inner)
        ]

    def _replica_outer(self, i: int) -> dict:
        """Local replica i's own outer state under eager: its outer weights and momentum, and its outer
        optimizer's state per fragment where the optimizer keeps its own (`optimizer`)."""
        own = self.outer_replicas[i]
        states = _own_states([s.replica_steppers[i] for s in self.syncs])
        return own if states is None else {**own, "optimizer": states}

    def state_dict(self, records: list[dict] | None = None) -> dict:
        """The state as tensors and numbers. With `records` (every replica's `replica_records`, gathered
        from all processes in replica order) it holds every replica of the run, else this process's."""
        replicas = list(self.replicas) if records is None else list(range(len(records)))
        records = self.replica_records() if records is None else records
        mid = records[0]["params"] is not None
        pending = None
        if self.pending is not None:
            pending = self.pending.state_dict([r["pending_stepped"] for r in records])
        return {
            "theta": self.theta,
            "outer_momentum": self.outer.momentum,
            # each fragment's outer optimizer's own state (None: the built-ins keep theirs in
            # `outer_momentum`; under async the server saves its optimizer's)
            "outer_optimizer": None if self.asynchronous else _own_states(self.outer_steppers),
            "inner": [r["inner"] for r in records],
            "replicas": replicas,
            "next_update": self.next_update,
            "rounds_done": self.rounds_done,
            "totals": dataclasses.asdict(self.totals),
            "round_first": self.round_first,
            "round_params": [r["params"] for r in records] if mid else None,
            "round_stepped": [r["stepped"] for r in records] if mid else None,
            "pending": pending,
            "errors": [r["errors"] for r in records] if self.errors is not None else None,
            "clock": self.clock.state_dict() if self.clock is not None else None,
            "in_flight": _in_flight_out(self.in_flight, records) if self.overlapped else None,
            "outer_replicas": [r["outer"] for r in records] if self.outer_replicas is not None else None,
            "lowrank_q": self.lowrank_q,
            "async": None
            if self.asynchronous is None
            else self.asynchronous.state_dict(
                {m: r["flying"] for m, r in zip(replicas, records, strict=True) if r["flying"] is not None}
            ),
        }

    @torch.no_grad()
    def load_state_dict(self, saved: dict) -> None:
        """Copy `saved` (from `state_dict`, or a checkpoint's in today's form: `records.formats`; it may
        hold more replicas, e.g. every replica of a run whose processes held a few each) into this state
        in place: this process's replicas only."""
        where = {m: i for i, m in enumerate(saved["replicas"])}
        missing = [m for m in self.replicas if m not in where]
        if missing:
            raise ValueError(f"the saved state holds replicas {saved['replicas']}, not {missing}")
        for name, t in self.theta.items():
            t.copy_(saved["theta"][name])
        for name, t in self.outer.momentum.items():
            t.copy_(saved["outer_momentum"][name])
        if saved.get("outer_optimizer") is not None and self.asynchronous is None:
            for stepper, kept in zip(self.outer_steppers, saved["outer_optimizer"], strict=True):
                stepper.load_state_dict(kept)
        for state, kept in zip(self.inner, (saved["inner"][where[m]] for m in self.replicas), strict=True):
            for moments in ("m", "v"):
                for name, t in getattr(state, moments).items():
                    t.copy_(kept[moments][name])
            state.step.copy_(kept["step"])
        self.next_update, self.rounds_done = int(saved["next_update"]), int(saved["rounds_done"])
        self.totals = Totals(**saved["totals"])
        if self.totals.comm_outer_bits is not None:
            self.totals.comm_outer_bits = list(self.totals.comm_outer_bits)
        if self.totals.async_moved_bytes is not None:
            self.totals.async_moved_bytes = list(self.totals.async_moved_bytes)
        self.round_first = int(saved["round_first"])
        self.round_params = self.round_stepped = self.pending = None
        device = next(iter(self.theta.values())).device
        if saved["round_params"] is not None:
            self.round_params = [
                {n: t.to(device) for n, t in saved["round_params"][where[m]].items()} for m in self.replicas
            ]
            self.round_stepped = [_flags_in(saved["round_stepped"][where[m]]) for m in self.replicas]
        if self.errors is not None:  # a run with error feedback resumes only from one (same config)
            for buffers, kept in zip(
                self.errors, (saved["errors"][where[m]] for m in self.replicas), strict=True
            ):
                for name, t in buffers.items():
                    t.copy_(kept[name])
        if saved["clock"] is None:
            self.clock = None
        elif self.clock is not None:
            self.clock.load_state_dict(saved["clock"])
        mine = [where[m] for m in self.replicas]
        if saved["pending"] is not None:
            self.pending = Pending.from_state_dict(saved["pending"], mine, device)
        if self.outer_replicas is not None:
            for local, (own, i) in enumerate(zip(self.outer_replicas, mine, strict=True)):
                for part in ("theta", "momentum"):
                    for name, t in own[part].items():
                        t.copy_(saved["outer_replicas"][i][part][name])
                kept = saved["outer_replicas"][i].get("optimizer")  # None: the built-ins keep none
                for s, optimizer in zip(self.syncs, kept or [None] * len(self.syncs), strict=True):
                    s.replica_steppers[local].load_state_dict(optimizer)
        if self.lowrank_q is not None and saved.get("lowrank_q") is not None:
            for name, t in self.lowrank_q.items():
                t.copy_(saved["lowrank_q"][name])
        if self.asynchronous is not None:
            self.asynchronous.load_state_dict(saved["async"], self.replicas)
        for s in self.syncs:
            s.due = None
        for taken in saved["in_flight"] or []:
            pending = Pending.from_taken(taken, mine, device)
            self.syncs[pending.fragment].pending = pending  # issued again by `reissue`


def _in_flight_out(flights: list[Pending], records: list[dict]) -> list[dict]:
    """Each fragment's reduction in flight as a checkpoint stores it: what every replica took."""
    out = []
    for pending in flights:
        mine = [r["in_flight"][pending.fragment] for r in records]
        errors = None if mine[0]["errors_before"] is None else [x["errors_before"] for x in mine]
        out.append(pending.taken_state([x["stepped"] for x in mine], [x["taken"] for x in mine], errors))
    return out


def _own_states(steppers: list[OuterStep]) -> list[dict] | None:
    """The outer optimizers' own states, in fragment order; None where they keep none (the built-ins)."""
    states = [s.state_dict() for s in steppers]
    return None if all(x is None for x in states) else states


def _flags_out(flags: list[bool]) -> bool | list[bool]:
    """A replica's stepped flags as saved: one bool for one fragment (as before fragments existed)."""
    return flags[0] if len(flags) == 1 else list(flags)


def _flags_in(saved: bool | list[bool]) -> list[bool]:
    return [bool(saved)] if isinstance(saved, bool) else [bool(x) for x in saved]
