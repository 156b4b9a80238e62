"""What the study scripts (experiments/*_study.py) share: their command line, an output folder, `--dry-run`
(print the commands, run nothing) and more overrides for every run; a script adds its own options and
reads them with `parse_intermixed_args` (overrides may follow an option)."""

from __future__ import annotations

import argparse
from pathlib import Path


def study_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a study whose module docstring is `doc` (its first paragraph the description)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder the study's runs go under")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    return parser
