"""Convolution kernels: Conv, ConvTranspose, DeformConv, Col2Im, CausalConvWithState.

`convolve` is the shared N-D cross-correlation (im2col + one batched matmul over groups) that the quantized
convolutions reuse.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from carrack.ops.registry import Kernel, register


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    # float16 matmul in numpy is slow and accumulates in float16; do the arithmetic in float32.
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def pad_spatial(x: np.ndarray, pads: Sequence[int], value: float = 0) -> np.ndarray:
    """Pads (or crops, for negative pads) the trailing spatial axes of x[N, C, *spatial]; ONNX pads order."""
    nd = len(pads) // 2
    begins, ends = list(pads[:nd]), list(pads[nd:])
    if not any(begins) and not any(ends):
        return x
    if any(p > 0 for p in begins + ends):
        widths = [(0, 0)] * (x.ndim - nd) + [(max(b, 0), max(e, 0)) for b, e in zip(begins, ends)]
        x = np.pad(x, widths, constant_values=value)
    if any(p < 0 for p in begins + ends):
        crop = tuple(slice(-min(b, 0), x.shape[x.ndim - nd + i] + min(e, 0)) for i, (b, e) in enumerate(zip(begins, ends)))
        x = x[(Ellipsis,) + crop]
    return x


def windows(x: np.ndarray, kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]) -> np.ndarray:
    """Strided view x[N, C, *out_spatial, *kernel] of the (already padded) input's sliding windows."""
    nd = len(kernel)
    extent = tuple((k - 1) * d + 1 for k, d in zip(kernel, dilations))
    view = sliding_window_view(x, extent, axis=tuple(range(x.ndim - nd, x.ndim)))
    step = tuple(slice(None, None, s) for s in strides) + tuple(slice(None, None, d) for d in dilations)
    return view[(Ellipsis,) + step]


def convolve(x: np.ndarray, w: np.ndarray, *, strides: Sequence[int], pads: Sequence[int],
             dilations: Sequence[int], group: int) -> np.ndarray:
    """N-D cross-correlation of x[N, C, *spatial] with w[M, C/group, *kernel]; no bias.

    ``pads`` is in ONNX order [x1_begin, x2_begin, ..., x1_end, x2_end, ...]. The result has the common dtype
    of x and w.
    """
    out_dtype = np.result_type(x, w)
    dtype = _compute_dtype(out_dtype)
    x = pad_spatial(x.astype(dtype, copy=False), pads)
    w = w.astype(dtype, copy=False)
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    kernel = w.shape[2:]
    nd = len(kernel)
    if cg * group != c or m % group:
        raise ValueError(f"Conv: input has {c} channels, weight {w.shape} with group={group} does not match")
    if all(k == 1 for k in kernel):
        out = _pointwise(x[(Ellipsis,) + tuple(slice(None, None, s) for s in strides)], w, group)
    elif group == c == m:
        out = _depthwise(x, w, strides, dilations)
    else:
        win = windows(x, kernel, strides, dilations)  # N, C, *O, *K
        out_spatial = win.shape[2:2 + nd]
        order = (0, 1) + tuple(range(2 + nd, 2 + 2 * nd)) + tuple(range(2, 2 + nd))
        cols = win.transpose(order).reshape(n, group, cg * int(np.prod(kernel)), -1)
        out = np.matmul(w.reshape(group, m // group, -1), cols).reshape((n, m) + out_spatial)
    return out.astype(out_dtype, copy=False)


def _pointwise(x: np.ndarray, w: np.ndarray, group: int) -> np.ndarray:
    n, c = x.shape[:2]
    m = w.shape[0]
    cols = x.reshape(n, group, c // group, -1)
    return np.matmul(w.reshape(group, m // group, c // group), cols).reshape((n, m) + x.shape[2:])


def _depthwise(x: np.ndarray, w: np.ndarray, strides: Sequence[int], dilations: Sequence[int]) -> np.ndarray:
    """group == C == M: one multiply-accumulate per kernel offset, no block-diagonal matmul."""
    kernel = w.shape[2:]
    win = windows(x, kernel, strides, dilations)  # N, C, *O, *K
    nd = len(kernel)
    out = np.zeros(win.shape[:2 + nd], dtype=x.dtype)
    taps = w.reshape(w.shape[0], -1)
    channel_shape = (1, -1) + (1,) * nd
    for i, offset in enumerate(np.ndindex(*kernel)):
        out += win[(Ellipsis,) + offset] * taps[:, i].reshape(channel_shape)
    return out
