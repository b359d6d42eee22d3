"""Convolution kernels: Conv, ConvTranspose, DeformConv, Col2Im, CausalConvWithState.

`convolve` is the shared N-D cross-correlation (im2col + one batched matmul over groups) that the quantized
convolutions reuse.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from carrack.ir.graph import Node
from carrack.native import convolution as native_conv
from carrack.ops import half
from carrack.ops.registry import Kernel, bound_or_run_into, register


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    # float16 matmul in numpy is slow and accumulates in float16; do the arithmetic in float32.
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def pad_spatial(x: np.ndarray, pads: Sequence[int], value: float = 0) -> np.ndarray:
    """Pads (or crops, for negative pads) the trailing spatial axes of x[N, C, *spatial]; ONNX pads order."""
    nd = len(pads) // 2
    begins, ends = list(pads[:nd]), list(pads[nd:])
    if not any(begins) and not any(ends):
        return x
    if any(p > 0 for p in begins + ends):  # one fill and one copy: much cheaper than np.pad
        lead = x.shape[:x.ndim - nd]
        spatial = x.shape[x.ndim - nd:]
        padded = np.full(lead + tuple(s + max(b, 0) + max(e, 0) for s, b, e in zip(spatial, begins, ends)), value,
                         dtype=x.dtype)
        padded[(Ellipsis,) + tuple(slice(max(b, 0), max(b, 0) + s) for s, b in zip(spatial, begins))] = x
        x = padded
    if any(p < 0 for p in begins + ends):
        spatial = x.shape[x.ndim - nd:]
        crop = tuple(slice(-min(b, 0), size + min(e, 0)) for size, b, e in zip(spatial, begins, ends))
        x = x[(Ellipsis,) + crop]
    return x


def windows(x: np.ndarray, kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]) -> np.ndarray:
    """Strided view x[N, C, *out_spatial, *kernel] of the (already padded) input's sliding windows."""
    nd = len(kernel)
    extent = tuple((k - 1) * d + 1 for k, d in zip(kernel, dilations))
    view = sliding_window_view(x, extent, axis=tuple(range(x.ndim - nd, x.ndim)))
    step = tuple(slice(None, None, s) for s in strides) + tuple(slice(None, None, d) for d in dilations)
    return view[(Ellipsis,) + step]


@dataclass(frozen=True)
class Epilogue:
    """An activation applied to a convolution's result: `apply` overwrites its argument with it (numpy); `code`,
    `alpha` and `beta` name it for the native kernels, which apply it before the result is stored (code -1: they
    do not know it, `apply` runs after them)."""

    apply: Callable[[np.ndarray], np.ndarray]
    code: int = -1
    alpha: float = 0.0
    beta: float = 0.0

    def native(self) -> native_conv.Activation:
        return (self.code, self.alpha, self.beta) if self.code >= 0 else native_conv.NO_ACTIVATION


def convolve(x: np.ndarray, w: np.ndarray, *, strides: Sequence[int], pads: Sequence[int],
             dilations: Sequence[int], group: int, bias: np.ndarray | None = None,
             out: np.ndarray | None = None, activation: Epilogue | None = None,
             kernels: native_conv.NativeConvolution | None | Literal["auto"] = "auto",
             residual: np.ndarray | None = None) -> np.ndarray:
    """N-D cross-correlation of x[N, C, *spatial] with w[M, C/group, *kernel], plus an optional bias[M] and an
    optional `residual` (broadcast to the result), then an optional activation.

    ``pads`` is in ONNX order [x1_begin, x2_begin, ..., x1_end, x2_end, ...]. The result has the common dtype
    of x and w and is always a fresh array (or `out`, a C-contiguous buffer of the result's shape and dtype, when
    given and usable), so callers may finish it in place. float32 convolutions run on the native `kernels` (by
    default loaded here; None: numpy only) where they can.
    """
    if kernels == "auto":
        kernels = native_conv.load()
    z = _native_residual(residual, out)
    y = None if kernels is None or z is False else _native_convolve(kernels, x, w, strides, pads, dilations, group,
                                                                    bias, out, activation, z)
    if y is not None:
        return y
    if residual is not None:  # the numpy way: the convolution and bias, then the residual, then the activation
        y = convolve(x, w, strides=strides, pads=pads, dilations=dilations, group=group, bias=bias, kernels=kernels)
        y = np.add(y, residual, out=y) if np.broadcast_shapes(y.shape, residual.shape) == y.shape else y + residual
        return y if activation is None else activation.apply(y)
    out_dtype = np.result_type(x, w)
    dtype = _compute_dtype(out_dtype)
    x = x.astype(dtype, copy=False)
    w = w.astype(dtype, copy=False)
    c, m, cg = x.shape[1], w.shape[0], w.shape[1]
    if cg * group != c or m % group:
        raise ValueError(f"Conv: input has {c} channels, weight {w.shape} with group={group} does not match")
    pads = list(pads)
    if out is not None and (out.dtype != dtype or out_dtype != dtype or not out.flags.c_contiguous):
        out = None
    if w.ndim == 3 and min(pads) >= 0:  # 1-D: the 2-D code on a height-1 image
        y = _convolve_2d(x[:, :, None], w[:, :, None], [1, *strides], [0, pads[0], 0, pads[1]], [1, *dilations],
                         group, None if out is None else out[:, :, None])[:, :, 0]
    elif w.ndim == 4 and min(pads) >= 0:
        y = _convolve_2d(x, w, strides, pads, dilations, group, out)
    else:
        y = _convolve_nd(x, w, strides, pads, dilations, group)
    act = native_conv.NO_ACTIVATION if activation is None else activation.native()
    if (bias is not None or act[0]) and out_dtype == dtype and kernels is not None and kernels.bias_activation(
            y, bias, act):
        bias = None  # one native pass added it, and applied the activation where it knows it
        activation = None if act[0] else activation
    if bias is not None:
        np.add(y, bias.astype(dtype, copy=False).reshape((1, -1) + (1,) * (y.ndim - 2)), out=y)
    y = y.astype(out_dtype, copy=False)
    return y if activation is None else activation.apply(y)


def _native_residual(residual: np.ndarray | None, out: np.ndarray | None) -> np.ndarray | None | bool:
    """The residual as the native kernels read it (C-contiguous aligned float32, not overlapping `out`); None for
    none, False when the native kernels cannot take it."""
    if residual is None:
        return None
    if residual.dtype != np.float32 or (out is not None and np.may_share_memory(out, residual)):
        return False
    return np.require(residual, np.float32, ("C", "A"))


def _native_convolve(kernels: native_conv.NativeConvolution, x: np.ndarray, w: np.ndarray, strides: Sequence[int],
                     pads: Sequence[int], dilations: Sequence[int], group: int, bias: np.ndarray | None,
                     out: np.ndarray | None, activation: Epilogue | None, z: np.ndarray | None = None
                     ) -> np.ndarray | None:
    """float32 convolutions by the native kernels (1x1 and im2col convolutions as one matrix product, depthwise ones
    directly), the bias and the activation applied before the one store; None: not done here (the numpy path then
    runs)."""
    if x.dtype != np.float32 or w.dtype != np.float32 or x.ndim < 3 or min(pads) < 0:
        return None
    act = native_conv.NO_ACTIVATION if activation is None else activation.native()
    # packconv runs 1-D and 2-D 1x1 convolutions too, as the bound calls do (the same sums, the same bits)
    if w.shape[2:] == (1,) * (w.ndim - 2) and not any(pads) and not (kernels.packs and w.ndim in (3, 4)):
        if any(s != 1 for s in strides):
            x = x[(Ellipsis,) + tuple(slice(None, None, s) for s in strides)]
        y = kernels.pointwise(x, w, bias, out, group, act, z)
    elif w.ndim == 3:  # 1-D: a height-1 image
        into = out[:, :, None] if out is not None and out.ndim == 3 else None
        y = _native_convolve_2d(kernels, x[:, :, None], w[:, :, None], [1, strides[0]], [0, pads[0], 0, pads[1]],
                                [1, dilations[0]], group, bias, into, act, None if z is None else z[:, :, None])
        y = None if y is None else y[:, :, 0]
    elif w.ndim == 4:
        y = _native_convolve_2d(kernels, x, w, strides, pads, dilations, group, bias, out, act, z)
    else:
        return None
    if y is not None and activation is not None and activation.code < 0:
        y = activation.apply(y)
    return y


def _native_convolve_2d(kernels: native_conv.NativeConvolution, x: np.ndarray, w: np.ndarray,
                        strides: Sequence[int], pads: Sequence[int], dilations: Sequence[int], group: int,
                        bias: np.ndarray | None, out: np.ndarray | None, act: native_conv.Activation,
                        z: np.ndarray | None = None) -> np.ndarray | None:
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    kind = _kind_2d(x.shape, w.shape, strides, pads, dilations, group)
    if kind == "depthwise":
        return None if z is not None else kernels.depthwise(x, w, bias, out, strides, pads, dilations, act)
    out_shape = (_output_size(h, kh, strides[0], dilations[0], pads[0], pads[2]),
                 _output_size(wd, kw, strides[1], dilations[1], pads[1], pads[3]))
    if kind is None or (bias is not None and bias.size != m) or (z is not None and z.shape != (n, m) + out_shape):
        return None
    if kernels.packs:  # weights packed for this call (they are not constants, or the binding was not made)
        y = kernels.packed(x, w, bias, out, strides, pads, dilations, group, act, z)
        if y is not None:
            return y
    if kind == "direct":
        return kernels.direct(x, w, bias, out, strides, pads, dilations, group, act, z)
    if not kernels.products:  # no vector code for the product in this variant: numpy's BLAS is faster
        return None
    if out is not None and not (out.shape == (n, m) + out_shape and out.dtype == np.float32
                                and out.flags.c_contiguous and out.flags.writeable
                                and not np.may_share_memory(out, x)):
        out = None
    residual = None if z is None else z.reshape(n, m, -1)
    contiguous = np.ascontiguousarray(w)
    if bias is not None:
        bias = np.ascontiguousarray(bias, dtype=np.float32)  # the C code reads it densely (constants may broadcast)
    weights, constants = contiguous.reshape(m, -1), (native_conv.address(contiguous), native_conv.address(bias))
    x = np.require(x, np.float32, ("C", "A"))

    def product(columns: np.ndarray, block: np.ndarray, b: int, p0: int) -> None:
        zb = None if residual is None else residual[b:b + 1, :, p0:p0 + block.shape[2]]
        if not kernels.gemm(columns, weights, bias, block, group, act, constants, zb):
            raise RuntimeError("the native convolution product refused its operands")

    def fill(columns: np.ndarray, b: int, r0: int, r1: int) -> None:
        kernels.im2col(x[b], columns, (kh, kw), out_shape[1], strides, dilations, pads, r0, r1)

    return _im2col_2d(x, w, out_shape, strides, pads, dilations, group, out, product, fill)


# at most this much im2col scratch at a time: small blocks stay in cache and keep peak memory low
COLUMN_BYTES = 4 << 20
_DEPTHWISE_BYTES = 1 << 20  # depthwise accumulators: sized to stay in the L2 cache
NATIVE_COLUMN_BYTES = 512 << 10  # the native product's columns: a block stays in the L2 cache while it is used
NATIVE_MIN_PIXELS = 512
#: input channels per group from which the direct native convolution beats columns (its per-tap setup is paid
#: once for all channels)
DIRECT_MIN_CHANNELS = 4
#: output row length from which the direct convolution fills its vectors well enough (else columns, unless the
#: layer has fewer output channels per group than DIRECT_MAX_SMALL_CHANNELS)
DIRECT_MIN_WIDTH = 24
DIRECT_MAX_SMALL_CHANNELS = 128


#: input shapes a kernel keeps prepared, the oldest dropped first: as many as the plan keeps evaluated size sets
#: (carrack.plan.plan.BOUND_CACHE_SIZE, also first in first out), so a size set the plan still holds keeps its shapes
MAX_PREPARED_SHAPES = 256


class PreparedShapes:
    """A kernel's per-input-shape state, written only by the plan's per-size evaluation (`prepare_shape`), read
    by runs. Writers replace the whole mapping (copy on write), so a run reading it never sees a partial update."""

    def __init__(self) -> None:
        self._by_shape: dict[tuple[int, ...], object] = {}
        self._lock = threading.Lock()

    def __contains__(self, shape: tuple[int, ...]) -> bool:
        return shape in self._by_shape

    def __len__(self) -> int:
        return len(self._by_shape)

    def get(self, shape: tuple[int, ...], default: object = None):
        return self._by_shape.get(shape, default)

    def add(self, shape: tuple[int, ...], value: object) -> None:
        with self._lock:
            kept = list(self._by_shape.items())[-(MAX_PREPARED_SHAPES - 1):]
            self._by_shape = {**dict(kept), shape: value}


def _native_kind(x_shape: tuple[int, ...], w_shape: tuple[int, ...], strides: Sequence[int], pads: Sequence[int],
                 dilations: Sequence[int], group: int, residual: bool, packs: bool = False) -> str | None:
    """Which native kernel `_native_convolve` runs for this geometry when it runs one that can be bound
    ("pointwise", "direct" or "depthwise"), or "packed" (any 1-D or 2-D convolution but depthwise, on weights
    packed once) when `packs` (the kernels have packconv.c's vector code); None for the rest (columns, strided
    1x1, 1-D, N-D without packconv)."""
    if min(pads) < 0:
        return None
    if packs and len(w_shape) == len(x_shape) == 4:
        if _kind_2d(x_shape, w_shape, strides, pads, dilations, group) in ("direct", "columns"):
            return "packed"
    if packs and len(w_shape) == len(x_shape) == 3 and len(pads) == 2:  # 1-D: as an image of height 1
        if _kind_2d(x_shape[:2] + (1,) + x_shape[2:], w_shape[:2] + (1,) + w_shape[2:], [1, strides[0]],
                    [0, pads[0], 0, pads[1]], [1, dilations[0]], group) in ("direct", "columns"):
            return "packed"
    if w_shape[2:] == (1,) * (len(w_shape) - 2) and not any(pads):
        return "pointwise" if all(s == 1 for s in strides) else None
    if len(w_shape) != 4 or len(x_shape) != 4:
        return None
    kind = _kind_2d(x_shape, w_shape, strides, pads, dilations, group)
    return kind if kind == "direct" or (kind == "depthwise" and not residual) else None


def _kind_2d(x_shape: tuple[int, ...], w_shape: tuple[int, ...], strides: Sequence[int], pads: Sequence[int],
             dilations: Sequence[int], group: int) -> str | None:
    """How the native kernels run a 2-D convolution (pads >= 0): "depthwise", "direct" (straight from the image),
    "columns" (im2col + product), or None (a geometry they do not take)."""
    (n, c, h, wd), (m, cg, kh, kw) = x_shape, w_shape
    if group == c and cg == 1:
        return "depthwise"
    out_height = _output_size(h, kh, strides[0], dilations[0], pads[0], pads[2])
    out_width = _output_size(wd, kw, strides[1], dilations[1], pads[1], pads[3])
    if cg * group != c or m % group or n * m == 0 or 0 in (out_height, out_width) or kh * kw == 0:
        return None
    return "direct" if _direct_pays(strides, cg, m // group, out_width, wd) else "columns"


def _direct_pays(strides: Sequence[int], cg: int, mg: int, out_width: int, in_width: int) -> bool:
    """Whether the direct native convolution beats columns + product: for unit strides (its stride-2 loads cost a
    permute per vector) with enough input channels, and output rows long enough to fill its vectors (short rows
    leave lanes idle) unless the layer is small (columns then cost more than the idle lanes) or its output rows are
    as wide as its input's (the kernel then runs its vectors across rows: no lane idles)."""
    return (strides[0] == strides[1] == 1 and cg >= DIRECT_MIN_CHANNELS
            and (out_width >= DIRECT_MIN_WIDTH or mg < DIRECT_MAX_SMALL_CHANNELS or out_width == in_width))


def _convolve_nd(x: np.ndarray, w: np.ndarray, strides: Sequence[int], pads: Sequence[int],
                 dilations: Sequence[int], group: int) -> np.ndarray:
    """Any rank and negative pads: im2col through a strided sliding-window view, a few images at a time."""
    x = pad_spatial(x, pads)
    n = x.shape[0]
    m = w.shape[0]
    kernel = w.shape[2:]
    nd = len(kernel)
    if all(k == 1 for k in kernel):
        return _pointwise(x[(Ellipsis,) + tuple(slice(None, None, s) for s in strides)], w, group)
    win = windows(x, kernel, strides, dilations)  # N, C, *O, *K
    out_spatial = win.shape[2:2 + nd]
    per_image = int(np.prod(win.shape[1:])) * win.itemsize
    chunk = max(1, COLUMN_BYTES // max(per_image, 1))
    weights = w.reshape(group, m // group, -1)
    parts = [_im2col_matmul(win[i:i + chunk], weights, group) for i in range(0, n, chunk)]
    joined = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros((0,), x.dtype)
    return joined.reshape((n, m) + out_spatial)


def _im2col_matmul(win: np.ndarray, weights: np.ndarray, group: int) -> np.ndarray:
    """win[N, C, *O, *K] -> columns [N, group, C/group * K, O], times weights [group, M/group, C/group * K]."""
    nd = (win.ndim - 2) // 2
    order = (0, 1) + tuple(range(2 + nd, 2 + 2 * nd)) + tuple(range(2, 2 + nd))
    cols = win.transpose(order).reshape(win.shape[0], group, weights.shape[2], -1)
    return np.matmul(weights, cols)


def _pointwise(x: np.ndarray, w: np.ndarray, group: int, into: np.ndarray | None = None) -> np.ndarray:
    """1x1 kernels: one (batched) matmul of the weights with the input's pixels."""
    n, c = x.shape[:2]
    m = w.shape[0]
    pixels = int(np.prod(x.shape[2:], dtype=np.int64))
    out = _buffer(into, (n, group, m // group, pixels), x.dtype)
    np.matmul(w.reshape(group, m // group, c // group), x.reshape(n, group, c // group, pixels), out=out)
    return out.reshape((n, m) + x.shape[2:])


def _output_size(size: int, kernel: int, stride: int, dilation: int, begin: int, end: int) -> int:
    return max(0, (size + begin + end - (kernel - 1) * dilation - 1) // stride + 1)


def _valid_range(size: int, count: int, begin: int, offset: int, stride: int) -> tuple[int, int, int]:
    """The outputs [lo, hi) of `count` whose input index o * stride - begin + offset lies in [0, size), and the
    input index of output lo."""
    start = offset - begin
    lo = min(count, (stride - 1 - start) // stride) if start < 0 else 0
    hi = max(lo, min(count, (size - 1 - start) // stride + 1))
    return lo, hi, lo * stride + start


def _buffer(into: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """`into` seen with `shape` when it holds exactly that many values, else a fresh array."""
    if into is not None and into.size == int(np.prod(shape, dtype=np.int64)):
        return into.reshape(shape)
    return np.empty(shape, dtype=dtype)


def _convolve_2d(x: np.ndarray, w: np.ndarray, strides: Sequence[int], pads: Sequence[int],
                 dilations: Sequence[int], group: int, into: np.ndarray | None = None) -> np.ndarray:
    """2-D convolution without a padded copy of the input (pads >= 0); `into` is a buffer for the result."""
    n, c, h, wd = x.shape
    m, _, kh, kw = w.shape
    out_shape = (_output_size(h, kh, strides[0], dilations[0], pads[0], pads[2]),
                 _output_size(wd, kw, strides[1], dilations[1], pads[1], pads[3]))
    if into is not None and into.shape != (n, m) + out_shape:
        into = None
    if n == 0 or m == 0 or 0 in out_shape:
        return np.zeros((n, m) + out_shape, dtype=x.dtype)
    if kh == kw == 1 and not any(pads):
        return _pointwise(x[:, :, ::strides[0], ::strides[1]], w, group, into)
    if group == c == m:
        return _depthwise(x, w, out_shape, strides, pads, dilations, into)
    return _im2col_2d(x, w, out_shape, strides, pads, dilations, group, into)


def _im2col_2d(x: np.ndarray, w: np.ndarray, out_shape: tuple[int, int], strides: Sequence[int],
               pads: Sequence[int], dilations: Sequence[int], group: int, into: np.ndarray | None = None,
               product: Callable[[np.ndarray, np.ndarray, int, int], None] | None = None,
               fill: Callable[[np.ndarray, int, int, int], None] | None = None) -> np.ndarray:
    """Columns [C, KH, KW, rows, OW] filled one kernel tap at a time (zeros where a tap reads padding), times
    the weights [group, M/group, C/group * KH * KW]; a block of output rows at a time bounds the scratch.

    `product(columns[1, C * KH * KW, pixels], block[1, M, pixels], image, first pixel)` and
    `fill(columns[C * KH * KW, pixels], image, r0, r1)`, when given, compute a block's product and fill its columns
    instead of numpy (the native kernels; the product finishes the block with bias, residual and activation too)."""
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    oh, ow = out_shape
    row_ranges = [_valid_range(h, oh, pads[0], i * dilations[0], strides[0]) for i in range(kh)]
    col_ranges = [_valid_range(wd, ow, pads[1], j * dilations[1], strides[1]) for j in range(kw)]
    depth = cg * kh * kw
    if product is None:
        block = max(1, min(oh, COLUMN_BYTES // (c * kh * kw * ow * x.itemsize)))
    else:  # blocks of at least a few hundred pixels: each block is a call with its own overhead
        block = max(-(-NATIVE_MIN_PIXELS // ow), min(oh, NATIVE_COLUMN_BYTES // (c * kh * kw * ow * x.itemsize)))
        block = min(block, oh, max(1, COLUMN_BYTES // (c * kh * kw * ow * x.itemsize)))
    scratch = np.empty(c * kh * kw * block * ow, dtype=x.dtype)
    weights = w.reshape(group, m // group, depth)
    out = _buffer(into, (n, group, m // group, oh * ow), x.dtype)
    for b in range(n):
        for r0 in range(0, oh, block):
            r1 = min(oh, r0 + block)
            cols = scratch[:c * kh * kw * (r1 - r0) * ow].reshape(c, kh, kw, r1 - r0, ow)
            if fill is not None:
                fill(cols.reshape(c * kh * kw, -1), b, r0, r1)
            else:
                for i, rows in enumerate(row_ranges):
                    for j, columns in enumerate(col_ranges):
                        _fill_tap(cols[:, i, j], x[b], r0, r1, rows, columns, strides)
            if product is None:
                np.matmul(weights, cols.reshape(group, depth, -1), out=out[b, :, :, r0 * ow:r1 * ow])
            else:
                product(cols.reshape(1, c * kh * kw, -1), out[b].reshape(1, m, oh * ow)[:, :, r0 * ow:r1 * ow], b,
                        r0 * ow)
    return out.reshape(n, m, oh, ow)


def _fill_tap(dst: np.ndarray, image: np.ndarray, r0: int, r1: int, rows: tuple[int, int, int],
              columns: tuple[int, int, int], strides: Sequence[int]) -> None:
    """dst[C, r1 - r0, OW] = what one kernel tap reads for output rows [r0, r1): the image, or 0 in the padding."""
    lo, hi, first = rows
    c_lo, c_hi, c_first = columns
    lo, hi = max(lo, r0), min(hi, r1)
    first += (lo - rows[0]) * strides[0]
    if hi <= lo or c_hi <= c_lo:
        dst[...] = 0
        return
    lo, hi = lo - r0, hi - r0
    if lo:
        dst[:, :lo] = 0
    if hi < dst.shape[1]:
        dst[:, hi:] = 0
    if c_lo:
        dst[:, lo:hi, :c_lo] = 0
    if c_hi < dst.shape[2]:
        dst[:, lo:hi, c_hi:] = 0
    dst[:, lo:hi, c_lo:c_hi] = image[:, first:first + (hi - lo - 1) * strides[0] + 1:strides[0],
                                     c_first:c_first + (c_hi - c_lo - 1) * strides[1] + 1:strides[1]]


def _depthwise(x: np.ndarray, w: np.ndarray, out_shape: tuple[int, int], strides: Sequence[int],
               pads: Sequence[int], dilations: Sequence[int], into: np.ndarray | None = None) -> np.ndarray:
    """group == C == M: one multiply-accumulate per kernel tap, on flat rows.

    The padded input is split into its stride phases (one plane per (row, column) remainder), each stored as
    flat rows [C, rows * width]. A tap then reads one contiguous run of its phase's plane per channel, and the
    outputs are computed on the plane's width (the few extra columns at each row's end are cropped): long
    unit-stride inner loops instead of short strided ones. Channels go a block at a time through accumulators
    small enough to stay in cache.
    """
    n, c, h, wd = x.shape
    kh, kw = w.shape[2:]
    oh, ow = out_shape
    (sh, sw), (dh, dw) = strides, dilations
    plane_h = oh + (kh - 1) * dh // sh
    plane_w = ow + (kw - 1) * dw // sw
    size = plane_h * plane_w
    phases = sorted({(i * dh % sh, j * dw % sw) for i in range(kh) for j in range(kw)})
    planes = np.zeros((len(phases), n * c, size + plane_w), dtype=x.dtype)  # + one row: the last tap's overrun
    images = x.reshape(n * c, h, wd)
    for p, (a, b) in enumerate(phases):
        lo, hi, first = _valid_range(h, plane_h, pads[0], a, sh)
        c_lo, c_hi, c_first = _valid_range(wd, plane_w, pads[1], b, sw)
        if hi > lo and c_hi > c_lo:
            plane = planes[p, :, :size].reshape(n * c, plane_h, plane_w)
            plane[:, lo:hi, c_lo:c_hi] = images[:, first:first + (hi - lo - 1) * sh + 1:sh,
                                                c_first:c_first + (c_hi - c_lo - 1) * sw + 1:sw]
    length = oh * plane_w
    taps = [(phases.index((i * dh % sh, j * dw % sw)), i * dh // sh * plane_w + j * dw // sw)
            for i in range(kh) for j in range(kw)]
    weights = w.reshape(c, kh * kw)
    step = max(1, _DEPTHWISE_BYTES // (2 * length * x.itemsize))
    acc = np.empty((min(step, c), length), dtype=x.dtype)
    term = np.empty_like(acc)
    out = _buffer(into, (n * c, oh, ow), x.dtype)
    blocks = [(i * c + s, i * c + min(c, s + step)) for i in range(n) for s in range(0, c, step)]
    for start, stop in blocks:  # a block of channels of one image
        a, t = acc[:stop - start], term[:stop - start]
        channels = slice(start % c, (stop - 1) % c + 1)
        for k, (p, offset) in enumerate(taps):
            source = planes[p, start:stop, offset:offset + length]
            weight = weights[channels, k:k + 1]
            if k == 0:
                np.multiply(source, weight, out=a)
            else:
                np.multiply(source, weight, out=t)
                np.add(a, t, out=a)
        out[start:stop] = a.reshape(stop - start, oh, plane_w)[:, :, :ow]
    return out.reshape(n, c, oh, ow)


def col2im(cols: np.ndarray, image_shape: Sequence[int], strides: Sequence[int],
           dilations: Sequence[int]) -> np.ndarray:
    """Scatter-adds cols[N, C, *kernel, *blocks] into an image[N, C, *image_shape] (before any cropping of pads).

    Block b's kernel tap k lands at b * stride + k * dilation; one strided slice-add per kernel offset.
    """
    nd = len(image_shape)
    kernel = cols.shape[2:2 + nd]
    blocks = cols.shape[2 + nd:]
    image = np.zeros(cols.shape[:2] + tuple(image_shape), dtype=cols.dtype)
    for offset in np.ndindex(*kernel):
        target = tuple(slice(k * d, k * d + (b - 1) * s + 1, s)
                       for k, d, b, s in zip(offset, dilations, blocks, strides))
        image[(Ellipsis,) + target] += cols[(slice(None), slice(None)) + offset]
    return image


def same_pads(in_shape: Sequence[int], out_shape: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
              dilations: Sequence[int], upper: bool) -> list[int]:
    """ONNX pads that make a window of this kernel produce `out_shape` outputs (odd extra at end if upper)."""
    begins, ends = [], []
    for i, o, k, s, d in zip(in_shape, out_shape, kernel, strides, dilations):
        total = max(0, (o - 1) * s + (k - 1) * d + 1 - i)
        small, large = total // 2, total - total // 2
        begins.append(small if upper else large)
        ends.append(large if upper else small)
    return begins + ends


def conv_pads(auto_pad: str, pads: Sequence[int] | None, in_shape: Sequence[int], kernel: Sequence[int],
              strides: Sequence[int], dilations: Sequence[int]) -> list[int]:
    """Explicit pads for Conv-like ops under every auto_pad mode."""
    nd = len(kernel)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out_shape = [-(-i // s) for i, s in zip(in_shape, strides)]
        return same_pads(in_shape, out_shape, kernel, strides, dilations, auto_pad == "SAME_UPPER")
    if auto_pad == "VALID" or pads is None:
        return [0] * (2 * nd)
    return list(pads)


def convolution_scratch_bytes(node: Node, facts: Mapping[str, Any], integer: bool = False) -> int:
    """A convolution's working memory beyond its output (the `scratch_bytes` of the convolution kernels): its padded
    input and im2col columns (1x1 and depthwise convolutions need no columns); `integer`: the quantized kernels,
    whose numpy path also makes a float copy of the shifted input."""
    from carrack.passes.facts import numpy_dtype

    if len(node.inputs) < 2:
        return 0
    x, w = facts.get(node.inputs[0]), facts.get(node.inputs[1])
    y = facts.get(node.outputs[0])
    if x is None or w is None or y is None or not all(f.shape and all(isinstance(d, int) for d in f.shape)
                                                      for f in (x, w, y)):
        return 0
    itemsize = max(numpy_dtype(x.elem_type).itemsize, 4)  # float16 and integer inputs are computed in float32/64
    n, c, *spatial = x.shape
    m, cg, *kernel = w.shape
    group = node.attrs.get("group", 1)
    pads = node.attrs.get("pads") or [0] * (2 * len(kernel))
    needs_padding = any(pads) or node.attrs.get("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER")
    padded = n * c * int(np.prod([d + 2 * (k // 2) for d, k in zip(spatial, kernel)])) * itemsize if needs_padding \
        else 0
    if integer:
        padded += n * c * int(np.prod(spatial)) * 4  # the numpy path's float32 copy of the shifted input
    if all(k == 1 for k in kernel) or (group == c == m):
        return padded
    columns = n * cg * group * int(np.prod(kernel)) * int(np.prod(y.shape[2:])) * itemsize
    return padded + min(columns, COLUMN_BYTES)  # columns are built in blocks of at most COLUMN_BYTES


def convolution_prepared_bytes(node: Node, constants: Mapping[str, Any]) -> int:
    """What the native kernels keep of a convolution's constant weights besides the graph's copy: a float32 copy
    of float16 weights, and the weights packed into packconv.c's panels (every 1-D and 2-D convolution but the
    depthwise ones, whose weights have one input channel a group)."""
    w = constants.get(node.inputs[1]) if len(node.inputs) > 1 else None
    kernels = native_conv.load() if isinstance(w, np.ndarray) and w.ndim >= 3 else None
    if kernels is None or w.dtype not in (np.float32, np.float16) or w.flags.writeable:
        return 0
    held = w.size * 4 if w.dtype == np.float16 else 0
    group = int(node.attrs.get("group", 1))
    if w.ndim in (3, 4) and w.shape[1] != 1 and group >= 1 and w.shape[0] % group == 0:
        held += kernels.packed_weight_bytes(w.shape, group)
    return held


class _ConvBase(Kernel):
    """Attributes shared by the convolution family."""

    def setup(self):
        self.auto_pad = self.attr("auto_pad", "NOTSET")
        if isinstance(self.auto_pad, bytes):
            self.auto_pad = self.auto_pad.decode()
        if self.auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
            self.fail(f"auto_pad must be NOTSET, SAME_UPPER, SAME_LOWER or VALID, got {self.auto_pad!r}")
        self.group = int(self.attr("group", 1))
        if self.group < 1:
            self.fail(f"group must be positive, got {self.group}")
        self.pads = self.attr("pads")
        self.strides = self.attr("strides")
        self.dilations = self.attr("dilations")

    def geometry(self, nd: int) -> tuple[list[int], list[int]]:
        strides = list(self.strides) if self.strides else [1] * nd
        dilations = list(self.dilations) if self.dilations else [1] * nd
        return strides, dilations


def _add_bias(y: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    if b is None:
        return y
    return y + b.astype(y.dtype, copy=False).reshape((1, -1) + (1,) * (y.ndim - 2))


@register("Conv", since=1)
class Conv(_ConvBase):
    #: the plan hands it each input shape it evaluates (`prepare_shape`), before any run of that shape
    prepares_shapes = True

    @classmethod
    def scratch_bytes(cls, node: Node, facts: Mapping[str, Any]) -> int:
        return convolution_scratch_bytes(node, facts)

    @classmethod
    def prepared_bytes(cls, node: Node, constants: Mapping[str, Any]) -> int:
        return convolution_prepared_bytes(node, constants)

    def setup(self):
        super().setup()
        self.native = self.if_native(native_conv.load)  # None: numpy (the plan chose it: CARRACK_NATIVE=0, ...)
        self.dense = self._dense_constants() if self.native is not None else {}
        self.widened = half.WidenedConstants()
        self.operands = self._constant_operands() if self.native is not None else None
        #: input shape -> (BoundConvolution, activation, residual?): filled by the plan's per-size evaluation
        self.prepared = PreparedShapes()

    def _dense_constants(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{input index: (constant, its C-contiguous aligned read-only copy)} for a weight or bias initializer the
        native kernels would otherwise copy on every run (e.g. a broadcast ConstantOfShape value, stride 0)."""
        graph = self.ctx.graph if self.ctx is not None else None
        dense: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for i in (1, 2):
            a = graph.initializers.get(self.node.inputs[i]) if graph is not None and len(self.node.inputs) > i else None
            if isinstance(a, np.ndarray) and a.dtype == np.float32 and not (a.flags.c_contiguous and a.flags.aligned):
                copy = np.require(a, np.float32, ("C", "A", "O"))
                copy.flags.writeable = False
                dense[i] = (a, copy)
        return dense

    def _constant_operands(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The weight and bias as a run hands them to the native kernels (dense copies, float16 widened), when both
        are read-only constants of the graph; None otherwise."""
        graph = self.ctx.graph if self.ctx is not None else None
        names = list(self.node.inputs) + ["", ""]
        if graph is None or not names[1]:
            return None
        w, b = graph.initializers.get(names[1]), graph.initializers.get(names[2]) if names[2] else None
        if not isinstance(w, np.ndarray) or w.flags.writeable or (names[2] and not isinstance(b, np.ndarray)):
            return None
        if b is not None and b.flags.writeable:
            return None
        w = self.dense[1][1] if 1 in self.dense else w
        b = self.dense[2][1] if 2 in self.dense else b
        return self.widened(w), self.widened(b)

    def prepare_shape(self, x_shape: tuple[int, ...], activation: Epilogue | None = None,
                      residual: bool = False) -> None:
        """Bind the native call for inputs of `x_shape` (see BoundConvolution), for constant weights only. Called
        by the plan's per-size evaluation (carrack.plan.plan.prepare_kernels), never by a run."""
        if self.native is None or len(x_shape) < 3 or x_shape in self.prepared:
            return
        bound = None
        if self.operands is not None:
            w, b = self.operands
            strides, dilations = self.geometry(len(x_shape) - 2)
            pads = conv_pads(self.auto_pad, self.pads, x_shape[2:], w.shape[2:], strides, dilations)
            if len(w.shape) == len(x_shape) and len(pads) == 2 * (len(x_shape) - 2):
                kind = _native_kind(x_shape, w.shape, strides, pads, dilations, self.group, residual,
                                    self.native.packs)
                act = native_conv.NO_ACTIVATION if activation is None else activation.native()
                if kind is not None:
                    bound = self.native.bind(kind, x_shape, w, b, strides, pads, dilations, self.group, act)
        self.prepared.add(x_shape, None if bound is None else (bound, activation, residual))

    def run(self, x, w, b=None):
        return self.run_into(None, x, w, b)

    def _check_output_size(self, x: np.ndarray, w: np.ndarray) -> None:
        """Padding and input sizes can ask for an output beyond the memory limit or the machine: refuse it first."""
        strides, dilations = self.geometry(x.ndim - 2)
        pads = conv_pads(self.auto_pad, self.pads, x.shape[2:], w.shape[2:], strides, dilations)
        nd = x.ndim - 2
        if len(pads) != 2 * nd or len(strides) != nd or len(dilations) != nd:
            return  # the kernel reports the mismatch
        spatial = [_output_size(x.shape[2 + i], w.shape[2 + i], strides[i], dilations[i], pads[i], pads[nd + i])
                   for i in range(nd)]
        self.check_output([x.shape[0], w.shape[0], *spatial], x.dtype)

    def run_into(self, out, x, w, b=None, activation: Epilogue | None = None, residual: np.ndarray | None = None):
        """The convolution (plus `residual`, then `activation`), written into `out` when it is a usable buffer for
        the result (else allocated)."""
        if out is None and x.ndim >= 3 and np.ndim(w) == x.ndim:
            self._check_output_size(x, w)
        if self.native is not None and half.is_half(x, w, b, residual):
            y = self.run_into(None, half.widen(x), self.widened(w), self.widened(b), activation,
                              half.widen(residual))
            return half.narrow(y, out)
        if self.dense:
            w = self.dense[1][1] if 1 in self.dense and w is self.dense[1][0] else w
            b = self.dense[2][1] if 2 in self.dense and b is self.dense[2][0] else b
        if self.native is not None:
            prepared = self.prepared.get(x.shape)
            if (prepared is not None and prepared[0].w is w and prepared[0].bias is b and prepared[1] is activation
                    and prepared[2] == (residual is not None)):
                y = prepared[0](x, out, residual)
                if y is not None:
                    return y if activation is None or activation.code >= 0 else activation.apply(y)
        nd = x.ndim - 2
        strides, dilations = self.geometry(nd)
        pads = conv_pads(self.auto_pad, self.pads, x.shape[2:], w.shape[2:], strides, dilations)
        return convolve(x, w, strides=strides, pads=pads, dilations=dilations, group=self.group, bias=b, out=out,
                        activation=activation, kernels=self.native, residual=residual)

    def bind_into(self, out, x, w, b=None, activation: Epilogue | None = None, residual: np.ndarray | None = None):
        """The shape's bound native call for these very arrays with its arguments converted once
        (BoundConvolution.bind_call), where `run_into` would make that call; a call that fails (out of memory)
        takes `run_into`'s general path. None where `run_into` would not reach the bound call."""
        if self.native is None or (activation is not None and activation.code < 0) or half.is_half(x, w, b, residual):
            return None
        wd = self.dense[1][1] if 1 in self.dense and w is self.dense[1][0] else w
        bd = self.dense[2][1] if 2 in self.dense and b is self.dense[2][0] else b
        prepared = self.prepared.get(x.shape)
        if (prepared is None or prepared[0].w is not wd or prepared[0].bias is not bd or prepared[1] is not activation
                or prepared[2] != (residual is not None)):
            return None
        call = prepared[0].bind_call(x, out, residual)
        if call is None:
            return None
        return bound_or_run_into(call, self.run_into, out, x, w, b, activation, residual)


@register("ConvTranspose", since=1)
class ConvTranspose(_ConvBase):
    def setup(self):
        super().setup()
        self.output_padding = self.attr("output_padding")
        self.output_shape = self.attr("output_shape")

    def run(self, x, w, b=None):
        nd = x.ndim - 2
        strides, dilations = self.geometry(nd)
        in_shape = x.shape[2:]
        kernel = w.shape[2:]
        out_pad = list(self.output_padding) if self.output_padding else [0] * nd
        full = [(i - 1) * s + (k - 1) * d + 1 for i, s, k, d in zip(in_shape, strides, kernel, dilations)]
        pads = self._pads(in_shape, full, out_pad, strides, nd)
        out_shape = [f + p - b - e for f, p, b, e in zip(full, out_pad, pads[:nd], pads[nd:])]

        out_dtype = np.result_type(x, w)
        dtype = _compute_dtype(out_dtype)
        n, c = x.shape[:2]
        g = self.group
        mg = w.shape[1]
        # cols[n, group, Mg*K, pixels] = W_g^T @ X_g, then scatter-add every kernel tap into the output.
        wg = w.astype(dtype, copy=False).reshape(g, c // g, -1).transpose(0, 2, 1)
        xg = x.astype(dtype, copy=False).reshape(n, g, c // g, -1)
        cols = np.matmul(wg, xg).reshape((n, g * mg) + tuple(kernel) + tuple(in_shape))
        image = col2im(cols, full, strides, dilations)
        # Crop the pads off the full result (negative pads) and extend by output_padding (positive pads).
        crop = [-p for p in pads[:nd]] + [o + p - f for o, p, f in zip(out_shape, pads[:nd], full)]
        y = pad_spatial(image, crop).astype(out_dtype, copy=False)
        return _add_bias(y, b)

    def _pads(self, in_shape, full, out_pad, strides, nd) -> list[int]:
        target = None
        if self.output_shape:
            target = list(self.output_shape)[-nd:]
        elif self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            target = [i * s for i, s in zip(in_shape, strides)]
        if target is None:
            if self.auto_pad == "VALID" or not self.pads:
                return [0] * (2 * nd)
            return list(self.pads)
        begins, ends = [], []
        for f, p, o in zip(full, out_pad, target):
            total = f + p - o
            if not self.output_shape:
                total = max(total, 0)  # like onnxruntime: SAME never pads the output out past the full result
            small, large = total // 2, total - total // 2
            upper = self.auto_pad == "SAME_UPPER"
            begins.append(small if upper else large)
            ends.append(large if upper else small)
        return begins + ends


@register("Col2Im", since=18)
class Col2Im(Kernel):
    def setup(self):
        self.pads = self.attr("pads")
        self.strides = self.attr("strides")
        self.dilations = self.attr("dilations")

    def run(self, x, image_shape, block_shape):
        image_shape = [int(v) for v in image_shape]
        block_shape = [int(v) for v in block_shape]
        nd = len(image_shape)
        strides = list(self.strides) if self.strides else [1] * nd
        dilations = list(self.dilations) if self.dilations else [1] * nd
        pads = list(self.pads) if self.pads else [0] * (2 * nd)
        padded = [i + b + e for i, b, e in zip(image_shape, pads[:nd], pads[nd:])]
        blocks = [(p - (k - 1) * d - 1) // s + 1 for p, k, d, s in zip(padded, block_shape, dilations, strides)]
        n = x.shape[0]
        cols = x.reshape((n, -1) + tuple(block_shape) + tuple(blocks))
        image = col2im(cols, padded, strides, dilations)
        return pad_spatial(image, [-p for p in pads])


@register("DeformConv", since=19)
class DeformConv(_ConvBase):
    def setup(self):
        super().setup()
        self.offset_group = int(self.attr("offset_group", 1))

    def run(self, x, w, offset, b=None, mask=None):
        nd = x.ndim - 2
        strides, dilations = self.geometry(nd)
        pads = list(self.pads) if self.pads else [0] * (2 * nd)
        kernel = w.shape[2:]
        out_spatial = tuple(offset.shape[2:])
        n, c = x.shape[:2]
        og = self.offset_group
        k_count = int(np.prod(kernel))
        p_count = int(np.prod(out_spatial))

        out_dtype = np.result_type(x, w)
        dtype = _compute_dtype(out_dtype)
        # Sampling positions: base grid (output position * stride - pad + tap * dilation) plus the learned offsets.
        base = np.stack(np.meshgrid(*[np.arange(o) * s - p for o, s, p in zip(out_spatial, strides, pads[:nd])],
                                    indexing="ij"), axis=0).reshape(nd, 1, p_count)
        taps = np.stack(np.meshgrid(*[np.arange(k) * d for k, d in zip(kernel, dilations)], indexing="ij"),
                        axis=0).reshape(nd, k_count, 1)
        delta = offset.astype(dtype, copy=False).reshape(n, og, k_count, nd, p_count).transpose(0, 1, 3, 2, 4)
        positions = delta + (base + taps).astype(dtype)  # N, og, nd, K, P
        samples = _multilinear_sample(x.astype(dtype, copy=False).reshape((n, og, c // og) + x.shape[2:]), positions)
        if mask is not None:
            samples = samples * mask.astype(dtype, copy=False).reshape(n, og, 1, k_count, p_count)
        cols = samples.reshape(n, self.group, -1, p_count)  # channel-major then tap: matches W's layout
        g = self.group
        y = np.matmul(w.astype(dtype, copy=False).reshape(g, w.shape[0] // g, -1), cols)
        y = y.reshape((n, w.shape[0]) + out_spatial).astype(out_dtype, copy=False)
        return _add_bias(y, b)


def _multilinear_sample(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Samples x[N, G, Cg, *spatial] at positions[N, G, nd, K, P] (zero outside); returns [N, G, Cg, K, P]."""
    n, g, cg = x.shape[:3]
    spatial = x.shape[3:]
    nd = len(spatial)
    flat = x.reshape(n, g, cg, -1).transpose(0, 1, 3, 2)  # N, G, S, Cg
    lows = np.floor(positions)
    fracs = positions - lows
    lows = lows.astype(np.int64)
    out = np.zeros(positions.shape[:2] + positions.shape[3:] + (cg,), dtype=x.dtype)
    n_idx = np.arange(n).reshape(n, 1, 1, 1)
    g_idx = np.arange(g).reshape(1, g, 1, 1)
    for corner in np.ndindex(*([2] * nd)):
        weight = np.ones(positions.shape[:2] + positions.shape[3:], dtype=x.dtype)
        linear = np.zeros(weight.shape, dtype=np.int64)
        inside = np.ones(weight.shape, dtype=bool)
        for axis, bit in enumerate(corner):
            idx = lows[:, :, axis] + bit
            frac = fracs[:, :, axis]
            weight = weight * (frac if bit else 1 - frac)
            inside &= (idx >= 0) & (idx < spatial[axis])
            linear = linear * spatial[axis] + np.clip(idx, 0, spatial[axis] - 1)
        values = flat[n_idx, g_idx, linear]  # N, G, K, P, Cg
        out += values * (weight * inside)[..., None]
    return out.transpose(0, 1, 4, 2, 3)


@register("CausalConvWithState", since=27)
class CausalConvWithState(Kernel):
    def setup(self):
        activation = self.attr("activation", "none")
        self.activation = activation.decode() if isinstance(activation, bytes) else activation
        if self.activation not in ("none", "silu", "swish"):
            self.fail(f"activation must be 'silu', 'swish' or 'none', got {self.activation!r}")
        self.native = self.if_native(native_conv.load)

    def run(self, x, w, b=None, past_state=None):
        k = w.shape[-1]
        if past_state is None:
            past_state = np.zeros(x.shape[:2] + (k - 1,), dtype=x.dtype)
        sequence = np.concatenate([past_state.astype(x.dtype, copy=False), x], axis=2)
        y = convolve(sequence, w, strides=[1], pads=[0, 0], dilations=[1], group=x.shape[1],
                     kernels=self.native).astype(x.dtype)
        y = _add_bias(y, b)
        if self.activation != "none":
            y = y / (1 + np.exp(-y))
        present = sequence[:, :, sequence.shape[2] - (k - 1):]
        return y.astype(x.dtype, copy=False), present
