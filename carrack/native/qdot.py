"""The Python side of qdot.c: ggml block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K) times activations quantized to 8 bits per 32 values, in integer dot products, split over threads by weight
rows. `matmul` returns None when the native library is not available or the type is not one it decodes; callers
then take the float path (carrack.native.qmatvec or numpy's dequantize-then-matmul).

`quantize_activations` is the numpy statement of the activation quantization, which the tests hold the kernel to.
"""

from __future__ import annotations

import ctypes

import numpy as np

from carrack import native
from carrack.native import data_address

#: values per activation scale
ACTIVATION_BLOCK = 32
#: weight rows a thread decodes together for a GEMM (ROW_TILE in qdot.c)
ROW_TILE = 16
#: weight bytes below which a product stays on one thread
PARALLEL_MIN_BYTES = 1 << 18
#: matrices one `matmul_group` call takes (MAX_GROUP in qdot.c)
MAX_GROUP = 8



def library() -> ctypes.CDLL | None:
    """qdot.c compiled, with its signatures declared (None when native kernels are unavailable)."""
    return native.declared_library("qdot", _declare)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.carrack_qdot_matmul.argtypes = [p, i32, i64, i64, i64, p, i64, p, i64]
    lib.carrack_qdot_matmul.restype = i32
    lib.carrack_qdot_quantize.argtypes = [p, i64, i64, p, p]
    lib.carrack_qdot_quantize.restype = i32
    lib.carrack_qdot_supports.argtypes = [i32]
    lib.carrack_qdot_matmul_group.argtypes = [i32, p, p, p, p, i64, p, i64, p, i64]
    lib.carrack_qdot_matmul_group.restype = i32
    lib.carrack_qdot_supports.restype = i32


def supports(ggml_type: int) -> bool:
    lib = library()
    return lib is not None and bool(lib.carrack_qdot_supports(int(ggml_type)))


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (m, k) float32 -> (codes (m, k) int8, scales (m, k / 32) float32) with x ~ codes * scale per 32 values:
    scale = max|x| / 127, codes = rint(x * (1 / scale)), as the kernel computes them."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    if k % ACTIVATION_BLOCK:
        raise ValueError(f"activations: a row of {k} values is not a whole number of {ACTIVATION_BLOCK}-value "
                         "blocks")
    blocks = x.reshape(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    scales = np.abs(blocks).max(axis=2) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(scales != 0, np.float32(1) / scales, np.float32(0)).astype(np.float32)
    codes = np.rint(blocks * inverse[:, :, None]).astype(np.int8)
    return codes.reshape(m, k), scales.astype(np.float32)


def native_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The kernel's own activation quantization (same result as quantize_activations), or None without it."""
    lib = library()
    if lib is None:
        return None
    x = np.require(x, np.float32, ("C_CONTIGUOUS", "ALIGNED"))
    m, k = x.shape
    codes = np.empty((m, k), np.int8)
    scales = np.empty((m, k // ACTIVATION_BLOCK), np.float32)
    if lib.carrack_qdot_quantize(data_address(x), m, k, data_address(codes), data_address(scales)):
        raise ValueError(f"activations: a row of {k} values is not a whole number of {ACTIVATION_BLOCK}-value "
                         "blocks")
    return codes, scales


def matmul(rows: np.ndarray, ggml_type: int, x: np.ndarray, threads: int | None = None) -> np.ndarray | None:
    """x (m, k) float32 @ W.T for W given as `rows`, a (n, row_bytes) uint8 array of ggml blocks, with x quantized
    to 8 bits per 32 values; (m, n) float32, or None when the native kernel cannot do it."""
    lib = library()
    if lib is None or not lib.carrack_qdot_supports(int(ggml_type)):
        return None
    rows = np.require(rows, np.uint8, ("C_CONTIGUOUS",))
    x = np.require(x, np.float32, ("C_CONTIGUOUS", "ALIGNED"))
    n, row_bytes = rows.shape
    m, k = x.shape
    y = np.empty((m, n), dtype=np.float32)
    work = rows.nbytes * max(1, m // 4)  # a prompt's product is worth splitting sooner than one token's
    parts = max(1, min(threads or native.threads(), n, work // PARALLEL_MIN_BYTES))
    status = lib.carrack_qdot_matmul(data_address(rows), int(ggml_type), row_bytes, n, k, data_address(x), m,
                                     data_address(y), parts)
    if status == -2:
        raise MemoryError(f"qdot: no memory for the scratch of a ({m}, {k}) x ({n}, {k}) product")
    if status:
        raise ValueError(f"qdot: ggml type {int(ggml_type)} with rows of {row_bytes} bytes does not hold {k} values "
                         f"per row in whole {ACTIVATION_BLOCK}-value blocks")
    return y


def matmul_group(matrices: list[tuple[np.ndarray, int]], x: np.ndarray, threads: int | None = None,
                 ) -> list[np.ndarray] | None:
    """[x @ W.T for W in matrices] for (rows, ggml_type) pairs as `matmul` takes them, sharing x (m, k): x is
    quantized once and every matrix's rows are split over the threads in one region (a layer's projections). The
    results equal one `matmul` per matrix. None when the native kernel cannot do them all."""
    lib = library()
    if lib is None or not 1 <= len(matrices) <= MAX_GROUP:
        return None
    if not all(lib.carrack_qdot_supports(int(ggml_type)) for _, ggml_type in matrices):
        return None
    x = np.require(x, np.float32, ("C_CONTIGUOUS", "ALIGNED"))
    m, k = x.shape
    rows = [np.require(r, np.uint8, ("C_CONTIGUOUS",)) for r, _ in matrices]
    outputs = [np.empty((m, r.shape[0]), dtype=np.float32) for r in rows]
    count = len(rows)
    pointers = (ctypes.c_void_p * count)(*[data_address(r) for r in rows])
    types = (ctypes.c_int * count)(*[int(t) for _, t in matrices])
    row_bytes = (ctypes.c_int64 * count)(*[r.shape[1] for r in rows])
    n = (ctypes.c_int64 * count)(*[r.shape[0] for r in rows])
    y = (ctypes.c_void_p * count)(*[data_address(o) for o in outputs])
    work = sum(r.nbytes for r in rows) * max(1, m // 4)
    parts = max(1, min(threads or native.threads(), sum(n), work // PARALLEL_MIN_BYTES))
    status = lib.carrack_qdot_matmul_group(count, pointers, types, row_bytes, n, k, data_address(x), m, y, parts)
    if status == -2:
        raise MemoryError(f"qdot: no memory for the scratch of {count} ({m}, {k}) products")
    if status:
        raise ValueError(f"qdot: the matrices {[(r.shape, int(t)) for r, (_, t) in zip(rows, matrices)]} do not "
                         f"all hold {k} values per row in whole blocks of their type")
    return outputs
