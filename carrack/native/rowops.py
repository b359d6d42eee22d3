"""The Python side of rowops.c: softmax, layer normalization and GELU over the rows of float32 arrays, and
float16 <-> float32 conversion.

Kernels call `library()` when they are built and keep their numpy path for when it returns None; the functions
below take any float32 arrays (they make the contiguous, aligned copies the C code needs, never write into their
inputs) and return float32 results, written into `out` when it is a buffer the C code can fill: C-contiguous, of
the result's shape, and either the first input itself or not overlapping any input.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

import numpy as np

from carrack import native
from carrack.native import data_address
from carrack.native.packed import GELU, LAYER_NORM, SOFTMAX, bound_call, packed

#: elements per thread below which a call stays on one thread (the pool's hand-off costs more than it saves)
PARALLEL_MIN = 1 << 14
_GELU_MIN_ROW = 256  # GELU without a bias splits at rows of at least this many elements

_F32 = np.dtype(np.float32)


def library() -> ctypes.CDLL | None:
    """The compiled rowops library with its signatures declared, or None (no compiler, CARRACK_NATIVE=0, ...)."""
    return native.declared_library("rowops", _declare)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    # the `_threads` entry points: each kernel's arguments, then the threads to split its rows over
    lib.carrack_softmax_threads.argtypes = [p, p, i64, i64, i64, f32, p, i64, i64, i64, i64, i64, i32, i64]
    lib.carrack_layer_norm_threads.argtypes = [p, p, p, p, p, p, p, p, p, i64, i64, i64, f32, i64]
    lib.carrack_gelu_threads.argtypes = [p, p, p, i64, i64, i64, i32, i64]
    lib.carrack_binary_threads.argtypes = [i32, i32, p, p, p, i64, i64, i64]
    lib.carrack_binary_threads.restype = None
    lib.carrack_half_to_float.argtypes = [p, p, i64]
    lib.carrack_float_to_half.argtypes = [p, p, i64]
    for fn in (lib.carrack_softmax_threads, lib.carrack_layer_norm_threads, lib.carrack_gelu_threads,
               lib.carrack_half_to_float, lib.carrack_float_to_half):
        fn.restype = None
    # the row kernels called with one prepared pointer (packed.py): ctypes' conversion of their 8-14 arguments
    # costs more than a small model's rows
    lib.carrack_packed_softmax = packed(lib.carrack_softmax_threads, 14, SOFTMAX)
    lib.carrack_packed_layer_norm = packed(lib.carrack_layer_norm_threads, 14, LAYER_NORM)
    lib.carrack_packed_gelu = packed(lib.carrack_gelu_threads, 8, GELU)


def _operand(a: np.ndarray | None) -> np.ndarray | None:
    """a as a C-contiguous, aligned float32 array (a copy only when it is not one already)."""
    if a is None:
        return None
    if type(a) is np.ndarray and a.dtype == _F32 and a.flags.c_contiguous and a.flags.aligned:
        return a  # the common case, without np.require's argument parsing (a few us a call on small rows)
    return np.require(a, _F32, ("C_CONTIGUOUS", "ALIGNED"))


def _output(out: np.ndarray | None, shape: tuple[int, ...], first: np.ndarray, *others: np.ndarray | None,
            ) -> np.ndarray:
    """`out` when the C code may write the result there, else a new array. Writing over the first input is safe
    (each element is read before it is written); any other overlap with an input is not."""
    if out is None:
        return np.empty(shape, _F32)
    if out is first and out.shape == shape and out.flags.writeable:  # in place (first is C-contiguous, aligned)
        if not any(o is not None and np.may_share_memory(out, o) for o in others):
            return out
        return np.empty(shape, _F32)
    if (out.dtype == _F32 and out.shape == shape and out.flags.c_contiguous
            and out.flags.aligned and out.flags.writeable):
        same = data_address(out) == data_address(first) and out.size == first.size
        if not (np.may_share_memory(out, first) and not same) and not any(
                o is not None and np.may_share_memory(out, o) for o in others):
            return out
    return np.empty(shape, _F32)


def _threads(rows: int, row_size: int) -> int:
    """The threads a call over `rows` rows may use: the run's count, each thread getting PARALLEL_MIN elements."""
    if rows * row_size < 2 * PARALLEL_MIN:
        return 1
    return min(native.threads(), rows, rows * row_size // PARALLEL_MIN)


def _ptr(a: np.ndarray | None) -> int:
    return 0 if a is None else data_address(a)


# -- softmax -----------------------------------------------------------------------------------------------------------
def softmax(x: np.ndarray, scale: float = 1.0, bias: np.ndarray | None = None, zero_masked: bool = False,
            out: np.ndarray | None = None) -> np.ndarray:
    """softmax(x * scale + bias) over the last axis; bias broadcasts to x. A row whose maximum is -inf gives zeros
    with `zero_masked` (attention with every key masked), else NaN (as numpy's exp(x - max) does); NaN anywhere in
    a row makes the row NaN."""
    lib = library()
    x = _operand(x)
    y = _output(out, x.shape, x, bias)
    if x.size:
        _packed_softmax(lib, x, y, scale, bias, zero_masked)
    return y


def softmax_fresh(x: np.ndarray, scale: float, bias: np.ndarray | None, zero_masked: bool) -> np.ndarray:
    """`softmax(x, scale, bias, zero_masked, out=x)` for a buffer the caller just made (np.empty: C-contiguous,
    aligned, writable float32, sharing memory with nothing), without the checks such a buffer needs none of."""
    if x.size:
        _packed_softmax(library(), x, x, scale, bias, zero_masked)
    return x


def _packed_softmax(lib, x: np.ndarray, y: np.ndarray, scale: float, bias: np.ndarray | None,
                    zero_masked: bool) -> None:
    """The native softmax of the rows of a non-empty `x` into `y`, the bias laid out for x's shape."""
    n = x.shape[-1]
    rows = x.size // n
    b, dims, strides = _bias_layout(bias, x.shape)
    lib.carrack_packed_softmax(_ptr(x), _ptr(y), 0, rows, n, scale, _ptr(b), dims[1], dims[2], *strides,
                                int(zero_masked), _threads(rows, n))


def softmax_bound(x: np.ndarray, scale: float, bias: np.ndarray | None, zero_masked: bool,
                  ) -> Callable[[], None] | None:
    """`softmax(x, scale, bias, zero_masked, out=x)` of these very arrays as a call without arguments (a step bound
    to its arena: their contents change between calls, never their layout); None where that call would copy the
    bias (its contents would then be the binding's) or cannot take it, or the library is not loaded."""
    lib = library()
    if lib is None or _operand(x) is not x or x.size == 0 or not x.flags.writeable:
        return None
    if bias is not None and (np.may_share_memory(x, bias) or type(bias) is not np.ndarray):
        return None
    try:
        b, dims, strides = _bias_layout(bias, x.shape)
    except ValueError:
        return None
    if b is not None and b is not bias and (b.flags.owndata or not np.may_share_memory(b, bias)):
        return None
    n = x.shape[-1]
    rows = x.size // n
    call = bound_call(lib.carrack_packed_softmax, _ptr(x), _ptr(x), 0, rows, n, scale, _ptr(b), dims[1], dims[2],
                      *strides, int(zero_masked), _threads(rows, n))
    call.bias = b  # the pointer does not keep a broadcast view alive
    return call


def _bias_layout(bias: np.ndarray | None, shape: tuple[int, ...],
                 ) -> tuple[np.ndarray | None, tuple[int, int, int], tuple[int, int, int]]:
    """The bias broadcast to `shape` as an array whose rows are contiguous, with the rows' grid as at most three
    dims and the bias's element strides along them (0 where it is broadcast)."""
    lead = shape[:-1]
    if bias is None:
        return None, (1, 1, max(1, int(np.prod(lead)))), (0, 0, 0)
    plain = type(bias) is np.ndarray and bias.dtype == _F32 and bias.flags.aligned
    if plain and bias.size == bias.shape[-1] == shape[-1] > 1 and bias.strides[-1] == 4 and bias.ndim <= len(shape):
        # one row of biases for every row (a decoder's mask over its keys): every lead dim broadcast
        return bias, (1, 1, math.prod(lead)), (0, 0, 0)
    key = (shape, bias.shape, bias.strides) if plain else None
    grid = _BIAS_GRIDS.get(key) if plain else None
    if grid is not None:  # the broadcast view reads the bias in place, from its first element
        return bias, grid[0], grid[1]
    strides = _broadcast_strides(bias, shape) if plain else None
    grid = None if strides is None or (shape[-1] > 1 and strides[-1] != 1) else _merge_dims(lead, strides[:-1])
    if grid is not None:  # read in place as above (a growing cache's scores change shape every call)
        _remember_grid(key, grid)
        return bias, grid[0], grid[1]
    b = np.broadcast_to(np.require(bias, _F32, ("ALIGNED",)), shape)
    grid = _merge_dims(lead, [s // _F32.itemsize for s in b.strides[:-1]])
    if (shape[-1] > 1 and b.strides[-1] != _F32.itemsize) or grid is None:
        b = np.ascontiguousarray(b)
        grid = _merge_dims(lead, [s // _F32.itemsize for s in b.strides[:-1]])
    elif plain:
        _remember_grid(key, grid)
    dims, strides = grid
    return b, dims, strides


def _broadcast_strides(bias: np.ndarray, shape: tuple[int, ...]) -> list[int] | None:
    """The element strides of `bias` (float32, aligned) broadcast to `shape` (0 along broadcast axes), as
    np.broadcast_to's view has them, without making the view; None where it does not broadcast."""
    extra = len(shape) - bias.ndim
    if extra < 0:
        return None
    strides = [0] * extra
    for size, have, stride in zip(shape[extra:], bias.shape, bias.strides):
        if have == size:
            strides.append(stride // _F32.itemsize)
        elif have == 1:
            strides.append(0)
        else:
            return None
    return strides


#: (scores shape, bias shape, bias strides) -> the grid `_bias_layout` found for a float32 aligned bias read in
#: place: attention computes it for every call with the same shapes (~8 us of broadcasting and dims merging)
_BIAS_GRIDS: dict[tuple, tuple[tuple[int, int, int], tuple[int, int, int]]] = {}
_BIAS_GRIDS_MAX = 256


def _remember_grid(key: tuple, grid: tuple[tuple[int, int, int], tuple[int, int, int]]) -> None:
    if len(_BIAS_GRIDS) >= _BIAS_GRIDS_MAX:  # many shapes (a growing cache): start over rather than grow
        _BIAS_GRIDS.clear()
    _BIAS_GRIDS[key] = grid


def _merge_dims(shape: tuple[int, ...], strides: list[int],
                ) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """shape/strides as three dims (merging those that step evenly, dropping size-1 ones), None if they need more."""
    dims: list[list[int]] = []
    for size, stride in zip(shape, strides):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:
            dims[-1] = [dims[-1][0] * size, stride]
        else:
            dims.append([size, stride])
    if len(dims) > 3:
        return None
    dims = [[1, 0]] * (3 - len(dims)) + dims
    return (dims[0][0], dims[1][0], dims[2][0]), (dims[0][1], dims[1][1], dims[2][1])


# -- layer normalization -----------------------------------------------------------------------------------------------
def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None, epsilon: float, row_size: int,
               skip: np.ndarray | None = None, bias: np.ndarray | None = None, out: np.ndarray | None = None,
               stats: bool = False, total: bool = False,
               ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """(y, mean, 1 / std, s) for s = x (+ skip) (+ bias) normalized over rows of `row_size` elements:
    y = (s - mean) / sqrt(var + epsilon) * gamma (+ beta). skip has x's shape; gamma, beta and bias hold row_size
    elements. mean and 1 / std (one per row, flat) come with `stats`, s (shaped as x) with `total`."""
    if gamma is None:  # the C kernel reads gamma unconditionally
        raise ValueError("layer normalization needs its scale (gamma)")
    lib = library()
    x, skip = _operand(x), _operand(skip)
    gamma, beta, bias = _operand(gamma), _operand(beta), _operand(bias)
    y = _output(out, x.shape, x, skip, gamma, beta, bias)
    rows = x.size // row_size if row_size else 0
    mean = np.empty(rows, _F32) if stats else None
    inv_std = np.empty(rows, _F32) if stats else None
    summed = np.empty(x.shape, _F32) if total else None
    if x.size == 0:
        return y, mean, inv_std, summed
    args = [_ptr(a) for a in (x, skip, bias, gamma, beta, y, mean, inv_std, summed)]
    lib.carrack_packed_layer_norm(*args, 0, rows, row_size, epsilon, _threads(rows, row_size))
    return y, mean, inv_std, summed


def layer_norm_checked(x: np.ndarray, skip: np.ndarray | None, bias: np.ndarray | None, gamma: np.ndarray,
                       beta: np.ndarray | None, out: np.ndarray, epsilon: float, total: np.ndarray | None = None,
                       ) -> bool:
    """`layer_norm` over the last axis into `out`, without stats, for a caller that has checked what `_operand`
    and `_output` check (C-contiguous aligned float32 arrays, skip of x's shape, the row parameters of x.shape[-1]
    elements, out of x's shape, writable and apart from the inputs); a kernel's constant row parameters are checked
    once when it is prepared. `total` (a new array of x's shape) receives x + skip + bias when given. False when
    the library is not loaded."""
    lib = library()
    if lib is None or x.size == 0:
        return False
    n = x.shape[-1]
    rows = x.size // n
    lib.carrack_packed_layer_norm(data_address(x), _ptr(skip), _ptr(bias), data_address(gamma), _ptr(beta),
                                   data_address(out), 0, 0, _ptr(total), 0, rows, n, epsilon, _threads(rows, n))
    return True


def layer_norm_bound(x: np.ndarray, skip: np.ndarray | None, bias: np.ndarray | None, gamma: np.ndarray,
                     beta: np.ndarray | None, out: np.ndarray, epsilon: float, total: np.ndarray | None = None,
                     ) -> Callable[[], None] | None:
    """`layer_norm_checked` of these very arrays as a call without arguments (a step bound to its arena's views:
    their contents change between calls, never their layout); None when the library is not loaded or x is
    empty."""
    lib = library()
    if lib is None or x.size == 0:
        return None
    n = x.shape[-1]
    rows = x.size // n
    return bound_call(lib.carrack_packed_layer_norm, data_address(x), _ptr(skip), _ptr(bias), data_address(gamma),
                      _ptr(beta), data_address(out), 0, 0, _ptr(total), 0, rows, n, epsilon, _threads(rows, n))


def gelu_bound(x: np.ndarray, bias: np.ndarray, out: np.ndarray, approximate: bool) -> Callable[[], None] | None:
    """`gelu_checked` of these very arrays as a call without arguments (see `layer_norm_bound`)."""
    lib = library()
    if lib is None or x.size == 0:
        return None
    n = x.shape[-1]
    rows = x.size // n
    return bound_call(lib.carrack_packed_gelu, data_address(x), data_address(bias), data_address(out), 0, rows, n,
                      int(approximate), _threads(rows, n))


def gelu_checked(x: np.ndarray, bias: np.ndarray, out: np.ndarray, approximate: bool) -> bool:
    """`gelu` with a bias over the last axis into `out`, for a caller that has checked the operands as
    `layer_norm_checked` says. False when the library is not loaded."""
    lib = library()
    if lib is None or x.size == 0:
        return False
    n = x.shape[-1]
    rows = x.size // n
    lib.carrack_packed_gelu(data_address(x), data_address(bias), data_address(out), 0, rows, n, int(approximate),
                             _threads(rows, n))
    return True


# -- GELU --------------------------------------------------------------------------------------------------------------
def gelu(x: np.ndarray, bias: np.ndarray | None = None, approximate: bool = False,
         out: np.ndarray | None = None) -> np.ndarray:
    """gelu(x + bias) (bias over the last axis, or None): 0.5 x (1 + erf(x / sqrt 2)), or with `approximate` the
    tanh form 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    lib = library()
    x, bias = _operand(x), _operand(bias)
    y = _output(out, x.shape, x, bias)
    if x.size == 0:
        return y
    # without a bias GELU is elementwise: any rows of the array will do, short ones merged into one long row
    n = x.shape[-1] if bias is not None or x.shape[-1] >= _GELU_MIN_ROW else x.size
    rows = x.size // n
    lib.carrack_packed_gelu(_ptr(x), _ptr(bias), _ptr(y), 0, rows, n, int(approximate), _threads(rows, n))
    return y


# -- float16 <-> float32 -----------------------------------------------------------------------------------------------
def _convert(x: np.ndarray, dtype: np.dtype, fn_name: str, out: np.ndarray | None) -> np.ndarray:
    lib = library()
    if lib is None:
        if out is not None and out.shape == x.shape and out.dtype == dtype:
            np.copyto(out, x, casting="unsafe")
            return out
        return x.astype(dtype)
    x = np.require(x, x.dtype, ("C_CONTIGUOUS", "ALIGNED"))
    y = out if (out is not None and out.dtype == dtype and out.shape == x.shape and out.flags.c_contiguous
                and out.flags.aligned and out.flags.writeable and not np.may_share_memory(out, x)) \
        else np.empty(x.shape, dtype)
    if x.size:
        getattr(lib, fn_name)(data_address(x), data_address(y), x.size)  # memory-bound: one thread
    return y


def half_to_float(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float16 x as float32 (exact), into `out` when it is a float32 buffer of x's shape."""
    return _convert(x, _F32, "carrack_half_to_float", out)


def float_to_half(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 x rounded to float16 (to nearest even, as numpy's astype), into `out` when it fits."""
    return _convert(np.asarray(x, _F32), np.dtype(np.float16), "carrack_float_to_half", out)


# -- elementwise arithmetic --------------------------------------------------------------------------------------------
_BINARY_OPS = {"Add": 0, "Sub": 1, "Mul": 2, "Div": 3}


def _period(full: np.ndarray, other: np.ndarray) -> int:
    """How many elements of `other` repeat along `full`'s flat order: all of them when the shapes match, a row of
    the last dims (a bias) or 1 (a scalar); 0 when `other` broadcasts some other way."""
    if other.size == 1:
        return 1
    shape = other.shape
    while shape and shape[0] == 1:
        shape = shape[1:]
    return other.size if shape == full.shape[full.ndim - len(shape):] else 0


def binary(op_type: str, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
    """a op b (Add, Sub, Mul, Div) for float32 arrays split over the run's threads, where one operand has the
    result's shape and the other the same shape, its last dims (a bias) or one element; each element is one IEEE
    operation, as numpy's. Written into `out` when given (it may be the full-size operand itself). None when the
    run has one thread, the arrays are too small to split, the layout is another or `out` overlaps the other
    operand: numpy does it then."""
    # cheapest checks first: every Add/Sub/Mul/Div of the run asks, shape arithmetic on int64 scalars included
    if type(a) is not np.ndarray or type(b) is not np.ndarray or a.dtype is not _F32 or b.dtype is not _F32:
        return None
    if (a.size if a.size > b.size else b.size) < 2 * PARALLEL_MIN or native.threads() < 2:
        return None
    swap = b.size > a.size
    full, other = (b, a) if swap else (a, b)
    if (full.ndim < other.ndim or not full.flags.c_contiguous or not other.flags.c_contiguous
            or not full.flags.aligned or not other.flags.aligned):
        return None
    period = _period(full, other)
    threads = _threads(full.size // 16, 16)
    lib = library()
    if not period or threads < 2 or lib is None:
        return None
    y = _output(out, full.shape, full, other)
    if out is not None and y is not out:  # a planned buffer that overlaps an operand: numpy writes it
        return None
    lib.carrack_binary_threads(_BINARY_OPS[op_type], int(swap), data_address(full), data_address(other),
                               data_address(y), period, full.size, threads)
    return y
