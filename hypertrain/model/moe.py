"""The mixture-of-experts MLP (Mixtral's sparse block), written once for a leading replica axis.

A layer's `router` [d, E] scores every token; softmax over all E experts, the top k kept and their
weights renormalised over the k (Mixtral); every token goes to its k experts, none is dropped (no
capacity). The experts are E SwiGLU MLPs stored as `experts.w1`, `experts.w3` [E, d, f] and
`experts.w2` [E, f, d], so a stacked model's are `[R, E, d, f]`. `mixture` groups the tokens by
(replica, expert) and runs every group of all R replicas in one batched matmul per expert matrix
(docs/moe.md: measured against the dense masked form, every expert on every token, which it beats at
these sizes).
`RouterTally` pools the router's statistics over the layers into Mixtral's load-balancing loss
(transformers' `load_balancing_loss_func`) and the tokens each layer sends to each expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class RouterTally:
    """The router's statistics of one forward pass, layer by layer, per replica, over its real tokens
    (`real` float [R, N], 1 for a real input position; None: all are real). `keep` also keeps every
    layer's router probabilities [R, N, E] (`probs`), for tests and studies of the routing."""

    def __init__(self, real: Tensor | None, keep: bool = False):
        self.real, self.keep = real, keep
        self.prob_sums: list[Tensor] = []  # per layer [R, E]: router probabilities summed over tokens
        self.counts: list[Tensor] = []  # per layer [R, E]: tokens routed to each expert
        self.probs: list[Tensor] = []
        self.positions = 0  # N, the positions of a replica

    def add(self, probs: Tensor, chosen: Tensor) -> None:
        """One layer's router probabilities [R, N, E] and chosen experts [R, N, k]."""
        self.positions = probs.shape[1]
        with torch.no_grad():  # [R, N, E], 1 where the token chose the expert (the k are distinct)
            hits = torch.zeros_like(probs).scatter_(-1, chosen, 1.0)
        if self.real is not None:
            real = self.real.to(probs.dtype).unsqueeze(-1)
            probs_real, hits = probs * real, hits * real
        else:
            probs_real = probs
        self.prob_sums.append(probs_real.sum(1))
        self.counts.append(hits.sum(1))
        if self.keep:
            self.probs.append(probs.detach())

    def tokens(self, like: Tensor) -> Tensor:
        """[R]: the real tokens each layer routed."""
        if self.real is None:
            return torch.full(like.shape[:1], float(self.positions), dtype=like.dtype, device=like.device)
        return self.real.to(like.dtype).sum(1)

    def columns(self, n_experts: int) -> Tensor:
        """[R, 2 + L*E]: the load-balancing loss, each layer's tokens per expert, the real tokens.

        The loss is transformers' `load_balancing_loss_func` pooled over the L layers as it pools them:
        `E * sum_e f_e * P_e`, f_e the fraction of the L * N routing rows whose top k holds expert e
        (summing to k over the experts) and P_e the mean router probability of e over those rows; its
        gradient flows through P (the choices are discrete). A replica without a real token gets 0."""
        counts, prob_sums = torch.stack(self.counts, 1), torch.stack(self.prob_sums, 1)  # [R, L, E]
        tokens = self.tokens(prob_sums)
        rows = (tokens * len(self.counts)).clamp(min=1.0).unsqueeze(-1)
        f, P = counts.sum(1) / rows, prob_sums.sum(1) / rows
        aux = n_experts * (f * P).sum(-1, keepdim=True)
        return torch.cat([aux, counts.flatten(1), tokens.unsqueeze(-1)], dim=1)


def route(router: Tensor, x: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """x [R, N, d] -> (probabilities [R, N, E], the top k's renormalised weights [R, N, k], the
    chosen experts [R, N, k]). The softmax is taken in at least fp32 (bf16 autocast makes the logits
    bf16); in float64 it stays float64."""
    logits = torch.bmm(x, router)
    probs = torch.softmax(logits, -1, dtype=torch.promote_types(logits.dtype, torch.float32))
    top, chosen = probs.topk(top_k, dim=-1)
    return probs, top / top.sum(-1, keepdim=True), chosen


def mixture(p: dict[str, Tensor], pre: str, x: Tensor, top_k: int, tally: RouterTally | None) -> Tensor:
    """One layer's experts on x [R, N, d] -> [R, N, d], grouped: the R*N*k routing slots (a token once
    for each of its k experts) placed by (replica, expert) into groups padded to the largest group
    (dropless), one batched matmul per expert matrix over all replicas and experts, the results taken
    back to their slots, weighted and summed over each token's k. Every move is a permutation or a
    copy, never a scattered sum, so the backward is deterministic on any device. `tally` records the
    layer's routing when given."""
    probs, weights, chosen = route(p[pre + "router"], x, top_k)
    if tally is not None:
        tally.add(probs, chosen)
    w1, w3, w2 = p[pre + "experts.w1"], p[pre + "experts.w3"], p[pre + "experts.w2"]
    R, N, d = x.shape
    E, f = w1.shape[1], w1.shape[-1]
    at, capacity = _places(chosen, E)
    slots = x.reshape(R * N, 1, d).expand(R * N, top_k, d).reshape(-1, d)
    grouped = x.new_zeros(R * E * capacity, d).index_copy(0, at, slots).view(R * E, capacity, d)
    h = F.silu(torch.bmm(grouped, w1.reshape(R * E, d, f))) * torch.bmm(grouped, w3.reshape(R * E, d, f))
    y = torch.bmm(h, w2.reshape(R * E, f, d)).view(-1, d).index_select(0, at).view(R, N, top_k, d)
    return (y * weights.unsqueeze(-1).to(y.dtype)).sum(2)


@torch.no_grad()  # the group size is data: torch.compile breaks its graph at its int(), quietly
def _places(chosen: Tensor, n_experts: int) -> tuple[Tensor, int]:
    """Where each routing slot goes among R*E groups padded to the largest, and that size: chosen
    experts [R, N, k] -> (rows [R*N*k] of the padded [R*E*capacity, d] groups, capacity). A slot's
    place in its group follows token order, found by a running count of one-hot rows, not a sort (a CPU
    sort of the slots costs more than the experts)."""
    R = chosen.shape[0]
    expert = chosen.reshape(R, -1)
    hits = torch.zeros(*expert.shape, n_experts, dtype=torch.int64, device=chosen.device)
    hits.scatter_(-1, expert.unsqueeze(-1), 1)  # [R, N*k, E] one-hot (F.one_hot syncs with a GPU)
    place = (hits.cumsum(1) - 1).gather(2, expert.unsqueeze(-1)).squeeze(-1)
    capacity = int(hits.sum(1).max())  # the one host sync: the largest group, so no token is dropped
    group = torch.arange(R, device=chosen.device).view(R, 1) * n_experts + expert
    return (group * capacity + place).reshape(-1), capacity


def weigh(columns: Tensor, weights: Tensor) -> Tensor:
    """A microbatch's router columns [R, 2 + L*E] with the loss scaled by the microbatch's weight [R]
    (its share of the replica's tokens), so that the sum over microbatches (and the mean over a
    replica's ranks) is the replica's token-weighted load-balancing loss; the counts add as they are."""
    return torch.cat([columns[:, :1] * weights.to(columns.dtype).unsqueeze(1), columns[:, 1:]], dim=1)


def router_figures(columns: Tensor, n_layers: int, n_experts: int) -> Tensor:
    """An update's summed router columns [R, 2 + L*E] (`weigh`) -> [R, 3] (`model.spec.ROUTER_FIGURES`): the
    token-weighted load-balancing loss, and the smallest and largest fraction of the update's tokens
    that a layer sends to one expert (a token counts once for each of its k experts: k/E is
    balanced, 1 means every token)."""
    counts = columns[:, 1:-1].view(-1, n_layers, n_experts)
    fraction = counts / columns[:, -1:].clamp(min=1.0).unsqueeze(-1)
    flat = fraction.flatten(1)
    return torch.stack([columns[:, 0], flat.min(1).values, flat.max(1).values], dim=1)
