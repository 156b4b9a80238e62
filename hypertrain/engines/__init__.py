"""Engines: how one process computes the inner steps of its replicas, and what they measured.

Every engine keeps the contract in `contract.py`: `loop` (replicas one after another, the reference
the others are checked against) and `stacked` (all replicas of a sub-round as one model with a
leading replica axis). `ENGINES` is their table, free of torch (the preflight asks it before a run is
built): `engine_for(engine.name)` imports and gives the engine, `replicas_at_once` tells the memory
estimate how many replicas' activations it holds at once.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hypertrain.choices import EngineName

if TYPE_CHECKING:
    from hypertrain.engines.contract import Engine


@dataclass(frozen=True)
class EngineEntry:
    """An engine: its module (`train_replicas`, imported when a run asks for it) and whether it computes
    a sub-round of engine.stack replicas as one model (else one replica after another)."""

    module: str
    stacks: bool

    def replicas_at_once(self, stack: int, replicas: int) -> int:
        """Of a process's `replicas`, those whose activations it holds at once (`stack`: 0, all of them)."""
        return min(stack or replicas, replicas) if self.stacks else 1


ENGINES = {
    EngineName.loop: EngineEntry("hypertrain.engines.loop", stacks=False),
    EngineName.stacked: EngineEntry("hypertrain.engines.stacked", stacks=True),
}


def engine_for(name: str) -> Engine:
    """The inner-step engine called `name`; an unknown name is a ValueError naming the valid ones."""
    if name not in ENGINES:
        valid = ", ".join(repr(member.value) for member in EngineName)
        raise ValueError(f"engine.name={name!r} is not an engine; valid: {valid}")
    return importlib.import_module(ENGINES[EngineName(name)].module).train_replicas


def replicas_at_once(name: str, stack: int, replicas: int) -> int:
    """How many of a process's `replicas` engine `name` holds activations of at once (engine.stack)."""
    return ENGINES[EngineName(name)].replicas_at_once(stack, replicas)
