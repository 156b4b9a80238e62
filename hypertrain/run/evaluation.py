"""The held-out loss of the global weights: the token mean over the last data.heldout ids, weighted as
the training loss is (and, for a multistream model, its text and mean audio channels).
"""

from __future__ import annotations

import torch

from hypertrain.diloco.state import PreparedRun
from hypertrain.engines.contract import channel_means, microbatch_terms
from hypertrain.model.transformer import Params, loss_channels


@torch.no_grad()
def heldout_eval(run: PreparedRun, theta: Params) -> tuple[float, dict[str, float]]:
    """The held-out loss of the global weights and, for multistream, from the same forward passes,
    the text channel's (channel 0) held-out token mean and the mean over the audio channels (1..C-1)
    of theirs, as `eval_loss_text` and `eval_loss_audio_mean` ({} otherwise)."""
    params = {n: t.unsqueeze(0) for n, t in theta.items()}
    total, sums, counts = 0, 0, 0
    for mb in run.heldout.microbatches:
        loss, channel = microbatch_terms(run.cfg, params, mb)
        total = total + loss.double()
        sums = sums + channel.double()
        counts = counts + mb.channel_counts.to(channel.device)
    if not loss_channels(run.cfg.model):
        return float(total), {}
    means = channel_means(sums, counts).tolist()
    return float(total), {
        "eval_loss_text": means[0],
        "eval_loss_audio_mean": sum(means[1:]) / max(1, len(means) - 1),
    }
