"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss against onnxruntime: weights, ignore_index, reductions,
N-D inputs, int32/int64 targets, the optional log_prob output."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack

SHAPES = [(4, 3), (2, 3, 5), (2, 4, 3, 2)]


def _model(op: str, inputs: dict[str, np.ndarray | None], opset: int, n_outputs: int = 1, **attrs) -> onnx.ModelProto:
    names = [n if v is not None else "" for n, v in inputs.items()]
    while names and names[-1] == "":
        names.pop()
    outs = ["loss", "log_prob"][:n_outputs]
    node = helper.make_node(op, names, outs, **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for n, v in inputs.items() if v is not None]
    elem = helper.np_dtype_to_tensor_dtype(next(iter(inputs.values())).dtype)
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info(o, elem, None) for o in outs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _compare(model: onnx.ModelProto, inputs: dict[str, np.ndarray | None], rtol=1e-5, atol=1e-6) -> list[np.ndarray]:
    feeds = {k: v for k, v in inputs.items() if v is not None}
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, feeds)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)
    return got


def _inputs(shape, weighted: bool, ignore_index: int | None = None, target_dtype=np.int64, dtype=np.float32):
    rng = np.random.default_rng(sum(shape))
    n, c = shape[:2]
    x = rng.standard_normal(shape).astype(dtype)
    target = rng.integers(0, c, (n, *shape[2:])).astype(target_dtype)
    if ignore_index is not None:
        target.flat[::3] = ignore_index
    weight = rng.uniform(0.2, 1.5, c).astype(dtype) if weighted else None
    return x, target, weight


@pytest.mark.parametrize("opset", [12, 13, 22])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_matches_onnxruntime(opset, shape, reduction, weighted):
    x, target, weight = _inputs(shape, weighted)
    inputs = {"x": x, "target": target, "weight": weight}
    _compare(_model("NegativeLogLikelihoodLoss", inputs, opset, reduction=reduction), inputs)


@pytest.mark.parametrize("ignore_index", [-1, 1, 7])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_ignore_index(ignore_index, reduction, weighted):
    x, target, weight = _inputs((3, 4, 5), weighted, ignore_index, target_dtype=np.int32)
    inputs = {"x": x, "target": target, "weight": weight}
    model = _model("NegativeLogLikelihoodLoss", inputs, 13, reduction=reduction, ignore_index=ignore_index)
    _compare(model, inputs)


def test_nll_hand_computed_weighted_mean():
    x = np.array([[[1.0, 2.0], [2.0, 2.0], [3.0, 2.0]], [[0.0, 1.0], [2.0, 2.0], [1.0, 2.0]]], np.float32)
    target = np.array([[2, 1], [0, 2]], np.int64)
    weight = np.array([0.2, 0.3, 0.1], np.float32)
    inputs = {"x": x, "target": target, "weight": weight}
    got = carrack.InferenceSession(_model("NegativeLogLikelihoodLoss", inputs, 22).SerializeToString()).run(
        None, inputs)[0]
    np.testing.assert_allclose(got, -1.1 / 0.7, rtol=1e-6)


@pytest.mark.parametrize("opset", [12, 13])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("n_outputs", [1, 2])
def test_sce_matches_onnxruntime(opset, shape, reduction, weighted, n_outputs):
    x, target, weight = _inputs(shape, weighted)
    inputs = {"x": x, "target": target, "weight": weight}
    _compare(_model("SoftmaxCrossEntropyLoss", inputs, opset, n_outputs, reduction=reduction), inputs)


@pytest.mark.parametrize("ignore_index", [-5, 0, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_sce_ignore_index(ignore_index, weighted):
    x, target, weight = _inputs((3, 4, 2), weighted, ignore_index, target_dtype=np.int32)
    inputs = {"x": x, "target": target, "weight": weight}
    _compare(_model("SoftmaxCrossEntropyLoss", inputs, 13, 2, ignore_index=ignore_index), inputs)


def test_sce_is_stable_for_large_scores():
    x = np.array([[1000.0, 0.0], [0.0, -1000.0]], np.float32)
    target = np.array([0, 1], np.int64)
    model = _model("SoftmaxCrossEntropyLoss", {"x": x, "target": target}, 13, 2, reduction="none")
    loss, log_prob = carrack.InferenceSession(model.SerializeToString()).run(None, {"x": x, "target": target})
    np.testing.assert_allclose(loss, [0.0, 1000.0], atol=1e-4)
    assert np.isfinite(log_prob).all()


def test_sce_float16():
    x, target, _ = _inputs((4, 5), False, dtype=np.float16)
    inputs = {"x": x, "target": target}
    loss, log_prob = _compare(_model("SoftmaxCrossEntropyLoss", inputs, 13, 2), inputs, rtol=2e-3, atol=2e-3)
    assert loss.dtype == np.float16 and log_prob.dtype == np.float16
    assert TensorProto.FLOAT16 == helper.np_dtype_to_tensor_dtype(loss.dtype)
