"""The entry as a user runs it: `python -m hypertrain.train` in a subprocess, Hydra composition, sweeps."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from helpers import CONF, HIDE_PLUGINS, QUICK, compose_cfg, compose_train, entry
from omegaconf import OmegaConf

from hypertrain import plan
from hypertrain.config import TrainConfig, UserError
from hypertrain.preflight.checks import plan_phase, validate
from hypertrain.preflight.composition import LAUNCHER_PLUGINS
from hypertrain.rundir.records import read_metrics
from hypertrain.rundir.wandb_offline import read_run


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
    # the network clock (docs/clock.md) under clock/: every update's and sync's clock_s, a sync's split
    clocks = [h["clock/seconds"] for h in history if "clock/seconds" in h]
    assert clocks == [r["clock_s"] for r in rows if r["kind"] in ("update", "sync")]
    assert clocks == sorted(clocks) and clocks[0] > 0
    split = [h["clock/outer_exposed_s"] for h in history if "clock/outer_exposed_s" in h]
    assert split == [r["clock_outer_exposed_s"] for r in syncs] and all(s > 0 for s in split)
    summary = [r for r in rows if r["kind"] == "summary"][-1]
    assert wandb_run["summary"]["clock/total_s"] == summary["clock/total_s"] == clocks[-1]


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


@pytest.mark.parametrize("launcher", ["basic", pytest.param("joblib", marks=pytest.mark.slow)])
def test_a_sweep_runs_every_job_as_its_own_wandb_run_in_one_group(tmp_path, launcher):
    sweep = tmp_path / "sweep"
    done = entry(
        ["-m", *QUICK, "world=4,8", "replicas=1,2", f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep}"],
        tmp_path,
        timeout=600,
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


@pytest.mark.parametrize(
    "launcher, package",
    [
        ("joblib", "hydra-joblib-launcher"),
        ("slurm_dist", "hydra-submitit-launcher"),
        ("submitit_local", "hydra-submitit-launcher"),
    ],
)
def test_a_launcher_whose_plugin_is_not_installed_is_one_line_naming_the_package(tmp_path, launcher, package):
    """Without the dev extra's launcher plugins Hydra says only that it cannot find or load the option:
    the entry names the package and how to install it, one line, exit 2, no sweep folder."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_PLUGINS)
    repo = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": f"{hide}:{repo}", "HIDDEN_PLUGINS": "hydra_joblib_launcher,hydra_submitit_launcher"}
    sweep = tmp_path / "sweep"
    args = ["-m", *QUICK, "replicas=1,2", f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep}"]
    done = entry(args, tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"hypertrain: error: hydra/launcher={launcher} needs the Hydra plugin {package}, which is not "
        f"installed (pyproject.toml's dev extra brings it); valid: python -m pip install "
        f"'{package}>=1.2,<1.3' (or the whole dev extra: scripts/setup --dev), or no hydra/launcher "
        "(Hydra's basic launcher runs the jobs one by one)"
    ]
    assert not sweep.exists()


def test_the_launcher_plugins_named_in_refusals_are_the_dev_extras_pins():
    tomllib = pytest.importorskip("tomllib")
    dev = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    pins = set(dev["project"]["optional-dependencies"]["dev"])
    assert {requirement for requirement, _ in LAUNCHER_PLUGINS.values()} <= pins


def _distributions(requirements: list[str], extras: dict[str, list[str]]) -> set[str]:
    """The distributions `requirements` install, transitively, as installed here: a requirement of
    hypertrain's own extras (`hypertrain[data]`) expands to that extra's, every other to its
    distribution and those it requires (their markers read with the extras asked of them)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: set[str] = set()
    todo = [(Requirement(text), "") for text in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        if name == "hypertrain":
            todo += [(Requirement(text), "") for e in requirement.extras for text in extras[e]]
            continue
        asked = sorted(requirement.extras) or [""]
        if (name, tuple(asked)) in found:
            continue
        found.add((name, tuple(asked)))
        try:
            needs = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [(Requirement(text), e) for text in needs for e in asked]
    return {name for name, _ in found}


def test_the_dev_extra_installs_every_module_the_tests_import():
    """`pip install -e .[dev]` alone runs the suite (issue 48: 37 errors on `import pyarrow`, the data
    extra's): every installed distribution a test file imports from, at any depth, is among those the
    dependencies and the dev extra install."""
    import ast
    import sys
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    tomllib = pytest.importorskip("tomllib")
    tests = Path(__file__).resolve().parent
    project = tomllib.loads((tests.parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    installed = _distributions(project["dependencies"] + extras["dev"], extras)
    own = {"hypertrain", "hydra_plugins"} | {path.stem for path in tests.glob("*.py")}
    modules = set()
    for path in tests.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    owners = packages_distributions()
    third_party = sorted(modules - own - set(sys.stdlib_module_names))
    missing = {
        module: owners[module]
        for module in third_party
        if module in owners and not {canonicalize_name(d) for d in owners[module]} & installed
    }
    assert not missing, f"imported by tests, installed by neither the dependencies nor dev: {missing}"


def _options(group: str) -> list[str]:
    if group == "phase":  # the plan's presets, registered with Hydra (hypertrain.preflight.schema)
        return sorted(plan.PRESETS)
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


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
    cfg = compose_train([override, *model, "replicas=1"])
    typed: TrainConfig = OmegaConf.to_object(cfg)
    assert isinstance(typed, TrainConfig)
    if override in ("data=text_files", "data=token_bin", "data=prepared"):  # each needs its data.path
        with pytest.raises(UserError, match="data.path"):
            validate(typed)
    elif override == "model=hf":  # a Hugging Face model needs its directory or config (docs/hf.md)
        with pytest.raises(UserError, match="model.path and model.config"):
            validate(typed)
    else:
        validate(typed)


@pytest.mark.parametrize("name", _options("phase"))
def test_phase_options_are_the_plans_presets(name):
    typed: TrainConfig = OmegaConf.to_object(compose_train([f"phase={name}"]))
    assert plan_phase(typed.phase) == plan.PRESETS[name]


def test_the_slurm_launcher_presets_compose_for_a_plain_cpu_cluster():
    for preset, tasks in (("slurm", 1), ("slurm_dist", 2)):  # tests/test_slurm.py runs them on SLURM
        launcher = compose_train([f"hydra/launcher={preset}"], hydra_cfg=True).hydra.launcher
        assert launcher._target_ == "hydra_plugins.hypertrain_slurm.slurm_launcher.SlurmLauncher"
        assert (launcher.gpus_per_node, launcher.gres, launcher.partition) == (None, None, None)
        assert launcher.tasks_per_node * launcher.nodes == tasks and launcher.max_num_timeout > 0


def test_a_sharded_slurm_job_whose_tasks_make_another_layout_is_refused_before_submitting():
    """processes.shard=true is built for the benchmark layout: a slurm_dist job whose tasks make the
    replicas layout (2 tasks, world 4, 2 replicas) is refused by the sweep's preflight, before sbatch,
    where each job's own preflight would fail on the cluster; with 4 tasks the same run passes."""
    from hypertrain.launchers.slurm import check_job

    cfg = compose_cfg([*QUICK, "processes=dist", "world=4", "replicas=2", "processes.shard=true"])
    with pytest.raises(UserError) as refused:
        check_job(cfg, 2)
    assert str(refused.value) == (
        "processes.shard=true needs the benchmark layout (processes = world.size = 4), but the job's 2 "
        "SLURM tasks make the replicas layout; valid: hydra.launcher.nodes x tasks_per_node = 4, or "
        "processes.shard=false"
    )
    check_job(cfg, 4)


def test_a_typo_in_a_field_is_rejected_by_the_schema():
    with pytest.raises(Exception, match="inner.hh"):
        compose_train(["inner.hh=3"])


OLD_DIST = [
    "engine=dist",
    "world=2",
    "replicas=2",
    "engine.nproc=2",
    "engine.layout=stacked",
    "engine.timeout_s=20",
]
NEW_DIST = ["processes=dist", "world.size=2", "replicas=2", "processes.nproc=2", "processes.layout=replicas"]


@pytest.mark.slow  # the spellings' translation alone: test_an_older_runs_config_reads_as_todays
def test_the_older_engine_dist_spelling_runs_as_processes_dist_with_one_notice_each(tmp_path):
    """engine=dist and engine.nproc/layout/timeout_s were the processes' choices before they had their
    own group: they still run, as processes=dist with engine=stacked, each older spelling named in one
    notice line, and the run's config is written in today's spelling."""
    run_dir = tmp_path / "run"
    done = entry([*QUICK, "logger=none", "phase.updates=2", *OLD_DIST, f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr
    notices = [line for line in done.stderr.splitlines() if line.startswith("hypertrain: note:")]
    assert notices == [
        "hypertrain: note: engine=dist is now spelled processes=dist (engine= chooses loop or stacked)",
        "hypertrain: note: engine.nproc=2 is now spelled processes.nproc=2 (engine= chooses loop or stacked)",
        "hypertrain: note: engine.layout=stacked is now spelled processes.layout=replicas "
        "(engine= chooses loop or stacked)",
        "hypertrain: note: engine.timeout_s=20 is now spelled processes.timeout_s=20 "
        "(engine= chooses loop or stacked)",
    ]
    written = OmegaConf.load(run_dir / "config.yaml")
    assert written.engine.name == "stacked"
    assert (written.processes.name, written.processes.nproc, written.processes.layout) == (
        "dist",
        2,
        "replicas",
    )
    assert written.processes.timeout_s == 20


def test_an_older_runs_config_reads_as_todays():
    """A checkpoint's or config.yaml's config written before the processes group (engine.name=dist,
    engine.nproc, engine.layout=stacked) reads as the same run in today's spelling: resuming compares
    it with today's resolved config key by key."""
    from hypertrain.preflight.checked import resolved_config
    from hypertrain.records.formats import upgrade_config as upgrade_resolved

    today = resolved_config(OmegaConf.to_object(compose_train([*QUICK, *NEW_DIST])))
    older = {k: v for k, v in today.items() if k != "processes"}
    older["engine"] = {**today["engine"], "name": "dist", "nproc": 2, "layout": "stacked", "timeout_s": 30.0}
    older["engine"]["backend"] = "auto"
    assert upgrade_resolved(older) == today
    assert upgrade_resolved(today) is today
    one = {k: v for k, v in today.items() if k != "processes"} | {"engine": {**today["engine"], "nproc": 0}}
    assert upgrade_resolved(one)["processes"]["name"] == "one"
    # fields added to a section since (restarts, experts, the cluster, churn): their neutral defaults
    before = {k: v for k, v in today.items() if k not in ("cluster", "churn")}
    before["processes"] = {k: v for k, v in today["processes"].items() if k != "max_restarts"}
    before["model"] = {k: v for k, v in today["model"].items() if k not in ("n_experts", "norm_eps")}
    assert "max_restarts" in today["processes"] and "norm_eps" in today["model"]
    assert upgrade_resolved(before) == today
