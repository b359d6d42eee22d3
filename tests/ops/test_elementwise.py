"""Elementwise kernels against onnxruntime (old opsets, dtypes, broadcasting) and hand-computed expectations."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.ops.elementwise import erf


def _model(op: str, inputs: dict[str, np.ndarray | None], opset: int, out_type: int | None = None,
           **attrs) -> onnx.ModelProto:
    names = [n if v is not None else "" for n, v in inputs.items()]
    node = helper.make_node(op, names, ["out"], **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for n, v in inputs.items() if v is not None]
    first = next(iter(inputs.values()))
    elem = out_type if out_type is not None else helper.np_dtype_to_tensor_dtype(first.dtype)
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info("out", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _run(model: onnx.ModelProto, inputs: dict[str, np.ndarray | None]) -> np.ndarray:
    feeds = {k: v for k, v in inputs.items() if v is not None}
    with np.errstate(all="ignore"):
        return carrack.InferenceSession(model.SerializeToString()).run(None, feeds)[0]


def _ort(model: onnx.ModelProto, inputs: dict[str, np.ndarray | None]) -> np.ndarray:
    feeds = {k: v for k, v in inputs.items() if v is not None}
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _check_vs_ort(op: str, inputs: dict[str, np.ndarray | None], opset: int, out_type: int | None = None,
                  rtol: float = 1e-6, atol: float = 1e-7, **attrs) -> np.ndarray:
    model = _model(op, inputs, opset, out_type, **attrs)
    got, expected = _run(model, inputs), _ort(model, inputs)
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    if got.dtype.kind in "fc":
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol)
    else:
        np.testing.assert_array_equal(got, expected)
    return got


def _values(shape, dtype, low=-5, high=5, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(low, info.min), min(high, info.max) + 1, shape).astype(dtype)
    return rng.uniform(low, high, shape).astype(dtype)


ARITH_DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.int8, np.uint8, np.uint16]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("dtype", ARITH_DTYPES)
def test_arithmetic_broadcasts_like_onnxruntime(op, dtype):
    a = _values((3, 1, 4), dtype, 0 if np.dtype(dtype).kind == "u" else -50, 50)
    b = _values((5, 1), dtype, 1, 9, seed=1)
    if np.dtype(dtype).kind == "i":
        b[::2] *= -1
    _check_vs_ort(op, {"a": a, "b": b}, 14, rtol=1e-3 if dtype == np.float16 else 1e-6)


@pytest.mark.parametrize("opset", [7, 13])
def test_arithmetic_older_opsets(opset):
    a, b = _values((2, 3), np.float32), _values((3,), np.float32, 1, 2)
    for op in ("Add", "Sub", "Mul", "Div"):
        _check_vs_ort(op, {"a": a, "b": b}, opset)


def test_integer_div_truncates_toward_zero():
    a = np.array([7, -7, 7, -7, 6, -6, 0, -1], dtype=np.int64)
    b = np.array([2, 2, -2, -2, 3, -4, 5, 2], dtype=np.int64)
    got = _check_vs_ort("Div", {"a": a, "b": b}, 14)
    np.testing.assert_array_equal(got, [3, -3, -3, 3, 2, 1, 0, 0])
    for dtype in (np.int8, np.int16, np.int32):
        _check_vs_ort("Div", {"a": a.astype(dtype), "b": b.astype(dtype)}, 14)


def test_legacy_broadcast_with_axis():
    a, b = _values((2, 3, 4, 5), np.float32), _values((3, 4), np.float32, seed=1)
    model = _model("Add", {"a": a, "b": b}, 6, broadcast=1, axis=1)
    np.testing.assert_allclose(_run(model, {"a": a, "b": b}), a + b[None, :, :, None])
    c = _values((5,), np.float32, seed=2)
    model = _model("Mul", {"a": a, "c": c}, 1, broadcast=1)
    np.testing.assert_allclose(_run(model, {"a": a, "c": c}), a * c)
    d = _values((2,), np.float32, 1, 2, seed=3)
    model = _model("Div", {"a": a, "d": d}, 6, broadcast=1, axis=0)
    np.testing.assert_allclose(_run(model, {"a": a, "d": d}), a / d[:, None, None, None], rtol=1e-6)
    model = _model("Greater", {"a": a, "b": b}, 1, out_type=TensorProto.BOOL, broadcast=1, axis=1)
    np.testing.assert_array_equal(_run(model, {"a": a, "b": b}), a > b[None, :, :, None])


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint32])
@pytest.mark.parametrize("fmod", [0, 1])
def test_integer_mod_sign_rules(dtype, fmod):
    a = np.array([5, -5, 5, -5, 7, -7, 0, 9], dtype=np.int64)
    b = np.array([3, 3, -3, -3, 7, 2, 4, -4], dtype=np.int64)
    if np.dtype(dtype).kind == "u":
        a, b = np.abs(a), np.abs(b)
    got = _check_vs_ort("Mod", {"a": a.astype(dtype), "b": b.astype(dtype)}, 13, fmod=fmod)
    expected = np.fmod(a, b) if fmod else np.array([x % y for x, y in zip(a.tolist(), b.tolist())])
    np.testing.assert_array_equal(got, expected.astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_float_mod(dtype):
    a = np.array([5.5, -5.5, 5.5, -5.5, 0.0, -0.0, 3.0, -3.0, np.inf], dtype=dtype)
    b = np.array([2.0, 2.0, -2.0, -2.0, -3.0, 3.0, np.inf, np.inf, 2.0], dtype=dtype)
    _check_vs_ort("Mod", {"a": a[:-3], "b": b[:-3]}, 13, fmod=1)
    got = _run(_model("Mod", {"a": a, "b": b}, 13, fmod=0), {"a": a, "b": b})
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.array([1.5, 0.5, -0.5, -1.5, -0.0, 0.0, 3.0, np.inf, np.nan], dtype))
    assert np.signbit(got[4]) and not np.signbit(got[5])
    got = _run(_model("Mod", {"a": a, "b": b}, 13, fmod=1), {"a": a, "b": b})
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(got, np.fmod(a, b))


@pytest.mark.parametrize("base, exponent", [
    (np.float32, np.float32), (np.float32, np.int64), (np.float32, np.int32), (np.float32, np.float64),
    (np.float64, np.int64), (np.int64, np.int64), (np.int32, np.int32), (np.int64, np.float32),
    (np.int32, np.float64), (np.float16, np.float32),
])
def test_pow_output_has_base_type(base, exponent):
    x = _values((2, 3), base, 1, 4)
    y = _values((3,), exponent, 0, 3, seed=1)
    if np.dtype(exponent).kind == "f":
        y = y.round(1).astype(exponent)
    got = _check_vs_ort("Pow", {"x": x, "y": y}, 15, rtol=1e-3 if base == np.float16 else 1e-5)
    assert got.dtype == base


def test_pow_negative_float_base_and_integer_negative_exponent():
    x = np.array([-2.0, -8.0, 4.0, 0.0], dtype=np.float32)
    y = np.array([2.0, 1 / 3, -0.5, -1.0], dtype=np.float32)
    got = _run(_model("Pow", {"x": x, "y": y}, 13), {"x": x, "y": y})
    np.testing.assert_allclose(got[[0, 2]], [4.0, 0.5])
    assert np.isnan(got[1]) and np.isposinf(got[3])
    xi, yi = np.array([2, 1, -1, -1], np.int64), np.array([-1, -3, -3, -2], np.int64)
    np.testing.assert_array_equal(_run(_model("Pow", {"x": xi, "y": yi}, 13), {"x": xi, "y": yi}), [0, 1, -1, 1])


@pytest.mark.parametrize("op", ["Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.int8, np.uint16, np.float16])
def test_comparisons_return_bool(op, dtype):
    a, b = _values((4, 1), dtype, 0, 4), _values((1, 5), dtype, 0, 4, seed=1)
    got = _check_vs_ort(op, {"a": a, "b": b}, 16, out_type=TensorProto.BOOL)
    assert got.dtype == np.bool_


def test_comparisons_at_opset_7_and_bool_equal():
    a, b = _values((3, 4), np.float32), _values((4,), np.float32, seed=1)
    for op in ("Greater", "Less"):
        _check_vs_ort(op, {"a": a, "b": b}, 7, out_type=TensorProto.BOOL)
    p, q = np.array([True, False, True]), np.array([True, True, False])
    _check_vs_ort("Equal", {"p": p, "q": q}, 11, out_type=TensorProto.BOOL)


def test_equal_on_strings():
    a = np.array(["cat", "dog", "", "émile"], dtype=object)
    b = np.array(["cat", "Dog", "", "émile"], dtype=object)
    got = _run(_model("Equal", {"a": a, "b": b}, 19, out_type=TensorProto.BOOL), {"a": a, "b": b})
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, [True, False, True, True])
    s = np.array(["dog"], dtype=object)
    got = _run(_model("Equal", {"a": a, "s": s}, 19, out_type=TensorProto.BOOL), {"a": a, "s": s})
    np.testing.assert_array_equal(got, [False, True, False, False])


def test_logical_ops():
    a = np.array([[True, False, True, False]])
    b = np.array([[True], [False]])
    for op in ("And", "Or", "Xor"):
        _check_vs_ort(op, {"a": a, "b": b}, 7)
    _check_vs_ort("Not", {"a": a}, 1)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint64])
def test_bitwise_ops(dtype):
    a, b = _values((3, 4), dtype, 0, 120), _values((4,), dtype, 0, 120, seed=1)
    if np.dtype(dtype).kind == "i":
        a = a - 60
    for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor"):
        _check_vs_ort(op, {"a": a, "b": b}, 18)
    _check_vs_ort("BitwiseNot", {"a": a}, 18)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.uint64])  # onnxruntime has no uint16 BitShift
@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bitshift_unsigned(dtype, direction):
    x = np.array([1, 2, 3, 255, 16, 128], dtype=dtype)
    y = np.array([0, 1, 2, 3, 4, 7], dtype=dtype)
    _check_vs_ort("BitShift", {"x": x, "y": y}, 11, direction=direction)


def test_bitshift_signed_and_out_of_range_amounts():
    x = np.array([1, -8, 64, -1, 5, -5, 5, -5], dtype=np.int8)
    y = np.array([1, 1, 1, 3, 8, 8, -1, -1], dtype=np.int8)
    left = _run(_model("BitShift", {"x": x, "y": y}, 28, direction="LEFT"), {"x": x, "y": y})
    np.testing.assert_array_equal(left, np.array([2, -16, -128, -8, 0, 0, 0, 0], dtype=np.int8))
    right = _run(_model("BitShift", {"x": x, "y": y}, 28, direction="RIGHT"), {"x": x, "y": y})
    np.testing.assert_array_equal(right, np.array([0, -4, 32, -1, 0, -1, 0, -1], dtype=np.int8))
    u = np.array([1, 255], dtype=np.uint8)
    v = np.array([8, 200], dtype=np.uint8)
    assert _run(_model("BitShift", {"u": u, "v": v}, 11, direction="LEFT"), {"u": u, "v": v}).tolist() == [0, 0]


def test_bitshift_rejects_bad_direction():
    x = np.array([1], dtype=np.uint8)
    with pytest.raises(carrack.errors.InvalidModel, match="direction"):
        _run(_model("BitShift", {"x": x, "y": x}, 11, direction="UP"), {"x": x, "y": x})


UNARY_FLOAT = {
    "Abs": (-5, 5), "Neg": (-5, 5), "Ceil": (-5, 5), "Floor": (-5, 5), "Sqrt": (0, 9), "Exp": (-5, 5),
    "Log": (0.01, 9), "Reciprocal": (0.5, 5), "Sign": (-5, 5), "Sin": (-5, 5), "Cos": (-5, 5), "Tan": (-1.5, 1.5),
    "Asin": (-1, 1), "Acos": (-1, 1), "Atan": (-5, 5), "Sinh": (-5, 5), "Cosh": (-5, 5), "Asinh": (-5, 5),
    "Acosh": (1, 9), "Atanh": (-0.99, 0.99), "Erf": (-4, 4), "Round": (-5, 5),
}


_NUMPY_REFERENCE = {
    "Abs": np.abs, "Neg": np.negative, "Ceil": np.ceil, "Floor": np.floor, "Sqrt": np.sqrt, "Exp": np.exp,
    "Log": np.log, "Reciprocal": np.reciprocal, "Sign": np.sign, "Sin": np.sin, "Cos": np.cos, "Tan": np.tan,
    "Asin": np.arcsin, "Acos": np.arccos, "Atan": np.arctan, "Sinh": np.sinh, "Cosh": np.cosh,
    "Asinh": np.arcsinh, "Acosh": np.arccosh, "Atanh": np.arctanh, "Round": np.rint,
    "Erf": np.vectorize(math.erf),
}


@pytest.mark.parametrize("op", sorted(UNARY_FLOAT))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_unary_math(op, dtype):
    low, high = UNARY_FLOAT[op]
    x = _values((4, 6), dtype, low, high)
    if dtype == np.float64:  # onnxruntime has no double kernel for several of these
        got = _run(_model(op, {"x": x}, 13), {"x": x})
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, _NUMPY_REFERENCE[op](x), rtol=1e-14, atol=1e-300)
    else:
        _check_vs_ort(op, {"x": x}, 13, rtol=2e-3 if dtype == np.float16 else 2e-6)


@pytest.mark.parametrize("op", ["Abs", "Neg", "Sign"])
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_unary_integer(op, dtype):
    _check_vs_ort(op, {"x": _values((3, 5), dtype, -9, 9)}, 13)


def test_unary_at_opset_7():
    x = _values((2, 5), np.float32, 0.1, 0.9)
    for op in ("Sin", "Acos", "Exp", "Sqrt", "Floor", "Reciprocal"):
        _check_vs_ort(op, {"x": x}, 7)


def test_round_half_to_even():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.3, -4.5, 0.9, np.inf, np.nan], dtype=np.float32)
    got = _run(_model("Round", {"x": x}, 11), {"x": x})
    np.testing.assert_array_equal(got, [0, 2, 2, -0, -2, -2, 2, -4, 1, np.inf, np.nan])


def test_half_precision_keeps_dtype():
    x = np.array([0.5, -1.25, 3.0, 7.5], dtype=ml_dtypes.bfloat16)
    for op, fn in (("Exp", np.exp), ("Sqrt", lambda v: np.sqrt(np.abs(v))), ("Neg", np.negative)):
        inp = np.abs(x) if op == "Sqrt" else x
        got = _run(_model(op, {"x": inp}, 22 if op != "Neg" else 13), {"x": inp})
        assert got.dtype == ml_dtypes.bfloat16
        np.testing.assert_allclose(got.astype(np.float32), fn(x.astype(np.float32)), rtol=1e-2)
    got = _run(_model("Add", {"a": x, "b": x}, 14), {"a": x, "b": x})
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), 2 * x.astype(np.float32))


def test_erf_accuracy():
    xs = np.concatenate([np.linspace(-7, 7, 20001), np.geomspace(1e-30, 1e-3, 50), [0.0, -0.0, 0.99999, 1.00001]])
    expected = np.array([math.erf(v) for v in xs])
    got = erf(xs)
    np.testing.assert_allclose(got, expected, rtol=1e-15, atol=0)
    assert np.signbit(erf(np.array([-0.0]))[0])
    special = erf(np.array([np.inf, -np.inf, np.nan]))
    assert special[0] == 1 and special[1] == -1 and np.isnan(special[2])


def test_erf_float32_and_integer_inputs():
    x = np.linspace(-5, 5, 4001, dtype=np.float32)
    got = _run(_model("Erf", {"x": x}, 13), {"x": x})
    assert got.dtype == np.float32
    expected = np.array([math.erf(v) for v in x.astype(np.float64)]).astype(np.float32)
    np.testing.assert_allclose(got, expected, rtol=1.2e-7, atol=1e-45)
    xi = np.array([-3, -1, 0, 1, 3], dtype=np.int32)
    got = _run(_model("Erf", {"x": xi}, 9), {"x": xi})
    assert got.dtype == np.int32 and got.tolist() == [0, 0, 0, 0, 0]


def test_isnan_isinf():
    x = np.array([1.0, np.nan, np.inf, -np.inf, -0.0], dtype=np.float32)
    _check_vs_ort("IsNaN", {"x": x}, 13, out_type=TensorProto.BOOL)
    for neg in (0, 1):
        for pos in (0, 1):
            _check_vs_ort("IsInf", {"x": x}, 10, out_type=TensorProto.BOOL, detect_negative=neg, detect_positive=pos)
    h = x.astype(np.float16)
    np.testing.assert_array_equal(_run(_model("IsNaN", {"h": h}, 13, TensorProto.BOOL), {"h": h}), np.isnan(x))
    f8 = x.astype(ml_dtypes.float8_e5m2)
    np.testing.assert_array_equal(_run(_model("IsInf", {"f": f8}, 20, TensorProto.BOOL), {"f": f8}), np.isinf(x))


def test_clip_attribute_bounds_before_opset_11():
    x = _values((3, 4), np.float32)
    _check_vs_ort("Clip", {"x": x}, 6, min=-1.0, max=2.0)
    _check_vs_ort("Clip", {"x": x}, 6, min=0.5)
    _check_vs_ort("Clip", {"x": x}, 6)


@pytest.mark.parametrize("opset", [11, 12, 13])
def test_clip_input_bounds(opset):
    x = _values((3, 4), np.float32)
    lo, hi = np.array(-1.0, np.float32), np.array(2.5, np.float32)
    _check_vs_ort("Clip", {"x": x, "lo": lo, "hi": hi}, opset)
    _check_vs_ort("Clip", {"x": x, "lo": None, "hi": hi}, opset)
    _check_vs_ort("Clip", {"x": x, "lo": lo}, opset)
    _check_vs_ort("Clip", {"x": x}, opset)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8])
def test_clip_integers_and_min_above_max(dtype):
    x = _values((3, 4), dtype, 0, 20)
    lo, hi = np.array(3, dtype), np.array(12, dtype)
    _check_vs_ort("Clip", {"x": x, "lo": lo, "hi": hi}, 13)
    got = _check_vs_ort("Clip", {"x": x, "lo": hi, "hi": lo}, 13)
    assert (got == 3).all()


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
@pytest.mark.parametrize("opset", [8, 13])
def test_variadic_broadcasting(op, opset):
    a, b, c = _values((2, 3, 1), np.float32), _values((3, 4), np.float32, seed=1), _values((4,), np.float32, seed=2)
    _check_vs_ort(op, {"a": a, "b": b, "c": c}, opset)
    _check_vs_ort(op, {"a": a}, opset)
    h = a.astype(np.float16)
    _check_vs_ort(op, {"h": h, "b": b.astype(np.float16)}, opset, rtol=2e-3)


def test_variadic_max_min_integers():
    a, b = _values((2, 3), np.int64, -9, 9), _values((3,), np.int64, -9, 9, seed=1)
    for op in ("Max", "Min"):
        _check_vs_ort(op, {"a": a, "b": b}, 12)
        _check_vs_ort(op, {"a": a.astype(np.uint8) % 7, "b": b.astype(np.uint8) % 7}, 13)


def test_where_broadcast_and_strings():
    cond = np.array([[True], [False]])
    x, y = _values((2, 3), np.float32), _values((3,), np.float32, seed=1)
    _check_vs_ort("Where", {"c": cond, "x": x, "y": y}, 16, out_type=TensorProto.FLOAT)
    xi, yi = _values((3,), np.int64), np.array(7, dtype=np.int64)
    _check_vs_ort("Where", {"c": cond, "x": xi, "y": yi}, 9, out_type=TensorProto.INT64)
    xs, ys = np.array(["a", "b", "c"], dtype=object), np.array(["z"], dtype=object)
    got = _run(_model("Where", {"c": cond, "x": xs, "y": ys}, 16, out_type=TensorProto.STRING),
               {"c": cond, "x": xs, "y": ys})
    assert got.tolist() == [["a", "b", "c"], ["z", "z", "z"]]
