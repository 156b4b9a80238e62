"""`python -m hypertrain.data prepare`: the prepared stream is the input documents, each followed by the
eod, in every input format and with every kind of tokenizer (the ids tokenizers' own encode_batch
gives); the meta's counts and hashes; the same request twice writes nothing; an interrupted prepare
leaves no corpus; and prepare writes nowhere but its output (not under HOME, not in the temporary
folder). Its one-line refusals are in tests/test_bad_input.py's catalogue."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from hypertrain.config import UserError
from hypertrain.data import corpus
from hypertrain.data.__main__ import main
from hypertrain.data.bpe import byte_level_bpe
from hypertrain.data.preparation.prepare import prepare, private_hf_home
from hypertrain.failures import DiskFull

REPO = Path(__file__).resolve().parents[1]
WORDS = "the a corpus token stream of replicas rounds outer inner naïve café 東京 🙂 def return x".split()


def make_documents(count: int, seed: int) -> list[str]:
    """`count` documents of a few hundred characters: words, punctuation, code, non-ASCII, newlines."""
    rng = random.Random(seed)
    documents = []
    for d in range(count):
        lines = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(1, 6))
        ]
        documents.append(f"doc {d}:\n" + "\n".join(lines) + ("\n" if d % 2 else "") + "  \tend.")
    return documents


DOCUMENTS = make_documents(24, seed=0)
DOCUMENTS[5] += " a special token's spelling is text: <|endoftext|> </s> <eos>"
OTHER = make_documents(9, seed=1)


def write_inputs(root: Path, documents: list[str]) -> dict[str, str]:
    """`documents` in every input format under `root`: {kind: the INPUT that names them}."""
    import pyarrow as pa
    import pyarrow.feather
    import pyarrow.parquet

    (root / "text").mkdir(parents=True)
    for i, document in enumerate(documents):  # names sort in document order
        (root / "text" / f"{i:03d}.txt").write_text(document, encoding="utf-8")
    with open(root / "docs.jsonl", "w", encoding="utf-8") as file:
        file.writelines(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(documents))
    table = pa.table({"id": list(range(len(documents))), "text": documents})
    pa.parquet.write_table(table, root / "docs.parquet", row_group_size=7)  # several row groups
    with pa.ipc.new_file(root / "docs.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=5)
    with pa.ipc.new_stream(root / "stream.arrow", table.schema) as writer:  # as datasets writes them
        writer.write_table(table, max_chunksize=5)
    pa.feather.write_feather(table, root / "docs.feather")
    with private_hf_home():  # datasets' caches in a temporary folder, as prepare has them
        import datasets

        datasets.Dataset.from_dict({"id": list(range(len(documents))), "text": documents}).save_to_disk(
            str(root / "saved")
        )
    return {
        "text": str(root / "text" / "**" / "*.txt"),
        "jsonl": str(root / "*.jsonl"),
        "parquet": str(root / "docs.parquet"),
        "arrow": str(root / "docs.arrow"),
        "arrow-stream": str(root / "stream.arrow"),
        "feather": str(root / "docs.feather"),
        "save_to_disk": str(root / "saved"),
    }


def bpe_file(path: Path, documents: list[str], vocab: int, special: list[str]) -> Path:
    """A byte-level BPE trained on `documents` with `special` tokens, saved as a tokenizer.json."""
    made = tokenizers.Tokenizer(models.BPE())
    made.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    made.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    made.train_from_iterator(documents, trainer)
    made.save(str(path))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    return write_inputs(tmp_path_factory.mktemp("inputs"), DOCUMENTS)


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> dict[str, str]:
    """tokenizer.json files: one without an eod token (prepare adds one), one whose `</s>` is the eod."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "file": str(bpe_file(root / "plain.json", DOCUMENTS, 320, [])),
        "file-with-eos": str(bpe_file(root / "eos.json", DOCUMENTS, 320, ["<pad>", "</s>"])),
    }


def documents_of(directory: Path) -> list[np.ndarray]:
    prepared = corpus.read(directory)
    bounds = zip(prepared.starts[:-1], prepared.starts[1:], strict=True)
    return [np.asarray(prepared.tokens[a:b]) for a, b in bounds]


def own_encoding(directory: Path, documents: list[str]) -> list[list[int]]:
    """What tokenizers' own encode_batch gives for `documents` with the corpus's tokenizer.json (special
    tokens' spellings encoded as text)."""
    loaded = tokenizers.Tokenizer.from_file(str(directory / corpus.TOKENIZER))
    loaded.encode_special_tokens = True
    return [e.ids for e in loaded.encode_batch(documents, add_special_tokens=False)]


@pytest.mark.parametrize(
    "kind", ["text", "jsonl", "parquet", "arrow", "arrow-stream", "feather", "save_to_disk"]
)
@pytest.mark.parametrize("tokenizer", ["bytes", "train:300", "file", "file-with-eos"])
def test_the_stream_is_the_documents_each_ended_by_the_eod(
    tmp_path, inputs, tokenizer_files, kind, tokenizer
):
    spec = tokenizer_files.get(tokenizer, tokenizer)
    out = tmp_path / "corpus"
    meta = prepare([inputs[kind]], out, spec, "text", progress=False).meta
    stored = documents_of(out)
    assert len(stored) == len(DOCUMENTS) == meta.documents
    assert all(ids[-1] == meta.eod and meta.eod not in ids[:-1] for ids in stored)
    said = corpus.Tokenizer(out, meta)
    assert [said.decode(ids) for ids in stored] == DOCUMENTS
    assert [said.encode(d) for d in DOCUMENTS] == [ids[:-1].tolist() for ids in stored]
    if tokenizer == "bytes":
        assert not (out / corpus.TOKENIZER).exists()
        assert [ids[:-1].tolist() for ids in stored] == [list(d.encode()) for d in DOCUMENTS]
        return
    assert [ids[:-1].tolist() for ids in stored] == own_encoding(out, DOCUMENTS)
    loaded = tokenizers.Tokenizer.from_file(str(out / corpus.TOKENIZER))
    largest = max(loaded.get_vocab(with_added_tokens=True).values())
    if tokenizer == "file":  # no eod token of its own: a new id after the tokenizer's
        assert (meta.eod, meta.vocab) == (largest + 1, largest + 2)
        assert (out / corpus.TOKENIZER).read_bytes() == Path(spec).read_bytes()
    else:
        eod = {"train:300": "<|endoftext|>", "file-with-eos": "</s>"}[tokenizer]
        assert (meta.eod, meta.vocab) == (loaded.token_to_id(eod), largest + 1)


def test_a_trained_tokenizer_is_the_same_every_time(tmp_path, inputs):
    """train:V is deterministic: two prepares of the same inputs, in two processes, write the same bytes."""
    for name in ("one", "two"):
        done = subprocess.run(
            [sys.executable, "-m", "hypertrain.data", "prepare", inputs["jsonl"], "--tokenizer", "train:300"]
            + ["--out", str(tmp_path / name), "--quiet"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    for name in (corpus.TOKENIZER, corpus.TOKENS):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    metas = [json.loads((tmp_path / name / corpus.META).read_text()) for name in ("one", "two")]
    for meta in metas:
        del meta["stamps"]  # when each file was written: the one field that differs
    assert metas[0] == metas[1]


def test_the_meta_counts_each_source_and_hashes_its_files(tmp_path, inputs):
    """Two sources, stored consecutively: per-source documents and tokens, the files' sha256, recomputed
    here from the inputs and the files written."""
    other = write_inputs(tmp_path / "other", OTHER)
    out = tmp_path / "corpus"
    meta = prepare([inputs["jsonl"], other["text"]], out, "bytes", "text", progress=False).meta
    lengths = [len(d.encode()) + 1 for d in DOCUMENTS + OTHER]
    assert (meta.documents, meta.tokens, meta.vocab, meta.eod) == (33, sum(lengths), 257, 256)
    assert [(s.files, s.documents, s.tokens) for s in meta.sources] == [
        (1, 24, sum(lengths[:24])),
        (9, 9, sum(lengths[24:])),
    ]
    assert meta.source_documents.tolist() == [0, 24, 33]
    starts = np.fromfile(out / corpus.DOCUMENTS, dtype="<i8")
    assert starts.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    for name, recorded in ((corpus.TOKENS, meta.tokens_sha256), (corpus.DOCUMENTS, meta.documents_sha256)):
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == recorded

    def files_sha256(named: list[tuple[str, Path]]) -> str:
        digest = hashlib.sha256()
        for name, path in named:
            data = path.read_bytes()
            digest.update(f"{name}\0{len(data)}\0".encode() + data)
        return digest.hexdigest()

    jsonl = Path(inputs["jsonl"]).with_name("docs.jsonl")
    texts = sorted((tmp_path / "other" / "text").iterdir())
    assert meta.sources[0].sha256 == files_sha256([("docs.jsonl", jsonl)])
    assert meta.sources[1].sha256 == files_sha256([(p.name, p) for p in texts])
    assert [s.name for s in meta.sources] == [inputs["jsonl"], other["text"]]
    assert meta.dtype == "uint16" and (out / corpus.TOKENS).stat().st_size == 2 * meta.tokens


def test_the_same_request_again_writes_nothing(tmp_path, inputs, capsys):
    out = tmp_path / "corpus"
    args = ["prepare", inputs["parquet"], inputs["text"], "--out", str(out), "--tokenizer", "train:300"]
    assert main(args) == 0
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    capsys.readouterr()
    assert main(args) == 0
    said = capsys.readouterr()
    assert said.out.count("\n") == 1 and "already prepared" in said.out and "nothing to do" in said.out
    assert said.err == ""
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


@pytest.mark.parametrize("tokenizer", ["bytes", "train:300"])
def test_text_that_is_not_utf8_is_replaced_and_counted_in_text_and_jsonl(tmp_path, capsys, tokenizer):
    """Bad bytes in a text file and in a JSONL line, and a JSON string's lone surrogate (which UTF-8 cannot
    spell: it stopped the encoder, and the trainer, with a traceback), each become U+FFFD; the summary
    counts the documents that had any (a record with both, once)."""
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 ok")  # Latin-1, not UTF-8
    (tmp_path / "b.txt").write_bytes("café ok".encode())
    records = [
        (b'{"text": "caf\xe9 line"}', "caf\ufffd line"),  # a bad byte
        (b'{"text": "fine"}', "fine"),
        (b'{"text": "half \\ud800 a pair"}', "half \ufffd a pair"),  # a lone surrogate
        (b'{"text": "\\udfff both", "id": "\xff"}', "\ufffd both"),  # a surrogate and a bad byte elsewhere
    ]
    (tmp_path / "c.jsonl").write_bytes(b"\n".join(line for line, _ in records) + b"\n")
    expected = ["caf\ufffd ok", "café ok", *(text for _, text in records)]
    bad = sum("\ufffd" in text for text in expected)  # every replacement is a bad byte or a surrogate here
    out = tmp_path / "corpus"
    args = ["prepare", str(tmp_path / "*.txt"), str(tmp_path / "c.jsonl"), "--out", str(out)]
    assert main([*args, "--tokenizer", tokenizer]) == 0
    said = capsys.readouterr().out.rstrip()
    assert said.endswith(f"; {bad} documents had text that is not UTF-8, replaced by U+FFFD"), said
    decoder = corpus.Tokenizer(out, corpus.read(out).meta)
    assert [decoder.decode(ids) for ids in documents_of(out)] == expected


def test_compressed_text_and_jsonl_are_read_through_their_suffix(tmp_path):
    import bz2
    import gzip
    import lzma

    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(DOCUMENTS[0].encode()))
    (tmp_path / "b.txt.xz").write_bytes(lzma.compress(DOCUMENTS[1].encode()))
    lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS[2:5])
    (tmp_path / "c.jsonl.bz2").write_bytes(bz2.compress(lines.encode()))
    out = tmp_path / "corpus"
    meta = prepare([str(tmp_path / "*.*")], out, "bytes", "text", progress=False).meta
    said = corpus.Tokenizer(out, meta)
    assert [said.decode(ids) for ids in documents_of(out)] == DOCUMENTS[:5]


def test_a_glob_over_the_output_directory_leaves_the_corpus_out(tmp_path):
    """`prepare 'data/**/*' --out data/corpus` twice: the second finds its corpus (whose files the glob
    now matches) and has nothing to do."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text(DOCUMENTS[0])
    args = [str(tmp_path / "data" / "**" / "*")], tmp_path / "data" / "corpus", "bytes", "text"
    first = prepare(*args, progress=False)
    again = prepare(*args, progress=False)
    assert first.written and not again.written and again.meta == first.meta and first.meta.documents == 1


def test_the_command_explains_itself(capsys):
    for args in (["--help"], ["prepare", "--help"]):
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == 0
    said = capsys.readouterr().out
    assert "prepare" in said and "--tokenizer" in said and "train:V" in said and "save_to_disk" in said


def test_an_empty_output_directory_is_filled(tmp_path, inputs):
    out = tmp_path / "corpus"
    out.mkdir()
    prepare([inputs["text"]], out, "bytes", "text", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [corpus.DOCUMENTS, corpus.META, corpus.TOKENS]


# A prepare in its own process that ends where `stop` says: SIGKILL after the corpus is written into
# the temporary directory but before its rename, Ctrl-C (KeyboardInterrupt) or SIGTERM while encoding.
INTERRUPTED = """
import os, signal, sys
from hypertrain.data import __main__ as command, corpus
from hypertrain.data.preparation import prepare

stop, written, encoded = sys.argv[1], corpus.write, prepare.encode
if stop == "kill-before-rename":
    def write(*args, **kwargs):
        written(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
    corpus.write = write
else:
    def encode(*args):
        encoded(*args)
        if stop == "sigterm-while-encoding":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            raise KeyboardInterrupt
    prepare.encode = encode
sys.exit(command.main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    "stop, code",
    [
        ("kill-before-rename", -signal.SIGKILL),
        ("ctrl-c-while-encoding", 130),
        ("sigterm-while-encoding", 128 + signal.SIGTERM),
    ],
)
def test_an_interrupted_prepare_leaves_no_corpus(tmp_path, inputs, stop, code):
    out = tmp_path / "corpus"
    args = ["prepare", inputs["jsonl"], "--out", str(out), "--tokenizer", "train:300", "--quiet"]
    temporary = tmp_path / "tmp"  # the temporary folder of the killed prepare: nothing of it may stay there
    temporary.mkdir()
    env = os.environ | {"TMPDIR": str(temporary)}
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED, stop, *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == code, done.stderr
    assert not out.exists() and list(temporary.iterdir()) == []
    if stop == "ctrl-c-while-encoding":
        assert done.stderr == f"hypertrain: prepare interrupted: {out} not written\n"
    left = sorted(p.name for p in tmp_path.iterdir() if p != temporary)
    killed = [".corpus.lock", ".corpus.partial"]  # the lock (not held: the kernel dropped it) and the
    assert left == (killed if stop == "kill-before-rename" else []), left  # partial corpus, HF's caches in it
    assert main(args) == 0  # the next prepare removes what a killed one left, and writes the corpus
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "tmp"]
    assert corpus.read(out).meta.documents == len(DOCUMENTS)


def test_the_progress_bar_goes_to_stderr_and_the_folders_made_for_a_refused_corpus_go_too(
    tmp_path, inputs, capsys
):
    out = tmp_path / "new" / "deeper" / "corpus"
    prepare([inputs["text"]], out, "train:300", "text", progress=True)
    said = capsys.readouterr()
    assert "training BPE" in said.err and "tokenizing" in said.err and said.out == ""
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="'.*empty.jsonl' holds no documents"):
        prepare([inputs["text"], str(tmp_path / "empty.jsonl")], tmp_path / "a" / "b", "bytes", "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl", "new"]


def test_a_dataset_dict_is_refused_naming_its_splits(tmp_path):
    with private_hf_home():
        import datasets

        split = datasets.Dataset.from_dict({"text": ["a document"]})
        datasets.DatasetDict(train=split, test=split).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(
        UserError, match=r"is a DatasetDict of splits \['train', 'test'\]; valid: one split's"
    ):
        prepare([str(tmp_path / "saved")], tmp_path / "corpus", "bytes", "text")
    assert not (tmp_path / "corpus").exists()


def word_level_file(path: Path, words: int) -> Path:
    """A word-level tokenizer of `words` words (w0, w1, ...) split at whitespace, saved as tokenizer.json."""
    made = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    made.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    made.save(str(path))
    return path


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    documents = ["w70000 w1 w65536 w3", "w69999", "w65535 w2"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    spec = str(word_level_file(tmp_path / "words.json", 70001))
    out = tmp_path / "corpus"
    meta = prepare([str(tmp_path / "docs.jsonl")], out, spec, "text", progress=False).meta
    assert (meta.dtype, meta.vocab, meta.eod) == ("uint32", 70002, 70001)
    assert (out / corpus.TOKENS).stat().st_size == 4 * meta.tokens
    stored = documents_of(out)
    assert [ids[:-1].tolist() for ids in stored] == [[70000, 1, 65536, 3], [69999], [65535, 2]]
    assert [corpus.Tokenizer(out, meta).decode(ids) for ids in stored] == documents


def test_prepare_writes_nowhere_but_its_output(tmp_path, inputs):
    """HOME and the temporary folder are empty folders of the test's: after a prepare of every input
    format (datasets imported, a BPE trained) both are still empty."""
    home, temporary = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    temporary.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_"))}
    env |= {"HOME": str(home), "TMPDIR": str(temporary), "PYTHONPATH": str(REPO)}
    out = tmp_path / "corpus"
    kinds = ("text", "jsonl", "parquet", "arrow", "save_to_disk")
    done = subprocess.run(
        [sys.executable, "-m", "hypertrain.data", "prepare", *(inputs[k] for k in kinds)]
        + ["--out", str(out), "--tokenizer", "train:300"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"prepared {out}: tokenizer train:300")
    assert list(home.rglob("*")) == [] and list(temporary.rglob("*")) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "home", "tmp"]
    assert corpus.read(out).meta.documents == len(kinds) * len(DOCUMENTS)


# -- issue 48: prepare's inputs, its output's place, a long document -----------------------------------


def test_a_recursive_glob_never_enters_a_symlinked_folder_and_reads_a_file_once(tmp_path):
    """`v/latest -> v1` made 3 files 6 documents (the held-out ones copies of training ones), a link back
    up made 1 file 41: `**` does not enter a symlinked folder, and a file reached by two names (through
    a `*`, or a link to a file) is read once."""
    v = tmp_path / "v"
    (v / "v1").mkdir(parents=True)
    files = {v / "v1" / "a.txt": "first", v / "v1" / "b.txt": "second", v / "c.txt": "third"}
    for path, text in files.items():
        path.write_text(text)
    (v / "latest").symlink_to("v1")
    (v / "loop").symlink_to(".")
    (v / "alias.txt").symlink_to(v / "c.txt")
    for pattern in ("v/**/*.txt", "v/*/*.txt", "v/**/*"):  # `*` goes through v/latest and v/loop: once
        out = tmp_path / f"corpus-{len(list(tmp_path.iterdir()))}"
        meta = prepare([str(tmp_path / pattern)], out, "bytes", "text", progress=False).meta
        read = sorted(corpus.Tokenizer(out, meta).decode(ids) for ids in documents_of(out))
        assert read == sorted(files.values()), pattern


def test_the_glob_matches_what_glob_matches_where_there_are_no_symlinks(tmp_path):
    """sources.matches (the glob that does not follow symlinked folders) against the standard library's
    glob on a tree without links: hidden names, `**` at every place, folders, character classes."""
    import glob

    from hypertrain.data.sources import matches

    for name in ("a.txt", "b.md", ".hidden.txt", "d/e.txt", "d/.h/f.txt", "d/g/h.txt", "x1/y.txt", "x2/z"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    patterns = ["**/*.txt", "*", "**", "**/", "*/", ".*", "**/.*", "d/**/*.txt", "x[12]/*", "?.md", "d/**"]
    for pattern in patterns:
        full = str(tmp_path / pattern)
        mine = sorted(os.path.normpath(p) for p in matches(full))
        assert mine == sorted(os.path.normpath(p) for p in glob.glob(full, recursive=True)), pattern


# Texts that meet every alternative of the ByteLevel regex at a cut: contractions, runs of spaces and
# newlines, tabs and "\r\n", digits, underscores, punctuation, letters of other scripts, emoji.
TRICKY = ["it's", "they're", "I'd", "  ", "\n\n", " \n ", "\r\n", "\t", "123", "4 5", "_x_", "a__b", "...",
          "东京", "🙂", "naïve", "x\n", "'s'", "end.", "--", "  \t\n", "Ω", "٣"]  # fmt: skip


def tricky_text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(TRICKY + WORDS) + rng.choice(["", " ", "\n", "  "]) for _ in range(words))


def test_a_long_text_cut_into_pieces_has_the_ids_of_the_whole_with_a_byte_level_bpe():
    """bpe.pieces: the ids of the pieces, joined, are the whole text's, for the BPE train:V fits, at
    every piece size down to 2 (a cut at nearly every allowed place); and the rule that allows pieces
    (bpe.cuts_keep_tokens) refuses the tokenizers where a cut can change the ids, here shown to."""
    from hypertrain.data.bpe import byte_level_bpe, cuts_keep_tokens, pieces

    rng = random.Random(0)
    texts = [tricky_text(rng, 400) for _ in range(6)]
    trained = byte_level_bpe(texts, 600, ["<|endoftext|>"])
    trained.encode_special_tokens = True
    assert cuts_keep_tokens(trained)
    for text in texts:
        whole = trained.encode(text, add_special_tokens=False).ids
        for size in (2, 3, 8, 64):
            parts = pieces(text, size)
            assert "".join(parts) == text and len(parts) > 1
            joined = [i for p in parts for i in trained.encode(p, add_special_tokens=False).ids]
            assert joined == whole, size

    prefixed = tokenizers.Tokenizer.from_str(trained.to_str())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # a space before each piece
    normalized = tokenizers.Tokenizer.from_str(trained.to_str())
    normalized.normalizer = tokenizers.normalizers.Lowercase()
    added = tokenizers.Tokenizer.from_str(trained.to_str())
    added.add_tokens(["e\nend"])  # an added token, not special: matched across a cut
    for refused in (prefixed, normalized, added):
        assert not cuts_keep_tokens(refused)
    text = "it's the\nend"
    parts = pieces(text, 4)
    assert parts == ["it's the", "\nend"]
    for refused in (prefixed, added):
        whole = refused.encode(text, add_special_tokens=False).ids
        assert [i for p in parts for i in refused.encode(p, add_special_tokens=False).ids] != whole


class RecordingTokenizer:
    """A tokenizers.Tokenizer that records the characters of each encode_batch call."""

    def __init__(self, hf):
        object.__setattr__(self, "hf", hf)
        object.__setattr__(self, "calls", [])

    def encode_batch(self, texts, **kwargs):
        self.calls.append(sum(len(t) for t in texts))
        return self.hf.encode_batch(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.hf, name)

    def __setattr__(self, name, value):
        setattr(self.hf, name, value)


def test_a_long_document_is_encoded_a_batch_at_a_time_to_the_ids_of_the_whole(tmp_path, monkeypatch):
    """One document 40 times the batch (scaled down: pieces of 64 characters, batches of 512): no
    encode_batch call gets more than a batch (the whole document went to one call: 188 bytes of memory a
    character), and the stored ids are tokenizers' own for the whole document."""
    from hypertrain.data.preparation import prepare as module

    monkeypatch.setattr(module, "PIECE_CHARS", 64)
    monkeypatch.setattr(module, "BATCH_CHARS", 512)
    trained = []

    def recorded(*args):
        trained.append(RecordingTokenizer(byte_level_bpe(*args)))
        return trained[-1]

    monkeypatch.setattr(module, "byte_level_bpe", recorded)
    document = tricky_text(random.Random(1), 5000)[: 40 * 512]
    (tmp_path / "long.txt").write_text(document)
    (tmp_path / "short.txt").write_text(DOCUMENTS[0])
    out = tmp_path / "corpus"
    prepare([str(tmp_path / "*.txt")], out, "train:400", "text", progress=False)
    assert len(document) > 40 * 500 and max(trained[0].calls) <= 512, trained[0].calls
    stored = [ids[:-1].tolist() for ids in documents_of(out)]
    assert stored == own_encoding(out, [document, DOCUMENTS[0]])


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_full_disk_is_one_line_exit_4_and_leaves_nothing(tmp_path, inputs, monkeypatch, capsys):
    """ENOSPC injected in this process (no full filesystem can be made here): the disk fills while
    tokens.bin is written. Exit 4, training's code for a full disk (failures.DiskFull); no partial
    corpus, no lock, none of the folders made for them."""

    def full(directory, *args, **kwargs):
        (directory / corpus.TOKENS).write_bytes(bytes(1000))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / corpus.TOKENS))

    monkeypatch.setattr(corpus, "write", full)
    out = tmp_path / "new" / "corpus"
    assert main(["prepare", inputs["text"], "--out", str(out), "--quiet"]) == DiskFull.exit_code == 4
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"hypertrain: error: no space left on the device writing --out '{out}' ("), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["a folder to make", "the lock file"])
def test_a_read_only_filesystem_is_one_line_and_leaves_nothing(tmp_path, inputs, monkeypatch, capsys, where):
    """EROFS injected in this process (no read-only filesystem can be mounted here) for whatever is created
    under `ro`, a folder or a file: one line, exit 2, nothing made."""
    from hypertrain.data.preparation import lockfile

    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkdir, real_open = os.mkdir, open

    def refused(path):
        if Path(path).is_relative_to(ro) and not os.path.exists(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: refused(path) or real_mkdir(path, *a, **k))
    monkeypatch.setattr(
        lockfile, "open", lambda path, *a: refused(path) or real_open(path, *a), raising=False
    )
    out = ro / "sub" / "corpus" if where == "a folder to make" else ro / "corpus"
    assert main(["prepare", inputs["text"], "--out", str(out)]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == (
        f"hypertrain: error: --out '{out}': nothing can be created in {ro} (Read-only file system); "
        "valid: a new or empty directory where this user can write"
    )
    assert list(ro.iterdir()) == []


def test_a_mount_point_is_refused_before_any_work_and_a_bind_mount_at_the_rename(
    tmp_path, inputs, monkeypatch, capsys
):
    """An empty mount point as --out was filled on its parent's filesystem, then its rmdir failed (EBUSY)
    after all the work. os.path.ismount's answer and the rename's EBUSY are injected in this process: the
    first is refused before an input is read, the second (a bind mount ismount cannot see) at the rename,
    both in one line, exit 2, the mount point as it was, nothing beside it."""
    from hypertrain.data.preparation import prepare as module

    out = tmp_path / "mnt"
    out.mkdir()
    real_ismount, real_rmdir = os.path.ismount, os.rmdir
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == out or real_ismount(path))
    monkeypatch.setattr(module, "open_input", lambda *args: pytest.fail("an input was read"))
    assert main(["prepare", inputs["text"], "--out", str(out)]) == 2
    said = f"hypertrain: error: --out '{out}' is a mount point, which prepare cannot replace"
    assert one_line(capsys.readouterr().err).startswith(said)
    assert sorted(tmp_path.iterdir()) == [out] and list(out.iterdir()) == []

    monkeypatch.undo()

    def busy(path, *args, **kwargs):
        if Path(path) == out:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", busy)
    assert main(["prepare", inputs["text"], "--out", str(out)]) == 2
    assert one_line(capsys.readouterr().err).startswith(said)
    assert sorted(tmp_path.iterdir()) == [out] and list(out.iterdir()) == []


def test_a_second_prepare_on_the_same_out_is_refused_while_the_first_writes(tmp_path, inputs, capsys):
    """Two prepares on one --out: the second took the first's partial corpus away and one of them ended
    in a traceback. Now the first holds the lock beside --out (here a thread of this process, stopped
    while encoding; flock refuses a second open file the same as another process): the second is one
    line, exit 2, and the first's corpus is whole; the same command again has nothing to do."""
    from hypertrain.data.preparation import prepare as module

    out = tmp_path / "corpus"
    encoding, go, encoded = threading.Event(), threading.Event(), module.encode

    def paused(*args):
        if threading.current_thread() is first:
            encoding.set()
            go.wait(60)
        return encoded(*args)

    first = threading.Thread(target=prepare, args=([inputs["jsonl"]], out, "bytes", "text", False))
    module.encode = paused
    try:
        first.start()
        assert encoding.wait(60)
        args = ["prepare", inputs["jsonl"], "--out", str(out)]
        assert main(args) == 2
        line = one_line(capsys.readouterr().err)
        lock = tmp_path / ".corpus.lock"
        assert line.startswith(
            f"hypertrain: error: --out '{out}' is being prepared by another process (it holds {lock})"
        )
    finally:
        go.set()
        first.join(60)
        module.encode = encoded
    assert corpus.read(out).meta.documents == len(DOCUMENTS)
    assert main(args) == 0 and "nothing to do" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]
