"""A prepared corpus's tokenizer as Hugging Face's `AutoTokenizer.from_pretrained(out)` reads it: `save`
copies the corpus's tokenizer.json byte for byte and writes tokenizer_config.json beside it, naming the
corpus's eod as the eos token when the tokenizer has it, and no other token (none is added). A corpus of
the bytes tokenizer has no tokenizer.json: `save` writes nothing. `corpus_of(data)` is the corpus whose
tokenizer a run's data reads (None: data without one); `context_length(data)` the most tokens the model
read at once. No transformers needed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hypertrain.config import DataConfig
from hypertrain.data import corpus, data_source

CONFIG = "tokenizer_config.json"


def context_length(data: DataConfig) -> int:
    """The most tokens the model read at once in training: a window's seq_len, a document's max_len
    (a document is cut at max_len + 1 ids, the last only a target)."""
    return data.max_len if data.examples == "documents" else data.seq_len


def corpus_of(data: DataConfig) -> tuple[Path, corpus.Meta] | None:
    """The prepared corpus (its directory and meta) whose tokenizer.json the data reads; None for data
    without one (bytes: a byte's id is its value; token_bin: ids alone; a corpus of the bytes tokenizer)."""
    if data_source(data).tokenizer != "corpus":
        return None
    path = Path(data.path).expanduser()
    meta = corpus.read_meta(path)
    return None if meta.tokenizer == "bytes" else (path, meta)


def tokenizer_config(directory: Path, meta: corpus.Meta, context: int) -> dict:
    """tokenizer_config.json's fields for the corpus at `directory` (a tokenizer.json it has)."""
    import tokenizers

    eod = tokenizers.Tokenizer.from_file(str(directory / corpus.TOKENIZER)).id_to_token(meta.eod)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,  # the most tokens the model read at once in training
        # prepare encoded with encode_special_tokens: a special token's spelling inside a text is text
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,  # decode as the corpus's tokenizer decodes
    }
    # The eod is an eos only where the tokenizer spells it; one prepare added after its ids has no text.
    return config | ({"eos_token": eod} if eod is not None else {})


def save(directory: Path, meta: corpus.Meta, out: Path, context: int) -> list[str]:
    """The corpus's tokenizer written into `out` (an existing directory) as tokenizer.json and
    tokenizer_config.json; the names written ([] for a corpus of the bytes tokenizer)."""
    if meta.tokenizer == "bytes":
        return []
    shutil.copyfile(directory / corpus.TOKENIZER, out / corpus.TOKENIZER)
    config = tokenizer_config(directory, meta, context)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [corpus.TOKENIZER, CONFIG]
