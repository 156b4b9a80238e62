"""What `processes.shard=true` (sharded replicas, docs/distributed.md "Sharded replicas") is built for:
`check_shard(cfg, layout)` raises a one-line `UserError` for every combination that is not built
(the replicas layout, codecs other than the quantizers, outer.codec.tile and outer.codec.transform,
async, models other than the own decoder and model=hf, compiled steps, checkpoints of outer.overlap's
terms in flight), naming the option and what is valid. No torch here.
"""

from __future__ import annotations

from hypertrain.codec_table import ELEMENTWISE, TABLE, codec_entry
from hypertrain.config import TrainConfig, UserError
from hypertrain.distributed.layouts import Layout
from hypertrain.model.spec import model_spec
from hypertrain.schedule_table import schedule_entry

NOT_BUILT = "is not built with processes.shard=true (docs/distributed.md, 'Sharded replicas')"


def check_shard(cfg: TrainConfig, layout: Layout | None) -> None:
    """UserError (one line) when `processes.shard=true` meets what it does not build."""
    if not cfg.processes.shard:
        return
    if layout is not None and layout.kind != "benchmark":
        raise UserError(
            f"processes.shard=true needs the benchmark layout (processes = world.size = {cfg.world.size}); "
            f"the {layout.kind} layout holds whole replicas in one process; valid: processes.nproc=0 "
            f"with processes.layout=auto or benchmark, or processes.shard=false"
        )
    if layout is not None and layout.ranks_per_replica == 1:
        raise UserError(
            f"processes.shard=true with world.size={cfg.world.size} and replicas={cfg.replicas} shards "
            "nothing (one rank per replica); valid: world.size a multiple of replicas above it, or "
            "processes.shard=false"
        )
    outer, spec, codec = cfg.outer, model_spec(cfg.model), codec_entry(cfg.outer.compress)
    checkpoints = cfg.checkpoint.every > 0 or cfg.checkpoint.every_updates > 0
    quantizers = ", ".join(name for name, entry in TABLE.items() if entry.scope == ELEMENTWISE)
    quantizers = f"outer.compress=none or a quantizer ({quantizers})"
    refused = [
        (
            not (codec.lossless or codec.scope == ELEMENTWISE),
            f"outer.compress={outer.compress} (a {codec.scope} codec: its blocks or tensors are not cut "
            "on shards)",
            quantizers,
        ),
        (codec.blocks and outer.codec.tile > 0, f"outer.codec.tile={outer.codec.tile}", "outer.codec.tile=0"),
        (
            codec.blocks and outer.codec.transform != "none",
            f"outer.codec.transform={outer.codec.transform}",
            "outer.codec.transform=none",
        ),
        (schedule_entry(outer.schedule).server, f"outer.schedule={outer.schedule}", "outer.schedule=rounds"),
        (
            not spec.shardable,
            f"model {cfg.model.name} ({spec.kind})",
            "the own decoder (model=tiny ...) or model=hf",
        ),
        (cfg.engine.compile, "engine.compile=true", "engine.compile=false"),
        (
            spec.module and cfg.model.compute_dtype == "bf16",
            f"model {cfg.model.name} with model.compute_dtype=bf16",
            "model.compute_dtype=fp32",
        ),
        (
            checkpoints and outer.overlap != "none",
            f"a checkpoint with outer.overlap={outer.overlap} (the replicas' terms in flight on the shards)",
            "checkpoint.every=0 checkpoint.every_updates=0, or outer.overlap=none",
        ),
    ]
    for bad, what, valid in refused:
        if bad:
            raise UserError(f"{what} {NOT_BUILT}; valid: {valid}, or processes.shard=false")
