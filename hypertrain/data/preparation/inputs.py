"""The inputs of `python -m hypertrain.data prepare`: each one a source of text documents, read in order.

`open_input(text, field)` expands one INPUT (a glob of text files, JSONL, Parquet or Arrow files, or a
directory saved by Hugging Face `datasets`' `save_to_disk`), checks its `field` and hashes its files;
`Reader(source, field)` yields its documents in batches, text that is not UTF-8 replaced and counted. A
bad input (an unreadable or corrupt file, a file named by two inputs) is one line (UserError).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import os
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hypertrain.config import UserError
from hypertrain.data.sources import expand_glob

TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # text and JSONL files read through them
# What a truncated or corrupt compressed file raises as it is read: EOFError (cut short), OSError (gzip's
# BadGzipFile, bz2's invalid stream), LZMAError, zlib.error (gzip's corrupt deflate data).
DECOMPRESSION_ERRORS = (EOFError, OSError, lzma.LZMAError, zlib.error)
SURROGATES = re.compile("[\ud800-\udfff]")  # half an UTF-16 pair: JSON can spell it, UTF-8 cannot
DATASET_FILES = ("state.json", "dataset_info.json")  # what save_to_disk writes beside its .arrow files
DATASET_DICT = "dataset_dict.json"  # what a DatasetDict's save_to_disk writes beside its splits' folders
BATCH_CHARS = 1 << 22  # characters per batch of documents: big enough for encode_batch's threads
_HASH_CHUNK = 1 << 24
VALID_INPUT = (
    "a glob of text files ('docs/**/*.txt'), JSONL ('*.jsonl'), Parquet or Arrow files "
    "('*.parquet', '*.arrow', '*.feather'), or a directory saved with datasets' save_to_disk"
)


@dataclass(frozen=True)
class Input:
    name: str  # the INPUT as given
    entries: tuple[tuple[str, str], ...]  # (name, path) of its files in order; a dataset's all files
    dataset: str | None  # the save_to_disk directory, else None
    sha256: str  # of its files' names and bytes, in order


def open_input(text: str, field: str, skipped: tuple[Path, ...] = ()) -> Input:
    """The input `text` names, its `field` checked where its documents are records; UserError when it
    matches nothing or has no such field. Files under a folder of `skipped` (prepare's own output)
    are not part of it."""
    if not text:
        raise UserError(f"input '' is empty (an unset shell variable?); valid: {VALID_INPUT}")
    path = Path(text).expanduser()
    if path.is_dir():
        saved = all((path / name).is_file() for name in DATASET_FILES) or (path / DATASET_DICT).is_file()
        if not saved:
            raise UserError(
                f"input {text!r} is a directory but not a dataset saved with datasets' save_to_disk "
                f"(no {' and '.join(DATASET_FILES)}); valid: {VALID_INPUT}, "
                f"e.g. '{text.rstrip('/')}/**/*.txt'"
            )
        files = sorted(p for p in path.rglob("*") if p.is_file())
        entries, dataset = tuple((p.relative_to(path).as_posix(), str(p)) for p in files), str(path)
    else:
        entries, dataset = tuple(expand_glob(text, skipped)), None
        if not entries:
            raise UserError(f"input {text!r} matches no files; valid: {VALID_INPUT}")
    source = Input(text, entries, dataset, digest(entries))
    check_field(source, field)
    return source


def digest(entries: tuple[tuple[str, str], ...]) -> str:
    """sha256 hex of the files' names and bytes in order (sources.read_files' scheme, streamed);
    UserError naming a file that cannot be read."""
    hashed = hashlib.sha256()
    for name, path in entries:
        try:
            hashed.update(os.fsencode(name) + b"\0" + str(os.path.getsize(path)).encode() + b"\0")
            with open(path, "rb") as file:
                while chunk := file.read(_HASH_CHUNK):
                    hashed.update(chunk)
        except OSError as error:
            said = f"input file {path!r} cannot be read ({error.strerror})"
            raise UserError(f"{said}; valid: {VALID_INPUT}") from None
    return hashed.hexdigest()


def check_disjoint(sources: Sequence[Input]) -> None:
    """UserError when two inputs name one file (by its real path): its documents would be in the corpus
    twice, and a held-out copy of a training document measures nothing."""
    owner: dict[str, str] = {}
    for source in sources:
        for _, path in source.entries:
            first = owner.setdefault(os.path.realpath(path), source.name)
            if first != source.name:
                raise UserError(
                    f"input {source.name!r} names {path}, which input {first!r} names too; "
                    "valid: inputs that name each file once"
                )


def kind_of(path: str) -> str:
    """How a file's documents are read: "jsonl", "parquet", "arrow" or "text" (one document a file), by
    its suffix (the one before .gz, .bz2 or .xz)."""
    name = Path(path)
    suffix = name.suffix.lower()
    if suffix in COMPRESSED:
        suffix = name.with_suffix("").suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "arrow" if suffix in TABLE_SUFFIXES else "text"


def check_field(source: Input, field: str) -> None:
    """UserError naming the fields that exist when a record input's first record lacks `field`."""
    if source.dataset is not None:
        names, where = load_dataset(source.dataset).column_names, f"input {source.name!r}"
    else:
        records = (path for _, path in source.entries if kind_of(path) != "text")
        named = ((path, field_names(path)) for path in records)
        where, names = next(((path, names) for path, names in named if names is not None), (None, None))
        if names is None:  # no record: an empty source, refused once its documents are counted
            return
    if field not in names:
        raise UserError(
            f"--field {field!r} is not a field of {where}; valid: one of {sorted(names)} (--field NAME)"
        )


def field_names(path: str) -> list[str] | None:
    """The fields of a record file: the keys of a JSONL file's first record (None: it has none), a
    table's columns."""
    if kind_of(path) == "jsonl":
        with open_text(path) as file:
            for number, line in enumerate(file, 1):
                if line.strip():
                    return list(json_record(line.decode("utf-8", errors="replace"), path, number))
        return None
    return list(table_schema(path).names)


@contextmanager
def open_text(path: str) -> Iterator:
    """A text or JSONL file opened for reading bytes, decompressed when its suffix says so; UserError
    when a compressed file turns out truncated or corrupt as it is read."""
    opener = COMPRESSED.get(Path(path).suffix.lower())
    if opener is None:
        with open(path, "rb") as file:
            yield file
        return
    try:
        with opener(path, "rb") as file:
            yield file
    except DECOMPRESSION_ERRORS as error:
        said = str(error) or type(error).__name__
        raise UserError(
            f"input file {path!r} cannot be decompressed ({said}); valid: a whole {Path(path).suffix} file "
            "(or the file without the suffix, uncompressed)"
        ) from None


def json_record(line: str, path: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UserError(f"{path}:{number} is not JSON ({error}); valid: one JSON object a line") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}:{number} is a JSON {type(record).__name__}; valid: one JSON object a line")
    return record


def pyarrow():
    """pyarrow, imported when an input needs it; UserError naming the extra when it is missing."""
    try:
        import pyarrow
        import pyarrow.feather
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise UserError(
            "Parquet, Arrow and save_to_disk inputs need pyarrow and datasets, which are not installed; "
            "valid: pip install 'hypertrain[data]'"
        ) from None
    return pyarrow


def table_schema(path: str):
    pa = pyarrow()
    try:
        if kind_of(path) == "parquet":
            return pa.parquet.ParquetFile(path).schema_arrow
        return arrow_table(path).schema
    except (pa.ArrowException, OSError) as error:
        raise UserError(f"input {path!r} cannot be read ({error}); valid: {VALID_INPUT}") from None


def arrow_table(path: str):
    """An Arrow file memory-mapped: IPC file format (.arrow, Feather v2) or IPC stream (datasets' .arrow)."""
    pa = pyarrow()
    if Path(path).suffix.lower() == ".feather":
        return pa.feather.read_table(path, memory_map=True)
    try:
        return pa.ipc.open_file(pa.memory_map(path)).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.memory_map(path)).read_all()


def load_dataset(directory: str):
    """A save_to_disk dataset (memory-mapped, nothing cached: `hf_home` set where prepare runs)."""
    pyarrow()
    import datasets

    try:
        loaded = datasets.load_from_disk(directory)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise UserError(f"input {directory!r} cannot be loaded ({error}); valid: {VALID_INPUT}") from None
    if isinstance(loaded, datasets.DatasetDict):
        raise UserError(
            f"input {directory!r} is a DatasetDict of splits {list(loaded)}; valid: one split's directory, "
            f"e.g. '{directory.rstrip('/')}/{next(iter(loaded), 'train')}'"
        )
    return loaded


class Reader:
    """The documents of `source` in batches of about BATCH_CHARS characters, in order; `undecodable`
    counts the documents (a JSONL record: its line) whose text was not UTF-8, bad bytes or a JSON
    string's lone surrogate, each replaced by U+FFFD; `on_bytes(n)` is called as the input's bytes are
    read (a progress bar's update)."""

    def __init__(self, source: Input, field: str, on_bytes: Callable[[int], None] = lambda n: None):
        self.source, self.field, self.on_bytes = source, field, on_bytes
        self.undecodable = 0

    def __iter__(self) -> Iterator[list[str]]:
        batch, chars = [], 0
        for document in self.documents():
            batch.append(document)
            chars += len(document)
            if chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
        if batch:
            yield batch

    def documents(self) -> Iterator[str]:
        if self.source.dataset is not None:
            yield from self.dataset_documents()
            return
        for _, path in self.source.entries:
            kind = kind_of(path)
            if kind == "text":
                with open_text(path) as file:
                    data = file.read()
                yield self.decode(data)
                self.on_bytes(len(data))
            elif kind == "jsonl":
                yield from self.jsonl_documents(path)
            else:
                yield from self.table_documents(path)

    def decode(self, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            self.undecodable += 1
            return data.decode("utf-8", errors="replace")

    def jsonl_documents(self, path: str) -> Iterator[str]:
        with open_text(path) as file:
            for number, line in enumerate(file, 1):
                self.on_bytes(len(line))
                if not line.strip():
                    continue
                counted = self.undecodable
                record = json_record(self.decode(line), path, number)
                if self.field not in record:
                    raise UserError(
                        f"{path}:{number} has no field {self.field!r}; valid: every record with it "
                        f"(this one has {sorted(record)})"
                    )
                text = self.text(record[self.field], f"{path}:{number}")
                self.undecodable = min(self.undecodable, counted + 1)  # bad bytes and a surrogate: once
                yield text

    def table_documents(self, path: str) -> Iterator[str]:
        if kind_of(path) == "parquet":
            parquet = pyarrow().parquet.ParquetFile(path)
            if self.field not in parquet.schema_arrow.names:
                raise UserError(
                    f"--field {self.field!r} is not a column of {path}; "
                    f"valid: one of {sorted(parquet.schema_arrow.names)}"
                )
            batches, rows = parquet.iter_batches(columns=[self.field]), parquet.metadata.num_rows
        else:
            table = arrow_table(path)
            if self.field not in table.schema.names:
                raise UserError(
                    f"--field {self.field!r} is not a column of {path}; "
                    f"valid: one of {sorted(table.schema.names)}"
                )
            batches, rows = table.select([self.field]).to_batches(), table.num_rows
        size, first = os.path.getsize(path), 0
        for batch in batches:
            yield from self.column_texts(batch.column(0).to_pylist(), path, first)
            self.on_bytes(size * batch.num_rows // max(rows, 1))
            first += batch.num_rows

    def dataset_documents(self) -> Iterator[str]:
        dataset = load_dataset(self.source.dataset).select_columns([self.field]).with_format("arrow")
        size, first = sum(os.path.getsize(p) for _, p in self.source.entries), 0
        for table in dataset.iter(batch_size=8192):
            yield from self.column_texts(table.column(0).to_pylist(), self.source.name, first)
            self.on_bytes(size * table.num_rows // max(len(dataset), 1))
            first += table.num_rows

    def column_texts(self, values: list, where: str, first: int) -> Iterator[str]:
        """The texts of a column's `values`, rows `first`, `first` + 1, ... of `where`."""
        for row, value in enumerate(values, first):
            yield self.text(value, f"{where} row {row}")

    def text(self, value, where: str) -> str:
        if isinstance(value, str):
            if value.isascii() or not SURROGATES.search(value):
                return value
            self.undecodable += 1
            return SURROGATES.sub("\ufffd", value)
        if isinstance(value, bytes):
            return self.decode(value)
        raise UserError(
            f"{where}: field {self.field!r} holds {type(value).__name__} {str(value)[:40]!r}, not text; "
            "valid: a string in every record (--field names the text)"
        )
