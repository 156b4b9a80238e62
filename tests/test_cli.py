"""The entry as a function, `hypertrain.train.cli(argv) -> exit code`: called many times in one process it
gives the same records each time and leaves the process as it found it; a refusal made from the config
alone imports no torch; the real command line is the same function (`python -m hypertrain.train`)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import QUICK, assert_same_weights, entry, entry_env, in_process, start_entry

from hypertrain.failures.signals import STOP_SIGNALS
from hypertrain.train import run_entry

# What differs between two runs of one config by who ran them and when (tests/helpers.py's `untimed`
# drops the same timings): measured seconds and rates, the process, the host, the ids, and the run's own
# directory in the checkpoint rows. The network clock stays: on cluster=h100 it is a number of the run.
IDENTITY = {"time", "pid", "host", "run_id", "wandb_run_id", "wall", "rank_seconds", "seconds", "path"}


def _measured(key: str) -> bool:
    return not key.startswith("clock") and (key.endswith("_s") or "_s_" in key or key.endswith("per_s"))


def records(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in IDENTITY and not _measured(k)} for r in rows]


def process_state() -> dict:
    """What a call of the entry may change in its process and must put back."""
    root = logging.getLogger()
    return {
        "environ": dict(os.environ),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "signals": {s: signal.getsignal(s) for s in STOP_SIGNALS},
        "root handlers": list(root.handlers),
        "root level": root.level,
        "hypertrain logger": (
            logging.getLogger("hypertrain").handlers[:],
            logging.getLogger("hypertrain").level,
        ),
        "threads": torch.get_num_threads(),
        "rng": torch.random.get_rng_state(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul": torch.get_float32_matmul_precision(),
    }


def assert_same_state(got: dict, want: dict) -> None:
    for key, value in want.items():
        same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
        assert same, f"the entry left {key} changed"


def test_cli_twice_with_other_configs_between_gives_the_first_runs_records_again(tmp_path):
    """A, then B (another R and H, engine.threads set, so torch's thread count changes during it), then A
    again, all in this process: both A's record every row alike (but for who and when), on the modelled
    cluster, whose clock is a number of the run; the process is as it was after each call."""
    a = [*QUICK, "logger=none", "cluster=h100"]
    b = [*a, "replicas=4", "inner.H=2", "engine=loop", "engine.threads=2"]
    before = process_state()
    first = run_entry([*a, f"hydra.run.dir={tmp_path / 'a1'}"])
    assert (first.code, first.error) == (0, None), first.stderr
    assert_same_state(process_state(), before)
    other = run_entry([*b, f"hydra.run.dir={tmp_path / 'b'}"])
    assert other.code == 0, other.stderr
    assert_same_state(process_state(), before)
    again = run_entry([*a, f"hydra.run.dir={tmp_path / 'a2'}"])
    assert again.code == 0 and again.run_dir == tmp_path / "a2", again.stderr
    assert_same_state(process_state(), before)
    rows, want = records(tmp_path / "a2"), records(tmp_path / "a1")
    assert [r["kind"] for r in rows] == [r["kind"] for r in want]
    for got_row, want_row in zip(rows, want, strict=True):
        assert got_row == want_row
    assert any(k.startswith("clock") for r in rows for k in r), "the run recorded no clock"
    assert records(tmp_path / "b") != want  # the check can fail: another config's records differ
    assert_same_weights(
        torch.load(tmp_path / "a2" / "weights.pt"), torch.load(tmp_path / "a1" / "weights.pt")
    )


def test_a_call_that_sets_up_wandb_tears_it_down_so_the_next_call_reads_its_own_environment(tmp_path):
    """W&B's process-wide singleton reads WANDB_BASE_URL, WANDB_INIT_TIMEOUT and the rest once, when it is
    made: left in place, a later call with another environment would run on the first call's settings
    (an online run after an offline one waited wandb's default 90 s, not its WANDB_INIT_TIMEOUT)."""
    import wandb
    from wandb.sdk import wandb_setup

    wandb.teardown()  # whatever an earlier test of this worker set up
    assert wandb_setup._singleton is None
    done = run_entry([*QUICK, "logger=wandb", "phase.updates=2", f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.code == 0, done.stderr
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*")), "the call made no W&B run"
    assert wandb_setup._singleton is None, "the call left W&B's singleton of its environment behind"


def test_a_refusal_in_process_returns_its_line_and_code_and_leaves_the_process_as_it_was(tmp_path):
    before = process_state()
    done = run_entry([*QUICK, "inner.H=0", f"hydra.run.dir={tmp_path / 'run'}"])
    assert (done.code, done.run_dir) == (2, None)
    assert done.error == "hypertrain: error: inner.H=0 is too small; valid: >= 1"
    assert done.stderr.splitlines() == [done.error]
    assert list(tmp_path.iterdir()) == []
    assert_same_state(process_state(), before)


# A refusal of each kind that the config alone decides (composition, a field, a section's check, the
# plan, the memory check, the run directory): none may import torch. The data's own checks (a
# vocabulary below the data's) and resuming (reading a checkpoint) need torch, and are not here.
TORCH_FREE = [
    ["model=huge"],
    ["inner.H=abc"],
    ["experiment=nope"],
    ["+inner.foo=1"],
    ["outer.name=average"],
    ["inner.H=0"],
    ["replicas=3"],
    ["phase.global_batch=1"],
    ["model.vocab=10000000", "model.d_model=4096"],
    ["-m", "inner.H=1,x,3"],
    ["hydra.run.dir=."],
]


def test_a_refusal_made_from_the_config_alone_imports_no_torch(tmp_path):
    """In a fresh interpreter, `cli` refuses each case with exit 2, and afterwards `torch` is not among
    the imported modules (nor torch._dynamo, which an import of the model used to pull in)."""
    (tmp_path / "config.yaml").write_text("mine")  # the last case: a directory with the user's files
    script = (
        "import json, sys\n"
        "from hypertrain.train import cli\n"
        "out = []\n"
        f"for case in {TORCH_FREE!r}:\n"
        "    out.append([cli(case), 'torch' in sys.modules, 'torch._dynamo' in sys.modules])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=entry_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    assert results == [[2, False, False]] * len(TORCH_FREE), (results, done.stderr)
    assert {p.name for p in tmp_path.iterdir()} == {"config.yaml"}


def test_the_command_line_is_the_function(tmp_path):
    """`python -m hypertrain.train` runs `cli`: a refusal and a run on the real command line give what the
    call in this process gives (the same line and code; the same records but for who and when)."""
    bad = [*QUICK, "replicas=3"]
    real, here = entry(bad, tmp_path, process=True), in_process(bad, tmp_path)
    assert real.returncode == here.returncode == 2
    assert real.stderr.splitlines() == here.stderr.splitlines()
    run = [*QUICK, "logger=none", "phase.updates=4", "cluster=h100"]
    real = entry([*run, f"hydra.run.dir={tmp_path / 'real'}"], tmp_path, process=True)
    here = in_process([*run, f"hydra.run.dir={tmp_path / 'here'}"], tmp_path)
    assert real.returncode == here.returncode == 0, real.stderr + here.stderr
    assert records(tmp_path / "real") == records(tmp_path / "here")


def test_a_reader_that_stops_reading_ends_the_console_not_the_run(tmp_path):
    """`python -m hypertrain.train ... | head -1`: the first line read, the pipe closed. The run goes on
    to its end (exit 0, end row finished, the whole log in train.log) and stderr holds nothing: no
    "--- Logging error ---" BrokenPipe traceback at each later line, none at the interpreter's exit."""
    run_dir = tmp_path / "run"
    run = start_entry([*QUICK, "logger=none", "phase.updates=4", f"hydra.run.dir={run_dir}"], tmp_path)
    first = run.stdout.readline()
    run.stdout.close()  # what head does after its line
    stderr = run.stderr.read()
    assert run.wait(timeout=300) == 0, stderr
    assert "hypertrain" in first and stderr == ""
    assert records(run_dir)[-1]["status"] == "finished"
    assert "done: held-out loss" in (run_dir / "train.log").read_text()


@pytest.mark.slow  # a fresh interpreter and a 2-update run a case (~10 s)
@pytest.mark.parametrize("compiled", [False, True])
def test_a_run_imports_torch_dynamo_only_when_it_compiles(tmp_path, compiled):
    """A worker holds what its run uses: torch._dynamo (and sympy with it, about 80 MB per process)
    comes only with `engine.compile=true`. A fresh interpreter per case, the same uncompiled run; the
    True case is the control that the probe sees the import at all: after the run it asks for the
    engines' compiled forward (`compiled.forward_fn(True)`, what engine.compile=true calls, which
    imports torch._dynamo without compiling anything until called). That a compile=true run goes
    through forward_fn(True) is test_compiled.py's (its compiled runs differ from eager by rounding)."""
    run = [*QUICK, "logger=none", "phase.updates=2", "engine.compile=false"]
    control = "from hypertrain.engines.compiled import forward_fn\nforward_fn(True)\n" if compiled else ""
    script = (
        "import json, sys\n"
        "from hypertrain.train import cli\n"
        f"code = cli({[*run, 'hydra.run.dir=run']!r})\n"
        f"{control}"
        "print(json.dumps([code, 'torch._dynamo' in sys.modules, 'sympy' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=entry_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [0, compiled, compiled], done.stderr[-3000:]
