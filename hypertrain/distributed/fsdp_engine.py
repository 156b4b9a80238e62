"""The inner steps of one rank of a sharded replica (`processes.shard=true`): FSDP2 (`fully_shard`) on
the replica's own 1-D group (never the run's 2-D mesh, which would be HSDP: data parallel), per decoder
block, then the root.

`ShardedEngine(groups)` is an engine (`engines.contract.Engine`) for this rank's one replica: every
parameter, gradient and AdamW moment is this rank's dim-0 shard (`shard_of`). An update runs
the microbatches of the rank's plan share with layout (a)'s loss weights; FSDP2 all-gathers each block
for its forward and backward and reduce-scatters the gradient sum once, at the last microbatch (gloo
has no average: a sum, then a division by L, as layout (a)'s all-reduce and `/ L`); the clip takes
the global norm over the shards (one float64 all-reduce); AdamW steps the local shards
(`optim.inner.inner_step`, elementwise); Muon gathers its matrices, one shape at a time, steps them
whole on every rank of the replica (the same bits everywhere) and keeps its shards. The replica's ranks
run as many microbatches in an update as the most any of them cut (FSDP2's all-gathers are collectives):
a rank with fewer, or none, runs zero-weight ones, so it adds exact zeros to the reduce-scatter, as
layout (a)'s zeros.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hypertrain.config import ModelConfig, TrainConfig
from hypertrain.engines.contract import (
    Assignment,
    ReplicaResult,
    StopAfter,
    channel_means,
    check_finite,
    timed_average,
)
from hypertrain.model import moe
from hypertrain.model import transformer as tf
from hypertrain.model.shapes import param_shapes, param_specs
from hypertrain.model.spec import model_spec
from hypertrain.model.transformer import loss_channels, router_columns
from hypertrain.optim.inner import CLIP_EPS, OptState, inner_step, per_replica


def shard_of(full: Tensor, local_rank: int, L: int) -> Tensor:
    """Local rank `local_rank`'s dim-0 shard of `full` among L, as FSDP2 cuts it (a copy)."""
    chunks = torch.chunk(full, L, dim=0)
    if local_rank < len(chunks):
        return chunks[local_rank].clone()
    return full.new_empty((0, *full.shape[1:]))


def _key(name: str) -> str:
    return name.replace(".", "__")  # a module's parameter names cannot hold dots


class _Params(nn.Module):
    """Parameters registered under `_key(name)`, read back with a replica axis of 1 (`tf.forward`'s)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device):
        super().__init__()
        self.names = list(shapes)
        for n, shape in shapes.items():
            self.register_parameter(_key(n), nn.Parameter(torch.empty(shape, device=device)))

    def own(self) -> dict[str, Tensor]:
        return {n: getattr(self, _key(n)).unsqueeze(0) for n in self.names}


class Block(_Params):
    """One decoder layer (`transformer.hidden`'s loop body, its MLP a mixture of experts' where the model
    has them), its own FSDP2 unit."""

    def __init__(self, cfg: ModelConfig, prefix: str, shapes, device):
        super().__init__(shapes, device)
        self.cfg, self.prefix, self.experts = cfg, prefix, model_spec(cfg).experts

    def forward(self, x: Tensor, B: int, T: int, tally: moe.RouterTally | None) -> Tensor:
        cfg, p, pre = self.cfg, self.own(), self.prefix
        x = x + tf._attention(cfg, p, pre, tf._rms_norm(x, p[pre + "attn_norm"], cfg.norm_eps), B, T)
        h = tf._rms_norm(x, p[pre + "mlp_norm"], cfg.norm_eps)
        return x + (moe.mixture(p, pre, h, cfg.top_k, tally) if self.experts else tf._mlp(p, pre, h))


class Replica(_Params):
    """The decoder (`transformer.forward` for `arch=decoder`, with or without experts) as modules: the
    embedding, the final norm and the head at the root, one `Block` per layer."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        shapes = {n: tuple(shape) for n, (shape, _) in param_specs(cfg).items()}
        layers = [f"layers.{i:03d}." for i in range(cfg.n_layers)]
        root = {n: s for n, s in shapes.items() if not n.startswith("layers.")}
        super().__init__(root, device)
        self.cfg = cfg
        self.blocks = nn.ModuleList(
            Block(cfg, pre, {n: s for n, s in shapes.items() if n.startswith(pre)}, device) for pre in layers
        )

    def named_tensors(self) -> dict[str, nn.Parameter]:
        """Every parameter by its model name (after `fully_shard`: the DTensor parameters)."""
        found = {n: getattr(self, _key(n)) for n in self.names}
        for block in self.blocks:
            found |= {n: getattr(block, _key(n)) for n in block.names}
        return found

    def forward(self, tokens: Tensor, mask: Tensor | None, channel_weights: Tensor | None = None) -> Tensor:
        """`transformer.forward`'s [R, 1 + C + M]: the loss, then the multistream model's per-channel sums
        (C, `channel_weights` [R, C] weighing them into the loss), or a mixture of experts' router
        columns (M)."""
        cfg, p = self.cfg, self.own()
        if model_spec(cfg).channels:
            R, B, C, T1 = tokens.shape
            with tf._autocast(cfg, tokens.device):
                x = tf.channel_inputs(cfg, p, tokens)
                for block in self.blocks:
                    x = block(x, B, T1 - 1, None)
                sums = tf.channel_heads(p, tf._rms_norm(x, p["norm"], cfg.norm_eps), tokens)
            loss = (sums * channel_weights.to(sums.dtype)).sum(-1, keepdim=True)
            return torch.cat([loss, sums], dim=-1)
        inputs, targets = tokens[:, :, :-1], tokens[:, :, 1:]
        R, B, T = inputs.shape
        tally = None
        if model_spec(cfg).experts:
            tally = moe.RouterTally(None if mask is None else mask[:, :, :-1].reshape(R, -1))
        with tf._autocast(cfg, tokens.device):
            x = tf.embed(p["emb"], inputs).view(R, B * T, cfg.d_model)
            for block in self.blocks:
                x = block(x, B, T, tally)
            out = torch.bmm(tf._rms_norm(x, p["norm"], cfg.norm_eps), p["head"])
        loss = _loss(out.to(p["head"].dtype), targets, mask).unsqueeze(1)
        if tally is None:
            return loss
        return torch.cat([loss, tally.columns(cfg.n_experts).to(loss.dtype)], dim=1)


def _loss(out: Tensor, targets: Tensor, mask: Tensor | None) -> Tensor:
    """`transformer.forward`'s loss [R] from the logits [R, B*T, vocab] (in the weights' dtype): the mean
    cross-entropy over the real targets (a target and its input real)."""
    R = targets.shape[0]
    ce = F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1), reduction="none").view(R, -1)
    if mask is None:
        return ce.mean(1)
    real = (mask[:, :, 1:] & mask[:, :, :-1]).reshape(R, -1).to(ce.dtype)
    return (ce * real).sum(1) / real.sum(1).clamp(min=1.0)


class ModuleReplica(nn.Module):
    """A Hugging Face model (`model=hf`) as the replica: a copy of the process's instance (`model.hf.base`),
    called as `model.hf.logits` calls it (fp32, no cache, no attention mask), its decoder layers
    (`hf.layer_list`) the FSDP2 units before the root."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        from hypertrain.model import hf  # transformers, imported by module models only

        super().__init__()
        self.module = copy.deepcopy(hf.base(cfg)).to(device)
        self.blocks = list(self.module.get_submodule(hf.layer_list(self.module)))

    def named_tensors(self) -> dict[str, nn.Parameter]:
        """Every parameter by its model name (tied ones once, as `hf.describe` names them)."""
        return dict(self.module.named_parameters())

    def forward(self, tokens: Tensor, mask: Tensor | None, channel_weights: Tensor | None = None) -> Tensor:
        inputs, targets = tokens[:, :, :-1], tokens[:, :, 1:]
        R, B, T = inputs.shape
        with torch.autocast(tokens.device.type, enabled=False):
            out = self.module(inputs[0], use_cache=False).logits
        return _loss(out.reshape(R, B * T, out.shape[-1]), targets, mask).unsqueeze(1)  # [R, 1]


def sharded_replica(
    cfg: ModelConfig, group: dist.ProcessGroup, device: torch.device
) -> Replica | ModuleReplica:
    """The replica's modules, each block then the root given to `fully_shard` on the replica's group;
    gradients reduced as a sum then divided (gloo has no average; the same on nccl)."""
    model = ModuleReplica(cfg, device) if model_spec(cfg).module else Replica(cfg, device)
    mesh = DeviceMesh.from_group(group, device.type)
    units = [*model.blocks, model]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
    return model


class ShardedEngine:
    """`engines.contract.Engine` for one rank of a sharded replica (see the module docstring)."""

    def __init__(self, groups):
        self.groups, self.model = groups, None

    def __call__(
        self,
        cfg: TrainConfig,
        theta: dict[str, Tensor],
        assigns: list[Assignment],
        states: list[OptState],
        average=None,
        stop: StopAfter | None = None,
    ) -> list[ReplicaResult]:
        (assign,), (state,) = assigns, states  # layout (a): one replica per process
        device = torch.device(cfg.engine.device)
        if self.model is None:
            self.model = sharded_replica(cfg.model, self.groups.replica_group, device)
        params = self.model.named_tensors()
        start = theta if assign.start is None else {n: t[0] for n, t in assign.start.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.to_local().copy_(start[n])
        losses, seconds, allreduce, channels, routing = [], [], [], [], []
        for t in range(len(assign.batches)):
            loss, took, reduced, means, figures = self._update(cfg, assign, t, params, state, average, device)
            losses.append(loss)
            seconds.append(took)
            allreduce.append(reduced)
            channels.append(means)
            routing.append(figures)
            if stop is not None and stop(assign.global_step0 + t):
                break
        weights = {n: p.to_local().detach().clone().unsqueeze(0) for n, p in params.items()}
        return [ReplicaResult.of(cfg.model, weights, state, losses, seconds, allreduce, channels, routing)]

    def _update(self, cfg: TrainConfig, assign: Assignment, t: int, params, state, average, device):
        """The replica's update `t` on this rank: (loss or None when the replica had no ids, seconds,
        the loss average's seconds, the multistream model's per-channel token means, a mixture of experts'
        router figures or None), as `engines.loop`'s."""
        batch = assign.batches[t]
        if batch.empty:
            return None, 0.0, 0.0, None, None
        begin = time.perf_counter()
        C, M = loss_channels(cfg.model), router_columns(cfg.model)
        loss, router = torch.zeros((), device=device), torch.zeros(M, device=device)
        sums, counts = torch.zeros(C, device=device), torch.zeros(C, dtype=torch.float64, device=device)
        work = [
            (mb.tokens, mb.mask, mb.weight, mb.channel_weights, mb.channel_counts)
            for mb in batch.microbatches
        ]
        # FSDP2 all-gathers a unit at every forward and backward: the replica's ranks run as many
        # microbatches (the most any of them cut; layout (a) lets counts differ), a rank with fewer, or no
        # ids, adding zero-weight ones (the multistream model's of no tokens: -1 ids, no targets): exact
        # zeros into the gradient, the channel sums and the replica's reduce-scatter
        most = self.groups.most_in_replica(len(work))
        empty = torch.full((1, C, 2), -1, dtype=torch.int64) if C else torch.zeros(1, 2, dtype=torch.int64)
        nothing = (empty, None, 0.0, torch.zeros(C, dtype=torch.float64) if C else None, torch.zeros(C))
        work += [nothing] * (most - len(work))
        for i, (tokens, mask, weight, channel_weights, channel_counts) in enumerate(work):
            self.model.set_requires_gradient_sync(i == len(work) - 1)
            mask = None if mask is None else mask.unsqueeze(0).to(device)
            weighed = None if channel_weights is None else channel_weights.unsqueeze(0).to(device)
            out = self.model(tokens.unsqueeze(0).to(device), mask, weighed)  # [1, 1 + C + M]
            (tf.objective(cfg.model, out)[0] * weight).backward()
            loss += out[0, 0].detach() * weight
            sums += out[0, 1 : 1 + C].detach()
            counts += channel_counts.to(device)
            if M:
                router += moe.weigh(out[:, 1 + C :].detach(), torch.full((1,), weight, device=device))[0]
        # the loss, the channel sums and counts and a mixture's router columns averaged over the replica's
        # ranks, as layout (a)'s (ratios unchanged)
        stats = torch.cat([x.to(loss.dtype) for x in (loss.view(1), sums, counts, router)]).view(1, -1)
        reduced = timed_average(average, {}, stats)
        grads = {n: p.grad.to_local().unsqueeze(0) for n, p in params.items()}
        norms = self._clip(cfg, grads)
        local = {n: p.to_local().unsqueeze(0) for n, p in params.items()}
        inner, lr = replace(cfg.inner, grad_clip=0.0), assign.lr(cfg, t)
        muon = [n for n in local if n not in state.v]  # init_state gave AdamW's parameters their `v`
        if muon:
            self._muon(cfg, inner, local, grads, state, lr, muon)
        adam = [n for n in local if n in state.v]
        moments = OptState({n: state.m[n] for n in adam}, state.v, state.step, state.fragment_of)
        inner_step(inner, {n: local[n] for n in adam}, {n: grads[n] for n in adam}, moments, lr)
        check_finite(stats[:, 0], norms, grads, [assign.replica], assign.global_step0 + t)
        self.model.zero_grad(set_to_none=True)
        figures = None
        if M:
            columns = stats[:, 1 + 2 * C :].double()
            figures = moe.router_figures(columns, cfg.model.n_layers, cfg.model.n_experts)[0].tolist()
        means = channel_means(stats[0, 1 : 1 + C].double(), stats[0, 1 + C : 1 + 2 * C].double()).tolist()
        return float(stats[0, 0]), time.perf_counter() - begin, reduced, means, figures

    @torch.no_grad()
    def _muon(self, cfg: TrainConfig, inner, local, grads, state: OptState, lr, names: list[str]) -> None:
        """Muon's step on whole matrices, one shape at a time: this shape's weights, gradients and momenta
        all-gathered in the replica, stepped as `inner_step` steps them (Newton-Schulz batched over the
        same matrices in the same order), and this rank's shards kept; the step counts move once, with
        AdamW's."""
        shapes = param_shapes(cfg.model)
        groups: dict[tuple[int, ...], list[str]] = {}
        for n in names:
            groups.setdefault(tuple(shapes[n]), []).append(n)
        j, L = self.groups.local_rank, self.groups.L
        for members in groups.values():

            def whole(part: dict[str, Tensor], members=members) -> dict[str, Tensor]:
                gathered = self.groups.whole({n: part[n][0] for n in members})
                return {n: t.unsqueeze(0) for n, t in gathered.items()}

            weights, momenta = whole(local), whole(state.m)
            kept = OptState(momenta, {}, state.step.clone(), state.fragment_of)
            inner_step(inner, weights, whole(grads), kept, lr)
            for n in members:
                local[n][0].copy_(shard_of(weights[n][0], j, L))
                state.m[n][0].copy_(shard_of(momenta[n][0], j, L))

    def _clip(self, cfg: TrainConfig, grads: dict[str, Tensor]) -> Tensor:
        """The global gradient norm [1] over the replica's shards (float64 squares summed, then summed
        over the ranks), and, with inner.grad_clip, the gradients scaled in place as `inner_step` would."""
        squares = [
            torch.linalg.vector_norm(g.reshape(1, -1), dim=1, dtype=torch.float64).square()
            for g in grads.values()
        ]
        total = torch.stack(squares).sum(0)
        self.groups._timed("inner", total, lambda: dist.all_reduce(total, group=self.groups.replica_group))
        norms = total.sqrt().float()
        if cfg.inner.grad_clip > 0:
            clip = torch.clamp(cfg.inner.grad_clip / (norms + CLIP_EPS), max=1.0)
            for g in grads.values():
                g.mul_(per_replica(clip, g))
        return norms
