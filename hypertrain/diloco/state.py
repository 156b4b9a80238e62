"""The run's state: what was decided before training (`PreparedRun`) and what training changes
(`RunState`, one object: what a checkpoint saves and a resumed run restores).

`RunState` holds the global weights and the outer optimizer's momentum, the inner optimizer
state of every replica this process trains (moments and per-replica step counts), the position
in the phase (next update, the current round's first update, rounds done) and the running totals.
At a round boundary every replica restarts from the global weights, so replica weights are kept
only in the middle of a round (`round_params`, with which replicas have stepped in it so far),
where a mid-round checkpoint or a stop leaves them. Nothing
in training draws random numbers after the initial weights (the plan and the data order are
pure functions of the config), so there is no RNG state to carry. `state_dict()` gives plain
tensors and numbers; `load_state_dict` puts them back in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hypertrain import plan
from hypertrain.config import TrainConfig
from hypertrain.data.batches import ReplicaBatch
from hypertrain.data.datasets import Dataset
from hypertrain.diloco.outer import OuterState, init_outer_state
from hypertrain.model.transformer import Params, param_roles
from hypertrain.optim.inner import OptState, init_state


@dataclass
class PreparedRun:
    """Everything decided before training: the config with derived fields filled, data, plan facts."""

    cfg: TrainConfig
    dataset: Dataset
    phase: plan.StrongPhase | plan.WeakPhase
    samples: int  # N: the plan's stream, the dataset without its held-out slice
    updates: int  # updates that have ids (the rest of the phase is past the end of the stream)
    plan_facts: dict  # union hash, data-order digest, rank digest, data fingerprint
    heldout: ReplicaBatch  # the held-out ids (the last data.heldout), read and cut once


@dataclass
class Totals:
    """Running sums since the phase's first update."""

    tokens: int = 0  # target tokens trained on, all replicas
    replica_steps: int = 0  # inner steps taken, summed over replicas
    comm_inner_bytes: int = 0  # the ideal ring's bytes per participant (communication.round_bytes)
    comm_outer_bytes: int = 0


@dataclass
class RunState:
    theta: Params  # global weights, no replica axis
    outer: OuterState
    inner: list[OptState]  # per local replica, each with a leading replica axis of 1
    replicas: list[int]  # the global index of each local replica, in `inner`'s order
    next_update: int = 0  # the plan's 0-based update to run next
    rounds_done: int = 0
    totals: Totals = field(default_factory=Totals)
    round_first: int = 0  # the first update of the round `next_update` is in (== it at a boundary)
    # Mid-round only (None at a boundary): each local replica's weights [1, ...] so far in the
    # round, and whether it has stepped in the round (a replica that has not sits the sync out).
    round_params: list[Params] | None = None
    round_stepped: list[bool] | None = None

    @property
    def mid_round(self) -> bool:
        return self.round_params is not None

    @classmethod
    def start(cls, cfg: TrainConfig, theta: Params, replicas: list[int] | None = None) -> RunState:
        """The state before the first update: `theta` (owned by the state), zero optimizer state."""
        local = list(range(cfg.replicas)) if replicas is None else list(replicas)
        one = {n: t.unsqueeze(0) for n, t in theta.items()}
        roles = param_roles(cfg.model)
        states = [init_state(cfg.inner, one, roles) for _ in local]
        return cls(theta, init_outer_state(theta), states, local)

    def replica_records(self) -> list[dict]:
        """Each local replica's part of the state, in `replicas` order: its inner optimizer state and,
        mid-round, its weights and whether it has stepped (what a checkpoint gathers from every process)."""
        mid = self.mid_round
        return [
            {
                "inner": {"m": s.m, "v": s.v, "step": s.step},
                "params": self.round_params[i] if mid else None,
                "stepped": self.round_stepped[i] if mid else None,
            }
            for i, s in enumerate(self.inner)
        ]

    def state_dict(self, records: list[dict] | None = None) -> dict:
        """The state as tensors and numbers. With `records` (every replica's `replica_records`, gathered
        from all processes in replica order) it holds every replica of the run, else this process's."""
        replicas = list(self.replicas) if records is None else list(range(len(records)))
        records = self.replica_records() if records is None else records
        mid = self.mid_round
        return {
            "theta": self.theta,
            "outer_momentum": self.outer.momentum,
            "inner": [r["inner"] for r in records],
            "replicas": replicas,
            "next_update": self.next_update,
            "rounds_done": self.rounds_done,
            "totals": vars(self.totals).copy(),
            "round_first": self.round_first,
            "round_params": [r["params"] for r in records] if mid else None,
            "round_stepped": [r["stepped"] for r in records] if mid else None,
        }

    @torch.no_grad()
    def load_state_dict(self, saved: dict) -> None:
        """Copy `saved` (from `state_dict`; it may hold more replicas, e.g. every replica of a run
        whose processes held a few each) into this state in place: this process's replicas only."""
        where = {m: i for i, m in enumerate(saved["replicas"])}
        missing = [m for m in self.replicas if m not in where]
        if missing:
            raise ValueError(f"the saved state holds replicas {saved['replicas']}, not {missing}")
        for name, t in self.theta.items():
            t.copy_(saved["theta"][name])
            self.outer.momentum[name].copy_(saved["outer_momentum"][name])
        for state, kept in zip(self.inner, (saved["inner"][where[m]] for m in self.replicas), strict=True):
            for moments in ("m", "v"):
                for name, t in getattr(state, moments).items():
                    t.copy_(kept[moments][name])
            state.step.copy_(kept["step"])
        self.next_update, self.rounds_done = int(saved["next_update"]), int(saved["rounds_done"])
        self.totals = Totals(**saved["totals"])
        self.round_first = int(saved.get("round_first", self.next_update))  # older: boundaries only
        self.round_params = self.round_stepped = None
        if saved.get("round_params") is not None:
            device = next(iter(self.theta.values())).device
            self.round_params = [
                {n: t.to(device) for n, t in saved["round_params"][where[m]].items()} for m in self.replicas
            ]
            self.round_stepped = [bool(saved["round_stepped"][where[m]]) for m in self.replicas]
