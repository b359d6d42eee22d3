"""Normalizations: BatchNormalization, InstanceNormalization, LayerNormalization, GroupNormalization,
RMSNormalization, LRN, LpNormalization, MeanVarianceNormalization, and Dropout.

Statistics of narrow floats (float16, bfloat16) are accumulated in float32; results keep the input dtype.
"""

from __future__ import annotations

import math

import numpy as np

from carrack.ir.dtypes import to_numpy
from carrack.native import rowops
from carrack.native.convolution import NO_ACTIVATION, Activation, NativeConvolution
from carrack.native.convolution import load as native_convolution
from carrack.ops.contrib import constant_rows, layer_norm_bind, layer_norm_prepared, offer_run_into
from carrack.ops.reduce import compute_dtype
from carrack.ops.registry import Kernel, register


def _widen(x: np.ndarray) -> np.ndarray:
    return x.astype(compute_dtype(x.dtype), copy=False)


def _moments(x: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Mean and population variance over `axes`, both with kept dims."""
    mean = np.mean(x, axis=axes, keepdims=True)
    centred = x - mean
    return mean, np.mean(centred * centred, axis=axes, keepdims=True)


def _channel_shape(x: np.ndarray) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel (axis 1) vector against x."""
    return (1, -1) + (1,) * max(x.ndim - 2, 0)


@register("BatchNormalization", since=1)
class BatchNormalization(Kernel):
    """Inference form, Y = (X - mean) / sqrt(var + epsilon) * scale + B; batch statistics in training mode.

    Training mode is `training_mode=1` from version 14, and before it a node asking for the running statistics
    outputs (with `is_test=0` before version 7). Before version 9, `spatial=0` means per-activation parameters of
    shape (C, D1, ..., Dn).
    """

    def setup(self):
        self.epsilon = float(self.attr("epsilon", 1e-5))
        self.momentum = float(self.attr("momentum", 0.9))
        self.spatial = bool(self.attr("spatial", 1)) if self.version < 9 else True
        wants_stats = any(self.node.outputs[1:])
        if self.version >= 14:
            self.training = bool(self.attr("training_mode", 0))
        elif self.version >= 7:
            self.training = wants_stats
        else:
            self.training = wants_stats and not self.attr("is_test", 0)
        self.affine = None if self.training or not self.spatial else self._constant_affine()
        offer_run_into(self)

    def _constant_affine(self) -> tuple[NativeConvolution, np.ndarray, np.ndarray] | None:
        """(native kernels, scale, shift) of y = x * scale + shift per channel, when the parameters are constant
        float32 initializers and native kernels load."""
        graph = self.ctx.graph if self.ctx is not None else None
        if graph is None or len(self.node.inputs) < 5:
            return None
        params = [graph.initializers.get(name) for name in self.node.inputs[1:5]]
        if any(p is None or p.dtype != np.float32 or p.ndim != 1 for p in params):
            return None
        kernels = self.if_native(native_convolution)
        if kernels is None:
            return None
        gamma, beta, mean, var = params
        factor = gamma / np.sqrt(var + np.float32(self.epsilon))  # the numpy path's float32 arithmetic
        return kernels, np.ascontiguousarray(factor), np.ascontiguousarray(beta - mean * factor)

    def native_affine(self, x: np.ndarray, activation: Activation, out: np.ndarray | None = None,
                      ) -> np.ndarray | None:
        """act(x * scale + shift) by the native kernel, or None where it cannot (then the numpy path runs)."""
        if self.affine is None or x.dtype != np.float32 or x.ndim < 2:
            return None
        kernels, factor, shift = self.affine
        return kernels.scale_shift(x, factor, shift, activation, out)

    def _into(self, out, x, scale, bias, mean, var):
        y = self.native_affine(x, NO_ACTIVATION, out)
        return self._run_numpy(x, scale, bias, mean, var) if y is None else y

    def run(self, x, scale, bias, mean, var):
        y = self.native_affine(x, NO_ACTIVATION)
        return self._run_numpy(x, scale, bias, mean, var) if y is None else y

    def _run_numpy(self, x, scale, bias, mean, var):
        wx = _widen(x)
        shape = self._param_shape(x, scale)
        params = [_widen(p).reshape(shape) for p in (scale, bias, mean, var)]
        w_scale, w_bias, w_mean, w_var = params
        if not self.training:
            factor = w_scale / np.sqrt(w_var + self.epsilon)
            y = wx * factor + (w_bias - w_mean * factor)
            return y.astype(x.dtype, copy=False)
        axes = (0,) + tuple(range(2, x.ndim)) if self.spatial else (0,)
        batch_mean, batch_var = _moments(wx, axes)
        y = (wx - batch_mean) / np.sqrt(batch_var + self.epsilon) * w_scale + w_bias
        running_mean = w_mean * self.momentum + batch_mean * (1 - self.momentum)
        running_var = w_var * self.momentum + batch_var * (1 - self.momentum)
        stats = [s.reshape(mean.shape).astype(mean.dtype) for s in (running_mean, running_var, batch_mean, batch_var)]
        return (y.astype(x.dtype, copy=False), *stats)

    def _param_shape(self, x: np.ndarray, scale: np.ndarray) -> tuple[int, ...]:
        if not self.spatial and x.ndim > 2 and scale.size == int(np.prod(x.shape[1:])):
            return (1,) + x.shape[1:]
        return _channel_shape(x)


@register("InstanceNormalization", since=1)
class InstanceNormalization(Kernel):
    def setup(self):
        self.epsilon = float(self.attr("epsilon", 1e-5))

    def run(self, x, scale, bias):
        wx = _widen(x)
        mean, var = _moments(wx, tuple(range(2, x.ndim)))
        shape = _channel_shape(x)
        y = (wx - mean) / np.sqrt(var + self.epsilon) * _widen(scale).reshape(shape) + _widen(bias).reshape(shape)
        return y.astype(x.dtype, copy=False)


def _stash_dtype(kernel: Kernel) -> np.dtype:
    """`stash_type` (float32 by default): the precision of the first stage and of LayerNormalization's statistics."""
    return compute_dtype(to_numpy(int(kernel.attr("stash_type", 1))))


def _first_stage_dtype(stash: np.dtype, x: np.ndarray) -> np.dtype:
    """The stash type, or x's own dtype where that is wider (float64 x is not normalized in float32)."""
    return np.promote_types(stash, compute_dtype(x.dtype))


@register("LayerNormalization", since=17)
class LayerNormalization(Kernel):
    def setup(self):
        self.axis = int(self.attr("axis", -1))
        self.epsilon = float(self.attr("epsilon", 1e-5))
        self.rows = self.if_native(rowops.library) if _stash_dtype(self) == np.float32 else None
        self.wants_stats = any(self.node.outputs[1:])
        self.row_constants: tuple | None = None  # (scale, bias) checked once (prepare), for axis -1
        offer_run_into(self)

    def prepare(self, constants):
        if self.rows is not None and not self.wants_stats and self.axis == -1:
            rows = constant_rows(self.node.inputs, constants, (1, 2))
            self.row_constants = rows if rows is not None and rows[0] is not None else None

    def run(self, x, scale, bias=None):
        return self._into(None, x, scale, bias)

    def bind_into(self, out, x, scale, bias=None):
        prepared = self.row_constants
        if prepared is not None and scale is prepared[0] and bias is prepared[1] and len(self.node.outputs) == 1:
            return layer_norm_bind(out, x, scale, bias, self.epsilon)
        return None

    def _into(self, out, x, scale, bias=None):
        prepared = self.row_constants
        if prepared is not None and scale is prepared[0] and bias is prepared[1]:
            y = layer_norm_prepared(out, x, scale, bias, self.epsilon)
            if y is not None:
                return y
        if self._native(x):
            return self._run_native(x, scale, bias, out)
        return self._run_numpy(x, scale, bias)

    def _native(self, x: np.ndarray) -> bool:
        return self.rows is not None and x.dtype == np.float32 and x.size > 0 and -x.ndim <= self.axis < x.ndim

    def _run_native(self, x, scale, bias, out):
        axis = self.axis % x.ndim
        normalized = x.shape[axis:]
        try:
            gamma, beta = (None if p is None else np.broadcast_to(p, normalized).astype(np.float32, copy=False)
                           for p in (scale, bias))
        except ValueError:  # parameters that broadcast x to a larger shape
            return self._run_numpy(x, scale, bias)
        y, mean, inv_std, _ = rowops.layer_norm(x, gamma, beta, self.epsilon, math.prod(normalized), out=out,
                                                stats=self.wants_stats)
        if not self.wants_stats:
            return y
        kept = x.shape[:axis] + (1,) * len(normalized)
        return y, mean.reshape(kept), inv_std.reshape(kept)

    def _run_numpy(self, x, scale, bias):
        stash = _stash_dtype(self)
        work = _first_stage_dtype(stash, x)
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        wx = x.astype(work, copy=False)
        mean, var = _moments(wx, tuple(range(axis, x.ndim)))
        inv_std_dev = 1 / np.sqrt(var + work.type(self.epsilon))
        normalized = ((wx - mean) * inv_std_dev).astype(x.dtype, copy=False)
        y = _widen(normalized) * _widen(scale)
        if bias is not None:
            y = y + _widen(bias)
        return y.astype(x.dtype, copy=False), mean.astype(stash, copy=False), inv_std_dev.astype(stash, copy=False)


@register("GroupNormalization", since=18)
class GroupNormalization(Kernel):
    """Version 18 has one scale/bias per group; version 21 one per channel."""

    def setup(self):
        self.num_groups = int(self.required_attr("num_groups"))
        self.epsilon = float(self.attr("epsilon", 1e-5))

    def run(self, x, scale, bias):
        n, channels = x.shape[:2]
        if channels % self.num_groups:
            raise ValueError(f"{channels} channels do not split into {self.num_groups} groups")
        work = _first_stage_dtype(_stash_dtype(self), x) if self.version >= 21 else compute_dtype(x.dtype)
        grouped = x.reshape(n, self.num_groups, -1).astype(work, copy=False)
        mean, var = _moments(grouped, (2,))
        normalized = ((grouped - mean) / np.sqrt(var + work.type(self.epsilon))).astype(x.dtype, copy=False)
        normalized = _widen(normalized.reshape(x.shape))
        w_scale, w_bias = _widen(scale), _widen(bias)
        if self.version < 21:
            per_group = channels // self.num_groups
            w_scale, w_bias = np.repeat(w_scale, per_group), np.repeat(w_bias, per_group)
        shape = _channel_shape(x)
        y = normalized * w_scale.reshape(shape) + w_bias.reshape(shape)
        return y.astype(x.dtype, copy=False)


@register("RMSNormalization", since=23)
class RMSNormalization(Kernel):
    def setup(self):
        self.axis = int(self.attr("axis", -1))
        self.epsilon = float(self.attr("epsilon", 1e-5))

    def run(self, x, scale):
        work = _first_stage_dtype(_stash_dtype(self), x)
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        wx = x.astype(work, copy=False)
        mean_square = np.mean(wx * wx, axis=tuple(range(axis, x.ndim)), keepdims=True)
        normalized = (wx / np.sqrt(mean_square + work.type(self.epsilon))).astype(x.dtype, copy=False)
        y = _widen(normalized) * _widen(scale)
        return y.astype(scale.dtype, copy=False)


@register("LRN", since=1)
class LRN(Kernel):
    def setup(self):
        self.size = int(self.required_attr("size"))
        self.alpha = float(self.attr("alpha", 1e-4))
        self.beta = float(self.attr("beta", 0.75))
        self.bias = float(self.attr("bias", 1.0))

    def run(self, x):
        wx = _widen(x)
        squares = wx * wx
        before, after = (self.size - 1) // 2, self.size // 2  # floor and ceil of (size - 1) / 2
        pad = [(0, 0)] * x.ndim
        pad[1] = (before, after)
        padded = np.pad(squares, pad)
        channels = x.shape[1]
        square_sum = np.zeros_like(squares)
        for offset in range(self.size):  # a window of `size` channels, as shifted slices
            square_sum += padded[:, offset:offset + channels]
        y = wx / (self.bias + (self.alpha / self.size) * square_sum) ** self.beta
        return y.astype(x.dtype, copy=False)


@register("LpNormalization", since=1)
class LpNormalization(Kernel):
    def setup(self):
        self.axis = int(self.attr("axis", -1))
        self.p = int(self.attr("p", 2))
        if self.p not in (1, 2):
            self.fail(f"p must be 1 or 2, got {self.p}")

    def run(self, x):
        wx = _widen(x)
        if self.p == 1:
            norm = np.sum(np.abs(wx), axis=self.axis, keepdims=True)
        else:
            norm = np.sqrt(np.sum(wx * wx, axis=self.axis, keepdims=True))
        safe = np.where(norm == 0, 1, norm)
        y = np.where(norm == 0, 0, wx / safe)
        return y.astype(x.dtype, copy=False)


@register("MeanVarianceNormalization", since=9)
class MeanVarianceNormalization(Kernel):
    """(X - E[X]) / (sqrt(E[(X - E[X])^2]) + 1e-9), the epsilon the ONNX function body uses."""

    def setup(self):
        self.axes = tuple(int(a) for a in self.attr("axes", [0, 2, 3]))

    def run(self, x):
        wx = _widen(x)
        axes = tuple(sorted({a + x.ndim if a < 0 else a for a in self.axes}))
        mean, var = _moments(wx, axes)
        y = (wx - mean) / (np.sqrt(var) + wx.dtype.type(1e-9))
        return y.astype(x.dtype, copy=False)


@register("Dropout", since=1)
class Dropout(Kernel):
    """Identity at inference. Random dropout in training (`training_mode` input from version 12, `is_test=0`
    before version 7): mask = uniform[0, 1) >= ratio, output = x * mask / (1 - ratio), seeded by `seed` if given.
    The mask output is bool from version 10 and has x's dtype before."""
    pure = False  # training mode draws a random mask
    in_place = view = True

    def setup(self):
        self.ratio = float(self.attr("ratio", 0.5))
        self.seed = self.attr("seed")
        self.training_attr = self.version < 7 and not self.attr("is_test", 0)

    def run(self, x, ratio=None, training_mode=None):
        if self.version >= 12:
            rate = 0.5 if ratio is None else float(ratio)
            training = training_mode is not None and bool(training_mode)
        else:
            rate, training = self.ratio, self.training_attr
        if not training or rate == 0:
            return x, self._mask(np.ones(x.shape, dtype=bool), x.dtype)
        seed = None if self.seed is None else int(self.seed) & 0xFFFFFFFF
        rng = np.random.RandomState(seed)
        keep = rng.uniform(0.0, 1.0, x.shape) >= rate
        scale = 1.0 / (1.0 - rate) if rate < 1 else 0.0
        y = _widen(x) * keep * scale
        return y.astype(x.dtype, copy=False), self._mask(keep, x.dtype)

    def _mask(self, keep: np.ndarray, dtype: np.dtype) -> np.ndarray:
        return keep if self.version >= 10 else keep.astype(dtype)
