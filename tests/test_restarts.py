"""Real processes that restart themselves (issue 26): a worker killed with SIGKILL at a named update
makes torch's elastic agent stop and restart every worker, and the restarted session goes on from
the newest checkpoint (or from the start) in the same run directory (docs/resume.md, "Restarts").

`test_a_killed_worker_restarts_and_the_run_equals_an_uninterrupted_one` runs each of three restarted
runs, `processes=dist world=2 replicas=2` (two worker processes of one torch thread each, plus the
entry, or torchrun's agent), beside the session's reference run (the first in the quick loop, the
other two slow):

- torchrun, `--max-restarts 1` (torchrun reads it from `PET_MAX_RESTARTS`), rank 1 killed right
  after update 4, before the ranks agree whether to stop: rank 0's collective fails, the agent
  restarts both; with `checkpoint.every_updates=2` the newest checkpoint is the sync's after update
  3 (update 4's is not written yet), and the failed session recorded nothing after it;
- self-launched, `processes.max_restarts=1`, rank 0 (the writer) killed while it writes update 4's
  checkpoint (its temporary file whole, not renamed): it goes on from update 3 again, and update 4,
  which the failed session had recorded, is run again (`recomputed` 1);
- torchrun, `--max-restarts 1`, `checkpoint.every=2` (no checkpoint before the run's end), rank 0
  killed as round 2 starts: the restart starts the run over in the same directory, under the same
  run id, the failed session's rows (updates 1-3) moved to metrics.superseded.jsonl;
- the same run uninterrupted, self-launched: the reference (`helpers.ReferenceRuns`, made once).

Each restarted run must exit 0 with one `restart` row (the count, the update gone on from, the
updates recomputed), no `preempted` end row anywhere, and per-replica losses, sync rows, held-out
losses and final weights equal (==) to the reference's. The fault fires only in the session of restart
count 0 (fault_points' default), so the restarted workers run through.

Bad input (one line, exit 2): `processes.max_restarts=-1`, and under torchrun with restarts a run
directory left to Hydra's default, a `resume=` that names a checkpoint, or a `processes.max_restarts`
other than torchrun's (`torchrun_restarts`, called here in this process with torchrun's environment).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import FAULT_ENV, QUICK, ReferenceRuns, assert_identical, entry, stderr_lines

from hypertrain.rundir.checkpoint import SUPERSEDED_FILE, checkpoints
from hypertrain.rundir.records import METRICS_FILE, read_metrics
from hypertrain.train import torchrun_restarts

# Workers share two cores with other tests' here: a restarted worker may wait long for its peers' imports.
COMMON = [*QUICK, "logger=none", "processes=dist", "world=2", "replicas=2", "processes.timeout_s=90"]


def rows(path: Path) -> list[dict]:
    return read_metrics(path) if path.exists() else []


RUNS = {
    # name: (overrides, torchrun processes (0: self-launched), fault, the restart row expected)
    "torchrun-rank1-after-4": (
        ["checkpoint.every_updates=2"],
        2,
        "1:4:kill:after",
        {"update": 3, "recomputed": 0, "from": "ckpt-u0000003.pt"},
    ),
    "self-launched-rank0-checkpoint-4": (
        ["checkpoint.every_updates=2", "processes.max_restarts=1"],
        0,
        "0:4:kill:checkpoint",
        {"update": 3, "recomputed": 1, "from": "ckpt-u0000003.pt"},
    ),
    "torchrun-from-the-start": (
        ["checkpoint.every=2"],
        2,
        "0:4:kill:round",
        {"update": 0, "recomputed": 3, "from": None},
    ),
}


@pytest.mark.slow  # torch's agent restarting real workers: the full suite's
@pytest.mark.parametrize("name", list(RUNS))
def test_a_killed_worker_restarts_and_the_run_equals_an_uninterrupted_one(tmp_path, name):
    overrides, torchrun, fault, expected = RUNS[name]
    env = {FAULT_ENV: fault} | ({"PET_MAX_RESTARTS": "1"} if torchrun else {})
    run_dir = tmp_path / name
    result = entry([*COMMON, *overrides, f"hydra.run.dir={run_dir}"], tmp_path, env=env, torchrun=torchrun)
    reference = ReferenceRuns.beside(tmp_path)(COMMON)
    want = [r for r in rows(reference / METRICS_FILE) if r["kind"] == "summary" and "run/restarts" in r]
    assert [r["run/restarts"] for r in want] == [0]

    assert result.returncode == 0, (name, result.stderr[-3000:])
    kept, moved = rows(run_dir / METRICS_FILE), rows(run_dir / SUPERSEDED_FILE)
    restarts = [r for r in kept if r["kind"] == "restart"]
    assert len(restarts) == 1, (name, restarts)
    row = restarts[0]
    got = {k: v for k, v in row.items() if k != "superseded_bytes"} | {
        "from": row["from"] and Path(row["from"]).name
    }
    assert got == {"kind": "restart", "count": 1, "max_restarts": 1} | expected, name
    assert row["superseded_bytes"] == (run_dir / SUPERSEDED_FILE).stat().st_size > 0, name
    # The failed session's updates after the point gone on from: moved aside, none lost or doubled.
    assert [r["update"] for r in moved if r["kind"] == "update"] == list(
        range(expected["update"] + 1, expected["update"] + 1 + expected["recomputed"])
    ), name
    assert [r["update"] for r in kept if r["kind"] == "update"] == list(range(1, 7)), name
    # The agent's SIGTERM to the survivors is no preemption; the run finished.
    ends = [r for r in kept + moved if r["kind"] == "end"]
    assert all(r["status"] in ("finished", "failed") for r in ends), (name, ends)
    assert [r["status"] for r in kept if r["kind"] == "end"] == ["finished"], name
    assert not any(r.get("exit_code") == 143 for r in ends), name
    assert len({r["run_id"] for r in kept + moved if r["kind"] == "start"}) == 1, name
    lines = [line for line in stderr_lines(result.stderr) if line.startswith("hypertrain:")]
    assert "hypertrain: restart 1 of 1 after a worker failed: going on from " in " ".join(lines), name
    assert not any(line.startswith(("hypertrain: error", "hypertrain: stopped")) for line in lines), (
        name,
        lines,
    )
    assert not list((run_dir / "checkpoints").glob("*.tmp")), name
    assert [p.name for p in checkpoints(run_dir)][-1] == "ckpt-u0000006.pt", name
    assert_identical(run_dir, reference)
    summary = [r for r in kept if r["kind"] == "summary" and "run/restarts" in r][-1]
    assert summary["run/restarts"] == 1, name  # the summary counts the agent's restarts

    if name == "torchrun-rank1-after-4":
        # The survivor of the worker killed after update 4 says the agent restarts it, as does its end row.
        restarting = "torch's agent restarts every rank (restart 1 of 1)"
        warnings = [line for line in stderr_lines(result.stderr) if line.startswith("hypertrain: warning")]
        assert [
            line.startswith("hypertrain: warning: rank 0: ") and line.endswith(restarting)
            for line in warnings
        ] == [True], warnings
        failed = [r for r in rows(run_dir / SUPERSEDED_FILE) if r["kind"] == "end"]
        assert [(r["status"], r["exit_code"], r["error"].endswith(restarting)) for r in failed] == [
            ("failed", 3, True)
        ]


def test_an_async_restart_counts_the_server_updates_and_jobs_it_runs_again(tmp_path, monkeypatch):
    """Issue 48: a restarted outer.schedule=async session counts what it runs again in the schedule's own
    unit: the arrival rows (server updates, as the checkpoint's `update`) the failed session had recorded
    after the checkpoint gone on from, and the jobs they applied; it counted update rows (none: 0). On a
    copy of the async reference's records, rewound (`restart_here`, as rank 0 of a restarted session) to
    its checkpoint after server update 2, which checkpoint.keep pruned: its `metrics_bytes` is where its
    checkpoint row starts (the rule checked on the newest but one, kept). Expected from the rows after
    that point, which are what moves to metrics.superseded.jsonl."""
    from test_async import ASYNC

    from hypertrain.records.rows import ArrivalRow
    from hypertrain.run.session import recorded_after, restart_here

    run_dir = tmp_path / "async"
    shutil.copytree(ReferenceRuns.beside(tmp_path)(ASYNC), run_dir, ignore=shutil.ignore_patterns("report"))
    data = (run_dir / METRICS_FILE).read_bytes()
    lines = data.splitlines(keepends=True)
    written = [json.loads(line) for line in lines]

    def start_of_checkpoint_row(update: int) -> tuple[int, int]:
        (at,) = [i for i, r in enumerate(written) if r["kind"] == "checkpoint" and r["update"] == update]
        return at, sum(len(line) for line in lines[:at])

    # the rule, on the newest but one checkpoint (kept): its metrics_bytes is where its row starts
    kept = checkpoints(run_dir)[-2]
    saved = torch.load(kept, weights_only=False)
    newest_but_one = saved["state"]["next_update"]
    assert saved["metrics_bytes"] == start_of_checkpoint_row(newest_but_one)[1] and newest_but_one > 2
    at, offset = start_of_checkpoint_row(2)
    arrivals = [r for r in written[at:] if r["kind"] == "arrival"]
    assert arrivals and [r["update"] for r in arrivals] == list(range(3, 3 + len(arrivals)))
    jobs = sum(len(r["replicas"]) for r in arrivals)
    torchrun_env(monkeypatch, count=1)
    saved = {"metrics_bytes": offset, "state": {"next_update": 2}}
    resume, restart = restart_here(run_dir, (run_dir / "checkpoints" / "ckpt-u0000002.pt", saved), True)
    assert (restart.update, restart.recomputed, restart.jobs) == (2, len(arrivals), jobs)
    assert restart.row().recomputed == len(arrivals)
    moved = [r for r in rows(run_dir / SUPERSEDED_FILE) if r["kind"] == "arrival"]
    assert moved == arrivals and resume.superseded == len(data) - offset
    assert restart.line().endswith(
        f"at server update 2; {len(arrivals)} server updates ({jobs} jobs) the failed session had recorded "
        "run again"
    )
    # Where a server update applied two jobs the units differ; a row written twice counts once; the
    # update rows a rounds run counts are none of them.
    two, one = ArrivalRow(update=3, replicas=[0, 1]), ArrivalRow(update=4, replicas=[1])
    data = "".join(json.dumps(r.to_json()) + "\n" for r in (two, one, two)).encode()
    assert recorded_after(data, 2, asynchronous=True) == (2, 3)
    assert recorded_after(data, 3, asynchronous=True) == (1, 1)
    assert recorded_after(data, 2, asynchronous=False) == (0, None)


def test_a_negative_max_restarts_is_one_line_and_creates_nothing(tmp_path):
    run_dir = tmp_path / "run"
    done = entry([*COMMON, "processes.max_restarts=-1", f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert stderr_lines(done.stderr) == [
        "hypertrain: error: processes.max_restarts=-1 is not valid; valid: >= 0 (0: a failed worker ends "
        "the run)"
    ]
    assert list(tmp_path.iterdir()) == []


TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


def torchrun_env(monkeypatch, count: int, allowed: int = 1) -> None:
    """This process as rank 0 of a torchrun with `--max-restarts allowed`, at restart `count`."""
    env = TORCHRUN_ENV | {
        "TORCHELASTIC_RUN_ID": "test",
        "TORCHELASTIC_RESTART_COUNT": str(count),
        "TORCHELASTIC_MAX_RESTARTS": str(allowed),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            [],
            "torchrun --max-restarts 1 needs hydra.run.dir=<a directory>: every restart resumes the run "
            "where the first start wrote it, and Hydra's default directory is named by the time of each "
            "start; valid: hydra.run.dir=DIR",
        ),
        (["hydra.run.dir=outputs/${now:%H-%M-%S}"], "torchrun --max-restarts 1 needs hydra.run.dir="),
        (
            ["hydra.run.dir=run", "resume=run/checkpoints/ckpt-u0000003.pt"],
            "resume='run/checkpoints/ckpt-u0000003.pt' names a checkpoint, but under torchrun --max-restarts "
            "1 every restart resumes from the newest checkpoint of hydra.run.dir; valid: "
            "hydra.run.dir=<its run directory> resume=true",
        ),
        (
            ["hydra.run.dir=run", "processes.max_restarts=2"],
            "processes.max_restarts=2 but torchrun's --max-restarts is 1; valid: "
            "processes.max_restarts=0 (torchrun's --max-restarts decides) or 1",
        ),
    ],
    ids=["no-run-dir", "a-dated-run-dir", "resume-a-checkpoint", "max-restarts-differ"],
)
def test_torchrun_with_restarts_refuses_what_a_restart_could_not_resume(monkeypatch, capsys, args, says):
    torchrun_env(monkeypatch, count=0)
    with pytest.raises(SystemExit) as stop:
        torchrun_restarts(["train", "processes=dist", *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"hypertrain: error: {says}"), err
    # The same mistake on a restart the agent still makes: exit 2 without repeating the line.
    torchrun_env(monkeypatch, count=1)
    with pytest.raises(SystemExit) as again:
        torchrun_restarts(["train", "processes=dist", *args])
    assert again.value.code == 2 and capsys.readouterr().err == ""


def test_a_restart_under_torchrun_resumes_with_resume_auto(monkeypatch):
    argv = ["train", "processes=dist", "hydra.run.dir=run", "resume=true", "processes.max_restarts=1"]
    torchrun_env(monkeypatch, count=0)
    assert torchrun_restarts(argv) == argv  # the first start: as given
    torchrun_env(monkeypatch, count=1)
    assert torchrun_restarts(argv) == [*argv[:3], argv[4], "resume=auto"]
    torchrun_env(monkeypatch, count=1, allowed=0)  # no restarts allowed: nothing is asked of the command
    assert torchrun_restarts(["train", "processes=dist"]) == ["train", "processes=dist"]
