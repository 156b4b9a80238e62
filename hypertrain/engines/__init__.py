"""Engines: how one process computes the inner steps of its replicas, and what they measured.

Every engine keeps the contract in `contract.py`: `loop` (replicas one after another, the reference
the others are checked against) and `stacked` (all replicas of a sub-round as one model with a
leading replica axis). `engine_for(engine.name)` gives the engine.
"""

from __future__ import annotations

from hypertrain.choices import EngineName
from hypertrain.engines import loop, stacked
from hypertrain.engines.contract import Engine


def engine_for(name: str) -> Engine:
    """The inner-step engine called `name`; an unknown name is a ValueError naming the valid ones."""
    if name == "loop":
        return loop.train_replicas
    if name == "stacked":
        return stacked.train_replicas
    valid = ", ".join(repr(member.value) for member in EngineName)
    raise ValueError(f"engine.name={name!r} is not an engine; valid: {valid}")
