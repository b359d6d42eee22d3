"""Kernels a decoder runs unbound every token (its cache grows), on their short paths: Unsqueeze with constant axes
(an initializer, as exporters write it) parsed once when built, equal to onnxruntime for unsorted, negative and
several axes, an axis out of range still refused; a one-input Concat copied into its planned buffer."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack

ort = pytest.importorskip("onnxruntime")


def _model(axes: list[int], rank: int) -> bytes:
    node = helper.make_node("Unsqueeze", ["x", "axes"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None] * rank)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(np.array(axes, np.int64), "axes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.mark.parametrize("axes", [[0], [3, 0], [1, 2], [0, 1, 2], [-1], [2, -4], [4]])
def test_constant_axes_give_onnxruntime_s_shapes(axes):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    model = _model(axes, 2)
    if max(axes) >= x.ndim + len(axes):  # onnxruntime refuses the model
        with pytest.raises((carrack.RunFailure, carrack.InvalidModel), match="out of range"):
            carrack.InferenceSession(model).run(None, {"x": x})
        return
    got = carrack.InferenceSession(model).run(None, {"x": x})[0]
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_repeated_constant_axes_are_refused():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises((carrack.RunFailure, carrack.InvalidModel, onnx.checker.ValidationError), match="repeat"):
        carrack.InferenceSession(_model([1, 1], 2)).run(None, {"x": x})


def test_a_one_input_concat_is_a_copy_into_its_planned_buffer():
    """x -> Concat(x) -> Neg: the Concat's result is an intermediate written into the arena; new lengths each run."""
    nodes = [helper.make_node("Concat", ["x"], ["c"], axis=2), helper.make_node("Neg", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, "n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    session = carrack.InferenceSession(model)
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for length in (3, 4, 9, 4, 0):
        x = rng.standard_normal((1, 4, length, 8)).astype(np.float32)
        kept = x.copy()
        got = session.run(None, {"x": x})[0]
        np.testing.assert_array_equal(got, reference.run(None, {"x": x})[0])
        np.testing.assert_array_equal(x, kept)
