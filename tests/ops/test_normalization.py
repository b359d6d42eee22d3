"""Normalizations and Dropout against onnxruntime (old opsets included) or hand-computed numpy expectations."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack


def _model(op: str, inputs: dict[str, np.ndarray | None], opset: int, outputs: list[tuple[str, int]] | None = None,
           **attrs) -> onnx.ModelProto:
    names = [n if v is not None else "" for n, v in inputs.items()]
    while names and names[-1] == "":
        names.pop()
    first = helper.np_dtype_to_tensor_dtype(next(iter(inputs.values())).dtype)
    outputs = outputs or [("y", first)]
    node = helper.make_node(op, names, [n for n, _ in outputs], **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for n, v in inputs.items() if v is not None]
    graph_outputs = [helper.make_tensor_value_info(n, t, None) for n, t in outputs if n]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _feeds(inputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray]:
    return {k: v for k, v in inputs.items() if v is not None}


def _run(model: onnx.ModelProto, inputs: dict[str, np.ndarray | None]) -> list[np.ndarray]:
    return carrack.InferenceSession(model.SerializeToString()).run(None, _feeds(inputs))


def _compare(model: onnx.ModelProto, inputs: dict[str, np.ndarray | None], rtol=1e-5, atol=1e-5) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = sess.run(None, _feeds(inputs))
    got = _run(model, inputs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)
    return got


def _rand(*shape, dtype=np.float32, seed=0, low=-2.0, high=2.0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, high, shape).astype(dtype)


def _bn_inputs(shape=(2, 3, 4, 5), dtype=np.float32) -> dict[str, np.ndarray]:
    c = shape[1]
    return {"x": _rand(*shape, dtype=dtype), "scale": _rand(c, seed=1, dtype=dtype),
            "b": _rand(c, seed=2, dtype=dtype), "mean": _rand(c, seed=3, dtype=dtype),
            "var": _rand(c, seed=4, low=0.5, high=2.0, dtype=dtype)}


def _bn_inference(x, scale, b, mean, var, eps=1e-5):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    r = [p.reshape(shape) for p in (scale, b, mean, var)]
    return (x - r[2]) / np.sqrt(r[3] + eps) * r[0] + r[1]


@pytest.mark.parametrize("opset", [7, 9, 14, 15])
@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4), (2, 3, 4, 5), (1, 3, 2, 2, 2)])
def test_batchnorm_inference_matches_onnxruntime(opset, shape):
    _compare(_model("BatchNormalization", _bn_inputs(shape), opset, epsilon=1e-3), _bn_inputs(shape))


@pytest.mark.parametrize("opset", [1, 6])
def test_batchnorm_is_test_before_opset7(opset):
    inputs = _bn_inputs()
    attrs = {"is_test": 1, "consumed_inputs": [0, 0, 0, 1, 1]} if opset == 1 else {"is_test": 1}
    got = _run(_model("BatchNormalization", inputs, opset, **attrs), inputs)[0]
    np.testing.assert_allclose(got, _bn_inference(*inputs.values()), rtol=1e-5, atol=1e-5)


def test_batchnorm_float16():
    inputs = _bn_inputs(dtype=np.float16)
    _compare(_model("BatchNormalization", inputs, 15), inputs, rtol=2e-3, atol=2e-3)


def test_batchnorm_spatial_0_has_per_activation_parameters():
    x = _rand(4, 3, 2)
    params = {k: _rand(3, 2, seed=i, low=0.5) for i, k in enumerate(["scale", "b", "mean", "var"])}
    inputs = {"x": x, **params}
    got = _run(_model("BatchNormalization", inputs, 7, spatial=0), inputs)[0]
    want = (x - params["mean"]) / np.sqrt(params["var"] + 1e-5) * params["scale"] + params["b"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_batchnorm_training_mode_outputs_running_statistics():
    inputs = _bn_inputs()
    f = TensorProto.FLOAT
    model = _model("BatchNormalization", inputs, 15, [("y", f), ("rm", f), ("rv", f)], training_mode=1, momentum=0.8)
    y, running_mean, running_var = _run(model, inputs)
    x = inputs["x"]
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    np.testing.assert_allclose(y, _bn_inference(x, inputs["scale"], inputs["b"], mean, var), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(running_mean, inputs["mean"] * 0.8 + mean * 0.2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(running_var, inputs["var"] * 0.8 + var * 0.2, rtol=1e-5, atol=1e-6)


def test_batchnorm_before_opset14_trains_when_statistics_outputs_are_asked_for():
    inputs = _bn_inputs()
    f = TensorProto.FLOAT
    outputs = [("y", f), ("rm", f), ("rv", f), ("sm", f), ("sv", f)]
    y, running_mean, _, saved_mean, saved_var = _run(_model("BatchNormalization", inputs, 9, outputs), inputs)
    x = inputs["x"]
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    np.testing.assert_allclose(y, _bn_inference(x, inputs["scale"], inputs["b"], mean, var), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(running_mean, inputs["mean"] * 0.9 + mean * 0.1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saved_mean, mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saved_var, var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opset", [6, 22])
@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 5)])
def test_instancenorm_matches_onnxruntime(opset, shape):
    inputs = {"x": _rand(*shape), "scale": _rand(3, seed=1), "b": _rand(3, seed=2)}
    _compare(_model("InstanceNormalization", inputs, opset, epsilon=1e-3), inputs)


@pytest.mark.parametrize("axis", [0, 1, -1, -2])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layernorm_matches_onnxruntime(axis, with_bias):
    x = _rand(2, 3, 4)
    norm_shape = x.shape[axis % 3:]
    inputs = {"x": x, "scale": _rand(*norm_shape, seed=1), "b": _rand(*norm_shape, seed=2) if with_bias else None}
    f = TensorProto.FLOAT
    model = _model("LayerNormalization", inputs, 17, [("y", f), ("mean", f), ("inv_std", f)], axis=axis)
    _compare(model, inputs)


def test_layernorm_float16_keeps_statistics_in_float32():
    inputs = {"x": _rand(3, 8, dtype=np.float16), "scale": _rand(8, seed=1, dtype=np.float16)}
    outputs = [("y", TensorProto.FLOAT16), ("mean", TensorProto.FLOAT), ("inv_std", TensorProto.FLOAT)]
    y, mean, inv_std = _compare(_model("LayerNormalization", inputs, 17, outputs), inputs, rtol=2e-3, atol=2e-3)
    assert y.dtype == np.float16 and mean.dtype == np.float32 and mean.shape == (3, 1)


def test_layernorm_float64_is_computed_in_float64():
    x = np.random.default_rng(0).standard_normal((3, 500)) * 1e3 + 1e4
    inputs = {"x": x, "scale": np.ones(500)}
    _compare(_model("LayerNormalization", inputs, 17), inputs, rtol=1e-12, atol=1e-12)


def _group_norm(x, scale, bias, groups, eps=1e-5):
    n, c = x.shape[:2]
    g = x.reshape(n, groups, -1)
    normalized = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + eps)).reshape(x.shape)
    shape = (1, c) + (1,) * (x.ndim - 2)
    return normalized * scale.reshape(shape) + bias.reshape(shape)


def test_groupnorm_opset18_has_per_group_parameters():
    x, scale, bias = _rand(2, 6, 3, 3), _rand(3, seed=1), _rand(3, seed=2)
    inputs = {"x": x, "scale": scale, "bias": bias}
    got = _run(_model("GroupNormalization", inputs, 18, num_groups=3), inputs)[0]
    want = _group_norm(x, np.repeat(scale, 2), np.repeat(bias, 2), 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2, 6])
def test_groupnorm_opset21_has_per_channel_parameters(groups):
    x, scale, bias = _rand(2, 6, 3, 3), _rand(6, seed=1), _rand(6, seed=2)
    inputs = {"x": x, "scale": scale, "bias": bias}
    got = _run(_model("GroupNormalization", inputs, 21, num_groups=groups, epsilon=1e-3), inputs)[0]
    np.testing.assert_allclose(got, _group_norm(x, scale, bias, groups, 1e-3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [-1, 1, 0])
def test_rmsnorm(axis):
    x = _rand(2, 3, 4)
    scale = _rand(*x.shape[axis % 3:], seed=1)
    inputs = {"x": x, "scale": scale}
    got = _run(_model("RMSNormalization", inputs, 23, axis=axis, epsilon=1e-3), inputs)[0]
    axes = tuple(range(axis % 3, 3))
    want = x / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + 1e-3) * scale
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_rmsnorm_output_has_scale_dtype():
    inputs = {"x": _rand(2, 4, dtype=np.float16), "scale": _rand(4, seed=1)}
    got = _run(_model("RMSNormalization", inputs, 23, [("y", TensorProto.FLOAT)]), inputs)[0]
    assert got.dtype == np.float32


@pytest.mark.parametrize("opset", [1, 13])
@pytest.mark.parametrize("size", [1, 3, 5])
def test_lrn_matches_onnxruntime(opset, size):
    inputs = {"x": _rand(2, 6, 3, 3)}
    _compare(_model("LRN", inputs, opset, size=size, alpha=0.01, beta=0.6, bias=1.5), inputs)


@pytest.mark.parametrize("size", [2, 4])
def test_lrn_even_size_window_leans_forward(size):
    # onnxruntime rejects even sizes; the spec's window is [c - floor((size-1)/2), c + ceil((size-1)/2)].
    x = _rand(1, 5, 2)
    got = _run(_model("LRN", {"x": x}, 13, size=size, alpha=0.1, beta=0.5, bias=2.0), {"x": x})[0]
    lo, hi = (size - 1) // 2, size // 2
    square_sum = np.stack([(x[:, max(0, c - lo):c + hi + 1] ** 2).sum(axis=1) for c in range(5)], axis=1)
    np.testing.assert_allclose(got, x / (2.0 + 0.1 / size * square_sum) ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("opset", [1, 22])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_lpnorm_matches_onnxruntime(opset, p, axis):
    inputs = {"x": _rand(3, 4, 5)}
    if opset == 22:
        got = _run(_model("LpNormalization", inputs, opset, p=p, axis=axis), inputs)[0]
        x = inputs["x"]
        norm = np.linalg.norm(x, ord=p, axis=axis, keepdims=True)
        np.testing.assert_allclose(got, x / norm, rtol=1e-5, atol=1e-6)
    else:
        _compare(_model("LpNormalization", inputs, opset, p=p, axis=axis), inputs)


def test_lpnorm_zero_vector_gives_zero():
    inputs = {"x": np.array([[0.0, 0.0], [3.0, 4.0]], np.float32)}
    got = _run(_model("LpNormalization", inputs, 22, p=2, axis=1), inputs)[0]
    np.testing.assert_allclose(got, [[0, 0], [0.6, 0.8]], rtol=1e-6)


@pytest.mark.parametrize("opset", [9, 13])
@pytest.mark.parametrize("axes", [None, [0, 2, 3], [1], [2, 3], [-1]])
def test_mvn_matches_onnxruntime(opset, axes):
    inputs = {"x": _rand(2, 3, 4, 5)}
    attrs = {} if axes is None else {"axes": axes}
    _compare(_model("MeanVarianceNormalization", inputs, opset, **attrs), inputs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("opset", [7, 10, 12, 13, 22])
def test_dropout_inference_is_identity_with_full_mask(opset):
    inputs = {"x": _rand(3, 4)}
    mask_type = TensorProto.FLOAT if opset < 10 else TensorProto.BOOL
    attrs = {"ratio": 0.3} if opset < 12 else {}
    model = _model("Dropout", inputs, opset, [("y", TensorProto.FLOAT), ("mask", mask_type)], **attrs)
    # onnxruntime's opset 7-11 mask is all zeros; a mask of kept elements is all ones (as from opset 12 on).
    y, mask = _compare(model, inputs) if opset >= 12 else _run(model, inputs)
    np.testing.assert_array_equal(y, inputs["x"])
    assert mask.dtype == (np.float32 if opset < 10 else np.bool_) and np.all(mask)


def test_dropout_is_test_before_opset7():
    inputs = {"x": _rand(3, 4)}
    y = _run(_model("Dropout", inputs, 6, is_test=1, ratio=0.5), inputs)[0]
    np.testing.assert_array_equal(y, inputs["x"])


def test_dropout_training_mode_uses_seeded_mask():
    x = _rand(20, 30)
    inputs = {"x": x, "ratio": np.array(0.25, np.float32), "training_mode": np.array(True)}
    outputs = [("y", TensorProto.FLOAT), ("mask", TensorProto.BOOL)]
    y, mask = _run(_model("Dropout", inputs, 13, outputs, seed=7), inputs)
    again, _ = _run(_model("Dropout", inputs, 13, outputs, seed=7), inputs)
    np.testing.assert_array_equal(y, again)
    np.testing.assert_allclose(y, np.where(mask, x / 0.75, 0), rtol=1e-6)
    assert 0.6 < mask.mean() < 0.9


def test_dropout_training_mode_false_or_zero_ratio_is_identity():
    x = _rand(5, 6)
    for ratio, training in ((0.5, False), (0.0, True)):
        inputs = {"x": x, "ratio": np.array(ratio, np.float32), "training_mode": np.array(training)}
        y, mask = _run(_model("Dropout", inputs, 13, [("y", TensorProto.FLOAT), ("mask", TensorProto.BOOL)]), inputs)
        np.testing.assert_array_equal(y, x)
        assert mask.all()
