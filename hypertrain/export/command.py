"""`python -m hypertrain.export RUN_DIR [--checkpoint PATH] --out DIR`: the run's global weights (weights.pt,
or a checkpoint's) written to DIR as a Hugging Face model (`save_pretrained`: config.json,
model.safetensors, generation_config.json) of the architecture its model matches (`names`), or for a
model=hf run the run's own module (`model.hf_export.write_hf`), with the data's tokenizer where it has one
(`data.hf_tokenizer`). It prints one line saying what it wrote. A mistake is one
line `hypertrain.export: error: ...`, exit 2, nothing created; a failing write one line, exit 4 (a full
disk) or 1, no partial DIR left (DIR is filled beside it and renamed into place); Ctrl-C one line, 130.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hypertrain.config import DataConfig, ModelConfig, UserError
from hypertrain.data import corpus, data_source, hf_tokenizer
from hypertrain.data.hf_tokenizer import context_length
from hypertrain.data.preparation.outdir import first_existing, first_missing, remove_made
from hypertrain.errors import Parser
from hypertrain.export.names import Architecture, architecture, hf_weights
from hypertrain.failures import DiskFull, RunFailure
from hypertrain.failures.signals import EXIT_CODES, ctrl_c_after_imports, interrupted
from hypertrain.model.spec import model_spec
from hypertrain.sample import load_weights, read_run, trained_with

PROG = "hypertrain.export"
ERROR = f"{PROG}: error:"  # every mistake's one line starts so
USAGE = "valid: RUN_DIR [--checkpoint PATH] --out DIR"
EXTRA = "pip install -e '.[hf]' (transformers)"


@dataclass
class Args:
    run_dir: Path
    out: Path
    checkpoint: Path | None = None


def parse(argv: list[str]) -> Args:
    """The command line, each value checked; UserError (one line) naming the first bad one."""
    parser = Parser(
        prog=f"python -m {PROG}", allow_abbrev=False, description=__doc__.split("\n\n")[0], valid=USAGE
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory")
    parser.add_argument("--checkpoint", help="a checkpoint file of the run, in place of weights.pt")
    given = parser.parse_args(argv)
    for flag, value in (("RUN_DIR", given.run_dir), ("--out", given.out), ("--checkpoint", given.checkpoint)):
        if value == "":  # an unset shell variable: Path("") would be the working directory
            raise UserError(f"{flag}='' is not valid; {USAGE}")
    chosen = None if given.checkpoint is None else Path(given.checkpoint)
    return Args(Path(given.run_dir), Path(given.out), chosen)


def check_out(out: Path) -> None:
    """UserError unless `out` can become the model directory: new, or an empty directory, under a
    directory this user can write in."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"--out {str(out)!r} exists and is not an empty directory; valid: a new or empty one")
    above = first_existing(out.parent)
    if not above.is_dir():
        raise UserError(
            f"--out {str(out)!r} lies under {above}, which is a file; valid: a path under a directory"
        )
    if not os.access(above, os.W_OK | os.X_OK):
        raise UserError(
            f"--out {str(out)!r}: {above} cannot be written; valid: a directory this user can write in"
        )


def tokenizer_of(
    model: ModelConfig, data: DataConfig, run_dir: Path, facts: dict
) -> tuple[Path, corpus.Meta] | None:
    """The prepared corpus whose tokenizer the run trained with (its directory and meta), None for data
    without a tokenizer.json (bytes: a byte's id is its value; token_bin: ids alone). UserError when the
    corpus is gone or holds another tokenizer now."""
    found = hf_tokenizer.corpus_of(data)
    if found is None:
        return None
    path, meta = found
    if not (path / corpus.TOKENIZER).is_file():
        raise UserError(f"data.path={str(path)!r} has no {corpus.TOKENIZER}; {corpus.prepare_again(path)}")
    trained_with(path, meta, model, facts, run_dir)
    return path, meta


def hf_model(arch: Architecture, model: ModelConfig, theta: dict, context: int, eod: int | None):
    """The transformers module of `arch` holding `theta` (fp32, every parameter loaded: strict)."""
    try:
        with ctrl_c_after_imports():
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UserError(f"exporting needs transformers, which is not installed; valid: {EXTRA}") from None
    # No bos, pad or eos the data does not have (the transformers defaults are Llama's ids 1 and 2).
    ids = {"bos_token_id": None, "pad_token_id": None, "eos_token_id": eod}
    fields = arch.fields(model) | ids | {"max_position_embeddings": context}
    config = AutoConfig.for_model(arch.model_type, **fields, dtype="float32")
    from transformers.utils import logging

    logging.disable_progress_bar()  # the command's output is its one line
    with torch.random.fork_rng(devices=[]):  # its own init draws from the global RNG, then is overwritten
        module = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    module.load_state_dict(hf_weights(model, theta), strict=True)
    return module.eval()


def write_atomically(out: Path, fill: Callable[[Path], None]) -> None:
    """`fill(partial)` on a fresh directory beside `out`, then renamed onto `out` (replacing it where it
    is an empty directory). On any way out but success the partial directory and the folders made for
    it go; a filesystem that refuses to make it: UserError (DiskFull when full); one failing in `fill`:
    DiskFull (exit 4) when full, else RunFailure (exit 1); a UserError of `fill` as it is."""
    made, partial = first_missing(out.parent), None
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            # named before it is made (not mkdtemp, which makes it before returning its name: a Ctrl-C
            # there left it behind, seen once under load), so the `finally` below always finds it; the
            # mode the umask's, as DIR's will be once renamed
            partial = out.parent / f".{out.name}.partial-{secrets.token_hex(8)}"
            os.mkdir(partial, 0o777)
        except OSError as error:
            if error.errno == errno.EEXIST:  # another's (a 64-bit name drawn twice): never removed here
                partial = None
            if error.errno == errno.ENOSPC:
                raise DiskFull(
                    f"no space left on the device for --out {str(out)!r}; nothing was written"
                ) from None
            raise UserError(
                f"--out {str(out)!r}: nothing can be created in {first_existing(out.parent)} "
                f"({error.strerror}); valid: a new or empty directory where this user can write"
            ) from None
        try:
            fill(partial)
            os.rename(partial, out)
        except UserError:
            raise
        except Exception as error:  # an OSError, or safetensors' own error around one
            raise _write_failure(out, error) from None
        partial = None
    finally:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
            remove_made(out.parent, made)


def _write_failure(out: Path, error: Exception) -> RunFailure:
    said = (error.strerror if isinstance(error, OSError) else None) or " ".join(str(error).split())[:200]
    where = f" ({error.filename})" if isinstance(error, OSError) and error.filename else ""
    full = getattr(error, "errno", None) == errno.ENOSPC or "StorageFull" in str(error)
    if full:
        return DiskFull(f"no space left on the device writing --out {str(out)!r}{where}; nothing was written")
    return RunFailure(f"export to --out {str(out)!r} failed: {said}{where}; nothing was written")


def export(args: Args) -> str:
    """`args.out` written; the line saying what it holds. Everything is checked and read before it is made."""
    check_out(args.out)
    model, data, run_ids, facts = read_run(args.run_dir)
    external = model_spec(model).external  # model=hf: the run's own module, its own config
    arch = None if external else architecture(model)
    tokenizer = tokenizer_of(model, data, args.run_dir, facts)
    theta, where = load_weights(args, model, run_ids)
    eod = tokenizer[1].eod if tokenizer else None

    def fill(partial: Path) -> None:  # the place is claimed first: refused before transformers loads
        if external:
            with ctrl_c_after_imports():
                from hypertrain.model.hf_export import write_hf

            write_hf(model, theta, partial)
        else:
            hf_model(arch, model, theta, context_length(data), eod).save_pretrained(partial)
        if tokenizer:
            hf_tokenizer.save(*tokenizer, partial, context_length(data))

    write_atomically(args.out, fill)
    if tokenizer:
        said = f"tokenizer.json and {hf_tokenizer.CONFIG} of {tokenizer[0]}"
    elif corpus.byte_level(ids := data_source(data).tokenizer) or corpus.own_tokenizer(ids):  # a bytes corpus
        said = "no tokenizer (byte-level data: a byte's id is its value)"
    else:
        said = f"no tokenizer (data={data.name}'s ids have none)"
    count = sum(t.numel() for t in theta.values())
    if external:
        from hypertrain.model.hf import base

    name = type(base(model)).__name__ if external else arch.class_name
    return f"{PROG}: wrote {args.out}: {name} ({count:,} parameters) from {where}; {said}"


def cli(argv: list[str] | None = None) -> int:
    """`python -m hypertrain.export ARGV` as a function: its exit code (0; 2 for a mistake, its one line
    on stderr; 4 or 1 for a failing write; Ctrl-C 130, one line), nothing left but a whole DIR."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        line = export(parse(argv))
    except UserError as e:
        print(f"{ERROR} {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    except RunFailure as e:
        print(f"{ERROR} {' '.join(str(e).splitlines())}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(interrupted(PROG), file=sys.stderr)
        return EXIT_CODES[signal.SIGINT]
    print(line)
    return 0
