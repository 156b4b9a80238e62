"""The protocols name what a component offers: every implementation keeps to them, and the model's
forward gives the loss and the channel sums in one shape for every architecture."""

from __future__ import annotations

import inspect
from typing import get_type_hints

import pytest
import torch

from hypertrain.config import ModelConfig
from hypertrain.data.batches import is_multistream
from hypertrain.data.datasets import Dataset, MultistreamDataset
from hypertrain.data.speech.dataset import SpeechDataset
from hypertrain.data.text import TextDataset
from hypertrain.engines import engine_for
from hypertrain.engines.contract import Engine
from hypertrain.model.transformer import forward, init_params, loss_channels
from hypertrain.rundir.jsonl import JsonlWriter
from hypertrain.rundir.logger import Logger
from hypertrain.rundir.records import NoLog, Records, RunLogger
from hypertrain.rundir.wandb_mirror import WandbMirror


def protocol_members(protocol: type) -> dict[str, object]:
    """Name -> signature (methods) or annotation (attributes) of what `protocol` declares."""
    members = {
        n: inspect.signature(f)
        for n, f in vars(protocol).items()
        if inspect.isfunction(f) and f.__qualname__ == f"{protocol.__name__}.{n}"  # not typing's
    }
    return members | dict(get_type_hints(protocol))


@pytest.mark.parametrize("implementation", [TextDataset, SpeechDataset])
def test_every_dataset_offers_the_dataset_protocol(implementation):
    hints = get_type_hints(implementation)
    for name, wanted in protocol_members(Dataset).items():
        if isinstance(wanted, inspect.Signature):
            assert inspect.signature(getattr(implementation, name)) == wanted, name
        else:  # an attribute: a field, a class attribute or a property
            assert name in hints or hasattr(implementation, name), name


def test_speech_alone_is_multistream():
    for name in protocol_members(MultistreamDataset):
        assert hasattr(SpeechDataset, name) or name in get_type_hints(SpeechDataset), name
    assert not any(hasattr(TextDataset, name) for name in protocol_members(MultistreamDataset))
    assert not is_multistream(object())


@pytest.mark.parametrize("implementation", [RunLogger, NoLog])
def test_run_logger_and_no_log_offer_the_records_protocol(implementation):
    for name, wanted in protocol_members(Records).items():
        assert inspect.signature(getattr(implementation, name)) == wanted, name


@pytest.mark.parametrize("implementation", [JsonlWriter, WandbMirror, RunLogger])
def test_the_writer_the_mirror_and_their_container_offer_the_logger_protocol(implementation):
    for name, wanted in protocol_members(Logger).items():
        assert inspect.signature(getattr(implementation, name)) == wanted, name


@pytest.mark.parametrize("name", ["loop", "stacked"])
def test_every_engine_has_the_engine_call_signature(name):
    wanted = inspect.signature(Engine.__call__)
    got = inspect.signature(engine_for(name))
    assert list(got.parameters) == list(wanted.parameters)[1:]  # less `self`
    assert [p.default for p in got.parameters.values()] == [
        p.default for p in list(wanted.parameters.values())[1:]
    ]


@pytest.mark.parametrize("arch", ["decoder", "multistream"])
def test_forward_gives_the_loss_then_the_channel_sums_for_every_model(arch):
    cfg = ModelConfig(arch=arch, vocab=11, channel_vocabs=[11, 5, 5] if arch == "multistream" else [])
    cfg = ModelConfig(**{**cfg.__dict__, "d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2})
    params = {n: t.unsqueeze(0).expand(2, *t.shape) for n, t in init_params(cfg, 0).items()}
    gen = torch.Generator().manual_seed(0)
    if arch == "multistream":
        tokens = torch.randint(0, 5, (2, 3, 3, 6), generator=gen)
        out = forward(cfg, params, tokens, None, torch.full((2, 3), 0.1, dtype=torch.float64))
    else:
        out = forward(cfg, params, torch.randint(0, 11, (2, 3, 6), generator=gen))
    assert out.shape == (2, 1 + loss_channels(cfg))
    assert loss_channels(cfg) == (3 if arch == "multistream" else 0)


@pytest.mark.parametrize("implementation", ["ReplicaGroups", "DistReplicaGroups"])
def test_one_process_and_real_processes_offer_the_collectives_protocol(implementation):
    from hypertrain.distributed import collectives, groups

    cls = getattr(groups, implementation, None) or getattr(collectives, implementation)
    hints = get_type_hints(cls.__init__) | get_type_hints(cls)
    for name, wanted in protocol_members(groups.Collectives).items():
        if isinstance(wanted, inspect.Signature):
            assert inspect.signature(getattr(cls, name)) == wanted, name
        elif name == "is_writer":
            assert isinstance(getattr(cls, name), property), name
        else:  # an attribute: set on the class or in __init__
            source = inspect.getsource(cls) + inspect.getsource(groups.ReplicaGroups)
            assert hasattr(cls, name) or name in hints or f"self.{name}" in source, name
