"""Exact int8 GEMM (uint8 activations x int8 weights -> int32) with fused epilogues, over qgemm.c.

A weight is packed once (`PackedInt8Weight.pack`); `qgemm` then multiplies uint8 rows against it, accumulating in
int32 with wrap-around (exactly int64 accumulation wrapped to int32), subtracts the activation zero point through
the weight's column sums, and finishes each element as int32, as float32 (`scale`, `bias_f32`) or requantized to
8 bits (`multiplier`, `y_zero_point`). Everything here returns None or falls back when the library is unavailable
(no compiler, CARRACK_NATIVE=0); callers keep their numpy path for that case.
"""

from __future__ import annotations

import ctypes

import numpy as np

from carrack import native

INT32, FLOAT, REQUANT_U8, REQUANT_S8 = 0, 1, 2, 3
#: below this many multiply-adds one thread does the whole product (a pool hand-off costs more)
_PARALLEL_MIN_MACS = 1 << 20  # multiply-adds per thread, at least
#: a product of fewer rows is counted as this many: it streams its whole weight from memory for little arithmetic
#: (a classifier head's [1, 2048] x [2048, 1000] in a run takes ~150 us on one core, ~51 us with the weight in
#: cache), and each thread's share of the panels streams in parallel
_STREAMING_ROWS = 4
_QUANTIZE_MIN_ELEMENTS = 1 << 15  # elements of x per thread, at least, when quantizing it (~10 us of work)

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_SIGNATURES = {
    "qgemm_panel_columns": ([], _i64),
    "qgemm_packed_bytes": ([_i64, _i64], _i64),
    "qgemm_isa": ([], _i64),
    "qgemm_amx": ([_i64], _i64),
    "qgemm_pack_b": ([_p, _i64, _i64, _i64, _p, _p], None),
    "qgemm_run": ([_i64, _i64, _i64, _i64, _i64, _i64, _p, _i64, _p, _p, _i32, _p, _i32, _p, _i64, _i64, _p, _p,
                   _i32], None),
    "qgemm_run_threads": ([_i64, _i64, _i64, _p, _i64, _p, _p, _i32, _p, _i32, _p, _i64, _i64, _p, _p, _i32, _i64],
                          None),
    "qgemm_dynamic_quantize_u8": ([_p, _i64, _i64, _i64, _p, _i64, _p, _p], _i64),
    "qgemm_dynamic_quantize_u8_threads": ([_p, _i64, _i64, _i64, _p, _i64, _p, _p, _i64], _i64),
}
_declare = native.signature_declarer(_SIGNATURES)


def library() -> ctypes.CDLL | None:
    """qgemm.c compiled, with its functions' signatures declared (None when native kernels are unavailable)."""
    return native.declared_library("qgemm", _declare)


def isa() -> int:
    """512 (AVX-512 VNNI), 256 (AVX2) or 0 (portable C) for the loaded library; -1 when it is unavailable."""
    lib = library()
    return -1 if lib is None else int(lib.qgemm_isa())


def amx(enable: bool | None = None) -> bool:
    """Whether products whose depth is a multiple of 64 run on AMX tiles (Sapphire Rapids and later, when the kernel
    grants them; CARRACK_AMX=0 turns them off). `enable` False turns them off for the process, True back on where
    usable (the VNNI tiles give the same bits: tests compare the two)."""
    lib = library()
    if lib is None:
        return False
    return bool(lib.qgemm_amx({None: -1, False: 0, True: 1}[enable]))


def int8_weight(weight: np.ndarray) -> np.ndarray | None:
    """A (zero-point-shifted) integer-valued weight as int8, or None when some value is not an int8 integer."""
    weight = np.asarray(weight)
    if weight.dtype == np.int8:
        return weight
    if weight.dtype.kind not in "iuf" or weight.size and (weight.min() < -128 or weight.max() > 127):
        return None
    as_int8 = weight.astype(np.int8)
    return as_int8 if weight.dtype.kind in "iu" or np.array_equal(as_int8, weight) else None


class PackedInt8Weight:
    """An int8 weight [K, N] in qgemm.c's panel layout, with its column sums (int32 [N])."""

    def __init__(self, k: int, n: int, data: np.ndarray, column_sums: np.ndarray, lib: ctypes.CDLL):
        self.k, self.n = k, n
        self.data = data
        self.column_sums = column_sums
        self._lib = lib

    @classmethod
    def pack(cls, weight: np.ndarray) -> PackedInt8Weight | None:
        """Pack an int8 [K, N] weight; None when the native library is unavailable."""
        lib = library()
        if lib is None:
            return None
        weight = np.asarray(weight)
        if weight.dtype != np.int8 or weight.ndim != 2:
            raise ValueError(f"expected an int8 [K, N] weight, got {weight.dtype} {weight.shape}")
        weight = np.ascontiguousarray(weight)
        k, n = weight.shape
        data = np.zeros(max(int(lib.qgemm_packed_bytes(k, n)), 1), np.int8)
        sums = np.zeros(n, np.int32)
        lib.qgemm_pack_b(native.pointer(weight), k, n, n, native.pointer(data), native.pointer(sums))
        return cls(k, n, data, sums, lib)


def _columns(p, n: int, dtype) -> np.ndarray | None:
    """A per-tensor or per-column parameter as a contiguous [n] array (None stays None)."""
    if p is None:
        return None
    p = np.asarray(p, dtype)
    if p.size == 1:
        return np.full(n, p.reshape(()), dtype)
    if p.size != n:
        raise ValueError(f"expected a per-tensor or {n}-element parameter, got shape {p.shape}")
    return np.ascontiguousarray(p.reshape(n))


def _mode(scale, multiplier, out_dtype: np.dtype) -> int:
    if multiplier is not None:
        if out_dtype not in (np.uint8, np.int8):
            raise ValueError(f"requantizing writes uint8 or int8, not {out_dtype}")
        return REQUANT_U8 if out_dtype == np.uint8 else REQUANT_S8
    if scale is not None:
        if out_dtype != np.float32:
            raise ValueError(f"a scaled result is float32, not {out_dtype}")
        return FLOAT
    if out_dtype != np.int32:
        raise ValueError(f"an integer result is int32, not {out_dtype}")
    return INT32


def _rows(a: np.ndarray, k: int) -> np.ndarray:
    """A's first k columns, with unit column stride and a non-negative row stride (copied when not so)."""
    if a.ndim != 2 or a.dtype != np.uint8 or a.shape[1] < k:
        raise ValueError(f"expected uint8 [M, >= {k}] activations, got {a.dtype} {a.shape}")
    a = a[:, :k]
    if (k > 1 and a.strides[1] != 1) or a.strides[0] < 0:
        a = np.ascontiguousarray(a)
    return a


def qgemm(a_u8: np.ndarray, packed: PackedInt8Weight, *, a_zero_point: int, bias_i32: np.ndarray | None = None,
          out: np.ndarray | None = None, out_strides: tuple[int, int] | None = None, scale=None,
          bias_f32: np.ndarray | None = None, multiplier=None, y_zero_point: int | None = None,
          out_dtype=np.int32) -> np.ndarray:
    """(a_u8 - a_zero_point) @ weight (+ bias_i32) in int32, then the epilogue its arguments choose:

    * neither `scale` nor `multiplier`: the int32 accumulator (`out_dtype` int32);
    * `scale` (per tensor or [N]): float32(acc) * scale (+ bias_f32) (`out_dtype` float32);
    * `multiplier`: clamp(round_half_even(float32(acc) * multiplier) + y_zero_point) as `out_dtype` uint8/int8.

    The result [M, N] is returned, or written into `out`, whose element (m, n) is at element offset
    m * out_strides[0] + n * out_strides[1] (default: `out`'s own strides), so a caller may write C transposed.
    """
    lib = packed._lib
    out_dtype = np.dtype(out.dtype if out is not None else out_dtype)
    mode = _mode(scale, multiplier, out_dtype)
    a = _rows(a_u8, packed.k)
    m, n = a.shape[0], packed.n
    if out is None:
        out = np.empty((m, n), out_dtype)
    if out_strides is None:
        if out.ndim != 2 or out.shape != (m, n):
            raise ValueError(f"out must be [{m}, {n}], got {out.shape}")
        out_strides = (out.strides[0] // out.itemsize, out.strides[1] // out.itemsize)
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    factors = _columns(multiplier if multiplier is not None else scale, n, np.float32)
    keep = (a, out, factors, _columns(bias_i32, n, np.int32), _columns(bias_f32, n, np.float32))  # alive
    if m and n:
        # the C side splits the output into column panels (or row ranges) over the threads
        work = max(m, _STREAMING_ROWS) * n * packed.k
        threads = min(native.threads(), max(1, work // max(1, _PARALLEL_MIN_MACS)))
        lib.qgemm_run_threads(m, packed.k, n, native.pointer(a), a.strides[0] if m > 1 else packed.k,
                              native.pointer(packed.data), native.pointer(packed.column_sums), int(a_zero_point),
                              native.pointer(keep[3]), mode, native.pointer(out), int(out_strides[0]),
                              int(out_strides[1]), native.pointer(factors), native.pointer(keep[4]),
                              int(y_zero_point or 0), threads)
    return out


def dynamic_quantize_u8(x: np.ndarray, row_bytes: int | None = None) -> tuple[np.ndarray, np.float32, int] | None:
    """DynamicQuantizeLinear of x [M, K] (float32): (q uint8 [M, K4] with K4 = K rounded up to 4 and the padding
    zero, or `row_bytes` wide; the scale; the zero point), exactly as the ONNX operator computes them.

    None when the library is unavailable or x holds a NaN or an infinity (the numpy path then decides).
    """
    lib = library()
    if lib is None:
        return None
    x = np.asarray(x)
    if x.ndim != 2 or x.dtype != np.float32:
        raise ValueError(f"expected float32 [M, K], got {x.dtype} {x.shape}")
    if (x.shape[1] > 1 and x.strides[1] != x.itemsize) or x.strides[0] < 0 or x.strides[0] % x.itemsize:
        x = np.ascontiguousarray(x)
    m, k = x.shape
    width = max(k, row_bytes if row_bytes is not None else -(-k // 4) * 4)
    q = np.empty((m, width), np.uint8)
    scale, zero_point = ctypes.c_float(), ctypes.c_int32()
    # two passes over x (its range, then the bytes): rows split over the run's threads, the same bytes at any count
    threads = min(native.threads(), m, max(1, m * k // _QUANTIZE_MIN_ELEMENTS))
    status = lib.qgemm_dynamic_quantize_u8_threads(native.pointer(x), m, k, x.strides[0] // x.itemsize if m > 1 else k,
                                                   native.pointer(q), width, ctypes.byref(scale),
                                                   ctypes.byref(zero_point), threads)
    if status:
        return None
    return q, np.float32(scale.value), int(zero_point.value)
