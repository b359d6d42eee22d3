"""com.microsoft DecoderMaskedMultiHeadAttention (the decoding step of onnxruntime's beam search graphs) against
onnxruntime: self attention over a shared max-length cache (onnxruntime's CPU kernel requires it), with beam search
cache indirection, and cross attention over (B, N, L, H) caches, each with its attribute and input variants."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import carrack

ort = pytest.importorskip("onnxruntime")
HEADS, HEAD = 2, 8
HIDDEN = HEADS * HEAD
PAST, CAPACITY, CROSS_LENGTH = 3, 6, 5


def _model(kind: str, mask=False, attention_bias=False, bias=False, scale=0.0, beams=1, shared=True):
    rng = np.random.default_rng(7)
    batch = 2 * beams
    feeds, names = {}, []

    def add(name, value):
        names.append(name if value is not None else "")
        if value is not None:
            feeds[name] = value

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    add("query", rand(batch, 1, HIDDEN))
    if kind == "cross":
        add("key", rand(batch, HEADS, CROSS_LENGTH, HEAD))
        add("value", rand(batch, HEADS, CROSS_LENGTH, HEAD))
    else:
        add("key", rand(batch, 1, HIDDEN))
        add("value", rand(batch, 1, HIDDEN))
    total = CROSS_LENGTH if kind == "cross" else PAST + 1
    add("mask_index", (rng.random((batch, total)) > 0.3).astype(np.int32) if mask else None)
    add("attention_bias", rand(batch, HEADS, 1, total) if attention_bias else None)
    cache = CAPACITY if shared else PAST
    add("past_key", None if kind == "cross" else rand(batch, HEADS, cache, HEAD))
    add("past_value", None if kind == "cross" else rand(batch, HEADS, cache, HEAD))
    add("past_sequence_length", np.array(PAST, np.int32) if kind == "self" and shared else None)
    add("beam_width", np.array(beams, np.int32) if beams > 1 else None)
    add("cache_indirection", rng.integers(0, beams, (2, beams, CAPACITY)).astype(np.int32) if beams > 1 else None)
    add("bias", rand(3 * HIDDEN) if bias else None)
    while not names[-1]:
        names.pop()
    outputs = ["output"] + ([] if kind == "cross" else ["present_key", "present_value"])
    node = helper.make_node("DecoderMaskedMultiHeadAttention", names, outputs, domain="com.microsoft",
                            num_heads=HEADS, scale=scale, past_present_share_buffer=int(kind == "self" and shared))
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), None) for k, v in feeds.items()],
        [onnx.ValueInfoProto(name=o) for o in outputs])
    model = helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17),
                                                                  helper.make_opsetid("com.microsoft", 1)])
    return model, feeds


VARIANTS = {"plain": {}, "mask": {"mask": True}, "attention_bias": {"attention_bias": True},
            "projection_bias": {"bias": True}, "scale": {"scale": 0.3}, "beam_search": {"beams": 2},
            "beam_search_mask": {"beams": 2, "mask": True}}
CASES = [("self", v) for v in VARIANTS] + [("cross", v) for v in ("plain", "mask", "projection_bias", "scale")]


@pytest.mark.parametrize("kind, variant", CASES)
def test_decoder_masked_multi_head_attention(kind, variant):
    model, feeds = _model(kind, **VARIANTS[variant])
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = carrack.InferenceSession(model).run(None, feeds)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_own_cache_matches_the_shared_buffer():
    """Without past_present_share_buffer (which onnxruntime's CPU kernel rejects) the present caches grow by one
    row: the same attention and the same rows as the shared buffer holds."""
    shared_model, shared_feeds = _model("self", mask=True)
    own_model, own_feeds = _model("self", mask=True, shared=False)
    own_feeds["past_key"] = shared_feeds["past_key"][:, :, :PAST]
    own_feeds["past_value"] = shared_feeds["past_value"][:, :, :PAST]
    for name in ("query", "key", "value", "mask_index"):
        own_feeds[name] = shared_feeds[name]
    shared = carrack.InferenceSession(shared_model).run(None, shared_feeds)
    own = carrack.InferenceSession(own_model).run(None, own_feeds)
    np.testing.assert_allclose(own[0], shared[0], rtol=1e-6)
    np.testing.assert_array_equal(own[1], shared[1][:, :, :PAST + 1])
