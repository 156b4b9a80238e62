"""Every format upgrade is one step of `hypertrain.records.formats`, keyed by the schema version written
into config.yaml and every checkpoint: each step maps a minimal older file to today's form (written out
here by hand, not by the step), today's passes unchanged, and a file of a newer schema is refused in one
line, exit 2, nothing changed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helpers import entry, stderr_lines, tree
from omegaconf import OmegaConf
from record_checkpoint_fixture import FIXTURE

from hypertrain.config import BEFORE, EngineConfig, ProcessesConfig, TrainConfig, UserError, before, node_type
from hypertrain.diloco.exchange.communication import ring_allreduce_bytes
from hypertrain.records import formats
from hypertrain.records.formats import SCHEMA_VERSION, upgrade_checkpoint, upgrade_config
from hypertrain.report.runs import ReportInputError, load_run
from hypertrain.rundir import checkpoint

ABOUT = json.loads((FIXTURE / "reference.json").read_text())
NEWER = SCHEMA_VERSION + 1
# issue 39's outer fields as every run before them had them (schema 6's step, written out here)
ASYNC_NEUTRAL = {
    "schedule": "rounds",
    "async_rule": "delayed_nesterov",
    "dn_buffer": 0,
    "dn_activation": 0.0,
    "grace_s": 0.0,
    "dylu": False,
    "async_eval_every": 0,
    "mean_weights": "uniform",
}
# the same after schema 8's step: the server's fields moved into async's node, which rounds lacks
ASYNC_TODAY = {"schedule": "rounds", "arrivals": None, "mean_weights": "uniform"}
# issue 49's outer fields as every run before them had them (schema 7's step, written out here)
OPTIMIZER_NEUTRAL = {"optimizer": "nesterov", "optimizer_args": {}}
REFUSED = f"was written by a newer hypertrain (schema {NEWER}, this one reads up to {SCHEMA_VERSION}); valid:"


def rounds_today(outer: dict) -> dict:
    """`outer` of a rounds run of no codec as it reads after schema 9's step: ASYNC_NEUTRAL's fields as
    ASYNC_TODAY, no low-rank or top-k node (their fields, unread, dropped), and the codecs' shared fields
    in outer.codec at their defaults (none reads them)."""
    kept = {k: v for k, v in outer.items() if k not in ASYNC_NEUTRAL and k not in CODEC_OWN + CODEC_SHARED}
    return kept | ASYNC_TODAY | NO_CODEC_NODES | {"codec": CODEC_NEUTRAL}


def test_today_is_schema_9_and_its_files_pass_unchanged():
    assert SCHEMA_VERSION == len(formats.CONFIG_STEPS) == len(formats.CHECKPOINT_STEPS) == 9
    today = {"replicas": 2, "engine": dataclasses.asdict(EngineConfig())}
    today["processes"] = dataclasses.asdict(ProcessesConfig())
    assert upgrade_config(today) is today
    assert upgrade_config({**today, "schema_version": SCHEMA_VERSION}) == today  # config.yaml's own line
    payload = {"format": 1, "schema_version": SCHEMA_VERSION, "state": {}, "config": today}
    assert upgrade_checkpoint(payload) is payload


def test_the_unversioned_config_step_gives_todays_shape():
    """engine=dist with its process fields, before the processes group: processes=dist with them,
    layout 'stacked' read as 'replicas', every field the sections gained since at its default."""
    older = {"replicas": 2, "engine": {"name": "dist", "nproc": 2, "layout": "stacked"}}
    engine = dataclasses.asdict(EngineConfig()) | {"name": "stacked"}
    processes = dataclasses.asdict(ProcessesConfig()) | {"name": "dist", "nproc": 2, "layout": "replicas"}
    for key in ("nproc", "layout", "timeout_s", "backend"):
        engine.pop(key, None)
    assert upgrade_config(older) == {"replicas": 2, "engine": engine, "processes": processes}


def _older_payload(clock: bool) -> dict:
    """A checkpoint payload as the first checkpoints wrote it: no version, digest, run id, mid-round
    position, sync in flight, clock seconds per replica, peak or churn totals, nor measured bytes."""
    state = {
        "theta": {"w": torch.zeros(10), "b": torch.zeros(5)},
        "outer_momentum": {"w": torch.zeros(10), "b": torch.zeros(5)},
        "inner": [{}, {}, {}, {}],
        "replicas": [0, 1, 2, 3],
        "next_update": 6,
        "rounds_done": 2,
        "totals": {"tokens": 96, "replica_steps": 24, "comm_inner_bytes": 0, "comm_outer_bytes": 180},
    }
    if clock:
        state["clock"] = {"total_s": 1.5, "recent": [], "best": None}
    config = {"replicas": 4, "engine": dataclasses.asdict(EngineConfig())}  # today's (its step: above)
    config["processes"] = dataclasses.asdict(ProcessesConfig())
    return {"format": 1, "state": state, "config": config, "plan": {}, "metrics_bytes": 120}


@pytest.mark.parametrize("clock", [False, True], ids=["before-the-clock", "with-the-clock"])
def test_the_unversioned_checkpoint_step_gives_todays_payload(clock):
    older = _older_payload(clock)
    got = upgrade_checkpoint(older)
    assert "sealed" not in older and "round_first" not in older["state"]  # the older payload is left alone
    want_state = {
        **older["state"],
        "round_first": 6,  # it stopped at a round's boundary
        "round_params": None,
        "round_stepped": None,
        "pending": None,
        "errors": None,
        "clock": None,
        "in_flight": None,
        "outer_replicas": None,
        "async": None,
        "outer_optimizer": None,
        "comm_measured": {},
        "totals": {
            **older["state"]["totals"],
            "comm_outer_peak": 2 * 3 * 15 * 4 // 4,  # the whole model (15 floats) over a ring of 4
            "churn_missed": 0,
            "churn_absent": 0,
            "churn_skipped": 0,
            "churn_late": 0,
            "replica_steps_reached": 0,
            "contributed_sha256": "",
            "comm_outer_bits": None,  # what each replica sent before it is not in the checkpoint
        },
    }
    if clock:  # the next update starts a round: no replica ahead
        want_state["clock"] = {"total_s": 1.5, "recent": [], "best": None, "round": 0, "ahead": [0.0] * 4}
    want = {
        **older,
        "schema_version": SCHEMA_VERSION,
        "sealed": False,  # no digest promised: loads unchecked
        "metrics_sha256": None,
        "run_id": None,
        "wandb_run_id": None,
        "state": want_state,
    }
    assert got == want
    assert upgrade_checkpoint(got) is got


# What a run of schema 2 sent, in issue 37's fields: int32 indices, fp32 values, undecayed buffers, no
# transform, flat blocks (and the low-rank rank, which its codecs never read, at its default)
BEFORE_ISSUE_37 = {"error_decay": 1.0, "index_bits": 32, "topk_values": "fp32", "transform": "none"}
BEFORE_ISSUE_37 |= {"tile": 0, "lowrank_rank": 4}
# the same after schema 8's step in a run of another codec than low rank and top-k: their own fields
# (unread) have no node
CODEC_OWN = ("lowrank_rank", "topk_fraction", "index_bits", "topk_values")
NO_CODEC_NODES = {"lowrank": None, "topk": None}
# the fields several codecs share, in outer.codec since schema 9's step, as every run before issue 37 had
# them (and outer.block's default, 128, since compression began)
CODEC_SHARED = ("block", "tile", "transform", "error_decay")
CODEC_NEUTRAL = {"block": 128, "tile": 0, "transform": "none", "reduce": "gather", "error_decay": 1.0}
CODECS_TODAY = NO_CODEC_NODES | {"codec": CODEC_NEUTRAL}


def test_a_version_1_config_and_checkpoint_gain_no_overlap():
    """Schema 1 knew no whole-round overlap: its config reads as outer.overlap=none, its checkpoint as
    one without reductions in flight across a round and without per-replica outer state."""
    outer = {"name": "nesterov", "lr": 0.7, "fragments": 1, "delay": 0}
    # and the later steps' fields
    then = {**outer, "overlap": "none", **CODECS_TODAY, **ASYNC_TODAY, **OPTIMIZER_NEUTRAL}
    assert upgrade_config({"outer": outer, "schema_version": 1}) == {"outer": then}
    older = {**_older_payload(clock=False), "schema_version": 1}
    older["config"] = {**older["config"], "outer": outer}
    got = upgrade_checkpoint(older)
    totals = {**older["state"]["totals"], "comm_outer_bits": None}  # and schema 3's step
    want = {**older["state"], "in_flight": None, "outer_replicas": None, "totals": totals, "async": None}
    assert got["state"] == want | {"outer_optimizer": None}
    assert got["config"]["outer"] == then and got["schema_version"] == SCHEMA_VERSION


def test_a_version_2_config_and_checkpoint_send_int32_indices_fp32_values_undecayed():
    """Schema 2 knew none of issue 37's codec fields: its config reads as outer.error_decay=1.0,
    index_bits=32, topk_values=fp32, transform=none (the bytes it sent, so it resumes with them), its
    checkpoint's state unchanged (but for schema 3's step: no running bits)."""
    outer = {"compress": "topk", "topk_fraction": 0.05, "error_feedback": True, "overlap": "none"}
    want = {k: v for k, v in outer.items() if k != "topk_fraction"} | CODECS_TODAY | ASYNC_TODAY
    want |= OPTIMIZER_NEUTRAL | {"topk": {"fraction": 0.05, "index_bits": 32, "values": "fp32"}}
    assert upgrade_config({"outer": outer, "schema_version": 2}) == {"outer": want}
    older = {**_older_payload(clock=False), "schema_version": 2}
    older["config"] = {**older["config"], "outer": outer}
    got = upgrade_checkpoint(older)
    totals = {**older["state"]["totals"], "comm_outer_bits": None}
    assert got["state"] == {**older["state"], "totals": totals, "async": None, "outer_optimizer": None}
    assert got["config"]["outer"] == want
    assert got["schema_version"] == SCHEMA_VERSION


def test_a_version_3_checkpoint_has_no_running_bits_and_its_config_reads_as_it_is():
    """Schema 3 did not count each replica's outer bits: None (the resumed run's rows hold each sync's
    bits but no running total); the config of version 3 is today's (but for schema 7's step)."""
    outer = {"name": "nesterov", "lr": 0.7, "overlap": "eager", **BEFORE_ISSUE_37, **ASYNC_NEUTRAL}
    want = rounds_today(outer) | OPTIMIZER_NEUTRAL
    assert upgrade_config({"outer": outer, "schema_version": 3}) == {"outer": want}
    older = {**_older_payload(clock=False), "schema_version": 3}
    older["state"] = {**older["state"], "in_flight": None, "outer_replicas": None}
    older["config"] = {**older["config"], "outer": outer}
    got = upgrade_checkpoint(older)
    assert got["state"]["totals"] == {**older["state"]["totals"], "comm_outer_bits": None}
    assert "comm_outer_bits" not in older["state"]["totals"] and got["schema_version"] == SCHEMA_VERSION


def test_a_version_4_config_cut_windows_across_the_stream_for_every_replica_alike():
    """Schema 4 knew no prepared corpus's options: its config reads as data.window_across_documents=true
    and data.replica_split=iid (what every such run did), its checkpoint's payload as it is."""
    data = {"name": "stdlib", "examples": "windows", "seq_len": 64, "heldout": 256}
    want = {**data, "window_across_documents": True, "replica_split": "iid"}
    assert upgrade_config({"data": data, "schema_version": 4}) == {"data": want}
    assert upgrade_config({"data": want, "schema_version": 4}) == {"data": want}
    older = {**_older_payload(clock=False), "schema_version": 4}
    older["state"] = {**older["state"], "in_flight": None, "outer_replicas": None}
    older["state"]["totals"] = {**older["state"]["totals"], "comm_outer_bits": None}
    older["config"] = {**older["config"], "data": data}
    got = upgrade_checkpoint(older)
    assert got["state"] == {**older["state"], "async": None, "outer_optimizer": None}
    assert got["config"]["data"] == want
    assert got["schema_version"] == SCHEMA_VERSION


def test_a_version_5_config_synced_in_rounds_and_timed_its_own_model_and_its_checkpoint_has_no_async():
    """Schema 5 knew no asynchronous replicas: its config reads as outer.schedule=rounds with the server's
    fields neutral, no speeds and the clock on the trained model; its checkpoint holds no async state."""
    outer = {"name": "nesterov", "lr": 0.7, "momentum": 0.9}
    cluster = {"name": "cpu_here", "compute": "measured"}
    want_outer = outer | ASYNC_TODAY | OPTIMIZER_NEUTRAL | CODECS_TODAY
    want_cluster = cluster | {"replica_speeds": [], "speed_sigma": 0.0, "speed_seed": 0, "model_params": 0}
    got = upgrade_config({"outer": outer, "cluster": cluster, "schema_version": 5})
    assert got == {"outer": want_outer, "cluster": want_cluster}
    today = {"outer": want_outer, "cluster": want_cluster}
    assert upgrade_config({**today, "schema_version": 5}) == today
    older = {**_older_payload(clock=False), "schema_version": 5}
    older["state"] = {**older["state"], "in_flight": None, "outer_replicas": None}
    older["state"]["totals"] = {**older["state"]["totals"], "comm_outer_bits": None}
    got = upgrade_checkpoint(older)
    assert got["state"] == {**older["state"], "async": None, "outer_optimizer": None}
    assert got["schema_version"] == SCHEMA_VERSION


def test_a_version_6_config_stepped_with_the_built_in_and_its_checkpoint_holds_no_optimizer_state():
    """Schema 6 knew no outer optimizer but the built-in: its config reads as outer.optimizer=nesterov
    with no arguments (its outer.momentum and outer.nesterov as written), its checkpoint as one whose
    outer state is its `outer_momentum` alone (`outer_optimizer`: None)."""
    outer = {"name": "average", "lr": 1.0, "momentum": 0.0, "nesterov": False, **ASYNC_NEUTRAL}
    want = rounds_today(outer) | OPTIMIZER_NEUTRAL
    assert upgrade_config({"outer": outer, "schema_version": 6}) == {"outer": want}
    adam = outer | {"optimizer": "torch.optim.Adam", "optimizer_args": {"betas": [0.8, 0.9]}}
    assert upgrade_config({"outer": adam, "schema_version": 6}) == {"outer": rounds_today(adam)}  # as written
    older = {**_older_payload(clock=False), "schema_version": 6}
    older["state"] = {**older["state"], "in_flight": None, "outer_replicas": None, "async": None}
    older["state"]["totals"] = {**older["state"]["totals"], "comm_outer_bits": None}
    got = upgrade_checkpoint(older)
    assert got["state"] == {**older["state"], "outer_optimizer": None}
    assert "outer_optimizer" not in older["state"] and got["schema_version"] == SCHEMA_VERSION


def test_a_version_7_config_had_the_servers_fields_flat_they_move_into_asyncs_node():
    """Schema 7 held the asynchronous server's fields in `outer` itself (outer.async_rule, ...): an async
    run's move into outer.arrivals under today's names, a rounds run's (at their defaults) are dropped
    for a node it lacks (None); low rank's rank and top-k's fields likewise (outer.lowrank.rank in a
    low-rank run, outer.topk.* in a top-k run, else dropped: unread); its checkpoint's payload reads as
    it is."""
    server = {"async_rule": "naive", "dn_buffer": 3, "dn_activation": 0.25, "grace_s": 0.5, "dylu": True}
    server |= {"async_eval_every": 2}
    flat = {"name": "nesterov", "lr": 0.7, "schedule": "async", **server, "mean_weights": "tokens"}
    arrivals = {"rule": "naive", "dn_buffer": 3, "dn_activation": 0.25, "grace_s": 0.5, "dylu": True}
    arrivals |= {"eval_every": 2}
    want = {
        "name": "nesterov",
        "lr": 0.7,
        "schedule": "async",
        "mean_weights": "tokens",
        "arrivals": arrivals,
        **CODECS_TODAY,
    }
    assert upgrade_config({"outer": flat | OPTIMIZER_NEUTRAL, "schema_version": 7}) == {
        "outer": want | OPTIMIZER_NEUTRAL
    }
    rounds = {"name": "nesterov", "lr": 0.7, **ASYNC_NEUTRAL, **OPTIMIZER_NEUTRAL}
    assert upgrade_config({"outer": rounds, "schema_version": 7}) == {"outer": rounds_today(rounds)}
    lowrank = {"compress": "lowrank", "lowrank_rank": 2, **ASYNC_NEUTRAL, **OPTIMIZER_NEUTRAL}
    want = {"compress": "lowrank", "lowrank": {"rank": 2}, **ASYNC_TODAY, **OPTIMIZER_NEUTRAL, "topk": None}
    want |= {"codec": CODEC_NEUTRAL}
    assert upgrade_config({"outer": lowrank, "schema_version": 7}) == {"outer": want}
    top = {"compress": "topk", "topk_fraction": 0.25, "index_bits": 12, "topk_values": "two_bit"}
    top |= {"lowrank_rank": 4, **ASYNC_NEUTRAL, **OPTIMIZER_NEUTRAL}
    want = {"compress": "topk", "topk": {"fraction": 0.25, "index_bits": 12, "values": "two_bit"}}
    want |= {**ASYNC_TODAY, **OPTIMIZER_NEUTRAL, "lowrank": None, "codec": CODEC_NEUTRAL}
    assert upgrade_config({"outer": top, "schema_version": 7}) == {"outer": want}
    older = {**_older_payload(clock=False), "schema_version": 7}
    older["state"] = {**older["state"], "in_flight": None, "outer_replicas": None, "async": None}
    older["state"]["totals"] = {**older["state"]["totals"], "comm_outer_bits": None}
    older["state"]["outer_optimizer"] = None
    got = upgrade_checkpoint(older)
    assert got["state"] == older["state"] and got["schema_version"] == SCHEMA_VERSION


def test_a_version_8_config_had_the_codecs_shared_fields_flat_they_move_into_outer_codec():
    """Schema 8 held the fields several codecs share in `outer` itself (outer.block, tile, transform,
    reduce, error_decay): they move into outer.codec, as written where the run's codec read them (a top-k
    run's block, tile, transform and decay; an int8 run's block and two_phase reduction; a low-rank run's
    decay), at their defaults where it did not (a none run's block 64 and two_phase reduction and a
    low-rank run's block 32 were accepted and never read); today's shape (an
    outer.codec) reads as it is; a checkpoint's payload reads as it is."""
    today = {"arrivals": None, "topk": None, "lowrank": None, **OPTIMIZER_NEUTRAL}
    sparse = {"compress": "topk", "block": 16, "tile": 4, "transform": "dct", "error_decay": 0.9}
    topk = {"fraction": 0.25, "index_bits": 32, "values": "fp32"}
    want = {
        "compress": "topk",
        "codec": CODEC_NEUTRAL | {"block": 16, "tile": 4, "transform": "dct", "error_decay": 0.9},
    }
    got = upgrade_config({"outer": sparse | today | {"topk": topk}, "schema_version": 8})
    assert got == {"outer": want | today | {"topk": topk}}
    plain = {"compress": "none", "block": 64, "tile": 0, "transform": "none", "reduce": "two_phase"}
    want = {"compress": "none", "codec": CODEC_NEUTRAL}
    assert upgrade_config({"outer": plain | today, "schema_version": 8}) == {"outer": want | today}
    quantized = {"compress": "int8", "block": 64, "reduce": "two_phase"}
    want = {"compress": "int8", "codec": CODEC_NEUTRAL | {"block": 64, "reduce": "two_phase"}}
    assert upgrade_config({"outer": quantized | today, "schema_version": 8}) == {"outer": want | today}
    lowrank = {"compress": "lowrank", "block": 32, "error_decay": 0.5, "lowrank": {"rank": 2}}
    want = {"compress": "lowrank", "codec": CODEC_NEUTRAL | {"error_decay": 0.5}, "lowrank": {"rank": 2}}
    assert upgrade_config({"outer": today | lowrank, "schema_version": 8}) == {"outer": today | want}
    now = {"outer": {"compress": "int8", "codec": CODEC_NEUTRAL | {"block": 32}} | today}
    assert upgrade_config({**now, "schema_version": 8}) == now
    older = {**_older_payload(clock=False), "schema_version": 8}
    older["state"] = {**older["state"], "in_flight": None, "outer_replicas": None, "async": None}
    older["state"]["totals"] = {**older["state"]["totals"], "comm_outer_bits": None}
    older["state"]["outer_optimizer"] = None
    got = upgrade_checkpoint(older)
    assert got["state"] == older["state"] and got["schema_version"] == SCHEMA_VERSION


def test_the_peak_of_a_run_that_never_synced_is_zero_and_its_ring_is_the_communication_formula():
    older = _older_payload(clock=False)
    older["state"]["totals"]["comm_outer_bytes"] = 0
    assert upgrade_checkpoint(older)["state"]["totals"]["comm_outer_peak"] == 0
    for participants, params in ((1, 7), (2, 15), (3, 1001), (8, 123457)):
        assert formats._ring_bytes(participants, params) == ring_allreduce_bytes(participants, params)


def test_a_pending_sync_without_its_figures_gets_none():
    older = _older_payload(clock=False)
    pending = {"fragment": 0, "taken_at": 5, "stepped": [True] * 4, "mean": None, "synced": 0}
    older["state"]["pending"] = pending
    assert upgrade_checkpoint(older)["state"]["pending"] == {**pending, "figures": {}}


def test_the_fixture_checkpoint_is_unversioned_and_reads_as_today():
    saved = torch.load(FIXTURE / ABOUT["checkpoint"], map_location="cpu", weights_only=True)
    assert "schema_version" not in saved
    got = checkpoint.load(FIXTURE / ABOUT["checkpoint"])
    assert got["schema_version"] == SCHEMA_VERSION and got["sealed"] is True
    written = OmegaConf.to_container(OmegaConf.load(FIXTURE / "run" / "config.yaml"))
    assert got["config"] == upgrade_config(written)


@pytest.mark.parametrize("version", [NEWER, "1", -1, True])
def test_a_config_of_a_newer_or_unknown_schema_is_refused_in_one_line(version):
    with pytest.raises(UserError) as refused:
        upgrade_config({"replicas": 2, "schema_version": version}, what="run/config.yaml")
    (line,) = str(refused.value).splitlines()
    assert line.startswith("run/config.yaml ")
    if version == NEWER:
        assert REFUSED in line


def test_a_checkpoint_of_a_newer_schema_is_refused_in_one_line(tmp_path):
    path = checkpoint.path_for(tmp_path, 6)
    path.parent.mkdir()
    torch.save({**_older_payload(clock=False), "schema_version": NEWER}, path)
    with pytest.raises(UserError) as refused:
        checkpoint.load(path)
    (line,) = str(refused.value).splitlines()
    assert line.startswith(f"checkpoint {path} {REFUSED}")


def _fixture_run(tmp_path, newer: str):
    """A copy of the fixture's run whose checkpoint or config.yaml says it is of a newer schema."""
    run_dir = shutil.copytree(FIXTURE / "run", tmp_path / "run")
    if newer == "checkpoint":
        (path,) = checkpoint.checkpoints(run_dir)
        torch.save({**torch.load(path, weights_only=True), "schema_version": NEWER}, path)
        checkpoint.seal(path)
    else:  # stopped before its first checkpoint: resume=auto compares its config.yaml
        shutil.rmtree(run_dir / checkpoint.FOLDER)
        written = run_dir / "config.yaml"
        written.write_text(f"schema_version: {NEWER}\n{written.read_text()}")
    return run_dir


@pytest.mark.parametrize("newer", ["checkpoint", "config"])
def test_resuming_a_newer_schemas_run_is_refused_in_one_line_with_nothing_changed(tmp_path, newer):
    run_dir = _fixture_run(tmp_path, newer)
    before = tree(tmp_path)
    resume = "resume=true" if newer == "checkpoint" else "resume=auto"
    done = entry([*ABOUT["args"], f"hydra.run.dir={run_dir}", resume], tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = stderr_lines(done.stderr)
    assert REFUSED in line, line
    assert tree(tmp_path) == before
    if newer == "config":
        with pytest.raises(ReportInputError, match="was written by a newer hypertrain"):
            load_run(run_dir)


def test_a_run_writes_its_schema_into_config_yaml_and_its_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    args = [a for a in ABOUT["args"] if not a.startswith(("churn", "outer.", "phase.updates"))]
    args += ["phase.updates=4", "checkpoint.every_updates=2", f"hydra.run.dir={run_dir}"]
    done = entry(args, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (run_dir / "config.yaml").read_text().startswith(f"schema_version: {SCHEMA_VERSION}\n")
    assert checkpoint.checkpoints(run_dir)
    for path in checkpoint.checkpoints(run_dir):
        saved = torch.load(path, map_location="cpu", weights_only=True)  # builtins and tensors only
        assert saved["schema_version"] == SCHEMA_VERSION
        assert checkpoint.load(path) is not None


# -- fields added since: their value before they existed ---------------------------------------------

FIELDS_THEN = Path(__file__).parent / "assets" / "config_fields_schema7.txt"


def config_fields(schema: type, prefix: str = ""):
    """Every field of the config as (dotted name, its dataclass field), sections and nodes walked."""
    for f in dataclasses.fields(schema):
        yield prefix + f.name, f
        kind = node_type(schema, f)
        if kind is not None:
            yield from config_fields(kind, f"{prefix}{f.name}.")


def test_every_field_added_since_schema_7_declares_its_value_before_it_existed():
    """A field not in the list of schema 7's fields carries `before` (config.before), so an older run's
    config upgrades to what that run did (formats.fill_before) with no hand-written step, or is where
    a field of then moved (formats.RETIRED: its value is the old field's); a field of then that is gone
    moved."""
    then = {line for line in FIELDS_THEN.read_text().splitlines() if line and not line.startswith("#")}
    fields = dict(config_fields(TrainConfig))
    gone = then - fields.keys()
    assert gone == set(formats.RETIRED), f"fields of schema 7 gone, not moved: {sorted(gone)}"
    assert set(formats.RETIRED.values()) <= fields.keys()
    moved = set(formats.RETIRED.values())
    undeclared = [n for n, f in fields.items() if n not in then | moved and BEFORE not in f.metadata]
    assert undeclared == [], f"new config fields without before=...: {undeclared}"


@dataclass
class _Node:
    old: int = 1
    added: float = field(default=0.5, metadata=before(0.0))


@dataclass
class _Section:
    kept: str = "a"
    mode: str = field(default="new", metadata=before("old"))
    node: _Node = field(default_factory=_Node)
    maybe: _Node | None = field(default=None, metadata=before(None))


def test_a_config_lacking_a_declared_field_gets_its_value_before_not_todays_default():
    """The rule, on a section of its own (the scan above finds one without `before`): a missing field is
    filled with `before` (not the default), in a node too; a field present is kept; a config lacking
    nothing is the same object."""
    older = {"kept": "b", "node": {"old": 3}}
    assert formats.fill_before(older, _Section) == {
        "kept": "b",
        "node": {"old": 3, "added": 0.0},
        "mode": "old",
        "maybe": None,
    }
    today = {"kept": "a", "mode": "new", "node": {"old": 1, "added": 0.5}, "maybe": None}
    assert formats.fill_before(today, _Section) is today
    assert formats.fill_before({**today, "maybe": {"old": 2}}, _Section)["maybe"] == {"old": 2, "added": 0.0}
