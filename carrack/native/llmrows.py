"""The Python side of llmrows.c: the GGUF decoder's row kernels (RMS norm, SiLU(gate) * up, rotary embedding,
causal attention over the KV cache) split over the run's threads.

Each function returns None (rope: False) when the native library is not available; carrack/llm/model.py then runs
its numpy statement of the same step, which the tests hold these kernels to.
"""

from __future__ import annotations

import ctypes

import numpy as np

from carrack import native
from carrack.native import data_address

#: elements below which a row kernel stays on one thread (the pool's hand-off costs more than it saves)
PARALLEL_MIN = 1 << 14

_F32 = np.dtype(np.float32)


def library() -> ctypes.CDLL | None:
    """llmrows.c compiled, with its signatures declared (None when native kernels are unavailable)."""
    return native.declared_library("llmrows", _declare)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.carrack_llm_rms_norm.argtypes = [p, i64, p, p, p, i64, i64, i64, f32, i64]
    lib.carrack_llm_silu_mul.argtypes = [p, i64, p, i64, p, i64, i64, i64]
    lib.carrack_llm_rope.argtypes = [p, i64, i64, i64, i64, i64, p, p, i32, i64]
    for fn in (lib.carrack_llm_rms_norm, lib.carrack_llm_silu_mul, lib.carrack_llm_rope):
        fn.restype = None
    lib.carrack_llm_attention.argtypes = [p, i64, p, p, i64, p, i64, i64, i64, i64, i64, f32, f32, i64, i64]
    lib.carrack_llm_attention.restype = i32


def _threads(threads: int | None, rows: int, elements: int) -> int:
    if elements < 2 * PARALLEL_MIN:
        return 1
    return max(1, min(threads or native.threads(), rows))


def _rows(a: np.ndarray, name: str) -> tuple[np.ndarray, int]:
    """a (rows, n) as float32 whose rows are contiguous and aligned, and its row stride in elements (a view of a
    wider array, such as the columns of a fused projection, is used in place)."""
    if a.ndim != 2:
        raise ValueError(f"llmrows: {name} must be 2-D (rows, values), got shape {list(a.shape)}")
    if not (a.dtype == _F32 and a.flags.aligned and (a.strides[1] == 4 or a.shape[1] <= 1)
            and a.strides[0] % 4 == 0 and a.strides[0] >= 0):
        a = np.ascontiguousarray(a, dtype=np.float32)
    return a, (a.strides[0] // 4 if a.shape[0] > 1 else a.shape[1])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, threads: int | None = None) -> np.ndarray | None:
    """x * (1 / sqrt(mean(x**2, axis=-1) + eps)) * weight for x (rows, n), as a new float32 array."""
    lib = library()
    if lib is None:
        return None
    x, x_stride = _rows(x, "x")
    rows, n = x.shape
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.shape != (n,):
        raise ValueError(f"llmrows: RMS norm weight has shape {list(weight.shape)}, expected [{n}]")
    y = np.empty((rows, n), np.float32)
    lib.carrack_llm_rms_norm(data_address(x), x_stride, None, data_address(weight), data_address(y), n, rows, n,
                             float(eps), _threads(threads, rows, x.size))
    return y


def add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float, threads: int | None = None,
                 ) -> np.ndarray | None:
    """x += residual in place (x: a C-contiguous, writable float32 (rows, n) array), then rms_norm(x, weight, eps)
    as a new array: the decoder's residual stream and the next norm in one pass."""
    lib = library()
    if lib is None:
        return None
    if not (x.ndim == 2 and x.dtype == _F32 and x.flags.c_contiguous and x.flags.aligned and x.flags.writeable):
        raise ValueError(f"llmrows: add_rms_norm updates x in place: it must be a C-contiguous writable float32 "
                         f"(rows, n) array, got {x.dtype} {list(x.shape)}")
    rows, n = x.shape
    residual = np.ascontiguousarray(residual, dtype=np.float32)
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if residual.shape != x.shape or weight.shape != (n,):
        raise ValueError(f"llmrows: add_rms_norm needs a residual of x's shape {list(x.shape)} and a weight of "
                         f"[{n}], got {list(residual.shape)} and {list(weight.shape)}")
    if np.may_share_memory(residual, x):
        residual = residual.copy()
    y = np.empty((rows, n), np.float32)
    lib.carrack_llm_rms_norm(data_address(x), n, data_address(residual), data_address(weight), data_address(y), n,
                             rows, n, float(eps), _threads(threads, rows, x.size))
    return y


def silu_mul(gate: np.ndarray, up: np.ndarray, threads: int | None = None) -> np.ndarray | None:
    """gate / (1 + exp(-gate)) * up for gate and up (rows, n), as a new float32 array."""
    lib = library()
    if lib is None:
        return None
    if gate.shape != up.shape:
        raise ValueError(f"llmrows: gate {list(gate.shape)} and up {list(up.shape)} must have the same shape")
    gate, gate_stride = _rows(gate, "gate")
    up, up_stride = _rows(up, "up")
    rows, n = gate.shape
    y = np.empty((rows, n), np.float32)
    lib.carrack_llm_silu_mul(data_address(gate), gate_stride, data_address(up), up_stride, data_address(y), rows, n,
                             _threads(threads, rows, gate.size))
    return y


def rope_(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, head_dim: int, rope_dim: int, neox: bool,
          threads: int | None = None) -> bool:
    """Rotate x (rows, heads * head_dim) in place, row i by the angles cos[i], sin[i] (rope_dim / 2 values each):
    pairs (2j, 2j + 1) of each head's first rope_dim values, or (j, j + rope_dim / 2) for NeoX. x must be float32
    with contiguous, aligned rows. False without the native library."""
    lib = library()
    if lib is None:
        return False
    if (x.ndim != 2 or x.dtype != _F32 or not x.flags.aligned or not x.flags.writeable or x.strides[1] != 4
            or x.shape[1] % head_dim or rope_dim > head_dim or rope_dim % 2):
        raise ValueError(f"llmrows: rope needs a writable float32 (rows, heads * {head_dim}) array with contiguous "
                         f"rows and an even rope_dim <= head_dim, got {x.dtype} {list(x.shape)}, rope_dim {rope_dim}")
    rows = x.shape[0]
    cos = np.ascontiguousarray(cos, dtype=np.float32)
    sin = np.ascontiguousarray(sin, dtype=np.float32)
    if cos.shape != (rows, rope_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"llmrows: rope angles must be ({rows}, {rope_dim // 2}), got cos {list(cos.shape)}, "
                         f"sin {list(sin.shape)}")
    stride = x.strides[0] // 4 if rows > 1 else x.shape[1]
    lib.carrack_llm_rope(data_address(x), stride, rows, x.shape[1] // head_dim, head_dim, rope_dim,
                         data_address(cos), data_address(sin), int(neox), _threads(threads, rows, x.size))
    return True


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int, scale: float, window: int = 0,
              threads: int | None = None, softcap: float = 0.0) -> np.ndarray | None:
    """Causal attention of n query positions start.. over one layer's cache.

    q: (n, n_head * head_dim) float32 (rows may be a view of a wider array); k_cache, v_cache: (n_head_kv, n_ctx,
    head_dim) float32 C-contiguous, holding keys and values at positions [0, start + n). Returns (n, n_head *
    head_dim): softmax(q k^T * scale + mask) v per head, query head h reading KV head h // (n_head / n_head_kv);
    the mask hides later positions and, with window > 0, keys window or more positions back; softcap > 0 caps the
    scores first as tanh(score / softcap) * softcap (gemma2)."""
    lib = library()
    if lib is None:
        return None
    if k_cache.ndim != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"llmrows: k and v caches must be (n_head_kv, n_ctx, head_dim) alike, got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    for cache in (k_cache, v_cache):
        if cache.dtype != _F32 or not cache.flags.c_contiguous or not cache.flags.aligned:
            raise ValueError("llmrows: k and v caches must be C-contiguous aligned float32 arrays")
    n_head_kv, n_ctx, head_dim = k_cache.shape
    q, q_stride = _rows(q, "q")
    n = q.shape[0]
    if q.shape[1] % head_dim or (q.shape[1] // head_dim) % n_head_kv:
        raise ValueError(f"llmrows: q has {q.shape[1]} values a row, not a multiple of {n_head_kv} KV heads of "
                         f"{head_dim}")
    if start < 0 or start + n > n_ctx:
        raise ValueError(f"llmrows: positions {start}..{start + n - 1} do not fit the cache of {n_ctx}")
    n_head = q.shape[1] // head_dim
    out = np.empty((n, n_head * head_dim), np.float32)
    items = n_head_kv * n * (n_head // n_head_kv)
    threads = 1 if items * (start + n) * head_dim < PARALLEL_MIN else max(1, threads or native.threads())
    status = lib.carrack_llm_attention(data_address(q), q_stride, data_address(k_cache), data_address(v_cache), n_ctx,
                                       data_address(out), n, start, n_head, n_head_kv, head_dim, float(scale),
                                       float(softcap), int(window), threads)
    if status == -2:
        raise MemoryError(f"llmrows: no memory for the attention scratch of {n} queries over {start + n} keys")
    return out
