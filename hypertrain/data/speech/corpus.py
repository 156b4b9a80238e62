"""The sentences to be spoken: readable English from the stdlib's docstrings and comments, or the user's text.

`read_source(path)` reads the text source (the stdlib's `.py` files, or a glob's files) with a sha256
of their names and contents; `sentences(source, max_words)` gives its distinct prose sentences in
source order (docs/audio.md, "sentences" and "Your own text").
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MIN_WORDS = 3  # shorter pieces ("Args:", "Helper.") are headings, not sentences
MIN_LETTER_FRACTION = 0.8  # of a sentence's non-space characters; below it, it reads as code or data
_PROSE = re.compile(r"[A-Za-z0-9 .,;:'\"()!?-]+")  # the characters a kept sentence may use
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")
_COMMENT = re.compile(r"[ \t]*#(?!!)(.*)")  # a full-line comment (not a #! line)
_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|\.\. |[-=~^*+#]{3,}|:\w+:)")  # doctest, reST, rule lines


@dataclass(frozen=True)
class TextSource:
    files: list[bytes]  # the contents of each file, in sorted path order
    python: bool  # extract docstrings and comments (else: paragraphs of plain text)
    digest: str  # sha256 hex of the files' names and contents
    label: str  # e.g. "stdlib (Python 3.11.7): 1790 files, 31.5 MB"


@dataclass(frozen=True)
class Sentences:
    texts: list[str]  # the distinct sentences, in source order
    duplicates: int  # sentences dropped because an earlier one has the same text
    unparsed: int  # Python files that do not parse (the stdlib's own test data has a few)


def read_source(path: str) -> TextSource:
    """The stdlib's `.py` files (`path` empty) or the glob's files; UserError when it matches none."""
    from hypertrain.data.sources import stdlib_source, text_files_source

    source = stdlib_source() if not path else text_files_source(path)
    bounds = source.file_bounds.tolist()
    data = source.tokens.tobytes()
    files = [data[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return TextSource(files, not path or path.endswith(".py"), source.digest, source.label)


def sentences(source: TextSource, max_words: int, map_: Callable = map) -> Sentences:
    """The distinct prose sentences of `source`, in source order, none longer than `max_words` words.

    `map_` maps `file_sentences` over the files (a process pool's `map` parses them in parallel).
    """
    found: dict[str, None] = {}
    total = unparsed = 0
    count = len(source.files)
    for result in map_(file_sentences, source.files, [source.python] * count, [max_words] * count):
        if result is None:
            unparsed += 1
            continue
        total += len(result)
        found.update(dict.fromkeys(result))
    return Sentences(list(found), total - len(found), unparsed)


def file_sentences(data: bytes, python: bool, max_words: int) -> list[str] | None:
    """The prose sentences of one file, in order, repeats included; None for Python that does not parse."""
    text = data.decode("utf-8", errors="replace")
    blocks = _python_blocks(text) if python else [text]
    if blocks is None:
        return None
    return [sentence for block in blocks for sentence in _block_sentences(block, max_words)]


def _python_blocks(text: str) -> list[str] | None:
    """The docstrings (module, classes, functions; in source order) then the comment blocks; None if
    the file does not parse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old test files
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    blocks = []
    # Only statements can hold a definition: walking their bodies, not every expression node (which
    # ast.walk does), finds the same docstrings in a fifth of the time.
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                blocks.append(doc)
        for name in ("cases", "handlers", "finalbody", "orelse", "body"):
            children = getattr(node, name, None)
            if isinstance(children, list):
                pending += reversed(children)
    # Consecutive comment lines form one block; a line that is no comment, or one without words, ends it.
    block: list[str] = []
    for line in text.splitlines() + [""]:
        match = _COMMENT.match(line)
        body = match.group(1).strip() if match else ""
        if any(ch.isalpha() for ch in body):
            block.append(body)
        elif block:
            blocks.append("\n".join(block))
            block = []
    return blocks


def _block_sentences(block: str, max_words: int):
    """The prose sentences of one docstring, comment block or text file, each of <= max_words words."""
    for paragraph in re.split(r"\n\s*\n", block):
        if any(_CODE_LINE.match(line) for line in paragraph.splitlines()):
            continue  # doctests, reST directives and tables, underlines: not prose
        flat = " ".join(paragraph.split())
        for sentence in _SENTENCE_END.split(flat):
            words = sentence.split()
            if len(words) < MIN_WORDS or not _PROSE.fullmatch(sentence):
                continue
            letters = sum(ch.isalpha() for ch in sentence)
            if letters < MIN_LETTER_FRACTION * (len(sentence) - sentence.count(" ")):
                continue
            pieces = -(-len(words) // max_words)
            for part in np.array_split(np.arange(len(words)), pieces):
                if len(part) >= MIN_WORDS:
                    yield " ".join(words[part[0] : part[-1] + 1])
