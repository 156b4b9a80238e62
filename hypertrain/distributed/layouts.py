"""Where the replicas of `processes=dist` live: which process trains what, and with whom it talks.

Pure arithmetic on (P processes, W = world.size, R replicas), no torch (docs/design.md, "Real processes"):
- benchmark (a), P = W: process r is plan rank r; replica m is the block of L = W/R processes
  `m*L .. m*L + L-1` (its replica group); local rank j = r - m*L; the R processes of local rank j
  form cross-replica group j.
- replicas (b), P divides R: process p trains the R/P whole replicas `p*R/P .. (p+1)*R/P - 1`,
  computed by its engine, each on its whole share; W is then only the plan's label, as in the simulation.
`auto` picks (a) when P = W, else (b) when P divides R; a P, W, R that fit no layout is a
`UserError` naming the values, the valid layouts and a command that fits.

`launched_rank()` says whether a launcher started this process as one of P ranks: torchrun's agent
(or the entry's own elastic self-launch), or `srun` as one task of a SLURM job step of several tasks
(`hypertrain.slurm_env`). Then P is the launcher's count, and only rank 0 writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypertrain.distributed import slurm_env


class LayoutError(ValueError):
    """No layout fits; the message is one line (the entry exits 2)."""


@dataclass(frozen=True)
class Layout:
    kind: str  # "benchmark" or "replicas"
    processes: int  # P
    world: int  # W, the plan's world
    replicas: int  # R

    @property
    def ranks_per_replica(self) -> int:
        """L: the processes that share one replica (1 under the replicas layout)."""
        return self.world // self.replicas if self.kind == "benchmark" else 1

    def replicas_of(self, rank: int) -> list[int]:
        if self.kind == "benchmark":
            return [rank // self.ranks_per_replica]
        per = self.replicas // self.processes
        return list(range(rank * per, (rank + 1) * per))

    def replica_group(self, replica: int) -> list[int]:
        """The processes that train `replica` together (benchmark layout)."""
        L = self.ranks_per_replica
        return list(range(replica * L, (replica + 1) * L))

    def cross_group(self, local_rank: int) -> list[int]:
        """Local rank j of every replica: the processes one shard of a sync goes between."""
        return [m * self.ranks_per_replica + local_rank for m in range(self.replicas)]


def choose_layout(processes: int, world: int, replicas: int, requested: str = "auto") -> Layout:
    """The layout for P processes, world W and R replicas; LayoutError (one line) when none fits."""
    fits = {"benchmark": processes == world, "replicas": replicas % processes == 0}
    if requested == "auto":
        kind = "benchmark" if fits["benchmark"] else "replicas" if fits["replicas"] else None
    else:  # a ProcessLayout: the config's type admits no other
        kind = str(requested) if fits[requested] else None
    if kind is None:
        divisors = [p for p in range(1, replicas + 1) if replicas % p == 0]
        # A command that fits: the requested layout's own process count (replicas: the largest
        # divisor of R not above the processes asked for), else the benchmark layout's.
        fitting = max(p for p in divisors if p <= max(processes, 1)) if requested == "replicas" else world
        misfit = "fits no layout" if requested == "auto" else f"does not fit processes.layout={requested}"
        raise LayoutError(
            f"processes=dist with {processes} processes, world.size={world} and replicas={replicas} "
            f"{misfit}; valid: "
            f"benchmark (processes = world.size = {world}) or replicas (processes divide replicas: "
            f"{', '.join(map(str, divisors))}), e.g. python -m hypertrain.train processes=dist "
            f"world.size={world} replicas={replicas} processes.nproc={fitting}"
        )
    return Layout(kind, processes, world, replicas)


def launched_by_torchrun() -> bool:
    """This process is a worker that torch's elastic agent started (torchrun, or our self-launch)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


@dataclass(frozen=True)
class LaunchedRank:
    """This process as one of the P ranks a launcher started together."""

    launcher: str  # "torchrun" (torch's elastic agent) or "srun" (the tasks of a SLURM job step)
    rank: int
    processes: int  # P
    local_rank: int  # among the ranks on this node (a GPU's index)
    local_processes: int


def launched_rank() -> LaunchedRank | None:
    """This process's rank when a launcher started it as one of several: torch's agent (its
    environment), or srun with more than one task (SLURM's; one task runs the entry as a plain
    process, which may self-launch). None for a plain process."""
    if launched_by_torchrun():  # also a torchrun that srun started, one per node: torch's ranks count
        env = os.environ
        return LaunchedRank(
            "torchrun",
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        )
    task = slurm_env.step_task()
    if task is not None and task.tasks > 1:
        return LaunchedRank("srun", task.rank, task.tasks, task.local_rank, task.local_tasks)
    return None


def process_count(nproc: int, world: int) -> int:
    """P: the launcher's process count when one started this process as a rank (processes.nproc 0 or
    equal to it), else nproc or world; LayoutError when processes.nproc disagrees with the launcher."""
    launched = launched_rank()
    if launched is not None:
        started = launched.processes
        if nproc not in (0, started):
            what = "torchrun started" if launched.launcher == "torchrun" else "the SLURM job step has"
            unit = "processes" if launched.launcher == "torchrun" else "tasks"
            raise LayoutError(
                f"processes.nproc={nproc} but {what} {started} {unit}; "
                f"valid: processes.nproc=0 (the launcher's count) or {started}"
            )
        return started
    return nproc or world
