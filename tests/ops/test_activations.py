"""Activation kernels against onnxruntime (old opsets, half precision) and hand-computed expectations."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import carrack


def _model(op: str, inputs: dict[str, np.ndarray], opset: int, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, list(inputs), ["out"], **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for n, v in inputs.items()]
    elem = helper.np_dtype_to_tensor_dtype(next(iter(inputs.values())).dtype)
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info("out", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _run(op: str, inputs: dict[str, np.ndarray], opset: int, **attrs) -> np.ndarray:
    model = _model(op, inputs, opset, **attrs)
    return carrack.InferenceSession(model.SerializeToString()).run(None, inputs)[0]


def _check_vs_ort(op: str, inputs: dict[str, np.ndarray], opset: int, rtol: float = 1e-5, atol: float = 1e-6,
                  **attrs) -> np.ndarray:
    model = _model(op, inputs, opset, **attrs)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    got = carrack.InferenceSession(model.SerializeToString()).run(None, inputs)[0]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol)
    return got


def _values(shape, dtype=np.float32, low=-4.0, high=4.0, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, high, shape).astype(dtype)


# op -> (opsets to check against onnxruntime, attributes)
POINTWISE = {
    "Relu": ([6, 13, 14], {}),
    "LeakyRelu": ([6, 16], {"alpha": 0.1}),
    "Elu": ([6, 22], {"alpha": 0.7}),
    "Selu": ([6, 22], {}),
    "Celu": ([12], {"alpha": 1.5}),
    "Gelu": ([20], {}),
    "Mish": ([18, 22], {}),
    "Softplus": ([7, 22], {}),
    "Softsign": ([7, 22], {}),
    "HardSigmoid": ([6, 22], {"alpha": 0.3, "beta": 0.4}),
    "HardSwish": ([14, 22], {}),
    "ThresholdedRelu": ([10, 22], {"alpha": 0.5}),
    "Sigmoid": ([6, 13], {}),
    "Tanh": ([6, 13], {}),
    "Shrink": ([9], {"lambd": 1.0, "bias": 0.25}),
}


@pytest.mark.parametrize("op", sorted(POINTWISE))
def test_pointwise_float32(op):
    opsets, attrs = POINTWISE[op]
    x = _values((3, 4, 5))
    for opset in opsets:
        _check_vs_ort(op, {"x": x}, opset, **attrs)


@pytest.mark.parametrize("op", sorted(POINTWISE))
@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_pointwise_other_float_types(op, dtype):
    opsets, attrs = POINTWISE[op]
    x = _values((4, 6), dtype)
    if op != "Celu":  # Celu-12 is float32 only; onnxruntime refuses opset 28, where Celu gained more types
        try:
            _check_vs_ort(op, {"x": x}, opsets[-1], rtol=2e-3 if dtype == np.float16 else 1e-6, atol=2e-3, **attrs)
            return
        except Exception as e:
            if "NOT_IMPLEMENTED" not in str(e):
                raise
    opset = 28 if op == "Celu" else opsets[-1]
    got = _run(op, {"x": x}, opset, **attrs)  # compare with the float32 computation instead
    assert got.dtype == dtype
    want = _run(op, {"x": x.astype(np.float32)}, opset, **attrs)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3)


def test_extreme_inputs_stay_finite():
    x = np.array([-1000.0, -80.0, -1e-8, 0.0, 1e-8, 80.0, 1000.0], dtype=np.float32)
    for op in ("Sigmoid", "Softplus", "Mish", "Elu", "Selu", "Celu", "Tanh", "Gelu"):
        opset = POINTWISE[op][0][-1]
        # onnxruntime's exp(x) - 1 rounds Elu-like ops at tiny negative x to 0; carrack uses expm1
        got = _check_vs_ort(op, {"x": x}, opset, rtol=1e-5, atol=3e-8)
        assert np.isfinite(got).all()


def test_gelu_tanh_approximation():
    x = _values((5, 7), low=-6, high=6)
    _check_vs_ort("Gelu", {"x": x}, 20, approximate="tanh")
    got = _run("Gelu", {"x": x.astype(np.float64)}, 20, approximate="tanh")
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x.astype(np.float64) ** 3)
    np.testing.assert_allclose(got, 0.5 * x * (1 + np.tanh(inner)), rtol=1e-12)


def test_gelu_exact_matches_erf_formula():
    x = np.linspace(-12, 6, 361)
    expected = np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x])
    np.testing.assert_allclose(_run("Gelu", {"x": x}, 20), expected, rtol=1e-13, atol=1e-300)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(carrack.errors.InvalidModel, match="approximate"):
        _run("Gelu", {"x": _values((2,))}, 20, approximate="fast")


def test_bfloat16_keeps_dtype():
    x = _values((3, 4)).astype(ml_dtypes.bfloat16)
    for op, opset in (("Relu", 14), ("Sigmoid", 13), ("Gelu", 20), ("HardSwish", 22), ("Softmax", 13)):
        got = _run(op, {"x": x}, opset)
        assert got.dtype == ml_dtypes.bfloat16
        want = _run(op, {"x": x.astype(np.float32)}, opset)
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_relu_integers(dtype):
    x = np.arange(-5, 5).astype(dtype)
    got = _run("Relu", {"x": x}, 14)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.maximum(x, 0))


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint8])
def test_shrink_integers(dtype):
    x = np.arange(-6, 6).astype(dtype) if np.dtype(dtype).kind == "i" else np.arange(0, 12).astype(dtype)
    got = _run("Shrink", {"x": x}, 9, lambd=2.0, bias=1.0)
    w = x.astype(np.int64)
    expected = np.where(w < -2, w + 1, np.where(w > 2, w - 1, 0)).astype(dtype)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("slope_shape", [(1,), (3, 1, 1), (5,), (1, 3, 4, 1), ()])
@pytest.mark.parametrize("opset", [7, 9, 16])
def test_prelu_broadcasts_slope(slope_shape, opset):
    x = _values((2, 3, 4, 5))
    slope = _values(slope_shape, low=0, high=1, seed=1)
    _check_vs_ort("PRelu", {"x": x, "slope": slope}, opset)


def test_prelu_integers_and_legacy_channel_slope():
    x = np.arange(-6, 6, dtype=np.int32).reshape(2, 6)
    slope = np.array([2], dtype=np.int32)
    got = _run("PRelu", {"x": x, "slope": slope}, 9)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.where(x < 0, 2 * x, x))
    x4 = _values((2, 3, 4, 5))
    per_channel = np.array([0.1, 0.2, 0.3], dtype=np.float32)
    got = _run("PRelu", {"x": x4, "slope": per_channel}, 6)
    np.testing.assert_allclose(got, np.where(x4 < 0, x4 * per_channel[:, None, None], x4))


def test_swish_and_swiglu():
    x = _values((3, 8))
    got = _run("Swish", {"x": x}, 24, alpha=1.5)
    np.testing.assert_allclose(got, x / (1 + np.exp(-1.5 * x)), rtol=1e-6)
    _check_vs_ort("Swish", {"x": x}, 24, alpha=0.5)
    a, b = _values((2, 3, 4)), _values((2, 3, 4), seed=1)
    got = _run("SwiGLU", {"a": a, "b": b}, 28, alpha=2.0)
    np.testing.assert_allclose(got, a / (1 + np.exp(-2.0 * a)) * b, rtol=1e-6)
    half = _run("SwiGLU", {"a": a.astype(np.float16), "b": b.astype(np.float16)}, 28)
    assert half.dtype == np.float16
    np.testing.assert_allclose(half, a / (1 + np.exp(-a)) * b, rtol=5e-3, atol=5e-3)
    with pytest.raises(carrack.errors.CarrackError):
        _run("SwiGLU", {"a": a, "b": b[:, :1]}, 28)


NORMALIZERS = ["Softmax", "LogSoftmax", "Hardmax"]


@pytest.mark.parametrize("op", NORMALIZERS)
@pytest.mark.parametrize("opset", [7, 11])
@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1, -3])
def test_normalizers_before_opset_13_flatten_to_2d(op, opset, axis):
    x = _values((2, 3, 4))
    attrs = {} if axis is None else {"axis": axis}
    if opset < 11 and axis is not None and axis < 0:
        return
    got = _check_vs_ort(op, {"x": x}, opset, **attrs)
    a = 1 if axis is None else axis % 3
    flat = x.reshape(math.prod(x.shape[:a]), -1)
    if op == "Softmax":
        expected = np.exp(flat) / np.exp(flat).sum(1, keepdims=True)
        np.testing.assert_allclose(got, expected.reshape(x.shape), rtol=1e-5)


@pytest.mark.parametrize("op", NORMALIZERS)
@pytest.mark.parametrize("axis", [None, 0, 1, -2])
def test_normalizers_from_opset_13_work_along_axis(op, axis):
    x = _values((2, 3, 4))
    attrs = {} if axis is None else {"axis": axis}
    got = _check_vs_ort(op, {"x": x}, 13, **attrs)
    if op == "Softmax":
        np.testing.assert_allclose(got.sum(axis=-1 if axis is None else axis), 1, rtol=1e-6)


@pytest.mark.parametrize("op", NORMALIZERS)
def test_normalizers_float16_and_large_values(op):
    x = _values((3, 5), low=-10, high=10).astype(np.float16)
    _check_vs_ort(op, {"x": x}, 13, rtol=5e-3, atol=5e-3)
    big = np.array([[1000.0, 1001.0, 999.0], [-1e30, 0.0, 1e30]], dtype=np.float32)
    _check_vs_ort(op, {"x": big}, 13)


def test_hardmax_picks_first_maximum():
    x = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]], dtype=np.float32)
    np.testing.assert_array_equal(_run("Hardmax", {"x": x}, 13), [[0, 1, 0, 0], [1, 0, 0, 0]])
    # opset 11, axis 0: the whole tensor is one row, whose first maximum is x[1, 0]
    np.testing.assert_array_equal(_run("Hardmax", {"x": x}, 11, axis=0), [[0, 0, 0, 0], [1, 0, 0, 0]])


def test_normalizers_on_empty_tensors():
    x = np.zeros((0, 4), dtype=np.float32)
    for op in NORMALIZERS:
        assert _run(op, {"x": x}, 13).shape == (0, 4)
        assert _run(op, {"x": x}, 11).shape == (0, 4)
