"""Everything decided before training: `prepare(cfg)` builds the data and checks that the phase fits
the stream and the model the data (a user mistake is one `UserError`/`PlanError` line before anything
is written); `initial_weights(run)` gives the global weights every replica starts from.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from hypertrain import plan
from hypertrain.config import HELDOUT_ROWS_PER_PASS, ModelConfig, TrainConfig, UserError
from hypertrain.data import build_dataset, data_source
from hypertrain.data.batches import ReplicaBatch, is_multistream, replica_batch
from hypertrain.diloco import fragments
from hypertrain.diloco.state import PreparedRun
from hypertrain.distributed.decided import Decided, decide
from hypertrain.model.spec import model_spec
from hypertrain.model.transformer import Params, init_params
from hypertrain.plan.check import verify_phase
from hypertrain.preflight.checks import plan_phase

logger = logging.getLogger("hypertrain")
SOURCE_CHUNK = 1 << 20  # ids counted at once for the sources' shares


def model_for_data(cfg: TrainConfig, dataset) -> ModelConfig:
    """The model config with what the data decides filled in (a decoder's vocabulary where model.vocab
    is 0, a multistream model's channel vocabularies); UserError when model and data do not go together."""
    model, channels = cfg.model, model_spec(cfg.model).channels
    if not is_multistream(dataset):
        if channels:
            raise UserError(
                f"model.arch=multistream needs data with several token channels, not data.name="
                f"{cfg.data.name!r}; valid: data=speech, or model=tiny|small|base"
            )
        if model_spec(model).external:  # the model's own vocabulary, never resized to the data's
            return _external_vocab(model, int(dataset.vocab))
        if model.vocab == 0:
            return replace(model, vocab=int(dataset.vocab))
        if data_source(cfg.data).own_vocab and model.vocab != dataset.vocab:
            raise UserError(
                f"model.vocab={model.vocab} differs from the prepared corpus's vocabulary ({dataset.vocab}, "
                f"its meta.json); valid: 0 or {dataset.vocab} (data=prepared takes the corpus's)"
            )
        return model
    vocabs = [int(v) for v in dataset.channel_vocabs]
    if not channels:
        raise UserError(
            f"data.name={cfg.data.name!r} has {len(vocabs)} token channels per position but "
            f"model.arch={model.arch!r} reads one; valid: model=multistream_tiny or multistream_small"
        )
    if model.channel_vocabs and list(model.channel_vocabs) != vocabs:
        raise UserError(
            f"model.channel_vocabs={list(model.channel_vocabs)} differs from the data's {vocabs}; "
            "valid: [] (taken from the data)"
        )
    return replace(model, channel_vocabs=vocabs)


def _external_vocab(model: ModelConfig, data_vocab: int) -> ModelConfig:
    """A Hugging Face model's vocabulary (its config's) as model.vocab; UserError when some id the data
    can produce is not below it."""
    (vocab,) = model_spec(model).vocabs(model)
    if vocab < data_vocab:
        raise UserError(
            f"the model's vocabulary ({vocab}, its config's vocab_size) is smaller than the data's "
            f"({data_vocab}): ids {vocab}..{data_vocab - 1} have no embedding; valid: a model with "
            f"vocab_size >= {data_vocab}, or data of a smaller vocabulary"
        )
    if model.vocab not in (0, vocab):
        raise UserError(f"model.vocab={model.vocab} is not the model's ({vocab}); valid: 0 (the model's)")
    return replace(model, vocab=vocab)


def prepare(cfg: TrainConfig, decided: Decided | None = None) -> PreparedRun:
    """Build data and plan facts; raise UserError/PlanError on any user mistake. `decided`: what the
    preflight decided from `cfg` and whose device it checked (None: `decided.decide`'s, for a caller
    without a preflight)."""
    decided = decide(cfg) if decided is None else decided
    dataset = build_dataset(cfg.data)
    cfg = replace(cfg, model=model_for_data(cfg, dataset))
    if not model_spec(cfg.model).channels and cfg.model.vocab < dataset.vocab:
        raise UserError(
            f"model.vocab={cfg.model.vocab} is smaller than the data's vocabulary ({dataset.vocab}); "
            f"valid: >= {dataset.vocab}"
        )
    samples = dataset.n_total - cfg.data.heldout
    phase = plan_phase(cfg.phase)
    if phase.offset >= samples:
        raise UserError(
            f"phase.offset={phase.offset} lies past the training stream ({samples} ids once "
            f"data.heldout={cfg.data.heldout} is reserved from {dataset.n_total}); "
            f"valid: < {samples}, or a longer stream"
        )
    plan.validate_run(phase, cfg.world.size, cfg.replicas, samples)
    updates = plan.updates_run(phase, samples)
    if updates < phase.updates:
        logger.warning(
            "phase %r: updates %d..%d are past the end of the stream (%d ids) and are not run",
            phase.name,
            updates,
            phase.updates - 1,
            samples,
        )
    inner = replace(cfg.inner, decay_steps=cfg.inner.decay_steps or phase.updates)
    cfg = replace(cfg, inner=inner)
    if cfg.outer.fragments > 1:  # the fragments' parameters, written to the run's config
        cfg = replace(cfg, outer=replace(cfg.outer, assignment=fragments.assignment(cfg)))
    check = verify_phase(phase, worlds=(cfg.world.size,), replicas=(cfg.replicas,), samples=samples)
    facts = {
        "plan/check": "PASS",
        "plan/unique_ids": check["unique_ids"],
        "plan/union_sha256": check["union_sha256"],
        "plan/data_order_sha256": plan.data_order_digest(phase, cfg.replicas, samples),
        "plan/rank_sha256": plan.rank_digest(phase, cfg.world.size, cfg.replicas, samples),
        "data/fingerprint": dataset.fingerprint,
        "data/samples": samples,
        "data/heldout": cfg.data.heldout,
        "plan/updates_run": updates,
    }
    if getattr(dataset, "corpus", ""):  # a prepared corpus: its tokenizer, vocabulary, sizes, sources
        facts["data/corpus"] = dataset.corpus
        facts["data/tokenizer_sha256"] = dataset.tokenizer_sha256  # the sample command reads it back
    heldout, heldout_sources = heldout_batch(dataset, np.arange(samples, dataset.n_total), cfg.data)
    facts |= source_facts(cfg, dataset, phase, samples, updates)
    return PreparedRun(cfg, dataset, phase, samples, updates, facts, heldout, decided, heldout_sources)


def heldout_batch(dataset, ids: np.ndarray, data) -> tuple[ReplicaBatch, list[int]]:
    """The held-out ids read and cut once, and, for data of several sources, the source of each
    microbatch: each source's ids are cut on their own (weighted over all the held-out targets, so
    the sum is the held-out loss as ever), which gives every source's loss from the same passes."""
    names = getattr(dataset, "source_names", ())
    if len(names) < 2:
        return replica_batch(dataset, ids, data, HELDOUT_ROWS_PER_PASS), []
    of = dataset.example_sources(ids)
    micro, sources = [], []
    for s in range(len(names)):
        part = replica_batch(dataset, ids[of == s], data, HELDOUT_ROWS_PER_PASS, replica_ids=ids)
        micro += part.microbatches
        sources += [s] * len(part.microbatches)
    return ReplicaBatch(micro, sum(mb.targets for mb in micro)), sources


def source_facts(cfg: TrainConfig, dataset, phase, samples: int, updates: int) -> dict:
    """For data of several sources: `data/sources` (their names) and `data/source_tokens`, per replica
    the target tokens of each source among the ids the plan gives it in the updates run (the share of
    each source in what every replica trains on; logged at start: `source_shares`). {} for data of one
    source."""
    names = list(getattr(dataset, "source_names", ()))
    if len(names) < 2:
        return {}
    # Update u's ids are [offset + u*G, ...) and replica m takes U[m::R] (docs/design.md): an id's
    # replica is its place in its update mod R. Counted in chunks of ids, so memory stays bounded.
    G, R, S = phase.update_size, cfg.replicas, len(names)
    tokens = np.zeros(R * S, dtype=np.int64)
    end = min(samples, phase.offset + updates * G)
    for first in range(phase.offset, end, SOURCE_CHUNK):
        ids = np.arange(first, min(end, first + SOURCE_CHUNK), dtype=np.int64)
        replica = (ids - phase.offset) % G % R
        cell = replica * S + dataset.example_sources(ids)
        tokens += np.bincount(cell, weights=dataset.lengths(ids) - 1, minlength=R * S).astype(np.int64)
    return {"data/sources": names, "data/source_tokens": tokens.reshape(R, S).tolist()}


def source_shares(facts: dict) -> list[str]:
    """A line per replica saying each source's share of the target tokens it trains on (`source_facts`);
    none for data of one source."""
    names, tokens = facts.get("data/sources"), facts.get("data/source_tokens")
    lines = []
    for m, row in enumerate(tokens or []):
        shares = ", ".join(f"{n} {t / max(1, sum(row)):.1%}" for n, t in zip(names, row, strict=True))
        lines.append(f"replica {m} trains on {shares} of its {sum(row):,} target tokens")
    return lines


def initial_weights(run: PreparedRun) -> Params:
    """The global weights before training: the same for every replica, from `seed`."""
    device = torch.device(run.decided.device)
    return {n: t.to(device) for n, t in init_params(run.cfg.model, run.cfg.seed).items()}
