"""The running network clock of a run (`Clock`): fed a run's rows in the order they are written (an
update's row, the sync rows landing after it, a held-out evaluation), it gives every update its
cumulative simulated seconds, every sync the split of the seconds since the previous landing, and the
run's totals on a cluster. Training feeds it as it writes (its state travels in the checkpoint); the
replay (`replay.clock_of`) feeds it a finished run's rows: one arithmetic, so one answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from omegaconf import OmegaConf

from hypertrain.clock.formulas import (
    Link,
    all_gather_s,
    all_to_all_s,
    exposed_s,
    modelled_compute_s,
    ring_allreduce_s,
    sharded_inner_s,
)
from hypertrain.codec_table import codec_entry
from hypertrain.config import ClusterConfig, ModelConfig, StragglerConfig, as_builtins
from hypertrain.model.shapes import count_params
from hypertrain.records.rows import SyncRow, UpdateRow
from hypertrain.schedule_table import BEFORE, schedule_entry

FP32_BYTES = 4


def straggler_factors(straggler: StragglerConfig, round_index: int, replicas: int) -> np.ndarray:
    """Each replica's slowdown in round `round_index`: `exp(sigma * z)`, z standard normals from
    `default_rng([seed, round])` in replica order; exactly 1 when sigma = 0."""
    if straggler.sigma == 0:
        return np.ones(replicas)
    z = np.random.default_rng([straggler.seed, round_index]).standard_normal(replicas)
    return np.exp(straggler.sigma * z)


def replica_speeds(cluster: ClusterConfig, replicas: int) -> list[float]:
    """Each replica's persistent speed v_m: `cluster.replica_speeds`, or `exp(speed_sigma * z)` with z
    R standard normals from numpy's `default_rng(speed_seed)` in replica order (1.0 each at sigma 0)."""
    if cluster.replica_speeds:
        return [float(v) for v in cluster.replica_speeds]
    if cluster.speed_sigma == 0:
        return [1.0] * replicas
    z = np.random.default_rng(cluster.speed_seed).standard_normal(replicas)
    return [float(v) for v in np.exp(cluster.speed_sigma * z)]


def block_params(model: dict) -> int:
    """The parameters of one layer block of a model (a resolved config's `model`): the model with one
    layer less the model without layers (the layers are alike)."""
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), model))
    return count_params(replace(cfg, n_layers=1)) - count_params(replace(cfg, n_layers=0))


@dataclass(frozen=True)
class Shape:
    """What of a run's config the clock reads: R, the L ranks of a replica, H, the fragments, their
    delay and the outer exchange's scheme; with `processes.shard` (FSDP2 in a replica) its `blocks`
    layer blocks of `block_params` parameters each (0 and 0 unsharded)."""

    replicas: int
    ranks_per_replica: int
    H: int
    fragments: int
    delay: int
    compress: str
    reduce: str
    overlap: str = "none"  # outer.overlap: a landing's reduction was taken at the fragment's last sync point
    schedule: str = BEFORE  # outer.schedule: its entry says if its clock orders arrivals (`Clock.arrival`)
    blocks: int = 0  # processes.shard=true: the FSDP2 units besides the root (model.n_layers); 0 unsharded
    block_params: int = 0  # the parameters of one of them

    @classmethod
    def of(cls, resolved: dict) -> Shape:
        """From a resolved config as plain containers (config.yaml, or `dataclasses.asdict(cfg)`); a config
        written before `processes.shard` is unsharded."""
        R, outer = int(resolved["replicas"]), resolved["outer"]
        sharded = bool((resolved.get("processes") or {}).get("shard", False))
        blocks = int(resolved["model"]["n_layers"]) if sharded else 0
        return cls(
            R,
            int(resolved["world"]["size"]) // R,
            int(resolved["inner"]["H"]),
            int(outer["fragments"]),
            int(outer["delay"]),
            str(outer["compress"]),
            str((outer.get("codec") or outer).get("reduce", "gather")),
            str(outer.get("overlap", "none")),
            str(outer.get("schedule", BEFORE)),
            blocks,
            block_params(resolved["model"]) if sharded else 0,
        )

    @property
    def arrival_clock(self) -> bool:
        """The schedule's entry orders its arrivals by this clock (`Clock.arrival`), keeping no split."""
        return schedule_entry(self.schedule).arrival_clock


class Clock:
    """The simulated seconds of one run on `cluster` (docs/clock.md, "The clock of a run").

    `run_params` is the run's parameter count and `active_params` the ones a token uses (a mixture of
    experts' top_k experts; all of a dense model's, the default); `model_params` N (optional) rescales
    every byte by N / run_params, modelled compute to `6 * N * active / run_params * tokens`, measured
    compute by N / run_params."""

    def __init__(
        self,
        shape: Shape,
        cluster: ClusterConfig,
        run_params: int,
        model_params: int | None = None,
        active_params: int | None = None,
    ):
        self.shape, self.cluster, self.run_params = shape, cluster, int(run_params)
        self.params = self.run_params if model_params is None else int(model_params)
        self.scale = self.params / self.run_params
        share = 1.0 if active_params is None else int(active_params) / self.run_params  # 1 when dense
        self.active = self.params * share
        self.intra, self.inter = Link.of(cluster.intra), Link.of(cluster.inter)
        block = shape.block_params * self.scale  # a sharded replica's units, at the timed size
        self.units = (self.params - shape.blocks * block, block)  # (the root: the rest, a block)
        self.total_s = self.compute_s = self.inner_s = self.outer_exposed_s = self.outer_hidden_s = 0.0
        self.since_compute_s = self.since_inner_s = 0.0  # since the previous landing
        self.recent: dict[int, float] = {}  # the compute seconds of the last H updates, by update count
        self.best: tuple[float, float] | None = None  # the lowest held-out loss and the clock at it
        self.round, self.ahead = 0, [0.0] * shape.replicas  # each replica's compute seconds in the round
        self.speeds = replica_speeds(cluster, shape.replicas)  # a step of replica m takes 1 / v_m as long

    def update(self, row: UpdateRow) -> float:
        """An `update` row (`update`, `round`, `loss`, `tokens`, `rank_seconds`): its compute, then the
        communication among a replica's L ranks (`inner_seconds`). Replicas run on their own
        between syncs: each stepping replica's step (modelled from its tokens, or the slowest process's
        measured seconds) times its straggler factor over its speed (`replica_speeds`) adds to its seconds
        since the round's start, and the
        update's compute is how far the slowest of them moved on (with every replica stepping, the round's
        largest factor times the step). Returns the clock at its end (`clock_s`), before any sync
        landing after it."""
        shape, cluster = self.shape, self.cluster
        stepped = row.stepped if row.loss else [True] * shape.replicas
        if cluster.compute == "modelled":
            one_replica_tokens = row.tokens / max(sum(stepped), 1)
            seconds = modelled_compute_s(self.active, one_replica_tokens, cluster.peak_flops, cluster.mfu)
        else:
            seconds = max(row.rank_seconds) * self.scale
        if row.round != self.round:  # the replicas start the round together
            self.round, self.ahead = int(row.round), [0.0] * shape.replicas
        before = max(self.ahead)
        factors = straggler_factors(cluster.straggler, self.round, shape.replicas)
        for m, did in enumerate(stepped):
            if did:
                self.ahead[m] += seconds * float(factors[m]) / self.speeds[m]
        compute = max(self.ahead) - before
        inner = self.inner_seconds(row)
        u = int(row.update)
        self.recent[u] = compute
        for old in [v for v in self.recent if v <= u - shape.H]:
            del self.recent[old]
        self.compute_s += compute
        self.inner_s += inner
        self.since_compute_s += compute
        self.since_inner_s += inner
        self.total_s += compute + inner
        return self.total_s

    def inner_seconds(self, row: UpdateRow) -> float:
        """An update's communication inside a replica of L ranks over `intra`: the ring all-reduce of the
        fp32 gradient; sharded (`Shape.blocks`), FSDP2's all-gathers per microbatch (the row's
        `grad_accum`, 1 when it holds none) and reduce-scatters per unit (`formulas.sharded_inner_s`)."""
        L = self.shape.ranks_per_replica
        if not self.shape.blocks:
            return ring_allreduce_s(FP32_BYTES * self.params, L, self.intra)
        root, block = (FP32_BYTES * n for n in self.units)
        return sharded_inner_s(root, block, self.shape.blocks, row.grad_accum or 1, L, self.intra)

    def sync(self, row: SyncRow) -> dict:
        """A `sync` row (`update`, `taken_at`, `params`, `comm_outer_bytes`, `payload_bytes`: what the
        landing recorded, never re-derived here): the outer exchange among the R replicas over the inter
        link by scheme (fp32 ring all-reduce of the synced parameters; a compressed payload's
        all-gather, or two_phase's all-to-all then the all-gather of shard means at the landing; low
        rank's gather of P and the 1-D tensors, then its gather of Q, `landing_bytes`, at the landing),
        the part started at the take hidden by the compute of the updates since. Returns the row's clock
        fields: the compute and inner seconds since the previous landing (on the first row of an
        update), outer exposed and hidden seconds, and `clock_s`."""
        shape = self.shape
        u, R = int(row.update), shape.replicas
        hideable = at_landing = 0.0
        if not row.comm_outer_bytes:  # R = 1, or no replica stepped: nothing was exchanged
            pass
        elif codec_entry(shape.compress).lossless:
            hideable = ring_allreduce_s(FP32_BYTES * row.params * self.scale, R, self.inter)
        elif shape.reduce == "two_phase" and codec_entry(shape.compress).two_phase:
            b = row.figures["payload_bytes"] * self.scale
            hideable = at_landing = all_to_all_s(b, R, self.inter)
        elif row.figures.get("landing_bytes"):  # low rank: P's gather at the take, Q's at the landing
            second = row.figures["landing_bytes"] * self.scale
            hideable = all_gather_s(row.figures["payload_bytes"] * self.scale - second, R, self.inter)
            at_landing = all_gather_s(second, R, self.inter)
        else:
            hideable = all_gather_s(row.figures["payload_bytes"] * self.scale, R, self.inter)
        since = range(row.taken_at + 1, u + 1)
        exposed = exposed_s(hideable, sum(self.recent.get(v, 0.0) for v in since))
        split = {
            "clock_compute_s": self.since_compute_s,
            "clock_inner_s": self.since_inner_s,
            "clock_outer_exposed_s": exposed + at_landing,
            "clock_outer_hidden_s": hideable - exposed,
        }
        self.since_compute_s = self.since_inner_s = 0.0
        self.outer_exposed_s += split["clock_outer_exposed_s"]
        self.outer_hidden_s += split["clock_outer_hidden_s"]
        self.total_s += split["clock_outer_exposed_s"]
        return split | {"clock_s": self.total_s}

    def arrival(self, clock_s: float) -> float:
        """outer.schedule=async: a server update at `clock_s`, the seconds the run's own arrival clock
        gave it (docs/async.md), which ordered the arrivals: the clock stands there now. Compute and
        communication overlap across replicas, so none of the split is kept (`summary`: None). Returns
        the clock now."""
        self.total_s = float(clock_s)
        return self.total_s

    def heldout(self, loss: float | None) -> float:
        """A held-out loss of the global weights as they are now (an `eval` row, DiLoCo's sync row after
        its landing, an async `arrival` row): kept when it is the lowest finite one so far. Returns the
        clock now."""
        if loss is not None and math.isfinite(loss) and (self.best is None or loss < self.best[0]):
            self.best = (float(loss), self.total_s)
        return self.total_s

    def summary(self) -> dict:
        """The run's totals under `clock/`: cluster, parameters timed, seconds, compute utilization
        (compute / total), the lowest held-out loss and the clock when it was reached; outer.schedule=
        async's split (compute, inner, outer, utilization) None: its clock keeps none (`arrival`)."""
        split = {
            "clock/compute_s": self.compute_s,
            "clock/inner_s": self.inner_s,
            "clock/outer_exposed_s": self.outer_exposed_s,
            "clock/outer_hidden_s": self.outer_hidden_s,
            "clock/compute_utilization": self.compute_s / self.total_s if self.total_s > 0 else 1.0,
        }
        if self.shape.arrival_clock:
            split = dict.fromkeys(split)
        return {
            "clock/cluster": self.cluster.name,
            "clock/params": self.params,
            "clock/total_s": self.total_s,
            **split,
            "clock/best_heldout_loss": None if self.best is None else self.best[0],
            "clock/time_to_best_s": None if self.best is None else self.best[1],
        }

    _FLOATS = ("total_s", "compute_s", "inner_s", "outer_exposed_s", "outer_hidden_s")
    _FLOATS += ("since_compute_s", "since_inner_s")

    def state_dict(self) -> dict:
        """Plain numbers: what a checkpoint keeps so that a resumed run's clock goes on exactly."""
        return {
            "cluster": as_builtins(self.cluster),
            "params": self.params,
            **{name: getattr(self, name) for name in self._FLOATS},
            "recent": sorted(self.recent.items()),
            "best": None if self.best is None else list(self.best),
            "round": self.round,
            "ahead": list(self.ahead),
        }

    def load_state_dict(self, saved: dict) -> None:
        for name in self._FLOATS:
            setattr(self, name, float(saved[name]))
        self.recent = {int(u): float(s) for u, s in saved["recent"]}
        self.best = None if saved["best"] is None else (float(saved["best"][0]), float(saved["best"][1]))
        self.round = int(saved["round"])
        self.ahead = [float(x) for x in saved["ahead"]]
