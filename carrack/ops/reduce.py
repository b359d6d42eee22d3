"""Reductions: ReduceSum/Mean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare, ArgMax/ArgMin.

`axes` is an attribute up to ReduceSum-11 and the other Reduce*-13, an optional input afterwards. With
`noop_with_empty_axes` and no axes, the reduction runs over the empty axis set, so element-wise parts still apply
(ReduceSumSquare squares, ReduceL1 takes the absolute value), as onnxruntime does. Reducing an empty set gives the
operation's identity (0 for sums, 1 for products, -inf for max and log-sums, +inf for min).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from carrack.ops.registry import Kernel, register

Axes = tuple[int, ...] | None  # None: every axis


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype to accumulate in: float32 for the narrow floats (float16, bfloat16, float8), else the input's."""
    if dtype == np.float16 or dtype.kind == "V":  # ml_dtypes types (bfloat16, float8, int4) have kind "V"
        return np.dtype(np.float32)
    return dtype


def normalize_axes(axes: Sequence[int], rank: int) -> tuple[int, ...]:
    return tuple(sorted({int(a) + rank if a < 0 else int(a) for a in axes}))


class _Reduce(Kernel):
    """Shared axes/keepdims handling; subclasses implement `reduce(x, axes, keepdims)` in a compute dtype."""

    axes_input_since = 18

    def setup(self):
        self.keepdims = bool(self.attr("keepdims", 1))
        self.noop_with_empty_axes = bool(self.attr("noop_with_empty_axes", 0))
        self.axes_attr = self.attr("axes")

    def run(self, data, axes=None):
        if self.version < self.axes_input_since:
            wanted = self.axes_attr
        else:
            wanted = None if axes is None else axes.reshape(-1).tolist()
        if wanted:
            resolved: Axes = normalize_axes(wanted, data.ndim)
        elif self.noop_with_empty_axes and self.version >= self.axes_input_since:
            resolved = ()
        else:
            resolved = None
        out = self.reduce(data, resolved, self.keepdims)
        return np.asarray(out).astype(data.dtype, copy=False)

    def reduce(self, x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
        raise NotImplementedError


def _as_compute(x: np.ndarray) -> np.ndarray:
    return x.astype(compute_dtype(x.dtype), copy=False)


@register("ReduceSum", since=1)
class ReduceSum(_Reduce):
    axes_input_since = 13

    def reduce(self, x, axes, keepdims):
        return np.sum(_as_compute(x), axis=axes, keepdims=keepdims, dtype=compute_dtype(x.dtype))


@register("ReduceMean", since=1)
class ReduceMean(_Reduce):
    def reduce(self, x, axes, keepdims):
        if x.dtype.kind in "iu":
            return np.trunc(np.mean(x, axis=axes, keepdims=keepdims, dtype=np.float64))
        if x.dtype == np.float32 and axes and _trailing(axes, x.ndim) and x.flags.c_contiguous and x.size:
            return _mean_trailing(x, axes, keepdims)
        return np.mean(_as_compute(x), axis=axes, keepdims=keepdims)


def _trailing(axes: tuple[int, ...], rank: int) -> bool:
    return axes == tuple(range(rank - len(axes), rank))


def _mean_trailing(x: np.ndarray, axes: tuple[int, ...], keepdims: bool) -> np.ndarray:
    """The mean over the last axes of a contiguous float32 tensor as a matrix-vector product (e.g. global
    average pooling of NCHW over H, W): BLAS sums rows several times faster than numpy's axis reduction."""
    inner = math.prod(x.shape[x.ndim - len(axes):])
    kept = x.shape[:x.ndim - len(axes)]
    sums = x.reshape(-1, inner) @ np.ones(inner, dtype=np.float32)
    mean = np.divide(sums, np.float32(inner), out=sums)
    return mean.reshape(kept + (1,) * len(axes) if keepdims else kept)


@register("ReduceProd", since=1)
class ReduceProd(_Reduce):
    def reduce(self, x, axes, keepdims):
        return np.prod(_as_compute(x), axis=axes, keepdims=keepdims, dtype=compute_dtype(x.dtype))


@register("ReduceSumSquare", since=1)
class ReduceSumSquare(_Reduce):
    def reduce(self, x, axes, keepdims):
        c = _as_compute(x)
        return np.sum(c * c, axis=axes, keepdims=keepdims, dtype=c.dtype)


@register("ReduceL1", since=1)
class ReduceL1(_Reduce):
    def reduce(self, x, axes, keepdims):
        c = _as_compute(x)
        return np.sum(np.abs(c), axis=axes, keepdims=keepdims, dtype=c.dtype)


@register("ReduceL2", since=1)
class ReduceL2(_Reduce):
    def reduce(self, x, axes, keepdims):
        c = _as_compute(x)
        if c.dtype.kind in "iu":
            c = c.astype(np.float64)
        return np.sqrt(np.sum(c * c, axis=axes, keepdims=keepdims))


@register("ReduceLogSum", since=1)
class ReduceLogSum(_Reduce):
    def reduce(self, x, axes, keepdims):
        c = _as_compute(x)
        if c.dtype.kind in "iu":
            c = c.astype(np.float64)
        with np.errstate(divide="ignore"):  # log(0) = -inf is the defined result of an empty or zero sum
            return np.log(np.sum(c, axis=axes, keepdims=keepdims))


@register("ReduceLogSumExp", since=1)
class ReduceLogSumExp(_Reduce):
    def reduce(self, x, axes, keepdims):
        c = _as_compute(x)
        if c.dtype.kind in "iu":
            c = c.astype(np.float64)
        # Shift by the maximum so exp cannot overflow; infinite maxima (and empty sets) are not shifted.
        peak = np.max(c, axis=axes, keepdims=True, initial=-np.inf)
        peak = np.where(np.isfinite(peak), peak, 0).astype(c.dtype)
        total = np.sum(np.exp(c - peak), axis=axes, keepdims=True)
        with np.errstate(divide="ignore"):
            out = np.log(total) + peak
        if not keepdims:
            out = out.reshape(_reduced_shape(c.shape, axes))
        return out


def _reduced_shape(shape: tuple[int, ...], axes: Axes) -> tuple[int, ...]:
    if axes is None:
        return ()
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _lowest(dtype: np.dtype):
    if dtype.kind == "b":
        return False
    if dtype.kind in "iu":
        return np.iinfo(dtype).min
    return -np.inf


def _highest(dtype: np.dtype):
    if dtype.kind == "b":
        return True
    if dtype.kind in "iu":
        return np.iinfo(dtype).max
    return np.inf


@register("ReduceMax", since=1)
class ReduceMax(_Reduce):
    def reduce(self, x, axes, keepdims):
        c = _as_compute(x)
        return np.max(c, axis=axes, keepdims=keepdims, initial=_lowest(c.dtype))


@register("ReduceMin", since=1)
class ReduceMin(_Reduce):
    def reduce(self, x, axes, keepdims):
        c = _as_compute(x)
        return np.min(c, axis=axes, keepdims=keepdims, initial=_highest(c.dtype))


class _ArgReduce(Kernel):
    pick = staticmethod(np.argmax)

    def setup(self):
        self.axis = int(self.attr("axis", 0))
        self.keepdims = bool(self.attr("keepdims", 1))
        self.select_last_index = bool(self.attr("select_last_index", 0))

    def run(self, data):
        axis = self.axis + data.ndim if self.axis < 0 else self.axis
        c = _as_compute(data)
        if self.select_last_index:
            flipped = np.flip(c, axis=axis)
            index = c.shape[axis] - 1 - self.pick(flipped, axis=axis, keepdims=self.keepdims)
        else:
            index = self.pick(c, axis=axis, keepdims=self.keepdims)
        return np.asarray(index, dtype=np.int64)


@register("ArgMax", since=1)
class ArgMax(_ArgReduce):
    pick = staticmethod(np.argmax)


@register("ArgMin", since=1)
class ArgMin(_ArgReduce):
    pick = staticmethod(np.argmin)
