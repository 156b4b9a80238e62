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
fragment's sync is skipped and waits for its next period. Schedules advance by update count.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from hypertrain import plan
from hypertrain.config import ChurnConfig
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


def schedule_for(cfg, updates: int) -> Schedule | None:
    """The run's churn schedule over its phase (ceil(updates / H) rounds); None without churn."""
    if not cfg.churn.enabled:
        return None
    H = cfg.inner.H
    return Schedule.of(cfg.churn, cfg.replicas, -(-updates // H))


def chain_digest(previous: str, facts: RoundFacts, fragments: int = 1) -> str:
    """The running sha256 of the ids whose pseudo-gradients reached a sync: the previous digest, the
    round (and with several fragments the fragment) and, per contributing replica in order, its index
    and its ids (int64) at each update of the sync's window."""
    h = hashlib.sha256(previous.encode())
    h.update(f"round {facts.k}".encode())
    if fragments > 1:
        h.update(f"fragment {facts.fragment}".encode())
    for m in sorted(facts.ids):
        h.update(f"replica {m}".encode())
        for ids in facts.ids[m]:
            h.update(np.asarray(ids, dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()


@dataclass
class RoundFacts:
    """What churn decided for one sync of round k (of `fragment`): the replicas whose pseudo-gradients
    reach it (present, with ids in its window: the updates since the fragment's last landing; none when
    `skipped`, fewer than the quorum), the round's absent and missing ones, each contributor's steps and
    ids in the window (for goodput and the ids digest)."""

    k: int
    contributors: list[int]
    absent: list[int]
    missed: list[int]
    skipped: bool
    steps: dict[int, int] = field(default_factory=dict)
    ids: dict[int, list[np.ndarray]] = field(default_factory=dict)
    fragment: int = 0

    def row(self) -> dict:
        """The sync row's churn fields."""
        return {
            "contributors": self.contributors,
            "absent": self.absent,
            "missed": self.missed,
            "skipped": self.skipped,
        }


def round_facts(run, schedule: Schedule, k: int, updates: range, fragment: int = 0) -> RoundFacts:
    """The facts of a sync of round k whose pseudo-gradients hold `updates` (0-based plan indices, the
    fragment's window): every process computes the same, from the schedule and the plan alone. A replica
    trained its ids of the window's updates in rounds it was not absent in; a present replica with none
    (past the stream's end) contributes nothing, as without churn."""
    cfg = run.cfg
    R, status = cfg.replicas, schedule.of_round(k)
    H = cfg.inner.H

    def trained(u: int, m: int) -> np.ndarray:  # a window may reach back into a round m was absent in
        ids = plan.replica_ids(run.phase, u, m, R, run.samples)
        return ids[:0] if schedule.absent(u // H + 1, m) else ids

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
    )


def round_start(cfg, schedule: Schedule, state, replicas: list[int]) -> frozenset[int]:
    """Before a segment of round `state.rounds_done + 1`: the replicas absent in it (they get no
    batches); at the round's first update, the local `replicas` rejoining in it get a fresh inner
    state with `churn.rejoin_state=reset`."""
    k = state.rounds_done + 1
    if state.next_update == state.round_first and cfg.churn.rejoin_state == "reset":
        for i, m in enumerate(replicas):
            if schedule.rejoining(k, m):
                reset_inner_state(state.inner[i])
    return frozenset(m for m in range(cfg.replicas) if schedule.absent(k, m))


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
