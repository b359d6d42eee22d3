"""Attention, RotaryEmbedding, LinearAttention and FlexAttention against plain numpy references written here
(loops over batch, heads and positions) and, where it has the op, onnxruntime."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.errors import InvalidModel

ATTENTION_INPUTS = ["Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen"]
ATTENTION_OUTPUTS = ["Y", "present_key", "present_value", "qk_matmul_output"]


def _model(op: str, input_order: list[str], feed: dict, outputs: list[str], opset: int, domain: str = "",
           **attrs) -> onnx.ModelProto:
    names = [n if feed.get(n) is not None else "" for n in input_order]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op, names, outputs, domain=domain, **attrs)
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(feed[n].dtype), None)
              for n in names if n]
    out_type = helper.np_dtype_to_tensor_dtype(feed[input_order[0]].dtype)
    outs = [helper.make_tensor_value_info(n, out_type, None) for n in outputs if n]
    graph = helper.make_graph([node], "g", inputs, outs)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _carrack(model: onnx.ModelProto, feed: dict) -> list:
    present = {k: v for k, v in feed.items() if v is not None}
    return carrack.InferenceSession(model.SerializeToString()).run(None, present)


def _ort(model: onnx.ModelProto, feed: dict) -> list:
    present = {k: v for k, v in feed.items() if v is not None}
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, present)


# ----------------------------------------------------------------------------------------------- Attention

def reference_attention(q, k, v, mask=None, past_k=None, past_v=None, nonpad=None, scale=None, causal=False,
                        softcap=0.0, left=-1, right=-1, q_heads=None, kv_heads=None):
    """Returns (Y, present_k, present_v, {mode: qk_output}) computed head by head in float64."""
    three_d = q.ndim == 3
    if three_d:
        q = q.reshape(q.shape[0], q.shape[1], q_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(k.shape[0], k.shape[1], kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(v.shape[0], v.shape[1], kv_heads, -1).transpose(0, 2, 1, 3)
    if past_k is not None:
        k, v = np.concatenate([past_k, k], axis=2), np.concatenate([past_v, v], axis=2)
    present_k, present_v = k, v
    b, hq, lq, d = q.shape
    hkv, total = k.shape[1], k.shape[2]
    k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
    scale = 1 / math.sqrt(d) if scale is None else scale
    if mask is not None and mask.shape[-1] < total:
        fill = False if mask.dtype == bool else -np.inf
        mask = np.concatenate([mask, np.full(mask.shape[:-1] + (total - mask.shape[-1],), fill)], axis=-1)
    mask = None if mask is None else np.broadcast_to(mask, (b, hq, lq, total))
    y = np.zeros((b, hq, lq, v.shape[-1]))
    qk = {m: np.zeros((b, hq, lq, total)) for m in range(4)}
    for bi in range(b):
        if past_k is not None:
            offset = past_k.shape[2]
        elif nonpad is not None:
            offset = int(nonpad[bi]) - lq
        else:
            offset = 0
        for h in range(hq):
            s = (q[bi, h].astype(np.float64) @ k[bi, h].astype(np.float64).T) * scale
            qk[0][bi, h] = s
            if softcap:
                s = softcap * np.tanh(s / softcap)
            qk[1][bi, h] = s
            bias = np.zeros((lq, total))
            for i in range(lq):
                for j in range(total):
                    p = i + offset
                    blocked = (causal and j > p) or (nonpad is not None and j >= nonpad[bi])
                    blocked |= (left >= 0 and j < p - left) or (right >= 0 and j > p + right)
                    if mask is not None and mask.dtype == bool:
                        blocked |= not mask[bi, h, i, j]
                    bias[i, j] = -np.inf if blocked else 0.0
            if mask is not None and mask.dtype != bool:
                bias = bias + mask[bi, h]
            s = s + bias
            qk[2][bi, h] = s
            probs = np.zeros_like(s)
            for i in range(lq):
                if np.isfinite(s[i]).any():
                    e = np.exp(s[i] - s[i][np.isfinite(s[i])].max())
                    probs[i] = e / e.sum()
            qk[3][bi, h] = probs
            y[bi, h] = probs @ v[bi, h].astype(np.float64)
    if three_d:
        y = y.transpose(0, 2, 1, 3).reshape(b, lq, -1)
    return y, present_k, present_v, qk


def _attention_feed(rng, b=2, hq=4, hkv=2, lq=3, lkv=5, d=8, dv=8, past=0, three_d=False, dtype=np.float32):
    if three_d:
        feed = {"Q": rng.standard_normal((b, lq, hq * d)), "K": rng.standard_normal((b, lkv, hkv * d)),
                "V": rng.standard_normal((b, lkv, hkv * dv))}
    else:
        feed = {"Q": rng.standard_normal((b, hq, lq, d)), "K": rng.standard_normal((b, hkv, lkv, d)),
                "V": rng.standard_normal((b, hkv, lkv, dv))}
    if past:
        feed["past_key"] = rng.standard_normal((b, hkv, past, d))
        feed["past_value"] = rng.standard_normal((b, hkv, past, dv))
    return {k: v.astype(dtype) for k, v in feed.items()}


def _run_attention(feed, opset=23, outputs=("Y",), **attrs):
    model = _model("Attention", ATTENTION_INPUTS, feed, list(outputs), opset, **attrs)
    return model, _carrack(model, feed)


def _reference(feed, **attrs):
    names = {"scale": "scale", "is_causal": "causal", "softcap": "softcap", "left_window_size": "left",
             "right_window_size": "right", "q_num_heads": "q_heads", "kv_num_heads": "kv_heads"}
    kwargs = {names[k]: v for k, v in attrs.items() if k in names}
    return reference_attention(feed["Q"], feed["K"], feed["V"], feed.get("attn_mask"), feed.get("past_key"),
                               feed.get("past_value"), feed.get("nonpad_kv_seqlen"), **kwargs)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [0, 1])
def test_attention_heads_and_causal_match_reference_and_onnxruntime(hq, hkv, causal):
    feed = _attention_feed(np.random.default_rng(hq * 10 + hkv + causal), hq=hq, hkv=hkv, dv=6)
    model, (y,) = _run_attention(feed, is_causal=causal)
    assert y.dtype == np.float32 and y.shape == (2, hq, 3, 6)
    np.testing.assert_allclose(y, _reference(feed, is_causal=causal)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, _ort(model, feed)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hq,hkv", [(3, 3), (6, 2)])
def test_attention_3d_inputs(hq, hkv):
    feed = _attention_feed(np.random.default_rng(hq), hq=hq, hkv=hkv, three_d=True, dv=4)
    attrs = {"q_num_heads": hq, "kv_num_heads": hkv, "is_causal": 1}
    model, (y,) = _run_attention(feed, **attrs)
    assert y.shape == (2, 3, hq * 4)
    np.testing.assert_allclose(y, _reference(feed, **attrs)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, _ort(model, feed)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask_shape", [(3, 5), (2, 1, 3, 5), (4, 3, 5), (2, 4, 3, 5), (5,)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attention_masks_broadcast(mask_shape, kind):
    rng = np.random.default_rng(len(mask_shape))
    feed = _attention_feed(rng)
    if kind == "bool":
        mask = rng.random(mask_shape) > 0.3
        mask[..., 0] = True  # keep every row attending something
    else:
        mask = rng.standard_normal(mask_shape).astype(np.float32)
    feed["attn_mask"] = mask
    model, (y,) = _run_attention(feed, is_causal=1)
    np.testing.assert_allclose(y, _reference(feed, is_causal=1)[0], rtol=1e-5, atol=1e-6)
    if mask.ndim >= 2:  # onnxruntime rejects 1-D masks
        np.testing.assert_allclose(y, _ort(model, feed)[0], rtol=1e-5, atol=1e-6)


def test_attention_past_and_present_with_bottom_right_causal():
    feed = _attention_feed(np.random.default_rng(7), past=4, dv=6)
    model, (y, pk, pv) = _run_attention(feed, outputs=ATTENTION_OUTPUTS[:3], is_causal=1)
    ref_y, ref_k, ref_v, _ = _reference(feed, is_causal=1)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pk, ref_k)
    np.testing.assert_array_equal(pv, ref_v)
    assert pk.shape == (2, 2, 9, 8) and pv.shape == (2, 2, 9, 6)
    for got, want in zip((y, pk, pv), _ort(model, feed)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_attention_3d_with_past_gives_4d_present():
    feed = _attention_feed(np.random.default_rng(8), three_d=True, past=2)
    attrs = {"q_num_heads": 4, "kv_num_heads": 2}
    _, (y, pk, pv) = _run_attention(feed, outputs=ATTENTION_OUTPUTS[:3], **attrs)
    ref_y, ref_k, ref_v, _ = _reference(feed, **attrs)
    assert y.shape == (2, 3, 32) and pk.shape == (2, 2, 7, 8)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pk, ref_k)
    np.testing.assert_array_equal(pv, ref_v)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_qk_matmul_output_modes(mode):
    rng = np.random.default_rng(mode)
    feed = _attention_feed(rng, past=2)
    feed["attn_mask"] = rng.standard_normal((3, 7)).astype(np.float32)
    attrs = {"qk_matmul_output_mode": mode, "softcap": 1.5, "is_causal": 1, "scale": 0.3}
    model, (y, _, _, qk) = _run_attention(feed, outputs=ATTENTION_OUTPUTS, **attrs)
    ref_y, _, _, ref_qk = _reference(feed, **attrs)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    assert qk.dtype == np.float32 and qk.shape == (2, 4, 3, 7)
    np.testing.assert_allclose(qk, ref_qk[mode], rtol=1e-5, atol=1e-6)
    if mode != 2:  # onnxruntime writes masked mode-2 scores as a large finite negative instead of -inf
        np.testing.assert_allclose(qk, _ort(model, feed)[3], rtol=1e-5, atol=1e-6)


def test_attention_fully_masked_row_is_zero_not_nan():
    feed = _attention_feed(np.random.default_rng(3))
    mask = np.ones((3, 5), bool)
    mask[1] = False
    feed["attn_mask"] = mask
    _, (y, probs) = _run_attention(feed, outputs=["Y", "", "", "qk_matmul_output"], qk_matmul_output_mode=3)
    assert np.isfinite(y).all() and np.isfinite(probs).all()
    np.testing.assert_array_equal(y[:, :, 1], 0)
    np.testing.assert_array_equal(probs[:, :, 1], 0)
    np.testing.assert_allclose(y, _reference(feed)[0], rtol=1e-5, atol=1e-6)


def test_attention_nonpad_kv_seqlen_external_cache():
    rng = np.random.default_rng(11)
    feed = _attention_feed(rng, lq=2, lkv=6)
    feed["nonpad_kv_seqlen"] = np.array([4, 1], dtype=np.int64)  # batch 1: offset -1, its first row is empty
    feed["attn_mask"] = rng.standard_normal((2, 1, 2, 5)).astype(np.float32)  # shorter than K: padded with -inf
    _, (y,) = _run_attention(feed, opset=24, is_causal=1)
    np.testing.assert_allclose(y, _reference(feed, is_causal=1)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[1, :, 0], 0)


def test_attention_nonpad_kv_seqlen_matches_onnxruntime():
    feed = _attention_feed(np.random.default_rng(12), lq=2, lkv=6)
    feed["nonpad_kv_seqlen"] = np.array([4, 3], dtype=np.int64)
    model, (y,) = _run_attention(feed, opset=24, is_causal=1)
    np.testing.assert_allclose(y, _reference(feed, is_causal=1)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, _ort(model, feed)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("left,right,causal", [(2, -1, 1), (1, 2, 0), (0, 0, 0), (-1, 1, 0)])
def test_attention_sliding_window_opset25(left, right, causal):
    feed = _attention_feed(np.random.default_rng(10 + left + 5 * right), lq=4, lkv=3, past=3)
    attrs = {"left_window_size": left, "right_window_size": right, "is_causal": causal}
    _, (y, _, _) = _run_attention(feed, opset=25, outputs=ATTENTION_OUTPUTS[:3], **attrs)
    np.testing.assert_allclose(y, _reference(feed, **attrs)[0], rtol=1e-5, atol=1e-6)


def test_attention_softmax_precision_double_keeps_float32_outputs():
    feed = _attention_feed(np.random.default_rng(5))
    _, (y, _, _, qk) = _run_attention(feed, outputs=ATTENTION_OUTPUTS, softmax_precision=TensorProto.DOUBLE,
                                      qk_matmul_output_mode=3)
    assert y.dtype == np.float32 and qk.dtype == np.float32
    ref_y, _, _, ref_qk = _reference(feed)
    np.testing.assert_allclose(y, ref_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(qk, ref_qk[3], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_attention_other_float_types(dtype):
    feed = _attention_feed(np.random.default_rng(2), dtype=dtype, past=2)
    model, (y, pk, _) = _run_attention(feed, outputs=ATTENTION_OUTPUTS[:3], is_causal=1)
    assert y.dtype == dtype and pk.dtype == dtype
    tol = 2e-3 if dtype == np.float16 else 1e-10
    np.testing.assert_allclose(y, _reference(feed, is_causal=1)[0], rtol=tol, atol=tol)
    if dtype == np.float16:
        np.testing.assert_allclose(y, _ort(model, feed)[0], rtol=tol, atol=tol)


def test_attention_bfloat16():
    import ml_dtypes

    feed = _attention_feed(np.random.default_rng(4), dtype=ml_dtypes.bfloat16)
    _, (y,) = _run_attention(feed, is_causal=1)
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(y.astype(np.float32), _reference(feed, is_causal=1)[0], rtol=3e-2, atol=3e-2)


def test_attention_rejects_bad_qk_mode():
    feed = _attention_feed(np.random.default_rng(0))
    with pytest.raises(InvalidModel, match="qk_matmul_output_mode"):
        _run_attention(feed, qk_matmul_output_mode=4)


# ----------------------------------------------------------------------------------------- RotaryEmbedding

def reference_rotary(x, cos, sin, position_ids=None, interleaved=0, rotary_dim=0, num_heads=0):
    shape = x.shape
    x = x.reshape(shape[0], shape[1], num_heads, -1) if x.ndim == 3 else x.transpose(0, 2, 1, 3)  # [B, S, H, D]
    out = x.astype(np.float64).copy()
    dim = rotary_dim or x.shape[-1]
    for bi in range(x.shape[0]):
        for s in range(x.shape[1]):
            pos = position_ids[bi, s] if position_ids is not None else None
            c = cos[pos] if pos is not None else cos[bi, s]
            n = sin[pos] if pos is not None else sin[bi, s]
            for m in range(dim // 2):
                i, j = (2 * m, 2 * m + 1) if interleaved else (m, m + dim // 2)
                a, b = x[bi, s, :, i], x[bi, s, :, j]
                out[bi, s, :, i] = c[m] * a - n[m] * b
                out[bi, s, :, j] = n[m] * a + c[m] * b
    return out.reshape(shape) if len(shape) == 3 else out.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 4])
@pytest.mark.parametrize("with_ids", [True, False])
@pytest.mark.parametrize("three_d", [False, True])
def test_rotary_embedding(interleaved, rotary_dim, with_ids, three_d):
    rng = np.random.default_rng(interleaved + 2 * rotary_dim + 3 * with_ids)
    b, h, s, d = 2, 3, 5, 8
    half = (rotary_dim or d) // 2
    x = rng.standard_normal((b, s, h * d) if three_d else (b, h, s, d)).astype(np.float32)
    cache_shape = (11, half) if with_ids else (b, s, half)
    angles = rng.uniform(0, 6, cache_shape)
    feed = {"X": x, "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32),
            "position_ids": rng.integers(0, 11, (b, s)) if with_ids else None}
    attrs = {"interleaved": interleaved, "rotary_embedding_dim": rotary_dim}
    if three_d:
        attrs["num_heads"] = h
    model = _model("RotaryEmbedding", ["X", "cos", "sin", "position_ids"], feed, ["Y"], 23, **attrs)
    (y,) = _carrack(model, feed)
    assert y.dtype == np.float32 and y.shape == x.shape
    ref = reference_rotary(x, feed["cos"], feed["sin"], feed["position_ids"], interleaved, rotary_dim, h)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, _ort(model, feed)[0], rtol=1e-5, atol=1e-6)


def test_rotary_embedding_float16():
    rng = np.random.default_rng(9)
    angles = rng.uniform(0, 6, (6, 4))
    feed = {"X": rng.standard_normal((1, 2, 3, 8)).astype(np.float16), "cos": np.cos(angles).astype(np.float16),
            "sin": np.sin(angles).astype(np.float16), "position_ids": np.array([[5, 0, 2]])}
    model = _model("RotaryEmbedding", ["X", "cos", "sin", "position_ids"], feed, ["Y"], 23)
    (y,) = _carrack(model, feed)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, _ort(model, feed)[0], rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------------------- LinearAttention

def reference_linear_attention(q, k, v, state, decay, beta, rule, hq, hkv, scale=0.0):
    b, t, _ = q.shape
    dk, dv = q.shape[-1] // hq, v.shape[-1] // hkv
    scale = scale or 1 / math.sqrt(dk)
    q = q.reshape(b, t, hq, dk).astype(np.float64)
    k = k.reshape(b, t, hkv, dk).astype(np.float64)
    v = v.reshape(b, t, hkv, dv).astype(np.float64)
    state = np.zeros((b, hkv, dk, dv)) if state is None else state.astype(np.float64).copy()
    out = np.zeros((b, t, hq, dv))
    for bi in range(b):
        for h in range(hkv):
            s = state[bi, h]
            for ti in range(t):
                if rule in ("gated", "gated_delta"):
                    g = decay.reshape(b, t, hkv, -1)[bi, ti, h]
                    s = np.exp(g)[:, None] * s
                kv = np.outer(k[bi, ti, h], v[bi, ti, h])
                if rule in ("delta", "gated_delta"):
                    r = beta.reshape(b, t, -1)[bi, ti]
                    r = r[h] if r.size > 1 else r[0]
                    kv = r * np.outer(k[bi, ti, h], v[bi, ti, h] - s.T @ k[bi, ti, h])
                s = s + kv
                for qh in range(h * hq // hkv, (h + 1) * hq // hkv):
                    out[bi, ti, qh] = scale * q[bi, ti, qh] @ s
            state[bi, h] = s
    return out.reshape(b, t, hq * dv), state


def _linear_feed(rng, rule, b=2, t=5, hq=4, hkv=2, dk=4, dv=3, past=False, per_head_decay=False, beta1=False):
    key = rng.standard_normal((b, t, hkv, dk))
    key /= np.linalg.norm(key, axis=-1, keepdims=True)
    feed = {"query": rng.standard_normal((b, t, hq * dk)), "key": key.reshape(b, t, hkv * dk),
            "value": rng.standard_normal((b, t, hkv * dv)),
            "past_state": rng.standard_normal((b, hkv, dk, dv)) if past else None, "decay": None, "beta": None}
    if rule in ("gated", "gated_delta"):
        feed["decay"] = -rng.uniform(0.01, 0.5, (b, t, hkv if per_head_decay else hkv * dk))
    if rule in ("delta", "gated_delta"):
        feed["beta"] = rng.uniform(0.1, 0.9, (b, t, 1 if beta1 else hkv))
    return {n: None if x is None else x.astype(np.float32) for n, x in feed.items()}


LINEAR_INPUTS = ["query", "key", "value", "past_state", "decay", "beta"]


@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
@pytest.mark.parametrize("past", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 1), (2, 2)])
def test_linear_attention_rules(rule, past, hq, hkv):
    rng = np.random.default_rng(hq + 7 * hkv + past)
    feed = _linear_feed(rng, rule, hq=hq, hkv=hkv, past=past, per_head_decay=hq == 3, beta1=hq == 2)
    model = _model("LinearAttention", LINEAR_INPUTS, feed, ["output", "present_state"], 27,
                   q_num_heads=hq, kv_num_heads=hkv, update_rule=rule)
    out, state = _carrack(model, feed)
    ref_out, ref_state = reference_linear_attention(*(feed[n] for n in LINEAR_INPUTS), rule, hq, hkv)
    assert out.dtype == np.float32 and state.dtype == np.float32
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, ref_state, rtol=1e-5, atol=1e-5)


def test_linear_attention_prefill_equals_chained_decode_steps():
    rng = np.random.default_rng(21)
    feed = _linear_feed(rng, "gated_delta", t=4, past=True)
    attrs = {"q_num_heads": 4, "kv_num_heads": 2, "scale": 0.7}
    model = _model("LinearAttention", LINEAR_INPUTS, feed, ["output", "present_state"], 27, **attrs)
    full, final = _carrack(model, feed)
    state = feed["past_state"]
    for t in range(4):
        step = {n: None if x is None or n == "past_state" else x[:, t:t + 1] for n, x in feed.items()}
        step["past_state"] = state
        out, state = _carrack(model, step)
        np.testing.assert_allclose(out, full[:, t:t + 1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, final, rtol=1e-5, atol=1e-6)


def test_linear_attention_rejects_unknown_rule():
    feed = _linear_feed(np.random.default_rng(0), "linear")
    model = _model("LinearAttention", LINEAR_INPUTS, feed, ["output", "present_state"], 27,
                   q_num_heads=4, kv_num_heads=2, update_rule="softmax")
    with pytest.raises(InvalidModel, match="update_rule"):
        _carrack(model, feed)


# ------------------------------------------------------------------------------------------ FlexAttention

def _causal_score_mod() -> onnx.GraphProto:
    """scores -> where(q_idx >= k_idx, scores + rel_bias, -inf); rel_bias is read from the outer graph."""
    nodes = [
        helper.make_node("Shape", ["scores"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["L"], axis=0),
        helper.make_node("Gather", ["shape", "three"], ["S"], axis=0),
        helper.make_node("Range", ["zero", "L", "one"], ["qr"]),
        helper.make_node("Range", ["zero", "S", "one"], ["kr"]),
        helper.make_node("Unsqueeze", ["qr", "one_axis"], ["qi"]),
        helper.make_node("GreaterOrEqual", ["qi", "kr"], ["keep"]),
        helper.make_node("Add", ["scores", "rel_bias"], ["biased"]),
        helper.make_node("Where", ["keep", "biased", "neg_inf"], ["scores_out"]),
    ]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [], [0]), helper.make_tensor("one", TensorProto.INT64,
             [], [1]), helper.make_tensor("two", TensorProto.INT64, [], [2]),
             helper.make_tensor("three", TensorProto.INT64, [], [3]),
             helper.make_tensor("one_axis", TensorProto.INT64, [1], [1]),
             helper.make_tensor("neg_inf", TensorProto.FLOAT, [], [-np.inf])]
    return helper.make_graph(nodes, "score_mod", [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)],
                             [helper.make_tensor_value_info("scores_out", TensorProto.FLOAT, None)], inits)


def _flex_model(feed, score_mod=None, prob_mod=None, rel_bias=None, **attrs) -> onnx.ModelProto:
    node_attrs = dict(attrs)
    if score_mod is not None:
        node_attrs["score_mod"] = score_mod
    if prob_mod is not None:
        node_attrs["prob_mod"] = prob_mod
    node = helper.make_node("FlexAttention", ["Q", "K", "V"], ["Y"], domain="ai.onnx.preview", **node_attrs)
    dtype = helper.np_dtype_to_tensor_dtype(feed["Q"].dtype)
    inputs = [helper.make_tensor_value_info(n, dtype, None) for n in "QKV"]
    inits = [] if rel_bias is None else [helper.make_tensor("rel_bias", TensorProto.FLOAT, rel_bias.shape,
                                                            rel_bias.ravel())]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("Y", dtype, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                   helper.make_opsetid("ai.onnx.preview", 1)], ir_version=10)


def test_flex_attention_gqa_with_score_mod_reading_outer_scope():
    rng = np.random.default_rng(1)
    feed = {"Q": rng.standard_normal((2, 4, 5, 8)), "K": rng.standard_normal((2, 2, 5, 8)),
            "V": rng.standard_normal((2, 2, 5, 6))}
    feed = {k: v.astype(np.float32) for k, v in feed.items()}
    rel_bias = rng.standard_normal((5, 5)).astype(np.float32)
    (y,) = _carrack(_flex_model(feed, _causal_score_mod(), rel_bias=rel_bias, scale=0.25), feed)
    mask = np.where(np.tril(np.ones((5, 5), bool)), rel_bias, -np.inf)
    expected = reference_attention(feed["Q"], feed["K"], feed["V"], mask=mask, scale=0.25)[0]
    assert y.dtype == np.float32 and y.shape == (2, 4, 5, 6)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_flex_attention_prob_mod_and_double():
    rng = np.random.default_rng(2)
    feed = {n: rng.standard_normal((1, 2, 3, 4)) for n in "QKV"}
    prob_mod = helper.make_graph([helper.make_node("Mul", ["p", "half"], ["p_out"])], "prob_mod",
                                 [helper.make_tensor_value_info("p", TensorProto.DOUBLE, None)],
                                 [helper.make_tensor_value_info("p_out", TensorProto.DOUBLE, None)],
                                 [helper.make_tensor("half", TensorProto.DOUBLE, [], [0.5])])
    (y,) = _carrack(_flex_model(feed, prob_mod=prob_mod), feed)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, 0.5 * reference_attention(feed["Q"], feed["K"], feed["V"])[0], rtol=1e-12)


def test_flex_attention_float16_uses_float32_softmax():
    rng = np.random.default_rng(3)
    feed = {n: rng.standard_normal((1, 2, 4, 8)).astype(np.float16) for n in "QKV"}
    (y,) = _carrack(_flex_model(feed), feed)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, reference_attention(feed["Q"], feed["K"], feed["V"])[0], rtol=3e-3, atol=3e-3)
