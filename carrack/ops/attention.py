"""Attention kernels: Attention, RotaryEmbedding, LinearAttention, and FlexAttention (ai.onnx.preview).

Multi-head tensors are handled as [batch, heads, sequence, head_size]. Grouped-query attention never copies
K/V per query head: the query heads that share a K/V head are folded into the sequence axis of one batched
matmul (see `grouped_matmul`).
"""

from __future__ import annotations

import math

import numpy as np

from carrack.ir.dtypes import to_numpy
from carrack.ops.registry import Kernel, register


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """[B, L, H*D] -> [B, H, L, D] (a view)."""
    b, length, hidden = x.shape
    if heads <= 0 or hidden % heads:
        raise ValueError(f"hidden size {hidden} is not a multiple of the number of heads ({heads})")
    return x.reshape(b, length, heads, hidden // heads).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """[B, H, L, D] -> [B, L, H*D]."""
    b, h, length, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, length, h * d)


def grouped_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a[B, Hq, L, X] @ b[B, Hkv, X, Y] -> [B, Hq, L, Y], query head h reading K/V head h // (Hq / Hkv)."""
    batch, hq, length, x = a.shape
    hkv = b.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    if hq == hkv:
        return np.matmul(a, b)
    out = np.matmul(a.reshape(batch, hkv, hq // hkv * length, x), b)
    return out.reshape(batch, hq, length, out.shape[-1])


def masked_softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, stable; a row whose every score is -inf gives zeros, not NaN."""
    peak = scores.max(axis=-1, keepdims=True)
    peak = np.where(np.isneginf(peak), 0, peak).astype(scores.dtype, copy=False)
    e = np.exp(scores - peak)
    total = e.sum(axis=-1, keepdims=True)
    return e / np.where(total == 0, 1, total).astype(scores.dtype, copy=False)


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Grouped batched matmul, rounded to a's dtype; float16 runs through float32 (numpy's float16 matmul has
    no BLAS path), bfloat16 already does in ml_dtypes."""
    if a.dtype == np.float16:
        return grouped_matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return grouped_matmul(a, b).astype(a.dtype, copy=False)


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """float16/bfloat16 recurrences run in float32 (states accumulate over many steps)."""
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def _softmax_precision(kernel: Kernel) -> np.dtype | None:
    """The softmax_precision attribute as a numpy dtype (None when absent)."""
    code = kernel.attr("softmax_precision")
    if code is None:
        return None
    try:
        dtype = to_numpy(code)
    except ValueError:
        dtype = None
    if dtype is None or dtype.kind != "f" and dtype.name != "bfloat16":
        kernel.fail(f"softmax_precision {code} is not a floating-point element type")
    return dtype


@register("Attention", since=23)
class Attention(Kernel):
    def setup(self):
        self.q_heads = self.attr("q_num_heads")
        self.kv_heads = self.attr("kv_num_heads")
        self.scale = self.attr("scale")
        self.softcap = float(self.attr("softcap", 0.0))
        self.is_causal = bool(self.attr("is_causal", 0))
        self.qk_mode = int(self.attr("qk_matmul_output_mode", 0))
        if self.qk_mode not in (0, 1, 2, 3):
            self.fail(f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {self.qk_mode}")
        self.softmax_dtype = _softmax_precision(self)
        self.left_window = int(self.attr("left_window_size", -1))
        self.right_window = int(self.attr("right_window_size", -1))
        outs = self.node.outputs
        self.wants_qk = len(outs) > 3 and bool(outs[3])

    def _to_4d(self, x: np.ndarray, heads: int | None, what: str) -> np.ndarray:
        if x.ndim == 4:
            return x
        if x.ndim != 3:
            raise ValueError(f"{what} must be 3-D or 4-D, got shape {x.shape}")
        if not heads:
            raise ValueError(f"{what} is 3-D, so the node needs its num_heads attribute")
        return split_heads(x, heads)

    def run(self, q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None):
        # Each stage's result is rounded to the input precision, as the spec's dataflow (and its softmax "in the
        # precision of Q and K" unless softmax_precision says otherwise) prescribes.
        dtype = q.dtype
        q4 = self._to_4d(q, self.q_heads, "Q")
        k4 = self._to_4d(k, self.kv_heads, "K")
        v4 = self._to_4d(v, self.kv_heads, "V")
        past_len = 0
        if past_key is not None:
            past_len = past_key.shape[2]
            k4 = np.concatenate([past_key, k4], axis=2)
        if past_value is not None:
            v4 = np.concatenate([past_value, v4], axis=2)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q4.shape[-1])
        root = math.sqrt(scale)
        scores = _matmul(q4 * root, (k4 * root).swapaxes(-1, -2))
        qk = scores if self.qk_mode == 0 else None
        if self.softcap > 0:
            scores = self.softcap * np.tanh(scores / self.softcap)
        if self.qk_mode == 1:
            qk = scores
        scores = self._apply_bias(scores, attn_mask, past_key is not None, past_len, nonpad_kv_seqlen)
        if self.qk_mode == 2:
            qk = scores
        probs = masked_softmax(scores.astype(self.softmax_dtype or dtype, copy=False)).astype(dtype, copy=False)
        if self.qk_mode == 3:
            qk = probs
        y = _matmul(probs.astype(v4.dtype, copy=False), v4).astype(dtype, copy=False)
        if q.ndim == 3:
            y = merge_heads(y)
        return y, k4, v4, qk if self.wants_qk else None

    def _apply_bias(self, scores, attn_mask, has_past, past_len, nonpad):
        """Adds the float mask, then sets every disallowed position (bool mask, causal, padding, window) to -inf."""
        lq, total = scores.shape[-2:]
        allowed = None
        if attn_mask is not None:
            if attn_mask.dtype == np.bool_:
                allowed = _pad_keys(attn_mask, total)
            else:
                scores = scores + _pad_keys(attn_mask.astype(scores.dtype, copy=False), total)
        structural = self._structural_mask(lq, total, has_past, past_len, nonpad)
        if structural is not None:
            allowed = structural if allowed is None else allowed & structural
        if allowed is None:
            return scores
        return np.where(allowed, scores, scores.dtype.type(-np.inf))

    def _structural_mask(self, lq, total, has_past, past_len, nonpad):
        """Keys allowed by is_causal, nonpad_kv_seqlen and the sliding window: [B or 1, 1, Lq, S], or None."""
        windowed = self.left_window >= 0 or self.right_window >= 0
        if not (self.is_causal or windowed or nonpad is not None):
            return None
        keys = np.arange(total)
        if has_past:
            offset = np.array(past_len).reshape(1, 1, 1, 1)
        elif nonpad is not None:
            offset = np.asarray(nonpad, dtype=np.int64).reshape(-1, 1, 1, 1) - lq
        else:
            offset = np.zeros((1, 1, 1, 1), dtype=np.int64)
        position = offset + np.arange(lq).reshape(1, 1, lq, 1)  # absolute position of each query
        allowed = np.ones((1, 1, 1, total), dtype=bool)
        if nonpad is not None:
            allowed = keys < np.asarray(nonpad, dtype=np.int64).reshape(-1, 1, 1, 1)
        if self.is_causal:
            allowed = allowed & (keys <= position)
        if self.left_window >= 0:
            allowed = allowed & (keys >= position - self.left_window)
        if self.right_window >= 0:
            allowed = allowed & (keys <= position + self.right_window)
        return allowed


def _pad_keys(mask: np.ndarray, total: int) -> np.ndarray:
    """A mask whose key axis is shorter than the total sequence is padded with 'not allowed' (False / -inf)."""
    short = total - mask.shape[-1]
    if short <= 0 or mask.shape[-1] == 1:
        return mask
    fill = False if mask.dtype == np.bool_ else -np.inf
    widths = [(0, 0)] * (mask.ndim - 1) + [(0, short)]
    return np.pad(mask, widths, constant_values=fill)


@register("RotaryEmbedding", since=23)
class RotaryEmbedding(Kernel):
    def setup(self):
        self.interleaved = bool(self.attr("interleaved", 0))
        self.rotary_dim = int(self.attr("rotary_embedding_dim", 0))
        self.num_heads = int(self.attr("num_heads", 0))

    def run(self, x, cos_cache, sin_cache, position_ids=None):
        # Work as [B, S, H, D] for 3-D input and [B, H, S, D] for 4-D; cos/sin become [B, S, 1, R/2] or [B, 1, S, R/2].
        if x.ndim == 3:
            if not self.num_heads:
                raise ValueError("RotaryEmbedding with 3-D input needs the num_heads attribute")
            b, s, hidden = x.shape
            if hidden % self.num_heads:
                raise ValueError(f"hidden size {hidden} is not a multiple of num_heads ({self.num_heads})")
            xh = x.reshape(b, s, self.num_heads, hidden // self.num_heads)
            head_axis = 2
        elif x.ndim == 4:
            xh, head_axis = x, 1
        else:
            raise ValueError(f"RotaryEmbedding input must be 3-D or 4-D, got shape {x.shape}")
        head_size = xh.shape[-1]
        dim = self.rotary_dim or head_size
        if dim % 2 or dim > head_size:
            raise ValueError(f"rotary_embedding_dim {dim} must be even and at most the head size {head_size}")
        if position_ids is not None:
            cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
        if cos_cache.shape[-1] != dim // 2 or sin_cache.shape[-1] != dim // 2:
            raise ValueError(f"cos/sin caches' last dimension must be rotary_embedding_dim / 2 = {dim // 2}, "
                             f"got {cos_cache.shape[-1]} and {sin_cache.shape[-1]}")
        cos = np.expand_dims(cos_cache, head_axis).astype(x.dtype, copy=False)
        sin = np.expand_dims(sin_cache, head_axis).astype(x.dtype, copy=False)
        rotate = xh[..., :dim]
        if self.interleaved:
            x1, x2 = rotate[..., 0::2], rotate[..., 1::2]
        else:
            x1, x2 = rotate[..., : dim // 2], rotate[..., dim // 2:]
        real = cos * x1 - sin * x2
        imag = sin * x1 + cos * x2
        out = np.empty_like(xh)
        if self.interleaved:
            out[..., 0:dim:2], out[..., 1:dim:2] = real, imag
        else:
            out[..., : dim // 2], out[..., dim // 2: dim] = real, imag
        out[..., dim:] = xh[..., dim:]
        return out.reshape(x.shape)


@register("LinearAttention", since=27)
class LinearAttention(Kernel):
    RULES = ("linear", "gated", "delta", "gated_delta")

    def setup(self):
        self.q_heads = int(self.required_attr("q_num_heads"))
        self.kv_heads = int(self.required_attr("kv_num_heads"))
        if self.q_heads <= 0 or self.kv_heads <= 0 or self.q_heads % self.kv_heads:
            self.fail(f"q_num_heads ({self.q_heads}) must be a positive multiple of kv_num_heads ({self.kv_heads})")
        rule = self.attr("update_rule", "gated_delta")
        self.rule = rule.decode() if isinstance(rule, bytes) else rule
        if self.rule not in self.RULES:
            self.fail(f"update_rule must be one of {', '.join(self.RULES)}, got {self.rule!r}")
        self.gated = self.rule in ("gated", "gated_delta")
        self.delta = self.rule in ("delta", "gated_delta")
        self.scale = float(self.attr("scale", 0.0))

    def run(self, query, key, value, past_state=None, decay=None, beta=None):
        b, t, q_hidden = query.shape
        hkv, group = self.kv_heads, self.q_heads // self.kv_heads
        dk, dv = q_hidden // self.q_heads, value.shape[-1] // hkv
        dtype = _compute_dtype(query.dtype)
        scale = self.scale or 1.0 / math.sqrt(dk)
        q = query.reshape(b, t, hkv, group, dk).astype(dtype, copy=False)
        k = key.reshape(b, t, hkv, dk).astype(dtype, copy=False)
        v = value.reshape(b, t, hkv, dv).astype(dtype, copy=False)
        gate = self._gate(decay, b, t, dk, dtype)
        rate = self._rate(beta, b, t, dtype)
        state = (np.zeros((b, hkv, dk, dv), dtype) if past_state is None
                 else past_state.astype(dtype, copy=True))
        out = np.empty((b, t, hkv, group, dv), dtype)
        for i in range(t):  # the recurrence runs over time steps; each step is vectorised over batch and heads
            if gate is not None:
                state = gate[:, i, :, :, None] * state
            ki, vi = k[:, i], v[:, i]
            if rate is not None:
                predicted = np.matmul(ki[:, :, None, :], state)[:, :, 0, :]  # S^T k: [B, Hkv, dv]
                vi = rate[:, i, :, None] * (vi - predicted)
            state = state + ki[..., :, None] * vi[..., None, :]
            out[:, i] = np.matmul(q[:, i], state)
        out *= scale
        state_dtype = past_state.dtype if past_state is not None else query.dtype
        return out.reshape(b, t, self.q_heads * dv).astype(query.dtype, copy=False), state.astype(state_dtype)

    def _gate(self, decay, b, t, dk, dtype):
        """exp(decay) as [B, T, Hkv, dk or 1], or None for the ungated rules."""
        if not self.gated:
            return None
        if decay is None:
            raise ValueError(f"update_rule '{self.rule}' needs the decay input")
        g = decay.reshape(b, t, self.kv_heads, -1)
        if g.shape[-1] not in (1, dk):
            raise ValueError(f"decay must have shape (B, T, Hkv*dk) or (B, T, Hkv), got {decay.shape}")
        return np.exp(g.astype(dtype, copy=False))

    def _rate(self, beta, b, t, dtype):
        """beta as [B, T, Hkv or 1], or None for the rules without a delta update."""
        if not self.delta:
            return None
        if beta is None:
            raise ValueError(f"update_rule '{self.rule}' needs the beta input")
        r = beta.reshape(b, t, -1)
        if r.shape[-1] not in (1, self.kv_heads):
            raise ValueError(f"beta must have shape (B, T, Hkv) or (B, T, 1), got {beta.shape}")
        return r.astype(dtype, copy=False)


@register("FlexAttention", since=1, domain="ai.onnx.preview")
class FlexAttention(Kernel):
    def setup(self):
        self.scale = self.attr("scale")
        self.softmax_dtype = _softmax_precision(self)
        score_mod, prob_mod = self.attr("score_mod"), self.attr("prob_mod")
        self.score_mod = self.ctx.compile(score_mod) if score_mod is not None else None
        self.prob_mod = self.ctx.compile(prob_mod) if prob_mod is not None else None

    def execute(self, inputs, scope):
        return self.attend(*inputs, scope=scope)

    def run(self, q, k, v):
        return self.attend(q, k, v, scope={})

    def attend(self, q, k, v, scope):
        for name, x in (("Q", q), ("K", k), ("V", v)):
            if x.ndim != 4:
                raise ValueError(f"FlexAttention needs rank-4 {name}, got shape {x.shape}")
        dtype = self.softmax_dtype or (np.dtype(np.float64) if q.dtype == np.float64 else np.dtype(np.float32))
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        # Q @ K^T is rounded to the input precision before the softmax-precision work (onnx's test data expects it).
        scores = _matmul(q, k.swapaxes(-1, -2)).astype(dtype, copy=False) * scale
        scores = self._modify(self.score_mod, scores, scope, "score_mod")
        probs = self._modify(self.prob_mod, masked_softmax(scores), scope, "prob_mod")
        return _matmul(probs, v.astype(dtype, copy=False)).astype(q.dtype, copy=False)

    def _modify(self, program, x, scope, what):
        """Runs a modifier subgraph once over the whole [B, Hq, L, S] tensor."""
        if program is None:
            return x
        out = np.asarray(program.run([x], scope)[0])
        if out.shape != x.shape:
            raise ValueError(f"{what} returned shape {out.shape}, expected {x.shape}")
        return out.astype(x.dtype, copy=False)
