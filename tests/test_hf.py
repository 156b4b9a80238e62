"""model=hf (docs/hf.md): a Hugging Face causal LM as the replica. Tied to what is proven: a Llama of the
tiny decoder's shape and weights runs as the decoder does; loop = stacked for Llama, Qwen2 (tied), GPT-2
and Qwen3; the stacked gradients against a float64 per-replica reference; a pretrained directory's
weights and held-out loss; RUN/hf read back by transformers bitwise; the fragments split the HF layers.
No hub: every model is built from a config in code (and saved with save_pretrained where a directory is
needed).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import (
    RUN,
    assert_engines_agree,
    assert_identical,
    compose_cfg,
    entry,
    killed_beside_uninterrupted,
    resumed,
    rounding_floors,
    run_rounds,
    small_cfg,
)
from omegaconf import OmegaConf
from references import (
    U32,
    assert_losses_within_rounding,
    assert_within_rounding,
    float64_arithmetic,
)

from hypertrain.config import ModelConfig
from hypertrain.diloco import fragments
from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.engines import loop
from hypertrain.model import hf
from hypertrain.model.shapes import ffn_width, param_roles
from hypertrain.model.transformer import forward, init_params
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.run.evaluation import heldout_eval

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=256)
CONFIGS = {  # small_cfg's shape (d 32, one layer, two heads) in each architecture the issue names
    "llama": dict(model_type="llama", intermediate_size=96, rms_norm_eps=1e-6, **TINY),
    "qwen2": dict(model_type="qwen2", intermediate_size=96, tie_word_embeddings=True, **TINY),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=2, vocab_size=256, n_positions=64)
    | dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "qwen3": dict(model_type="qwen3", intermediate_size=96, head_dim=16, **TINY),
}


def hf_cfg(kind: str, **overrides):
    return small_cfg(model=ModelConfig(name="hf", arch="hf", vocab=0, config=CONFIGS[kind]), **overrides)


def tiny_to_llama(theta: dict, layers: int) -> dict:
    """The decoder's weights under Llama's names: its [in, out] matrices transposed into Linear's
    [out, in]; same RoPE convention (half split), same RMSNorm (docs/parity.md)."""
    out = {
        "model.embed_tokens.weight": theta["emb"],
        "lm_head.weight": theta["head"].T.contiguous(),
        "model.norm.weight": theta["norm"],
    }
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj"}
    names |= {"wo": "self_attn.o_proj", "w1": "mlp.gate_proj", "w3": "mlp.up_proj", "w2": "mlp.down_proj"}
    for i in range(layers):
        pre, to = f"layers.{i:03d}.", f"model.layers.{i}."
        out[to + "input_layernorm.weight"] = theta[pre + "attn_norm"]
        out[to + "post_attention_layernorm.weight"] = theta[pre + "mlp_norm"]
        out |= {f"{to}{hf_name}.weight": theta[pre + own].T.contiguous() for own, hf_name in names.items()}
    return dict(sorted(out.items()))


def rounds_from(cfg, theta: dict, engine, dtype=torch.float32, batches: list | None = None):
    """The run's per-replica losses and held-out losses (before training and after every sync) from the
    initial weights `theta`; `batches` collects the replica batches that stepped."""
    run = prepare(cfg)
    state = RunState.start(run.cfg, {n: t.to(dtype, copy=True) for n, t in theta.items()})  # updated in place
    losses, evals = [], []
    with float64_arithmetic() if dtype == torch.float64 else torch.no_grad():
        evals.append(heldout_eval(run, state.theta)[0])
    with float64_arithmetic() if dtype == torch.float64 else torch.enable_grad():
        for rnd in rounds(run, state, engine):
            losses += [list(step) for step in zip(*(r.losses for r in rnd.results), strict=True)]
            if batches is not None:
                batches += [b for a in rnd.assigns for b in a.batches if not b.empty]
            evals.append(heldout_eval(run, state.theta)[0])
    return losses, evals


@pytest.mark.slow
def test_llama_of_the_tiny_decoder_runs_as_the_decoder():
    """model=hf with a Llama config equal to the decoder's and the decoder's initial weights mapped into
    it: every update's per-replica losses and every held-out loss within twice the decoder's own fp32
    error against its float64 run (or twice the fp32 floor of `rounding_floors`): the two compute the
    same function with other reduction orders (Linear's transposed matmuls, HF's RMSNorm in fp32)."""
    own = small_cfg()
    assert ffn_width(own.model) == CONFIGS["llama"]["intermediate_size"]
    theta = init_params(own.model, own.seed)
    mapped = tiny_to_llama(theta, own.model.n_layers)
    cfg = hf_cfg("llama")
    assert set(mapped) == set(hf.init_params(cfg.model, 0)), "the mapping names every Llama parameter"
    batches: list = []
    ref_losses, ref_evals = rounds_from(own, theta, loop.train_replicas, torch.float64, batches)
    own_losses, own_evals = rounds_from(own, theta, loop.train_replicas)
    got_losses, got_evals = rounds_from(cfg, mapped, loop.train_replicas)
    loss_floor, _ = rounding_floors(own, batches, len(ref_losses))
    assert_losses_within_rounding(got_losses, own_losses, ref_losses, loss_floor)
    assert_losses_within_rounding([got_evals], [own_evals], [ref_evals], loss_floor)


@pytest.mark.parametrize(
    "kind",
    [
        "llama",
        pytest.param("qwen2", marks=pytest.mark.slow),
        "gpt2",
        pytest.param("qwen3", marks=pytest.mark.slow),
    ],
)
def test_loop_equals_stacked(kind):
    """The stacked engine (vmap over the replicas' parameters) against the loop (functional_call, one
    replica at a time), each against the float64 loop: losses and final weights within twice the loop's
    own error or twice the fp32 floor (helpers.assert_engines_agree, the decoder's own bound)."""
    assert_engines_agree(replace(hf_cfg(kind), replicas=2))


def test_loop_equals_stacked_under_bf16():
    """model.compute_dtype=bf16 (the module on bf16 copies of the fp32 weights): stacked against loop,
    each against the float64 loop, within twice the loop's own bf16 error (helpers.assert_engines_agree)."""
    cfg = hf_cfg("llama")
    assert_engines_agree(replace(cfg, replicas=2, model=replace(cfg.model, compute_dtype="bf16")))


def test_stacked_gradients_against_a_float64_reference():
    """One step's gradients of R = 3 stacked replicas (vmap) against each replica alone in float64
    (functional_call): per tensor within twice the fp32 per-replica loop's own error or twice a floor of
    (2 + ceil(log2 N)) U32 of the gradient's norm (N: the targets a gradient sums over)."""
    cfg = hf_cfg("gpt2").model
    gen = torch.Generator().manual_seed(3)
    base = hf.init_params(cfg, 0)
    params = {
        n: torch.stack([t + 0.02 * torch.randn(t.shape, generator=gen) for _ in range(3)])
        for n, t in base.items()
    }
    tokens = torch.randint(0, 256, (3, 2, 17), generator=gen)

    def grads(p, ids, dtype):
        p = {n: t.detach().to(dtype, copy=True).requires_grad_(True) for n, t in p.items()}
        forward(cfg, p, ids)[:, 0].sum().backward()
        return {n: t.grad for n, t in p.items()}

    def replica(r):
        return {n: t[r : r + 1] for n, t in params.items()}

    got = grads(params, tokens, torch.float32)
    alone = [grads(replica(r), tokens[r : r + 1], torch.float32) for r in range(3)]
    with float64_arithmetic():
        ref = [grads(replica(r), tokens[r : r + 1], torch.float64) for r in range(3)]
    floor_factor = (2 + 6) * U32  # log2(2 * 16 targets) = 5, rounded up, plus the mean's division
    for r in range(3):
        for n in params:
            want = ref[r][n][0]
            assert_within_rounding(got[n][r], alone[r][n][0], want, floor_factor * float(want.norm()), n)


def test_roles_and_fragments_of_every_preset():
    """Each shipped config: every parameter has a role (matrices Muon's, embeddings and 1-D AdamW's)
    and a place from the module's own layer list, so fragments=2 split the layers as the decoder's
    (layer i in fragment i mod 2, the embeddings in the first, the final norm and head in the last)."""
    for preset in ("hf_llama_tiny", "hf_qwen2_tied_tiny", "hf_gpt2_tiny"):
        cfg = compose_cfg([f"model={preset}", "inner.H=4"])
        cfg = replace(cfg, outer=replace(cfg.outer, fragments=2))
        module = hf.base(cfg.model)
        names = dict(module.named_parameters())
        roles = param_roles(cfg.model)
        assert set(roles) == set(names)  # tied weights once
        where = fragments.fragment_of(cfg)
        layers = hf.layer_list(module) + "."
        for name, p in names.items():
            if name.startswith(layers):
                assert where[name] == int(name[len(layers) :].split(".")[0]) % 2, name
            if isinstance(_owner(module, name), torch.nn.Embedding):
                assert roles[name] == "embedding" and where[name] == 0, name
            elif p.dim() == 1:
                assert roles[name] == "norm", name
            elif not name.startswith("lm_head"):
                assert roles[name] == "hidden", name
        assert all(
            where[n] == 1 for n in names if n.startswith(("lm_head", "model.norm", "transformer.ln_f"))
        )


def _owner(module, name: str):
    return module.get_submodule(name.rpartition(".")[0])


def test_a_pretrained_directory_is_where_the_run_starts(tmp_path):
    """model.path=DIR (save_pretrained's, as a hub download leaves it): the initial weights are the
    directory's, bitwise, and the first held-out loss is the HF module's own loss (its `labels=` path)
    on the same windows, within twice the fp32 floor of one held-out pass (`rounding_floors`: each
    path errs by at most the floor against the exact value)."""
    config = transformers.LlamaConfig(**{k: v for k, v in CONFIGS["llama"].items() if k != "model_type"})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        module = transformers.LlamaForCausalLM(config).eval()
    module.save_pretrained(tmp_path / "m")
    cfg = small_cfg(model=ModelConfig(name="hf", arch="hf", vocab=0, path=str(tmp_path / "m")))
    run = prepare(cfg)
    theta = initial_weights(run)
    own = dict(module.named_parameters())
    assert set(theta) == set(own) and all(torch.equal(theta[n], own[n]) for n in own)
    got = heldout_eval(run, theta)[0]
    with torch.no_grad():
        want = sum(
            float(module(input_ids=mb.tokens, labels=mb.tokens).loss) * mb.weight
            for mb in run.heldout.microbatches
        )
    floor = rounding_floors(cfg, [run.heldout], 1)[0]
    assert abs(got - want) <= 2 * floor * abs(want), (got, want, floor)


def test_run_hf_is_read_back_by_transformers_bitwise(tmp_path):
    """Every model=hf run writes RUN/hf with save_pretrained: AutoModelForCausalLM.from_pretrained reads
    it and gives the logits of the run's final weights (weights.pt, the module's own parameter names),
    bitwise in fp32."""
    run_dir = tmp_path / "run"
    done = entry(
        [*RUN, "model=hf_qwen2_tied_tiny", "inner.H=2", "phase.updates=2", f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    weights = torch.load(run_dir / "weights.pt")
    read = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", local_files_only=True).eval()
    assert set(weights) == set(dict(read.named_parameters()))  # tied once: no lm_head.weight
    cfg = compose_cfg(["model=hf_qwen2_tied_tiny"]).model
    ids = torch.randint(0, 256, (1, 3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf.logits(cfg, {n: t.unsqueeze(0) for n, t in weights.items()}, ids)
        got = read(input_ids=ids[0]).logits.reshape(want.shape)
    assert torch.equal(got, want)
    assert not torch.equal(
        weights["model.embed_tokens.weight"], hf.init_params(cfg, 0)["model.embed_tokens.weight"]
    )


# -- real processes, resume (slow tier) ------------------------------------------------------------------

HF_RUN = [*RUN, "model=hf_llama_tiny", "inner.H=2", "phase.updates=6"]


@pytest.mark.slow
def test_a_killed_hf_run_resumes_bit_identical(tmp_path):
    """SIGKILL before update 5 (after the checkpoint of update 4), resume=true: every row, the held-out
    losses and weights.pt equal the uninterrupted run's exactly; RUN/hf is written at the end."""
    run_dir, reference = killed_beside_uninterrupted(HF_RUN, tmp_path, "0:5:kill")
    resumed(HF_RUN, run_dir, tmp_path)
    assert_identical(run_dir, reference)
    assert (run_dir / "hf" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, overrides, layout, nproc",
    [
        ("hf-benchmark-w2-r1", ["world=2", "replicas=1", "inner.H=2", "phase.updates=4"], "benchmark", 2),
        (
            "hf-replicas-p2-r4",
            ["world=4", "replicas=4", "processes.nproc=2", "inner.H=2", "phase.updates=4"],
            "replicas",
            2,
        ),
    ],
)
def test_real_processes_equal_the_simulation(tmp_path, monkeypatch, name, overrides, layout, nproc):
    """processes=dist with an HF Llama in both layouts: losses, held-out losses and weights within the
    bound tests/test_dist.py derives for the own decoder (twice the fp32 simulation's error, or floor)."""
    import test_dist

    case = test_dist.Case(["model=hf_llama_tiny", *overrides], layout, nproc)
    monkeypatch.setitem(test_dist.CASES, name, case)
    test_dist.test_real_processes_equal_the_simulation_within_rounding(tmp_path, name)


def test_the_init_is_the_seeds_and_leaves_torchs_generator_alone():
    """A config's initial weights are drawn under `seed` (the same seed, the same weights; another,
    others) without touching torch's global generator; GPT-2's summary_first_dropout (0.1 by default,
    read only by its double-heads model) is not dropout of the causal LM, so the preset builds."""
    cfg = compose_cfg(["model=hf_gpt2_tiny"]).model
    assert hf.base(cfg).config.summary_first_dropout > 0
    before = torch.random.get_rng_state()
    a, b, c = hf.init_params(cfg, 1), hf.init_params(cfg, 1), hf.init_params(cfg, 2)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["transformer.wte.weight"], c["transformer.wte.weight"])


@pytest.mark.slow
def test_a_prepared_corpus_trains_a_model_of_a_larger_vocabulary(tmp_path):
    """data=prepared with model=hf: the vocabulary is the model's (300), larger than the corpus's (257,
    bytes and the end of document), never resized; the run's config records it."""
    from test_prepared import write_corpus

    write_corpus(tmp_path / "corpus", [(200, 1, 80), (300, 1, 60)])
    run_dir = tmp_path / "run"
    args = [*RUN, "model=hf_llama_tiny", "model.config.vocab_size=300", "data=prepared"]
    args += [f"data.path={tmp_path}/corpus", "inner.H=2", "phase.updates=2", f"hydra.run.dir={run_dir}"]
    done = entry(args, tmp_path)
    assert done.returncode == 0, done.stderr
    assert OmegaConf.load(run_dir / "config.yaml").model.vocab == 300
    assert torch.load(run_dir / "weights.pt")["model.embed_tokens.weight"].shape == (300, 64)


# -- the tokenizer: RUN/hf's, prepare --tokenizer DIR, the export command and sample ----------------------

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 8,
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))\n" * 6,
    "Low-communication training: each replica takes H inner steps, then they average. " * 8,
    "A <|endoftext|> inside a text is text, as prepare encoded it. " * 4,
]
BPE = dict(model="model=hf_llama_tiny", vocab="model.config.vocab_size=320")  # the corpus's 300, and more


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory):
    """A corpus of TEXTS prepared with a byte-level BPE of 300 tokens (its eod <|endoftext|>)."""
    from hypertrain.data.preparation.prepare import prepare as prepare_corpus

    where = tmp_path_factory.mktemp("hf-bpe")
    (where / "texts").mkdir()
    for i, text in enumerate(TEXTS * 8):
        (where / "texts" / f"{i:02d}.txt").write_text(text)
    prepare_corpus([str(where / "texts" / "*.txt")], where / "corpus", "train:300", "text", False)
    return where


def test_run_hf_holds_the_corpus_tokenizer_and_prepare_takes_that_directory(bpe_corpus):
    """A model=hf run on a corpus with a tokenizer.json writes it into RUN/hf beside the weights (with
    tokenizer_config.json): AutoTokenizer.from_pretrained(RUN/hf) encodes and decodes every text as the
    corpus's tokenizer, its one special token the corpus's eod (none added). `prepare --tokenizer DIR`
    takes that directory's tokenizer.json: the same texts give the same ids. data=prepared with a model
    whose vocabulary is below the corpus's is one line."""
    from hypertrain.config import UserError
    from hypertrain.data import corpus
    from hypertrain.data.preparation.prepare import prepare as prepare_corpus
    from hypertrain.run.session import save_weights

    folder = bpe_corpus / "corpus"
    cfg = compose_cfg([*RUN, *BPE.values(), "data=prepared", f"data.path={folder}"])
    save_weights(cfg, hf.init_params(cfg.model, 0), bpe_corpus)
    saved = bpe_corpus / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in saved.iterdir()
    }
    meta = corpus.read_meta(folder)
    ours = corpus.Tokenizer(folder, meta)
    theirs = transformers.AutoTokenizer.from_pretrained(saved)
    for text in [*TEXTS, "unseen words: zebra 42 <|endoftext|>"]:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids  # no bos or eos added; a special token's spelling read as text
        assert theirs.decode(ids) == ours.decode(ids) == text
    assert theirs.all_special_ids == [meta.eod]

    again = prepare_corpus(
        [str(bpe_corpus / "texts" / "*.txt")], bpe_corpus / "again", str(saved), "text", False
    )
    assert (again.meta.vocab, again.meta.eod, again.meta.tokens_sha256) == (
        meta.vocab,
        meta.eod,
        meta.tokens_sha256,
    )
    small = compose_cfg([*RUN, "model=hf_llama_tiny", "data=prepared", f"data.path={bpe_corpus / 'again'}"])
    with pytest.raises(UserError) as err:
        prepare(small)
    assert str(err.value).startswith(
        f"the model's vocabulary (256, its config's vocab_size) is smaller than the data's ({meta.vocab})"
    )


@pytest.fixture(scope="module")
def bpe_run(bpe_corpus):
    """A model=hf run of 4 updates (checkpoints after 2 and 4) on the BPE corpus, its vocabulary (320)
    above the corpus's (300)."""
    run_dir = bpe_corpus / "run"
    args = [*RUN, *BPE.values(), "data=prepared", f"data.path={bpe_corpus / 'corpus'}", "inner.H=2"]
    done = entry([*args, "phase.updates=4", f"hydra.run.dir={run_dir}"], bpe_corpus)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_the_export_command_writes_a_checkpoint_of_an_hf_run(bpe_run, tmp_path):
    """`python -m hypertrain.export RUN --checkpoint C --out DIR` for model=hf: DIR is the run's module
    with the checkpoint's weights (`write_hf`) and RUN/hf's tokenizer; from_pretrained(DIR)'s logits are
    the checkpoint's weights' bitwise in fp32 (the same module code, the same fp32 weights: no other
    rounding to allow for), not the final weights'."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from hypertrain.export import command
    from hypertrain.sample import read_run

    model = read_run(bpe_run)[0]
    path = sorted((bpe_run / "checkpoints").glob("ckpt-u*.pt"))[0]
    theta = torch.load(path, weights_only=True)["state"]["theta"]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = command.cli([str(bpe_run), "--checkpoint", str(path), "--out", str(tmp_path / "hf")])
    assert code == 0, err.getvalue()
    assert out.getvalue().startswith(f"hypertrain.export: wrote {tmp_path / 'hf'}: LlamaForCausalLM (")
    assert f"from {path} (update " in out.getvalue()
    assert "; tokenizer.json and tokenizer_config.json of " in out.getvalue()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (bpe_run / "hf" / name).read_bytes()
    read = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    ids = torch.randint(0, 320, (1, 2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf.logits(model, {n: t.unsqueeze(0) for n, t in theta.items()}, ids)
        got = read(input_ids=ids[0]).logits.reshape(want.shape)
        final = hf.logits(
            model, {n: t.unsqueeze(0) for n, t in torch.load(bpe_run / "weights.pt").items()}, ids
        )
    assert torch.equal(got, want)
    assert not torch.equal(got, final)


@pytest.mark.slow
def test_sample_decodes_an_hf_run_with_its_corpus_tokenizer(bpe_run):
    """`python -m hypertrain.sample` on a model=hf run: the prompt encoded and the continuation decoded
    by the corpus's tokenizer, the continuation the module's greedy one over the corpus's ids."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from hypertrain import sample
    from hypertrain.data import corpus

    model, data, _, _ = sample.read_run(bpe_run)
    folder = bpe_run.parent / "corpus"
    tokenizer = corpus.Tokenizer(folder, corpus.read_meta(folder))
    theta = torch.load(bpe_run / "weights.pt", weights_only=True)
    prompt = "The quick brown"
    added = sample.continuation(
        model, theta, tokenizer.encode(prompt), tokens=6, context=32, vocab=300, eod=tokenizer.meta.eod
    )
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = sample.cli([str(bpe_run), "--prompt", prompt, "--tokens", "6"])
    assert code == 0, err.getvalue()
    assert out.getvalue() == prompt + tokenizer.decode(added) + "\n"
    assert added and all(i < 300 for i in added)


@pytest.mark.slow  # dynamo traces the module for each engine's shapes: about 15 s of CPU
@pytest.mark.parametrize("engine", ["loop", "stacked"])
def test_compile_captures_the_hf_module_and_agrees_with_the_eager_loop(monkeypatch, engine):
    """engine.compile=true with model=hf: torch.compile captures the module's forward and backward
    (functional_call for the loop, vmap for the stacked engine: dynamo's graph counter moves) and the
    run agrees with the eager loop, each against the float64 loop (helpers.assert_engines_agree: twice
    the eager loop's own error, or its floor). The backend is aot_eager (dynamo and AOT autograd, the
    graphs inductor would be given) to keep inductor's C++ builds out of the suite; with inductor the
    same forward and backward ran once by hand (docs/hf.md)."""
    from torch._dynamo.utils import counters

    from hypertrain.engines import compiled, stacked
    from hypertrain.engines.compiled import inner_step_fn

    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "_compiled", lambda fn: torch.compile(fn, backend="aot_eager"))
    inner_step_fn.cache_clear()  # its compiled step is made again with the backend above, then dropped
    try:
        cfg = replace(hf_cfg("llama"), replicas=2)
        on = replace(cfg, engine=replace(cfg.engine, compile=True))
        before = counters["stats"]["unique_graphs"]
        got = run_rounds(on, {"loop": loop, "stacked": stacked}[engine].train_replicas)
        assert counters["stats"]["unique_graphs"] - before >= 2  # the loss and the step ran compiled
        assert_engines_agree(cfg, got=got)
    finally:
        inner_step_fn.cache_clear()


def test_model_config_is_set_with_or_without_a_plus():
    """`model=hf 'model.config={...}'` (the field is declared, its keys open as outer.optimizer_args')
    and `'+model.config={...}'` compose the same config; on a preset, a key it has changes without `+`
    (Hydra refuses `+` there), one it lacks is added with or without it, the others stay (dicts merge)."""
    fields = "{model_type:llama,hidden_size:32,num_hidden_layers:1,num_attention_heads:2,vocab_size:256}"
    plain = compose_cfg(["model=hf", f"model.config={fields}"]).model
    plus = compose_cfg(["model=hf", f"+model.config={fields}"]).model
    assert plain == plus and plain.config == {
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 256,
    }
    preset = compose_cfg(["model=hf_llama_tiny"]).model.config
    for added in ("model.config.head_dim=16", "+model.config.head_dim=16"):
        changed = compose_cfg(["model=hf_llama_tiny", "model.config.num_hidden_layers=4", added]).model.config
        assert changed == preset | {"num_hidden_layers": 4, "head_dim": 16}
