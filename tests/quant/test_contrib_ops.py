"""com.microsoft quantized kernels against onnxruntime.

Quantized outputs may differ by one step: onnxruntime's vectorised kernels round near-tie values of the float
intermediate (x / scale lands within float32 rounding of a .5) differently from an exact round-half-even.
Float outputs of integer matmuls use the same exact int32 accumulator, so they agree to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.quant.helpers import MS, carrack_run, ort_run

U8, I8, F32 = TensorProto.UINT8, TensorProto.INT8, TensorProto.FLOAT
rng = np.random.default_rng(0)


def _q(shape, dtype=np.uint8):
    lo, hi = (0, 256) if dtype == np.uint8 else (-128, 128)
    return rng.integers(lo, hi, shape).astype(dtype)


def _f(v):
    return np.asarray(v, np.float32)


def _compare_quantized(node, feeds, out_type=U8, inits=None):
    got = carrack_run(node, feeds, out_type, inits)
    want = ort_run(node, feeds, out_type, inits)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max(initial=0) <= 1


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_binary(op, dtype):
    a, b = _q((2, 3, 8), dtype), _q((3, 1), dtype)
    feeds = {"a": a, "as": _f(0.05), "az": np.asarray(3, dtype), "b": b, "bs": _f(0.1), "bz": np.asarray(-1 if
             dtype == np.int8 else 9, dtype), "cs": _f(0.2 if op == "QLinearAdd" else 1.5),
             "cz": np.asarray(5, dtype)}
    node = helper.make_node(op, ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], ["y"], domain=MS)
    _compare_quantized(node, feeds, U8 if dtype == np.uint8 else I8)


@pytest.mark.parametrize("op,attrs", [("QLinearSigmoid", {}), ("QLinearLeakyRelu", {"alpha": 0.1})])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_lookup_activations(op, attrs, dtype):
    x = _q((4, 64), dtype)
    feeds = {"x": x, "xs": _f(0.07), "xz": np.asarray(10, dtype), "ys": _f(0.004 if op == "QLinearSigmoid" else 0.05),
             "yz": np.asarray(0 if op == "QLinearSigmoid" else 20, dtype)}
    node = helper.make_node(op, list(feeds), ["y"], domain=MS, **attrs)
    _compare_quantized(node, feeds, U8 if dtype == np.uint8 else I8)


@pytest.mark.parametrize("opset,axis", [(13, -1), (12, 1)])
def test_softmax(opset, axis):
    x = _q((2, 3, 16))
    feeds = {"x": x, "xs": _f(0.05), "xz": np.asarray(128, np.uint8), "ys": _f(1 / 256), "yz": np.asarray(0, np.uint8)}
    node = helper.make_node("QLinearSoftmax", list(feeds), ["y"], domain=MS, opset=opset, axis=axis)
    _compare_quantized(node, feeds)


@pytest.mark.parametrize("channels_last", [0, 1])
def test_global_average_pool(channels_last):
    x = _q((2, 5, 6, 7))
    feeds = {"x": x, "xs": _f(0.05), "xz": np.asarray(128, np.uint8), "ys": _f(0.02), "yz": np.asarray(100, np.uint8)}
    node = helper.make_node("QLinearGlobalAveragePool", list(feeds), ["y"], domain=MS, channels_last=channels_last)
    _compare_quantized(node, feeds)


@pytest.mark.parametrize("channels_last", [0, 1])
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool(channels_last, count_include_pad):
    x = _q((1, 4, 7, 7))
    feeds = {"x": x, "xs": _f(0.05), "xz": np.asarray(128, np.uint8), "ys": _f(0.03), "yz": np.asarray(120, np.uint8)}
    node = helper.make_node("QLinearAveragePool", list(feeds), ["y"], domain=MS, kernel_shape=[3, 3], strides=[2, 2],
                            pads=[1, 1, 1, 1], channels_last=channels_last, count_include_pad=count_include_pad)
    _compare_quantized(node, feeds)


def test_concat():
    feeds = {"ys": _f(0.1), "yz": np.asarray(128, np.uint8), "a": _q((1, 2, 3)), "as": _f(0.1),
             "az": np.asarray(128, np.uint8), "b": _q((1, 4, 3)), "bs": _f(0.07), "bz": np.asarray(3, np.uint8)}
    node = helper.make_node("QLinearConcat", list(feeds), ["y"], domain=MS, axis=1)
    _compare_quantized(node, feeds)


@pytest.mark.parametrize("quantized_out", [False, True])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_qgemm(quantized_out, trans_b):
    a, b = _q((3, 40)), _q((40, 6), np.int8)
    feeds = {"a": a, "as": _f(0.02), "az": np.asarray(120, np.uint8), "b": b.T.copy() if trans_b else b,
             "bs": _f(rng.uniform(0.01, 0.02, 6)), "bz": np.zeros(6, np.int8), "c": rng.integers(-500, 500, 6).astype(
                 np.int32)}
    if quantized_out:
        feeds.update(ys=_f(0.5), yz=np.asarray(128, np.uint8))
    node = helper.make_node("QGemm", list(feeds), ["y"], domain=MS, transB=trans_b, alpha=1.0)
    if quantized_out:
        _compare_quantized(node, feeds)
    else:
        np.testing.assert_allclose(carrack_run(node, feeds, F32), ort_run(node, feeds, F32), rtol=1e-6, atol=1e-6)


def test_matmul_integer_to_float():
    a, b = _q((2, 5, 64)), _q((64, 7), np.int8)
    feeds = {"a": a, "b": b, "as": _f(0.03), "bs": _f(rng.uniform(0.01, 0.02, 7)), "az": np.asarray(100, np.uint8),
             "bz": np.asarray(0, np.int8), "bias": _f(rng.normal(size=7))}
    node = helper.make_node("MatMulIntegerToFloat", list(feeds), ["y"], domain=MS)
    np.testing.assert_allclose(carrack_run(node, feeds, F32), ort_run(node, feeds, F32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b_dtype", [np.int8, np.uint8])
def test_dynamic_quantize_matmul(b_dtype):
    a = rng.normal(size=(2, 5, 300)).astype(np.float32)
    b = _q((300, 9), b_dtype)
    feeds = {"a": a, "b": b, "bs": _f(rng.uniform(0.01, 0.02, 9)),
             "bz": np.full(9, 0 if b_dtype == np.int8 else 128, b_dtype), "bias": _f(rng.normal(size=9))}
    node = helper.make_node("DynamicQuantizeMatMul", list(feeds), ["y"], domain=MS)
    got, want = carrack_run(node, feeds, F32), ort_run(node, feeds, F32)
    # activation quantization may round a near-tie value differently: one step of a times |b| at most
    step = np.float32((a.max() - min(a.min(), 0)) / 255) * np.abs(b.astype(np.float32) - feeds["bz"]).max() * 0.02
    assert np.abs(got - want).max() <= step + 1e-4


@pytest.mark.parametrize("op,out_type", [("QuantizeLinear", U8), ("DequantizeLinear", F32)])
def test_ms_quantize_dequantize(op, out_type):
    if op == "QuantizeLinear":
        feeds = {"x": rng.normal(size=(2, 3, 4)).astype(np.float32), "s": _f([0.01, 0.02, 0.03]),
                 "z": np.asarray([0, 128, 255], np.uint8)}
    else:
        feeds = {"x": _q((2, 3, 4)), "s": _f([0.01, 0.02, 0.03]), "z": np.asarray([0, 128, 255], np.uint8)}
    node = helper.make_node(op, ["x", "s", "z"], ["y"], domain=MS, axis=1)
    got, want = carrack_run(node, feeds, out_type), ort_run(node, feeds, out_type)
    np.testing.assert_array_equal(got, want)


def _nbits_weights(k, n, block, with_zp):
    blocks = -(-k // block)
    q = rng.integers(0, 16, (n, blocks * block)).astype(np.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, blocks, block // 2)
    scales = rng.uniform(0.01, 0.05, (n, blocks)).astype(np.float32)
    zps = rng.integers(0, 16, (n, blocks + blocks % 2)).astype(np.uint8)
    zp_packed = (zps[:, 0::2] | (zps[:, 1::2] << 4))
    return packed, scales, (zp_packed if with_zp else None)


@pytest.mark.parametrize("k,block", [(64, 32), (80, 16), (100, 32)])
@pytest.mark.parametrize("with_zp", [False, True])
@pytest.mark.parametrize("constant", [False, True])
def test_matmul_nbits(k, block, with_zp, constant):
    n = 6
    packed, scales, zps = _nbits_weights(k, n, block, with_zp)
    a = rng.normal(size=(3, k)).astype(np.float32)
    weights = {"b": packed, "s": scales} | ({"z": zps} if with_zp else {})
    names = ["a", "b", "s"] + (["z"] if with_zp else [])
    node = helper.make_node("MatMulNBits", names, ["y"], domain=MS, K=k, N=n, bits=4, block_size=block)
    feeds, inits = ({"a": a}, weights) if constant else ({"a": a} | weights, None)
    np.testing.assert_allclose(carrack_run(node, feeds, F32, inits), ort_run(node, feeds, F32, inits), rtol=1e-4,
                               atol=1e-4)
