"""Typed configuration for every Hydra group (registered by `preflight/schema.py`); each section checks
itself.

`TrainConfig` is the whole run: one dataclass per group (model, inner, outer, phase, world, data,
engine, processes, logger, checkpoint, guard, cluster: the network clock's target) plus `replicas` (R)
and `seed`. Each field is documented here, once, and each section checks its own fields (`check()`),
raising `UserError` (a `ValueError`) with one line naming the field, the bad value and what is
valid. A string choice is an enum of `hypertrain.choices` (with the codec and schedule tables, whose
entries say what a codec or a schedule can run with, and `errors`, the only modules of hypertrain
imported here; what one data source needs is its entry's check, `hypertrain.data`): OmegaConf refuses
any other value, so no check here repeats it. Four tables open to entries from outside the package
take a str instead, a name or an import path, resolved by their checks: outer.compress (the codec
table's), outer.schedule (the schedule table's), data.name (the data sources') and model.arch (the
models', `model.spec.model_spec`). The
checks across sections and against the plan are
`hypertrain.preflight.checks.validate`. A field one table entry alone reads lives in that entry's node
(`OUTER_NODES`: outer.arrivals, async's; outer.lowrank, low rank's), which exists with that entry alone;
the fields several codecs share live in outer.codec, each read by the codecs whose entry takes it; a field
added since schema 7 declares its value before it existed (`before`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hypertrain.choices import (
    AsyncRule,
    Backend,
    Compute,
    EngineName,
    Examples,
    InnerName,
    LoggerName,
    MeanWeights,
    Overlap,
    PhaseKind,
    Precision,
    ProcessesName,
    ProcessLayout,
    ProgressLine,
    Reduction,
    RejoinState,
    ReplicaSplit,
    StatePolicy,
    TokenDtype,
    TopkValues,
    Transform,
    WandbMode,
)
from hypertrain.codec_table import ENTRIES as CODEC_ENTRIES
from hypertrain.codec_table import NotACodec, codec_entry
from hypertrain.errors import UserError
from hypertrain.schedule_table import ENTRIES as SCHEDULE_ENTRIES
from hypertrain.schedule_table import schedule_entry

INT64_MAX = 2**63 - 1  # torch, numpy and the checkpoints hold every int of a run as a 64-bit integer
HELDOUT_ROWS_PER_PASS = (
    64  # rows of one held-out forward pass (run.prepare batches them; run.memory sizes them)
)


# A field added to a section declares the value it had in every run written before it, so that such a
# run's config upgrades to what that run did (`records.formats.fill_before`, whatever today's default
# is), without a hand-written step per feature: `field(default=..., metadata=before(VALUE))`.
# tests/test_formats.py lists the fields that existed when this rule began: any other needs `before`.
BEFORE = "before"


def before(value: Any) -> dict[str, Any]:
    """A field's metadata: `value` is what every run written before the field existed did."""
    return {BEFORE: value}


@dataclass
class ModelConfig:
    name: str = "tiny"
    # decoder (one token stream), multistream (several token channels per position, e.g. text and
    # audio codebooks per frame: the input is the sum of the channels' embeddings, one head each), hf
    # (below), or the import path (module.NAME) of a model entry outside the package (docs/extending.md,
    # "A model"; resolved by the preflight's check, `model.spec.model_spec`)
    arch: str = "decoder"
    # model.arch=hf (docs/hf.md): a Hugging Face causal LM, from a local directory holding its
    # config.json and, if any, its weights (`path`; read offline, never remote code), or built from a
    # config's fields (`config`, with its model_type; initialised under `seed`); exactly one of the two
    path: str = field(default="", metadata=before(""))
    config: dict[str, Any] = field(default_factory=dict, metadata=before({}))
    # mixture of experts (docs/moe.md): every layer's SwiGLU MLP becomes n_experts SwiGLU experts of
    # width expert_ffn and a linear router; each token goes to its top_k experts (softmax over all,
    # the chosen k renormalised, as Mixtral), dropless; Mixtral's load-balancing loss, weighted by
    # router_aux_weight, joins the objective
    is_moe: bool = False
    n_experts: int = 8  # E, at least 2
    top_k: int = 2  # experts per token, 1..n_experts
    expert_ffn: int = 0  # each expert's SwiGLU hidden width; at least 1 with is_moe (0: no experts)
    router_aux_weight: float = 0.001  # the load-balancing loss's weight in the objective (Mixtral's)
    # decoder: every token id is below it (256: byte-level tokens for the embedded corpus); 0 = the data's,
    # filled in at start-up (data=prepared sets 0: its corpus's vocabulary; another is refused)
    vocab: int = 256
    # multistream: each channel's vocabulary, in the data's channel order; [] = the data's, filled
    # in at start-up (a list that differs from the data's is refused)
    channel_vocabs: list[int] = field(default_factory=list)
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4  # < n_heads gives grouped-query attention; must divide n_heads
    d_ff: int = 0  # SwiGLU hidden width; 0 = 8/3 * d_model rounded up to a multiple of 16
    rope_theta: float = 10000.0
    init_std: float = 0.02
    norm_eps: float = 1e-6  # RMSNorm's epsilon (Hugging Face's rms_norm_eps)
    compute_dtype: Precision = Precision.fp32  # fp32, or bf16 autocast (weights and optimizer stay fp32)

    def check(self) -> None:
        if self.is_moe:  # which models take experts, model.path or model.config: `model.spec.check_model`
            self.check_experts()
        _at_least("model.expert_ffn", self.expert_ffn, 0)
        _at_least("model.vocab", self.vocab, 0)  # 0: the data's
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads"):
            _at_least(f"model.{name}", getattr(self, name), 1)
        _at_least("model.d_ff", self.d_ff, 0)
        for name in ("rope_theta", "init_std"):
            if not getattr(self, name) > 0:
                raise UserError(f"model.{name}={getattr(self, name)!r} is not valid; valid: > 0")
        if not 0 < self.norm_eps < math.inf:
            raise UserError(f"model.norm_eps={self.norm_eps!r} is not valid; valid: finite, > 0")
        if self.d_model % self.n_heads:
            raise UserError(f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            raise UserError(f"model.d_model/n_heads={self.d_model // self.n_heads} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}"
            )

    def check_experts(self) -> None:
        """The mixture-of-experts fields (with is_moe); UserError naming the first bad one."""
        _at_least("model.n_experts", self.n_experts, 2)
        if not 1 <= self.top_k <= self.n_experts:
            raise UserError(
                f"model.top_k={self.top_k!r} is out of range; valid: 1..model.n_experts={self.n_experts}"
            )
        if self.expert_ffn < 1:
            raise UserError(
                f"model.expert_ffn={self.expert_ffn!r} is not valid with model.is_moe=true; valid: >= 1"
            )
        if not 0 <= self.router_aux_weight < math.inf:
            raise UserError(
                f"model.router_aux_weight={self.router_aux_weight!r} is not valid; valid: finite, >= 0"
            )


@dataclass
class InnerConfig:
    name: InnerName = InnerName.adamw  # adamw, or muon (Muon on hidden matrices, AdamW on the rest)
    H: int = 5  # inner steps per round (the default run: 8 rounds of the strong phase)
    lr: float = 3e-3  # peak learning rate (Muon's is scaled 0.2*sqrt(max(rows, cols)) per matrix)
    warmup_steps: int = 10  # linear warmup over the first updates of the phase
    decay_steps: int = 0  # cosine to lr*min_lr_ratio ends here (updates from the phase start, warmup
    #                       included); 0 = the phase's updates, filled in at start-up
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    rewarmup_steps: int = 0  # > 0: ramp the lr again over the first steps of every round
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    wd: float = 0.1  # decoupled weight decay, on matrices only
    grad_clip: float = 1.0  # per-replica global gradient-norm clip; 0 = off
    micro_batch: int = 0  # rows in one forward pass; 0 = a replica's whole share in one pass
    state_policy: StatePolicy = StatePolicy.carry  # at every sync: carry (kept per replica), reset, average
    muon_momentum: float = 0.95
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_dtype: Precision = Precision.fp32  # fp32 or bf16 for the Newton-Schulz iteration

    def check(self) -> None:
        if not self.eps > 0:
            raise UserError(f"inner.eps={self.eps!r} is not valid; valid: > 0")
        _at_least("inner.H", self.H, 1)
        _at_least("inner.lr", self.lr, 0.0)
        for name in ("warmup_steps", "decay_steps", "rewarmup_steps", "micro_batch", "ns_steps"):
            _at_least(f"inner.{name}", getattr(self, name), 0)
        _at_least("inner.grad_clip", self.grad_clip, 0.0)
        _at_least("inner.wd", self.wd, 0.0)
        for name in ("beta1", "beta2", "muon_momentum"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise UserError(f"inner.{name}={value!r} is out of range; valid: [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:  # 1 = no decay; 0 = the cosine ends at a rate of exactly 0
            raise UserError(f"inner.min_lr_ratio={self.min_lr_ratio!r} is out of range; valid: [0, 1]")


def topk_kept(fraction: float, length: int) -> int:
    """Entries top-k keeps of a block of `length` values: ceil(fraction * length), at least 1.

    The product is rounded to 9 decimals before the ceiling, so a fraction written in decimal keeps
    what it says (0.07 of 100 keeps 7, not the 8 that 0.07's binary excess would give).
    """
    return max(1, math.ceil(round(fraction * length, 9)))


@dataclass
class ArrivalsConfig:
    """outer.arrivals: the asynchronous server's own fields (docs/async.md), a node that exists only with
    outer.schedule=async (older spellings: outer.async_rule, outer.dn_buffer, ...: records.formats)."""

    # the server's step on an arrival: naive (outer.optimizer's step on it) or delayed_nesterov (Liu et
    # al. 2024, Algorithm 3: momentum updated once per dn_buffer arrivals; the built-in only)
    rule: AsyncRule = AsyncRule.delayed_nesterov
    dn_buffer: int = 0  # delayed_nesterov: N, the arrivals per momentum update; 0 = replicas (R)
    dn_activation: float = 0.0  # delayed_nesterov: c in [0, 1/N], the momentum applied between updates
    # arrivals within grace_s seconds of a group's first are applied together, as one mean (Decoupled
    # DiLoCo's grace window); 0 = only exact ties
    grace_s: float = 0.0
    # dynamic local updates (Liu et al. Eq. 6): replica m's job is H_m = max(1, floor(v_m / max v * H))
    dylu: bool = False
    # the held-out loss after the server update at which the jobs applied reach each multiple of this
    # many (and after the last); 0 = replicas (R): with ties of all R, every update
    eval_every: int = 0

    def check(self) -> None:
        _at_least("outer.arrivals.dn_buffer", self.dn_buffer, 0)
        _at_least("outer.arrivals.grace_s", self.grace_s, 0.0)
        _at_least("outer.arrivals.eval_every", self.eval_every, 0)


@dataclass
class TopKConfig:
    """outer.topk: top-k's own fields (docs/compression.md), a node that exists only with outer.compress=topk
    (older spellings: outer.topk_fraction, outer.index_bits, outer.topk_values: records.formats)."""

    fraction: float = 0.01  # the fraction of each block sent, in (0, 1]
    # 32 (int32 indices in the vector) or 12 (each index within its block, two in three bytes;
    # outer.codec.block <= 4096 and an even k of a whole block)
    index_bits: int = 32
    # how the kept values travel: fp32, fp16, int8 (one fp32 scale per block) or two_bit (templar's: per
    # tensor an fp32 shift and four fp32 reconstruction values, then 2 bits a value)
    values: TopkValues = TopkValues.fp32

    def check(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise UserError(f"outer.topk.fraction={self.fraction!r} is out of range; valid: (0, 1]")
        if self.index_bits not in (32, 12):
            raise UserError(f"outer.topk.index_bits={self.index_bits!r} is not valid; valid: 32 or 12")


@dataclass
class LowRankConfig:
    """outer.lowrank: low rank's own fields (PowerSGD; docs/compression.md), a node that exists only with
    outer.compress=lowrank (older spelling: outer.lowrank_rank: records.formats)."""

    # the rank r of each matrix's factors P [rows, r] and Q [cols, r] (a tensor of more dims is
    # [shape[0], rest]; r is cut to min(rows, cols)); 1-D tensors are sent exact in fp32
    rank: int = 4

    def check(self) -> None:
        _at_least("outer.lowrank.rank", self.rank, 1)


@dataclass
class CodecConfig:
    """outer.codec: the fields several codecs share (docs/compression.md); each codec's entry says which it
    reads (`codec_table.Codec.takes`), and under a codec that does not read one it stays at its default
    (`check_taken`). Older spellings: outer.block, outer.tile, outer.transform, outer.error_decay
    (records.formats)."""

    # values per block (a tensor's last block may be shorter): one scale, or one top-k chunk; beyond the
    # largest tensor synced it is that tensor's size (each tensor one block: tiles.blocks_and_order)
    block: int = 128
    # The blocks' order: 0 (each tensor's values in order, cut in blocks of outer.codec.block) or T
    # (SparseLoCo's chunks, templar's rule: each side cut at its largest divisor <= T, a matrix read chunk
    # after chunk, one chunk a block, T x T tiles where the sides are multiples of T; top-k keeps a whole
    # tile's k of every chunk; outer.codec.block must be T * T). The block codecs'.
    tile: int = 0
    # What each block becomes before the codec: none (itself) or dct (its orthonormal DCT-II coefficients,
    # as DeMo's chunks: top-k then keeps the largest frequency components; decoded by the inverse). Error
    # feedback stays in the parameter domain. The block codecs'.
    transform: Transform = Transform.none
    # SparseLoCo's decay beta of the error buffers (Sarfi et al. 2025; docs/compression.md): a replica
    # compresses u = beta * e + delta and keeps e <- u - decoded; 1.0 = plain error feedback, in [0, 1].
    # The codecs' that feed back what they leave out (with outer.error_feedback=true).
    error_decay: float = 1.0
    # How the payloads are reduced: gather (every payload to every process, decoded and summed in replica
    # order) or two_phase (shards by replica index, all-to-all, each shard's mean re-encoded and
    # all-gathered: fewer bytes, a second quantization; a codec whose entry says `gather_only` refuses it).
    # The block codecs'.
    reduce: Reduction = field(default=Reduction.gather, metadata=before(Reduction.gather))

    def check_taken(self, codec) -> None:
        """A field the codec's entry `codec` does not read (`takes`) stays at its default: one line naming
        it, its value and the codecs that read it."""
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), default_of(CodecConfig, f.name)
            if f.name in codec.takes or value == default:
                continue
            readers = [entry.name for entry in CODEC_ENTRIES if f.name in entry.takes]
            raise UserError(
                f"outer.codec.{f.name}={_plain(value)} is not read by outer.compress={codec.name}; valid: a "
                f"codec that reads it ({', '.join(readers)}), or outer.codec.{f.name}={_plain(default)} (its "
                "default)"
            )

    def check(self) -> None:
        _at_least("outer.codec.block", self.block, 1)
        _at_least("outer.codec.tile", self.tile, 0)
        if self.tile and self.block != self.tile * self.tile:
            raise UserError(
                f"outer.codec.tile={self.tile} with outer.codec.block={self.block}: a tile is one block; "
                f"valid: outer.codec.block={self.tile * self.tile}, or outer.codec.tile=0"
            )
        if not 0.0 <= self.error_decay <= 1.0:
            raise UserError(f"outer.codec.error_decay={self.error_decay!r} is out of range; valid: [0, 1]")


def _plain(value: Any) -> str:
    """A field's value as the command line writes it (an enum by its value)."""
    return str(value.value if isinstance(value, Enum) else value)


@dataclass
class OuterConfig:
    name: str = "nesterov"
    # The outer optimizer (docs/concepts.md, "The outer optimizer"; `hypertrain.optim.outer`'s table):
    # nesterov (the built-in step: SGD with momentum on the mean pseudo-gradient, its fields
    # outer.momentum and outer.nesterov), or the import path of any torch.optim.Optimizer subclass
    # (torch.optim.Adam), built with lr=outer.lr and outer.optimizer_args, which the built-in's fields
    # then do not reach. Under outer.schedule=async, outer.arrivals.rule=naive steps it on each update.
    optimizer: str = "nesterov"
    # a torch optimizer's keyword arguments beside lr (e.g. {betas: [0.8, 0.9]}); {} for the built-in
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    lr: float = 0.7  # every outer optimizer's learning rate
    momentum: float = 0.9
    nesterov: bool = True
    # Streaming DiLoCo (docs/streaming.md): P fragments of the model, each synced once per round of H
    # updates on a staggered schedule (fragment p after updates k*H + (p+1)*H/P); P must divide H.
    # 1 = DiLoCo, every parameter synced at the round's end.
    fragments: int = 1
    # tau: a fragment's pseudo-gradient is taken tau updates before its sync point and its reduction
    # overlaps those updates; 0 <= tau < H/P.
    delay: int = 0
    # At a fragment's sync each replica's weights become lerp(global_new, local_now, merge_alpha);
    # 0 = the new global weights (with delay > 0 the last tau updates' local progress is dropped).
    merge_alpha: float = 0.0
    # Derived, written to the run's config: the parameters of each fragment, in fragment order
    # (layer i in fragment i mod P, the embeddings in fragment 0, the final norm and head in P-1).
    assignment: list[str] = field(default_factory=list)
    # Compressed pseudo-gradients (docs/compression.md): what each replica sends at a sync. none (fp32,
    # a summing all-reduce), int8, uint8 (min-max), fp8_e4m3, fp8_e5m2, fp4_e2m1, e3m0 (a sign and a power
    # of two in 4 bits; these with one fp32 scale per block), or topk (the largest-magnitude
    # outer.topk.fraction of each block, fp32 values and int32 indices), lowrank; or the import path
    # (module.NAME) of a codec entry outside the package (docs/extending.md, "A codec"). Each replica's
    # contribution is its own decoded payload.
    compress: str = "none"
    # compress=topk only: its own fields (fraction, index_bits, values); None under another codec
    topk: TopKConfig | None = field(default=None, metadata=before(None))
    # the fields several codecs share (block, tile, transform, error_decay), each read by the codecs whose
    # entry takes it (`codec_table.Codec.takes`); under another codec a field stays at its default
    codec: CodecConfig = field(default_factory=CodecConfig, metadata=before(CodecConfig()))
    # Error feedback: what compression left out of a replica's pseudo-gradient is added to its next one.
    error_feedback: bool = False
    # An outer step overlapping a whole round (docs/overlap.md): none (today's sync), delayed (the
    # reduction started at the end of round t is applied at the end of round t+1, while round t+1
    # trains) or eager (as delayed, each replica's own fresh pseudo-gradient in place of its stale one,
    # per-replica outer weights and momentum; Kale, Douillard, Donchev 2025). outer.delay must be 0.
    overlap: Overlap = Overlap.none
    # compress=lowrank only (PowerSGD; docs/compression.md): its own fields; None under another codec
    lowrank: LowRankConfig | None = field(default=None, metadata=before(None))
    # Asynchronous replicas (docs/async.md): rounds (every replica syncs at a round's end) or async (a
    # replica's job of H_m inner steps from the weights it pulled; its pseudo-gradient is applied when
    # the network clock says it arrives; no barrier); or the import path (module.NAME) of a schedule
    # entry outside the package (docs/extending.md, "A schedule").
    schedule: str = "rounds"
    # async only (docs/async.md): the server's own fields; None under rounds, which has no such node
    # (setting one there is refused as a field rounds lacks: `OuterConfig.check_nodes`)
    arrivals: ArrivalsConfig | None = field(default=None, metadata=before(None))
    # pseudo-gradients averaged uniformly or weighted by the tokens each trained on (docs/async.md)
    mean_weights: MeanWeights = MeanWeights.uniform

    def __post_init__(self) -> None:
        """A table entry's own node (its `node`: a schedule's, a codec's) exists with that entry alone:
        at its defaults when not given; under another entry None, unless set there (`check_nodes`)."""
        for owner, entry in node_owners():
            node, kind = getattr(self, entry.node), OUTER_NODES[entry.node]
            if entry.name == str(getattr(self, owner)) and node is None:
                setattr(self, entry.node, kind())
            elif entry.name != str(getattr(self, owner)) and node == kind():
                setattr(self, entry.node, None)

    def check_nodes(self) -> None:
        """A node of an entry not chosen does not exist: a field of it set is one the chosen entry lacks,
        one line naming it and where it lives; a node that exists checks its own fields."""
        for owner, entry in node_owners():
            node, chosen = getattr(self, entry.node), getattr(self, owner)
            if node is not None and entry.name != str(chosen):
                default = type(node)()
                name = next(
                    f.name
                    for f in dataclasses.fields(node)
                    if getattr(node, f.name) != getattr(default, f.name)
                )
                raise UserError(
                    f"outer.{entry.node}.{name} is not a field of outer.{owner}={chosen}: outer.{entry.node} "
                    f"exists only with outer.{owner}={entry.name}; valid: outer.{owner}={entry.name}, or no "
                    f"outer.{entry.node}.*"
                )
            if node is not None:
                node.check()

    def check(self) -> None:
        try:  # the codec's entry, a path imported here once (`codec_table.imported`): what the rest asks
            codec = codec_entry(self.compress)
        except NotACodec as error:
            raise UserError(str(error)) from None
        schedule_entry(self.schedule)  # refused when none; a path imported once (`schedule_table.imported`)
        self.check_nodes()
        _at_least("outer.lr", self.lr, 0.0)
        if not 0.0 <= self.momentum < 1.0:
            raise UserError(f"outer.momentum={self.momentum!r} is out of range; valid: [0, 1)")
        _at_least("outer.fragments", self.fragments, 1)
        _at_least("outer.delay", self.delay, 0)
        if not 0.0 <= self.merge_alpha <= 1.0:
            raise UserError(f"outer.merge_alpha={self.merge_alpha!r} is out of range; valid: [0, 1]")
        if self.error_feedback and not codec.error_feedback:
            raise UserError(
                "outer.error_feedback=true with outer.compress=none has nothing to feed back; valid: a "
                "compressor, or outer.error_feedback=false"
            )
        self.codec.check_taken(codec)
        self.codec.check()
        self.check_sparseloco()
        if self.overlap != "none" and self.delay:
            raise UserError(
                f"outer.delay={self.delay} with outer.overlap={self.overlap}: the reduction already overlaps "
                "a whole round; valid: outer.delay=0, or outer.overlap=none"
            )
        if self.overlap != "none" and self.merge_alpha:
            raise UserError(
                f"outer.merge_alpha={self.merge_alpha!r} with outer.overlap={self.overlap} is not built; "
                "valid: outer.merge_alpha=0, or outer.overlap=none"
            )
        self.check_codec()

    def check_codec(self) -> None:
        """What the codec's entry (`codec_table`) says it cannot run with: two_phase, overlap."""
        codec = codec_entry(self.compress)
        if self.codec.reduce == "two_phase" and codec.gather_only:
            raise UserError(
                f"outer.compress={self.compress} with outer.codec.reduce=two_phase: {codec.gather_only}; "
                "valid: outer.codec.reduce=gather"
            )
        if self.overlap != "none" and not codec.overlap:
            raise UserError(
                f"outer.compress={self.compress} with outer.overlap={self.overlap} is not built; valid: "
                "outer.overlap=none, or another outer.compress"
            )

    def check_sparseloco(self) -> None:
        """error_decay, and top-k's index_bits against the blocks (SparseLoCo's pieces)."""
        decay = self.codec.error_decay
        if decay != 1.0 and not self.error_feedback:
            raise UserError(
                f"outer.codec.error_decay={decay!r} without error feedback decays no buffer; valid: "
                "outer.error_feedback=true, or outer.codec.error_decay=1.0"
            )
        if self.topk is None or self.topk.index_bits != 12:  # top-k's node: with outer.compress=topk alone
            return
        block = self.codec.block
        if block > 4096:
            raise UserError(
                f"outer.topk.index_bits=12 with outer.codec.block={block}: 12 bits index a block of at most "
                "4096; valid: outer.codec.block <= 4096, or outer.topk.index_bits=32"
            )
        k = topk_kept(self.topk.fraction, block)
        if k % 2 and block < 2:  # a block of one value keeps k = 1 at any fraction: no even k exists
            raise UserError(
                f"outer.topk.index_bits=12 with outer.codec.block={block} keeps k = 1 of each block, an odd "
                "number (12-bit indices pack two in three bytes); valid: outer.codec.block >= 2, or "
                "outer.topk.index_bits=32"
            )
        if k % 2:
            even = k + 1 if k < block else k - 1
            raise UserError(
                f"outer.topk.index_bits=12 with outer.topk.fraction={self.topk.fraction!r} keeps k = {k} of "
                f"a {block}-value block, an odd number (12-bit indices pack two in three bytes); valid: "
                f"an even k, e.g. outer.topk.fraction={even / block!r} (k = {even}), or "
                "outer.topk.index_bits=32"
            )


# The outer nodes a table entry owns (its `node` names one): the typed config each holds.
OUTER_NODES: dict[str, type] = {"arrivals": ArrivalsConfig, "lowrank": LowRankConfig, "topk": TopKConfig}


def node_owners() -> list[tuple[str, Any]]:
    """(the outer field that chooses it, the entry) of every schedule and codec entry owning a node."""
    owners = [("schedule", entry) for entry in SCHEDULE_ENTRIES] + [("compress", e) for e in CODEC_ENTRIES]
    return [(owner, entry) for owner, entry in owners if entry.node]


def nodes_chosen(outer: dict) -> set[str]:
    """The nodes a recorded outer section (plain containers, as config.yaml holds it) has: those of the
    entries it chose (a field it lacks at its default)."""
    return {
        entry.node
        for owner, entry in node_owners()
        if str(outer.get(owner, default_of(OuterConfig, owner))) == entry.name
    }


@dataclass
class PhaseConfig:
    """A benchmark phase. `kind` strong uses `global_batch`; weak uses `base_world` and `per_rank_batch`."""

    name: str = "strong"
    kind: PhaseKind = PhaseKind.strong  # strong or weak
    offset: int = 0  # first id of the phase in the stream
    global_batch: int = 256  # strong: ids per update
    base_world: int = 8  # weak: B, the world whose streams are replicated; world must be k*B
    per_rank_batch: int = 32  # weak: b, ids per rank per update
    updates: int = 40
    timing_warmup: int = 10  # first updates left out of train/replica_steps_per_s (none left if >= updates)


@dataclass
class WorldConfig:
    size: int = 8  # simulated (or, under torchrun, real) number of ranks W

    def check(self) -> None:
        _at_least("world.size", self.size, 1)


@dataclass
class DataConfig:
    # stdlib (embedded), text_files, token_bin, prepared, speech (data=NAME, conf/data/); or the import path
    # (module.NAME) of a data source outside the package (docs/extending.md, "A data source")
    name: str = "stdlib"
    # text_files: a glob of the user's files; token_bin: the token file; prepared: the directory
    # `python -m hypertrain.data prepare` wrote (docs/data.md); speech: a glob of the text to
    # speak ("" = the stdlib's docstrings and comments; a glob ending in .py reads the docstrings and
    # comments of those files, any other glob plain text)
    path: str = ""
    token_dtype: TokenDtype = TokenDtype.uint16  # token_bin: uint16 or uint32
    examples: Examples = Examples.windows  # windows (fixed seq_len + 1 ids) or documents (variable length)
    seq_len: int = 64  # windows: tokens the model reads per row (each row holds seq_len + 1 ids)
    max_len: int = 256  # documents: a paragraph is cut at max_len + 1 ids (max_len targets)
    heldout: int = 256  # the last ids of the stream, never trained on, for the held-out loss
    # prepared: windows may run from one document into the next (true, the eod between them) or stay
    # inside one document, its eod included (false)
    window_across_documents: bool = True
    # prepared: iid (every replica samples every source) or by_source (replica m trains only on source
    # m mod S of the corpus's S sources; S must divide replicas)
    replica_split: ReplicaSplit = ReplicaSplit.iid
    max_padded_tokens: int = 12000  # documents, speech: bound on rows * longest row in one microbatch
    max_examples: int = 16  # documents, speech: bound on rows in one microbatch
    shuffle_seed: int = 0  # order of windows / documents / utterances in the stream
    # speech: espeak-ng speech of the source's sentences; per 80 ms frame one text token and
    # `codebooks` residual-VQ codes of its log-mel. Built once into a cache directory keyed by every
    # field below but `audio_delay` and `cache_dir` (python -m hypertrain.data.speech build; docs/audio.md).
    speech_voice: str = "en-us"  # an espeak-ng voice, as `espeak-ng --voices` names it (+variant allowed)
    speech_rate: int = 175  # words per minute (espeak-ng's default)
    speech_sentences: int = 17000  # sentences spoken: a seeded sample of the source's distinct ones; 0 = all
    speech_max_words: int = 24  # a longer sentence is cut into near-equal pieces of at most this many words
    speech_seed: int = 0  # the sentence sample and the quantiser's k-means
    mel_bins: int = 80  # log-mel bins per frame
    codebooks: int = 12  # K: residual-VQ stages, one token channel each (the seed's 12)
    codebook_size: int = 1024  # entries per stage
    quantizer_frames: int = 32768  # frames sampled to fit the quantiser (at least codebook_size)
    text_vocab: int = 4096  # the text channel's byte-level BPE vocabulary, its PAD and END included
    audio_delay: int = 1  # frames codebooks 2..K lag the text and codebook 1 (Moshi's acoustic delay)
    cache_dir: str = ""  # where speech datasets are built; "" = $XDG_CACHE_HOME/hypertrain/speech

    def check_speech(self) -> None:
        """The speech fields' ranges; UserError (one line) naming the first bad one."""
        for name in ("speech_rate", "speech_max_words", "mel_bins", "codebooks"):
            _at_least(f"data.{name}", getattr(self, name), 1)
        for name in ("speech_sentences", "speech_seed", "audio_delay"):
            _at_least(f"data.{name}", getattr(self, name), 0)
        _at_least("data.codebook_size", self.codebook_size, 2)
        _at_least("data.quantizer_frames", self.quantizer_frames, self.codebook_size)
        _at_least("data.text_vocab", self.text_vocab, 258)  # PAD, END and the 256 byte symbols
        for name in ("codebook_size", "text_vocab"):  # codes and text tokens are stored as uint16
            if getattr(self, name) > 65536:
                raise UserError(f"data.{name}={getattr(self, name)} is too large; valid: <= 65536")
        if not self.speech_voice.strip():
            raise UserError("data.speech_voice is empty; valid: an espeak-ng voice, e.g. 'en-us'")

    def check(self) -> None:
        """The fields every source reads; what one source needs of them (data.path, speech's fields,
        ...) is its entry's `check` in the data sources' table (`hypertrain.data`), asked by
        `preflight.checks.validate` right after this."""
        _at_least("data.shuffle_seed", self.shuffle_seed, 0)  # numpy's seeds are non-negative
        _at_least("data.seq_len", self.seq_len, 1)
        _at_least("data.max_len", self.max_len, 2)
        _at_least("data.heldout", self.heldout, 1)
        _at_least("data.max_examples", self.max_examples, 1)
        if self.examples == "documents" and self.max_padded_tokens < self.max_len + 1:
            raise UserError(
                f"data.max_padded_tokens={self.max_padded_tokens} is smaller than the longest example "
                f"(data.max_len + 1 = {self.max_len + 1} ids); valid: >= {self.max_len + 1}"
            )


@dataclass
class EngineConfig:
    # How a process computes its replicas: stacked (all replicas of a sub-round as one model with a
    # leading replica axis, the fast path) or loop (one after another, the reference); docs/parity.md
    name: EngineName = EngineName.stacked
    stack: int = 0  # stacked: replicas per sub-round; 0 = all of the process's replicas
    device: str = "cpu"
    threads: int = 0  # torch intra-op threads; 0 = torch's default; at most the CPUs a process may use
    compile: bool = False  # torch.compile the loss (forward and backward) and the inner optimizer step

    def check(self) -> None:
        _at_least("engine.stack", self.stack, 0)
        _at_least("engine.threads", self.threads, 0)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if self.threads > cpus:  # more only oversubscribes; far more, OpenMP cannot start (a segfault)
            raise UserError(
                f"engine.threads={self.threads} is more than the {cpus} CPUs this process may use; "
                f"valid: 0 (torch's default) to {cpus}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise UserError(f"engine.device={self.device!r} is not valid; valid: 'cpu', 'cuda', 'cuda:N'")


TIMEOUT_MAX_S = 365 * 24 * 3600


@dataclass
class ProcessesConfig:
    # How many processes hold the replicas and how they talk: one (this process holds every replica:
    # the simulation) or dist (P real processes, torch.distributed; docs/distributed.md)
    name: ProcessesName = ProcessesName.one
    nproc: int = 0  # dist: processes P; 0 = the launcher's count under torchrun or srun, else world.size
    layout: ProcessLayout = ProcessLayout.auto  # dist: benchmark (P = W), replicas (P divides R), or auto
    timeout_s: float = 30.0  # dist: a collective waiting longer (a dead or hung rank) stops the run
    backend: Backend = Backend.auto  # dist: gloo, nccl, or auto (nccl on cuda devices, else gloo)
    # dist, self-launched: how often torch's agent may restart every worker after one failed, each
    # restart resuming from the newest checkpoint (docs/resume.md, "Restarts"); under torchrun its
    # --max-restarts decides (0 here, or the same number)
    max_restarts: int = 0
    # dist, benchmark layout: each replica's weights, gradients and inner optimizer state sharded over
    # its L ranks with FSDP2, the sync per shard (docs/distributed.md, "Sharded replicas")
    shard: bool = field(default=False, metadata=before(False))

    def check(self) -> None:
        _at_least("processes.nproc", self.nproc, 0)
        if self.max_restarts < 0:
            raise UserError(
                f"processes.max_restarts={self.max_restarts!r} is not valid; valid: >= 0 (0: a failed "
                "worker ends the run)"
            )
        # below a second gloo's own waits time out inside torch (C++ frames); above a year torch's
        # timedelta overflows on rank 0 and the cause never reaches the one line
        if not 1 <= self.timeout_s <= TIMEOUT_MAX_S:
            raise UserError(
                f"processes.timeout_s={self.timeout_s:g} is out of range; valid: 1 to {TIMEOUT_MAX_S} "
                "seconds (a year)"
            )
        if self.name != "dist" and (self.nproc or self.layout != "auto" or self.max_restarts or self.shard):
            what = f"processes.nproc={self.nproc}" if self.nproc else f"processes.layout={self.layout!r}"
            what = f"processes.max_restarts={self.max_restarts}" if self.max_restarts else what
            what = "processes.shard=true" if self.shard else what
            raise UserError(
                f"{what} applies to processes=dist only (now processes={self.name}); valid: processes=dist"
            )


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.wandb  # wandb or none (metrics.jsonl is always written)
    project: str = "hypertrain"
    mode: WandbMode = WandbMode.offline  # offline, online or disabled; WANDB_MODE in the environment wins
    group: str = ""  # empty = the experiment name, or the sweep's name in a multirun
    entity: str = ""
    progress: ProgressLine = ProgressLine.auto  # auto (a live line only on a terminal), always, never


@dataclass
class CheckpointConfig:
    every: int = 1  # write a checkpoint after every `every` syncs (and after the last); 0 = never
    keep: int = 2  # checkpoints kept in run_dir/checkpoints (the newest)
    # > 0: also a checkpoint in the middle of a round whenever the updates done since the phase's
    # start are a multiple of it (a round's end is a sync's checkpoint, `every`); 0 = syncs only.
    # A stop signal (SIGTERM, SIGUSR2) always checkpoints where it stops (docs/resume.md).
    every_updates: int = 0

    def check(self) -> None:
        _at_least("checkpoint.every", self.every, 0)
        _at_least("checkpoint.keep", self.keep, 1)
        _at_least("checkpoint.every_updates", self.every_updates, 0)


@dataclass
class GuardConfig:
    """The divergence guard: at every sync the run stops (exit 1, one line naming the update and the
    figure; records closed, checkpoints intact) when the global weights have diverged without a
    non-finite number (a non-finite one always stops it)."""

    enabled: bool = True  # false: only non-finite numbers stop a run
    # the held-out loss may exceed the uniform prediction's loss by at most this many nats (ln vocab;
    # multistream: each channel's ln vocab weighted as the loss weighs the channels)
    heldout_margin: float = 1.0
    # the pseudo-gradient's norm may be at most this many times the global weights' norm before the sync
    pseudo_grad_ratio: float = 1000.0
    # Before anything is made: refuse a run whose estimated memory (hypertrain/preflight/memory.py: weights,
    # optimizer state, activations, batches, per process) exceeds 90% of the memory available (host,
    # and the GPU's on engine.device=cuda); false skips the comparison (a tensor larger than torch can
    # index is refused still). A guard: it changes no number, so a resumed run may change it.
    memory_check: bool = True

    def check(self) -> None:
        _at_least("guard.heldout_margin", self.heldout_margin, 0.0)
        if not self.pseudo_grad_ratio > 0:
            raise UserError(f"guard.pseudo_grad_ratio={self.pseudo_grad_ratio!r} is not valid; valid: > 0")


# The ranges that keep the network clock's seconds finite, training's and the clock command's alike
# (ClusterConfig.check). A straggler factor is exp(sigma * z), z numpy's standard normal: |z| < 12.3 (its
# ziggurat's tail, 3.65 + sqrt(2 * 53 ln 2)), and exp overflows float64 past 709, so sigma <= 10 keeps every
# factor below e^123 (1e53). With compute of at least 1 FLOP/s (peak_tflops and mfu >= 1e-6) and links of
# at least 1 bit/s and at most 1e12 us (11.6 days) a message, a run of int64-many updates of int64-many
# tokens and bytes stays below 1e120 simulated seconds, far from float64's 1.8e308. A replica's speed v
# divides its steps' seconds: drawn (exp(speed_sigma * z), the same sigma bound) it is at least e^-123
# (3.6e-54), and a given one must be at least 1e-54, so 1 / v stays below 1e54 and the clock below 1e174
# seconds (a subnormal speed such as 1e-320 made 1 / v infinite).
MAX_STRAGGLER_SIGMA = 10.0
MIN_REPLICA_SPEED = 1e-54
MIN_PEAK_TFLOPS = MIN_MFU = 1e-6
MIN_BANDWIDTH_GBIT = 1e-9
MAX_LATENCY_US = 1e12


@dataclass
class LinkConfig:
    """One tier of the network clock's links (docs/clock.md): alpha-beta, one message per ring step."""

    name: str = "infiniband"  # the preset chosen (`LINKS`), a label only; every number overridable
    bandwidth_gbit: float = 400.0  # beta, Gbit/s (1e9 bits per second) one way, per participant
    latency_us: float = 5.0  # alpha, microseconds per message (one way)

    @property
    def bandwidth(self) -> float:
        """beta in bytes per second."""
        return self.bandwidth_gbit * 1e9 / 8

    @property
    def latency(self) -> float:
        """alpha in seconds."""
        return self.latency_us * 1e-6

    def check(self, prefix: str) -> None:
        if not self.bandwidth_gbit >= MIN_BANDWIDTH_GBIT:
            raise UserError(
                f"{prefix}.bandwidth_gbit={self.bandwidth_gbit!r} is out of range; valid: >= "
                f"{MIN_BANDWIDTH_GBIT:g} (Gbit/s: 1 bit/s)"
            )
        if not 0 <= self.latency_us <= MAX_LATENCY_US:
            raise UserError(
                f"{prefix}.latency_us={self.latency_us!r} is out of range; valid: [0, {MAX_LATENCY_US:g}] "
                "(microseconds)"
            )


# The link presets (cluster/intra=NAME, cluster/inter=NAME), registered with Hydra by preflight/schema.py;
# bandwidth one way per participant, latency one way per message. Sources in docs/clock.md.
LINKS = {
    "nvlink": LinkConfig("nvlink", 3600.0, 2.0),  # H100 NVLink 4: 450 GB/s each way
    "infiniband": LinkConfig("infiniband", 400.0, 5.0),  # NDR, one 400 Gbit/s port per GPU
    "datacenter_100g": LinkConfig("datacenter_100g", 100.0, 10.0),  # 100 GbE inside one data centre
    "cross_region_10g": LinkConfig("cross_region_10g", 10.0, 30_000.0),  # 10 Gbit/s, 30 ms one way
    "internet_1g": LinkConfig("internet_1g", 1.0, 50_000.0),  # 1 Gbit/s, 50 ms one way
}


@dataclass
class StragglerConfig:
    """Seeded slowdowns: in round k replica m computes `exp(sigma * z)` times as long, z a standard normal
    drawn from numpy's `default_rng([seed, k])` (R draws, replica order): lognormal with median 1. A sync
    waits for the slowest replica, so every update of round k takes the round's largest factor."""

    sigma: float = 0.0  # 0 = no stragglers (every factor exactly 1)
    seed: int = 0

    def check(self) -> None:
        if not 0 <= self.sigma <= MAX_STRAGGLER_SIGMA:
            raise UserError(
                f"cluster.straggler.sigma={self.sigma!r} is out of range; valid: [0, {MAX_STRAGGLER_SIGMA:g}]"
            )
        _at_least("cluster.straggler.seed", self.seed, 0)  # numpy's seeds are non-negative


@dataclass
class ClusterConfig:
    """The cluster the network clock simulates (docs/clock.md): per-replica compute and two link tiers.
    It changes no weight, only the simulated seconds a run records (so a resumed run keeps it);
    `python -m hypertrain.clock` re-times a finished run on another."""

    name: str = "cpu_here"  # the preset chosen (conf/cluster/), a label only
    # measured (the run's own seconds per update: its slowest process's) or modelled
    # (6 * params * tokens of a replica / (peak_tflops * 1e12 * mfu))
    compute: Compute = Compute.measured
    peak_tflops: float = 0.1  # modelled: one replica's peak, TFLOP/s (1e12 FLOP/s) in the dtype trained
    mfu: float = 0.3  # modelled: the fraction of the peak reached, in [1e-6, 1]
    intra: LinkConfig = field(default_factory=lambda: dataclasses.replace(LINKS["infiniband"]))
    inter: LinkConfig = field(default_factory=lambda: dataclasses.replace(LINKS["datacenter_100g"]))
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    # Each replica's persistent speed v_m (docs/async.md; a step takes 1 / v_m times its seconds, on top of
    # the stragglers): this list (R positive numbers), or, when it is empty, drawn once as
    # exp(speed_sigma * z), z standard normals from numpy's default_rng(speed_seed). Under rounds they
    # time the clock only (a sync waits for the slowest); under outer.schedule=async they order arrivals.
    replica_speeds: list[float] = field(default_factory=list)
    speed_sigma: float = 0.0
    speed_seed: int = 0
    # N, the parameters the clock times while training (bytes and modelled compute scaled by N / the
    # trained model's, as the clock command's model_params); 0 = the trained model's
    model_params: int = 0

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    def check(self) -> None:
        """Every field, as training checks it and the clock command (`python -m hypertrain.clock`) too:
        finite numbers, in the ranges that keep the clock's seconds finite (MAX_STRAGGLER_SIGMA's), and
        speeds given or drawn, not both (their count against a run's R: `check_replicas`)."""
        check_finite_floats(self, "cluster.")
        check_int64(self, "cluster.")
        if not self.peak_tflops >= MIN_PEAK_TFLOPS:
            raise UserError(
                f"cluster.peak_tflops={self.peak_tflops!r} is out of range; valid: >= {MIN_PEAK_TFLOPS:g} "
                "(TFLOP/s)"
            )
        if not MIN_MFU <= self.mfu <= 1.0:
            raise UserError(f"cluster.mfu={self.mfu!r} is out of range; valid: [{MIN_MFU:g}, 1]")
        self.intra.check("cluster.intra")
        self.inter.check("cluster.inter")
        self.straggler.check()
        if not all(MIN_REPLICA_SPEED <= speed < math.inf for speed in self.replica_speeds):
            raise UserError(
                f"cluster.replica_speeds={self.replica_speeds!r} is out of range; valid: finite numbers >= "
                f"{MIN_REPLICA_SPEED:g} (1 = the cluster's step time)"
            )
        if not 0 <= self.speed_sigma <= MAX_STRAGGLER_SIGMA:
            raise UserError(
                f"cluster.speed_sigma={self.speed_sigma!r} is out of range; valid: "
                f"[0, {MAX_STRAGGLER_SIGMA:g}]"
            )
        if self.replica_speeds and self.speed_sigma:
            raise UserError(
                f"cluster.replica_speeds with cluster.speed_sigma={self.speed_sigma!r}: the speeds are given "
                "or drawn, not both; valid: cluster.speed_sigma=0, or cluster.replica_speeds=[]"
            )
        _at_least("cluster.speed_seed", self.speed_seed, 0)  # numpy's seeds are non-negative
        _at_least("cluster.model_params", self.model_params, 0)

    def check_replicas(self, replicas: int) -> None:
        """The speeds given fit a run of `replicas` (R): one each, or none (drawn or equal). Training's
        preflight and the clock command (each run it times, by its own R) ask it alike."""
        if self.replica_speeds and len(self.replica_speeds) != replicas:
            raise UserError(
                f"cluster.replica_speeds={self.replica_speeds!r} has {len(self.replica_speeds)} speeds; "
                f"valid: one per replica ({replicas}), or []"
            )


CHURN_EVENTS = ("miss", "leave", "rejoin")


@dataclass
class ChurnConfig:
    """Seeded churn (docs/churn.md): per round (H updates) and replica, drawn from `seed` by one
    documented rule (`diloco.churn`), a replica *misses* its sync (trains; its pseudo-gradient is
    discarded, count 0) or *leaves* for a geometric number of rounds (absent: trains nothing, count 0)
    and rejoins from the global weights. `events` adds hand-written ones; a sync with fewer contributors
    than `min_quorum` is skipped; `deadline` stops slow replicas (the clock's modelled step times and
    stragglers). The defaults are no churn: today's runs, bitwise."""

    p_miss: float = 0.0  # per round and present replica
    p_leave: float = 0.0  # per round and present replica
    mean_absence: float = 2.0  # rounds, the mean of the geometric absence (>= 1)
    rejoin_state: RejoinState = RejoinState.reset  # a rejoining replica's inner state: reset (zeros) or carry
    events: list[str] = field(default_factory=list)  # "ROUND:REPLICA:EVENT", EVENT one of CHURN_EVENTS
    min_quorum: int = 1  # a sync with fewer contributing replicas is skipped (1: only an empty one)
    seed: int = 0
    # seconds of modelled compute from a round's start (0: none, a sync waits for every replica): a
    # replica, slowed by the cluster's stragglers, contributes the inner steps it finished by then
    deadline: float = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.p_miss or self.p_leave or self.events or self.min_quorum > 1 or self.deadline)

    def parsed_events(self) -> list[tuple[int, int, str]]:
        """`events` as (round, replica, event), checked: one line naming a bad one."""
        out = []
        for text in self.events:
            parts = str(text).split(":")
            ok = len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() and int(parts[0]) >= 1
            if not ok or parts[2] not in CHURN_EVENTS:
                raise UserError(
                    f"churn.events entry {text!r} is not valid; valid: 'ROUND:REPLICA:EVENT' with "
                    f"ROUND >= 1, REPLICA >= 0 and EVENT one of {', '.join(CHURN_EVENTS)}"
                )
            out.append((int(parts[0]), int(parts[1]), parts[2]))
        return out

    def check(self, replicas: int) -> None:
        for name in ("p_miss", "p_leave"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise UserError(f"churn.{name}={value!r} is out of range; valid: [0, 1]")
        _at_least("churn.mean_absence", self.mean_absence, 1.0)
        _at_least("churn.seed", self.seed, 0)  # numpy's seeds are non-negative
        _at_least("churn.deadline", self.deadline, 0.0)
        if not 1 <= self.min_quorum <= replicas:
            raise UserError(
                f"churn.min_quorum={self.min_quorum!r} is out of range; valid: 1 to replicas ({replicas})"
            )
        for _, replica, _ in self.parsed_events():
            if replica >= replicas:
                raise UserError(
                    f"churn.events names replica {replica}; valid: 0 to {replicas - 1} (replicas={replicas})"
                )


class ResumeMode(Enum):
    """What `resume` asks for, one meaning each."""

    START = "start"  # resume= or resume=false: a new run
    LATEST = "latest"  # resume=true: the run directory's newest good checkpoint; refused without one
    AUTO = "auto"  # resume=auto: resume when the run directory holds a checkpoint, else start (over)
    PATH = "path"  # resume=PATH: that checkpoint file, or that run directory's newest good checkpoint

    @classmethod
    def of(cls, text: str) -> ResumeMode:
        """The mode `resume`'s text asks for: its word in RESUME_WORDS, else PATH."""
        return RESUME_WORDS.get(text.strip().lower(), cls.PATH)


# The words `resume` accepts, in any case and with blanks around them; any other text is a PATH.
RESUME_WORDS = {
    "": ResumeMode.START,
    "false": ResumeMode.START,
    "true": ResumeMode.LATEST,
    "auto": ResumeMode.AUTO,
}


@dataclass(frozen=True)
class ResumeRequest:
    """The `resume` field decided: its mode and, for PATH only, the path (absolute, ~ expanded).
    `given` is the field's text without the blanks around it, as the refusals quote it."""

    mode: ResumeMode
    path: Path | None = None
    given: str = ""

    @classmethod
    def of(cls, text: str) -> ResumeRequest:
        """`resume`'s text read (Hydra makes `resume=true` the text "True"); UserError, one line, for
        a path whose leading ~ names a home this machine does not know."""
        given, mode = text.strip(), ResumeMode.of(text)
        if mode is not ResumeMode.PATH:
            return cls(mode, None, given)
        try:
            path = Path(given).expanduser().absolute()
        except RuntimeError:  # pathlib: ~user of an unknown user, or ~ without a home
            raise UserError(
                f"resume={given!r} starts with a ~ whose home directory this machine does not know; valid: "
                "true, auto, a checkpoint file, or a run directory with checkpoints/"
            ) from None
        return cls(mode, path, given)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    phase: PhaseConfig = field(default_factory=PhaseConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    processes: ProcessesConfig = field(default_factory=ProcessesConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # the network clock's target
    churn: ChurnConfig = field(default_factory=ChurnConfig)  # replicas that miss syncs, leave, rejoin
    replicas: int = 4  # R, model replicas; must divide the world (weak phases: the base world)
    seed: int = 0  # initial weights (the same for every replica)
    experiment: str = "default"  # names the W&B group of a run unless logger.group is set
    # "" or false (start), true (the run directory's newest good checkpoint), auto (resume when the
    # run directory holds a checkpoint of this config, else start), or a checkpoint file or run
    # directory; read once, by the preflight (`ResumeRequest.of`: its mode and, for a PATH, the path)
    resume: str = ""

    def check(self) -> None:
        """Every section's own fields (the checks that need several sections or the plan:
        `hypertrain.preflight.checks.validate`)."""
        check_finite_floats(self)
        check_int64(self)
        for section in (self.model, self.inner, self.outer, self.world):
            section.check()
        _at_least("replicas", self.replicas, 1)
        for section in (
            self.data,
            self.engine,
            self.processes,
            self.guard,
            self.checkpoint,
            self.cluster,
        ):
            section.check()
        self.churn.check(self.replicas)


def _at_least(name: str, value: int | float, low: int | float) -> None:
    if value < low:
        raise UserError(f"{name}={value!r} is too small; valid: >= {low}")


@functools.cache
def _hints(schema: type) -> dict:
    return typing.get_type_hints(schema)


def node_type(schema: type, f: dataclasses.Field) -> type | None:
    """The config dataclass a field of `schema` holds (`X`, or `X | None` for a node some runs lack);
    None for a value."""
    hint = _hints(schema)[f.name]
    kinds = [hint, *typing.get_args(hint)]
    return next((k for k in kinds if isinstance(k, type) and dataclasses.is_dataclass(k)), None)


def default_of(section: type, name: str) -> Any:
    """The default of dataclass `section`'s field `name` (its default_factory's value where it has one)."""
    found = next(f for f in dataclasses.fields(section) if f.name == name)
    return found.default_factory() if found.default is dataclasses.MISSING else found.default


def as_builtins(section: Any) -> Any:
    """A config dataclass (or a value of one) as builtins: dicts, lists, and a choice as its plain str,
    what a checkpoint (`torch.load(weights_only=True)`), config.yaml or W&B may hold."""
    if dataclasses.is_dataclass(section):
        return {f.name: as_builtins(getattr(section, f.name)) for f in dataclasses.fields(section)}
    if isinstance(section, list | tuple):
        return [as_builtins(item) for item in section]
    if isinstance(section, Enum):
        return section.value
    return section


def check_finite_floats(node: Any, prefix: str = "") -> None:
    """Every float field of the config (any group) is a finite number: nan or inf would start a run
    that fails, or trains on silently, later."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            check_finite_floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{prefix}{f.name}={value!r} is not a finite number; valid: a finite number")


def check_int64(node: Any, prefix: str = "") -> None:
    """Every int field of the config (any group, in lists too) fits a 64-bit integer: a larger one
    would fail later, in torch or numpy, with a traceback."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            check_int64(value, f"{prefix}{f.name}.")
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not -INT64_MAX - 1 <= item <= INT64_MAX:
                raise UserError(
                    f"{prefix}{f.name}={value!r} does not fit a 64-bit integer; valid: -{INT64_MAX + 1}.."
                    f"{INT64_MAX}"
                )


# The sections that never change a number of the run: a resumed run may change them, the run's hash
# and the report's comparison leave them out.
MAY_CHANGE = ("logger", "checkpoint", "guard", "resume")
# single fields a resumed run may change: a sharded run's checkpoint holds whole tensors, as an unsharded
# run's does, so either loads into the other (docs/distributed.md, "Sharded replicas")
MAY_CHANGE_FIELDS = ("processes.shard",)


def flatten(tree: dict, prefix: str = "") -> dict:
    """A resolved config's nested sections as dotted keys (`inner.lr`), in the config's order."""
    flat: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# Fields filled in at start-up from others (preflight.with_layout, preflight/prepare.py): the process count
# and layout from processes=dist, world.size and replicas, the decay from phase.updates, the fragments'
# parameters from outer.fragments and the model, the vocabularies from the data. Where one
# differs, what it is derived from differs too: `changed_fields` names that first (the user set it).
DERIVED = (
    "processes.nproc",
    "processes.layout",
    "inner.decay_steps",
    "outer.assignment",
    "model.channel_vocabs",
    "model.vocab",
)


def changed_fields(was: dict, now: dict) -> list[str]:
    """The keys of two flattened resolved configs whose values differ (the sections that MAY_CHANGE left
    out), what the user chose first: the config groups' choices (`model.name`: model=...), then the
    fields set directly, in alphabetical order, a section's own before a node's below it (outer.schedule
    before outer.arrivals.*, a node that exists with one schedule alone), then the DERIVED ones in its
    order (the process count before the layout derived from it)."""

    def kind(key: str) -> tuple[int, int, str]:
        if key in DERIVED:
            return (2, DERIVED.index(key), key)
        return (0 if key.partition(".")[2] == "name" else 1, key.count("."), key)

    keys = was.keys() | now.keys()
    differ = [
        k
        for k in keys
        if was.get(k) != now.get(k) and k.split(".")[0] not in MAY_CHANGE and k not in MAY_CHANGE_FIELDS
    ]
    return sorted(differ, key=kind)


def setting(key: str, value: Any) -> str:
    """`key` set to `value` as a user writes it on the command line: a config group's choice as
    `group=option` (the section's `name` labels the option composed), any other field as `key=value`."""
    section, _, rest = key.partition(".")
    return f"{section}={value}" if rest == "name" else f"{key}={value!r}"
