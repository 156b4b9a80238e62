"""Engines: how one process computes the inner steps of its replicas, and what they measured.

Every engine keeps the contract in `contract.py`: `loop` (replicas one after another, the reference
the others are checked against) and `stacked` (all replicas of a sub-round as one model with a
leading replica axis). `ENGINES` is their table: `engine_for(engine.name)` gives the engine, and
`replicas_at_once` what the memory estimate asks of it.
"""

from __future__ import annotations

from hypertrain.choices import EngineName
from hypertrain.engines import loop, stacked
from hypertrain.engines.contract import Engine

# the engines' table: each module gives train_replicas and replicas_at_once
ENGINES = {EngineName.loop: loop, EngineName.stacked: stacked}


def engine_for(name: str) -> Engine:
    """The inner-step engine called `name`; an unknown name is a ValueError naming the valid ones."""
    if name not in ENGINES:
        valid = ", ".join(repr(member.value) for member in EngineName)
        raise ValueError(f"engine.name={name!r} is not an engine; valid: {valid}")
    return ENGINES[EngineName(name)].train_replicas


def replicas_at_once(name: str, stack: int, replicas: int) -> int:
    """How many of a process's `replicas` engine `name` holds activations of at once (engine.stack)."""
    return ENGINES[EngineName(name)].replicas_at_once(stack, replicas)
