"""Conv weights and bias that constant folding leaves as broadcast views (ConstantOfShape, as in the "light" model
zoo files): densified once at setup for the native kernels, same results as numpy and onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from carrack.runtime.session import InferenceSession
from tests.helpers import ort_run


def _model():
    shape = helper.make_tensor("ws", TensorProto.INT64, [4], [8, 3, 3, 3])
    bshape = helper.make_tensor("bs", TensorProto.INT64, [1], [8])
    nodes = [helper.make_node("ConstantOfShape", ["ws"], ["w"], value=helper.make_tensor("v", 1, [1], [0.25])),
             helper.make_node("ConstantOfShape", ["bs"], ["b"], value=helper.make_tensor("v", 1, [1], [-0.5])),
             helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 30])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape, bshape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.mark.parametrize("native", ["0", "1"])
def test_broadcast_constant_weights(monkeypatch, native):
    monkeypatch.setenv("CARRACK_NATIVE", native)
    model = _model()
    x = np.random.default_rng(0).standard_normal((1, 3, 12, 30)).astype(np.float32)
    session = InferenceSession(model.SerializeToString())
    for _ in range(2):  # the second run reuses the densified constants
        np.testing.assert_allclose(session.run(None, {"x": x})[0], ort_run(model, {"x": x})[0], rtol=1e-5, atol=1e-5)
