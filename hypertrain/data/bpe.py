"""A byte-level BPE fitted with Hugging Face `tokenizers`' own trainer: the one recipe behind prepare's
`--tokenizer train:V` and the speech dataset's text channel. The same texts give the same tokenizer
(its trainer is deterministic); the special tokens take the first ids, in the order given. Such a
tokenizer encodes a long text in pieces (`pieces`, `cuts_keep_tokens`) to the same ids as whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

# Where a text may be cut without changing its byte-level tokens: just after a word character, before
# a space or a newline. The ByteLevel pre-tokenizer splits a text with GPT-2's regex
#     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# and the model tokenizes each part alone. At such a place p the part holding the word character ends
# (none of its alternatives reaches past a non-space into whitespace) and the next part starts, read
# from p on (no alternative looks behind); the parts before p are found alike in text[:p] (the one
# ending at p stops there as it stops at the whitespace; a lookahead never sees past p, text[p - 1]
# not being whitespace). So the parts, hence the ids, of text[:p] and text[p:] are those of the text.
_CUT = re.compile(r"\w(?=[ \n])")  # Python's \w (letters, digits, "_") is never whitespace in the regex


def pieces(text: str, size: int) -> list[str]:
    """`text` cut, at the places of _CUT, into pieces of `size` // 2 to about `size` characters; a
    stretch with no such place (a long line of symbols) stays in one longer piece."""
    cuts, start = [], 0
    while len(text) - start > size:
        found = _CUT.search(text, start + size // 2, start + size) or _CUT.search(text, start + size)
        if found is None:
            break
        start = found.end()
        cuts.append(start)
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def cuts_keep_tokens(tokenizer) -> bool:
    """Whether `tokenizer` (a tokenizers.Tokenizer, its special tokens' spellings encoded as text) gives
    a text's ids as its pieces' ids joined: no normalizer, the ByteLevel pre-tokenizer alone with its
    regex and no prefix space (each piece would get one), and no added token but special ones (one
    could be matched across a cut). The tokenizers this module trains are such."""
    spec = json.loads(tokenizer.to_str())
    split = spec.get("pre_tokenizer") or {}
    return (
        spec.get("normalizer") is None
        and split.get("type") == "ByteLevel"
        and split.get("use_regex", True)
        and split.get("add_prefix_space") is False
        and all(added.get("special") for added in spec.get("added_tokens") or [])
    )


def byte_level_bpe(texts: Iterable[str], vocab_size: int, specials: list[str]):
    """A `tokenizers.Tokenizer`: BPE of at most `vocab_size` ids (specials included) fitted on `texts`,
    with the ByteLevel pre-tokenizer (no prefix space) and decoder and the whole byte alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer
