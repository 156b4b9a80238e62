"""A Hugging Face causal LM as the replica (`model.arch=hf`, docs/hf.md): built once per process from a
local directory (`model.path`, offline, never remote code) or a config's fields (`model.config`), its
parameters (their own names, tied once) described, initialised and called by name.

`describe(cfg)` gives each parameter's shape, role and layer (the model's own layer list, whatever its
names); `init_params(cfg, seed)` the directory's weights or the config's init under `seed` (torch's global
generator untouched); `logits(cfg, p, inputs)` runs R replicas: `torch.func.functional_call` for R = 1
(the loop engine), the same under `torch.vmap` over `[R, ...]` parameters for R > 1 (the stacked
engine), the module's buffers shared. Whatever cannot be read or batched is a `UserError` (one line).
The same machinery runs a model entry from outside the package (`model.arch=module.NAME`, a
`model.spec.ModuleModel`): its `factory` builds the module, its `layer_list` and `head` place and role.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import json
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from hypertrain.config import ModelConfig, UserError

EXTRA = "pip install 'hypertrain[hf]' (or -e .[hf])"
# torch's vmap runs the CPU flash attention kernel replica by replica (no batching rule yet): correct,
# and what the stacked engine's benchmark measures (docs/performance.md), not a warning at every step.
NO_BATCHING_RULE = "There is a performance drop because we have not yet implemented the batching rule"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError(f"model=hf needs transformers, which is not installed; valid: {EXTRA}") from None
    transformers.logging.set_verbosity_error()  # its advice goes to the log, not the run's one line
    return transformers


def _key(cfg: ModelConfig) -> tuple[str, str, str]:
    """What builds the module: a Hugging Face model's path and config, an outside entry's whole section."""
    if cfg.arch == "hf":
        return "hf", cfg.path, json.dumps(dict(cfg.config), sort_keys=True, default=str)
    return str(cfg.arch), "", json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)


def _outside(path: str):
    """The `ModuleModel` entry at the import path `path` (the config's check resolved it already)."""
    module, _, attribute = path.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def _build_outside(cfg: ModelConfig, seed: int) -> nn.Module:
    """An outside entry's module (CPU, fp32, eval) from its factory, initialised under `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = _outside(str(cfg.arch)).factory(cfg)
    _check_batchable(module, str(cfg.arch))
    return module.float().eval()


def _read_config(path: str):
    """The directory's config, checked before transformers reads it (no remote code, a known type)."""
    where = Path(path).expanduser()
    file = where / "config.json"
    try:
        fields = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(
            f"model.path={path!r} holds no readable config.json ({type(e).__name__}); "
            "valid: a local Hugging Face model directory (save_pretrained's)"
        ) from None
    if not isinstance(fields, dict):
        raise UserError(f"model.path={path!r}: its config.json is not an object; valid: save_pretrained's")
    if "auto_map" in fields:
        raise UserError(
            f"model.path={path!r} needs remote code (its config.json has auto_map), which hypertrain never "
            "runs; valid: a model transformers builds itself"
        )
    config = _config_of(fields, f"model.path={path!r}")
    return config, where


def _config_of(fields: dict, what: str):
    """A transformers config from its fields (with `model_type`); UserError when it is not one."""
    tf = _transformers()
    fields = dict(fields)
    kind = fields.pop("model_type", None)
    if kind not in tf.CONFIG_MAPPING:
        raise UserError(
            f"{what}: model_type {kind!r} is not a model transformers {tf.__version__} knows; "
            "valid: llama, qwen2, qwen3, gpt2, mistral, ... (transformers' CONFIG_MAPPING)"
        )
    if fields.pop("gradient_checkpointing", False):
        raise UserError(f"{what}: gradient checkpointing does not run under vmap; valid: false")
    attention = fields.pop("attn_implementation", None) or fields.pop("_attn_implementation", None) or "sdpa"
    if attention not in ("sdpa", "eager"):
        raise UserError(f"{what}: attention {attention!r} does not run under vmap; valid: sdpa, eager")
    config_class = tf.CONFIG_MAPPING[kind]
    if config_class not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"{what}: model_type {kind!r} is not a causal LM; valid: a *ForCausalLM model")
    try:
        config = config_class(**fields)
    except (TypeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{what}: its fields do not make a {kind} config ({first})") from None
    config._attn_implementation = attention
    return config


def _has_weights(where: Path) -> bool:
    return any(where.glob("*.safetensors")) or any(where.glob("pytorch_model*.bin"))


def _build(cfg: ModelConfig, seed: int) -> nn.Module:
    """A real instance (CPU, fp32, eval): the directory's weights, or initialised under `seed`."""
    if cfg.arch != "hf":
        return _build_outside(cfg, seed)
    tf = _transformers()
    if cfg.path:
        config, where = _read_config(cfg.path)
    else:
        config, where = _config_of(cfg.config, "model.config"), None
    with torch.random.fork_rng(devices=[]):  # the init draws from the global generator: restored after
        torch.manual_seed(seed)
        if where is not None and _has_weights(where):
            try:
                module = tf.AutoModelForCausalLM.from_pretrained(
                    where, config=config, local_files_only=True, trust_remote_code=False, dtype=torch.float32
                )
            except (OSError, ValueError, RuntimeError) as e:
                raise UserError(
                    f"model.path={cfg.path!r}: its weights cannot be read ({type(e).__name__}); "
                    "valid: safetensors (or torch files loadable with weights_only)"
                ) from None
        else:
            module = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _check_batchable(module, cfg.path or "model.config")
    return module.eval()


def _check_batchable(module: nn.Module, what: str) -> None:
    """Dropout (an nn.Dropout with p > 0, an attention dropout above 0) does not run under vmap."""
    for name, sub in module.named_modules():
        rate = sub.p if isinstance(sub, nn.Dropout) else getattr(sub, "attention_dropout", 0.0)
        if isinstance(rate, (int, float)) and rate > 0:
            raise UserError(
                f"{what}: {name or type(module).__name__} drops out (p={rate}), which vmap cannot batch "
                "and the replicas' comparison forbids; valid: every dropout 0 in the config"
            )


@functools.cache
def _base(key: tuple[str, str, str]) -> nn.Module:
    arch, path, config = key
    if arch != "hf":
        return _build(ModelConfig(**json.loads(config)), 0)
    return _build(ModelConfig(arch="hf", path=path, config=json.loads(config)), 0)


def base(cfg: ModelConfig) -> nn.Module:
    """The process's one instance of the model (CPU): its shapes, ties, layer list and buffers."""
    return _base(_key(cfg))


@functools.cache
def _on(key: tuple[str, str, str], device: str) -> nn.Module:
    module = _base(key)
    return module if device == "cpu" else copy.deepcopy(module).to(device)


@torch.compiler.disable  # engine.compile: a cache lookup, not traced (dynamo would trace the build itself)
def _module(cfg: ModelConfig, device: str) -> nn.Module:
    return _on(_key(cfg), device)


def layer_list(module: nn.Module) -> str:
    """The name of the model's layer list: its ModuleList holding the most parameters."""
    lists = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, nn.ModuleList)]
    if not lists:
        raise UserError(f"{type(module).__name__} has no list of layers; valid: a decoder-only causal LM")
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))[0]


def describe(
    cfg: ModelConfig, layers: str | None = None, head: str | None = None
) -> dict[str, tuple[tuple[int, ...], str, int | None, bool]]:
    """Name -> (shape, role, layer index or None, before the layers) of every parameter, tied ones once:
    the embeddings (every nn.Embedding) and an untied output head are AdamW's, like every 1-D tensor
    (`norm`); the other matrices are Muon's (`hidden`). Outside the layer list a parameter sits before
    the layers when the module registers it before them. An outside entry names its layer list and its
    head's submodule (`layers`, `head`); a Hugging Face model's are found."""
    module = base(cfg)
    layers = (layers or layer_list(module)) + "."
    embeddings = {id(sub.weight) for sub in module.modules() if isinstance(sub, nn.Embedding)}
    head = module.get_submodule(head) if head else getattr(module, "get_output_embeddings", lambda: None)()
    head_id = None if head is None else id(head.weight)
    out, seen_layer = {}, False
    for name, p in module.named_parameters():
        layer = None
        if name.startswith(layers):
            layer, seen_layer = int(name[len(layers) :].split(".")[0]), True
        if id(p) in embeddings:
            role = "embedding"
        elif id(p) == head_id:
            role = "head"
        else:
            role = "hidden" if p.dim() >= 2 else "norm"
        out[name] = (tuple(p.shape), role, layer, not seen_layer)
    return dict(sorted(out.items()))


def config_fields(cfg: ModelConfig) -> dict:
    """The sizes the memory estimate and the clock read: hidden, intermediate, heads, layers, vocab."""
    config = base(cfg).config
    hidden = config.hidden_size
    return {
        "hidden": hidden,
        "intermediate": getattr(config, "intermediate_size", None)
        or getattr(config, "n_inner", None)
        or 4 * hidden,
        "heads": config.num_attention_heads,
        "layers": config.num_hidden_layers,
        "vocab": config.vocab_size,
    }


def init_params(cfg: ModelConfig, seed: int) -> dict[str, Tensor]:
    """One replica's fp32 weights: the directory's, else the config's initialisation under `seed`."""
    pretrained = cfg.arch == "hf" and bool(cfg.path) and _has_weights(Path(cfg.path).expanduser())
    module = base(cfg) if pretrained else _build(cfg, seed)
    return {name: p.detach().clone() for name, p in sorted(module.named_parameters())}


def logits(cfg: ModelConfig, p: dict[str, Tensor], inputs: Tensor) -> Tensor:
    """inputs int64 [R, B, T] -> logits [R, B*T, vocab]: the module called with each replica's
    parameters (no attention mask: rows are right-padded and attention is causal). With
    model.compute_dtype=bf16 the module runs on bf16 copies of the fp32 weights (autocast off: its SDPA
    refuses autocast's mixed query and value dtypes), the gradients flowing back to the fp32 weights;
    float64 weights (the tests' reference) stay float64, as autocast leaves them."""
    R, B, T = inputs.shape
    module = _module(cfg, str(inputs.device))
    if cfg.compute_dtype == "bf16":  # the module in bf16 from the fp32 weights (its own casts, no autocast)
        p = {n: t.to(torch.bfloat16) if t.dtype == torch.float32 else t for n, t in p.items()}

    def one(params: dict[str, Tensor], ids: Tensor) -> Tensor:
        if cfg.arch != "hf":  # an outside entry's module returns its logits [B, T, vocab]
            return torch.func.functional_call(module, params, (ids,))
        return torch.func.functional_call(module, params, (ids,), {"use_cache": False}).logits

    with torch.autocast(inputs.device.type, enabled=False):
        out = _call(one, p, inputs)
    return out.reshape(R, B * T, out.shape[-1])


def _call(one, p: dict[str, Tensor], inputs: Tensor) -> Tensor:
    """`one` for each replica: alone (R = 1, the loop engine), else under vmap (the stacked engine)."""
    if inputs.shape[0] == 1:
        out = one({n: t[0] for n, t in p.items()}, inputs[0]).unsqueeze(0)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NO_BATCHING_RULE)
            out = torch.vmap(one)(p, inputs)
    return out
