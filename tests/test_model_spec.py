"""The model table (`hypertrain.model.spec`): the config picks one entry, and the fragments ask it where
each parameter sits, so a parameter the model does not place is refused (never the last fragment by
default) and a model whose layers are named otherwise is split by its layers all the same.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hypertrain.config import ModelConfig, OuterConfig, TrainConfig, UserError
from hypertrain.diloco import fragments
from hypertrain.engines.columns import REPLICA_COLUMNS
from hypertrain.model.spec import AFTER, BEFORE, MODELS, Decoder, model_spec

ROOT = Path(__file__).resolve().parents[1]
ROUTER_COLUMNS = ("router_aux", "expert_min", "expert_max")  # the update rows' names of ROUTER_FIGURES
# One config per entry: three layers, so that P = 1..4 fragments all hold parameters.
LAYERS = 3
CONFIGS = {
    "decoder": ModelConfig(d_model=32, n_layers=LAYERS, n_heads=2, n_kv_heads=2),
    "moe": ModelConfig(d_model=32, n_layers=LAYERS, n_heads=2, n_kv_heads=2, is_moe=True, expert_ffn=8),
    "multistream": ModelConfig(
        d_model=32, n_layers=LAYERS, n_heads=2, n_kv_heads=2, arch="multistream", channel_vocabs=[7, 5, 5]
    ),
    # a Hugging Face Llama (docs/hf.md): its own names, `model.layers.<i>.` (transformers is a dev extra)
    "hf": ModelConfig(
        arch="hf",
        config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS)
        | dict(num_attention_heads=2, num_key_value_heads=2, vocab_size=64),
    ),
}


def test_every_entry_has_a_config_here_and_each_config_picks_its_entry():
    assert CONFIGS.keys() == MODELS.keys()
    for kind, cfg in CONFIGS.items():
        assert model_spec(cfg) is MODELS[kind]


@pytest.mark.parametrize("path", sorted((ROOT / "conf" / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_model_preset_picks_the_entry_its_fields_say(path):
    """The presets' spellings (model.arch, model.is_moe) unchanged, read by `model_spec` alone."""
    fields = OmegaConf.to_container(OmegaConf.load(path))
    cfg = ModelConfig(**fields)
    expected = "moe" if fields.get("is_moe") else fields.get("arch", "decoder")
    assert model_spec(cfg) is MODELS[expected]


def test_the_replica_records_hold_each_entrys_columns_filled_from_what_its_engine_returned():
    """`REPLICA_COLUMNS` is the engine's own four and the entries' columns; each entry fills its own
    from the engine's channel means and router figures, and nothing when the replica skipped."""
    own = ("stepped", "loss", "targets", "microbatches")
    assert REPLICA_COLUMNS.names == own + tuple(c for e in MODELS.values() for c in e.replica_columns)
    means, routing = [2.0, 1.0, 4.0], [0.5, 0.1, 0.7]
    assert MODELS["decoder"].replica_values(None, None) == {}
    assert MODELS["multistream"].replica_values(means, None) == {"text_loss": 2.0, "audio_loss": 2.5}
    assert MODELS["moe"].replica_values(None, routing) == dict(zip(ROUTER_COLUMNS, routing, strict=True))
    assert all(e.replica_values(None, None) == {} for e in MODELS.values())


def layer_in_name(name: str) -> int | str:
    """The place today's models give a parameter, read from its name alone: `layers.<i>.` is layer i,
    the embeddings come before the layers, the final norm and the heads after them."""
    match = re.fullmatch(r"(?:model\.)?layers\.(\d+)\..+", name)
    if match:
        return int(match.group(1))
    return BEFORE if name.split(".")[0] == "emb" or ".embed_tokens." in name else AFTER


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_each_entry_places_every_parameter_in_the_layer_its_name_holds(kind):
    cfg, entry = CONFIGS[kind], MODELS[kind]
    names = list(entry.param_specs(cfg))
    places = entry.places(cfg, names)
    assert places == {name: layer_in_name(name) for name in names}
    assert sorted({p for p in places.values() if isinstance(p, int)}) == list(range(LAYERS))
    for P in range(1, LAYERS + 2):
        where = fragments.fragment_of(TrainConfig(model=cfg, outer=OuterConfig(fragments=P)))
        ends = {BEFORE: 0, AFTER: P - 1}
        assert where == {n: ends[p] if p in ends else p % P for n, p in places.items()}


def test_a_parameter_the_model_does_not_place_is_refused_not_put_in_the_last_fragment():
    cfg = TrainConfig(model=CONFIGS["decoder"], outer=OuterConfig(fragments=2))
    names = [*model_spec(cfg.model).param_specs(cfg.model), "model.layers.3.wq"]
    refused = r"model parameter 'model\.layers\.3\.wq' is not placed by the decoder model"
    with pytest.raises(UserError, match=refused) as e:
        fragments.fragment_of(cfg, names)
    assert "\n" not in str(e.value)


class Prefixed(Decoder):
    """A decoder whose parameters are named as Hugging Face names them (`model.layers.<i>.`, no zero
    padding): the place is declared by the model, whatever its names."""

    def declared(self, cfg):
        out = {}
        for name, (shape, role, place) in super().declared(cfg).items():
            if isinstance(place, int):
                name = f"model.layers.{place}." + name.split(".", 2)[2]
            out[name] = (shape, role, place)
        return out


def test_a_model_with_other_names_is_split_by_its_own_layers(monkeypatch):
    monkeypatch.setattr(fragments, "model_spec", lambda cfg: Prefixed())
    cfg = TrainConfig(model=CONFIGS["decoder"], outer=OuterConfig(fragments=2))
    where = fragments.fragment_of(cfg)
    layers = {n: int(n.split(".")[2]) for n in where if n.startswith("model.layers.")}
    assert len(layers) == sum(n.startswith("layers.") for n in Decoder().param_specs(cfg.model))
    assert {n: where[n] for n in layers} == {n: i % 2 for n, i in layers.items()}
    assert fragments.assignment(cfg)[0].startswith("layer0 layer2 emb")


def test_no_model_name_or_flag_is_compared_outside_the_model_package_and_the_configs_checks():
    """The model's facts are asked of its entry: `model.arch` and `model.is_moe` are read by
    `model_spec` and `check_model` (and is_moe by the config's own check of the experts' fields), nowhere
    else in the package; the config compares no model name (what an entry takes is its own)."""
    pattern = re.compile(r"is_moe|\.arch ==|\.arch !=|\.arch in")
    package = ROOT / "hypertrain"
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in sorted(package.rglob("*.py"))
        if path.parent != package / "model" and path != package / "config.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
    names = re.compile(r"\.arch ==|\.arch !=|\.arch in")
    config = (package / "config.py").read_text().splitlines()
    assert [i for i, line in enumerate(config, 1) if names.search(line)] == []
