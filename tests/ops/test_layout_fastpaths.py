"""Fast paths of the data-movement ops: constant Reshape targets, Transpose checked once, Concat into the arena,
ReduceMean over trailing axes; each against numpy and onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from tests.helpers import ort_run


def _session(model: onnx.ModelProto) -> carrack.InferenceSession:
    return carrack.InferenceSession(model.SerializeToString())


def _shuffle_model(groups: int, channels: int, shape_as_input: bool = False) -> onnx.ModelProto:
    """Channel shuffle (Reshape -> Transpose -> Reshape) between two Relus, then Concat with its input."""
    n, h, w = 1, 5, 6
    split = helper.make_tensor("split_shape", TensorProto.INT64, [5], [0, groups, -1, h, w])
    merge = helper.make_tensor("merge_shape", TensorProto.INT64, [4], [n, -1, h, w])
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("Reshape", ["a", "split_shape"], ["b"]),
             helper.make_node("Transpose", ["b"], ["c"], perm=[0, 2, 1, 3, 4]),
             helper.make_node("Reshape", ["c", "merge_shape"], ["d"]),
             helper.make_node("Relu", ["d"], ["e"]),
             helper.make_node("Concat", ["e", "a"], ["f"], axis=1),
             helper.make_node("Sigmoid", ["f"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, channels, h, w])]
    if shape_as_input:  # an initializer that is also a graph input: a run may override it
        inputs.append(helper.make_tensor_value_info("merge_shape", TensorProto.INT64, [4]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[split, merge])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _shuffle_reference(x: np.ndarray, groups: int) -> np.ndarray:
    a = np.maximum(x, 0)
    n, c, h, w = a.shape
    d = a.reshape(n, groups, c // groups, h, w).transpose(0, 2, 1, 3, 4).reshape(n, c, h, w)
    return 1 / (1 + np.exp(-np.concatenate([np.maximum(d, 0), a], axis=1)))


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("groups,channels", [(2, 8), (3, 12), (4, 4)])
def test_channel_shuffle_and_concat(monkeypatch, native: str, groups: int, channels: int) -> None:
    monkeypatch.setenv("CARRACK_NATIVE", native)
    model = _shuffle_model(groups, channels)
    x = np.random.default_rng(0).standard_normal((1, channels, 5, 6)).astype(np.float32)
    session = _session(model)
    for _ in range(2):  # the second run reuses the arena the first one planned
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, _shuffle_reference(x, groups), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(y, ort_run(model, {"x": x})[0], rtol=1e-6, atol=1e-7)


def test_reshape_overridden_shape_initializer_is_read_per_run() -> None:
    model = _shuffle_model(2, 8, shape_as_input=True)
    x = np.random.default_rng(1).standard_normal((1, 8, 5, 6)).astype(np.float32)
    session = _session(model)
    (y,) = session.run(None, {"x": x})
    np.testing.assert_allclose(y, _shuffle_reference(x, 2), rtol=1e-6)
    with pytest.raises(Exception, match="reshape|Concat|concatenat|dimension"):
        session.run(None, {"x": x, "merge_shape": np.array([1, 8, 30, 1], dtype=np.int64)})


def test_transpose_bad_perm_fails_at_run() -> None:
    node = helper.make_node("Transpose", ["x"], ["y"], perm=[0, 0])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    session = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(Exception, match="perm"):
        session.run(None, {"x": np.zeros((2, 3), np.float32)})


def _reduce_mean_model(axes: list[int], keepdims: int) -> onnx.ModelProto:
    node = helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=keepdims)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(np.array(axes, np.int64), "axes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("axes", [[2, 3], [-1], [1, 2, 3], [3, 2], [1, 3]])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_mean_trailing_axes(axes: list[int], keepdims: int) -> None:
    x = np.random.default_rng(2).standard_normal((2, 7, 5, 3)).astype(np.float32)
    model = _reduce_mean_model(axes, keepdims)
    (y,) = _session(model).run(None, {"x": x})
    expected = np.mean(x.astype(np.float64), axis=tuple(axes), keepdims=bool(keepdims))
    assert y.dtype == np.float32 and y.shape == expected.shape
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, ort_run(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_reduce_mean_trailing_special_values_and_views() -> None:
    x = np.ones((1, 3, 2, 2), np.float32)
    x[0, 0, 0, 0], x[0, 1, 1, 1] = np.nan, np.inf
    (y,) = _session(_reduce_mean_model([2, 3], 0)).run(None, {"x": x})
    assert np.isnan(y[0, 0]) and np.isinf(y[0, 1]) and y[0, 2] == 1.0
    strided = np.random.default_rng(3).standard_normal((1, 4, 6, 6)).astype(np.float32)[:, ::2, :, ::2]
    (z,) = _session(_reduce_mean_model([2, 3], 1)).run(None, {"x": strided})
    np.testing.assert_allclose(z, strided.mean(axis=(2, 3), keepdims=True), rtol=1e-6)
    (e,) = _session(_reduce_mean_model([2, 3], 0)).run(None, {"x": np.zeros((0, 3, 2, 2), np.float32)})
    assert e.shape == (0, 3)
