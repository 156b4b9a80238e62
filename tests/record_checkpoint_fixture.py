"""Record the regression fixture tests/assets/checkpoint_fixture/: a run killed after a checkpoint, as
this commit wrote it, and the outcome of the same run uninterrupted.

REGRESSION FIXTURE: a checkpoint written by an earlier commit must resume at a later one (issue 34's
proof: a move of hypertrain's modules must not break the checkpoints users hold). The run is small
(d_model 8, 2 replicas, 8 updates) but saves most of what a checkpoint can hold: Streaming DiLoCo (two
fragments, delay 1) with int8 pseudo-gradients and error feedback, churn (replica 1 misses round 1's
syncs), killed (SIGKILL, the test-only fault hook) after update 6's inner step; its newest checkpoint is
mid-round after update 5, fragment 0's sync in flight. tests/test_checkpoint_fixture.py checks that it
unpickles with builtins and tensors only, and that resumed today it equals an uninterrupted run made
today and the uninterrupted outcome recorded here.

  run/            what resume needs of the killed run: config.yaml, plan.json, metrics.jsonl (up to the
                  kill: the rows past the checkpoint included, as a resume finds them) and the newest
                  checkpoint with its digest (checkpoints/ckpt-u0000005.pt, .pt.sha256); the run's
                  train.log, .hydra/ and .lock are left out (a resume needs none of them)
  reference.json  the args, the fault, the commit and environment it was recorded in (data fingerprint,
                  torch, Python), and the uninterrupted run's outcome: every update and sync row without
                  timings, the held-out losses, the final summary and the sha256 of each tensor of
                  weights.pt (`tests/helpers.py` `streaming_outcome`)
  README.md       what it is, where it came from, how to regenerate it

Regenerate (after an intended change of the checkpoint's contents or of the run's arithmetic), from the
repository root:

    .venv/bin/python tests/record_checkpoint_fixture.py

Not a test module: pytest collects test_*.py only.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from helpers import KILLED, REPO, ckpt, entry, streaming_outcome

FIXTURE = REPO / "tests" / "assets" / "checkpoint_fixture"
REGENERATE = ".venv/bin/python tests/record_checkpoint_fixture.py"

# helpers.QUICK at d_model 8: a checkpoint of about 320 kB. Two rounds of H = 4; a checkpoint at every sync
# (ckpt-u4, ckpt-u8) and after update 5 (mid-round), only the newest kept.
ARGS = [
    "experiment=quick",
    "model.d_model=8",
    "data.seq_len=32",
    "data.heldout=64",
    "logger=none",
    "inner.H=4",
    "phase.updates=8",
    "outer.fragments=2",
    "outer.delay=1",
    "outer.compress=int8",
    "outer.error_feedback=true",
    "churn=flaky",
    "churn.events=[1:1:miss]",
    "checkpoint.every_updates=5",
    "checkpoint.keep=1",
]
FAULT = "0:6:kill:after"  # SIGKILL after update 6's inner step, before fragment 0's landing
CHECKPOINT_AT = 5  # the newest checkpoint the killed run leaves: ckpt-u0000005.pt
RUN_FILES = ("config.yaml", "plan.json", "metrics.jsonl")


def weights_sha256(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's sha256 over its dtype, shape and bytes (contiguous, on the CPU)."""
    out = {}
    for name, t in sorted(weights.items()):
        sha = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
        sha.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out[name] = sha.hexdigest()
    return out


def outcome_json(run_dir: Path) -> dict:
    """The run's outcome as reference.json holds it (`streaming_outcome`, weights as digests)."""
    got = streaming_outcome(run_dir)
    return {
        "updates": got.updates,
        "syncs": got.syncs,
        "heldout": got.heldout,
        "final": got.final,
        "weights_sha256": weights_sha256(got.weights),
    }


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def recorded_at() -> dict:
    """The commit the fixture is recorded at, and the files of the package or its config that differ
    from it (none for a fixture of that commit's code; the tests' own changes do not count)."""
    changed = _git("status", "--porcelain", "--", "hypertrain", "conf").splitlines()
    return {"commit": _git("rev-parse", "HEAD"), "uncommitted": [line[3:] for line in changed]}


def readme(about: dict) -> str:
    return f"""# checkpoint_fixture: a REGRESSION FIXTURE

A run killed after a checkpoint, as commit {about["commit"][:12]} wrote it: a checkpoint written
before a change must resume after it (issue 34). Checked by `tests/test_checkpoint_fixture.py`: the
checkpoint unpickles with builtins and tensors only (`torch.load(..., weights_only=True)`), and the
run resumed today equals an uninterrupted run made today and `reference.json`'s uninterrupted
outcome. `tests/record_checkpoint_fixture.py` recorded it; its docstring says what each file holds.

The run, killed by the test-only fault hook after update 6 (`run/` is what resume needs of its
directory; its newest checkpoint is mid-round, after update 5):

    HYPERTRAIN_FAULT={about["fault"]} python -m hypertrain.train \\
      {shlex.join(about["args"])}

Recorded at commit {about["commit"]}, torch {about["torch"]}, Python {about["python"]} (its
stdlib is the data: fingerprint {about["data_fingerprint"][:16]}...); the test skips the resume
where the fingerprint or torch differs. Regenerate, from the repository root:

    {REGENERATE}
"""


def record(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        killed = entry([*ARGS, f"hydra.run.dir={where / 'run'}"], where, FAULT)
        assert killed.returncode == KILLED, killed.stderr[-3000:]
        newest = sorted((where / "run" / "checkpoints").glob("ckpt-u*.pt"))
        assert newest == [ckpt(where / "run", CHECKPOINT_AT)], newest
        done = entry([*ARGS, f"hydra.run.dir={where / 'reference'}"], where)
        assert done.returncode == 0, done.stderr[-3000:]

        shutil.rmtree(dest, ignore_errors=True)
        (dest / "run" / "checkpoints").mkdir(parents=True)
        for name in RUN_FILES:
            shutil.copy2(where / "run" / name, dest / "run" / name)
        for path in (newest[0], newest[0].with_name(newest[0].name + ".sha256")):
            shutil.copy2(path, dest / "run" / "checkpoints" / path.name)
        plan_facts = json.loads((where / "reference" / "plan.json").read_text())
        about = {
            "about": "REGRESSION FIXTURE: a run killed after a checkpoint and its uninterrupted outcome; "
            f"tests/test_checkpoint_fixture.py reads it. Regenerate: {REGENERATE}",
            "regenerate": REGENERATE,
            "args": ARGS,
            "fault": FAULT,
            "checkpoint": f"run/checkpoints/{newest[0].name}",
            **recorded_at(),
            "data_fingerprint": plan_facts["data/fingerprint"],
            "torch": torch.__version__,
            "python": platform.python_version(),
            "uninterrupted": outcome_json(where / "reference"),
        }
    (dest / "reference.json").write_text(json.dumps(about, indent=1) + "\n")
    (dest / "README.md").write_text(readme(about))


if __name__ == "__main__":
    record(FIXTURE)
    size = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
    print(f"wrote {FIXTURE} ({size / 1000:.0f} kB)", file=sys.stderr)
