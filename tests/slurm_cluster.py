"""A real one-node SLURM cluster on loopback for the tests: munged, slurmctld and slurmd as child processes.

`start(root)` writes a minimal slurm.conf and a fresh munge key under `root` (one node on 127.0.0.1
with this machine's CPUs and memory as `slurmd -C` reports them, processes tracked without cgroups,
no accounting, finished jobs in a job-completion text log, every spool, state, log and socket file
under `root`, free ports), starts the three daemons in the foreground as children of this process,
waits until `sinfo` shows the node idle, and returns a `Cluster` whose `env` (SLURM_CONF) every
client command and every submitted job needs. `Cluster.stop()` ends the daemons it started, by PID.

The session fixture `slurm_cluster` (registered in conftest.py) starts one per test process and
skips, saying why, only when the daemons are not installed or do not start. Without accounting
`sacct` fails: read a job with `Cluster.job` (scontrol) or `Cluster.completed` (the completion log).

By hand: `.venv/bin/python tests/slurm_cluster.py` starts one, prints the environment to use with
sbatch/srun/sinfo, and stops it on Ctrl-C.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sinfo", "squeue", "sbatch", "srun", "scontrol", "scancel")
START_TIMEOUT_S = 30.0  # measured: the node is idle about 1.2 s after slurmd starts
KILL_WAIT_S = 5  # SIGTERM -> SIGKILL: time enough for a run to finish its update and checkpoint


class ClusterError(RuntimeError):
    """The daemons could not be started (the message says which and why)."""


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _which(name: str) -> str | None:
    # The daemons live in /usr/sbin, which a non-root PATH may leave out.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def missing() -> list[str]:
    """The daemons and client commands this machine lacks."""
    return [name for name in (*DAEMONS, "mungekey", *CLIENTS) if _which(name) is None]


def node_hardware() -> str:
    """`slurmd -C`'s description of this machine (CPUs, sockets, cores, threads, memory), as a node line."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30)
    line = out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else ""
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    if not all(k in fields for k in ("CPUs", "RealMemory")):
        raise ClusterError(f"slurmd -C did not describe this machine: {out.stdout!r} {out.stderr!r}")
    return " ".join(f"{k}={fields[k]}" for k in keep if k in fields)


@dataclass
class Cluster:
    root: Path
    node: str  # the node's name, which jobs see in SLURM_JOB_NODELIST
    env: dict[str, str]  # os.environ plus SLURM_CONF: for client commands and the jobs they submit
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def jobcomp(self) -> Path:
        return self.root / "jobcomp.txt"

    def run(self, *args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        done = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise ClusterError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); {} once SLURM forgot it."""
        done = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if done.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout.splitlines()[0]))

    def completed(self) -> list[dict[str, str]]:
        """The job-completion log: one dict per job that ended (JobId, JobState, ExitCode, ...)."""
        if not self.jobcomp.exists():
            return []
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in self.jobcomp.read_text().splitlines()]

    def daemon_log(self, name: str, lines: int = 30) -> str:
        path = self.root / "log" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def jobs(self) -> list[str]:
        """The ids of the jobs SLURM still runs or holds (pending, running, completing)."""
        done = self.run("squeue", "-h", "-o", "%i", check=False)
        return done.stdout.split() if done.returncode == 0 else []

    def cancel_all(self, timeout: float = KILL_WAIT_S + 15) -> list[str]:
        """Cancel every job and wait until SLURM holds none (their processes ended); the ids cancelled."""
        ids = self.jobs()
        if ids:
            self.run("scancel", *ids, check=False)
            deadline = time.monotonic() + timeout
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        return ids

    def stop(self) -> None:
        """Cancel the jobs left, then SIGTERM the daemons this object started (slurmd first) and
        SIGKILL what is left of them after 10 s."""
        if self.processes.get("slurmctld") is not None and self.processes["slurmctld"].poll() is None:
            self.cancel_all()
        for name in reversed(DAEMONS):
            proc = self.processes.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _write_config(root: Path, node: str, hardware: str, ports: list[int]) -> Path:
    ctld_port, slurmd_port = ports
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "# A one-node cluster on loopback, written by tests/slurm_cluster.py",
                "ClusterName=hypertrain-test",
                f"SlurmctldHost={node}(127.0.0.1)",
                f"SlurmctldPort={ctld_port}",
                f"SlurmdPort={slurmd_port}",
                "SlurmUser=root" if os.geteuid() == 0 else f"SlurmUser={os.environ.get('USER', 'nobody')}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/filetxt",
                f"JobCompLoc={root / 'jobcomp.txt'}",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",  # memory is not consumed: jobs without --mem run side by side
                "SchedulerType=sched/builtin",
                "MpiDefault=none",
                "ReturnToService=2",
                f"KillWait={KILL_WAIT_S}",
                "MinJobAge=600",  # finished jobs stay visible to scontrol for the session
                # Job ids of their own: two test processes' clusters on this host must not derive
                # the same rendezvous port from the same job id (hypertrain.slurm_env).
                f"FirstJobId={1000 + os.getpid() % 10000 * 100}",
                "InactiveLimit=0",
                "SlurmdTimeout=60",
                "MailProg=/bin/true",
                f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} {hardware}",
                f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    return conf


def _wait(condition, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in cluster.processes.items():
            if proc.poll() is not None:
                raise ClusterError(
                    f"{name} exited with {proc.returncode} while waiting for {what}: "
                    + cluster.daemon_log(name, 5)
                )
        if condition():
            return
        time.sleep(0.2)
    raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")


def start(root: Path, timeout: float = START_TIMEOUT_S) -> Cluster:
    """Write the config under `root`, start munged, slurmctld and slurmd, and wait for an idle node."""
    if missing():
        raise ClusterError(
            f"not installed: {', '.join(missing())} (apt: slurmctld slurmd slurm-client munge)"
        )
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("munge", "state", "spool", "run", "log"):
        (root / sub).mkdir(mode=0o700, exist_ok=True)
    node = socket.gethostname().split(".")[0]
    conf = _write_config(root, node, node_hardware(), _free_ports(2))
    cluster = Cluster(root, node, os.environ | {"SLURM_CONF": str(conf)})
    for var in [k for k in cluster.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
        if var != "SLURM_CONF":  # a test run inside a SLURM job must not leak that job's settings
            del cluster.env[var]
    key = root / "munge" / "munge.key"
    subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
    key.chmod(0o600)
    socket_path = root / "munge" / "munge.socket"
    commands = {
        "munged": [
            _which("munged"),
            "--foreground",
            "--force",  # root, and a key and socket outside munge's own directories
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={root / 'run' / 'munged.pid'}",
            f"--seed-file={root / 'munge' / 'munged.seed'}",
            f"--log-file={root / 'log' / 'munged.log'}",
        ],
        "slurmctld": [_which("slurmctld"), "-D", "-i", "-f", str(conf)],
        "slurmd": [_which("slurmd"), "-D", "-N", node, "-f", str(conf)],
    }
    try:
        for name in DAEMONS:
            with open(root / "log" / f"{name}.out", "w") as out:
                cluster.processes[name] = subprocess.Popen(
                    commands[name], stdout=out, stderr=subprocess.STDOUT, env=cluster.env, cwd=root
                )
            if name == "munged":
                _wait(socket_path.exists, timeout, "munged's socket", cluster)
            if name == "slurmctld":
                _wait(
                    lambda: cluster.run("sinfo", "-h", check=False).returncode == 0,
                    timeout,
                    "slurmctld",
                    cluster,
                )

        def idle() -> bool:
            state = cluster.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.strip()
            return state == "idle"

        _wait(idle, timeout, "the node to be idle in sinfo", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster():
    """One cluster per test process, stopped at the session's end; a skip saying why where it cannot start."""
    root = Path(tempfile.mkdtemp(prefix="hypertrain-slurm-"))
    try:
        cluster = start(root)
    except (ClusterError, OSError, subprocess.SubprocessError) as e:
        shutil.rmtree(root, ignore_errors=True)
        reason = f"SLURM daemons could not be started: {e}"
        print(reason)
        pytest.skip(reason)
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    where = Path(tempfile.mkdtemp(prefix="hypertrain-slurm-"))
    t0 = time.monotonic()
    up = start(where)
    print(
        f"node {up.node} idle after {time.monotonic() - t0:.2f} s; "
        f"use: export SLURM_CONF={up.env['SLURM_CONF']}",
        flush=True,
    )
    print(up.run("sinfo").stdout, flush=True)
    # Ctrl-C, or SIGTERM (a background shell ignores SIGINT): cancel the jobs, stop the daemons.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        up.stop()
        shutil.rmtree(where, ignore_errors=True)
