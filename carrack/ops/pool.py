"""Pooling kernels: MaxPool, AveragePool, LpPool, their Global forms, MaxUnpool, MaxRoiPool, RoiAlign.

Windowed pools accumulate, one kernel offset at a time, strided views of the padded input.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from carrack.native import convolution as native_conv
from carrack.ops import half
from carrack.ops.conv import pad_spatial, same_pads
from carrack.ops.registry import Kernel, register


def _text(value, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else value


class PoolGeometry:
    """Output shape, pads and the extra end padding ceil_mode needs, for one input shape."""

    def __init__(self, in_shape: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
                 dilations: Sequence[int], pads: Sequence[int] | None, auto_pad: str, ceil_mode: bool):
        nd = len(kernel)
        extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            self.out_shape = [-(-i // s) for i, s in zip(in_shape, strides)]
            self.pads = same_pads(in_shape, self.out_shape, kernel, strides, dilations, auto_pad == "SAME_UPPER")
        else:
            self.pads = [0] * (2 * nd) if auto_pad == "VALID" or not pads else [int(p) for p in pads]
            self.out_shape = []
            for i, e, s, b, end in zip(in_shape, extents, strides, self.pads[:nd], self.pads[nd:]):
                span = i + b + end - e
                count = (-(-span // s) if ceil_mode else span // s) + 1
                if ceil_mode and (count - 1) * s >= i + b:  # a last window starting in the end padding is dropped
                    count -= 1
                self.out_shape.append(count)
        self.kernel = self._reachable_kernel(in_shape, kernel, dilations)
        extents = [(k - 1) * d + 1 for k, d in zip(self.kernel, dilations)]
        # ceil_mode windows may overhang the explicit end padding; pad those cells too (never counted as padding).
        self.overhang = [max(0, (o - 1) * s + e - (i + b + end))
                         for o, s, e, i, b, end in zip(self.out_shape, strides, extents, in_shape,
                                                       self.pads[:nd], self.pads[nd:])]

    def _reachable_kernel(self, in_shape: Sequence[int], kernel: Sequence[int], dilations: Sequence[int],
                          ) -> list[int]:
        """The kernel cut to the taps that land inside the input or its explicit pads for some window.

        Every window starts at or after the first padded cell, so a tap whose offset reaches past the padded
        input even from the first window reads only the ceil_mode overhang, for every window: it adds nothing to
        a sum, a maximum or a count, and pooling without it bounds the work by the input, not the kernel (a
        320x320 average over a 3x3 map reads 9 taps, not 102400)."""
        nd = len(kernel)
        padded = [i + b + end for i, b, end in zip(in_shape, self.pads[:nd], self.pads[nd:])]
        return [max(1, min(k, -(-p // d))) for k, d, p in zip(kernel, dilations, padded)]

    def padded(self, x: np.ndarray, value) -> np.ndarray:
        nd = len(self.overhang)
        ends = [e + o for e, o in zip(self.pads[nd:], self.overhang)]
        return pad_spatial(x, list(self.pads[:nd]) + ends, value)


class _WindowPool(Kernel):
    """Attributes shared by MaxPool, AveragePool and LpPool."""

    def setup(self):
        self.kernel = [int(k) for k in self.required_attr("kernel_shape")]
        nd = len(self.kernel)
        self.strides = [int(s) for s in self.attr("strides", [1] * nd)] or [1] * nd
        self.dilations = [int(d) for d in self.attr("dilations", [1] * nd)] or [1] * nd
        self.pads = self.attr("pads")
        self.auto_pad = _text(self.attr("auto_pad"), "NOTSET")
        if self.auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
            self.fail(f"auto_pad must be NOTSET, SAME_UPPER, SAME_LOWER or VALID, got {self.auto_pad!r}")
        self.ceil_mode = bool(self.attr("ceil_mode", 0))
        self.native = self.if_native(native_conv.load) if nd == 2 else None  # float32 2-D pools: None = numpy only

    def native_pool(self, x: np.ndarray, geometry: PoolGeometry, mode: int) -> np.ndarray | None:
        """The pool by the native kernel (float32 images; float16 ones widened, pooled, rounded once); None when it
        cannot do it."""
        if self.native is not None and x.dtype == np.float16 and x.ndim == 4:
            y = self.native_pool(half.widen(x), geometry, mode)
            return None if y is None else half.narrow(y)
        if self.native is None or x.dtype != np.float32 or x.ndim != 4:
            return None
        if (mode != native_conv.POOL_MAX and list(geometry.kernel) == list(x.shape[2:]) and not any(geometry.pads)
                and geometry.out_shape == [1, 1] and self.dilations == [1, 1]):
            return self.native.plane_mean(x)  # a window over the whole image: a global average
        return self.native.pool(x, geometry.kernel, self.strides, self.dilations, geometry.pads, geometry.out_shape,
                                mode)

    def geometry(self, x: np.ndarray) -> PoolGeometry:
        return PoolGeometry(x.shape[2:], self.kernel, self.strides, self.dilations, self.pads, self.auto_pad,
                            self.ceil_mode)

    def taps(self, x: np.ndarray, geometry: PoolGeometry, value) -> Iterator[np.ndarray]:
        """For each kernel offset (row-major), the strided view x_padded[N, C, *out] of the input it reads.

        Accumulating over these views is far faster than reducing a sliding-window view over its kernel axes.
        """
        padded = geometry.padded(x, value)
        for offset in np.ndindex(*geometry.kernel):
            yield padded[(Ellipsis,) + tuple(slice(k * d, k * d + (o - 1) * s + 1, s) for k, d, o, s in
                                             zip(offset, self.dilations, geometry.out_shape, self.strides))]


def _sum(terms: Iterator[np.ndarray]) -> np.ndarray:
    total = None
    for term in terms:
        total = term.copy() if total is None else np.add(total, term, out=total)
    return total


def _lowest(dtype: np.dtype):
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


@register("MaxPool", since=1)
class MaxPool(_WindowPool):
    def setup(self):
        super().setup()
        self.storage_order = int(self.attr("storage_order", 0))

    def run(self, x):
        geometry = self.geometry(x)
        if (x.dtype in (np.uint8, np.int8) and (len(self.node.outputs) < 2 or not self.node.outputs[1])
                and self.implementation == "native"):
            from carrack.native import qconv  # quantized models' pools: native when the library loads

            y = qconv.maxpool_8bit(x, geometry.kernel, self.strides, self.dilations, geometry.pads,
                                   geometry.out_shape)
            if y is not None:
                return y
        if len(self.node.outputs) < 2 or not self.node.outputs[1]:
            y = self.native_pool(x, geometry, native_conv.POOL_MAX)
            if y is not None:
                return y
        taps = self.taps(x, geometry, _lowest(x.dtype))
        best = next(taps).copy()
        if len(self.node.outputs) < 2 or not self.node.outputs[1]:
            for view in taps:
                np.maximum(best, view, out=best)
            return best
        chosen = np.zeros(best.shape, dtype=np.int64)
        for tap, view in enumerate(taps, start=1):
            better = view > best  # strict: ties keep the first tap in row-major window order
            best = np.where(better, view, best)
            chosen[better] = tap
        return best, self._indices(x.shape, geometry, chosen)

    def _indices(self, in_shape, geometry: PoolGeometry, tap: np.ndarray) -> np.ndarray:
        """Flat input index of each chosen window tap (row-major, or column-major spatial if storage_order=1)."""
        nd = len(self.kernel)
        spatial = in_shape[2:]
        offsets = np.unravel_index(tap, geometry.kernel)
        coords = []
        for axis in range(nd):
            start = np.arange(geometry.out_shape[axis]) * self.strides[axis] - geometry.pads[axis]
            start = start.reshape((-1,) + (1,) * (nd - 1 - axis))
            coords.append(start + offsets[axis] * self.dilations[axis])
        order = range(nd - 1, -1, -1) if self.storage_order == 1 else range(nd)
        index = np.zeros(tap.shape, dtype=np.int64)
        for axis in order:
            index = index * spatial[axis] + coords[axis]
        plane = int(np.prod(spatial))
        channel = np.arange(in_shape[0] * in_shape[1], dtype=np.int64).reshape(in_shape[:2] + (1,) * nd)
        return index + channel * plane


def _window_counts(geometry: PoolGeometry, in_shape: Sequence[int], kernel, strides, dilations,
                   include_pad: bool) -> np.ndarray:
    """How many taps of each output window fall inside the input (or inside input + explicit pads)."""
    nd = len(kernel)
    counts = np.ones((), dtype=np.int64)
    for axis in range(nd):
        begin, end = geometry.pads[axis], geometry.pads[nd + axis]
        lo, hi = (-begin, in_shape[axis] + end) if include_pad else (0, in_shape[axis])
        start = np.arange(geometry.out_shape[axis]) * strides[axis] - begin
        taps = start[:, None] + np.arange(kernel[axis]) * dilations[axis]
        per_axis = ((taps >= lo) & (taps < hi)).sum(axis=1)
        counts = np.multiply.outer(counts, per_axis)
    return counts


@register("AveragePool", since=1)
class AveragePool(_WindowPool):
    def setup(self):
        super().setup()
        self.count_include_pad = bool(self.attr("count_include_pad", 0))

    def run(self, x):
        geometry = self.geometry(x)
        y = self.native_pool(x, geometry, native_conv.POOL_AVERAGE_PADS if self.count_include_pad
                             else native_conv.POOL_AVERAGE)
        if y is not None:
            return y
        acc = np.float32 if x.dtype == np.float16 else x.dtype
        total = _sum(view.astype(acc, copy=False) for view in self.taps(x, geometry, 0))
        counts = _window_counts(geometry, x.shape[2:], geometry.kernel, self.strides, self.dilations,
                                self.count_include_pad)
        np.divide(total, np.maximum(counts, 1).astype(acc), out=total)  # total is a fresh sum
        return total.astype(x.dtype, copy=False)


@register("LpPool", since=1)
class LpPool(_WindowPool):
    def setup(self):
        super().setup()
        self.p = self.attr("p", 2)

    def run(self, x):
        geometry = self.geometry(x)
        acc = np.float32 if x.dtype == np.float16 else x.dtype
        total = _sum(np.abs(view).astype(acc) ** self.p for view in self.taps(x, geometry, 0))
        return (total ** (1.0 / self.p)).astype(x.dtype)


@register("GlobalAveragePool", since=1)
class GlobalAveragePool(Kernel):
    def setup(self):
        self.native = self.if_native(native_conv.load)  # float32 inputs: None = numpy only

    def run(self, x):
        if self.native is not None and x.dtype == np.float16:  # a float32 mean, rounded once
            y = self.native.plane_mean(half.widen(x))
            if y is not None:
                return half.narrow(y)
        y = None if self.native is None else self.native.plane_mean(x)
        if y is not None:
            return y
        acc = np.float32 if x.dtype == np.float16 else x.dtype
        return x.mean(axis=tuple(range(2, x.ndim)), keepdims=True, dtype=acc).astype(x.dtype)


@register("GlobalMaxPool", since=1)
class GlobalMaxPool(Kernel):
    def run(self, x):
        return x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


@register("GlobalLpPool", since=1)
class GlobalLpPool(Kernel):
    def setup(self):
        self.p = self.attr("p", 2)

    def run(self, x):
        acc = np.float32 if x.dtype == np.float16 else x.dtype
        total = (np.abs(x).astype(acc) ** self.p).sum(axis=tuple(range(2, x.ndim)), keepdims=True)
        return (total ** (1.0 / self.p)).astype(x.dtype)


@register("MaxUnpool", since=9)
class MaxUnpool(Kernel):
    def setup(self):
        self.kernel = [int(k) for k in self.required_attr("kernel_shape")]
        nd = len(self.kernel)
        self.strides = [int(s) for s in self.attr("strides", [1] * nd)] or [1] * nd
        self.pads = [int(p) for p in self.attr("pads", [0] * (2 * nd))] or [0] * (2 * nd)

    def run(self, x, indices, output_shape=None):
        nd = len(self.kernel)
        pooled_from = tuple((i - 1) * s + k - b - e for i, s, k, b, e in
                            zip(x.shape[2:], self.strides, self.kernel, self.pads[:nd], self.pads[nd:]))
        shape = x.shape[:2] + pooled_from if output_shape is None else tuple(int(v) for v in output_shape)
        # Indices address the input MaxPool saw (the default unpooled shape); keep their coordinates when an
        # explicit, larger output_shape is requested.
        plane_in = int(np.prod(pooled_from))
        channel, within = np.divmod(indices.reshape(-1).astype(np.int64), plane_in)
        coords = np.unravel_index(within, pooled_from)
        target = np.ravel_multi_index(coords, shape[2:]) + channel * int(np.prod(shape[2:]))
        out = np.zeros(int(np.prod(shape)), dtype=x.dtype)
        out[target] = x.reshape(-1)
        return out.reshape(shape)


@register("MaxRoiPool", since=1)
class MaxRoiPool(Kernel):
    def setup(self):
        self.pooled = [int(v) for v in self.required_attr("pooled_shape")]
        self.scale = float(self.attr("spatial_scale", 1.0))

    def run(self, x, rois):
        ph, pw = self.pooled
        height, width = x.shape[2:]
        out = np.zeros((rois.shape[0], x.shape[1], ph, pw), dtype=x.dtype)
        for r, roi in enumerate(rois):  # one box at a time; the bins inside a box are vectorised
            batch = int(roi[0])
            x1, y1, x2, y2 = (_round_half_away(float(v) * self.scale) for v in roi[1:5])
            rows = _bin_mask(y1, y2, ph, height)  # ph, H
            cols = _bin_mask(x1, x2, pw, width)  # pw, W
            image = x[batch]
            low = _lowest(x.dtype)
            row_max = np.where(rows[None, :, :, None], image[:, None, :, :], low).max(axis=2)  # C, ph, W
            pooled = np.where(cols[None, None], row_max[:, :, None, :], low).max(axis=3)  # C, ph, pw
            empty = ~(rows.any(axis=1)[:, None] & cols.any(axis=1)[None, :])
            out[r] = np.where(empty, 0, pooled)
        return out


def _round_half_away(value: float) -> int:
    return int(np.sign(value) * np.floor(abs(value) + 0.5))


def _bin_mask(start: int, end: int, bins: int, size: int) -> np.ndarray:
    """mask[b, i]: whether pixel i falls in bin b of the box [start, end] (Caffe's floor/ceil bin edges)."""
    length = max(end - start + 1, 1)
    edges = np.arange(bins + 1) * (length / bins)
    lo = np.clip(np.floor(edges[:-1]).astype(np.int64) + start, 0, size)
    hi = np.clip(np.ceil(edges[1:]).astype(np.int64) + start, 0, size)
    pixel = np.arange(size)
    return (pixel[None, :] >= lo[:, None]) & (pixel[None, :] < hi[:, None])


@register("RoiAlign", since=10)
class RoiAlign(Kernel):
    def setup(self):
        self.mode = _text(self.attr("mode"), "avg")
        if self.mode not in ("avg", "max"):
            self.fail(f"mode must be 'avg' or 'max', got {self.mode!r}")
        self.out_h = int(self.attr("output_height", 1))
        self.out_w = int(self.attr("output_width", 1))
        self.sampling_ratio = int(self.attr("sampling_ratio", 0))
        self.scale = float(self.attr("spatial_scale", 1.0))
        default_mode = "half_pixel" if self.version >= 16 else "output_half_pixel"
        self.transform = _text(self.attr("coordinate_transformation_mode"), default_mode)
        if self.transform not in ("half_pixel", "output_half_pixel"):
            self.fail(f"coordinate_transformation_mode must be half_pixel or output_half_pixel, got {self.transform!r}")

    def run(self, x, rois, batch_indices):
        out = np.zeros((rois.shape[0], x.shape[1], self.out_h, self.out_w), dtype=x.dtype)
        shift = 0.5 if self.transform == "half_pixel" else 0.0
        for r in range(rois.shape[0]):  # per box: the adaptive sampling grid differs between boxes
            x1, y1, x2, y2 = (float(v) * self.scale - shift for v in rois[r])
            ys = self._axis(y1, y2, self.out_h, x.shape[2])
            xs = self._axis(x1, x2, self.out_w, x.shape[3])
            out[r] = self._pool(x[int(batch_indices[r])], ys, xs).astype(x.dtype)
        return out

    def _axis(self, start: float, end: float, bins: int, size: int):
        """Per-axis bilinear taps: (low index, high index, low weight, high weight), each [bins, grid]."""
        length = end - start
        if self.transform == "output_half_pixel":
            length = max(length, 1.0)
        bin_size = length / bins
        grid = self.sampling_ratio if self.sampling_ratio > 0 else max(int(np.ceil(length / bins)), 1)
        pos = start + np.arange(bins)[:, None] * bin_size + (np.arange(grid)[None, :] + 0.5) * bin_size / grid
        outside = (pos < -1.0) | (pos > size)
        pos = np.maximum(pos, 0.0)
        low = np.floor(pos).astype(np.int64)
        at_edge = low >= size - 1
        low = np.where(at_edge, size - 1, low)
        high = np.where(at_edge, size - 1, low + 1)
        pos = np.where(at_edge, low, pos)
        frac = pos - low
        keep = ~outside
        return low, high, (1 - frac) * keep, frac * keep

    def _pool(self, image: np.ndarray, ys, xs) -> np.ndarray:
        y_low, y_high, wy_low, wy_high = ys
        x_low, x_high, wx_low, wx_high = xs
        corners = []
        for y_idx, wy in ((y_low, wy_low), (y_high, wy_high)):
            for x_idx, wx in ((x_low, wx_low), (x_high, wx_high)):
                values = image[:, y_idx[:, :, None, None], x_idx[None, None, :, :]]  # C, oh, gh, ow, gw
                corners.append(values * (wy[:, :, None, None] * wx[None, None, :, :]))
        if self.mode == "avg":
            return sum(corners).mean(axis=(2, 4))
        # max mode takes the largest weighted corner term of each sample, then the largest sample.
        return np.maximum.reduce(corners).max(axis=(2, 4))
