"""A sync between its take and its landing (`Pending`): the fragment, the update count it was taken
at, which local replicas took part, and its reduction: in flight (`Reduction`, e.g. an asynchronous
collective) or known (`Landed`). A checkpoint stores the result, so a resumed run issues nothing again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class Reduced:
    """A communication stage's result: the mean pseudo-gradient (flat), the replicas that took part,
    and what the stage reports for the sync row (a compressor's bytes and errors; none for fp32)."""

    mean: Tensor
    synced: int
    figures: dict = field(default_factory=dict)


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
        figures = saved.get("figures", {})
        result = None if mean is None else Reduced(mean.to(device), int(saved["synced"]), figures)
        stepped = [bool(saved["stepped"][i]) for i in rows]
        return cls(int(saved["fragment"]), int(saved["taken_at"]), stepped, Landed(result))
