"""`Arrivals`: outer.schedule=async as `train`'s schedule, the server updates
(`diloco.asynchrony.asynchronous`) and
their records: an `arrival` row per server update, the held-out loss of the
server's weights whenever the jobs applied reach a multiple of outer.arrivals.eval_every (and after the
last), under the divergence guard (its held-out verdict, then the applied pseudo-gradient's ratio to the
weights), the outer bytes counted (`moved_bytes`), the network clock fed, the checkpoints asked for,
a stop after the update a signal arrived in; then the run's `async/` summary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

from hypertrain.diloco.asynchrony.arrivals import Job, ServerUpdate
from hypertrain.diloco.asynchrony.asynchronous import server_updates
from hypertrain.diloco.guard import HELDOUT_NON_FINITE, heldout_verdict, pseudo_grad_verdict, stop_on_verdict
from hypertrain.diloco.state import Totals
from hypertrain.failures import signals
from hypertrain.records.rows import ArrivalRow
from hypertrain.run.evaluation import heldout_eval
from hypertrain.run.schedule import ScheduleBase


def last_loss(losses: list[float | None]) -> float | None:
    """A job's training loss at its last step that trained (None: no step did)."""
    return next((x for x in reversed(losses) if x is not None), None)


def moved_bytes(totals: Totals, row: ArrivalRow, n_params: int) -> None:
    """Count `row`'s jobs' outer bytes into `totals` by the report's rule (`ArrivalRow.moved`; docs/async.md
    "Records and checkpoints"): `comm_outer_bits` takes each replica's uploads applied, `async_moved_bytes`
    its uploads and downloads, `comm_outer_bytes` the most one replica moved, `comm_outer_peak` the most
    one job moved."""
    if totals.comm_outer_bits is not None:
        for m, bits in zip(row.replicas, row.payload_bits, strict=True):
            totals.comm_outer_bits[m] += bits
    for m, moved in row.moved(n_params):
        if totals.async_moved_bytes is not None:
            totals.async_moved_bytes[m] += moved
        totals.comm_outer_peak = max(totals.comm_outer_peak, moved)
    if totals.async_moved_bytes is not None:
        totals.comm_outer_bytes = max(totals.async_moved_bytes)


def away_fields(update: ServerUpdate) -> tuple[list[dict], list[dict]]:
    """The arrival row's `absent` and `dropped`: the update's jobs that did not arrive, each its replica,
    job number (1-based), first step and steps."""

    def of(job: Job) -> dict:
        return {"replica": job.replica, "job": job.index, "first": job.first, "steps": job.steps}

    return [of(j) for j in update.away if j.absent], [of(j) for j in update.away if j.dropped]


def churn_figures(totals) -> dict:
    """An asynchronous run's churn figures (docs/async.md, "Churn with async"): its absent and dropped
    jobs, goodput (replica-steps that reached the server / replica-steps computed: a dropped job's were
    computed and thrown away, an absent job's never computed) and the sha256 of the ids that reached it."""
    return {
        "async/absent_jobs": totals.churn_absent,
        "async/dropped_jobs": totals.churn_missed,
        "churn/goodput": totals.replica_steps_reached / totals.replica_steps if totals.replica_steps else 1.0,
        "churn/contributed_ids_sha256": totals.contributed_sha256,
    }


class Arrivals(ScheduleBase):
    """outer.schedule=async: the server updates from `state` on (`rows`), after each a stop signal
    calling `on_stop(signum, last)` (a checkpoint, then `Preempted`). `eval_loss` is the held-out loss so
    far, then the last. On real processes (`groups`) the writer evaluates and its rows are written; every
    process agrees the guard's verdict and a stop. The writer's network clock (`state.clock`) stands at
    each update's arrival clock and keeps the held-out losses (`Clock.arrival`, `Clock.heldout`), so the
    run's `clock/` summary is the replay of its rows."""

    def __init__(self, *args):
        super().__init__(*args)
        self.clock_s, self.seconds, self.steps = 0.0, 0.0, 0

    def rows(self, progress, throughput, start: float) -> Iterator[ArrivalRow]:
        """An `arrival` row per server update (none where its held-out loss is non-finite: JSON has no
        NaN, the end row holds the line), each yielded before the guard's verdict on it. The rounds'
        `progress` and `throughput` see no updates here; this session is timed from its first update."""
        run, state, groups, checkpointer = self.run, self.state, self.groups, self.checkpointer
        cfg = run.cfg
        clock = state.clock if groups.is_writer else None
        every = cfg.outer.arrivals.eval_every or cfg.replicas
        start = time.perf_counter()
        n_params = sum(t.numel() for t in state.theta.values())
        for applied in server_updates(run, state, groups=groups):
            update = applied.update
            stale = update.staleness
            row = ArrivalRow(
                update=update.index,
                replicas=[job.replica for job in update.jobs],
                steps=[job.steps for job in update.jobs],
                first=[job.first for job in update.jobs],
                tokens=[job.tokens for job in update.jobs],
                staleness=stale,
                loss=[last_loss(losses) for losses in applied.losses],
                payload_bits=applied.bits,
                pseudo_grad_norm=applied.delta_norm if math.isfinite(applied.delta_norm) else None,
                staleness_mean=sum(stale) / len(stale),
                clock_s=update.clock_s,
            )
            if cfg.churn.enabled:
                row.absent, row.dropped = away_fields(update)
            self.clock_s = update.clock_s
            self.steps += sum(job.steps for job in update.jobs)
            jobs = state.totals.async_jobs  # applied so far, this update's included
            if (jobs // every > (jobs - len(stale)) // every or applied.last) and groups.is_writer:
                self.eval_loss = heldout_eval(run, state.theta)[0]
                row.eval_loss = self.eval_loss
            if clock is not None:  # before the checkpoint below, which saves the clock
                clock.arrival(update.clock_s)
                clock.heldout(row.eval_loss)
            after = f"server update {update.index}"
            verdict, why = heldout_verdict(run, row.eval_loss, after)
            if not verdict:  # the same figures on every process: their verdicts agree
                verdict, why = pseudo_grad_verdict(run, applied.delta_norm, applied.theta_norm, after)
            moved_bytes(state.totals, row, n_params)
            if verdict != HELDOUT_NON_FINITE:  # JSON has no NaN: the end row holds the line
                yield row
            stop_on_verdict(
                groups.max_over_processes(verdict) if groups.size > 1 else verdict, verdict, why, after
            )
            if checkpointer is not None:
                checkpointer.after_sync(state, last=applied.last)
            signum = signals.requested() or 0
            if groups.size > 1:
                signum = groups.max_over_processes(signum)
            if signum:
                self.on_stop(signum, applied.last)
        self.seconds = time.perf_counter() - start

    def summary(self) -> dict:
        """The run's `async/` summary (and its churn's, with churn)."""
        cfg, totals, seconds = self.run.cfg, self.state.totals, self.seconds
        summary = {
            # this session's inner steps (jobs are computed when pulled, so counted at their arrival) over
            # its seconds: the rounds' window figures have no updates to time here
            "train/replica_steps_per_s": self.steps / seconds if seconds else 0.0,
            "train/timed_s": seconds,
            "async/server_updates": self.state.next_update,
            "async/arrivals": totals.async_jobs,
            "async/staleness_mean": totals.async_staleness_sum / totals.async_jobs
            if totals.async_jobs
            else 0.0,
            "async/staleness_max": totals.async_staleness_max,
            "async/payload_bits": totals.async_payload_bits,  # the phase's arrivals', all sessions
            "async/clock_s": self.clock_s if self.clock_s else None,  # None: this session applied none
        }
        if cfg.churn.enabled:
            summary |= churn_figures(totals)
        return summary
