"""float32 MatMul of rows by a weight matrix on convgemm.c's 6x64 tile (`matmul_f32`), for the token counts of
transformer inference (tens to hundreds of rows), where it beats OpenBLAS's sgemm on this machine's AVX-512 by
3-18 % inside real models (GPT-2, BERT, ViT): the weight is read in place, a block of 64 rows (contiguous memory)
at a time, the result accumulating in the cache, with the next panel of the block prefetched; a sgemm packs both
operands per call. No packed copy of the weight is made: resident memory stays that of the model.
`matmul_into` returns False for what it does not cover; the caller then uses numpy.
"""

from __future__ import annotations

import ctypes

import numpy as np

from carrack import native
from carrack.native import data_address, intra_op
from carrack.native.convolution import GEMM_PIXELS, GEMM_ROWS, _run, _threads
from carrack.native.packed import packed

_F32 = np.dtype(np.float32)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
#: rows (tokens) for which the tile beats BLAS here; fewer rows leave it load-bound, more suit BLAS's packing
MIN_ROWS, MAX_ROWS = 8, 256
MIN_SIDE = 64  # K and N: smaller products are not worth a native call
#: weight rows per pass: measured in GPT-2 (64 tokens): 32 -> 57.6, 48 -> 54.7, 64 -> 55.5, 128 -> 61.2, 256 -> 63.7,
#: whole depth -> 70.8 ms of MatMul per inference, against 67.3 for OpenBLAS
DEPTH_BLOCK = 64


def _load():
    lib = native.library("convgemm")
    if lib is None:
        return None
    fn = getattr(lib, "carrack_matmul", None)
    if fn is None:
        lib.matmul_f32_vectorized.restype = _i64
        lib.matmul_f32_vectorized.argtypes = []
        fn = lib.matmul_f32_threads
        fn.argtypes = [_ptr, _ptr, _ptr, *[_i64] * 10]
        fn.restype = None
        batched = lib.matmul_f32_batched_threads
        batched.argtypes = [_ptr, _ptr, _ptr, *[_i64] * 16]
        batched.restype = None
        transposed = lib.matmul_bt_f32_threads
        transposed.argtypes = [_ptr, _ptr, _ptr, *[_i64] * 8]
        transposed.restype = None
        copy = lib.transpose_f32_threads
        copy.argtypes = [_ptr, _ptr, *[_i64] * 9]
        copy.restype = None
        lib.carrack_matmul = fn if lib.matmul_f32_vectorized() else False
        # the same kernels called with one prepared pointer (packed.py): ctypes' conversion of 11-19 arguments
        # costs more than the arithmetic of the small products of tiny transformers
        lib.carrack_matmul_packed = (packed(fn, 13), packed(batched, 19), packed(transposed, 11))
    return lib.carrack_matmul or None


def _packed_kernels():
    """(matmul_f32_threads, matmul_f32_batched_threads, matmul_bt_f32_threads), called with plain ints; None when
    the library is not there or its tile is not vectorized here (`_load()` is None)."""
    lib = native.library("convgemm")
    if lib is None:
        return None
    kernels = getattr(lib, "carrack_matmul_packed", None)
    if kernels is None:
        _load()
        kernels = getattr(lib, "carrack_matmul_packed", None)
    return kernels if lib.carrack_matmul else None


def depth_block(depth: int) -> int:
    """The depth per pass. The weight is read a block of DEPTH_BLOCK whole rows at a time (contiguous memory, a
    stream the prefetchers follow) and each block's product added into the result, which stays in the cache: at
    16-256 tokens the weight comes from memory once per inference and that read is what bounds the product."""
    return min(depth, DEPTH_BLOCK)


def pays(rows: int, depth: int, cols: int) -> bool:
    """Whether the native product is the faster choice for a [rows, depth] @ [depth, cols] float32 product."""
    return MIN_ROWS <= rows <= MAX_ROWS and depth >= MIN_SIDE and cols >= MIN_SIDE


def blas_exceeds_run() -> bool:
    """Whether numpy's BLAS pool (process-wide) has more threads than the running session allows: a session with
    a lower intra_op_num_threads then has its products done here, on at most its own thread count, instead of
    widening into BLAS's threads (or changing the pool that other sessions and threads share)."""
    allowed = native.threads()
    if allowed >= intra_op.cores():
        return False
    from carrack.runtime.blas import blas_threads

    return allowed < (blas_threads() or 1)


#: OpenBLAS runs a gemm of at most this many multiply-adds on one thread (its interface/gemm.c: 65536 x
#: GEMM_MULTITHREAD_THRESHOLD 4), whatever its pool holds
SINGLE_THREAD_BLAS_WORK = 1 << 18
#: and a gemv (one row or one column) of a matrix under this many elements (interface/gemv.c: 2304 x 4 before
#: OpenBLAS 0.3.27, 50 times that since its pull request 4441); None: read from numpy's OpenBLAS on first use
SINGLE_THREAD_GEMV_WORK: int | None = None
#: the OpenBLAS release whose gemv stays on one thread up to 115200 x 4 elements (checked on 0.3.31 by the CPU time
#: of its pool threads: 449 x 1024 runs on the calling thread alone, 450 x 1024 on two)
WIDE_GEMV_OPENBLAS = (0, 3, 27)


def single_thread_gemv_work() -> int:
    """SINGLE_THREAD_GEMV_WORK, read from numpy's BLAS once: 460800 elements for OpenBLAS >= 0.3.27, else (older
    OpenBLAS, another BLAS, unknown) the smaller 9216."""
    global SINGLE_THREAD_GEMV_WORK
    if SINGLE_THREAD_GEMV_WORK is None:
        from carrack.runtime.blas import openblas_version

        version = openblas_version()
        SINGLE_THREAD_GEMV_WORK = 2304 * 4 * (50 if version is not None and version >= WIDE_GEMV_OPENBLAS else 1)
    return SINGLE_THREAD_GEMV_WORK


def numpy_is_faster(rows: int, depth: int, cols: int) -> bool:
    """Whether numpy takes a [rows, depth] @ [depth, cols] float32 product on one thread and in less time than the
    native tile: a matrix product of at most SINGLE_THREAD_BLAS_WORK multiply-adds, or a product by a vector
    (one row or one column) under `single_thread_gemv_work()`. Measured at 1 thread (BLAS at 1 thread, 2-core
    AVX-512 machine, us): 16x64x64 3.2 native vs 1.4 numpy, 16x128x128 5.4 vs 3.8, 1x64x64 1.1 vs 0.7, 4 heads of
    16x16x16 1.9 vs 1.1; above it the tile wins: 64x128x128 13.7 vs 16.3, 16x256x256 18.8 vs 23.3. One row (tile
    vs numpy's gemv, in a model's run): 1x64x192 4.8 vs 1.2, 1x64x1000 8.5 vs 3.4; A @ B^T 1x256x256 (the
    dot-product kernel) 7.1 vs 4.6."""
    work = rows * depth * cols
    if rows == 1 or cols == 1:
        return work < (SINGLE_THREAD_GEMV_WORK if SINGLE_THREAD_GEMV_WORK is not None else single_thread_gemv_work())
    return work <= SINGLE_THREAD_BLAS_WORK


def chosen(rows: int, depth: int, cols: int) -> bool:
    """Whether a [rows, depth] @ [depth, cols] float32 product should run here: not where `numpy_is_faster` (BLAS
    then runs it on one thread); where it `pays`; for the few rows of a token-by-token run when the run has threads
    (its pool then is the only one busy: OpenBLAS's threads, spinning on beside it, made 1-token BERT-base 2.4x
    slower at 2 threads on the shared machine); and for any non-empty shape while BLAS would use more threads than
    the run allows."""
    if numpy_is_faster(rows, depth, cols):
        return False
    if pays(rows, depth, cols):
        return True
    if 0 < rows < MIN_ROWS and depth >= MIN_SIDE and cols >= MIN_SIDE and native.threads() > 1:
        return True
    return rows * depth * cols > 0 and blas_exceeds_run()


def matmul_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """out[T, N] = a[T, K] @ b[K, N] for C-contiguous float32 arrays (out writable, not overlapping a or b) of
    shapes where it is `chosen`; False when not done."""
    fn = _load()
    if fn is None or a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        return False
    for x in (a, b, out):
        if x.dtype is not _F32 or not x.flags.c_contiguous or not x.flags.aligned:
            return False
    (t, k), n = a.shape, b.shape[1]
    if b.shape[0] != k or out.shape != (t, n) or not out.flags.writeable or not chosen(t, k, n):
        return False
    if np.may_share_memory(out, a) or np.may_share_memory(out, b):
        return False
    tiles = -(-t // GEMM_ROWS) * -(-n // GEMM_PIXELS)
    head = (data_address(a), data_address(b), data_address(out), t, k, n, k, n, n, depth_block(k))
    _run(_packed_kernels()[0], tiles, GEMM_ROWS * GEMM_PIXELS * k, head, ())
    return True


def matmul_checked_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """`matmul_into` for a caller that has checked what it checks (2-D C-contiguous aligned float32 operands of
    matching shapes, out writable and apart from a and b): only whether the product is `chosen` here and the
    library loaded. For a constant weight checked once (MatMul.prepare)."""
    (t, k), n = a.shape, b.shape[1]
    if not chosen(t, k, n):
        return False
    kernels = _packed_kernels()
    if kernels is None:
        return False
    tiles = -(-t // GEMM_ROWS) * -(-n // GEMM_PIXELS)
    kernels[0](data_address(a), data_address(b), data_address(out), t, k, n, k, n, n, depth_block(k), 0, tiles,
               _threads(tiles, GEMM_ROWS * GEMM_PIXELS * k))
    return True


def batched_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """out[..., T, N] = a[..., T, K] @ b[..., K, N] over one or two batch dims that all three share (no
    broadcasting), e.g. attention's scores and context per (batch, head): float32, aligned, rows contiguous (b is
    copied when its rows are not), out writable and not overlapping a or b, of shapes where it is `chosen`. False
    when not done. numpy would run these as one BLAS call per head, on BLAS's own threads."""
    if not 3 <= a.ndim <= 4 or not a.ndim == b.ndim == out.ndim:
        return False
    (t, k), n = a.shape[-2:], b.shape[-1]
    batch = a.shape[:-2]
    if b.shape[:-2] != batch or out.shape != (*batch, t, n) or b.shape[-2] != k or not chosen(t, k, n):
        return False  # (asked before the library: attention's small heads go to numpy twice a call)
    if _load() is None:
        return False
    if b.dtype is _F32 and b.strides[-1] != 4:
        b = _contiguous_transposed(b)
    for x in (a, b, out):
        if x.dtype is not _F32 or not x.flags.aligned or x.strides[-1] != 4 or min(x.strides) < 0:
            return False
    if not out.flags.writeable or np.may_share_memory(out, a) or np.may_share_memory(out, b):
        return False
    outer, inner = (batch[0], 1) if a.ndim == 3 else batch

    def steps(x: np.ndarray) -> tuple[int, int]:
        return x.strides[0] // 4, (x.strides[1] // 4 if x.ndim == 4 else 0)

    items = outer * inner * -(-t // GEMM_ROWS) * -(-n // GEMM_PIXELS)
    threads = _threads(items, GEMM_ROWS * GEMM_PIXELS * k)
    _packed_kernels()[1](data_address(a), data_address(b), data_address(out), outer, inner, t, k, n,
                         a.strides[-2] // 4, b.strides[-2] // 4, out.strides[-2] // 4, depth_block(k),
                         *steps(a), *steps(b), *steps(out), threads)
    return True


#: columns of a transposing copy per item (transpose_f32's band)
TRANSPOSE_BAND = 16
#: what copying one element costs in multiply-adds of the products (for the split threshold): ~0.4 ns a float here
COPY_WORK = 10


def _contiguous_transposed(b: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of b (..., K, N) whose K axis is the contiguous one (attention's keys swapped to (B, N, H,
    L)), made by the native blocked copy on the run's threads; numpy's copy, one element at a time down the long
    stride, is a serial pass of ~80 us per BERT layer. Other layouts are copied by numpy."""
    strides = b.strides
    if (b.dtype is not _F32 or not 3 <= b.ndim <= 4 or strides[-2] != 4 or not b.flags.aligned
            or any(s < 0 or s % 4 for s in strides) or b.size == 0):
        return np.ascontiguousarray(b)
    (k, n), batch = b.shape[-2:], b.shape[:-2]
    outer, inner = (batch[0], 1) if b.ndim == 3 else batch
    outer_step, inner_step = strides[0] // 4, (strides[1] // 4 if b.ndim == 4 else 0)
    out = np.empty(b.shape, _F32)
    items = outer * inner * -(-k // TRANSPOSE_BAND)
    native.library("convgemm").transpose_f32_threads(data_address(b), data_address(out), inner, n, k, outer_step,
                                                     inner_step, strides[-1] // 4, 0, items,
                                                     _threads(items, TRANSPOSE_BAND * n * COPY_WORK))
    return out


#: rows up to which a product by a transposed weight is done as dot products (a classifier head's few rows)
MAX_DOT_ROWS = 16


def transposed_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """out[T, N] = a[T, K] @ b[N, K]^T for a few rows (T <= MAX_DOT_ROWS; Gemm with transB, e.g. a classifier
    head), as dot products of C-contiguous float32 rows on the run's threads: each weight row is read once. False
    when not done."""
    if _load() is None or a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        return False
    (t, k), n = a.shape, b.shape[0]
    if not 0 < t <= MAX_DOT_ROWS or b.shape[1] != k or out.shape != (t, n) or not out.flags.writeable or k == 0:
        return False
    if numpy_is_faster(t, k, n):
        return False
    for x in (a, b, out):
        if x.dtype is not _F32 or not x.flags.c_contiguous or not x.flags.aligned:
            return False
    if np.may_share_memory(out, a) or np.may_share_memory(out, b):
        return False
    _packed_kernels()[2](data_address(a), data_address(b), data_address(out), t, k, k, k, n, 0, n,
                         _threads(n, t * k))
    return True


def transposed_checked_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """`transposed_into` for a caller that has checked what it checks (2-D C-contiguous aligned float32 operands,
    out [T, N] writable and apart from a and b, K > 0): only the row count and the library. For a Gemm's constant
    weight checked once (Gemm.prepare)."""
    t, k = a.shape
    n = b.shape[0]
    if not 0 < t <= MAX_DOT_ROWS or numpy_is_faster(t, k, n) or _load() is None:
        return False
    _packed_kernels()[2](data_address(a), data_address(b), data_address(out), t, k, k, k, n, 0, n,
                         _threads(n, t * k))
    return True
