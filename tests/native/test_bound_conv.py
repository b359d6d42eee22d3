"""Convolutions bound once to their constants and geometry (BoundConvolution): the same results as the general
path for every kind it serves, new input shapes, inputs and buffers it must refuse (strided, misaligned,
overlapping), residuals, and threads sharing a session."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

from carrack.native import convolution as native_conv
from carrack.runtime.session import InferenceSession

pytestmark = pytest.mark.skipif(native_conv.load() is None, reason="native convolution kernels not built here")

#: (name, weight shape, attributes, residual): one of each kind the binding serves, and one it leaves alone
KINDS = [("pointwise", (12, 8, 1, 1), {}, False), ("pointwise+z", (12, 8, 1, 1), {}, True),
         ("grouped pointwise", (12, 8 // 2, 1, 1), {"group": 2}, False),
         ("direct", (7, 8, 3, 3), {"pads": [1, 1, 1, 1]}, False),
         ("direct+z", (7, 8, 3, 3), {"pads": [1, 1, 1, 1]}, True),
         ("depthwise", (8, 1, 3, 3), {"pads": [1, 1, 1, 1], "group": 8, "strides": [2, 2]}, False),
         ("columns", (6, 8, 3, 3), {"strides": [2, 2]}, False)]


def _model(w: np.ndarray, attrs: dict, residual: bool):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], **attrs)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, "h", "w"])]
    if residual:
        nodes.append(helper.make_node("Add", ["c", "z"], ["s"]))
        inputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    nodes.append(helper.make_node("Relu", ["s" if residual else "c"], ["y"]))
    b = np.linspace(-1, 1, w.shape[0], dtype=np.float32)
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel()),
                               helper.make_tensor("b", TensorProto.FLOAT, b.shape, b)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()


def _sessions(monkeypatch, model: bytes) -> tuple[InferenceSession, InferenceSession]:
    monkeypatch.setenv("CARRACK_NATIVE", "0")
    reference = InferenceSession(model)
    monkeypatch.setenv("CARRACK_NATIVE", "1")
    return InferenceSession(model), reference


def _feeds(rng, shape, residual: bool, session: InferenceSession) -> dict:
    feed = {"x": rng.standard_normal(shape).astype(np.float32)}
    if residual:
        y_shape = session.run(None, {"x": feed["x"], "z": np.zeros(1, np.float32)})[0].shape
        feed["z"] = rng.standard_normal(y_shape).astype(np.float32)
    return feed


@pytest.mark.parametrize("kind", range(len(KINDS)))
def test_bound_calls_match_the_general_path(monkeypatch, kind):
    name, w_shape, attrs, residual = KINDS[kind]
    calls = []
    original = native_conv.BoundConvolution.__call__
    monkeypatch.setattr(native_conv.BoundConvolution, "__call__",
                        lambda self, *a: calls.append(a) or original(self, *a))
    rng = np.random.default_rng(kind)
    session, reference = _sessions(monkeypatch, _model(rng.standard_normal(w_shape).astype(np.float32), attrs,
                                                       residual))
    for shape in [(1, 8, 7, 7), (2, 8, 13, 20), (1, 8, 7, 7), (1, 8, 1, 33)]:
        feed = _feeds(rng, shape, residual, reference)
        expected = reference.run(None, feed)[0]
        np.testing.assert_allclose(session.run(None, feed)[0], expected, rtol=1e-5, atol=1e-5)
        # inputs the binding must refuse: every other column of a wider image, a misaligned copy, a strided z
        wide = np.zeros(shape[:3] + (2 * shape[3],), np.float32)
        wide[..., ::2] = feed["x"]
        raw = np.zeros(feed["x"].nbytes + 4, np.uint8)
        odd = raw[2:2 + feed["x"].nbytes].view(np.float32).reshape(shape)
        odd[...] = feed["x"]
        for x in (wide[..., ::2], odd):
            np.testing.assert_allclose(session.run(None, {**feed, "x": x})[0], expected, rtol=1e-5, atol=1e-5)
        if residual:
            z_wide = np.repeat(feed["z"], 2, axis=-1)[..., ::2]
            np.testing.assert_allclose(session.run(None, {**feed, "z": z_wide})[0], expected, rtol=1e-5, atol=1e-5)
    # columns (strided KxK) are bound too where packconv.c's packed-weight convolution runs (AVX-512)
    assert bool(calls) == (name != "columns" or native_conv.load().packs)


def test_threads_share_bound_calls(monkeypatch):
    rng = np.random.default_rng(5)
    session, reference = _sessions(monkeypatch, _model(rng.standard_normal((12, 8, 3, 3)).astype(np.float32),
                                                       {"pads": [1, 1, 1, 1]}, False))
    feeds = [{"x": rng.standard_normal((1, 8, 9 + i % 3, 11)).astype(np.float32)} for i in range(12)]
    expected = [reference.run(None, f)[0] for f in feeds]
    results: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        for _ in range(20):
            results[i] = session.run(None, feeds[i])[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, e in enumerate(expected):
        np.testing.assert_allclose(results[i], e, rtol=1e-5, atol=1e-5)
