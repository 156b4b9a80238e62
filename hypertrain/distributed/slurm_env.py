"""SLURM's environment, read: which task of a job step this process is, and where its ranks meet.

Pure string arithmetic on what srun sets (docs/slurm.md lists the variables): no torch, no commands.
The ranks meet on the step's first node, on a port derived from the job id; `MASTER_ADDR` /
`MASTER_PORT` in the environment win.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

# rendezvous ports 20000-39999; from 32768 up they lie in Linux's default ephemeral range
PORT_BASE, PORT_SPAN = 20000, 20000


@dataclass(frozen=True)
class StepTask:
    """This process as one task of a SLURM job step."""

    rank: int  # SLURM_PROCID
    tasks: int  # SLURM_STEP_NUM_TASKS
    local_rank: int  # SLURM_LOCALID: its index among the step's tasks on this node
    local_tasks: int  # the step's tasks on this node
    job_id: str  # SLURM_JOB_ID (an array task has its own)


def step_task(environ: Mapping[str, str] = os.environ) -> StepTask | None:
    """This process's place in its job step, or None outside one (no srun, or a batch script)."""
    if "SLURM_STEP_NUM_TASKS" not in environ or "SLURM_PROCID" not in environ:
        return None
    node = int(environ.get("SLURM_NODEID", "0"))
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE", ""))
    tasks = int(environ["SLURM_STEP_NUM_TASKS"])
    return StepTask(
        rank=int(environ["SLURM_PROCID"]),
        tasks=tasks,
        local_rank=int(environ.get("SLURM_LOCALID", "0")),
        local_tasks=tasks_on_node(per_node, node) if per_node else tasks,
        job_id=environ.get("SLURM_JOB_ID", ""),
    )


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """SLURM's compressed count list (`2(x3),1`: 2 tasks on each of 3 nodes, then 1) at `node`."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"SLURM tasks per node {tasks_per_node!r} is not a count list like 2(x3),1")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node]


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: `gpu[07-09,12],cpu3` -> `gpu07`, `a[1-2]b[3-4]` -> `a1b3`."""
    depth, end = 0, len(nodelist)
    for i, c in enumerate(nodelist):  # the first entry ends at the first comma outside brackets
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            end = i
            break
    # Each bracketed range contributes its first value, zero padding kept.
    host = re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"\1", nodelist[:end].strip())
    if not host or any(c in host for c in "[],"):
        raise ValueError(f"SLURM node list {nodelist!r} has no first host")
    return host


def rendezvous(environ: Mapping[str, str] = os.environ) -> tuple[str, int]:
    """(host, port) where a step's ranks meet: rank 0's node, a port derived from the job id."""
    host = environ.get("MASTER_ADDR") or first_host(
        environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    )
    port = environ.get("MASTER_PORT")
    if port:
        return host, int(port)
    job_id = environ.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job_id!r} is not a job id; set MASTER_PORT for the rendezvous")
    return host, PORT_BASE + int(job_id) % PORT_SPAN
