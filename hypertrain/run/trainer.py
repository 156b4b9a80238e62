"""`train(run, log)`: one loop over the phase's schedule (the one outer.schedule's entry builds,
`schedule_table`: `Rounds` here, `asynchronous.Arrivals`), writing every row it yields, then one
summary. `Rounds` keeps the rounds' records: a row per update and per sync (`run.records`), the
held-out loss after every sync, the checkpoints the checkpointer asks for, the divergence guard's
verdict, and a stop after the update in flight when a signal arrived. `hypertrain.run.session` wraps
`train` with the run's records.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Iterator

import torch

from hypertrain.clock.timeline import Clock
from hypertrain.diloco.churn import chain_digest
from hypertrain.diloco.exchange.communication import inner_bytes
from hypertrain.diloco.fragments import Schedule
from hypertrain.diloco.guard import HELDOUT_NON_FINITE, stop_on_verdict, sync_verdict
from hypertrain.diloco.rounds import Segment, StopCheck, rounds
from hypertrain.diloco.state import PreparedRun, RunState
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.engines.throughput import Throughput
from hypertrain.failures import restarts, signals
from hypertrain.model.shapes import active_params, count_params
from hypertrain.model.spec import model_spec
from hypertrain.model.transformer import Params
from hypertrain.preflight.prepare import initial_weights
from hypertrain.records.rows import EvalRow, Row, SummaryRow, SyncRow, UpdateRow
from hypertrain.run.evaluation import heldout_eval
from hypertrain.run.progress import Progress
from hypertrain.run.runtime import keep_freed_memory
from hypertrain.run.schedule import ScheduleBase
from hypertrain.rundir import checkpoint
from hypertrain.rundir.checkpoint import Checkpointer
from hypertrain.rundir.records import NoLog, RunLogger
from hypertrain.schedule_table import schedule_entry

logger = logging.getLogger("hypertrain")


def device_name(device: str) -> str:
    """What a run was measured on: the GPU's name, or the CPU's model (for benchmark tables)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    try:
        with open("/proc/cpuinfo") as info:
            model = next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), ""
            )
    except OSError:
        model = ""
    return f"cpu: {model or platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def sync_rows(
    cfg, rnd: Segment, heldout: list[tuple[float, dict]] | None, totals, n_params: int, clock: Clock | None
) -> list[SyncRow]:
    """The rows of the syncs that landed after `rnd`, advancing `totals`: the pseudo-gradient norm, the
    replicas that took part, the formula's bytes (inner: the updates since the previous sync, on the
    first row; outer: what the landing's reducer sent) and what real processes
    measured since the previous landing (the first row's includes the updates' gradient all-reduces),
    the bits per parameter each replica's contribution sent and each replica's running total of bits
    (`Landing.bits`; the total left out of a run resumed from a checkpoint written before it).
    DiLoCo's sync row also holds the held-out loss and figures (a multistream model's per-channel
    held-out losses) of the weights its landing left (`heldout`, one per row, from `row_heldout`; None
    where no round ended); with fragments each row names its fragment and the held-out loss has its
    own row. With `clock` each row gets its simulated seconds (`Clock.sync`)."""
    count = rnd.updates[-1] + 1
    since = count - Schedule.of(cfg, count).previous_land(count)
    rows = []
    streaming = cfg.outer.fragments > 1
    for i, sync in enumerate(rnd.syncs):
        eval_loss, extra = (None, {}) if heldout is None or streaming else heldout[i]
        extra = dict(extra)
        sources = extra.pop("eval_loss_sources", None)  # a field of its own, beside the loss
        inner = inner_bytes(cfg, n_params, since if i == 0 else 0)
        outer = sync.outer_bytes  # what the fragment's reducer sent (the fp32 ring's, or a codec's)
        totals.comm_inner_bytes += inner
        totals.comm_outer_bytes += outer
        totals.comm_outer_peak = max(totals.comm_outer_peak, outer)
        per_param = None
        if sync.bits is not None:
            per_param = [None if bits is None else bits / sync.params for bits in sync.bits]
            if totals.comm_outer_bits is not None:
                totals.comm_outer_bits = [
                    total + (bits or 0) for total, bits in zip(totals.comm_outer_bits, sync.bits, strict=True)
                ]
        elif outer:  # sent, by replicas no record names (an old checkpoint's sync in flight): total unknown
            totals.comm_outer_bits = None
        row = SyncRow(
            update=count,
            round=rnd.index,
            fragment=sync.fragment if cfg.outer.fragments > 1 else None,
            taken_at=sync.taken_at,
            params=sync.params,
            eval_loss=eval_loss,
            eval_loss_sources=sources,
            pseudo_grad_norm=sync.delta_norm,
            replicas_synced=sync.synced,
            comm_inner_bytes=inner,
            comm_outer_bytes=outer,
            comm_inner_total=totals.comm_inner_bytes,
            comm_outer_total=totals.comm_outer_bytes,
            bits_per_param=per_param,
            bits_total=None if totals.comm_outer_bits is None else list(totals.comm_outer_bits),
            outer_spread=sync.outer_spread,
            figures=sync.codec_figures() | sync.measured | extra,
        )
        if sync.churn is not None:  # who contributed, was absent, missed; whether the quorum failed
            facts = sync.churn
            row.figures |= facts.row()
            if facts.fragment == cfg.outer.fragments - 1:  # the round's last sync counts its replicas
                totals.churn_missed += len(facts.missed)
                totals.churn_absent += len(facts.absent)
                totals.churn_late += len(facts.late)
            totals.churn_skipped += int(facts.skipped)
            totals.replica_steps_reached += sum(facts.steps.values())
            totals.contributed_sha256 = chain_digest(totals.contributed_sha256, facts, cfg.outer.fragments)
        if clock is not None:
            row.figures |= clock.sync(row)
            if row.eval_loss is not None:
                clock.heldout(row.eval_loss)
        rows.append(row)
    return rows


def bits_summary(totals) -> dict:
    """The run's outer bits (docs/compression.md, "Bits"): `comm/outer_total_bits`, the most one replica
    sent (every replica's alike without churn), and `comm/outer_replica_bits`, each replica's; none for a
    run resumed from a checkpoint written before they were counted."""
    if totals.comm_outer_bits is None:
        return {}
    return {
        "comm/outer_total_bits": max(totals.comm_outer_bits, default=0),
        "comm/outer_replica_bits": list(totals.comm_outer_bits),
    }


def churn_summary(totals, fragments: int) -> dict:
    """The run's churn under `churn/`: replica-rounds missed, absent and stopped by the deadline (late),
    syncs skipped below the quorum, goodput (replica-steps that reached the global weights / replica-steps
    computed; with P fragments a step reaches each fragment's sync, so it counts 1/P a time) and the
    sha256 of the ids whose pseudo-gradients reached a sync (beside the plan's data-order digest)."""
    computed = totals.replica_steps * fragments
    return {
        "churn/missed_replica_rounds": totals.churn_missed,
        "churn/absent_replica_rounds": totals.churn_absent,
        "churn/skipped_syncs": totals.churn_skipped,
        "churn/late_replica_rounds": totals.churn_late,
        "churn/goodput": totals.replica_steps_reached / computed if computed else 1.0,
        "churn/contributed_ids_sha256": totals.contributed_sha256,
    }


def row_heldout(run: PreparedRun, theta: Params, kept: list[Params | None]) -> list[tuple[float, dict]]:
    """The writer's held-out evaluation (`heldout_eval`) at the end of a round, of the weights each
    landing left: the copy a landing kept (`kept`, whole: `Landing.weights`, another landed after it, as
    outer.overlap's flush after the landing due at the phase's end), else the global weights now; one
    per sync of the round, then the global weights' own last (what the round ends on): `theta`, whole."""
    now = heldout_eval(run, theta)
    return [now if weights is None else heldout_eval(run, weights) for weights in kept] + [now]


def after_syncs(
    run: PreparedRun, state: RunState, rnd: Segment, groups, progress, checkpointer, n_params: int
) -> Iterator[Row]:
    """After the syncs that landed at the end of `rnd`: their rows, and at a round's end the held-out
    loss of the new global weights (the writer) and the checkpoint it asks for. Yields the writer's rows;
    returns the held-out loss (NaN off the writer) and each source's (a prepared corpus of several
    sources, else None); None when no round ended. Each of DiLoCo's sync rows holds the held-out loss
    of the weights its landing left (`row_heldout`). Before the checkpoint every process agrees the
    verdict (`sync_verdict`): a non-finite held-out loss or a divergence stops them all here, the
    writer's rows holding finite figures."""
    cfg = run.cfg
    theta = kept = None
    if rnd.ends_round:  # every process: sharded ones gather
        theta = groups.whole(state.theta)
        kept = [None if sync.weights is None else groups.whole(sync.weights) for sync in rnd.syncs]
    heldout = row_heldout(run, theta, kept) if groups.is_writer and rnd.ends_round else None
    eval_loss, channels = (math.nan, {}) if heldout is None else heldout[-1]
    channels = dict(channels)
    sources = channels.pop("eval_loss_sources", None)
    verdict, why = sync_verdict(run, rnd, [loss for loss, _ in heldout or ()])
    streaming = cfg.outer.fragments > 1
    clock = state.clock if groups.is_writer else None
    rows = sync_rows(cfg, rnd, None if heldout is None else heldout[:-1], state.totals, n_params, clock)
    if groups.is_writer:
        if verdict != HELDOUT_NON_FINITE or streaming:
            yield from rows
        if rnd.ends_round and verdict != HELDOUT_NON_FINITE:
            progress.eval_loss = eval_loss
            if streaming:  # the held-out loss in its own row, beside the running totals
                yield EvalRow(
                    update=rnd.updates[-1] + 1,
                    round=rnd.index,
                    eval_loss=eval_loss,
                    eval_loss_sources=sources,
                    comm_inner_total=rows[-1].comm_inner_total,
                    comm_outer_total=rows[-1].comm_outer_total,
                    clock_s=None if clock is None else clock.heldout(eval_loss),
                    figures=channels,
                )
    stop_on_verdict(
        groups.max_over_processes(verdict), verdict, why, f"the sync at update {rnd.updates[-1] + 1}"
    )
    if checkpointer is not None:
        if rnd.ends_round:
            checkpointer.after_sync(state, last=state.next_update >= run.updates)
        else:
            checkpointer.after_update(state)
    return (eval_loss, sources) if rnd.ends_round else None


def stop_here(
    run: PreparedRun,
    state: RunState,
    signum: int,
    checkpointer: Checkpointer | None,
    groups: Collectives,
    finished: bool | None = None,
) -> None:
    """Every process stops after the same update: a checkpoint of this point (unless one was just
    written), then `Preempted`, which closes the records with a `preempted` end row. A stop after the
    last update (`finished`; by default the phase's last) is no stop: the run has finished."""
    if finished is None:
        finished = state.next_update >= run.updates
    if finished:
        return
    name, where = signal.Signals(signum).name, f"after update {state.next_update}"
    if checkpointer is None or not (checkpointer.every or checkpointer.every_updates):
        raise signals.Preempted(f"stopped by {name} {where}; no checkpoint (checkpoint.every=0)", signum)
    if checkpointer.saved_at != state.next_update:
        checkpointer.save(state)
    groups.max_over_processes(0)  # the others wait until rank 0 has written it, then leave together
    path = checkpoint.path_for(checkpointer.run_dir, state.next_update, groups.checkpoints_by_shard)
    raise signals.Preempted(f"stopped by {name} {where}; checkpoint {path}; resume=auto goes on", signum)


def run_facts(run: PreparedRun, groups: Collectives) -> dict:
    """The model's size and where the run ran, for its first summary row (beside the plan's facts)."""
    return {
        "model/params": count_params(run.cfg.model),
        "model/active_params": active_params(run.cfg.model),  # a token's: a mixture's top_k experts
        "engine/layout": groups.layout,
        "env/processes": groups.size,
        "env/backend": groups.backend,
        "env/device": device_name(run.decided.device),
        "env/torch": torch.__version__,
    }


def first_eval(
    run: PreparedRun, state: RunState, log, writer: bool, resumed: bool, theta: Params
) -> tuple[float, list]:
    """The held-out loss of the weights the run starts from (`theta`, whole; the writer's, NaN
    elsewhere) and each source's; a new run's own row of it (a resumed run's metrics.jsonl holds it
    already), which the writer's network clock keeps."""
    eval_loss, channels = heldout_eval(run, theta) if writer else (math.nan, {})
    sources = channels.pop("eval_loss_sources", None)
    if not resumed:
        if writer and state.clock is not None:
            state.clock.heldout(eval_loss)
        first = EvalRow(update=0, round=0, eval_loss=eval_loss, eval_loss_sources=sources, figures=channels)
        log.write(first)
    return eval_loss, sources


def final_summary(state: RunState, schedule, throughput: Throughput, start: float, end: float) -> dict:
    """The run's summary common to every schedule: the last held-out loss, tokens, seconds, outer bytes
    and bits, restarts, throughput and the writer's network clock (`schedule.summary()` adds its own)."""
    totals, sources = state.totals, schedule.sources
    return (
        {
            "eval/final_loss": schedule.eval_loss,
            **({"eval/final_loss_sources": sources} if sources is not None else {}),
            "train/tokens_total": totals.tokens,
            "train/wall_s": end - start,
            "comm/outer_total_bytes": totals.comm_outer_bytes,
            "comm/outer_peak_bytes": totals.comm_outer_peak,
            "run/restarts": restarts.count(),  # by torch's agent, in the launch that finished the run
        }
        | bits_summary(totals)
        | throughput.window(end)
        | throughput.summary()
        | (state.clock.summary() if schedule.groups.is_writer and state.clock is not None else {})
    )


class Rounds(ScheduleBase):
    """outer.schedule=rounds: the phase's segments (`diloco.rounds`, a round unless a checkpoint or a stop
    cut it), each yielding its update rows, then its sync (and held-out) rows (`after_syncs`); a
    checkpoint and a stop where they ask. `eval_loss` and `sources`: the held-out loss so far, then the
    last."""

    def rows(self, progress: Progress, throughput: Throughput, start: float) -> Iterator[Row]:
        """Each segment's update rows, timed from `start` (`wall`) into `throughput`, then its syncs'."""
        run, state, groups, checkpointer, cfg = (
            self.run,
            self.state,
            self.groups,
            self.checkpointer,
            self.run.cfg,
        )
        clock = state.clock if groups.is_writer else None  # the writer's: fed the rows it writes
        stop = StopCheck(groups)
        n_params = count_params(cfg.model)
        every_updates = checkpointer.every_updates if checkpointer is not None else 0
        for rnd in rounds(run, state, groups=groups, stop=stop, every_updates=every_updates):
            throughput.add(
                rnd.updates,
                rnd.ranks,
                [sum(x is not None for x in rnd.losses(t)) for t in range(len(rnd.updates))],
            )
            # Rows are written once the segment is over: `wall` is when it ended (an engine runs a
            # segment as a whole), the same for its updates.
            round_end = time.perf_counter() - start
            for t, u in enumerate(rnd.updates):
                losses = rnd.losses(t)
                stepped = [x for x in losses if x is not None]
                tokens = int(rnd.replica_column("targets")[t].sum())
                state.totals.tokens += tokens
                state.totals.replica_steps += len(stepped)
                row = UpdateRow(
                    update=u + 1,
                    round=rnd.index,
                    lr=rnd.assigns[0].lr(cfg, t),
                    loss=losses,
                    tokens=tokens,
                    grad_accum=int(rnd.replica_column("microbatches")[t].max()),
                    wall=round_end,
                    rank_seconds=rnd.process_column("seconds")[:, t].tolist(),  # each process's time
                    figures=model_spec(cfg.model).row_figures(rnd, t),  # channel losses, router figures
                )
                if clock is not None:
                    row.clock_s = clock.update(row)
                yield row
                progress.update(u + 1, sum(stepped) / len(stepped) if stepped else None, len(stepped))
            if rnd.syncs or rnd.ends_round:
                evaluated = yield from after_syncs(run, state, rnd, groups, progress, checkpointer, n_params)
                if evaluated is not None:
                    self.eval_loss, self.sources = evaluated
            elif checkpointer is not None:
                checkpointer.after_update(state)
            if stop.signum:
                self.on_stop(stop.signum, state.next_update >= run.updates)
            throughput.next_segment(time.perf_counter())

    def summary(self) -> dict:
        """The run's churn figures (`churn_summary`), with churn."""
        cfg = self.run.cfg
        return churn_summary(self.state.totals, cfg.outer.fragments) if cfg.churn.enabled else {}


def train(
    run: PreparedRun,
    log: RunLogger | None,
    groups: Collectives | None = None,
    checkpointer: Checkpointer | None = None,
    saved: dict | None = None,
) -> tuple[dict, RunState]:
    """Run the phase's schedule (its `schedule_table` entry's `build`: rounds or server updates); the
    writer logs the rows it yields; return the final summary and the run's state (its `theta` is the
    trained global weights).

    Every process of a run calls this with its `groups`; only the writer (rank 0) gets a `log`,
    evaluates the held-out loss and shows progress. The others pass `log=None`. With `checkpointer`
    a checkpoint follows the syncs it asks for; with `saved` (a checkpoint's `state`) the run goes
    on from there, exactly as it would have without the stop.
    """
    cfg = run.cfg
    groups = groups or ReplicaGroups(cfg.replicas)
    log = log if log is not None else NoLog()
    writer = groups.is_writer
    keep_freed_memory()
    state = RunState.start(cfg, groups.local_part(initial_weights(run)), groups.replicas, run.decided)
    if saved is not None:
        fragments = [sync.names for sync in state.syncs]
        state.load_state_dict(groups.local_state(saved, fragments))  # sharded replicas: this rank's shards
        state.reissue(groups)  # outer.overlap: the reductions in flight, started again
        groups.restore_measured(saved["comm_measured"])
    log.write(SummaryRow(values=run.plan_facts | run_facts(run, groups) | groups.memory_facts(state)))
    eval_loss, sources = first_eval(run, state, log, writer, saved is not None, groups.whole(state.theta))
    progress = Progress(run.updates, cfg.logger.progress if writer else "never", state.next_update)
    progress.eval_loss = eval_loss
    start = time.perf_counter()
    # Throughput leaves out the phase's first timing_warmup updates (compilation, allocator warm-up);
    # all are timed when that would leave none. A resumed session times only its own updates.
    throughput = Throughput(
        groups.size, run.phase.timing_warmup if run.phase.timing_warmup < run.updates else 0, start
    )

    def on_stop(signum: int, last: bool) -> None:
        stop_here(run, state, signum, checkpointer, groups, finished=last)

    built = (run, state, groups, checkpointer, on_stop, eval_loss, sources)
    schedule = schedule_entry(cfg.outer.schedule).build(*built)
    for row in schedule.rows(progress, throughput, start):
        log.write(row)
    progress.close()
    end = time.perf_counter()
    summary = final_summary(state, schedule, throughput, start, end) | schedule.summary()
    log.write(SummaryRow(values=summary))
    return summary, state
