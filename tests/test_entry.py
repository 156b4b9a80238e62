"""The entry as a user runs it: `python -m hypertrain.train` in a subprocess, Hydra composition, sweeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hypertrain import plan
from hypertrain.config import ConfigError, TrainConfig, register_configs, validate
from hypertrain.log import read_metrics
from hypertrain.wandb_offline import read_run

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
QUICK = ["experiment=quick", "model.d_model=32", "data.seq_len=32", "data.heldout=64"]


def entry(args: list[str], tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = os.environ | {"WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false", "HYDRA_FULL_ERROR": "0"}
    env.pop("WANDB_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "hypertrain.train", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_default_entry_writes_metrics_plan_and_a_matching_wandb_run(tmp_path):
    run_dir = tmp_path / "run"
    done = entry([*QUICK, f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = read_metrics(run_dir / "metrics.jsonl")
    updates = [r for r in rows if r["kind"] == "update"]
    syncs = [r for r in rows if r["kind"] == "sync"]
    assert [r["update"] for r in updates] == [1, 2, 3, 4, 5, 6]  # smoke phase: 6 updates
    assert [r["update"] for r in syncs] == [3, 6]  # H = 3
    assert all(len(r["loss"]) == 2 and None not in r["loss"] for r in updates)
    facts = json.loads((run_dir / "plan.json").read_text())
    assert facts["plan/union_sha256"] and facts["data/fingerprint"]
    assert OmegaConf.load(run_dir / "config.yaml").replicas == 2

    (wandb_dir,) = (run_dir / "wandb").glob("offline-run-*")
    wandb_run = read_run(wandb_dir)
    history = wandb_run["history"]
    for row in updates:
        (logged,) = [h for h in history if h.get("update") == row["update"] and "train/loss_mean" in h]
        assert [logged[f"train/loss/replica_{m}"] for m in range(2)] == row["loss"]
    evals = [h["eval/loss"] for h in history if "eval/loss" in h]
    assert evals == [r["eval_loss"] for r in rows if r["kind"] in ("eval", "sync")]
    for key in ("plan/union_sha256", "plan/data_order_sha256", "data/fingerprint"):
        assert wandb_run["summary"][key] == facts[key]
    assert wandb_run["config"]["replicas"] == 2


def test_user_text_files_and_token_files_train_end_to_end(tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("argparse.py", "textwrap.py", "dataclasses.py"):  # real text, ~200 KB
        (corpus / f"{name}.txt").write_bytes((stdlib / name).read_bytes())
    tokens = np.frombuffer(b"".join(p.read_bytes() for p in sorted(corpus.iterdir())), dtype=np.uint8)
    tokens.astype("<u2").tofile(tmp_path / "train.bin")
    for source in (
        ["data=text_files", f"data.path={corpus}/**/*.txt"],
        ["data=token_bin", f"data.path={tmp_path / 'train.bin'}"],
    ):
        run_dir = tmp_path / source[0].replace("=", "_")
        done = entry([*QUICK, "logger=none", *source, f"hydra.run.dir={run_dir}"], tmp_path)
        assert done.returncode == 0, done.stderr
        rows = read_metrics(run_dir / "metrics.jsonl")
        assert len([r for r in rows if r["kind"] == "update"]) == 6
    # Same bytes, same windows: the two sources give the same losses.
    losses = [
        [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "update"]
        for name in ("data_text_files", "data_token_bin")
    ]
    assert losses[0] == losses[1]


def test_progress_shows_on_request_and_stays_quiet_otherwise(tmp_path):
    shown = entry(
        [*QUICK, "logger=none", "logger.progress=always", f"hydra.run.dir={tmp_path / 'a'}"], tmp_path
    )
    assert "update 6/6" in shown.stderr and "replica-steps/s" in shown.stderr and "ETA" in shown.stderr
    quiet = entry([*QUICK, "logger=none", f"hydra.run.dir={tmp_path / 'b'}"], tmp_path)  # stderr is a pipe
    assert "ETA" not in quiet.stderr


def tree(path: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `path`: what a rejected run must leave alone."""
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in path.rglob("*")}


NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("replicas=3", "replicas=3"),
        ("inner.H=0", "inner.H=0"),
        ("phase.offset=100000000", "phase.offset=100000000"),
        ("model.n_kv_heads=3", "model.n_kv_heads=3"),
        ("inner.state_policy=keep", "inner.state_policy='keep'"),
        ("data=text_files", "data.path"),
        ("model.vocab=100", "model.vocab=100"),
        ("phase.global_batch=1", "phase.global_batch=1"),
        ("inner.min_lr_ratio=1.5", "inner.min_lr_ratio=1.5"),
        ("outer.name=average", "outer.name='average'"),
        ("model.name=small", "model.name='small'"),
        pytest.param(
            "engine.device=cuda",
            "engine.device='cuda'",
            marks=pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is present"),
        ),
        ("engine.device=cuda:99", "engine.device='cuda:99'"),
    ],
)
def test_a_bad_value_fails_with_one_line_and_exit_code_2_and_creates_nothing(tmp_path, override, named):
    """Checked before Hydra makes the run directory: nothing at all appears in the working directory."""
    done = entry([*QUICK, override], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hypertrain: error:"), done.stderr
    assert named in lines[0]
    assert tree(tmp_path) == {}, "a rejected run left files behind"


def test_a_run_directory_under_a_file_fails_with_one_line(tmp_path):
    (tmp_path / "notes").write_text("x")
    done = entry([*QUICK, f"hydra.run.dir={tmp_path / 'notes' / 'run'}"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"hypertrain: error: hydra.run.dir={tmp_path / 'notes' / 'run'} lies under {tmp_path / 'notes'}, "
        "which is a file; valid: a path under a directory"
    ]
    assert tree(tmp_path) == {"notes": b"x"}


def test_an_empty_data_file_fails_with_one_line_naming_it(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    done = entry([*QUICK, "data=text_files", "data.path=empty.txt"], tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("hypertrain: error: data.path='empty.txt'") and "heldout < 0" not in line
    assert tree(tmp_path) == {"empty.txt": b""}


def test_the_schemas_are_not_offered_as_group_options(tmp_path):
    done = entry(["model=huge"], tmp_path)
    assert "Could not find 'model/huge'" in done.stderr
    assert "tiny" in done.stderr and "_schema" not in done.stderr


def test_a_diverging_run_exits_1_with_one_line_and_closed_records(tmp_path):
    run_dir = tmp_path / "run"
    done = entry([*QUICK, "inner.lr=1e30", "inner.warmup_steps=0", f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 1, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("hypertrain:")]
    assert line.startswith("hypertrain: error: run failed: replica 0 at update 2: ")
    assert "Traceback" not in done.stderr
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["update"] for r in rows if r["kind"] == "update"] == []  # the round never finished
    assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "failed" and rows[-1]["exit_code"] == 1
    assert rows[-1]["error"].startswith("replica 0 at update 2: ")
    (wandb_dir,) = (run_dir / "wandb").glob("offline-run-*")
    assert read_run(wandb_dir)["exit_code"] == 1


def test_a_second_run_into_the_same_directory_is_refused_and_the_first_kept(tmp_path):
    run_dir = tmp_path / "run"
    assert entry([*QUICK, "logger=none", f"hydra.run.dir={run_dir}"], tmp_path).returncode == 0
    before = tree(run_dir)
    done = entry([*QUICK, "logger=none", "seed=1", f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("hypertrain: error: hydra.run.dir=")
    assert tree(run_dir) == before  # not one byte of the first run touched, .hydra/ included


def test_an_unknown_option_fails_with_hydras_wording_in_one_line(tmp_path):
    """Hydra's own composition error, checked before Hydra runs: its first line and the options."""
    done = entry(["model=huge"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "hypertrain: error: In 'train': Could not find 'model/huge'; valid: base, multistream_small, "
        "multistream_tiny, small, tiny"
    ]
    assert tree(tmp_path) == {}


@pytest.mark.parametrize("launcher", ["basic", "joblib"])
def test_a_sweep_runs_every_job_as_its_own_wandb_run_in_one_group(tmp_path, launcher):
    sweep = tmp_path / "sweep"
    done = entry(
        ["-m", *QUICK, "world=4,8", "replicas=1,2", f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep}"],
        tmp_path,
        600,
    )
    assert done.returncode == 0, done.stderr
    jobs = sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").exists())
    assert [p.name for p in jobs] == ["0_w4_r1_h3", "1_w4_r2_h3", "2_w8_r1_h3", "3_w8_r2_h3"]
    groups, digests = set(), {}
    for job in jobs:
        (wandb_dir,) = (job / "wandb").glob("offline-run-*")
        start = next(r for r in read_metrics(job / "metrics.jsonl") if r["kind"] == "start")
        groups.add(start["group"])
        assert read_run(wandb_dir)["config"]["world"]["size"] == int(job.name.split("_")[1][1:])
        digests[job.name] = json.loads((job / "plan.json").read_text())["plan/data_order_sha256"]
    assert len(groups) == 1 and groups.pop().startswith("quick-")
    # The data order depends on R, not on the world.
    assert digests["0_w4_r1_h3"] == digests["2_w8_r1_h3"] != digests["1_w4_r2_h3"]


def test_a_sweep_stops_at_the_first_invalid_job(tmp_path):
    sweep = tmp_path / "sweep"
    done = entry(["-m", *QUICK, "replicas=3,2", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert done.returncode == 2
    assert "hypertrain: error: replicas=3 does not divide world.size (8)" in done.stderr
    assert not list(sweep.glob("*/metrics.jsonl"))
    assert not [p for p in sweep.iterdir() if p.is_dir()]  # the rejected job's directory is removed


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(overrides: list[str], hydra_cfg: bool = False):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=hydra_cfg)


@pytest.mark.parametrize(
    "override",
    [
        f"{g}={o}"
        for g in ("model", "inner", "outer", "phase", "data", "engine", "logger")
        for o in _options(g)
    ]
    + [f"world='{o}'" for o in _options("world")]
    + [f"experiment={o}" for o in _options("experiment")],
)
def test_every_config_option_composes_and_validates(override):
    # Speech has several token channels per frame: it is read by the multistream model.
    model = ["model=multistream_tiny"] if override == "data=speech" else []
    cfg = _compose([override, *model, "replicas=1"])
    typed: TrainConfig = OmegaConf.to_object(cfg)
    assert isinstance(typed, TrainConfig)
    if override == "data=text_files" or override == "data=token_bin":
        with pytest.raises(ConfigError, match="data.path"):
            validate(typed)
    else:
        validate(typed)


@pytest.mark.parametrize("name", _options("phase"))
def test_phase_options_are_the_plans_presets(name):
    typed: TrainConfig = OmegaConf.to_object(_compose([f"phase={name}"]))
    assert typed.phase.to_plan() == plan.PRESETS[name]


def test_the_slurm_launcher_presets_compose_for_a_plain_cpu_cluster():
    for preset, tasks in (("slurm", 1), ("slurm_dist", 2)):  # tests/test_slurm.py runs them on SLURM
        launcher = _compose([f"hydra/launcher={preset}"], hydra_cfg=True).hydra.launcher
        assert launcher._target_ == "hydra_plugins.hypertrain_slurm.slurm_launcher.SlurmLauncher"
        assert (launcher.gpus_per_node, launcher.gres, launcher.partition) == (None, None, None)
        assert launcher.tasks_per_node * launcher.nodes == tasks and launcher.max_num_timeout > 0


def test_a_typo_in_a_field_is_rejected_by_the_schema():
    with pytest.raises(Exception, match="inner.hh"):
        _compose(["inner.hh=3"])
