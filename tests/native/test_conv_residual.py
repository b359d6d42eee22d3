"""FusedConv with a residual Z (act(conv + B + Z)) through every native convolution path and the numpy one, the
graph rule that makes it from Conv -> Add/Sum [-> Relu], and the direct convolution at column stride 2 (which
the kernel choice now leaves to columns) called on its own."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from carrack.native import convolution as native_conv
from carrack.ops import conv
from carrack.runtime.session import InferenceSession
from tests.helpers import ort_run

#: (input shape, weight shape, strides, pads, group): 1x1, strided 1x1, direct, columns (stride 2 / narrow rows),
#: grouped, 1-D, depthwise (no native residual: numpy adds it)
CASES = [
    ((1, 8, 9, 11), (12, 8, 1, 1), [1, 1], [0, 0, 0, 0], 1),
    ((2, 6, 9, 10), (7, 6, 1, 1), [2, 2], [0, 0, 0, 0], 1),
    ((1, 8, 30, 33), (13, 8, 3, 3), [1, 1], [1, 1, 1, 1], 1),
    ((2, 8, 15, 17), (9, 8, 3, 3), [2, 2], [1, 1, 1, 1], 1),
    ((1, 8, 7, 7), (130, 8, 3, 3), [1, 1], [1, 1, 1, 1], 1),
    ((1, 8, 12, 12), (6, 4, 3, 3), [1, 1], [0, 1, 2, 1], 2),
    ((1, 5, 40), (7, 5, 3), [1], [1, 1], 1),
    ((1, 4, 9, 9), (4, 1, 3, 3), [1, 1], [1, 1, 1, 1], 4),
]


def _model(x_shape, w, b, strides, pads, group, z_shape, op="Add", act="Relu", conv_first=True) -> onnx.ModelProto:
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=strides, pads=pads, group=group)]
    pair = ["c", "z"] if conv_first else ["z", "c"]
    nodes.append(helper.make_node(op, pair, ["s" if act else "y"]))
    if act:
        nodes.append(helper.make_node(act, ["s"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
                                           helper.make_tensor_value_info("z", TensorProto.FLOAT, z_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel()),
                               helper.make_tensor("b", TensorProto.FLOAT, b.shape, b.ravel())])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_residual_fusion_matches_onnxruntime(monkeypatch, native, case):
    monkeypatch.setenv("CARRACK_NATIVE", native)
    x_shape, w_shape, strides, pads, group = CASES[case]
    rng = np.random.default_rng(case)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    y_shape = ort_run(_model(x_shape, w, b, strides, pads, group, [1], act=""),
                      {"x": x, "z": np.zeros(1, np.float32)})[0].shape
    z = rng.standard_normal(y_shape).astype(np.float32)
    model = _model(x_shape, w, b, strides, pads, group, list(y_shape), op="Sum" if case % 2 else "Add",
                   conv_first=case % 3 != 0)
    session = InferenceSession(model.SerializeToString())
    assert session.optimizer_stats.get("conv_residual_fusion") == 1
    got = session.run(None, {"x": x, "z": z})[0]
    want = ort_run(model, {"x": x, "z": z})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native", ["0", "1"])
def test_residual_that_broadcasts(monkeypatch, native):
    """A residual smaller than the result (or a layout the kernel cannot read) is added the numpy way."""
    monkeypatch.setenv("CARRACK_NATIVE", native)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((6, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    x = rng.standard_normal((1, 3, 10, 10)).astype(np.float32)
    z = rng.standard_normal((6, 1, 1)).astype(np.float32)
    model = _model([1, 3, 10, 10], w, b, [1, 1], [1, 1, 1, 1], 1, [6, 1, 1], act="")
    got = InferenceSession(model.SerializeToString()).run(None, {"x": x, "z": z})[0]
    np.testing.assert_allclose(got, ort_run(model, {"x": x, "z": z})[0], rtol=1e-4, atol=1e-4)
    kernels = native_conv.load()
    full = rng.standard_normal((1, 6, 10, 10)).astype(np.float32)
    strided = np.repeat(full, 2, axis=3)[..., ::2]  # not contiguous: copied for the native kernel
    y = conv.convolve(x, w, strides=[1, 1], pads=[1, 1, 1, 1], dilations=[1, 1], group=1, bias=b, residual=strided,
                      kernels=kernels)
    ref = conv.convolve(x, w, strides=[1, 1], pads=[1, 1, 1, 1], dilations=[1, 1], group=1, bias=b, kernels=None)
    np.testing.assert_allclose(y, ref + full, rtol=1e-5, atol=1e-5)


def test_no_fusion_when_the_residual_is_the_convolution():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 4, 1, 1)).astype(np.float32)
    b = np.zeros(4, np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"]), helper.make_node("Add", ["c", "c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel()),
                               helper.make_tensor("b", TensorProto.FLOAT, b.shape, b.ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    session = InferenceSession(model.SerializeToString())
    assert not session.optimizer_stats.get("conv_residual_fusion")
    x = rng.standard_normal((1, 4, 3, 3)).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], ort_run(model, {"x": x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(native_conv.load() is None, reason="native convolution kernels not built here")
@pytest.mark.parametrize("width", [7, 16, 29, 70])
def test_direct_stride_two_with_residual(width):
    kernels = native_conv.load()
    rng = np.random.default_rng(width)
    x = rng.standard_normal((1, 8, 11, width)).astype(np.float32)
    w = rng.standard_normal((10, 8, 3, 3)).astype(np.float32)
    b = rng.standard_normal(10).astype(np.float32)
    ref = conv.convolve(x, w, strides=[2, 2], pads=[1, 1, 1, 1], dilations=[1, 1], group=1, bias=b, kernels=None)
    z = rng.standard_normal(ref.shape).astype(np.float32)
    got = kernels.direct(x, w, b, None, [2, 2], [1, 1, 1, 1], [1, 1], 1, (1, 0.0, 0.0), z)
    np.testing.assert_allclose(got, np.maximum(ref + z, 0), rtol=1e-4, atol=1e-4)
    got = kernels.direct(x, w, b, None, [2, 2], [1, 1, 1, 1], [1, 1], 1)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
