"""The catalogue of user mistakes: each one line naming the bad value and what is valid, exit 2, no
traceback, nothing created or changed. Each case runs the entry (`hypertrain.train.cli`, in this
process; a sample of them on the command line too, which must say the same) in an empty working
directory; an earlier run's directory beside it must stay byte for byte as it was.

Hydra's own composition errors (unknown option, misspelled key, wrong type, an ambiguous sweep) keep
Hydra's wording: the entry composes the command line before Hydra runs and prints Hydra's first
line, with the options or the cause, as its one line.

`CASES` is also the source of docs/errors.md: `.venv/bin/python tests/test_bad_input.py` rewrites
it, and `test_the_errors_page_is_the_catalogue` fails when the page and the cases differ.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import HIDE_PLUGINS, RUN, ReferenceRuns, data_command, entry, entry_env, tree
from test_prepared import rewrite_tokens, write_corpus

from hypertrain.failures import EXIT_CODES
from hypertrain.rundir.checkpoint import seal

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "errors.md"
BASE = RUN
# A one-node cluster whose controller does not run: port 1 on loopback refuses at once (privileged,
# never a slurmctld's), so `scontrol ping` says DOWN without waiting (no munged is needed for that).
DEAD_CLUSTER = b"""ClusterName=nobody
SlurmctldHost=n1(127.0.0.1)
SlurmctldPort=1
AuthType=auth/munge
NodeName=n1 NodeAddr=127.0.0.1 CPUs=1
PartitionName=test Nodes=n1 Default=YES
"""


@dataclass
class Case:
    mistake: str  # what the user did, for docs/errors.md
    args: list[str]  # after BASE; {earlier} is the earlier run's directory, {cwd} the working one
    says: str  # the start of the one line after "hypertrain: error: " (placeholders as in args)
    fix: str  # what to do, for docs/errors.md
    files: dict[str, bytes] = field(default_factory=dict)  # made in the working directory first
    hydra: bool = False  # Hydra's own wording
    setup: Callable[[Path, Path], None] | None = None  # (earlier, cwd): more to make in cwd first
    env: dict[str, str] = field(default_factory=dict)  # the entry's environment ({cwd} as in args)
    # the command: "train" (args after BASE), "sample" (`python -m hypertrain.sample ARGS`, its line
    # `hypertrain.sample: error: ...`), "data" (`python -m hypertrain.data ARGS`, no BASE before them),
    # "clock" (`python -m hypertrain.clock ARGS`, its line `hypertrain.clock: error: ...`) or "export"
    # (`python -m hypertrain.export ARGS`, its line `hypertrain.export: error: ...`)
    command: str = "train"


def trained_async(earlier: Path, cwd: Path) -> None:
    """A setup: a finished outer.schedule=async run (the session's reference) copied to cwd/run."""
    from test_async import ASYNC

    shutil.copytree(ReferenceRuns.beside(cwd.parent)(ASYNC), cwd / "run")


def copy_of_earlier(change: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    """A setup: the earlier run copied to cwd/run, then `change(cwd/run)`."""

    def setup(earlier: Path, cwd: Path) -> None:
        shutil.copytree(earlier, cwd / "run")
        change(cwd / "run")

    return setup


def _without(name: str) -> Callable[[Path], None]:
    return lambda run: shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()


def _model_arch(arch: str) -> Callable[[Path], None]:
    """A change: the run's config.yaml says it trained a model of `arch` (its weights stay as they are)."""

    def change(run: Path) -> None:
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["model"]["arch"] = arch
        (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    return change


def _metrics_cut(run: Path) -> None:
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:100])


def _metrics_edited(run: Path) -> None:
    """One character of the first update row changed (its loss's last digit): the same length."""
    metrics = run / "metrics.jsonl"
    data = bytearray(metrics.read_bytes())
    at = data.index(b'"loss": [') + len(b'"loss": [')
    at = data.index(b",", at) - 1
    data[at] = ord("1") if data[at] != ord("1") else ord("2")
    metrics.write_bytes(bytes(data))


def _checkpoint_of_another_run(run: Path) -> None:
    """The newest checkpoint stands for one of another run: its run id changed."""
    path = sorted((run / "checkpoints").glob("ckpt-u*.pt"))[-1]
    saved = torch.load(path, weights_only=False)
    saved["run_id"] = "0" * 32
    torch.save(saved, path)
    seal(path)  # a whole checkpoint, of another run


def _newer_checkpoint_of_another_run(run: Path) -> None:
    """The newest checkpoint stands for one of another run of the same config that went further: its
    run id changed and its records 1000 bytes longer than this run's metrics.jsonl."""
    path = sorted((run / "checkpoints").glob("ckpt-u*.pt"))[-1]
    saved = torch.load(path, weights_only=False)
    saved["run_id"] = "0" * 32
    saved["metrics_bytes"] = (run / "metrics.jsonl").stat().st_size + 1000
    torch.save(saved, path)
    seal(path)


def _flip_a_bit(run: Path) -> None:
    """One bit of the newest checkpoint flipped, half-way through its bytes."""
    path = sorted((run / "checkpoints").glob("ckpt-u*.pt"))[-1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _stopped_before_its_first_checkpoint(earlier: Path, cwd: Path) -> None:
    """A session of the earlier run's config in cwd/run that stopped before its first checkpoint: its
    config.yaml and plan.json, nothing more."""
    (cwd / "run").mkdir()
    for name in ("config.yaml", "plan.json"):
        shutil.copy(earlier / name, cwd / "run" / name)


def _trained_on(data: str) -> Callable[[Path], None]:
    """A change: the run's config.yaml says it trained on `data` (its weights stay as they are)."""

    def change(run: Path) -> None:
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["data"]["name"] = data
        (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    return change


# A sitecustomize that makes the modules named in HIDDEN_MODULES not installed, as far as an import can tell.
HIDE_MODULES = """
import importlib.abc, os, sys

hidden = os.environ["HIDDEN_MODULES"].split(",")


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in hidden):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
"""


def prepared_corpus(earlier: Path, cwd: Path) -> None:
    """A setup: cwd/corpus holds the corpus prepared from cwd/docs.txt with the bytes tokenizer."""
    from hypertrain.data.preparation.prepare import prepare

    prepare([str(cwd / "docs.txt")], cwd / "corpus", "bytes", "text", progress=False)


def word_level_without_unk() -> bytes:
    """A tokenizer.json of the words "a" and "document" and no unknown token: it cannot encode "here"."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    made = tokenizers.Tokenizer(models.WordLevel({"a": 0, "document": 1}))
    made.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return made.to_str().encode()


_HELD_LOCKS = []  # another_prepare_running's locks: held until the session ends (the case's cwd goes)


def another_prepare_running(earlier: Path, cwd: Path) -> None:
    """A setup: cwd/corpus is being prepared by another process: the lock beside it is held through a
    file this test opened (flock refuses a second open file, in this process or another)."""
    from hypertrain.data.preparation.lockfile import LockFile

    lock = LockFile(cwd / ".corpus.lock")
    assert lock.acquire(wait=False)
    _HELD_LOCKS.append(lock)


def token_file(largest: int, n: int = 20000) -> bytes:
    """A uint16 token file of distinct-enough random ids up to `largest` (which it holds)."""
    ids = np.random.default_rng(0).integers(0, largest, size=n)
    ids[n // 2] = largest
    return ids.astype("<u2").tobytes()


def _corpus(*sources: tuple[int, int, int]) -> Callable[[Path, Path], None]:
    """A setup: a `bytes` corpus in cwd/corpus whose sources hold (documents, shortest, longest + 1)."""
    return lambda earlier, cwd: write_corpus(cwd / "corpus", list(sources))


TWO_SOURCES = _corpus((200, 1, 80), (300, 1, 60))


def _changed(cwd: Path) -> None:
    """One id of cwd/corpus/tokens.bin changed in place (the size kept)."""
    rewrite_tokens(cwd / "corpus", 0)


def _cut(cwd: Path) -> None:
    """cwd/corpus/tokens.bin one id (2 bytes) short."""
    tokens = cwd / "corpus" / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-2])


def _id_300_under_vocab_257(earlier: Path, cwd: Path) -> None:
    """A setup: a `bytes` corpus (vocab 257) in cwd/corpus one of whose ids is 300."""
    from hypertrain.data import corpus

    documents = [np.arange(i, i + 40) % 256 for i in range(60)]
    documents[7][3] = 300
    source = corpus.SourceMeta("s", 1, 0, 0, "0" * 64)
    (cwd / "corpus").mkdir()
    corpus.write(
        cwd / "corpus",
        [documents],
        [source],
        vocab=257,
        eod=256,
        tokenizer="bytes",
        tokenizer_json=None,
        request="0" * 64,
    )


def _trained_on_corpus(run: Path) -> None:
    """A change: the run's config.yaml says it trained on data=prepared at cwd/corpus (relative)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"] |= {"name": "prepared", "path": "corpus"}
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


CASES = {
    # issue 50: model=hf (docs/hf.md), a Hugging Face causal LM from a local directory or a config
    "hf-neither-path-nor-config": Case(
        "model=hf without a model directory or config",
        ["model=hf"],
        "model.arch=hf takes one of model.path and model.config, not neither",
        "model.path=DIR (a directory save_pretrained wrote) or 'model.config={model_type:llama,...}'",
    ),
    "hf-path-missing": Case(
        "model=hf with a directory that does not exist (or holds no config.json)",
        ["model=hf", "model.path=nowhere"],
        "model.path='nowhere' holds no readable config.json (FileNotFoundError)",
        "a local directory save_pretrained wrote (nothing is fetched from a hub)",
    ),
    "hf-unknown-model-type": Case(
        "model=hf with a config whose model_type transformers does not know",
        ["model=hf", "model.path=m"],
        "model.path='m': model_type 'nosuch' is not a model transformers",
        "a model_type of transformers' CONFIG_MAPPING (llama, qwen2, qwen3, gpt2, mistral, ...)",
        files={"m/config.json": b'{"model_type": "nosuch"}'},
    ),
    "hf-remote-code": Case(
        "model=hf with a directory whose model needs remote code (auto_map)",
        ["model=hf", "model.path=m"],
        "model.path='m' needs remote code (its config.json has auto_map), which hypertrain never runs",
        "a model transformers builds itself (trust_remote_code is never set)",
        files={"m/config.json": b'{"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "x.Y"}}'},
    ),
    "hf-not-a-causal-lm": Case(
        "model=hf with a model that is not a causal LM",
        ["model=hf", "model.config={model_type:t5}"],
        "model.config: model_type 't5' is not a causal LM",
        "a model with a *ForCausalLM class",
    ),
    "hf-dropout": Case(
        "model=hf with dropout in the built module (vmap cannot batch it)",
        ["model=hf_gpt2_tiny", "model.config.attn_pdrop=0.1"],
        "model.config: transformer.h.0.attn.attn_dropout drops out (p=0.1)",
        "every dropout 0 in the config (fields the causal LM does not use, such as summary_*, do not count)",
    ),
    "hf-gradient-checkpointing": Case(
        "model=hf with gradient checkpointing (vmap cannot batch it)",
        ["model=hf_llama_tiny", "+model.config.gradient_checkpointing=true"],
        "model.config: gradient checkpointing does not run under vmap; valid: false",
        "leave gradient checkpointing off",
    ),
    "hf-flex-attention": Case(
        "model=hf with flex attention (vmap cannot batch it)",
        ["model=hf_llama_tiny", "+model.config.attn_implementation=flex_attention"],
        "model.config: attention 'flex_attention' does not run under vmap; valid: sdpa, eager",
        "attn_implementation sdpa (the default) or eager",
    ),
    "hf-vocab-below-data": Case(
        "model=hf whose vocabulary is smaller than the data's ids",
        ["model=hf_llama_tiny", "model.config.vocab_size=100"],
        "the model's vocabulary (100, its config's vocab_size) is smaller than the data's (256)",
        "a model with vocab_size at least the data's vocabulary (the embeddings are never resized)",
    ),
    "hf-without-transformers": Case(
        "model=hf without transformers installed (here hidden by a sitecustomize)",
        ["model=hf_llama_tiny"],
        "model=hf needs transformers, which is not installed; valid: pip install 'hypertrain[hf]'",
        "pip install 'hypertrain[hf]' (the dev extra includes it)",
        files={"hide/sitecustomize.py": HIDE_MODULES.encode()},
        env={"PYTHONPATH": f"{{cwd}}/hide{os.pathsep}{REPO}", "HIDDEN_MODULES": "transformers"},
    ),
    # issue 38: data=prepared
    "prepared-without-path": Case(
        "a prepared corpus without its directory",
        ["data=prepared"],
        "data.path is empty; data=prepared needs a corpus's directory (python -m hypertrain.data prepare)",
        "data.path=DIR, the directory `python -m hypertrain.data prepare ... --out DIR` wrote",
    ),
    "prepared-not-a-corpus": Case(
        "a directory that holds no prepared corpus",
        ["data=prepared", "data.path=notes"],
        "data.path='notes' holds no prepared corpus (no meta.json)",
        "prepare it first: `python -m hypertrain.data prepare INPUT ... --out DIR`",
        files={"notes/a.txt": b"some text"},
    ),
    "prepared-vocab-differs": Case(
        "a model vocabulary other than the prepared corpus's",
        ["data=prepared", "data.path=corpus", "model.vocab=300"],
        "model.vocab=300 differs from the prepared corpus's vocabulary (257, its meta.json)",
        "leave model.vocab unset with data=prepared (0: the corpus's)",
        setup=TWO_SOURCES,
    ),
    "prepared-source-short-of-heldout": Case(
        "a source too short for its share of the held-out examples",
        ["data=prepared", "data.path=corpus"],
        "source 1 of data.path='corpus' (source1) holds 1 windows, fewer than the 32 held-out ones it owes",
        "a smaller data.heldout, or more text in that source",
        setup=_corpus((200, 1, 80), (1, 40, 41)),
    ),
    "by-source-sources-do-not-divide-replicas": Case(
        "replica_split=by_source with a number of sources that does not divide the replicas",
        ["data=prepared", "data.path=corpus", "data.replica_split=by_source"],
        "data.replica_split=by_source gives replica m the corpus's source m mod S, and its S=3 sources do "
        "not divide replicas=2",
        "replicas a multiple of the corpus's sources, or data.replica_split=iid",
        setup=_corpus((100, 1, 80), (100, 1, 80), (100, 1, 80)),
    ),
    "by-source-global-batch": Case(
        "replica_split=by_source with a global batch the sources do not divide",
        ["data=prepared", "data.path=corpus", "data.replica_split=by_source", "phase.global_batch=33"],
        "data.replica_split=by_source needs phase global_batch=33 to be a multiple of the corpus's S=2",
        "a global batch (weak: base_world * per_rank_batch) that is a multiple of the sources",
        setup=TWO_SOURCES,
    ),
    "by-source-offset": Case(
        "replica_split=by_source with a phase offset the sources do not divide",
        ["data=prepared", "data.path=corpus", "data.replica_split=by_source", "phase.offset=3"],
        "data.replica_split=by_source needs phase.offset=3 to be a multiple of the corpus's S=2 sources",
        "a phase offset that is a multiple of the sources",
        setup=TWO_SOURCES,
    ),
    "by-source-without-prepared": Case(
        "replica_split=by_source with data other than a prepared corpus",
        ["data.replica_split=by_source"],
        "data.replica_split=by_source needs a prepared corpus's sources, not data=stdlib",
        "data=prepared data.path=DIR",
    ),
    "windows-inside-documents-without-prepared": Case(
        "window_across_documents=false with data other than a prepared corpus",
        ["data.window_across_documents=false"],
        "data.window_across_documents=false needs a prepared corpus's documents, not data=stdlib",
        "data=prepared data.path=DIR",
    ),
    # issue 48: a prepared corpus's files against its meta.json, new run or resumed (its stamps, size and
    # mtime_ns, checked; a file whose stamp differs hashed), and a meta.json that is none
    "prepared-tokens-changed": Case(
        "a prepared corpus whose tokens.bin changed after it was prepared (one id, the size kept)",
        ["data=prepared", "data.path=corpus"],
        "corpus: tokens.bin changed after it was prepared (its sha256 is not meta.json's tokens_sha256); "
        "valid: the corpus as prepared: remove corpus and prepare it again (python -m hypertrain.data "
        "prepare INPUT ... --out corpus)",
        "remove the corpus and prepare it again from its inputs",
        setup=lambda earlier, cwd: (TWO_SOURCES(earlier, cwd), _changed(cwd)),
    ),
    "prepared-tokens-cut": Case(
        "a prepared corpus whose tokens.bin is shorter than its meta.json says",
        ["data=prepared", "data.path=corpus"],
        "corpus: tokens.bin holds 20 bytes where its meta.json says 22 (11 tokens, 1 documents); valid: "
        "the corpus as prepared: remove corpus and prepare it again",
        "remove the corpus and prepare it again from its inputs",
        files={"docs.txt": b"a document"},
        setup=lambda earlier, cwd: (prepared_corpus(earlier, cwd), _cut(cwd)),
    ),
    "prepare-over-a-cut-corpus": Case(
        "prepare: `--out` holding the corpus of the same request whose tokens.bin was cut",
        ["prepare", "docs.txt", "--out", "corpus"],
        "{cwd}/corpus: tokens.bin holds 20 bytes where its meta.json says 22 (11 tokens, 1 documents); "
        "valid: the corpus as prepared: remove {cwd}/corpus and prepare it again",
        "remove the corpus, then the same command prepares it again",
        files={"docs.txt": b"a document"},
        setup=lambda earlier, cwd: (prepared_corpus(earlier, cwd), _cut(cwd)),
        command="data",
    ),
    "prepared-id-beyond-vocabulary": Case(
        "a prepared corpus holding an id at or above its vocabulary",
        ["data=prepared", "data.path=corpus"],
        "corpus: tokens.bin holds id 300, at or above its vocab 257 (meta.json): a model of that "
        "vocabulary has no embedding for it",
        "a corpus whose ids are below its vocab: prepare it again",
        setup=_id_300_under_vocab_257,
    ),
    **{
        f"prepared-meta-{name}": Case(
            f"a prepared corpus whose meta.json holds {what}",
            ["data=prepared", "data.path=corpus"],
            f"corpus/meta.json is not a prepared corpus's meta (it holds {text}, not a JSON object); valid: "
            "the corpus as prepared: remove corpus and prepare it again",
            "remove the corpus and prepare it again from its inputs",
            files={"corpus/meta.json": text.encode()},
        )
        for name, what, text in (("null", "null", "null"), ("string", "a string", '"x"'))
    },
    "prepared-path-is-a-file": Case(
        "data.path a file of the corpus (its meta.json), not its directory",
        ["data=prepared", "data.path=corpus/meta.json"],
        "data.path='corpus/meta.json' is a file, not a prepared corpus's directory; valid: the directory",
        "the corpus's directory, the one holding meta.json",
        setup=TWO_SOURCES,
    ),
    "unknown-group-option": Case(
        "an option a group does not have",
        ["model=huge"],
        "In 'train': Could not find 'model/huge'; valid: base, hf, hf_gpt2_tiny, hf_llama_tiny, "
        "hf_qwen2_tied_tiny, moe_small, moe_tiny, multistream_small, multistream_tiny, small, tiny",
        "pick one of the options listed",
        hydra=True,
    ),
    "misspelled-key": Case(
        "a key the group does not have",
        ["inner.hh=3"],
        "Could not override 'inner.hh'. Key 'hh' not in 'InnerConfig'",
        "spell the key as `hypertrain/config.py` documents it",
        hydra=True,
    ),
    "wrong-type": Case(
        "a value of the wrong type",
        ["inner.H=abc"],
        "Error merging override inner.H=abc Value 'abc' of type 'str' could not be converted to Integer",
        "give a value of the field's type",
        hydra=True,
    ),
    "schema-as-option": Case(
        "a schema's name used as an option",
        ["model=model_schema"],
        "In 'train': Could not find 'model/model_schema'; valid: base, hf, hf_gpt2_tiny, hf_llama_tiny, "
        "hf_qwen2_tied_tiny, moe_small, moe_tiny, multistream_small, multistream_tiny, small, tiny",
        "schemas are not options; pick one of the options listed",
        hydra=True,
    ),
    "ambiguous-sweep": Case(
        "a list of values without -m",
        ["replicas=1,2"],
        "Ambiguous value for argument 'replicas=1,2'; valid: -m to sweep",
        "add -m to sweep, or write key=[a,b] for a list",
        hydra=True,
    ),
    "unknown-experiment": Case(
        "an experiment that does not exist",
        ["experiment=nope"],
        "experiment='nope' is not an experiment; valid: audio_phases, phases, quick, sweep_rh, weak_scaling",
        "pick one of the experiments listed",
    ),
    "added-key": Case(
        "`+key=value` for a key the run never reads",
        ["+inner.foo=1"],
        "inner.foo is not a config field; valid: H, beta1",
        "drop it, or use one of the fields listed",
    ),
    "label-not-option": Case(
        "a group's label changed instead of its option",
        ["outer.name=average"],
        "outer.name='average' only labels the run; the outer is chosen with outer=...",
        "choose the option: outer=average",
    ),
    "model-label-not-option": Case(
        "the model's label changed instead of its option",
        ["model.name=small"],
        "model.name='small' only labels the run; the model is chosen with model=...",
        "choose the option: model=small",
    ),
    "unknown-state-policy": Case(
        "an inner state policy that does not exist",
        ["inner.state_policy=keep"],
        "inner.state_policy='keep' is not valid; valid: 'carry', 'reset', 'average'",
        "one of the policies listed",
    ),
    "kv-heads-not-dividing-heads": Case(
        "key/value heads that do not divide the heads",
        ["model.n_kv_heads=3"],
        "model.n_kv_heads=3 does not divide model.n_heads=4",
        "a divisor of model.n_heads",
    ),
    "vocab-below-the-data": Case(
        "a vocabulary smaller than the data's",
        ["model.vocab=100"],
        "model.vocab=100 is smaller than the data's vocabulary (256); valid: >= 256",
        "model.vocab at least the data's vocabulary",
    ),
    "min-lr-ratio-out-of-range": Case(
        "a minimum learning-rate ratio outside [0, 1]",
        ["inner.min_lr_ratio=1.5"],
        "inner.min_lr_ratio=1.5 is out of range; valid: [0, 1]",
        "a ratio in [0, 1]",
    ),
    "replicas-not-dividing-world": Case(
        "R that does not divide the world",
        ["replicas=3"],
        "replicas=3 does not divide world.size (8); valid: a divisor of 8",
        "a divisor of world.size",
    ),
    "global-batch-below-replicas": Case(
        "a global batch smaller than R",
        ["phase.global_batch=1"],
        "phase.global_batch=1 is smaller than replicas=2",
        "at least one id per replica and update",
    ),
    "zero-H": Case("H = 0", ["inner.H=0"], "inner.H=0 is too small; valid: >= 1", "at least 1"),
    "zero-updates": Case(
        "a phase of no updates", ["phase.updates=0"], "phase smoke: updates=0", "at least 1 update"
    ),
    "negative-updates": Case(
        "a negative number of updates", ["phase.updates=-1"], "phase smoke: updates=-1", "at least 1"
    ),
    "negative-lr": Case(
        "a negative learning rate", ["inner.lr=-0.1"], "inner.lr=-0.1 is too small; valid: >= 0.0", ">= 0"
    ),
    "churn-probability": Case(
        "a churn probability outside [0, 1] (docs/churn.md)",
        ["churn.p_miss=1.5"],
        "churn.p_miss=1.5 is out of range; valid: [0, 1]",
        "a probability",
    ),
    "churn-quorum": Case(
        "a churn quorum above the replicas",
        ["churn.min_quorum=3"],
        "churn.min_quorum=3 is out of range; valid: 1 to replicas (2)",
        "1 to R",
    ),
    "churn-event": Case(
        "a churn event naming a replica that does not exist",
        ["churn.events=[2:5:leave]"],
        "churn.events names replica 5; valid: 0 to 1 (replicas=2)",
        "ROUND:REPLICA:miss, leave or rejoin, REPLICA below R",
    ),
    "deadline-measured": Case(
        "a churn deadline on measured compute",
        ["churn.deadline=0.5"],
        "churn.deadline=0.5 needs modelled compute, not cluster.compute='measured'",
        "cluster.compute=modelled (a cluster preset such as h100), or churn.deadline=0",
    ),
    "async-measured": Case(
        "asynchronous replicas on measured compute (docs/async.md: the clock decides the weights)",
        ["outer.schedule=async"],
        "outer.schedule=async needs modelled compute, not cluster.compute='measured'",
        "cluster.compute=modelled (a cluster preset such as h100)",
    ),
    "async-with-overlap": Case(
        "asynchronous replicas with a whole-round overlap (not built)",
        ["outer.schedule=async", "cluster=h100", "outer.overlap=delayed"],
        "outer.schedule=async with outer.overlap=delayed is not built (docs/async.md)",
        "outer.schedule=rounds, or outer.overlap=none (fragments, delay, a merge likewise)",
    ),
    "async-churn-quorum": Case(
        "asynchronous replicas with a churn quorum (no sync to skip: docs/async.md, Churn with async)",
        ["outer.schedule=async", "cluster=h100", "churn.min_quorum=2"],
        "outer.schedule=async with churn.min_quorum=2 is not built (it needs a sync to skip",
        "churn.min_quorum=1, or outer.schedule=rounds",
    ),
    "async-churn-deadline": Case(
        "asynchronous replicas with a churn deadline (no round to cut: docs/async.md, Churn with async)",
        ["outer.schedule=async", "cluster=h100", "churn.deadline=0.5"],
        "outer.schedule=async with churn.deadline=0.5 is not built (it needs a round to cut",
        "churn.deadline=0, or outer.schedule=rounds",
    ),
    "async-speeds-length": Case(
        "a speed list whose length is not R",
        ["outer.schedule=async", "cluster=h100", "cluster.replica_speeds=[1,1,0.5]"],
        "cluster.replica_speeds=[1.0, 1.0, 0.5] has 3 speeds; valid: one per replica (2), or []",
        "one speed per replica",
    ),
    "async-speed-zero": Case(
        "a replica speed that is not a positive number",
        ["outer.schedule=async", "cluster=h100", "cluster.replica_speeds=[1,0]"],
        "cluster.replica_speeds=[1.0, 0.0] is out of range; valid: finite numbers >= 1e-54",
        "finite speeds of at least 1e-54 (1 = the cluster's step time)",
    ),
    "async-speeds-and-sigma": Case(
        "speeds both given and drawn",
        ["outer.schedule=async", "cluster=h100", "cluster.replica_speeds=[1,2]", "cluster.speed_sigma=0.5"],
        "cluster.replica_speeds with cluster.speed_sigma=0.5: the speeds are given or drawn, not both",
        "one of the two",
    ),
    "async-dn-activation": Case(
        "a delayed Nesterov momentum activation above 1/N",
        ["outer.schedule=async", "cluster=h100", "outer.arrivals.dn_activation=0.9"],
        "outer.arrivals.dn_activation=0.9 is out of range; valid: [0, 1/N] = [0, 0.5] (N = "
        "outer.arrivals.dn_buffer = 2)",
        "c in [0, 1/N]",
    ),
    "async-field-with-rounds": Case(
        "a field of the asynchronous server's node in a synchronous run, which has no such node",
        ["outer.arrivals.dylu=true"],
        "outer.arrivals.dylu is not a field of outer.schedule=rounds: outer.arrivals exists only with "
        "outer.schedule=async; valid: outer.schedule=async, or no outer.arrivals.*",
        "outer.schedule=async, or leave it unset (the other server fields likewise)",
    ),
    "async-field-unknown": Case(
        "a field the asynchronous server's node does not have",
        ["outer.schedule=async", "cluster=h100", "outer.arrivals.buffer=2"],
        "Could not override 'outer.arrivals.buffer'. Key 'buffer' not in 'ArrivalsConfig'",
        "a field of outer.arrivals (docs/async.md)",
    ),
    "tokens-weights-with-eager": Case(
        "token-weighted means of synchronous rounds with eager overlap (each replica's own terms)",
        ["outer.mean_weights=tokens", "outer.overlap=eager"],
        "outer.mean_weights=tokens with outer.overlap=eager under outer.schedule=rounds is not built",
        "outer.mean_weights=uniform, or outer.overlap=none or delayed",
    ),
    "lowrank-rank-with-topk": Case(
        "low rank's rank with another codec (its older spelling, outer.lowrank_rank, which that codec "
        "ignored, is dropped with a note in train.log)",
        ["outer.compress=topk", "outer.lowrank.rank=2"],
        "outer.lowrank.rank is not a field of outer.compress=topk: outer.lowrank exists only with "
        "outer.compress=lowrank; valid: outer.compress=lowrank, or no outer.lowrank.*",
        "outer.compress=lowrank, or the rank unset",
    ),
    "async-field-added": Case(
        "a key added (+) to the asynchronous server's node that no field of it is",
        ["+outer.arrivals.foo=1"],
        "outer.arrivals.foo is not a config field; valid: dn_activation, dn_buffer, dylu, eval_every, "
        "grace_s, rule",
        "a field of outer.arrivals (docs/async.md)",
    ),
    "async-grace-negative": Case(
        "a negative grace window",
        ["outer.schedule=async", "cluster=h100", "outer.arrivals.grace_s=-1"],
        "outer.arrivals.grace_s=-1.0 is too small; valid: >= 0.0",
        ">= 0 seconds",
    ),
    "clock-retimes-async": Case(
        "the clock command timing an asynchronous run on another cluster (its clock chose the arrivals)",
        ["run", "cluster=a100"],
        "run was trained with outer.schedule=async: its own clock chose the order its replicas "
        "arrived in, so its weights are that cluster's",
        "its own cluster and size (no cluster overrides or --model-params), or a run trained on that cluster",
        setup=trained_async,
        command="clock",
    ),
    # issue 49: codecs (`outer.compress`: a name of the table or a codec entry by import path;
    # hypertrain/codec_table.py)
    "outer-compress-unknown": Case(
        "a codec that is neither the table's nor an import path",
        ["outer.compress=int4"],
        "outer.compress='int4' is not a codec; valid: none, int8, uint8, fp8_e4m3, fp8_e5m2, fp4_e2m1, e3m0, "
        "topk, lowrank, or the import path (module.NAME) of a hypertrain.codec_table.Codec entry",
        "a codec of the table (docs/compression.md), or a path such as ternary.TERNARY (docs/extending.md)",
    ),
    "outer-compress-no-module": Case(
        "a codec's import path whose module is not installed",
        ["outer.compress=nosuch.CODEC"],
        "outer.compress='nosuch.CODEC' does not import (No module named 'nosuch')",
        "a path that imports (its folder on PYTHONPATH)",
    ),
    "outer-compress-not-a-codec": Case(
        "a codec's import path that names something other than a codec entry",
        ["outer.compress=hypertrain.codec_table.E2M1"],
        "outer.compress='hypertrain.codec_table.E2M1' names a tuple, not a codec entry",
        "a hypertrain.codec_table.Codec instance",
    ),
    # issue 49: data sources (`data.name`: a name of the table, or a data source by import path;
    # hypertrain/data/__init__.py)
    "data-name-unknown": Case(
        "a data source that is neither the table's nor an import path",
        ["data.name=csv"],
        "data.name='csv' is not a data source; valid: stdlib, text_files, token_bin, prepared, speech "
        "(data=NAME), or the import path (module.NAME) of a hypertrain.data.DataSource entry",
        "data=NAME of the table (docs/data.md), or a path such as tsv_column.TEXT (docs/extending.md)",
    ),
    "data-name-no-module": Case(
        "a data source's import path whose module is not installed",
        ["data.name=nosuch.SOURCE"],
        "data.name='nosuch.SOURCE' does not import (No module named 'nosuch')",
        "a path that imports (its folder on PYTHONPATH)",
    ),
    "data-name-not-a-source": Case(
        "a data source's import path that names something other than a data source entry",
        ["data.name=hypertrain.data.BYTE_VOCAB"],
        "data.name='hypertrain.data.BYTE_VOCAB' names a int, not a data source",
        "a hypertrain.data.DataSource instance",
    ),
    # issue 49: models (`model.arch`: a name of the table, or a model entry by import path;
    # hypertrain/model/spec.py)
    "model-arch-unknown": Case(
        "a model that is neither the table's nor an import path",
        ["model.arch=rnn"],
        "model.arch='rnn' is not a model; valid: decoder, multistream, hf, or the import path (module.NAME) "
        "of a hypertrain.model.spec.ModuleModel entry",
        "a model of the table, or a path such as gated_conv.MODEL (docs/extending.md)",
    ),
    "model-arch-no-module": Case(
        "a model's import path whose module is not installed",
        ["model.arch=nosuch.MODEL"],
        "model.arch='nosuch.MODEL' does not import (No module named 'nosuch')",
        "a path that imports (its folder on PYTHONPATH)",
    ),
    "model-arch-not-a-model": Case(
        "a model's import path that names something other than a model entry",
        ["model.arch=hypertrain.model.spec.DECODER"],
        "model.arch='hypertrain.model.spec.DECODER' names a Decoder, not a model entry",
        "a hypertrain.model.spec.ModuleModel instance",
    ),
    # issue 49: schedules (`outer.schedule`: a name of the table, or a schedule entry by import path;
    # hypertrain/schedule_table.py)
    "outer-schedule-unknown": Case(
        "a schedule that is neither the table's nor an import path",
        ["outer.schedule=local_sgd"],
        "outer.schedule='local_sgd' is not a schedule; valid: rounds, async, or the import path "
        "(module.NAME) of a hypertrain.schedule_table.ScheduleEntry entry",
        "rounds or async, or a path such as post_local.POST_LOCAL (docs/extending.md)",
    ),
    "outer-schedule-no-module": Case(
        "a schedule's import path whose module is not installed",
        ["outer.schedule=nosuch.SCHEDULE"],
        "outer.schedule='nosuch.SCHEDULE' does not import (No module named 'nosuch')",
        "a path that imports (its folder on PYTHONPATH)",
    ),
    "outer-schedule-not-a-schedule": Case(
        "a schedule's import path that names something other than a schedule entry",
        ["outer.schedule=hypertrain.schedule_table.ENTRIES"],
        "outer.schedule='hypertrain.schedule_table.ENTRIES' names a tuple, not a schedule entry",
        "a hypertrain.schedule_table.ScheduleEntry instance",
    ),
    # issue 49: outer optimizers (`outer.optimizer`: the built-in or a torch.optim.Optimizer by import path;
    # hypertrain/optim/outer.py)
    "outer-optimizer-unknown": Case(
        "an outer optimizer that is neither the built-in nor an import path",
        ["outer.optimizer=adam"],
        "outer.optimizer='adam' is not an outer optimizer; valid: nesterov, or the import path of a "
        "torch.optim.Optimizer subclass (e.g. torch.optim.Adam)",
        "nesterov, or a path such as torch.optim.Adam",
    ),
    "outer-optimizer-no-attribute": Case(
        "an import path whose module lacks the name",
        ["outer.optimizer=torch.optim.Adamm"],
        "outer.optimizer='torch.optim.Adamm' does not import (module 'torch.optim' has no attribute 'Adamm')",
        "a path that imports",
    ),
    "outer-optimizer-no-module": Case(
        "an import path whose module is not installed",
        ["outer.optimizer=nosuch.Optimizer"],
        "outer.optimizer='nosuch.Optimizer' does not import (No module named 'nosuch')",
        "a path that imports",
    ),
    "outer-optimizer-not-an-optimizer": Case(
        "an import path that names something other than an optimizer",
        ["outer.optimizer=torch.nn.Linear"],
        "outer.optimizer='torch.nn.Linear' names no torch.optim.Optimizer subclass",
        "a torch.optim.Optimizer subclass",
    ),
    "outer-optimizer-async-rule": Case(
        "an asynchronous rule given as the outer optimizer",
        ["outer.optimizer=delayed_nesterov"],
        "outer.optimizer='delayed_nesterov' is a rule of asynchronous replicas, picked by "
        "outer.arrivals.rule=delayed_nesterov",
        "outer.schedule=async outer.arrivals.rule=delayed_nesterov",
    ),
    "outer-optimizer-args-unknown": Case(
        "an argument the optimizer does not take",
        ["outer.optimizer=torch.optim.Adam", "outer.optimizer_args={bettas:[0.8,0.9]}"],
        'outer.optimizer_args={"bettas":[0.8,0.9]} is not taken by torch.optim.Adam (Adam.__init__() got an '
        "unexpected keyword argument 'bettas')",
        "its keyword arguments but params and lr",
    ),
    "outer-optimizer-args-invalid": Case(
        "an argument the optimizer refuses",
        ["outer.optimizer=torch.optim.Adam", "outer.optimizer_args={betas:[1.5,0.9]}"],
        'outer.optimizer_args={"betas":[1.5,0.9]} is not taken by torch.optim.Adam (Invalid beta parameter '
        "at index 0: 1.5)",
        "values the optimizer takes",
    ),
    "outer-optimizer-args-lr": Case(
        "the learning rate among the optimizer's arguments",
        ["outer.optimizer=torch.optim.Adam", "outer.optimizer_args={lr:0.1}"],
        "outer.optimizer_args={\"lr\":0.1} holds 'lr', which the run gives: the learning rate is outer.lr",
        "outer.lr",
    ),
    "outer-optimizer-closure": Case(
        "an optimizer whose step needs a closure (it re-evaluates the loss)",
        ["outer.optimizer=torch.optim.LBFGS"],
        "outer.optimizer=torch.optim.LBFGS cannot step on a given gradient (LBFGS.step() missing 1 required "
        "positional argument: 'closure')",
        "an optimizer whose step() needs no closure",
    ),
    "outer-optimizer-args-built-in": Case(
        "arguments for the built-in step",
        ["outer.optimizer_args={momentum:0.5}"],
        'outer.optimizer_args={"momentum":0.5} with the built-in nesterov: its fields are outer.lr, '
        "outer.momentum and outer.nesterov",
        "outer.momentum=0.5, or a torch optimizer",
    ),
    "outer-optimizer-delayed-nesterov": Case(
        "a torch optimizer with delayed Nesterov, the default asynchronous rule (docs/async.md)",
        ["outer.schedule=async", "cluster=h100", "outer.optimizer=torch.optim.Adam"],
        "outer.arrivals.rule=delayed_nesterov with outer.optimizer=torch.optim.Adam: delayed Nesterov is its "
        "own step on the built-in's momentum",
        "outer.arrivals.rule=naive, or outer.optimizer=nesterov",
    ),
    "overlap-unknown": Case(
        "an outer overlap that does not exist (docs/overlap.md)",
        ["outer.overlap=late"],
        "outer.overlap='late' is not valid; valid: 'none', 'delayed', 'eager'",
        "none, delayed or eager",
    ),
    "overlap-with-delay": Case(
        "a whole-round overlap with Streaming DiLoCo's delay",
        ["outer.overlap=delayed", "outer.delay=1"],
        "outer.delay=1 with outer.overlap=delayed: the reduction already overlaps a whole round",
        "outer.delay=0 with an overlap",
    ),
    "overlap-with-merge": Case(
        "a whole-round overlap with a merge alpha",
        ["outer.overlap=eager", "outer.merge_alpha=0.5"],
        "outer.merge_alpha=0.5 with outer.overlap=eager is not built",
        "outer.merge_alpha=0, or outer.overlap=none",
    ),
    "eager-with-churn": Case(
        "eager updates with churn",
        ["outer.overlap=eager", "churn.p_miss=0.1"],
        "outer.overlap=eager with churn is not built",
        "outer.overlap=delayed or none, or churn off",
    ),
    "transform-unknown": Case(
        "a transform before the codec that does not exist (docs/compression.md)",
        ["outer.compress=topk", "outer.codec.transform=fft"],
        "outer.codec.transform='fft' is not valid; valid: 'none', 'dct'",
        "none or dct",
    ),
    "transform-with-none": Case(
        "a DCT of the pseudo-gradient with no compressor (a field of outer.codec, the fields the codecs "
        "share, with a codec whose entry does not read it)",
        ["outer.codec.transform=dct"],
        "outer.codec.transform=dct is not read by outer.compress=none; valid: a codec that reads it (int8, "
        "uint8, fp8_e4m3, fp8_e5m2, fp4_e2m1, e3m0, topk), or outer.codec.transform=none (its default)",
        "a block codec (outer.compress=topk, e3m0, ...), or outer.codec.transform=none",
    ),
    "error-decay-with-none": Case(
        "an error decay with no compressor (nothing left out to feed back)",
        ["outer.codec.error_decay=0.9"],
        "outer.codec.error_decay=0.9 is not read by outer.compress=none; valid: a codec that reads it (int8, "
        "uint8, fp8_e4m3, fp8_e5m2, fp4_e2m1, e3m0, topk, lowrank), or outer.codec.error_decay=1.0 (its "
        "default)",
        "a compressor with outer.error_feedback=true, or outer.codec.error_decay=1.0",
    ),
    "error-decay-range": Case(
        "an error decay outside [0, 1] (docs/compression.md)",
        ["outer.compress=topk", "outer.error_feedback=true", "outer.codec.error_decay=1.5"],
        "outer.codec.error_decay=1.5 is out of range; valid: [0, 1]",
        "a decay beta in [0, 1] (1 = plain error feedback)",
    ),
    "error-decay-without-feedback": Case(
        "an error decay without error feedback",
        ["outer.compress=topk", "outer.codec.error_decay=0.9"],
        "outer.codec.error_decay=0.9 without error feedback decays no buffer",
        "outer.error_feedback=true, or outer.codec.error_decay=1.0",
    ),
    "index-bits-unknown": Case(
        "top-k indices of a width not built",
        ["outer.compress=topk", "outer.topk.index_bits=16"],
        "outer.topk.index_bits=16 is not valid; valid: 32 or 12",
        "outer.topk.index_bits=32 or 12",
    ),
    "topk-settings-without-topk": Case(
        "top-k's own fields (its node, outer.topk) with another compressor (their older spellings, "
        "outer.topk_values and the like, which that compressor ignored or refused, are dropped with a note "
        "in train.log)",
        ["outer.compress=int8", "outer.topk.values=two_bit"],
        "outer.topk.values is not a field of outer.compress=int8: outer.topk exists only with "
        "outer.compress=topk; valid: outer.compress=topk, or no outer.topk.*",
        "outer.compress=topk, or top-k's fields unset",
    ),
    "index-bits-12-large-block": Case(
        "12-bit indices in blocks longer than 4096",
        ["outer.compress=topk", "outer.topk.index_bits=12", "outer.codec.block=8192"],
        "outer.topk.index_bits=12 with outer.codec.block=8192: 12 bits index a block of at most 4096",
        "outer.codec.block <= 4096, or outer.topk.index_bits=32",
    ),
    "index-bits-12-odd-k": Case(
        "12-bit indices with an odd number kept per block",
        [
            "outer.compress=topk",
            "outer.topk.index_bits=12",
            "outer.codec.block=4096",
            "outer.topk.fraction=0.03",
        ],
        "outer.topk.index_bits=12 with outer.topk.fraction=0.03 keeps k = 123 of a 4096-value block, an odd",
        "a fraction whose k is even (the line names one), or outer.topk.index_bits=32",
    ),
    "tile-without-block-codec": Case(
        "2-D tiles of the blocks with no block codec (docs/compression.md)",
        ["outer.codec.tile=64"],
        "outer.codec.tile=64 is not read by outer.compress=none; valid: a codec that reads it (int8, uint8, "
        "fp8_e4m3, fp8_e5m2, fp4_e2m1, e3m0, topk), or outer.codec.tile=0 (its default)",
        "a block codec, or outer.codec.tile=0",
    ),
    "tile-not-the-block": Case(
        "a tile that is not one block",
        ["outer.compress=topk", "outer.codec.tile=64"],
        "outer.codec.tile=64 with outer.codec.block=128: a tile is one block; valid: outer.codec.block=4096, "
        "or outer.codec.tile=0",
        "outer.codec.block = outer.codec.tile squared",
    ),
    "lowrank-rank-0": Case(
        "a low-rank compression of rank 0 (docs/compression.md)",
        ["outer.compress=lowrank", "outer.lowrank.rank=0"],
        "outer.lowrank.rank=0 is too small; valid: >= 1",
        "a rank of at least 1",
    ),
    "lowrank-two_phase": Case(
        "low rank with the two-phase reduction",
        ["outer.compress=lowrank", "outer.codec.reduce=two_phase"],
        "outer.codec.reduce=two_phase is not read by outer.compress=lowrank",
        "outer.codec.reduce=gather (its default)",
    ),
    "lowrank-with-overlap": Case(
        "low rank with a whole-round overlap",
        ["outer.compress=lowrank", "outer.overlap=delayed"],
        "outer.compress=lowrank with outer.overlap=delayed is not built",
        "outer.overlap=none, or another outer.compress",
    ),
    "lowrank-with-transform": Case(
        "low rank with the DCT transform",
        ["outer.compress=lowrank", "outer.codec.transform=dct"],
        "outer.codec.transform=dct is not read by outer.compress=lowrank; valid: a codec that reads it "
        "(int8, uint8, fp8_e4m3, fp8_e5m2, fp4_e2m1, e3m0, topk), or outer.codec.transform=none (its "
        "default)",
        "outer.codec.transform=none, or a block codec",
    ),
    "negative-restarts": Case(
        "a negative number of restarts",
        ["processes=dist", "processes.max_restarts=-1"],
        "processes.max_restarts=-1 is not valid; valid: >= 0",
        '0 or more (docs/resume.md, "Restarts")',
    ),
    "moe-top-k": Case(
        "a mixture of experts choosing more experts than it has (docs/moe.md)",
        ["model=moe_tiny", "model.top_k=5"],
        "model.top_k=5 is out of range; valid: 1..model.n_experts=4",
        "1 to n_experts",
    ),
    "moe-multistream": Case(
        "a mixture of experts in the multistream model",
        ["model=multistream_tiny", "model.is_moe=true", "model.expert_ffn=8"],
        "model.is_moe=true with model.arch='multistream' is not built; valid: model.arch=decoder",
        "a decoder model: moe_tiny or moe_small",
    ),
    "non-finite-lr": Case(
        "a learning rate that is not a finite number (any float field: nan, inf)",
        ["inner.lr=nan"],
        "inner.lr=nan is not a finite number; valid: a finite number",
        "a finite number",
    ),
    "infinite-outer-lr": Case(
        "an infinite outer learning rate",
        ["outer.lr=inf"],
        "outer.lr=inf is not a finite number; valid: a finite number",
        "a finite number",
    ),
    "huge-world": Case(
        "a world beyond any machine (the plan's checks go over every rank)",
        ["world.size=1000000000", "replicas=1"],
        "world.size=1000000000 is too large; valid: 1..65536",
        "at most 65536 ranks",
    ),
    # Sizes that cannot fit (hypertrain/preflight/memory.py): the estimate is a pure function of the config,
    # so the line is the same on every machine up to "but <the memory available>"; each needs far more
    # than any test machine has (the smallest, the 7B model, 630 GB).
    "model-too-large-for-memory": Case(
        "a model whose replicas cannot fit this machine's memory",
        ["model.d_model=1000000"],
        "model.d_model=1000000, model.n_layers=2, model.vocab=256, replicas=2 need about 2.5 PB "
        "(weights 96 TB",
        "smaller sizes; guard.memory_check=false skips the check (the line gives the estimate's parts)",
    ),
    "vocabulary-too-large-for-memory": Case(
        "a vocabulary whose logits cannot fit",
        ["model.vocab=10000000000"],
        "phase.global_batch=32, data.seq_len=32, model.d_model=32, model.n_layers=2, model.vocab=10000000000 "
        "need about 312 TB",
        "a smaller vocabulary (or microbatch: inner.micro_batch)",
    ),
    "global-batch-too-large-for-memory": Case(
        "a global batch whose activations cannot fit",
        ["phase.global_batch=100000000"],
        "phase.global_batch=100000000, data.seq_len=32, model.d_model=32, model.n_layers=2, model.vocab=256 "
        "need about 39.1 TB",
        "a smaller batch, or inner.micro_batch to cut each replica's share into microbatches",
    ),
    "7b-model-on-a-small-machine": Case(
        "a 7B-sized model (d 4096, 32 layers, vocabulary 32000) on a machine without the memory for it",
        ["model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8"]
        + ["model.vocab=32000"],
        "model.d_model=4096, model.n_layers=32, model.vocab=32000, replicas=2 need about 630 GB",
        "a machine with the memory the line gives, or a smaller model",
    ),
    "replicas-too-many-for-memory": Case(
        "more replicas than this machine's memory holds",
        ["world.size=65536", "replicas=65536", "phase.global_batch=65536", "model.d_model=256"],
        "model.d_model=256, model.n_layers=2, model.vocab=256, replicas=65536 need about 5.54 TB",
        "fewer replicas, or processes=dist over several machines",
    ),
    "sweep-value-too-large-for-memory": Case(
        "a sweep with a value that cannot fit (checked before the sweep directory is written)",
        ["-m", "model.d_model=32,1000000", "hydra.sweep.dir=sweep"],
        "model.d_model=1000000, model.n_layers=2, model.vocab=256, replicas=2 need about 2.5 PB",
        "values that fit; no job runs and no sweep directory is left",
    ),
    # issue 48: outer.codec.block beyond every tensor. Such a block is the largest tensor's size (each
    # tensor one block, docs/compression.md), so 2^62 runs on the default model; the codec's padding of
    # every tensor to the largest is in the memory estimate: 9,003 tensors (1,000 layers) padded to the
    # 32-million-value embedding need 23 TB, refused at start (2^62 once overflowed torch's storage at the
    # first sync).
    "block-beyond-every-tensor-padding-cannot-fit": Case(
        "an outer.codec.block beyond every tensor on a model of many tensors and a large embedding: each "
        "tensor one block, every block padded to the largest",
        ["outer.compress=int8", "outer.codec.block=4611686018427387904", "model.n_layers=1000"]
        + ["model.vocab=1000000"],
        "outer.compress=int8, outer.codec.block=4611686018427387904, model.d_model=32, model.n_layers=1000, "
        "model.vocab=1000000, replicas=2 need about 23.1 TB",
        "a block the tensors fill (the default 128), or fewer, more even tensors",
    ),
    # issue 38: sample. `python -m hypertrain.sample RUN_DIR --prompt TEXT` on a run that is none, has no
    # weights to read, or has no text; or given a value out of range. It never writes.
    "sample-not-a-run": Case(
        "`python -m hypertrain.sample` given a directory that holds no run",
        ["{cwd}", "--prompt", "def "],
        "RUN_DIR={cwd} is not a run directory (no config.yaml); valid: the directory a training run wrote "
        "(its hydra.run.dir)",
        "the run's directory (hydra.run.dir)",
        command="sample",
    ),
    "sample-run-without-weights": Case(
        "`python -m hypertrain.sample` on a run that has not finished (no weights.pt) without --checkpoint",
        ["run", "--prompt", "def "],
        "run has no weights.pt yet (the run has not finished); valid: --checkpoint "
        "run/checkpoints/ckpt-u0000006.pt (its newest checkpoint)",
        "name one of its checkpoints with --checkpoint, or wait for the run to finish",
        setup=copy_of_earlier(_without("weights.pt")),
        command="sample",
    ),
    "sample-unknown-checkpoint": Case(
        "`python -m hypertrain.sample --checkpoint` naming no file",
        ["{earlier}", "--prompt", "def ", "--checkpoint", "{earlier}/checkpoints/ckpt-u9999999.pt"],
        "--checkpoint={earlier}/checkpoints/ckpt-u9999999.pt is not a file; valid: a checkpoint of "
        "{earlier} ({earlier}/checkpoints/ckpt-u*.pt)",
        "one of the run's checkpoints",
        command="sample",
    ),
    "sample-checkpoint-of-another-run": Case(
        "`python -m hypertrain.sample --checkpoint` naming a checkpoint of another run",
        ["run", "--prompt", "def ", "--checkpoint", "run/checkpoints/ckpt-u0000006.pt"],
        "--checkpoint=run/checkpoints/ckpt-u0000006.pt is of run 00000000000000000000000000000000, "
        "not of run",
        "a checkpoint of RUN_DIR's own run",
        setup=copy_of_earlier(_checkpoint_of_another_run),
        command="sample",
    ),
    "sample-no-tokens": Case(
        "`python -m hypertrain.sample --tokens` below 1",
        ["{earlier}", "--prompt", "def ", "--tokens", "0"],
        "--tokens=0 is too small; valid: a whole number >= 1",
        "at least one token",
        command="sample",
    ),
    "sample-negative-temperature": Case(
        "`python -m hypertrain.sample --temperature` below 0",
        ["{earlier}", "--prompt", "def ", "--temperature", "-0.5"],
        "--temperature=-0.5 is not valid; valid: 0 (greedy) or a finite number > 0",
        "0 for the likeliest token each step, or a positive temperature to sample",
        command="sample",
    ),
    "sample-empty-prompt": Case(
        "`python -m hypertrain.sample --prompt ''`",
        ["{earlier}", "--prompt", ""],
        "--prompt='' is empty; valid: some text for the model to continue",
        "some text",
        command="sample",
    ),
    "sample-token-bin-run": Case(
        "`python -m hypertrain.sample` on a run trained on data=token_bin (ids without a tokenizer)",
        ["run", "--prompt", "def "],
        "run trained on data=token_bin, whose ids have no tokenizer to read them as text; valid: a decoder "
        "run on data=stdlib, text_files or prepared",
        "a run on text: data=prepared keeps its tokenizer beside its ids",
        setup=copy_of_earlier(_trained_on("token_bin")),
        command="sample",
    ),
    "sample-speech-run": Case(
        "`python -m hypertrain.sample` on a run trained on data=speech (text and audio channels)",
        ["run", "--prompt", "def "],
        "run trained on data=speech, text and audio channels, not text alone; valid: a decoder run on "
        "data=stdlib, text_files or prepared",
        "a run on text",
        setup=copy_of_earlier(_trained_on("speech")),
        command="sample",
    ),
    # issue 48: sample. A prompt that is no text, and a corpus prepared again at the run's data.path with
    # another tokenizer (here: a run of vocab 256 whose corpus now has 257; the tokenizer's sha256, which
    # a run records, is tests/test_sample.py's)
    "sample-prompt-not-utf8": Case(
        "`python -m hypertrain.sample --prompt` holding bytes that are not UTF-8 (quoted as Python writes "
        "it, spaces kept)",
        ["{earlier}", "--prompt", "a   b\udcff"],
        "--prompt='a   b\\udcff' holds bytes that are not UTF-8; valid: UTF-8 text",
        "a prompt in UTF-8",
        command="sample",
    ),
    "sample-corpus-prepared-again": Case(
        "`python -m hypertrain.sample` on a data=prepared run whose corpus was prepared again with another "
        "tokenizer",
        ["run", "--prompt", "def "],
        "data.path='corpus' now holds a corpus of another tokenizer (vocab 257, the bytes tokenizer) than "
        "run trained with (vocab 256); valid: the corpus the run trained on at that path",
        "the corpus the run trained on (prepared again from the same inputs with the same --tokenizer)",
        setup=lambda earlier, cwd: (
            TWO_SOURCES(earlier, cwd),
            copy_of_earlier(_trained_on_corpus)(earlier, cwd),
        ),
        command="sample",
    ),
    "int-beyond-int64": Case(
        "an integer beyond 64 bits (any int field)",
        ["model.d_model=9223372036854775808"],
        "model.d_model=9223372036854775808 does not fit a 64-bit integer; valid: "
        "-9223372036854775808..9223372036854775807",
        "a value that fits 64 bits",
    ),
    "tensor-beyond-torch": Case(
        "sizes whose product is a tensor larger than torch can index (even with guard.memory_check=false)",
        ["model.vocab=4611686018427387904", "guard.memory_check=false"],
        "model.d_model=32, model.n_layers=2, model.vocab=4611686018427387904, phase.global_batch=32, "
        "data.seq_len=32 give the logits of a microbatch of 4.72e+21 elements, more than a tensor can hold",
        "smaller sizes",
    ),
    "divergence-guard-limit": Case(
        "a divergence guard limit out of range",
        ["guard.pseudo_grad_ratio=0"],
        "guard.pseudo_grad_ratio=0.0 is not valid; valid: > 0",
        "a positive ratio (guard.enabled=false turns the guard off)",
    ),
    "phase-past-the-data": Case(
        "a phase that starts past the end of the data",
        ["phase.offset=100000000"],
        "phase.offset=100000000 lies past the training stream",
        "an offset inside the stream, or more data",
    ),
    "missing-data-path": Case(
        "a data source without a path",
        ["data=text_files"],
        "data.path is empty; data=text_files needs a path",
        "data.path='my/**/*.txt'",
    ),
    "data-path-matches-nothing": Case(
        "a glob that matches no file",
        ["data=text_files", "data.path=nothing/*.txt"],
        "data.path='nothing/*.txt' matches no files",
        "a glob of existing text files",
    ),
    "empty-data-file": Case(
        "an empty data file",
        ["data=text_files", "data.path=empty.txt"],
        "data.path='empty.txt' holds 0 bytes",
        "a file with more examples than data.heldout",
        files={"empty.txt": b""},
    ),
    "token-ids-beyond-vocab": Case(
        "token ids at or above the model's vocabulary",
        ["data=token_bin", "data.path=train.bin", "model.vocab=256"],
        "model.vocab=256 is smaller than the data's vocabulary (301)",
        "model.vocab at least the largest id + 1",
        files={"train.bin": token_file(300)},
    ),
    "padded-bound-below-longest": Case(
        "a padded-token bound below the longest example",
        ["data.examples=documents", "data.max_len=128", "data.max_padded_tokens=64"],
        "data.max_padded_tokens=64 is smaller than the longest example",
        "at least data.max_len + 1",
    ),
    "multistream-model-on-text": Case(
        "a multistream model on one-channel data",
        ["model=multistream_tiny"],
        "model.arch=multistream needs data with several token channels, not data.name='stdlib'",
        "data=speech, or a one-channel model",
    ),
    "speech-on-the-byte-decoder": Case(
        "speech data on the one-stream (byte) decoder",
        ["data=speech"],
        "data=speech gives 1 + data.codebooks = 13 token channels per frame but model.arch='decoder' "
        "reads one stream; valid: model=multistream_tiny or multistream_small",
        "model=multistream_tiny (refused before the speech is built)",
    ),
    "processes-option-without-dist": Case(
        "a processes=dist option on one process",
        ["processes.layout=benchmark"],
        "processes.layout='benchmark' applies to processes=dist only (now processes=one); "
        "valid: processes=dist",
        "processes=dist, or drop the option",
    ),
    "dist-is-not-an-engine": Case(
        "an engine that is the processes' choice (engine.name=dist)",
        ["engine.name=dist"],
        "engine.name='dist' is not valid; valid: 'loop', 'stacked'",
        "processes=dist (the older engine=dist is read as that, with a notice)",
    ),
    "no-dist-layout": Case(
        "processes=dist with processes that fit no layout",
        ["processes=dist", "world.size=8", "replicas=4", "processes.nproc=3"],
        "processes=dist with 3 processes, world.size=8 and replicas=4 fits no layout; valid: benchmark",
        "processes = world.size, or a divisor of replicas",
    ),
    "shard-with-replicas-layout": Case(
        "sharded replicas (processes.shard=true) under the replicas layout",
        ["processes=dist", "processes.shard=true", "world.size=8", "replicas=4", "processes.nproc=2"],
        "processes.shard=true needs the benchmark layout (processes = world.size = 8); the replicas layout "
        "holds whole replicas in one process",
        "processes.nproc=0 (processes = world.size), or processes.shard=false",
    ),
    "shard-with-low-rank": Case(
        "sharded replicas (processes.shard=true) with a factored codec (low rank)",
        ["processes=dist", "processes.shard=true", "world.size=4", "replicas=2", "outer.compress=lowrank"],
        "outer.compress=lowrank (its factors of each matrix are not cut on shards) is not built "
        "with processes.shard=true",
        "outer.compress=none or a codec with blocks (a quantizer or topk), or processes.shard=false",
    ),
    "shard-with-hf-bf16": Case(
        "sharded replicas (processes.shard=true) of a Hugging Face model in bf16",
        [
            "processes=dist",
            "processes.shard=true",
            "world.size=4",
            "replicas=2",
            "model=hf_llama_tiny",
            "model.compute_dtype=bf16",
        ],
        "model hf_llama_tiny with model.compute_dtype=bf16 is not built with processes.shard=true",
        "model.compute_dtype=fp32, or processes.shard=false",
    ),
    "cuda-on-a-cpu-build": Case(
        "a CUDA device on a machine or torch build without one",
        ["engine.device=cuda"],
        "engine.device='cuda'",
        "cpu, or a machine whose torch sees a CUDA device",
    ),
    "absent-device": Case(
        "a device this machine does not have",
        ["engine.device=cuda:99"],
        "engine.device='cuda:99'",
        "cpu, or a CUDA device that exists",
    ),
    "unwritable-output": Case(
        "an output directory where nothing can be created",
        ["hydra.run.dir=/proc/self/run"],
        "hydra.run.dir=/proc/self/run: nothing can be created in /proc/self",
        "a writable directory",
    ),
    "output-under-a-file": Case(
        "an output directory under a file",
        ["hydra.run.dir=notes/run"],
        "hydra.run.dir={cwd}/notes/run lies under {cwd}/notes, which is a file",
        "a path under a directory",
        files={"notes": b"x"},
    ),
    "path-hydra-cannot-read": Case(
        "a path Hydra's override grammar cannot read (a leading ~)",
        ["hydra.run.dir=~/x"],
        "hydra.run.dir=~/x cannot be read by Hydra's override grammar (at '~', character 15); valid: an "
        "absolute path, hydra.run.dir=",
        "an absolute path ($HOME/x), or the value in quotes: 'hydra.run.dir=\"~/x\"'",
    ),
    "path-unresolvable": Case(
        "an output directory with an interpolation that does not resolve",
        ["hydra.run.dir=out/${oops}"],
        "hydra.run.dir=out/${oops} cannot be resolved (Interpolation key 'oops' not found)",
        "a path, with ${now:...} if wanted",
    ),
    "path-name-too-long": Case(
        "an output directory with a folder name longer than Linux allows (255 bytes)",
        [f"hydra.run.dir=out/{'n' * 256}"],
        f"hydra.run.dir=out/{'n' * 256} has a folder name of 256 bytes",
        "names of at most 255 bytes",
    ),
    "sweep-invalid-first-job": Case(
        "a sweep whose first job is invalid (-m; here hydra.mode=MULTIRUN, as -m must come first)",
        ["hydra.mode=MULTIRUN", "replicas=3,2", "hydra.sweep.dir=sweep"],
        "replicas=3 does not divide world.size (8); valid: a divisor of 8",
        "a valid value; a rejected sweep leaves no sweep directory",
    ),
    "sweep-later-value-wrong-type": Case(
        "a sweep with a value of the wrong type after its first (Hydra)",
        ["-m", "inner.H=1,x,3"],
        "Error merging override inner.H=x Value 'x' of type 'str' could not be converted to Integer",
        "every value of a sweep is composed before its first job runs; give values of the field's type",
        hydra=True,
    ),
    "sweep-later-option-missing": Case(
        "a sweep over a group's options, one of which does not exist (Hydra)",
        ["-m", "model=tiny,huge"],
        "In 'train': Could not find 'model/huge'; valid: base, hf, hf_gpt2_tiny, hf_llama_tiny, "
        "hf_qwen2_tied_tiny, moe_small, moe_tiny, multistream_small, multistream_tiny, small, tiny",
        "pick options the group has",
        hydra=True,
    ),
    "run-directory-holds-a-run": Case(
        "a run directory that holds a run, without resume",
        ["hydra.run.dir={earlier}"],
        "hydra.run.dir={earlier} already holds a run (metrics.jsonl); valid: a new directory",
        "a new directory, or resume=true to go on",
    ),
    "directory-with-the-users-files": Case(
        "a run directory that holds files of the user's (hydra.run.dir=. in a folder of one's own)",
        ["hydra.run.dir=."],
        "hydra.run.dir={cwd} holds files that are not this run's (checkpoints, config.yaml, plan.json); "
        "valid: a new or empty directory",
        "a new or empty directory (a run writes config.yaml, plan.json, weights.pt, checkpoints/ there)",
        files={"config.yaml": b"mine", "plan.json": b"{}", "checkpoints/ckpt-u0000001.pt": b"mine"},
    ),
    "old-run-without-its-records": Case(
        "an earlier run's directory whose metrics.jsonl was deleted, reused",
        ["hydra.run.dir=run"],
        "hydra.run.dir={cwd}/run holds files that are not this run's (.hydra, checkpoints, config.yaml "
        "and 3 more); valid: a new or empty directory",
        "a new directory (or restore metrics.jsonl and resume=true)",
        setup=copy_of_earlier(_without("metrics.jsonl")),
    ),
    "old-run-without-records-or-checkpoints-auto": Case(
        "the same with its checkpoints deleted too, and resume=auto",
        ["hydra.run.dir=run", "resume=auto"],
        "hydra.run.dir={cwd}/run holds files that are not this run's (weights.pt); valid: a new or empty "
        "directory, or the directory of this run",
        "a new directory",
        setup=copy_of_earlier(lambda run: (_without("metrics.jsonl")(run), _without("checkpoints")(run))),
    ),
    "checkpoints-is-a-file": Case(
        "resume=auto where the run's checkpoints/ has been replaced by a file",
        ["hydra.run.dir=run", "resume=auto"],
        "{cwd}/run/checkpoints is not a folder, so the run cannot keep its checkpoints there",
        "that file moved away (a run's checkpoints/ is a folder it makes)",
        setup=copy_of_earlier(
            lambda run: (_without("checkpoints")(run), (run / "checkpoints").write_text("x"))
        ),
    ),
    "nothing-to-resume": Case(
        "resume=true where there is no checkpoint",
        ["hydra.run.dir=fresh", "resume=true"],
        "resume=true but {cwd}/fresh holds no checkpoint",
        "the directory of a run that wrote checkpoints",
    ),
    "resume-missing-path": Case(
        "resume= a path that does not exist",
        ["resume=/no/such/run"],
        "resume='/no/such/run' is no checkpoint file and no run directory holding one",
        "true, auto, a checkpoint file or a run directory",
    ),
    "resume-unknown-home": Case(
        "resume= a path under ~ of a user this machine does not know",
        ["resume='~no_such_user/run'"],
        "resume='~no_such_user/run' starts with a ~ whose home directory this machine does not know",
        "true, auto, a checkpoint file or a run directory (an absolute path)",
    ),
    "resume-changed-plan": Case(
        "resume with a changed plan",
        ["hydra.run.dir={earlier}", "resume=true", "phase.offset=64"],
        "phase.offset=64 differs from the checkpoint's phase.offset=0; a resumed run may change only "
        "logger.*, checkpoint.*, guard.* and phase.updates; valid: resume with phase.offset=0, or start a "
        "new run in another directory",
        "the run's own config (only logger.*, checkpoint.*, guard.* and phase.updates may change)",
    ),
    # A changed config is named as the user changed it, never by a field derived from it (here
    # processes.layout, outer.assignment, model.expert_ffn), whose advice would loop (issue 35, item 5).
    "resume-another-processes": Case(
        "resume with another option of a config group (processes=dist on a run of processes=one)",
        ["hydra.run.dir={earlier}", "resume=true", "processes=dist"],
        "processes=dist differs from the checkpoint's processes=one; a resumed run may change only "
        "logger.*, checkpoint.*, guard.* and phase.updates; valid: resume with processes=one, or start a "
        "new run in another directory",
        "resume with the run's own option, or start a new run in another directory",
    ),
    "resume-more-fragments": Case(
        "resume=auto with a field that others are derived from changed (outer.fragments=3 on a run of 1)",
        ["hydra.run.dir={earlier}", "resume=auto", "outer.fragments=3"],
        "outer.fragments=3 differs from the checkpoint's outer.fragments=1; a resumed run may change only "
        "logger.*, checkpoint.*, guard.* and phase.updates; valid: resume with outer.fragments=1, or start "
        "a new run in another directory",
        "resume with the run's own value, or start a new run in another directory",
    ),
    "resume-another-model-by-path": Case(
        "resume=PATH with another model (model=moe_tiny on a run of the default model)",
        ["resume={earlier}/checkpoints/ckpt-u0000006.pt", "model=moe_tiny"],
        "model=moe_tiny differs from the checkpoint's model=tiny; a resumed run may change only logger.*, "
        "checkpoint.*, guard.* and phase.updates; valid: resume with model=tiny, or start a new run in "
        "another directory",
        "resume with the run's own model, or start a new run in another directory",
    ),
    "resume-auto-another-model-before-a-checkpoint": Case(
        "resume=auto with another model where the run stopped before its first checkpoint",
        ["hydra.run.dir=run", "resume=auto", "model=moe_tiny"],
        "hydra.run.dir={cwd}/run holds another run that stopped before its first checkpoint (model=tiny "
        "there, model=moe_tiny here); valid: resume with model=tiny, or a new directory",
        "resume with the run's own model, or a new directory",
        setup=_stopped_before_its_first_checkpoint,
    ),
    "resume-corrupt-checkpoint": Case(
        "resume from a corrupt checkpoint",
        ["resume=run/checkpoints/broken.pt"],
        "checkpoint {cwd}/run/checkpoints/broken.pt cannot be read",
        "an earlier checkpoint (resume=true skips a corrupt newest one)",
        files={"run/metrics.jsonl": b"", "run/checkpoints/broken.pt": b"PK\x03\x04 not a whole zip"},
    ),
    "resume-records-missing": Case(
        "resume where the run's metrics.jsonl was deleted",
        ["hydra.run.dir=run", "resume=true"],
        "{cwd}/run/metrics.jsonl is missing but checkpoint {cwd}/run/checkpoints/ckpt-u0000006.pt goes on "
        "from its first",
        "restore the run's metrics.jsonl, or start a new run",
        setup=copy_of_earlier(_without("metrics.jsonl")),
    ),
    "resume-records-cut-short": Case(
        "resume where metrics.jsonl is shorter than the checkpoint recorded",
        ["hydra.run.dir=run", "resume=true"],
        "{cwd}/run/metrics.jsonl holds 100 bytes, fewer than the",
        "restore the run's metrics.jsonl (rows were lost), or start a new run",
        setup=copy_of_earlier(_metrics_cut),
    ),
    "resume-records-edited": Case(
        "resume where metrics.jsonl was changed before the checkpoint's length",
        ["hydra.run.dir=run", "resume=true"],
        "{cwd}/run/metrics.jsonl up to byte",
        "the run's own unedited metrics.jsonl",
        setup=copy_of_earlier(_metrics_edited),
    ),
    "resume-checkpoint-of-another-run": Case(
        "resume from a checkpoint of another run than the directory's records",
        ["hydra.run.dir=run", "resume=true"],
        "checkpoint {cwd}/run/checkpoints/ckpt-u0000006.pt is of run 00000000000000000000000000000000 but",
        "a checkpoint of the run whose metrics.jsonl is beside it",
        setup=copy_of_earlier(_checkpoint_of_another_run),
    ),
    "extended-without-decay": Case(
        "phase.updates extended without an explicit inner.decay_steps",
        ["hydra.run.dir={earlier}", "resume=true", "phase.updates=8"],
        "phase.updates=8 extends the run (6 before)",
        "set inner.decay_steps to the saved value explicitly",
    ),
    # Launch-side refusals (issue 21): a SLURM sweep without a controller, a backend the machine
    # cannot run, -m among the overrides.
    "slurm-without-controller": Case(
        "a SLURM sweep where no SLURM controller answers (here SLURM_CONF names a cluster whose "
        "slurmctld does not run; or sbatch is not installed)",
        ["-m", "hydra/launcher=slurm"],
        "hydra/launcher=slurm: no SLURM controller can be reached from here (",
        "submit where `scontrol ping` answers (SLURM_CONF), or drop hydra/launcher=slurm; nothing is "
        "created or submitted (an sbatch that refuses at submission: the same, exit 2)",
        files={"slurm.conf": DEAD_CLUSTER},
        env={"SLURM_CONF": "{cwd}/slurm.conf"},
    ),
    "launcher-plugin-not-installed": Case(
        "a sweep's launcher whose Hydra plugin is not installed (hydra/launcher=joblib, submitit_local, "
        "slurm or slurm_dist without pyproject.toml's dev extra; here both plugins are hidden from "
        "Python and Hydra's plugin scan by a sitecustomize)",
        ["-m", "replicas=1,2", "hydra/launcher=joblib", "hydra.sweep.dir=sweep"],
        "hydra/launcher=joblib needs the Hydra plugin hydra-joblib-launcher, which is not installed",
        "python -m pip install the package the line names (or the whole dev extra: scripts/setup --dev), "
        "or no hydra/launcher (Hydra's basic launcher runs the jobs one by one); no sweep folder is made",
        files={"hide/sitecustomize.py": HIDE_PLUGINS.encode()},
        env={
            "PYTHONPATH": f"{{cwd}}/hide{os.pathsep}{REPO}",
            "HIDDEN_PLUGINS": "hydra_joblib_launcher,hydra_submitit_launcher",
        },
    ),
    "nccl-without-cuda": Case(
        "processes.backend=nccl on a machine without CUDA",
        ["processes=dist", "world=2", "replicas=1", "processes.backend=nccl"],
        "processes.backend=nccl needs CUDA devices, but CUDA is not available to this torch",
        "processes.backend=gloo or auto (nccl also needs engine.device=cuda and a GPU per process)",
    ),
    "nccl-on-cpu-tensors": Case(
        "processes.backend=nccl with engine.device=cpu on a machine with CUDA",
        ["processes=dist", "world=2", "replicas=1", "processes.backend=nccl"],
        "processes.backend=nccl moves CUDA tensors only, but engine.device='cpu'",
        "engine.device=cuda, or processes.backend=gloo or auto",
    ),
    "multirun-flag-among-overrides": Case(
        "-m between overrides (Hydra's parser takes it only first or last; the entry takes it anywhere)",
        ["-m", "replicas=3,2", "hydra.sweep.dir=sweep"],
        "replicas=3 does not divide world.size (8); valid: a divisor of 8",
        "-m anywhere works as -m first; a rejected sweep leaves no sweep directory",
    ),
    # Run-start failures known up front (issue 21): W&B that could not start, resume=FILE outside a
    # run. NETRC and WANDB_CONFIG_DIR name files that do not exist: no credentials, whoever runs it.
    "wandb-online-without-credentials": Case(
        "W&B online without credentials (no WANDB_API_KEY, netrc entry or `wandb login`)",
        ["logger=wandb", "logger.mode=online"],
        "WANDB_MODE='online' needs W&B credentials for ",
        "`wandb login` or WANDB_API_KEY, or logger.mode=offline and `wandb sync` later",
        env={
            "WANDB_MODE": "online",
            "WANDB_API_KEY": "",
            "WANDB_IDENTITY_TOKEN_FILE": "",
            "NETRC": "{cwd}/no-netrc",
            "WANDB_CONFIG_DIR": "{cwd}/no-wandb-config",
        },
    ),
    "wandb-mode-unknown": Case(
        "a W&B mode wandb does not have",
        ["logger=wandb"],
        "WANDB_MODE='bogus' is not a W&B mode; valid: online, offline, disabled, dryrun, run, shared",
        "one of the modes listed (WANDB_MODE wins over logger.mode)",
        env={"WANDB_MODE": "bogus"},
    ),
    "wandb-project-rejected": Case(
        "a W&B project name wandb rejects (a '/', or over 128 characters)",
        ["logger=wandb", "logger.project=team/speech"],
        "logger.project='team/speech' is not a W&B project name (it holds '/'); valid: 1 to 128 characters",
        "a name without / \\ # ? % : (the team goes in logger.entity)",
    ),
    "resume-file-outside-a-run": Case(
        "resume= a checkpoint file copied out of its run's checkpoints/ folder",
        ["resume=loose.pt"],
        "resume='loose.pt' is a file, but it lies outside a run's checkpoints/ folder; valid: a run "
        "directory, or a checkpoint inside RUN/checkpoints/ of a run that has its metrics.jsonl",
        "the checkpoint where its run wrote it, or the run's directory",
        setup=lambda earlier, cwd: shutil.copy(
            sorted((earlier / "checkpoints").glob("ckpt-u*.pt"))[-1], cwd / "loose.pt"
        ),
    ),
    "resume-damaged-checkpoint": Case(
        "resume= a checkpoint whose bytes changed after it was written (a failing disk, a stray write)",
        ["resume={cwd}/run/checkpoints/ckpt-u0000006.pt"],
        "checkpoint {cwd}/run/checkpoints/ckpt-u0000006.pt is not the one that was written (its sha256 ",
        "resume=RUN (or resume=true): the newest checkpoint whose bytes match its digest",
        setup=copy_of_earlier(_flip_a_bit),
    ),
    # numpy's generators take no negative seed (issue 35: a traceback, exit 1, the run directory left)
    **{
        f"negative-{key.replace('.', '-')}": Case(
            f"a negative {key} (numpy's random generators take seeds >= 0)",
            [f"{key}=-1"],
            f"{key}=-1 is too small; valid: >= 0",
            "a seed >= 0",
        )
        for key in ("data.shuffle_seed", "cluster.straggler.seed", "churn.seed")
    },
    "threads-beyond-the-cpus": Case(
        "engine.threads above the CPUs the process may use (far above, OpenMP cannot start: a segfault)",
        ["engine.threads=100000"],
        "engine.threads=100000 is more than the ",
        "0 (torch's default) or at most the CPUs of the machine (the line says how many)",
    ),
    **{
        f"timeout-{name}": Case(
            f"processes.timeout_s {name} (torch's timedelta overflowed on rank 0; gloo timed out in C++)",
            ["processes=dist", "world=2", "replicas=1", f"processes.timeout_s={value}"],
            f"processes.timeout_s={value} is out of range; valid: 1 to 31536000 seconds (a year)",
            "a timeout between a second and a year",
        )
        for name, value in (("huge", "1e+15"), ("tiny", "1e-06"))
    },
    "fault-hook-left-set": Case(
        "HYPERTRAIN_FAULT (the tests' fault hook) left set in the environment to something it cannot do",
        [],
        "HYPERTRAIN_FAULT='garbage' is not a fault of the tests' hook; valid: unset it",
        "unset HYPERTRAIN_FAULT: it is for tests only",
        env={"HYPERTRAIN_FAULT": "garbage"},
    ),
    # exp(sigma * z) overflowed the clock: two RuntimeWarnings, NaN and Infinity in metrics.jsonl, exit 0
    # (issue 35); each cluster number has the range that keeps the clock finite (hypertrain.config)
    "straggler-sigma-overflowing-the-clock": Case(
        "a straggler sigma whose factors exp(sigma * z) would overflow the clock (or any cluster number "
        "beyond its range: docs/clock.md)",
        ["cluster=h100", "cluster.straggler.sigma=1e6"],
        "cluster.straggler.sigma=1000000.0 is out of range; valid: [0, 10]",
        "a sigma of at most 10 (already a factor of e^10 for one replica in six)",
    ),
    # issue 48: the cluster's speeds and the schedules' fields. The clock command read speeds of another
    # length (fewer: an IndexError traceback; more: cut silently) and a subnormal one (a table of nan, exit
    # 0; training stopped mid-run, exit 1, the run directory made); each schedule's fields were accepted
    # and ignored under the other.
    **{
        f"clock-speeds-{name}-than-replicas": Case(
            f"the clock command given {name} cluster.replica_speeds than the run's replicas",
            ["run", f"cluster.replica_speeds={speeds}"],
            f"run: cluster.replica_speeds={shown} has {count} speeds; valid: one per replica (2), or []",
            "one speed per replica of the run (training's own line)",
            setup=copy_of_earlier(lambda run: None),
            command="clock",
        )
        for name, speeds, shown, count in (
            ("fewer", "[1]", "[1.0]", 1),
            ("more", "[1,1,1]", "[1.0, 1.0, 1.0]", 3),
        )
    },
    "subnormal-speed": Case(
        "a replica speed so small that a step's seconds over it overflow the clock (a subnormal 1e-320)",
        ["cluster=h100", "cluster.replica_speeds=[1,1e-320]"],
        "cluster.replica_speeds=[1.0, 1e-320] is out of range; valid: finite numbers >= 1e-54",
        "speeds of at least 1e-54 (hypertrain.config: the clock stays finite)",
    ),
    "clock-subnormal-speed": Case(
        "the clock command given a subnormal replica speed (it printed nan seconds)",
        ["run", "cluster.replica_speeds=[1,1e-320]"],
        "cluster.replica_speeds=[1.0, 1e-320] is out of range; valid: finite numbers >= 1e-54",
        "speeds of at least 1e-54 (training's own line)",
        setup=copy_of_earlier(lambda run: None),
        command="clock",
    ),
    "clock-speeds-and-sigma": Case(
        "the clock command given speeds both listed and drawn (the list was used, the sigma ignored)",
        ["run", "cluster.replica_speeds=[1,2]", "cluster.speed_sigma=0.5"],
        "cluster.replica_speeds with cluster.speed_sigma=0.5: the speeds are given or drawn, not both",
        "one of the two (training's own line)",
        setup=copy_of_earlier(lambda run: None),
        command="clock",
    ),
    **{
        f"async-{field.replace('_', '-')}-with-rounds": Case(
            f"outer.{field} (the asynchronous server's, in its older spelling) in a synchronous run",
            [f"outer.{field}={value}"],
            f"outer.arrivals.{today} is not a field of outer.schedule=rounds: outer.arrivals exists only "
            "with outer.schedule=async; valid: outer.schedule=async, or no outer.arrivals.*",
            "outer.schedule=async, or the field unset",
        )
        for field, value, today in (
            ("grace_s", "0.5", "grace_s"),
            ("async_rule", "naive", "rule"),
            ("dn_buffer", "2", "dn_buffer"),
            ("dn_activation", "5", "dn_activation"),
            ("async_eval_every", "2", "eval_every"),
        )
    },
    "two-phase-with-async": Case(
        "outer.codec.reduce=two_phase (a round's reduction) under async, whose payloads travel whole",
        ["outer.schedule=async", "cluster=h100", "outer.compress=int8", "outer.codec.reduce=two_phase"],
        "outer.schedule=async with outer.codec.reduce=two_phase is not built (docs/async.md); valid: "
        "outer.schedule=rounds, or outer.codec.reduce at its default",
        "outer.schedule=rounds, or outer.codec.reduce at its default",
    ),
    "index-bits-12-with-blocks-of-one": Case(
        "12-bit top-k indices with blocks of one value (k = 1 each: no even k exists; the advice was "
        "outer.topk.fraction=0.0, itself refused)",
        ["outer.compress=topk", "outer.topk.index_bits=12", "outer.codec.block=1"],
        "outer.topk.index_bits=12 with outer.codec.block=1 keeps k = 1 of each block, an odd number (12-bit "
        "indices pack two in three bytes); valid: outer.codec.block >= 2, or outer.topk.index_bits=32",
        "outer.codec.block >= 2, or outer.topk.index_bits=32",
    ),
    "resume-shorter-phase": Case(
        "resume with a shorter phase.updates (it may change, but only to a longer phase)",
        ["hydra.run.dir={earlier}", "resume=true", "phase.updates=4"],
        "phase.updates=4 shortens the run (6 before); a resumed run may change phase.updates only to a "
        "longer phase; valid: resume with phase.updates=6 or more, or start a new run in another directory",
        "phase.updates at least the run's own, or a new run in another directory",
    ),
    "resume-newer-checkpoint-of-another-run": Case(
        "resume where the newest checkpoint is another run's, written after more records than these "
        "(it was blamed on rows lost from metrics.jsonl)",
        ["hydra.run.dir=run", "resume=true"],
        "checkpoint {cwd}/run/checkpoints/ckpt-u0000006.pt is of run 00000000000000000000000000000000 but",
        "a checkpoint of the run whose metrics.jsonl is beside it",
        setup=copy_of_earlier(_newer_checkpoint_of_another_run),
    ),
    # issue 38: prepare (`python -m hypertrain.data prepare INPUT ... --out DIR`; docs/data.md)
    "prepare-input-matching-nothing": Case(
        "prepare: an INPUT that is missing, or a glob that matches no file",
        ["prepare", "texts/**/*.txt", "--out", "corpus"],
        "input 'texts/**/*.txt' matches no files; valid: a glob of text files ('docs/**/*.txt'), JSONL",
        "name existing files: a glob (quoted, `**` recursive), JSONL, Parquet/Arrow files or a saved dataset",
        command="data",
    ),
    "prepare-directory-not-a-dataset": Case(
        "prepare: a directory as INPUT that `datasets`' save_to_disk did not write",
        ["prepare", "texts", "--out", "corpus"],
        "input 'texts' is a directory but not a dataset saved with datasets' save_to_disk",
        "a glob of its files (`'texts/**/*.txt'`), or the directory save_to_disk wrote",
        files={"texts/a.txt": b"a document"},
        command="data",
    ),
    "prepare-empty-input": Case(
        "prepare: an INPUT with no documents (an empty JSONL file, a table of no rows)",
        ["prepare", "docs.txt", "empty.jsonl", "--out", "corpora/mine"],
        "input 'empty.jsonl' holds no documents; valid: at least one document in every input",
        "leave the empty input out",
        files={"docs.txt": b"a document", "empty.jsonl": b"\n"},
        command="data",
    ),
    "prepare-unknown-field": Case(
        "prepare: a `--field` the JSONL records (or the table's columns) do not have",
        ["prepare", "docs.jsonl", "--out", "corpus", "--field", "text"],
        "--field 'text' is not a field of {cwd}/docs.jsonl; valid: one of ['body', 'id'] (--field NAME)",
        "`--field` one of the fields the line names",
        files={"docs.jsonl": b'{"id": 1, "body": "a document"}\n'},
        command="data",
    ),
    "prepare-line-not-json": Case(
        "prepare: a JSONL line that is not a JSON object",
        ["prepare", "docs.jsonl", "--out", "corpus"],
        "{cwd}/docs.jsonl:2 is not JSON (Expecting value: line 1 column 1 (char 0)); valid: one JSON object",
        "fix the line the error names (file:line)",
        files={"docs.jsonl": b'{"text": "a document"}\nnot json\n'},
        command="data",
    ),
    "prepare-tokenizer-that-does-not-load": Case(
        "prepare: a `--tokenizer` file that is not a Hugging Face tokenizer.json",
        ["prepare", "docs.txt", "--out", "corpus", "--tokenizer", "tokenizer.json"],
        "--tokenizer 'tokenizer.json' does not load (",
        "a tokenizer.json saved by `tokenizers` (or `transformers`' save_pretrained), bytes, or train:V",
        files={"docs.txt": b"a document", "tokenizer.json": b"{}"},
        command="data",
    ),
    **{
        f"prepare-trained-vocabulary-{name}": Case(
            f"prepare: `--tokenizer train:V` with V {what}",
            ["prepare", "docs.txt", "--out", "corpus", "--tokenizer", f"train:{value}"],
            f"--tokenizer 'train:{value}': V='{value}' is not a vocabulary a byte-level BPE can have; "
            "valid: train:V with V an integer 258..16777216",
            "V an integer from 258 (the 256 bytes, the eod and one merge) to 2^24 (the trainer reserves "
            "about 70 bytes a token up front); a larger vocabulary as a tokenizer.json trained elsewhere",
            files={"docs.txt": b"a document"},
            command="data",
        )
        for name, value, what in (
            ("too-small", "256", "below 258"),
            ("not-an-integer", "4k", "not an integer"),
            ("over-the-trainer", "1000000000", "over 2^24 (the trainer would reserve 71 GB and abort)"),
        )
    },
    "prepare-into-another-corpus": Case(
        "prepare: `--out` a directory holding a corpus prepared from other inputs or options",
        ["prepare", "docs.txt", "--out", "corpus", "--tokenizer", "train:300"],
        "--out '{cwd}/corpus' holds another corpus (tokenizer bytes (vocab 257), 1 documents, 11 tokens",
        "a new or empty `--out`, or remove the old corpus; the same inputs and options say nothing to do",
        files={"docs.txt": b"a document"},
        setup=prepared_corpus,
        command="data",
    ),
    "prepare-into-other-files": Case(
        "prepare: `--out` a directory holding other files",
        ["prepare", "docs.txt", "--out", "corpus"],
        "--out '{cwd}/corpus' holds other files (no prepared corpus); valid: a new or empty directory",
        "a new or empty `--out`",
        files={"docs.txt": b"a document", "corpus/notes.txt": b"mine"},
        command="data",
    ),
    "prepare-without-the-data-extra": Case(
        "prepare: a Parquet, Arrow or save_to_disk INPUT without the `data` extra (pyarrow, datasets; here "
        "hidden by a sitecustomize)",
        ["prepare", "docs.parquet", "--out", "corpus"],
        "Parquet, Arrow and save_to_disk inputs need pyarrow and datasets, which are not installed; "
        "valid: pip install 'hypertrain[data]'",
        "pip install 'hypertrain[data]' (scripts/setup --dev installs it)",
        files={"docs.parquet": b"PAR1", "hide/sitecustomize.py": HIDE_MODULES.encode()},
        env={"PYTHONPATH": f"{{cwd}}/hide{os.pathsep}{REPO}", "HIDDEN_MODULES": "pyarrow,datasets"},
        command="data",
    ),
    # issue 48: prepare (each was a traceback; a full disk, a read-only filesystem and a mount point need an
    # injected OSError: tests/test_prepare.py)
    "prepare-empty-input-string": Case(
        'prepare: an empty INPUT (an unset shell variable: `prepare "$DOCS" --out corpus`)',
        ["prepare", "", "--out", "corpus"],
        "input '' is empty (an unset shell variable?); valid: a glob of text files",
        "name the files (a quoted glob), or set the variable",
        command="data",
    ),
    "prepare-two-inputs-naming-one-file": Case(
        "prepare: two INPUTs that match the same file (it would be in the corpus twice)",
        ["prepare", "docs/*.txt", "docs/a.txt", "--out", "corpus"],
        "input 'docs/a.txt' names {cwd}/docs/a.txt, which input 'docs/*.txt' names too; valid: inputs that",
        "globs that do not overlap",
        files={"docs/a.txt": b"a document", "docs/b.txt": b"another"},
        command="data",
    ),
    **{
        f"prepare-{name}": Case(
            f"prepare: a {what} compressed input",
            ["prepare", f"docs.txt.{suffix}", "--out", "corpus"],
            f"input file '{{cwd}}/docs.txt.{suffix}' cannot be decompressed (",
            "the whole file (compress it again), or leave it out",
            files={f"docs.txt.{suffix}": data},
            command="data",
        )
        for name, what, suffix, data in (
            ("truncated-gz", "truncated `.gz`", "gz", gzip.compress(b"a document " * 100)[:40]),
            ("corrupt-xz", "corrupt `.xz`", "xz", b"not xz at all"),
        )
    },
    "prepare-tokenizer-that-cannot-encode": Case(
        "prepare: a `--tokenizer` that cannot encode the text (a WordLevel without an unknown token)",
        ["prepare", "docs.txt", "--out", "corpus", "--tokenizer", "words.json"],
        "--tokenizer 'words.json' cannot encode the text of input 'docs.txt' (WordLevel error: Missing",
        "a tokenizer with an unknown token (`unk_token`) or a byte-level one, bytes, or train:V",
        files={"docs.txt": b"a document here", "words.json": word_level_without_unk()},
        command="data",
    ),
    "prepare-out-under-a-file": Case(
        "prepare: `--out` under a file",
        ["prepare", "docs.txt", "--out", "docs.txt/corpus"],
        "--out '{cwd}/docs.txt/corpus' lies under {cwd}/docs.txt, which is a file; valid: a path under a",
        "an `--out` under a directory",
        files={"docs.txt": b"a document"},
        command="data",
    ),
    "prepare-out-where-nothing-can-be-made": Case(
        "prepare: `--out` where nothing can be created (`/proc`; a read-only filesystem says the same)",
        ["prepare", "docs.txt", "--out", "/proc/hypertrain-corpus"],
        "--out '/proc/hypertrain-corpus': nothing can be created in /proc (No such file or directory); "
        "valid: a new or empty directory where this user can write",
        "an `--out` on a writable filesystem",
        files={"docs.txt": b"a document"},
        command="data",
    ),
    "prepare-out-being-prepared": Case(
        "prepare: `--out` that another prepare is writing (it holds the lock `.DIR.lock` beside DIR)",
        ["prepare", "docs.txt", "--out", "corpus"],
        "--out '{cwd}/corpus' is being prepared by another process (it holds {cwd}/.corpus.lock)",
        "wait for the other prepare to end (the same command then has nothing to do), or another `--out`",
        files={"docs.txt": b"a document"},
        setup=another_prepare_running,
        command="data",
    ),
    # issue 50: export. `python -m hypertrain.export RUN_DIR --out DIR` on a run that is none, has no
    # weights, or has no Hugging Face architecture; or a DIR that cannot be made. It creates nothing.
    "export-not-a-run": Case(
        "`python -m hypertrain.export` given a directory that holds no run",
        ["{cwd}", "--out", "hf"],
        "RUN_DIR={cwd} is not a run directory (no config.yaml); valid: the directory a training run wrote "
        "(its hydra.run.dir)",
        "the run's directory (hydra.run.dir)",
        command="export",
    ),
    "export-run-without-weights": Case(
        "`python -m hypertrain.export` on a run that has not finished (no weights.pt) without --checkpoint",
        ["run", "--out", "hf"],
        "run has no weights.pt yet (the run has not finished); valid: --checkpoint "
        "run/checkpoints/ckpt-u0000006.pt (its newest checkpoint)",
        "name one of its checkpoints with --checkpoint, or wait for the run to finish",
        setup=copy_of_earlier(_without("weights.pt")),
        command="export",
    ),
    "export-unknown-checkpoint": Case(
        "`python -m hypertrain.export --checkpoint` naming no file",
        ["{earlier}", "--checkpoint", "{earlier}/checkpoints/ckpt-u9999999.pt", "--out", "hf"],
        "--checkpoint={earlier}/checkpoints/ckpt-u9999999.pt is not a file; valid: a checkpoint of "
        "{earlier} ({earlier}/checkpoints/ckpt-u*.pt)",
        "one of the run's checkpoints",
        command="export",
    ),
    "export-multistream-run": Case(
        "`python -m hypertrain.export` on a run of a model no Hugging Face architecture matches (the "
        "multistream model)",
        ["run", "--out", "hf"],
        "a multistream model has no Hugging Face architecture to export to; valid: the own decoder "
        "(model=tiny|small|base: Llama's LlamaForCausalLM) or its mixture of experts "
        "(model=moe_tiny|moe_small: Mixtral's MixtralForCausalLM)",
        "a run of the decoder (exported as Llama) or of the mixture of experts (as Mixtral)",
        setup=copy_of_earlier(_model_arch("multistream")),
        command="export",
    ),
    "export-out-not-empty": Case(
        "`python -m hypertrain.export --out` naming a directory that holds files (or a file)",
        ["{earlier}", "--out", "hf"],
        "--out 'hf' exists and is not an empty directory; valid: a new or empty one",
        "a new or empty directory: an export never overwrites",
        files={"hf/config.json": b"{}"},
        command="export",
    ),
    "export-out-under-a-file": Case(
        "`python -m hypertrain.export --out` under a file",
        ["{earlier}", "--out", "notes.txt/hf"],
        "--out 'notes.txt/hf' lies under notes.txt, which is a file; valid: a path under a directory",
        "an `--out` under a directory",
        files={"notes.txt": b"a file"},
        command="export",
    ),
    "export-out-where-nothing-can-be-made": Case(
        "`python -m hypertrain.export --out` where nothing can be created (`/proc`; a read-only or "
        "unwritable place says the same)",
        ["{earlier}", "--out", "/proc/hypertrain-export"],
        "--out '/proc/hypertrain-export': nothing can be created in /proc (No such file or directory); "
        "valid: a new or empty directory where this user can write",
        "an `--out` where this user can write",
        command="export",
    ),
}


@pytest.fixture(scope="module")
def earlier(tmp_path_factory) -> Path:
    """A finished run (with checkpoints) that every case's working directory lies beside: the session's
    reference of BASE (`ReferenceRuns`), which the cases copy before they change it."""
    return ReferenceRuns.beside(tmp_path_factory.mktemp("earlier"))(BASE)


def fill(text: str, earlier: Path, cwd: Path) -> str:
    return text.replace("{earlier}", str(earlier)).replace("{cwd}", str(cwd))


def skip_where_valid(name: str) -> None:
    """The cases that are no mistake on this machine (it has the devices they name) are skipped."""
    if name == "absent-device" and torch.cuda.device_count() > 99:
        pytest.skip("this machine has a 100th CUDA device")
    if name == "cuda-on-a-cpu-build" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: engine.device=cuda is valid here")
    if name == "nccl-without-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: its nccl refusal is engine.device's")
    nccl = torch.cuda.is_available() and torch.distributed.is_nccl_available()
    if name == "nccl-on-cpu-tensors" and not nccl:
        pytest.skip("this machine has no CUDA device or torch no NCCL: nccl is refused for that")


def refused(name: str, tmp_path: Path, earlier: Path, process: bool | None = None) -> list[str]:
    """Case `name` run in an empty working directory beside `earlier` (in this process, or on the real
    command line with `process`): exit 2, one line, no traceback, nothing created or changed. Its lines."""
    case = CASES[name]
    cwd = tmp_path / "work"
    cwd.mkdir(parents=True)
    for file, data in case.files.items():
        (cwd / file).parent.mkdir(parents=True, exist_ok=True)
        (cwd / file).write_bytes(data)
    if case.setup is not None:
        case.setup(earlier, cwd)
    before, earlier_before = tree(cwd), tree(earlier)
    env = {key: fill(value, earlier, cwd) for key, value in case.env.items()}
    args = [fill(a, earlier, cwd) for a in case.args]
    if case.command == "sample":
        done = sample_command(args, cwd, process)
    elif case.command == "data":
        hidden = "hide/sitecustomize.py" in case.files  # works at an interpreter's start only
        done = data_command(args, cwd, env=env, process=bool(process or hidden))
    elif case.command == "clock":
        done = module_command(
            "hypertrain.clock", "hypertrain.report.clock.retime", "main", args, cwd, process
        )
    elif case.command == "export":
        done = module_command("hypertrain.export", "hypertrain.export.command", "cli", args, cwd, process)
    else:
        hidden = "hide/sitecustomize.py" in case.files  # works at an interpreter's start only
        done = entry([*BASE, *args], cwd, env=env, process=True if hidden else process)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    prefixes = {"sample": "hypertrain.sample: error: ", "clock": "hypertrain.clock: error: "}
    prefix = (prefixes | {"export": "hypertrain.export: error: "}).get(case.command, "hypertrain: error: ")
    assert lines[0].startswith(prefix + fill(case.says, earlier, cwd)), lines[0]
    assert "Traceback" not in done.stderr + done.stdout
    assert tree(cwd) == before, "a rejected run created or changed files"
    assert tree(earlier) == earlier_before, "a rejected run touched the earlier run"
    return [line.replace(str(cwd), "<cwd>") for line in lines]


def sample_command(args: list[str], cwd: Path, process: bool | None) -> subprocess.CompletedProcess:
    """`python -m hypertrain.sample ARGS` in `cwd`: on the command line with `process`, else its `cli`
    in this process, stdout and stderr captured."""
    return module_command("hypertrain.sample", "hypertrain.sample", "cli", args, cwd, process)


def module_command(
    name: str, module: str, function: str, args: list[str], cwd: Path, process: bool | None
) -> subprocess.CompletedProcess:
    """`python -m NAME ARGS` in `cwd`: on the command line with `process`, else `module.function(args)`
    in this process, stdout and stderr captured."""
    if process:
        command = [sys.executable, "-m", name, *args]
        return subprocess.run(command, cwd=cwd, env=entry_env(), capture_output=True, text=True, timeout=120)
    import importlib

    entry_point = getattr(importlib.import_module(module), function)
    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            code = entry_point(args)
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess([name, *args], code, out.getvalue(), err.getvalue())


def quick_every(names: list[str], step: int) -> list:
    """`names` as parameters, every `step`-th one in the quick loop (a sample of every kind, the catalogue
    being in the order of its kinds) and the others slow."""
    return [pytest.param(n, marks=() if i % step == 0 else pytest.mark.slow) for i, n in enumerate(names)]


@pytest.mark.parametrize("name", quick_every(list(CASES), 3))
def test_a_mistake_is_one_line_exit_2_and_changes_nothing(tmp_path, earlier, name):
    skip_where_valid(name)
    refused(name, tmp_path, earlier)


# Every seventh case, from Hydra's composition errors through the fields, the plan, the memory check and
# the run directory to the resumes and the launch-side refusals, both ways.
# A case whose environment works at an interpreter's start (a sitecustomize hiding plugins) has no
# in-process form: the sample takes every 7th of the others.
SAMPLE = [name for name in CASES if "hide/sitecustomize.py" not in CASES[name].files][::7]


@pytest.mark.parametrize("name", quick_every(SAMPLE, 6))
def test_a_sample_of_the_catalogue_says_the_same_in_process_as_on_the_command_line(tmp_path, earlier, name):
    """`hypertrain.train.cli` in this process and `python -m hypertrain.train` give the same one line
    and exit code (2) for the same mistake, and neither changes anything."""
    skip_where_valid(name)
    here = refused(name, tmp_path / "here", earlier, process=False)
    real = refused(name, tmp_path / "real", earlier, process=True)
    assert _at_any_moment(here) == _at_any_moment(real)


def _at_any_moment(outcome):
    """The memory refusal names the memory available when it was made (MemAvailable), which another
    process can change between the two calls: that figure is left out of the comparison."""
    return re.sub(r"but [0-9.]+ [kMGT]?B is available", "but N is available", repr(outcome))


def test_a_sweep_stops_at_its_invalid_second_job_and_keeps_the_first(tmp_path):
    sweep = tmp_path / "sweep"
    done = entry(["-m", *BASE, "replicas=2,3", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert done.returncode == 2
    errors = [x for x in done.stderr.splitlines() if x.startswith("hypertrain:")]
    assert errors == ["hypertrain: error: replicas=3 does not divide world.size (8); valid: a divisor of 8"]
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0_w8_r2_h3"]  # the first job's results; the rejected job left no directory
    assert (sweep / "0_w8_r2_h3" / "metrics.jsonl").read_text().rstrip().endswith('"status": "finished"}')


def test_the_plan_command_refuses_a_world_beyond_any_machine_at_once(tmp_path):
    """`python -m hypertrain.plan show|check` with a huge world: one line, exit 2, in seconds (it went
    over every rank: a billion of them)."""
    for args in (
        ["show", "--world", "1000000000", "--replicas", "1"],
        ["check", "--worlds", "8", "1000000000"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "hypertrain.plan", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [
            "error: world=1000000000 is too large; valid: an integer 1..65536"
        ], done.stderr
        assert list(tmp_path.iterdir()) == []


def render() -> str:
    """docs/errors.md from CASES and failures.EXIT_CODES."""
    lines = [
        "# Errors",
        "",
        "Generated from `tests/test_bad_input.py` (`.venv/bin/python tests/test_bad_input.py` rewrites",
        "it; a test fails when they differ). Every user mistake below stops the run before anything is",
        "written, with one line on stderr (`hypertrain: error: ...`) and exit code 2; an earlier run's",
        "files are never touched. Lines marked Hydra keep Hydra's own wording (its first line, with the",
        "options or the cause). `<cwd>` is the working directory, `<run>` an earlier run's directory.",
        "The rows of `python -m hypertrain.sample` are that command's: its line begins",
        "`hypertrain.sample: error:`, and it writes nothing, ever; those of `python -m hypertrain.clock`",
        "begin `hypertrain.clock: error:`, those of `python -m hypertrain.export`",
        "`hypertrain.export: error:` (a write that fails after these checks: exit 4 for a full disk, else 1;",
        "Ctrl-C 130; no DIR left).",
        "",
        "| mistake | the line begins | what to do |",
        "|---|---|---|",
    ]
    for case in CASES.values():
        says = case.says.replace("{cwd}", "<cwd>").replace("{earlier}", "<run>").replace("|", "\\\\|")
        mark = " (Hydra)" if case.hydra else ""
        lines.append(f"| {case.mistake}{mark} | `{says}` | {case.fix} |")
    lines += [
        "",
        "A sweep stops at its first invalid job with that job's line (exit 2); the jobs before it keep",
        "their results. Every value of every sweep is composed (Hydra's checks) before Hydra writes the",
        "sweep directory, and a sweep whose first job is invalid leaves no sweep directory.",
        "",
        "## Failures during a run",
        "",
        "These are not mistakes in the command: the run started and could not go on. Each stops it with",
        "one line (`hypertrain: error: run failed: ...`), its metrics.jsonl closed with an `end` row that",
        "holds the line and the code, its W&B run finished with the code, its checkpoints intact",
        "(`hypertrain/failures/__init__.py`).",
        "",
        "| exit code | meaning |",
        "|---|---|",
    ]
    lines += [f"| {code} | {meaning} |" for code, meaning in EXIT_CODES.items()]
    return "\n".join(lines) + "\n"


def test_the_errors_page_is_the_catalogue():
    assert DOCS.read_text() == render(), (
        "docs/errors.md differs: run .venv/bin/python tests/test_bad_input.py"
    )


if __name__ == "__main__":
    DOCS.write_text(render())
    print(f"wrote {DOCS}", file=sys.stderr)
