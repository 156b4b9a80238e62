"""`train(run, log)`: runs a phase's rounds (`diloco.rounds`) and keeps its records: a row per update and
per sync (`run.records`), the held-out loss after every sync, the checkpoints the checkpointer asks for,
the divergence guard's verdict, and a stop after the update in flight when a signal arrived.
`hypertrain.run.session` wraps `train` with the run's records.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time

import torch

from hypertrain.diloco.communication import round_bytes
from hypertrain.diloco.guard import HELDOUT_NON_FINITE, stop_on_verdict, sync_verdict
from hypertrain.diloco.rounds import Segment, StopCheck, rounds
from hypertrain.diloco.state import PreparedRun, RunState
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.engines.throughput import Throughput
from hypertrain.failures import signals
from hypertrain.model.transformer import count_params
from hypertrain.run import checkpoint
from hypertrain.run.checkpoint import Checkpointer
from hypertrain.run.evaluation import heldout_eval
from hypertrain.run.prepare import initial_weights
from hypertrain.run.progress import Progress
from hypertrain.run.records import NoLog, RunLogger
from hypertrain.run.runtime import keep_freed_memory

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


def log_sync_row(log, rnd: Segment, eval_loss: float, totals, inner: int, outer: int, measured: dict) -> None:
    """The sync row: held-out loss, pseudo-gradient norm, the formula's and the measured bytes (and
    `measured`'s other figures: a multistream model's per-channel held-out losses)."""
    log.log_sync(
        {
            "update": rnd.updates[-1] + 1,
            "round": rnd.index,
            "eval_loss": eval_loss,
            "pseudo_grad_norm": rnd.delta_norm,
            "replicas_synced": rnd.synced,
            "comm_inner_bytes": inner,
            "comm_outer_bytes": outer,
            "comm_inner_total": totals.comm_inner_bytes,
            "comm_outer_total": totals.comm_outer_bytes,
            **measured,
        }
    )


def channel_losses(rnd: Segment, t: int) -> dict[str, float]:
    """multistream: update `t`'s text and mean audio training losses, averaged over the replicas that
    stepped (`loss/text`, `loss/audio_mean`; W&B `train/loss/text`, `train/loss/audio_mean`)."""
    text, audio = rnd.replica_column("text_loss")[t], rnd.replica_column("audio_loss")[t]
    stepped = ~torch.isnan(text)
    if not bool(stepped.any()):
        return {}
    return {"loss/text": float(text[stepped].mean()), "loss/audio_mean": float(audio[stepped].mean())}


def after_sync(
    run: PreparedRun, state: RunState, rnd: Segment, groups, log, progress, checkpointer, n_params: int
) -> float:
    """A round's end: the bytes it sent, the held-out loss of the new global weights (the writer),
    the sync row and the checkpoint it asks for. Returns the held-out loss (NaN off the writer).
    Before the checkpoint every process agrees the sync's verdict (`sync_verdict`): a non-finite
    held-out loss or a divergence stops them all here, the writer's sync row holding a finite figure."""
    totals = state.totals
    inner_bytes, outer_bytes = round_bytes(run.cfg, n_params, len(rnd.round_updates), rnd.synced)
    totals.comm_inner_bytes += inner_bytes
    totals.comm_outer_bytes += outer_bytes
    measured = groups.comm_stats()
    eval_loss = math.nan
    if groups.is_writer:
        eval_loss, channels = heldout_eval(run, state.theta)
    verdict, why = sync_verdict(run, rnd, eval_loss if groups.is_writer else None)
    if groups.is_writer and verdict != HELDOUT_NON_FINITE:
        progress.eval_loss = eval_loss
        measured |= channels
        log_sync_row(log, rnd, eval_loss, totals, inner_bytes, outer_bytes, measured)
    stop_on_verdict(groups.max_over_processes(verdict), verdict, why, rnd)
    if checkpointer is not None:
        checkpointer.after_sync(state, last=state.next_update >= run.updates)
    return eval_loss


def stop_here(
    run: PreparedRun, state: RunState, signum: int, checkpointer: Checkpointer | None, groups: Collectives
) -> None:
    """Every process stops after the same update: a checkpoint of this point (unless one was just
    written), then `Preempted`, which closes the records with a `preempted` end row. A stop after the
    last update is no stop: the run has finished."""
    if state.next_update >= run.updates:
        return
    name, where = signal.Signals(signum).name, f"after update {state.next_update}"
    if checkpointer is None or not (checkpointer.every or checkpointer.every_updates):
        raise signals.Preempted(f"stopped by {name} {where}; no checkpoint (checkpoint.every=0)", signum)
    if checkpointer.saved_at != state.next_update:
        checkpointer.save(state)
    groups.max_over_processes(0)  # the others wait until rank 0 has written it, then leave together
    path = checkpoint.path_for(checkpointer.run_dir, state.next_update)
    raise signals.Preempted(f"stopped by {name} {where}; checkpoint {path}; resume=auto goes on", signum)


def train(
    run: PreparedRun,
    log: RunLogger | None,
    groups: Collectives | None = None,
    checkpointer: Checkpointer | None = None,
    saved: dict | None = None,
) -> tuple[dict, RunState]:
    """Run the phase's rounds; the writer logs per update and per sync; return the final summary
    and the run's state (its `theta` is the trained global weights).

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
    state = RunState.start(cfg, initial_weights(run), groups.replicas)
    if saved is not None:
        state.load_state_dict(saved)
    totals = state.totals
    n_params = count_params(cfg.model)
    log.summary(
        run.plan_facts
        | {
            "model/params": n_params,
            "engine/layout": groups.layout,
            "env/processes": groups.size,
            "env/backend": groups.backend,
            "env/device": device_name(cfg.engine.device),
            "env/torch": torch.__version__,
        }
    )
    eval_loss, channels = heldout_eval(run, state.theta) if writer else (math.nan, {})
    if saved is None:  # a resumed run's metrics.jsonl holds its first eval already
        log.log_eval(update=0, eval_loss=eval_loss, **channels)
    progress = Progress(run.updates, cfg.logger.progress if writer else "never", state.next_update)
    progress.eval_loss = eval_loss
    start = time.perf_counter()
    # Throughput leaves out the phase's first timing_warmup updates (compilation, allocator warm-up);
    # all are timed when that would leave none.
    # A resumed session times only its own updates.
    warmup = run.phase.timing_warmup if run.phase.timing_warmup < run.updates else 0
    throughput = Throughput(groups.size, warmup, start)
    stop = StopCheck(groups)
    every_updates = checkpointer.every_updates if checkpointer is not None else 0
    for rnd in rounds(run, state, groups=groups, stop=stop, every_updates=every_updates):
        throughput.add(
            rnd.updates,
            rnd.ranks,
            [sum(x is not None for x in rnd.losses(t)) for t in range(len(rnd.updates))],
        )
        # Rows are written once the segment (a round, unless a checkpoint or a stop cut it) is over:
        # `wall` is when it ended (an engine runs a segment as a whole), the same for its updates.
        round_end = time.perf_counter() - start
        for t, u in enumerate(rnd.updates):
            losses = rnd.losses(t)
            stepped = [x for x in losses if x is not None]
            tokens = int(rnd.replica_column("targets")[t].sum())
            totals.tokens += tokens
            totals.replica_steps += len(stepped)
            log.log_update(
                {
                    "update": u + 1,
                    "round": rnd.index,
                    "lr": rnd.assigns[0].lr(cfg, t),
                    "loss": losses,
                    "tokens": tokens,
                    "grad_accum": int(rnd.replica_column("microbatches")[t].max()),
                    "wall": round_end,
                    "rank_seconds": rnd.process_column("seconds")[:, t].tolist(),  # each process's time
                    **channel_losses(rnd, t),
                }
            )
            progress.update(u + 1, sum(stepped) / len(stepped) if stepped else None, len(stepped))
        if rnd.ends_round:
            eval_loss = after_sync(run, state, rnd, groups, log, progress, checkpointer, n_params)
        elif checkpointer is not None:
            checkpointer.after_update(state)
        if stop.signum:
            stop_here(run, state, stop.signum, checkpointer, groups)
        throughput.next_segment(time.perf_counter())
    progress.close()
    end = time.perf_counter()
    summary = (
        {"eval/final_loss": eval_loss, "train/tokens_total": totals.tokens, "train/wall_s": end - start}
        | throughput.window(end)
        | throughput.summary()
    )
    log.summary(summary)
    return summary, state
