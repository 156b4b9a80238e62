"""`prepare(inputs, out, tokenizer, field)`: tokenize the inputs (each one source, stored in order) into
the prepared corpus `out` (corpus.py's format), written whole or not at all: a sibling temporary
directory renamed into place, under a lock beside `out` (`claimed`). The same request on an existing
`out` writes nothing; any other content in `out`, a place where `out` cannot be, and every bad input
are refused with one line (UserError); a full disk is DiskFull (exit 4); nothing is left of a refusal.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import hypertrain.data.corpus as corpus
from hypertrain.config import UserError
from hypertrain.data.bpe import byte_level_bpe, cuts_keep_tokens, pieces
from hypertrain.data.preparation.inputs import BATCH_CHARS, Input, Reader, check_disjoint, open_input
from hypertrain.data.preparation.outdir import claimed, put_in_place, write_error

EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>")  # an existing special token among these ends documents
TRAINED_EOD = "<|endoftext|>"
MIN_TRAINED_VOCAB = corpus.BYTES_VOCAB + 1  # the 256 bytes, the eod and one merge at least
# tokenizers' BpeTrainer reserves about 70 bytes of address space per token of V before it reads a word
# (1.34 GiB at 2^24, 6.3 GiB at 10^8: docs/data.md) and aborts the process where that cannot be had
# (train:1000000000: 71 GB). 2^24 is 64 times the largest vocabularies in use (256k); a larger one is
# trained elsewhere and given as PATH/tokenizer.json.
MAX_TRAINED_VOCAB = 1 << 24
PIECE_CHARS = 1 << 16  # a longer document is encoded in pieces of about this many characters, where safe
HF_HOME = ".hf"  # Hugging Face's caches during a prepare: in the partial corpus, so they go with it
VALID_TOKENIZER = (
    "bytes, PATH/tokenizer.json (a Hugging Face tokenizer), DIR (a model directory holding one) or train:V "
    "(a byte-level BPE of V tokens)"
)


@dataclass(frozen=True)
class Prepared:
    meta: corpus.Meta
    written: bool  # False: `out` already held this request's corpus
    seconds: float
    undecodable: int  # documents whose text was not UTF-8 (bad bytes, lone surrogates), replaced


@dataclass
class Tokenizer:
    spec: str  # as asked: "bytes", "train:V" or the tokenizer.json path
    hf: object | None = None  # a tokenizers.Tokenizer; None for bytes (and for train:V until trained)
    json: bytes | None = None  # tokenizer.json's bytes: the file given, byte for byte, or the trained one's
    trained_vocab: int = 0  # V of train:V
    _in_pieces: bool | None = None  # bpe.cuts_keep_tokens(hf), asked once

    @property
    def in_pieces(self) -> bool:
        """Whether a long document's ids are its pieces' ids joined (bpe.pieces): the byte-level BPEs."""
        if self._in_pieces is None:
            self._in_pieces = self.hf is not None and cuts_keep_tokens(self.hf)
        return self._in_pieces

    @property
    def file_sha256(self) -> str:
        """sha256 of the tokenizer.json given (part of the request); "" for bytes and train:V."""
        given = self.json is not None and not self.trained_vocab
        return hashlib.sha256(self.json).hexdigest() if given else ""

    def vocab_and_eod(self) -> tuple[int, int]:
        """The vocabulary (every id below it) and the eod: an existing special token of EOD_TOKENS, else
        a new id after the tokenizer's own."""
        if self.hf is None:
            return corpus.BYTES_VOCAB, corpus.BYTES_EOD
        largest = max(self.hf.get_vocab(with_added_tokens=True).values())
        for token in EOD_TOKENS:
            if (found := self.hf.token_to_id(token)) is not None:
                return largest + 1, found
        return largest + 2, largest + 1


def parse_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `--tokenizer` names (a file loaded, train:V checked); UserError when it cannot serve."""
    if spec == "bytes":
        return Tokenizer(spec)
    if spec.startswith("train:"):
        text = spec.removeprefix("train:")
        try:
            vocab = int(text)
        except ValueError:
            vocab = None
        if vocab is None or not MIN_TRAINED_VOCAB <= vocab <= MAX_TRAINED_VOCAB:
            raise UserError(
                f"--tokenizer {spec!r}: V={text!r} is not a vocabulary a byte-level BPE can have; valid: "
                f"train:V with V an integer {MIN_TRAINED_VOCAB}..{MAX_TRAINED_VOCAB} "
                "(the 256 bytes, the eod, one merge at least; at most 2^24, as the trainer reserves about "
                "70 bytes a token up front: a larger vocabulary as PATH/tokenizer.json)"
            )
        return Tokenizer(spec, trained_vocab=vocab)
    import tokenizers

    path = Path(spec).expanduser()
    if path.is_dir():  # a model directory (save_pretrained's, or RUN/hf): its tokenizer.json
        path = path / corpus.TOKENIZER
    try:
        data = path.read_bytes()
        hf = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as error:  # tokenizers raises its own Exception with serde's message
        said = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"--tokenizer {spec!r} does not load ({said}); valid: {VALID_TOKENIZER}") from None
    return Tokenizer(spec, hf, data)


def train(tokenizer: Tokenizer, sources: Sequence[Input], field: str, bar) -> None:
    """A byte-level BPE of `tokenizer.trained_vocab` tokens fitted on every document of `sources`
    (tokenizers' BpeTrainer: deterministic for the same documents), `TRAINED_EOD` its special token."""
    bar.set_description("training BPE")
    documents = (d for s in sources for batch in Reader(s, field, bar.update) for d in batch)
    hf = byte_level_bpe(documents, tokenizer.trained_vocab, [TRAINED_EOD])
    tokenizer.hf, tokenizer.json = hf, hf.to_str().encode()


def encode(tokenizer: Tokenizer, documents: list[str], dtype: np.dtype, where: str) -> list[np.ndarray]:
    """Each document's ids (no eod): the UTF-8 bytes, or tokenizers' encode_batch (its threads) on at
    most about BATCH_CHARS characters at a time, a document longer than PIECE_CHARS in pieces where its
    ids are the same (`Tokenizer.in_pieces`), so a long one takes no more memory than a batch. UserError
    when the tokenizer cannot encode a text of the input `where`."""
    if tokenizer.hf is None:
        return [np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(dtype) for d in documents]
    cut = [pieces(d, PIECE_CHARS) if tokenizer.in_pieces and len(d) > PIECE_CHARS else [d] for d in documents]
    texts = [piece for parts in cut for piece in parts]
    ids = [
        row for group in batched(texts, BATCH_CHARS) for row in encode_batch(tokenizer, group, dtype, where)
    ]
    bounds = np.cumsum([0, *(len(parts) for parts in cut)]).tolist()
    return [np.concatenate(ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def batched(texts: list[str], chars: int) -> Iterator[list[str]]:
    """`texts` in order, in consecutive groups of at most `chars` characters (a longer text alone)."""
    group, size = [], 0
    for text in texts:
        if group and size + len(text) > chars:
            yield group
            group, size = [], 0
        group.append(text)
        size += len(text)
    if group:
        yield group


def encode_batch(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype, where: str) -> list[np.ndarray]:
    """The ids of `texts` by tokenizers' encode_batch; UserError when the tokenizer cannot encode one."""
    try:
        encodings = tokenizer.hf.encode_batch(texts, add_special_tokens=False)
    except Exception as error:  # tokenizers raises a bare Exception with its model's message
        if isinstance(error, MemoryError):
            raise
        said = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(
            f"--tokenizer {tokenizer.spec!r} cannot encode the text of input {where!r} ({said}); valid: "
            "a tokenizer that encodes any text (a byte-level one, or one with an unknown token), "
            "bytes or train:V"
        ) from None
    return [np.array(e.ids, dtype=dtype) for e in encodings]


def request_of(sources: Sequence[Input], field: str, tokenizer: Tokenizer) -> str:
    """sha256 hex of what was asked: the format, each source's content, the field and the tokenizer."""
    asked = {
        "format": corpus.FORMAT,
        "sources": [s.sha256 for s in sources],
        "field": field,
        "tokenizer": tokenizer.spec,
        "tokenizer_sha256": tokenizer.file_sha256,
    }
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()


def existing(out: Path) -> corpus.Meta | None:
    """The corpus `out` holds, None when it is absent or an empty directory; UserError for anything else."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file; valid: a new or empty directory")
    if not any(out.iterdir()):
        return None
    if not (out / corpus.META).is_file():
        raise UserError(
            f"--out {str(out)!r} holds other files (no prepared corpus); valid: a new or empty directory"
        )
    return corpus.read_meta(out)


@contextmanager
def private_hf_home(home: Path | None = None) -> Iterator[None]:
    """Hugging Face's caches (datasets imports them) in the folder `home` (made, and removed afterwards;
    None: a new temporary folder), and no network: prepare writes nothing but its output."""
    names = ("HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    before = {name: os.environ.get(name) for name in names}
    if home is None:
        home = Path(tempfile.mkdtemp(prefix="hypertrain-prepare-hf-"))
    else:
        home.mkdir()
    os.environ.update(
        HF_HOME=str(home),
        HF_DATASETS_CACHE=str(home / "datasets"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(home, ignore_errors=True)


def prepare(
    inputs: Sequence[str], out: Path, tokenizer_spec: str, field: str, progress: bool | None = None
) -> Prepared:
    """Prepare `inputs` into `out` (see the module's docstring); `progress`: a bar on stderr (None: only
    when stderr is a terminal)."""
    started = time.perf_counter()
    out = Path(out).expanduser().absolute()
    tokenizer = parse_tokenizer(tokenizer_spec)
    with claimed(out) as partial:
        try:
            with private_hf_home(partial / HF_HOME):  # in the partial corpus: a killed prepare's goes with it
                found = existing(out)
                own = (out, partial)  # an earlier corpus in DIR is never an input of the next prepare
                sources = [open_input(text, field, own) for text in inputs]
                check_disjoint(sources)
                request = request_of(sources, field, tokenizer)
                if found is not None:
                    if found.request != request:
                        raise UserError(
                            f"--out {str(out)!r} holds another corpus ({found.describe()}); "
                            "valid: a new or empty directory, or the inputs and options that prepared it"
                        )
                    corpus.verify(out, found)  # a damaged corpus is refused, never "nothing to do"
                    return Prepared(found, False, time.perf_counter() - started, 0)
                meta, undecodable = build(partial, sources, field, tokenizer, request, progress)
        except OSError as error:  # a full disk (DiskFull), another error of the filesystem: one line
            raise write_error(out, error) from None
        put_in_place(partial, out)
    return Prepared(meta, True, time.perf_counter() - started, undecodable)


def build(
    partial: Path,
    sources: Sequence[Input],
    field: str,
    tokenizer: Tokenizer,
    request: str,
    progress: bool | None,
) -> tuple[corpus.Meta, int]:
    """The corpus written into `partial` (a BPE trained first for train:V), with a progress bar."""
    from tqdm import tqdm

    total = sum(os.path.getsize(path) for s in sources for _, path in s.entries)
    disable = None if progress is None else not progress  # None: tqdm's own test, a terminal
    with tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, disable=disable) as bar:
        if tokenizer.trained_vocab:
            train(tokenizer, sources, field, bar)
            bar.reset(total=total)
        bar.set_description("tokenizing")
        return write(partial, sources, field, tokenizer, request, bar)


def write(
    directory: Path, sources: Sequence[Input], field: str, tokenizer: Tokenizer, request: str, bar
) -> tuple[corpus.Meta, int]:
    """Every source encoded and written into `directory` (corpus.write), a batch of documents at a time;
    UserError for an empty source."""
    vocab, eod = tokenizer.vocab_and_eod()
    dtype = np.dtype(corpus.dtype_for(vocab))
    if tokenizer.hf is not None:  # a special token's spelling in a document is text: eods end documents only
        tokenizer.hf.encode_special_tokens = True
    readers = [Reader(source, field, bar.update) for source in sources]
    meta = corpus.write(
        directory,
        [encoded(reader, tokenizer, dtype) for reader in readers],
        [corpus.SourceMeta(s.name, len(s.entries), 0, 0, s.sha256) for s in sources],
        vocab=vocab,
        eod=eod,
        tokenizer=tokenizer.spec,
        tokenizer_json=tokenizer.json,
        request=request,
    )
    return meta, sum(reader.undecodable for reader in readers)


def encoded(reader: Reader, tokenizer: Tokenizer, dtype: np.dtype) -> Iterator[np.ndarray]:
    """The ids of each document `reader` yields, in order; UserError when it yields none."""
    empty = True
    for batch in reader:
        yield from encode(tokenizer, batch, dtype, reader.source.name)
        empty = False
    if empty:
        name = reader.source.name
        raise UserError(f"input {name!r} holds no documents; valid: at least one document in every input")


def summary(prepared: Prepared, out: Path) -> str:
    """One line: what `out` holds and how fast it was made (or that it was there already)."""
    meta = prepared.meta
    if not prepared.written:
        return f"{out} already prepared ({meta.describe()}): nothing to do"
    rate = meta.tokens / max(prepared.seconds, 1e-9)
    bad = prepared.undecodable
    replaced = ""
    if bad:
        replaced = f"; {bad} document{'s' * (bad > 1)} had text that is not UTF-8, replaced by U+FFFD"
    return f"prepared {out}: {meta.describe()} in {prepared.seconds:.1f} s ({rate:,.0f} tokens/s){replaced}"
