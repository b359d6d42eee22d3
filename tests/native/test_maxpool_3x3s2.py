"""MaxPool 3x3 stride 2 (SqueezeNet's, DenseNet's): the native separable fast path against numpy and onnxruntime,
with the shapes around its conditions (ceil_mode, pads, NaN planes and rows whose last window ends at the edge)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from carrack.runtime.session import InferenceSession
from tests.helpers import ort_run

CASES = [((1, 4, 111, 111), {}), ((2, 3, 56, 57), {}), ((1, 2, 7, 40), {}), ((1, 3, 3, 3), {}),
         ((1, 2, 111, 111), {"ceil_mode": 1}), ((1, 2, 20, 21), {"pads": [1, 1, 1, 1]}), ((1, 2, 3, 9), {}),
         ((3, 2, 9, 8), {})]


def _model(shape, attrs):
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _carrack(monkeypatch, native: str, model, x: np.ndarray) -> np.ndarray:
    monkeypatch.setenv("CARRACK_NATIVE", native)
    return InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_maxpool_3x3_stride_2(monkeypatch, case):
    shape, attrs = CASES[case]
    x = np.random.default_rng(case).standard_normal(shape).astype(np.float32)
    model = _model(shape, attrs)
    y = _carrack(monkeypatch, "1", model, x)
    np.testing.assert_array_equal(y, ort_run(model, {"x": x})[0])
    np.testing.assert_array_equal(y, _carrack(monkeypatch, "0", model, x))
    x[0, 1, 1, 2] = np.nan  # one plane takes the NaN-aware path (onnxruntime's NaN handling differs: numpy's only)
    x[-1, -1, -1, -1] = np.inf
    np.testing.assert_array_equal(_carrack(monkeypatch, "1", model, x), _carrack(monkeypatch, "0", model, x))


def test_nan_anywhere_in_a_window_reaches_the_output(monkeypatch):
    """The fast path notices a NaN wherever the windows read it (every column of a 16-output block, first and last
    rows) and redoes that plane NaN-aware, as numpy's maximum; a NaN no window reads changes nothing."""
    shape = (1, 1, 7, 69)
    model = _model(shape, {})
    monkeypatch.setenv("CARRACK_NATIVE", "1")
    session = InferenceSession(model.SerializeToString())
    base = np.random.default_rng(9).standard_normal(shape).astype(np.float32)
    for r in (0, 3, 6):
        for c in range(shape[3]):
            x = base.copy()
            x[0, 0, r, c] = np.nan
            expected = _carrack(monkeypatch, "0", model, x)
            np.testing.assert_array_equal(session.run(None, {"x": x})[0], expected, err_msg=f"NaN at ({r}, {c})")
            assert np.isnan(expected).any() == (c < 2 * expected.shape[3] + 1)
