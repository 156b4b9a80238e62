"""The data: token windows and documents from text sources, speech, and the batches an update trains
on. `SOURCES` is the table of the `data=` choices (conf/data/): each entry says what the rest of the
code asks of its data (checks, vocabulary, tokenizer, channels, example lengths) and builds it, so no
data source's name is compared outside this package. An entry may also live outside the package:
data.name=module.NAME names a `DataSource` by its import path (docs/extending.md, "A data source"),
imported once per process. Light: the builders are imported when called.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from hypertrain.config import DataConfig, UserError
from hypertrain.import_path import entry_at, is_import_path

if TYPE_CHECKING:
    from hypertrain.data.datasets import Dataset
    from hypertrain.data.sources import Source

BYTE_VOCAB = 256  # byte-level text: a token is a byte of UTF-8


@dataclass(frozen=True)
class DataSource:
    """A text source whose examples are one channel of tokens, windows or documents (`data.examples`),
    read by `text.text_dataset`. Subclasses override what their data does differently."""

    name: str
    path: str = ""  # what a required data.path names, for its refusal; "" = data.path is optional
    tokenizer: str = ""  # how `sample` reads ids as text: "bytes" (UTF-8), "corpus" (the prepared
    # corpus's tokenizer.json), "" (none: the ids alone)
    windows_only: bool = False  # data.examples=documents needs documents this source does not mark

    channels: ClassVar[str] = "text"  # what an example's token channels hold, for messages
    channel_fields: ClassVar[tuple[str, ...]] = ()  # the data fields that size a multistream model's channels
    own_vocab: ClassVar[bool] = False  # the model's vocabulary is the data's own (model.vocab 0 or equal)
    # a prepared corpus's documents and sources: data.replica_split and data.window_across_documents apply
    documents: ClassVar[bool] = False

    @property
    def multistream(self) -> bool:
        """Examples are [C, L], several token channels per position (`datasets.MultistreamDataset`)."""
        return bool(self.channel_fields)

    def check(self, d: DataConfig) -> None:
        """What this source needs of the data fields, before anything is built; UserError (one line)."""
        if self.path and not d.path:
            raise UserError(f"data.path is empty; data={self.name} needs {self.path}")
        # the prepared corpus's options would silently do nothing with any other data
        if not self.documents and d.replica_split != "iid":
            raise UserError(
                f"data.replica_split={d.replica_split} needs a prepared corpus's sources, not "
                f"data={self.name}; valid: data={_names(documents=True)}, or data.replica_split=iid"
            )
        if not self.documents and not d.window_across_documents:
            raise UserError(
                f"data.window_across_documents=false needs a prepared corpus's documents, not "
                f"data={self.name}; valid: data={_names(documents=True)}, "
                "or data.window_across_documents=true"
            )
        if self.windows_only and d.examples != "windows":
            raise UserError(f"data.examples='documents' needs text; data={self.name} gives windows only")

    def build(self, d: DataConfig) -> Dataset:
        """The dataset `d` describes (`d` is checked (`validate`)); UserError (one line) for a
        missing or too short source."""
        from hypertrain.data.text import text_dataset

        return text_dataset(d, self)

    def read(self, d: DataConfig) -> Source:
        """The token stream `text.text_dataset` cuts into windows or documents (`sources.Source`: its
        tokens, where each file starts, a digest of what was read, a label); UserError (one line) for a
        source that cannot be read. An entry from outside the package overrides it."""
        import hypertrain.data.sources as sources

        if self.name == "stdlib":
            return sources.stdlib_source()
        if self.name == "text_files":
            return sources.text_files_source(d.path)
        assert d.examples == "windows", "token_bin gives windows only (its entry's check)"
        return sources.token_bin_source(d.path, d.token_dtype)

    def vocab(self, d: DataConfig) -> int:
        """The vocabulary the memory estimate reckons with where model.vocab is 0, before the data is
        built (a token file's largest id is read by the build; bytes' until then)."""
        return BYTE_VOCAB

    def channel_vocabs(self, d: DataConfig) -> list[int]:
        """Each channel's vocabulary as the data fills a multistream model's in ([] for one channel)."""
        return []

    def channels_said(self, d: DataConfig) -> str:
        """How many token channels an example has, for a refusal."""
        return "1 token channel per position"

    def variable_length(self, d: DataConfig) -> bool:
        """Examples have lengths of their own (a microbatch is bounded by data.max_padded_tokens), not
        fixed windows of data.seq_len + 1 ids."""
        return d.examples == "documents"

    def longest(self, d: DataConfig) -> int | None:
        """The longest example in ids that the config allows; None where the config sets no bound."""
        return d.seq_len + 1 if d.examples == "windows" else d.max_len + 1

    def length_fields(self, d: DataConfig) -> list[str]:
        """The data fields that bound an example's length."""
        return ["data.seq_len"] if d.examples == "windows" else ["data.max_len"]


@dataclass(frozen=True)
class PreparedSource(DataSource):
    """A corpus `python -m hypertrain.data prepare` wrote (docs/data.md): its own tokenizer and
    vocabulary, documents and sources."""

    own_vocab = True
    documents = True

    def build(self, d: DataConfig) -> Dataset:
        from hypertrain.data.prepared import prepared_dataset

        return prepared_dataset(d)

    def vocab(self, d: DataConfig) -> int:
        from hypertrain.data.corpus import read_meta

        return read_meta(Path(d.path).expanduser()).vocab


@dataclass(frozen=True)
class SpeechSource(DataSource):
    """Multistream speech from a built cache (docs/audio.md): per frame a text token and
    data.codebooks audio codes; utterances of their own lengths, whatever data.examples says."""

    channels = "text and audio"
    channel_fields = ("data.text_vocab", "data.codebook_size", "data.codebooks")

    def check(self, d: DataConfig) -> None:
        d.check_speech()
        super().check(d)

    def build(self, d: DataConfig) -> Dataset:
        from hypertrain.data.speech.dataset import speech_dataset

        return speech_dataset(d)

    def channel_vocabs(self, d: DataConfig) -> list[int]:
        return [d.text_vocab] + [d.codebook_size] * d.codebooks

    def channels_said(self, d: DataConfig) -> str:
        return f"1 + data.codebooks = {1 + d.codebooks} token channels per frame"

    def variable_length(self, d: DataConfig) -> bool:
        return True

    def longest(self, d: DataConfig) -> int | None:
        return None

    def length_fields(self, d: DataConfig) -> list[str]:
        return []


SOURCES: dict[str, DataSource] = {
    source.name: source
    for source in (
        DataSource("stdlib", tokenizer="bytes"),  # the embedded default: this Python's stdlib .py files
        DataSource("text_files", path="a path (a glob or a file)", tokenizer="bytes"),
        DataSource("token_bin", path="a path (a glob or a file)", windows_only=True),
        PreparedSource(
            "prepared", path="a corpus's directory (python -m hypertrain.data prepare)", tokenizer="corpus"
        ),
        SpeechSource("speech"),
    )
}


IMPORTED = "the import path (module.NAME) of a hypertrain.data.DataSource entry"


def data_source(d: DataConfig) -> DataSource:
    """The entry of `d.name`: the table's entry of that name, or the entry at the import path `d.name` (a
    dot in it; `imported`); UserError (one line) for neither."""
    entry = SOURCES.get(str(d.name))
    if entry is not None:
        return entry
    if is_import_path(d.name):
        return imported(str(d.name))
    valid = f"{', '.join(SOURCES)} (data=NAME), or {IMPORTED}"
    raise UserError(f"data.name={str(d.name)!r} is not a data source; valid: {valid}")


@functools.cache
def imported(path: str) -> DataSource:
    """The `DataSource` at the import path `path` (module.NAME), its `name` made `path` (what the config
    and messages say); UserError (one line) when the path does not import or names no `DataSource`."""
    entry = entry_at("data.name", path, DataSource, "a data source", IMPORTED, UserError)
    return dataclasses.replace(entry, name=path)


def _names(**capabilities) -> str:
    """The sources with these capabilities, as a message lists them ("a, b or c")."""
    names = [n for n, s in SOURCES.items() if all(getattr(s, k) == v for k, v in capabilities.items())]
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def build_dataset(cfg: DataConfig) -> Dataset:
    """The dataset `cfg` describes (its entry's `build`); UserError (one line) for a missing or too short
    source."""
    return data_source(cfg).build(cfg)
