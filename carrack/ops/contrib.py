"""com.microsoft contrib kernels that onnxruntime tools and carrack's optimizer emit.

Statistics and activations of half floats are computed in float32 and rounded back once, as onnxruntime does.
"""

from __future__ import annotations

import math

import numpy as np

from carrack.ops.elementwise import gelu, tanh_gelu, widen
from carrack.ops.registry import Kernel, register

MS = "com.microsoft"


def _work(x: np.ndarray) -> np.ndarray:
    """x in the precision its statistics are computed in (float32 at least)."""
    x = widen(x)
    return x if x.dtype == np.float64 else x.astype(np.float32, copy=False)


def layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, axis: int, epsilon: float,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, mean, 1 / std) of x normalized over the axes from `axis` on; mean and 1 / std keep reduced dims."""
    w = _work(x)
    axes = tuple(range(axis % x.ndim if x.ndim else 0, x.ndim))
    mean = np.mean(w, axis=axes, keepdims=True)
    centred = w - mean
    inv_std = 1 / np.sqrt(np.mean(centred * centred, axis=axes, keepdims=True) + w.dtype.type(epsilon))
    y = centred * inv_std * _work(scale)
    if bias is not None:
        y = y + _work(bias)
    return y.astype(x.dtype, copy=False), mean, inv_std


def _outputs(node_outputs: list[str], values: list) -> tuple | np.ndarray:
    """As many results as the node names (None for omitted ones), one array when it has a single output."""
    values = [v if name else None for name, v in zip(node_outputs, values)]
    return values[0] if len(values) == 1 else tuple(values)


@register("LayerNormalization", since=1)
class ContribLayerNormalization(Kernel):
    """onnxruntime's LayerNormalization before ONNX had one (ONNX domain below opset 17, and com.microsoft)."""

    def setup(self) -> None:
        self.axis = int(self.attr("axis", -1))
        self.epsilon = float(self.attr("epsilon", 1e-5))

    def run(self, x, scale, bias=None):
        if not -x.ndim <= self.axis < x.ndim:
            self.fail(f"axis {self.axis} out of range for a rank-{x.ndim} input")
        y, mean, inv_std = layer_norm(x, scale, bias, self.axis, self.epsilon)
        return _outputs(self.node.outputs, [y, mean.astype(np.float32), inv_std.astype(np.float32)])


register("LayerNormalization", domain=MS)(type("MsLayerNormalization", (ContribLayerNormalization,), {}))


@register("SkipLayerNormalization", domain=MS)
class SkipLayerNormalization(Kernel):
    """LayerNormalization(input + skip + bias) over the last axis; 4th output: the sum itself."""

    def setup(self) -> None:
        self.epsilon = float(self.attr("epsilon", 1e-12))

    def run(self, x, skip, gamma, beta=None, bias=None):
        total = _work(x) + _work(skip)
        if bias is not None:
            total = total + _work(bias)
        y, mean, inv_std = layer_norm(total, gamma, beta, -1, self.epsilon)
        return _outputs(self.node.outputs, [y.astype(x.dtype), mean.astype(np.float32),
                                            inv_std.astype(np.float32), total.astype(x.dtype)])


class _GeluBase(Kernel):
    """An activation of x (+ an optional bias), computed in float32 for half floats."""

    activation = staticmethod(gelu)

    def run(self, x, bias=None):
        w = _work(x)
        if bias is not None:
            w = np.add(w, _work(bias))
        # overwrite the widened or biased copy this kernel made; never the input itself
        y = self.activation(w, out=None if w is x else w)
        return y.astype(x.dtype, copy=False)


@register("Gelu", domain=MS)
class Gelu(_GeluBase):
    pass


@register("BiasGelu", domain=MS)
class BiasGelu(_GeluBase):
    pass


@register("FastGelu", domain=MS)
class FastGelu(_GeluBase):
    activation = staticmethod(tanh_gelu)


@register("QuickGelu", domain=MS)
class QuickGelu(Kernel):
    """x * sigmoid(alpha * x)."""

    def setup(self) -> None:
        self.alpha = float(self.attr("alpha", 1.702))

    def run(self, x):
        w = _work(x)
        return (w / (1 + np.exp(-w.dtype.type(self.alpha) * w))).astype(x.dtype, copy=False)


# -- attention -------------------------------------------------------------------------------------------------------

def _heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(B, S, N * H) -> (B, N, S, H)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; a fully masked row (all -inf) gives zeros, not NaN."""
    peak = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(peak), peak, 0))
    total = np.sum(e, axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, bias: np.ndarray | None) -> np.ndarray:
    """softmax(q k^T * scale + bias) v over (B, N, S, H) heads, merged back to (B, S, N * Hv)."""
    scores = np.matmul(q, k.swapaxes(-1, -2)) * q.dtype.type(scale)
    if bias is not None:
        scores = scores + bias
    out = np.matmul(_softmax(scores), v)
    b, n, s, h = out.shape
    return out.transpose(0, 2, 1, 3).reshape(b, s, n * h)


def _causal_bias(seq: int, total: int, fill: float, dtype) -> np.ndarray:
    """0 where a query (the last `seq` of `total` positions) may see a key, `fill` where the key is in its future."""
    future = np.arange(total)[None, :] > np.arange(total - seq, total)[:, None]
    return np.where(future, dtype(fill), dtype(0))


def _key_padding_bias(mask: np.ndarray, batch: int, seq: int, total: int, fill: float, dtype) -> np.ndarray:
    """onnxruntime's mask_index forms as an additive (B, 1, S, L) bias: (B, L) or (B, S, L) 1/0 masks, or (B,)
    valid lengths."""
    if mask.ndim == 1 and mask.shape[0] == batch:
        keep = np.arange(total)[None, :] < mask[:, None]
        keep = keep[:, None, :]
    elif mask.ndim == 2:
        keep = (mask != 0)[:, None, :]
    elif mask.ndim == 3:
        keep = mask != 0
    else:
        raise ValueError(f"unsupported mask shape {mask.shape}")
    keep = np.broadcast_to(keep, (batch, seq, total))
    return np.where(keep, dtype(0), dtype(fill))[:, None]


class _AttentionBase(Kernel):
    def setup(self) -> None:
        self.heads = int(self.required_attr("num_heads"))
        self.scale = float(self.attr("scale", 0.0))
        self.fill = float(self.attr("mask_filter_value", -10000.0))
        self.causal = bool(self.attr("unidirectional", 0))
        if self.heads <= 0:
            self.fail(f"num_heads must be positive, got {self.heads}")

    def _bias(self, q: np.ndarray, k: np.ndarray, mask, attention_bias, dtype) -> np.ndarray | None:
        batch, _, seq, _ = q.shape
        total = k.shape[2]
        bias = None
        if mask is not None:
            try:
                bias = _key_padding_bias(mask, batch, seq, total, self.fill, dtype)
            except ValueError as e:
                self.fail(str(e))
        if attention_bias is not None:
            extra = _work(attention_bias).astype(dtype, copy=False)
            bias = extra if bias is None else bias + extra
        if self.causal:
            causal = _causal_bias(seq, total, self.fill, dtype)
            bias = causal if bias is None else bias + causal
        return bias

    def _scale(self, head_size: int) -> float:
        return self.scale if self.scale else 1 / math.sqrt(head_size)


@register("MultiHeadAttention", domain=MS)
class MultiHeadAttention(_AttentionBase):
    """Query (B, S, D) or packed QKV (B, S, N, 3, H); key/value (B, L, D), per head (B, N, L, H), or packed KV
    (B, L, N, 2, H); optional projection bias, key padding mask, additive attention bias and past key/value."""

    def run(self, query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
            past_key=None, past_value=None, *unused):
        dtype = _work(query).dtype.type
        n = self.heads
        if query.ndim == 5:  # packed (B, S, N, 3, H)
            q, k, v = (_work(query[:, :, :, i]).transpose(0, 2, 1, 3) for i in range(3))
        else:
            q = _work(query)
            if bias is not None:
                b = _work(bias)
                d = q.shape[-1]
                q = q + b[:d]
                if key is not None and key.ndim == 3:
                    key = _work(key) + b[d:2 * d]
                    value = _work(value) + b[2 * d:]
            q = _heads(q, n)
            if key is None:
                self.fail("key is required unless the query is packed QKV")
            if key.ndim == 5:  # packed (B, L, N, 2, H)
                k, v = (_work(key[:, :, :, i]).transpose(0, 2, 1, 3) for i in range(2))
            elif key.ndim == 4:
                k, v = _work(key), _work(value)
            else:
                k, v = _heads(_work(key), n), _heads(_work(value), n)
        if past_key is not None:
            k = np.concatenate([_work(past_key), k], axis=2)
            v = np.concatenate([_work(past_value), v], axis=2)
        out = _attend(q, k, v, self._scale(q.shape[-1]), self._bias(q, k, key_padding_mask, attention_bias, dtype))
        return _outputs(self.node.outputs, [out.astype(query.dtype), k.astype(query.dtype), v.astype(query.dtype)])


@register("Attention", domain=MS)
class Attention(_AttentionBase):
    """Self-attention with the input projection inside: x (B, S, D_in) @ weights (D_in, Dq + Dk + Dv) + bias,
    optional mask_index (onnxruntime's 1-D lengths, 2-D or 3-D 0/1 forms), past (2, B, N, P, H) and attention_bias."""

    def setup(self) -> None:
        super().setup()
        self.sizes = list(self.attr("qkv_hidden_sizes", []))
        if self.sizes and len(self.sizes) != 3:
            self.fail(f"qkv_hidden_sizes must have 3 entries, got {self.sizes}")

    def run(self, x, weights, bias=None, mask_index=None, past=None, attention_bias=None, *unused):
        w = _work(x)
        proj = np.matmul(w, _work(weights))
        if bias is not None:
            proj = proj + _work(bias)
        sizes = self.sizes or [proj.shape[-1] // 3] * 3
        q, k, v = np.split(proj, np.cumsum(sizes)[:2], axis=-1)
        q, k, v = (_heads(t, self.heads) for t in (q, k, v))
        if past is not None:
            k = np.concatenate([_work(past[0]), k], axis=2)
            v = np.concatenate([_work(past[1]), v], axis=2)
        scale = self._scale(q.shape[-1])
        out = _attend(q, k, v, scale, self._bias(q, k, mask_index, attention_bias, w.dtype.type))
        if len(self.node.outputs) < 2 or not self.node.outputs[1]:
            return _outputs(self.node.outputs, [out.astype(x.dtype)])
        return _outputs(self.node.outputs, [out.astype(x.dtype), np.stack([k, v]).astype(x.dtype)])
