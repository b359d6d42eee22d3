"""carrack.gguf.quant: bytes equal to gguf-py's quantizer (ggml's reference rounding), round trips, validation."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.gguf.dequant import dequantize
from carrack.gguf.quant import quantizable_types, quantize
from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType

gguf = pytest.importorskip("gguf")
gguf_quants = pytest.importorskip("gguf.quants")

TYPES = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1]


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ramp = np.arange(32, dtype=np.float32) - 15.5
    mixed = np.concatenate([np.full(16, 1e30), np.full(16, -1e-30)]).astype(np.float32)
    return {
        "normal": rng.standard_normal((37, 64)),
        "uniform_positive": rng.uniform(0, 5, (9, 96)),
        "zeros": np.zeros((3, 32)),
        "negative_zeros": np.full((2, 32), -0.0),
        "constant_rows": np.repeat(rng.uniform(-9, 9, (5, 1)), 64, axis=1),
        "half_integers": rng.integers(-16, 16, (20, 32)) / 2,
        "exact_ties": np.stack([ramp, ramp * 127 / 15.5, -ramp * 8 / 15.5, ramp * 16 / 15.5, ramp * 15 / 31]),
        "equal_magnitudes_both_signs": np.tile(np.array([-2.0, 2.0], np.float32), (4, 16)),
        "single_spike": np.eye(32)[:5] * 1000,
        "huge": rng.standard_normal((8, 32)) * 1e38,
        "beyond_f16": rng.standard_normal((8, 32)) * 1e6,
        "tiny_normal": rng.standard_normal((8, 32)) * 1e-30,
        "subnormal": rng.standard_normal((8, 32)) * 1e-40,
        "mixed_scales": mixed[None],
    }


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_bytes_equal_gguf_py(ggml_type, case):
    x = np.asarray(CASES[case], dtype=np.float32)
    with np.errstate(all="ignore"):
        expected = gguf_quants.quantize(x, gguf.GGMLQuantizationType(int(ggml_type)))
    got = quantize(x, ggml_type)
    assert got.dtype == np.uint8 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_round_trip_error_is_bounded(ggml_type):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 256)).astype(np.float32)
    raw = quantize(x, ggml_type)
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    assert raw.shape == (4, 3, 256 // block_size * type_size)
    back = dequantize(raw, ggml_type, x.shape)
    blocks = x.reshape(-1, 32)
    span = blocks.max(axis=1) - blocks.min(axis=1)
    levels = {GGMLType.Q8_0: 254, GGMLType.Q4_0: 15, GGMLType.Q4_1: 15, GGMLType.Q5_0: 31, GGMLType.Q5_1: 31}
    error = np.abs(back - x).reshape(-1, 32).max(axis=1)
    assert (error <= span / levels[ggml_type] * 1.01 + 1e-6).all()


def test_quantize_accepts_float64_and_keeps_input():
    x = np.linspace(-1, 1, 64)
    before = x.copy()
    np.testing.assert_array_equal(quantize(x, GGMLType.Q8_0), quantize(x.astype(np.float32), GGMLType.Q8_0))
    np.testing.assert_array_equal(x, before)


def test_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), GGMLType.Q4_0)
    with pytest.raises(NotImplementedError):
        quantize(np.zeros(256, np.float32), GGMLType.Q4_K)
    assert quantizable_types() == sorted(TYPES)
