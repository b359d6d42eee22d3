"""The Python side of halfmat.c: float32 activations times F16 or BF16 weights kept as 16-bit values.

`matvec` (a few rows of x: generation) streams the 16-bit weights once, widening them in registers, split over
threads by whole weight rows; `ProductGroup` does the same for matrices that share x (a layer's q, k, v or gate,
up) in one native call, with their addresses bound once; `decode_rows` widens a panel of weight rows into a
float32 buffer for a BLAS product (prompts). They return None / False when the native library is not available;
callers then widen with numpy.
"""

from __future__ import annotations

import ctypes

import numpy as np

from carrack import native
from carrack.native import data_address

#: weight bytes below which a product stays on one thread
PARALLEL_MIN_BYTES = 1 << 18
#: the 16-bit weight dtypes the kernels read: numpy's float16, and BF16 held as raw uint16
_BF16_FLAG = {np.dtype(np.float16): 0, np.dtype(np.uint16): 1}
#: matrices one group call takes (MAX_GROUP in halfmat.c)
MAX_GROUP = 8



def library() -> ctypes.CDLL | None:
    """halfmat.c compiled, with its signatures declared (None when native kernels are unavailable)."""
    return native.declared_library("halfmat", _declare)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.carrack_halfmat_threads.argtypes = [p, i32, i64, i64, p, i64, p, i64]
    lib.carrack_halfmat_threads.restype = None
    lib.carrack_halfmat_decode_threads.argtypes = [p, i32, i64, i64, i64, p, i64]
    lib.carrack_halfmat_decode_threads.restype = None
    lib.carrack_halfmat_group.argtypes = [i32, p, p, p, i64, p, i64, p, i64]
    lib.carrack_halfmat_group.restype = i32


def _bf16_flag(weight: np.ndarray) -> int:
    flag = _BF16_FLAG.get(weight.dtype)
    if flag is None or weight.ndim != 2:
        raise ValueError(f"halfmat: weight must be a 2-D float16 (F16) or uint16 (BF16 bits) array, got "
                         f"{weight.ndim}-D {weight.dtype}")
    return flag


def matvec(weight: np.ndarray, x: np.ndarray, threads: int | None = None) -> np.ndarray | None:
    """x (m, k) float32 @ W.T for W (n, k) float16 or BF16 bits in uint16; (m, n) float32, or None without the
    native library."""
    bf16 = _bf16_flag(weight)
    lib = library()
    if lib is None:
        return None
    weight = np.require(weight, requirements=("C_CONTIGUOUS", "ALIGNED"))
    x = np.require(x, np.float32, ("C_CONTIGUOUS", "ALIGNED"))
    n, k = weight.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"halfmat: x has shape {list(x.shape)}, expected (rows, {k}) to match the weight")
    m = x.shape[0]
    y = np.empty((m, n), dtype=np.float32)
    parts = max(1, min(threads or native.threads(), n, weight.nbytes // PARALLEL_MIN_BYTES))
    lib.carrack_halfmat_threads(data_address(weight), bf16, n, k, data_address(x), m, data_address(y), parts)
    return y


class ProductGroup:
    """[x @ W.T for W in weights] for 16-bit matrices (float16, or BF16 bits as uint16) of one row length that
    share x, in one native call: all their rows split over the threads in one parallel region, each output row
    computed as `matvec` computes it. The matrices are checked and their addresses bound once, at construction;
    a call passes only x and the outputs."""

    def __init__(self, weights: list[np.ndarray], threads: int | None = None):
        if not 1 <= len(weights) <= MAX_GROUP:
            raise ValueError(f"halfmat: a product group takes 1 to {MAX_GROUP} matrices, got {len(weights)}")
        flags = [_bf16_flag(w) for w in weights]
        self.weights = [np.require(w, requirements=("C_CONTIGUOUS", "ALIGNED")) for w in weights]
        self.in_features = self.weights[0].shape[1]
        if any(w.shape[1] != self.in_features for w in self.weights):
            raise ValueError(f"halfmat: a product group's matrices must share their row length, got shapes "
                             f"{[list(w.shape) for w in self.weights]}")
        self.rows = [w.shape[0] for w in self.weights]
        self.threads = threads
        count = len(self.weights)
        self._count = count
        self._addresses = (ctypes.c_void_p * count)(*[data_address(w) for w in self.weights])
        self._flags = (ctypes.c_int * count)(*flags)
        self._rows = (ctypes.c_int64 * count)(*self.rows)
        self._max_parts = max(1, min(sum(self.rows), sum(w.nbytes for w in self.weights) // PARALLEL_MIN_BYTES))

    def __call__(self, x: np.ndarray) -> list[np.ndarray] | None:
        """The products for x (m, k) float32, each (m, n) float32; None without the native library."""
        lib = library()
        if lib is None:
            return None
        x = np.require(x, np.float32, ("C_CONTIGUOUS", "ALIGNED"))
        k = self.in_features
        if x.ndim != 2 or x.shape[1] != k:
            raise ValueError(f"halfmat: x has shape {list(x.shape)}, expected (rows, {k}) to match the weights")
        m = x.shape[0]
        outputs = [np.empty((m, n), dtype=np.float32) for n in self.rows]
        y = (ctypes.c_void_p * self._count)(*[data_address(o) for o in outputs])
        parts = min(self.threads or native.threads(), self._max_parts)
        lib.carrack_halfmat_group(self._count, self._addresses, self._flags, self._rows, k, data_address(x), m, y,
                                  parts)
        return outputs


def decode_rows(weight: np.ndarray, start: int, stop: int, out: np.ndarray, threads: int | None = None) -> bool:
    """Widen weight rows [start, stop) into `out`, a C-contiguous float32 (stop - start, k) array; False without
    the native library."""
    bf16 = _bf16_flag(weight)
    lib = library()
    if lib is None:
        return False
    weight = np.require(weight, requirements=("C_CONTIGUOUS", "ALIGNED"))
    k = weight.shape[1]
    if out.dtype != np.float32 or not out.flags.c_contiguous or out.shape != (stop - start, k):
        raise ValueError(f"halfmat: out must be a C-contiguous float32 array of shape {[stop - start, k]}")
    panel_bytes = (stop - start) * k * 2
    parts = max(1, min(threads or native.threads(), stop - start, panel_bytes // PARALLEL_MIN_BYTES))
    lib.carrack_halfmat_decode_threads(data_address(weight), bf16, k, start, stop, data_address(out), parts)
    return True
