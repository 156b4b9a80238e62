"""A sync between its take and its landing (`Pending`): the fragment, the update count it was taken
at, which local replicas took part, churn's facts of it, and its reduction: in flight (`Reduction`,
e.g. an asynchronous collective) or known (`Landed`). A checkpoint stores the result, so a resumed run
issues nothing again; its saved form is unchanged since before the sync was one object per fragment.
With outer.overlap a checkpoint stores what was taken instead (`taken_state`) and the resumed run
re-issues the reduction (`from_taken`): the reduction is deterministic, and waiting for it at every
checkpoint would undo the overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from hypertrain.diloco.churn import RoundFacts


@dataclass
class Reduced:
    """A communication stage's result: the mean pseudo-gradient (flat), the replicas that took part,
    and a codec's facts (None for fp32's exact mean): the bytes one participant sent, each replica's
    payload bytes and each one's compression error (None for a replica that did not take part)."""

    mean: Tensor
    synced: int
    sent_bytes: int | None = None
    payload_bytes: int | None = None
    compress_error: list[float | None] | None = None
    # of `payload_bytes`, what is exchanged only at the landing (low rank's second gather: its Q factors)
    landing_bytes: int | None = None

    @property
    def figures(self) -> dict:
        """The codec's facts as a checkpoint stores them (`comm_outer_bytes`, `payload_bytes`,
        `compress_error`, low rank's `landing_bytes`; empty for fp32)."""
        if self.sent_bytes is None:
            return {}
        figures = {
            "comm_outer_bytes": self.sent_bytes,
            "payload_bytes": self.payload_bytes,
            "compress_error": self.compress_error,
        }
        return figures if self.landing_bytes is None else figures | {"landing_bytes": self.landing_bytes}

    @classmethod
    def of(cls, mean: Tensor, synced: int, figures: dict) -> Reduced:
        """From a checkpoint's `figures` (see `figures`)."""
        return cls(
            mean,
            synced,
            figures.get("comm_outer_bytes"),
            figures.get("payload_bytes"),
            figures.get("compress_error"),
            figures.get("landing_bytes"),
        )


class Reduction(Protocol):
    """A communication stage's result in the making: `wait()` gives the `Reduced`, or None when no
    replica took part; every process gets the same numbers."""

    def wait(self) -> Reduced | None: ...

    def is_completed(self) -> bool: ...


class Landed:
    """A reduction whose result is known."""

    def __init__(self, result: Reduced | None):
        self.result = result

    def wait(self) -> Reduced | None:
        return self.result

    def is_completed(self) -> bool:
        return True


@dataclass
class Pending:
    fragment: int
    taken_at: int  # the update count (updates done in the phase) at which it was taken
    stepped: list[bool]  # which local replicas took part (stepped since the fragment's last landing)
    reduction: Reduction
    # with churn: who contributed, was absent, missed (decided at the take); None when churn is off or
    # the pending sync was read back from a checkpoint (its landing decides them again, the same way)
    churn: RoundFacts | None = None
    # outer.overlap (a reduction in flight a whole round): what was taken, this process's replicas'
    # pseudo-gradients [R_local, n] fp32 and their error buffers before the take (None without error
    # feedback), which a checkpoint stores and a resumed run re-issues the reduction from; and each
    # replica's own contribution d_m [R_local, n] (eager's fresh and stale terms)
    taken: Tensor | None = None
    errors_before: Tensor | None = None
    own: Tensor | None = None
    # outer.mean_weights=tokens with outer.overlap: every replica's token weight of the window it took,
    # fp32 [R] (None: uniform), which the checkpoint stores beside what was taken
    weights: Tensor | None = None

    def settle(self) -> None:
        """Wait for the reduction (every process, at the same point) and keep its result."""
        if not isinstance(self.reduction, Landed):
            self.reduction = Landed(self.reduction.wait())

    def state_dict(self, stepped: list[bool] | None = None) -> dict:
        """Its result (waited for). `stepped`: every replica's flag (gathered from all processes),
        else this process's."""
        self.settle()
        result = self.reduction.wait()
        return {
            "fragment": self.fragment,
            "taken_at": self.taken_at,
            "stepped": list(self.stepped if stepped is None else stepped),
            "mean": None if result is None else result.mean.cpu(),
            "synced": 0 if result is None else result.synced,
            "figures": {} if result is None else dict(result.figures),
        }

    @classmethod
    def from_state_dict(cls, saved: dict, rows: list[int], device: torch.device) -> Pending:
        """This process's part of a saved pending sync (`rows`: its replicas' rows in `saved`)."""
        mean = saved["mean"]
        figures = saved["figures"]
        result = None if mean is None else Reduced.of(mean.to(device), int(saved["synced"]), figures)
        stepped = [bool(saved["stepped"][i]) for i in rows]
        return cls(int(saved["fragment"]), int(saved["taken_at"]), stepped, Landed(result))

    def taken_state(self, stepped: list[bool], taken: list[Tensor], errors: list[Tensor] | None) -> dict:
        """outer.overlap: what was taken, not waited for: every replica's flag, pseudo-gradient and error
        buffer before the take (gathered from all processes, in replica order), and the token weights
        (every replica's, the same on every process) where it has them."""
        saved = {
            "fragment": self.fragment,
            "taken_at": self.taken_at,
            "stepped": list(stepped),
            "taken": list(taken),
            "errors_before": None if errors is None else list(errors),
        }
        return saved if self.weights is None else saved | {"weights": self.weights.cpu()}

    @classmethod
    def from_taken(cls, saved: dict, rows: list[int], device: torch.device) -> Pending:
        """This process's part of `taken_state` (`rows`: its replicas'), its reduction not issued yet
        (`diloco.sync.FragmentSync.issue`)."""
        errors, weights = saved["errors_before"], saved.get("weights")
        return cls(
            int(saved["fragment"]),
            int(saved["taken_at"]),
            [bool(saved["stepped"][i]) for i in rows],
            Landed(None),
            taken=torch.stack([saved["taken"][i] for i in rows]).to(device),
            errors_before=None if errors is None else torch.stack([errors[i] for i in rows]).to(device),
            weights=None if weights is None else weights.to(device),
        )
