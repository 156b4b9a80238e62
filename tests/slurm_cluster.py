"""A real one-node SLURM cluster on loopback for the tests: munged, slurmctld and slurmd as child processes.

`start(root)` writes a minimal slurm.conf and a fresh munge key under `root` (one node on 127.0.0.1
with this machine's CPUs and memory as `slurmd -C` reports them, processes tracked without cgroups,
no accounting, finished jobs in a job-completion text log, every spool, state, log and socket file
under `root`, free ports), starts the three daemons in the foreground as children of this process,
waits until `sinfo` shows the node idle, and returns a `Cluster` whose `env` (SLURM_CONF) every
client command and every submitted job needs. `Cluster.stop()` ends the daemons it started, by PID.

The session fixture `slurm_cluster` (registered in conftest.py) starts one per test process. It
skips, saying why, only where an installed daemon cannot run here (it exits while starting, or the
kernel refuses to execute it); a package that `scripts/setup --dev` installs but that is missing,
or a cluster that does not come up within its bound, fails. Without accounting `sacct` fails: read
a job with `Cluster.job` (scontrol) or `Cluster.completed` (the completion log).

Every bound below is derived from SLURM's own intervals, which `_write_config` writes into the
slurm.conf (the values are SLURM's defaults unless said), and from the CPU time of the work in
between, slowed by the load the tests must bear (SLOWDOWN).

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
SETUP = "scripts/setup --dev"  # installs the Debian packages below
PACKAGES = {"munged": "munge", "mungekey": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd"}
PACKAGES |= {name: "slurm-client" for name in CLIENTS}

# The load the bounds hold for: LOAD processes wanting a CPU on this machine's CORES, so that one
# process runs SLOWDOWN wall seconds per CPU second. LOAD = these tests' own at their busiest (a
# 2-task job beside its reference run's 2 ranks: 4), a CPU-bound process beside them (1) and another
# session's `pytest -n 2` (its 2 workers and the runs they start: 5). (Load averages of 2 to 13 were
# seen while the SLURM tests ran here with a CPU-bound process beside them.)
CORES, LOAD = 2, 10
SLOWDOWN = LOAD / CORES  # 5.0 wall seconds per CPU second
# SLURM's intervals, written into slurm.conf (SLURM 22.05's defaults but SlurmdTimeout and KillWait).
MESSAGE_TIMEOUT_S = 10  # MessageTimeout: the longest wait for a reply to one message
# One message to slurmctld: connecting is retried once a second for up to MessageTimeout
# (slurm_protocol_api.c, slurm_open_controller_conn), then the reply within MessageTimeout. Taken as
# the bound of every message below, to slurmctld or to slurmd (whose connections are not retried).
RPC_S = 2 * MESSAGE_TIMEOUT_S
SLURMD_TIMEOUT_S = 60  # SlurmdTimeout: slurmctld pings a node every SlurmdTimeout / 3 (controller.c)
PING_INTERVAL_S = SLURMD_TIMEOUT_S // 3
# SchedulerParameters: a submitted or updated job is scheduled by the event-driven pass, which
# slurmctld's background loop (once a second) runs when batch_sched_delay has passed since the
# last pass; the periodic full pass comes every sched_interval.
BATCH_SCHED_DELAY_S, SCHED_INTERVAL_S = 3, 60
# What a stopped run does between SIGTERM and its exit: the update in flight, the checkpoint and
# the `end` row (0.04 CPU s), the interpreter's exit (0.7): 0.77 CPU s measured with the 100-update
# run the requeue tests stop, rounded up to the second.
STOP_CPU_S = 1
KILL_WAIT_S = round(STOP_CPU_S * SLOWDOWN)  # KillWait, SIGTERM -> SIGKILL: the stop at SLOWDOWN (5 s)
# The cluster up, per stage (munged's socket, slurmctld answering, the node idle): slurmd registers
# as it starts; were that message lost, slurmctld asks again at its next ping of the node, and the
# answer is one more message. The daemons' own start-up is 0.05 CPU s (measured), under a second.
START_TIMEOUT_S = PING_INTERVAL_S + RPC_S  # 40 s
# A client command (sinfo, squeue, scontrol, scancel): one message, plus its own start-up (under
# 0.1 CPU s, so under 1 s at SLOWDOWN).
CLIENT_TIMEOUT_S = RPC_S + 1  # 21 s
# A job cancelled or requeued until SLURM holds it no more: scancel's message, KillWait, then the
# step's, the batch script's and the epilog's completion messages.
END_TIMEOUT_S = RPC_S + KILL_WAIT_S + 3 * RPC_S  # 85 s
# A daemon's exit after SIGTERM: slurmctld lets the messages in flight finish for up to
# CONTROL_TIMEOUT (30 s, slurmctld.h) before it saves its state and exits; then SIGKILL.
DAEMON_STOP_S = 30


class ClusterError(RuntimeError):
    """The cluster did not come up (the message says which daemon and why): the tests fail."""


class Refused(ClusterError):
    """An installed daemon or tool cannot run here: it exited while starting (munged refused by the
    kernel, say), or could not be executed. The message says which and why; the tests skip."""


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
    return [name for name in PACKAGES if _which(name) is None]


def not_installed(names: list[str]) -> str:
    """What to say when `names` are missing: they and their packages, and the command that installs them."""
    packages = sorted({PACKAGES[name] for name in names})
    return (
        f"not installed: {', '.join(names)} (Debian packages {' '.join(packages)}); "
        f"run `{SETUP}`, which installs {' '.join(sorted(set(PACKAGES.values())))}"
    )


def node_hardware() -> str:
    """`slurmd -C`'s description of this machine (CPUs, sockets, cores, threads, memory), as a node line."""
    # No message to send: a client command's bound is ample for its start-up.
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    line = out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else ""
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    if not all(k in fields for k in ("CPUs", "RealMemory")):
        raise Refused(f"slurmd -C did not describe this machine: {out.stdout!r} {out.stderr!r}")
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

    def run(
        self, *args: str, timeout: float = CLIENT_TIMEOUT_S, check: bool = True
    ) -> subprocess.CompletedProcess:
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

    def cancel_all(self, timeout: float = END_TIMEOUT_S) -> list[str]:
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
        SIGKILL what is left of them after DAEMON_STOP_S."""
        if self.processes.get("slurmctld") is not None and self.processes["slurmctld"].poll() is None:
            self.cancel_all()
        for name in reversed(DAEMONS):
            proc = self.processes.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=DAEMON_STOP_S)
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
                f"MessageTimeout={MESSAGE_TIMEOUT_S}",
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
                f"SchedulerParameters=batch_sched_delay={BATCH_SCHED_DELAY_S},sched_interval={SCHED_INTERVAL_S}",
                "MpiDefault=none",
                "ReturnToService=2",
                f"KillWait={KILL_WAIT_S}",
                "MinJobAge=600",  # finished jobs stay visible to scontrol for the session
                # Job ids of their own: two test processes' clusters on this host must not derive
                # the same rendezvous port (20000 + job id mod 20000, hypertrain.slurm_env) from the
                # same job id; and the ports stay below Linux's ephemeral ports (32768 and up, where
                # any connection on the host may hold one): job ids mod 20000 from 100 to 12767.
                f"FirstJobId={100 + os.getpid() % 127 * 100}",
                "InactiveLimit=0",
                f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
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
            if proc.poll() is not None:  # it cannot run here: its log says why
                raise Refused(
                    f"{name} exited with {proc.returncode} while waiting for {what}: "
                    + (cluster.daemon_log(name, 5) or _output(cluster, name) or "(it said nothing)")
                )
        if condition():
            return
        time.sleep(0.2)
    logs = "\n".join(f"--- {name}\n{cluster.daemon_log(name, 10)}" for name in cluster.processes)
    raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}, the daemons running:\n{logs}")


def _output(cluster: Cluster, name: str) -> str:
    path = cluster.root / "log" / f"{name}.out"
    return path.read_text(errors="replace")[-2000:] if path.exists() else ""


def start(root: Path, timeout: float = START_TIMEOUT_S) -> Cluster:
    """Write the config under `root`, start munged, slurmctld and slurmd, and wait for an idle node.
    Raises `Refused` where an installed daemon cannot run here, `ClusterError` for anything else
    (a missing package, a cluster not up within `timeout`)."""
    if missing():
        raise ClusterError(not_installed(missing()))
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
    made = subprocess.run(
        [_which("mungekey"), "--create", f"--keyfile={key}"], capture_output=True, text=True
    )
    if made.returncode != 0:
        raise Refused(f"mungekey --create exited with {made.returncode}: {made.stderr.strip()}")
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
                try:
                    cluster.processes[name] = subprocess.Popen(
                        commands[name], stdout=out, stderr=subprocess.STDOUT, env=cluster.env, cwd=root
                    )
                except OSError as e:  # installed, but this system will not execute it
                    raise Refused(f"{name} could not be executed: {e}") from e
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
    """One cluster per test process, stopped at the session's end: a skip saying why where an
    installed daemon cannot run here, a failure for anything else (a missing package, a timeout)."""
    root = Path(tempfile.mkdtemp(prefix="hypertrain-slurm-"))
    failure = None
    try:
        cluster = start(root)
    except Refused as e:
        shutil.rmtree(root, ignore_errors=True)
        reason = f"SLURM daemons cannot run here: {e}"
        print(reason)
        pytest.skip(reason)
    except (ClusterError, OSError, subprocess.SubprocessError) as e:
        shutil.rmtree(root, ignore_errors=True)
        failure = f"the SLURM test cluster did not come up: {e}"
    if failure is not None:  # outside the except: the message alone, not the chained traceback
        pytest.fail(failure, pytrace=False)
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
