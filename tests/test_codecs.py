"""The pseudo-gradient codecs (hypertrain/codecs/kernels.py) against float64 references written here from each
format's definition, never by calling the code under test: exact codes and values on hand-picked inputs,
exact bytes and the grid's error bound on random ones, top-k's tie rule, payload sizes, shards; the DCT
transform against a float64 matrix DCT-II written here. A deliberately broken variant (a wrong e3m0 bias, an
unnormalized DCT) is shown to fail the same checks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from hypertrain import codec_table
from hypertrain.codecs import kernels as codecs
from hypertrain.codecs.kernels import CODECS, Blocks, decode, encode, payload_size, topk_kept

QUANTIZERS = ("int8", "uint8", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "e3m0")
EPS = 2.0**-24  # fp32's unit roundoff: |fl(a op b) - a op b| <= EPS * |a op b| for normal results


# --- references ---------------------------------------------------------------------------------------


def f32(a) -> np.ndarray:
    """Round float64 values to fp32 (nearest even), kept as float64.

    A quotient, product, sum or difference of two fp32 numbers computed in float64 and then rounded to
    fp32 equals the correctly rounded fp32 operation (53 >= 2 * 24 + 2: double rounding is innocuous),
    so f32(a / b) is exactly what fp32 division gives.
    """
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def grid(exponent_bits: int, mantissa_bits: int, bias: int, reserved: int) -> np.ndarray:
    """Non-negative values of a minifloat, indexed by their bits (exponent << mantissa_bits | mantissa),
    the last `reserved` bit patterns (infinities, NaN) left out."""
    values = []
    for e in range(2**exponent_bits):
        for m in range(2**mantissa_bits):
            fraction = m / 2**mantissa_bits
            values.append(fraction * 2.0 ** (1 - bias) if e == 0 else (1 + fraction) * 2.0 ** (e - bias))
    return np.array(values[: len(values) - reserved])


def e3m0_grid(bias: int = 7) -> np.ndarray:
    """e3m0's magnitudes by code (the sign apart): code 0 is zero, code e >= 1 is 2^(e - bias)."""
    return np.array([0.0] + [2.0 ** (e - bias) for e in range(1, 8)])


# format: (values by index, mantissa bits, smallest normal exponent, code bits)
FORMATS = {
    "fp8_e4m3": (grid(4, 3, 7, reserved=1), 3, -6, 8),  # e4m3fn: only S.1111.111 is NaN, no infinity
    "fp8_e5m2": (grid(5, 2, 15, reserved=4), 2, -14, 8),  # e5m2: exponent 11111 is inf / NaN
    "fp4_e2m1": (grid(2, 1, 1, reserved=0), 1, 0, 4),
    # no mantissa: in [2^e, 2^(e+1)) the spacing is 2^e; below 2^-6 (the least power) it is 2^-6, to zero
    "e3m0": (e3m0_grid(), 0, -6, 4),
}
LARGEST = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "fp4_e2m1": 6.0, "e3m0": 1.0}


def round_to_grid(y: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Indices of the nearest grid values to |y| (ties to the even index, i.e. the even mantissa),
    saturating at the largest."""
    magnitude = np.minimum(np.abs(y), values[-1])
    upper = np.minimum(np.searchsorted(values, magnitude), len(values) - 1)  # first value >= magnitude
    lower = np.maximum(upper - 1, 0)
    below, above = magnitude - values[lower], values[upper] - magnitude
    tie = np.where(lower % 2 == 0, lower, upper)
    return np.where(below < above, lower, np.where(above < below, upper, tie))


def block_slices(sizes, block) -> list[tuple[int, int]]:
    """(start, stop) of every block: each tensor cut from its own start into runs of `block`."""
    out, offset = [], 0
    for size in sizes:
        out += [(offset + a, offset + min(a + block, size)) for a in range(0, size, block)]
        offset += size
    return out


def raw(value, dtype) -> bytes:
    return np.asarray(value, dtype=dtype).tobytes()  # native byte order, as the codecs write


def reference_block(codec: str, x: np.ndarray, start: int, fraction: float) -> tuple[bytes, np.ndarray]:
    """One block's payload bytes and decoded values, from the format's definition (x: fp32 values)."""
    if codec == "topk":
        k = max(1, math.ceil(round(fraction * len(x), 9)))
        order = sorted(range(len(x)), key=lambda j: (-abs(x[j]), j))[:k]
        decoded = np.zeros_like(x)
        decoded[order] = x[order]
        return raw(x[order], np.float32) + raw([start + j for j in order], np.int32), decoded
    if codec == "uint8":
        low, high = x.min(), x.max()
        scale = f32(f32(high - low) / 255)
        q = f32(f32(x - low) / scale) if scale > 0 else np.zeros_like(x)
        codes = np.clip(np.round(q), 0, 255)  # np.round: half to even
        decoded = f32(low + f32(codes * scale))
        return raw([low, scale], np.float32) + raw(codes, np.uint8), decoded
    amax = np.abs(x).max()
    largest = LARGEST[codec]
    scale = f32(amax / largest)
    q = f32(x / scale) if scale > 0 else np.zeros_like(x)
    if codec == "int8":
        codes = np.clip(np.round(q), -127, 127)
        return raw(scale, np.float32) + raw(codes, np.int8), f32(codes * scale)
    values, _, _, bits = FORMATS[codec]
    index = round_to_grid(np.clip(q, -largest, largest), values)
    sign = np.signbit(q)
    codes = index | (sign.astype(np.int64) << (bits - 1))
    decoded = f32(np.where(sign, -1.0, 1.0) * values[index] * scale)
    if bits == 4:
        padded = np.append(codes, 0) if len(codes) % 2 else codes
        codes = padded[0::2] | (padded[1::2] << 4)  # element 2i in the low nibble
    return raw(scale, np.float32) + raw(codes, np.uint8), decoded


def reference(codec, x: torch.Tensor, sizes, block, fraction=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Payload [R, b] and decoded [R, n]: the rows one by one, the blocks one by one, in order."""
    payloads, decoded = [], []
    for row in x.double().numpy():
        parts = [reference_block(codec, row[a:b], a, fraction) for a, b in block_slices(sizes, block)]
        payloads.append(np.frombuffer(b"".join(p for p, _ in parts), dtype=np.uint8))
        decoded.append(np.concatenate([d for _, d in parts]) if parts else np.zeros(0))
    return torch.from_numpy(np.stack(payloads)), torch.from_numpy(np.stack(decoded))


def error_bound(codec, x: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    """Per element, the largest |decoded - x| the format's grid and fp32 arithmetic allow (one block).

    int8: |fl(x/s) - x/s| <= EPS |x|/s, rounding to an integer adds <= 1/2, fl(code * s) adds
      <= EPS * 127 s: 0.5 s + EPS (|x| + 127 s).
    uint8: t = fl(x - min) within EPS (x - min), fl(t / s) within EPS t / s, rounding <= 1/2,
      fl(code * s) within EPS 255 s, fl(min + that) within EPS |decoded|:
      0.5 s + EPS (2 (x - min) + 255 s + |decoded|), (x - min) bounding t up to a factor 1 + EPS.
    fp8 / fp4: fl(x/s) within EPS |x| / s (clamping to the largest value only moves it closer to x / s),
      rounding to the grid within half the grid's spacing at that magnitude (2^(e - mantissa bits) in the
      binade [2^e, 2^(e+1)), e at least the smallest normal exponent: the subnormals' spacing), and
      fl(code * s) within EPS |code| s: s * spacing / 2 + EPS (|x| + |code| s).
    The factor 1 + 2^-20 covers the float64 evaluation of the bound and the (1 + EPS) factors above.
    """
    slack = 1 + 2.0**-20
    if codec == "uint8":
        low, high = x.min(), x.max()
        scale = f32(f32(high - low) / 255)
        return (0.5 * scale + EPS * (2 * (x - low) + 255 * scale + np.abs(decoded))) * slack
    scale = f32(np.abs(x).max() / LARGEST[codec])
    if codec == "int8":
        return (0.5 * scale + EPS * (np.abs(x) + 127 * scale)) * slack
    values, mantissa_bits, smallest_exponent, _ = FORMATS[codec]
    q = np.clip(f32(x / scale) if scale > 0 else np.zeros_like(x), -values[-1], values[-1])
    with np.errstate(divide="ignore"):
        exponent = np.maximum(np.floor(np.log2(np.abs(q))), smallest_exponent)
    spacing = 2.0 ** (exponent - mantissa_bits)
    return (scale * spacing / 2 + EPS * (np.abs(x) + np.abs(decoded))) * slack


def roundtrip(codec, values, block=None, fraction=1.0) -> tuple[np.ndarray, np.ndarray]:
    """One row of fp32 values, one block: (payload bytes, decoded values) from the code under test."""
    x = torch.tensor([values], dtype=torch.float32)
    blocks = Blocks((x.shape[1],), block or x.shape[1])
    payload = encode(codec, x, blocks, fraction)
    return payload[0].numpy(), decode(codec, payload, blocks, fraction)[0].double().numpy()


def assert_matches_reference(codec, values, block=None):
    x = torch.tensor([values], dtype=torch.float32)
    n = x.shape[1]
    payload, decoded = roundtrip(codec, values, block)
    want_payload, want_decoded = reference(codec, x, (n,), block or n)
    np.testing.assert_array_equal(payload, want_payload[0].numpy())
    np.testing.assert_array_equal(decoded, want_decoded[0].numpy())


# --- hand-picked values -------------------------------------------------------------------------------


def test_int8_codes_on_hand_picked_values_round_half_to_even():
    # amax 127: scale exactly 1, so each code is the value rounded half to even.
    values = [127, -127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 3.25, 0, 100.75]
    codes = [127, -127, 0, 2, 2, 0, -2, -2, 126, 3, 0, 101]
    payload, decoded = roundtrip("int8", values)
    assert payload[:4].tobytes() == raw(1.0, np.float32)
    np.testing.assert_array_equal(payload[4:].view(np.int8), codes)
    np.testing.assert_array_equal(decoded, codes)
    # amax 254: scale 2, 3 / 2 = 1.5 and 5 / 2 = 2.5 are ties, both to code 2.
    payload, decoded = roundtrip("int8", [254, 3, 5, -3])
    np.testing.assert_array_equal(payload[4:].view(np.int8), [127, 2, 2, -2])
    np.testing.assert_array_equal(decoded, [254, 4, 4, -4])
    # amax 889: scale 7, not a power of two; 45.5 / 7 = 6.5 is a tie (to 6) only for a true division
    # (45.5 times fl(1/7) is 6.5000005 in fp32, which would round to 7).
    payload, decoded = roundtrip("int8", [889, 10.5, 45.5, -45.5])
    np.testing.assert_array_equal(payload[4:].view(np.int8), [127, 2, 6, -6])
    np.testing.assert_array_equal(decoded, [889, 14, 42, -42])
    assert_matches_reference("int8", values)


def test_uint8_endpoints_and_ties_are_exact():
    step = 2.0**-7
    low = -1.0
    high = low + 255 * step  # scale (high - low) / 255 = 2^-7 exactly
    values = [low, high, low + 0.5 * step, low + 1.5 * step, low + 2.5 * step, low + 100 * step]
    payload, decoded = roundtrip("uint8", values)
    assert payload[:8].tobytes() == raw([low, step], np.float32)
    np.testing.assert_array_equal(payload[8:], [0, 255, 0, 2, 2, 100])
    np.testing.assert_array_equal(decoded, [low, high, low, low + 2 * step, low + 2 * step, low + 100 * step])
    assert_matches_reference("uint8", values)
    # scale (1785 - 0) / 255 = 7: ties at a scale that is not a power of two (a true division, see int8).
    payload, decoded = roundtrip("uint8", [0, 1785, 10.5, 45.5])
    np.testing.assert_array_equal(payload[8:], [0, 255, 2, 6])
    np.testing.assert_array_equal(decoded, [0, 1785, 14, 42])
    # Any block: the minimum gets code 0 and comes back exactly, the maximum gets code 255.
    x = torch.randn(1, 77, generator=torch.Generator().manual_seed(3)).mul(3.3).add(0.7)
    payload, decoded = roundtrip("uint8", x[0].tolist())
    lo, hi = int(x.argmin()), int(x.argmax())
    assert payload[8 + lo] == 0 and payload[8 + hi] == 255
    assert decoded[lo] == x[0, lo].item()


def test_uint8_constant_block_decodes_to_the_constant():
    constant = float(np.float32(3.7))
    payload, decoded = roundtrip("uint8", [constant] * 10)
    assert payload[:8].tobytes() == raw([constant, 0.0], np.float32)
    np.testing.assert_array_equal(payload[8:], 0)
    np.testing.assert_array_equal(decoded, constant)


def test_fp8_e4m3_codes_on_448_subnormals_and_ties():
    tiny = 2.0**-9  # the smallest subnormal (1/8 * 2^-6)
    cases = [  # value (scale 1: amax is 448), code, decoded
        (448.0, 0x7E, 448.0),  # the largest finite: 1.75 * 2^8, S.1111.110
        (-448.0, 0xFE, -448.0),
        (tiny, 0x01, tiny),
        (tiny / 2, 0x00, 0.0),  # a tie between 0 and the smallest subnormal: to the even 0
        (3 * tiny / 2, 0x02, 2 * tiny),  # tie between mantissas 1 and 2: to 2
        (5 * tiny / 2, 0x02, 2 * tiny),  # tie between mantissas 2 and 3: to 2
        (7 * tiny, 0x07, 7 * tiny),  # the largest subnormal
        (2.0**-6, 0x08, 2.0**-6),  # the smallest normal
        (17.0, 0x58, 16.0),  # spacing 2 in [16, 32): tie to the even mantissa 0
        (232.0, 0x76, 224.0),  # spacing 16 in [128, 256): tie between 224 and 240 to 224
        (248.0, 0x78, 256.0),  # tie between 240 (mantissa 7) and 256 (next binade, mantissa 0)
        (-0.3, 0xAA, -0.3125),  # nearest: 1.25 * 2^-2
        (0.0, 0x00, 0.0),
        (-0.0, 0x80, -0.0),  # the sign bit is kept
    ]
    payload, decoded = roundtrip("fp8_e4m3", [c[0] for c in cases])
    assert payload[:4].tobytes() == raw(1.0, np.float32)
    np.testing.assert_array_equal(payload[4:], [c[1] for c in cases])
    np.testing.assert_array_equal(decoded, [c[2] for c in cases])
    assert_matches_reference("fp8_e4m3", [c[0] for c in cases])


def test_fp8_e5m2_codes_on_its_largest_subnormals_and_ties():
    tiny = 2.0**-16  # the smallest subnormal (1/4 * 2^-14)
    cases = [  # value (scale 1: amax is 57344), code, decoded
        (57344.0, 0x7B, 57344.0),  # the largest finite: 1.75 * 2^15
        (-57344.0, 0xFB, -57344.0),
        (53248.0, 0x7A, 49152.0),  # tie between 1.5 * 2^15 and 1.75 * 2^15: to the even mantissa
        (tiny, 0x01, tiny),
        (tiny / 2, 0x00, 0.0),
        (3 * tiny / 2, 0x02, 2 * tiny),
        (2.0**-14, 0x04, 2.0**-14),  # the smallest normal
        (1.0, 0x3C, 1.0),
        (1.125, 0x3C, 1.0),  # tie between 1 and 1.25: to 1
        (1.375, 0x3E, 1.5),  # tie between 1.25 and 1.5: to 1.5
    ]
    payload, decoded = roundtrip("fp8_e5m2", [c[0] for c in cases])
    assert payload[:4].tobytes() == raw(1.0, np.float32)
    np.testing.assert_array_equal(payload[4:], [c[1] for c in cases])
    np.testing.assert_array_equal(decoded, [c[2] for c in cases])
    assert_matches_reference("fp8_e5m2", [c[0] for c in cases])


def test_fp4_e2m1_eight_magnitudes_ties_to_even_and_nibble_order():
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # each halfway between two neighbours
    tie_codes = [0, 2, 2, 4, 4, 6, 6]  # to the even code (even mantissa bit)
    # amax 6: scale exactly 1, so the values are the grid's own.
    # -0.0 keeps its sign bit (code 8), as the float8 casts do; -0.1 rounds to -0 as well.
    values = magnitudes + [-m for m in magnitudes[1:]] + ties + [-5.0, -0.75, -0.0, -0.1]
    codes = list(range(8)) + [8 + i for i in range(1, 8)] + tie_codes + [8 + 6, 8 + 2, 8, 8]
    decoded_values = magnitudes + [-m for m in magnitudes[1:]] + [0, 1, 1, 2, 2, 4, 4] + [-4, -1, 0, 0]
    payload, decoded = roundtrip("fp4_e2m1", values)
    assert payload[:4].tobytes() == raw(1.0, np.float32)
    padded = codes + [0] * (len(codes) % 2)
    np.testing.assert_array_equal(
        payload[4:], [lo | hi << 4 for lo, hi in zip(padded[0::2], padded[1::2], strict=True)]
    )
    np.testing.assert_array_equal(decoded, decoded_values)
    assert_matches_reference("fp4_e2m1", values)


def check_e3m0_value_set_rounding_zero_and_sign():
    """e3m0's chosen definition on hand-picked values (codecs.py: code 0 is zero, code e is 2^(e - 7), the
    scale amax / 1, nearest in the linear domain, ties to the even code, the sign bit kept)."""
    magnitudes = [0.0] + [2.0 ** (e - 7) for e in range(1, 8)]  # 0, 1/64, 1/32, ..., 1/2, 1
    ties = [2.0**-7] + [0.75 * 2.0 ** (e - 7) for e in range(2, 8)]  # halfway: 1/128, 3/128, ..., 3/4
    tie_codes = [0, 2, 2, 4, 4, 6, 6]  # to the even code
    # Linear, not logarithmic: 0.72 lies above 2^-0.5 (the geometric midpoint of 1/2 and 1) but below 3/4,
    # so it goes to 1/2; 0.76 to 1; 0.01 (above 1/128) to 1/64; 0.007 (below) to zero, -0.005 to -0.
    chosen = [0.72, 0.76, 0.01, 0.007, -0.005, -0.0]
    chosen_codes = [6, 7, 1, 0, 8, 8]
    chosen_decoded = [0.5, 1.0, 2.0**-6, 0.0, -0.0, -0.0]
    # amax 1: scale exactly 1, so the values are the grid's own.
    values = magnitudes + [-m for m in magnitudes[1:]] + ties + chosen
    codes = list(range(8)) + [8 + e for e in range(1, 8)] + tie_codes + chosen_codes
    decoded_values = (
        magnitudes + [-m for m in magnitudes[1:]] + [magnitudes[c] for c in tie_codes] + chosen_decoded
    )
    payload, decoded = roundtrip("e3m0", values)
    assert payload[:4].tobytes() == raw(1.0, np.float32)
    padded = codes + [0] * (len(codes) % 2)  # element 2i in the low nibble, 2i + 1 in the high one
    np.testing.assert_array_equal(
        payload[4:], [lo | hi << 4 for lo, hi in zip(padded[0::2], padded[1::2], strict=True)]
    )
    np.testing.assert_array_equal(decoded, decoded_values)
    assert list(np.signbit(decoded[-2:])) == [True, True]  # -0.005 and -0.0 come back as -0.0
    # amax 3: scale 3; 2.25 / 3 = 3/4 exactly, a tie to 1/2 (code 6); 0.75 / 3 = 1/4 (code 5).
    payload, decoded = roundtrip("e3m0", [3.0, -1.5, 2.25, 0.75, 0.0])
    assert payload[:4].tobytes() == raw(3.0, np.float32)
    np.testing.assert_array_equal(payload[4:], [7 | (8 + 6) << 4, 6 | 5 << 4, 0])
    np.testing.assert_array_equal(decoded, [3.0, -1.5, 1.5, 0.75, 0.0])
    assert_matches_reference("e3m0", values)


def test_e3m0_value_set_nearest_linear_rounding_ties_zero_sign_and_nibble_order():
    check_e3m0_value_set_rounding_zero_and_sign()


def _midpoints(grid_values, middle) -> tuple:
    return tuple(
        (middle(a, b), i % 2 == 1)
        for i, (a, b) in enumerate(zip(grid_values[:-1], grid_values[1:], strict=True))
    )


E3M0_BROKEN = {  # deliberately broken variants of the codec: each must fail the hand-picked check
    # exponent bias 6 (magnitudes up to 2, scale amax / 2): the codes agree, the scale bytes do not
    "bias-6": tuple(e3m0_grid(bias=6)),
    # no zero code: code 0 is 2^-7, so nothing rounds to zero
    "no-zero": (2.0**-7,) + tuple(e3m0_grid()[1:]),
    # nearest in the log domain: a tie at the geometric midpoint (0.72 would go to 1)
    "log-rounding": "log",
}


@pytest.mark.parametrize("variant", list(E3M0_BROKEN))
def test_a_broken_e3m0_variant_fails_the_check(monkeypatch, variant):
    broken = E3M0_BROKEN[variant]
    if broken == "log":
        grid_values = codec_table.E3M0
        middle = lambda a, b: math.sqrt(a * b) if a > 0 else b / 2  # noqa: E731
    else:
        grid_values, middle = broken, lambda a, b: (a + b) / 2  # noqa: E731
    broken = dataclasses.replace(
        codec_table.TABLE["e3m0"], magnitudes=grid_values, midpoints=_midpoints(grid_values, middle)
    )
    monkeypatch.setitem(codec_table.TABLE, "e3m0", broken)
    with pytest.raises(AssertionError):
        check_e3m0_value_set_rounding_zero_and_sign()


@pytest.mark.parametrize("codec", QUANTIZERS)
def test_all_zero_block_encodes_to_zero_bytes_and_decodes_to_zeros(codec):
    x = torch.zeros(2, 64 + 50)
    x[1, 64:] = torch.randn(50, generator=torch.Generator().manual_seed(0))
    blocks = Blocks((64, 50), 32)  # blocks 32, 32 | 32, 18: row 0 all zero, row 1 zero then random
    payload = encode(codec, x, blocks)
    decoded = decode(codec, payload, blocks)
    assert not payload[0].any()
    assert not payload[1, : payload_size(codec, Blocks((64,), 32))].any()
    assert torch.equal(decoded[:, :64], torch.zeros(2, 64)) and not decoded.isnan().any()


# --- random values: exact bytes and the grid's bound --------------------------------------------------


def wide_range_values(rows, sizes, block, seed) -> torch.Tensor:
    """Per block a magnitude from 1e-6 to 1e3, per element heavy tails (down to 1e-4 of the block's
    scale, so fp8 and fp4 reach their subnormals)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    x *= 10 ** (torch.rand(rows, n, generator=gen, dtype=torch.float64) * -4)
    for a, b in block_slices(sizes, block):
        x[:, a:b] *= 10 ** (torch.rand(rows, 1, generator=gen, dtype=torch.float64) * 9 - 6)
    return x.float()


@pytest.mark.parametrize("codec", QUANTIZERS)
def test_quantizer_bytes_and_values_equal_the_reference_within_the_grid_bound(codec):
    sizes, block = (300, 128, 77, 1000, 5, 64, 1), 64  # ragged last blocks: 44, 13, 40, 5, 1
    x = wide_range_values(3, sizes, block, seed=1)
    blocks = Blocks(sizes, block)
    payload = encode(codec, x, blocks)
    decoded = decode(codec, payload, blocks)
    want_payload, want_decoded = reference(codec, x, sizes, block)
    assert torch.equal(payload, want_payload)
    assert torch.equal(decoded.double(), want_decoded)
    x64, decoded64 = x.double().numpy(), decoded.double().numpy()
    for row in range(x.shape[0]):
        for a, b in block_slices(sizes, block):
            error = np.abs(decoded64[row, a:b] - x64[row, a:b])
            assert (error <= error_bound(codec, x64[row, a:b], decoded64[row, a:b])).all(), (row, a, b)


# --- top-k --------------------------------------------------------------------------------------------


def parse_topk(payload: np.ndarray, kept: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per block: its fp32 values then its int32 indices."""
    values, indices, offset = [], [], 0
    for k in kept:
        values.append(payload[offset : offset + 4 * k].view(np.float32))
        indices.append(payload[offset + 4 * k : offset + 8 * k].view(np.int32))
        offset += 8 * k
    assert offset == len(payload)
    return values, indices


def test_topk_breaks_ties_by_index():
    x = [1.0, -2.0, 2.0, 0.5, -2.0, 1.0, 2.0, 0.0, -1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    payload, decoded = roundtrip("topk", x, fraction=3 / 16)  # k = 3 of the four magnitudes 2
    values, indices = parse_topk(payload, [3])
    np.testing.assert_array_equal(indices[0], [1, 2, 4])  # magnitude descending, ties: lower index first
    np.testing.assert_array_equal(values[0], [-2.0, 2.0, -2.0])
    np.testing.assert_array_equal(decoded, [0, -2, 2, 0, -2] + [0] * 11)
    payload, _ = roundtrip("topk", x, fraction=6 / 16)  # all four 2s, then two of the 1s: indices 0, 5
    np.testing.assert_array_equal(parse_topk(payload, [6])[1][0], [1, 2, 4, 6, 9, 0])


def test_topk_chooses_the_reference_entries_with_exact_values():
    sizes, block, fraction = (300, 128, 77, 5, 1), 64, 0.1
    gen = torch.Generator().manual_seed(2)
    # Dyadic values from a small set: many ties in every block.
    x = torch.randint(-6, 7, (3, sum(sizes)), generator=gen).float() / 8
    blocks = Blocks(sizes, block)
    payload = encode("topk", x, blocks, fraction)
    decoded = decode("topk", payload, blocks, fraction)
    want_payload, want_decoded = reference("topk", x, sizes, block, fraction)
    assert torch.equal(payload, want_payload)
    assert torch.equal(decoded.double(), want_decoded)
    kept = [max(1, math.ceil(round(fraction * (b - a), 9))) for a, b in block_slices(sizes, block)]
    for row in range(3):
        values, indices = parse_topk(payload[row].numpy(), kept)
        for v, i in zip(values, indices, strict=True):
            np.testing.assert_array_equal(v, x[row, i].numpy())  # values are x's, exactly


def test_topk_all_zero_and_large_vectors_keep_their_values():
    x = torch.zeros(2, 130)
    x[1, 129] = -3.0
    blocks = Blocks((130,), 64)  # 64, 64, 2
    decoded = decode("topk", encode("topk", x, blocks, 0.02), blocks, 0.02)
    assert torch.equal(decoded, x)


def test_topk_kept_rounds_the_fraction_as_written():
    assert topk_kept(0.01, 128) == 2  # ceil(1.28)
    assert topk_kept(0.07, 100) == 7  # 0.07 * 100 is 7.000000000000001 in binary
    assert topk_kept(1.0, 37) == 37
    assert topk_kept(1e-6, 5) == 1


# --- sizes, ratios, shards, determinism ---------------------------------------------------------------

SIZES = [((300, 128, 77, 1000, 5), 64), ((128,) * 4, 128), ((1, 2, 3), 2), ((7,), 3), ((), 8), ((0, 5), 4)]


def expected_size(codec, sizes, block, fraction) -> int:
    lengths = [b - a for a, b in block_slices(sizes, block)]
    n, count = sum(sizes), len(lengths)
    return {
        "int8": n + 4 * count,
        "uint8": n + 8 * count,
        "fp8_e4m3": n + 4 * count,
        "fp8_e5m2": n + 4 * count,
        "fp4_e2m1": sum(math.ceil(length / 2) for length in lengths) + 4 * count,  # packed per block
        "e3m0": sum(math.ceil(length / 2) for length in lengths) + 4 * count,  # as fp4_e2m1
        "topk": 8 * sum(max(1, math.ceil(round(fraction * length, 9))) for length in lengths),
    }[codec]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("sizes, block", SIZES)
def test_payload_size_equals_the_formula(codec, sizes, block):
    blocks = Blocks(sizes, block)
    size = payload_size(codec, blocks, 0.3)
    assert size == expected_size(codec, sizes, block, 0.3)
    x = torch.randn(2, sum(sizes), generator=torch.Generator().manual_seed(0))
    payload = encode(codec, x, blocks, 0.3)
    assert payload.shape == (2, size) and payload.dtype == torch.uint8
    assert decode(codec, payload, blocks, 0.3).shape == x.shape


def test_compression_ratios_against_fp32():
    blocks = Blocks((128 * 600, 128 * 400), 128)  # n = 128000, 1000 blocks of 128
    fp32 = 4 * blocks.numel
    assert fp32 / payload_size("int8", blocks) == 512 / 132  # 3.88 >= 3.5
    assert fp32 / payload_size("fp8_e4m3", blocks) == 512 / 132
    assert fp32 / payload_size("uint8", blocks) == 512 / 136  # 3.76 >= 3.5
    assert fp32 / payload_size("fp4_e2m1", blocks) == 512 / 68  # 7.53 >= 7
    assert fp32 / payload_size("e3m0", blocks) == 512 / 68
    assert min(512 / 132, 512 / 136) >= 3.5 and 512 / 68 >= 7
    # Top-k sends 8 bytes per kept entry: block / (2 ceil(f block)). At f = 1% of 128, ceil keeps 2,
    # so 32x, not 1 / (2f) = 50x; 1 / (2f) holds exactly when f * block is whole (f = 1/128: 64x).
    assert fp32 / payload_size("topk", blocks, 0.01) == 32.0
    assert fp32 / payload_size("topk", blocks, 1 / 128) == 64.0


@pytest.mark.parametrize("sizes, block", SIZES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 40])
def test_shards_cover_the_vector_on_block_boundaries(sizes, block, n):
    blocks = Blocks(sizes, block)
    whole = block_slices(sizes, block)
    shards = blocks.shards(n)
    assert len(shards) == n
    counts = [len(block_slices(sub.sizes, sub.block)) for _, _, sub in shards]
    each, extra = divmod(len(whole), n)
    assert counts == [each + (i < extra) for i in range(n)]
    position, first = 0, 0
    for (start, stop, sub), count in zip(shards, counts, strict=True):
        assert start == position and stop - start == sub.numel and sub.block == block
        mine = [(start + a, start + b) for a, b in block_slices(sub.sizes, block)]
        assert mine == whole[first : first + count]  # the same blocks as the whole's
        position, first = stop, first + count
    assert position == sum(sizes) and first == len(whole)


@pytest.mark.parametrize("codec", QUANTIZERS)
def test_a_shard_encodes_to_its_blocks_of_the_whole_payload(codec):
    sizes, block = (300, 128, 77, 1000, 5), 64
    blocks = Blocks(sizes, block)
    x = wide_range_values(2, sizes, block, seed=4)
    whole, decoded = encode(codec, x, blocks), decode(codec, encode(codec, x, blocks), blocks)
    offset = 0
    for start, stop, sub in blocks.shards(3):
        part = encode(codec, x[:, start:stop], sub)  # a column slice: not contiguous
        assert torch.equal(part, whole[:, offset : offset + part.shape[1]])
        assert torch.equal(
            decode(codec, whole[:, offset : offset + part.shape[1]], sub), decoded[:, start:stop]
        )
        offset += part.shape[1]
    assert offset == whole.shape[1]


@pytest.mark.parametrize("codec", CODECS)
def test_rows_are_encoded_on_their_own_and_deterministically(codec):
    sizes, block = (300, 77, 5), 64
    blocks = Blocks(sizes, block)
    x = wide_range_values(4, sizes, block, seed=5)
    before = x.clone()
    payload = encode(codec, x, blocks, 0.05)
    decode(codec, payload, blocks, 0.05)
    assert torch.equal(x, before)  # the input is left as it was
    assert torch.equal(payload, encode(codec, x.clone(), blocks, 0.05))
    for row in range(4):
        assert torch.equal(encode(codec, x[row : row + 1], blocks, 0.05), payload[row : row + 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("codec", CODECS)
def test_cuda_bytes_and_values_equal_cpu(codec):
    sizes, block = (300, 128, 77, 1000, 5), 64
    blocks = Blocks(sizes, block)
    x = wide_range_values(3, sizes, block, seed=6)
    payload = encode(codec, x, blocks, 0.05)
    on_device = encode(codec, x.cuda(), blocks, 0.05)
    assert torch.equal(on_device.cpu(), payload)
    assert torch.equal(decode(codec, on_device, blocks, 0.05).cpu(), decode(codec, payload, blocks, 0.05))


def test_bad_arguments_are_refused_in_one_line():
    blocks = Blocks((10,), 4)
    x = torch.zeros(1, 10)
    with pytest.raises(ValueError, match="codec='int4' is not valid"):
        encode("int4", x, blocks)
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction=.* is not valid"):
            payload_size("topk", blocks, fraction)
    with pytest.raises(ValueError, match="block=0 is not valid"):
        Blocks((10,), 0)
    with pytest.raises(ValueError, match=r"valid: float32 \[R, 10\]"):
        encode("int8", x.double(), blocks)
    with pytest.raises(ValueError, match=r"valid: uint8 \[R, 22\]"):
        decode("int8", torch.zeros(1, 21, dtype=torch.uint8), blocks)


# --- the DCT transform (outer.codec.transform=dct) ----------------------------------------------------------

DCT_SIZES, DCT_BLOCK = (300, 128, 77, 5, 1), 64  # ragged last blocks: 44, 13, 5, 1 (each its own length)


def dct_matrix64(length: int) -> np.ndarray:
    """The orthonormal DCT-II from its definition, float64: X_k = s_k sum_j x_j cos(pi (2j + 1) k / (2N)),
    s_0 = sqrt(1/N), s_k = sqrt(2/N)."""
    j = np.arange(length)
    k = j[:, None]
    s = np.where(k == 0, math.sqrt(1 / length), math.sqrt(2 / length))
    return s * np.cos(math.pi * (2 * j[None, :] + 1) * k / (2 * length))


def dct_reference(x: np.ndarray, sizes, block) -> tuple[np.ndarray, np.ndarray]:
    """Rows of fp32 values [R, n] (as float64) -> (their blocks' float64 DCT-II coefficients, per coefficient
    the largest error an fp32 evaluation may make).

    Bound: the code multiplies by the matrix rounded to fp32 (each entry within EPS of D's) and sums L
    products in fp32 in any order (with or without fused multiply-adds): |error| <= (gamma_L (1 + EPS) +
    EPS) sum_j |D_kj x_j| <= (L + 1) EPS sum_j |D_kj x_j| (1 + 2^-10), gamma_L = L EPS / (1 - L EPS)."""
    coefficients, bound = np.zeros_like(x), np.zeros_like(x)
    for a, b in block_slices(sizes, block):
        matrix = dct_matrix64(b - a)
        coefficients[:, a:b] = x[:, a:b] @ matrix.T
        bound[:, a:b] = (b - a + 1) * EPS * (np.abs(x[:, a:b]) @ np.abs(matrix).T) * (1 + 2.0**-10)
    return coefficients, bound


def dct_check(x: torch.Tensor, sizes, block) -> tuple[float, float]:
    """(the largest coefficient error over its bound, the largest per-block round-trip error
    ||inverse(forward(x)) - x|| over its bound) of the code under test.

    Round-trip bound per block of L: the forward error e1 has ||e1|| <= (L + 1) EPS || |D| |x| || <=
    (L + 1) EPS ||D||_F ||x|| = (L + 1) EPS sqrt(L) ||x|| (orthonormal D: ||D||_F = sqrt(L)); the inverse
    maps it unchanged in norm and adds its own (L + 1) EPS sqrt(L) ||y'||, ||y'|| <= ||x|| + ||e1||: in
    all 2 (L + 1) EPS sqrt(L) ||x|| (1 + 2^-10)."""
    blocks = Blocks(sizes, block)
    forward = codecs._dct(x, blocks, inverse=False).double().numpy()
    back = codecs._dct(codecs._dct(x, blocks, inverse=False), blocks, inverse=True).double().numpy()
    x64 = x.double().numpy()
    want, bound = dct_reference(x64, sizes, block)
    coefficient = float((np.abs(forward - want) / np.maximum(bound, 1e-300)).max())
    trip = 0.0
    for a, b in block_slices(sizes, block):
        length = b - a
        allowed = 2 * (length + 1) * EPS * math.sqrt(length) * np.linalg.norm(x64[:, a:b], axis=1)
        error = np.linalg.norm(back[:, a:b] - x64[:, a:b], axis=1)
        trip = max(trip, float((error / np.maximum(allowed * (1 + 2.0**-10), 1e-300)).max()))
    return coefficient, trip


def test_dct_equals_the_float64_matrix_dct_ii_and_inverts_within_the_fp32_bound():
    x = wide_range_values(3, DCT_SIZES, DCT_BLOCK, seed=7)
    coefficient, trip = dct_check(x, DCT_SIZES, DCT_BLOCK)
    print(f"coefficient error {coefficient:.3g} of its bound, round trip {trip:.3g} of its bound")
    assert coefficient <= 1 and trip <= 1
    # a block of one value is itself; the DC coefficient of a constant block of L is sqrt(L) times it
    blocks = Blocks((64, 1), 64)
    y = codecs._dct(torch.tensor([[2.0] * 64 + [-3.0]]), blocks, inverse=False)[0]
    assert y[64] == -3.0 and abs(y[0].item() - 16.0) <= 65 * EPS * 16 and y[1:64].abs().max() <= 65 * EPS * 16


def unnormalized_dct_matrix(length: int, device: torch.device) -> torch.Tensor:
    """A common mistake: the DCT-II without its orthonormal scaling (2 sum_j x_j cos(...), scipy's
    norm=None), whose transpose is not its inverse."""
    j = torch.arange(length, dtype=torch.float64)
    return (2 * torch.cos(math.pi * (2 * j[None, :] + 1) * j[:, None] / (2 * length))).float().to(device)


def sqrt2_dc_dct_matrix(length: int, device: torch.device) -> torch.Tensor:
    """Another: every row scaled by sqrt(2/N), s_0 included (the DC row is sqrt(2) too large)."""
    j = torch.arange(length, dtype=torch.float64)
    matrix = math.sqrt(2 / length) * torch.cos(math.pi * (2 * j[None, :] + 1) * j[:, None] / (2 * length))
    return matrix.float().to(device)


@pytest.mark.parametrize("broken", [unnormalized_dct_matrix, sqrt2_dc_dct_matrix])
def test_a_broken_dct_fails_both_checks(monkeypatch, broken):
    monkeypatch.setattr(codecs, "_dct_matrix", broken)
    x = wide_range_values(2, DCT_SIZES, DCT_BLOCK, seed=8)
    coefficient, trip = dct_check(x, DCT_SIZES, DCT_BLOCK)
    assert coefficient > 1 and trip > 1, (coefficient, trip)


def test_topk_after_the_dct_keeps_the_largest_frequency_components():
    # One block of 64: 2 x basis 3 - 1 x basis 10 (+ a small ripple): top-2 keeps frequencies 3 then 10.
    basis = dct_matrix64(64)
    signal = 2 * basis[3] - basis[10] + 1e-3 * np.sin(np.arange(64))
    x = torch.tensor(signal[None], dtype=torch.float32)
    blocks = Blocks((64,), 64)
    payload = encode("topk", x, blocks, 2 / 64, "dct")
    (values,), (indices,) = parse_topk(payload[0].numpy(), [2])
    np.testing.assert_array_equal(indices, [3, 10])
    want, bound = dct_reference(x.double().numpy(), (64,), 64)
    assert (np.abs(values - want[0, [3, 10]]) <= bound[0, [3, 10]]).all()
    # Random blocks: the kept indices are the reference's k largest |X_k| (by magnitude, then index),
    # wherever the k-th and (k+1)-th magnitudes are further apart than their bounds allow a swap.
    fraction = 0.1
    x = wide_range_values(3, DCT_SIZES, DCT_BLOCK, seed=9)
    payload = encode("topk", x, Blocks(DCT_SIZES, DCT_BLOCK), fraction, "dct")
    want, bound = dct_reference(x.double().numpy(), DCT_SIZES, DCT_BLOCK)
    slices = block_slices(DCT_SIZES, DCT_BLOCK)
    kept = [max(1, math.ceil(round(fraction * (b - a), 9))) for a, b in slices]
    compared = 0
    for row in range(3):
        values, indices = parse_topk(payload[row].numpy(), kept)
        for (a, b), k, v, i in zip(slices, kept, values, indices, strict=True):
            order = sorted(range(a, b), key=lambda j: (-abs(want[row, j]), j))
            if k < b - a:
                gap = abs(want[row, order[k - 1]]) - abs(want[row, order[k]])
                if gap <= bound[row, order[k - 1]] + bound[row, order[k]]:
                    continue  # within rounding of a swap: not decided by the reference
            assert sorted(i.tolist()) == sorted(order[:k]), (row, a)
            assert (np.abs(v - want[row, i]) <= bound[row, i]).all(), (row, a)
            compared += 1
    assert compared >= 0.9 * 3 * len(slices), compared
    # decoded: the inverse of the kept coefficients (zeros elsewhere), within the inverse's bound
    decoded = decode("topk", payload, Blocks(DCT_SIZES, DCT_BLOCK), fraction, "dct").double().numpy()
    sparse = decode("topk", payload, Blocks(DCT_SIZES, DCT_BLOCK), fraction).double().numpy()
    for a, b in slices:
        matrix = dct_matrix64(b - a)
        back = sparse[:, a:b] @ matrix  # x = D^T X, as rows
        allowed = (b - a + 1) * EPS * (np.abs(sparse[:, a:b]) @ np.abs(matrix)) * (1 + 2.0**-10)
        assert (np.abs(decoded[:, a:b] - back) <= allowed).all(), a


@pytest.mark.parametrize("codec", CODECS)
def test_the_dct_wraps_every_codec_with_its_bytes_and_rows_unchanged(codec):
    """transform=dct is the codec applied to the blocks' coefficients and the inverse applied to what it
    decodes, exactly; the payload size is the codec's; a row's bytes do not depend on the rows beside it
    (each process encodes its own replicas: the simulation's bytes). transform=none is the codec alone."""
    blocks = Blocks(DCT_SIZES, DCT_BLOCK)
    x = wide_range_values(4, DCT_SIZES, DCT_BLOCK, seed=10)
    payload = encode(codec, x, blocks, 0.05, "dct")
    coefficients = codecs._dct(x, blocks, inverse=False)
    assert torch.equal(payload, encode(codec, coefficients, blocks, 0.05))
    assert payload.shape == (4, payload_size(codec, blocks, 0.05))
    decoded = decode(codec, payload, blocks, 0.05, "dct")
    assert torch.equal(decoded, codecs._dct(decode(codec, payload, blocks, 0.05), blocks, inverse=True))
    for row in range(4):
        assert torch.equal(encode(codec, x[row : row + 1], blocks, 0.05, "dct"), payload[row : row + 1])
        assert torch.equal(decode(codec, payload[row : row + 1], blocks, 0.05, "dct"), decoded[row : row + 1])
    assert torch.equal(encode(codec, x, blocks, 0.05, "none"), encode(codec, x, blocks, 0.05))
    with pytest.raises(ValueError, match="transform='fft' is not valid; valid: none, dct"):
        encode(codec, x, blocks, 0.05, "fft")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_dct_is_within_the_float64_bound_and_its_rows_are_independent():
    """On a GPU the products round in another order than on the CPU (so no bitwise claim across devices),
    within the same bound; a row's bytes still do not depend on the rows beside it (one product per row)."""
    blocks = Blocks(DCT_SIZES, DCT_BLOCK)
    x = wide_range_values(3, DCT_SIZES, DCT_BLOCK, seed=11)
    want, bound = dct_reference(x.double().numpy(), DCT_SIZES, DCT_BLOCK)
    forward = codecs._dct(x.cuda(), blocks, inverse=False).cpu().double().numpy()
    assert (np.abs(forward - want) <= bound).all()
    payload = encode("topk", x.cuda(), blocks, 0.1, "dct")
    for row in range(3):
        assert torch.equal(
            encode("topk", x[row : row + 1].cuda(), blocks, 0.1, "dct"), payload[row : row + 1]
        )
