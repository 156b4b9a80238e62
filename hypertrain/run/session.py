"""One session of a run: open its records, say where a resumed run goes on from, train with
checkpoints, save the final weights.

`train_session(run, run_dir, resolved, identity, groups, resume)` is what the entry (one process) and
every `processes=dist` worker call: rank 0 opens `RunLogger` (metrics.jsonl, W&B) and writes; the other
ranks take part in the checkpoints' gathers and write nothing. A full disk while writing becomes
`DiskFull` (exit 4); the records are closed by `RunLogger` whatever ends the session (a stop signal's
`Preempted` too: its end row holds the stop's status, line and exit code, failures.signals).
A session that fails while opening its records (no space, W&B that cannot start) has written no
record: `RunLogger` leaves nothing of its own, and the entry removes the rest of a new run.

A session that torch's agent started again after a worker failed (`failures.restarts`) goes on from
the newest checkpoint, or from the start when there is none, in the same run directory under the same
run id: `restart_here` (rank 0) rewinds the records to that point, and the session writes a `restart`
row (docs/resume.md, "Restarts").
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from hypertrain.diloco.state import PreparedRun
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.failures import DiskFull, RankFailed, RunFailure, restarts
from hypertrain.failures.signals import Preempted, StoppedAtOnce, requested, settled
from hypertrain.model.spec import model_spec
from hypertrain.records.rows import ArrivalRow, RestartRow, ResumeRow, StartRow, UpdateRow, parse
from hypertrain.run.trainer import train
from hypertrain.rundir import checkpoint
from hypertrain.rundir.checkpoint import Checkpointer, checkpoints, written_by_run
from hypertrain.rundir.logger import no_space
from hypertrain.rundir.records import METRICS_FILE, NoLog, RunLogger, readable_rows


@contextmanager
def stopping(run_dir: Path | str) -> Iterator[None]:
    """Around a session's training, inside its records: a stop's checkpoint is settled before the
    records close; a stop at once says which checkpoint is intact (the end row holds the line). A
    collective that fails while this process is stopping on a Ctrl-C is another rank that stopped at
    once on the second one (every process of the run gets it), not a failure of the run. A failure
    while torch's agent has restarts left is a session the agent restarts: its line (the end row's)
    says so, and its exit code is never a stop's (`restarts.restarting`)."""

    def at_once(what: str) -> StoppedAtOnce:
        settled()
        newest = checkpoints(Path(run_dir))
        intact = f"checkpoint {newest[-1]} is intact; resume=auto goes on" if newest else "no checkpoint yet"
        return StoppedAtOnce(f"{what}, without finishing the update in flight; {intact}", signal.SIGINT)

    try:
        yield
    except StoppedAtOnce as e:
        raise at_once(str(e)) from None
    except Preempted:
        settled()
        raise
    except RunFailure as e:
        if isinstance(e, RankFailed) and requested() == signal.SIGINT:
            raise at_once("stopped at once by a second SIGINT (to another rank)") from None
        restarts.restarting(e)
        raise


@contextmanager
def disk_full_as_failure() -> Iterator[None]:
    """No space left while writing (records, a checkpoint, the weights): a run failure (exit 4).
    torch.save reports it as a RuntimeError whose context is the OSError, hence the walk."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        cause = no_space(e)
        if cause is None:
            raise
        where = getattr(cause, "filename", None) or "the run's records"
        raise DiskFull(f"no space left on the device writing {where}") from None


@dataclass
class Resume:
    """Where a resumed run goes on from: the checkpoint and what its session left in metrics.jsonl."""

    path: str  # the checkpoint file
    saved: dict  # its payload (checkpoint.load)
    superseded: int  # bytes of metrics.jsonl moved to metrics.superseded.jsonl


@dataclass
class Restart:
    """A session torch's agent started again after a worker failed: where it goes on from and what
    the failed session had recorded after that point (the `restart` row, docs/resume.md "Restarts")."""

    count: int  # the agent's restart count (1 for the first restart)
    allowed: int  # the restarts the agent allows in all
    update: int  # the update the run goes on from (the checkpoint's next update; 0: from the start)
    recomputed: int  # the updates the failed session had recorded after `update`: run again now
    superseded: int  # bytes of metrics.jsonl moved to metrics.superseded.jsonl
    path: str | None = None  # the checkpoint gone on from; None: from the start
    run_id: str | None = None  # from the start: the run's id, kept (None: the records held none yet)
    wandb_id: str | None = None  # from the start: the W&B run's id, kept
    # outer.schedule=async: `update` and `recomputed` count server updates (arrival rows), and
    # `jobs` the jobs those recomputed applied; None under rounds
    jobs: int | None = None

    def row(self) -> RestartRow:
        return RestartRow(
            count=self.count,
            max_restarts=self.allowed,
            update=self.update,
            recomputed=self.recomputed,
            from_=self.path,
            superseded_bytes=self.superseded,
        )

    def line(self) -> str:
        where = f"checkpoint {self.path}" if self.path else "the start (no checkpoint yet)"
        unit = "update" if self.jobs is None else "server update"
        again = f"{self.recomputed} {unit}{'' if self.recomputed == 1 else 's'}"
        if self.jobs is not None:
            again += f" ({self.jobs} {'job' if self.jobs == 1 else 'jobs'})"
        return (
            f"hypertrain: restart {self.count} of {self.allowed} after a worker failed: going on from "
            f"{where} at {unit} {self.update}; {again} the failed session had recorded run again"
        )


def recorded_after(data: bytes, update: int, asynchronous: bool) -> tuple[int, int | None]:
    """What the failed session recorded in `data` (metrics.jsonl after the point gone on from) beyond
    `update`, in its schedule's own unit: the updates (an `update` row each), or with outer.schedule=async
    the server updates (an `arrival` row each; `update` counts them too) and the jobs they applied (None
    under rounds). A row written twice counts once."""
    kind = ArrivalRow if asynchronous else UpdateRow
    rows = {r.update: r for r in map(parse, readable_rows(data)) if isinstance(r, kind) and r.update > update}
    jobs = sum(len(r.replicas) for r in rows.values()) if asynchronous else None
    return len(rows), jobs


def restart_here(
    run_dir: Path, found: tuple[Path, dict] | None, asynchronous: bool = False
) -> tuple[Resume | None, Restart]:
    """Rank 0 of a restarted session (`failures.restarts.count()` > 0): go on from `found` (the
    newest checkpoint, whose records `checkpoint.records_match` has checked) or, with None, from the
    start under the run's own id. Drops the checkpoints after it, moves what the failed session
    recorded after that point to metrics.superseded.jsonl (never lost) and says what it was, in the
    schedule's unit (`recorded_after`; `asynchronous`: its schedule entry has a server, as async's)."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    data = metrics.read_bytes() if metrics.exists() else b""
    saved = None if found is None else found[1]
    length = 0 if saved is None else int(saved["metrics_bytes"])
    update = 0 if saved is None else int(saved["state"]["next_update"])
    recomputed, jobs = recorded_after(data[length:], update, asynchronous)
    run_id = wandb_id = None
    if saved is None:  # from the start: the same run, its own id kept
        starts = [r for r in map(parse, readable_rows(data)) if isinstance(r, StartRow)]
        if starts:
            run_id, wandb_id = starts[-1].run_id, starts[-1].wandb_run_id
    checkpoint.drop_later(run_dir, update)  # and a checkpoint's temporary file a kill cut short
    moved = checkpoint.rewind_metrics(run_dir, length)
    path = None if found is None else str(found[0])
    restart = Restart(
        restarts.count(), restarts.allowed(), update, recomputed, moved, path, run_id, wandb_id, jobs
    )
    return (None if saved is None else Resume(path, saved, moved)), restart


def train_session(
    run: PreparedRun,
    run_dir: Path,
    resolved: dict,
    identity: dict,
    groups: Collectives | None = None,
    resume: Resume | None = None,
    restart: Restart | None = None,
) -> dict:
    """One session of the writer (or, with `groups`, of every process): open the records (rank 0),
    say where a resumed run goes on from (and, restarted by torch's agent, that it was: `restart`),
    train with checkpoints, save weights.pt; the summary."""
    cfg = run.cfg
    groups = groups or ReplicaGroups(cfg.replicas)
    saved = None if resume is None else resume.saved["state"]
    ckpt = cfg.checkpoint

    # Pruning removes only checkpoints this run wrote: a new run's own; a resumed run's are named
    # by its records (rewound to the checkpoint it goes on from) and that checkpoint.
    ours = [] if resume is None or not groups.is_writer else written_by_run(run_dir, Path(resume.path))

    def checkpointer(log) -> Checkpointer:
        facts = run.plan_facts
        return Checkpointer(
            run_dir, resolved, facts, ckpt.every, ckpt.keep, log, groups, ckpt.every_updates, ours
        )

    if not groups.is_writer:  # takes part in the checkpoints' gathers; writes nothing
        with stopping(run_dir):
            summary, state = train(run, None, groups, checkpointer(NoLog()), saved)
            groups.whole(state.theta)  # sharded replicas: the writer's weights.pt gathers the shards
            return summary
    wandb_id = None if resume is None else resume.saved["wandb_run_id"]
    run_id = None if resume is None else resume.saved["run_id"]  # None: a new id (RunLogger)
    if resume is None and restart is not None:  # restarted from the start: still the same run
        run_id, wandb_id = restart.run_id, restart.wandb_id
    records = RunLogger(
        run_dir, resolved, cfg.logger, replicas=cfg.replicas, wandb_id=wandb_id, run_id=run_id, **identity
    )
    # `stopping` is innermost: a stop has settled (a second Ctrl-C changes nothing) before the records
    # close, and the end row of a stop at once names the checkpoint that is intact. A full disk while
    # opening them is DiskFull too, though no end row can hold it (there is no record yet).
    with disk_full_as_failure(), ExitStack() as stack:  # the outer one: the records' close (its flush)
        with disk_full_as_failure():
            log = stack.enter_context(records)
        stack.enter_context(disk_full_as_failure())
        stack.enter_context(stopping(run_dir))
        if resume is not None:
            log.write(
                ResumeRow(
                    from_=resume.path,
                    update=resume.saved["state"]["next_update"],
                    round=resume.saved["state"]["rounds_done"],
                    superseded_bytes=resume.superseded,
                )
            )
        if restart is not None:
            log.write(restart.row())
            sys.stderr.write(restart.line() + "\n")
            sys.stderr.flush()
        summary, state = train(run, log, groups, checkpointer(log), saved)
        save_weights(cfg, groups.whole(state.theta), Path(run_dir))
    return summary


def save_weights(cfg, theta, run_dir: Path) -> None:
    """The final global weights: weights.pt, and for a Hugging Face model RUN/hf (save_pretrained's,
    `model.hf_export`, with the data's tokenizer where it has one, `data.hf_tokenizer`; docs/hf.md)."""
    weights = {n: t.cpu() for n, t in theta.items()}
    torch.save(weights, run_dir / "weights.pt")
    if model_spec(cfg.model).external:
        from hypertrain.data import hf_tokenizer
        from hypertrain.model.hf_export import HF_FOLDER, write_hf

        out = write_hf(cfg.model, weights, run_dir / HF_FOLDER)
        if (found := hf_tokenizer.corpus_of(cfg.data)) is not None:
            hf_tokenizer.save(*found, out, hf_tokenizer.context_length(cfg.data))
