"""`python -m hypertrain.export`: a run's weights as a Hugging Face model directory.

- The mapping (`export.names`): `AutoModelForCausalLM.from_pretrained(DIR)` of the decoder (Llama, with
  and without grouped-query attention) and of the mixture of experts (Mixtral) gives the logits of our
  own forward on the same weights, within a bound derived below. Not bitwise in fp32: transformers builds
  RoPE's tables another way (inverse frequencies 1 / base^(i/d) and the angles by a matmul; ours
  base^(-i/d) times the positions: their cos differs from ours by up to 2e-7), and its projections are
  `F.linear` where ours are `bmm`.
- A run on a prepared corpus with a trained BPE, exported: the tokenizer AutoTokenizer loads encodes and
  decodes as the corpus's, with no special token the corpus lacks; the logits are the run's final
  weights'; a checkpoint exports its own weights; lm-eval's HF model reads the export on a local task
  this test writes (no download) and its log-likelihoods are the ones computed here from the logits.
- A write that fails half way (a full disk) or a Ctrl-C leaves no DIR and no partial one.
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from helpers import BASE, QUICK, U32, ReferenceRuns, entry, entry_env, tree

from hypertrain.config import ModelConfig
from hypertrain.data import corpus
from hypertrain.export import command
from hypertrain.export.names import hf_weights
from hypertrain.model.transformer import init_params, logits
from hypertrain.sample import read_run

pytest.importorskip("transformers")

RUN = [*QUICK, "logger=none", "inner.H=2", "phase.updates=4"]  # syncs (and checkpoints) after 2 and 4
CONTEXT = 32  # QUICK's data.seq_len


def logits_bound(cfg: ModelConfig) -> float:
    """Relative (norm-wise) bound on the difference of the two fp32 forwards' logits. The steps that may
    round differently, each within about 4 U32 of its output as tests/test_moe.py counts them: per layer
    the 7 projections (another kernel may sum a dot product in another order), the 2 RMSNorms, RoPE on q
    and k (the tables above) and the attention; then the final RMSNorm and the head."""
    steps = 12 * cfg.n_layers + 2
    return 4 * steps * U32


def our_logits(cfg: ModelConfig, theta: dict, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] -> [B, T, V] by hypertrain's own forward (one replica)."""
    B, T = tokens.shape
    with torch.no_grad():
        return logits(cfg, {n: t[None].float() for n, t in theta.items()}, tokens[None])[0].view(B, T, -1)


def their_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return module(input_ids=tokens).logits


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def export(*argv: str) -> tuple[int, str, str]:
    """`python -m hypertrain.export ARGV` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = command.cli(list(argv))
    return code, out.getvalue(), err.getvalue()


MOE = ModelConfig(
    is_moe=True,
    n_experts=4,
    top_k=2,
    expert_ffn=24,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab=64,
)


@pytest.mark.parametrize(
    "cfg",
    [ModelConfig(d_model=32, vocab=64), ModelConfig(d_model=32, n_kv_heads=2, vocab=64, norm_eps=1e-5), MOE],
    ids=["llama", "llama-gqa", "mixtral"],
)
def test_the_saved_model_gives_our_forwards_logits(tmp_path, cfg):
    theta = init_params(cfg, 3)
    arch = command.architecture(cfg)
    command.hf_model(arch, cfg, theta, context=CONTEXT, eod=None).save_pretrained(tmp_path)
    tokens = torch.randint(0, cfg.vocab, (3, CONTEXT), generator=torch.Generator().manual_seed(0))
    theirs, ours = their_logits(tmp_path, tokens), our_logits(cfg, theta, tokens)
    assert relative(theirs, ours) <= logits_bound(cfg)
    if cfg.is_moe:  # routing is discrete: no token's top k within rounding of a tie (test_moe's margin)
        return
    # The comparison can fail: the MLP's gate and up projections swapped is far outside the bound.
    swapped = {n.replace("w1", "w_").replace("w3", "w1").replace("w_", "w3"): t for n, t in theta.items()}
    assert relative(our_logits(cfg, swapped, tokens), ours) > 100 * logits_bound(cfg)


def test_the_mapping_names_every_parameter_once_in_their_layout():
    theta = init_params(MOE, 0)
    mapped = hf_weights(MOE, theta)
    assert sum(t.numel() for t in mapped.values()) == sum(t.numel() for t in theta.values())
    assert mapped["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 48, 32)  # [E, 2f, d], gate first
    assert torch.equal(
        mapped["model.layers.1.mlp.experts.gate_up_proj"][:, :24], theta["layers.001.experts.w1"].mT
    )
    assert torch.equal(mapped["lm_head.weight"], theta["head"].T)


def test_a_model_without_an_architecture_is_one_line_naming_what_is_supported():
    with pytest.raises(command.UserError) as err:
        command.architecture(ModelConfig(arch="multistream", channel_vocabs=[8, 8]))
    assert str(err.value) == (
        "a multistream model has no Hugging Face architecture to export to; valid: the own decoder "
        "(model=tiny|small|base: Llama's LlamaForCausalLM) or its mixture of experts "
        "(model=moe_tiny|moe_small: Mixtral's MixtralForCausalLM)"
    )


# -- a run on a prepared corpus with a trained BPE --------------------------------------------------


TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 8,
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))\n" * 6,
    "Low-communication training: each replica takes H inner steps, then they average. " * 8,
    "A <|endoftext|> inside a text is text, as prepare encoded it. " * 4,
]


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory) -> Path:
    """A tiny run (4 updates) on a corpus of TEXTS prepared with a byte-level BPE of 300 tokens."""
    from hypertrain.data.preparation.prepare import prepare

    where = tmp_path_factory.mktemp("export")
    for i, text in enumerate(TEXTS * 6):
        (where / "texts").mkdir(exist_ok=True)
        (where / "texts" / f"{i:02d}.txt").write_text(text)
    prepare([str(where / "texts" / "*.txt")], where / "corpus", "train:300", "text", False)
    done = entry(
        [*RUN, "data=prepared", f"data.path={where / 'corpus'}", f"hydra.run.dir={where / 'run'}"], where
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return where / "run"


@pytest.fixture(scope="module")
def exported(prepared_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "hf"
    code, said, err = export(str(prepared_run), "--out", str(out))
    assert code == 0, err
    assert said.startswith(f"hypertrain.export: wrote {out}: LlamaForCausalLM (")
    return out


@pytest.mark.slow
def test_the_export_holds_the_runs_final_weights_and_its_corpus_tokenizer(prepared_run, exported):
    from transformers import AutoTokenizer

    model, data, _, _ = read_run(prepared_run)
    theta = torch.load(prepared_run / "weights.pt", weights_only=True)
    folder = Path(data.path)
    assert sorted(p.name for p in exported.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (exported / "tokenizer.json").read_bytes() == (folder / corpus.TOKENIZER).read_bytes()
    tokens = torch.randint(0, model.vocab, (2, CONTEXT), generator=torch.Generator().manual_seed(1))
    assert relative(their_logits(exported, tokens), our_logits(model, theta, tokens)) <= logits_bound(model)

    meta = corpus.read_meta(folder)
    ours, theirs = corpus.Tokenizer(folder, meta), AutoTokenizer.from_pretrained(exported)
    for text in [*TEXTS, "unseen words: zebra 42 <|endoftext|>"]:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids  # no bos or eos added, a special token's spelling read as text
        assert theirs.decode(ids) == ours.decode(ids) == text
    # No special token the corpus lacks: the one it has is the eod, the model's eos.
    assert (
        theirs.all_special_ids
        == [meta.eod]
        == [json.loads((exported / "config.json").read_text())["eos_token_id"]]
    )
    assert len(theirs) == meta.vocab


@pytest.mark.slow
def test_a_checkpoint_exports_its_own_weights(prepared_run, tmp_path):
    from safetensors.torch import load_file

    model, _, _, _ = read_run(prepared_run)
    path = sorted((prepared_run / "checkpoints").glob("ckpt-u*.pt"))[0]
    theta = torch.load(path, weights_only=True)["state"]["theta"]
    code, said, err = export(str(prepared_run), "--checkpoint", str(path), "--out", str(tmp_path / "hf"))
    assert code == 0, err
    assert f"from {path} (update 2)" in said
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    want = hf_weights(model, theta)
    assert saved.keys() == want.keys()
    assert all(torch.equal(saved[n], want[n]) for n in want)
    assert not torch.equal(
        saved["lm_head.weight"],
        hf_weights(model, torch.load(prepared_run / "weights.pt", weights_only=True))["lm_head.weight"],
    )


# The probe lm-eval scores: each a context and the continuation whose log-likelihood it sums.
PROBES = [
    {"prompt": "The quick brown", "continuation": " fox jumps"},
    {"prompt": "def add(a, b):\n", "continuation": "    return a + b"},
    {"prompt": "each replica takes", "continuation": " H inner steps, then"},
]


def write_task(where: Path) -> str:
    """A local loglikelihood task: PROBES as JSONL and its yaml (no delimiter before the continuation)."""
    (where / "probes.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROBES))
    (where / "export_probe.yaml").write_text(
        "task: export_probe\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {where / 'probes.jsonl'}\n"
        f"  cache_dir: {where / 'cache'}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "{{prompt}}"\n'
        'doc_to_target: "{{continuation}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n"
    )
    return "export_probe"


def log_likelihood(model: ModelConfig, theta: dict, tokenizer, prompt: str, continuation: str):
    """The continuation's summed log-probability from our forward's logits, its ids split from the
    prompt's as lm-eval splits them (the prompt's trailing whitespace moved to the continuation, the whole
    encoded, the prompt's ids cut off), its token count and the norm of the logits."""
    kept = prompt.rstrip()
    prompt, continuation = kept, prompt[len(kept) :] + continuation
    whole, head = tokenizer.encode(prompt + continuation), tokenizer.encode(prompt)
    out = our_logits(model, theta, torch.tensor([whole[:-1]]))[0]
    targets = whole[len(head) :]
    picked = out.double().log_softmax(-1)[len(head) - 1 :].gather(1, torch.tensor(targets)[:, None])
    return float(picked.sum()), len(targets), float(out.norm())


@pytest.mark.slow
def test_lm_eval_reads_the_export_and_its_log_likelihoods_are_ours(
    prepared_run, exported, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    task = write_task(tmp_path)
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(exported), "dtype": "float32", "device": "cpu"},
        tasks=[task],
        task_manager=TaskManager(include_path=str(tmp_path)),
        batch_size=1,
        log_samples=True,
    )
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    model, data, _, _ = read_run(prepared_run)
    theta = torch.load(prepared_run / "weights.pt", weights_only=True)
    tokenizer = corpus.Tokenizer(Path(data.path), corpus.read_meta(Path(data.path)))
    assert len(samples) == len(PROBES)
    for sample, probe in zip(samples, PROBES, strict=True):
        theirs = sample["resps"][0][0][0]
        ours, n, norm = log_likelihood(model, theta, tokenizer, probe["prompt"], probe["continuation"])
        # A token's log-probability z_y - logsumexp(z) moves by at most 2 max|dz| <= 2 ||dz||: the
        # logits' bound times their norm, for each of the n tokens; plus fp32's rounding of each
        # log-softmax and of the sum (4 + n) U32 of its size.
        bound = 2 * n * logits_bound(model) * norm + (4 + n) * U32 * abs(ours)
        assert abs(theirs - ours) <= bound, (probe, theirs, ours, bound)


# -- failures while writing --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_run(tmp_path_factory) -> Path:
    """The session's reference run of BASE (data=stdlib, bytes), which tests/test_bad_input.py shares."""
    return ReferenceRuns.beside(tmp_path_factory.mktemp("stdlib"))(BASE)


@pytest.mark.parametrize(
    "failure, code, says",
    [
        (OSError(errno.ENOSPC, "No space left on device"), 4, "no space left on the device writing --out"),
        (OSError(errno.EIO, "Input/output error"), 1, "export to --out"),
        (KeyboardInterrupt(), 130, "hypertrain.export: stopped by SIGINT (Ctrl-C); nothing was written"),
    ],
    ids=["disk-full", "io-error", "ctrl-c"],
)
def test_a_write_that_fails_half_way_leaves_nothing(stdlib_run, tmp_path, monkeypatch, failure, code, says):
    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def half_way(self, directory, *args, **kwargs):
        real(self, directory, *args, **kwargs)  # the files are there, then the failure
        assert any(Path(directory).iterdir())
        raise failure

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", half_way)
    before = tree(tmp_path)
    got, said, err = export(str(stdlib_run), "--out", str(tmp_path / "a" / "hf"))
    assert got == code
    assert len(err.splitlines()) == 1 and says in err, err
    assert said == ""
    assert tree(tmp_path) == before  # no DIR, no partial one, not the folder made above it


def test_an_empty_out_directory_is_replaced_and_a_byte_level_run_writes_no_tokenizer(stdlib_run, tmp_path):
    (tmp_path / "hf").mkdir()
    code, said, err = export(str(stdlib_run), "--out", str(tmp_path / "hf"))
    assert code == 0, err
    assert said.endswith("; no tokenizer (byte-level data: a byte's id is its value)\n")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no partial directory left beside it
    assert oct((tmp_path / "hf").stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.slow
def test_ctrl_c_to_the_command_while_it_writes_is_one_line_130_and_leaves_nothing(stdlib_run, tmp_path):
    """The real command sent SIGINT once its partial directory exists (then it loads transformers for
    seconds): one line, exit 130, no DIR and no partial one."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hypertrain.export", str(stdlib_run), "--out", str(tmp_path / "hf")],
        cwd=tmp_path,
        env=entry_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".hf.partial-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (130, ""), err
    assert err.splitlines() == ["hypertrain.export: stopped by SIGINT (Ctrl-C); nothing was written"]
    assert list(tmp_path.iterdir()) == []
