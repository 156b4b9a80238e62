"""Runs one phase: rounds of inner steps by an engine, then a sync, a held-out eval and logs.

`prepare(cfg)` builds the data and the plan and checks that the phase fits the stream (all
user mistakes raise `ConfigError`/`PlanError` before anything is written). `rounds(run, state)`
yields the rounds (cut into segments where a mid-round checkpoint or a stop falls), advancing the
run's state (`hypertrain.diloco.state.RunState`); `train(run, log)` runs and logs them. A round is H
updates (the last may be shorter and still ends with a sync); the engine returns every replica's
weights, state and losses; the sync steps the global weights with the outer optimizer on the
mean pseudo-gradient of the replicas that stepped and applies the inner state policy; then the
global weights are evaluated on held-out ids. After every update the processes agree whether a
stop signal arrived (`StopCheck`); if so the run checkpoints there and raises `Preempted`.
`hypertrain.session` wraps `train` with the run's records.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from hypertrain import plan
from hypertrain.config import ConfigError, ModelConfig, TrainConfig
from hypertrain.data.batches import ReplicaBatch, is_multistream, replica_batch
from hypertrain.data.datasets import build_dataset
from hypertrain.data.text import Dataset
from hypertrain.diloco.state import RunState
from hypertrain.distributed.groups import ReplicaGroups
from hypertrain.engines import engine_for
from hypertrain.engines.contract import (
    Assignment,
    Engine,
    ReplicaResult,
    StopAfter,
    channel_means,
    microbatch_terms,
)
from hypertrain.engines.throughput import Throughput, process_table
from hypertrain.failures import NonFiniteError, RunFailure, fault_points
from hypertrain.failures import signals as preemption
from hypertrain.model.transformer import Params, count_params, init_params
from hypertrain.optim.inner import (
    outer_step,
    pseudo_gradient_sum,
    sync_inner_states,
    unflatten,
)
from hypertrain.plan.check import verify_phase
from hypertrain.run import checkpoint
from hypertrain.run.checkpoint import Checkpointer
from hypertrain.run.records import NoLog, RunLogger
from hypertrain.run.runtime import keep_freed_memory

logger = logging.getLogger("hypertrain")
HELDOUT_ROWS_PER_PASS = 64


class Diverged(RunFailure):
    """The divergence guard (`guard.*`): at a sync, the held-out loss lies more than guard.heldout_margin
    above the uniform prediction's, or the pseudo-gradient's norm exceeds guard.pseudo_grad_ratio times
    the global weights' norm. The run stops there (exit 1), never trains on."""

    exit_code = 1


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


def check_device(device: str) -> None:
    """engine.device names a device this process has; ConfigError (one line) otherwise."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            f"engine.device={device!r} but this torch ({torch.__version__}) sees no CUDA device; valid: 'cpu'"
        )
    count, index = torch.cuda.device_count(), torch.device(device).index
    if index is not None and index >= count:
        raise ConfigError(
            f"engine.device={device!r} but this machine has {count} CUDA device(s); "
            f"valid: cuda:0..cuda:{count - 1}"
        )


def model_for_data(cfg: TrainConfig, dataset) -> ModelConfig:
    """The model config with what the data decides filled in (a multistream model's channel
    vocabularies); ConfigError when model and data do not go together."""
    model = cfg.model
    if not is_multistream(dataset):
        if model.arch == "multistream":
            raise ConfigError(
                f"model.arch=multistream needs data with several token channels, not data.name="
                f"{cfg.data.name!r}; valid: data=speech, or model=tiny|small|base"
            )
        return model
    vocabs = [int(v) for v in dataset.channel_vocabs]
    if model.arch != "multistream":
        raise ConfigError(
            f"data.name={cfg.data.name!r} has {len(vocabs)} token channels per position but "
            f"model.arch={model.arch!r} reads one; valid: model=multistream_tiny or multistream_small"
        )
    if model.channel_vocabs and list(model.channel_vocabs) != vocabs:
        raise ConfigError(
            f"model.channel_vocabs={list(model.channel_vocabs)} differs from the data's {vocabs}; "
            "valid: [] (taken from the data)"
        )
    return replace(model, channel_vocabs=vocabs)


def prepare(cfg: TrainConfig) -> PreparedRun:
    """Build data and plan facts; raise ConfigError/PlanError on any user mistake."""
    check_device(cfg.engine.device)
    dataset = build_dataset(cfg.data)
    cfg = replace(cfg, model=model_for_data(cfg, dataset))
    if cfg.model.arch == "decoder" and cfg.model.vocab < dataset.vocab:
        raise ConfigError(
            f"model.vocab={cfg.model.vocab} is smaller than the data's vocabulary ({dataset.vocab}); "
            f"valid: >= {dataset.vocab}"
        )
    samples = dataset.n_total - cfg.data.heldout
    phase = cfg.phase.to_plan()
    if phase.offset >= samples:
        raise ConfigError(
            f"phase.offset={phase.offset} lies past the training stream ({samples} ids once "
            f"data.heldout={cfg.data.heldout} is reserved from {dataset.n_total}); "
            f"valid: < {samples}, or a longer stream"
        )
    plan.validate_run(phase, cfg.world.size, cfg.replicas, samples)
    updates = plan.updates_run(phase, samples)
    if updates < phase.updates:
        logger.warning(
            "phase %r: updates %d..%d are past the end of the stream (%d ids) and are not run",
            phase.name,
            updates,
            phase.updates - 1,
            samples,
        )
    inner = replace(cfg.inner, decay_steps=cfg.inner.decay_steps or phase.updates)
    cfg = replace(cfg, inner=inner)
    check = verify_phase(phase, worlds=(cfg.world.size,), replicas=(cfg.replicas,), samples=samples)
    facts = {
        "plan/check": "PASS",
        "plan/unique_ids": check["unique_ids"],
        "plan/union_sha256": check["union_sha256"],
        "plan/data_order_sha256": plan.data_order_digest(phase, cfg.replicas, samples),
        "plan/rank_sha256": plan.rank_digest(phase, cfg.world.size, cfg.replicas, samples),
        "data/fingerprint": dataset.fingerprint,
        "data/samples": samples,
        "data/heldout": cfg.data.heldout,
        "plan/updates_run": updates,
    }
    heldout_ids = np.arange(samples, dataset.n_total, dtype=np.int64)
    heldout = replica_batch(dataset, heldout_ids, cfg.data, HELDOUT_ROWS_PER_PASS)
    return PreparedRun(cfg, dataset, phase, samples, updates, facts, heldout)


def ring_allreduce_bytes(participants: int, params: int, bytes_per_element: int = 4) -> int:
    """Bytes one participant sends in a ring all-reduce of `params` elements."""
    if participants <= 1:
        return 0
    return int(2 * (participants - 1) / participants * params * bytes_per_element)


def round_bytes(cfg: TrainConfig, params: int, updates: int, synced: int) -> tuple[int, int]:
    """Bytes one participant sends in a round of `updates` updates, as an ideal ring all-reduce would.

    Inner: every update, among the L = W/R ranks of a replica. Outer: once, among all R replicas
    whenever some replica stepped (`synced` > 0; one that did not sends zeros), 0 when none did.
    """
    inner = ring_allreduce_bytes(cfg.world.size // cfg.replicas, params) * updates
    outer = ring_allreduce_bytes(cfg.replicas, params) if synced else 0
    return inner, outer


@torch.no_grad()
def heldout_loss(run: PreparedRun, theta: Params) -> float:
    """Token-mean loss of the global weights on the held-out ids (the last data.heldout ids)."""
    return heldout_eval(run, theta)[0]


@torch.no_grad()
def heldout_eval(run: PreparedRun, theta: Params) -> tuple[float, dict[str, float]]:
    """The held-out loss of the global weights and, for multistream, from the same forward passes,
    the text channel's (channel 0) held-out token mean and the mean over the audio channels (1..C-1)
    of theirs, as `eval_loss_text` and `eval_loss_audio_mean` ({} otherwise)."""
    params = {n: t.unsqueeze(0) for n, t in theta.items()}
    total, sums, counts = 0, None, None
    for mb in run.heldout.microbatches:
        loss, channel = microbatch_terms(run.cfg, params, mb)
        total = total + loss.double()
        if channel is not None:
            sums = channel.double() + (0 if sums is None else sums)
            counts = mb.channel_counts.to(channel.device) + (0 if counts is None else counts)
    if sums is None:
        return float(total), {}
    means = channel_means(sums, counts).tolist()
    return float(total), {
        "eval_loss_text": means[0],
        "eval_loss_audio_mean": sum(means[1:]) / max(1, len(means) - 1),
    }


def rank_streams(phase: plan.Phase, world: int, ranks_per_replica: int) -> int:
    """The `world` a rank's loss weights use under the benchmark layout: the replica's distinct
    streams. A strong phase's L ranks split the replica's ids, so L. A weak phase at W = kB presents
    each of the replica's ids on k of its L ranks (docs/design.md, "Rank ids"): their shares cover the
    batch k times, so each rank weighs its share as one of L/k = B/R streams. The average of the L
    ranks' losses (and gradients) is then the replica batch's token mean, as in the simulation, not k
    times it."""
    repeats = world // phase.base_world if isinstance(phase, plan.WeakPhase) else 1
    return ranks_per_replica // repeats


def assignments(
    run: PreparedRun, updates: range, groups: ReplicaGroups | None = None, state: RunState | None = None
) -> list[Assignment]:
    """This process's replicas' batches for `updates` (a round, or the rest of one), as the plan
    assigns them: each replica's whole share, or (benchmark layout) this rank's share weighted over its
    replica's ranks. With `state` in the middle of a round, each starts from the weights it reached."""
    cfg = run.cfg
    groups = groups or ReplicaGroups(cfg.replicas)
    share = groups.rank_share()
    streams = rank_streams(run.phase, share[1], share[2]) if share is not None else 1

    def batch(u: int, m: int) -> ReplicaBatch:
        ids = plan.replica_ids(run.phase, u, m, cfg.replicas, run.samples)
        if share is None:
            return replica_batch(run.dataset, ids, cfg.data, cfg.inner.micro_batch)
        rank, world, _ = share
        mine = plan.rank_ids(run.phase, u, rank, world, cfg.replicas, run.samples)
        return replica_batch(run.dataset, mine, cfg.data, cfg.inner.micro_batch, ids, streams)

    first = updates[0] if state is None else state.round_first
    reached = state.round_params if state is not None and state.mid_round else [None] * len(groups.replicas)
    return [
        Assignment(m, updates[0], [batch(u, m) for u in updates], updates[0] - first, start)
        for m, start in zip(groups.replicas, reached, strict=True)
    ]


def sync(
    cfg: TrainConfig,
    state: RunState,
    params: list[Params],
    stepped: list[bool],
    groups: ReplicaGroups | None = None,
) -> tuple[float, int]:
    """End a round: outer step on the replicas that stepped, then the inner state policy.

    `params` are this process's replicas' weights at the round's end ([1, ...] each), `stepped`
    whether each stepped in the round; their inner states are `state.inner`. Every process sums its
    replicas' pseudo-gradients and the sum goes over all processes (`groups.sum_over_replicas`), so
    each steps the same `state.theta` in place (it never shares storage with a replica's weights).
    Returns the pseudo-gradient norm and the replicas that took part.
    """
    groups = groups or ReplicaGroups(cfg.replicas)
    theta = state.theta
    device = next(iter(theta.values())).device
    active = torch.tensor(stepped, device=device)
    replica_params = {n: torch.cat([p[n] for p in params]) for n in theta}
    total = groups.sum_over_replicas(pseudo_gradient_sum(theta, replica_params, active))
    synced = int(total[-1])
    if synced == 0:  # nobody stepped: no pseudo-gradient, and momentum must not move theta
        return 0.0, 0
    mean = total[:-1] / total[-1]
    delta = unflatten(mean, theta)
    delta_norm = math.sqrt(float(mean.double().pow(2).sum()))
    outer_step(cfg.outer, theta, delta, state.outer)
    sync_inner_states(
        cfg.inner,
        state.inner,
        active.to(state.inner[0].step.device),
        groups.sum_over_replicas,
        groups.max_over_replicas,
    )
    return delta_norm, synced


class Progress:
    """One live status line on a terminal (update, losses, replica-steps/s, ETA); quiet otherwise."""

    def __init__(self, total: int, mode: str):
        self.total, self.start = total, time.perf_counter()
        self.live = mode == "always" or (mode == "auto" and sys.stderr.isatty())
        self.eval_loss: float | None = None
        self.replica_steps = self.done = 0
        self.loss_mean: float | None = None

    def update(self, done: int, loss_mean: float | None, stepped: int) -> None:
        self.replica_steps += stepped
        self.done, self.loss_mean = done, loss_mean
        self._render()

    def _render(self) -> None:
        if not self.live:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        loss = "-" if self.loss_mean is None else f"{self.loss_mean:.4f}"
        held = "-" if self.eval_loss is None else f"{self.eval_loss:.4f}"
        sys.stderr.write(
            f"\rupdate {self.done}/{self.total}  loss {loss}  held-out {held}  "
            f"{self.replica_steps / elapsed:.1f} replica-steps/s  ETA {eta:.0f}s   "
        )
        sys.stderr.flush()

    def close(self) -> None:
        """Show the line once more with the final held-out loss, then end it."""
        if self.live and self.done:
            self._render()
            sys.stderr.write("\n")


@dataclass
class Segment:
    """A finished round, or the part of one that a mid-round checkpoint or a stop cut off: its
    updates, what this process's replicas were given and did, every replica's per-update records
    (`table`, gathered once per segment for the writer) and, when it ends the round, the sync."""

    index: int  # the 1-based round it belongs to
    updates: range  # the plan's update indices of the segment
    round_updates: range  # those of its whole round
    assigns: list[Assignment]  # this process's replicas
    results: list[ReplicaResult]
    table: Tensor  # float64 [updates, R, 5]: loss (NaN = skipped), targets, microbatches, text, audio
    ranks: Tensor  # float64 [P, updates, 6]: each process's work and seconds (throughput.COLUMNS)
    ends_round: bool = False  # the round's sync followed
    delta_norm: float = 0.0  # norm of the mean pseudo-gradient the outer step used
    synced: int = 0  # replicas that stepped in the round and took part in the sync
    theta_norm: float = 0.0  # norm of the global weights the outer step started from

    def losses(self, t: int) -> list[float | None]:
        return [None if math.isnan(x) else x for x in self.table[t, :, 0].tolist()]


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


def initial_weights(run: PreparedRun) -> Params:
    """The global weights before training: the same for every replica, from `seed`."""
    device = torch.device(run.cfg.engine.device)
    return {n: t.to(device) for n, t in init_params(run.cfg.model, run.cfg.seed).items()}


def local_table(assigns: list[Assignment], results: list[ReplicaResult]) -> Tensor:
    """[updates, local replicas, 5] float64: loss or NaN when skipped, the replica's targets,
    microbatches, and for multistream the text channel's token mean and the audio channels' mean
    (NaN otherwise)."""

    def channels(res: ReplicaResult, t: int) -> list[float]:
        means = res.channel_losses[t] if res.channel_losses else None
        if means is None:
            return [math.nan, math.nan]
        return [means[0], sum(means[1:]) / max(1, len(means) - 1)]

    rows = [
        [
            [
                math.nan if res.losses[t] is None else res.losses[t],
                a.batches[t].replica_total,
                len(a.batches[t].microbatches),
                *channels(res, t),
            ]
            for a, res in zip(assigns, results, strict=True)
        ]
        for t in range(len(assigns[0].batches))
    ]
    return torch.tensor(rows, dtype=torch.float64)


def rounds(
    run: PreparedRun,
    state: RunState,
    engine: Engine | None = None,
    groups: ReplicaGroups | None = None,
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
    engine = engine or engine_for(cfg.engine.name)
    groups = groups or ReplicaGroups(cfg.replicas)
    average = groups.average_in_replica if groups.rank_share() is not None else None
    while state.next_update < run.updates:
        whole = range(state.round_first, min(state.round_first + cfg.inner.H, run.updates))
        end = whole.stop
        if every_updates:
            end = min(end, (state.next_update // every_updates + 1) * every_updates)
        updates = range(state.next_update, end)
        groups.before_round(updates)
        assigns = assignments(run, updates, groups, state)
        results = engine(cfg, state.theta, assigns, state.inner, average, stop)
        updates = updates[: len(results[0].losses)]  # a stop ends every replica after the same update
        assigns = [a.first(len(updates)) for a in assigns]
        before = state.round_stepped or [False] * len(results)
        stepped = [was or res.stepped for was, res in zip(before, results, strict=True)]
        state.inner = [res.state for res in results]
        part = Segment(
            state.rounds_done + 1,
            updates,
            whole,
            assigns,
            results,
            groups.gather_round(local_table(assigns, results)),
            groups.gather_ranks(process_table(assigns, results)),
        )
        state.next_update = updates.stop
        if updates.stop == whole.stop:
            params = [res.params for res in results]
            groups.check_replicas_identical({n: torch.cat([p[n] for p in params]) for n in state.theta})
            part.theta_norm = weights_norm(state.theta)  # before the outer step changes theta in place
            part.delta_norm, part.synced = sync(cfg, state, params, stepped, groups)
            part.ends_round = True
            state.round_first, state.rounds_done = whole.stop, state.rounds_done + 1
            state.round_params = state.round_stepped = None
        else:
            state.round_params, state.round_stepped = [res.params for res in results], stepped
        yield part


class StopCheck:
    """The engines' `stop`: after every update, whether some process of the run got a stop signal
    (one agreement per update, so every process stops after the same one); `signum` is the signal
    (the largest number when processes got different ones). The test-only fault point `after`
    (hypertrain.fault_points) fires first."""

    def __init__(self, groups: ReplicaGroups):
        self.groups, self.signum = groups, 0

    def __call__(self, update: int) -> bool:
        fault_points.act(self.groups.rank, "after", range(update, update + 1))
        self.signum = self.groups.max_over_processes(preemption.requested() or 0)
        return self.signum > 0


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


def channel_losses(table: Tensor) -> dict[str, float]:
    """multistream: an update's text and mean audio training losses, averaged over the replicas that
    stepped (`loss/text`, `loss/audio_mean`; W&B `train/loss/text`, `train/loss/audio_mean`)."""
    text, audio = table[:, 3], table[:, 4]
    stepped = ~torch.isnan(text)
    if not bool(stepped.any()):
        return {}
    return {"loss/text": float(text[stepped].mean()), "loss/audio_mean": float(audio[stepped].mean())}


def weights_norm(theta: Params) -> float:
    """The global weights' norm (all tensors as one vector, summed in float64)."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in theta.values()))


def uniform_loss(run: PreparedRun) -> tuple[float, str]:
    """The held-out loss of the uniform prediction and how it is made: ln vocab; for a multistream
    model each channel's ln vocab weighted as the held-out loss weighs its channels' token means
    (k_c over the channels with held-out targets, docs/design.md "Loss weights")."""
    model = run.cfg.model
    if not is_multistream(run.dataset):
        return math.log(model.vocab), f"ln {model.vocab}"
    counts = sum(mb.channel_counts for mb in run.heldout.microbatches).tolist()
    scales = run.dataset.channel_scales
    active = [(k, v) for k, v, n in zip(scales, model.channel_vocabs, counts, strict=True) if n > 0]
    loss = sum(k * math.log(v) for k, v in active) / sum(k for k, _ in active)
    return loss, "each channel's ln vocab, weighted as the loss weighs the channels"


# The verdicts of a sync, agreed by every process (the largest wins): 0 = train on.
PSEUDO_GRAD, HELDOUT_ABOVE_UNIFORM, HELDOUT_NON_FINITE = 1, 2, 3


def sync_verdict(run: PreparedRun, rnd: Segment, eval_loss: float | None) -> tuple[int, str]:
    """This process's verdict on a sync and its reason: the held-out loss (the writer's, None
    elsewhere) non-finite or above the uniform prediction's by more than guard.heldout_margin, or the
    pseudo-gradient's norm (the same on every process) beyond guard.pseudo_grad_ratio x the weights'."""
    guard, update = run.cfg.guard, rnd.updates[-1] + 1
    if eval_loss is not None and not math.isfinite(eval_loss):
        return HELDOUT_NON_FINITE, (
            f"the held-out loss of the global weights after the sync at update {update} is {eval_loss}; "
            "the run stops"
        )
    if not guard.enabled:
        return 0, ""
    if eval_loss is not None:
        uniform, how = uniform_loss(run)
        if eval_loss > uniform + guard.heldout_margin:
            return HELDOUT_ABOVE_UNIFORM, (
                f"diverged: the held-out loss of the global weights after the sync at update {update} is "
                f"{eval_loss:.4f}, more than guard.heldout_margin={guard.heldout_margin:g} nats above the "
                f"uniform prediction's {uniform:.4f} ({how}); the run stops"
            )
    if rnd.synced and not rnd.delta_norm <= guard.pseudo_grad_ratio * rnd.theta_norm:
        return PSEUDO_GRAD, (
            f"diverged: the pseudo-gradient norm at the sync at update {update} is {rnd.delta_norm:.4g}, "
            f"more than guard.pseudo_grad_ratio={guard.pseudo_grad_ratio:g} times the global weights' "
            f"norm {rnd.theta_norm:.4g}; the run stops"
        )
    return 0, ""


def stop_on_verdict(agreed: int, mine: int, why: str, rnd: Segment) -> None:
    """Every process raises on the verdict they agreed (a process other than the writer names the
    writer's held-out verdict without its figure: the writer's line and end row hold it)."""
    if not agreed:
        return
    if agreed != mine:
        why = (
            f"the held-out loss of the global weights after the sync at update {rnd.updates[-1] + 1} "
            f"{'is non-finite' if agreed == HELDOUT_NON_FINITE else 'diverged'} on rank 0; the run stops"
        )
    raise (NonFiniteError if agreed == HELDOUT_NON_FINITE else Diverged)(why)


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
    run: PreparedRun, state: RunState, signum: int, checkpointer: Checkpointer | None, groups: ReplicaGroups
) -> None:
    """Every process stops after the same update: a checkpoint of this point (unless one was just
    written), then `Preempted`, which closes the records with a `preempted` end row. A stop after the
    last update is no stop: the run has finished."""
    if state.next_update >= run.updates:
        return
    name, where = signal.Signals(signum).name, f"after update {state.next_update}"
    if checkpointer is None or not (checkpointer.every or checkpointer.every_updates):
        raise preemption.Preempted(f"stopped by {name} {where}; no checkpoint (checkpoint.every=0)", signum)
    if checkpointer.saved_at != state.next_update:
        checkpointer.save(state)
    groups.max_over_processes(0)  # the others wait until rank 0 has written it, then leave together
    path = checkpoint.path_for(checkpointer.run_dir, state.next_update)
    raise preemption.Preempted(f"stopped by {name} {where}; checkpoint {path}; resume=auto goes on", signum)


def train(
    run: PreparedRun,
    log: RunLogger | None,
    groups: ReplicaGroups | None = None,
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
    progress = Progress(run.updates, cfg.logger.progress if writer else "never")
    progress.eval_loss = eval_loss
    start = time.perf_counter()
    # Throughput leaves out the phase's first timing_warmup updates (compilation, allocator warm-up);
    # all are timed when that would leave none.
    warmup = run.phase.timing_warmup if run.phase.timing_warmup < run.updates else 0
    # A resumed session times only its own updates: the steps restored from the checkpoint are not its.
    first = state.next_update
    timed_from, timed_steps_before = start, totals.replica_steps
    throughput = Throughput(groups.size, warmup)
    round_started = start
    stop = StopCheck(groups)
    every_updates = checkpointer.every_updates if checkpointer is not None else 0
    for rnd in rounds(run, state, groups=groups, stop=stop, every_updates=every_updates):
        throughput.add(rnd.updates, rnd.ranks)
        if warmup in rnd.updates and warmup > 0:
            # The timed window opens where the first timed update started: its segment's start plus
            # the updates before it (rank 0's own seconds; rows are only written at the segment's end).
            before = rnd.updates.index(warmup)
            timed_from = round_started + float(rnd.ranks[0, :before, 3].sum())
        # Rows are written once the segment (a round, unless a checkpoint or a stop cut it) is over:
        # `wall` is when it ended (an engine runs a segment as a whole), the same for its updates.
        round_end = time.perf_counter() - start
        for t, u in enumerate(rnd.updates):
            losses = rnd.losses(t)
            stepped = [x for x in losses if x is not None]
            tokens = int(rnd.table[t, :, 1].sum())
            totals.tokens += tokens
            totals.replica_steps += len(stepped)
            log.log_update(
                {
                    "update": u + 1,
                    "round": rnd.index,
                    "lr": rnd.assigns[0].lr(cfg, t),
                    "loss": losses,
                    "tokens": tokens,
                    "grad_accum": int(rnd.table[t, :, 2].max()),
                    "wall": round_end,
                    "rank_seconds": rnd.ranks[:, t, 3].tolist(),  # each process's time for the update
                    **channel_losses(rnd.table[t]),
                }
            )
            progress.update(u + 1, sum(stepped) / len(stepped) if stepped else None, len(stepped))
            if u < warmup:
                timed_steps_before = totals.replica_steps
        if rnd.ends_round:
            eval_loss = after_sync(run, state, rnd, groups, log, progress, checkpointer, n_params)
        elif checkpointer is not None:
            checkpointer.after_update(state)
        if stop.signum:
            stop_here(run, state, stop.signum, checkpointer, groups)
        round_started = time.perf_counter()
    progress.close()
    end = time.perf_counter()
    timed = end - timed_from
    summary = {
        "eval/final_loss": eval_loss,
        "train/tokens_total": totals.tokens,
        "train/wall_s": end - start,
        "train/replica_steps_per_s": (totals.replica_steps - timed_steps_before) / timed if timed else 0.0,
        "train/timed_updates": run.updates - max(warmup, first),  # the updates the throughput counts
        "train/timed_s": timed,
    } | throughput.summary()
    log.summary(summary)
    return summary, state
