"""Seeded churn (docs/churn.md; DESIGN.md, "Churn"): which replicas train and contribute in every round.

`Schedule.of(churn, replicas, rounds)` is a pure function of the config, so every engine and every
process computes the same one and a resumed run recomputes it. Round k (1-based: the updates
(k-1)H .. kH-1) and replica m, in order k = 1, 2, ...:
1. hand events of round k first: `rejoin` ends any absence (hand-written or drawn), `leave` starts a
   hand-written absence that lasts until a `rejoin`;
2. `rng = numpy.random.default_rng([seed, k])` draws `u = rng.random((2, R))` and
   `g = rng.geometric(1 / mean_absence, R)`, every round, whatever happens to them;
3. a replica absent (by hand, or drawn earlier and not over: round < its drawn return) is ABSENT;
   else it leaves when `u[0, m] < p_leave`, ABSENT for rounds k .. k + g[m] - 1; else it MISSES when
   `u[1, m] < p_miss` or a hand `miss` names it; else it is PRESENT.
A replica is *rejoining* in round k when it is not absent in k and was absent in k - 1.

Every sync landing in round k uses round k's statuses (with Streaming DiLoCo's fragments, each of the P
fragment syncs of the round, its take and its landing both lie in the round): its contributors are the
present replicas with ids since the fragment's last landing (`RoundFacts`); below the quorum that
fragment's sync is skipped and waits for its next period. Schedules advance by update count. With
`churn.deadline`, `Churn` also stops each replica after the inner steps it finishes by the deadline.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from hypertrain import plan
from hypertrain.clock.formulas import modelled_compute_s
from hypertrain.clock.timeline import straggler_factors
from hypertrain.config import ChurnConfig
from hypertrain.data.batches import targets_of
from hypertrain.model.shapes import active_params
from hypertrain.optim.inner import OptState

PRESENT, MISS, ABSENT = "present", "miss", "absent"


@dataclass(frozen=True)
class Schedule:
    status: tuple[tuple[str, ...], ...]  # [round - 1][replica]

    @classmethod
    def of(cls, churn: ChurnConfig, replicas: int, rounds: int) -> Schedule:
        """The statuses of `rounds` rounds of `replicas` replicas, by the rule in the module docstring."""
        hand: dict[int, list[tuple[int, str]]] = {}
        for k, m, event in churn.parsed_events():
            hand.setdefault(k, []).append((m, event))
        by_hand = [False] * replicas  # a hand-written absence in progress
        back_at = [0] * replicas  # a drawn absence lasts until this round (exclusive)
        status = []
        for k in range(1, rounds + 1):
            missed = set()
            for m, event in hand.get(k, []):
                if event == "rejoin":
                    by_hand[m], back_at[m] = False, 0
                elif event == "leave":
                    by_hand[m] = True
                else:
                    missed.add(m)
            rng = np.random.default_rng([churn.seed, k])
            u = rng.random((2, replicas))
            g = rng.geometric(1.0 / churn.mean_absence, replicas)
            row = []
            for m in range(replicas):
                if by_hand[m] or k < back_at[m]:
                    row.append(ABSENT)
                elif u[0, m] < churn.p_leave:
                    back_at[m] = k + int(g[m])
                    row.append(ABSENT)
                elif u[1, m] < churn.p_miss or m in missed:
                    row.append(MISS)
                else:
                    row.append(PRESENT)
            status.append(tuple(row))
        return cls(tuple(status))

    def of_round(self, k: int) -> tuple[str, ...]:
        """Round k's statuses (1-based); rounds past the schedule are all present."""
        if 1 <= k <= len(self.status):
            return self.status[k - 1]
        return (PRESENT,) * (len(self.status[0]) if self.status else 0)

    def absent(self, k: int, m: int) -> bool:
        return self.of_round(k)[m] == ABSENT

    def contributes(self, k: int, m: int) -> bool:
        return self.of_round(k)[m] == PRESENT

    def rejoining(self, k: int, m: int) -> bool:
        return k > 1 and not self.absent(k, m) and self.absent(k - 1, m)


def chain_digest(previous: str, facts: RoundFacts, fragments: int = 1) -> str:
    """The running sha256 of the ids whose pseudo-gradients reached a sync: the previous digest, the
    round (and with several fragments the fragment) and, per contributing replica in order, its index
    and its ids (int64) at each update of the sync's window."""
    head = f"round {facts.k}" + (f"fragment {facts.fragment}" if fragments > 1 else "")
    return ids_digest(previous, head, facts.ids)


def ids_digest(previous: str, head: str, ids: dict[int, list[np.ndarray]]) -> str:
    """sha256 over the previous digest, `head`, and per replica in order its index and its ids (int64)
    at each of its steps (`chain_digest`'s, and an asynchronous server update's)."""
    h = hashlib.sha256(previous.encode())
    h.update(head.encode())
    for m in sorted(ids):
        h.update(f"replica {m}".encode())
        for step in ids[m]:
            h.update(np.asarray(step, dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()


def count_arrivals(totals, update, replica_ids) -> None:
    """Churn's figures of an asynchronous server update (`arrivals.ServerUpdate`, docs/async.md "Churn
    with async") added to the run's `totals`: its absent and dropped jobs (`churn_absent`,
    `churn_missed`), a dropped job's steps and tokens as computed (`replica_steps`, `tokens`: its
    arrivals' are counted already), the arrivals' steps as reached (`replica_steps_reached`), and the ids
    digest chained over the update's index and each arrival's ids (`replica_ids(k, m)`: the plan's ids of
    replica m's step k)."""
    dropped = [job for job in update.away if job.dropped]
    totals.churn_absent += sum(job.absent for job in update.away)
    totals.churn_missed += len(dropped)
    totals.replica_steps += sum(job.steps for job in dropped)
    totals.tokens += sum(job.tokens for job in dropped)
    totals.replica_steps_reached += sum(job.steps for job in update.jobs)
    ids = {job.replica: [replica_ids(k, job.replica) for k in job.updates] for job in update.jobs}
    totals.contributed_sha256 = ids_digest(totals.contributed_sha256, f"update {update.index}", ids)


@dataclass
class RoundFacts:
    """What churn decided for one sync of round k (of `fragment`): the replicas whose pseudo-gradients
    reach it (present, with ids in its window: the updates since the fragment's last landing; none when
    `skipped`, fewer than the quorum), the round's absent and missing ones, each contributor's steps and
    ids in the window (for goodput and the ids digest), and the round's replicas the deadline stopped
    before the round's last update (`late`)."""

    k: int
    contributors: list[int]
    absent: list[int]
    missed: list[int]
    skipped: bool
    steps: dict[int, int] = field(default_factory=dict)
    ids: dict[int, list[np.ndarray]] = field(default_factory=dict)
    fragment: int = 0
    late: list[int] = field(default_factory=list)  # present, but stopped by the deadline in the round

    def row(self) -> dict:
        """The sync row's churn fields."""
        return {
            "contributors": self.contributors,
            "absent": self.absent,
            "missed": self.missed,
            "late": self.late,
            "skipped": self.skipped,
        }


class Churn:
    """A run's churn: the schedule's statuses and, with `churn.deadline` (seconds of the network clock's
    modelled compute from a round's start), the inner steps each replica finishes in a round: replica m's
    step at update u takes `modelled_compute_s(params, its targets at u) * f[k, m]`, f the round's
    straggler factors (`clock.timeline.straggler_factors`), and it stops after the last step that ends
    by the deadline. Every process computes the same, from the config, the plan and the data's lengths."""

    def __init__(self, run, schedule: Schedule):
        self.run, self.schedule = run, schedule
        self._finished: dict[int, tuple[int, ...]] = {}

    @classmethod
    def of(cls, run) -> Churn | None:
        """The run's churn over its phase (ceil(updates / H) rounds); None without churn."""
        cfg = run.cfg
        if not cfg.churn.enabled:
            return None
        return cls(run, Schedule.of(cfg.churn, cfg.replicas, -(-run.updates // cfg.inner.H)))

    def round_updates(self, k: int) -> range:
        """Round k's updates (0-based plan indices)."""
        H = self.run.cfg.inner.H
        return range((k - 1) * H, min(k * H, self.run.updates))

    def finished(self, k: int) -> tuple[int, ...]:
        """The inner steps each replica finishes in round k by the deadline (all of them without one)."""
        if k not in self._finished:
            self._finished[k] = self._by_deadline(k)
        return self._finished[k]

    def _by_deadline(self, k: int) -> tuple[int, ...]:
        run, cfg = self.run, self.run.cfg
        updates, R, deadline = self.round_updates(k), cfg.replicas, cfg.churn.deadline
        if not deadline:
            return (len(updates),) * R
        cluster, params = cfg.cluster, active_params(cfg.model)
        factors = straggler_factors(cluster.straggler, k, R)
        out = []
        for m in range(R):
            seconds, n = 0.0, 0
            for u in updates:
                targets = targets_of(run.dataset, plan.replica_ids(run.phase, u, m, R, run.samples))
                seconds += modelled_compute_s(params, targets, cluster.peak_flops, cluster.mfu) * factors[m]
                if seconds > deadline:
                    break
                n += 1
            out.append(n)
        return tuple(out)

    def trains(self, u: int, m: int) -> bool:
        """Whether replica m trains update u (0-based): not absent in its round, within the deadline."""
        k = u // self.run.cfg.inner.H + 1
        return not self.schedule.absent(k, m) and u - self.round_updates(k)[0] < self.finished(k)[m]

    def round_start(self, state, replicas: list[int], updates: range) -> frozenset[tuple[int, int]]:
        """Before a segment `updates` of round `state.rounds_done + 1`: the (update, replica) pairs that
        train nothing (absent, or past the deadline: they get no batches); at the round's first update,
        the local `replicas` rejoining in it get a fresh inner state with `churn.rejoin_state=reset`."""
        k = state.rounds_done + 1
        if state.next_update == state.round_first and self.run.cfg.churn.rejoin_state == "reset":
            for i, m in enumerate(replicas):
                if self.schedule.rejoining(k, m):
                    reset_inner_state(state.inner[i])
        R = self.run.cfg.replicas
        return frozenset((u, m) for u in updates for m in range(R) if not self.trains(u, m))

    def facts(self, k: int, updates: range, fragment: int = 0) -> RoundFacts:
        """The facts of a sync of round k whose pseudo-gradients hold `updates` (0-based plan indices,
        the fragment's window). A replica trained its ids of the window's updates it `trains`; a present
        replica with none (past the stream's end, or none by the deadline) contributes nothing."""
        run, cfg = self.run, self.run.cfg
        R, status, full = cfg.replicas, self.schedule.of_round(k), len(self.round_updates(k))

        def trained(u: int, m: int) -> np.ndarray:  # a window may reach back into the previous round
            ids = plan.replica_ids(run.phase, u, m, R, run.samples)
            return ids if self.trains(u, m) else ids[:0]

        ids = {m: [trained(u, m) for u in updates] for m in range(R)}
        stepping = [m for m in range(R) if status[m] == PRESENT and any(len(x) for x in ids[m])]
        skipped = len(stepping) < cfg.churn.min_quorum
        contributors = [] if skipped else stepping
        return RoundFacts(
            k,
            contributors,
            [m for m in range(R) if status[m] == ABSENT],
            [m for m in range(R) if status[m] == MISS],
            skipped,
            {m: sum(1 for x in ids[m] if len(x)) for m in contributors},
            {m: ids[m] for m in contributors},
            fragment,
            [m for m in range(R) if status[m] != ABSENT and self.finished(k)[m] < full],
        )


@torch.no_grad()
def restart_others(
    facts: RoundFacts, theta: dict, names: list[str], params: list[dict], replicas: list[int]
) -> None:
    """With a merge alpha (the replicas keep their weights across a sync): every local replica that did
    not contribute to the sync takes the new global weights `theta` of the synced parameters `names`."""
    for i, m in enumerate(replicas):
        if m not in facts.contributors:
            for n in names:
                params[i][n][0].copy_(theta[n])


@torch.no_grad()
def reset_inner_state(state: OptState) -> None:
    """A rejoining replica's fresh inner optimizer state (churn.rejoin_state=reset): zero moments and
    step counts, as at the phase's start."""
    torch._foreach_zero_([*state.m.values(), *state.v.values()])
    state.step.zero_()
