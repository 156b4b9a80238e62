"""`python -m hypertrain.sample`: its text is the model's own continuation (an independent greedy loop
over `model.transformer.logits` agrees token for token), the same command prints the same text, a
checkpoint gives its own weights' text, the context is the training length, it stops at the eod, and
a prepared corpus's tokenizer reads its text back. One tiny run (4 updates on stdlib) serves them all.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import QUICK, entry, entry_env, tree

from hypertrain import sample
from hypertrain.config import DataConfig, ModelConfig
from hypertrain.data import corpus
from hypertrain.failures.signals import EXIT_CODES as signal_codes
from hypertrain.model.transformer import logits

RUN = [*QUICK, "logger=none", "inner.H=2", "phase.updates=4"]  # syncs (and checkpoints) after 2 and 4
CONTEXT = 32  # QUICK's data.seq_len: the windows the run trained on
PROMPT = "    def __init__(self, name):\n        "  # 40 bytes: longer than the context


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("sample")
    done = entry([*RUN, f"hydra.run.dir={where / 'run'}"], where)
    assert done.returncode == 0, done.stderr[-3000:]
    return where / "run"


def command(*argv: str) -> tuple[int, str, str]:
    """`python -m hypertrain.sample ARGV` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = sample.cli(list(argv))
    return code, out.getvalue(), err.getvalue()


def model_of(run_dir: Path) -> ModelConfig:
    return ModelConfig(**yaml.safe_load((run_dir / "config.yaml").read_text())["model"])


def greedy_reference(
    model: ModelConfig, theta: dict, ids: list[int], n: int, vocab: int = 256, eod: int | None = None
) -> list[int]:
    """Written apart from the command: each step the argmax over the ids below `vocab` (the text's) of
    the last position's logits of the last CONTEXT ids, by the model's own forward; it stops after `eod`."""
    params = {name: t[None].float() for name, t in theta.items()}
    ids, added = list(ids), []
    for _ in range(n):
        with torch.no_grad():
            out = logits(model, params, torch.tensor([[ids[-CONTEXT:]]]))  # [1, T, vocab]
        token = int(out[0, -1, :vocab].argmax())
        ids.append(token)
        added.append(token)
        if token == eod:
            break
    return added


def text_of(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_greedy_is_the_argmax_of_the_models_own_logits_token_by_token(run):
    theta = torch.load(run / "weights.pt", weights_only=True)
    want = greedy_reference(model_of(run), theta, list(PROMPT.encode()), 24)
    code, out, err = command(str(run), "--prompt", PROMPT, "--tokens", "24")
    assert code == 0, err
    assert out == PROMPT + text_of(want) + "\n"
    assert err.count("\n") == 1 and "24 tokens from" in err  # one header line, on stderr
    assert command(str(run), "--prompt", PROMPT, "--tokens", "24") == (code, out, err)  # the same again


def test_the_continuation_has_the_tokens_asked_for(run):
    theta = torch.load(run / "weights.pt", weights_only=True)
    for n in (1, 7):
        got = sample.continuation(
            model_of(run), theta, list(b"import "), tokens=n, context=CONTEXT, vocab=256
        )
        assert len(got) == n


def test_the_context_is_the_last_training_length_of_tokens(run):
    """A prefix beyond the last CONTEXT tokens changes nothing: the window slides."""
    theta, model = torch.load(run / "weights.pt", weights_only=True), model_of(run)
    tail = list(PROMPT.encode())[-CONTEXT:]
    longer = list(b"some other text entirely, " * 3) + tail
    args = dict(tokens=10, context=CONTEXT, vocab=256)
    assert sample.continuation(model, theta, longer, **args) == sample.continuation(
        model, theta, tail, **args
    )


def test_the_context_is_what_the_model_read_in_training():
    """A window of seq_len + 1 ids trains seq_len inputs; a document cut at max_len + 1 ids, max_len."""
    assert sample.context_length(DataConfig(seq_len=32)) == 32
    assert sample.context_length(DataConfig(examples="documents", seq_len=32, max_len=48)) == 48


def test_the_same_seed_gives_the_same_sample_and_another_seed_another(run):
    def sampled(seed: int) -> str:
        code, out, err = command(
            str(run), "--prompt", "x = ", "--tokens", "40", "--temperature", "1.0", "--seed", str(seed)
        )
        assert code == 0, err
        return out

    assert sampled(5) == sampled(5)
    assert sampled(5) != sampled(6)  # 40 draws from a nearly flat distribution: equal by chance ~never


def test_a_checkpoint_gives_its_own_weights_continuation(run):
    path = run / "checkpoints" / "ckpt-u0000002.pt"
    early = torch.load(path, weights_only=True)["state"]["theta"]
    final = torch.load(run / "weights.pt", weights_only=True)
    assert any(not torch.equal(early[n], final[n]) for n in final)
    code, out, err = command(str(run), "--prompt", PROMPT, "--tokens", "24", "--checkpoint", str(path))
    assert code == 0, err
    assert out == PROMPT + text_of(greedy_reference(model_of(run), early, list(PROMPT.encode()), 24)) + "\n"
    assert "(update 2)" in err
    code, final_out, _ = command(str(run), "--prompt", PROMPT, "--tokens", "24")
    assert final_out != out


def test_an_eager_overlap_runs_last_checkpoint_continues_as_its_final_weights(tmp_path):
    """outer.overlap=eager keeps one outer copy per replica; the checkpoint's global weights are their
    mean, the weights.pt of the run's end."""
    done = entry([*RUN, "outer.overlap=eager", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    last = sorted((tmp_path / "run" / "checkpoints").glob("ckpt-u*.pt"))[-1]
    saved = torch.load(last, weights_only=True)["state"]
    mean = {
        n: torch.stack([r["theta"][n][0] for r in saved["outer_replicas"]]).mean(0) for n in saved["theta"]
    }
    assert all(torch.allclose(mean[n], saved["theta"][n], atol=1e-7) for n in mean)
    args = [str(tmp_path / "run"), "--prompt", PROMPT, "--tokens", "16", "--temperature", "0.7"]
    assert command(*args, "--checkpoint", str(last))[1] == command(*args)[1]


def test_sampling_stops_at_the_eod(run):
    theta, model = torch.load(run / "weights.pt", weights_only=True), model_of(run)
    free = sample.continuation(model, theta, list(b"class "), tokens=20, context=CONTEXT, vocab=256)
    eod = free[3]
    stopped = sample.continuation(
        model, theta, list(b"class "), tokens=20, context=CONTEXT, vocab=256, eod=eod
    )
    assert stopped == free[: free.index(eod) + 1]


def test_the_command_writes_nothing(run, tmp_path):
    before = tree(run)
    assert command(str(run), "--prompt", "a", "--tokens", "3", "--temperature", "0.5")[0] == 0
    assert tree(run) == before


# -- a prepared corpus's tokenizer ---------------------------------------------------------------

TEXTS = ["the cat sat on the mat. ", "a dog ran in the park, héllo wörld! ", "def f(x):\n    return x + 1\n"]


def prepared(directory: Path, documents: list[list[int]], vocab: int, eod: int, tokenizer_json: bytes | None):
    directory.mkdir()
    arrays = [np.array(doc, dtype=np.int64) for doc in documents]
    source = corpus.SourceMeta("test", 1, len(arrays), 0, "")
    name = "bytes" if tokenizer_json is None else f"train:{vocab}"
    corpus.write(
        directory,
        [arrays],
        [source],
        vocab=vocab,
        eod=eod,
        tokenizer=name,
        tokenizer_json=tokenizer_json,
        request="test",
    )
    return directory


def test_a_bytes_corpus_tokenizer_reads_its_text_back(tmp_path):
    folder = prepared(
        tmp_path / "corpus", [list(t.encode()) for t in TEXTS], corpus.BYTES_VOCAB, corpus.BYTES_EOD, None
    )
    tokenizer = corpus.Tokenizer(folder, corpus.read_meta(folder))
    for text in TEXTS:
        assert tokenizer.encode(text) == list(text.encode())
        assert tokenizer.decode([*tokenizer.encode(text), corpus.BYTES_EOD]) == text  # the eod dropped


def test_a_trained_bpe_corpus_tokenizer_reads_its_text_back(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eod>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(TEXTS * 20, trainer)
    eod, vocab = bpe.token_to_id("<eod>"), bpe.get_vocab_size()
    documents = [bpe.encode(text, add_special_tokens=False).ids for text in TEXTS]
    folder = prepared(tmp_path / "corpus", documents, vocab, eod, bpe.to_str().encode())
    tokenizer = corpus.Tokenizer(folder, corpus.read_meta(folder))
    for text, ids in zip(TEXTS, documents, strict=True):
        assert tokenizer.encode(text) == ids
        assert len(ids) < len(text.encode())  # merges learned: not one token per byte
        assert tokenizer.decode([*ids, eod]) == text


def test_a_prepared_run_continues_with_its_corpus_tokenizer(tmp_path):
    """End to end on data=prepared (a bytes corpus): the text is the greedy reference's, cut at the eod."""
    from hypertrain.data import build_dataset

    text = "".join(f"line {i}: the quick brown fox. " for i in range(400))
    folder = prepared(
        tmp_path / "corpus",
        [list(text[i : i + 300].encode()) for i in range(0, len(text), 300)],
        corpus.BYTES_VOCAB,
        corpus.BYTES_EOD,
        None,
    )
    try:
        build_dataset(DataConfig(name="prepared", path=str(folder), seq_len=CONTEXT, heldout=64))
    except AssertionError:
        pytest.skip("data=prepared has no loader yet (hypertrain.data builds stdlib, text_files, token_bin)")
    run_dir = tmp_path / "run"
    done = entry(
        [*RUN, "data=prepared", f"data.path={folder}", "model.vocab=257", f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    code, out, err = command(str(run_dir), "--prompt", "line 7: the", "--tokens", "30")
    assert code == 0, err
    theta = torch.load(run_dir / "weights.pt", weights_only=True)
    want = greedy_reference(model_of(run_dir), theta, list(b"line 7: the"), 30, 257, corpus.BYTES_EOD)
    assert out == "line 7: the" + text_of([i for i in want if i != corpus.BYTES_EOD]) + "\n"

    # The corpus prepared again at the same path with another tokenizer of the same vocabulary (257: the
    # 256 bytes' tokens and its eod, no merge), whose ids mean other text: refused, not decoded.
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=257, special_tokens=["<eod>"], initial_alphabet=alphabet
    )
    bpe.train_from_iterator([text], trainer)
    assert bpe.get_vocab_size() == corpus.BYTES_VOCAB
    json_bytes = bpe.to_str().encode()
    shutil.rmtree(folder)
    documents = [
        bpe.encode(text[i : i + 300], add_special_tokens=False).ids for i in range(0, len(text), 300)
    ]
    prepared(folder, documents, corpus.BYTES_VOCAB, bpe.token_to_id("<eod>"), json_bytes)
    code, out, err = command(str(run_dir), "--prompt", "line 7: the", "--tokens", "30")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"hypertrain.sample: error: data.path={str(folder)!r} now holds a corpus of another tokenizer "
        f"(vocab 257, tokenizer.json sha256 {hashlib.sha256(json_bytes).hexdigest()[:16]}...) than {run_dir} "
        "trained with (vocab 257, the bytes tokenizer); valid: the corpus the run trained on at that path "
        "(prepared again from the same inputs with the same --tokenizer)"
    ]


def test_a_prompt_quoted_in_a_line_keeps_its_spaces(run):
    """The line quotes the prompt as Python writes it (repr), its runs of spaces and tabs kept; here a
    prompt of bytes that are no UTF-8 (argv's surrogate escapes): one line, exit 2, not a traceback."""
    prompt = "a   b\t\udcff"  # b"a   b\t\xff" as the shell passes it
    code, out, err = command(str(run), "--prompt", prompt)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "hypertrain.sample: error: --prompt='a   b\\t\\udcff' holds bytes that are not UTF-8; "
        "valid: UTF-8 text"
    ]


def test_ctrl_c_while_sampling_is_one_line_and_exit_130(run, monkeypatch):
    """Ctrl-C (Python's SIGINT handler raises KeyboardInterrupt) in the middle of the sampling loop:
    one line and the code the train entry stops with on SIGINT."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sample, "continuation", interrupted)
    code, out, err = command(str(run), "--prompt", "x")
    assert (code, out) == (signal_codes[signal.SIGINT], "") == (130, "")
    assert err.splitlines() == ["hypertrain.sample: stopped by SIGINT (Ctrl-C); nothing was written"]


def mapped(pid: int, library: str) -> bool:
    """Whether process `pid` has loaded a shared library whose path holds `library` (it imported it)."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("when", ["importing", "sampling"])
def test_ctrl_c_to_the_command_is_one_line_and_exit_130(run, tmp_path, when):
    """The real command sent SIGINT once numpy is loaded (its module's imports, under the command's
    guard) or torch (inside `cli`: the weights, then a loop of a million tokens); about 2 s each."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("no /proc to see what the process has loaded")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hypertrain.sample", str(run), "--prompt", "x", "--tokens", "1000000"],
        cwd=tmp_path,
        env=entry_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    library = {"importing": "_multiarray_umath", "sampling": "libtorch_cpu"}[when]
    deadline = time.monotonic() + 60
    while not mapped(proc.pid, library) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if when == "sampling":
        time.sleep(0.5)  # torch's import done, the weights loaded: in the loop
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (130, ""), err
    assert err.splitlines() == ["hypertrain.sample: stopped by SIGINT (Ctrl-C); nothing was written"]
