"""The held-out loss of the global weights: the token mean over the last data.heldout ids, weighted as
the training loss is (and, for a multistream model, its text and mean audio channels; for a prepared
corpus of several sources, each source's).
"""

from __future__ import annotations

import torch

from hypertrain.diloco.state import PreparedRun
from hypertrain.engines.contract import channel_means, microbatch_terms
from hypertrain.model.transformer import Params, loss_channels


@torch.no_grad()
def heldout_eval(run: PreparedRun, theta: Params) -> tuple[float, dict]:
    """The held-out loss of the global weights and, from the same forward passes: for multistream the
    text channel's (channel 0) held-out token mean and the mean over the audio channels (1..C-1) of
    theirs, as `eval_loss_text` and `eval_loss_audio_mean`; for a prepared corpus of several sources
    each source's held-out token mean, as the list `eval_loss_sources` (None for a source with no
    held-out example); {} otherwise."""
    params = {n: t.unsqueeze(0) for n, t in theta.items()}
    total, sums, counts = 0, 0, 0
    per_source = [0.0] * run.sources
    for i, mb in enumerate(run.heldout.microbatches):
        loss, channel = microbatch_terms(run.cfg, params, mb)
        total = total + loss.double()
        sums = sums + channel.double()
        counts = counts + mb.channel_counts.to(channel.device)
        if run.heldout_sources:
            per_source[run.heldout_sources[i]] += loss.double()  # a tensor: no sync per microbatch
    if run.heldout_sources:
        return float(total), {"eval_loss_sources": source_means(run, [float(x) for x in per_source])}
    if not loss_channels(run.cfg.model):
        return float(total), {}
    means = channel_means(sums, counts).tolist()
    return float(total), {
        "eval_loss_text": means[0],
        "eval_loss_audio_mean": sum(means[1:]) / max(1, len(means) - 1),
    }


def source_means(run: PreparedRun, weighted: list[float]) -> list[float | None]:
    """Each source's held-out token mean from its microbatches' weighted losses (each weighted by its
    targets over all the held-out targets, so a source's sum times all over its own targets)."""
    everything = run.heldout.targets
    own = [0] * run.sources
    for i, mb in enumerate(run.heldout.microbatches):
        own[run.heldout_sources[i]] += mb.targets
    return [w * everything / n if n else None for w, n in zip(weighted, own, strict=True)]
