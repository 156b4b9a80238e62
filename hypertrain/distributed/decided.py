"""What a run's config decides, decided once: `decide(cfg)` gives `Decided`, the process layout (with
its world and replica arithmetic), the device, torch.distributed's backend and the sync's reduction.

The preflight builds it from the validated config (`preflight.checks.validate`) and hands it on with
the prepared run (`PreparedRun.decided`, the self-launch's `WorkerJob.decided`); the memory estimate,
the launchers, the session and the sync read it and decide nothing again. A process that runs the entry
itself (a torchrun or srun rank) builds its own in its own preflight, by this same `decide`; a worker
adds only its local rank's device (`Decided.on_rank`). No torch: the refusals stay torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypertrain.codec_table import codec_entry
from hypertrain.config import OuterConfig, TrainConfig
from hypertrain.distributed.layouts import Layout, choose_layout, process_count


@dataclass(frozen=True)
class Decided:
    """What the config decides: `layout` (processes=dist's; None for one process), `device` (where the
    replicas train: engine.device, a dist worker's own once `on_rank`), `backend` (torch.distributed's,
    gloo or nccl; None for one process) and `reduction` (the sync's: `exact` fp32 sums, or a codec's
    payloads reduced by `gather` or `two_phase`)."""

    layout: Layout | None
    device: str
    backend: str | None
    reduction: str

    @property
    def processes(self) -> int:
        """P: the processes that train the run (1 without processes=dist)."""
        return 1 if self.layout is None else self.layout.processes

    def on_rank(self, local_rank: int) -> Decided:
        """This run as the worker of local rank `local_rank` trains it: a CUDA run's worker takes the
        device of its local rank (one each), a CPU run's the CPU."""
        return replace(self, device=f"cuda:{local_rank}" if self.device.startswith("cuda") else "cpu")


def reduction(outer: OuterConfig) -> str:
    """The sync's reduction: `exact` (outer.compress=none: fp32 sums), else outer.codec.reduce."""
    return "exact" if codec_entry(outer.compress).lossless else outer.codec.reduce


def backend(cfg: TrainConfig) -> str | None:
    """processes=dist's backend: processes.backend, `auto` being nccl on CUDA devices, else gloo."""
    if cfg.processes.name != "dist":
        return None
    if cfg.processes.backend != "auto":
        return cfg.processes.backend
    return "nccl" if cfg.engine.device.startswith("cuda") else "gloo"


def decide(cfg: TrainConfig, processes: int | None = None) -> Decided:
    """The run's `Decided`, from its validated config; `processes`: P to lay out (a SLURM job's tasks),
    else the launcher's count or processes.nproc (`layouts.process_count`). LayoutError (one line)
    when processes=dist fits no layout."""
    layout = None
    if cfg.processes.name == "dist":
        count = process_count(cfg.processes.nproc, cfg.world.size) if processes is None else processes
        layout = choose_layout(count, cfg.world.size, cfg.replicas, cfg.processes.layout)
    return Decided(layout, cfg.engine.device, backend(cfg), reduction(cfg.outer))
