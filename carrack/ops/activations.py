"""Activation kernels: Relu family, sigmoid-like functions, Gelu/Mish/Swish/SwiGLU, and Softmax/LogSoftmax/Hardmax.

Floating-point activations compute half-precision inputs (float16, bfloat16) in float32 and round back once.
"""

from __future__ import annotations

import math

import numpy as np

from carrack.native import rowops
from carrack.ops.elementwise import gelu, tanh_gelu, widen
from carrack.ops.registry import Kernel, register


class _FloatActivation(Kernel):
    """y = f(x) elementwise; subclasses implement `compute` on the widened input."""
    in_place = True

    def run(self, x):
        with np.errstate(all="ignore"):
            return self.compute(widen(x)).astype(x.dtype, copy=False)

    def compute(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) without overflow: exp only ever sees -|x|."""
    e = np.exp(-np.abs(x))
    r = 1 / (1 + e)
    return np.where(x >= 0, r, e * r).astype(x.dtype, copy=False)


def softplus(x: np.ndarray) -> np.ndarray:
    """ln(1 + exp(x)), stable for large |x|."""
    return np.logaddexp(x.dtype.type(0), x)


@register("Relu", since=1)
class Relu(Kernel):
    in_place = True

    def run(self, x):
        return relu(x)

    def run_into(self, out, x):
        """Into the planned buffer when it fits (a wrong planned shape costs an allocation, not a wrong result)."""
        return relu(x, out=out) if x.dtype == out.dtype and x.shape == out.shape else relu(x)


def relu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """max(x, 0); NaN stays NaN."""
    if x.dtype in _FAST_CLIP:  # numpy's clip is vectorised where maximum with a scalar is not (4x faster)
        if type(x) is np.ndarray and (out is None or type(out) is np.ndarray):
            return _clip_ufunc(x, 0, np.inf, out=out)  # what np.clip calls, without its ~1.5 us of Python
        return np.clip(x, 0, np.inf, out=out)
    return np.maximum(x, np.zeros((), dtype=x.dtype), out=out)


_FAST_CLIP = (np.dtype(np.float32), np.dtype(np.float64))
try:  # the clip ufunc np.clip ends in for float arrays (numpy 2: numpy._core; 1.x: numpy.core)
    from numpy._core.umath import clip as _clip_ufunc
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.umath import clip as _clip_ufunc


@register("LeakyRelu", since=1)
class LeakyRelu(_FloatActivation):
    def setup(self) -> None:
        self.alpha = self.attr("alpha", 0.01)

    def compute(self, x):
        return np.where(x < 0, x * self.alpha, x)


@register("Elu", since=1)
class Elu(_FloatActivation):
    def setup(self) -> None:
        self.alpha = self.attr("alpha", 1.0)

    def compute(self, x):
        return np.where(x > 0, x, self.alpha * np.expm1(np.minimum(x, 0)))


@register("Selu", since=1)
class Selu(_FloatActivation):
    def setup(self) -> None:
        self.alpha = self.attr("alpha", 1.67326319217681884765625)
        self.gamma = self.attr("gamma", 1.05070102214813232421875)

    def compute(self, x):
        return self.gamma * np.where(x > 0, x, self.alpha * np.expm1(np.minimum(x, 0)))


@register("Celu", since=12)
class Celu(_FloatActivation):
    def setup(self) -> None:
        self.alpha = self.attr("alpha", 1.0)
        if self.alpha == 0:
            self.fail("alpha must be nonzero")

    def compute(self, x):
        return np.where(x > 0, x, self.alpha * np.expm1(np.minimum(x, 0) / self.alpha))


@register("Gelu", since=20)
class Gelu(_FloatActivation):
    def setup(self) -> None:
        self.approximate = self.attr("approximate", "none")
        if self.approximate not in ("none", "tanh"):
            self.fail(f"approximate must be 'none' or 'tanh', got {self.approximate!r}")
        self.rows = self.if_native(rowops.library)

    def compute(self, x):
        return tanh_gelu(x) if self.approximate == "tanh" else gelu(x)

    def run(self, x):
        if self.rows is not None and x.dtype == np.float32:
            return rowops.gelu(x, approximate=self.approximate == "tanh")
        return super().run(x)

    def run_into(self, out, x):
        if self.rows is not None and x.dtype == np.float32:
            return rowops.gelu(x, approximate=self.approximate == "tanh", out=out)
        return self.run(x)


@register("Mish", since=18)
class Mish(_FloatActivation):
    def compute(self, x):
        return x * np.tanh(softplus(x))


@register("Softplus", since=1)
class Softplus(_FloatActivation):
    def compute(self, x):
        return softplus(x)


@register("Softsign", since=1)
class Softsign(_FloatActivation):
    def compute(self, x):
        return x / (1 + np.abs(x))


@register("HardSigmoid", since=1)
class HardSigmoid(_FloatActivation):
    def setup(self) -> None:
        self.alpha = self.attr("alpha", 0.2)
        self.beta = self.attr("beta", 0.5)

    def compute(self, x):
        return np.clip(x * self.alpha + self.beta, 0, 1)


@register("HardSwish", since=14)
class HardSwish(_FloatActivation):
    def compute(self, x):
        return x * np.clip(x * (1 / 6) + 0.5, 0, 1)


@register("ThresholdedRelu", since=10)
class ThresholdedRelu(_FloatActivation):
    def setup(self) -> None:
        self.alpha = self.attr("alpha", 1.0)

    def compute(self, x):
        return np.where(x > self.alpha, x, 0)


@register("Sigmoid", since=1)
class Sigmoid(_FloatActivation):
    def compute(self, x):
        return sigmoid(x)


@register("Tanh", since=1)
class Tanh(_FloatActivation):
    def compute(self, x):
        return np.tanh(x)

    def run_into(self, out, x):
        if x.dtype == out.dtype and x.dtype in (np.float32, np.float64) and x.shape == out.shape:
            return np.tanh(x, out=out)
        return self.run(x)


@register("Swish", since=24)
class Swish(_FloatActivation):
    def setup(self) -> None:
        self.alpha = self.attr("alpha", 1.0)

    def compute(self, x):
        return x * sigmoid(x * self.alpha)


@register("SwiGLU", since=28)
class SwiGLU(Kernel):
    """Swish(A) * B; A and B must have the same shape (no broadcasting)."""

    def setup(self) -> None:
        self.alpha = self.attr("alpha", 1.0)

    def run(self, a, b):
        if a.shape != b.shape:
            raise ValueError(f"SwiGLU needs inputs of the same shape, got {a.shape} and {b.shape}")
        gate, value = widen(a), widen(b)
        with np.errstate(all="ignore"):
            return (gate * sigmoid(gate * self.alpha) * value).astype(a.dtype, copy=False)


@register("Shrink", since=9)
class Shrink(Kernel):
    """x + bias below -lambd, x - bias above lambd, 0 between (integer inputs too)."""

    def setup(self) -> None:
        self.lambd = self.attr("lambd", 0.5)
        self.bias = self.attr("bias", 0.0)

    def run(self, x):
        w = x.astype(np.float64) if x.dtype.kind in "iu" else widen(x)
        out = np.where(w < -self.lambd, w + self.bias, np.where(w > self.lambd, w - self.bias, 0))
        return out.astype(x.dtype)


@register("PRelu", since=1)
class PRelu(Kernel):
    """slope * x where x < 0. Opset 7+ broadcasts slope to x; a 1-D per-channel slope (old models) is
    aligned with axis 1."""

    def run(self, x, slope):
        if slope.ndim == 1 and x.ndim > 2 and slope.shape[0] == x.shape[1] and slope.shape[0] != x.shape[-1]:
            slope = slope.reshape((-1,) + (1,) * (x.ndim - 2))
        xw, sw = widen(x), widen(slope)
        return np.where(xw < 0, xw * sw, xw).astype(x.dtype, copy=False)


class _AxisNormalizer(Kernel):
    """Softmax-like ops. Before opset 13 the input is viewed as 2-D [prod(shape[:axis]), prod(shape[axis:])]
    and normalised along the second dim (default axis 1); from 13 on they work along `axis` (default -1)."""

    def setup(self) -> None:
        self.flatten = self.version < 13
        self.axis = self.attr("axis", 1 if self.flatten else -1)

    def run(self, x):
        rank = max(x.ndim, 1)
        if not -rank <= self.axis < rank:
            raise ValueError(f"axis {self.axis} is out of range for a tensor of rank {x.ndim}")
        axis = self.axis % rank
        # float16 stays float16, step by step, as the ONNX reference (and its conformance data) computes it.
        w = x if x.dtype == np.float16 else widen(x)
        if x.ndim == 0:
            return self.compute(w.reshape(1), 0).reshape(()).astype(x.dtype)
        with np.errstate(all="ignore"):
            if self.flatten:
                rows = math.prod(x.shape[:axis])
                flat = w.reshape(rows, math.prod(x.shape[axis:]))
                out = self.compute(flat, 1).reshape(x.shape)
            else:
                out = self.compute(w, axis)
        return out.astype(x.dtype, copy=False)

    def compute(self, x: np.ndarray, axis: int) -> np.ndarray:
        raise NotImplementedError


@register("Softmax", since=1)
class Softmax(_AxisNormalizer):
    def setup(self) -> None:
        super().setup()
        self.rows = self.if_native(rowops.library)

    def run(self, x):
        return self.run_into(None, x)

    def run_into(self, out, x):
        if self.rows is None or x.dtype != np.float32 or not self._rows_last(x):
            return super().run(x)
        n = math.prod(x.shape[self.axis % x.ndim:]) if self.flatten else x.shape[self.axis % x.ndim]
        into = out.reshape(-1, n) if out is not None and out.shape == x.shape else None
        return rowops.softmax(x.reshape(-1, n), out=into).reshape(x.shape)

    def _rows_last(self, x: np.ndarray) -> bool:
        """Whether the normalized elements are the trailing ones of a non-empty x (whole rows of a 2-D view)."""
        if x.size == 0 or not -x.ndim <= self.axis < x.ndim:
            return False
        # dims of size 1 after the axis (a classifier's [N, classes, 1, 1]) leave the axis trailing in memory
        return self.flatten or all(d == 1 for d in x.shape[self.axis % x.ndim + 1:])

    def compute(self, x, axis):
        if x.size == 0:
            return x
        e = np.exp(x - np.max(x, axis=axis, keepdims=True))
        return e / np.sum(e, axis=axis, keepdims=True)


@register("LogSoftmax", since=1)
class LogSoftmax(_AxisNormalizer):
    def compute(self, x, axis):
        if x.size == 0:
            return x
        shifted = x - np.max(x, axis=axis, keepdims=True)
        return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


@register("Hardmax", since=1)
class Hardmax(_AxisNormalizer):
    """1 at the first maximum along the axis, 0 elsewhere."""

    def compute(self, x, axis):
        out = np.zeros_like(x)
        if x.size == 0:
            return out
        first_max = np.expand_dims(np.argmax(x, axis=axis), axis)
        np.put_along_axis(out, first_max, 1, axis=axis)
        return out
