"""The decoder forward of GGUF language models, with a KV cache preallocated for n_ctx and written in place.

`Decoder.forward(tokens, start)` runs a batch of tokens at positions start.. (the prompt as matrix-matrix
products, then one token at a time) and returns their logits. Nothing is compiled or re-planned per step: every
buffer that depends only on n_ctx (KV cache, rope tables) is allocated once, and the per-token Python work is a
fixed number of numpy / native calls per layer, whatever the size of the weights (float weights: one BLAS call
per matrix; Q8_0, Q4_0, Q4_K, Q6_K: one native call per matrix. Only the numpy fallback for other quantized types,
or without a C compiler, walks a matrix in chunks of ~4 MiB of decoded rows). The steps between the products
(RMS norms with the residual add, rope, attention over the cache, SiLU * up) run in carrack/native/llmrows.c on the
same threads; the numpy functions below state them and run when the native library is not there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from carrack.errors import InvalidArgument, InvalidModel, MemoryLimitExceeded
from carrack.gguf.reader import GGUFFile, read_gguf
from carrack.llm.hparams import HParams, read_hparams
from carrack.llm.weights import Linear, SharedInputProducts, WeightStore
from carrack.native import llmrows


@dataclass
class Layer:
    attn_norm: np.ndarray
    wq: Linear | None
    wk: Linear | None
    wv: Linear | None
    wqkv: Linear | None
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    wo: Linear
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    attn_post_norm: np.ndarray | None
    ffn_norm: np.ndarray
    w_gate: Linear | None
    w_up: Linear
    w_down: Linear
    ffn_post_norm: np.ndarray | None
    qkv: SharedInputProducts | None = None  # wq, wk, wv grouped (None with a fused wqkv)
    gate_up: SharedInputProducts | None = None  # w_gate, w_up grouped (None with a fused gate_up)

    def __post_init__(self) -> None:
        if self.wqkv is None:
            self.qkv = SharedInputProducts([self.wq, self.wk, self.wv])
        if self.w_gate is not None:
            self.gate_up = SharedInputProducts([self.w_gate, self.w_up])


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes the model needs before the first token: weights as held, the KV cache, and the largest scratch."""

    weight_bytes: int
    kv_cache_bytes: int
    scratch_bytes: int
    float_copies: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.scratch_bytes

    def summary(self) -> str:
        mib = 1 << 20
        lines = [f"weights  {self.weight_bytes / mib:10.2f} MiB",
                 f"KV cache {self.kv_cache_bytes / mib:10.2f} MiB",
                 f"scratch  {self.scratch_bytes / mib:10.2f} MiB",
                 f"total    {self.total_bytes / mib:10.2f} MiB"]
        if self.float_copies:
            lines.append(f"note: {len(self.float_copies)} F16/BF16 matrices are held as float32")
        return "\n".join(lines)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(variance + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives the right limit, -0
        return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)))


class Decoder:
    """A decoder-only transformer read from a GGUF file (architectures in carrack.llm.hparams.ARCHITECTURES)."""

    def __init__(self, model: str | os.PathLike[str] | GGUFFile, n_ctx: int = 0, n_batch: int = 512,
                 dequantize: bool = False, memory_limit_bytes: int | None = None, n_threads: int | None = None,
                 activations: str = "int8"):
        self.gguf = model if isinstance(model, GGUFFile) else read_gguf(model)
        metadata = self.gguf.metadata
        store = WeightStore(self.gguf, str(metadata.get("general.architecture")), dequantize_all=dequantize,
                            threads=n_threads, activations=activations)
        self.token_embd = store.tensor("token_embd.weight")
        if len(self.token_embd.shape) != 2:
            raise InvalidModel(f"{self.gguf.path}: token_embd.weight must be 2-D, got {list(self.token_embd.shape)}")
        self.hp: HParams = read_hparams(metadata, self.token_embd.shape[0], self.gguf.path)
        hp = self.hp
        if self.token_embd.shape[1] != hp.n_embd:
            raise InvalidModel(f"{self.gguf.path}: token_embd.weight has {self.token_embd.shape[1]} columns, "
                               f"expected embedding_length {hp.n_embd}")
        self.n_ctx = int(n_ctx) or hp.n_ctx_train
        self.n_batch = max(1, int(n_batch))
        self.threads = n_threads  # of the native row kernels (None: the run's count)
        self.embeddings = store.matrix("token_embd.weight", (hp.n_vocab, hp.n_embd))
        self.layers = [self._load_layer(store, i) for i in range(hp.n_layer)]
        self.output_norm = store.vector("output_norm.weight", hp.n_embd)
        self.output = (store.matrix("output.weight", (hp.n_vocab, hp.n_embd)) if store.has("output.weight")
                       else self.embeddings)
        self.float_copies = tuple(store.float_copies)
        rope_factors = store.optional_vector("rope_freqs.weight", hp.rope_dim // 2)
        self.cos, self.sin = _rope_tables(hp, self.n_ctx, rope_factors)
        self.kv_shape = (hp.n_layer, hp.n_head_kv, self.n_ctx, hp.head_dim)
        plan = self.memory_plan()
        if memory_limit_bytes is not None and plan.total_bytes > memory_limit_bytes:
            raise MemoryLimitExceeded(f"{self.gguf.path} with n_ctx={self.n_ctx}, n_batch={self.n_batch} needs "
                                      f"{plan.total_bytes:,} bytes (weights {plan.weight_bytes:,}, KV cache "
                                      f"{plan.kv_cache_bytes:,}, scratch {plan.scratch_bytes:,}), more than "
                                      f"memory_limit_bytes={memory_limit_bytes:,}")
        self.k_cache = np.zeros(self.kv_shape, dtype=np.float32)
        self.v_cache = np.zeros(self.kv_shape, dtype=np.float32)
        self.n_past = 0  # positions of the cache that hold valid keys and values
        self.gguf.prefault()  # the weights' pages mapped now, not one fault per 4 KiB inside the first prompt

    def _load_layer(self, store: WeightStore, i: int) -> Layer:
        hp, arch = self.hp, self.hp.arch
        p = f"blk.{i}."
        q_rows, kv_rows = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        fused_qkv = arch.fused_qkv or store.has(p + "attn_qkv.weight")
        if fused_qkv:
            wqkv = store.matrix(p + "attn_qkv.weight", (q_rows + 2 * kv_rows, hp.n_embd))
            wq = wk = wv = None
        else:
            wqkv = None
            wq = store.matrix(p + "attn_q.weight", (q_rows, hp.n_embd))
            wk = store.matrix(p + "attn_k.weight", (kv_rows, hp.n_embd))
            wv = store.matrix(p + "attn_v.weight", (kv_rows, hp.n_embd))
        fused_gate_up = arch.fused_gate_up and not store.has(p + "ffn_gate.weight")
        return Layer(
            attn_norm=store.vector(p + "attn_norm.weight", hp.n_embd),
            wq=wq, wk=wk, wv=wv, wqkv=wqkv,
            bq=store.optional_vector(p + "attn_q.bias", q_rows),
            bk=store.optional_vector(p + "attn_k.bias", kv_rows),
            bv=store.optional_vector(p + "attn_v.bias", kv_rows),
            wo=store.matrix(p + "attn_output.weight", (hp.n_embd, q_rows)),
            q_norm=store.vector(p + "attn_q_norm.weight", hp.head_dim) if arch.qk_norm else None,
            k_norm=store.vector(p + "attn_k_norm.weight", hp.head_dim) if arch.qk_norm else None,
            attn_post_norm=store.vector(p + "attn_post_norm.weight", hp.n_embd) if arch.post_norms else None,
            ffn_norm=store.vector(p + "ffn_norm.weight", hp.n_embd),
            w_gate=None if fused_gate_up else store.matrix(p + "ffn_gate.weight", (hp.n_ff, hp.n_embd)),
            w_up=store.matrix(p + "ffn_up.weight", ((2 if fused_gate_up else 1) * hp.n_ff, hp.n_embd)),
            w_down=store.matrix(p + "ffn_down.weight", (hp.n_embd, hp.n_ff)),
            ffn_post_norm=store.vector(p + "ffn_post_norm.weight", hp.n_embd) if arch.post_norms else None,
        )

    # ---------------------------------------------------------------------------------------------------------
    # memory

    def memory_plan(self) -> MemoryPlan:
        hp = self.hp
        matrices = {id(m): m for layer in self.layers for m in _layer_matrices(layer)}
        matrices[id(self.embeddings)] = self.embeddings
        matrices[id(self.output)] = self.output
        weight_bytes = sum(m.nbytes for m in matrices.values())
        weight_bytes += sum(v.nbytes for layer in self.layers for v in _layer_vectors(layer))
        weight_bytes += self.output_norm.nbytes + self.cos.nbytes + self.sin.nbytes
        n = self.n_batch
        activations = 4 * n * (4 * hp.n_embd + 3 * hp.n_head * hp.head_dim + 3 * hp.n_ff)
        attention = 4 * 3 * hp.n_head * n * self.n_ctx
        logits = 4 * n * hp.n_vocab
        products = max(m.scratch_bytes(n) for m in matrices.values())
        return MemoryPlan(weight_bytes, 2 * 4 * int(np.prod(self.kv_shape)),
                          activations + attention + logits + products, self.float_copies)

    # ---------------------------------------------------------------------------------------------------------
    # forward

    def reset(self) -> None:
        self.n_past = 0

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        x = self.embeddings.rows(tokens).astype(np.float32, copy=False)
        if self.hp.arch.embedding_scale:
            x = x * np.float32(np.sqrt(self.hp.n_embd))
        return x

    def forward(self, tokens: np.ndarray | list[int], start: int | None = None, all_logits: bool = True) -> np.ndarray:
        """Logits (float32, [len(tokens), n_vocab], or [1, n_vocab] for the last token when not `all_logits`) of
        `tokens` at positions start..; their keys and values are written to the cache and n_past moves past them."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        start = self.n_past if start is None else int(start)
        if tokens.size == 0:
            raise InvalidArgument("no tokens to evaluate")
        if tokens.min() < 0 or tokens.max() >= self.hp.n_vocab:
            bad = int(tokens[(tokens < 0) | (tokens >= self.hp.n_vocab)][0])
            raise InvalidArgument(f"token id {bad} is outside the vocabulary (0..{self.hp.n_vocab - 1})")
        if start < 0 or start + tokens.size > self.n_ctx:
            raise InvalidArgument(f"{start + tokens.size} positions do not fit the context of n_ctx={self.n_ctx} "
                                  "tokens")
        outputs = []
        for chunk_start in range(0, tokens.size, self.n_batch):
            chunk = tokens[chunk_start:chunk_start + self.n_batch]
            last_chunk = chunk_start + self.n_batch >= tokens.size
            hidden = self._forward_chunk(chunk, start + chunk_start)
            if all_logits:
                outputs.append(self._logits(hidden))
            elif last_chunk:
                outputs.append(self._logits(hidden[-1:]))
        self.n_past = start + tokens.size
        return np.concatenate(outputs) if len(outputs) > 1 else outputs[0]

    def _forward_chunk(self, tokens: np.ndarray, start: int) -> np.ndarray:
        hp = self.hp
        # the residual stream, updated in place (each residual add is fused with the norm that follows it)
        x = np.require(self.embed(tokens), np.float32, ("C_CONTIGUOUS", "ALIGNED", "WRITEABLE", "OWNDATA"))
        positions = slice(start, start + tokens.size)
        cos, sin = self.cos[positions], self.sin[positions]
        masks = {sliding: _attention_mask(start, tokens.size, hp.sliding_window if sliding else 0)
                 for sliding in {hp.uses_sliding_window(i) for i in range(hp.n_layer)}}
        h = self._rms_norm(x, self.layers[0].attn_norm)
        for index, layer in enumerate(self.layers):
            attn = self._attention(layer, index, h, start, cos, sin, masks[hp.uses_sliding_window(index)])
            if layer.attn_post_norm is not None:
                attn = self._rms_norm(attn, layer.attn_post_norm)
            h = self._add_rms_norm(x, attn, layer.ffn_norm)
            ffn = self._feed_forward(layer, h)
            if layer.ffn_post_norm is not None:
                ffn = self._rms_norm(ffn, layer.ffn_post_norm)
            if index + 1 < len(self.layers):
                h = self._add_rms_norm(x, ffn, self.layers[index + 1].attn_norm)
            else:
                x += ffn
        return x

    def _rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        y = llmrows.rms_norm(x, weight, self.hp.rms_eps, self.threads) if x.ndim == 2 else None
        return rms_norm(x, weight, self.hp.rms_eps) if y is None else y

    def _add_rms_norm(self, x: np.ndarray, residual: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """x += residual (in place), then the RMS norm of x with `weight`."""
        y = llmrows.add_rms_norm(x, residual, weight, self.hp.rms_eps, self.threads)
        if y is None:
            x += residual
            y = rms_norm(x, weight, self.hp.rms_eps)
        return y

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        h = self._rms_norm(hidden, self.output_norm)
        logits = np.asarray(self.output(h), dtype=np.float32)
        if self.hp.final_softcap:
            cap = np.float32(self.hp.final_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits

    def _projections(self, layer: Layer, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        hp = self.hp
        if layer.wqkv is not None:
            qkv = layer.wqkv(h)
            q_rows, kv_rows = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
            q, k, v = qkv[:, :q_rows], qkv[:, q_rows:q_rows + kv_rows], qkv[:, q_rows + kv_rows:]
        else:
            q, k, v = layer.qkv(h)
        if layer.bq is not None:
            q = q + layer.bq
        if layer.bk is not None:
            k = k + layer.bk
        if layer.bv is not None:
            v = v + layer.bv
        return q, k, v

    def _attention(self, layer: Layer, index: int, h: np.ndarray, start: int, cos: np.ndarray,
                   sin: np.ndarray, mask: np.ndarray) -> np.ndarray:
        hp = self.hp
        n = h.shape[0]
        q, k, v = self._projections(layer, h)
        if llmrows.library() is not None:
            window = hp.sliding_window if hp.uses_sliding_window(index) else 0
            return layer.wo(self._native_attention(layer, index, q, k, v, start, cos, sin, window))
        q = q.reshape(n, hp.n_head, hp.head_dim).transpose(1, 0, 2)  # (heads, n, head_dim)
        k = k.reshape(n, hp.n_head_kv, hp.head_dim).transpose(1, 0, 2)
        v = v.reshape(n, hp.n_head_kv, hp.head_dim).transpose(1, 0, 2)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, hp.rms_eps)
            k = rms_norm(k, layer.k_norm, hp.rms_eps)
        q = _apply_rope(q, cos, sin, hp.rope_dim, hp.arch.rope_neox)
        k = _apply_rope(k, cos, sin, hp.rope_dim, hp.arch.rope_neox)
        end = start + n
        self.k_cache[index, :, start:end] = k
        self.v_cache[index, :, start:end] = v
        keys = self.k_cache[index, :, :end]  # (kv_heads, end, head_dim)
        values = self.v_cache[index, :, :end]
        group = hp.n_head // hp.n_head_kv
        q = q.reshape(hp.n_head_kv, group * n, hp.head_dim)  # heads sharing a kv head side by side
        scores = (q * np.float32(hp.attention_scale)) @ keys.transpose(0, 2, 1)  # (kv_heads, group * n, end)
        if hp.attn_softcap:
            cap = np.float32(hp.attn_softcap)
            scores = np.tanh(scores / cap) * cap
        scores = scores.reshape(hp.n_head_kv, group, n, end)
        scores += mask
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = scores.reshape(hp.n_head_kv, group * n, end) @ values  # (kv_heads, group * n, head_dim)
        out = out.reshape(hp.n_head, n, hp.head_dim).transpose(1, 0, 2).reshape(n, hp.n_head * hp.head_dim)
        return layer.wo(out)

    def _native_attention(self, layer: Layer, index: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int,
                          cos: np.ndarray, sin: np.ndarray, window: int) -> np.ndarray:
        """_attention's steps after the projections in llmrows.c, on the run's threads: q / k norms, rope in
        place, the new keys and values into the cache, causal attention; returns (n, n_head * head_dim)."""
        hp, n, d = self.hp, q.shape[0], self.hp.head_dim
        if layer.q_norm is not None:
            q = self._rms_norm(q.reshape(n * hp.n_head, d), layer.q_norm).reshape(n, hp.n_head * d)
            k = self._rms_norm(k.reshape(n * hp.n_head_kv, d), layer.k_norm).reshape(n, hp.n_head_kv * d)
        q, k = _writable_rows(q), _writable_rows(k)
        llmrows.rope_(q, cos, sin, d, hp.rope_dim, hp.arch.rope_neox, self.threads)
        llmrows.rope_(k, cos, sin, d, hp.rope_dim, hp.arch.rope_neox, self.threads)
        end = start + n
        self.k_cache[index, :, start:end] = k.reshape(n, hp.n_head_kv, d).transpose(1, 0, 2)
        self.v_cache[index, :, start:end] = v.reshape(n, hp.n_head_kv, d).transpose(1, 0, 2)
        return llmrows.attention(q, self.k_cache[index], self.v_cache[index], start, hp.attention_scale, window,
                                 self.threads, hp.attn_softcap)

    def _feed_forward(self, layer: Layer, h: np.ndarray) -> np.ndarray:
        if layer.w_gate is None:
            gate_up = layer.w_up(h)
            gate, up = gate_up[:, :self.hp.n_ff], gate_up[:, self.hp.n_ff:]
        else:
            gate, up = layer.gate_up(h)
        if self.hp.arch.activation != "gelu_tanh":
            product = llmrows.silu_mul(gate, up, self.threads)
            if product is not None:
                return layer.w_down(product)
        activated = gelu_tanh(gate) if self.hp.arch.activation == "gelu_tanh" else silu(gate)
        return layer.w_down(activated * up)


def _writable_rows(a: np.ndarray) -> np.ndarray:
    """a itself when llmrows can rotate it in place (float32, aligned, writable, contiguous rows), else a copy."""
    if a.dtype == np.float32 and a.flags.aligned and a.flags.writeable and a.strides[1] == 4:
        return a
    return np.array(a, dtype=np.float32, order="C")


def _attention_mask(start: int, n: int, window: int) -> np.ndarray:
    """Additive mask (n, start + n) of queries at positions start.. over the keys before them: causal, and with a
    sliding `window` (> 0) keys at most window - 1 positions back."""
    query_pos = np.arange(start, start + n)[:, None]
    key_pos = np.arange(start + n)[None, :]
    hidden = key_pos > query_pos
    if window > 0:
        hidden |= query_pos - key_pos >= window
    return np.where(hidden, np.float32(-np.inf), np.float32(0.0))


def _rope_tables(hp: HParams, n_ctx: int, factors: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of position * frequency, (n_ctx, rope_dim / 2): positions scaled by linear rope scaling,
    frequencies divided by rope_freqs if given."""
    inv_freq = 1.0 / (hp.rope_base ** (np.arange(0, hp.rope_dim, 2, dtype=np.float32) / np.float32(hp.rope_dim)))
    inv_freq = inv_freq.astype(np.float32)
    if factors is not None:
        inv_freq = inv_freq / factors
    positions = np.arange(n_ctx, dtype=np.float32) * np.float32(hp.rope_freq_scale)
    angles = positions[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int, neox: bool) -> np.ndarray:
    """Rotate the first rope_dim values of each head of x (heads, n, head_dim) by the angles of its position."""
    half = rope_dim // 2
    out = np.array(x, dtype=np.float32, copy=True)
    if neox:
        a, b = x[..., :half], x[..., half:rope_dim]
        out[..., :half] = a * cos - b * sin
        out[..., half:rope_dim] = b * cos + a * sin
    else:
        a, b = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
        out[..., 0:rope_dim:2] = a * cos - b * sin
        out[..., 1:rope_dim:2] = b * cos + a * sin
    return out


def _layer_matrices(layer: Layer) -> list[Linear]:
    return [m for m in (layer.wq, layer.wk, layer.wv, layer.wqkv, layer.wo, layer.w_gate, layer.w_up, layer.w_down)
            if m is not None]


def _layer_vectors(layer: Layer) -> list[np.ndarray]:
    return [v for v in (layer.attn_norm, layer.bq, layer.bk, layer.bv, layer.q_norm, layer.k_norm,
                        layer.attn_post_norm, layer.ffn_norm, layer.ffn_post_norm) if v is not None]
