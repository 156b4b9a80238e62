"""One session of a run: open its records, say where a resumed run goes on from, train with
checkpoints, save the final weights.

`train_session(run, run_dir, resolved, identity, groups, resume)` is what the entry (one process) and
every `processes=dist` worker call: rank 0 opens `RunLogger` (metrics.jsonl, W&B) and writes; the other
ranks take part in the checkpoints' gathers and write nothing. A full disk while writing becomes
`DiskFull` (exit 4); the records are closed by `RunLogger` whatever ends the session (a stop signal's
`Preempted` too: its end row holds the stop's status, line and exit code, failures.signals).
A session that fails while opening its records (no space, W&B that cannot start) has written no
record: `RunLogger` leaves nothing of its own, and the entry removes the rest of a new run.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from hypertrain.diloco.state import PreparedRun
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.failures import DiskFull, RankFailed
from hypertrain.failures.signals import Preempted, StoppedAtOnce, requested, settled
from hypertrain.run.checkpoint import Checkpointer, checkpoints, written_by_run
from hypertrain.run.records import NoLog, RunLogger, no_space
from hypertrain.run.trainer import train


@contextmanager
def stopping(run_dir: Path | str) -> Iterator[None]:
    """Around a session's training, inside its records: a stop's checkpoint is settled before the
    records close; a stop at once says which checkpoint is intact (the end row holds the line). A
    collective that fails while this process is stopping on a Ctrl-C is another rank that stopped at
    once on the second one (every process of the run gets it), not a failure of the run."""

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
    except RankFailed:
        if requested() != signal.SIGINT:
            raise
        raise at_once("stopped at once by a second SIGINT (to another rank)") from None


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


def train_session(
    run: PreparedRun,
    run_dir: Path,
    resolved: dict,
    identity: dict,
    groups: Collectives | None = None,
    resume: Resume | None = None,
) -> dict:
    """One session of the writer (or, with `groups`, of every process): open the records (rank 0),
    say where a resumed run goes on from, train with checkpoints, save weights.pt; the summary."""
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
            return train(run, None, groups, checkpointer(NoLog()), saved)[0]
    wandb_id = None if resume is None else resume.saved.get("wandb_run_id")
    run_id = None if resume is None else resume.saved.get("run_id")  # None: a new id (RunLogger)
    records = RunLogger(
        run_dir, resolved, cfg.logger, replicas=cfg.replicas, wandb_id=wandb_id, run_id=run_id, **identity
    )
    # `stopping` is innermost: a stop has settled (a second Ctrl-C changes nothing) before the records
    # close, and the end row of a stop at once names the checkpoint that is intact. A full disk while
    # opening them is DiskFull too, though no end row can hold it (there is no record yet).
    with ExitStack() as stack:
        with disk_full_as_failure():
            log = stack.enter_context(records)
        stack.enter_context(disk_full_as_failure())
        stack.enter_context(stopping(run_dir))
        if resume is not None:
            log.log_resume(
                {
                    "from": resume.path,
                    "update": resume.saved["state"]["next_update"],
                    "round": resume.saved["state"]["rounds_done"],
                    "superseded_bytes": resume.superseded,
                }
            )
        summary, state = train(run, log, groups, checkpointer(log), saved)
        torch.save({n: t.cpu() for n, t in state.theta.items()}, Path(run_dir) / "weights.pt")
    return summary
