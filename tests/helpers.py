"""What the test modules share: the entry run as a user runs it (in this process where the process
boundary is not what a test checks, `entry`; as a real command line otherwise), composed configs,
the trainer's rounds with their rounding floors, and the records a run leaves. Test modules import
from here (and from references.py, the float64 references), never from each other."""

from __future__ import annotations

import copy
import fcntl
import hashlib
import io
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import traceback
from contextlib import nullcontext, redirect_stderr, redirect_stdout
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from references import U32, assert_losses_within_rounding, assert_within_rounding, float64_arithmetic

from hypertrain.config import (
    DataConfig,
    EngineConfig,
    InnerConfig,
    LoggerConfig,
    ModelConfig,
    PhaseConfig,
    TrainConfig,
    WorldConfig,
)
from hypertrain.diloco.fragments import fragment_of
from hypertrain.diloco.outer import pseudo_gradient_sum, unflatten
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.engines import loop, stacked
from hypertrain.preflight.checks import validate
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.preflight.schema import register_configs
from hypertrain.records.files import merged_summary, read_records
from hypertrain.records.rows import EvalRow, SyncRow, UpdateRow, parse
from hypertrain.run.evaluation import heldout_eval
from hypertrain.run.trainer import train
from hypertrain.rundir.records import METRICS_FILE, RunLogger, read_metrics
from hypertrain.train import cli, quote_numeric_choices

# -- the entry in a subprocess ---------------------------------------------------------------------


REPO = Path(__file__).resolve().parents[1]


CONF = REPO / "conf"


QUICK = ["experiment=quick", "model.d_model=32", "data.seq_len=32", "data.heldout=64"]


def tree(path: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `path`: what a rejected run must leave alone."""
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in path.rglob("*")}


def compose_train(overrides: list[str], hydra_cfg: bool = False):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=hydra_cfg)


FAULT_ENV = "HYPERTRAIN_FAULT"  # the test-only fault hook: "RANK:UPDATE:kill" or "RANK:UPDATE:sleep"


TIMEOUT = 300  # seconds for one entry subprocess: a bug fails the test instead of hanging CI


def _command(args: list[str], torchrun: int = 0) -> list[str]:
    if not torchrun:
        return [sys.executable, "-m", "hypertrain.train", *args]
    script = Path(sys.executable).with_name("torchrun")  # the venv's torchrun, else the module it runs
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    # --standalone: a free port for the rendezvous, so parallel tests never collide on torchrun's 29500.
    return [*launcher, "--standalone", "--nproc_per_node", str(torchrun), "-m", "hypertrain.train", *args]


# What the entry's environment is, as a user's shell would have it: offline W&B, Hydra's one-line
# errors, one thread per process, and none of a launcher's or the fault hook's variables.
ENTRY_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_ERROR_REPORTING": "false",
    "HYDRA_FULL_ERROR": "0",
    "OMP_NUM_THREADS": "1",
}
NOT_INHERITED = ("WANDB_DIR", FAULT_ENV, "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def entry_env(env: dict | None = None) -> dict:
    base = os.environ | ENTRY_ENV
    for name in NOT_INHERITED:
        base.pop(name, None)
    return base | (env or {})


def start_entry(args: list[str], cwd: Path, env: dict | None = None, torchrun: int = 0) -> subprocess.Popen:
    """The entry started as a user starts it: offline W&B, one line per Hydra error, one thread per
    process, no fault unless asked; in its own session so a hung run can be stopped whole."""
    return subprocess.Popen(
        _command(args, torchrun),
        cwd=cwd,
        env=entry_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


# A sitecustomize that makes the hydra_plugins packages named in HIDDEN_PLUGINS not installed, as far as
# Python and Hydra's plugin scan can tell: the scan lists none of them, an import of one finds nothing.
HIDE_PLUGINS = """
import importlib.abc, os, pkgutil, sys

hidden = {"hydra_plugins." + name for name in os.environ["HIDDEN_PLUGINS"].split(",")}


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in hidden):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
listed = pkgutil.iter_modules
pkgutil.iter_modules = lambda path=None, prefix="": (m for m in listed(path, prefix) if m.name not in hidden)
"""


# Overrides whose runs start processes of their own (torch's elastic agent, a sweep's launcher): `entry`
# runs them on the real command line.
STARTS_PROCESSES = (
    "processes=dist",
    "engine=dist",
    "experiment=phases",
    "experiment=audio_phases",
    "launcher=",
)


def needs_a_process(args: list[str], fault: str | None, torchrun: int) -> bool:
    """Whether `entry` must start a real process: a fault (it kills or stops the process), torchrun,
    or a run that starts processes itself."""
    return bool(fault or torchrun) or any(part in a for a in args for part in STARTS_PROCESSES)


def in_process(
    args: list[str], cwd: Path, env: dict | None = None, main=cli, module: str = "hypertrain.train"
) -> subprocess.CompletedProcess:
    """`python -m hypertrain.train ARGS` as `hypertrain.train.cli(ARGS)` in this process (or `module`'s
    `main`), in `cwd` with the entry's environment (`entry_env`), its stdout and stderr captured; what a
    process would have ended with: an exception that escapes the entry is its traceback on stderr and
    exit 1."""
    before_env, before_cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(entry_env(env))
    try:
        os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(before_cwd)
        os.environ.clear()
        os.environ.update(before_env)
    return subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())


def finish(proc: subprocess.Popen, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the entry and the workers it started, nothing else
        out, err = proc.communicate()
        pytest.fail(f"the entry ran past {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def entry(
    args: list[str],
    cwd: Path,
    fault: str | None = None,
    *,
    timeout: int = TIMEOUT,
    env: dict | None = None,
    torchrun: int = 0,
    process: bool | None = None,
) -> subprocess.CompletedProcess:
    """`python -m hypertrain.train ARGS` (or under `torchrun` with that many processes) in `cwd`, to
    its end; `fault` sets the test-only fault hook (FAULT_ENV). It runs in this process (`in_process`)
    unless it needs a process of its own (`needs_a_process`) or `process` is True: the same exit code,
    the same lines (the catalogue's sample proves it, tests/test_bad_input.py)."""
    if process is None:
        process = needs_a_process(args, fault, torchrun)
    if not process:
        return in_process(args, cwd, env)
    extra = (env or {}) | ({FAULT_ENV: fault} if fault else {})
    return finish(start_entry(args, cwd, extra, torchrun), timeout)


def data_command(
    args: list[str], cwd: Path, *, env: dict | None = None, process: bool = False
) -> subprocess.CompletedProcess:
    """`python -m hypertrain.data ARGS` in `cwd` with the entry's environment, to its end: in this process
    (its `main`), or as a real command line with `process`."""
    if not process:
        from hypertrain.data.__main__ import main

        return in_process(args, cwd, env, main=main, module="hypertrain.data")
    command = [sys.executable, "-m", "hypertrain.data", *args]
    env = entry_env(env)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def compose_cfg(overrides: list[str]) -> TrainConfig:
    """The TrainConfig the entry builds from these command-line overrides (before its layout is filled)."""
    return OmegaConf.to_object(compose_train(quote_numeric_choices(overrides)))


def error_lines(stderr: str) -> list[str]:
    """hypertrain's own lines (errors, warnings, notices) among what a run printed."""
    return [line for line in stderr.splitlines() if line.startswith("hypertrain:")]


def stderr_lines(stderr: str) -> list[str]:
    """Every non-blank line: a one-line error must be the only one."""
    return [line for line in stderr.splitlines() if line.strip()]


# -- the trainer's rounds in this process ----------------------------------------------------------


def small_cfg(**overrides) -> TrainConfig:
    """A config that trains in about a second: tiny model, short windows, a small strong phase."""
    cfg = TrainConfig(
        model=ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2),
        inner=InnerConfig(H=2, lr=3e-3, warmup_steps=2),
        phase=PhaseConfig(name="t", kind="strong", offset=0, global_batch=24, updates=4, timing_warmup=0),
        world=WorldConfig(size=8),
        data=DataConfig(seq_len=16, heldout=32),
        logger=LoggerConfig(name="none", progress="never"),
        replicas=2,
    )
    for key, value in overrides.items():
        cfg = replace(cfg, **{key: value})
    validate(cfg)
    return cfg


def run_losses(cfg: TrainConfig, tmp_path) -> list[dict]:
    run = prepare(cfg)
    with RunLogger(
        tmp_path, {}, cfg.logger, name="t", group="t", job_type="t", tags=[], replicas=cfg.replicas
    ) as log:
        train(run, log)
    return read_metrics(tmp_path / "metrics.jsonl")


def update_losses(rows: list[dict]) -> list[list[float | None]]:
    """Each update row's per-replica losses (None: the replica did not step), read as `UpdateRow`s."""
    return [row.loss for row in map(parse, rows) if isinstance(row, UpdateRow)]


def run_rounds(
    cfg: TrainConfig, engine, dtype: torch.dtype = torch.float32, batches: list | None = None
) -> tuple[list[list[float | None]], dict[str, torch.Tensor]]:
    """The trainer's rounds (assignments, engine, sync with the state policy), without logging.

    dtype float64: the float64 reference, the same code on float64 weights and state (references.py's
    `float64_arithmetic`), from the same fp32 initial weights. `batches`: a list that collects every
    replica batch that stepped."""
    run = prepare(cfg)
    state = RunState.start(run.cfg, {n: t.to(dtype) for n, t in initial_weights(run).items()})
    theta = state.theta
    losses: list[list[float | None]] = []
    with float64_arithmetic() if dtype == torch.float64 else nullcontext():
        for rnd in rounds(run, state, engine):
            losses += [list(step) for step in zip(*(r.losses for r in rnd.results), strict=True)]
            if batches is not None:
                batches += [b for a in rnd.assigns for b in a.batches if not b.empty]
    return losses, theta


def rounding_floors(cfg: TrainConfig, batches: list, updates: int) -> tuple[float, float]:
    """(relative floor of a loss, floor of a weight tensor relative to its norm) for one fp32 path.

    A loss: the mean of N targets' cross-entropies, each a log-sum-exp minus a logit (2 roundings),
    summed pairwise (ceil(log2 N) levels), divided (1), then weighted and accumulated once per
    microbatch (2 per microbatch): (3 + ceil(log2 N) + 2 M) U32, N and M a replica update's most
    targets and microbatches (over `batches`). A weight: each of a replica's `updates` inner updates
    rounds it twice (decay, then the update's add) and each sync once: (2 updates + rounds) U32."""
    targets = max(b.targets for b in batches)
    microbatches = max(len(b.microbatches) for b in batches)
    loss = (3 + math.ceil(math.log2(targets)) + 2 * microbatches) * U32
    weights = (2 * updates + math.ceil(updates / cfg.inner.H)) * U32
    return loss, weights


def assert_engines_agree(cfg: TrainConfig, got=None) -> None:
    """The stacked engine (or `got`, a `run_rounds` result) against the eager loop, each against the
    float64 loop: per-replica losses elementwise and final weights per tensor within twice the eager
    loop's own error, or twice its floor (`rounding_floors`), whichever is larger (references.py).
    This covers bf16 Newton-Schulz and autocast too: their bound is then the loop's own bf16 error."""
    batches: list = []
    ref_losses, ref_theta = run_rounds(cfg, loop.train_replicas, torch.float64, batches)
    loop_losses, loop_theta = run_rounds(cfg, loop.train_replicas)
    losses, theta = got or run_rounds(cfg, stacked.train_replicas)
    loss_floor, weight_floor = rounding_floors(cfg, batches, len(ref_losses))
    assert_losses_within_rounding(losses, loop_losses, ref_losses, loss_floor)
    for n, t in ref_theta.items():
        assert_within_rounding(theta[n], loop_theta[n], t, weight_floor * float(t.norm()), n)


def cfg_for(R: int, H: int, stack: int = 0, **inner) -> TrainConfig:
    cfg = small_cfg(
        replicas=R,
        world=WorldConfig(size=6 if R == 3 else 8),
        inner=InnerConfig(H=H, lr=3e-3, warmup_steps=2, **inner),
        phase=PhaseConfig(name="t", kind="strong", offset=0, global_batch=12, updates=2 * H, timing_warmup=0),
        engine=EngineConfig(name="stacked", stack=stack),
    )
    return cfg


# -- runs stopped and resumed, and what a run directory holds ------------------------------------


RUN = [*QUICK, "logger=none"]


# 4 rounds of 2 updates (syncs after updates 2, 4, 6, 8); the decay spans the phase (decay_steps = 8).
BASE = [*RUN, "inner.H=2", "phase.updates=8"]


KILLED = -9  # the entry's return code when the fault hook SIGKILLs it (one-process engines)


class ReferenceRuns:
    """Finished runs of the entry, each trained once per test session and shared by every test and
    xdist worker that asks for the same resolved config (its key), in pytest's temporary directory of
    the session; a file lock per key makes one worker train it while the others wait. A test reads a
    reference, never writes into it: `copy` gives one to change."""

    def __init__(self, root: Path):
        self.root = root

    @classmethod
    def beside(cls, tmp_path: Path) -> ReferenceRuns:
        """The session's store, found from a test's `tmp_path` (or a `tmp_path_factory.mktemp` folder):
        its parent is the worker's base temporary directory, whose parent xdist's workers share."""
        base = tmp_path.parent
        return cls((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "reference-runs")

    @staticmethod
    def key(args: list[str]) -> str:
        """The run's resolved config (what config.yaml would hold), hashed; the overrides themselves
        where the config needs Hydra's run to resolve."""
        try:
            text = OmegaConf.to_yaml(compose_train(quote_numeric_choices(list(args))), resolve=True)
        except Exception:
            text = "\n".join(args)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __call__(self, args: list[str]) -> Path:
        """The finished run of `args` (trained now if no test of this session has asked for it yet)."""
        self.root.mkdir(parents=True, exist_ok=True)
        key = self.key(args)
        folder = self.root / key
        with open(self.root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / "done").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                done = entry([*args, f"hydra.run.dir={folder / 'run'}"], folder)
                assert done.returncode == 0, (args, done.stderr[-3000:])
                (folder / "done").write_text(" ".join(args) + "\n")
        return folder / "run"

    def copy(self, args: list[str], dest: Path) -> Path:
        """A copy of the reference run of `args` at `dest`, for a test that changes it."""
        shutil.copytree(self(args), dest)
        return dest


def killed_beside_uninterrupted(
    args: list[str], tmp_path: Path, fault: str, killed_rc: int = KILLED
) -> tuple[Path, Path]:
    """The run `args` killed by the test-only `fault` (failures.fault_points) in tmp_path/run, and the
    same run uninterrupted (the session's reference, `ReferenceRuns`); asserts the killed run ended with
    `killed_rc`, leaving no final weights. Returns (run, reference), the reference to read only."""
    run_dir = tmp_path / "run"
    killed = entry([*args, f"hydra.run.dir={run_dir}"], tmp_path, fault)
    assert killed.returncode == killed_rc, killed.stderr
    assert not (run_dir / "weights.pt").exists()
    return run_dir, ReferenceRuns.beside(tmp_path)(args)


def resumed(args: list[str], run_dir: Path, tmp_path: Path) -> None:
    """`args` resumed in `run_dir` (resume=true) to the end."""
    done = entry([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr


DOCUMENTS = ["data.examples=documents", "data.max_len=48", "data.max_examples=4"]


ENGINES = {"stacked": [], "loop": ["engine=loop"], "dist": ["processes=dist", "world=2", "replicas=2"]}


INNERS = {"adamw": [], "muon": ["inner=muon"]}


DATA = {"windows": [], "documents": DOCUMENTS}


def ckpt(run_dir: Path, next_update: int) -> Path:
    return run_dir / "checkpoints" / f"ckpt-u{next_update:07d}.pt"


@dataclass
class Outcome:
    updates: list[dict]  # update rows without their timings
    syncs: list[dict]  # sync rows without their seconds
    heldout: list[float]  # the held-out loss before training, then after every sync
    final: dict  # the last summary's final held-out loss and token total
    weights: dict[str, torch.Tensor]


def untimed(row: dict) -> dict:
    """A row without its timings: seconds, and the network clock (measured compute, the default, makes
    it a timing; tests/test_clock.py compares clocks of modelled compute)."""
    return {
        k: v
        for k, v in row.items()
        if k not in ("wall", "rank_seconds") and not k.endswith("_s") and not k.startswith("clock")
    }


def recorded_clock(run_dir: Path) -> dict:
    """What a run's records say of its network clock (docs/clock.md): every update, sync and eval row's
    clock fields in the order written, and the last summary's `clock/` totals."""
    rows = read_records(run_dir / METRICS_FILE)
    fields = [
        (r.kind, r.update, {k: v for k, v in r.to_json().items() if k.startswith("clock_")})
        for r in rows
        if isinstance(r, (UpdateRow, SyncRow, EvalRow)) and r.update > 0
    ]
    summary = {k: v for k, v in merged_summary(rows).items() if k.startswith("clock/")}
    assert fields and summary, "the run recorded no clock"
    return {"rows": fields, "summary": summary}


def outcome(run_dir: Path) -> Outcome:
    rows = read_records(run_dir / METRICS_FILE)
    summary = merged_summary(rows)
    return Outcome(
        [untimed(r.to_json()) for r in rows if isinstance(r, UpdateRow)],
        [untimed(r.to_json()) for r in rows if isinstance(r, SyncRow)],
        [r.eval_loss for r in rows if isinstance(r, (EvalRow, SyncRow))],
        {k: summary[k] for k in ("eval/final_loss", "train/tokens_total")},
        torch.load(run_dir / "weights.pt"),
    )


def assert_same_weights(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"weights.pt differs at {name}"


def assert_identical(run_dir: Path, reference: Path) -> None:
    """The run in `run_dir` equals the uninterrupted `reference` exactly (==, torch.equal)."""
    got, want = outcome(run_dir), outcome(reference)
    assert [r["update"] for r in got.updates] == [r["update"] for r in want.updates]
    for a, b in zip(got.updates, want.updates, strict=True):
        assert a == b, f"update {b['update']}: {a} != {b}"
    assert got.syncs == want.syncs
    assert got.heldout == want.heldout and len(got.heldout) == len(want.syncs) + 1
    assert got.final == want.final
    assert_same_weights(got.weights, want.weights)


# -- the package's arithmetic in the shapes the tests check it in ------------------------------------


def heldout_loss(run, theta) -> float:
    """The held-out loss of global weights `theta` (what a sync row's `eval_loss` records)."""
    return heldout_eval(run, theta)[0]


def pseudo_gradient(global_params, replica_params, active=None) -> dict:
    """mean over active replicas of (theta_global - theta_m), shaped like the global params (none
    active gives zeros): the sync's first stage, `pseudo_gradient_sum` over its count, unflattened."""
    total = pseudo_gradient_sum(global_params, replica_params, active)
    return unflatten(total[:-1] / total[-1].clamp(min=1), global_params)


# -- real processes against the simulation -----------------------------------------------------


DIST = [*QUICK, "logger=none", "processes=dist"]


def simulate(cfg: TrainConfig, dtype: torch.dtype = torch.float32, batches: list | None = None):
    """`run_rounds` (the trainer's rounds by the per-replica loop, one process) plus what
    the entry logs beside the losses: the held-out loss of the global weights before training and after
    every sync. dtype float64: the float64 reference from the same fp32 initial weights.
    Returns (losses [update][replica], held-out losses, final global weights, the prepared run)."""
    run = prepare(replace(cfg, engine=EngineConfig(name="loop")))
    state = RunState.start(run.cfg, {n: t.to(dtype) for n, t in initial_weights(run).items()})
    losses: list[list[float | None]] = []
    with float64_arithmetic() if dtype == torch.float64 else nullcontext():
        evals = [heldout_loss(run, state.theta)]
        for rnd in rounds(run, state, loop.train_replicas):
            losses += [list(step) for step in zip(*(r.losses for r in rnd.results), strict=True)]
            if batches is not None:
                batches += [b for a in rnd.assigns for b in a.batches if not b.empty]
            evals.append(heldout_loss(run, state.theta))
    return losses, evals, state.theta, run


# -- Streaming DiLoCo (outer.fragments, outer.delay, outer.merge_alpha) ---------------------------------


def streaming_cfg(P: int, tau: int, alpha: float, updates: int = 19, engine: str = "stacked", **inner):
    """A config with Streaming DiLoCo's fragments: three layers (so four fragments all hold parameters),
    H = 8 (P = 1, 2, 4 divide it), R = 2, a strong phase of `updates` updates (19: two full periods and
    a short one that ends in the flush)."""
    from hypertrain.config import OuterConfig

    return small_cfg(
        model=ModelConfig(d_model=32, n_layers=3, n_heads=2, n_kv_heads=2),
        inner=InnerConfig(**({"H": 8, "lr": 3e-3, "warmup_steps": 2} | inner)),
        outer=OuterConfig(fragments=P, delay=tau, merge_alpha=alpha),
        phase=PhaseConfig(
            name="t", kind="strong", offset=0, global_batch=12, updates=updates, timing_warmup=0
        ),
        engine=EngineConfig(name=engine),
    )


def fragment_landings(H: int, P: int, updates: int) -> list[int]:
    """How many syncs land on each fragment's parameters in a phase of `updates` updates, counted from
    the paper's schedule (fragment p lands after counts c with c = (p+1)*H/P mod H) and our flush (at
    the phase's end every fragment that did not land at that count lands once more). Every parameter
    is synced once per full period of H updates, at its fragment's offset; the last, short period and
    the flush add at most one: fragment P-1 lands ceil(updates/H) times, the others up to one more
    (updates = 16, P = 2: fragment 0 after 4, 12 and in the flush at 16; fragment 1 after 8, 16)."""
    out = []
    for p in range(P):
        point = (p + 1) * H // P % H
        lands = [c for c in range(1, updates + 1) if c % H == point]
        out.append(len(lands) + (0 if lands and lands[-1] == updates else 1))
    return out


def streaming_rounding_floors(cfg: TrainConfig, batches: list, updates: int) -> tuple[float, float]:
    """`rounding_floors` for a run with fragments: the same loss floor; a weight's floor counts, beside
    its 2 roundings per inner update, its fragment's syncs as they land (`fragment_landings`, the most
    of any fragment, instead of ceil(updates/H): the flush can add one) and, with merge_alpha > 0, the
    merge's lerp(global, local, alpha) rounding the replica's weights up to 3 more times at each of
    them (a subtraction, a product, a sum; at alpha = 0 the merge copies, exactly):
    (2 updates + S (1 + 3 [alpha > 0])) U32, S = the most syncs of any parameter."""
    loss, _ = rounding_floors(cfg, batches, updates)
    syncs = max(fragment_landings(cfg.inner.H, cfg.outer.fragments, updates))
    per_sync = 1 + (3 if cfg.outer.merge_alpha else 0)
    return loss, (2 * updates + syncs * per_sync) * U32


def assert_streaming_engines_agree(cfg: TrainConfig) -> dict[str, float]:
    """`assert_engines_agree` with the floors of `streaming_rounding_floors`: the stacked engine against
    the eager loop, each against the float64 loop, per-replica losses elementwise and final global
    weights per tensor. Returns the largest fraction of its bound each comparison used."""
    batches: list = []
    ref_losses, ref_theta = run_rounds(cfg, loop.train_replicas, torch.float64, batches)
    loop_losses, loop_theta = run_rounds(cfg, loop.train_replicas)
    losses, theta = run_rounds(cfg, stacked.train_replicas)
    loss_floor, weight_floor = streaming_rounding_floors(cfg, batches, len(ref_losses))
    used = {"losses": assert_losses_within_rounding(losses, loop_losses, ref_losses, loss_floor)}
    used["weights"] = max(
        assert_within_rounding(theta[n], loop_theta[n], t, weight_floor * float(t.norm()), n)
        for n, t in ref_theta.items()
    )
    return used


def simulated_beside(proc: subprocess.Popen, cfg: TrainConfig, simulate_fn=None):
    """`simulate_fn` (`simulate` by default) of `cfg` in float64 (collecting the batches) and in fp32, run
    here while `proc`, the real run, runs; on an error here `proc` and its workers are killed first.
    Returns (batches, the float64 (losses, evals, weights), the fp32 ones, the prepared run)."""
    try:
        batches: list = []
        *ref, run = (simulate_fn or simulate)(cfg, torch.float64, batches)
        *sim, _ = (simulate_fn or simulate)(cfg)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # the entry and its workers; the test fails with the error
        raise
    return batches, tuple(ref), tuple(sim), run


def streaming_bounds_used(cfg, run, batches, got, sim, ref) -> dict[str, float]:
    """Real processes' (losses, held-out losses of the eval rows, final weights) `got` against the
    simulation's fp32 `sim` and float64 `ref` (`simulate_streaming`'s first three): each within twice the
    fp32 simulation's error against the float64 one, or twice the floor (`streaming_rounding_floors`);
    returns the fraction of each bound used."""
    loss_floor, weight_floor = streaming_rounding_floors(cfg, batches, len(ref[0]))
    heldout_floor = streaming_rounding_floors(cfg, [run.heldout], 1)[0]
    as_rows = lambda xs: [[x] for x in xs]  # noqa: E731
    weights = got[2]
    assert set(weights) == set(ref[2])
    return {
        "losses": assert_losses_within_rounding(got[0], sim[0], ref[0], loss_floor),
        "held-out": assert_losses_within_rounding(
            as_rows(got[1]), as_rows(sim[1]), as_rows(ref[1]), heldout_floor
        ),
        "weights": max(
            assert_within_rounding(weights[n], sim[2][n], t, weight_floor * float(t.norm()), n)
            for n, t in ref[2].items()
        ),
    }


def simulate_streaming(cfg: TrainConfig, dtype: torch.dtype = torch.float32, batches: list | None = None):
    """`simulate` for a run with fragments: the rounds are cut at every take and landing, and the entry
    logs the held-out loss (its `eval` rows) before training and after every period of H updates and the
    phase's end (the segments that end a round), not after every sync. Returns what `simulate` does."""
    run = prepare(replace(cfg, engine=EngineConfig(name="loop")))
    state = RunState.start(run.cfg, {n: t.to(dtype) for n, t in initial_weights(run).items()})
    losses: list[list[float | None]] = []
    with float64_arithmetic() if dtype == torch.float64 else nullcontext():
        evals = [heldout_loss(run, state.theta)]
        for part in rounds(run, state, loop.train_replicas):
            losses += [list(step) for step in zip(*(r.losses for r in part.results), strict=True)]
            if batches is not None:
                batches += [b for a in part.assigns for b in a.batches if not b.empty]
            if part.ends_round:
                evals.append(heldout_loss(run, state.theta))
    return losses, evals, state.theta, run


def streaming_outcome(run_dir: Path) -> Outcome:
    """`outcome` of a run with fragments: its held-out losses are its `eval` rows (before training, after
    every period of H updates and at the end); its sync rows (one per fragment sync) hold none."""
    rows = read_records(run_dir / METRICS_FILE)
    summary = merged_summary(rows)
    return Outcome(
        [untimed(r.to_json()) for r in rows if isinstance(r, UpdateRow)],
        [untimed(r.to_json()) for r in rows if isinstance(r, SyncRow)],
        [r.eval_loss for r in rows if isinstance(r, EvalRow)],
        {k: summary[k] for k in ("eval/final_loss", "train/tokens_total")},
        torch.load(run_dir / "weights.pt"),
    )


def assert_identical_streaming(run_dir: Path, reference: Path, skip: tuple[str, ...] = ()) -> None:
    """`assert_identical` for a run with fragments: every update row, every sync row (its fragment
    included; but the keys in `skip`), every `eval` row's held-out loss (one before training and one per
    period, the periods being the sync rows' rounds), the final summary and weights.pt, exactly."""
    got, want = streaming_outcome(run_dir), streaming_outcome(reference)
    assert [r["update"] for r in got.updates] == [r["update"] for r in want.updates]
    for a, b in zip(got.updates, want.updates, strict=True):
        assert a == b, f"update {b['update']}: {a} != {b}"
    kept = lambda rows: [{k: v for k, v in r.items() if k not in skip} for r in rows]  # noqa: E731
    assert kept(got.syncs) == kept(want.syncs)
    periods = len({r["round"] for r in want.syncs})
    assert got.heldout == want.heldout and len(got.heldout) == periods + 1
    assert got.final == want.final
    assert_same_weights(got.weights, want.weights)


def observe(cfg):
    """Run the rounds by the loop engine, cut after every update. Returns the fragment split, the initial
    global weights and, per update count: the replicas' weights before the count's events, and after
    them the global weights, the outer momentum and the replicas' weights (all cloned); and per update
    (0-based) the inner optimizer states the engine was handed (cloned)."""
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    theta0 = {n: t.clone() for n, t in state.theta.items()}
    before: dict[int, list[dict]] = {}
    handed: dict[int, list] = {}

    def recording(cfg, theta, assigns, states, average=None, stop=None):
        handed[assigns[0].global_step0] = [copy.deepcopy(s) for s in states]
        results = loop.train_replicas(cfg, theta, assigns, states, average, stop)
        count = assigns[0].global_step0 + len(results[0].losses)
        before[count] = [{n: t[0].clone() for n, t in r.params.items()} for r in results]
        return results

    after = {}
    for part in rounds(run, state, recording, every_updates=1):
        count = part.updates.stop
        replicas = (
            None
            if state.round_params is None
            else [{n: t[0].clone() for n, t in p.items()} for p in state.round_params]
        )
        after[count] = (
            {n: t.clone() for n, t in state.theta.items()},
            {n: t.clone() for n, t in state.outer.momentum.items()},
            replicas,
        )
    return fragment_of(run.cfg), theta0, before, after, handed


# -- compressed pseudo-gradients (outer.compress) ------------------------------------------------------


def shard_norm_bound(params: int) -> float:
    """How far (relative) a sharded run's norm of `params` values (`norm_over_shards`: each rank's float64
    norm of its shard, squared, summed over the shards, square-rooted) may lie from the unsharded run's
    float64 norm of the whole: both sum the same non-negative squares (each rounded once) in other orders,
    each within (n + 3) 2^-53 of the exact sum (n - 1 additions, the squares, the shard's square root
    squared again: recursive summation, Higham 2002, section 4.2), so the two sums lie within twice that
    of each other and their square roots within half of it."""
    return (params + 3) * 2**-53


def assert_identical_but(run_dir: Path, reference: Path, skip: tuple[str, ...] = ()) -> None:
    """`assert_identical` but for the sync rows' keys in `skip` (figures only some runs record, such as the
    bytes real processes measured): every update row, every other sync field, the held-out losses, the
    final summary and weights.pt, exactly."""
    got, want = outcome(run_dir), outcome(reference)
    assert [r["update"] for r in got.updates] == [r["update"] for r in want.updates]
    for a, b in zip(got.updates, want.updates, strict=True):
        assert a == b, f"update {b['update']}: {a} != {b}"
    kept = lambda rows: [{k: v for k, v in r.items() if k not in skip} for r in rows]  # noqa: E731
    assert kept(got.syncs) == kept(want.syncs)
    assert got.heldout == want.heldout and len(got.heldout) == len(want.syncs) + 1
    assert got.final == want.final
    assert_same_weights(got.weights, want.weights)


# -- processes a test starts itself -----------------------------------------------------------------


def fork_ranks(world: int, worker) -> None:
    """Run `worker(rank)` for ranks 0..world-1: rank 0 in this process, the others forked from it
    (call it before any thread or process group exists, with torch and hypertrain imported once);
    exits this process with 1 when a rank failed (its traceback printed), else 0."""
    children = []
    for rank in range(1, world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                worker(rank)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)  # never back into the parent's code
        children.append(pid)
    worker(0)
    failed = [pid for pid in children if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0]
    sys.exit(1 if failed else 0)


# -- the report's page in a real browser -------------------------------------------------------------

CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None
)
MARK = (
    "<script>window.addEventListener('load', () => { document.body.dataset.images = "
    "Array.from(document.images).map(i => i.complete && i.naturalWidth > 0 ? 'ok' : 'broken').join(' '); });"
    "</script></body>"
)


def load_in_chromium(page: Path, profile: Path) -> tuple[list[str], list[str]]:
    """The page's images as 'ok' / 'broken' after its load event, and Chromium's console lines."""
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={profile}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    marked = re.search(r'data-images="([^"]*)"', done.stdout)
    assert marked, f"the page was not loaded: {done.stderr[-2000:]}"
    return marked.group(1).split(), [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
