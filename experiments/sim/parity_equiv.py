"""engine=loop against engine=stacked on the same plan: per-replica losses and final global weights.

Runs the trainer's rounds (`prepare`, `assignments`, the engine, `sync`) with both engines for
AdamW and Muon, R in (1, 3, 8), H in (1, 5), several sub-round sizes (`engine.stack`), a tail
update in which some replicas get no ids, a grouped-query model, variable-length documents and
the bf16 modes. Prints, per case, the max relative difference of the per-replica losses over every
step (|a - b| / |a|) and of the final global weights (per tensor ||a - b|| / ||a||, then the max
over tensors; the stricter max |a - b| / max |a| is printed for information), and exits 1 when one
is past its tolerance (fp32 1e-5; bf16 NS 1e-3; bf16
autocast 1e-2; see docs/parity.md).

    .venv/bin/python experiments/sim/parity_equiv.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import numpy as np
import torch

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
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.engines import loop, stacked
from hypertrain.preflight.checks import validate
from hypertrain.preflight.prepare import initial_weights, prepare

TOLERANCE = {"fp32": 1e-5, "bf16-ns": 1e-3, "bf16-autocast": 1e-2}


def run_rounds(cfg: TrainConfig, engine) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """Losses [updates, R] (NaN = skipped) and the final global weights of the trainer's rounds."""
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    theta = state.theta
    losses = []
    for rnd in rounds(run, state, engine):
        steps = zip(*(r.losses for r in rnd.results), strict=True)
        losses += [[np.nan if x is None else x for x in step] for step in steps]
    return np.array(losses), theta


def base_cfg(R: int, H: int, optimizer: str) -> TrainConfig:
    cfg = TrainConfig(
        model=ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4),
        inner=InnerConfig(name=optimizer, H=H, lr=3e-3, warmup_steps=3, micro_batch=2),
        phase=PhaseConfig(name="parity", kind="strong", global_batch=24, updates=2 * H, timing_warmup=0),
        world=WorldConfig(size=24),
        data=DataConfig(seq_len=32, heldout=64),
        logger=LoggerConfig(name="none", progress="never"),
        replicas=R,
    )
    validate(cfg)
    return cfg


def cases(quick: bool):
    """(label, config, tolerance key, sub-round sizes)."""
    Rs, Hs = ((1, 3), (1, 3)) if quick else ((1, 3, 8), (1, 5))
    for optimizer in ("adamw", "muon"):
        for R in Rs:
            for H in Hs:
                stacks = sorted({0, 1, 2, R // 2 + 1} & set(range(R + 1))) if R > 1 else [0]
                yield f"{optimizer} R={R} H={H}", base_cfg(R, H, optimizer), "fp32", stacks
    muon = base_cfg(3 if quick else 8, 3, "muon")
    yield "muon bf16 NS", replace(muon, inner=replace(muon.inner, ns_dtype="bf16")), "bf16-ns", [0, 2]
    bf16 = replace(muon, model=replace(muon.model, compute_dtype="bf16"))
    yield "muon bf16 autocast", bf16, "bf16-autocast", [0, 2]
    gqa = replace(muon, model=replace(muon.model, n_heads=4, n_kv_heads=1))
    yield "muon GQA 4q/1kv", gqa, "fp32", [0, 2]
    docs = DataConfig(examples="documents", max_len=128, max_examples=4, max_padded_tokens=256, heldout=64)
    yield "adamw documents", replace(base_cfg(3, 3, "adamw"), data=docs), "fp32", [0, 2]
    for optimizer, policy in (("adamw", "reset"), ("muon", "average")):
        cfg = base_cfg(3, 3, optimizer)
        inner = replace(cfg.inner, state_policy=policy, rewarmup_steps=2)
        yield f"{optimizer} {policy} + re-warmup", replace(cfg, inner=inner), "fp32", [0, 2]
    # A tail: the stream ends 5 ids into update 1, so 3 of 8 replicas (1 of 3 in quick) get no ids.
    for optimizer in ("adamw", "muon"):
        cfg = base_cfg(3 if quick else 8, 2, optimizer)
        samples = prepare(cfg).samples
        tail = replace(cfg.phase, offset=samples - 24 - (2 if quick else 5), updates=2)
        yield f"{optimizer} tail update", replace(cfg, phase=tail), "fp32", [0, 2]


def relative(a: np.ndarray, b: np.ndarray) -> float:
    both = ~np.isnan(a)
    if not np.array_equal(both, ~np.isnan(b)):
        return float("inf")  # the engines disagree on which replicas stepped
    return float(np.max(np.abs(a[both] - b[both]) / np.abs(a[both]), initial=0.0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="R in (1, 3), H in (1, 3)")
    args = parser.parse_args()
    torch.manual_seed(0)
    failed = 0
    print(
        f"{'case':<28} {'stack':>5} {'tol':>7} {'loss rel':>10} {'weight rel':>10} {'w max rel':>10} "
        f"{'bitwise':>7}"
    )
    start = time.perf_counter()
    for label, cfg, tol_key, stacks in cases(args.quick):
        ref_losses, ref_theta = run_rounds(cfg, loop.train_replicas)
        for stack in stacks:
            losses, theta = run_rounds(
                replace(cfg, engine=EngineConfig(name="stacked", stack=stack)), stacked.train_replicas
            )
            loss_rel = relative(ref_losses, losses)
            weight_rel = max(float((theta[n] - t).norm() / t.norm()) for n, t in ref_theta.items())
            weight_max = max(float((theta[n] - t).abs().max() / t.abs().max()) for n, t in ref_theta.items())
            bitwise = np.array_equal(ref_losses, losses, equal_nan=True) and all(
                torch.equal(theta[n], t) for n, t in ref_theta.items()
            )
            tol = TOLERANCE[tol_key]
            ok = loss_rel <= tol and weight_rel <= tol
            failed += not ok
            print(
                f"{label:<28} {stack:>5} {tol:>7.0e} {loss_rel:>10.2e} {weight_rel:>10.2e} "
                f"{weight_max:>10.2e} "
                f"{'yes' if bitwise else 'no':>7}{'' if ok else '  FAIL'}"
            )
    print(
        f"{'FAIL' if failed else 'PASS'}: {failed} case(s) past tolerance, "
        f"{time.perf_counter() - start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
