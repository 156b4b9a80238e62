"""`python -m hypertrain.data.speech build [field=value ...]`: build the speech dataset data=speech reads.

Fields are DataConfig's (`codebooks=8` or `data.codebooks=8`; docs/audio.md, "The cache"); it prints
what it built or found ("The default build, measured"). A user mistake or a missing tool is one line
`hypertrain: error: ...`, exit 2.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import fields

from hypertrain.choices import choice_error
from hypertrain.config import DataConfig, UserError
from hypertrain.data.command import Parser, exit_on_sigterm


def parse_config(assignments: list[str]) -> DataConfig:
    """A speech DataConfig from `field=value` strings, each value converted to its field's type."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    names = {f.name for f in fields(DataConfig)}
    values = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        key = key.removeprefix("data.")
        if not sep or key not in names:
            valid = "field=value with a field of DataConfig, e.g. codebooks=8"
            raise UserError(f"{item!r} is not a data field assignment; valid: {valid}")
        values[key] = value  # the text as given ("" stays ""); OmegaConf converts it to the field's type
    merged = OmegaConf.structured(DataConfig(name="speech"))
    for key, value in values.items():
        try:
            merged = OmegaConf.merge(merged, {key: value})
        except OmegaConfBaseException as error:
            said = choice_error(error, "data.") or f"data.{key}={value!r}: {str(error).splitlines()[0]}"
            raise UserError(said) from None
    cfg = OmegaConf.to_object(merged)
    if cfg.name != "speech":
        raise UserError(f"name={cfg.name!r}: this command builds speech data only; valid: name=speech")
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m hypertrain.data.speech", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build"])
    parser.add_argument("fields", nargs="*", help="DataConfig fields, e.g. codebooks=8 speech_sentences=500")
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no summary, and a user mistake's line on stdout (for a caller that reports it: training)",
    )
    args = parser.parse_intermixed_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        from hypertrain.data.speech import build, cache

        cfg = parse_config(args.fields)
        recipe = cache.recipe(cfg)
        with cache.build_lock(recipe.directory):
            if cache.is_built(recipe.directory):
                manifest, found = build.read_manifest(recipe.directory), "already built"
            else:
                manifest, found = build.build(recipe, recipe.directory), "built"
    except UserError as error:
        print(f"hypertrain: error: {error}", file=sys.stdout if args.quiet else sys.stderr)
        return 2
    if not args.quiet:
        print(f"{found}: " + build.summary(manifest, recipe.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
