"""What Hydra composes over: the run's schema (`config.TrainConfig`, which types every group's YAML) and
the `phase` group's options, which are the plan's presets (`plan.PRESETS`), and the network clock's link
presets (`config.LINKS`, the groups `cluster/intra` and `cluster/inter`): one source for each.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from hypertrain.choices import PhaseKind
from hypertrain.config import LINKS, OUTER_NODES, PhaseConfig, TrainConfig
from hypertrain.plan.sampling import PRESETS, Phase, StrongPhase


def phase_config(phase: Phase) -> PhaseConfig:
    """The config of the plan's `phase` (the fields of the other kind keep their defaults)."""
    common = dict(
        name=phase.name, offset=phase.offset, updates=phase.updates, timing_warmup=phase.timing_warmup
    )
    if isinstance(phase, StrongPhase):
        return PhaseConfig(kind=PhaseKind.strong, global_batch=phase.global_batch, **common)
    return PhaseConfig(
        kind=PhaseKind.weak, base_world=phase.base_world, per_rank_batch=phase.per_rank_batch, **common
    )


def register_configs() -> None:
    """Register the schema and the phase presets with Hydra's ConfigStore (`conf/train.yaml` composes
    over them)."""
    cs = ConfigStore.instance()
    # One schema for the whole tree (it types every group's YAML); storing a schema per group would
    # list `model_schema` and the like among the options a user can pick.
    schema = OmegaConf.structured(TrainConfig)
    # a dict field's keys are the user's (outer.optimizer_args={betas:[0.8,0.9]}, model.config): open,
    # where Hydra's struct flag would refuse any key the default ({}) lacks
    OmegaConf.set_struct(schema.outer.optimizer_args, False)
    OmegaConf.set_struct(schema.model.config, False)  # model=hf 'model.config={model_type:llama,...}'
    # a table entry's own node (outer.arrivals, outer.lowrank) is there to be set on the command line, at
    # its defaults: the typed config drops it again under another entry (`config.OuterConfig.__post_init__`)
    for node, kind in OUTER_NODES.items():
        schema.outer[node] = OmegaConf.structured(kind)
    cs.store(name="train_schema", node=schema)
    for name, phase in PRESETS.items():
        cs.store(group="phase", name=name, node=phase_config(phase))
    for tier in ("intra", "inter"):  # the same presets for both tiers: cluster/inter=internet_1g
        for name, link in LINKS.items():
            cs.store(group=f"cluster/{tier}", name=name, node=link)
