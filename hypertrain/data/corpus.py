"""A prepared corpus on disk (written by `python -m hypertrain.data prepare`, read by `data=prepared`):

    tokens.bin      little-endian uint16 or uint32 (meta "dtype"): every document followed by the eod id
    documents.bin   little-endian int64 [D + 1]: document d is tokens[starts[d] : starts[d + 1]], eod last
    tokenizer.json  the Hugging Face tokenizer (absent for the `bytes` tokenizer: ids 0..255, eod 256)
    meta.json       what the corpus is (`Meta`): vocab, eod, counts, its sources, sha256 of inputs and files

`write(dir, ...)` writes the four files into an existing empty directory (atomicity is the caller's);
`read(dir)` memory-maps them back; `Tokenizer` encodes and decodes with the corpus's own tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hypertrain.config import UserError

FORMAT = 1
TOKENS, DOCUMENTS, TOKENIZER, META = "tokens.bin", "documents.bin", "tokenizer.json", "meta.json"
BYTES_VOCAB, BYTES_EOD = 257, 256  # the `bytes` tokenizer: a byte's id is its value, the eod 256
UINT32_VOCAB = 1 << 32  # the largest vocabulary a uint32 token file holds


@dataclass(frozen=True)
class SourceMeta:
    name: str  # the prepare input as given (a glob, a file, a dataset directory)
    files: int  # files it expanded to
    documents: int  # its documents in the corpus (consecutive: sources are stored in input order)
    tokens: int  # its tokens, each document's eod included
    sha256: str  # sha256 of its files' names and bytes, in order


@dataclass(frozen=True)
class Meta:
    format: int
    vocab: int  # every id is below this
    eod: int  # the id that ends every document
    dtype: str  # "uint16" (vocab <= 65536) or "uint32"
    documents: int
    tokens: int
    tokenizer: str  # as asked: "bytes", "train:V", or the tokenizer.json path given
    tokenizer_sha256: str  # sha256 of tokenizer.json's bytes ("" for bytes)
    sources: tuple[SourceMeta, ...]
    tokens_sha256: str  # sha256 of tokens.bin
    documents_sha256: str  # sha256 of documents.bin
    request: str  # sha256 of what was asked (inputs' sha256, tokenizer, options): equal = nothing to do

    @property
    def source_documents(self) -> np.ndarray:
        """int64 [S + 1]: source s holds documents source_documents[s] .. source_documents[s + 1] - 1."""
        return np.concatenate([[0], np.cumsum([s.documents for s in self.sources])]).astype(np.int64)

    def describe(self) -> str:
        """One line: tokenizer, vocab, documents and tokens, sources."""
        names = ", ".join(s.name for s in self.sources)
        return (
            f"tokenizer {self.tokenizer} (vocab {self.vocab}), {self.documents:,} documents, "
            f"{self.tokens:,} tokens from {len(self.sources)} source{'s' * (len(self.sources) > 1)} ({names})"
        )


@dataclass(frozen=True, eq=False)
class Corpus:
    meta: Meta
    tokens: np.ndarray  # read-only memmap (or an empty array), meta.dtype
    starts: np.ndarray  # int64 [D + 1]
    path: Path


def dtype_for(vocab: int) -> str:
    return "uint16" if vocab <= 1 << 16 else "uint32"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write(
    directory: Path,
    documents_per_source: Sequence[Iterable[np.ndarray]],
    sources: Sequence[SourceMeta],
    *,
    vocab: int,
    eod: int,
    tokenizer: str,
    tokenizer_json: bytes | None,
    request: str,
) -> Meta:
    """Write a corpus of the given documents (token id arrays without their eod, per source, in order;
    each source's an iterable read once, as it is written: a generator streams) into `directory`
    (existing, empty). `sources`' documents and tokens are recounted here."""
    if vocab > UINT32_VOCAB:
        raise UserError(
            f"a vocabulary of {vocab} tokens does not fit uint32 token ids; valid: <= {UINT32_VOCAB}"
        )
    directory = Path(directory)
    dtype = np.dtype("<u2" if dtype_for(vocab) == "uint16" else "<u4")
    lengths, counted = array("q"), []  # 8 bytes a document, however many
    with open(directory / TOKENS, "wb") as out:
        for docs, source in zip(documents_per_source, sources, strict=True):
            tokens, documents = 0, 0
            for doc in docs:
                row = np.empty(len(doc) + 1, dtype=dtype)
                row[:-1] = doc
                row[-1] = eod
                out.write(row.tobytes())
                lengths.append(len(row))
                tokens += len(row)
                documents += 1
            counted.append(SourceMeta(source.name, source.files, documents, tokens, source.sha256))
    starts = np.concatenate([[0], np.cumsum(np.frombuffer(lengths, dtype=np.int64))]).astype("<i8")
    (directory / DOCUMENTS).write_bytes(starts.tobytes())
    if tokenizer_json is not None:
        (directory / TOKENIZER).write_bytes(tokenizer_json)
    meta = Meta(
        format=FORMAT,
        vocab=vocab,
        eod=eod,
        dtype=dtype_for(vocab),
        documents=len(lengths),
        tokens=int(starts[-1]),
        tokenizer=tokenizer,
        tokenizer_sha256=hashlib.sha256(tokenizer_json).hexdigest() if tokenizer_json is not None else "",
        sources=tuple(counted),
        tokens_sha256=sha256_file(directory / TOKENS),
        documents_sha256=sha256_file(directory / DOCUMENTS),
        request=request,
    )
    (directory / META).write_text(json.dumps(asdict(meta), indent=1) + "\n")
    return meta


def read_meta(directory: Path) -> Meta:
    """The meta of the corpus in `directory`; UserError (one line) when there is none or it is not one."""
    path = Path(directory) / META
    try:
        raw = json.loads(path.read_text())
        sources = tuple(SourceMeta(**s) for s in raw.pop("sources"))
        meta = Meta(**raw, sources=sources)
    except FileNotFoundError:
        raise UserError(
            f"data.path={str(directory)!r} holds no prepared corpus (no {META}); "
            "valid: a directory written by `python -m hypertrain.data prepare INPUT ... --out DIR`"
        ) from None
    except (ValueError, TypeError, KeyError) as error:
        raise UserError(f"{path} is not a prepared corpus's meta ({error}); valid: prepare again") from None
    if meta.format != FORMAT:
        raise UserError(f"{path} has format {meta.format}; valid: {FORMAT} (prepare it again)")
    return meta


def read(directory: Path) -> Corpus:
    """The corpus in `directory`, tokens memory-mapped; UserError when its files disagree with the meta."""
    directory = Path(directory).expanduser()
    meta = read_meta(directory)
    dtype = np.dtype("<u2" if meta.dtype == "uint16" else "<u4")
    tokens_path, documents_path = directory / TOKENS, directory / DOCUMENTS
    sizes = {p: p.stat().st_size if p.is_file() else -1 for p in (tokens_path, documents_path)}
    expected = {tokens_path: meta.tokens * dtype.itemsize, documents_path: (meta.documents + 1) * 8}
    if sizes != expected:
        raise UserError(
            f"{directory}: {TOKENS} or {DOCUMENTS} does not match {META} ({meta.tokens} tokens, "
            f"{meta.documents} documents); valid: an intact prepared corpus (prepare it again)"
        )
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r") if meta.tokens else np.zeros(0, dtype=dtype)
    starts = np.fromfile(documents_path, dtype="<i8").astype(np.int64)
    return Corpus(meta, tokens, starts, directory)


class Tokenizer:
    """The corpus's tokenizer: `encode(text)` -> ids (no eod), `decode(ids)` -> text (the eod dropped)."""

    def __init__(self, directory: Path, meta: Meta):
        self.meta = meta
        self._hf = None
        if meta.tokenizer != "bytes":
            import tokenizers  # a dependency of hypertrain; imported here so `bytes` corpora need nothing

            self._hf = tokenizers.Tokenizer.from_file(str(Path(directory) / TOKENIZER))
            self._hf.encode_special_tokens = True  # as prepare encoded: "<|endoftext|>" in a text is text

    def encode(self, text: str) -> list[int]:
        if self._hf is None:
            return list(text.encode("utf-8"))
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        kept = [int(i) for i in ids if int(i) != self.meta.eod]
        if self._hf is None:
            return bytes(i for i in kept if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(kept, skip_special_tokens=False)
