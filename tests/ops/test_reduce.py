"""Reduce* and ArgMax/ArgMin against onnxruntime across opsets (axes attribute vs input), plus edge cases."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack

REDUCE_OPS = ["ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMin", "ReduceMean",
              "ReduceProd", "ReduceSum", "ReduceSumSquare"]


def _axes_input_since(op: str) -> int:
    return 13 if op == "ReduceSum" else 18


def _model(op: str, inputs: dict[str, np.ndarray | None], opset: int, out_type: int | None = None,
           **attrs) -> onnx.ModelProto:
    names = [n if v is not None else "" for n, v in inputs.items()]
    node = helper.make_node(op, names, ["y"], **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for n, v in inputs.items() if v is not None]
    first = next(iter(inputs.values()))
    elem = out_type if out_type is not None else helper.np_dtype_to_tensor_dtype(first.dtype)
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _run_both(model: onnx.ModelProto, inputs: dict[str, np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
    feeds = {k: v for k, v in inputs.items() if v is not None}
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, feeds)
    return got[0], expected[0]


def _run(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> np.ndarray:
    return carrack.InferenceSession(model.SerializeToString()).run(None, inputs)[0]


def _reduce(op: str, x: np.ndarray, axes: list[int] | None, opset: int, **attrs):
    """Builds a Reduce model taking axes as an attribute or an input, as `opset` requires."""
    inputs: dict[str, np.ndarray | None] = {"x": x}
    if opset < _axes_input_since(op):
        if axes is not None:
            attrs["axes"] = axes
    else:
        inputs["axes"] = None if axes is None else np.array(axes, dtype=np.int64)
    return _model(op, inputs, opset, **attrs), inputs


def _data(op: str, shape=(3, 4, 5), dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, shape)
    if op == "ReduceLogSum":
        x = np.abs(x) + 0.1
    if op == "ReduceProd":
        x = x * 0.6
    return x.astype(dtype)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("opset", [7, 11, 13, 18, 20])
@pytest.mark.parametrize("axes", [None, [1], [0, 2], [-1]])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_matches_onnxruntime(op, opset, axes, keepdims):
    model, inputs = _reduce(op, _data(op), axes, opset, keepdims=keepdims)
    got, expected = _run_both(model, inputs)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_noop_with_empty_axes_applies_only_elementwise_part(op):
    x = _data(op, (2, 3))
    model, inputs = _reduce(op, x, [], _axes_input_since(op), noop_with_empty_axes=1)
    got, expected = _run_both(model, inputs)
    assert got.shape == x.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_empty_axes_input_without_noop_reduces_everything(op):
    model, inputs = _reduce(op, _data(op), [], _axes_input_since(op), keepdims=0)
    got, expected = _run_both(model, inputs)
    assert got.shape == ()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("op", "identity"), [
    ("ReduceSum", 0.0), ("ReduceSumSquare", 0.0), ("ReduceL1", 0.0), ("ReduceL2", 0.0), ("ReduceProd", 1.0),
    ("ReduceMax", -np.inf), ("ReduceMin", np.inf), ("ReduceLogSum", -np.inf), ("ReduceLogSumExp", -np.inf),
])
def test_empty_reduction_gives_identity(op, identity):
    x = np.zeros((2, 0, 4), np.float32)
    model, inputs = _reduce(op, x, [1], 18 if op != "ReduceSum" else 13, keepdims=1)
    got = _run(model, {k: v for k, v in inputs.items() if v is not None})
    assert got.shape == (2, 1, 4) and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.full((2, 1, 4), identity, np.float32))


@pytest.mark.parametrize(("op", "dtype", "identity"), [
    ("ReduceMax", np.int32, np.iinfo(np.int32).min), ("ReduceMin", np.int64, np.iinfo(np.int64).max),
    ("ReduceMax", np.bool_, False), ("ReduceMin", np.bool_, True), ("ReduceSum", np.int32, 0),
])
def test_empty_integer_reduction_gives_dtype_identity(op, dtype, identity):
    x = np.zeros((0, 3), dtype)
    model, inputs = _reduce(op, x, [0], 20, keepdims=0)
    got = _run(model, {k: v for k, v in inputs.items() if v is not None})
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.full((3,), identity, dtype))


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
                                "ReduceSumSquare", "ReduceL1"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_inputs_keep_their_dtype(op, dtype):
    x = np.random.default_rng(1).integers(-5, 6, (3, 4)).astype(dtype)
    model, inputs = _reduce(op, x, [1], 13, keepdims=0)
    got, expected = _run_both(model, inputs)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)


def test_bool_reduce_max_min():
    x = np.array([[True, False], [False, False]])
    for op, want in (("ReduceMax", [True, False]), ("ReduceMin", [False, False])):
        model, inputs = _reduce(op, x, [1], 20, keepdims=0)
        got = _run(model, {k: v for k, v in inputs.items() if v is not None})
        np.testing.assert_array_equal(got, np.array(want))


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceL2", "ReduceSumSquare"])
def test_float16_accumulates_in_float32(op):
    x = np.full((4096,), 0.1, np.float16)
    model, inputs = _reduce(op, x, None, 18, keepdims=0)
    got = _run(model, {"x": x})
    want = {"ReduceSum": 4096 * 0.1, "ReduceMean": 0.1, "ReduceL2": np.sqrt(4096 * 0.01),
            "ReduceSumSquare": 4096 * 0.01}[op]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3)


def test_log_sum_exp_is_stable_for_large_values():
    x = np.array([[1000.0, 1000.0], [-1000.0, -1000.0]], np.float32)
    model, inputs = _reduce("ReduceLogSumExp", x, [1], 18, keepdims=0)
    got = _run(model, {k: v for k, v in inputs.items() if v is not None})
    np.testing.assert_allclose(got, [1000 + np.log(2), -1000 + np.log(2)], rtol=1e-6)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("opset", [7, 11, 12, 13])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_arg_reduce_matches_onnxruntime(op, opset, axis, keepdims):
    x = np.random.default_rng(2).integers(0, 3, (3, 4, 5)).astype(np.float32)  # many ties
    attrs = {"axis": axis, "keepdims": keepdims}
    for last in ([0, 1] if opset >= 12 else [None]):
        if last is not None:
            attrs["select_last_index"] = last
        model = _model(op, {"x": x}, opset, out_type=TensorProto.INT64, **attrs)
        got, expected = _run_both(model, {"x": x})
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, expected)


def test_arg_reduce_select_last_index_picks_last_tie():
    x = np.array([[1, 3, 3, 0], [2, 2, 1, 1]], np.int32)
    model = _model("ArgMax", {"x": x}, 13, out_type=TensorProto.INT64, axis=1, keepdims=0, select_last_index=1)
    np.testing.assert_array_equal(_run(model, {"x": x}), [2, 1])
    model = _model("ArgMin", {"x": x}, 13, out_type=TensorProto.INT64, axis=1, keepdims=0, select_last_index=1)
    np.testing.assert_array_equal(_run(model, {"x": x}), [3, 3])
