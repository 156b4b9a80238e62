"""processes=dist: the one round loop on P real processes (torch.distributed), started by torch's launcher.

Each process trains with `distributed.collectives.DistReplicaGroups`, the collectives of the layout
the preflight decided (`distributed.decided`, with the device and backend); every rank steps the same
global weights.

`run_worker(job)` is what each process runs: under `torchrun -m hypertrain.train processes=dist` every
launched process calls it from the entry; `python -m hypertrain.train processes=dist` calls `launch(job)`,
which starts the P workers with torch's elastic launcher (`elastic_launch`, what torchrun runs).
Rank 0 alone writes the run. A rank that dies or hangs makes the others fail in their next
collective (gloo: at once for a closed connection, after `processes.timeout_s` for silence), and the
launcher stops the rest; each rank says what happened in one line and exits non-zero. With restarts
(`torchrun --max-restarts N`, `processes.max_restarts=N` self-launched) the agent then starts every
worker again, and the restarted session goes on from the newest checkpoint (`failures.restarts`,
docs/resume.md "Restarts").
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hypertrain.config import TrainConfig
from hypertrain.distributed import slurm_env
from hypertrain.distributed.collectives import DistReplicaGroups, collective, first_line
from hypertrain.distributed.decided import Decided
from hypertrain.distributed.layouts import LaunchedRank, launched_rank
from hypertrain.distributed.sharded import ShardedReplicaGroups
from hypertrain.failures import RankFailed, RunFailure, fault_points, restarts
from hypertrain.failures.signals import STOP_SIGNALS, Preempted, StoppedAtOnce, StopSignals
from hypertrain.records.files import merged_summary
from hypertrain.rundir import checkpoint
from hypertrain.rundir.records import METRICS_FILE, read_metrics, session_end, session_rows
from hypertrain.schedule_table import schedule_entry

if TYPE_CHECKING:
    from hypertrain.run.session import Restart

PEER_FAILURE_GRACE_S = 1.0  # > the launcher's 0.1 s poll: it records the rank that failed first


@dataclass
class WorkerJob:
    """What the entry hands every worker (picklable: the self-launch sends it to spawned processes)."""

    cfg: TrainConfig  # validated, with the chosen layout and process count filled in
    decided: Decided  # the entry's preflight's: the layout, device, backend and reduction
    run_dir: str | None  # the writer's run directory (rank 0); None on the other ranks
    resolved: dict  # the resolved config, W&B's run config
    identity: dict  # W&B name, group, job type, tags
    resume_from: str | None = None  # the checkpoint every rank loads its replicas' state from
    superseded: int | None = None  # rank 0: bytes of metrics.jsonl the entry moved aside for it
    self_launched: bool = False  # set by `launch`: the entry says how the run ended, the workers not
    restart: Restart | None = None  # rank 0 under torchrun, restarted by its agent: what the entry rewound


def same_run_everywhere(run, resolved: dict, rank: int, processes: int) -> None:
    """Every rank must train the same config on the same data in the same order (agents started
    with other overrides, or nodes whose Python has another standard library, would not)."""
    mine = (json.dumps(resolved, sort_keys=True), run.plan_facts["data/fingerprint"])
    everyone = [None] * processes
    with collective("the start's comparison of configs and data"):
        dist.all_gather_object(everyone, mine)
    for other, theirs in enumerate(everyone):
        if theirs != mine:
            what = "data (fingerprint)" if theirs[0] == mine[0] else "config"
            raise RankFailed(
                f"rank {other} has another {what} than rank {rank}; every rank must run the same"
            )


def _cpu_threads(me: LaunchedRank) -> int:
    """Intra-op threads of a CPU worker: the CPUs SLURM gave its task, else the node's cores shared
    by the node's workers (at least 1)."""
    given = os.environ.get("SLURM_CPUS_PER_TASK", "") if me.launcher == "srun" else ""
    return int(given) if given.isdigit() else max(1, (os.cpu_count() or 1) // me.local_processes)


def _rendezvous(me: LaunchedRank, timeout: timedelta) -> dict:
    """init_process_group's rendezvous: torch's agent exported it (env://); srun's tasks meet on the
    step's first node at a port derived from the job id (hypertrain.slurm_env), no torchrun needed.

    A session the agent restarted meets under keys of its own: the agent keeps serving the same
    store (the workers' MASTER_PORT) across restarts, and the process group's keys are the same at
    every start, so a restarted worker would read the failed session's addresses and wait for a
    dead peer (measured here, torch 2.13: gloo's "connectFullMesh failed ... Connect timeout")."""
    if me.launcher == "srun":
        host, port = slurm_env.rendezvous()
        return {"init_method": f"tcp://{host}:{port}", "rank": me.rank, "world_size": me.processes}
    if not restarts.count():
        return {}
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return {
        "store": dist.PrefixStore(f"hypertrain/restart_{restarts.count()}", store),
        "rank": rank,
        "world_size": world_size,
    }


def run_worker(job: WorkerJob, run=None) -> dict | None:
    """One process of a dist run: join the group, train this rank's replicas, rank 0 writes.

    `run` is the prepared run when the entry already built it in this process (torchrun); a
    spawned worker prepares its own (the same config gives the same data and plan everywhere). What
    the preflight decided comes in `job.decided` (a torchrun rank's own preflight built it, by the same
    `decided.decide`); a worker adds only its local rank's device (`Decided.on_rank`).
    Returns rank 0's summary. A failure prints one line naming this rank and exits non-zero.
    """
    from hypertrain.preflight.prepare import prepare
    from hypertrain.run.session import Resume, train_session

    signals = StopSignals().install()  # SIGTERM, SIGUSR2: stop after the update in flight, checkpointed
    me = launched_rank()  # torch's agent (torchrun, the self-launch) or srun's tasks started this process
    if me is None:
        raise RuntimeError("run_worker runs in a process a launcher started as one rank of several")
    rank, local_rank, processes = me.rank, me.local_rank, me.processes
    cfg, decided = job.cfg, job.decided.on_rank(local_rank)
    device = torch.device(decided.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the node's cores shared by its workers, never oversubscribed
        torch.set_num_threads(cfg.engine.threads or _cpu_threads(me))
    cfg = replace(cfg, engine=replace(cfg.engine, device=decided.device))  # what the engines read
    timeout = timedelta(seconds=cfg.processes.timeout_s)
    try:
        backend = decided.backend
        try:  # its cause in this rank's one line, not lost behind the launcher's exit code
            dist.init_process_group(backend, timeout=timeout, **_rendezvous(me, timeout))
        except Exception as e:
            raise RankFailed(f"torch.distributed could not start ({backend}): {first_line(e)}") from None
        resume, restart, finished = None, job.restart if rank == 0 else None, False
        if rank == 0 and job.self_launched and restarts.count() > 0:  # the entry's agent restarted us
            server = schedule_entry(cfg.outer.schedule).server
            resume, restart, finished = _restarted(Path(job.run_dir), server)
        # Rank 0 decided the run directory and the checkpoint the run goes on from; the others learn both.
        told = [job.run_dir, job.resume_from if restart is None else restart.path, finished]
        dist.broadcast_object_list(told, src=0)
        run_dir, resume_from, finished = told
        if finished:  # restarted after a worker died in its teardown: the run had finished
            return _finished_summary(Path(run_dir)) if rank == 0 else None
        kind = ShardedReplicaGroups if cfg.processes.shard else DistReplicaGroups
        groups = kind(decided.layout, rank, device, cfg.processes.timeout_s)
        run = replace(run, cfg=cfg, decided=decided) if run is not None else prepare(cfg, decided)
        same_run_everywhere(run, job.resolved, rank, processes)
        if resume is None and resume_from is not None:
            saved = checkpoint.load(Path(resume_from))
            resume = Resume(resume_from, saved, job.superseded or 0)
        where = Path(run_dir)
        summary = train_session(run, where, job.resolved, job.identity, groups, resume, restart)
        # Tests only: die in teardown, once rank 0's end row is written (a finished run stays finished).
        fault_points.act(rank, "end", range(run.updates), ready=lambda: _has_end_row(where))
        return summary if rank == 0 else None
    except Preempted as e:  # every rank stopped after the same update, the checkpoint written
        if rank == 0 and not job.self_launched:  # self-launched, the entry prints the end row's line
            _say(f"hypertrain: {e}")
        signals.hand_over()  # a launcher's own handler (submitit requeues), when there was one
        os._exit(e.exit_code)
    except Exception as e:
        if not isinstance(e, RunFailure):
            traceback.print_exc()  # not a run failure we know: a bug, shown whole
        if restarts.left():  # the agent restarts every rank: a warning, and never a stop's exit code
            _say(f"hypertrain: warning: rank {rank}: {restarts.restarting(e)}")
        else:
            _say(f"hypertrain: error: run failed on rank {rank}: {first_line(e)}")
        code = getattr(e, "exit_code", 1)
        if isinstance(e, RankFailed):
            # A peer failed first: give the launcher (it polls every 0.1 s) time to see that rank's
            # failure before this one's, so the run is reported as the root cause, not its echo.
            signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
            time.sleep(PEER_FAILURE_GRACE_S)
        os._exit(code)  # no teardown that could wait on a dead peer
    finally:
        signals.restore()
        if dist.is_initialized():
            dist.destroy_process_group()


def _restarted(run_dir: Path, asynchronous: bool):
    """Rank 0 of a self-launched session that the entry's agent restarted: (the Resume, the Restart,
    whether the run had finished already). It goes on from the newest checkpoint whose records match,
    or from the start (`session.restart_here`, counting what it runs again in server updates when
    `asynchronous`: the schedule's entry has a server, as outer.schedule=async's); a run whose records
    end `finished` (a worker died in its teardown) is left as it is."""
    from hypertrain.run.session import restart_here
    from hypertrain.rundir.directory import finished_updates

    if finished_updates(run_dir) is not None:
        _say(
            f"hypertrain: restart {restarts.count()} of {restarts.allowed()} after a worker failed: the run "
            "had finished; nothing was run"
        )
        return None, None, True
    found = checkpoint.find(run_dir)
    if found is not None:
        checkpoint.records_match(run_dir, *found)
    resume, restart = restart_here(run_dir, found, asynchronous)
    return resume, restart, False


def _finished_summary(run_dir: Path) -> dict:
    """The summary a finished run's records hold (its summary rows, merged)."""
    return merged_summary(read_metrics(run_dir))


def _say(line: str) -> None:
    """One line to stderr in one write(2): the ranks share the launcher's stderr pipe, and a line
    written in pieces (text, then its newline) can be cut by another rank's (a pipe keeps writes of
    up to PIPE_BUF = 4096 bytes whole)."""
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (line[:4000] + "\n").encode(errors="replace"))
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor
        print(line, file=sys.stderr, flush=True)


def _start_resource_tracker_deaf_to(*signums: int) -> None:
    """multiprocessing's resource tracker (a helper process the spawned workers share) ignores
    SIGINT and SIGTERM but dies of SIGUSR2 and SIGHUP, which a scheduler or a closed terminal sends
    to every process of the job (a tracker started again by a worker then prints a traceback for
    every name it never saw): start it now with those ignored (a process started with a signal
    ignored keeps it so)."""
    from multiprocessing import resource_tracker

    before = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signums}
    try:
        resource_tracker.ensure_running()
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


class _QuietSignalNotice(logging.Filter):
    """Drops torch's agent's "Received <signal> death signal, shutting down workers" warning: the
    stop's one line is the entry's (the agent logs it on a logger whose level torch sets itself,
    `torch.distributed.elastic.agent.server.api`, so the parent logger's level does not reach it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Received %s death signal")


_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


def _quiet_agent() -> None:
    """The launcher's own logging, silenced where it only repeats what the run says in one line."""
    # The launcher logs every worker failure as a traceback of its own process-watching code; the
    # workers and `launch` already say what failed in one line each.
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    agent = logging.getLogger(_AGENT_LOGGER)
    if not any(isinstance(f, _QuietSignalNotice) for f in agent.filters):
        agent.addFilter(_QuietSignalNotice())


def _has_end_row(run_dir: Path) -> bool:
    return session_end(session_rows(run_dir)) is not None


def _wait_for_workers(signum: int, timeout_s: float = 30.0) -> None:
    """After a signal the agent did not pass on (a second Ctrl-C cuts its shutdown short), the
    workers may still run: pass on that and any further stop signal, and wait for them (as torch's
    agent does: SIGKILL after `timeout_s`), so that rank 0's records are closed before they are read."""
    from multiprocessing import active_children

    workers = active_children()

    def forward(received: int, frame=None) -> None:
        for worker in workers:
            try:
                os.kill(worker.pid, received)
            except (ProcessLookupError, TypeError):  # gone already (TypeError: never started)
                pass

    before = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        if workers:
            forward(signum)
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _ended(job: WorkerJob, since: int, failed: RankFailed | None, signum: int | None, results) -> dict:
    """How the run ended, decided once: as rank 0's `end` row says (its status and exit code), the
    launcher's view of the workers only where that row says less (which rank failed first) or is
    missing (rank 0 died before writing it). Returns the summary of a finished run; raises otherwise."""
    rows = session_rows(Path(job.run_dir), since)
    end = session_end(rows)
    if end is None:  # rank 0 wrote no end row: the launcher's view is all there is
        if failed is not None:
            raise failed
        name = signal.Signals(signum or signal.SIGTERM).name
        stop = Preempted(f"stopped by {name} before rank 0 closed its records", signum or signal.SIGTERM)
        raise stop
    code = end.code
    if end.status == "finished":
        if failed is not None:  # a worker died after the run finished (its records and weights are whole)
            print(f"hypertrain: warning: {failed.teardown}; the run had finished", file=sys.stderr)
            sys.stderr.flush()
        if results and results.get(0) is not None:
            return results[0]
        return merged_summary(rows)
    error = end.error or ("failed" if end.status is None else end.status)
    if end.status in ("preempted", "interrupted"):
        kind = StoppedAtOnce if error.startswith("stopped at once") else Preempted
        raise kind(error, signum or signal.SIGTERM, exit_code=code, status=end.status)
    if failed is None:
        failed = RankFailed(f"rank 0 failed: {error}")
    failed.exit_code = code
    failed.writer_error = error  # a sweeper's study tells a divergence by it (train.failed_trial)
    raise failed


RENDEZVOUS_HOST = "127.0.0.1"  # loopback by address: "localhost" may resolve to ::1 first, or to both


def store_timeout(timeout_s: float) -> int:
    """Seconds a rendezvous store's reads wait: processes.timeout_s, at least torch's default 60."""
    return max(60, math.ceil(timeout_s))


def rendezvous_store(timeout_s: float):
    """The self-launch's rendezvous store, a TCP server on a free loopback port this process binds
    before torch's agent starts. The agent's c10d rendezvous (is_host, multi-tenant) then serves from
    the same server instead of binding `localhost:0` itself: on a loaded machine that bind could fail
    and the agent fall back to a client of port 0, which waited 2 x 60 s and ended in a traceback.
    Kept open by the caller for as long as the agent runs."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(
            RENDEZVOUS_HOST,
            0,
            is_master=True,
            multi_tenant=True,
            timeout=timedelta(seconds=store_timeout(timeout_s)),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError, TimeoutError) as e:  # DistNetworkError, DistStoreError among them
        raise RankFailed(
            f"no rendezvous store could be started on {RENDEZVOUS_HOST}: {first_line(e)}"
        ) from None


def launch(job: WorkerJob) -> dict:
    """Start P = processes.nproc workers on this node with torch's elastic launcher and wait for them;
    with `processes.max_restarts`, the agent starts every worker again after one failed, and the
    restarted session goes on from the newest checkpoint (the entry keeps the directory's lock).

    How the run ended is what rank 0's `end` row says (`_ended`), so the entry's exit code is the
    records' own: a finished run returns rank 0's summary (a worker that died after the end row is a
    warning line), a stop (a signal to this process, forwarded by torch's agent, or to the ranks)
    raises `Preempted` with the end row's line and code, a failure `RankFailed` naming the first
    rank that failed, with the end row's code (without an end row: that rank's, 3 for a signal).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_agent()
    store = rendezvous_store(job.cfg.processes.timeout_s)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=job.cfg.processes.nproc,
        run_id=f"hypertrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        # The agent hosts the store on the port bound above (`rendezvous_store`): never a client of itself.
        rdzv_endpoint=f"{RENDEZVOUS_HOST}:{store.port}",
        rdzv_configs={"is_host": True, "read_timeout": store_timeout(job.cfg.processes.timeout_s)},
        max_restarts=job.cfg.processes.max_restarts,  # each restart resumes from the newest checkpoint
        monitor_interval=0.1,
        start_method="spawn",
        # The agent stops its workers with the signal it got (they checkpoint after their update in
        # flight); SIGUSR2, a scheduler's warning, is not among the ones it handles unless asked.
        signals_to_handle=",".join(signal.Signals(s).name for s in (*STOP_SIGNALS, signal.SIGQUIT)),
    )
    _start_resource_tracker_deaf_to(signal.SIGUSR2, signal.SIGHUP)
    metrics = Path(job.run_dir) / METRICS_FILE
    since = metrics.stat().st_size if metrics.exists() else 0  # this session's rows start here
    job = replace(job, self_launched=True)
    results, failed, signum = None, None, None
    try:
        results = elastic_launch(config, run_worker)(job)
    except RendezvousError as e:  # the agent's store or its rendezvous: no worker started
        raise RankFailed(
            f"the {job.cfg.processes.nproc} processes could not meet at {config.rdzv_endpoint} "
            f"(torch's rendezvous: {first_line(e)})"
        ) from None
    except SignalException as e:
        signum = int(e.sigval)
        _wait_for_workers(signum)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        what = f"died of {failure.signal_name()}" if code < 0 else f"exited with code {code}"
        failed = RankFailed(f"rank {rank} {what}; the launcher stopped the other ranks")
        failed.exit_code = code if code > 0 else RankFailed.exit_code  # the rank's own failure's code
        failed.teardown = f"rank {rank} {what} in its teardown"
    return _ended(job, since, failed, signum, results)
