"""com.microsoft GroupQueryAttention against onnxruntime: prompts (right-padded entries), decoding from a cache,
a shared (max-length) cache buffer and multi-token continuations, each with the op's attribute variants. (No
exporter in this environment emits it: onnxruntime's optimizer fuses it for Phi and Qwen3 graphs whose patterns
current transformers exports no longer match, so the nodes are built directly.)"""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import pytest
from onnx import helper

import carrack

ort = pytest.importorskip("onnxruntime")
HEADS, KV_HEADS, HEAD = 4, 2, 16  # onnxruntime's rotary path wants head sizes in multiples of 16

#: (batch, new tokens, past buffer length or None, seqlens_k, total_sequence_length)
SCENARIOS = {"prompt": (2, 5, None, [4, 2], 5), "prompt_empty_past": (2, 5, 0, [4, 2], 5),
             "decode": (2, 1, 4, [4, 2], 5), "shared_buffer": (2, 1, 8, [4, 2], 5), "continue": (1, 2, 3, [4], 5)}
VARIANTS = {
    "plain": {}, "packed_qkv": {"packed": True}, "as_many_kv_heads": {"kv_heads": 4}, "rotary": {"rotary": True},
    "rotary_interleaved": {"rotary": True, "interleaved": True}, "local_window": {"window": 2},
    "softcap": {"softcap": 2.0}, "smooth_softmax": {"smooth": 1}, "head_sink": {"sink": True},
    "attention_bias": {"bias": True}, "scale": {"scale": 0.3}, "qk_before_softmax": {"qk": 1},
    "qk_after_softmax": {"qk": 2}, "float16": {"dtype": np.float16},
    "float16_packed_rotary": {"rotary": True, "dtype": np.float16, "packed": True},
    "rotary_position_ids": {"rotary": True, "position_ids": True},
}


def _case(scenario: str, packed=False, rotary=False, interleaved=False, window=-1, softcap=0.0, smooth=0,
          sink=False, bias=False, scale=0.0, qk=0, dtype=np.float32, kv_heads=KV_HEADS, position_ids=False):
    rng = np.random.default_rng(zlib.crc32(repr((scenario, packed, rotary, window, qk, kv_heads)).encode()))
    batch, seq, past, seqlens, total = SCENARIOS[scenario]
    feeds, names = {}, []

    def add(name: str, value: np.ndarray | None) -> None:
        names.append(name if value is not None else "")
        if value is not None:
            feeds[name] = value

    def rand(*shape):
        return rng.standard_normal(shape).astype(dtype)

    if packed:
        add("query", rand(batch, seq, (HEADS + 2 * kv_heads) * HEAD))
        add("key", None)
        add("value", None)
    else:
        add("query", rand(batch, seq, HEADS * HEAD))
        add("key", rand(batch, seq, kv_heads * HEAD))
        add("value", rand(batch, seq, kv_heads * HEAD))
    add("past_key", None if past is None else rand(batch, kv_heads, past, HEAD))
    add("past_value", None if past is None else rand(batch, kv_heads, past, HEAD))
    add("seqlens_k", np.array(seqlens, np.int32))
    add("total_sequence_length", np.array(total, np.int32))
    add("cos_cache", rand(16, HEAD // 2) if rotary else None)
    add("sin_cache", rand(16, HEAD // 2) if rotary else None)
    positions = (np.array(seqlens)[:, None] + 1 - seq + np.arange(seq)[None, :]) if position_ids else None
    add("position_ids", None if positions is None else positions.astype(np.int64))
    add("attention_bias", rand(batch, 1, seq, total) if bias else None)
    add("head_sink", rand(HEADS) if sink else None)
    while not names[-1]:
        names.pop()
    outputs = ["output", "present_key", "present_value"] + (["qk"] if qk else [])
    node = helper.make_node("GroupQueryAttention", names, outputs, domain="com.microsoft", num_heads=HEADS,
                            kv_num_heads=kv_heads, do_rotary=int(rotary), rotary_interleaved=int(interleaved),
                            local_window_size=window, softcap=softcap, smooth_softmax=smooth, scale=scale,
                            qk_output=qk)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), None) for k, v in feeds.items()],
        [onnx.ValueInfoProto(name=o) for o in outputs])
    model = helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17),
                                                                  helper.make_opsetid("com.microsoft", 1)])
    return model, feeds, seqlens


def _specified(values: np.ndarray, index: int, seqlens: list[int], prompt: bool) -> np.ndarray:
    """What onnxruntime specifies of an output: padded query rows of a prompt, cache rows past an entry's length
    and the scores of padded rows are unspecified (zeroed here on both sides)."""
    values = values.astype(np.float32)
    for b, last in enumerate(seqlens):
        if index == 0 and prompt:
            values[b, last + 1:] = 0
        if index in (1, 2):
            values[b, :, last + 1:] = 0
        if index == 3 and prompt:
            values[b, :, last + 1:] = 0
    return values


# position_ids are read only after the first prompt
CASES = [(s, v) for s in SCENARIOS for v in VARIANTS if not (v == "rotary_position_ids" and s.startswith("prompt"))]


@pytest.mark.parametrize("scenario, variant", CASES)
def test_group_query_attention(scenario, variant):
    options = VARIANTS[variant]
    model, feeds, seqlens = _case(scenario, **options)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = carrack.InferenceSession(model).run(None, feeds)
    tol = 2e-2 if options.get("dtype") is np.float16 else 1e-4
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype and g.shape == e.shape, (i, g.shape, e.shape)
        prompt = scenario.startswith("prompt")
        np.testing.assert_allclose(_specified(g, i, seqlens, prompt), _specified(e, i, seqlens, prompt), rtol=tol,
                                   atol=tol)


def test_group_query_attention_rejects_unsupported_caches():
    model, _, _ = _case("decode")
    model.graph.node[0].attribute.append(helper.make_attribute("k_quant_type", "PER_TENSOR"))
    with pytest.raises(carrack.errors.CarrackError, match="quantized caches"):
        carrack.InferenceSession(model)
