"""BitNet b1.58's absmean ternary quantizer (Ma et al. 2024, "The Era of 1-bit LLMs: All Large Language
Models are in 1.58 Bits", arXiv:2402.17764, eqs. 1-3) as a codec of the pseudo-gradient that lives
outside the package: a `hypertrain.codec_table.Codec` entry, named on the command line by its import path
(outer.compress=ternary.TERNARY; docs/extending.md, "A codec").

Per block of outer.codec.block values x (a tensor's last block may be shorter): gamma = mean |x| over the
block's own values, codes RoundClip(x / (gamma + eps), -1, 1) = max(-1, min(1, round(x / (gamma + eps))))
(round half to even), sent as gamma in fp32 then 2 bits a code, four a byte; decoded code * gamma. What
it leaves out is what outer.error_feedback=true feeds into the next sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hypertrain.codec_table import ELEMENTWISE, Quantizer

CODES_PER_BYTE = 4  # 2 bits a code: value + 1 in {0, 1, 2}


@functools.lru_cache(maxsize=16)
def real_slots(blocks, device: torch.device) -> torch.Tensor:
    """bool [C, block]: which slots of the padded blocks hold a value (padding repeats a block's last)."""
    lengths = []
    for size, cut in zip(blocks.sizes, blocks.cuts, strict=True):
        full, rest = divmod(size, cut)
        lengths += [cut] * full + ([rest] if rest else [])
    return torch.arange(blocks.block) < torch.tensor(lengths, dtype=torch.int64)[:, None]


@dataclass(frozen=True)
class AbsMeanTernary(Quantizer):
    """An ELEMENTWISE entry: a header of one fp32 gamma a block, then the ternary codes packed."""

    eps: float = 1e-8  # the paper's epsilon, which keeps an all-zero block's x / (gamma + eps) at 0

    def encode(self, kernels, values, blocks, spec) -> list:
        """values fp32 [R, C, block] -> [gamma's 4 bytes, the packed codes] per block."""
        real = real_slots(blocks, values.device)
        gamma = values.abs().mul_(real).sum(-1, keepdim=True) / real.sum(-1, keepdim=True)
        codes = (values / (gamma + self.eps)).round_().clamp_(-1, 1).add_(1).to(torch.uint8)
        codes = torch.where(real, codes, 1)  # padding sends a 0
        codes = torch.nn.functional.pad(codes, (0, -blocks.block % CODES_PER_BYTE), value=1)
        quads = codes.unflatten(-1, (-1, CODES_PER_BYTE))
        packed = quads[..., 0] | quads[..., 1] << 2 | quads[..., 2] << 4 | quads[..., 3] << 6
        return [gamma.contiguous().view(torch.uint8), packed]

    def values(self, kernels, codes, block: int):
        """The packed codes [R, C, ceil(block / 4)] -> their values -1, 0 or 1, fp32 [R, C, block]."""
        quads = torch.stack([(codes >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
        return quads.flatten(-2)[..., :block].float().sub_(1)


TERNARY = AbsMeanTernary(
    "ternary",
    ELEMENTWISE,
    gather_only="this example is checked under outer.codec.reduce=gather only (tests/test_extending.py)",
    value_bits=2,
    header_bytes=4,
)
