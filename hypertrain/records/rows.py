"""The rows of `metrics.jsonl`, one dataclass per `kind`: its fields in the order the row holds them, its
JSON form (`to_json`, and `parse` back) and its W&B keys (`wandb`). A field left None is not written (a
field marked `_null` is written as null); an open field (`figures`, `values`) holds the row's own keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

OPEN = "open"  # metadata: the field's keys are the row's own, in their order (`figures`, `values`)
NULL = "null"  # metadata: the field is written as JSON null when it is None


def _null(doc: str) -> Any:
    return field(default=None, metadata={NULL: True, "doc": doc})


def _maybe(doc: str, default: Any = None) -> Any:
    return field(default=default, metadata={"doc": doc})


def _open(doc: str) -> Any:
    return field(default_factory=dict, metadata={OPEN: True, "doc": doc})


def json_name(name: str) -> str:
    """A field's key in the JSON row: its name, but `from_` (`from` is a Python keyword) is `from`."""
    return name.rstrip("_")


def plain(value: Any) -> Any:
    """JSON fallback for numpy / torch scalars and arrays, without importing either."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"metrics.jsonl cannot hold a {type(value).__name__}: {value!r}")


def non_finite(value: Any, key: str = "") -> tuple[str, float] | None:
    """The first number in `value` (a row as `to_json` gives it, at any depth: `loss[1]`) that is nan
    or an infinity, which JSON has no number for, with its key; None when every number is finite."""
    if hasattr(value, "tolist") or hasattr(value, "item"):  # numpy / torch, as `plain` writes them
        value = plain(value)
    if isinstance(value, float):
        return None if math.isfinite(value) else (key, value)
    if isinstance(value, dict):
        found = (non_finite(item, f"{key}.{k}" if key else str(k)) for k, item in value.items())
    elif isinstance(value, (list, tuple)):
        found = (non_finite(item, f"{key}[{i}]") for i, item in enumerate(value))
    else:
        return None
    return next((hit for hit in found if hit is not None), None)


def is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def clock_key(key: str) -> str | None:
    """The network clock's W&B keys: `clock_s` (an update's or a sync's, the clock at its end) is
    `clock/seconds`, a sync's `clock_<part>` is `clock/<part>`; None for any other field."""
    if key == "clock_s":
        return "clock/seconds"
    return f"clock/{key.removeprefix('clock_')}" if key.startswith("clock_") else None


def wandb_scalars(extra: dict, prefix: str) -> dict:
    """`extra`'s numbers under their W&B keys (the clock's, else `prefix + key`); lists and strings stay
    in metrics.jsonl only."""
    out = {}
    for key, value in extra.items():
        value = plain(value) if hasattr(value, "item") else value
        if is_scalar(value):
            out[clock_key(key) or f"{prefix}{key}"] = value
    return out


SOURCES_DOC = (
    "data=prepared of S > 1 sources: each source's held-out loss (held-out id N + j is source j mod S's); "
    "None (null) for a source with no held-out example"
)


def source_losses(losses: list[float | None] | None) -> dict:
    """A row's per-source held-out losses under their W&B keys, `eval/loss/source_<s>`."""
    return {f"eval/loss/source_{s}": x for s, x in enumerate(losses or ()) if x is not None}


def loss_mean(losses: list[float | None]) -> float | None:
    """Mean of the replicas that stepped (None entries left out); None when no replica stepped."""
    stepped = [float(loss) for loss in losses if loss is not None]
    return math.fsum(stepped) / len(stepped) if stepped else None


@dataclass
class Row:
    """A row of metrics.jsonl: `kind` first, then the fields in order (`to_json`)."""

    kind: ClassVar[str] = ""
    wandb_keys: ClassVar[dict[str, str]] = {}  # field -> its W&B key (the docs' tables)
    wandb_prefix: ClassVar[str] = ""  # the W&B prefix of the open field's numbers; "" = not in W&B

    def to_json(self) -> dict:
        """The row as metrics.jsonl holds it (before `json.dumps`)."""
        row: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get(OPEN):
                row |= value
            elif value is not None or f.metadata.get(NULL):
                row[json_name(f.name)] = value
        return row

    @classmethod
    def from_json(cls, row: dict) -> Row:
        """The row `to_json` wrote (or one written before a field existed: that field None); keys no
        field names go to the open field, in order."""
        named = {json_name(f.name): f.name for f in fields(cls) if not f.metadata.get(OPEN)}
        spare = [f.name for f in fields(cls) if f.metadata.get(OPEN)]
        given = {named[k]: v for k, v in row.items() if k in named}
        rest = {k: v for k, v in row.items() if k not in named and k != "kind"}
        if spare:
            given[spare[0]] = rest
        return cls(**given)

    @classmethod
    def of(cls, row: Row | dict) -> Row:
        """`row` itself, or the row of the dict of its fields (without `kind`); ValueError for a field
        the row has not (where it has no open field to hold it)."""
        if isinstance(row, cls):
            return row
        names = {json_name(f.name) for f in fields(cls)}
        if not any(f.metadata.get(OPEN) for f in fields(cls)) and not set(row) <= names:
            unknown = ", ".join(sorted(set(row) - names))
            raise ValueError(f"a {cls.kind} row has no field {unknown}; valid: {', '.join(sorted(names))}")
        return cls.from_json({"kind": cls.kind, **row})

    def wandb(self) -> dict | None:
        """What W&B logs for the row (plotted against `update`); None: the row is metrics.jsonl's only."""
        return None


@dataclass
class StartRow(Row):
    """The first row of every session; a resumed run appends another."""

    kind: ClassVar[str] = "start"
    time: float = _maybe("seconds since the epoch")
    run_id: str | None = _maybe("the run's own id, kept by every session of it and its checkpoints")
    name: str | None = _maybe("the run's name")
    group: str | None = _maybe("its W&B group")
    job_type: str | None = _maybe("its W&B job type")
    tags: list[str] | None = _maybe("its W&B tags")
    replicas: int | None = _maybe("R: every update row holds R losses")
    wandb_run_id: str | None = _null("the W&B run's id; None without one")
    pid: int | None = _maybe("the writing process (a file without an end row: running or dead)")
    host: str | None = _maybe("`socket.gethostname()` of the writing process")


@dataclass
class EvalRow(Row):
    """A held-out loss in its own row: the starting weights', and with fragments after every round."""

    kind: ClassVar[str] = "eval"
    wandb_keys: ClassVar[dict[str, str]] = {
        "eval_loss": "eval/loss",
        "eval_loss_sources": "eval/loss/source_<s>",
        "clock_s": "clock/seconds",
    }
    wandb_prefix: ClassVar[str] = "eval/"
    update: int = _maybe("updates done before it")
    round: int = _maybe("rounds done before it", 0)
    eval_loss: float = _maybe("the global weights' held-out loss")
    eval_loss_sources: list[float | None] | None = _maybe(SOURCES_DOC)
    comm_inner_total: int | None = _maybe("with fragments: the running inner bytes")
    comm_outer_total: int | None = _maybe("with fragments: the running outer bytes")
    clock_s: float | None = _maybe("with fragments: the network clock now (docs/clock.md)")
    figures: dict = _open("a multistream model's per-channel held-out losses")

    def __post_init__(self) -> None:
        if self.eval_loss is not None:
            self.eval_loss = float(self.eval_loss)

    def wandb(self) -> dict:
        data = {"update": self.update, "round": self.round, "eval/loss": self.eval_loss}
        skip = ("kind", "update", "round", "eval_loss", "eval_loss_sources")
        extra = {k: v for k, v in self.to_json().items() if k not in skip}
        return data | source_losses(self.eval_loss_sources) | wandb_scalars(extra, self.wandb_prefix)


@dataclass
class UpdateRow(Row):
    """One update: each replica's training loss (None: it did not step), its tokens and seconds."""

    kind: ClassVar[str] = "update"
    wandb_keys: ClassVar[dict[str, str]] = {
        "loss": "train/loss/replica_<m>",
        "lr": "train/lr",
        "tokens": "train/tokens",
        "wall": "train/wall",
        "grad_accum": "train/grad_accum",
        "clock_s": "clock/seconds",
        "loss_mean": "train/loss_mean",
    }
    wandb_prefix: ClassVar[str] = "train/"
    update: int = _maybe("its count in the phase, 1 for the first")
    round: int = _maybe("the round it belongs to")
    lr: float | None = _maybe("the inner learning rate")
    loss: list[float | None] = _maybe("per replica; None (null) = the replica did not step", ())
    tokens: int | None = _maybe("target tokens trained on, all replicas")
    grad_accum: int | None = _maybe("the most microbatches a replica's share was cut into")
    wall: float | None = _maybe("seconds since training started, at its segment's end")
    rank_seconds: list[float] | None = _maybe("each process's seconds for it")
    figures: dict = _open("a multistream model's channel losses, a mixture's router figures")
    clock_s: float | None = _maybe("the network clock at its end (docs/clock.md)")

    def __post_init__(self) -> None:
        if self.loss is not None:  # None: a row that holds no losses (it reads back as one)
            self.loss = [None if loss is None else float(loss) for loss in self.loss]

    @property
    def stepped(self) -> list[bool]:
        """Per replica: whether it stepped."""
        return [loss is not None for loss in self.loss or ()]

    @property
    def loss_mean(self) -> float | None:
        """The mean over the replicas that stepped; None when none did."""
        return loss_mean(self.loss or [])

    def to_json(self) -> dict:
        return super().to_json() | {"loss_mean": self.loss_mean}

    @classmethod
    def from_json(cls, row: dict) -> UpdateRow:
        return super().from_json({k: v for k, v in row.items() if k != "loss_mean"})

    def wandb(self) -> dict:
        data: dict[str, Any] = {"update": self.update, "round": self.round}
        data.update({f"train/loss/replica_{m}": x for m, x in enumerate(self.loss) if x is not None})
        if self.loss_mean is not None:
            data["train/loss_mean"] = self.loss_mean
        row = self.to_json()
        data.update({f"train/{key}": row[key] for key in ("lr", "tokens", "wall") if key in row})
        skip = ("kind", "update", "round", "loss", "lr", "tokens", "wall", "loss_mean")
        return data | wandb_scalars({k: v for k, v in row.items() if k not in skip}, self.wandb_prefix)


@dataclass
class SyncRow(Row):
    """One sync landing (with fragments, one per fragment): the pseudo-gradient norm, the bytes."""

    kind: ClassVar[str] = "sync"
    wandb_keys: ClassVar[dict[str, str]] = {
        "eval_loss": "eval/loss",
        "eval_loss_sources": "eval/loss/source_<s>",
        "pseudo_grad_norm": "sync/pseudo_grad_norm",
        "comm_inner_bytes": "comm/inner_bytes",
        "comm_outer_bytes": "comm/outer_bytes",
        "comm_inner_total": "comm/inner_total",
        "comm_outer_total": "comm/outer_total",
    }
    wandb_prefix: ClassVar[str] = "sync/"
    update: int = _maybe("updates done when it landed")
    round: int = _maybe("the round it ends")
    fragment: int | None = _maybe("with fragments: the fragment synced")
    taken_at: int | None = _maybe("updates done when its pseudo-gradient was taken (`update` less the delay)")
    params: int | None = _maybe("the parameters synced (the fragment's, with fragments)")
    eval_loss: float | None = _maybe(
        "without fragments: the held-out loss of the global weights this landing left (outer.overlap's"
        " two at the phase's end: the weights before the flush, then after it)"
    )
    eval_loss_sources: list[float | None] | None = _maybe(f"without fragments: {SOURCES_DOC}")
    pseudo_grad_norm: float | None = _maybe("the norm of the mean pseudo-gradient")
    replicas_synced: int | None = _maybe("the replicas that took part")
    comm_inner_bytes: int | None = _maybe("inner bytes per rank since the previous sync (the ring's)")
    comm_outer_bytes: int | None = _maybe("outer bytes per replica of this sync (a codec's payload)")
    comm_inner_total: int | None = _maybe("running inner bytes")
    comm_outer_total: int | None = _maybe("running outer bytes")
    bits_per_param: list[float | None] | None = _maybe(
        "per replica: the bits its contribution sent over `params` (32 for fp32; a codec's 8 * (payload +"
        ' header bytes) / params: docs/compression.md, "Bits"); None (null): it did not take part'
    )
    bits_total: list[int] | None = _maybe(
        "per replica: the bits it sent in the run so far, this sync's included"
    )
    outer_spread: float | None = _maybe(
        "outer.overlap=eager: the largest relative distance of a replica's outer weights from their mean"
    )
    figures: dict = _open(
        "a codec's (`payload_bytes`, its errors; low rank's `landing_bytes`, the part exchanged at the"
        " landing), real processes' measured bytes and seconds, a"
        " multistream model's held-out losses, churn's facts, the clock's split (`clock_*`)"
    )

    def wandb(self) -> dict:
        row = self.to_json()
        data: dict[str, Any] = {"update": self.update, "round": self.round}
        data.update(
            {key: row[n] for n, key in self.wandb_keys.items() if n in row and n != "eval_loss_sources"}
        )
        data |= source_losses(self.eval_loss_sources)
        skip = ("kind", "update", "round", *self.wandb_keys)
        return data | wandb_scalars({k: v for k, v in row.items() if k not in skip}, self.wandb_prefix)


@dataclass
class ArrivalRow(Row):
    """outer.schedule=async (docs/async.md): one server update, the jobs it applied together."""

    kind: ClassVar[str] = "arrival"
    wandb_keys: ClassVar[dict[str, str]] = {
        "eval_loss": "eval/loss",
        "staleness_mean": "async/staleness",
        "clock_s": "clock/seconds",
    }
    update: int = _maybe("server updates applied, this one included (W&B's step)")
    replicas: list[int] = _maybe("the replicas whose jobs it applied, in replica order")
    steps: list[int] = _maybe("each job's inner steps")
    first: list[int] = _maybe("each job's first inner step (the replica's own count, 0-based)")
    tokens: list[int] = _maybe("each job's training tokens")
    staleness: list[int] = _maybe("each job's server updates applied since it pulled its weights")
    loss: list[float] = _maybe("each job's training loss at its last step")
    payload_bits: list[int] = _maybe(
        "each job's payload bits: 32 a parameter (fp32), or its codec's payload (docs/async.md, Codecs)"
    )
    staleness_mean: float = _maybe("the mean of `staleness`")
    pseudo_grad_norm: float | None = _maybe("the norm of the pseudo-gradient applied (the jobs' mean)")
    clock_s: float = _maybe("the network clock at the update (docs/async.md)")
    eval_loss: float | None = _maybe(
        "every outer.arrivals.eval_every arrivals: the new weights' held-out loss"
    )
    absent: list[dict] | None = _maybe(
        "with churn: the absent jobs that returned since the previous update (the last update: and after "
        "it), each {replica, job, first, steps} (docs/async.md, Churn with async)"
    )
    dropped: list[dict] | None = _maybe(
        "with churn: the missed jobs whose push was dropped since the previous update, as `absent`"
    )
    figures: dict = _open("none yet")

    def moved(self, n_params: int) -> list[tuple[int, int]]:
        """Each job's outer bytes (docs/async.md, "Records and checkpoints"), as (replica, bytes): per job
        applied its upload, `payload_bits / 8` (a row without them: fp32, 4 N), and its download of the
        new weights, 4 N (N fp32 parameters); then per job absent or dropped its download alone, at its
        return. The one rule of the run's summary and of the report."""
        bits = self.payload_bits or [32 * n_params] * len(self.replicas)
        applied = [(m, b // 8 + 4 * n_params) for m, b in zip(self.replicas, bits, strict=True)]
        return applied + [(job["replica"], 4 * n_params) for job in self.away]

    @property
    def away(self) -> list[dict]:
        """The jobs that did not arrive (churn): `absent`, then `dropped` ([] without churn)."""
        return [*(self.absent or []), *(self.dropped or [])]

    def wandb(self) -> dict:
        data = {"update": self.update, "async/staleness": self.staleness_mean, "clock/seconds": self.clock_s}
        return data | ({} if self.eval_loss is None else {"eval/loss": self.eval_loss})


@dataclass
class CheckpointRow(Row):
    """A checkpoint written."""

    kind: ClassVar[str] = "checkpoint"
    wandb_keys: ClassVar[dict[str, str]] = {"bytes": "checkpoint/bytes", "seconds": "checkpoint/seconds"}
    wandb_prefix: ClassVar[str] = "checkpoint/"
    update: int = _maybe("the next update to run")
    round: int = _maybe("rounds done")
    mid_round: bool | None = _maybe("whether it was written inside a round")
    path: str | None = _maybe("the file")
    bytes: int | None = _maybe("its size")
    seconds: float | None = _maybe("the time the write took")

    def wandb(self) -> dict:
        data = {"update": self.update, "round": self.round}
        return data | wandb_scalars({"bytes": self.bytes, "seconds": self.seconds}, self.wandb_prefix)


@dataclass
class ResumeRow(Row):
    """This session goes on from a checkpoint."""

    kind: ClassVar[str] = "resume"
    from_: str | None = _maybe("the checkpoint")
    update: int | None = _maybe("the update the run goes on from")
    round: int | None = _maybe("rounds done")
    superseded_bytes: int | None = _maybe("bytes moved to metrics.superseded.jsonl")


@dataclass
class RestartRow(Row):
    """This session was started again by torch's agent after a worker failed (docs/resume.md)."""

    kind: ClassVar[str] = "restart"
    count: int | None = _maybe("the agent's restart count, 1 for the first")
    max_restarts: int | None = _maybe("the restarts the agent allows")
    update: int | None = _maybe(
        "the update the run goes on from, 0 from the start (outer.schedule=async: the server update)"
    )
    recomputed: int | None = _maybe(
        "the updates the failed session had recorded, run again (outer.schedule=async: the server updates,"
        " its arrival rows)"
    )
    from_: str | None = _null("the checkpoint gone on from; None from the start")
    superseded_bytes: int | None = _maybe("bytes moved to metrics.superseded.jsonl")


@dataclass
class SummaryRow(Row):
    """Run-level facts: the plan's hashes, the data's fingerprint, the totals (W&B's run summary)."""

    kind: ClassVar[str] = "summary"
    values: dict = _open("`plan/...`, `data/...`, `model/...`, `env/...`, totals under their W&B keys")


@dataclass
class EndRow(Row):
    """The last row of a session; a file without one was killed or is still running."""

    kind: ClassVar[str] = "end"
    time: float = _maybe("seconds since the epoch")
    status: str | None = _maybe(
        "finished, failed, preempted (SIGTERM or SIGUSR2: exit 143) or interrupted (SIGINT 130, SIGHUP 129)"
    )
    error: str | None = _maybe("a run that did not finish: its one line")
    exit_code: int | None = _maybe("a run that did not finish: the code the entry exits with")

    @property
    def code(self) -> int:
        """The exit code the session ended with (0 when it finished)."""
        return 0 if self.exit_code is None else int(self.exit_code)


ROWS: dict[str, type[Row]] = {
    cls.kind: cls
    for cls in (
        StartRow,
        EvalRow,
        UpdateRow,
        SyncRow,
        ArrivalRow,
        CheckpointRow,
        ResumeRow,
        RestartRow,
        SummaryRow,
        EndRow,
    )
}


def parse(row: dict | Row) -> Row | None:
    """The typed row of a metrics.jsonl object (a row already typed: itself); None for a kind no type
    names, or for something that is not a row."""
    if isinstance(row, Row):
        return row
    cls = ROWS.get(row.get("kind")) if isinstance(row, dict) else None
    return None if cls is None else cls.from_json(row)
