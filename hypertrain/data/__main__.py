"""`python -m hypertrain.data prepare INPUT ... --out DIR`: tokenize text into a corpus data=prepared reads.

Each INPUT is one source (docs/data.md, "Preparing a corpus"); it prints one line: what it prepared, or
that DIR already holds it. A user mistake is one line `hypertrain: error: ...`, exit 2; a full disk one
line, exit 4 (DiskFull); another failure of the filesystem one line, exit 1; nothing written in each case.
"""

from __future__ import annotations

import signal
import sys

from hypertrain.config import UserError
from hypertrain.data.command import Parser, exit_on_sigterm
from hypertrain.failures import RunFailure


def parser() -> Parser:
    made = Parser(prog="python -m hypertrain.data", description=__doc__.splitlines()[0])
    commands = made.add_subparsers(dest="command", required=True, parser_class=Parser)
    prepare = commands.add_parser(
        "prepare",
        help="tokenize text files, JSONL, Parquet/Arrow or a saved dataset into a prepared corpus",
        description="Tokenize the inputs (each one source, stored in order) into the prepared corpus DIR.",
    )
    prepare.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="a glob of text files (each file a document; ** recursive, not into symlinked folders), JSONL, "
        "Parquet, Arrow or Feather files (--field of each record a document), or a directory saved by "
        "datasets' save_to_disk",
    )
    prepare.add_argument(
        "--out", required=True, metavar="DIR", help="the corpus directory (new or empty; not a mount point)"
    )
    prepare.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (ids 0..255, eod 256; the default), PATH/tokenizer.json, DIR (a Hugging Face model "
        "directory: its tokenizer.json), or train:V (a byte-level BPE of V <= 2^24 tokens trained on the "
        "inputs)",
    )
    prepare.add_argument(
        "--field", default="text", help="the text field of JSONL, Parquet, Arrow and datasets (default: text)"
    )
    prepare.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    return made


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    from hypertrain.data.preparation.prepare import prepare, summary

    try:
        prepared = prepare(args.inputs, args.out, args.tokenizer, args.field, False if args.quiet else None)
    except UserError as error:
        print(f"hypertrain: error: {error}", file=sys.stderr)
        return 2
    except RunFailure as error:  # a full disk (DiskFull), another filesystem error: the partial corpus gone
        print(f"hypertrain: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:  # the temporary directory is gone already (prepare's own cleanup)
        print(f"hypertrain: prepare interrupted: {args.out} not written", file=sys.stderr)
        return 130
    if not args.quiet:
        print(summary(prepared, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
