"""Stop anywhere, resume from the last checkpoint: the rest is bit-identical (docs/design.md invariant 9).

Every case runs the entry as a user does (`python -m hypertrain.train`, a subprocess) and stops a
run with the test-only fault hook (`HYPERTRAIN_FAULT=RANK:UPDATE:kill`: SIGKILL at the start of
the round that holds UPDATE; the entry itself for the one-process engines, rank 1 for processes=dist),
then resumes it with `resume=true`. The resumed run must equal the uninterrupted run of the same
config exactly (==, no tolerance: the same machine runs the same arithmetic in the same order):
every update row but its timings (per-replica losses, lr, tokens, round), every sync row but its
seconds (held-out loss, pseudo-gradient norm, running byte totals), the held-out loss before
training, the final summary, and every tensor of weights.pt (torch.equal). Its records must show
the stop: the rows after the checkpoint moved to metrics.superseded.jsonl byte for byte, one
`resume` row naming the checkpoint, every update once, a finished `end` row.

The default cases: engine=stacked AdamW on windows, engine=loop Muon on documents, processes=dist
with 2 processes (world 2, R = 2) whose rank 1 dies; the rest of engine x optimizer x data, and
other fault points (right after a checkpointed sync with H = 3, two rounds past the checkpoint with
H = 1), are marked slow. With logger=wandb the two sessions are one W&B run (one id, two offline
folders). Negative controls show the comparison can fail: a checkpoint whose outer momentum was
zeroed, or whose replica 1 step count was changed (AdamW's bias correction uses it), resumed the
same way, gives other losses and weights, exactly where the edited state first acts. Refusals (a
resume that cannot be done, a config that changed, every checkpoint corrupt) exit 2 with one line
and leave every file as it was (a changed config named as the user changed it, with the run's value
to resume with, which then resumes); a corrupt newest checkpoint falls back to the one before. A
finished run extended (phase.updates longer, the same explicit inner.decay_steps) is its continuation.
A killed run reported on (`python -m hypertrain.report` and `python -m hypertrain.clock`, their
default report/ in the run directory) still resumes with resume=auto, to the same run, its report
untouched.

A known limitation: a SIGKILLed session's W&B piece holds only what wandb's writer had flushed
(often nothing); the test asserts what it holds is exact and in order, not that it is complete.
"""

from __future__ import annotations

import io
import shutil
import struct
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from helpers import (
    BASE,
    DATA,
    ENGINES,
    INNERS,
    KILLED,
    QUICK,
    RUN,
    assert_identical,
    ckpt,
    entry,
    finish,
    outcome,
    start_entry,
    stderr_lines,
    tree,
)

from hypertrain.config import DERIVED, ResumeMode, ResumeRequest, TrainConfig, UserError, flatten
from hypertrain.failures import RankFailed
from hypertrain.report import cli as report
from hypertrain.report.clock import retime
from hypertrain.rundir import checkpoint
from hypertrain.rundir.checkpoint import SUPERSEDED_FILE, digest_path, seal
from hypertrain.rundir.records import METRICS_FILE, read_metrics
from hypertrain.rundir.wandb_offline import read_run

DIST_FAILED = RankFailed.exit_code  # the entry's exit code when a dist rank dies (docs/errors.md)


def copy_run(source: Path, to: Path) -> Path:
    shutil.copytree(source, to)
    return to


# -- what a run produced, and the exact comparison -------------------------------------------------


def assert_resumed_records(run_dir: Path, before: bytes, path: Path, saved: dict, updates: int) -> list[int]:
    """metrics.jsonl of a run resumed once from `path` (payload `saved`) after a session that left
    `before` in it: the rows up to the checkpoint kept byte for byte, the rest moved to
    metrics.superseded.jsonl byte for byte, one `resume` row, updates 1..`updates` once each, in
    order, and a finished end. Returns the superseded rows' update numbers."""
    cut = saved["metrics_bytes"]
    assert 0 < cut < len(before)
    assert (run_dir / METRICS_FILE).read_bytes()[:cut] == before[:cut]
    assert (run_dir / SUPERSEDED_FILE).read_bytes() == before[cut:]
    rows = read_metrics(run_dir / METRICS_FILE)
    kinds = [r["kind"] for r in rows]
    assert [r["update"] for r in rows if r["kind"] == "update"] == list(range(1, updates + 1))
    syncs = [r["update"] for r in rows if r["kind"] == "sync"]
    assert syncs == sorted(set(syncs)) and syncs[-1] == updates, syncs
    assert kinds.count("start") == 2 and kinds.count("end") == 1 and kinds.count("eval") == 1, kinds
    second = [i for i, kind in enumerate(kinds) if kind == "start"][1]
    assert second == before[:cut].count(b"\n")  # the new session begins at the cut
    state = saved["state"]
    assert rows[second + 1] == {
        "kind": "resume",
        "from": str(path),
        "update": state["next_update"],
        "round": state["rounds_done"],
        "superseded_bytes": len(before) - cut,
    }
    assert kinds.count("resume") == 1
    resumed = [r["update"] for r in rows[second:] if r["kind"] == "update"]
    assert resumed == list(range(state["next_update"] + 1, updates + 1))
    assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "finished", rows[-1]
    return [r["update"] for r in read_metrics(run_dir / SUPERSEDED_FILE) if r["kind"] == "update"]


def kill_and_resume(
    tmp_path: Path, overrides: list[str], fault: str, killed_rc: int, at: int, updates: int
) -> tuple[Path, list[int]]:
    """Run until the fault kills it (its newest checkpoint must be ckpt-u`at`), resume with
    resume=true; check the records of both sessions. Returns the run directory and the update rows
    the resumed session superseded."""
    run_dir = tmp_path / "run"
    killed = entry([*overrides, f"hydra.run.dir={run_dir}"], tmp_path, fault)
    assert killed.returncode == killed_rc, killed.stderr
    assert not (run_dir / "weights.pt").exists()
    newest = sorted((run_dir / "checkpoints").glob("ckpt-u*.pt"))[-1]
    assert newest == ckpt(run_dir, at)
    saved = torch.load(newest, weights_only=False)
    before = (run_dir / METRICS_FILE).read_bytes()

    done = entry([*overrides, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr
    return run_dir, assert_resumed_records(run_dir, before, newest, saved, updates)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """BASE run uninterrupted, every checkpoint kept (ckpt-u2, u4, u6, u8): what resumed runs must
    equal, and the run directory the refusals and the edited checkpoints start from."""
    where = tmp_path_factory.mktemp("reference")
    done = entry([*BASE, "checkpoint.keep=10", f"hydra.run.dir={where / 'run'}"], where)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (where / "run" / "checkpoints").iterdir()) == [
        name for u in (2, 4, 6, 8) for name in (ckpt(where, u).name, f"{ckpt(where, u).name}.sha256")
    ]
    return where / "run"


# -- 1, 2: killed anywhere, resumed, identical; the records of both sessions ----------------------

# The quick loop kills one run; test_dist and test_preemption kill dist and loop runs in it too.
DEFAULT_CASES = {("stacked", "adamw", "windows")}


@dataclass
class Kill:
    overrides: list[str]  # the run's config; checkpoint.* may differ from the reference's
    fault: str  # HYPERTRAIN_FAULT
    at: int  # the newest checkpoint when the fault strikes (its next update)
    superseded: list[int]  # update rows written after that checkpoint (moved aside on resume)
    killed_rc: int = KILLED
    updates: int = 8


def _matrix_case(engine: str, inner: str, data: str) -> Kill:
    """4 rounds of 2 updates, a checkpoint every 2 syncs; the fault strikes as round 4 starts
    (update 7): the newest checkpoint is after round 2 (update 4), round 3's rows are superseded."""
    rank = "1" if engine == "dist" else "0"  # dist: rank 1 dies, rank 0 writes the run
    return Kill(
        [*BASE, *ENGINES[engine], *INNERS[inner], *DATA[data], "checkpoint.every=2"],
        f"{rank}:7:kill",
        at=4,
        superseded=[5, 6],
        killed_rc=DIST_FAILED if engine == "dist" else KILLED,
    )


KILLS = [
    pytest.param(
        _matrix_case(e, i, d), marks=() if (e, i, d) in DEFAULT_CASES else pytest.mark.slow, id=f"{e}-{i}-{d}"
    )
    for e in ENGINES
    for i in INNERS
    for d in DATA
] + [
    # H = 3 (2 rounds), a checkpoint every sync: the fault names update 5, mid-round, and strikes as
    # round 2 starts, right after the sync of update 3 and its checkpoint; no update row is superseded.
    pytest.param(Kill([*RUN], "0:5:kill", 3, [], updates=6), marks=pytest.mark.slow, id="after-a-sync-h3"),
    # H = 1, a checkpoint every 3 syncs: the fault strikes after the sync of update 5, two rounds
    # past the checkpoint (update 3), whose rows are superseded.
    pytest.param(
        Kill([*RUN, "inner.H=1", "checkpoint.every=3"], "0:6:kill", 3, [4, 5], updates=6),
        marks=pytest.mark.slow,
        id="mid-interval-h1",
    ),
    # A mixture of experts (docs/moe.md), Muon on the experts, the router's aux loss on: killed as round
    # 4 starts, resumed from round 2's checkpoint; the routed run's rows (router figures included) and
    # weights equal the uninterrupted run's.
    pytest.param(
        Kill([*BASE, "model=moe_tiny", "inner=muon", "checkpoint.every=2"], "0:7:kill", 4, [5, 6]),
        marks=pytest.mark.slow,
        id="moe-tiny-muon",
    ),
]


@pytest.mark.parametrize("case", KILLS)
def test_a_killed_run_resumed_equals_the_uninterrupted_run_exactly(tmp_path, case, request):
    """Invariant 9, and the records of the two sessions (see `assert_resumed_records`)."""
    plain = [o for o in case.overrides if not o.startswith("checkpoint.")]
    if plain == BASE:
        reference, proc = request.getfixturevalue("reference"), None
    else:  # its own uninterrupted run, started beside the killed one
        reference = tmp_path / "reference"
        proc = start_entry([*plain, f"hydra.run.dir={reference}"], tmp_path)
    try:
        run_dir, superseded = kill_and_resume(
            tmp_path, case.overrides, case.fault, case.killed_rc, case.at, case.updates
        )
    finally:
        done = finish(proc) if proc is not None else None
    assert done is None or done.returncode == 0, done.stderr
    assert superseded == case.superseded
    assert_identical(run_dir, reference)


# -- 3: W&B: the two sessions are one W&B run ------------------------------------------------------


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    """Killed as round 4 starts (update 7), resumed from the checkpoint after update 4: two offline
    W&B folders of one run id; the second holds updates 5..8, each update's losses exactly as
    metrics.jsonl holds them; the first, read back as far as it was written, holds nothing past the
    rows the kill superseded, and with the second every update of metrics.jsonl once."""
    overrides = [*QUICK, "inner.H=2", "phase.updates=8", "checkpoint.every=2"]  # logger=wandb
    run_dir, _ = kill_and_resume(tmp_path, overrides, "0:7:kill", KILLED, at=4, updates=8)
    rows = read_metrics(run_dir / METRICS_FILE)
    losses = {r["update"]: r["loss"] for r in rows if r["kind"] == "update"}
    starts = [r for r in rows if r["kind"] == "start"]
    run_id = starts[0]["wandb_run_id"]
    assert run_id and starts[1]["wandb_run_id"] == run_id

    folders = sorted((run_dir / "wandb").glob("offline-run-*"))  # named by their start time
    assert len(folders) == 2 and all(f.name.endswith(f"-{run_id}") for f in folders), folders
    first, second = (read_run(f) for f in folders)
    assert second["run"]["id"] == run_id and second["exit_code"] == 0

    def logged(piece: dict) -> list[tuple[int, list[float]]]:
        return [
            (h["update"], [h[f"train/loss/replica_{m}"] for m in range(2)])
            for h in piece["history"]
            if "train/loss_mean" in h
        ]

    assert [u for u, _ in logged(second)] == [5, 6, 7, 8]  # starts at the checkpoint's next update
    assert all(loss == losses[u] for u, loss in logged(second))
    heldout = [h["eval/loss"] for h in second["history"] if "eval/loss" in h]
    assert heldout == [r["eval_loss"] for r in rows if r["kind"] == "sync"][2:]  # syncs 6 and 8

    early = logged(first)
    assert all(loss == losses[u] for u, loss in early)  # what it holds, it holds exactly
    assert [u for u, _ in early] == sorted({u for u, _ in early}) and all(u <= 6 for u, _ in early)
    # A SIGKILLed session's piece holds what wandb's writer had written, in order (often nothing:
    # wandb-core buffers; docs/resume.md). metrics.jsonl, flushed row by row, is the record.
    kept = [u for u, _ in early if u <= 4]
    assert kept == list(range(1, len(kept) + 1))


# -- 4: negative controls: a wrong state must not pass the comparison -----------------------------


def _edited(reference: Path, to: Path, change) -> Path:
    """A copy of the reference run whose checkpoint after update 2 was edited by `change(state)`
    (format, config and plan facts kept), resumed from that checkpoint; the resumed run's directory."""
    run_dir = copy_run(reference, to)
    path = ckpt(run_dir, 2)
    if change is not None:
        saved = torch.load(path, weights_only=False)
        change(saved["state"])
        torch.save(saved, path)
        seal(path)  # a whole checkpoint of a wrong state
    # keep=10: the newer checkpoints of the run that had gone on stay (see the xfail test below).
    done = entry([*BASE, "checkpoint.keep=10", f"resume={path}"], to.parent)
    assert done.returncode == 0, done.stderr
    return run_dir


def _zero_momentum(state: dict) -> None:
    assert any(float(t.abs().max()) > 0 for t in state["outer_momentum"].values())  # Nesterov moved it
    for t in state["outer_momentum"].values():
        t.zero_()


def _replica_1_steps(state: dict) -> None:
    assert state["inner"][1]["step"].tolist() == [2]
    state["inner"][1]["step"] += 5


@pytest.mark.slow
def test_a_checkpoint_with_a_wrong_state_resumes_to_a_different_run(tmp_path, reference):
    """Resumed from the checkpoint after update 2 of the reference run (resume=PATH, a run that had
    gone on): unedited, the rest equals the reference (the harness is sound); with the outer momentum
    zeroed, round 2 (updates 3-4) is the same but the sync after it is not, so updates 5-8, the
    held-out losses from update 4 and the weights differ; with replica 1's AdamW step count changed,
    update 3 (the loss of the synced weights) is the same and from update 4 replica 1's loss differs
    while replica 0's stays the same until the sync mixes them."""
    want = outcome(reference)
    assert_identical(_edited(reference, tmp_path / "unedited", None), reference)

    momentum = outcome(_edited(reference, tmp_path / "momentum", _zero_momentum))
    assert momentum.updates[:4] == want.updates[:4] and momentum.heldout[:2] == want.heldout[:2]
    for got, ref in zip(momentum.updates[4:], want.updates[4:], strict=True):
        assert got["loss"][0] != ref["loss"][0] and got["loss"][1] != ref["loss"][1], got["update"]
    assert all(a != b for a, b in zip(momentum.heldout[2:], want.heldout[2:], strict=True))
    assert all(not torch.equal(momentum.weights[n], t) for n, t in want.weights.items())

    steps = outcome(_edited(reference, tmp_path / "steps", _replica_1_steps))
    assert steps.updates[:3] == want.updates[:3]
    assert steps.updates[3]["loss"][0] == want.updates[3]["loss"][0]
    assert steps.updates[3]["loss"][1] != want.updates[3]["loss"][1]
    for got, ref in zip(steps.updates[4:], want.updates[4:], strict=True):
        assert got["loss"][0] != ref["loss"][0] and got["loss"][1] != ref["loss"][1], got["update"]
    assert steps.heldout[2:] != want.heldout[2:]
    assert any(not torch.equal(steps.weights[n], t) for n, t in want.weights.items())


@pytest.mark.slow
def test_resumed_from_an_older_checkpoint_and_killed_again_resumes_from_the_new_checkpoints(
    tmp_path, reference
):
    """Going back: resume=PATH to the checkpoint after update 2 of a run that had gone on to update
    8, killed again as round 4 starts; resume=true must go on from the checkpoint this timeline
    wrote (after update 6), not from the abandoned one's, and the run equals the reference."""
    run_dir = copy_run(reference, tmp_path / "run")
    killed = entry([*BASE, f"resume={ckpt(run_dir, 2)}"], tmp_path, "0:7:kill")
    assert killed.returncode == KILLED, killed.stderr
    done = entry([*BASE, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr
    resumes = [r for r in read_metrics(run_dir / METRICS_FILE) if r["kind"] == "resume"]
    assert [r["from"] for r in resumes] == [str(ckpt(run_dir, 2)), str(ckpt(run_dir, 6))]
    assert_identical(run_dir, reference)


# -- 5: refusals: one line, exit 2, nothing touched ------------------------------------------------


def _no_checkpoints(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "checkpoints")


REFUSALS = {
    # name: (what the copy of the reference loses, the arguments, what the one line must say)
    "resume-true-without-a-checkpoint": (
        _no_checkpoints,
        lambda d: [*BASE, f"hydra.run.dir={d}", "resume=true"],
        lambda d: [f"resume=true but {d} holds no checkpoint", "valid: hydra.run.dir="],
    ),
    "resume-true-in-a-new-directory": (
        None,
        lambda d: [*BASE, f"hydra.run.dir={d.parent / 'new'}", "resume=true"],
        lambda d: [f"resume=true but {d.parent / 'new'} holds no checkpoint", "valid: "],
    ),
    "resume-a-missing-path": (
        None,
        lambda d: [*BASE, "resume=/no/such/path"],
        lambda d: ["resume='/no/such/path' is no checkpoint file", "valid: true, auto, a checkpoint file"],
    ),
    "changed-learning-rate": (
        None,
        lambda d: [*BASE, "inner.lr=0.002", f"hydra.run.dir={d}", "resume=true"],
        lambda d: [
            "inner.lr=0.002 differs from the checkpoint's inner.lr=0.003",
            "valid: resume with inner.lr=0.003",
        ],
    ),
    "changed-learning-rate-resumed-by-path": (
        None,
        lambda d: [*BASE, "inner.lr=0.002", f"resume={ckpt(d, 4)}"],
        lambda d: [
            "inner.lr=0.002 differs from the checkpoint's inner.lr=0.003",
            "valid: resume with inner.lr=0.003",
        ],
    ),
    "extended-without-an-explicit-decay": (
        None,
        lambda d: [*BASE, "phase.updates=10", f"hydra.run.dir={d}", "resume=true"],
        # The line names the longer phase and the explicit decay that would keep the schedule.
        lambda d: ["phase.updates=10 extends the run (8 before)", "valid: ", "inner.decay_steps=8"],
    ),
    "a-finished-run-without-resume": (
        None,
        lambda d: [*BASE, f"hydra.run.dir={d}"],
        lambda d: [f"hydra.run.dir={d} already holds a run", "valid: a new directory"],
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_resume_that_cannot_be_done_fails_with_one_line_and_touches_nothing(tmp_path, reference, name):
    prepare, args, says = REFUSALS[name]
    run_dir = copy_run(reference, tmp_path / "run")
    if prepare is not None:
        prepare(run_dir)
    before = tree(tmp_path)
    done = entry(args(run_dir), tmp_path)
    assert done.returncode == 2, done.stderr
    lines = stderr_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("hypertrain: error: "), done.stderr
    assert all(part in lines[0] for part in says(run_dir)), lines[0]
    assert tree(tmp_path) == before, "a refused resume created or changed files"


def test_a_phase_change_on_resume_is_named_for_what_it_is():
    """phase.updates may change on resume, only to a longer phase: a shorter one is refused saying so
    (issue 48: the line said phase.updates may change); a longer one beside another change names that
    other change, never the phase (whose advice, its old value, would drop the extension)."""
    saved = {"config": asdict(TrainConfig())}
    shorter = asdict(TrainConfig())
    shorter["phase"]["updates"] = 20
    with pytest.raises(UserError) as refused:
        checkpoint.compatible(saved, shorter, {})
    assert str(refused.value) == (
        "phase.updates=20 shortens the run (40 before); a resumed run may change phase.updates only to a "
        "longer phase; valid: resume with phase.updates=40 or more, or start a new run in another directory"
    )
    longer = asdict(TrainConfig())
    longer["phase"]["updates"], longer["seed"] = 60, 1
    with pytest.raises(UserError, match=r"^seed=1 differs from the checkpoint's seed=0; "):
        checkpoint.compatible(saved, longer, {})


# A changed config is named as the user changed it (a config group chosen, a field set) with the
# checkpoint's value, never by a field derived from it, whose advice would give the same line again
# (processes.layout from processes=dist, outer.assignment from outer.fragments; issue 35, item 5):
# (the change, the run's own setting, how the run is resumed).
CHANGED = {
    "processes-dist-on-a-one-process-run": ("processes=dist", "processes=one", "true"),
    "two-fragments-on-a-one-fragment-run": ("outer.fragments=2", "outer.fragments=1", "auto"),
    "moe-tiny-on-the-default-model": ("model=moe_tiny", "model=tiny", "path"),
}


@pytest.mark.parametrize("name", list(CHANGED))
def test_a_changed_config_names_what_the_user_changed_and_its_advice_resumes(tmp_path, reference, name):
    """One line naming the change with both values and what to do, exit 2, nothing touched; then the
    advice followed (the run's own setting in place of the change) resumes: the run has finished, a
    no-op, exit 0. In this process: processes=dist is refused before any process starts."""
    change, own, resume = CHANGED[name]
    run_dir = copy_run(reference, tmp_path / "run")
    if resume == "path":
        where = [f"resume={ckpt(run_dir, 8)}"]
    else:
        where = [f"hydra.run.dir={run_dir}", f"resume={resume}"]
    before = tree(tmp_path)
    done = entry([*BASE, change, *where], tmp_path, process=False)
    assert done.returncode == 2, done.stderr
    assert stderr_lines(done.stderr) == [
        f"hypertrain: error: {change} differs from the checkpoint's {own}; a resumed run may change only "
        f"logger.*, checkpoint.*, guard.* and phase.updates; valid: resume with {own}, or start a new run "
        "in another directory"
    ], done.stderr
    assert tree(tmp_path) == before, "a refused resume created or changed files"
    followed = entry([*BASE, own, *where], tmp_path)
    assert followed.returncode == 0, followed.stderr
    lines = stderr_lines(followed.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"hypertrain: {run_dir} has finished (update 8 of 8)")
    assert tree(tmp_path) == before


def test_the_derived_fields_are_fields_of_the_config():
    """`DERIVED` names fields that exist (a renamed one would be ranked as set by the user)."""
    assert set(DERIVED) <= flatten(asdict(TrainConfig())).keys()


# Every spelling `resume` has accepted, in the cases and blanks `.strip().lower()` let through, and what
# it asks for ("True" is Hydra's `resume=true`, read into a text field).
SPELLINGS = {
    "": ResumeMode.START,
    "   ": ResumeMode.START,
    "false": ResumeMode.START,
    "False": ResumeMode.START,
    " FALSE\t": ResumeMode.START,
    "true": ResumeMode.LATEST,
    "True": ResumeMode.LATEST,
    " TRUE ": ResumeMode.LATEST,
    "auto": ResumeMode.AUTO,
    "Auto": ResumeMode.AUTO,
    "\tAUTO\n": ResumeMode.AUTO,
}


@pytest.mark.parametrize("text", list(SPELLINGS))
def test_every_old_spelling_of_resume_reads_as_its_one_mode(text):
    assert ResumeRequest.of(text) == ResumeRequest(SPELLINGS[text], None, text.strip())
    assert ResumeMode.of(text) is SPELLINGS[text]


@pytest.mark.parametrize("spelling", ["true", "false", "auto", "''", "/a/run"])
def test_the_config_keeps_resume_as_the_command_line_gave_it(spelling):
    """The field stays text (config.yaml holds it as it did); its reading is the same as the word's."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.from_dotlist([f"resume={spelling}"]))
    assert isinstance(cfg.resume, str)
    expected = SPELLINGS.get(spelling.strip("'"), ResumeMode.PATH)
    assert ResumeRequest.of(cfg.resume).mode is expected


def test_any_other_resume_is_a_path_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for text, path in [
        (" run/checkpoints/ckpt-u0000004.pt ", tmp_path / "run/checkpoints/ckpt-u0000004.pt"),
        ("auto/", tmp_path / "auto"),  # a folder named like a word is a path
        ("TRUE.pt", tmp_path / "TRUE.pt"),
        ("~/runs/a", tmp_path / "home/runs/a"),
        (str(tmp_path / "x"), tmp_path / "x"),
    ]:
        assert ResumeRequest.of(text) == ResumeRequest(ResumeMode.PATH, path, text.strip()), text
        assert ResumeMode.of(text) is ResumeMode.PATH


def test_a_resume_under_an_unknown_home_is_refused_in_one_line():
    with pytest.raises(UserError) as refused:
        ResumeRequest.of("~no_such_user/run")
    assert str(refused.value) == (
        "resume='~no_such_user/run' starts with a ~ whose home directory this machine does "
        "not know; valid: true, auto, a checkpoint file, or a run directory with checkpoints/"
    )


@pytest.mark.parametrize("resume", ["true", "auto", "dir"])
def test_a_finished_run_resumed_is_a_no_op_with_one_line(tmp_path, reference, resume):
    """resume=true, resume=auto (a requeued job's) or resume=<its directory> on a finished run: one
    line saying it has finished, exit 0, nothing run or written (no summary rewritten, no .hydra/)."""
    run_dir = copy_run(reference, tmp_path / "run")
    before = tree(tmp_path)
    where = [f"resume={run_dir}"] if resume == "dir" else [f"hydra.run.dir={run_dir}", f"resume={resume}"]
    done = entry([*BASE, *where], tmp_path)
    assert done.returncode == 0, done.stderr
    assert stderr_lines(done.stderr) == [
        f"hypertrain: {run_dir} has finished (update 8 of 8); nothing was run or written (a longer "
        "phase.updates with the same explicit inner.decay_steps extends it: docs/resume.md)"
    ]
    assert tree(tmp_path) == before, "resuming a finished run changed files"


# -- 6: a corrupt checkpoint -----------------------------------------------------------------------


def _tensor_bytes(path: Path) -> tuple[int, int]:
    """(offset, length) in the checkpoint file of its largest tensor's data (torch's zip stores tensor
    storages uncompressed under `*/data/<key>`)."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as file:  # the local header: 30 bytes, then the name and the extra field
        file.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", file.read(4))
    return info.header_offset + 30 + name_length + extra_length, info.file_size


def _damage(path: Path, how: str) -> None:
    """Damage checkpoint `path` as a failing disk or a stray write would: `truncated` to half its bytes
    (a write that never finished), 64 bytes of its largest tensor overwritten (`overwritten`), or one
    bit of a float32 in it flipped (`bit`: the lowest exponent bit, which torch's zip reader, checking no
    CRC, loads silently as a weight twice or half as large)."""
    data = bytearray(path.read_bytes())
    if how == "truncated":
        del data[len(data) // 2 :]
    else:
        start, length = _tensor_bytes(path)
        middle = start + (length // 2) // 4 * 4
        if how == "overwritten":
            data[middle : middle + 64] = bytes(range(64))
        else:
            data[middle + 2] ^= 0x80  # little endian: byte 2's top bit is the exponent's lowest
    path.write_bytes(bytes(data))


def _two_newest_cut(reference: Path, to: Path, cut: tuple[int, ...], how: str = "truncated") -> Path:
    """A copy of the reference holding what checkpoint.keep=2 leaves (ckpt-u6, ckpt-u8), the ones
    in `cut` damaged (`_damage`)."""
    run_dir = copy_run(reference, to)
    for u in (2, 4):
        ckpt(run_dir, u).unlink()
        digest_path(ckpt(run_dir, u)).unlink()
    for u in cut:
        _damage(ckpt(run_dir, u), how)
    return run_dir


def test_a_checkpoint_write_cut_short_leaves_no_temporary_file_after_the_resume(tmp_path, reference):
    """Killed after the temporary file of a mid-round checkpoint (after update 7, with
    checkpoint.every_updates=1) is whole, before its rename; resumed without mid-round checkpoints,
    the run never writes that name again, so only the resume can remove the temporary file."""
    run_dir = tmp_path / "run"
    killed = entry(
        [*BASE, "checkpoint.every_updates=1", f"hydra.run.dir={run_dir}"], tmp_path, "0:7:kill:checkpoint"
    )
    assert killed.returncode == KILLED, killed.stderr
    assert [p.name for p in (run_dir / "checkpoints").glob("*.tmp")] == [ckpt(run_dir, 7).name + ".tmp"]
    done = entry([*BASE, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert_identical(run_dir, reference)


@pytest.mark.parametrize(
    "how",
    [
        "bit",
        pytest.param("overwritten", marks=pytest.mark.slow),
        pytest.param("truncated", marks=pytest.mark.slow),
    ],
)
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, reference, how):
    """The newest checkpoint damaged after it was written (`_damage`): its bytes no longer match the
    digest written with it, so resume=true says so in one warning line and resumes from the one before,
    and the run equals the uninterrupted one. Without the digest the bit flip loads (the control)."""
    run_dir = _two_newest_cut(reference, tmp_path / "run", cut=(8,), how=how)
    if how != "truncated":
        assert torch.load(ckpt(run_dir, 8), weights_only=False)["format"] == 1  # torch alone sees nothing
    before = (run_dir / METRICS_FILE).read_bytes()
    saved = torch.load(ckpt(run_dir, 6), weights_only=False)
    done = entry([*BASE, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr
    # One warning line on stderr names the damaged checkpoint and the one used instead.
    (warning,) = [x for x in done.stderr.splitlines() if "warning" in x]
    assert warning.startswith(
        f"hypertrain: warning: checkpoint {ckpt(run_dir, 8)} is not the one that was written (its sha256 "
    )
    assert warning.endswith(f"resuming from {ckpt(run_dir, 6)} instead")
    assert not [x for x in done.stderr.splitlines() if x.startswith("hypertrain: error")]
    assert assert_resumed_records(run_dir, before, ckpt(run_dir, 6), saved, 8) == [7, 8]
    assert_identical(run_dir, reference)


def test_every_checkpoint_corrupt_fails_with_one_line_and_touches_nothing(tmp_path, reference):
    run_dir = _two_newest_cut(reference, tmp_path / "run", cut=(6, 8), how="bit")
    before = tree(tmp_path)
    done = entry([*BASE, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert stderr_lines(done.stderr) == [
        f"hypertrain: error: no checkpoint in {run_dir / 'checkpoints'} can be read; "
        "valid: a run with a whole checkpoint"
    ]
    assert tree(tmp_path) == before


def test_a_damaged_or_unsealed_checkpoint_named_by_path_is_refused_and_touches_nothing(tmp_path, reference):
    """resume=PATH of a checkpoint whose bytes differ from its digest, or whose digest is gone (it was
    written with one): one line, exit 2, nothing changed."""
    run_dir = _two_newest_cut(reference, tmp_path / "run", cut=(8,), how="bit")
    digest_path(ckpt(run_dir, 6)).unlink()
    before = tree(tmp_path)
    for u, says in ((8, "is not the one that was written"), (6, "was written with a digest")):
        done = entry([*BASE, f"hydra.run.dir={run_dir}", f"resume={ckpt(run_dir, u)}"], tmp_path)
        assert done.returncode == 2, done.stderr
        (line,) = stderr_lines(done.stderr)
        assert line.startswith(f"hypertrain: error: checkpoint {ckpt(run_dir, u)} {says}"), line
        assert tree(tmp_path) == before


@pytest.mark.slow
def test_a_checkpoint_from_before_digests_resumes_unchecked(tmp_path, reference):
    """A checkpoint written before digests (no `.sha256`, no `sealed` in its payload) still resumes,
    to the uninterrupted run."""
    run_dir = _two_newest_cut(reference, tmp_path / "run", cut=())
    path = ckpt(run_dir, 8)
    saved = torch.load(path, weights_only=False)
    del saved["sealed"], saved["schema_version"]  # as it was written then: unversioned too
    torch.save(saved, path)
    digest_path(path).unlink()
    done = entry([*BASE, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert_identical(run_dir, reference)


# -- 7: a finished run extended --------------------------------------------------------------------


@pytest.mark.slow
def test_a_finished_run_extended_runs_the_extra_updates_and_keeps_its_first(tmp_path, reference):
    """phase.updates=4 with inner.decay_steps=8 set explicitly, finished, then resumed with
    phase.updates=8 (the same decay): updates 5-8 run after the checkpoint of the last sync; the
    first 4 are the original's, and the whole equals the uninterrupted 8-update run (whose decay is
    its 8 updates), so the extension is a continuation, not a new schedule."""
    run_dir = tmp_path / "run"
    short = [*RUN, "inner.H=2", "phase.updates=4", "inner.decay_steps=8"]
    done = entry([*short, f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr
    original = outcome(run_dir)
    assert [r["update"] for r in original.updates] == [1, 2, 3, 4]
    before = (run_dir / METRICS_FILE).read_bytes()
    saved = torch.load(ckpt(run_dir, 4), weights_only=False)

    longer = [*RUN, "inner.H=2", "phase.updates=8", "inner.decay_steps=8"]
    done = entry([*longer, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert assert_resumed_records(run_dir, before, ckpt(run_dir, 4), saved, 8) == []
    extended = outcome(run_dir)
    assert extended.updates[:4] == original.updates
    assert extended.heldout[:3] == original.heldout
    assert_identical(run_dir, reference)


@pytest.mark.slow
def test_resume_auto_starts_over_a_run_stopped_before_its_first_checkpoint(tmp_path, reference):
    """A scheduler's restart with resume=auto: the run died in its first round (no checkpoint yet),
    so it starts again in its own directory; what it had written moves to metrics.superseded.jsonl.
    A finished run is never started over (the refusals above)."""
    run_dir = tmp_path / "run"
    killed = entry([*BASE, f"hydra.run.dir={run_dir}"], tmp_path, "0:1:kill")
    assert killed.returncode == KILLED, killed.stderr
    before = (run_dir / METRICS_FILE).read_bytes()
    assert before and not (run_dir / "checkpoints").exists()
    done = entry([*BASE, f"hydra.run.dir={run_dir}", "resume=auto"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert (run_dir / SUPERSEDED_FILE).read_bytes() == before
    assert_identical(run_dir, reference)
    again = entry(
        [*BASE, f"hydra.run.dir={run_dir}", "resume=auto"], tmp_path
    )  # finished: resumes, adds nothing
    assert again.returncode == 0, again.stderr
    assert_identical(run_dir, reference)


def test_the_report_and_the_clock_of_a_killed_run_leave_it_resumable(tmp_path, reference):
    """A run's own tools never make it unresumable (issue 35): killed as round 3 starts, with no
    checkpoint (checkpoint.every=0), then reported on and timed by the clock with their default output
    (the run's report/), `resume=auto` starts it over in its directory and it equals the uninterrupted
    run; the report is left as it was, of the killed run. A report/ holding anything else is not the
    run's: refused with one line, exit 2, nothing changed."""
    args = [*BASE, "checkpoint.every=0"]
    run_dir = tmp_path / "run"
    killed = entry([*args, f"hydra.run.dir={run_dir}"], tmp_path, "0:5:kill")
    assert killed.returncode == KILLED, killed.stderr
    before = (run_dir / METRICS_FILE).read_bytes()
    assert not (run_dir / "checkpoints").exists()
    out = run_dir / "report"
    printed, said = io.StringIO(), io.StringIO()
    with redirect_stdout(printed):
        assert report.main([str(run_dir)]) == 0
    with redirect_stdout(io.StringIO()), redirect_stderr(said):
        assert retime.main([str(run_dir)]) == 0
    assert printed.getvalue().splitlines()[-1].startswith(f"report: {out / 'report.html'} ("), (
        printed.getvalue()
    )
    assert said.getvalue().startswith(f"hypertrain.clock: wrote {out / 'clock-cpu_here' / 'clock.md'} and ")
    reported = tree(out)

    (out / "notes.txt").write_text("mine")
    kept = tree(tmp_path)
    refused = entry([*args, f"hydra.run.dir={run_dir}", "resume=auto"], tmp_path)
    assert refused.returncode == 2 and stderr_lines(refused.stderr) == [
        f"hypertrain: error: hydra.run.dir={run_dir} holds files that are not this run's (report); valid: a "
        "new or empty directory, or the directory of this run"
    ], refused.stderr
    assert tree(tmp_path) == kept, "a refused resume created or changed files"
    (out / "notes.txt").unlink()

    done = entry([*args, f"hydra.run.dir={run_dir}", "resume=auto"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert (run_dir / SUPERSEDED_FILE).read_bytes() == before
    assert_identical(run_dir, reference)
    assert tree(out) == reported


@pytest.mark.slow
def test_a_resumed_sessions_throughput_counts_only_its_own_updates(tmp_path):
    """A resumed session's throughput is its own (docs/report.md): the replica-steps it took over the
    seconds it timed, and the updates it timed, never the restored run's. Killed as update 7 starts
    (checkpoint after update 4, warm-up 1), the resumed session takes updates 5..8: its replica-steps
    are the non-null losses of those rows, and replica_steps_per_s x timed_s equals them (float
    division and one multiplication: a relative error of a few ulps, 1e-12 is far above it)."""
    run_dir, _ = kill_and_resume(tmp_path, [*BASE, "checkpoint.every=2"], "0:7:kill", KILLED, at=4, updates=8)
    rows = read_metrics(run_dir)
    last_start = max(i for i, r in enumerate(rows) if r["kind"] == "start")
    session = rows[last_start:]
    steps = sum(x is not None for r in session if r["kind"] == "update" for x in r["loss"])
    assert steps == 2 * 4  # experiment=quick's 2 replicas, 4 updates
    summary = {k: v for r in session if r["kind"] == "summary" for k, v in r.items()}
    assert summary["train/timed_updates"] == 4
    assert summary["train/replica_steps_per_s"] * summary["train/timed_s"] == pytest.approx(steps, rel=1e-12)
