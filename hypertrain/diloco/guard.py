"""The divergence guard (`guard.*`): after the syncs that land together, a verdict every process
agrees on: train on, or stop (`Diverged`, or `NonFiniteError` for a non-finite held-out loss),
naming the update and the figure.
"""

from __future__ import annotations

import math

from hypertrain.data.batches import is_multistream
from hypertrain.diloco.rounds import Segment
from hypertrain.diloco.state import PreparedRun
from hypertrain.failures import DIVERGED_LINE, Diverged, NonFiniteError


def uniform_loss(run: PreparedRun) -> tuple[float, str]:
    """The held-out loss of the uniform prediction and how it is made: ln vocab; for a multistream
    model each channel's ln vocab weighted as the held-out loss weighs its channels' token means
    (k_c over the channels with held-out targets, docs/design.md "Loss weights")."""
    model = run.cfg.model
    if not is_multistream(run.dataset):
        return math.log(model.vocab), f"ln {model.vocab}"
    counts = sum(mb.channel_counts for mb in run.heldout.microbatches).tolist()
    scales = run.dataset.channel_scales
    active = [(k, v) for k, v, n in zip(scales, model.channel_vocabs, counts, strict=True) if n > 0]
    loss = sum(k * math.log(v) for k, v in active) / sum(k for k, _ in active)
    return loss, "each channel's ln vocab, weighted as the loss weighs the channels"


# The verdicts of a sync, agreed by every process (the largest wins): 0 = train on.
PSEUDO_GRAD, HELDOUT_ABOVE_UNIFORM, HELDOUT_NON_FINITE = 1, 2, 3


def heldout_verdict(run: PreparedRun, eval_loss: float | None, after: str) -> tuple[int, str]:
    """The verdict on a held-out loss of the global weights (None: none taken) measured after `after`
    (a sync, or an asynchronous server update): non-finite, or (guard on) above the uniform
    prediction's by more than guard.heldout_margin; 0 and "" to train on."""
    guard = run.cfg.guard
    if eval_loss is not None and not math.isfinite(eval_loss):
        return HELDOUT_NON_FINITE, (
            f"the held-out loss of the global weights after {after} is {eval_loss}; the run stops"
        )
    if guard.enabled and eval_loss is not None:
        uniform, how = uniform_loss(run)
        if eval_loss > uniform + guard.heldout_margin:
            return HELDOUT_ABOVE_UNIFORM, (
                f"{DIVERGED_LINE}the held-out loss of the global weights after {after} is "
                f"{eval_loss:.4f}, more than guard.heldout_margin={guard.heldout_margin:g} nats above the "
                f"uniform prediction's {uniform:.4f} ({how}); the run stops"
            )
    return 0, ""


def sync_verdict(run: PreparedRun, rnd: Segment, eval_losses: list[float]) -> tuple[int, str]:
    """This process's verdict on the syncs of `rnd` and its reason: a held-out loss (the writer's at a
    round's end, of the weights each landing left and of those the round ends on; none elsewhere)
    non-finite or above the uniform prediction's by more than guard.heldout_margin, or a sync's
    pseudo-gradient norm (the same on every process) beyond guard.pseudo_grad_ratio x its global
    weights' (a fragment's, with fragments)."""
    guard, update = run.cfg.guard, rnd.updates[-1] + 1
    for eval_loss in eval_losses:
        verdict = heldout_verdict(run, eval_loss, f"the sync at update {update}")
        if verdict[0]:
            return verdict
    if not guard.enabled:
        return 0, ""
    for sync in rnd.syncs:
        if sync.synced:
            what = "" if run.cfg.outer.fragments == 1 else f" of fragment {sync.fragment}"
            weights = "global weights'" if run.cfg.outer.fragments == 1 else "fragment's global weights'"
            verdict = pseudo_grad_verdict(
                run, sync.delta_norm, sync.theta_norm, f"the sync{what} at update {update}", weights
            )
            if verdict[0]:
                return verdict
    return 0, ""


def pseudo_grad_verdict(
    run: PreparedRun, delta_norm: float, theta_norm: float, where: str, weights: str = "global weights'"
) -> tuple[int, str]:
    """The guard's verdict on one applied pseudo-gradient (a sync's mean, or an asynchronous server
    update's): its norm beyond guard.pseudo_grad_ratio x the norm of the weights it steps (`weights`,
    taken before the step), or not finite; 0 and "" to train on (and with the guard off)."""
    guard = run.cfg.guard
    if not guard.enabled or delta_norm <= guard.pseudo_grad_ratio * theta_norm:
        return 0, ""
    return PSEUDO_GRAD, (
        f"{DIVERGED_LINE}the pseudo-gradient norm at {where} is {delta_norm:.4g}, more than "
        f"guard.pseudo_grad_ratio={guard.pseudo_grad_ratio:g} times the {weights} norm {theta_norm:.4g}; "
        "the run stops"
    )


def stop_on_verdict(agreed: int, mine: int, why: str, after: str) -> None:
    """Every process raises on the verdict they agreed (a process other than the writer names the
    writer's held-out verdict without its figure: the writer's line and end row hold it); `after` names
    the point (a sync, a server update)."""
    if not agreed:
        return
    if agreed != mine:
        how = "is non-finite" if agreed == HELDOUT_NON_FINITE else "diverged"
        why = f"the held-out loss of the global weights after {after} {how} on rank 0; the run stops"
    raise (NonFiniteError if agreed == HELDOUT_NON_FINITE else Diverged)(why)
