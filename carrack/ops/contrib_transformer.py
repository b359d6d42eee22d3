"""com.microsoft kernels that onnxruntime's transformer optimizer (onnxruntime.transformers.optimizer) and its
generation tools emit, beyond those of carrack.ops.contrib: BERT's fused embedding, T5/LLaMA-style RMS
normalizations, diffusion models' bias fusions, rotary embeddings and grouped-query attention.

Half floats are computed in float32 and rounded back once, as onnxruntime does.
"""

from __future__ import annotations

import numpy as np

from carrack.ops.contrib import MS, _outputs, _work, layer_norm
from carrack.ops.elementwise import gelu, tanh_gelu
from carrack.ops.registry import Kernel, register


def _rms_norm(x: np.ndarray, scale: np.ndarray, axis: int, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """(x / sqrt(mean(x^2) + epsilon) * scale, 1 / rms with reduced dims kept), over the axes from `axis` on, in
    float32 (float64 for float64 x)."""
    axes = tuple(range(axis, x.ndim))
    inv_rms = 1 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + x.dtype.type(epsilon))
    return x * inv_rms * _work(scale), inv_rms


@register("EmbedLayerNormalization", domain=MS)
class EmbedLayerNormalization(Kernel):
    """LayerNormalization(word_embedding[input_ids] + position_embedding[positions] + segment_embedding[segment_ids])
    (BERT's embeddings); positions are 0..S-1 unless position_ids are given. Outputs: the normalized embeddings,
    mask_index (each row's count of mask ones, zeros without a mask) and the sum before normalization."""

    def setup(self) -> None:
        self.epsilon = float(self.attr("epsilon", 1e-12))

    def run(self, input_ids, segment_ids, word_embedding, position_embedding, segment_embedding=None, gamma=None,
            beta=None, mask=None, position_ids=None):
        if input_ids.ndim != 2:
            self.fail(f"input_ids must be 2-D (batch, sequence), got shape {input_ids.shape}")
        batch, seq = input_ids.shape
        if position_ids is None:
            positions = np.arange(seq)[None, :]
        else:
            positions = np.broadcast_to(position_ids, (batch, seq)) if position_ids.shape[0] == 1 else position_ids
        total = self._lookup(word_embedding, input_ids, "input_ids") + self._lookup(position_embedding, positions,
                                                                                    "position ids")
        if segment_embedding is not None and segment_ids is not None:
            total = total + self._lookup(segment_embedding, segment_ids, "segment_ids")
        y, _, _ = layer_norm(total, gamma, beta, -1, self.epsilon)
        dtype = word_embedding.dtype
        if mask is None:
            mask_index = np.zeros(batch, np.int32)
        else:
            mask_index = np.count_nonzero(mask == 1, axis=-1).astype(np.int32)
        return _outputs(self.node.outputs, [y.astype(dtype), mask_index, total.astype(dtype)])

    def _lookup(self, table: np.ndarray, ids: np.ndarray, what: str) -> np.ndarray:
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            self.fail(f"{what} must be in [0, {table.shape[0]}) (the embedding table's rows), got values from "
                      f"{ids.min()} to {ids.max()}")
        return _work(table)[ids]


@register("SimplifiedLayerNormalization", since=1)
class SimplifiedLayerNormalization(Kernel):
    """RMS normalization: x / sqrt(mean(x^2 over the axes from `axis`) + epsilon) * scale (onnxruntime registers it
    in the ONNX domain); second output: 1 / rms."""

    def setup(self) -> None:
        self.axis = int(self.attr("axis", -1))
        self.epsilon = float(self.attr("epsilon", 1e-5))

    def run(self, x, scale):
        if not -x.ndim <= self.axis < x.ndim:
            self.fail(f"axis {self.axis} out of range for a rank-{x.ndim} input")
        y, inv_rms = _rms_norm(_work(x), scale, self.axis % x.ndim, self.epsilon)
        return _outputs(self.node.outputs, [y.astype(x.dtype), inv_rms.astype(np.float32)])


@register("SkipSimplifiedLayerNormalization", domain=MS)
class SkipSimplifiedLayerNormalization(Kernel):
    """RMS normalization of input + skip (+ bias) over the last axis, times gamma; outputs: the result, mean (unused:
    onnxruntime leaves it unset), 1 / rms, and the sum itself."""

    def setup(self) -> None:
        self.epsilon = float(self.attr("epsilon", 1e-12))

    def run(self, x, skip, gamma, bias=None):
        total = _work(x) + _work(skip)
        if bias is not None:
            total = total + _work(bias)
        y, inv_rms = _rms_norm(total, gamma, x.ndim - 1, self.epsilon)
        kept = np.zeros_like(inv_rms, np.float32)
        return _outputs(self.node.outputs, [y.astype(x.dtype), kept, inv_rms.astype(np.float32),
                                            total.astype(x.dtype)])


@register("BiasAdd", domain=MS)
class BiasAdd(Kernel):
    """x + bias + skip (diffusion models' residual: x and skip (N, S, C), bias (C))."""

    def run(self, x, bias, skip):
        if x.ndim != 3 or bias.shape != (x.shape[-1],) or skip.shape != x.shape:
            self.fail(f"expected x and skip of one (N, S, C) shape and bias (C,), got {x.shape}, {skip.shape} and "
                      f"{bias.shape}")
        return (_work(x) + _work(bias) + _work(skip)).astype(x.dtype)


@register("BiasSplitGelu", domain=MS)
class BiasSplitGelu(Kernel):
    """(x + bias) split in two halves over the last axis: left * gelu(right) (exact gelu), (N, S, D) -> (N, S, D/2)."""

    def run(self, x, bias):
        if x.ndim != 3 or bias.shape != (x.shape[-1],) or x.shape[-1] % 2:
            self.fail(f"expected x (N, S, D) with D even and bias (D,), got {x.shape} and {bias.shape}")
        total = _work(x) + _work(bias)
        half = x.shape[-1] // 2
        return (total[..., :half] * gelu(np.ascontiguousarray(total[..., half:]))).astype(x.dtype)


@register("GemmFastGelu", domain=MS)
class GemmFastGelu(Kernel):
    """FastGelu(x @ w + bias): the tanh approximation of gelu after a matrix product."""

    def run(self, x, w, bias=None):
        y = np.matmul(_work(x), _work(w))
        if bias is not None:
            y += _work(bias)
        return tanh_gelu(y, out=y).astype(x.dtype, copy=False)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dim: int, interleaved: bool) -> np.ndarray:
    """Rotary embedding of the first `dim` features of x's last axis by cos/sin (broadcast against x[..., :dim/2]);
    the features past `dim` are copied. Interleaved: pairs (2i, 2i + 1); else halves (i, i + dim/2)."""
    rotated = x[..., :dim]
    if interleaved:
        first, second = rotated[..., 0::2], rotated[..., 1::2]
    else:
        first, second = rotated[..., : dim // 2], rotated[..., dim // 2:]
    out = np.empty_like(x)
    real, imag = first * cos - second * sin, first * sin + second * cos
    if interleaved:
        out[..., 0:dim:2], out[..., 1:dim:2] = real, imag
    else:
        out[..., : dim // 2], out[..., dim // 2: dim] = real, imag
    out[..., dim:] = x[..., dim:]
    return out


@register("RotaryEmbedding", domain=MS)
class MsRotaryEmbedding(Kernel):
    """onnxruntime's rotary embedding: input (B, S, hidden) or (B, N, S, head), position_ids (B, S) or a one-element
    start position, cos/sin caches (max positions, rotary_dim / 2)."""

    def setup(self) -> None:
        self.interleaved = bool(self.attr("interleaved", 0))
        self.rotary_dim = int(self.attr("rotary_embedding_dim", 0))
        self.num_heads = int(self.attr("num_heads", 0))
        if self.attr("is_packed_batching", 0):
            self.fail("is_packed_batching=1 (ragged batches) is not supported")
        if self.rotary_dim and not self.num_heads:
            self.fail("rotary_embedding_dim needs num_heads")

    def run(self, x, position_ids, cos_cache, sin_cache):
        w = _work(x)
        if x.ndim == 4:  # (B, N, S, head)
            heads = w.transpose(0, 2, 1, 3)
        elif x.ndim == 3:
            b, s, hidden = x.shape
            head_size = hidden // self.num_heads if self.num_heads else 2 * cos_cache.shape[1]
            if not head_size or hidden % head_size:
                self.fail(f"hidden size {hidden} does not split into heads of {head_size}")
            heads = w.reshape(b, s, hidden // head_size, head_size)
        else:
            self.fail(f"input must be 3-D or 4-D, got shape {x.shape}")
        batch, seq, _, head_size = heads.shape
        dim = self.rotary_dim or head_size
        if dim % 2 or dim > head_size or cos_cache.shape[-1] != dim // 2:
            self.fail(f"rotary dimension {dim} must be even, at most the head size {head_size}, and twice the cos/sin "
                      f"caches' last dimension {cos_cache.shape[-1]}")
        positions = self._positions(position_ids, batch, seq, cos_cache.shape[0])
        cos = _work(cos_cache)[positions][:, :, None, :]
        sin = _work(sin_cache)[positions][:, :, None, :]
        out = _rotate(heads, cos, sin, dim, self.interleaved)
        out = out.transpose(0, 2, 1, 3) if x.ndim == 4 else out.reshape(x.shape)
        return np.ascontiguousarray(out).astype(x.dtype, copy=False)

    def _positions(self, position_ids: np.ndarray, batch: int, seq: int, cached: int) -> np.ndarray:
        if position_ids.size == 1:  # the first position; the sequence follows it
            positions = np.broadcast_to(int(position_ids.reshape(-1)[0]) + np.arange(seq), (batch, seq))
        elif position_ids.shape == (batch, seq):
            positions = position_ids.astype(np.int64)
        else:
            self.fail(f"position_ids must have shape (1,) or ({batch}, {seq}), got {position_ids.shape}")
        if positions.size and (positions.min() < 0 or positions.max() >= cached):
            self.fail(f"positions must be in [0, {cached}) (the cos/sin caches' rows), got {positions.min()} to "
                      f"{positions.max()}")
        return positions


@register("GroupQueryAttention", domain=MS)
class GroupQueryAttention(Kernel):
    """Causal attention with fewer key/value heads than query heads and a key/value cache in (B, kv_heads, length,
    head) layout. For batch entry b, T = seqlens_k[b] + 1 tokens are in the cache after the step; the S new ones sit
    at positions [T - S, T) (a first prompt, S == total_sequence_length, starts at 0 and may be right-padded). The
    cache is past_key's buffer, or a new one of total_sequence_length. Optional: packed QKV, rotary embedding of
    q and k (cos/sin caches), softcap, a local window, an attention bias, per-head sinks or the smooth softmax, and
    as a fourth output the QK scores before (hidden ones 0) or after the softmax, total_sequence_length wide.
    Quantized caches, windowed caches, query_seqlens and Q/K norms are not supported."""

    def setup(self) -> None:
        self.heads = int(self.required_attr("num_heads"))
        self.kv_heads = int(self.required_attr("kv_num_heads"))
        if self.heads <= 0 or self.kv_heads <= 0 or self.heads % self.kv_heads:
            self.fail(f"num_heads ({self.heads}) must be a positive multiple of kv_num_heads ({self.kv_heads})")
        self.scale = float(self.attr("scale", 0.0))
        self.softcap = float(self.attr("softcap", 0.0))
        self.window = int(self.attr("local_window_size", -1))
        self.causal = bool(self.attr("causal", 1))
        self.rotary = bool(self.attr("do_rotary", 0))
        self.interleaved = bool(self.attr("rotary_interleaved", 0))
        self.smooth = bool(self.attr("smooth_softmax", 0))
        self.qk_output = int(self.attr("qk_output", 0))
        if self.attr("sliding_window_cache", 0):
            self.fail("sliding_window_cache=1 (window-sized caches) is not supported")
        for quant in ("k_quant_type", "v_quant_type"):
            if self.attr(quant, "NONE") not in ("NONE", b"NONE"):
                self.fail(f"{quant} other than NONE (quantized caches) is not supported")

    def run(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
            total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None, attention_bias=None,
            head_sink=None, *rest):
        if any(r is not None for r in rest):
            self.fail("k_scale/v_scale, q_norm_weight/k_norm_weight and query_seqlens are not supported")
        if seqlens_k is None or total_sequence_length is None:
            self.fail("seqlens_k and total_sequence_length are required")
        q, k, v = self._split_heads(query, key, value)
        batch, _, seq, head = q.shape
        total = int(np.asarray(total_sequence_length).reshape(-1)[0])
        lengths = np.asarray(seqlens_k).reshape(-1).astype(np.int64) + 1
        first_prompt = past_key is None or seq == total
        starts = np.zeros(batch, np.int64) if first_prompt else lengths - seq
        if self.rotary:
            q, k = self._rotary(q, k, starts, position_ids, cos_cache, sin_cache, first_prompt)
        present_k, present_v = self._caches(past_key, past_value, k, v, starts, lengths, total)
        out, qk = self._attend(q, present_k, present_v, starts, lengths, attention_bias, head_sink)
        qk = None if qk is None else qk[..., :total]
        dtype = query.dtype
        results = [out.transpose(0, 2, 1, 3).reshape(batch, seq, -1).astype(dtype), present_k.astype(dtype),
                   present_v.astype(dtype), None if qk is None else qk.astype(dtype)]
        return _outputs(self.node.outputs, results[:len(self.node.outputs)])

    def _split_heads(self, query, key, value) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q (B, N, S, H), k and v (B, kv_heads, S, H), in float32."""
        w = _work(query)
        batch, seq, width = w.shape
        if key is None:  # packed (B, S, (N + 2 kv_heads) H)
            head = width // (self.heads + 2 * self.kv_heads)
            w = w.reshape(batch, seq, self.heads + 2 * self.kv_heads, head)
            q, k, v = np.split(w, [self.heads, self.heads + self.kv_heads], axis=2)
        else:
            head = width // self.heads
            q = w.reshape(batch, seq, self.heads, head)
            k = _work(key).reshape(batch, key.shape[1], self.kv_heads, head)
            v = _work(value).reshape(batch, value.shape[1], self.kv_heads, -1)
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def _rotary(self, q, k, starts, position_ids, cos_cache, sin_cache, first_prompt):
        if cos_cache is None or sin_cache is None:
            self.fail("do_rotary needs cos_cache and sin_cache")
        batch, _, seq, head = q.shape
        if position_ids is not None and not first_prompt:
            positions = np.asarray(position_ids, np.int64).reshape(batch, seq)
        else:
            positions = starts[:, None] + np.arange(seq)[None, :]
        if positions.max(initial=0) >= cos_cache.shape[0]:
            self.fail(f"position {positions.max()} is past the cos/sin caches' {cos_cache.shape[0]} rows")
        cos = _work(cos_cache)[positions][:, None]
        sin = _work(sin_cache)[positions][:, None]
        dim = 2 * cos_cache.shape[1]
        return (_rotate(q, cos, sin, dim, self.interleaved), _rotate(k, cos, sin, dim, self.interleaved))

    def _caches(self, past_key, past_value, k, v, starts, lengths, total) -> tuple[np.ndarray, np.ndarray]:
        """The present caches: the past's rows before each entry's start, the new rows from it."""
        batch, kv_heads, seq, head = k.shape
        capacity = max(total, 0 if past_key is None else past_key.shape[2])
        present_k = np.zeros((batch, kv_heads, capacity, head), np.float32)
        present_v = np.zeros((batch, kv_heads, capacity, v.shape[-1]), np.float32)
        for b in range(batch):
            start = int(starts[b])
            if start + seq > capacity or start < 0:
                self.fail(f"batch entry {b}: {seq} new tokens from position {start} do not fit a cache of {capacity}")
            if past_key is not None and start:
                present_k[b, :, :start] = _work(past_key[b, :, :start])
                present_v[b, :, :start] = _work(past_value[b, :, :start])
            present_k[b, :, start:start + seq] = k[b]
            present_v[b, :, start:start + seq] = v[b]
        return present_k, present_v

    def _attend(self, q, k, v, starts, lengths, attention_bias, head_sink):
        batch, heads, seq, head = q.shape
        capacity = k.shape[2]
        group = heads // self.kv_heads
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        scale = self.scale or 1 / np.sqrt(head)
        scores = np.matmul(q * np.float32(scale), k.swapaxes(-1, -2))
        if self.softcap > 0:
            scores = self.softcap * np.tanh(scores / self.softcap)
        if attention_bias is not None:
            bias = _work(attention_bias)
            scores = scores + bias[..., :capacity] if bias.shape[-1] >= capacity else scores + np.pad(
                bias, [(0, 0)] * (bias.ndim - 1) + [(0, capacity - bias.shape[-1])])
        positions = starts[:, None] + np.arange(seq)[None, :]  # (B, S) absolute query positions
        key_at = np.arange(capacity)[None, None, :]
        visible = key_at < lengths[:, None, None]
        if self.causal:
            visible = visible & (key_at <= positions[:, :, None])
        if self.window > 0:
            visible = visible & (key_at > positions[:, :, None] - self.window)
        raw = np.where(visible[:, None], scores, 0) if self.qk_output == 1 else None  # hidden scores read 0
        scores = np.where(visible[:, None], scores, -np.inf).astype(np.float32)
        probs = self._softmax(scores, head_sink)
        out = np.matmul(probs, v)
        qk = raw if self.qk_output == 1 else probs if self.qk_output == 2 else None
        return out, qk

    def _softmax(self, scores: np.ndarray, head_sink) -> np.ndarray:
        peak = np.max(scores, axis=-1, keepdims=True)
        if head_sink is not None:
            sink = _work(head_sink).reshape(1, -1, 1, 1)
            peak = np.maximum(peak, sink)
        elif self.smooth:
            peak = np.maximum(peak, 0)
        peak = np.where(np.isfinite(peak), peak, 0)
        e = np.exp(scores - peak)
        total = np.sum(e, axis=-1, keepdims=True)
        if head_sink is not None:
            total = total + np.exp(sink - peak)
        elif self.smooth:
            total = total + np.exp(-peak)
        return e / np.where(total == 0, 1, total)


@register("DecoderMaskedMultiHeadAttention", domain=MS)
class DecoderMaskedMultiHeadAttention(Kernel):
    """One decoding step of multi-head attention (query length 1), as onnxruntime's beam search graphs use it.
    Self attention appends the new key/value to the past (B, N, P, H), in a new cache or, with
    past_present_share_buffer, in the past's max-length buffer at past_sequence_length; with beam search,
    cache_indirection[b, beam, t] names the beam whose cache row t a beam reads. Cross attention takes key/value
    as (B, N, L, H) caches. Optional: packed QKV, projection bias, a (B, total) 0/1 mask, an attention bias, and the
    scaled QK scores as a fourth output."""

    def setup(self) -> None:
        self.heads = int(self.required_attr("num_heads"))
        if self.heads <= 0:
            self.fail(f"num_heads must be positive, got {self.heads}")
        self.scale = float(self.attr("scale", 0.0))
        self.fill = float(self.attr("mask_filter_value", -10000.0))
        self.shared = bool(self.attr("past_present_share_buffer", 0))

    def run(self, query, key=None, value=None, mask_index=None, attention_bias=None, past_key=None,
            past_value=None, past_sequence_length=None, beam_width=None, cache_indirection=None, bias=None):
        if query.ndim != 3 or query.shape[1] != 1:
            self.fail(f"query must be (batch, 1, hidden), got shape {query.shape}")
        q, k_new, v_new = self._projections(query, key, value, bias)
        batch = q.shape[0]
        cross = key is not None and key.ndim == 4
        if cross:
            keys, values = _work(key), _work(value)
            present = (None, None)
        else:
            keys, values, present = self._self_cache(k_new, v_new, past_key, past_value, past_sequence_length)
            if cache_indirection is not None:
                keys, values = self._follow_beams(keys, values, cache_indirection, beam_width)
        total = keys.shape[2]
        head = q.shape[-1]
        scores = np.matmul(q * np.float32(self.scale or 1 / np.sqrt(head)), keys.swapaxes(-1, -2))
        if mask_index is not None:
            scores = np.where(np.asarray(mask_index)[:batch, None, None, :total] == 0, np.float32(self.fill), scores)
        if attention_bias is not None:
            scores = scores + _work(attention_bias)[..., :total]
        qk = scores
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.matmul(probs, values).transpose(0, 2, 1, 3).reshape(batch, 1, -1)
        dtype = query.dtype
        results = [out.astype(dtype), *(None if p is None else p.astype(dtype) for p in present), qk.astype(dtype)]
        return _outputs(self.node.outputs, results[:len(self.node.outputs)])

    def _projections(self, query, key, value, bias) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """q (B, N, 1, H) and, for self attention, the new k and v (B, N, 1, H), projection bias added."""
        w = _work(query)
        batch = w.shape[0]
        if key is None:  # packed (B, 1, 3 D)
            hidden = w.shape[-1] // 3
            parts = [w[..., :hidden], w[..., hidden:2 * hidden], w[..., 2 * hidden:]]
        elif key.ndim == 3:
            parts = [w, _work(key), _work(value)]
        else:
            parts = [w, None, None]
        if bias is not None:
            b, d = _work(bias), parts[0].shape[-1]
            spans = [(0, d), (d, 2 * d), (2 * d, None)]
            parts = [None if p is None else p + b[lo:hi] for p, (lo, hi) in zip(parts, spans)]
        heads = [None if p is None else p.reshape(batch, 1, self.heads, -1).transpose(0, 2, 1, 3) for p in parts]
        return heads[0], heads[1], heads[2]

    def _self_cache(self, k, v, past_key, past_value, past_sequence_length):
        """(keys, values) to attend over and the present caches."""
        if past_key is None:
            return k, v, (k, v)
        if not self.shared:
            keys = np.concatenate([_work(past_key), k], axis=2)
            values = np.concatenate([_work(past_value), v], axis=2)
            return keys, values, (keys, values)
        if past_sequence_length is None:
            self.fail("past_present_share_buffer needs past_sequence_length")
        past = int(np.asarray(past_sequence_length).reshape(-1)[0])
        if past >= past_key.shape[2]:
            self.fail(f"past_sequence_length {past} leaves no room in a cache of {past_key.shape[2]}")
        present_k, present_v = _work(past_key).copy(), _work(past_value).copy()
        present_k[:, :, past:past + 1] = k
        present_v[:, :, past:past + 1] = v
        return present_k[:, :, :past + 1], present_v[:, :, :past + 1], (present_k, present_v)

    def _follow_beams(self, keys, values, cache_indirection, beam_width):
        """Row t of beam j reads the cache of the beam cache_indirection[b, j, t] (the newest row is its own)."""
        beams = int(np.asarray(beam_width).reshape(-1)[0]) if beam_width is not None else 1
        batch_beams, _, total, _ = keys.shape
        if beams <= 1:
            return keys, values
        source = np.asarray(cache_indirection, np.int64).reshape(batch_beams, -1)[:, :total].copy()
        source[:, total - 1] = np.arange(batch_beams) % beams
        rows = (np.arange(batch_beams) // beams * beams)[:, None] + source
        steps = np.arange(total)[None, :]
        return (keys[rows, :, steps].transpose(0, 2, 1, 3), values[rows, :, steps].transpose(0, 2, 1, 3))
