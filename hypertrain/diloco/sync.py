"""The DiLoCo sync as one object per fragment (`FragmentSync`, in the shape of torchft's
`_StreamingDiLoCoFragment`; docs/design.md, "The sync pipeline"): built once with the run's state, it
holds its parameters' global weights, outer momentum and error-feedback buffers (views), its sync in
flight (`pending`; the state's checkpoint saves them all) and its reduction, the one the preflight
decided (`distributed.decided`; `ExactReducer`: fp32 sums; `CodecReducer`: a codec, gathered or
two_phase). `take` forms this process's replicas' pseudo-gradients and starts the reduction; `land`
waits for its mean, steps the global weights (its outer optimizer's step, built once from the table
`optim.outer`: one per fragment, under eager one per local replica), merges them into every replica,
applies the inner state policy and returns a typed `Landing`. Between the two the replicas may train
on (outer.delay). Simulation and real processes differ only in their `Collectives`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hypertrain.codec_table import codec_entry
from hypertrain.codecs.kernels import Blocks
from hypertrain.codecs.tiles import blocks_and_order
from hypertrain.config import OuterConfig, TrainConfig
from hypertrain.diloco.churn import RoundFacts
from hypertrain.diloco.exchange.communication import (
    compressed_mean,
    contribution_bits,
    exact_mean,
    ring_allreduce_bytes,
)
from hypertrain.diloco.exchange.lowrank import Factors, lowrank_mean
from hypertrain.diloco.exchange.shard_windows import Windows, windowed_mean
from hypertrain.diloco.outer import (
    OuterState,
    OuterStep,
    pseudo_gradient_sum,
    pseudo_gradients,
    unflatten,
    weights_norm,
)
from hypertrain.diloco.pending import Pending, Reduced, Reduction
from hypertrain.distributed import decided
from hypertrain.distributed.groups import Collectives, ReplicaGroups
from hypertrain.model.shapes import param_shapes
from hypertrain.model.transformer import Params
from hypertrain.optim.inner import OptState, sync_inner_states
from hypertrain.optim.outer import outer_optimizer


@dataclass
class Landing:
    """A landed sync, typed: its fragment, the update count its pseudo-gradient was taken at, the
    fragment's parameter count, the replicas that took part, the mean pseudo-gradient's norm, the norm
    of the fragment's global weights before the outer step, the bytes one participant sent for it
    (the fp32 ring's, or a codec's), a codec's payload bytes and errors, the bits each replica's
    contribution sent (`communication.contribution_bits`; None for one that did not take part), what
    real processes measured since the previous landing, and churn's facts (who contributed, was
    absent, missed; skipped)."""

    fragment: int
    taken_at: int
    params: int
    synced: int = 0
    delta_norm: float = 0.0
    theta_norm: float = 0.0
    outer_bytes: int = 0
    payload_bytes: int | None = None
    compress_error: list[float | None] | None = None
    bits: list[int | None] | None = None
    measured: dict = field(default_factory=dict)
    churn: RoundFacts | None = None
    # outer.overlap=eager: the largest relative distance ||theta_m - mean|| / ||mean|| of a replica's
    # outer weights of the fragment from their mean over replicas, after this landing; None otherwise
    outer_spread: float | None = None
    # of `payload_bytes`, the part exchanged at the landing (low rank's Q factors); None otherwise
    landing_bytes: int | None = None
    # a copy of the global weights this landing left, kept (on the writer, with one fragment) when
    # another landing follows it after the same update (outer.overlap's flush): its row's held-out loss
    # is of the weights that existed then, not of those the later landing makes; None otherwise
    weights: Params | None = None

    def codec_figures(self) -> dict:
        """A codec's fields of the sync row (`payload_bytes`, `compress_error`, low rank's
        `landing_bytes`); none for fp32."""
        if self.payload_bytes is None:
            return {}
        figures = {"payload_bytes": self.payload_bytes, "compress_error": self.compress_error}
        return figures if self.landing_bytes is None else figures | {"landing_bytes": self.landing_bytes}


class ExactReducer:
    """outer.compress=none: the fp32 sum of the pseudo-gradients and their count, one all-reduce
    (`communication.exact_mean`); one participant sends the ideal ring's bytes."""

    def start(
        self, sync: FragmentSync, replica_params: Params, active, count: int, groups, weights=None
    ) -> Reduction:
        """`weights` (outer.mean_weights=tokens): every replica's `server.token_weights`, fp32 [R],
        which sum to 1 over the replicas that stepped: one all-reduce of this process's
        [sum_m w_m delta_m, count] gives the weighted mean itself (None: the plain sum and count)."""
        local_weights = None if weights is None else weights[groups.replicas]
        local = pseudo_gradient_sum(sync.theta, replica_params, active, local_weights)
        return exact_mean(local, groups, weighted=weights is not None)

    def start_taken(self, sync: FragmentSync, deltas, errors, active, count: int, groups, weights=None):
        """outer.overlap: the reduction of the flat pseudo-gradients `deltas` [R_local, n] that were
        taken (weighted as `start`), and each replica's own contribution (its pseudo-gradient, 0 where
        it did not step)."""
        own = torch.where(active[:, None], deltas, 0.0)
        summed = own if weights is None else weights[groups.replicas][:, None] * own
        local = torch.cat([summed.sum(0), active.sum().to(own.dtype).reshape(1)])
        return exact_mean(local, groups, weighted=weights is not None), own

    def sent_bytes(self, result: Reduced, sync: FragmentSync) -> int:
        return ring_allreduce_bytes(sync.cfg.replicas, sync.params)

    def took_part(self, result: Reduced, stepped: list[bool], groups: Collectives) -> list[bool]:
        """Every replica's flag, in replica order: whether its pseudo-gradient is in the mean. The sum
        holds only their count, so when some did not take part each process's flags are combined (one
        all-reduce of R numbers, on every process at the same landing: the count is the same on all)."""
        R = groups.total_replicas
        if result.synced == R:
            return [True] * R
        flags = torch.zeros(R, device=result.mean.device)
        flags[groups.replicas] = torch.tensor(stepped, dtype=flags.dtype, device=flags.device)
        return [bool(x) for x in groups.max_over_replicas(flags).tolist()]


class CodecReducer:
    """outer.compress=a codec: each replica's payload, with its error-feedback buffer, reduced by
    outer.codec.reduce (`communication.compressed_mean`); one participant sends what the codec reports."""

    def __init__(self, outer: OuterConfig, blocks: Blocks, order=None):
        """`order`: the blocks' order over the fragment's parameters (outer.codec.tile; None: their own)."""
        self.outer, self.blocks, self.order = outer, blocks, order

    def start(
        self, sync: FragmentSync, replica_params: Params, active, count: int, groups, weights=None
    ) -> Reduction:
        """`weights`: every replica's token weight, fp32 [R]: the mean is `sum_m w_m d_m` of the
        decoded payloads (`communication.compressed_mean`); None: uniform."""
        errors = sync.flat_errors()
        deltas = pseudo_gradients(sync.theta, replica_params)
        reduction = compressed_mean(
            self.outer, deltas, errors, active, self.blocks, groups, count, self.order, weights
        )
        if errors is not None:
            sync.store_errors(errors)
        return reduction

    def start_taken(self, sync: FragmentSync, deltas, errors, active, count: int, groups, weights=None):
        """outer.overlap: as `start`, from the flat pseudo-gradients taken and the error buffers before
        the take (updated in place); each replica's own contribution is its decoded payload."""
        reduction = compressed_mean(
            self.outer, deltas, errors, active, self.blocks, groups, count, self.order, weights
        )
        return reduction, reduction.own

    def sent_bytes(self, result: Reduced, sync: FragmentSync) -> int:
        return result.sent_bytes

    def took_part(self, result: Reduced, stepped: list[bool], groups: Collectives) -> list[bool] | None:
        """Every replica's flag, from the messages' headers (its compression error: None where it did
        not take part); None for a sync in flight read from a checkpoint that kept no errors."""
        if result.compress_error is None:
            return None
        return [error is not None for error in result.compress_error]


class ShardedCodecReducer(CodecReducer):
    """outer.compress=a codec with processes.shard=true: this rank's shards of the pseudo-gradient and
    error buffer, encoded over the whole blocks they touch (a quantizer without tiles or a transform), or
    over the whole tensors gathered (any other codec: `Windows.gathered_whole`), by
    `shard_windows.windowed_mean`, exchanged over its cross-replica group; one participant's bytes are
    the replica's ranks' together."""

    def __init__(self, outer: OuterConfig, shapes: dict[str, tuple[int, ...]]):
        """`shapes`: the fragment's whole tensors."""
        self.outer, self.shapes, self.windows = outer, shapes, None

    def _windows(self, groups) -> Windows:
        """The unsharded run's blocks (of the whole shapes), cut on this rank's shards where a quantizer's
        blocks allow it, else every tensor whole."""
        if self.windows is None:
            outer, j, L = self.outer, groups.local_rank, groups.L
            shapes = list(self.shapes.values())
            if codec_entry(outer.compress).windowed(outer.codec):
                width = blocks_and_order(shapes, outer.codec.block, 0)[0].block
                self.windows = Windows.of(self.shapes, width, j, L)
            else:
                blocks, order = blocks_and_order(shapes, outer.codec.block, outer.codec.tile)
                self.windows = Windows.gathered_whole(self.shapes, blocks, order, j, L)
        return self.windows

    def start(
        self, sync: FragmentSync, replica_params: Params, active, count: int, groups, weights=None
    ) -> Reduction:
        errors = sync.flat_errors()
        deltas = pseudo_gradients(sync.theta, replica_params)
        reduction, _ = self.start_taken(sync, deltas, errors, active, count, groups, weights)
        if errors is not None:
            sync.store_errors(errors)
        return reduction

    def start_taken(self, sync: FragmentSync, deltas, errors, active, count: int, groups, weights=None):
        """As `start` from the flat shards taken and the error buffers before the take (updated in place);
        each replica's own contribution is its decoded payload, this rank's values of it (outer.overlap)."""
        reduction = windowed_mean(
            self.outer, deltas, errors, active, self._windows(groups), groups, count, weights
        )
        return reduction, reduction.own


class LowRankReducer:
    """outer.compress=lowrank: PowerSGD's rank-r factors of each matrix, warm-started from the fragment's
    `lowrank_q`, all-gathered twice and summed in replica order, the 1-D tensors exact
    (`lowrank.lowrank_mean`); the error buffers and warm starts are updated when the mean is waited for.
    One participant sends what the gather of the factors reports."""

    def __init__(self, factors: Factors):
        self.factors = factors

    def start(
        self, sync: FragmentSync, replica_params: Params, active, count: int, groups, weights=None
    ) -> Reduction:
        """`weights`: every replica's token weight, fp32 [R] (`lowrank.lowrank_mean`); None: uniform."""
        deltas = pseudo_gradients(sync.theta, replica_params)
        errors = sync.flat_errors()
        store = None if errors is None else sync.store_errors
        decay, q = sync.cfg.outer.codec.error_decay, sync.lowrank_q
        return lowrank_mean(self.factors, deltas, errors, active, q, groups, store, count, decay, weights)

    def start_taken(self, sync: FragmentSync, deltas, errors, active, count: int, groups, weights=None):
        raise NotImplementedError("outer.compress=lowrank with outer.overlap is refused by OuterConfig.check")

    def sent_bytes(self, result: Reduced, sync: FragmentSync) -> int:
        return result.sent_bytes

    took_part = CodecReducer.took_part  # the second gather's headers: each one's error, None if absent


class FragmentSync:
    """The sync of the parameters `names` (fragment `index`; all of them with DiLoCo's one fragment).

    The run state holds one per fragment (`RunState.syncs`) and saves what it owns: views of its
    parameters' global weights, outer momentum and each local replica's error buffer (so
    `state.load_state_dict`, which copies in place, reaches them), its `pending` sync, taken and not
    landed, and its outer optimizer's state (`stepper`; under eager each local replica's,
    `replica_steppers`). Its reducer and outer optimizers are built here, once."""

    def __init__(
        self,
        cfg: TrainConfig,
        index: int,
        names: list[str],
        theta: Params,
        outer: OuterState,
        errors: list[Params] | None,
        replica_outer: list[dict] | None = None,
        reduction: str | None = None,
        lowrank_q: Params | None = None,
    ):
        """Fragment `index`'s sync of the parameters `names`, of the run's global weights `theta`,
        outer state `outer` and local replicas' error buffers `errors` (None without error feedback);
        `replica_outer`: eager's per-replica outer weights and momentum ({"theta", "momentum"} each; the
        momentum {} for an outer optimizer that keeps none in the run state);
        reduced by `reduction` (the run's `Decided.reduction`; None: `decided.reduction(cfg.outer)`);
        `lowrank_q`: outer.compress=lowrank's warm start Q of every matrix of the model (`RunState`'s)."""
        self.cfg, self.names, self.index = cfg, list(names), index
        self.pending: Pending | None = None
        # outer.overlap: the sync taken a period earlier, due to land now (set by `take`, landed by `land`)
        self.overlap, self.due = cfg.outer.overlap, None
        # outer.overlap=eager: each local replica's own outer weights and momentum (views, [1, ...])
        self.replica_theta: list[Params] | None = None
        self.replica_momentum: list[Params] | None = None
        if replica_outer is not None:
            self.replica_theta = [{n: o["theta"][n] for n in self.names} for o in replica_outer]
            self.replica_momentum = [_kept(o["momentum"], self.names) for o in replica_outer]
        self.theta = {n: theta[n] for n in self.names}
        self.outer = OuterState(_kept(outer.momentum, self.names))
        optimizer = outer_optimizer(cfg.outer)
        self.stepper: OuterStep = optimizer.build(cfg.outer, self.theta, self.outer.momentum, cfg.replicas)
        self.replica_steppers: list[OuterStep] | None = None
        if replica_outer is not None:
            self.replica_steppers = [
                optimizer.build(cfg.outer, theta_m, momentum_m, cfg.replicas)
                for theta_m, momentum_m in zip(self.replica_theta, self.replica_momentum, strict=True)
            ]
        self.errors = None if errors is None else [{n: e[n] for n in self.names} for e in errors]
        self.params = sum(t.numel() for t in self.theta.values())
        if cfg.processes.shard:  # this process holds dim-0 shards: a sync's figures count whole tensors
            whole = param_shapes(cfg.model)
            self.params = sum(math.prod(whole[n]) for n in self.names)
        self.whole_model = len(self.names) == len(theta)
        reduction = decided.reduction(cfg.outer) if reduction is None else reduction
        self.lowrank_q = None
        if reduction == "exact":
            self.reducer: ExactReducer | CodecReducer | LowRankReducer = ExactReducer()
        elif codec_entry(cfg.outer.compress).factored:
            self.lowrank_q = {n: lowrank_q[n] for n in self.names if n in lowrank_q}
            shapes = {n: tuple(t.shape) for n, t in self.theta.items()}
            self.reducer = LowRankReducer(Factors.of(shapes, cfg.outer.lowrank.rank))
        elif cfg.processes.shard:  # the unsharded run's blocks, of the whole tensors
            shapes = {n: tuple(param_shapes(cfg.model)[n]) for n in self.names}
            self.reducer = ShardedCodecReducer(cfg.outer, shapes)
        else:
            shapes = [tuple(t.shape) for t in self.theta.values()]
            blocks, order = blocks_and_order(shapes, cfg.outer.codec.block, cfg.outer.codec.tile)
            self.reducer = CodecReducer(cfg.outer, blocks, order)

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
        weights: list[float] | None = None,
    ) -> Pending:
        """Start this fragment's sync at update count `count` (its `pending`): this process's replicas'
        pseudo-gradients (theta - theta_m over the replicas that `stepped`) handed to the reducer,
        which starts their mean over every process's replicas. `churn`: the facts of the sync.
        `weights`: outer.mean_weights=tokens' weights of every replica (R of them, summing to 1 over
        those that stepped; `diloco.rounds.token_weights`), the same on every process; None: uniform."""
        device = next(iter(self.theta.values())).device
        active = torch.tensor(stepped, device=device)
        replica_params = {n: torch.cat([p[n] for p in params]) for n in self.names}
        w = None if weights is None else torch.tensor(weights, dtype=torch.float32, device=device)
        if self.overlap != "none":
            return self._take_overlapped(replica_params, stepped, count, groups, churn, w)
        reduction = self.reducer.start(self, replica_params, active, count, groups, w)
        self.pending = Pending(self.index, count, list(stepped), reduction, churn)
        return self.pending

    def _take_overlapped(
        self, replica_params: Params, stepped, count: int, groups, churn, weights
    ) -> Pending:
        """outer.overlap: the pseudo-gradients from the weights each replica started the period from
        (the global weights, or eager's own outer weights), their reduction started and left in flight
        for a whole period, weighted by `weights` (those of the window it took; None: uniform); the
        sync taken a period earlier becomes `due`."""
        origin = self.theta
        if self.replica_theta is not None:
            origin = {n: torch.cat([o[n] for o in self.replica_theta]) for n in self.names}
        errors = self.flat_errors()
        taken = Pending(
            self.index,
            count,
            list(stepped),
            None,
            churn,
            taken=pseudo_gradients(origin, replica_params),
            errors_before=None if errors is None else errors.clone(),
            weights=weights,
        )
        self.issue(taken, groups, store=True)
        self.due, self.pending = self.pending, taken
        return taken

    def issue(self, pending: Pending, groups: Collectives, store: bool = False) -> None:
        """Start `pending`'s reduction from what it took (at the take; on resume, again: the same
        numbers); `store`: keep the updated error buffers (at the take only)."""
        active = torch.tensor(pending.stepped, device=pending.taken.device)
        errors = None if pending.errors_before is None else pending.errors_before.clone()
        pending.reduction, pending.own = self.reducer.start_taken(
            self, pending.taken, errors, active, pending.taken_at, groups, pending.weights
        )
        if store and errors is not None:
            self.store_errors(errors)

    @torch.no_grad()
    def land(self, inner: list[OptState], params: list[Params] | None, groups: Collectives) -> Landing:
        """Finish the `pending` sync: wait for the mean pseudo-gradient, step the global weights with
        the outer state, merge them into every local replica's weights `params` (None: the replicas
        restart from the global weights), and apply the inner state policy to these parameters of the
        local replicas' inner optimizer states `inner`."""
        if self.overlap != "none":
            return self._land_overlapped(inner, params, groups, last=False)
        cfg, pending, self.pending = self.cfg, self.pending, None
        assert pending is not None and pending.fragment == self.index, (pending, self.index)
        landing = Landing(pending.fragment, pending.taken_at, self.params, churn=pending.churn)
        communicated = pending.reduction.wait()
        if communicated is not None:  # None: nobody stepped, and momentum must not move theta
            self._record(landing, communicated, pending.stepped, groups)
            self.stepper.step(unflatten(communicated.mean, self.theta))
        if params is not None:
            merge(self.theta, params, cfg.outer.merge_alpha)
        if communicated is not None:
            self._sync_inner(inner, pending.stepped, groups)
        return landing

    def _record(
        self, landing: Landing, communicated: Reduced, stepped: list[bool], groups: Collectives
    ) -> None:
        """The landed reduction's figures on `landing` (`stepped`: this process's replicas' flags at the
        take), the weights' norm taken before the outer step changes them in place."""
        landing.synced = communicated.synced
        landing.theta_norm = groups.norm_over_shards(weights_norm(self.theta))
        delta_norm = math.sqrt(float(communicated.mean.double().pow(2).sum()))
        landing.delta_norm = groups.norm_over_shards(delta_norm)
        landing.outer_bytes = self.reducer.sent_bytes(communicated, self)
        landing.payload_bytes = communicated.payload_bytes
        landing.compress_error = communicated.compress_error
        landing.landing_bytes = communicated.landing_bytes
        outer = self.cfg.outer
        bits = contribution_bits(
            outer.compress, outer.codec.reduce, self.cfg.replicas, self.params, communicated.payload_bytes
        )
        took_part = self.reducer.took_part(communicated, stepped, groups)
        if took_part is not None:
            landing.bits = [bits if took else None for took in took_part]

    def _sync_inner(self, inner: list[OptState], stepped: list[bool], groups: Collectives) -> None:
        """The inner state policy on this fragment's parameters of the replicas that `stepped`."""
        sync_inner_states(
            self.cfg.inner,
            inner,
            torch.tensor(stepped, device=inner[0].step.device),
            groups.sum_over_replicas,
            groups.max_over_replicas,
            names=None if self.whole_model else self.names,
            fragment=self.index,
        )

    @torch.no_grad()
    def flush(self, inner: list[OptState], params: list[Params] | None, groups: Collectives) -> Landing:
        """outer.overlap, the phase's end: wait for the last reduction in flight and apply it (delayed:
        one more outer step; eager: each replica's last stale term), so the run ends on weights that hold
        every round."""
        return self._land_overlapped(inner, params, groups, last=True)

    def _land_overlapped(self, inner, params, groups, last: bool) -> Landing:
        """Land the sync taken a period ago (`due`; at the phase's end, `last`, the one in flight): its
        mean steps the global weights (delayed) or, with each replica's fresh term in place of its stale
        one, each replica's own outer weights (eager); every replica restarts from them; the inner
        state policy applies to the replicas that stepped in the period just trained."""
        fresh = None if last else self.pending
        landed = self.pending if last else self.due
        self.due = None
        if last:
            self.pending = None
        landing = Landing(self.index, (landed or fresh).taken_at, self.params)
        communicated = None
        if landed is not None:
            landing.churn = landed.churn
            communicated = landed.reduction.wait()
        if communicated is not None:
            self._record(landing, communicated, landed.stepped, groups)
        if self.replica_theta is not None:
            if communicated is not None or not last:
                stale = None if communicated is None else landed.own
                self._eager_step(communicated, stale, None if fresh is None else fresh.own)
            landing.outer_spread = self._mean_of_replicas(groups)
            if params is not None:
                for own, p in zip(self.replica_theta, params, strict=True):
                    for n in self.names:
                        p[n].copy_(own[n])
        else:
            if communicated is not None:
                self.stepper.step(unflatten(communicated.mean, self.theta))
            if params is not None:
                merge(self.theta, params, 0.0)
        if fresh is not None:
            self._sync_inner(inner, fresh.stepped, groups)
        return landing

    def _eager_step(self, communicated, stale, fresh) -> None:
        """Each local replica m steps its own outer weights and outer optimizer with
        A(t-1) + (d_m(t) - d_m(t-1)) / M: the mean landed now with the replica's own fresh contribution
        in place of its stale one (M = outer replicas; a term not there is zero)."""
        M = self.cfg.replicas
        like = self.replica_theta[0]
        for i, stepper in enumerate(self.replica_steppers):
            own = 0.0
            if fresh is not None:
                own = fresh[i]
            if stale is not None:
                own = own - stale[i]
            step = own / M if communicated is None else communicated.mean + own / M
            if not torch.is_tensor(step):
                continue
            stepper.step(unflatten(step, like))

    def _mean_of_replicas(self, groups: Collectives) -> float:
        """The global weights (what is evaluated and saved) become the mean over every replica of their
        outer weights; returns the largest relative distance of one from that mean."""
        flat = torch.cat(
            [torch.cat([o[n].float().reshape(1, -1) for n in self.names], dim=1) for o in self.replica_theta]
        )
        mean = groups.sum_over_replicas_beside(flat.sum(0)) / self.cfg.replicas
        for n, part in zip(self.names, mean.split([self.theta[n].numel() for n in self.names]), strict=True):
            self.theta[n].copy_(part.view_as(self.theta[n]))
        norm = groups.norm_over_shards(float(mean.double().norm()))
        norm = max(norm, torch.finfo(torch.float64).tiny)
        apart = (flat.double() - mean.double()).norm(dim=1).tolist()
        local = max(groups.norm_over_shards(x) for x in apart) / norm
        return float(groups.max_over_replicas(torch.tensor(local, dtype=torch.float64, device=flat.device)))


def _kept(momentum: Params, names: list[str]) -> Params:
    """The momentum buffers of `names` (views); none where the outer optimizer keeps none."""
    return {n: momentum[n] for n in names if n in momentum}


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
    the mean pseudo-gradient's norm and the replicas that took part. The state's own sync when it has
    one fragment (its outer optimizer's state goes on)."""
    groups = groups or ReplicaGroups(cfg.replicas)
    if len(state.syncs) == 1:
        whole = state.syncs[0]
    else:
        whole = FragmentSync(
            cfg, 0, list(state.theta), state.theta, state.outer, state.errors, lowrank_q=state.lowrank_q
        )
    whole.take(params, stepped, state.next_update, groups)
    landing = whole.land(state.inner, None, groups)
    return landing.delta_norm, landing.synced
