"""Every upgrade of what a run writes and reads back later, in one place, keyed by `SCHEMA_VERSION`:
the resolved config (config.yaml, a checkpoint's `config`), a checkpoint's payload, a sync row written
before it held its take and size, sync rows written before they held their bits, and the command
line's older spellings. A file of a newer schema
than this code reads is refused in one line.

`SCHEMA_VERSION` is written into config.yaml (`schema_version: N`, its first line) and every
checkpoint payload (`"schema_version": N`, an int: the payload stays builtins and tensors). Version 0
is everything written before versions were: its step finds each older change by the fields a file
lacks, so it also reads a file of any shape since, unchanged. `CONFIG_STEPS[k]` and
`CHECKPOINT_STEPS[k]` take a file from version k to k + 1; a file of version v gets steps v, v + 1,
... A change to what a run writes adds a step here and raises `SCHEMA_VERSION` by one. The upgraded
config carries no version: it is compared key by key with the config a run resolves today.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypertrain.codec_table import codec_entry
from hypertrain.config import (
    BEFORE,
    ChurnConfig,
    ClusterConfig,
    CodecConfig,
    ProcessesConfig,
    TrainConfig,
    UserError,
    as_builtins,
    node_type,
    nodes_chosen,
)
from hypertrain.records.rows import SyncRow

SCHEMA_VERSION = 9
VERSION_KEY = "schema_version"


class NewerSchema(UserError):
    """A file a newer hypertrain wrote: readable, not corrupt, so never passed over for an older one."""


def version_of(written: dict, what: str) -> int:
    """The schema version of `written` (a config or a checkpoint payload; 0 without one); UserError
    (one line) when it is not one this code reads."""
    version = written.get(VERSION_KEY, 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise UserError(
            f"{what} has schema_version={version!r}; valid: an int from 0 to {SCHEMA_VERSION}, as hypertrain "
            "writes it"
        )
    if version > SCHEMA_VERSION:
        raise NewerSchema(
            f"{what} was written by a newer hypertrain (schema {version}, this one reads up to "
            f"{SCHEMA_VERSION}); valid: read it with that hypertrain or a newer one, or start a new run"
        )
    return version


def config_yaml(text: str) -> str:
    """config.yaml's text: the resolved config's YAML (`text`) under its schema version."""
    return f"{VERSION_KEY}: {SCHEMA_VERSION}\n{text}"


# -- the resolved config --------------------------------------------------------------------------

OLD_PROCESS_FIELDS = ("nproc", "layout", "timeout_s", "backend")  # engine.* before processes had a group


def _config_0_to_1(resolved: dict) -> dict:
    """Unversioned: a config written before a section's newer fields (streaming, compression, restarts,
    experts: given their neutral defaults), before the cluster (the default one, cpu_here, which the
    clock of such a run replays on) or churn (none), or before the processes had their own group, in
    today's shape: engine=dist is processes=dist with engine=stacked, engine.nproc, layout, timeout_s
    and backend are processes.*, layout 'stacked' is 'replicas'. Today's is returned as it is."""
    if "outer" in resolved:  # sections added since, at their defaults (which change nothing)
        for name, section in (("cluster", ClusterConfig), ("churn", ChurnConfig)):
            if name not in resolved:
                resolved = {**resolved, name: as_builtins(section())}
    neutral = TrainConfig()
    for f in dataclasses.fields(TrainConfig):  # fields added to a section since: their neutral settings
        section, default = resolved.get(f.name), getattr(neutral, f.name)
        if isinstance(section, dict) and dataclasses.is_dataclass(default):
            declared = {g.name for g in dataclasses.fields(default) if BEFORE in g.metadata}  # fill_before's
            missing = {
                k: v for k, v in as_builtins(default).items() if k not in section and k not in declared
            }
            if missing:
                resolved = {**resolved, f.name: section | missing}
    engine = resolved.get("engine")
    if "processes" in resolved or not isinstance(engine, dict):
        return resolved
    engine = dict(engine)
    processes = {"name": "dist" if engine.get("name") == "dist" else "one"}
    for key in OLD_PROCESS_FIELDS:
        if key in engine:
            processes[key] = engine.pop(key)
    if processes.get("layout") == "stacked":
        processes["layout"] = "replicas"
    if engine.get("name") == "dist":
        engine["name"] = "stacked"
    defaults = as_builtins(ProcessesConfig())
    return {**resolved, "engine": engine, "processes": defaults | processes}


def _config_1_to_2(resolved: dict) -> dict:
    """Version 1: before the whole-round overlap (`outer.overlap`, none: the sync of then)."""
    outer = resolved.get("outer")
    if isinstance(outer, dict) and "overlap" not in outer:
        resolved = {**resolved, "outer": {**outer, "overlap": "none"}}
    return resolved


# The codecs' fields of issue 37: the settings that send what such a run sent (int32 indices, fp32 values,
# undecayed buffers, no transform, flat blocks; the low-rank rank, unread by its codecs, at its default),
# whatever today's defaults are
BEFORE_ISSUE_37 = {
    "error_decay": 1.0,
    "index_bits": 32,
    "topk_values": "fp32",
    "transform": "none",
    "tile": 0,
    "lowrank_rank": 4,
}


def _lacks(section: dict, before: dict, name: str = "outer") -> dict:
    """The fields of `before` that `section` (the config's `name`) lacks, at their values there; a field
    since moved into a node the section holds (`RETIRED`: today's shape, read as version 0) it has."""

    def moved(key: str) -> bool:
        new = RETIRED.get(f"{name}.{key}")
        return new is not None and new.split(".")[1] in section

    return {key: value for key, value in before.items() if key not in section and not moved(key)}


def _config_2_to_3(resolved: dict) -> dict:
    """Version 2: before issue 37's codec fields (`outer.error_decay`, `index_bits`, `topk_values`,
    `transform`, `tile`, `lowrank_rank`): the run sent int32 indices and fp32 values, transformed nothing and
    never decayed its buffers, so it resumes with its own bytes."""
    outer = resolved.get("outer")
    if isinstance(outer, dict) and (missing := _lacks(outer, BEFORE_ISSUE_37)):
        resolved = {**resolved, "outer": missing | outer}
    return resolved


def _config_3_to_4(resolved: dict) -> dict:
    """Version 3: the config is today's (version 4 changed a checkpoint's totals only)."""
    return resolved


# The data fields of issue 38 (a prepared corpus's options): what every run before them did
BEFORE_ISSUE_38 = {"window_across_documents": True, "replica_split": "iid"}


def _config_4_to_5(resolved: dict) -> dict:
    """Version 4: before issue 38's data fields (`data.window_across_documents`, `data.replica_split`):
    such a run cut its windows across the whole stream and gave every replica every source."""
    data = resolved.get("data")
    if isinstance(data, dict) and any(key not in data for key in BEFORE_ISSUE_38):
        resolved = {**resolved, "data": BEFORE_ISSUE_38 | data}
    return resolved


# The fields of issue 39 (asynchronous replicas, docs/async.md): what every run before them did (rounds,
# no per-replica speed, the clock timing the trained model), whatever today's defaults are
BEFORE_ISSUE_39_OUTER = {
    "schedule": "rounds",
    "async_rule": "delayed_nesterov",
    "dn_buffer": 0,
    "dn_activation": 0.0,
    "grace_s": 0.0,
    "dylu": False,
    "async_eval_every": 0,
    "mean_weights": "uniform",
}
BEFORE_ISSUE_39_CLUSTER = {"replica_speeds": [], "speed_sigma": 0.0, "speed_seed": 0, "model_params": 0}


def _config_5_to_6(resolved: dict) -> dict:
    """Version 5: before issue 39's fields (`outer.schedule` and the asynchronous server's, the cluster's
    speeds and `cluster.model_params`): such a run synced in rounds and its clock timed its own model."""
    for name, before in (("outer", BEFORE_ISSUE_39_OUTER), ("cluster", BEFORE_ISSUE_39_CLUSTER)):
        section = resolved.get(name)
        if isinstance(section, dict) and (missing := _lacks(section, before, name)):
            resolved = {**resolved, name: missing | section}
    return resolved


# The fields of issue 49 (the outer optimizer as a component): every run before them stepped with the
# built-in, whatever today's defaults are
BEFORE_ISSUE_49_OUTER = {"optimizer": "nesterov", "optimizer_args": {}}


def _config_6_to_7(resolved: dict) -> dict:
    """Version 6: before `outer.optimizer` and `outer.optimizer_args`: such a run stepped with the
    built-in Nesterov step (outer.momentum, outer.nesterov)."""
    outer = resolved.get("outer")
    if isinstance(outer, dict) and any(key not in outer for key in BEFORE_ISSUE_49_OUTER):
        resolved = {**resolved, "outer": BEFORE_ISSUE_49_OUTER | outer}
    return resolved


# Fields that moved (issue 49: the config by concern), old dotted key -> today's: config.yaml's and a
# checkpoint's config move them (`_config_7_to_8`, `_config_8_to_9`), the command line's spelling too
# (`modern_spelling`).
RETIRED_IN_8 = {
    "outer.async_rule": "outer.arrivals.rule",
    "outer.dn_buffer": "outer.arrivals.dn_buffer",
    "outer.dn_activation": "outer.arrivals.dn_activation",
    "outer.grace_s": "outer.arrivals.grace_s",
    "outer.dylu": "outer.arrivals.dylu",
    "outer.async_eval_every": "outer.arrivals.eval_every",
    "outer.lowrank_rank": "outer.lowrank.rank",
    "outer.topk_fraction": "outer.topk.fraction",
    "outer.index_bits": "outer.topk.index_bits",
    "outer.topk_values": "outer.topk.values",
}
RETIRED_IN_9 = {  # the fields several codecs share, into outer.codec (`config.CodecConfig`)
    "outer.block": "outer.codec.block",
    "outer.tile": "outer.codec.tile",
    "outer.transform": "outer.codec.transform",
    "outer.error_decay": "outer.codec.error_decay",
    "outer.reduce": "outer.codec.reduce",
}
RETIRED = RETIRED_IN_8 | RETIRED_IN_9
# Of `RETIRED_IN_9`, the fields a codec that does not read them accepted, unread (the checks of then refused
# the others there): the older spelling under such a codec is dropped with a note (`composition.drop_unread`).
# The value: whether only a lossless codec (none) accepted it so (outer.reduce=two_phase: the lossy codecs
# that do not read it, low rank's, refused it).
UNREAD_ELSEWHERE = {"outer.block": False, "outer.reduce": True}


def _config_7_to_8(resolved: dict) -> dict:
    """Version 7: the asynchronous server's fields, low rank's and top-k's were outer's own
    (`outer.async_rule`, `outer.lowrank_rank`, `outer.topk_fraction`, ...): they move (`RETIRED`) into the
    node of the entry that reads them (outer.arrivals, async's; outer.lowrank, low rank's; outer.topk,
    top-k's), which a run of another schedule or codec lacks (None: the schedule's were at their defaults,
    as the checks of then required; a codec's, unread)."""
    outer = resolved.get("outer")
    if not isinstance(outer, dict):
        return resolved
    outer, nodes = dict(outer), {}
    for old, new in RETIRED_IN_8.items():
        key = old.removeprefix("outer.")
        node, _, name = new.removeprefix("outer.").partition(".")
        if old.startswith("outer.") and key in outer:
            nodes.setdefault(node, {})[name] = outer.pop(key)
    if not nodes:  # today's shape: nothing to move
        return resolved
    own = nodes_chosen(outer)
    for node, fields in nodes.items():
        outer[node] = fields if node in own else None
    return {**resolved, "outer": outer}


def _config_8_to_9(resolved: dict) -> dict:
    """Version 8: the fields several codecs share were outer's own (`outer.block`, `tile`, `transform`,
    `error_decay`, `reduce`): they move (`RETIRED_IN_9`) into outer.codec, a field the run's codec did not
    read at its default (only outer.block and outer.reduce could differ there, unread; the checks of then
    refused the others), as today's check requires. Today's shape (an outer.codec) is returned as it is."""
    outer = resolved.get("outer")
    if not isinstance(outer, dict) or "codec" in outer:
        return resolved
    outer, codec = dict(outer), as_builtins(CodecConfig())
    taken = codec_entry(outer.get("compress", "none")).takes
    for old in RETIRED_IN_9:
        key = old.removeprefix("outer.")
        if key in outer:
            value = outer.pop(key)
            codec[key] = value if key in taken else codec[key]
    return {**resolved, "outer": {**outer, "codec": codec}}


CONFIG_STEPS: tuple[Callable[[dict], dict], ...] = (
    _config_0_to_1,
    _config_1_to_2,
    _config_2_to_3,
    _config_3_to_4,
    _config_4_to_5,
    _config_5_to_6,
    _config_6_to_7,
    _config_7_to_8,
    _config_8_to_9,
)


def fill_before(resolved: dict, schema: type = TrainConfig) -> dict:
    """`resolved` (a config or a section of one, as plain containers) with every field that declares its
    value before it existed (`config.before`) and that it lacks, at that value, in every section and
    node below: what the run that wrote it did, whatever today's default is. No step per feature: a
    field added since the last step is filled here. Returned as it is when it lacks none."""
    out = resolved
    for f in dataclasses.fields(schema):
        if f.name not in resolved:
            if BEFORE in f.metadata:
                out = {**out, f.name: as_builtins(f.metadata[BEFORE])}
            continue
        kind, value = node_type(schema, f), resolved[f.name]
        if kind is not None and isinstance(value, dict) and (filled := fill_before(value, kind)) is not value:
            out = {**out, f.name: filled}
    return out


def upgrade_config(resolved: dict, version: int | None = None, what: str = "the config") -> dict:
    """A resolved config (a run's config.yaml, a checkpoint's) in today's shape, without its version;
    `version` where the file holding it says (a checkpoint's payload), else its own `schema_version`
    (0 without one): its version's steps, then `fill_before`. Today's, unversioned, is returned as it
    is."""
    if VERSION_KEY in resolved:
        version = version_of(resolved, what) if version is None else version
        resolved = {k: v for k, v in resolved.items() if k != VERSION_KEY}
    for step in CONFIG_STEPS[version or 0 :]:
        resolved = step(resolved)
    return fill_before(resolved)


# -- a checkpoint's payload -----------------------------------------------------------------------

# the run's totals counted since the first checkpoints: zero in a run that did not count them yet
CHURN_TOTALS = {
    "churn_missed": 0,
    "churn_absent": 0,
    "churn_skipped": 0,
    "churn_late": 0,
    "replica_steps_reached": 0,
    "contributed_sha256": "",
}


def _ring_bytes(participants: int, params: int) -> int:
    """The fp32 ring's bytes per participant (`diloco.exchange.communication.ring_allreduce_bytes`, which this
    layer cannot import; tests/test_formats.py checks they agree)."""
    return 0 if participants <= 1 else int(2 * (participants - 1) / participants * params * 4)


def _checkpoint_0_to_1(saved: dict) -> dict:
    """Unversioned: a payload written before its digest (`sealed`), the run id and the records'
    sha256 (None: checked by the length alone), before mid-round checkpoints (`round_first` is
    `next_update`: it stopped at a boundary; no replica weights), Streaming DiLoCo (no sync in flight,
    no peak: every sync of such a run sent the whole model over the ring), error feedback, the
    clock (None: the rest of the run has none), each replica's clock seconds (the next update starts
    a round), the codecs' figures of a sync in flight, the measured bytes, or churn's totals (zero)."""
    saved = {**saved}
    saved.setdefault("sealed", False)
    for key in ("metrics_sha256", "run_id", "wandb_run_id"):
        saved.setdefault(key, None)
    state = saved["state"] = {**saved["state"]}
    state.setdefault("round_first", state["next_update"])
    for key in ("round_params", "round_stepped", "pending", "errors", "clock"):
        state.setdefault(key, None)
    state.setdefault("comm_measured", {})
    totals = state["totals"] = CHURN_TOTALS | state["totals"]
    if "comm_outer_peak" not in totals:
        size = sum(t.numel() for t in state["theta"].values())
        sent = totals.get("comm_outer_bytes", 0)
        totals["comm_outer_peak"] = _ring_bytes(len(state["replicas"]), size) if sent else 0
    if state["pending"] is not None:
        state["pending"] = {"figures": {}} | state["pending"]
    if state["clock"] is not None:
        replicas = int(saved["config"]["replicas"])
        state["clock"] = {"round": 0, "ahead": [0.0] * replicas} | state["clock"]
    return saved


def _checkpoint_1_to_2(saved: dict) -> dict:
    """Version 1: before the whole-round overlap: no reductions in flight across a round (`in_flight`)
    and no per-replica outer state (`outer_replicas`)."""
    saved = {**saved}
    state = saved["state"] = {**saved["state"]}
    for key in ("in_flight", "outer_replicas"):
        state.setdefault(key, None)
    return saved


def _checkpoint_2_to_3(saved: dict) -> dict:
    """Version 2: the payload is today's (only its config gained fields: `_config_2_to_3`)."""
    return saved


def _checkpoint_3_to_4(saved: dict) -> dict:
    """Version 3: before the totals held each replica's outer bits (`comm_outer_bits`): None, so the
    resumed run's rows hold each sync's bits but no running total and its summary no total bits (the
    report sums its rows instead: `sync_bits`). Nothing in the checkpoint says what each replica sent
    at the syncs before it (metrics.jsonl does)."""
    saved = {**saved}
    state = saved["state"] = {**saved["state"]}
    state["totals"] = {"comm_outer_bits": None} | state["totals"]
    return saved


def _checkpoint_4_to_5(saved: dict) -> dict:
    """Version 4: the payload is today's (only its config gained fields: `_config_4_to_5`)."""
    return saved


def _checkpoint_5_to_6(saved: dict) -> dict:
    """Version 5: before asynchronous replicas: no asynchronous run state (`async`: None)."""
    saved = {**saved}
    saved["state"] = {"async": None} | saved["state"]
    return saved


def _checkpoint_6_to_7(saved: dict) -> dict:
    """Version 6: before the outer optimizer's own state (`outer_optimizer`: None, the built-in's is its
    `outer_momentum`; an asynchronous naive server's buffer, never read, is put back into nothing)."""
    saved = {**saved}
    saved["state"] = {"outer_optimizer": None} | saved["state"]
    return saved


def _checkpoint_7_to_8(saved: dict) -> dict:
    """Version 7: the payload is today's (only its config's asynchronous fields moved: `_config_7_to_8`)."""
    return saved


def _checkpoint_8_to_9(saved: dict) -> dict:
    """Version 8: the payload is today's (only its config's codec fields moved: `_config_8_to_9`)."""
    return saved


CHECKPOINT_STEPS: tuple[Callable[[dict], dict], ...] = (
    _checkpoint_0_to_1,
    _checkpoint_1_to_2,
    _checkpoint_2_to_3,
    _checkpoint_3_to_4,
    _checkpoint_4_to_5,
    _checkpoint_5_to_6,
    _checkpoint_6_to_7,
    _checkpoint_7_to_8,
    _checkpoint_8_to_9,
)


def upgrade_checkpoint(saved: dict, what: str = "the checkpoint") -> dict:
    """A checkpoint's payload (what `torch.load` gave) in today's form: its config too, its version
    `SCHEMA_VERSION`; UserError (one line) for a newer one. Today's is returned as it is."""
    version = version_of(saved, what)
    if version == SCHEMA_VERSION:  # its config may still lack a field added since (`fill_before`)
        config = fill_before(saved["config"]) if isinstance(saved.get("config"), dict) else None
        return saved if config is None or config is saved["config"] else {**saved, "config": config}
    for step in CHECKPOINT_STEPS[version:]:
        saved = step(saved)
    config = upgrade_config(saved["config"], version, what)
    return {**saved, "config": config, VERSION_KEY: SCHEMA_VERSION}


# -- the records ----------------------------------------------------------------------------------


def streaming_take(count: int, fragment: int, H: int, P: int, tau: int) -> int:
    """The update count after which the pseudo-gradient landing after `count` was taken, by the
    streaming schedule of docs/streaming.md as it was before a sync row held it: tau earlier at its
    scheduled landing `k*H + (p+1)*H/P`; at the phase's final flush, when it was in flight, at its
    scheduled take; otherwise at the landing itself."""
    if tau == 0:
        return count
    stride = H // P
    if (count % H or H) == (fragment + 1) * stride:
        return count - tau
    k = (count - 1) // H
    for period in (k, k + 1):
        land = period * H + (fragment + 1) * stride
        if land - tau < count < land:
            return land - tau
    return count


def upgrade_sync_row(row: SyncRow, resolved: dict, run_params: int) -> SyncRow:
    """A sync row written before it held `taken_at` and `params` (any run before schema 1's rows
    gained them; found by their absence), given them as its run's config says: the take by the
    streaming schedule, the parameters synced the run's (`run_params`) without fragments, else the fp32
    ring's bytes inverted (a codec's row is timed by its payload, so its `params` stays None). Today's
    row is returned as it is."""
    if row.taken_at is not None:
        return row
    outer, R = resolved["outer"], int(resolved["replicas"])
    H, P, tau = int(resolved["inner"]["H"]), int(outer["fragments"]), int(outer["delay"])
    params = row.params
    if params is None and P == 1:
        params = run_params
    elif params is None and row.comm_outer_bytes and codec_entry(outer["compress"]).lossless:
        params = round(row.comm_outer_bytes * R / (2 * (R - 1)) / 4)  # `_ring_bytes` inverted
    taken = streaming_take(int(row.update), row.fragment or 0, H, P, tau)
    return dataclasses.replace(row, taken_at=taken, params=params)


HEADER_BYTES = 8  # a compressed message's header (`diloco.exchange.communication.HEADER_BYTES`;
# tests/test_bits.py)


def _contribution_bits(outer: dict, replicas: int, params: int, payload_bytes: int | None) -> int:
    """`diloco.exchange.communication.contribution_bits`, which this layer cannot import (tests/test_bits.py
    checks
    they agree)."""
    if replicas <= 1:
        return 0
    codec = codec_entry(outer["compress"])
    if codec.lossless:
        return codec.value_bits * params
    messages = (
        1
        if str((outer.get("codec") or {}).get("reduce", outer.get("reduce", "gather"))) == "gather"
        else replicas
    )
    return 8 * (int(payload_bytes) + messages * HEADER_BYTES)


def _took_part(row: SyncRow, replicas: int) -> list[bool] | None:
    """Each replica's flag in a sync row that does not hold its bits: a codec's compression errors (None
    where it did not take part), churn's contributors, or every replica when all took part; None when the
    row does not say who (an fp32 sync some replicas sat out, without churn)."""
    errors, contributors = row.figures.get("compress_error"), row.figures.get("contributors")
    if isinstance(errors, list) and len(errors) == replicas:
        return [error is not None for error in errors]
    if isinstance(contributors, list):
        return [m in contributors for m in range(replicas)]
    if row.replicas_synced == replicas:
        return [True] * replicas
    return None


def sync_bits(rows: list[SyncRow], resolved: dict) -> list[SyncRow]:
    """A run's sync rows (in order, each given `taken_at` and `params` by `upgrade_sync_row`) with their
    bits: a row written before it held `bits_per_param` gets them from its parameters and payload bytes
    (`_contribution_bits`, for the replicas `_took_part` names), and every row without `bits_total` (a
    run written before it, or resumed from a checkpoint written before it) the running sum of the rows'
    bits. A row whose bits cannot be told (no parameter count, or no word of who took part) keeps none,
    and the rows after it no running total. Today's rows are returned as they are."""
    replicas, outer = int(resolved["replicas"]), resolved["outer"]
    totals: list[int] | None = [0] * replicas
    out = []
    for row in rows:
        per_param = row.bits_per_param
        if per_param is None and row.params and row.comm_outer_bytes is not None:
            took = _took_part(row, replicas)
            payload = row.figures.get("payload_bytes")
            if took is not None and (payload is not None or codec_entry(outer["compress"]).lossless):
                bits = _contribution_bits(outer, replicas, row.params, payload)
                per_param = [bits / row.params if t else None for t in took]
        if row.bits_total is not None:
            totals = list(row.bits_total)
        elif totals is not None and per_param is not None:
            sent = [0 if x is None else round(x * row.params) for x in per_param]
            totals = [total + bits for total, bits in zip(totals, sent, strict=True)]
        elif row.comm_outer_bytes:  # bits sent that no row says: the running total is unknown from here
            totals = None
        if (per_param, row.bits_total) != (row.bits_per_param, totals):
            row = dataclasses.replace(row, bits_per_param=per_param, bits_total=totals)
        out.append(row)
    return out


# -- the command line -----------------------------------------------------------------------------

OLD_SPELLINGS = {  # engine=dist and its fields, before the processes had their own group
    "engine=dist": "processes=dist",
    **{f"engine.{k}": f"processes.{k}" for k in OLD_PROCESS_FIELDS},
}


def modern_spelling(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """`engine=dist engine.nproc=2 engine.layout=stacked` -> `processes=dist processes.nproc=2
    processes.layout=replicas`, with one notice per older spelling (for the terminal); a sweep over
    engine=dist and an engine (`engine=loop,dist`) is two axes now and is left for Hydra to refuse. A
    `RETIRED` key -> today's (`outer.async_rule=naive` -> `outer.arrivals.rule=naive`), with one notice
    for the run's train.log alone. Returns the argv, the terminal's notices and the log's."""
    out, notices, logged = [], [], []
    for arg in argv:
        key, sep, value = arg.partition("=")
        new = OLD_SPELLINGS.get(arg) or (OLD_SPELLINGS.get(key) and f"{OLD_SPELLINGS[key]}={value}")
        if sep and new:
            if key == "engine.layout":
                new = "processes.layout=" + ",".join(
                    "replicas" if v == "stacked" else v for v in value.split(",")
                )
            notices.append(f"hypertrain: note: {arg} is now spelled {new} (engine= chooses loop or stacked)")
            arg = new
        elif sep and key in RETIRED:
            arg = f"{RETIRED[key]}={value}"
            logged.append(f"{key}= is now spelled {RETIRED[key]}= (read as {arg})")
        out.append(arg)
    return out, notices, logged
