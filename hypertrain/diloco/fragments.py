"""Streaming DiLoCo's fragments and schedule (Douillard et al. 2025, arXiv:2501.18512, Section 2;
torchft's `DiLoCo(model_fragments=...)` orders them the same way): which parameters each of the P
fragments holds, and at which update counts a fragment's pseudo-gradient is taken and its sync lands.

Counts are updates done since the phase's start (update u, 0-based, ends at count u + 1). Fragment p
lands after counts k*H + (p+1)*H/P and is taken tau counts before; the phase's end flushes every
fragment in order 0..P-1 (`Schedule.events`). P = 1, tau = 0 is DiLoCo's one sync per round of H.
Rounds are of H unless the outer.schedule entry ends them elsewhere (`ScheduleEntry.round_at`, an entry
from outside the package: a round of length L then stands for H above).
With outer.overlap a fragment's landing at its sync point lands the sync taken at its previous one (a
whole period in flight), and the phase's end lands the last one too (FLUSH, after every fragment's
take and landing).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypertrain.config import TrainConfig, UserError
from hypertrain.model.spec import AFTER, BEFORE, model_spec
from hypertrain.schedule_table import BEFORE as FIRST_SCHEDULE
from hypertrain.schedule_table import TABLE, ScheduleEntry, schedule_entry

TAKE, LAND, FLUSH = "take", "land", "flush"


def fragment_of(cfg: TrainConfig, names=None) -> dict[str, int]:
    """Parameter name -> fragment, for the model's parameters (or `names`), by the place the model gives
    each (`model.spec`): layer i in fragment i mod P, what comes before the layers (the embeddings) in
    fragment 0, what comes after them (the final norm and the heads) in fragment P - 1. A parameter
    the model does not place is refused (UserError), never put in a fragment by default."""
    P, spec = cfg.outer.fragments, model_spec(cfg.model)
    places = spec.places(cfg.model, spec.param_specs(cfg.model) if names is None else names)
    ends = {BEFORE: 0, AFTER: P - 1}
    return {name: ends[place] if place in ends else place % P for name, place in places.items()}


def members(cfg: TrainConfig) -> list[list[str]]:
    """Each fragment's parameter names, in the model's parameter order."""
    where = fragment_of(cfg)
    return [[n for n, f in where.items() if f == p] for p in range(cfg.outer.fragments)]


def assignment(cfg: TrainConfig) -> list[str]:
    """What the run's config records (`outer.assignment`): per fragment, its layers and the rest."""
    out = []
    spec = model_spec(cfg.model)
    for names in members(cfg):
        places = spec.places(cfg.model, names)
        layers = sorted({place for place in places.values() if place not in (BEFORE, AFTER)})
        rest = [n for n in names if places[n] in (BEFORE, AFTER)]
        out.append(" ".join([*(f"layer{i}" for i in layers), *rest]))
    return out


def check(cfg: TrainConfig) -> None:
    """outer.fragments divides inner.H, leaves no fragment empty, and outer.delay < H/P."""
    P, tau, H = cfg.outer.fragments, cfg.outer.delay, cfg.inner.H
    if H % P:
        raise UserError(f"outer.fragments={P} does not divide inner.H={H}; valid: a divisor of {H}")
    layers = model_spec(cfg.model).layers(cfg.model)
    if P > 1 and P > layers + 1:
        raise UserError(
            f"outer.fragments={P} leaves a fragment without parameters (model.n_layers="
            f"{layers}); valid: 1..{layers + 1}"
        )
    if tau >= H // P:
        raise UserError(
            f"outer.delay={tau} is out of range; valid: 0..{H // P - 1} (below inner.H/outer.fragments "
            f"= {H // P})"
        )


@dataclass(frozen=True)
class Schedule:
    """The streaming schedule of a phase of `updates` updates. Its rounds are the schedule entry's
    (`entry.round_at`: rounds of H, or an entry's own from outside the package); each round's length a
    multiple of P, and tau below its length / P."""

    H: int
    P: int
    tau: int
    updates: int
    overlap: bool = False  # outer.overlap: each fragment's last sync lands at the phase's end (FLUSH)
    entry: ScheduleEntry = TABLE[FIRST_SCHEDULE]  # outer.schedule's: where its rounds end

    @classmethod
    def of(cls, cfg: TrainConfig, updates: int) -> Schedule:
        overlap = cfg.outer.overlap != "none"
        entry = schedule_entry(cfg.outer.schedule)
        return cls(cfg.inner.H, cfg.outer.fragments, cfg.outer.delay, updates, overlap, entry)

    def round_of(self, u: int) -> tuple[int, int]:
        """The round holding update u (0-based): its first update and its length."""
        return self.entry.round_at(self.H, u)

    def land_in(self, p: int, start: int, length: int) -> int:
        """The count after which fragment p's sync of the round (`start`, `length`) lands."""
        return start + (p + 1) * (length // self.P)

    def events(self, count: int) -> list[tuple[str, int]]:
        """What happens after `count` updates, in order: (TAKE or LAND, fragment). A landing at a count
        comes before a take (with tau = 0 a fragment is taken and lands at once); at most one fragment
        is in flight at a time. At the phase's end every fragment that did not just land is flushed,
        in fragment order: one taken earlier lands with what it took; the others are taken and land."""
        out: list[tuple[str, int]] = []
        if count <= 0 or count > self.updates:
            return out
        start, length = self.round_of(count - 1)
        offset, stride = count - start, length // self.P  # the count within its round, 1..length
        if offset % stride == 0:
            p = offset // stride - 1
            if self.tau == 0:
                out.append((TAKE, p))
            out.append((LAND, p))
        if count == self.updates:  # the flush: a take due now is made just before its landing
            landed = {p for kind, p in out if kind == LAND}
            for p in range(self.P):
                if p not in landed:
                    out += [(LAND, p)] if self._in_flight(p, count) else [(TAKE, p), (LAND, p)]
            if self.overlap:
                out += [(FLUSH, p) for p in range(self.P)]
        elif self.tau and (offset + self.tau) % stride == 0:
            out.append((TAKE, (offset + self.tau) // stride - 1))
        return out

    def _in_flight(self, p: int, count: int) -> bool:
        """Whether fragment p was taken at a count < `count` and has not landed by it."""
        if not self.tau:
            return False
        start, length = self.round_of(count - 1)  # the round `count` lies in
        for round_start, round_length in ((start, length), self.round_of(start + length)):
            land = self.land_in(p, round_start, round_length)
            if land - self.tau < count < land:
                return True
        return False

    def next_cut(self, count: int) -> int:
        """The first count after `count` at which something happens (a take, a land, the end)."""
        c = count + 1
        while c < self.updates and not self.events(c):
            c += 1
        return min(c, self.updates)

    def previous_land(self, count: int) -> int:
        """The count of the last regular landing before `count` (0 at the phase's start)."""
        start, length = self.round_of(count - 1)
        stride = length // self.P
        return start + (count - 1 - start) // stride * stride

    def is_period_end(self, count: int) -> bool:
        """A round ends here (or the phase does): the held-out eval and checkpoints."""
        return count == self.updates or sum(self.round_of(count - 1)) == count

    def since_land(self, u: int) -> tuple[int, ...]:
        """Update u's (0-based) step within each fragment's own round: updates since the fragment's
        last landing (the phase's start if none); what the lr's re-warmup counts."""
        start, length = self.round_of(u)
        out = []
        for p in range(self.P):
            last = self.land_in(p, start, length)  # p's landing in u's round, else in the round before
            if last > u:
                last = self.land_in(p, *self.round_of(start - 1)) if start else 0
            out.append(u - last)
        return tuple(out)

    def window(self, p: int, count: int) -> range:
        """The updates (0-based) since fragment p's last landing before `count`, up to `count`: the
        steps a pseudo-gradient of p taken at `count` holds (what churn's goodput and ids digest count)."""
        return range(count - 1 - self.since_land(count - 1)[p], count)
