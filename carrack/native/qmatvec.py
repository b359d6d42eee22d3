"""The Python side of qmatvec.c: float32 activations times ggml block-quantized weights (Q8_0, Q4_0, Q4_K, Q6_K)
straight from the blocks, split over threads by weight rows. `matvec` returns None when the native library is not
available or the type is not one it decodes; callers then take the numpy dequantize-then-matmul path
(carrack.gguf.matmul.quantized_matmul), which the tests check it against.
"""

from __future__ import annotations

import ctypes

import numpy as np

from carrack import native
from carrack.native import data_address

#: weight bytes below which a product stays on one thread
PARALLEL_MIN_BYTES = 1 << 18



def library() -> ctypes.CDLL | None:
    """qmatvec.c compiled, with its signatures declared (None when native kernels are unavailable)."""
    return native.declared_library("qmatvec", _declare)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.carrack_qmatvec.argtypes = [p, i32, i64, i64, i64, p, i64, p, i64, i64]
    lib.carrack_qmatvec_threads.argtypes = [p, i32, i64, i64, i64, p, i64, p, i64]
    lib.carrack_qmatvec.restype = i32
    lib.carrack_qdecode.argtypes = [p, i32, i64, i64, i64, i64, p]
    lib.carrack_qdecode.restype = i32
    lib.carrack_qmatvec_supports.argtypes = [i32]
    lib.carrack_qmatvec_supports.restype = i32


def supports(ggml_type: int) -> bool:
    lib = library()
    return lib is not None and bool(lib.carrack_qmatvec_supports(int(ggml_type)))


def matvec(rows: np.ndarray, ggml_type: int, x: np.ndarray, threads: int | None = None) -> np.ndarray | None:
    """x (m, k) float32 @ W.T for W given as `rows`, a (n, row_bytes) uint8 array of ggml blocks; (m, n) float32,
    or None when the native kernel cannot do it."""
    lib = library()
    if lib is None or not lib.carrack_qmatvec_supports(int(ggml_type)):
        return None
    rows = np.require(rows, np.uint8, ("C_CONTIGUOUS",))
    x = np.require(x, np.float32, ("C_CONTIGUOUS", "ALIGNED"))
    n, row_bytes = rows.shape
    m, k = x.shape
    y = np.empty((m, n), dtype=np.float32)
    args = (data_address(rows), int(ggml_type), row_bytes, n, k, data_address(x), m, data_address(y))
    parts = max(1, min(threads or native.threads(), n, rows.nbytes // PARALLEL_MIN_BYTES))
    status = [lib.carrack_qmatvec_threads(*args, parts)]
    if any(status):
        raise ValueError(f"qmatvec: ggml type {int(ggml_type)} with rows of {row_bytes} bytes does not hold "
                         f"{k} values per row")
    return y


def decode_rows(rows: np.ndarray, ggml_type: int, start: int, stop: int, out: np.ndarray) -> bool:
    """Decode weight rows [start, stop) of `rows` ((n, row_bytes) uint8 blocks) into `out`, a C-contiguous float32
    (stop - start, k) array; False when the native library cannot (the caller decodes with numpy)."""
    lib = library()
    if lib is None or not lib.carrack_qmatvec_supports(int(ggml_type)):
        return False
    rows = np.require(rows, np.uint8, ("C_CONTIGUOUS",))
    status = lib.carrack_qdecode(data_address(rows), int(ggml_type), rows.shape[1], out.shape[1], start, stop,
                                 data_address(out))
    if status:
        raise ValueError(f"qdecode: ggml type {int(ggml_type)} rows of {rows.shape[1]} bytes do not hold "
                         f"{out.shape[1]} values")
    return True
