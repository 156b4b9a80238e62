"""The DiLoCo sync as one object per fragment (`FragmentSync`, in the shape of torchft's
`_StreamingDiLoCoFragment`; docs/design.md, "The sync pipeline"): built once with the run's state, it
holds its parameters' global weights, outer momentum and error-feedback buffers (views), its sync in
flight (`pending`; the state's checkpoint saves them all) and its reduction, the one the preflight
decided (`distributed.decided`; `ExactReducer`: fp32 sums; `CodecReducer`: a codec, gathered or
two_phase). `take` forms this process's replicas' pseudo-gradients and starts the reduction; `land`
waits for its mean, steps the global weights (`outer.outer_step`), merges them into every replica,
applies the inner state policy and returns a typed `Landing`. Between the two the replicas may train
on (outer.delay). Simulation and real processes differ only in their `Collectives`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hypertrain.config import OuterConfig, TrainConfig
from hypertrain.diloco.churn import RoundFacts
from hypertrain.diloco.codecs import Blocks
from hypertrain.diloco.communication import compressed_mean, exact_mean, ring_allreduce_bytes
from hypertrain.diloco.outer import (
    OuterState,
    outer_step,
    pseudo_gradient_sum,
    pseudo_gradients,
    unflatten,
    weights_norm,
)
from hypertrain.diloco.pending import Pending, Reduced, Reduction
from hypertrain.distributed import decided
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.model.transformer import Params
from hypertrain.optim.inner import OptState, sync_inner_states


@dataclass
class Landing:
    """A landed sync, typed: its fragment, the update count its pseudo-gradient was taken at, the
    fragment's parameter count, the replicas that took part, the mean pseudo-gradient's norm, the norm
    of the fragment's global weights before the outer step, the bytes one participant sent for it
    (the fp32 ring's, or a codec's), a codec's payload bytes and errors, what real processes measured
    since the previous landing, and churn's facts (who contributed, was absent, missed; skipped)."""

    fragment: int
    taken_at: int
    params: int
    synced: int = 0
    delta_norm: float = 0.0
    theta_norm: float = 0.0
    outer_bytes: int = 0
    payload_bytes: int | None = None
    compress_error: list[float | None] | None = None
    measured: dict = field(default_factory=dict)
    churn: RoundFacts | None = None

    def codec_figures(self) -> dict:
        """A codec's fields of the sync row (`payload_bytes`, `compress_error`); none for fp32."""
        if self.payload_bytes is None:
            return {}
        return {"payload_bytes": self.payload_bytes, "compress_error": self.compress_error}


class ExactReducer:
    """outer.compress=none: the fp32 sum of the pseudo-gradients and their count, one all-reduce
    (`communication.exact_mean`); one participant sends the ideal ring's bytes."""

    def start(self, sync: FragmentSync, replica_params: Params, active, count: int, groups) -> Reduction:
        return exact_mean(pseudo_gradient_sum(sync.theta, replica_params, active), groups)

    def sent_bytes(self, result: Reduced, sync: FragmentSync) -> int:
        return ring_allreduce_bytes(sync.cfg.replicas, sync.params)


class CodecReducer:
    """outer.compress=a codec: each replica's payload, with its error-feedback buffer, reduced by
    outer.reduce (`communication.compressed_mean`); one participant sends what the codec reports."""

    def __init__(self, outer: OuterConfig, blocks: Blocks):
        self.outer, self.blocks = outer, blocks

    def start(self, sync: FragmentSync, replica_params: Params, active, count: int, groups) -> Reduction:
        errors = sync.flat_errors()
        deltas = pseudo_gradients(sync.theta, replica_params)
        reduction = compressed_mean(self.outer, deltas, errors, active, self.blocks, groups, count)
        if errors is not None:
            sync.store_errors(errors)
        return reduction

    def sent_bytes(self, result: Reduced, sync: FragmentSync) -> int:
        return result.sent_bytes


class FragmentSync:
    """The sync of the parameters `names` (fragment `index`; all of them with DiLoCo's one fragment).

    The run state holds one per fragment (`RunState.syncs`) and saves what it owns: views of its
    parameters' global weights, outer momentum and each local replica's error buffer (so
    `state.load_state_dict`, which copies in place, reaches them) and its `pending` sync, taken and not
    landed. Its reducer is built here, once, for the decided reduction."""

    def __init__(
        self,
        cfg: TrainConfig,
        index: int,
        names: list[str],
        theta: Params,
        outer: OuterState,
        errors: list[Params] | None,
        reduction: str | None = None,
    ):
        """Fragment `index`'s sync of the parameters `names`, of the run's global weights `theta`,
        outer state `outer` and local replicas' error buffers `errors` (None without error feedback),
        reduced by `reduction` (the run's `Decided.reduction`; None: `decided.reduction(cfg.outer)`)."""
        self.cfg, self.names, self.index = cfg, list(names), index
        self.pending: Pending | None = None
        self.theta = {n: theta[n] for n in self.names}
        self.outer = OuterState({n: outer.momentum[n] for n in self.names})
        self.errors = None if errors is None else [{n: e[n] for n in self.names} for e in errors]
        self.params = sum(t.numel() for t in self.theta.values())
        self.whole_model = len(self.names) == len(theta)
        reduction = decided.reduction(cfg.outer) if reduction is None else reduction
        if reduction == "exact":
            self.reducer: ExactReducer | CodecReducer = ExactReducer()
        else:
            blocks = Blocks(tuple(t.numel() for t in self.theta.values()), cfg.outer.block)
            self.reducer = CodecReducer(cfg.outer, blocks)

    def flat_errors(self):
        """This fragment's part of each local replica's error buffer, flat: [R_local, n]; None without
        error feedback."""
        if self.errors is None:
            return None
        return torch.cat([torch.cat([e[n].reshape(1, -1) for n in self.names], dim=1) for e in self.errors])

    def store_errors(self, flat) -> None:
        """The updated flat buffers back into the state."""
        for row, e in zip(flat, self.errors, strict=True):
            for n, part in zip(self.names, row.split([e[n].numel() for n in self.names]), strict=True):
                e[n].copy_(part.view_as(e[n]))

    def take(
        self,
        params: list[Params],
        stepped: list[bool],
        count: int,
        groups: Collectives,
        churn: RoundFacts | None = None,
    ) -> Pending:
        """Start this fragment's sync at update count `count` (its `pending`): this process's replicas'
        pseudo-gradients (theta - theta_m over the replicas that `stepped`) handed to the reducer,
        which starts their mean over every process's replicas. `churn`: the facts of the sync."""
        device = next(iter(self.theta.values())).device
        active = torch.tensor(stepped, device=device)
        replica_params = {n: torch.cat([p[n] for p in params]) for n in self.names}
        reduction = self.reducer.start(self, replica_params, active, count, groups)
        self.pending = Pending(self.index, count, list(stepped), reduction, churn)
        return self.pending

    @torch.no_grad()
    def land(self, inner: list[OptState], params: list[Params] | None, groups: Collectives) -> Landing:
        """Finish the `pending` sync: wait for the mean pseudo-gradient, step the global weights with
        the outer state, merge them into every local replica's weights `params` (None: the replicas
        restart from the global weights), and apply the inner state policy to these parameters of the
        local replicas' inner optimizer states `inner`."""
        cfg, pending, self.pending = self.cfg, self.pending, None
        assert pending is not None and pending.fragment == self.index, (pending, self.index)
        landing = Landing(pending.fragment, pending.taken_at, self.params, churn=pending.churn)
        communicated = pending.reduction.wait()
        if communicated is not None:  # None: nobody stepped, and momentum must not move theta
            mean = communicated.mean
            landing.synced = communicated.synced
            landing.theta_norm = weights_norm(self.theta)  # before the outer step changes theta in place
            landing.delta_norm = math.sqrt(float(mean.double().pow(2).sum()))
            outer_step(cfg.outer, self.theta, unflatten(mean, self.theta), self.outer)
            landing.outer_bytes = self.reducer.sent_bytes(communicated, self)
            landing.payload_bytes = communicated.payload_bytes
            landing.compress_error = communicated.compress_error
        if params is not None:
            merge(self.theta, params, cfg.outer.merge_alpha)
        if communicated is not None:
            active = torch.tensor(pending.stepped, device=inner[0].step.device)
            sync_inner_states(
                cfg.inner,
                inner,
                active,
                groups.sum_over_replicas,
                groups.max_over_replicas,
                names=None if self.whole_model else self.names,
                fragment=pending.fragment,
            )
        return landing


def merge(theta: Params, params: list[Params], alpha: float) -> None:
    """Each replica's weights of `theta`'s parameters become lerp(theta_new, theta_m_now, alpha)
    (torchft's fragment_update_alpha): the new global weights at alpha = 0, exactly."""
    for p in params:
        for n, global_new in theta.items():
            local = p[n][0]
            if alpha == 0.0:
                local.copy_(global_new)
            else:
                local.copy_(torch.lerp(global_new.to(local.dtype), local, alpha))


def sync(
    cfg: TrainConfig,
    state,
    params: list[Params],
    stepped: list[bool],
    groups: Collectives | None = None,
) -> tuple[float, int]:
    """DiLoCo's sync of every parameter of the run `state` (a `diloco.state.RunState`, which imports
    this module) at once, take and land together (the replicas then restart from the global weights):
    the mean pseudo-gradient's norm and the replicas that took part."""
    groups = groups or ReplicaGroups(cfg.replicas)
    whole = FragmentSync(cfg, 0, list(state.theta), state.theta, state.outer, state.errors)
    whole.take(params, stepped, state.next_update, groups)
    landing = whole.land(state.inner, None, groups)
    return landing.delta_norm, landing.synced
