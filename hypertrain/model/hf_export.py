"""A Hugging Face model's weights as a directory every tool of that ecosystem reads: `write_hf(cfg,
weights, out)` puts `weights` (the module's own parameter names, tied ones once, no replica axis) into a
copy of the run's module and writes it with `save_pretrained` (config.json, model.safetensors), so
`AutoModelForCausalLM.from_pretrained(out)` gives the same logits. The tokenizer is the caller's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor

from hypertrain.config import ModelConfig
from hypertrain.model.hf import base

HF_FOLDER = "hf"  # where a run with model=hf writes its final global weights (RUN/hf/)


def write_hf(cfg: ModelConfig, weights: dict[str, Tensor], out: Path) -> Path:
    """`weights` in the model of `cfg` (`model.hf`), saved with save_pretrained into `out`; `out`."""
    module = copy.deepcopy(base(cfg))
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise ValueError(f"write_hf: the weights lack {missing[0]!r} ({len(missing)} of {len(params)})")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].detach().to(device=p.device, dtype=p.dtype))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging

    logging.disable_progress_bar()  # a run's and the export command's output are their own lines
    module.save_pretrained(out, safe_serialization=True)
    return out
