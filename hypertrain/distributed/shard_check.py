"""What `processes.shard=true` (sharded replicas, docs/distributed.md "Sharded replicas") is built for:
`check_shard(cfg, layout)` raises a one-line `UserError` for every combination that is not built
(the replicas layout, a factored codec (low rank), async, an outside module model, compiled steps,
bf16 module models), naming the option and what is valid. No torch here.
"""

from __future__ import annotations

from hypertrain.codec_table import codec_entry
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
    refused = [
        (
            codec.factored,
            f"outer.compress={outer.compress} (its factors of each matrix are not cut on shards)",
            "outer.compress=none or a codec with blocks (a quantizer or topk)",
        ),
        (schedule_entry(outer.schedule).server, f"outer.schedule={outer.schedule}", "outer.schedule=rounds"),
        (
            not spec.shardable,
            f"model {cfg.model.name} ({spec.kind})",
            "the own models (model=tiny, moe_tiny, multistream_tiny ...) or model=hf",
        ),
        (cfg.engine.compile, "engine.compile=true", "engine.compile=false"),
        (
            spec.module and cfg.model.compute_dtype == "bf16",
            f"model {cfg.model.name} with model.compute_dtype=bf16",
            "model.compute_dtype=fp32",
        ),
    ]
    for bad, what, valid in refused:
        if bad:
            raise UserError(f"{what} {NOT_BUILT}; valid: {valid}, or processes.shard=false")
