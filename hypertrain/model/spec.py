"""The model table (torchtitan's ModelSpec): one entry per model kind, each declaring its facts: every
parameter's shape, role and place (the layer it belongs to, hence its fragment), its loss channels and
router columns, its activation estimate, the figures its update rows add and whether it samples as text.

`model_spec(cfg)` is the one place the config (`model.arch`, `model.is_moe`) picks the entry; the
engines, fragments, memory estimate, sample command, report and preflight ask the entry, never the
config's names. No torch and no Hydra here: `cfg` is a plain `ModelConfig`.
"""

from __future__ import annotations

import copy
import functools
import math

from hypertrain.choices import Arch
from hypertrain.config import ModelConfig, UserError
from hypertrain.import_path import entry_at, is_import_path

# What a parameter is for; the inner optimizer picks its rule by role (Muon takes `hidden`; a mixture
# of experts' router is AdamW's, as the embeddings and heads are).
ROLES = ("embedding", "head", "norm", "hidden", "router")
# Where a parameter sits: a layer's index (an int), or before the layers (the embeddings: the first
# fragment's) or after them (the final norm and the heads: the last fragment's).
BEFORE, AFTER = "before", "after"
# What a replica's update records of its routing (`moe.router_figures`): the load-balancing loss, and the
# smallest and largest fraction of the update's tokens a layer sends to one of its experts.
ROUTER_FIGURES = ("aux", "min_fraction", "max_fraction")

Spec = tuple[tuple[int, ...], str]  # a parameter's (shape, role)


def ffn_width(cfg: ModelConfig) -> int:
    """SwiGLU hidden width: `d_ff`, or 8/3 * d_model rounded up to a multiple of 16."""
    return cfg.d_ff or 16 * math.ceil(8 * cfg.d_model / 3 / 16)


def expert_specs(d: int, n_experts: int, width: int) -> dict[str, Spec]:
    """One layer's mixture parameters (names after the layer's prefix) -> (shape, role). The router is
    `router` (AdamW's, also under Muon); each expert's matrices are `hidden` (Muon's)."""
    return {
        "router": ((d, n_experts), "router"),
        "experts.w1": ((n_experts, d, width), "hidden"),
        "experts.w3": ((n_experts, d, width), "hidden"),
        "experts.w2": ((n_experts, width, d), "hidden"),
    }


class Decoder:
    """The decoder (`model.arch=decoder`): one token stream, one embedding, an untied head, SwiGLU MLPs."""

    kind = "decoder"
    experts = False  # each layer's MLP is a mixture of experts with a router (`model.moe`)
    channels = False  # reads several token channels per position, one embedding and head each
    text = True  # its tokens are text: `python -m hypertrain.sample` decodes them
    external = False  # a Hugging Face module (`HFModel`), not hypertrain's own
    shardable = True  # processes.shard=true builds it: FSDP2 per layer block (distributed.shard_check)
    module = False  # an nn.Module `model.hf` builds and calls (`HFModel`, an outside `ModuleModel`)
    # The model fields it takes (`check_model`): model.is_moe=true makes its MLPs experts (`MoEDecoder`);
    # it is built from exactly one of model.path and model.config (a Hugging Face model's), else neither
    takes_experts = True
    sourced = False
    # The run summary's figures a report's phase row adds: report column -> summary key.
    report_figures: dict[str, str] = {}
    # The columns a replica's update record adds (`engines.columns.REPLICA_COLUMNS`; NaN in a run of
    # another model), filled by `replica_values`.
    replica_columns: tuple[str, ...] = ()

    def declared(self, cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str, int | str]]:
        """Name -> (shape, role, place) of one replica's parameters, in a fixed (sorted) order: each is
        given its role and its place where it is declared, so none falls to the wrong optimizer rule
        or fragment."""
        d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
        out = {"norm": ((d,), "norm", AFTER)}
        for name, (shape, role) in self.stream_specs(cfg).items():
            out[name] = (shape, role, BEFORE if role == "embedding" else AFTER)
        for i in range(cfg.n_layers):
            pre = f"layers.{i:03d}."
            layer = {
                "attn_norm": ((d,), "norm"),
                "wq": ((d, cfg.n_heads * hd), "hidden"),
                "wk": ((d, cfg.n_kv_heads * hd), "hidden"),
                "wv": ((d, cfg.n_kv_heads * hd), "hidden"),
                "wo": ((cfg.n_heads * hd, d), "hidden"),
                "mlp_norm": ((d,), "norm"),
            } | self.mlp_specs(cfg)
            out |= {pre + name: (shape, role, i) for name, (shape, role) in layer.items()}
        return dict(sorted(out.items()))

    def stream_specs(self, cfg: ModelConfig) -> dict[str, Spec]:
        """The embedding(s) and head(s)."""
        return {"emb": ((cfg.vocab, cfg.d_model), "embedding"), "head": ((cfg.d_model, cfg.vocab), "head")}

    def mlp_specs(self, cfg: ModelConfig) -> dict[str, Spec]:
        """One layer's MLP (names after the layer's prefix)."""
        d, f = cfg.d_model, ffn_width(cfg)
        return {"w1": ((d, f), "hidden"), "w3": ((d, f), "hidden"), "w2": ((f, d), "hidden")}

    def param_specs(self, cfg: ModelConfig) -> dict[str, Spec]:
        """Name -> (shape, role) of one replica's parameters, in a fixed (sorted) order."""
        return {name: (shape, role) for name, (shape, role, _) in self.declared(cfg).items()}

    def places(self, cfg: ModelConfig, names) -> dict[str, int | str]:
        """Name -> place (a layer's index, `BEFORE` or `AFTER`) of each of `names`; UserError (one line)
        for a parameter the model does not place, rather than a fragment by default."""
        declared = self.declared(cfg)
        unplaced = [name for name in names if name not in declared]
        if unplaced:
            raise UserError(
                f"model parameter {unplaced[0]!r} is not placed by the {self.kind} model (in a layer, or "
                f"before or after them; {len(unplaced)} such); valid: the parameters the model declares"
            )
        return {name: declared[name][2] for name in names}

    def layers(self, cfg: ModelConfig) -> int:
        """The layers a parameter can be placed in (what the fragments share out)."""
        return cfg.n_layers

    def vocabs(self, cfg: ModelConfig) -> list[int]:
        """Each head's vocabulary."""
        return [cfg.vocab]

    def loss_channels(self, cfg: ModelConfig) -> int:
        """C: the per-channel sums `forward` returns beside each replica's loss (0: one stream)."""
        return len(self.vocabs(cfg)) if self.channels else 0

    def id_channels(self, cfg: ModelConfig) -> int:
        """Token ids a position holds."""
        return len(self.vocabs(cfg))

    def router_columns(self, cfg: ModelConfig) -> int:
        """M: the router columns `forward` returns after the channel sums (0 without experts)."""
        return 2 + cfg.n_layers * cfg.n_experts if self.experts else 0

    def router_figures(self) -> tuple[str, ...]:
        """The figures of its routing a replica's update records (`ROUTER_FIGURES`; none without)."""
        return ROUTER_FIGURES if self.experts else ()

    def activation_floats(self, cfg: ModelConfig) -> tuple[int, int]:
        """(floats per position a training microbatch holds, floats per position of a forward-only
        held-out pass), counted from `model.transformer.forward`:

        - per layer 17 d + 4 f + h saved for the backward: the residual stream before and after the
          attention (2 d); each RMSNorm's normalised input and output (2 x 2 d); q and k before RoPE, the
          concatenated halves and the rotated result (3 x 2 d at most, kv heads <= heads), v (d); the
          attention's output and its contiguous copy (2 d) and its log-sum-exp (h: the CPU and CUDA
          kernels are flash or memory-efficient, never a T x T matrix); the output projection (d); the
          MLP's w1 and w3 outputs, the SiLU and the product (4 f) and its output (d);
        - once: the embedding and the final norm (3 d), the gradient flowing back through one layer at a
          time (4 d + 2 f), a multistream model's per-channel embeddings (C d);
        - the heads: every channel's log-probabilities are saved (sum of V), and one channel's logits and
          their gradient are in flight (2 max V): 3 V for one stream.
        The held-out pass saves nothing: one layer's working set (4 d + 2 f) and the heads' logits.
        """
        d, f, h = cfg.d_model, ffn_width(cfg), cfg.n_heads
        vocabs = self.vocabs(cfg)
        heads = sum(vocabs) + 2 * max(vocabs)
        layer = 17 * d + 4 * f + h
        train = cfg.n_layers * layer + 3 * d + (4 * d + 2 * f) + self.loss_channels(cfg) * d + heads
        return train, (4 * d + 2 * f) + heads

    def replica_values(self, means: list[float] | None, routing: list[float] | None) -> dict[str, float]:
        """A replica's `replica_columns` at one update, from what its engine returned: the channels'
        token means (`ReplicaResult.channel_losses`) and the router figures (`ReplicaResult.routing`);
        None where the replica skipped the update (its columns stay NaN)."""
        return {}

    def row_figures(self, rnd, t: int) -> dict[str, float]:
        """The figures update `t` of the round `rnd` (a `diloco.rounds.Segment`) adds to its row."""
        return {}


# What the rest of the code holds of a model: an entry, the decoder's facts or an entry's own.
ModelSpec = Decoder


class MoEDecoder(Decoder):
    """The decoder with a mixture of experts (`model.is_moe=true`, docs/moe.md): every layer's MLP is
    n_experts SwiGLU experts and a router; its update rows add the router's figures."""

    kind = "decoder (model.is_moe=true)"
    experts = True
    replica_columns = ("router_aux", "expert_min", "expert_max")  # ROUTER_FIGURES, in order

    def replica_values(self, means: list[float] | None, routing: list[float] | None) -> dict[str, float]:
        """The update's load-balancing loss (unweighted) and the smallest and largest fraction of
        routing slots an expert got."""
        return dict(zip(self.replica_columns, routing, strict=True)) if routing else {}

    def mlp_specs(self, cfg: ModelConfig) -> dict[str, Spec]:
        return expert_specs(cfg.d_model, cfg.n_experts, cfg.expert_ffn)

    def row_figures(self, rnd, t: int) -> dict[str, float]:
        """Update `t`'s load-balancing loss (unweighted) averaged over the replicas that stepped
        (`loss/router_aux`; W&B `train/loss/router_aux`), and the smallest and largest fraction of
        routing slots an expert got in any of them (`experts/min_fraction`, `experts/max_fraction`;
        balanced is top_k / n_experts, 0 a dead expert)."""
        aux, stepped = rnd.replica_column("router_aux")[t], rnd.stepped(t)
        if not bool(stepped.any()):
            return {}
        return {
            "loss/router_aux": float(aux[stepped].mean()),
            "experts/min_fraction": float(rnd.replica_column("expert_min")[t][stepped].min()),
            "experts/max_fraction": float(rnd.replica_column("expert_max")[t][stepped].max()),
        }


class Multistream(Decoder):
    """The multistream model (`model.arch=multistream`): C token channels per position (text and audio
    codebooks per frame), one embedding `emb.<c>` and one head `head.<c>` per channel; its update rows
    add the text and mean audio losses, its report the frames per second."""

    kind = "multistream"
    takes_experts = False
    channels = True
    text = False
    report_figures = {"frames_per_s": "bench/frames_per_s"}
    replica_columns = ("text_loss", "audio_loss")

    def replica_values(self, means: list[float] | None, routing: list[float] | None) -> dict[str, float]:
        """The text channel's token mean, and the audio channels' mean of theirs."""
        if means is None:
            return {}
        return {"text_loss": means[0], "audio_loss": sum(means[1:]) / max(1, len(means) - 1)}

    def stream_specs(self, cfg: ModelConfig) -> dict[str, Spec]:
        d, out = cfg.d_model, {}
        for c, vocab in enumerate(cfg.channel_vocabs):
            out |= {f"emb.{c:02d}": ((vocab, d), "embedding"), f"head.{c:02d}": ((d, vocab), "head")}
        return out

    def vocabs(self, cfg: ModelConfig) -> list[int]:
        return list(cfg.channel_vocabs)

    def row_figures(self, rnd, t: int) -> dict[str, float]:
        """Update `t`'s text and mean audio training losses, averaged over the replicas that stepped
        (`loss/text`, `loss/audio_mean`; W&B `train/loss/text`, `train/loss/audio_mean`)."""
        text, audio = rnd.replica_column("text_loss")[t], rnd.replica_column("audio_loss")[t]
        stepped = rnd.stepped(t)
        if not bool(stepped.any()):
            return {}
        return {"loss/text": float(text[stepped].mean()), "loss/audio_mean": float(audio[stepped].mean())}


class HFModel(Decoder):
    """A Hugging Face causal LM (`model.arch=hf`, docs/hf.md): its parameters, their roles and layers,
    its vocabulary and sizes are the module's own (`model.hf`, which imports torch and transformers when
    first asked); `model.transformer.logits` calls it."""

    kind = "hf"
    external = True  # the module is Hugging Face's: `model.hf` builds and calls it
    shardable = True  # FSDP2 per decoder layer, then the root (`distributed.fsdp_engine.ModuleReplica`)
    module = True
    takes_experts = False
    sourced = True

    def declared(self, cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str, int | str]]:
        from hypertrain.model.hf import describe

        return {
            name: (shape, role, layer if layer is not None else (BEFORE if before else AFTER))
            for name, (shape, role, layer, before) in describe(cfg).items()
        }

    def layers(self, cfg: ModelConfig) -> int:
        return self.sizes(cfg)["layers"]

    def vocabs(self, cfg: ModelConfig) -> list[int]:
        return [self.sizes(cfg)["vocab"]]

    def sizes(self, cfg: ModelConfig) -> dict[str, int]:
        from hypertrain.model.hf import config_fields

        return config_fields(cfg)

    def activation_floats(self, cfg: ModelConfig) -> tuple[int, int]:
        """The decoder's count (`Decoder.activation_floats`) at the HF config's hidden and intermediate
        sizes, heads, layers and vocabulary, doubled per layer: a module written for readability saves
        more than the hand-written decoder (its masks, casts and unfused projections)."""
        s = self.sizes(cfg)
        d, f, h, V = s["hidden"], s["intermediate"], s["heads"], s["vocab"]
        layer = 2 * (17 * d + 4 * f + h)
        return s["layers"] * layer + 7 * d + 2 * f + 3 * V, 4 * d + 2 * f + 3 * V


class ModuleModel(Decoder):
    """A causal LM from outside the package (`model.arch=module.NAME`, docs/extending.md, "A model"): any
    torch nn.Module, built by `factory(cfg)` (the model section: its `vocab`, `d_model`, `n_layers`, ...)
    under the run's seed, called on token ids [B, T] for logits [B, T, vocab] by `model.hf`'s machinery
    (functional_call; vmap for the stacked engine). Its parameters are placed by `layers`, the name of its
    list of layers (an nn.ModuleList: the fragments share them out), before or after them by where the
    module registers them; roles as a Hugging Face model's (`model.hf.describe`), the `head` submodule's
    weight the head. Its vocabulary is `model.vocab` (0: the data's)."""

    module = True
    shardable = False  # FSDP2 of an outside module is not built (distributed.shard_check)
    takes_experts = False

    def __init__(self, factory, layers: str = "layers", head: str = "head", kind: str = "module"):
        self.factory, self.layer_list, self.head, self.kind = factory, layers, head, kind

    def declared(self, cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str, int | str]]:
        from hypertrain.model.hf import describe

        return {
            name: (shape, role, layer if layer is not None else (BEFORE if before else AFTER))
            for name, (shape, role, layer, before) in describe(cfg, self.layer_list, self.head).items()
        }

    def layers(self, cfg: ModelConfig) -> int:
        return 1 + max((p for *_, p in self.declared(cfg).values() if isinstance(p, int)), default=-1)


DECODER, MOE, MULTISTREAM, HF = Decoder(), MoEDecoder(), Multistream(), HFModel()
MODELS = {"decoder": DECODER, "multistream": MULTISTREAM, "moe": MOE, "hf": HF}
# Every entry's replica columns, each once, in the table's order (`engines.columns.REPLICA_COLUMNS`).
MODEL_COLUMNS = tuple(dict.fromkeys(name for entry in MODELS.values() for name in entry.replica_columns))


ARCHS = tuple(a.value for a in Arch)  # model.arch's names (moe is model.is_moe on top of decoder)
IMPORTED = "the import path (module.NAME) of a hypertrain.model.spec.ModuleModel entry"


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The run's model entry, from `model.arch` and `model.is_moe` (the one place they are read): the
    table's, or the entry at the import path `model.arch` (a dot in it; `imported`); UserError (one line)
    for neither. `cfg` may also be a run's config.yaml section as read (the report), written before
    `is_moe` existed."""
    if getattr(cfg, "is_moe", False):  # on an entry that takes experts (`check_model` refuses another)
        return MOE
    return arch_entry(str(cfg.arch))


def arch_entry(arch: str) -> ModelSpec:
    """The entry `model.arch=arch` names: the table's, or the one at the import path `arch` (a dot in it;
    `imported`); UserError (one line) for neither."""
    if arch in ARCHS:
        return MODELS[arch]
    if is_import_path(arch):
        return imported(arch)
    raise UserError(f"model.arch={arch!r} is not a model; valid: {', '.join(ARCHS)}, or {IMPORTED}")


def check_model(cfg: ModelConfig) -> ModelSpec:
    """The model fields `model.arch`'s entry declares it takes, against those given: model.is_moe=true
    (`takes_experts`), model.path and model.config (`sourced`: exactly one; else neither); UserError (one
    line) naming the field and what is valid. Returns the run's entry (`model_spec`). Asked by
    `preflight.checks.validate`; what the directory or config holds is the entry's own (`model.hf`)."""
    arch = str(cfg.arch)
    entry = arch_entry(arch)
    if cfg.is_moe and not entry.takes_experts:
        built = " or ".join(f"model.arch={name}" for name in ARCHS if MODELS[name].takes_experts)
        raise UserError(f"model.is_moe=true with model.arch={arch!r} is not built; valid: {built}")
    given = [name for name in ("path", "config") if getattr(cfg, name)]
    if entry.sourced and len(given) != 1:
        raise UserError(
            f"model.arch={arch} takes one of model.path and model.config, not "
            f"{' and '.join(given) or 'neither'}; valid: model.path=DIR (a local Hugging Face model "
            "directory) or 'model.config={model_type:llama,...}'"
        )
    if not entry.sourced and given:
        raise UserError(
            f"model.{given[0]} is set with model.arch={arch!r}; valid: model=hf (a Hugging Face model)"
        )
    return model_spec(cfg)


@functools.cache
def imported(path: str) -> ModuleModel:
    """The `ModuleModel` at the import path `path` (module.NAME), its `kind` made `path` (what messages
    say); UserError (one line) when the path does not import or names no `ModuleModel`."""
    entry = entry_at("model.arch", path, ModuleModel, "a model entry", IMPORTED, UserError)
    entry = copy.copy(entry)
    entry.kind = path
    return entry
