"""Killed any number of times, anywhere, and resumed with resume=auto: the finished run is the run
that was never stopped (issue 21; docs/design.md invariant 9), as a property over random sequences.

Each case is one seeded random sequence of operations on ONE run directory: start it (a new run,
or resume=auto on a directory that does not exist yet), then one to three sessions killed with
SIGKILL, then a session that finishes it, then a resume of the finished run (a no-op). A killed
session is stopped either by the test-only fault hook (`HYPERTRAIN_FAULT=RANK:UPDATE:kill:POINT`,
hypertrain/failures/fault_points.py: at a named update, as its round starts, right after its inner step,
with its metrics row half written, or with its checkpoint's temporary file whole but not renamed),
or from outside at a moment the run does not choose: SIGKILL to the entry's process group a random
0-20 ms after the session's K-th row reached metrics.jsonl, or a random 0.5-3.5 s after launch (in
the start-up: imports, Hydra making the directory, the lock, building the data). Where no
checkpoint exists yet, the sequence may also ask resume=true, which must be refused (exit 2, one
line, nothing touched). The engine (stacked, loop; one dist sequence), the inner optimizer and the
checkpoint cadence (every sync, every 2nd sync, and mid-round every 3 updates) are drawn too.

After every operation:
- nothing outside the run directory was created, changed or removed: every file (its bytes and
  mtime) and folder (its mtime) of the test's folder, which holds the run's parent (with a
  neighbouring run and a file in it) and the cwd the entry runs in (with a file); the parent's
  own mtime may change only when the operation created the run directory;
- a killed session exits with its documented code (SIGKILL, -9; processes=dist, a rank killed by the
  hook: RankFailed's 3), its records hold no `end` row (SIGKILL leaves no last words; under dist a
  surviving rank 0 writes a `failed` one), every checkpoint on disk loads and names its update, and
  the newest is where the hook's point puts it (`hook_bounds`);
- a refused or no-op resume leaves every file of the test's folder, the run directory's included,
  as it was (bytes and mtimes), with exactly one line on stderr.
At the end, against an uninterrupted run of the same config:
- metrics.jsonl's training record (`record`: the held-out eval before training, every update and
  sync row, every checkpoint row) is equal (==) apart from the documented timing fields (`wall`,
  `rank_seconds`, `*_s`: tests/helpers.py `untimed`), with a checkpoint row's path taken relative
  to its run directory, and a `resume` row standing for the row of the checkpoint it resumed from;
- every session's first summary (the plan, the data) is the uninterrupted run's, and the last
  summary is too, apart from its timings and the throughput figures, which are the last session's
  (docs/report.md: `bench/*`, `train/replica_steps_per_s`, `train/presentations`, `train/timed_updates`);
- every session has the run's id, every session but the first resumes, exactly one `end` row, the
  last, `finished`;
- weights.pt is bit-identical (torch.equal), the same checkpoint files are kept
  (`checkpoint.keep` counts the run's own), and their states are identical.

Reproducing a failure: the case id is the seed (`pytest tests/test_kill_sequences.py -k seed-7-`),
and the operations are printed as they run (pytest shows them with the failure). The hook's kills
reproduce exactly; an external kill lands at the same row and delay, so at nearly the same point.

16 sequences: one in the quick loop (about 32 s with its uninterrupted run, `pytest -n 1`), 14
slow ones of stacked and loop and one slow dist sequence: the whole file took 218 s with `-n 1` on
this 2-core machine at load averages of 2-3 (each entry process 3-6 s, mostly its start-up).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helpers import (
    BASE,
    ENGINES,
    FAULT_ENV,
    INNERS,
    KILLED,
    TIMEOUT,
    ReferenceRuns,
    assert_same_weights,
    finish,
    start_entry,
    stderr_lines,
    untimed,
)

from hypertrain.config import MAY_CHANGE
from hypertrain.failures import RankFailed
from hypertrain.rundir.records import METRICS_FILE, read_metrics, session_rows

H = 2  # BASE's inner.H: a round is 2 updates, 8 updates in all
UPDATES = 8

CHECKPOINTS = {
    "every-sync": [],  # after updates 2, 4, 6, 8
    "every-2nd-sync": ["checkpoint.every=2"],  # after 4 and 8: a kill before 4 leaves none
    "mid-round": ["checkpoint.every_updates=3"],  # also after update 3, in round 2
}

POINTS = ("round", "after", "metrics", "checkpoint")  # the fault hook's points of one update

# Throughput figures of the final summary: the last session's (docs/report.md, "Throughput of a
# resumed run is its last session's"); they count what that session timed and presented.
SESSION_FIGURES = ("train/replica_steps_per_s", "train/presentations", "train/timed_updates")

DIST_FAILED = RankFailed.exit_code  # processes=dist: the entry's code when the hook kills a rank

# Every sequence is slow: the quick loop's resume cases are tests/test_resume.py's one kill and the
# churn, deadline and error-buffer kills beside it. Seed 14 (stacked, every sync, three kills by the
# hook) resumes from three different checkpoints: it found the checkpoint an earlier session resumed
# from left unpruned (checkpoint.written_by_run).
SEEDS = range(15)
DIST_SEED = 49  # rank 1 killed by the hook after update 6, then the whole job from outside


# -- what a sequence runs --------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A sequence's fixed draws: its config and how many sessions are killed."""

    seed: int
    engine: str
    inner: str
    checkpoints: str
    kills: int

    @property
    def overrides(self) -> list[str]:
        # cluster=h100: modelled compute, so the network clock each checkpoint holds is a number of the
        # run (measured compute would make it this session's timings) and is compared with the rest
        return [
            *BASE,
            "cluster=h100",
            *ENGINES[self.engine],
            *INNERS[self.inner],
            *CHECKPOINTS[self.checkpoints],
        ]


def plan(seed: int, engine: str | None = None) -> Plan:
    """The draws of `seed` (the engine forced for the dist sequence, which kills once or twice to
    stay cheap and checkpoints at every sync: a mid-round resume's measured collective bytes count
    only its session's part, docs/slurm.md)."""
    rng = random.Random(seed)
    engine = engine or rng.choice(["stacked", "loop"])
    inner = rng.choice(sorted(INNERS))
    checkpoints = "every-sync" if engine == "dist" else rng.choice(sorted(CHECKPOINTS))
    kills = rng.randint(1, 2 if engine == "dist" else 3)
    return Plan(seed, engine, inner, checkpoints, kills)


def _param(seed: int, engine: str | None = None):
    p = plan(seed, engine)
    return pytest.param(
        p,
        marks=pytest.mark.slow,
        id=f"seed-{seed}-{p.engine}-{p.inner}-{p.checkpoints}-{p.kills}kills",
    )


SEQUENCES = [_param(s) for s in SEEDS] + [_param(DIST_SEED, engine="dist")]


# -- the run directory and what surrounds it --------------------------------------------------------


@dataclass
class Place:
    """The test's folder: the run's parent (a neighbouring run and a file in it), the run directory,
    and the cwd the entry runs in (with a file of its own)."""

    root: Path
    run_dir: Path = field(init=False)
    cwd: Path = field(init=False)

    def __post_init__(self):
        parent = self.root / "runs"
        (parent / "neighbour").mkdir(parents=True)
        (parent / "neighbour" / METRICS_FILE).write_text('{"kind": "start"}\n')
        (parent / "notes.txt").write_text("the user's\n")
        self.cwd = self.root / "cwd"
        self.cwd.mkdir()
        (self.cwd / "notes.txt").write_text("the user's\n")
        self.run_dir = parent / "run"


def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[bytes | None, int]]:
    """Every file (bytes, mtime) and folder (None, mtime) under `root`, `root` included, but `skip`
    and what it holds: an mtime shows a file written back unchanged, or one made and removed."""
    found = {}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        if skip is not None and here == skip:
            dirs[:] = []
            continue
        found[str(here.relative_to(root))] = (None, here.stat().st_mtime_ns)
        for name in files:
            p = here / name
            found[str(p.relative_to(root))] = (p.read_bytes(), p.stat().st_mtime_ns)
    return found


def checkpoint_files(run_dir: Path) -> dict[int, Path]:
    """The run's checkpoints by the update they go on from (not the temporary files of a write)."""
    found = (run_dir / "checkpoints").glob("ckpt-u*.pt") if (run_dir / "checkpoints").is_dir() else []
    return {int(p.name[len("ckpt-u") : -len(".pt")]): p for p in found}


def newest(run_dir: Path) -> int:
    """The update the newest checkpoint goes on from; 0 for none."""
    return max(checkpoint_files(run_dir), default=0)


def finished(run_dir: Path) -> bool:
    """Whether the run's records end with a `finished` end row (a torn last line is not one)."""
    rows = session_rows(run_dir)
    return bool(rows) and rows[-1].get("kind") == "end" and rows[-1].get("status") == "finished"


def start_times(run_dir: Path) -> set[float]:
    """The `time` of every `start` row in metrics.jsonl: a session started later has another."""
    return {r["time"] for r in session_rows(run_dir) if r.get("kind") == "start"}


# -- the records compared -----------------------------------------------------------------------


def _checkpoint_entry(run_dir: Path, path: str, update: int, rnd: int) -> dict:
    # relative_to raises for a checkpoint outside the run directory: a run writes only its own.
    return {
        "kind": "checkpoint",
        "file": str(Path(path).relative_to(run_dir)),
        "update": update,
        "round": rnd,
    }


def record(run_dir: Path) -> list[dict]:
    """metrics.jsonl's training record: the eval, update and sync rows without their timings, and
    the checkpoints. A checkpoint saves metrics.jsonl's length before its own row, so resuming from
    it moves that row to metrics.superseded.jsonl and the session's `resume` row takes its place."""
    out = []
    for r in read_metrics(run_dir / METRICS_FILE):
        if r["kind"] in ("eval", "update", "sync"):
            out.append(untimed(r))
        elif r["kind"] == "checkpoint":
            out.append(_checkpoint_entry(run_dir, r["path"], r["update"], r["round"]))
        elif r["kind"] == "resume":
            out.append(_checkpoint_entry(run_dir, r["from"], r["update"], r["round"]))
    return out


def _untimed_summary(row: dict) -> dict:
    return {k: v for k, v in untimed(row).items() if not k.startswith("bench/") and k not in SESSION_FIGURES}


def assert_sessions(run_dir: Path, reference: Path) -> None:
    """The sessions of the finished run: one run id, every later one a resume, each one's first
    summary the reference's, the last summary the reference's but for timings and throughput, one
    `end` row, the last, finished."""
    rows, want = read_metrics(run_dir / METRICS_FILE), read_metrics(reference / METRICS_FILE)
    kinds = [r["kind"] for r in rows]
    starts = [i for i, k in enumerate(kinds) if k == "start"]
    assert starts[0] == 0 and len({rows[i]["run_id"] for i in starts}) == 1, starts
    assert kinds.count("resume") == len(starts) - 1 and all(kinds[i + 1] == "resume" for i in starts[1:]), (
        kinds
    )
    plan_summary = next(r for r in want if r["kind"] == "summary")
    for i in starts:  # a session's first summary follows its start (and its resume) row
        first = next(r for r in rows[i:] if r["kind"] == "summary")
        assert first == plan_summary, f"session at row {i}: {first} != {plan_summary}"
    final = [r for r in rows if r["kind"] == "summary"][-1]
    assert _untimed_summary(final) == _untimed_summary([r for r in want if r["kind"] == "summary"][-1])
    assert kinds.count("end") == 1 and kinds[-1] == "end" and rows[-1]["status"] == "finished", rows[-1]


def _same(a, b) -> bool:
    """Nested dicts, lists and tensors equal exactly (tensors: dtype and torch.equal)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def assert_same_checkpoints(run_dir: Path, reference: Path) -> None:
    """The same checkpoint files kept, each with the same state, config (but what a resume may
    change) and plan facts as the reference's."""
    got, want = checkpoint_files(run_dir), checkpoint_files(reference)
    assert sorted(got) == sorted(want), f"checkpoints kept: {sorted(got)}, uninterrupted: {sorted(want)}"
    for update, path in want.items():
        a, b = (torch.load(p, weights_only=False) for p in (got[update], path))
        assert _same(a["state"], b["state"]), f"the state in {got[update].name} differs"
        assert a["plan"] == b["plan"]
        assert {k: v for k, v in a["config"].items() if k not in MAY_CHANGE} == {
            k: v for k, v in b["config"].items() if k not in MAY_CHANGE
        }


# -- the operations ------------------------------------------------------------------------------


def hook_bounds(point: str, update: int, done: int, saved_at: list[int]) -> tuple[int, int]:
    """(lowest, highest) update the newest checkpoint may go on from after the hook kills the run
    at `point` of `update`, the newest being `done` before the session; `saved_at`: the updates the
    uninterrupted run checkpoints after. Every checkpoint before `update` is written before its
    inner step ('after'), its row ('metrics') or its own checkpoint's rename ('checkpoint'); 'round'
    strikes as the round, or the part of one a resume left, holding `update` starts: anywhere from
    the round's first update to `update` itself."""
    highest = max([c for c in saved_at if c < update], default=0)
    if point != "round":
        return highest, highest
    first = update - (update - 1) % H
    return max([done] + [c for c in saved_at if c < first]), highest


@dataclass
class Sequence:
    """One sequence's run directory, config and random choices at run time (seeded)."""

    plan: Plan
    place: Place
    saved_at: list[int]  # the uninterrupted run's checkpoint updates
    rng: random.Random = field(init=False)
    steps: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.rng = random.Random(f"operations-{self.plan.seed}")

    def say(self, line: str) -> None:
        self.steps.append(line)
        print(f"seed {self.plan.seed}: {line}", flush=True)

    def args(self, resume: str | None) -> list[str]:
        run_dir = self.place.run_dir
        if resume == "dir":
            return [*self.plan.overrides, f"resume={run_dir}"]
        where = [f"hydra.run.dir={run_dir}"]
        return [*self.plan.overrides, *where, *([f"resume={resume}"] if resume else [])]

    def launch(self, resume: str | None, fault: str | None = None):
        return start_entry(self.args(resume), self.place.cwd, {FAULT_ENV: fault} if fault else None)

    def guarded(self, operation) -> object:
        """Run `operation()`; nothing outside the run directory may change (the parent's mtime only
        when the run directory did not exist: a new run probes its parent for room to make it, then
        makes it, and a kill may fall between the two)."""
        run_dir, root = self.place.run_dir, self.place.root
        existed = run_dir.exists()
        before = snapshot(root, skip=run_dir)
        result = operation()
        after = snapshot(root, skip=run_dir)
        if not existed:  # probing the parent (run.directory.check_place) and making the run directory
            parent = str(run_dir.parent.relative_to(root))
            before[parent], after[parent] = (None, 0), (None, 0)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        assert not changed, f"outside the run directory, changed: {changed}; steps: {self.steps}"
        return result

    # -- a killed session

    def kill_by_hook(self, resume: str | None) -> None:
        """The fault hook kills the session at a random point of a random update it will run."""
        done = newest(self.place.run_dir)
        point = self.rng.choice(POINTS)
        updates = (
            [c for c in self.saved_at if c > done] if point == "checkpoint" else range(done + 1, UPDATES + 1)
        )
        update = self.rng.choice(list(updates))
        dist = self.plan.engine == "dist"
        # Only rank 0 writes rows and checkpoints; under dist either rank may die at the others.
        rank = self.rng.choice([0, 1]) if dist and point in ("round", "after") else 0
        fault = f"{rank}:{update}:kill:{point}"
        self.say(f"resume={resume}, {FAULT_ENV}={fault} (newest checkpoint before: {done})")
        seen = start_times(self.place.run_dir)
        done_proc = self.guarded(lambda: finish(self.launch(resume, fault)))
        want = DIST_FAILED if dist else KILLED
        assert done_proc.returncode == want, (done_proc.returncode, done_proc.stderr[-3000:], self.steps)
        assert not (self.place.run_dir / "weights.pt").exists()
        self.assert_stopped(seen, rank_zero_survived=dist and rank == 1)
        lowest, highest = hook_bounds(point, update, done, self.saved_at)
        got = newest(self.place.run_dir)
        assert lowest <= got <= highest, (
            f"newest checkpoint {got}, not in [{lowest}, {highest}]: {self.steps}"
        )
        if point == "checkpoint":  # the write cut short before its rename: the previous one is newest
            tmp = self.place.run_dir / "checkpoints" / f"ckpt-u{update:07d}.pt.tmp"
            assert tmp.is_file(), self.steps

    def kill_from_outside(self, resume: str | None) -> None:
        """SIGKILL to the entry's process group at a moment it does not choose: in its start-up, or
        0-20 ms (a few rows' time: an update here takes 10-20 ms) after its session's K-th row."""
        run_dir = self.place.run_dir
        done = newest(run_dir)
        if self.rng.random() < 0.25:
            rows, delay = None, self.rng.uniform(0.5, 3.5)  # the start-up takes about 3 s here
        else:  # a session writes about 3 rows per update: K up to the end of the run
            rows, delay = self.rng.randint(0, 3 * (UPDATES - done) + 3), self.rng.uniform(0, 0.02)
        when = f"{delay:.3f} s after launch" if rows is None else f"{delay * 1000:.1f} ms after row {rows}"
        self.say(f"resume={resume}, SIGKILL from outside {when} (newest checkpoint before: {done})")
        seen = start_times(run_dir)

        def run():
            proc = self.launch(resume)
            _kill_when(proc, run_dir, seen, rows, delay)
            return finish(proc)

        done_proc = self.guarded(run)
        self.say(f"  exit {done_proc.returncode}, newest checkpoint {newest(run_dir)}")
        if done_proc.returncode == 0 or finished(run_dir):  # it got there first, or had closed its records
            assert finished(run_dir) and (run_dir / "weights.pt").is_file(), (
                done_proc.stderr[-3000:],
                self.steps,
            )
            return
        assert done_proc.returncode == KILLED, (done_proc.returncode, done_proc.stderr[-3000:], self.steps)
        self.assert_stopped(seen, rank_zero_survived=False)
        assert newest(run_dir) in [0, *self.saved_at] and newest(run_dir) >= done, self.steps

    def assert_stopped(self, seen: set[float], rank_zero_survived: bool) -> None:
        """A killed session's records and checkpoints: no `end` row after its `start` row (one whose
        time is not in `seen`; an outside kill may land before it writes one), under dist a
        `failed` one where rank 0 survived; and every checkpoint whole."""
        rows = session_rows(self.place.run_dir)
        mine = [i for i, r in enumerate(rows) if r.get("kind") == "start" and r.get("time") not in seen]
        ends = [r for r in rows[mine[-1] :] if r.get("kind") == "end"] if mine else []
        if rank_zero_survived:
            assert [r["status"] for r in ends] == ["failed"], (ends, self.steps)
        else:
            assert ends == [], (ends, self.steps)
        for update, path in checkpoint_files(self.place.run_dir).items():
            saved = torch.load(path, weights_only=False)  # a kill never leaves a torn one in place
            assert saved["state"]["next_update"] == update, (path, self.steps)

    # -- refused, finished, and a no-op

    def whole(self, resume: str, fault: str | None = None):
        """A session that must not change anything: every file of the test's folder stays."""
        before = snapshot(self.place.root)
        done = finish(self.launch(resume, fault))
        assert snapshot(self.place.root) == before, f"resume={resume} changed files: {self.steps}"
        return done

    def refused(self) -> None:
        """resume=true where no checkpoint exists: refused with one line, exit 2, nothing touched."""
        self.say("resume=true without a checkpoint: refused")
        done = self.whole("true")
        lines = stderr_lines(done.stderr)
        assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:], self.steps)
        assert lines[0].startswith(
            f"hypertrain: error: resume=true but {self.place.run_dir} holds no checkpoint"
        )

    def finish_run(self, resume: str) -> None:
        # Under dist, rank 1 may also die as it tears down after the run finished (the run stays
        # finished, exit 0: docs/resume.md, tests/test_signals.py).
        fault = f"1:{UPDATES}:kill:end" if self.plan.engine == "dist" and self.rng.random() < 0.5 else None
        self.say(f"resume={resume}{f', {FAULT_ENV}={fault}' if fault else ''}: runs to the end")
        done = self.guarded(lambda: finish(self.launch(resume, fault)))
        assert done.returncode == 0, (done.stderr[-3000:], self.steps)
        assert not [x for x in done.stderr.splitlines() if x.startswith("hypertrain: error")], done.stderr
        assert finished(self.place.run_dir), self.steps

    def no_op(self, resume: str) -> None:
        """A finished run resumed: exit 0, one line, nothing run or written."""
        self.say(f"resume={resume} of the finished run: a no-op")
        done = self.whole(resume)
        assert done.returncode == 0, (done.stderr[-3000:], self.steps)
        assert stderr_lines(done.stderr) == [
            f"hypertrain: {self.place.run_dir} has finished (update {UPDATES} of {UPDATES}); nothing was "
            "run or written (a longer phase.updates with the same explicit inner.decay_steps extends it: "
            "docs/resume.md)"
        ], (done.stderr, self.steps)


def _kill_when(proc, run_dir: Path, seen: set[float], rows: int | None, delay: float) -> None:
    """SIGKILL `proc`'s process group `delay` s after launch (`rows` None), or `delay` s after its
    session (a `start` row whose time is not in `seen`) has `rows` whole rows after its start row;
    nothing when it exits first. Polls every millisecond (an update takes 10-20 ms here)."""
    deadline = time.monotonic() + TIMEOUT
    launched = time.monotonic()
    metrics, size = run_dir / METRICS_FILE, -1
    while proc.poll() is None and time.monotonic() < deadline:
        if rows is None:
            if time.monotonic() - launched >= delay:
                break
        elif metrics.exists() and metrics.stat().st_size != size:
            data = metrics.read_bytes()
            size = len(data)
            lines = data.split(b"\n")[:-1]  # whole rows only: the last one may be half written
            mine = [i for i, line in enumerate(lines) if b'"start"' in line and _new_start(line, seen)]
            if mine and len(lines) - 1 - mine[-1] >= rows:
                time.sleep(delay)
                break
        time.sleep(0.001)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the entry and every process it started, nothing else


def _new_start(line: bytes, seen: set[float]) -> bool:
    try:
        row = json.loads(line)
    except ValueError:
        return False
    return isinstance(row, dict) and row.get("kind") == "start" and row.get("time") not in seen


# -- the property ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run of a config, run once per config the session's sequences draw (the
    session's references, `ReferenceRuns`)."""
    return ReferenceRuns.beside(tmp_path_factory.mktemp("uninterrupted"))


@pytest.mark.parametrize("p", SEQUENCES)
def test_killed_and_resumed_any_number_of_times_the_run_is_the_uninterrupted_one(tmp_path, p, uninterrupted):
    reference = uninterrupted(p.overrides)
    saved_at = [r["update"] for r in read_metrics(reference / METRICS_FILE) if r["kind"] == "checkpoint"]
    seq = Sequence(p, Place(tmp_path), saved_at)
    seq.say(f"{p.overrides}; uninterrupted run checkpoints after {saved_at}")
    run_dir = seq.place.run_dir

    resume: str | None = seq.rng.choice([None, "auto"])  # a new run, or a scheduler's first start
    for i in range(p.kills):
        if finished(run_dir):  # an outside kill came too late: nothing left to stop
            break
        if newest(run_dir) == 0 and seq.rng.random() < 0.3:
            seq.refused()
        if i:  # every later session resumes; resume=true only where it can
            resume = "true" if newest(run_dir) and seq.rng.random() < 0.3 else "auto"
        if seq.rng.random() < 0.6:
            seq.kill_by_hook(resume)
        else:
            seq.kill_from_outside(resume)

    if not finished(run_dir):
        seq.finish_run("true" if newest(run_dir) and seq.rng.random() < 0.3 else "auto")
    seq.no_op(seq.rng.choice(["auto", "true", "dir"]))

    got, want = record(run_dir), record(reference)
    assert [r.get("update") for r in got] == [r.get("update") for r in want], seq.steps
    for a, b in zip(got, want, strict=True):
        assert a == b, f"{a} != {b}; steps: {seq.steps}"
    assert_sessions(run_dir, reference)
    assert_same_weights(torch.load(run_dir / "weights.pt"), torch.load(reference / "weights.pt"))
    assert_same_checkpoints(run_dir, reference)
