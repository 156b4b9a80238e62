"""docs/extending.md's worked examples, components that live outside the package, each run by the
command line its section of the page gives, through the entry:

- an outer optimizer (experiments/extend/sign_momentum.py, Signum: Bernstein et al. 2018,
  arXiv:1802.04434, Algorithm 3): every sync is one step of a float64 Signum written here, its momentum
  kept from the first sync on;
- a codec (experiments/extend/ternary.py, BitNet b1.58's absmean ternary quantizer: Ma et al. 2024,
  arXiv:2402.17764): every replica's error buffer after every sync is what a float64 quantizer written
  here leaves out, and the outer momentum took the mean of what it sends; on 2 real processes the
  same command gives the simulation's weights and sync rows, bitwise;
- a data source (experiments/extend/tsv_column.py, a TSV file's column): the run's examples are the
  windows of that column's bytes, each once, and nothing else;
- a model (experiments/extend/gated_conv.py, a gated causal-convolution LM): the stacked engine agrees
  with the eager loop within rounding, the run trains the module's own parameters, and two fragments
  share out its layers;
- a schedule (experiments/extend/post_local.py, post-local SGD: Lin et al. 2020, arXiv:1808.07217,
  Section 3): the run syncs after exactly the counts the paper's statement gives, each sync is a float64
  outer step of the mean pseudo-gradient, the stacked engine agrees with the loop, and a run killed
  between syncs resumes bit-identically.

A command is read from the page and run in this process (its module put on sys.path as the page's
PYTHONPATH puts it); the same config is then trained again with every sync recorded, its final weights
the command's own, bitwise.
"""

from __future__ import annotations

import ast
import csv
import json
import math
import os
import shlex
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    KILLED,
    assert_engines_agree,
    assert_identical,
    assert_same_weights,
    compose_cfg,
    entry,
    resumed,
)
from references import U32
from test_overlap import _flat, _nesterov, _snapshot, run_syncs, step_bound

from hypertrain.data import build_dataset
from hypertrain.diloco.exchange.communication import HEADER_BYTES
from hypertrain.diloco.fragments import members
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.engines import engine_for
from hypertrain.preflight.prepare import initial_weights, prepare

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending.md"
ENTRY = ["python", "-m", "hypertrain.train"]


def page_command(section: str = "## An outer optimizer") -> tuple[list[str], list[str]]:
    """The command line of the page's `section`: the folders its PYTHONPATH puts first (the
    repository's), its arguments."""
    text = PAGE.read_text().split(f"\n{section}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for line in text.splitlines() if line.startswith("    PYTHONPATH=")]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    assert words[1:4] == ENTRY, words
    folders = [ROOT / f for f in words[0].removeprefix("PYTHONPATH=").split(":") if f and "$" not in f]
    return folders, words[4:]


class Signum64:
    """Algorithm 3 in float64: m = beta m + (1 - beta) g, x = x - lr sign(m), m from 0.

    `Em` bounds, per entry, how far the run's fp32 m (fed a g within err_g of the reference's) is from
    the reference's, first order in U32: the run's m.mul_(beta).add_(g, alpha=1 - beta) rounds three
    times (the product, alpha g, the sum), each at most U32 of its operands, and inherits beta Em +
    (1 - beta) err_g. Where |m| > Em the run's sign is the reference's, and its step is exact to fp32's
    one rounding of x - lr (sign(m) is +-1, so lr times it is exact)."""

    def __init__(self, lr: float, beta: float):
        self.lr, self.beta = lr, beta
        self.m = self.Em = 0.0

    def step(self, theta, g, err_g):
        b = self.beta
        m_old = self.m
        self.m = b * m_old + (1 - b) * g
        self.Em = b * self.Em + (1 - b) * err_g + 3 * U32 * (b * abs(m_old) + (1 - b) * g.abs())
        sure = self.m.abs() > self.Em
        want = (theta.float() - self.lr * torch.sign(self.m).float()).double()
        return want, sure


def signum_checks(cfg, syncs, beta: float):
    """Per landing: (entries whose sign is sure, how many of them the run got exactly right, entries)."""
    R, frags = cfg.replicas, members(cfg)
    refs: dict[int, Signum64] = {}
    out = []
    for before, landed, after, _ in syncs:
        for p in landed:
            names = frags[p]
            theta = _flat(before["theta"], names)
            d = theta - torch.stack([_flat(x, names) for x in before["X"]])
            # the run's mean: R subtractions and the sum's and division's roundings, (R + 1) U32 of mean |d|
            err_g = (R + 1) * U32 * d.abs().mean(0)
            want, sure = refs.setdefault(p, Signum64(cfg.outer.lr, beta)).step(theta, d.mean(0), err_g)
            got = _flat(after["theta"], names)
            out.append((int(sure.sum()), int((got == want)[sure].sum()), sure.numel()))
    return out


def test_the_pages_signum_command_runs_and_every_sync_is_a_float64_signum(tmp_path, monkeypatch):
    folders, args = page_command()
    assert folders == [ROOT / "experiments" / "extend"]
    for folder in folders:
        monkeypatch.syspath_prepend(str(folder))
    done = entry([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    weights = torch.load(tmp_path / "run" / "weights.pt")

    cfg = compose_cfg(args)
    assert cfg.outer.optimizer == "sign_momentum.SignMomentum"
    syncs, state = run_syncs(cfg)
    assert weights.keys() == state.theta.keys()
    assert all(torch.equal(weights[n], t) for n, t in state.theta.items())  # the command's run, checked

    beta = cfg.outer.optimizer_args["beta"]
    checks = signum_checks(cfg, syncs, beta)
    assert len(checks) >= 3  # the momentum carried over two syncs
    for sure, right, n in checks:
        assert right == sure, (sure, right, n)
        assert sure >= 0.99 * n, (sure, n)  # the check is not vacuous: nearly every sign is decided
    # a negative control: signSGD without momentum (beta 0) is not this run. (Signum's dampening 1 - beta
    # scales m and so not its sign: a momentum without it is the same run, which no check could tell.)
    assert any(right < sure for sure, right, _ in signum_checks(cfg, syncs, 0.0)[1:])


def ternary_syncs(cfg):
    """Train `cfg` in this process; per sync (P = 1: every parameter): the run before it (weights, outer
    momentum, the replicas' weights), each replica's error buffer before and after it, and the run after."""
    run = prepare(cfg)
    state = RunState.start(cfg, initial_weights(run))
    real = engine_for(cfg.engine.name)
    before: list[tuple] = []

    def errors():
        return [{n: t.detach().double().reshape(-1) for n, t in e.items()} for e in state.errors]

    def engine(*args):
        results = real(*args)
        before.append((_snapshot(state, results), errors()))
        return results

    out = []
    for part in rounds(run, state, engine):
        if part.syncs:
            out.append((*before[-1], _snapshot(state), errors()))
    return out, state


def blockwise(x: torch.Tensor, sizes: list[int], block: int) -> list[torch.Tensor]:
    """A flat vector of tensors of `sizes` values cut in the codec's blocks (outer.codec.tile=0): each
    tensor's values in blocks of `block`, its last shorter, none crossing a tensor's boundary."""
    return [b for t in x.split(sizes) for b in t.split(block)]


def ternary64(u: torch.Tensor, eps: float, scale: str = "absmean") -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's quantizer of one block u, float64: gamma = mean |u| (the negative control: max |u|,
    absmax), codes RoundClip(u / (gamma + eps), -1, 1) (round half to even); (codes, gamma)."""
    gamma = u.abs().mean() if scale == "absmean" else u.abs().max()
    return torch.round(u / (gamma + eps)).clamp(-1, 1), gamma


def replica_check(u, d, e_after, sizes: list[int], block: int, eps: float, scale: str):
    """One replica's flat u = d + e (float64) cut in blocks against the run's error buffer after the sync
    (`ternary_checks` derives the bounds): (sure codes, of them right, entries), and per entry the
    reference's decoded value (NaN where its code is not sure), its error bound Eq, and its block's gamma."""
    eu_all = U32 * (d.abs() + u.abs())
    sure_n = right_n = 0
    decoded, eq_all, gamma_all = [], [], []
    for ub, eu, e_run in zip(*(blockwise(x, sizes, block) for x in (u, eu_all, e_after)), strict=True):
        q, gamma = ternary64(ub, eps, scale)
        g = float(gamma)
        eg = (len(ub) + 1) * U32 * g + float(eu.mean())
        r = ub / (g + eps)
        er = eu / g + r.abs() * (eg / g + 2 * U32) if g > 0 else torch.zeros_like(r)
        sure = (r.abs() - 0.5).abs() > 2 * er
        eq, want = eg + U32 * g, ub - q * g
        right = (e_run - want).abs() <= 2 * (eu + eq + U32 * want.abs())
        sure_n, right_n = sure_n + int(sure.sum()), right_n + int(right[sure].sum())
        decoded.append(torch.where(sure, q * g, math.nan))  # not sure: left out of the mean's check
        eq_all.append(torch.full_like(ub, eq))
        gamma_all.append(torch.full_like(ub, g))
    return (sure_n, right_n, len(u)), torch.cat(decoded), torch.cat(eq_all), torch.cat(gamma_all)


def ternary_checks(cfg, syncs, scale: str = "absmean"):
    """Per sync and replica: (entries whose code is sure, how many of those the run's error buffer
    matches, entries); and per sync whether the outer momentum took the mean of the decoded payloads.

    First-order bounds in U32, per entry of a block of L values: the run's u = fl(fl(theta - X) + e)
    errs by Eu = U32 (|d| + |u|); its gamma (a sum of L magnitudes in any order, a division) by
    Eg = (L + 1) U32 gamma + mean Eu, and gamma + eps once more; so r = u / (gamma + eps) by
    Er = Eu / gamma + |r| (Eg / gamma + 2 U32). A code is sure where r is farther than 2 Er from the
    rounding's only threshold in use, |r| = 1/2 (beyond 3/2 the clip gives 1 as rounding to 1 does).
    The decoded value q gamma errs by Eq = Eg + U32 gamma, the buffer e' = fl(u - q gamma) by
    Eu + Eq + U32 |e'|; the mean over R replicas by mean Eq + (R + 1) U32 mean gamma, the momentum
    mu m + g by that and 2 U32 (mu |m| + |g|). Each bound is doubled for the second-order terms."""
    from ternary import TERNARY

    R, mu = cfg.replicas, cfg.outer.momentum
    names = members(cfg)[0]
    sizes = [syncs[0][0]["theta"][n].numel() for n in names]
    checks, means = [], []
    for before, errors_before, after, errors_after in syncs:
        theta = _flat(before["theta"], names)
        per = []
        for m in range(R):
            d = theta - _flat(before["X"][m], names)
            u = d + torch.cat([errors_before[m][n] for n in names])
            e_after = torch.cat([errors_after[m][n] for n in names])
            per.append(replica_check(u, d, e_after, sizes, cfg.outer.codec.block, TERNARY.eps, scale))
        checks += [check for check, *_ in per]
        decoded, eq, gamma = (torch.stack(x).mean(0) for x in list(zip(*per, strict=True))[1:])
        m_before, m_after = (_flat(x["momentum"], names) for x in (before, after))
        want = mu * m_before + decoded
        bound = 2 * (eq + (R + 1) * U32 * gamma + 2 * U32 * (mu * m_before.abs() + decoded.abs()))
        known = ~decoded.isnan()
        means.append(bool(((m_after - want).abs() <= bound)[known].all()) and int(known.sum()) > 0.9 * len(u))
    return checks, means


@pytest.mark.slow
def test_the_pages_ternary_codec_runs_and_every_sync_is_the_papers_absmean_quantizer(tmp_path, monkeypatch):
    folders, args = page_command("## A codec")
    assert folders == [ROOT / "experiments" / "extend"]
    for folder in folders:
        monkeypatch.syspath_prepend(str(folder))
    done = entry([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    weights = torch.load(tmp_path / "run" / "weights.pt")

    cfg = compose_cfg(args)
    assert cfg.outer.compress == "ternary.TERNARY" and cfg.outer.error_feedback and cfg.outer.fragments == 1
    syncs, state = ternary_syncs(cfg)
    assert weights.keys() == state.theta.keys()
    assert all(torch.equal(weights[n], t) for n, t in state.theta.items())  # the command's run, checked

    checks, means = ternary_checks(cfg, syncs)
    assert len(checks) == 3 * cfg.replicas  # 6 updates, H = 2: three syncs, the buffers fed back twice
    for sure, right, n in checks:
        assert right == sure and sure >= 0.99 * n, (sure, right, n)  # and nearly every code is decided
    assert all(means), means
    # the wire format reached the records: per block an fp32 gamma and ceil(L / 4) bytes of codes
    sizes = [t.numel() for t in state.theta.values()]
    blocks = [len(b) for b in blockwise(torch.zeros(sum(sizes)), sizes, cfg.outer.codec.block)]
    payload = sum(4 + -(-L // 4) for L in blocks)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sync_rows = [row for row in rows if row["kind"] == "sync"]
    assert [row["payload_bytes"] for row in sync_rows] == [payload] * 3
    bits = 8 * (payload + HEADER_BYTES) / sum(blocks)  # and each message's header (took part, its error)
    assert sync_rows[0]["bits_per_param"] == pytest.approx([bits] * cfg.replicas, rel=1e-12)
    # a negative control: BitNet's absmax scale (its activations' quantizer) is not this run
    wrong, _ = ternary_checks(cfg, syncs, scale="absmax")
    assert any(right < sure for sure, right, _ in wrong)


CODEC_COLUMNS = ("eval_loss", "pseudo_grad_norm", "payload_bytes", "bits_per_param", "compress_error")


def sync_rows(run: Path) -> list[dict]:
    """A run's sync rows: what the codec sent and what came of it (a real process's rows add measured
    bytes and seconds, and its clock reads its own timings)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in CODEC_COLUMNS} for r in rows if r["kind"] == "sync"]


@pytest.mark.slow
def test_the_pages_codec_on_real_processes_equals_the_simulation_bitwise(tmp_path, monkeypatch):
    """The page's codec command at world.size=2 on 2 processes under torchrun (each imports the entry by
    its path, from PYTHONPATH as the page sets it) and in this process: the same weights and sync rows."""
    folders, args = page_command("## A codec")
    args = [*args, "world.size=2"]
    for folder in folders:
        monkeypatch.syspath_prepend(str(folder))
    done = entry([*args, f"hydra.run.dir={tmp_path / 'sim'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    path = os.pathsep.join([*map(str, folders), str(ROOT), os.environ.get("PYTHONPATH", "")])
    real = [*args, "processes=dist", f"hydra.run.dir={tmp_path / 'dist'}"]
    done = entry(real, tmp_path, torchrun=2, env={"PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_weights(
        torch.load(tmp_path / "dist" / "weights.pt"), torch.load(tmp_path / "sim" / "weights.pt")
    )
    assert (
        sync_rows(tmp_path / "dist") == sync_rows(tmp_path / "sim") and len(sync_rows(tmp_path / "sim")) == 3
    )


def stdlib_docstrings() -> list[tuple[str, str]]:
    """(module, docstring) of every top-level module of this Python's standard library that has one."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = [(p.stem, ast.get_docstring(ast.parse(p.read_bytes()))) for p in sorted(root.glob("*.py"))]
    return [(module, text) for module, text in found if text]


@pytest.mark.slow
def test_the_pages_tsv_source_runs_and_trains_on_the_windows_of_its_columns_bytes(tmp_path, monkeypatch):
    folders, args = page_command("## A data source")
    assert folders == [ROOT / "experiments" / "extend"]
    for folder in folders:
        monkeypatch.syspath_prepend(str(folder))
    rows = stdlib_docstrings()  # docstrings hold newlines and quotes: the csv module quotes those cells
    with (tmp_path / "docstrings.tsv").open("w", newline="", encoding="utf-8") as file:
        csv.writer(file, delimiter="\t").writerows([("module", "text"), *rows])
    done = entry([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]

    cfg = compose_cfg(args)
    assert cfg.data.name == "tsv_column.TEXT" and cfg.data.path == "docstrings.tsv"
    monkeypatch.chdir(tmp_path)
    dataset = build_dataset(cfg.data)
    # the column's cells, in file order, a blank line between two: windows of seq_len + 1 bytes every
    # seq_len, each distinct one once (the text pipeline drops repeats); the module column is not in it
    stream = "\n\n".join(text for _, text in rows).encode()
    L = cfg.data.seq_len
    windows = {stream[w * L : w * L + L + 1] for w in range((len(stream) - 1) // L)}
    examples = [dataset.get(i).astype(np.uint8).tobytes() for i in range(len(dataset))]
    assert len(set(examples)) == len(examples) and set(examples) == windows
    # the run trained on that dataset: its fingerprint (the stream's digest and order) and size
    summary = next(
        row
        for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if row["kind"] == "summary"
    )
    assert summary["data/fingerprint"] == dataset.fingerprint
    assert summary["data/samples"] == len(dataset) - cfg.data.heldout


@pytest.mark.slow
def test_the_pages_gated_conv_model_trains_its_own_parameters_split_by_its_layers(tmp_path, monkeypatch):
    """The page's model command (experiments/extend/gated_conv.py, a gated causal-convolution LM, no
    attention): (a) the stacked engine (vmap over [R, ...] parameters) = the eager loop (functional_call
    one replica at a time), each against the float64 loop, within twice the loop's own error or twice
    the fp32 floor (helpers.assert_engines_agree, references.py's derivation); (b) the run trained the
    module's own parameters, by its names, every one moved; (c) outer.fragments=2 shares out its list of
    layers, the embedding with the first layer, the final norm and head with the last."""
    folders, args = page_command("## A model")
    assert folders == [ROOT / "experiments" / "extend"]
    for folder in folders:
        monkeypatch.syspath_prepend(str(folder))
    done = entry([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    weights = torch.load(tmp_path / "run" / "weights.pt")

    import gated_conv

    cfg = compose_cfg(args)
    assert cfg.model.arch == "gated_conv.MODEL" and cfg.outer.fragments == 2
    module = gated_conv.build(cfg.model)
    assert weights.keys() == dict(module.named_parameters()).keys()  # its names, and only its
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in module.modules())
    run = prepare(cfg)
    start = initial_weights(run)
    assert all(not torch.equal(weights[n], t) for n, t in start.items()), "a parameter never trained"

    layer = [sorted(n for n in weights if n.startswith(f"layers.{i}.")) for i in range(cfg.model.n_layers)]
    first, last = members(run.cfg)
    assert sorted(first) == sorted(["emb.weight", *layer[0]])
    assert sorted(last) == sorted([*layer[1], "norm.weight", "head.weight"])

    assert_engines_agree(cfg)


def post_local_counts(updates: int, H: int, switch_at: int) -> list[int]:
    """The paper's statement (Lin et al. 2020, Section 3): mini-batch SGD (a sync after every update) up
    to t' = `switch_at`, then local SGD (a sync every H updates from t'); the phase's end syncs too."""
    return [c for c in range(1, updates + 1) if c <= switch_at or (c - switch_at) % H == 0 or c == updates]


def test_the_pages_post_local_schedule_syncs_where_the_paper_says_each_a_float64_outer_step(
    tmp_path, monkeypatch
):
    """The page's schedule command (experiments/extend/post_local.py): its sync rows are after exactly
    the counts of the paper's statement, not rounds' (every H); each sync, from the run's weights and
    the replicas' before it, is one float64 Nesterov step of their mean pseudo-gradient within the fp32
    rounding of that step (test_overlap.step_bound's derivation); the command's weights are the run's."""
    folders, args = page_command("## A schedule")
    assert folders == [ROOT / "experiments" / "extend"]
    for folder in folders:
        monkeypatch.syspath_prepend(str(folder))
    done = entry([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    import post_local

    cfg = compose_cfg(args)
    assert cfg.outer.schedule == "post_local.POST_LOCAL" and cfg.outer.fragments == 1
    updates = sum(r["kind"] == "update" for r in rows)
    want = post_local_counts(updates, cfg.inner.H, post_local.POST_LOCAL.switch_at)
    assert [r["update"] for r in rows if r["kind"] == "sync"] == want
    assert want != post_local_counts(updates, cfg.inner.H, 0)  # rounds' syncs: the check tells them apart
    assert want[: post_local.POST_LOCAL.switch_at] == [1, 2] and len(want) >= 4

    syncs, state = run_syncs(cfg)
    assert_same_weights(torch.load(tmp_path / "run" / "weights.pt"), state.theta)
    assert len(syncs) == len(want)
    names = list(state.theta)
    for before, landed, after, _ in syncs:
        assert landed == [0]
        theta, buf = _flat(before["theta"], names), _flat(before["momentum"], names)
        d = theta - torch.stack([_flat(x, names) for x in before["X"]])
        g = d.mean(0)
        new, _ = _nesterov(cfg.outer, theta, buf, g)
        bound = step_bound(cfg.outer, cfg.replicas, theta, buf, g, d)
        assert float((_flat(after["theta"], names) - new).norm()) <= bound


@pytest.mark.slow
def test_the_pages_post_local_schedule_on_both_engines_and_killed_between_syncs_resumes_bit_identically(
    tmp_path, monkeypatch
):
    """The page's schedule command: (a) the stacked engine = the eager loop, each against the float64 loop,
    within twice the loop's own error or twice the fp32 floor (helpers.assert_engines_agree); (b) killed
    (SIGKILL, a real process importing the entry from PYTHONPATH) after update 4, in local SGD's first
    round, its newest checkpoint the mid-round one at 3, the resumed run equals the uninterrupted command
    exactly: every row, the held-out losses, the summary, weights.pt."""
    folders, args = page_command("## A schedule")
    for folder in folders:
        monkeypatch.syspath_prepend(str(folder))
    assert_engines_agree(compose_cfg(args))

    reference = tmp_path / "reference"
    assert entry([*args, f"hydra.run.dir={reference}"], tmp_path).returncode == 0
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([*map(str, folders), str(ROOT)]))
    killing = [*args, "checkpoint.every_updates=3", "checkpoint.keep=10"]
    run_dir = tmp_path / "run"
    killed = entry([*killing, f"hydra.run.dir={run_dir}"], tmp_path, "0:4:kill:after")
    assert killed.returncode == KILLED, killed.stderr[-2000:]
    assert not (run_dir / "weights.pt").exists()
    resumed(killing, run_dir, tmp_path)
    resumes = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert [r["from"] for r in resumes if r["kind"] == "resume"] == [
        str(run_dir / "checkpoints" / "ckpt-u0000003.pt")
    ]
    assert_identical(run_dir, reference)
