"""The engine contract (hypertrain.engines): every name maps to an engine, an unknown one is an error."""

from __future__ import annotations

import pytest

from hypertrain.choices import EngineName
from hypertrain.engines import engine_for, loop, stacked


def test_each_engine_name_selects_its_own_engine():
    assert engine_for("loop") is loop.train_replicas
    assert engine_for("stacked") is stacked.train_replicas
    assert set(EngineName) == {"loop", "stacked"}  # how many processes is processes=, not an engine


def test_an_unknown_engine_name_is_an_error_not_a_default():
    with pytest.raises(ValueError, match=r"engine.name='stacke' is not an engine; valid: 'loop', 'stacked'"):
        engine_for("stacke")
    with pytest.raises(ValueError, match=r"engine.name='dist' is not an engine"):
        engine_for("dist")
