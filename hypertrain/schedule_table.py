"""The schedule table (docs/extending.md, "A schedule"): every `outer.schedule` value is one entry,
registered once in `TABLE`, declaring what the rest of the code asks of it (a server, a clock that orders
its arrivals, the node of its own outer fields, the run-side class that runs it) and refusing what it is
not built with (`check`); `choices.Schedule` is read from it, and the rest of the code asks an
entry (`schedule_entry(name)`), never compares a name. `outer.schedule` also takes the import path
(module.NAME) of an entry defined outside the package (`imported`; docs/extending.md, "A schedule").

Imports nothing of hypertrain but `errors` and `import_path`, and no torch (the config's enum and
refusals come from here): an entry's `build` imports its run-side class (`runs`, an import path into
`hypertrain.run`) only when a run is built.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass

from hypertrain.errors import UserError
from hypertrain.import_path import entry_at, is_import_path


@dataclass(frozen=True)
class ScheduleEntry:
    """A table entry: `name` (its `outer.schedule` value) and what it is.

    - `server`: a server applies each replica's pseudo-gradient as it arrives: the outer step is the
      server's rule (outer.arrivals.rule's entry, `optim.outer.outer_optimizer`), the run state holds the
      server's buffer and the jobs in flight (`diloco.asynchrony.server.AsyncState`, one fragment), its rows
      are
      `arrival` rows, and a restarted session counts what it runs again in server updates and jobs
      (`run.session.restart_here`); else the syncs of rounds (one outer state per fragment);
    - `arrival_clock`: the network clock orders its pseudo-gradients, so the clock decides its weights:
      its replay is `clock.replay.arrival_clock`, its clock keeps no compute/inner/outer split, and
      re-timing it on another cluster is refused (`clock.replay.decided_by_clock`);
    - `node`: the outer field holding its own typed config (`config.OUTER_NODES`), which exists with it
      alone: None under another schedule, and a field of it set there is one that schedule lacks;
    - `runs`: its run-side class, `module:Class`, built by `build` (`run.schedule.ScheduleBase`'s
      arguments): it yields the rows `run.trainer.train` writes, then its part of the summary;
    - `round_at(H, u)`: the round of rounds' run-side class holding update u (`diloco.fragments.Schedule`
      asks it where rounds end, so where syncs land): rounds of inner.H by default.
    """

    name: str
    runs: str
    server: bool = False
    arrival_clock: bool = False
    node: str = ""

    def round_at(self, H: int, u: int) -> tuple[int, int]:
        """The round holding update `u` (0-based, counted from the phase's start; `H` is inner.H): its first
        update and its length. Rounds of H: syncs after counts H, 2H, ... (and the phase's end)."""
        return u // H * H, H

    def check(self, cfg) -> None:
        """What this schedule is not built with across the config's sections (`cfg` a `TrainConfig`);
        UserError, one line. Asked by `preflight.checks.validate`."""

    def build(self, *args):
        """The run-side object (`runs`) for `train`: built from the run, its state, the process groups,
        the checkpointer, the stop callback and the held-out loss and sources so far."""
        module, _, attribute = self.runs.partition(":")
        return getattr(importlib.import_module(module), attribute)(*args)


@dataclass(frozen=True)
class Rounds(ScheduleEntry):
    """outer.schedule=rounds: every replica syncs at a round's end (DiLoCo), or each of outer.fragments
    fragments once per round (Streaming DiLoCo), with outer.delay, outer.merge_alpha and outer.overlap.
    A subclass (an entry from outside, docs/extending.md) inherits its run-side class, its fields and its
    refusals, and may override `round_at` (where its rounds end) and `check`."""

    runs: str = "hypertrain.run.trainer:Rounds"

    def check(self, cfg) -> None:
        outer = cfg.outer
        if outer.mean_weights == "tokens" and outer.overlap == "eager":
            raise UserError(
                "outer.mean_weights=tokens with outer.overlap=eager under outer.schedule=rounds is not built "
                "(its own fresh and stale terms are weighted 1/R); valid: outer.mean_weights=uniform, or "
                "outer.overlap=none|delayed"
            )


@dataclass(frozen=True)
class Arrivals(ScheduleEntry):
    """outer.schedule=async (docs/async.md): each replica's job of H_m inner steps from the weights it
    pulled; its pseudo-gradient is applied when the network clock says it arrives; no round, no barrier."""

    def check(self, cfg) -> None:
        """The clock decides its weights, so its compute is modelled; what needs a round (fragments,
        overlap, delay, merge, mid-round checkpoints, churn's quorum and deadline) is not built; delayed
        Nesterov's activation fits its buffer."""
        outer = cfg.outer
        if cfg.cluster.compute != "modelled":
            raise UserError(
                f"outer.schedule=async needs modelled compute, not cluster.compute={cfg.cluster.compute!r} "
                "(the clock decides the weights); valid: cluster.compute=modelled (e.g. cluster=h100)"
            )
        unbuilt = [
            (outer.fragments > 1, f"outer.fragments={outer.fragments}"),
            (outer.overlap != "none", f"outer.overlap={outer.overlap}"),
            (bool(outer.delay), f"outer.delay={outer.delay}"),
            (bool(outer.merge_alpha), f"outer.merge_alpha={outer.merge_alpha!r}"),
            (outer.codec.reduce != "gather", f"outer.codec.reduce={outer.codec.reduce}"),  # one payload whole
            (bool(cfg.checkpoint.every_updates), f"checkpoint.every_updates={cfg.checkpoint.every_updates}"),
        ]
        for refused, what in unbuilt:
            if refused:
                raise UserError(
                    f"outer.schedule=async with {what} is not built (docs/async.md); valid: "
                    f"outer.schedule=rounds, or {what.split('=')[0]} at its default"
                )
        # churn's round-bound fields: a quorum skips a sync, a deadline cuts a round; async has neither
        roundly = [
            (cfg.churn.min_quorum > 1, f"churn.min_quorum={cfg.churn.min_quorum}", "a sync to skip", "1"),
            (bool(cfg.churn.deadline), f"churn.deadline={cfg.churn.deadline!r}", "a round to cut", "0"),
        ]
        for refused, what, needs, default in roundly:
            if refused:
                raise UserError(
                    f"outer.schedule=async with {what} is not built (it needs {needs}: docs/async.md, "
                    f"'Churn with async'); valid: {what.split('=')[0]}={default}, or outer.schedule=rounds"
                )
        own = outer.arrivals
        N = own.dn_buffer or cfg.replicas
        if not 0.0 <= own.dn_activation <= 1.0 / N:
            raise UserError(
                f"outer.arrivals.dn_activation={own.dn_activation!r} is out of range; valid: [0, 1/N] = "
                f"[0, {1.0 / N:g}] (N = outer.arrivals.dn_buffer = {N})"
            )


# In `choices.Schedule`'s order. The server's fields are async's node, outer.arrivals (its rule, delayed
# Nesterov's N and c, the grace window, dynamic local updates, its evaluations); outer.codec.reduce's
# two_phase is rounds' alone (an arrival's payload is broadcast whole).
ENTRIES = (
    Rounds("rounds"),
    Arrivals(
        "async",
        runs="hypertrain.run.asynchronous:Arrivals",
        server=True,
        arrival_clock=True,
        node="arrivals",
    ),
)
TABLE: dict[str, ScheduleEntry] = {entry.name: entry for entry in ENTRIES}


# What a run written before outer.schedule existed ran (records.formats upgrades its config to it).
BEFORE = "rounds"


IMPORTED = "the import path (module.NAME) of a hypertrain.schedule_table.ScheduleEntry entry"


def schedule_entry(name: str) -> ScheduleEntry:
    """The entry of `outer.schedule=name` (a `choices.Schedule` member or its str): the table's entry of
    that name, or the entry at the import path `name` (a dot in it; `imported`); UserError for neither."""
    entry = TABLE.get(str(name))
    if entry is not None:
        return entry
    if is_import_path(name):
        return imported(str(name))
    raise UserError(
        f"outer.schedule={str(name)!r} is not a schedule; valid: {', '.join(TABLE)}, or {IMPORTED}"
    )


@functools.cache
def imported(path: str) -> ScheduleEntry:
    """The `ScheduleEntry` at the import path `path` (module.NAME), its `name` made `path` (what the config
    and the records say); UserError (one line) when the path does not import or names no entry."""
    entry = entry_at("outer.schedule", path, ScheduleEntry, "a schedule entry", IMPORTED, UserError)
    return dataclasses.replace(entry, name=path)


def recorded_entry(outer: dict | None) -> ScheduleEntry:
    """The entry of a run's recorded `outer` section (config.yaml's, as plain containers): its
    outer.schedule, or `BEFORE` where it has none."""
    return schedule_entry((outer or {}).get("schedule") or BEFORE)
