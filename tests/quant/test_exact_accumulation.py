"""Integer matmul/conv cores equal int32 accumulation bit for bit, for every K, through float32-chunked BLAS.

The float32 chunk for uint8 x uint8 (zero points at the extremes, |q - zp| up to 255) is 2**24 // 255**2 = 258, so
K = 1, 257, 258, 259 and 10000 straddle the chunk edges; all-extreme operands make every product maximal.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from carrack.ops import quant
from tests.quant.helpers import carrack_run

CHUNK_U8 = quant.FLOAT32_EXACT // (255 * 255)
KS = [1, CHUNK_U8 - 1, CHUNK_U8, CHUNK_U8 + 1, 10000]


def _reference(a, a_zp, b, b_zp) -> np.ndarray:
    acc = (a.astype(np.int64) - np.int64(a_zp)) @ (b.astype(np.int64) - np.int64(b_zp))
    return acc.astype(np.int32)  # wraps like a 32-bit accumulator


def _operands(k: int, case: str):
    if case == "u8_max":  # all 255 against zero point 0: every product 255 * 255
        return (np.full((3, k), 255, np.uint8), np.uint8(0), np.full((k, 4), 255, np.uint8), np.uint8(0))
    if case == "u8_min_zp_max":  # all 0 against zero point 255: every product (-255) * (-255)
        return (np.zeros((3, k), np.uint8), np.uint8(255), np.zeros((k, 4), np.uint8), np.uint8(255))
    if case == "i8_min":  # all -128 against zero point 127
        return (np.full((3, k), -128, np.int8), np.int8(127), np.full((k, 4), -128, np.int8), np.int8(127))
    rng = np.random.default_rng(k)
    return (rng.integers(0, 256, (3, k)).astype(np.uint8), np.uint8(3),
            rng.integers(-128, 128, (k, 4)).astype(np.int8), np.int8(-128))


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("case", ["u8_max", "u8_min_zp_max", "i8_min", "random"])
def test_integer_matmul_exact(k, case):
    a, a_zp, b, b_zp = _operands(k, case)
    got = quant.wrap_int32(quant.integer_matmul(a, a_zp, b, b_zp))
    np.testing.assert_array_equal(got, _reference(a, a_zp, b, b_zp))


@pytest.mark.parametrize("k", KS)
def test_matmul_integer_kernel_exact(k):
    a, a_zp, b, b_zp = _operands(k, "u8_min_zp_max")
    node = helper.make_node("MatMulInteger", ["a", "b", "az", "bz"], ["y"])
    got = carrack_run(node, {"a": a, "b": b, "az": np.asarray(a_zp), "bz": np.asarray(b_zp)}, TensorProto.INT32)
    np.testing.assert_array_equal(got, _reference(a, a_zp, b, b_zp))


def test_int16_goes_through_float64():
    a = np.full((2, 300), 32767, np.int16)
    b = np.full((300, 2), -32768, np.int16)
    got = quant.wrap_int32(quant.integer_matmul(a, None, b, None))
    np.testing.assert_array_equal(got, _reference(a, 0, b, 0))


@pytest.mark.parametrize("channels", [1, 28, 29, 30, 1200])
@pytest.mark.parametrize("group", [1, 2])
def test_conv_integer_exact(channels, group):
    """3x3 kernels: the float32 chunk of 258 products is 28 whole channels (28 * 9 = 252)."""
    channels *= group
    x = np.zeros((1, channels, 4, 4), np.uint8)
    w = np.zeros((2 * group, channels // group, 3, 3), np.uint8)
    node = helper.make_node("ConvInteger", ["x", "w", "xz", "wz"], ["y"], pads=[1, 1, 1, 1], group=group)
    feeds = {"x": x, "w": w, "xz": np.asarray(255, np.uint8), "wz": np.asarray(255, np.uint8)}
    got = carrack_run(node, feeds, TensorProto.INT32)
    xs = x.astype(np.int64) - 255
    ws = w.astype(np.int64) - 255
    padded = np.pad(xs, ((0, 0), (0, 0), (1, 1), (1, 1)))  # padding holds the zero point: 0 after the shift
    per = channels // group
    want = np.zeros((1, 2 * group, 4, 4), np.int64)
    for m in range(2 * group):
        g = m // 2
        for i in range(4):
            for j in range(4):
                want[0, m, i, j] = (padded[0, g * per:(g + 1) * per, i:i + 3, j:j + 3] * ws[m]).sum()
    np.testing.assert_array_equal(got, want.astype(np.int32))
