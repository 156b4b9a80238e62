"""The command line as Hydra composes it, checked before Hydra writes anything: Hydra's own mistakes as
one line, every value of a sweep validated (and sized) before the sweep folder exists, the folders of a
rejected sweep or job removed.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import re
import shutil
from contextvars import ContextVar
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hypertrain.choices import choice_error
from hypertrain.codec_table import NotACodec, codec_entry
from hypertrain.config import (
    OUTER_NODES,
    CodecConfig,
    TrainConfig,
    UserError,
    default_of,
    node_owners,
    node_type,
)
from hypertrain.distributed.layouts import launched_rank
from hypertrain.preflight import memory
from hypertrain.preflight.checks import validate
from hypertrain.preflight.refusal import fail
from hypertrain.records.formats import RETIRED, UNREAD_ELSEWHERE
from hypertrain.rundir.directory import close_log_files
from hypertrain.rundir.records import METRICS_FILE

# Groups whose `name` field only labels the option chosen; the option is chosen with `group=option`.
LABELLED_GROUPS = ("model", "outer", "phase")


CONF = Path(__file__).resolve().parents[2] / "conf"

# The retired keys (`formats.RETIRED`) the command line gave, as typed (outer.lowrank_rank): set by the
# entry (hypertrain.train), read by `drop_unread`.
retired_given: ContextVar[tuple[str, ...]] = ContextVar("hypertrain_retired_given", default=())
# The command line's retired spellings read as today's (`formats.modern_spelling`): one notice each, for
# the run's train.log alone, written once the run is checked (one call's own: `hypertrain.train.cli`).
# Here, not in the entry: a sweep's launcher pickles the entry's task function, and a context variable
# of the entry's own module (run as __main__) would go with it by value (cloudpickle refuses it).
retired_notes: ContextVar[tuple[str, ...]] = ContextVar("hypertrain_retired", default=())


def _taken(compress: str) -> tuple[str, ...]:
    """The outer.codec fields the codec `compress` reads; all of them for no codec (refused later)."""
    try:
        return codec_entry(compress).takes
    except NotACodec:
        return tuple(f.name for f in dataclasses.fields(CodecConfig))


def _lossless(compress: str) -> bool:
    """The codec `compress` sends the values themselves (none); False for no codec (refused later)."""
    try:
        return codec_entry(compress).lossless
    except NotACodec:
        return False


def drop_unread(task: DictConfig) -> tuple[DictConfig, tuple[str, ...]]:
    """A codec's field given by its older spelling with another codec (`outer.lowrank_rank=2` with
    outer.compress=topk, `outer.block=64` with outer.compress=none), which that codec ignored then: reset to
    its default in a copy of `task`, so the node the run lacks stays unset, with a note for train.log.
    Today's spelling there is refused (`config.OuterConfig.check_nodes`, `CodecConfig.check_taken`), and
    so is a schedule's field under another schedule, or a codec field the checks of then refused."""
    task = copy.deepcopy(task)
    outer, notes = task.outer, []
    for key in retired_given.get():
        node, _, name = RETIRED[key].removeprefix("outer.").partition(".")
        if node == "codec":  # the codecs' shared node: a field the chosen codec does not read
            owner, kind, chosen = "compress", CodecConfig, str(outer.compress)
            if key not in UNREAD_ELSEWHERE or name in _taken(chosen):
                continue
            if UNREAD_ELSEWHERE[key] and not _lossless(chosen):  # refused then, refused now
                continue
        else:
            owner, entry = next((o, e) for o, e in node_owners() if e.node == node)
            kind, chosen = OUTER_NODES[node], str(outer[owner])
            if owner != "compress" or chosen == entry.name or outer[node] is None:
                continue
        value = outer[node][name]
        with read_write(outer), open_dict(outer):
            outer[node][name] = default_of(kind, name)
        notes.append(f"{key}={value} has no effect with outer.{owner}={chosen}: dropped")
    return task, tuple(notes)


def check_experiment(choices: dict) -> None:
    """`experiment` is an optional group: Hydra silently ignores an option that does not exist."""
    chosen = choices.get("experiment")
    options = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
    if chosen is not None and chosen not in options:
        raise UserError(f"experiment={chosen!r} is not an experiment; valid: {', '.join(options)}")


def check_fields(node: DictConfig, schema: type, prefix: str = "") -> None:
    """`+key=value` adds a key the run would never read: every key must be a field of the schema."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        if key not in fields:
            raise UserError(f"{prefix}{key} is not a config field; valid: {', '.join(sorted(fields))}")
        kind = node_type(schema, fields[key])  # a section, or a node some runs lack (outer.arrivals)
        if kind is not None and isinstance(node[key], DictConfig):
            check_fields(node[key], kind, f"{prefix}{key}.")


def check_labels(cfg: TrainConfig, choices: dict) -> None:
    """`outer.name=average` only relabels the Nesterov option: a label that disagrees with the
    option Hydra composed is a mistake, not a silent choice of the composed option's values."""
    for group in LABELLED_GROUPS:
        chosen, label = choices.get(group), getattr(cfg, group).name
        if chosen is not None and label != chosen:
            raise UserError(
                f"{group}.name={label!r} only labels the run; the {group} is chosen with {group}=... "
                f"(now {group}={chosen}); valid: {group}={label} to use that option, or {group}.name={chosen}"
            )


def grammar_error(error: Exception) -> str | None:
    """An override Hydra's grammar cannot read (`hydra.run.dir=~/x`: a leading ~) as one line naming
    the value, where it stops and what would be valid; None for any other error."""
    from hydra.errors import OverrideParseException

    if not isinstance(error, OverrideParseException):
        return None
    text = error.override
    key, sep, value = text.partition("=")
    lines = str(error).splitlines()
    prefix = "LexerNoViableAltException: "
    where = ""
    if len(lines) > 1 and lines[0].startswith(prefix) and "^" in lines[1]:
        at = lines[1].index("^") - len(prefix)
        if 0 <= at < len(text):
            where = f" (at {text[at]!r}, character {at + 1})"
    if not sep:
        return f"{text!r} cannot be read by Hydra's override grammar{where}; valid: key=value"
    quote = '"' if "'" in value else "'"
    quoted = f"{key}={quote}{value}{quote}"
    if value.startswith("~"):
        hint = (
            f"valid: an absolute path, {key}={os.path.expanduser(value)} (Hydra does not expand ~), or "
            f"the value quoted, {quoted}, for a folder named ~"
        )
    else:
        hint = f"valid: the value quoted for Hydra, {quoted} (on a shell, quote the whole argument)"
    return f"{key}={value} cannot be read by Hydra's override grammar{where}; {hint}"


# Hydra's launchers that come from plugins outside hypertrain's own dependencies (pyproject.toml's dev
# extra, whose pins these are): the option under hydra/launcher -> (the requirement, its module under
# hydra_plugins). conf/hydra/launcher/slurm.yaml and slurm_dist.yaml build on submitit_slurm.
LAUNCHER_PLUGINS = {
    "joblib": ("hydra-joblib-launcher>=1.2,<1.3", "hydra_joblib_launcher"),
    "submitit_local": ("hydra-submitit-launcher>=1.2,<1.3", "hydra_submitit_launcher"),
    "submitit_slurm": ("hydra-submitit-launcher>=1.2,<1.3", "hydra_submitit_launcher"),
}


def plugin_installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(f"hydra_plugins.{module}") is not None
    except ImportError:
        return False


def missing_launcher(error: Exception, overrides: list[str]) -> str | None:
    """A launcher whose Hydra plugin is not installed (Hydra says only that it cannot find or load the
    option) as one line naming the package and how to install it; None for any other error."""
    found = re.search(r"Could not (?:find|load) 'hydra/launcher/(\w+)'", str(error))
    if found is None or found.group(1) not in LAUNCHER_PLUGINS:
        return None
    requirement, module = LAUNCHER_PLUGINS[found.group(1)]
    if plugin_installed(module):
        return None
    chosen = [o for o in overrides if o.startswith("hydra/launcher=")]
    chosen = chosen[-1] if chosen else f"hydra/launcher={found.group(1)}"
    package = re.split(r"[<>=]", requirement)[0]
    return (
        f"{chosen} needs the Hydra plugin {package}, which is not installed (pyproject.toml's dev extra "
        f"brings it); valid: python -m pip install '{requirement}' (or the whole dev extra: "
        "scripts/setup --dev), or no hydra/launcher (Hydra's basic launcher runs the jobs one by one)"
    )


def composition_error(error: Exception, overrides: list[str] = ()) -> str:
    """Hydra's own composition error as one line: its first line, with the cause or the options; a
    choice given a value it does not have names the valid ones (`choice_error`); a launcher whose
    plugin is not installed says which package to install."""
    unreadable = grammar_error(error)
    if unreadable is not None:
        return unreadable
    bad_choice = choice_error(error)
    if bad_choice is not None:
        return bad_choice
    uninstalled = missing_launcher(error, list(overrides))
    if uninstalled is not None:
        return uninstalled
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    options = getattr(error, "options", None)
    if options:  # an option of a group that does not exist
        return f"{first}; valid: {', '.join(sorted(options))}"
    cause = error.__cause__
    detail = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    return f"{first} {detail}".strip() if detail and detail not in first else first


SWEEP_ROOT_ENV = "HYPERTRAIN_SWEEP_ROOT"  # the deepest folder above the sweep directory that existed


def task_part(config: DictConfig) -> DictConfig:
    """The run's config without Hydra's node, as Hydra hands it to the task function (still typed)."""
    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


def check_composition(args: list[str]) -> None:
    """Compose the command line's overrides as Hydra will, before Hydra runs: an unknown option,
    a misspelled key or a value of the wrong type exits 2 with one line (Hydra's own wording),
    nothing created. In a multirun every value of every sweep is composed (with the other sweeps'
    first values), before Hydra writes the sweep directory; every job is then checked in full when
    it starts. Hydra's flags (--help, --cfg, ...) are left to Hydra."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in args):
        return
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    multirun = len(overrides) < len(args)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        first, sweeps, others = [], [], []  # others: (position in first, the sweep's other values)
        for override, text in zip(parsed, overrides, strict=True):
            if override.is_sweep_override():
                sweeps.append(text)
                key = override.get_key_element()
                try:
                    values = [f"{key}={v}" for v in override.sweep_string_iterator()]
                except Exception:  # a sweep Hydra enumerates only later (glob, interval): the jobs check it
                    continue
                if not values:
                    continue
                text = values[0]
                others.append((len(first), values[1:]))
            first.append(text)
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            composed = compose("train", overrides=first, return_hydra_config=True)
            sweeping = multirun or str(composed.hydra.mode) == "RunMode.MULTIRUN"
            jobs = [composed]
            if sweeping:  # each value once: time in proportion to the values given, not their product
                for at, values in others:
                    for value in values:
                        jobs.append(
                            compose(
                                "train",
                                overrides=[*first[:at], value, *first[at + 1 :]],
                                return_hydra_config=True,
                            )
                        )
    except Exception as e:  # Hydra's errors have no common base class beyond Exception
        fail(composition_error(e, overrides))
    check_output_dir(composed, "sweep.dir" if sweeping else "run.dir")
    if sweeping and (launched := launched_rank()) is not None:
        fail(
            f"a multirun (-m) under {launched.launcher} is not supported: every rank would run the whole "
            "sweep; valid: python -m hypertrain.train -m processes=dist ... (each job starts its own "
            "processes), or -m hydra/launcher=slurm_dist (each job's SLURM tasks are its ranks)"
        )
    if sweeps and not sweeping:
        fail(
            f"Ambiguous value for argument '{sweeps[0]}'; valid: -m to sweep over the values, "
            "or key=[a,b] for a list"
        )
    if sweeping:
        for job in jobs:
            check_sweep_memory(job)
        note_sweep_root(composed)


NAME_MAX, PATH_MAX = 255, 4096  # Linux's limits: bytes in one path component, in a whole path


def check_output_dir(composed: DictConfig, key: str) -> None:
    """`hydra.<key>` (run.dir, or sweep.dir in a multirun) resolves and names a folder this system can
    make: an interpolation that does not resolve, or a component over NAME_MAX bytes, is one line
    naming the value (Hydra would fail making it, with a traceback)."""
    try:
        folder = str(OmegaConf.select(composed, f"hydra.{key}"))
    except Exception as e:  # omegaconf's interpolation errors
        written = OmegaConf.to_container(composed.hydra, resolve=False)
        for part in key.split("."):
            written = written[part]
        reason = str(e).strip().splitlines()[0]
        fail(
            f"hydra.{key}={written} cannot be resolved ({reason}); valid: a path, with ${{now:...}} if wanted"
        )
    encoded = os.fsencode(folder)
    long = [c for c in encoded.split(b"/") if len(c) > NAME_MAX]
    if long:
        fail(
            f"hydra.{key}={folder} has a folder name of {len(long[0])} bytes; valid: names of at most "
            f"{NAME_MAX} bytes"
        )
    if len(encoded) >= PATH_MAX:
        fail(f"hydra.{key}={folder} is {len(encoded)} bytes long; valid: a path under {PATH_MAX} bytes")


def check_sweep_memory(composed: DictConfig) -> None:
    """A sweep's value fits this machine's memory (hypertrain.memory), checked before Hydra writes the
    sweep directory: one line, exit 2. A value that is not valid is left to its own job's checks."""
    try:
        cfg = OmegaConf.to_object(task_part(composed))
        decided = validate(cfg)
    except Exception:  # not valid (or not typed): its job says what is wrong, in its turn
        return
    try:
        memory.check(cfg, decided=decided)
    except UserError as e:
        fail(str(e))


def note_sweep_root(composed: DictConfig) -> None:
    """Remember (for the jobs, in the environment) the deepest folder above the sweep directory that
    exists before Hydra makes it: a sweep whose first job is rejected removes what Hydra made below."""
    try:
        sweep_dir = Path(str(OmegaConf.select(composed, "hydra.sweep.dir"))).absolute()
    except Exception:  # a sweep directory that only resolves inside Hydra's run: nothing is removed
        return
    existing = sweep_dir
    while not existing.exists():
        existing = existing.parent
    os.environ[SWEEP_ROOT_ENV] = str(existing)


SWEEP_FILE = "multirun.yaml"  # what Hydra writes into a sweep directory before its first job


def remove_rejected_sweep_dir(sweep_dir: Path) -> None:
    """A sweep whose jobs so far were all rejected: remove its directory when it holds only Hydra's
    multirun.yaml, and the empty folders Hydra made above it (below the one noted before, if any)."""
    sweep_dir = sweep_dir.absolute()
    if not sweep_dir.is_dir() or {p.name for p in sweep_dir.iterdir()} != {SWEEP_FILE}:
        return
    (sweep_dir / SWEEP_FILE).unlink(missing_ok=True)
    noted = os.environ.get(SWEEP_ROOT_ENV)
    root = Path(noted) if noted else None
    folder = sweep_dir
    while root is None or root in folder.parents:  # below the folder that existed before, if noted
        try:
            folder.rmdir()
        except OSError:  # not empty: not only Hydra's
            return
        if root is None:
            return
        folder = folder.parent


def remove_rejected_job_dir(job_dir: Path) -> None:
    """Remove what Hydra wrote for a job that never started (`.hydra/`, its log), if that is all."""
    if not job_dir.is_dir() or (job_dir / METRICS_FILE).exists():
        return
    hydra_files = {".hydra", "train.log"}
    if {p.name for p in job_dir.iterdir()} <= hydra_files:
        close_log_files(job_dir)  # the job's log file, closed before it is removed
        shutil.rmtree(job_dir, ignore_errors=True)
