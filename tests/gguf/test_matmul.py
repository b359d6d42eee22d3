"""carrack.gguf.matmul.quantized_matmul and the carrack::GGUFMatMul kernel built on it."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
import carrack.ops.gguf_ops  # noqa: F401  (registers GGUFMatMul until carrack.ops imports it)
from carrack.errors import InvalidModel
from carrack.gguf.dequant import dequantize
from carrack.gguf.matmul import chunk_rows, quantized_matmul
from carrack.gguf.quant import quantize
from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType
from tests.gguf.test_dequant import embed, random_blocks

T = GGMLType
MATMUL_TYPES = [T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K]


def make_weight(ggml_type: GGMLType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw (n, k) weight bytes of `ggml_type` with modest scales."""
    if ggml_type in (T.Q8_0, T.Q4_0):
        return quantize(rng.standard_normal((n, k)).astype(np.float32), ggml_type)
    if ggml_type == T.F32:
        return rng.standard_normal((n, k)).astype("<f4").view(np.uint8)
    if ggml_type == T.F16:
        return rng.standard_normal((n, k)).astype("<f2").view(np.uint8)
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    return random_blocks(ggml_type, n * k // block_size, rng, f16_max=0.05).reshape(n, -1)


def assert_close_to_reference(got, x, raw, ggml_type, n, k):
    weight = dequantize(raw, ggml_type, (n, k))
    expected = x @ weight.T
    scale = np.abs(x).reshape(-1, k).max(initial=0) * np.abs(weight).sum(axis=1).max(initial=0)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale + 1e-30)


@pytest.mark.parametrize("ggml_type", [*MATMUL_TYPES, T.IQ4_XS, T.F16, T.F32], ids=lambda t: t.name)
@pytest.mark.parametrize("x_shape", [(512,), (3, 512), (2, 5, 512)])
def test_matches_dequantize_then_matmul(ggml_type, x_shape):
    rng = np.random.default_rng([int(ggml_type), len(x_shape)])
    n, k = 83, 512
    raw = make_weight(ggml_type, n, k, rng)
    x = rng.standard_normal(x_shape).astype(np.float32)
    got = quantized_matmul(x, embed(raw, 3), ggml_type, (n, k), rows_per_chunk=16)  # 6 chunks, the last partial
    assert got.shape == (*x_shape[:-1], n)
    assert_close_to_reference(got, x, raw, ggml_type, n, k)


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 64, 1000, None])
def test_chunk_sizes(rows_per_chunk):
    rng = np.random.default_rng(1)
    raw = make_weight(T.Q6_K, 70, 256, rng)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    got = quantized_matmul(x, raw.tobytes(), int(T.Q6_K), (70, 256), rows_per_chunk=rows_per_chunk)
    assert_close_to_reference(got, x, raw, T.Q6_K, 70, 256)


def test_chunk_rows_budget():
    assert chunk_rows(4096) == 256
    assert chunk_rows(14336) == 73
    assert chunk_rows(1 << 20) == 16
    assert chunk_rows(32) == 256


def test_empty_batch_and_empty_weight():
    rng = np.random.default_rng(2)
    raw = make_weight(T.Q8_0, 8, 64, rng)
    assert quantized_matmul(np.zeros((0, 64), np.float32), raw, T.Q8_0, (8, 64)).shape == (0, 8)
    assert quantized_matmul(np.zeros((2, 64), np.float32), b"", T.Q8_0, (0, 64)).shape == (2, 0)


def test_errors():
    raw = np.zeros(8 * 34, np.uint8)
    with pytest.raises(ValueError, match="last axis must be 64"):
        quantized_matmul(np.zeros((2, 32), np.float32), raw, T.Q8_0, (4, 64))
    with pytest.raises(ValueError, match="takes 272 bytes"):
        quantized_matmul(np.zeros((2, 64), np.float32), raw[:-1], T.Q8_0, (4, 64))
    with pytest.raises(ValueError, match="multiple of 256"):
        quantized_matmul(np.zeros((2, 64), np.float32), raw, T.Q4_K, (4, 64))


def test_peak_extra_memory_is_a_small_fraction_of_the_float_weight():
    n = k = 4096
    rng = np.random.default_rng(3)
    raw = random_blocks(T.Q8_0, n * k // 32, rng, f16_max=0.05)
    x = rng.standard_normal((1, k)).astype(np.float32)
    float_weight_bytes = n * k * 4
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        baseline, _ = tracemalloc.get_traced_memory()
        y = quantized_matmul(x, raw, T.Q8_0, (n, k))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    extra = peak - baseline - y.nbytes
    print(f"peak extra memory: {extra / 2**20:.2f} MiB for a {float_weight_bytes / 2**20:.0f} MiB float weight")
    assert extra < float_weight_bytes / 8
    # spot-check a few output rows against the dequantized weight
    rows = dequantize(raw[:5 * 128], T.Q8_0, (5, k))
    np.testing.assert_allclose(y[0, :5], x[0] @ rows.T, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# the GGUFMatMul kernel


def gguf_matmul_model(ggml_type: int, shape, x_shape, w=None, w_len=None):
    node = helper.make_node("GGUFMatMul", ["x", "w"], ["y"], domain="carrack", ggml_type=int(ggml_type), shape=shape)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    initializers = []
    if w is None:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.UINT8, [w_len]))
    else:
        initializers.append(numpy_helper.from_array(w, "w"))
    out_shape = [*x_shape[:-1], shape[0]]
    graph = helper.make_graph([node], "gguf_matmul", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("carrack", 1)])


@pytest.mark.parametrize("ggml_type", MATMUL_TYPES, ids=lambda t: t.name)
def test_kernel_with_weight_as_input(ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    n, k = 40, 256
    raw = make_weight(ggml_type, n, k, rng).reshape(-1)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    model = gguf_matmul_model(ggml_type, [n, k], x.shape, w_len=raw.size)
    (y,) = carrack.InferenceSession(model.SerializeToString()).run(None, {"x": x, "w": raw})
    assert_close_to_reference(y, x, raw, ggml_type, n, k)


def test_kernel_with_weight_as_initializer():
    rng = np.random.default_rng(4)
    raw = make_weight(T.Q4_K, 24, 512, rng)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    model = gguf_matmul_model(T.Q4_K, [24, 512], x.shape, w=raw)
    (y,) = carrack.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    assert_close_to_reference(y, x, raw, T.Q4_K, 24, 512)


@pytest.mark.parametrize(("ggml_type", "shape"), [(999, [4, 32]), (int(T.Q8_1), [4, 32]), (int(T.Q8_0), [4, 48]),
                                                  (int(T.Q8_0), [4]), (int(T.Q8_0), [-1, 32])])  # fmt: skip
def test_kernel_rejects_bad_attributes(ggml_type, shape):
    model = gguf_matmul_model(ggml_type, shape, (1, 32), w_len=136)
    with pytest.raises(InvalidModel):
        carrack.InferenceSession(model.SerializeToString())
