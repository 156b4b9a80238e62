"""Every scheme with model=hf (issue 50): the schemes are the sync's, not the model's, so an HF Llama goes
through each of them as the own decoder does. Real processes against the simulation exactly (the codecs,
fragments with a delay and churn: test_compression's and test_dist's comparisons, reused with
`model=hf_llama_tiny`); eager overlap loop = stacked within test_overlap's rounding bound; asynchronous
replicas and churn to the end with RUN/hf written.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers import RUN, entry, read_metrics
from references import U32

from hypertrain.report import cli as report

transformers = pytest.importorskip("transformers")

HF = "model=hf_llama_tiny"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, extra",
    [
        ("hf-int8-ef", ["outer.compress=int8", "outer.error_feedback=true"]),
        (
            "hf-int8-fragments2-delay1",
            ["outer.compress=int8", "inner.H=4", "phase.updates=8"] + ["outer.fragments=2", "outer.delay=1"],
        ),
    ],
)
def test_real_processes_equal_the_simulation_exactly_with_a_codec(tmp_path, monkeypatch, name, extra):
    """processes=dist world=2 replicas=2 (one replica a process, the loop engine in both) against the
    simulation, exactly: every row, the held-out losses, the summary and weights.pt (test_compression's
    WHOLE explains why exact: the same module code on the same numbers, the codec exact on equal inputs)."""
    import test_compression

    monkeypatch.setitem(test_compression.WHOLE_CASES, name, [HF, *extra])
    test_compression.test_real_processes_equal_the_simulation_exactly_with_compression(tmp_path, name)


def test_eager_overlap_loop_equals_stacked():
    """Eager overlap (each replica its own outer optimizer), two fragments, int8: the loop engine
    (functional_call per replica) and the stacked one (vmap) within test_overlap's bound, 4 roundings per
    inner step and sync on each of the 2 * updates + 8 steps a weight takes."""
    import test_overlap
    from test_hf import CONFIGS

    from hypertrain.config import ModelConfig

    def hf(cfg):
        model = ModelConfig(name="hf", arch="hf", vocab=0, config=CONFIGS["llama"])
        return replace(cfg, model=model)

    a, sa = test_overlap.run_syncs(hf(test_overlap.overlap_cfg("eager", 2, "int8", engine="loop")))
    b, sb = test_overlap.run_syncs(hf(test_overlap.overlap_cfg("eager", 2, "int8", engine="stacked")))
    assert [n for n, _ in sa.theta.items()] == [n for n, _ in sb.theta.items()]
    assert any(n.startswith("model.layers.") for n in sb.theta)  # the HF module's own names
    updates = 8
    for n, t in sb.theta.items():
        bound = 4 * (2 * updates + 8) * U32 * float(t.norm())
        assert float((sa.theta[n].double() - t.double()).norm()) <= bound, n


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        [
            "outer.schedule=async",
            "cluster=h100",
            "cluster.replica_speeds=[1.0,2.0]",
            "outer.arrivals.rule=naive",
        ],
        ["churn.events=[2:1:leave,3:1:rejoin]", "outer.merge_alpha=0.5", "outer.mean_weights=tokens"],
    ],
    ids=["async", "churn-tokens"],
)
def test_asynchronous_replicas_and_churn_run_to_the_end(tmp_path, extra):
    """The asynchronous server (its clock's modelled compute) and churn with an HF Llama: the run
    finishes, every loss it records is finite (an update row's per replica, an arrival's), RUN/hf holds
    the final global weights (those of weights.pt, bitwise), the summary counts the module's parameters
    and the report reads the run."""
    run = [*RUN, HF, "replicas=2", "world=2", "inner.H=2", "phase.updates=8", *extra]
    done = entry([*run, f"hydra.run.dir={tmp_path}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] in ("update", "arrival")]
    losses = [x for r in rows for x in (r.get("losses") or r.get("loss") or []) if x is not None]
    assert len(rows) >= 4 and losses and all(math.isfinite(x) for x in losses), rows
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for n, t in weights.items():
        assert torch.equal(exported[n], t), n
    # the clock's modelled compute counts the module's own parameters (tied ones once), and the report
    # reads the run
    summary = next(r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "summary")
    module = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert summary["model/params"] == sum(p.numel() for p in module.parameters())
    assert report.main([str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.md").is_file()
