"""A prepared corpus on disk (written by `python -m hypertrain.data prepare`, read by `data=prepared`):

    tokens.bin      little-endian uint16 or uint32 (meta "dtype"): every document followed by the eod id
    documents.bin   little-endian int64 [D + 1]: document d is tokens[starts[d] : starts[d + 1]], eod last
    tokenizer.json  the Hugging Face tokenizer (absent for the `bytes` tokenizer: ids 0..255, eod 256)
    meta.json       what the corpus is (`Meta`): vocab, eod, counts, its sources, sha256 of inputs and files,
                    the files' stamps (size, mtime_ns) as written and the largest id

`write(dir, ...)` writes the four files into an existing empty directory (atomicity is the caller's);
`read(dir)` checks the files against the meta (`verify`: a file whose stamp differs is hashed) and
memory-maps them back; `Tokenizer` encodes and decodes with the corpus's own tokenizer.
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
    # Absent from a corpus prepared before them (issue 48), which `verify` then hashes at every read:
    stamps: dict | None = None  # {file: [size, mtime_ns]} of tokens.bin and documents.bin as written
    max_id: int | None = None  # the largest id in tokens.bin

    @property
    def ids(self) -> np.dtype:
        """tokens.bin's numpy dtype (little-endian)."""
        return np.dtype("<u2" if self.dtype == "uint16" else "<u4")

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


def sha256_file(path: Path, dtype: np.dtype | None = None) -> tuple[str, int | None]:
    """The file's sha256 hex and, given the ids' `dtype`, its largest id (None when it is empty), in one
    pass: 16 MiB at a time, a multiple of every id's size."""
    digest, largest = hashlib.sha256(), None
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
            if dtype is not None:
                top = int(np.frombuffer(chunk, dtype=dtype).max())
                largest = top if largest is None else max(largest, top)
    return digest.hexdigest(), largest


def stamp(path: Path) -> list[int]:
    """[size, mtime_ns]: what a later read compares before it trusts the file's recorded sha256."""
    status = path.stat()
    return [status.st_size, status.st_mtime_ns]


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
    tokens_sha256, max_id = sha256_file(directory / TOKENS, dtype)
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
        tokens_sha256=tokens_sha256,
        documents_sha256=sha256_file(directory / DOCUMENTS)[0],
        request=request,
        stamps={name: stamp(directory / name) for name in (TOKENS, DOCUMENTS)},
        max_id=max_id,
    )
    (directory / META).write_text(json.dumps(asdict(meta), indent=1) + "\n")
    return meta


def prepare_again(directory: Path) -> str:
    """The advice for a corpus whose files are not what its meta says: prepare refuses a DIR holding
    one (it would otherwise find its request there and say nothing to do), so it goes first."""
    return (
        f"valid: the corpus as prepared: remove {directory} and prepare it again "
        f"(python -m hypertrain.data prepare INPUT ... --out {directory})"
    )


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _malformed(meta: Meta) -> str:
    """The first field of `meta` its readers could not use, in words; "" when there is none."""
    for name in ("format", "vocab", "eod", "documents", "tokens"):
        if not _whole(getattr(meta, name)):
            return f"{name}={getattr(meta, name)!r} is not a whole number >= 0"
    for name in ("tokenizer", "tokenizer_sha256", "tokens_sha256", "documents_sha256", "request"):
        if not isinstance(getattr(meta, name), str):
            return f"{name}={getattr(meta, name)!r} is not a string"
    if meta.dtype not in ("uint16", "uint32"):
        return f"dtype={meta.dtype!r} is neither uint16 nor uint32"
    if meta.max_id is not None and not _whole(meta.max_id):
        return f"max_id={meta.max_id!r} is not a whole number >= 0"
    stamps = meta.stamps if meta.stamps is not None else {}
    if not isinstance(stamps, dict) or not all(
        isinstance(v, list) and len(v) == 2 and all(_whole(x) for x in v) for v in stamps.values()
    ):
        return f"stamps={meta.stamps!r} is not {{file: [size, mtime_ns]}}"
    return ""


def read_meta(directory: Path) -> Meta:
    """The meta of the corpus in `directory`; UserError (one line) when there is none or it is not one."""
    directory = Path(directory)
    path = directory / META
    if directory.exists() and not directory.is_dir():  # CORPUS/meta.json given for CORPUS
        raise UserError(
            f"data.path={str(directory)!r} is a file, not a prepared corpus's directory; valid: the "
            f"directory `python -m hypertrain.data prepare INPUT ... --out DIR` wrote (DIR holds {META})"
        )
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"it holds {json.dumps(raw)[:40]}, not a JSON object")
        if not isinstance(raw.get("sources"), list):
            raise ValueError(f"sources={raw.get('sources')!r} is not a list")
        sources = tuple(SourceMeta(**s) for s in raw.pop("sources"))
        meta = Meta(**raw, sources=sources)
    except FileNotFoundError:
        raise UserError(
            f"data.path={str(directory)!r} holds no prepared corpus (no {META}); "
            "valid: a directory written by `python -m hypertrain.data prepare INPUT ... --out DIR`"
        ) from None
    except OSError as error:  # a directory named meta.json, no permission to read it
        raise UserError(f"{path} cannot be read ({error.strerror}); {prepare_again(directory)}") from None
    except (ValueError, TypeError, KeyError) as error:
        why = " ".join(str(error).split())
        raise UserError(
            f"{path} is not a prepared corpus's meta ({why}); {prepare_again(directory)}"
        ) from None
    if why := _malformed(meta):
        raise UserError(f"{path} is not a prepared corpus's meta ({why}); {prepare_again(directory)}")
    if meta.format != FORMAT:
        raise UserError(f"{path} has format {meta.format}; valid: {FORMAT}: {prepare_again(directory)}")
    return meta


def verify(directory: Path, meta: Meta) -> int:
    """The largest id of the corpus in `directory`, once its files are the ones `meta` describes: their
    sizes, and their bytes' sha256, hashed only where the file's stamp (size, mtime_ns) is not the one
    recorded when it was written (a copy's, an edit's, a corpus's from before stamps); the largest id
    is the meta's where tokens.bin's stamp holds, else the hash's pass gives it. UserError (one line)
    for a file that differs, or an id (the eod included) at or above the vocabulary."""
    dtype = meta.ids
    files = {
        TOKENS: (meta.tokens * dtype.itemsize, meta.tokens_sha256, "tokens_sha256"),
        DOCUMENTS: ((meta.documents + 1) * 8, meta.documents_sha256, "documents_sha256"),
    }
    for name, (size, _, _) in files.items():
        path = directory / name
        have = path.stat().st_size if path.is_file() else None
        if have != size:
            held = "is missing" if have is None else f"holds {have:,} bytes"
            raise UserError(
                f"{directory}: {name} {held} where its {META} says {size:,} ({meta.tokens:,} tokens, "
                f"{meta.documents:,} documents); {prepare_again(directory)}"
            )
    largest = meta.max_id
    for name, (_, recorded, key) in files.items():
        tokens = name == TOKENS
        if (meta.stamps or {}).get(name) == stamp(directory / name) and not (tokens and largest is None):
            continue  # as it was written: its recorded sha256 (and largest id) hold
        digest, top = sha256_file(directory / name, dtype if tokens else None)
        if digest != recorded:
            raise UserError(
                f"{directory}: {name} changed after it was prepared (its sha256 is not {META}'s {key}); "
                f"{prepare_again(directory)}"
            )
        largest = top if tokens else largest
    top = meta.eod if largest is None else max(largest, meta.eod)
    if top >= meta.vocab:
        raise UserError(
            f"{directory}: {TOKENS} holds id {top}, at or above its vocab {meta.vocab} ({META}): a model of "
            f"that vocabulary has no embedding for it; {prepare_again(directory)}"
        )
    return top


def read(directory: Path) -> Corpus:
    """The corpus in `directory` (`verify`'d), tokens memory-mapped; UserError when its files disagree with
    the meta."""
    directory = Path(directory).expanduser()
    meta = read_meta(directory)
    verify(directory, meta)
    dtype = meta.ids
    tokens = np.memmap(directory / TOKENS, dtype=dtype, mode="r") if meta.tokens else np.zeros(0, dtype=dtype)
    starts = np.fromfile(directory / DOCUMENTS, dtype="<i8").astype(np.int64)
    return Corpus(meta, tokens, starts, directory)


def byte_level(tokenizer: str) -> bool:
    """A source's or corpus's `tokenizer` is UTF-8 bytes (a byte's id is its value: no tokenizer.json)."""
    return tokenizer == "bytes"


def own_tokenizer(tokenizer: str) -> bool:
    """A source's `tokenizer` is its prepared corpus's own (the one the corpus's meta names: tokenizer.json
    or bytes), not one of its own."""
    return tokenizer == "corpus"


class Tokenizer:
    """The corpus's tokenizer: `encode(text)` -> ids (no eod), `decode(ids)` -> text (the eod dropped)."""

    def __init__(self, directory: Path, meta: Meta):
        self.meta = meta
        self._hf = None
        if not byte_level(meta.tokenizer):
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
