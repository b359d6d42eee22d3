"""MultiHeadAttention's per-head path (a decoder's query row against its cache, run unbound because the cache grows
every token): the same bits as its general path, close to onnxruntime, taken only where it applies."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.ops import contrib

ort = pytest.importorskip("onnxruntime")
BATCH, HEADS, HEAD, SEQ = 2, 4, 8, 3


def _model(bias_shape: tuple | None, causal: int = 0) -> onnx.ModelProto:
    """q (B, S, D), per-head k/v (B, N, L, H) and an additive bias -> MultiHeadAttention -> Neg (so the attention's
    result is an intermediate placed in the arena and written by run_into)."""
    names = ["q", "k", "v", "", "", "bias" if bias_shape else ""]
    while not names[-1]:
        names.pop()
    nodes = [helper.make_node("MultiHeadAttention", names, ["a"], domain="com.microsoft", num_heads=HEADS,
                              unidirectional=causal),
             helper.make_node("Neg", ["a"], ["y"])]
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["b", "s", HEADS * HEAD]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, ["b", HEADS, "l", HEAD]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, ["b", HEADS, "l", HEAD])]
    if bias_shape:
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, list(bias_shape)))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def _feed(rng, length: int, bias_shape: tuple | None) -> dict:
    feed = {"q": rng.standard_normal((BATCH, SEQ, HEADS * HEAD)).astype(np.float32),
            "k": rng.standard_normal((BATCH, HEADS, length, HEAD)).astype(np.float32),
            "v": rng.standard_normal((BATCH, HEADS, length, HEAD)).astype(np.float32)}
    if bias_shape:
        shape = tuple(length if d == "l" else d for d in bias_shape)
        bias = rng.standard_normal(shape).astype(np.float32)
        bias[..., 0] = -np.inf  # a masked key
        feed["bias"] = bias
    return feed


@pytest.mark.skipif(contrib.rowops.library() is None, reason="native row kernels unavailable")
@pytest.mark.parametrize("bias_shape", [None, (1, 1, SEQ, "l"), (BATCH, HEADS, SEQ, "l"), (BATCH, 1, SEQ, "l")],
                         ids=["none", "row", "full", "per-batch"])
def test_per_head_path_gives_the_general_path_s_bits(monkeypatch, bias_shape):
    model = _model(bias_shape).SerializeToString()
    taken = []
    per_head = contrib.MultiHeadAttention._per_head_into

    def counted(self, *args):
        result = per_head(self, *args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(contrib.MultiHeadAttention, "_per_head_into", counted)
    session = carrack.InferenceSession(model)
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = [_feed(rng, length, bias_shape) for length in (5, 6, 9, 6)]  # a growing cache, and back
    got = [session.run(None, feed)[0] for feed in feeds]
    assert taken and all(taken)
    monkeypatch.setattr(contrib.MultiHeadAttention, "_per_head_into", lambda self, *args: None)
    general = carrack.InferenceSession(model)
    for feed, result in zip(feeds, got):
        np.testing.assert_array_equal(result, general.run(None, feed)[0])
        np.testing.assert_allclose(result, reference.run(None, feed)[0], rtol=1e-5, atol=1e-5)


def test_a_causal_attention_takes_the_general_path(monkeypatch):
    session = carrack.InferenceSession(_model(None, causal=1).SerializeToString())
    monkeypatch.setattr(contrib.MultiHeadAttention, "_per_head_into",
                        lambda self, *args: pytest.fail("the per-head path has no causal mask"))
    feed = _feed(np.random.default_rng(1), SEQ, None)  # keys = queries: both engines mask the same future
    result = session.run(None, feed)[0]
    reference = ort.InferenceSession(_model(None, causal=1).SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(result, reference.run(None, feed)[0], rtol=1e-5, atol=1e-5)
