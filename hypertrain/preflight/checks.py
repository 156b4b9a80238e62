"""The checks of a composed config that need more than one section, or the plan, in one place.

`validate(cfg)` runs every section's own checks (`TrainConfig.check`), then these: the phase as the
plan builds it (`plan_phase`), the world, replicas and phase together, the data and the model, and
whether a process layout fits processes=dist, and the outer optimizer (`optim.outer`); it returns what
the config decides (`Decided`, built here once); `check_device`, whether this machine has the decided
device. None of them imports torch for a CPU run, but for an outer.optimizer that names a torch
optimizer. A user mistake is one `UserError` line, before anything is built or written; what needs the
data (the stream's length, the vocabulary) is checked by `prepare`.
"""

from __future__ import annotations

from pathlib import Path

from hypertrain.choices import PhaseKind
from hypertrain.config import PhaseConfig, TrainConfig, UserError
from hypertrain.data import data_source
from hypertrain.data.corpus import read_meta
from hypertrain.diloco import fragments
from hypertrain.distributed.decided import Decided, decide
from hypertrain.distributed.layouts import LayoutError
from hypertrain.distributed.shard_check import check_shard
from hypertrain.model.spec import check_model, model_spec
from hypertrain.optim import outer as outer_optimizers
from hypertrain.plan.sampling import MAX_WORLD, PlanError, StrongPhase, WeakPhase
from hypertrain.schedule_table import schedule_entry


def plan_phase(phase: PhaseConfig) -> StrongPhase | WeakPhase:
    """The plan's phase for `phase`; UserError naming the bad field."""
    common = dict(
        name=phase.name, offset=phase.offset, updates=phase.updates, timing_warmup=phase.timing_warmup
    )
    try:
        if phase.kind == PhaseKind.strong:
            return StrongPhase(**common, global_batch=phase.global_batch)
        return WeakPhase(**common, base_world=phase.base_world, per_rank_batch=phase.per_rank_batch)
    except PlanError as e:
        raise UserError(str(e)) from None


def check_world(cfg: TrainConfig) -> None:
    """World, replicas and phase together: every replica gets ids at every full update."""
    # The plan's checks and digests go over every rank: a world beyond any machine is refused.
    if cfg.world.size > MAX_WORLD:
        raise UserError(f"world.size={cfg.world.size} is too large; valid: 1..{MAX_WORLD}")
    phase = plan_phase(cfg.phase)
    base = phase.base_world if isinstance(phase, WeakPhase) else cfg.world.size
    if cfg.world.size % cfg.replicas or base % cfg.replicas:
        what = "the weak phase's base world" if isinstance(phase, WeakPhase) else "world.size"
        raise UserError(
            f"replicas={cfg.replicas} does not divide {what} ({base}); valid: a divisor of {base}"
        )
    # Weak phases need no check here: R divides B, so B*b >= R.
    if isinstance(phase, StrongPhase) and phase.global_batch < cfg.replicas:
        raise UserError(
            f"phase.global_batch={phase.global_batch} is smaller than replicas={cfg.replicas}: a replica "
            f"would never get an id; valid: global_batch >= {cfg.replicas}"
        )
    if isinstance(phase, WeakPhase) and cfg.world.size % phase.base_world:
        raise UserError(
            f"world.size={cfg.world.size} is not a multiple of phase.base_world={phase.base_world}"
        )


def check_data_for_model(cfg: TrainConfig) -> None:
    """Several token channels (speech's) need a multistream model: refused here, before a first use
    builds the data (speech's cache)."""
    d, m = cfg.data, cfg.model
    if data_source(d).multistream and not model_spec(m).channels:
        raise UserError(
            f"data={d.name} gives {data_source(d).channels_said(d)} but "
            f"model.arch={m.arch!r} reads one stream; valid: model=multistream_tiny or multistream_small"
        )


def check_sources(cfg: TrainConfig) -> None:
    """data.replica_split=by_source: stream id i is source i mod S's and replica m gets the ids
    offset + u*G + m + k*R, so replica m trains on source m mod S alone when S divides R, G (weak: B*b)
    and phase.offset (docs/data.md, "Data that differs across replicas"). Reads the corpus's meta only."""
    if not data_source(cfg.data).documents or cfg.data.replica_split != "by_source":
        return
    S = len(read_meta(Path(cfg.data.path).expanduser()).sources)
    if cfg.replicas % S:
        raise UserError(
            f"data.replica_split=by_source gives replica m the corpus's source m mod S, and its S={S} "
            f"sources do not divide replicas={cfg.replicas}; valid: replicas a multiple of {S}, or "
            "data.replica_split=iid"
        )
    phase = plan_phase(cfg.phase)
    batch = "the weak phase's base_world * per_rank_batch" if isinstance(phase, WeakPhase) else "global_batch"
    for what, value in ((f"phase {batch}", phase.update_size), ("phase.offset", phase.offset)):
        if value % S:
            raise UserError(
                f"data.replica_split=by_source needs {what}={value} to be a multiple of the corpus's "
                f"S={S} sources, so that every replica's ids stay in its source; valid: a multiple of {S}"
            )


def check_fragments(cfg: TrainConfig) -> None:
    """Streaming DiLoCo: outer.fragments divides inner.H and the model's layers fill every fragment,
    outer.delay is below H/P; outer.assignment is derived (a run's own, or empty)."""
    fragments.check(cfg)
    if cfg.outer.assignment and cfg.outer.assignment != fragments.assignment(cfg):
        raise UserError(
            f"outer.assignment={cfg.outer.assignment!r} is derived from outer.fragments and the model; "
            "valid: leave it unset"
        )


def check_deadline(cfg: TrainConfig) -> None:
    """churn.deadline cuts rounds by the network clock's modelled step times: measured ones would make
    engines, processes and a resumed run disagree."""
    if cfg.churn.deadline and cfg.cluster.compute != "modelled":
        raise UserError(
            f"churn.deadline={cfg.churn.deadline!r} needs modelled compute, not "
            f"cluster.compute={cfg.cluster.compute!r}; valid: cluster.compute=modelled (e.g. cluster=h100), "
            "or churn.deadline=0"
        )


def check_overlap(cfg: TrainConfig) -> None:
    """outer.overlap=eager keeps an outer state per replica, which churn's absent and missing replicas
    have no rule for (docs/overlap.md): refused with churn."""
    if cfg.outer.overlap == "eager" and cfg.churn.enabled:
        raise UserError(
            "outer.overlap=eager with churn is not built (a replica's own outer state has no rule for "
            "a missed or absent round); valid: outer.overlap=delayed or none, or churn off"
        )


def check_schedule(cfg: TrainConfig) -> None:
    """The speeds fit R (under rounds they time the clock; under async they order arrivals), then what
    the schedule's entry (`schedule_table`) is not built with (its own fields under another schedule:
    `OuterConfig.check`)."""
    cluster = cfg.cluster
    cluster.check_replicas(cfg.replicas)
    slowed = cluster.replica_speeds or cluster.speed_sigma
    if slowed and cfg.churn.deadline:
        raise UserError(
            "cluster.replica_speeds or speed_sigma with churn.deadline is not built (the deadline reads the "
            "stragglers only); valid: equal speeds, or churn.deadline=0"
        )
    schedule_entry(cfg.outer.schedule).check(cfg)


def check_layout(cfg: TrainConfig) -> Decided:
    """What the config decides (`decided.decide`); UserError when processes=dist fits no process layout
    for its processes (the launcher's, or processes.nproc), W and R."""
    try:
        return decide(cfg)
    except LayoutError as error:
        raise UserError(str(error)) from None


def validate(cfg: TrainConfig) -> Decided:
    """Every check that can be made without the data; UserError (one line) at the first mistake.
    Returns what the config decides: the layout, device, backend and reduction the run reads after."""
    check_model(cfg.model)  # model.arch's entry (the table's, or one imported once) and the fields it takes
    cfg.check()
    data_source(cfg.data).check(cfg.data)  # what the data source needs of the data fields
    check_world(cfg)
    check_data_for_model(cfg)
    check_sources(cfg)
    decided = check_layout(cfg)
    check_shard(cfg, decided.layout)
    check_fragments(cfg)
    check_deadline(cfg)
    check_overlap(cfg)
    check_schedule(cfg)
    outer_optimizers.check(cfg.outer)  # a torch optimizer's path and arguments (imports torch for it)
    return decided


def check_device(device: str) -> None:
    """engine.device names a device this process has; UserError (one line) otherwise."""
    if not device.startswith("cuda"):
        return
    import torch  # only for a CUDA device: a CPU run's refusals never import it

    if not torch.cuda.is_available():
        raise UserError(
            f"engine.device={device!r} but this torch ({torch.__version__}) sees no CUDA device; valid: 'cpu'"
        )
    count, index = torch.cuda.device_count(), torch.device(device).index
    if index is not None and index >= count:
        raise UserError(
            f"engine.device={device!r} but this machine has {count} CUDA device(s); "
            f"valid: cuda:0..cuda:{count - 1}"
        )


def check_backend(cfg: TrainConfig, decided: Decided, local_processes: int) -> None:
    """processes.backend and the decided device can run `local_processes` ranks on this machine, checked
    before any starts (a rank would fail in init_process_group, its cause lost to the launcher's
    "exited with code 1"): nccl moves CUDA tensors only (a torch built with NCCL, a CUDA device,
    engine.device=cuda), and a CUDA rank takes the device of its local rank, one each. UserError
    (one line) otherwise; engine.device=cuda without CUDA is `check_device`'s to refuse."""
    import torch  # here: a refusal made from the config alone never imports it
    import torch.distributed as dist

    e = cfg.engine
    cuda = decided.device.startswith("cuda")
    if cfg.processes.backend == "nccl":
        if not torch.cuda.is_available():
            raise UserError(
                f"processes.backend=nccl needs CUDA devices, but CUDA is not available to this torch "
                f"({torch.__version__}); valid: processes.backend=gloo or auto (gloo on CPUs)"
            )
        if not dist.is_nccl_available():
            raise UserError(
                f"processes.backend=nccl but this torch ({torch.__version__}) is built without NCCL; "
                "valid: processes.backend=gloo or auto"
            )
        if not cuda:
            raise UserError(
                f"processes.backend=nccl moves CUDA tensors only, but engine.device={e.device!r}; "
                "valid: engine.device=cuda, or processes.backend=gloo or auto (gloo on CPUs)"
            )
    if cuda and torch.cuda.is_available() and local_processes > torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise UserError(
            f"processes=dist on engine.device={e.device!r} runs {local_processes} processes on this machine, "
            f"one CUDA device each, but it has {count} (fewer GPUs than processes); valid: at most "
            f"{count} processes per machine (processes.nproc, torchrun --nproc_per_node), or "
            "engine.device=cpu with processes.backend=gloo or auto"
        )
