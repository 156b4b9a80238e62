"""The config's string choices are enums (hypertrain.choices), decided once: OmegaConf refuses a value
a choice does not have, and the entry says so in the house's one line (the field, the value, the
valid ones); a member reads as its str everywhere, and what a run stores holds plain str only
(checkpoints load with `torch.load(weights_only=True)`, config.yaml reads as before).
"""

from __future__ import annotations

import dataclasses
import io
import typing

import pytest
import torch
import yaml
from helpers import compose_train
from omegaconf import OmegaConf

from hypertrain.choices import Choice, Compressor, EngineName, Schedule, StatePolicy
from hypertrain.clock.timeline import Clock, Shape
from hypertrain.config import ClusterConfig, OuterConfig, TrainConfig, as_builtins
from hypertrain.preflight.checked import resolved_config
from hypertrain.preflight.composition import composition_error


def choice_fields(schema: type, prefix: str = "") -> list[tuple[str, type[Choice]]]:
    """(dotted key, its enum) for every field of `schema` typed by a Choice (in a node some runs lack,
    `X | None`, too)."""
    hints = typing.get_type_hints(schema)
    found = []
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        node = next((k for k in (kind, *typing.get_args(kind)) if dataclasses.is_dataclass(k)), None)
        if node is not None:
            found += choice_fields(node, f"{prefix}{f.name}.")
        elif isinstance(kind, type) and issubclass(kind, Choice):
            found.append((f"{prefix}{f.name}", kind))
    return found


FIELDS = choice_fields(TrainConfig)


def test_every_choice_is_named_by_its_value_and_reads_as_its_str():
    # issue 34's 20, overlap (36), transform, topk.values (37), replica_split (38),
    # schedule, async_rule (now outer.arrivals.rule), mean_weights (39)
    # outer.compress, data.name, model.arch and outer.schedule are str since issue 49 (a codec, a data
    # source, a model, a schedule by import path)
    assert len(FIELDS) == 23, FIELDS
    for _, enum in FIELDS:
        for member in enum:
            assert member.name == member.value and member.value.isidentifier(), member
            assert member == member.value and hash(member) == hash(member.value)
            assert f"{member}" == str(member) == member.value and repr(member) == repr(member.value)
    assert f"outer.compress={Compressor.none!r}" == "outer.compress='none'"


@pytest.mark.parametrize("key,enum", FIELDS, ids=[key for key, _ in FIELDS])
def test_a_value_a_choice_lacks_is_one_line_naming_the_field_the_value_and_the_valid_ones(key, enum):
    with pytest.raises(Exception) as caught:
        compose_train([f"{key}=bogus"])
    valid = ", ".join(repr(member.value) for member in enum)
    assert composition_error(caught.value) == f"{key}='bogus' is not valid; valid: {valid}"


def test_a_choice_is_given_by_its_name_and_composes_to_its_member():
    cfg = OmegaConf.to_object(compose_train(["inner.state_policy=reset", "engine=loop"]))
    assert cfg.inner.state_policy is StatePolicy.reset and cfg.engine.name is EngineName.loop


def test_what_a_run_stores_holds_plain_str_never_a_member(tmp_path):
    cfg = TrainConfig(outer=OuterConfig(schedule=Schedule["async"], compress="topk"))  # outer.arrivals, .topk
    resolved = resolved_config(cfg)
    stored = [resolved, as_builtins(ClusterConfig())]
    clock = Clock(Shape.of(resolved), cfg.cluster, 1000)
    stored.append(clock.state_dict())
    buffer = io.BytesIO()
    torch.save(stored, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == stored  # a member would need its class to unpickle
    for key, _ in FIELDS:
        value = resolved
        for part in key.split("."):
            value = value[part]
        assert type(value) is str, key
    assert type(stored[1]["compute"]) is str
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    assert yaml.safe_load(text)["outer"]["compress"] == "topk"  # config.yaml as before: the plain value
