"""`python -m hypertrain.sample RUN_DIR --prompt TEXT [--tokens N] [--temperature T] [--seed S]
[--checkpoint PATH]`: the prompt and its continuation by a run's global weights (weights.pt, or one of
its checkpoints), decoded with the run's tokenizer, on stdout; greedy at temperature 0, else sampled
with a generator seeded by --seed, so a command prints the same text each time. It writes nothing;
a mistake is one line `hypertrain.sample: error: ...`, exit 2 (docs/errors.md); Ctrl-C one line, 130.
"""

from __future__ import annotations

if __name__ == "__main__":  # first of all: a Ctrl-C during the imports below is the one line too
    from hypertrain.failures.signals import guard_command

    guard_command("hypertrain.sample")

import hashlib
import math
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hypertrain.config import DataConfig, ModelConfig, UserError
from hypertrain.data import BYTE_VOCAB, SOURCES, corpus, data_source
from hypertrain.data.hf_tokenizer import context_length
from hypertrain.errors import Parser
from hypertrain.failures.signals import EXIT_CODES, ctrl_c_after_imports, interrupted
from hypertrain.model.shapes import param_shapes
from hypertrain.model.spec import model_spec
from hypertrain.records import formats
from hypertrain.records.rows import StartRow
from hypertrain.report.command import print_out
from hypertrain.report.runs import ReportInputError, load_run
from hypertrain.rundir import checkpoint

PROG = "hypertrain.sample"
ERROR = f"{PROG}: error:"  # every mistake's one line starts so
USAGE = "valid: RUN_DIR --prompt TEXT [--tokens N] [--temperature T] [--seed S] [--checkpoint PATH]"
CONFIG, WEIGHTS = "config.yaml", "weights.pt"
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's non-negative range


@dataclass
class Args:
    run_dir: Path
    prompt: str
    tokens: int = 200
    temperature: float = 0.0
    seed: int = 0
    checkpoint: Path | None = None


@dataclass
class TextCodec:
    """How a run's text becomes ids and back: `vocab` ids can be text (the model's other ids, if any,
    are never sampled); `eod` ends a document (None: the data has none)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    vocab: int
    eod: int | None = None


def parse(argv: list[str]) -> Args:
    """The command line, each value checked; UserError (one line) naming the first bad one."""
    parser = Parser(
        prog=f"python -m {PROG}", allow_abbrev=False, description=__doc__.split("\n\n")[0], valid=USAGE
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--prompt", required=True, help="the text to continue (not empty)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to add, at least 1 (default 200)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: softmax(logits / T)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (default 0)")
    parser.add_argument("--checkpoint", help="a checkpoint file of the run, in place of weights.pt")
    given = parser.parse_args(argv)
    if not given.run_dir:  # an unset shell variable: Path("") would be the working directory
        raise UserError(f"RUN_DIR='' is not valid; {USAGE}")
    if not given.prompt:
        raise UserError("--prompt='' is empty; valid: some text for the model to continue")
    try:  # bytes that are no UTF-8 reach argv as lone surrogates, which no tokenizer reads
        given.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(
            f"--prompt={given.prompt!r} holds bytes that are not UTF-8; valid: UTF-8 text"
        ) from None
    if given.tokens < 1:
        raise UserError(f"--tokens={given.tokens} is too small; valid: a whole number >= 1")
    if not (math.isfinite(given.temperature) and given.temperature >= 0):
        raise UserError(
            f"--temperature={given.temperature!r} is not valid; valid: 0 (greedy) or a finite number > 0"
        )
    if not 0 <= given.seed <= MAX_SEED:
        raise UserError(f"--seed={given.seed} is out of range; valid: 0..{MAX_SEED}")
    if given.checkpoint == "":
        raise UserError(f"--checkpoint='' is not valid; valid: a checkpoint file of {given.run_dir}")
    chosen = None if given.checkpoint is None else Path(given.checkpoint)
    return Args(Path(given.run_dir), given.prompt, given.tokens, given.temperature, given.seed, chosen)


def _section(tree: dict, name: str, schema: type, config: Path):
    """The run's config section `name` as its typed dataclass; UserError when it does not fit today's."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), tree.get(name) or {}))
    except OmegaConfBaseException as e:
        why = " ".join(str(e).split("\n")[0].split())
        raise UserError(
            f"{config}: its {name} section cannot be read ({why}); valid: a run's config"
        ) from None


def read_run(run_dir: Path) -> tuple[ModelConfig, DataConfig, set[str], dict]:
    """The run's model and data config (config.yaml in today's shape), the ids of its sessions' runs
    (its `start` rows) and its plan facts (plan.json; {} without one); UserError when `run_dir` is no run."""
    if not (run_dir / CONFIG).is_file():
        raise UserError(
            f"RUN_DIR={run_dir} is not a run directory (no {CONFIG}); valid: the directory a training run "
            "wrote (its hydra.run.dir)"
        )
    try:
        run = load_run(run_dir, need_plan=False)
        tree = formats.upgrade_config(run.resolved, what=str(run_dir / CONFIG))
    except ReportInputError as e:
        raise UserError(str(e)) from None
    model = _section(tree, "model", ModelConfig, run_dir / CONFIG)
    data = _section(tree, "data", DataConfig, run_dir / CONFIG)
    ids = {row.run_id for row in run.rows if isinstance(row, StartRow) and row.run_id}
    return model, data, ids, run.plan


def codec(model: ModelConfig, data: DataConfig, run_dir: Path, facts: dict) -> TextCodec:
    """The run's tokenizer, as its data source declares it: UTF-8 bytes for byte-level data, the
    corpus's own for data=prepared (which must be the one the run trained with: `trained_with`);
    UserError for data that has none or is not text."""
    source = data_source(data)
    readable = [s.name for s in SOURCES.values() if s.tokenizer and not s.multistream]
    valid = f"valid: a decoder run on data={', '.join(readable[:-1])} or {readable[-1]}"
    if source.multistream:
        raise UserError(
            f"{run_dir} trained on data={data.name}, {source.channels} channels, not text alone; {valid}"
        )
    if not model_spec(model).text:
        raise UserError(
            f"{run_dir} trained a model.arch={model.arch} model, several token channels per position, not "
            f"text alone; {valid}"
        )
    if corpus.byte_level(source.tokenizer):
        return TextCodec(
            lambda text: list(text.encode("utf-8")),
            lambda ids: bytes(ids).decode("utf-8", errors="replace"),
            vocab=min(BYTE_VOCAB, model.vocab),
        )
    if corpus.own_tokenizer(source.tokenizer):
        path = Path(data.path).expanduser()
        meta = corpus.read_meta(path)
        try:
            tokenizer = corpus.Tokenizer(path, meta)
        except Exception as e:  # tokenizer.json missing or not one: the tokenizers library's own errors
            why = " ".join(str(e).split())[:200] or type(e).__name__
            raise UserError(
                f"data.path={str(path)!r}: its {corpus.TOKENIZER} cannot be read ({why}); "
                f"{corpus.prepare_again(path)}"
            ) from None
        trained_with(path, meta, model, facts, run_dir)
        return TextCodec(tokenizer.encode, tokenizer.decode, vocab=min(meta.vocab, model.vocab), eod=meta.eod)
    raise UserError(
        f"{run_dir} trained on data={data.name}, whose ids have no tokenizer to read them as text; {valid}"
    )


def trained_with(path: Path, meta: corpus.Meta, model: ModelConfig, facts: dict, run_dir: Path) -> None:
    """UserError unless the corpus at `path` has the tokenizer the run trained with: its vocabulary the
    run's model.vocab (data=prepared takes the corpus's) and its tokenizer.json's sha256 ("" for bytes)
    the one the run recorded (`data/tokenizer_sha256`; a run from before it was recorded: the vocabulary
    alone). A corpus prepared again at the run's data.path would otherwise decode its ids as garbage.
    A Hugging Face model's vocabulary is its config's, at least the corpus's (never resized to it)."""
    tokenizer = path / corpus.TOKENIZER
    now = hashlib.sha256(tokenizer.read_bytes()).hexdigest() if not corpus.byte_level(meta.tokenizer) else ""
    then = facts.get("data/tokenizer_sha256")
    external = model_spec(model).external
    if (meta.vocab == model.vocab or external and meta.vocab <= model.vocab) and then in (None, now):
        return

    def said(sha: str | None, vocab: int) -> str:
        if sha is None:  # not recorded
            return f"vocab {vocab}"
        return f"vocab {vocab}, " + (
            f"{corpus.TOKENIZER} sha256 {sha[:16]}..." if sha else "the bytes tokenizer"
        )

    raise UserError(
        f"data.path={str(path)!r} now holds a corpus of another tokenizer ({said(now, meta.vocab)}) than "
        f"{run_dir} trained with ({said(then, model.vocab)}); valid: the corpus the run trained on at that "
        "path (prepared again from the same inputs with the same --tokenizer)"
    )


def load_weights(args: Args, model: ModelConfig, run_ids: set[str]) -> tuple[dict, str]:
    """The global weights (no replica axis) and where they come from, in words: the run's weights.pt,
    or `args.checkpoint`'s (its `theta`: what the run evaluates, with outer.overlap=eager the mean of
    the replicas' own outer weights); UserError for a file missing, unreadable, of another run or model."""
    with ctrl_c_after_imports():
        import torch

    if args.checkpoint is None:
        path = args.run_dir / WEIGHTS
        if not path.is_file():
            newest = checkpoint.checkpoints(args.run_dir)
            hint = f"--checkpoint {newest[-1]} (its newest checkpoint)" if newest else "a finished run"
            raise UserError(f"{args.run_dir} has no {WEIGHTS} yet (the run has not finished); valid: {hint}")
        try:
            theta = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated, not a torch file, unreadable
            raise UserError(
                f"{path} cannot be read ({type(e).__name__}); valid: a run's whole {WEIGHTS}"
            ) from None
        where = str(path)
    else:
        path = args.checkpoint
        if not checkpoint.is_checkpoint(path):
            raise UserError(
                f"--checkpoint={path} is not a file; valid: a checkpoint of {args.run_dir} "
                f"({args.run_dir / checkpoint.FOLDER}/ckpt-u*.pt)"
            )
        saved = checkpoint.load(path, weights_only=True)
        if saved["run_id"] is not None and run_ids and saved["run_id"] not in run_ids:
            raise UserError(
                f"--checkpoint={path} is of run {saved['run_id']}, not of {args.run_dir} "
                f"({', '.join(sorted(run_ids))}); valid: a checkpoint of {args.run_dir}"
            )
        state = saved["state"]
        if state.get("shards_at") is not None:  # a sharded run's folder: its tensors read whole
            from hypertrain.distributed.dcp_shards import load_whole

            state = load_whole(Path(state["shards_at"]), state)
        theta = state["theta"]
        where = f"{path} (update {saved['state']['next_update']})"
    shapes = {name: tuple(t.shape) for name, t in theta.items()} if isinstance(theta, dict) else None
    if shapes != param_shapes(model):
        raise UserError(f"{where} does not hold the weights of {args.run_dir}'s model; valid: the run's own")
    return {name: t.float() for name, t in theta.items()}, where


def continuation(
    model: ModelConfig,
    theta: dict,
    prompt: list[int],
    *,
    tokens: int,
    context: int,
    vocab: int,
    temperature: float = 0.0,
    seed: int = 0,
    eod: int | None = None,
) -> list[int]:
    """Up to `tokens` ids after `prompt`, each from the model's logits at the last position of the
    last `context` ids (a sliding window): argmax at temperature 0, else a draw from
    softmax(logits / temperature) by a generator seeded with `seed`. Only ids below `vocab` are
    chosen; it stops after `eod` when one is given (the eod is the last id returned)."""
    import torch

    from hypertrain.model.transformer import logits

    params = {name: t.unsqueeze(0) for name, t in theta.items()}  # one replica: [1, ...]
    generator = torch.Generator().manual_seed(seed)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(tokens):
            window = torch.tensor(ids[-context:], dtype=torch.int64).view(1, 1, -1)
            last = logits(model, params, window)[0, -1, :vocab].double()  # [vocab]
            if temperature == 0:
                chosen = int(last.argmax())
            else:  # the largest logit first subtracted: a tiny temperature gives 0, never inf - inf
                probs = torch.softmax((last - last.max()) / temperature, dim=0)
                chosen = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(chosen)
            out.append(chosen)
            if chosen == eod:
                break
    return out


def sample(args: Args) -> tuple[str, str]:
    """The prompt followed by its continuation, and a one-line header saying what made it."""
    model, data, run_ids, facts = read_run(args.run_dir)
    text = codec(model, data, args.run_dir, facts)
    prompt = text.encode(args.prompt)
    if not prompt:
        raise UserError(f"--prompt={args.prompt!r} encodes to no tokens; valid: text the tokenizer reads")
    theta, where = load_weights(args, model, run_ids)
    added = continuation(
        model,
        theta,
        prompt,
        tokens=args.tokens,
        context=context_length(data),
        vocab=text.vocab,
        temperature=args.temperature,
        seed=args.seed,
        eod=text.eod,
    )
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}, seed {args.seed}"
    header = f"{PROG}: {len(added)} tokens from {where}, {how}, context {context_length(data)}"
    return args.prompt + text.decode(added), header


def cli(argv: list[str] | None = None) -> int:
    """`python -m hypertrain.sample ARGV` as a function: its exit code (0; 1 when stdout's reader left
    early; 2 for a mistake, its one line on stderr; Ctrl-C 130, as the train entry's, one line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        text, header = sample(parse(argv))
    except UserError as e:  # one line; the spaces inside it (a prompt quoted) kept as they are
        print(f"{ERROR} {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted(PROG), file=sys.stderr)
        return EXIT_CODES[signal.SIGINT]
    print(header, file=sys.stderr)
    return print_out([text])


if __name__ == "__main__":
    # The guard's handler stays: the command writes nothing, so ending at once is right throughout
    # (torch's import too, `ctrl_c_after_imports`). In-process callers get `cli`'s catch.
    sys.exit(cli())
