"""The float32 Gelu path (a fitted erfc in float32 arithmetic) and the in-place activations of fused kernels."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.ops.elementwise import erfc, gelu, tanh_gelu

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]


def _reference(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return 0.5 * x64 * erfc(-x64 / math.sqrt(2))


def test_float32_gelu_accuracy():
    x = np.concatenate([np.linspace(-12, 12, 200001), np.geomspace(1e-30, 12, 2000),
                        -np.geomspace(1e-30, 12, 2000)]).astype(np.float32)
    got = gelu(x)
    assert got.dtype == np.float32
    expected = _reference(x)
    rel = np.abs(got - expected) / np.maximum(np.abs(expected), 1e-300)
    assert rel[np.abs(x) < 2].max() < 1e-6
    assert rel[x > -4].max() < 3e-6
    assert rel[x >= 2].max() < 1.2e-7  # within an ulp
    np.testing.assert_allclose(got, expected, rtol=3e-5, atol=1e-37)


def test_gelu_special_values_and_in_place():
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e30, -1e30], np.float32)
    got = gelu(special)
    assert got[0] == np.inf and np.isnan(got[2]) and got[3] == 0 and got[5] == np.float32(1e30) and got[6] == 0
    x = np.random.default_rng(0).standard_normal((3, 70000)).astype(np.float32)  # several blocks
    expected = gelu(x)
    y = x.copy()
    assert gelu(y, out=y) is y
    np.testing.assert_array_equal(y, expected)
    strided = x[:, ::3]
    np.testing.assert_array_equal(gelu(strided), expected[:, ::3])


def test_float64_gelu_stays_accurate():
    x = np.linspace(-8, 8, 1001)
    np.testing.assert_allclose(gelu(x), [0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x], rtol=1e-13, atol=1e-300)


def test_tanh_gelu_in_place():
    x = np.linspace(-6, 6, 101, dtype=np.float32)
    expected = 0.5 * x * (1 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * (x + np.float32(0.044715) * x ** 3)))
    np.testing.assert_allclose(tanh_gelu(x), expected, rtol=1e-6, atol=1e-7)
    y = x.copy()
    tanh_gelu(y, out=y)
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-7)


def _fused_model(activation: str, params: list[float]) -> bytes:
    extra = {"activation_params": params} if params else {}
    node = helper.make_node("FusedConv", ["x", "w", "b"], ["y"], domain="com.microsoft", activation=activation,
                            kernel_shape=[3, 3], pads=[1, 1, 1, 1], **extra)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 5]),
                                            helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 2, 3, 3]),
                                            helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=8).SerializeToString()


@pytest.mark.parametrize("activation, params", [("Relu", []), ("Sigmoid", []), ("Tanh", []), ("LeakyRelu", [0.1]),
                                                ("HardSigmoid", [0.3, 0.4]), ("Clip", [-0.5, 0.5])])
def test_fused_conv_activations_match_onnxruntime(activation, params):
    import onnxruntime as ort

    rng = np.random.default_rng(4)
    feed = {"x": rng.standard_normal((1, 2, 5, 5)).astype(np.float32),
            "w": rng.standard_normal((3, 2, 3, 3)).astype(np.float32),
            "b": rng.standard_normal(3).astype(np.float32)}
    copies = {k: v.copy() for k, v in feed.items()}
    model = _fused_model(activation, params)
    got = carrack.InferenceSession(model).run(None, feed)[0]
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    for k in feed:  # the activation overwrote the kernel's own result, never an input
        np.testing.assert_array_equal(feed[k], copies[k])


def test_bias_gelu_leaves_inputs_alone():
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal(8).astype(np.float32)
    node = helper.make_node("BiasGelu", ["x", "b"], ["y"], domain="com.microsoft")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
                                            helper.make_tensor_value_info("b", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=OPSETS, ir_version=8)
    x0, b0 = x.copy(), b.copy()
    got = carrack.InferenceSession(model.SerializeToString()).run(None, {"x": x, "b": b})[0]
    np.testing.assert_allclose(got, _reference(x + b), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(b, b0)
    assert isinstance(onnx.load_from_string(model.SerializeToString()), onnx.ModelProto)
