"""Inner (AdamW, Muon) and outer (Nesterov SGD) optimizers, the lr schedule and the state policies.

Written once for tensors with a leading replica axis `[R, ...]` (R = 1 in the loop engine, R = many
in the stacked engine), so both engines share the math. Steps are in place, per replica (own clip
norm, own step count), without host syncs or Python loops over replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # types only: the optimizer reads config fields, it never builds configs
    from hypertrain.config import InnerConfig

Params = dict[str, Tensor]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz (Keller Jordan's Muon)
NS_EPS = 1e-7  # torch.optim.Muon's
MUON_RMS_SCALE = 0.2  # update scale 0.2 * sqrt(max(rows, cols)) matches AdamW's update RMS
CLIP_EPS = 1e-6
_NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class OptState:
    """Inner optimizer state, every tensor with the params' leading replica axis.

    m: AdamW first moment, or Muon momentum buffer (sum form `m = mu*m + g`), for every param.
    v: AdamW second moment, only for AdamW-handled params.
    step: int64 [R], steps taken per replica (a replica that skips an update keeps its count); with
    Streaming DiLoCo's fragments [R, P], one count per fragment (a fragment's sync may reset its own).
    fragment_of: param name -> its fragment (the column of `step` its bias correction reads); empty
    for one fragment. Derived from the config, never saved.
    """

    m: Params
    v: Params
    step: Tensor
    fragment_of: dict[str, int] = field(default_factory=dict)

    def steps_of(self, fragment: int) -> Tensor:
        """[R]: each replica's step count for `fragment`'s parameters."""
        return self.step if self.step.ndim == 1 else self.step[:, fragment]


def uses_muon(inner: InnerConfig, role: str) -> bool:
    """Muon handles the hidden matrices (role `hidden`, `model.ROLES`), a mixture of experts' expert
    matrices among them; embeddings, heads, norms and a mixture's routers use AdamW."""
    return inner.name == "muon" and role == "hidden"


def init_state(
    inner: InnerConfig,
    params: Params,
    roles: dict[str, str],
    fragment_of: dict[str, int] | None = None,
    fragments: int = 1,
) -> OptState:
    """Zero state on the params' device and dtype; step counts [R] (or [R, fragments]) start at 0.
    `roles` (the model's `param_roles`) decides each parameter's rule: an AdamW parameter has a second
    moment `v`, a Muon one has not, and `inner_step` reads the rule from that. `fragment_of`: each
    parameter's fragment, with several."""
    first = next(iter(params.values()))
    shape = (first.shape[0],) if fragments == 1 else (first.shape[0], fragments)
    return OptState(
        m={n: torch.zeros_like(p) for n, p in params.items()},
        v={n: torch.zeros_like(p) for n, p in params.items() if not uses_muon(inner, roles[n])},
        step=torch.zeros(shape, dtype=torch.int64, device=first.device),
        fragment_of=dict(fragment_of or {}) if fragments > 1 else {},
    )


def by_fragment(names: list[str], fragment_of: dict[str, int]) -> list[tuple[int, list[str]]]:
    """`names` grouped by fragment, in fragment order (one group, in `names`' order, for one)."""
    if not fragment_of:
        return [(0, names)]
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(fragment_of[n], []).append(n)
    return sorted(groups.items())


def lr_at(inner: InnerConfig, global_step: int, inner_step: int) -> float:
    """Learning rate of the update `global_step` (0-based from the phase start), `inner_step` in its round.

    Warmup: lr * (global_step + 1) / warmup_steps while global_step < warmup_steps. Then cosine from lr
    down to lr * min_lr_ratio, reached at global_step == decay_steps and held after (decay_steps counts
    from step 0, warmup included, so decay_steps = the phase's updates ends the phase at the floor);
    decay_steps == 0 means no decay. With rewarmup_steps > 0 the result is multiplied by
    min(1, (inner_step + 1) / rewarmup_steps), a ramp at the start of every round.
    """
    lr = inner.lr
    if global_step < inner.warmup_steps:
        lr = lr * (global_step + 1) / inner.warmup_steps
    elif inner.decay_steps > 0:
        span = max(1, inner.decay_steps - inner.warmup_steps)
        progress = min(1.0, (global_step - inner.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        lr = lr * (inner.min_lr_ratio + (1.0 - inner.min_lr_ratio) * cosine)
    if inner.rewarmup_steps > 0:
        lr = lr * min(1.0, (inner_step + 1) / inner.rewarmup_steps)
    return lr


def newton_schulz(G: Tensor, steps: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Approximate orthogonalisation U V^T of every matrix in G [..., rows, cols] (quintic NS).

    Each matrix is normalised by its own Frobenius norm over the last two dims; wide orientation is
    used (transposed when rows > cols, as torch.optim.Muon does) so the Gram matrix is the small one.
    Computed in `dtype`, returned in G's dtype.
    """
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    batch_shape = X.shape[:-2]
    X = X.reshape(-1, *X.shape[-2:])  # [batch, rows, cols] for the batched fused multiply-adds
    for _ in range(steps):
        gram = X @ X.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        X = torch.baddbmm(X, poly, X, beta=a)
    X = X.reshape(*batch_shape, *X.shape[-2:])
    if tall:
        X = X.mT
    return X.to(G.dtype)


def grad_norms(grads: Params) -> Tensor:
    """Per-replica global L2 norm [R] (float32) of all grads; accumulated in float64 so the loop (R = 1)
    and stacked engines get the same value whatever the reduction shape."""
    squares = [
        torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1, dtype=torch.float64).square()
        for g in grads.values()
    ]
    return torch.stack(squares).sum(0).sqrt().float()


def per_replica(values: Tensor, like: Tensor) -> Tensor:
    """[R] -> [R, 1, ..., 1] broadcastable against `like`."""
    return values.view(-1, *[1] * (like.ndim - 1))


@torch.no_grad()
def inner_step(
    inner: InnerConfig,
    params: Params,
    grads: Params,
    state: OptState,
    lr: float | Tensor,
    active: Tensor | None = None,
) -> Tensor:
    """One inner update of every replica in place (params and state); returns pre-clip grad norms [R].

    Per replica: global-norm clip (coefficient min(1, grad_clip / (norm + 1e-6)), off when grad_clip
    is 0), then AdamW (torch.optim.AdamW's formula, per-replica bias correction, decoupled decay on
    matrices only) or Muon (`m = mu*m + g`, update NS(g + mu*m), decay, step lr * 0.2*sqrt(max(rows,
    cols))). `active` bool [R] (None = all): inactive rows keep weights, m, v and step bitwise; the
    mask costs one copy of the state, so pass None when every replica steps. `grads` are not modified.
    `lr` is a float or a 0-d CPU float64 tensor (a tensor is what a compiled step takes), or with
    fragments (`state.fragment_of`) one float per fragment.
    """
    names = list(params)
    norms = grad_norms(grads)
    g_list = [grads[n] for n in names]
    if inner.grad_clip > 0:
        clip = torch.clamp(inner.grad_clip / (norms + CLIP_EPS), max=1.0)
        g_list = torch._foreach_mul(g_list, [per_replica(clip, g) for g in g_list])
    g_of = dict(zip(names, g_list, strict=True))

    touched = (
        [params[n] for n in names] + [state.m[n] for n in names] + [state.v[n] for n in names if n in state.v]
    )
    saved = torch._foreach_clone(touched) if active is not None else None

    # Each fragment's parameters with its own rate and step count (one group without fragments).
    per_fragment = isinstance(lr, (tuple, list)) or (isinstance(lr, Tensor) and lr.ndim == 1)
    for f, members in by_fragment(names, state.fragment_of):
        # Scalar math in float64 tensors, the same eager or under torch.compile (where a Python float
        # lr would be a constant to recompile for, and a float64 multiplier would round differently).
        rate = torch.as_tensor(lr[f] if per_fragment else lr, dtype=torch.float64)
        decayed = [params[n] for n in members if params[n].ndim - 1 >= 2]
        if inner.wd > 0 and decayed:
            # 1 - lr*wd rounded once to the weights' dtype, as eager torch rounds a float scalar.
            like = decayed[0]
            torch._foreach_mul_(decayed, (1.0 - rate * inner.wd).to(device=like.device, dtype=like.dtype))
        adam = [n for n in members if n in state.v]  # init_state gave AdamW's parameters their `v`
        muon = [n for n in members if n not in state.v]
        if adam:
            _adamw(inner, [params[n] for n in adam], [g_of[n] for n in adam], state, adam, rate, f)
        if muon:
            _muon(inner, [params[n] for n in muon], [g_of[n] for n in muon], [state.m[n] for n in muon], rate)

    if active is None:
        state.step += 1
    else:
        for t, old in zip(touched, saved, strict=True):
            torch.where(per_replica(active, t), t, old, out=t)
        state.step += per_replica(active, state.step).to(state.step.dtype)
    return norms


def _adamw(
    inner: InnerConfig,
    weights: list[Tensor],
    grads: list[Tensor],
    state: OptState,
    names: list[str],
    lr: Tensor,
    fragment: int = 0,
) -> None:
    """torch.optim.AdamW's update after weight decay, in its tensor-step (capturable) form, per replica
    (the bias corrections from `fragment`'s step counts)."""
    m = [state.m[n] for n in names]
    v = [state.v[n] for n in names]
    torch._foreach_lerp_(m, grads, 1.0 - inner.beta1)
    torch._foreach_mul_(v, inner.beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1.0 - inner.beta2)
    # Bias corrections from each replica's own count (the step about to be taken), in float64.
    # torch.optim.AdamW's default form, w -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps): the rate
    # multiplies the update and is never a divisor, so lr = 0 (or a cosine that ends at 0) moves
    # nothing, also where m = v = 0 (embedding rows that were not looked up).
    step = (state.steps_of(fragment) + 1).double()
    neg_step_size = (-lr / (1.0 - inner.beta1**step)).float()
    bias2_sqrt = (1.0 - inner.beta2**step).sqrt().float()
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, [per_replica(bias2_sqrt, d) for d in denom])
    torch._foreach_add_(denom, inner.eps)
    update = torch._foreach_div(m, denom)
    torch._foreach_mul_(update, [per_replica(neg_step_size, u) for u in update])
    torch._foreach_add_(weights, update)


def _muon(
    inner: InnerConfig, weights: list[Tensor], grads: list[Tensor], m: list[Tensor], lr: Tensor
) -> None:
    """Muon after weight decay: momentum, Nesterov look-ahead, NS batched over same-shape matrices.
    Every axis before the last two is a batch axis: the replicas' and, for a mixture's experts
    `[R, E, rows, cols]`, the experts', so each expert's matrix is orthogonalised (and scaled by its
    own rows and cols) on its own."""
    mu = inner.muon_momentum
    torch._foreach_mul_(m, mu)
    torch._foreach_add_(m, grads)
    lookahead = torch._foreach_add(grads, m, alpha=mu)
    dtype = _NS_DTYPES[inner.ns_dtype]
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, w in enumerate(weights):
        by_shape.setdefault(tuple(w.shape), []).append(i)
    for shape, members in by_shape.items():
        # One NS call for all matrices of a shape: [k, R, rows, cols] -> k updates.
        group = (
            torch.stack([lookahead[i] for i in members]) if len(members) > 1 else lookahead[members[0]][None]
        )
        ortho = newton_schulz(group, inner.ns_steps, dtype)
        scale = MUON_RMS_SCALE * math.sqrt(max(shape[-2], shape[-1]))
        ortho.mul_((-lr * scale).to(device=ortho.device, dtype=ortho.dtype))
        torch._foreach_add_([weights[i] for i in members], list(ortho.unbind(0)))


def sync_inner_states(
    inner: InnerConfig,
    states: list[OptState],
    active: Tensor | None = None,
    sum_over_replicas: Callable[[Tensor], Tensor] | None = None,
    max_over_replicas: Callable[[Tensor], Tensor] | None = None,
    names: list[str] | None = None,
    fragment: int = 0,
) -> None:
    """Apply inner.state_policy at a sync, in place, to every replica's state.

    `states` hold 1 or several replica rows each; `active` bool over all those rows (None = all) marks
    the replicas that stepped in the round and so took part in the sync. With several processes,
    `sum_over_replicas` / `max_over_replicas` extend the sums and maxima to the other processes'
    replicas (None: this process holds them all). `names` (None = all) restricts the policy to the
    parameters a fragment's sync synced, and the step counts to that `fragment`'s.
    carry: nothing changes. reset: m, v and step counts zeroed (the next step is bias-corrected as a
    first step). average: every row's m and v become the mean over the active rows only (a replica
    that never stepped holds zero or stale moments and would dilute them), and every row's step count
    becomes the largest active count: the moments are those of replicas that took that many steps, so
    the bias correction must not treat them as a first step's. With no active row nothing changes.
    """
    policy = inner.state_policy
    if policy == "carry":
        return
    chosen = list(states[0].m) if names is None else list(names)
    if policy == "reset":
        for s in states:
            torch._foreach_zero_([s.m[n] for n in chosen] + [s.v[n] for n in chosen if n in s.v])
            s.steps_of(fragment).zero_()
        return
    # average (a StatePolicy has no other value)
    steps = torch.cat([s.steps_of(fragment) for s in states])
    keep = torch.ones_like(steps, dtype=torch.bool) if active is None else active.to(steps.device)
    pairs = [("m", n) for n in chosen] + [("v", n) for n in chosen if n in states[0].v]
    parts = []
    for moments, name in pairs:
        rows = torch.cat([getattr(s, moments)[name] for s in states])
        parts.append(torch.where(per_replica(keep, rows), rows, 0.0).sum(0).reshape(-1))
    parts.append(keep.sum().to(parts[0]).reshape(1))
    total = torch.cat(parts)
    total = total if sum_over_replicas is None else sum_over_replicas(total)
    if float(total[-1]) == 0:
        return
    mean = total[:-1] / total[-1]
    start = 0
    for moments, name in pairs:
        shape = getattr(states[0], moments)[name].shape[1:]
        row = mean[start : start + shape.numel()].view(shape)
        for s in states:
            t = getattr(s, moments)[name]
            t.copy_(row.expand_as(t))
        start += shape.numel()
    largest = torch.where(keep, steps, torch.zeros_like(steps)).max()
    largest = largest if max_over_replicas is None else max_over_replicas(largest)
    for s in states:
        s.steps_of(fragment).fill_(largest)
