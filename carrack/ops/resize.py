"""Resampling kernels: Resize, Upsample, GridSample, AffineGrid.

Resize is separable: each resized axis gets a small table of input taps and weights per output position
(``AxisTaps``), applied with one gather per tap along that axis.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from carrack.ops.registry import Kernel, register


def _text(value, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else value


def _work_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _cast_back(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(np.rint(y), info.min, info.max).astype(dtype)
    return y.astype(dtype, copy=False)


def cubic_weights(t: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel at distances t."""
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


@dataclass
class AxisTaps:
    """For each output position along one axis: input indices [out, T], weights [out, T], and `outside` [out]
    (positions that take the extrapolation value)."""

    index: np.ndarray
    weight: np.ndarray | None
    outside: np.ndarray | None = None


def apply_taps(x: np.ndarray, axis: int, taps: AxisTaps, work: np.dtype) -> np.ndarray:
    """Resamples x along `axis` with one gather (and multiply-add) per tap."""
    shape = [1] * x.ndim
    shape[axis] = -1
    if taps.weight is None:
        return np.take(x, taps.index[:, 0], axis=axis)
    y = None
    for t in range(taps.index.shape[1]):
        term = np.take(x, taps.index[:, t], axis=axis) * taps.weight[:, t].astype(work).reshape(shape)
        y = term if y is None else y + term
    return y


class ResizeAxis:
    """The coordinate transform and interpolation filter of one Resize axis."""

    def __init__(self, kernel: Resize, in_len: int, out_len: int, scale: float, roi: tuple[float, float]):
        self.k = kernel
        self.in_len, self.out_len, self.scale, self.roi = in_len, out_len, scale, roi

    def source(self) -> np.ndarray:
        """Fractional input coordinate of every output position."""
        x = np.arange(self.out_len, dtype=np.float64)
        mode, n_in, n_out, scale = self.k.transform, self.in_len, self.out_len, self.scale
        if mode == "half_pixel":
            return (x + 0.5) / scale - 0.5
        if mode == "half_pixel_symmetric":
            adjustment = n_out / (n_in * scale)
            offset = n_in / 2 * (1 - adjustment)
            return offset + (x + 0.5) / scale - 0.5
        if mode == "pytorch_half_pixel":
            return (x + 0.5) / scale - 0.5 if n_out > 1 else np.zeros_like(x)
        if mode == "align_corners":
            # The resized length is the fractional one (in * scale) when the size came from a scale.
            span = n_in * scale - 1
            return x * (n_in - 1) / span if n_out > 1 and span > 0 else np.zeros_like(x)
        if mode == "asymmetric":
            return x / scale
        if mode == "tf_half_pixel_for_nn":
            return (x + 0.5) / scale
        start, end = self.roi  # tf_crop_and_resize
        if n_out > 1:
            return start * (n_in - 1) + x * (end - start) * (n_in - 1) / (n_out - 1)
        return np.full_like(x, 0.5 * (start + end) * (n_in - 1))

    def taps(self) -> AxisTaps:
        pos = self.source()
        outside = None
        if self.k.transform == "tf_crop_and_resize":
            outside = (pos < 0) | (pos > self.in_len - 1)
        if self.k.mode == "nearest":
            index = np.clip(self._round(pos), 0, self.in_len - 1).astype(np.int64)
            return AxisTaps(index[:, None], None, outside)
        if self.k.antialias and self.scale < 1:
            index, weight = self._antialias(pos)
        elif self.k.mode == "linear":
            low = np.floor(pos)
            frac = pos - low
            index = low[:, None] + np.arange(2)
            weight = np.stack([1 - frac, frac], axis=1)
        else:
            low = np.floor(pos)
            index = low[:, None] + np.arange(-1, 3)
            weight = cubic_weights(pos[:, None] - index, self.k.cubic_coeff_a)
            if self.k.exclude_outside:
                weight = self._renormalise(weight * ((index >= 0) & (index < self.in_len)))
        return AxisTaps(np.clip(index, 0, self.in_len - 1).astype(np.int64), weight, outside)

    def _round(self, pos: np.ndarray) -> np.ndarray:
        rule = self.k.nearest_mode
        if rule == "round_prefer_floor":
            return np.ceil(pos - 0.5)
        if rule == "round_prefer_ceil":
            return np.floor(pos + 0.5)
        if rule == "floor":
            return np.floor(pos)
        if rule == "ceil":
            return np.ceil(pos)
        return np.where(self.scale < 1, np.ceil(pos), np.floor(pos))  # opset 10's "simple" rule

    def _antialias(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The filter stretched by 1/scale, renormalised to sum to one (outside taps repeat the edge)."""
        support = (1.0 if self.k.mode == "linear" else 2.0) / self.scale
        span = int(np.ceil(support)) * 2 + 1
        index = np.floor(pos)[:, None] + np.arange(-(span // 2), span // 2 + 1)
        distance = (index - pos[:, None]) * self.scale
        if self.k.mode == "linear":
            weight = np.maximum(0.0, 1 - np.abs(distance))
        else:
            weight = cubic_weights(distance, self.k.cubic_coeff_a)
        if self.k.exclude_outside:
            weight = weight * ((index >= 0) & (index < self.in_len))
        return index, self._renormalise(weight)

    @staticmethod
    def _renormalise(weight: np.ndarray) -> np.ndarray:
        total = weight.sum(axis=1, keepdims=True)
        return weight / np.where(total == 0, 1, total)


@register("Resize", since=10)
class Resize(Kernel):
    def setup(self):
        self.mode = _text(self.attr("mode"), "nearest")
        if self.mode not in ("nearest", "linear", "cubic"):
            self.fail(f"mode must be nearest, linear or cubic, got {self.mode!r}")
        v10 = self.version < 11
        self.transform = "asymmetric" if v10 else _text(self.attr("coordinate_transformation_mode"), "half_pixel")
        self.nearest_mode = "simple" if v10 else _text(self.attr("nearest_mode"), "round_prefer_floor")
        self.cubic_coeff_a = float(self.attr("cubic_coeff_a", -0.75))
        self.exclude_outside = bool(self.attr("exclude_outside", 0))
        self.extrapolation_value = float(self.attr("extrapolation_value", 0.0))
        self.antialias = bool(self.attr("antialias", 0))
        self.axes = self.attr("axes")
        self.policy = _text(self.attr("keep_aspect_ratio_policy"), "stretch")
        if self.policy not in ("stretch", "not_larger", "not_smaller"):
            self.fail(f"keep_aspect_ratio_policy must be stretch, not_larger or not_smaller, got {self.policy!r}")

    def run(self, x, *rest):
        if self.version < 11:
            roi, scales, sizes = None, rest[0], None
        else:
            roi, scales, sizes = (list(rest) + [None] * 3)[:3]
        rank = x.ndim
        axes = [a % rank for a in self.axes] if self.axes else list(range(rank))
        scales = _present(scales)
        if scales is not None and not np.all(np.isfinite(np.asarray(scales, dtype=np.float64))):
            raise ValueError(f"Resize scales {np.asarray(scales).tolist()} must be finite")
        plans = self._plan(x.shape, axes, _present(roi), scales, _present(sizes))
        out_shape = list(x.shape)
        for a, plan in plans:
            out_shape[a] = plan.out_len
        self.check_output(out_shape, x.dtype)
        return resample(x, plans, self, self.extrapolation_value)

    def _plan(self, shape, axes, roi, scales, sizes) -> list[tuple[int, ResizeAxis]]:
        n = len(axes)
        starts = [0.0] * n if roi is None else [float(v) for v in roi[:n]]
        ends = [1.0] * n if roi is None else [float(v) for v in roi[n:2 * n]]
        if sizes is not None:
            sizes = [int(v) for v in sizes]
            if self.policy == "stretch":
                out = sizes
                scale = [o / shape[a] for o, a in zip(out, axes)]
            else:
                pick = min if self.policy == "not_larger" else max
                common = pick(s / shape[a] for s, a in zip(sizes, axes))
                out = [int(np.floor(common * shape[a] + 0.5)) for a in axes]
                scale = [common] * n
        elif scales is not None:
            scale = [float(s) for s in np.asarray(scales, dtype=np.float32)]
            crop = self.transform == "tf_crop_and_resize"
            out = [scaled_length(shape[a] * ((e - b) if crop else 1.0), s)
                   for a, s, b, e in zip(axes, scale, starts, ends)]
        else:
            self.fail("Resize needs either 'scales' or 'sizes'")
        return [(a, ResizeAxis(self, shape[a], o, s, (b, e)))
                for a, o, s, b, e in zip(axes, out, scale, starts, ends)]


def scaled_length(length: float, scale: float) -> int:
    """floor(length * scale) in float32, as onnxruntime computes it (10 * 0.7f is 7, not 6.99...)."""
    return int(np.floor(np.float32(length) * np.float32(scale)))


def _present(value) -> np.ndarray | None:
    return None if value is None or np.size(value) == 0 else value


def resample(x: np.ndarray, plans: Sequence[tuple[int, ResizeAxis]], kernel, extrapolation: float) -> np.ndarray:
    """Applies each axis' taps in turn; positions outside the crop box get the extrapolation value."""
    work = _work_dtype(x.dtype) if kernel.mode != "nearest" else x.dtype
    y = x if kernel.mode == "nearest" else x.astype(work)
    outside = None
    for axis, plan in plans:
        if plan.out_len == plan.in_len and plan.scale == 1 and kernel.transform != "tf_crop_and_resize":
            continue
        taps = plan.taps()
        y = apply_taps(y, axis, taps, work)
        if taps.outside is not None and taps.outside.any():
            shape = [1] * x.ndim
            shape[axis] = -1
            mask = taps.outside.reshape(shape)
            outside = mask if outside is None else outside | mask
    if outside is not None:
        y = np.where(outside, np.asarray(extrapolation, dtype=y.dtype), y)
    return _cast_back(y, x.dtype) if kernel.mode != "nearest" else y


@register("Upsample", since=7)
class Upsample(Kernel):
    """Upsample 7 (scales attribute) and 9 (scales input): asymmetric coordinates, floor for nearest."""

    def setup(self):
        self.mode = _text(self.attr("mode"), "nearest")
        if self.mode == "bilinear":
            self.mode = "linear"
        if self.mode not in ("nearest", "linear"):
            self.fail(f"mode must be nearest or linear, got {self.mode!r}")
        self.transform = "asymmetric"
        self.nearest_mode = "floor"
        self.antialias = False
        self.scales = self.attr("scales")

    def run(self, x, scales=None):
        scales = self.scales if scales is None else scales
        scale = [float(s) for s in np.asarray(scales, dtype=np.float32)]
        plans = [(a, ResizeAxis(self, x.shape[a], scaled_length(x.shape[a], s), s, (0.0, 1.0)))
                 for a, s in enumerate(scale)]
        return resample(x, plans, self, 0.0)


@register("AffineGrid", since=20)
class AffineGrid(Kernel):
    def setup(self):
        self.align_corners = bool(self.attr("align_corners", 0))

    def run(self, theta, size):
        spatial = [int(v) for v in size[2:]]
        axes = []
        for n in spatial:
            if self.align_corners:
                axes.append(np.linspace(-1.0, 1.0, n) if n > 1 else np.zeros(1))
            else:
                axes.append((np.arange(n) * 2.0 + 1) / n - 1)
        # Homogeneous positions (x, y[, z], 1) with x running along the innermost axis.
        mesh = np.meshgrid(*axes, indexing="ij")
        base = np.stack(list(mesh)[::-1] + [np.ones(tuple(spatial))], axis=-1).astype(theta.dtype)
        grid = base.reshape(-1, len(spatial) + 1) @ np.swapaxes(theta, 1, 2)
        return grid.reshape([theta.shape[0]] + spatial + [len(spatial)]).astype(theta.dtype, copy=False)


@register("GridSample", since=16)
class GridSample(Kernel):
    _MODES = {"bilinear": "linear", "linear": "linear", "nearest": "nearest", "bicubic": "cubic", "cubic": "cubic"}

    def setup(self):
        mode = _text(self.attr("mode"), "bilinear" if self.version < 20 else "linear")
        if mode not in self._MODES:
            self.fail(f"mode must be linear/bilinear, nearest or cubic/bicubic, got {mode!r}")
        self.mode = self._MODES[mode]
        self.padding = _text(self.attr("padding_mode"), "zeros")
        if self.padding not in ("zeros", "border", "reflection"):
            self.fail(f"padding_mode must be zeros, border or reflection, got {self.padding!r}")
        self.align_corners = bool(self.attr("align_corners", 0))

    def run(self, x, grid):
        work = _work_dtype(x.dtype)
        n, c = x.shape[:2]
        spatial = x.shape[2:]
        nd = len(spatial)
        out_spatial = grid.shape[1:-1]
        g = grid.astype(np.float64).reshape(n, -1, nd)
        # grid lists coordinates innermost axis first; per_axis[i] is the tap table of spatial axis i.
        per_axis = [self._axis_taps(g[:, :, nd - 1 - i], spatial[i]) for i in range(nd)]
        flat = x.astype(work, copy=False).reshape(n, c, -1).transpose(0, 2, 1)  # N, S, C
        batch = np.arange(n)[:, None]
        out = np.zeros((n, g.shape[1], c), dtype=work)
        for combo in itertools.product(*[range(t[0].shape[-1]) for t in per_axis]):
            linear = np.zeros(g.shape[:2], dtype=np.int64)
            weight = np.ones(g.shape[:2], dtype=np.float64)
            for axis, tap in enumerate(combo):
                index, w = per_axis[axis]
                linear = linear * spatial[axis] + index[..., tap]
                weight = weight * w[..., tap]
            out += flat[batch, linear] * weight.astype(work)[..., None]
        y = out.transpose(0, 2, 1).reshape((n, c) + tuple(out_spatial))
        return y.astype(x.dtype, copy=False)

    def _axis_taps(self, coord: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Input indices and weights [N, P, T] along one axis, padding already applied (zeros: weight 0)."""
        if self.align_corners:
            pos = (coord + 1) / 2 * (size - 1)
        else:
            pos = ((coord + 1) * size - 1) / 2
        if self.mode != "cubic":
            pos = self._pad_coordinate(pos, size)
        if self.mode == "nearest":
            index = np.rint(pos)[..., None]
            weight = np.ones_like(index)
        elif self.mode == "linear":
            low = np.floor(pos)
            index = low[..., None] + np.arange(2)
            frac = (pos - low)[..., None]
            weight = np.concatenate([1 - frac, frac], axis=-1)
        else:
            low = np.floor(pos)
            index = low[..., None] + np.arange(-1, 3)
            weight = cubic_weights(pos[..., None] - index, -0.75)
            if self.padding != "zeros":
                index = self._pad_coordinate(index, size)
        inside = (index >= 0) & (index <= size - 1)
        weight = weight * inside
        return np.clip(index, 0, size - 1).astype(np.int64), weight

    def _pad_coordinate(self, pos: np.ndarray, size: int) -> np.ndarray:
        if self.padding == "border":
            return np.clip(pos, 0, size - 1)
        if self.padding == "reflection":
            lo, hi = (0.0, size - 1.0) if self.align_corners else (-0.5, size - 0.5)
            return np.clip(_reflect(pos, lo, hi), 0, size - 1)
        return pos


def _reflect(pos: np.ndarray, lo: float, hi: float) -> np.ndarray:
    span = hi - lo
    if span <= 0:
        return np.zeros_like(pos)
    offset = np.abs(pos - lo)
    flips = np.floor(offset / span)
    rem = offset - flips * span
    return np.where(flips % 2 == 0, lo + rem, hi - rem)
