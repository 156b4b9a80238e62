"""Bits on every record (issue 37, item 5): each sync row holds the bits per parameter each replica's
contribution sent (fp32: 32; a codec: 8 * (its payload + a message header per message) / params, the
payload sized here by `codecs.payload_size`, not read from the run) and each replica's running total,
which a checkpoint carries (a killed and resumed run's totals equal the uninterrupted run's); the
summary's `comm/outer_total_bits`; old rows get their bits from their bytes; and the report's Pareto
table lists exactly the runs no other run beats.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import BASE, QUICK, entry, killed_beside_uninterrupted, resumed, run_losses, small_cfg
from matplotlib.image import imread
from omegaconf import OmegaConf
from references import templar_chunks, templar_k

from hypertrain.codecs import kernels as codecs
from hypertrain.config import ChurnConfig, CodecConfig, OuterConfig, TopKConfig
from hypertrain.diloco.exchange.communication import HEADER_BYTES, contribution_bits
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.records import formats
from hypertrain.records.rows import SyncRow
from hypertrain.report import cli
from hypertrain.report.bits import RECORDED, SUMMED, pareto_front, run_bits
from hypertrain.report.runs import load_run
from hypertrain.rundir.records import read_metrics

REPO = Path(__file__).resolve().parents[1]
MISS = ChurnConfig(events=["1:1:miss"])  # replica 1's pseudo-gradient of round 1 is discarded


def _sizes(cfg) -> tuple[int, ...]:
    """Each parameter's element count, in the order the sync flattens them (the weights' own)."""
    return tuple(t.numel() for t in initial_weights(prepare(cfg)).values())


def _syncs(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["kind"] == "sync"]


CASES = {  # name: the outer config, and the bits of one replica's contribution from the parameters' sizes
    "fp32": (OuterConfig(), lambda sizes, R, block: 32 * sum(sizes)),
    "int8-gather": (
        OuterConfig(compress="int8"),
        lambda sizes, R, block: 8 * (codecs.payload_size("int8", codecs.Blocks(sizes, block)) + HEADER_BYTES),
    ),
    "topk-12-bit-two-bit": (  # SparseLoCo's packing: the bits follow the payload the codec packs
        OuterConfig(compress="topk", topk=TopKConfig(fraction=0.0625, index_bits=12, values="two_bit")),
        lambda sizes, R, block: (
            8
            * (
                codecs.payload_size("topk", codecs.Blocks(sizes, block), codecs.TopK(0.0625, 12, "two_bit"))
                + HEADER_BYTES
            )
        ),
    ),
    "fp4-two-phase": (  # one message per shard, each its own header
        OuterConfig(compress="fp4_e2m1", codec=CodecConfig(reduce="two_phase")),
        lambda sizes, R, block: (
            8
            * sum(
                codecs.payload_size("fp4_e2m1", own) + HEADER_BYTES
                for _, _, own in codecs.Blocks(sizes, block).shards(R)
            )
        ),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_syncs_bits_per_parameter_are_its_contributions_wire_bytes_over_its_parameters(tmp_path, case):
    outer, expected = CASES[case]
    cfg = small_cfg(outer=outer, churn=MISS)
    sizes, R = _sizes(cfg), cfg.replicas
    sent = expected(sizes, R, cfg.outer.codec.block)
    rows = run_losses(cfg, tmp_path)
    syncs = _syncs(rows)
    assert len(syncs) == 2 and all(r["params"] == sum(sizes) for r in syncs)
    want = sent / sum(sizes)
    if case == "fp32":
        assert want == 32.0
    # round 1: replica 1 missed (it took no part: null); round 2: both took part
    assert syncs[0]["bits_per_param"] == [want, None] and syncs[0]["contributors"] == [0]
    assert syncs[1]["bits_per_param"] == [want, want]
    # the running totals are the rows' bits summed (bits per parameter * parameters, whole bits)
    total = [0] * R
    for row in syncs:
        total = [
            t + round((x or 0) * row["params"]) for t, x in zip(total, row["bits_per_param"], strict=True)
        ]
        assert row["bits_total"] == total
    summary = [r for r in rows if r["kind"] == "summary" and "comm/outer_total_bits" in r]
    assert [(s["comm/outer_total_bits"], s["comm/outer_replica_bits"]) for s in summary] == [
        (max(total), total)
    ]
    assert total == [2 * sent, sent]


def test_the_sparseloco_presets_bits_are_templars_bytes(tmp_path):
    """Issue 48 item 7: `outer=sparseloco`'s bits per parameter follow templar's chunks and counts
    (tests/references.py, not the codec's sizes): per tensor a 20-byte two_bit header, per chunk
    ceil(k / 4) bytes of 2-bit values and ceil(3k / 2) of 12-bit indices, k = `templar_k`(64, its length)
    (the 32-wide test model: its norms of 32 whole, its 32 x 96 FFN in 32 x 48 chunks), and the message's
    8-byte header; both replicas at both syncs."""
    preset = OmegaConf.merge(OuterConfig, OmegaConf.load(REPO / "conf/outer/sparseloco.yaml"))
    cfg = small_cfg(outer=OmegaConf.to_object(preset))  # typed: its node outer.topk a TopKConfig
    shapes = [tuple(t.shape) for t in initial_weights(prepare(cfg)).values()]
    k = math.ceil(cfg.outer.topk.fraction * cfg.outer.codec.tile**2)
    counts = [templar_k(k, len(c)) for s in shapes for c in templar_chunks(s, cfg.outer.codec.tile)]
    payload = 20 * len(shapes) + sum(math.ceil(c / 4) + math.ceil(3 * c / 2) for c in counts)
    params = sum(math.prod(s) for s in shapes)
    syncs = _syncs(run_losses(cfg, tmp_path))
    assert [r["bits_per_param"] for r in syncs] == [[8 * (payload + HEADER_BYTES) / params] * 2] * 2


def test_one_replica_sends_no_bits():
    assert contribution_bits("none", "gather", 1, 1000, None) == 0
    assert contribution_bits("int8", "gather", 1, 1000, 1004) == 0


def test_the_records_layers_bits_formula_is_the_communication_layers():
    # formats cannot import diloco; its copy of the formula must agree
    assert formats.HEADER_BYTES == HEADER_BYTES
    for compress, reduce, R, payload in [("none", "gather", 3, None), ("int8", "gather", 2, 77),
                                         ("int8", "two_phase", 4, 77), ("topk", "gather", 1, 5)]:  # fmt: skip
        outer = {"compress": compress, "reduce": reduce}
        assert formats._contribution_bits(outer, R, 1000, payload) == contribution_bits(
            compress, reduce, R, 1000, payload
        )


RESUMED = [*BASE, "checkpoint.every=1", "outer.compress=int8", "churn.events=[3:0:miss]"]


def test_a_killed_run_resumed_keeps_its_bit_totals_identical(tmp_path):
    """Killed at update 7 (after the checkpoint of update 6), resumed: every sync row's bits and running
    totals and the summary's totals equal the uninterrupted run's."""
    run_dir, reference = killed_beside_uninterrupted(RESUMED, tmp_path, "0:7:kill")
    resumed(RESUMED, run_dir, tmp_path)
    got, want = read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    keys = ("update", "bits_per_param", "bits_total")
    assert [[r.get(k) for k in keys] for r in _syncs(got)] == [[r.get(k) for k in keys] for r in _syncs(want)]
    rows = _syncs(want)
    assert len(rows) == 4 and rows[2]["bits_per_param"][0] is None  # round 3: replica 0 missed
    assert rows[-1]["bits_total"][0] < rows[-1]["bits_total"][1]

    def totals(rows):
        return [
            (r["comm/outer_total_bits"], r["comm/outer_replica_bits"])
            for r in rows
            if "comm/outer_total_bits" in r
        ]

    assert totals(got)[-1] == totals(want)[-1] == (rows[-1]["bits_total"][1], rows[-1]["bits_total"])


def _old(row: dict) -> dict:
    """A sync row as written before it held its bits."""
    return {k: v for k, v in row.items() if k not in ("bits_per_param", "bits_total")}


@pytest.mark.parametrize("case", ["fp32", "int8-gather"])
def test_rows_written_before_their_bits_get_them_from_their_bytes(tmp_path, case):
    outer, _ = CASES[case]
    cfg = small_cfg(outer=outer, churn=MISS)
    rows = _syncs(run_losses(cfg, tmp_path))
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg))
    upgraded = formats.sync_bits([SyncRow.from_json(_old(r)) for r in rows], resolved)
    assert [r.to_json() for r in upgraded] == [SyncRow.from_json(r).to_json() for r in rows]
    assert (
        formats.sync_bits([SyncRow.from_json(r) for r in rows], resolved)[0].bits_total
        == rows[0]["bits_total"]
    )


def test_an_fp32_row_that_does_not_say_who_took_part_gets_no_bits_and_stops_the_total():
    resolved = {"replicas": 2, "outer": {"compress": "none", "reduce": "gather"}}
    rows = [
        SyncRow(update=2, round=1, taken_at=2, params=10, replicas_synced=2, comm_outer_bytes=40),
        SyncRow(update=4, round=2, taken_at=4, params=10, replicas_synced=1, comm_outer_bytes=40),
        SyncRow(update=6, round=3, taken_at=6, params=10, replicas_synced=2, comm_outer_bytes=40),
    ]
    got = formats.sync_bits(rows, resolved)
    assert [r.bits_per_param for r in got] == [[32.0, 32.0], None, [32.0, 32.0]]
    assert [r.bits_total for r in got] == [[320, 320], None, None]


FRONT = {  # name: final held-out loss, bits; a, b, c are on the front, the rest are beaten
    "a": (3.0, 100),
    "b": (2.5, 400),
    "c": (2.0, 1600),
    "beaten-by-b": (2.6, 800),  # b: lower loss and fewer bits
    "tied-loss-more-bits": (3.0, 200),  # a: the same loss with fewer bits
    "tied-bits-worse-loss": (2.2, 1600),  # c: the same bits with a lower loss
}


def test_the_pareto_front_holds_exactly_the_runs_no_other_run_beats():
    on = dict(zip(FRONT, pareto_front(list(FRONT.values())), strict=True))
    assert {name for name, front in on.items() if front} == {"a", "b", "c"}
    assert pareto_front([(1.0, 5), (1.0, 5)]) == [True, True]  # equal runs: neither beats the other


def _hand_run(path, loss: float, bits: int | None) -> None:
    """A finished run's files, written by hand as a run writes them (R = 2, one sync): its final held-out
    loss `loss` and, in its summary, `bits` (None: a run written before the bits, whose fp32 sync row says
    its parameters and that both replicas took part)."""
    path.mkdir(parents=True)
    (path / "plan.json").write_text(json.dumps({"plan/check": "PASS", "plan/updates_run": 1}))
    config = {"experiment": "hand", "replicas": 2, "world": {"size": 2}, "phase": {"name": "p"},
              "inner": {"H": 1}, "outer": {"compress": "none", "fragments": 1, "delay": 0}}  # fmt: skip
    (path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    summary = {"kind": "summary", "model/params": 10} | (
        {} if bits is None else {"comm/outer_total_bits": bits}
    )
    rows = [
        {"kind": "start", "time": 0.0, "replicas": 2},
        {"kind": "eval", "update": 0, "round": 0, "eval_loss": 5.5},
        {"kind": "update", "update": 1, "round": 1, "loss": [5.0, 5.0], "tokens": 64, "wall": 0.5}
        | {"rank_seconds": [0.1, 0.1], "loss_mean": 5.0},
        {
            "kind": "sync",
            "update": 1,
            "round": 1,
            "eval_loss": loss,
            "replicas_synced": 2,
            "comm_inner_total": 0,
        }
        | {"comm_outer_total": 40, "comm_inner_bytes": 0, "comm_outer_bytes": 40},
        summary,
        {"kind": "end", "time": 1.0, "status": "finished"},
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_report_lists_the_front_and_leaves_the_beaten_runs_out(tmp_path):
    runs = tmp_path / "runs"
    for name, (loss, bits) in FRONT.items():
        _hand_run(runs / name, loss, bits)
    _hand_run(runs / "old", 2.9, None)  # its 320 bits (32 * 10 per replica) summed from its row: beats a
    assert cli.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "report.json").read_text())
    bits = {b["run"]: (b["outer_bits"], b["bits_source"], b["pareto"]) for b in record["bits"]}
    assert bits["old"] == (320, SUMMED, True) and bits["a"] == (100, RECORDED, True)
    assert {name for name, (_, _, on) in bits.items() if on} == {"a", "b", "c", "old"}
    page = (tmp_path / "out" / "report.md").read_text()
    table = page[page.index("## Held-out loss against outer bits") :].split("\n\n")[2].splitlines()[2:]
    assert [line.split("|")[1].strip() for line in table] == ["a", "old", "b", "c"]  # fewest bits first
    assert not any(name in "".join(table) for name in ("beaten-by-b", "tied-loss-more-bits", "tied-bits"))
    (plot,) = [p for p in record["plots"] if p["file"] == "heldout-bits.png"]
    assert imread(tmp_path / "out" / plot["file"]).shape[:2] == (plot["height"], plot["width"])
    assert set(plot["series"]) == {*FRONT, "old", "Pareto front"}  # every run placed, one point each


def test_a_run_of_today_reads_its_recorded_total(tmp_path):
    run_dir = tmp_path / "run"
    done = entry([*QUICK, "logger=none", "phase.updates=6", f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr
    run = load_run(run_dir)
    total, source = run_bits(run)
    syncs = run.of_kind("sync")
    assert source == RECORDED and total == max(syncs[-1].bits_total)
    assert total == sum(round(32 * r.params) for r in syncs) and math.isclose(total / syncs[0].params, 64)


REAL = [
    *QUICK,
    "logger=none",
    "world=4",
    "replicas=4",
    "inner.H=2",
    "phase.updates=4",
    "churn.events=[1:1:miss]",
]


def test_real_processes_record_the_simulations_bits(tmp_path):
    """fp32 with replica 1 missing round 1: under 2 processes of 2 replicas its flag comes from process 0
    alone (the sum holds only the count), yet every row names the same replicas as the simulation."""
    rows = {}
    for name, extra in (("simulation", []), ("processes", ["processes=dist", "processes.nproc=2"])):
        done = entry([*REAL, *extra, f"hydra.run.dir={tmp_path / name}"], tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        rows[name] = [
            (r["bits_per_param"], r["bits_total"])
            for r in _syncs(read_metrics(tmp_path / name / "metrics.jsonl"))
        ]
    assert rows["processes"] == rows["simulation"]
    assert rows["simulation"][0][0] == [32.0, None, 32.0, 32.0]
