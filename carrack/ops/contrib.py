"""com.microsoft contrib kernels that onnxruntime tools and carrack's optimizer emit.

Statistics and activations of half floats are computed in float32 and rounded back once, as onnxruntime does.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from carrack.native import matmul as native_matmul
from carrack.native import rowops
from carrack.ops.elementwise import gelu, tanh_gelu, widen
from carrack.ops.registry import Kernel, register

MS = "com.microsoft"


def _work(x: np.ndarray) -> np.ndarray:
    """x in the precision its statistics are computed in (float32 at least)."""
    if type(x) is np.ndarray and x.dtype == _F32:
        return x
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


_F32 = np.dtype(np.float32)


def _plain_f32(x) -> bool:
    """A C-contiguous, aligned float32 ndarray (what the native row kernels read in place)."""
    return type(x) is np.ndarray and x.dtype == _F32 and x.flags.c_contiguous and x.flags.aligned


def _writable_apart(out, shape: tuple[int, ...], *inputs: np.ndarray | None) -> bool:
    """`out` is a plain float32 buffer of `shape`, writable, sharing no memory with the inputs."""
    if not (_plain_f32(out) and out.shape == shape and out.flags.writeable):
        return False
    return not any(a is not None and np.may_share_memory(out, a) for a in inputs)


def constant_rows(node_inputs: list[str], constants, indices: tuple[int, ...]) -> tuple | None:
    """The inputs at `indices` when each is a constant plain float32 vector of one length (None where the node
    omits the input); None when any is not (a run value, another shape or dtype)."""
    rows = []
    for i in indices:
        present = i < len(node_inputs) and bool(node_inputs[i])
        value = constants[i] if i < len(constants) else None
        if not present:
            rows.append(None)
        elif value is None or not _plain_f32(value) or value.ndim != 1:
            return None
        else:
            rows.append(value)
    sizes = {r.shape[0] for r in rows if r is not None}
    return tuple(rows) if len(sizes) == 1 else None


def layer_norm_prepared(out, x, gamma: np.ndarray, beta: np.ndarray | None, epsilon: float) -> np.ndarray | None:
    """Layer normalization of x over its last axis by the native kernel, into `out` (a new array when None), with
    gamma and beta checked by `constant_rows` when the kernel was prepared: only x and out are checked here. None
    when they do not fit (the kernel's general path then runs)."""
    if not (_plain_f32(x) and x.ndim > 0 and x.shape[-1] == gamma.shape[0]):
        return None
    if out is None:  # a graph output: not planned in the arena
        out = np.empty(x.shape, _F32)
    if _writable_apart(out, x.shape, x) and rowops.layer_norm_checked(x, None, None, gamma, beta, out, epsilon):
        return out
    return None


def layer_norm_bind(out, x, gamma: np.ndarray, beta: np.ndarray | None, epsilon: float):
    """`layer_norm_prepared` of these very arrays as a call without arguments (Kernel.bind_into), or None."""
    if not (_plain_f32(x) and x.ndim > 0 and x.shape[-1] == gamma.shape[0] and _writable_apart(out, x.shape, x)):
        return None
    return rowops.layer_norm_bound(x, None, None, gamma, beta, out, epsilon)


def offer_run_into(kernel: Kernel) -> None:
    """Give a kernel with an `_into(out, *inputs)` its `run_into` when its node has a single output: the executor
    writes no other node's output into the arena, where the memory plan would still reserve bytes for them all."""
    if len(kernel.node.outputs) == 1:
        kernel.run_into = kernel._into


def _outputs(node_outputs: list[str], values: list) -> tuple | np.ndarray:
    """As many results as the node names (None for omitted ones), one array when it has a single output."""
    values = [v if name else None for name, v in zip(node_outputs, values)]
    return values[0] if len(values) == 1 else tuple(values)


def _row_params(shape: tuple[int, ...], *params: np.ndarray | None) -> list[np.ndarray | None] | None:
    """Per-element parameters as float32 arrays of the normalized `shape` (None: one does not broadcast to it)."""
    try:
        return [p if p is None or (p.shape == shape and p.dtype == np.float32)
                else np.broadcast_to(p, shape).astype(np.float32, copy=False) for p in params]
    except ValueError:
        return None


def _native_layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, axis: int, epsilon: float,
                       out: np.ndarray | None = None, stats: bool = True,
                       ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None:
    """`layer_norm` of float32 x by the native kernel (None when its parameters do not fit it)."""
    axis %= x.ndim
    params = _row_params(x.shape[axis:], scale, bias)
    if params is None:
        return None
    y, mean, inv_std, _ = rowops.layer_norm(x, params[0], params[1], epsilon, math.prod(x.shape[axis:]), out=out,
                                            stats=stats)
    if not stats:
        return y, None, None
    kept = x.shape[:axis] + (1,) * (x.ndim - axis)
    return y, mean.reshape(kept), inv_std.reshape(kept)


@register("LayerNormalization", since=1)
class ContribLayerNormalization(Kernel):
    """onnxruntime's LayerNormalization before ONNX had one (ONNX domain below opset 17, and com.microsoft)."""

    def setup(self) -> None:
        self.axis = int(self.attr("axis", -1))
        self.epsilon = float(self.attr("epsilon", 1e-5))
        self.rows = self.if_native(rowops.library)
        self.wants_stats = any(self.node.outputs[1:])
        if len(self.node.inputs) < 2 or not self.node.inputs[1]:
            self.fail("input 1 (Scale) is required")
        self.row_constants: tuple | None = None  # (scale, bias) checked once (prepare), for axis -1
        offer_run_into(self)

    def prepare(self, constants):
        if self.rows is not None and not self.wants_stats and self.axis == -1:
            rows = constant_rows(self.node.inputs, constants, (1, 2))
            self.row_constants = rows if rows is not None and rows[0] is not None else None

    def run(self, x, scale, bias=None):
        return self._into(None, x, scale, bias)

    def bind_into(self, out, x, scale, bias=None):
        prepared = self.row_constants
        if prepared is not None and scale is prepared[0] and bias is prepared[1] and len(self.node.outputs) == 1:
            return layer_norm_bind(out, x, scale, bias, self.epsilon)
        return None

    def _into(self, out, x, scale, bias=None):
        prepared = self.row_constants
        if prepared is not None and scale is prepared[0] and bias is prepared[1]:
            y = layer_norm_prepared(out, x, scale, bias, self.epsilon)
            if y is not None:
                return y
        if not -x.ndim <= self.axis < x.ndim:
            self.fail(f"axis {self.axis} out of range for a rank-{x.ndim} input")
        result = None
        if self.rows is not None and x.dtype == np.float32 and x.size:
            result = _native_layer_norm(x, scale, bias, self.axis, self.epsilon, out, self.wants_stats)
        if result is None:
            result = layer_norm(x, scale, bias, self.axis, self.epsilon)
        y, mean, inv_std = result
        if not self.wants_stats:
            return _outputs(self.node.outputs, [y])
        return _outputs(self.node.outputs, [y, mean.astype(np.float32), inv_std.astype(np.float32)])


register("LayerNormalization", domain=MS)(type("MsLayerNormalization", (ContribLayerNormalization,), {}))


@register("SkipLayerNormalization", domain=MS)
class SkipLayerNormalization(Kernel):
    """LayerNormalization(input + skip + bias) over the last axis; 4th output: the sum itself."""

    def setup(self) -> None:
        self.epsilon = float(self.attr("epsilon", 1e-12))
        self.rows = self.if_native(rowops.library)
        outs = self.node.outputs
        self.wants_stats = any(outs[1:3])
        self.wants_sum = len(outs) > 3 and bool(outs[3])
        self.row_constants: tuple | None = None  # (gamma, beta, bias) checked once (prepare)
        offer_run_into(self)

    def prepare(self, constants):
        if self.rows is not None and not self.wants_stats:
            rows = constant_rows(self.node.inputs, constants, (2, 3, 4))
            self.row_constants = rows if rows is not None and rows[0] is not None else None

    def run(self, x, skip, gamma, beta=None, bias=None):
        return self._into(None, x, skip, gamma, beta, bias)

    def bind_into(self, out, x, skip, gamma, beta=None, bias=None):
        prepared = self.row_constants
        if (prepared is not None and not self.wants_sum and gamma is prepared[0] and beta is prepared[1]
                and bias is prepared[2] and _plain_f32(x) and _plain_f32(skip) and skip.shape == x.shape and x.ndim
                and x.shape[-1] == gamma.shape[0] and _writable_apart(out, x.shape, x, skip)):
            return rowops.layer_norm_bound(x, skip, bias, gamma, beta, out, self.epsilon)
        return None

    def bind_outputs(self, outs: tuple, x, skip, gamma, beta=None, bias=None):
        """With the sum output read (a decoder's residual stream; not placed in the arena): the prepared native
        call writing these very output arrays (`outs` as `run` returned them), or None."""
        prepared = self.row_constants
        if not (prepared is not None and self.wants_sum and len(outs) == 4 and gamma is prepared[0]
                and beta is prepared[1] and bias is prepared[2] and _plain_f32(x) and _plain_f32(skip)
                and skip.shape == x.shape and x.ndim and x.shape[-1] == gamma.shape[0]):
            return None
        y, total = outs[0], outs[3]
        if y is None or not (_writable_apart(y, x.shape, x, skip, total) and _writable_apart(total, x.shape, x, skip)):
            return None
        return rowops.layer_norm_bound(x, skip, bias, gamma, beta, y, self.epsilon, total)

    def _into(self, out, x, skip, gamma, beta=None, bias=None):
        prepared = self.row_constants
        if (prepared is not None and gamma is prepared[0] and beta is prepared[1] and bias is prepared[2]
                and _plain_f32(x) and _plain_f32(skip) and skip.shape == x.shape and x.ndim
                and x.shape[-1] == gamma.shape[0]):
            if out is None:  # a graph output or a node with the sum output: not planned in the arena
                out = np.empty(x.shape, _F32)
            total = np.empty(x.shape, _F32) if self.wants_sum else None
            if (_writable_apart(out, x.shape, x, skip)
                    and rowops.layer_norm_checked(x, skip, bias, gamma, beta, out, self.epsilon, total)):
                return _outputs(self.node.outputs, [out, None, None, total]) if self.wants_sum else out
        if self.rows is not None and x.dtype == np.float32 and x.size and x.ndim:
            result = self._run_native(out, x, skip, gamma, beta, bias)
            if result is not None:
                return result
        total = _work(x) + _work(skip)
        if bias is not None:
            total = total + _work(bias)
        y, mean, inv_std = layer_norm(total, gamma, beta, -1, self.epsilon)
        return _outputs(self.node.outputs, [y.astype(x.dtype), mean.astype(np.float32),
                                            inv_std.astype(np.float32), total.astype(x.dtype)])

    def _run_native(self, out, x, skip, gamma, beta, bias) -> tuple | np.ndarray | None:
        hidden = x.shape[-1]
        params = _row_params((hidden,), gamma, beta, bias)
        if params is None:
            return None
        if skip.shape != x.shape:
            if np.broadcast_shapes(x.shape, skip.shape) != x.shape:
                return None
            skip = np.broadcast_to(skip, x.shape)
        y, mean, inv_std, total = rowops.layer_norm(x, params[0], params[1], self.epsilon, hidden, skip=skip,
                                                    bias=params[2], out=out, stats=self.wants_stats,
                                                    total=self.wants_sum)
        kept = x.shape[:-1] + (1,)
        if self.wants_stats:
            mean, inv_std = mean.reshape(kept), inv_std.reshape(kept)
        return _outputs(self.node.outputs, [y, mean, inv_std, total])


class _GeluBase(Kernel):
    """An activation of x (+ an optional bias), computed in float32 for half floats."""

    activation = staticmethod(gelu)
    approximate = False

    def setup(self) -> None:
        self.rows = self.if_native(rowops.library)
        self.bias: np.ndarray | None = None  # a constant bias checked once (prepare)

    def prepare(self, constants):
        rows = constant_rows(self.node.inputs, constants, (1,)) if self.rows is not None else None
        self.bias = rows[0] if rows is not None else None

    def run_into(self, out, x, bias=None):
        if (bias is not None and bias is self.bias and _plain_f32(x) and x.ndim and x.shape[-1] == bias.shape[0]
                and _writable_apart(out, x.shape, x) and rowops.gelu_checked(x, bias, out, self.approximate)):
            return out
        if self._native(x, bias):
            return rowops.gelu(x, bias, self.approximate, out=out)
        return self.run(x, bias)

    def bind_into(self, out, x, bias=None):
        if (bias is not None and bias is self.bias and _plain_f32(x) and x.ndim and x.shape[-1] == bias.shape[0]
                and _writable_apart(out, x.shape, x)):
            return rowops.gelu_bound(x, bias, out, self.approximate)
        return None

    def _native(self, x: np.ndarray, bias: np.ndarray | None) -> bool:
        return self.rows is not None and x.dtype == np.float32 and (
            bias is None or x.ndim > 0 and bias.shape == (x.shape[-1],) and bias.dtype == np.float32)

    def run(self, x, bias=None):
        if self._native(x, bias):
            return rowops.gelu(x, bias, self.approximate)
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
    approximate = True


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


def _softmax_in_place(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of a scores buffer the caller owns; a fully masked row (every score -inf) gives
    zeros, not NaN; a NaN score makes its row NaN."""
    peak = np.max(x, axis=-1, keepdims=True)
    peak[np.isneginf(peak)] = 0
    np.subtract(x, peak, out=x)
    np.exp(x, out=x)
    total = np.sum(x, axis=-1, keepdims=True)
    total[total == 0] = 1
    return np.divide(x, total, out=x)


def _probabilities(q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None, native: bool) -> np.ndarray:
    """softmax(q k^T * scale + bias) over (B, N, S, H) heads (float32 by the native softmax where `native`)."""
    if native and q.dtype == np.float32:
        keys = k.swapaxes(-1, -2)
        lead = q.shape[:-2] if q.shape[:-2] == keys.shape[:-2] else np.broadcast_shapes(q.shape[:-2],
                                                                                         keys.shape[:-2])
        scores = np.empty(lead + (q.shape[-2], keys.shape[-1]), q.dtype if q.dtype == keys.dtype
                          else np.result_type(q, keys))
        if not native_matmul.batched_into(q, keys, scores):
            np.matmul(q, keys, out=scores)
        try:  # scale, bias and softmax in one pass over the scores, in place
            return rowops.softmax(scores, scale, bias, zero_masked=True, out=scores)
        except ValueError:  # a bias that broadcasts the scores to a larger shape: the general path below
            pass
    # the scale goes into q: a pass over S x H per head rather than over S x L scores
    scores = np.matmul(q * q.dtype.type(scale), k.swapaxes(-1, -2))
    if bias is not None:
        fits = np.broadcast_shapes(scores.shape, bias.shape) == scores.shape
        scores = np.add(scores, bias, out=scores if fits else None)
    return _softmax_in_place(scores)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, bias: np.ndarray | None,
            out: np.ndarray | None = None, native: bool = False) -> np.ndarray:
    """softmax(q k^T * scale + bias) v over (B, N, S, H) heads, merged back to (B, S, N * Hv): written into `out`
    when it is a C-contiguous buffer of that shape and dtype."""
    probs = _probabilities(q, k, scale, bias, native)
    batch, heads, seq, _ = probs.shape
    hv = v.shape[-1]
    shape, dtype = (batch, seq, heads * hv), probs.dtype if probs.dtype == v.dtype else np.result_type(probs, v)
    if (out is None or out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous
            or not out.flags.writeable or np.may_share_memory(out, v)):
        out = np.empty(shape, dtype)
    heads_view = out.reshape(batch, seq, heads, hv).transpose(0, 2, 1, 3)
    if not (native and native_matmul.batched_into(probs, v, heads_view)):  # on the run's threads, not BLAS's
        np.matmul(probs, v, out=heads_view)
    return out


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
        self.rows = self.if_native(rowops.library)
        offer_run_into(self)
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

    def setup(self) -> None:
        super().setup()
        #: whether `_per_head_into` may take a call (no causal mask, the native softmax, the one output read)
        self.per_head = not self.causal and self.rows is not None and not any(self.node.outputs[1:])

    def run(self, *inputs):
        return self._into(None, *inputs)

    def _into(self, out, query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
              past_key=None, past_value=None, *unused):
        if (self.per_head and out is not None and bias is None and key_padding_mask is None and past_key is None
                and past_value is None):
            done = self._per_head_into(out, query, key, value, attention_bias)
            if done is not None:
                return done
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
        out = _attend(q, k, v, self._scale(q.shape[-1]), self._bias(q, k, key_padding_mask, attention_bias, dtype),
                      out if query.dtype == dtype else None, self.rows is not None)
        outs = self.node.outputs
        present = [t.astype(query.dtype) if i < len(outs) and outs[i] else None for i, t in ((1, k), (2, v))]
        return _outputs(outs, [out.astype(query.dtype, copy=False), *present])


    def _per_head_into(self, out, query, key, value, attention_bias) -> np.ndarray | None:
        """`_into`'s computation for a float32 query (B, S, D), per-head key and value (B, N, L, H) and an optional
        float32 additive bias, into `out` (a plain float32 (B, S, N * Hv) buffer apart from the value): the same
        calls as its general path, with the checks of this case only (a decoder's cache changes length every
        token, so this step runs unbound). None: not this case."""
        if not (type(query) is type(key) is type(value) is np.ndarray and query.ndim == 3 and key.ndim == 4
                and value.ndim == 4 and query.dtype == key.dtype == value.dtype == _F32):
            return None
        if attention_bias is not None and (type(attention_bias) is not np.ndarray or attention_bias.dtype != _F32):
            return None
        batch, seq, hidden = query.shape
        heads, length, head = key.shape[1:]
        hv = value.shape[-1]
        if (key.shape[0] != batch or heads != self.heads or hidden != heads * head or value.shape[:3] != key.shape[:3]
                or not _writable_apart(out, (batch, seq, heads * hv), value)):
            return None
        q = query.reshape(batch, seq, heads, head).transpose(0, 2, 1, 3)
        keys = key.swapaxes(-1, -2)
        scores = np.empty((batch, heads, seq, length), _F32)
        # (batched_into asks `chosen` last, after its checks: asked first here, where a decoder's row goes to numpy)
        if not (native_matmul.chosen(seq, head, length) and native_matmul.batched_into(q, keys, scores)):
            np.matmul(q, keys, out=scores)
        try:  # scale, bias and softmax in one pass over the scores, in place
            rowops.softmax_fresh(scores, self._scale(head), attention_bias, zero_masked=True)
        except ValueError:  # a bias that broadcasts the scores to a larger shape: the general path
            return None
        context = out.reshape(batch, seq, heads, hv).transpose(0, 2, 1, 3)
        if not (native_matmul.chosen(seq, length, hv) and native_matmul.batched_into(scores, value, context)):
            np.matmul(scores, value, out=context)
        return out

    def bind_into(self, out, query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
                  past_key=None, past_value=None, *unused):
        """`_into` for these very arrays in its common case (float32 query (B, S, D), key and value (B, L, D) or
        per head, an optional additive attention bias, no projection bias, mask, past or causal mask, one
        output): the head views, the scores buffer and the softmax's packet made once."""
        if (bias is not None or key_padding_mask is not None or past_key is not None or past_value is not None
                or self.causal or self.rows is None or any(self.node.outputs[1:]) or key is None or value is None
                or query.ndim != 3 or key.ndim not in (3, 4) or key.ndim != value.ndim):
            return None
        arrays = (query, key, value) if attention_bias is None else (query, key, value, attention_bias)
        if not all(type(a) is np.ndarray and a.dtype == _F32 for a in arrays):
            return None
        q = _heads(query, self.heads)
        k, v = (key, value) if key.ndim == 4 else (_heads(key, self.heads), _heads(value, self.heads))
        keys = k.swapaxes(-1, -2)
        batch, heads, seq, _ = q.shape
        hv = v.shape[-1]
        if (keys.shape[:-2] != q.shape[:-2] or v.shape[:-2] != q.shape[:-2] or keys.shape[-2] != q.shape[-1]
                or v.shape[-2] != keys.shape[-1] or not _writable_apart(out, (batch, seq, heads * hv), q, k, v)):
            return None
        scores = np.empty(q.shape[:-1] + keys.shape[-1:], _F32)
        softmax = rowops.softmax_bound(scores, self._scale(q.shape[-1]), attention_bias, True)
        if softmax is None:
            return None
        context = out.reshape(batch, seq, heads, hv).transpose(0, 2, 1, 3)
        scores_product = _bound_batched(q, keys, scores)
        context_product = _bound_batched(scores, v, context)

        def attend() -> None:
            scores_product()
            softmax()
            context_product()
        return attend


def _bound_batched(a: np.ndarray, b: np.ndarray, y: np.ndarray):
    """y = a @ b over heads as `_attend` computes it (native where `native_matmul.batched_into` takes it, else
    numpy), for these very arrays."""
    rows, depth, cols = a.shape[-2], a.shape[-1], b.shape[-1]
    if native_matmul.numpy_is_faster(rows, depth, cols):  # never the native tile (chosen is False there)
        return functools.partial(np.matmul, a, b, out=y)

    def product() -> None:
        if not native_matmul.batched_into(a, b, y):
            np.matmul(a, b, out=y)
    return product


@register("Attention", domain=MS)
class Attention(_AttentionBase):
    """Self-attention with the input projection inside: x (B, S, D_in) @ weights (D_in, Dq + Dk + Dv) + bias,
    optional mask_index (onnxruntime's 1-D lengths, 2-D or 3-D 0/1 forms), past (2, B, N, P, H) and attention_bias."""

    def setup(self) -> None:
        super().setup()
        self.sizes = list(self.attr("qkv_hidden_sizes", []))
        if self.sizes and len(self.sizes) != 3:
            self.fail(f"qkv_hidden_sizes must have 3 entries, got {self.sizes}")

    def run(self, *inputs):
        return self._into(None, *inputs)

    def _into(self, out, x, weights, bias=None, mask_index=None, past=None, attention_bias=None, *unused):
        w = _work(x)
        proj = np.matmul(w, _work(weights))
        if bias is not None:
            proj += _work(bias)
        sizes = self.sizes or [proj.shape[-1] // 3] * 3
        q, k, v = np.split(proj, np.cumsum(sizes)[:2], axis=-1)
        q, k, v = (_heads(t, self.heads) for t in (q, k, v))
        if past is not None:
            k = np.concatenate([_work(past[0]), k], axis=2)
            v = np.concatenate([_work(past[1]), v], axis=2)
        scale = self._scale(q.shape[-1])
        out = _attend(q, k, v, scale, self._bias(q, k, mask_index, attention_bias, w.dtype.type),
                      out if x.dtype == w.dtype else None, self.rows is not None)
        if len(self.node.outputs) < 2 or not self.node.outputs[1]:
            return _outputs(self.node.outputs, [out.astype(x.dtype, copy=False)])
        return _outputs(self.node.outputs, [out.astype(x.dtype, copy=False), np.stack([k, v]).astype(x.dtype)])
