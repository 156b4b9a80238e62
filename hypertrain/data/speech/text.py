"""The text channel's tokens: a byte-level BPE (Hugging Face `tokenizers`) fitted on the spoken sentences.

Ids 0 and 1 are PAD (a frame between words' tokens) and END (one per example, after its last frame);
each word is encoded with its leading space, so an example's pieces decode to " " + its sentence.
"""

from __future__ import annotations

from pathlib import Path

from hypertrain.data.bpe import byte_level_bpe

PAD, END = 0, 1
SPECIALS = ["<pad>", "<end>"]


def fit(sentences: list[str], vocab_size: int):
    """A byte-level BPE of `vocab_size` ids (specials included) fitted on `sentences`, each with its
    leading space."""
    return byte_level_bpe((" " + s for s in sentences), vocab_size, SPECIALS)


def load(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def word_tokens(tokenizer, sentences: list[list[str]]) -> list[list[list[int]]]:
    """For each sentence (a list of words), each word's token ids, the word encoded with its leading space."""
    flat = [" " + word for sentence in sentences for word in sentence]
    encoded = [e.ids for e in tokenizer.encode_batch(flat, add_special_tokens=False)]
    out, at = [], 0
    for sentence in sentences:
        out.append(encoded[at : at + len(sentence)])
        at += len(sentence)
    return out


def decode(tokenizer, ids) -> str:
    """The text of token ids, the special tokens left out."""
    return tokenizer.decode([int(i) for i in ids if int(i) >= len(SPECIALS)], skip_special_tokens=True)
