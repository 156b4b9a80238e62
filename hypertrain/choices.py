"""The config's string choices as enums (`hypertrain.config` types its fields with them), one place.

Each is a `Choice`, an `enum.StrEnum` whose names are its values: OmegaConf's Enum node takes the
name a user writes (`inner.state_policy=reset`) and refuses any other, naming the valid ones (the
entry turns that into its one line: `choice_error`). A member is its string:
it equals it (`member == "none"`), hashes as it, formats and quotes as it (f-strings, `!r`, JSON), so
code and messages read a choice as they read a str. What a run stores (config.yaml, checkpoints, W&B)
holds plain str, never a member (`config.as_builtins`, `enum_to_str=True`). Of hypertrain only the codec
and schedule tables are imported here (`Compressor`'s and `Schedule`'s members are their entries);
omegaconf only by `choice_error`.
"""

from __future__ import annotations

from enum import StrEnum

from hypertrain.codec_table import TABLE as CODEC_TABLE
from hypertrain.schedule_table import TABLE as SCHEDULE_TABLE


class Choice(StrEnum):
    """A config field's choice: a str that is one of its members; repr quotes it as a str would."""

    def __repr__(self) -> str:
        return repr(self.value)


def choice_error(error: BaseException, prefix: str = "") -> str | None:
    """A choice (an enum here) given a value it does not have, which OmegaConf
    refuses ("Invalid value 'x', expected one of [...]"), as one line naming the field, the value and
    the valid ones; `prefix` goes before OmegaConf's key (a section's own config). None for any other
    error."""
    from omegaconf.errors import ValidationError
    from omegaconf.nodes import EnumNode

    while error is not None:
        node = getattr(error, "child_node", None)
        if isinstance(error, ValidationError) and isinstance(node, EnumNode) and error.full_key:
            valid = ", ".join(repr(member.value) for member in node.enum_type)
            return f"{prefix}{error.full_key}={str(error.value)!r} is not valid; valid: {valid}"
        error = error.__cause__
    return None


class Arch(Choice):
    """model.arch: one token stream, or several token channels per position."""

    decoder = "decoder"
    multistream = "multistream"
    hf = "hf"  # a Hugging Face causal LM (model.path or model.config; docs/hf.md)


class Precision(Choice):
    """model.compute_dtype (bf16: autocast) and inner.ns_dtype (the Newton-Schulz iteration's)."""

    fp32 = "fp32"
    bf16 = "bf16"


class InnerName(Choice):
    """inner.name: the inner optimizer (muon: Muon on hidden matrices, AdamW on the rest)."""

    adamw = "adamw"
    muon = "muon"


class StatePolicy(Choice):
    """inner.state_policy: what the inner optimizer state does at every sync."""

    carry = "carry"
    reset = "reset"
    average = "average"


# outer.compress's built-in names: one member per entry of the codec table (`hypertrain.codec_table`,
# which declares what each can do), in its order. The field itself is a str: one of these, or the import
# path of an entry outside the package, which OmegaConf could not check (`OuterConfig.check` does)
Compressor = Choice("Compressor", [(name, name) for name in CODEC_TABLE])
Compressor.__doc__ = "outer.compress: what each replica sends at a sync (hypertrain.codec_table's entries)."


class Transform(Choice):
    """outer.codec.transform: what each block of a pseudo-gradient becomes before the codec (and after the
    decoder, inverted): itself, or its orthonormal DCT-II coefficients (hypertrain.codecs.kernels)."""

    none = "none"
    dct = "dct"


class TopkValues(Choice):
    """outer.topk.values: how top-k's kept values travel (hypertrain.codecs.kernels.TopK)."""

    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    two_bit = "two_bit"


class Reduction(Choice):
    """outer.codec.reduce: how compressed payloads are reduced."""

    gather = "gather"
    two_phase = "two_phase"


class Overlap(Choice):
    """outer.overlap: the outer step overlaps a whole round (docs/overlap.md), or not (none)."""

    none = "none"
    delayed = "delayed"
    eager = "eager"


# outer.schedule: one member per entry of the schedule table (`hypertrain.schedule_table`, which declares
# what each is), in its order: rounds (every replica syncs at a round's end) or async (docs/async.md: each
# replica's pseudo-gradient is applied when it arrives); `async` is a keyword, so the functional form.
# The field itself is a str: one of these, or the import path of an entry outside the package, which
# OmegaConf could not check (`OuterConfig.check` does)
Schedule = Choice("Schedule", [(name, name) for name in SCHEDULE_TABLE])
Schedule.__doc__ = "outer.schedule: synchronous rounds, or asynchronous replicas (docs/async.md)."


class AsyncRule(Choice):
    """outer.arrivals.rule: the server's step on an arrival (docs/async.md)."""

    naive = "naive"
    delayed_nesterov = "delayed_nesterov"


class MeanWeights(Choice):
    """outer.mean_weights: how contributions applied together are averaged (docs/async.md)."""

    uniform = "uniform"
    tokens = "tokens"


class PhaseKind(Choice):
    """phase.kind: strong (a global batch) or weak (a base world's streams, replicated) scaling."""

    strong = "strong"
    weak = "weak"


class TokenDtype(Choice):
    """data.token_dtype: a token_bin file's integer type."""

    uint16 = "uint16"
    uint32 = "uint32"


class Examples(Choice):
    """data.examples: fixed windows of seq_len + 1 ids, or documents of variable length."""

    windows = "windows"
    documents = "documents"


class ReplicaSplit(Choice):
    """data.replica_split: every replica samples the whole stream (iid), or replica m only the prepared
    corpus's source m mod S (by_source; docs/data.md)."""

    iid = "iid"
    by_source = "by_source"


class EngineName(Choice):
    """engine.name: how a process computes its replicas (hypertrain.engines maps each to its engine)."""

    loop = "loop"
    stacked = "stacked"


class ProcessesName(Choice):
    """processes.name: one process holds every replica, or P real processes (torch.distributed)."""

    one = "one"
    dist = "dist"


class ProcessLayout(Choice):
    """processes.layout: which process trains what (hypertrain.distributed.layouts)."""

    auto = "auto"
    benchmark = "benchmark"
    replicas = "replicas"


class Backend(Choice):
    """processes.backend: torch.distributed's backend (auto: nccl on cuda devices, else gloo)."""

    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class LoggerName(Choice):
    """logger.name: whether W&B mirrors metrics.jsonl (always written)."""

    wandb = "wandb"
    none = "none"


class WandbMode(Choice):
    """logger.mode: the W&B mode (the WANDB_MODE environment variable wins)."""

    offline = "offline"
    online = "online"
    disabled = "disabled"


class ProgressLine(Choice):
    """logger.progress: the live progress line (auto: only on a terminal)."""

    auto = "auto"
    always = "always"
    never = "never"


class Compute(Choice):
    """cluster.compute: the clock's seconds per update, measured or modelled from FLOPs."""

    measured = "measured"
    modelled = "modelled"


class RejoinState(Choice):
    """churn.rejoin_state: a rejoining replica's inner optimizer state."""

    reset = "reset"
    carry = "carry"
