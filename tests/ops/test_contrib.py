"""com.microsoft contrib kernels against onnxruntime on small random inputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import carrack

MS = "com.microsoft"
rng = np.random.default_rng(0)


def _model(op: str, feeds: dict, n_out: int, domain: str = MS, opset: int = 17, inits: dict | None = None,
           inputs: list[str] | None = None, **attrs) -> onnx.ModelProto:
    inits = inits or {}
    names = inputs if inputs is not None else list(feeds) + list(inits)
    outs = [f"y{i}" if i >= 0 else "" for i in range(n_out)]
    node = helper.make_node(op, names, outs, domain=domain, **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), None) for k, v in feeds.items()],
        [onnx.ValueInfoProto(name=o) for o in outs if o],
        initializer=[onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", opset),
                                                                 helper.make_opsetid(MS, 1)])


def _compare(model: onnx.ModelProto, feeds: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    import onnxruntime as ort

    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = carrack.InferenceSession(model).run(None, feeds)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_allclose(g.astype(np.float32), e.astype(np.float32), rtol=rtol, atol=atol)


def _rand(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("axis", [-1, -2, 1])
def test_layer_norm_before_opset_17(axis):
    x = _rand(2, 3, 8)
    norm = x.shape[axis:] if axis != 1 else x.shape[1:]
    feeds = {"x": x, "g": _rand(*norm), "b": _rand(*norm)}
    _compare(_model("LayerNormalization", feeds, 3, domain="", opset=14, axis=axis, epsilon=1e-3), feeds)


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_layer_norm(with_bias):
    feeds = {"x": _rand(2, 5, 16), "skip": _rand(2, 5, 16), "gamma": _rand(16), "beta": _rand(16)}
    if with_bias:
        feeds["bias"] = _rand(16)
    _compare(_model("SkipLayerNormalization", feeds, 4, epsilon=1e-5), feeds)
    _compare(_model("SkipLayerNormalization", feeds, 1, epsilon=1e-5), feeds)


def test_skip_layer_norm_float16():
    feeds = {"x": _rand(2, 5, 16, dtype=np.float16), "skip": _rand(2, 5, 16, dtype=np.float16),
             "gamma": _rand(16, dtype=np.float16)}
    _compare(_model("SkipLayerNormalization", feeds, 1), feeds, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("op,bias", [("Gelu", False), ("FastGelu", False), ("FastGelu", True), ("BiasGelu", True),
                                     ("QuickGelu", False)])
def test_gelu_family(op, bias):
    feeds = {"x": _rand(3, 4, 10) * 3}
    if bias:
        feeds["bias"] = _rand(10)
    _compare(_model(op, feeds, 1), feeds)


def test_gelu_float16():
    feeds = {"x": _rand(3, 10, dtype=np.float16)}
    _compare(_model("Gelu", feeds, 1), feeds, rtol=1e-3, atol=1e-3)


def _mha_feeds(batch=2, seq=3, total=4, heads=2, size=4, v_size=4):
    return {"q": _rand(batch, seq, heads * size), "k": _rand(batch, total, heads * size),
            "v": _rand(batch, total, heads * v_size)}


@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_multi_head_attention_basic(scale):
    feeds = _mha_feeds(v_size=6)
    attrs = {"scale": scale} if scale else {}
    _compare(_model("MultiHeadAttention", feeds, 1, num_heads=2, **attrs), feeds)


def test_multi_head_attention_bias_and_masks():
    feeds = _mha_feeds()
    feeds["bias"] = _rand(24)
    feeds["key_padding_mask"] = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int32)
    feeds["attention_bias"] = _rand(1, 2, 3, 4)
    _compare(_model("MultiHeadAttention", feeds, 1, num_heads=2), feeds)


def test_multi_head_attention_causal_bias_with_inf():
    feeds = _mha_feeds(seq=4)
    causal = np.where(np.triu(np.ones((4, 4)), 1) > 0, -np.inf, 0).astype(np.float32)
    feeds["attention_bias"] = causal[None, None]
    inputs = ["q", "k", "v", "", "", "attention_bias"]
    _compare(_model("MultiHeadAttention", feeds, 1, inputs=inputs, num_heads=2), feeds)


def test_multi_head_attention_per_head_key_value():
    feeds = {"q": _rand(2, 3, 8), "k": _rand(2, 2, 5, 4), "v": _rand(2, 2, 5, 4)}
    _compare(_model("MultiHeadAttention", feeds, 1, num_heads=2), feeds)


def test_multi_head_attention_past_and_present():
    feeds = _mha_feeds(seq=1, total=1)
    feeds["past_key"] = _rand(2, 2, 3, 4)
    feeds["past_value"] = _rand(2, 2, 3, 4)
    inputs = ["q", "k", "v", "", "", "", "past_key", "past_value"]
    _compare(_model("MultiHeadAttention", feeds, 3, inputs=inputs, num_heads=2), feeds)


@pytest.mark.parametrize("mask", [None, "2d", "1d", "3d"])
def test_attention(mask):
    feeds = {"x": _rand(2, 3, 6)}
    inits = {"w": _rand(6, 24), "b": _rand(24)}
    inputs = ["x", "w", "b"]
    if mask == "2d":
        feeds["mask"] = np.array([[1, 1, 0], [1, 1, 1]], np.int32)
    elif mask == "1d":
        feeds["mask"] = np.array([2, 3], np.int32)
    elif mask == "3d":
        feeds["mask"] = (rng.random((2, 3, 3)) > 0.3).astype(np.int32)
        feeds["mask"][..., 0] = 1
    if mask:
        inputs.append("mask")
    _compare(_model("Attention", feeds, 1, inits=inits, inputs=inputs, num_heads=2), feeds)


def test_attention_unidirectional_with_past():
    feeds = {"x": _rand(2, 1, 8), "past": _rand(2, 2, 2, 3, 4)}
    inits = {"w": _rand(8, 24), "b": _rand(24)}
    model = _model("Attention", feeds, 2, inits=inits, inputs=["x", "w", "b", "", "past"], num_heads=2,
                   unidirectional=1)
    _compare(model, feeds)


def test_attention_uneven_hidden_sizes():
    feeds = {"x": _rand(2, 3, 6)}
    inits = {"w": _rand(6, 8 + 8 + 12), "b": _rand(28)}
    _compare(_model("Attention", feeds, 1, inits=inits, inputs=["x", "w", "b"], num_heads=2,
                    qkv_hidden_sizes=[8, 8, 12]), feeds)
