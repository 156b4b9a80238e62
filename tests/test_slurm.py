"""Sweeps on a real SLURM cluster: the one-node cluster of `slurm_cluster` (real slurmctld, slurmd and
munged on loopback), jobs submitted through Hydra's submitit launcher by the entry, as a user runs it.

What each test proves, against an independent run of the same config on this machine (exactly, with
`==` and torch.equal: the same processes run the same arithmetic in the same order, one thread each):
- a `-m world=1,2 replicas=1` sweep through `hydra/launcher=slurm` runs as two SLURM jobs (an array;
  scontrol says COMPLETED) whose records equal the basic launcher's job for job, laid out as a local
  sweep's (`<sweep>/<num>_w<W>_r<R>_h<H>/`, one W&B run per job, one group for the sweep);
- one `hydra/launcher=slurm_dist` job of 2 tasks is one processes=dist run of 2 processes, ranks and
  rendezvous taken from SLURM's environment, equal to torchrun's run of 2 processes; task 1 creates
  nothing; the same job with `processes.shard=true` (nothing else to type) is a sharded run, equal to
  torchrun's unsharded one bitwise (as tests/test_sharded.py proves the sharded layout at L = 2);
- a job stopped by `scancel --signal=USR2` (submitit's warning; here a 2-task job, so both ranks must
  agree where to stop) or by `scontrol requeue` (SIGTERM) checkpoints, is requeued, resumes in the
  same job directory from its checkpoint (the default sweep directory, whose name holds a time, is
  not renamed by the requeue) and finishes with the records of a run never stopped.

Every test is bounded: each sweep subprocess by SWEEP_TIMEOUT_S (then it is killed, its jobs are
cancelled and the test fails with their logs), the wait for a job's first rows by JOB_DONE_S, each
wait for a SLURM state by STATE_TIMEOUT_S, and a job that SLURM records as failed (or a sweep that
exits early) fails the test at once. The bounds are derived below from SLURM's intervals and the
jobs' CPU time on a loaded 2-core machine, not measured durations. The jobs use the smoke phase
(seconds each); the file took 51 s on this 2-core machine (74 s with -n 2, each test process
starting its own cluster), 1.2 to 3.5 minutes beside a CPU-bound process at load averages of 2 to 13.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    FAULT_ENV,
    QUICK,
    assert_identical,
    assert_identical_but,
    assert_same_weights,
    finish,
    outcome,
    shard_norm_bound,
    start_entry,
)
from slurm_cluster import END_TIMEOUT_S, RPC_S, SCHED_INTERVAL_S, SLOWDOWN, STOP_CPU_S

from hypertrain.rundir.checkpoint import SUPERSEDED_FILE
from hypertrain.rundir.records import METRICS_FILE, read_metrics
from hypertrain.rundir.wandb_offline import read_run

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # a SLURM cluster per test process: 1-2 min

# The bounds of the waits, derived. tests/slurm_cluster.py holds SLURM's intervals (written into its
# slurm.conf) and SLOWDOWN, the wall seconds per CPU second of one process on the loaded machine.
# CPU seconds do not change with the load; these were measured with /usr/bin/time on this 2-core
# machine (a job's task: wrapped by `+hydra.launcher.srun_args`) and are rounded up to the second:
SUBMIT_CPU_S = 4  # the submitting process: Python, Hydra, the preflight, sbatch (3.8 to its end)
JOB_CPU_S = 6  # one task of the longest job (LONG, 2 tasks), its start to its result (5.45 and 4.6)
# Queued to running: the scheduler's periodic pass at the latest (the event-driven pass comes
# BATCH_SCHED_DELAY_S + 1 s after a submission or `scontrol update`), then three messages: the batch
# script's launch to slurmd, srun's step request to slurmctld, srun's launch of the tasks.
JOB_START_S = SCHED_INTERVAL_S + 3 * RPC_S  # 120 s
# A sweep's start to its job's result (and to its first update rows, which come before it).
JOB_DONE_S = SUBMIT_CPU_S * SLOWDOWN + JOB_START_S + JOB_CPU_S * SLOWDOWN  # 170 s
RESULT_POLL_S = 1  # submitit's Job.wait looks for a job's result file once a second
SWEEP_TIMEOUT_S = JOB_DONE_S + RESULT_POLL_S  # one sweep to its last job's result: 171 s
# A job reaching the state asked for, after its result or a stop signal: its process stops and
# exits (STOP_CPU_S at SLOWDOWN), then SLURM ends the job (END_TIMEOUT_S: a message, KillWait, the
# completion messages).
STATE_TIMEOUT_S = STOP_CPU_S * SLOWDOWN + END_TIMEOUT_S  # 90 s
# A failed job record is final once it has stood this long with the job out of the queue (a requeue
# returns it within a controller's message, well under a second here).
REQUEUE_GRACE_S = 10.0
FAILED = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
RUN = [*QUICK, "logger=none"]


@pytest.fixture
def cluster(slurm_cluster):
    """The session's cluster; whatever a test leaves queued or running is cancelled after it."""
    yield slurm_cluster
    slurm_cluster.cancel_all()


# -- submitting and waiting ----------------------------------------------------------------------


def start_sweep(args: list[str], cwd: Path, cluster) -> subprocess.Popen:
    """`python -m hypertrain.train -m ARGS` in `cwd` against `cluster` (SLURM_CONF; the jobs inherit it)."""
    env = {k: v for k, v in cluster.env.items() if k not in ("WANDB_DIR", FAULT_ENV)}
    env |= {"WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false", "HYDRA_FULL_ERROR": "0"}
    env["OMP_NUM_THREADS"] = "1"
    for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "hypertrain.train", "-m", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def job_logs(cwd: Path, lines: int = 25) -> str:
    """The tail of every SLURM task's stderr under `cwd` (`.submitit/<job>/<job>_<task>_log.err`)."""
    parts = []
    for path in sorted(cwd.rglob(".submitit/*/*_log.err")):
        tail = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        parts.append(f"--- {path.relative_to(cwd)}\n{tail}")
    return "\n".join(parts)


def failed_jobs(cluster, cwd: Path) -> list[dict]:
    """This test's jobs whose last completion SLURM records as failed and that it no longer holds: a
    preempted job's attempt may be logged FAILED (its tasks ended by the requeue's SIGTERM) before the
    controller requeues it, and that job is still in the queue, to run again."""
    last = {j.get("JobId"): j for j in cluster.completed() if j.get("WorkDir") == str(cwd)}
    failed = [j for j in last.values() if j.get("JobState") in FAILED]
    held = set(cluster.jobs()) if failed else set()
    return [j for j in failed if j.get("JobId") not in held]


def wait_sweep(proc: subprocess.Popen, cwd: Path, cluster, timeout: float = SWEEP_TIMEOUT_S):
    """The sweep's result; a job SLURM records as failed, or a sweep past `timeout`, fails the test
    (without accounting, submitit cannot tell a job that died without a result and waits for ever).
    A failed record must stand for REQUEUE_GRACE_S first: a requeued attempt's record can precede the
    job's return to the queue."""
    deadline = time.monotonic() + timeout
    seen: dict[str, float] = {}  # a failed job's id -> when it was first seen failed
    while True:
        try:
            out, err = proc.communicate(timeout=1)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        failed = failed_jobs(cluster, cwd)
        seen = {j["JobId"]: seen.get(j["JobId"], now) for j in failed}
        failed = [j for j in failed if now - seen[j["JobId"]] >= REQUEUE_GRACE_S]
        if failed or now > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            cluster.cancel_all()
            why = f"SLURM jobs failed: {failed}" if failed else f"the sweep ran past {timeout} s"
            pytest.fail(f"{why}\n{err[-3000:]}\n{job_logs(cwd)}")


def wait_for(what: str, condition, timeout: float = STATE_TIMEOUT_S, cwd: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}\n{job_logs(cwd) if cwd else ''}")


def wait_first_rows(proc: subprocess.Popen, cwd: Path, cluster, sweeps: Path) -> Path:
    """The sweep's job directory once it holds update rows (by JOB_DONE_S: they come before the
    job's result); a sweep that exits first, or a job SLURM records as failed, fails the test at once."""

    def rows() -> list[Path]:
        failed = failed_jobs(cluster, cwd)
        if proc.poll() is not None or failed:
            if proc.poll() is None:  # without accounting, submitit waits for ever for a failed job
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            cluster.cancel_all()
            why = f"SLURM jobs failed: {failed}" if failed else f"the sweep exited with {proc.returncode}"
            pytest.fail(f"{why} before the job's first update rows\n{err[-3000:]}\n{job_logs(cwd)}")
        return [p for p in sweeps.glob("*/*/0_*") if update_rows(p)]

    return wait_for("the job's first update rows", rows, timeout=JOB_DONE_S, cwd=cwd)[0]


def submitit_jobs(sweep_dir: Path) -> list[str]:
    """The SLURM job ids of a sweep, from submitit's folders: `<id>` for one job; for an array (one
    job per Hydra job), `<array>_<index>` beside the array's own `<array>`."""
    root = sweep_dir / ".submitit"
    names = [p.name for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    tasks = sorted(n for n in names if re.fullmatch(r"\d+_\d+", n))
    return tasks or sorted(n for n in names if n.isdigit())


def wait_state(cluster, job_id: str, state: str, restarts: int = 0, cwd: Path | None = None) -> dict:
    """scontrol's view of the job once it is in `state` after `restarts` requeues (submitit's
    result file appears as the task ends, a moment before SLURM records the job's end)."""
    want = {"JobState": state, "Restarts": str(restarts)}
    return wait_for(
        f"job {job_id} to be {want}",
        lambda: (j := cluster.job(job_id)) and all(j.get(k) == v for k, v in want.items()) and j,
        cwd=cwd,
    )


def update_rows(run_dir: Path) -> list[dict]:
    metrics = run_dir / METRICS_FILE
    if not metrics.exists():
        return []
    try:
        return [r for r in read_metrics(metrics) if r["kind"] == "update"]
    except ValueError:  # a row being written
        return []


# -- a sweep of single-process jobs --------------------------------------------------------------


def test_a_slurm_sweep_equals_the_basic_launchers_sweep_job_for_job(cluster, tmp_path):
    sweep = ["world=1,2", "replicas=1"]
    slurm_dir, basic_dir = tmp_path / "slurm", tmp_path / "basic"
    submitted = start_sweep(
        [*QUICK, "logger=wandb", *sweep, "hydra/launcher=slurm", f"hydra.sweep.dir={slurm_dir}"],
        tmp_path,
        cluster,
    )
    # The same sweep in this machine's own processes, meanwhile (the basic launcher, job after job).
    basic = finish(start_entry(["-m", *RUN, *sweep, f"hydra.sweep.dir={basic_dir}"], tmp_path))
    done = wait_sweep(submitted, tmp_path, cluster)
    assert done.returncode == 0, done.stderr[-3000:] + job_logs(tmp_path)
    assert basic.returncode == 0, basic.stderr
    # Without accounting every poll of sacct fails: said once for the sweep (hypertrain.slurm's
    # SacctWatcher), neither sacct's own line nor submitit's warning on every poll.
    said = done.stdout + done.stderr
    assert said.count("sacct failed (exit 1: Slurm accounting storage is disabled)") == 1, said[-3000:]
    assert said.count("Slurm accounting storage is disabled") == 1, said[-3000:]
    assert "Bypassing sacct error" not in said, said[-3000:]

    jobs = ["0_w1_r1_h3", "1_w2_r1_h3"]
    assert sorted(p.name for p in slurm_dir.iterdir() if not p.name.startswith(".")) == [
        *jobs,
        "multirun.yaml",
    ]
    # Two SLURM jobs (one array), both completed; each Hydra job knows its SLURM job id.
    array = submitit_jobs(slurm_dir)
    assert len(array) == 2 and array[0].endswith("_0") and array[1].endswith("_1"), array
    for job, job_id in zip(jobs, array, strict=True):
        wait_state(cluster, job_id, "COMPLETED")
        hydra_yaml = (slurm_dir / job / ".hydra" / "hydra.yaml").read_text()
        assert re.search(rf"^    id: '?{job_id}'?$", hydra_yaml, re.MULTILINE), job_id

    groups, ids = set(), set()
    for job in jobs:
        got, want = slurm_dir / job, basic_dir / job
        # The same records, exactly; the same files as a local sweep's job (plus its W&B run).
        assert_identical(got, want)
        assert {p.name for p in got.iterdir()} - {"wandb"} == {p.name for p in want.iterdir()}
        # The preset's jobs run with resume=auto (so a requeued job goes on); the basic sweep's do not.
        assert "resume: auto" in (got / "config.yaml").read_text()
        assert "resume: ''" in (want / "config.yaml").read_text()
        # One W&B run per job, all in the sweep's group, the same numbers as metrics.jsonl.
        (wandb_dir,) = (got / "wandb").glob("offline-run-*")
        wandb_run = read_run(wandb_dir)
        assert wandb_run["exit_code"] == 0
        ids.add(wandb_run["run"]["id"])
        groups.add(wandb_run["run"]["group"])
        logged = [h["train/loss/replica_0"] for h in wandb_run["history"] if "train/loss_mean" in h]
        assert logged == [r["loss"][0] for r in update_rows(got)]
    assert len(ids) == 2 and groups == {"quick-slurm"}


# -- one multi-task job: the tasks are the ranks -------------------------------------------------


# The sweep's second job is the same run sharded (processes.shard=true: L = 2 ranks of its one replica),
# submitted with nothing else changed. It must equal torchrun's unsharded run bitwise for the reason
# tests/test_sharded.py gives for L = 2 (the same block code on the same gathered weights; the
# reduce-scatter's sum of two terms exact in any order, the division by 2 exact; AdamW and the sync
# elementwise). The bytes measured at the collectives are left out: FSDP2's collectives are not counted
# (the sharded run measures its loss all-reduce alone) and one replica sends nothing across replicas. The
# pseudo-gradient's norm is compared apart, within `shard_norm_bound`: it is summed per shard, then over the
# two, another float64 order (bitwise on one machine's data, one ulp off on another's: CI, this one).
SHARD_SKIP = ("comm_measured_inner_bytes", "comm_measured_outer_bytes", "pseudo_grad_norm")
# The two jobs each take both cores, so they run one after the other: the second waits for the
# first's end and one more start.
TWO_JOBS_S = SWEEP_TIMEOUT_S + STATE_TIMEOUT_S + JOB_START_S + JOB_CPU_S * SLOWDOWN


def test_a_two_task_slurm_job_equals_torchrun_with_two_processes_exactly(cluster, tmp_path):
    dist = [*RUN, "processes=dist", "world=2", "replicas=1"]
    slurm_dir = tmp_path / "slurm"
    submitted = start_sweep(
        [*dist, "processes.shard=false,true", "hydra/launcher=slurm_dist", f"hydra.sweep.dir={slurm_dir}"],
        tmp_path,
        cluster,
    )
    torchrun = finish(start_entry([*dist, f"hydra.run.dir={tmp_path / 'torchrun'}"], tmp_path, torchrun=2))
    done = wait_sweep(submitted, tmp_path, cluster, timeout=TWO_JOBS_S)
    assert done.returncode == 0, done.stderr[-3000:] + job_logs(tmp_path)
    assert torchrun.returncode == 0, torchrun.stderr

    job, sharded = slurm_dir / "0_w2_r1_h3", slurm_dir / "1_w2_r1_h3"
    assert_identical(job, tmp_path / "torchrun")
    assert_identical_but(sharded, tmp_path / "torchrun", skip=SHARD_SKIP)
    syncs = [[r for r in read_metrics(d / METRICS_FILE) if r["kind"] == "sync"] for d in (sharded, job)]
    assert len(syncs[0]) == len(syncs[1]) > 0
    for mine, theirs in zip(*syncs, strict=True):
        bound = shard_norm_bound(theirs["params"])
        assert mine["pseudo_grad_norm"] == pytest.approx(theirs["pseudo_grad_norm"], rel=bound, abs=0)
    for run_dir in (job, sharded):
        rows = read_metrics(run_dir / METRICS_FILE)
        summary = {k: v for r in rows if r["kind"] == "summary" for k, v in r.items()}
        assert summary["env/processes"] == 2 and summary["engine/layout"] == "benchmark"
        assert "nproc: 2" in (run_dir / "config.yaml").read_text()
        assert ("memory/rank_weights_bytes" in summary) == (run_dir == sharded)  # a rank's shards' bytes
    assert "shard: true" in (sharded / "config.yaml").read_text()
    assert "engine=sharded replicas (FSDP2)" in (sharded / "train.log").read_text()

    # One SLURM job of two tasks per Hydra job (an array of two), srun's (no torchrun inside), each
    # task one rank. The array's script is in the array's own folder, each job's logs in its own.
    jobs = submitit_jobs(slurm_dir)
    assert len(jobs) == 2, jobs
    array = jobs[0].split("_")[0]
    script = (slurm_dir / ".submitit" / array / f"{array}_submission.sh").read_text()
    assert "srun" in script and "torchrun" not in script
    for job_id in jobs:
        assert wait_state(cluster, job_id, "COMPLETED").get("NumTasks") == "2"
        folder = slurm_dir / ".submitit" / job_id
        for task in (0, 1):
            log = (folder / f"{job_id}_{task}_log.out").read_text()  # submitit's own lines
            assert f"global_rank={task}(2)" in log, log[-2000:]
    # Task 1 created nothing: the job directory holds what torchrun's rank 0 wrote, and nothing else
    # appeared in the working directory (its Hydra would have written .hydra/ and a log somewhere).
    assert {p.name for p in job.iterdir()} == {p.name for p in (tmp_path / "torchrun").iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slurm", "torchrun"]


# -- preemption and requeue ----------------------------------------------------------------------


def assert_identical_but_measured(run_dir: Path, reference: Path) -> None:
    """test_resume's `assert_identical`, but for the payload bytes measured at the collectives
    (`comm_measured_*`): the sync row of the round a stop cut in two counts only the resumed
    session's part of it (the first session's part is not carried over)."""
    got, want = outcome(run_dir), outcome(reference)
    assert got.updates == want.updates
    unmeasured = lambda rows: [
        {k: v for k, v in r.items() if not k.startswith("comm_measured_")} for r in rows
    ]  # noqa: E731
    assert unmeasured(got.syncs) == unmeasured(want.syncs)
    assert got.heldout == want.heldout and got.final == want.final
    assert_same_weights(got.weights, want.weights)


# Long enough (about 3 s of training) for a signal sent after the first rows to land mid-run.
LONG = [*RUN, "phase.updates=100", "inner.H=4"]
CASES = {
    # submitit's warning to both tasks of a 2-task job: the ranks agree on the update to stop after,
    # rank 0 hands over to submitit, which saves the job and requeues it.
    "usr2-two-tasks": (["processes=dist", "world=2", "replicas=1", "hydra/launcher=slurm_dist"], "usr2"),
    # SLURM itself requeues a single-process job: SIGTERM, then (KillWait later) SIGKILL.
    "requeue-one-task": (["hydra/launcher=slurm"], "requeue"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_preempted_job_is_requeued_and_finishes_as_a_run_never_stopped(cluster, tmp_path, name):
    extra, how = CASES[name]
    launcher = [x for x in extra if x.startswith("hydra/launcher=")]
    config = [x for x in extra if x not in launcher]
    # The default sweep directory (outputs/sweeps/<date>/<time>_quick): the requeued job must land in it.
    submitted = start_sweep([*LONG, *config, *launcher], tmp_path, cluster)
    reference = start_entry([*LONG, *config, f"hydra.run.dir={tmp_path / 'reference'}"], tmp_path)

    sweeps = tmp_path / "outputs" / "sweeps"
    job_dir = wait_first_rows(submitted, tmp_path, cluster, sweeps)
    (job_id,) = submitit_jobs(job_dir.parent)
    stopped_after = len(update_rows(job_dir))
    if how == "usr2":
        cluster.run("scancel", "--signal=USR2", job_id)
    else:
        cluster.run("scontrol", "requeue", job_id)

    # Requeued: SLURM holds it back (BeginTime, about 2 minutes); let it start now.
    wait_state(cluster, job_id, "PENDING", restarts=1, cwd=tmp_path)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    done = wait_sweep(submitted, tmp_path, cluster)
    reference = finish(reference)
    assert reference.returncode == 0, reference.stderr
    assert done.returncode == 0, done.stderr[-3000:] + job_logs(tmp_path)
    wait_state(cluster, job_id, "COMPLETED", restarts=1)

    # The requeued job came back to the same directory: one sweep, one job.
    assert [p.relative_to(sweeps) for p in sweeps.glob("*/*/0_*")] == [job_dir.relative_to(sweeps)]
    # The first session stopped mid-run after a checkpoint; the second went on from it.
    superseded = read_metrics(job_dir / SUPERSEDED_FILE)
    end = superseded[-1]
    assert end["kind"] == "end" and end["status"] == "preempted", superseded[-3:]
    rows = read_metrics(job_dir / METRICS_FILE)
    (resume,) = [r for r in rows if r["kind"] == "resume"]
    assert stopped_after <= resume["update"] < 100, (stopped_after, resume)
    assert Path(resume["from"]).parent == job_dir / "checkpoints"
    assert [r["update"] for r in rows if r["kind"] == "update"] == list(range(1, 101))
    assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "finished"
    # ... and the whole equals the run that was never stopped.
    assert_identical_but_measured(job_dir, tmp_path / "reference")


def test_a_submission_sbatch_refuses_is_one_line_exit_2_and_leaves_nothing(cluster, tmp_path):
    """The controller answers `scontrol ping` (the preflight passes) but sbatch refuses the array (a
    partition the cluster lacks): one line naming sbatch's reason, exit 2, no sweep directory and no
    submitit files left, no job queued (issue 21)."""
    args = [*RUN, "hydra/launcher=slurm", "hydra.launcher.partition=nope"]
    done = wait_sweep(start_sweep(args, tmp_path, cluster), tmp_path, cluster)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    refused = r"hypertrain: error: hydra/launcher=slurm: sbatch refused the sweep \((.*)\); (.*)"
    said = re.fullmatch(refused, lines[0])
    assert said and said.group(1).startswith("sbatch: error: ") and "partition" in said.group(1), lines[0]
    assert said.group(2).startswith("nothing was submitted; valid: "), lines[0]
    assert list(tmp_path.iterdir()) == []
    assert cluster.jobs() == []
