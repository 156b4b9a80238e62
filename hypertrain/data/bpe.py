"""A byte-level BPE fitted with Hugging Face `tokenizers`' own trainer: the one recipe behind prepare's
`--tokenizer train:V` and the speech dataset's text channel. The same texts give the same tokenizer
(its trainer is deterministic); the special tokens take the first ids, in the order given.
"""

from __future__ import annotations

from collections.abc import Iterable


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
