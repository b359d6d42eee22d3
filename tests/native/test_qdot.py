"""qdot.c (8-bit activations, integer dot products) against dequantize-then-matmul, for every type it decodes.

Two references: the weights dequantized by gguf-py (llama.cpp's own Python package) times the activations as the
kernel quantizes them (equal up to float rounding), and times the float activations (within the bound that the
8-bit activations allow: half an activation step per value, weighted by |w|).
"""

from __future__ import annotations

import numpy as np
import pytest

from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType
from carrack.native import qdot
from tests.native.portable import native_and_portable

gguf_quants = pytest.importorskip("gguf.quants")

TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K,
         GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
# byte offsets of the fp16 scales in each block (the rest of a block is any byte pattern)
_HALF_OFFSETS = {GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
                 GGMLType.Q8_0: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.Q4_K: (0, 2),
                 GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,)}

needs_native = pytest.mark.skipif(qdot.library() is None, reason="native kernels unavailable (no C compiler?)")


def random_blocks(ggml_type: GGMLType, n: int, k: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """(n, row_bytes) rows of random blocks with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    block_values, block_bytes = GGML_BLOCK_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (n * k // block_values, block_bytes), dtype=np.uint8)
    for offset in _HALF_OFFSETS[ggml_type]:
        scales = rng.uniform(-scale, scale, len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def gguf_dequantized(rows: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    return gguf_quants.dequantize(rows, int(ggml_type)).astype(np.float64)


portable_library, build = native_and_portable("qdot", qdot.library, "AVX-512 VNNI where it has it",
                                              "native kernels unavailable (no C compiler?)")


@pytest.mark.parametrize("m", [1, 3, 13, 19])  # the GEMM takes activation rows 8, then 4, then 1 at a time
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_equals_dequantized_weights_times_quantized_activations(build, ggml_type, m):
    n, k = 37, 512 + 256  # 768: a tail after the 64-value steps of the vector loop is not needed, 3 K-blocks
    rows = random_blocks(ggml_type, n, k)
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    codes, scales = qdot.quantize_activations(x)
    x_quantized = (codes.reshape(m, -1, 32) * scales[:, :, None].astype(np.float64)).reshape(m, k)
    expected = x_quantized @ gguf_dequantized(rows, ggml_type).T
    got = qdot.matmul(rows, ggml_type, x)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_within_the_activation_rounding_bound_of_float_activations(build, ggml_type):
    n, k, m = 23, 256, 2
    rows = random_blocks(ggml_type, n, k, seed=4)
    x = np.random.default_rng(5).standard_normal((m, k)).astype(np.float32)
    weight = gguf_dequantized(rows, ggml_type)
    _, scales = qdot.quantize_activations(x)
    half_step = np.repeat(scales, 32, axis=1).astype(np.float64) / 2  # |x - dx * xq| <= dx / 2 per value
    bound = half_step @ np.abs(weight).T
    error = np.abs(qdot.matmul(rows, ggml_type, x) - x.astype(np.float64) @ weight.T)
    assert np.all(error <= bound * 1.001 + 1e-6 * np.abs(weight).max()), (error / bound).max()


def test_native_activation_quantization_is_the_numpy_statement(build):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((5, 256)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
    x[2, 32:64] = 0  # an all-zero block: scale 0, codes 0
    x[3, :32] = np.arange(32, dtype=np.float32) / 2  # codes landing on half steps
    codes, scales = qdot.native_quantize(x)
    expected_codes, expected_scales = qdot.quantize_activations(x)
    np.testing.assert_array_equal(scales, expected_scales)
    np.testing.assert_array_equal(codes, expected_codes)
    assert scales[2, 1] == 0 and not codes[2, 32:64].any()


@needs_native
@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_threads_split_rows_without_changing_results(ggml_type):
    rows = random_blocks(ggml_type, 700, 2048)  # over PARALLEL_MIN_BYTES: split over threads; a partial last tile
    for m in (1, 9, 13, 40):  # 40 rows: x's quantization is split over the threads too
        x = np.random.default_rng(2).standard_normal((m, 2048)).astype(np.float32)
        one_thread = qdot.matmul(rows, ggml_type, x, threads=1)
        for threads in (2, 4):
            np.testing.assert_array_equal(qdot.matmul(rows, ggml_type, x, threads=threads), one_thread)


@needs_native
@pytest.mark.parametrize("m", [1, 13, 40])
def test_a_group_of_matrices_equals_one_call_each(m):
    """q, k, v (or gate, up) in one call: x quantized once, all rows in one region; every result as a call per
    matrix gives, at any thread count (the pieces straddle the matrices)."""
    matrices = [(random_blocks(GGMLType.Q4_K, 700, 2048, seed=1), GGMLType.Q4_K),  # ~1 MB: 4 pieces at 4 threads
                (random_blocks(GGMLType.Q6_K, 37, 2048, seed=2), GGMLType.Q6_K),
                (random_blocks(GGMLType.Q8_0, 90, 2048, seed=3), GGMLType.Q8_0)]
    x = np.random.default_rng(4).standard_normal((m, 2048)).astype(np.float32)
    expected = [qdot.matmul(rows, ggml_type, x, threads=1) for rows, ggml_type in matrices]
    for threads in (1, 2, 4):
        got = qdot.matmul_group(matrices, x, threads)
        for one, each in zip(got, expected):
            np.testing.assert_array_equal(one, each)


@needs_native
def test_a_group_with_a_wrong_row_length_is_refused():
    matrices = [(random_blocks(GGMLType.Q4_K, 16, 512), GGMLType.Q4_K), (random_blocks(GGMLType.Q4_K, 16, 256),
                                                                         GGMLType.Q4_K)]
    with pytest.raises(ValueError, match="do not all hold 512 values per row"):
        qdot.matmul_group(matrices, np.zeros((1, 512), np.float32))
    assert qdot.matmul_group([(np.zeros((2, 20), np.uint8), GGMLType.IQ4_NL)], np.zeros((1, 32), np.float32)) is None


@needs_native
def test_refusals_name_the_problem():
    assert qdot.matmul(np.zeros((2, 20), np.uint8), GGMLType.IQ4_NL, np.zeros((1, 32), np.float32)) is None
    assert not qdot.supports(GGMLType.F16)
    with pytest.raises(ValueError, match="rows of 20 bytes"):
        qdot.matmul(np.zeros((2, 20), np.uint8), GGMLType.Q4_0, np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="32-value blocks"):
        qdot.quantize_activations(np.zeros((1, 40), np.float32))


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("ggml_type", TYPES[:5], ids=lambda t: t.name)
def test_rows_of_an_odd_number_of_32_value_blocks(build, ggml_type, m):
    """k = 96: the vector loops' 64-value steps leave one block over."""
    n, k = 21, 96
    rows = random_blocks(ggml_type, n, k, seed=8)
    x = np.random.default_rng(9).standard_normal((m, k)).astype(np.float32)
    codes, scales = qdot.quantize_activations(x)
    x_quantized = (codes.reshape(m, -1, 32) * scales[:, :, None].astype(np.float64)).reshape(m, k)
    expected = x_quantized @ gguf_dequantized(rows, ggml_type).T
    np.testing.assert_allclose(qdot.matmul(rows, ggml_type, x), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("zeroed", ["d", "dmin"])
def test_q4_k_matrix_vector_decodes_scales_and_mins_each(build, zeroed):
    """One token (the fused Q4_K kernel): with d = 0 only the mins' offsets remain, with dmin = 0 only the scaled
    codes, so a swapped or misread 6-bit field cannot hide behind the other part."""
    n, k = 19, 1024
    rows = random_blocks(GGMLType.Q4_K, n, k, seed=11)
    blocks = rows.reshape(-1, 144)
    blocks[:, (0, 1) if zeroed == "d" else (2, 3)] = 0
    blocks[:, 4:16] |= 0xc0 if zeroed == "dmin" else 0x00  # top bits of the packed scales set: sub-blocks 4-7 use them
    x = np.random.default_rng(12).standard_normal((1, k)).astype(np.float32)
    codes, scales = qdot.quantize_activations(x)
    x_quantized = (codes.reshape(1, -1, 32) * scales[:, :, None].astype(np.float64)).reshape(1, k)
    expected = x_quantized @ gguf_dequantized(rows, GGMLType.Q4_K).T
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(qdot.matmul(rows, GGMLType.Q4_K, x), expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())
