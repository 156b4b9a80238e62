"""docs/extending.md's worked example: an outer optimizer that lives outside the package
(experiments/extend/sign_momentum.py, Signum: Bernstein et al. 2018, arXiv:1802.04434, Algorithm 3),
run by the command line the page gives, through the entry.

The command is read from the page and run in this process (its module put on sys.path as the page's
PYTHONPATH puts it); the same config is then trained again with every sync's weights recorded
(`test_overlap.run_syncs`), its final weights the command's own, bitwise. Every sync is one step of a
float64 Signum written here, its momentum kept from the first sync on.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import torch
from helpers import compose_cfg, entry
from references import U32
from test_overlap import _flat, run_syncs

from hypertrain.diloco.fragments import members

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending.md"
ENTRY = ["python", "-m", "hypertrain.train"]


def page_command() -> tuple[list[str], list[str]]:
    """The page's command line: the folders its PYTHONPATH puts first (the repository's), its arguments."""
    lines = [line.strip() for line in PAGE.read_text().splitlines() if line.startswith("    PYTHONPATH=")]
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
