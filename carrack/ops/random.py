"""Random generators: RandomNormal/Uniform(+Like), Bernoulli, Multinomial.

Each run draws from a fresh numpy Generator: seeded from the ``seed`` attribute when the node has one (so the same
node always produces the same values), from the OS entropy pool otherwise. Nothing mutable lives on the kernel,
so concurrent runs are safe. The values cannot match other engines' generators; the distributions do.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from carrack.ir.dtypes import to_numpy
from carrack.ops.registry import Kernel, register


class _RandomKernel(Kernel):
    pure = False

    def setup(self) -> None:
        seed = self.attr("seed")
        # the float attribute's bit pattern, so distinct seeds give distinct streams
        self.seed = None if seed is None else int(np.array(float(seed), dtype=np.float64).view(np.uint64))

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)

    def _dtype_attr(self, default: np.dtype | None) -> np.dtype | None:
        code = self.attr("dtype")
        return default if code is None else to_numpy(code)


def _float_draw(rng: np.random.Generator, draw: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Standard normal or [0, 1) uniform samples, drawn natively in float32/float64 and cast for narrower types."""
    native = np.float64 if dtype == np.float64 else np.float32
    fn = rng.standard_normal if draw == "normal" else rng.random
    return fn(shape, dtype=native)


class _Distribution(_RandomKernel):
    """Normal (mean, scale) or uniform [low, high) samples of a given shape and dtype."""

    draw = "normal"

    def setup(self) -> None:
        super().setup()
        if self.draw == "normal":
            self.offset, self.spread = float(self.attr("mean", 0.0)), float(self.attr("scale", 1.0))
        else:
            low, high = float(self.attr("low", 0.0)), float(self.attr("high", 1.0))
            self.offset, self.spread = low, high - low

    def sample(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if dtype.kind != "f" and dtype.name != "bfloat16":
            raise ValueError(f"random values cannot be of type {dtype}")
        x = _float_draw(self.rng(), self.draw, shape, dtype)
        return (x * x.dtype.type(self.spread) + x.dtype.type(self.offset)).astype(dtype, copy=False)


class _Generator(_Distribution):
    def setup(self) -> None:
        super().setup()
        self.shape = tuple(int(d) for d in self.required_attr("shape"))
        self.dtype = self._dtype_attr(np.dtype(np.float32))

    def run(self):
        return self.sample(self.shape, self.dtype)


class _LikeGenerator(_Distribution):
    def setup(self) -> None:
        super().setup()
        self.dtype = self._dtype_attr(None)

    def run(self, x):
        dtype = self.dtype or x.dtype
        if self.dtype is None and dtype.kind != "f" and dtype.name != "bfloat16":
            raise ValueError(f"input type {dtype} is not a float type; set the dtype attribute")
        return self.sample(x.shape, dtype)


@register("RandomNormal", since=1)
class RandomNormal(_Generator):
    draw = "normal"


@register("RandomUniform", since=1)
class RandomUniform(_Generator):
    draw = "uniform"


@register("RandomNormalLike", since=1)
class RandomNormalLike(_LikeGenerator):
    draw = "normal"


@register("RandomUniformLike", since=1)
class RandomUniformLike(_LikeGenerator):
    draw = "uniform"


@register("Bernoulli", since=15)
class Bernoulli(_RandomKernel):
    def setup(self) -> None:
        super().setup()
        self.dtype = self._dtype_attr(None)

    def run(self, p):
        u = self.rng().random(p.shape)
        return (u < p.astype(np.float64)).astype(self.dtype or p.dtype)


@register("Multinomial", since=7)
class Multinomial(_RandomKernel):
    def setup(self) -> None:
        super().setup()
        self.sample_size = int(self.attr("sample_size", 1))
        self.dtype = self._dtype_attr(to_numpy(TensorProto.INT32))
        if self.dtype not in (np.int32, np.int64):
            self.fail(f"dtype must be int32 or int64, got {self.dtype}")

    def run(self, logits):
        """Inverse-CDF sampling of each row's softmax distribution, all rows in one searchsorted."""
        if logits.ndim != 2:
            raise ValueError(f"input must be [batch_size, class_size], got shape {logits.shape}")
        batch, classes = logits.shape
        x = logits.astype(np.float64)
        probs = np.exp(x - x.max(axis=1, keepdims=True))
        cdf = np.cumsum(probs, axis=1)
        cdf /= cdf[:, -1:]
        u = self.rng().random((batch, self.sample_size))
        rows = np.arange(batch, dtype=np.float64)[:, None]
        # offset each row by its index so one sorted search over the flattened CDFs samples every row
        flat = np.searchsorted((cdf + rows).ravel(), (u + rows).ravel(), side="right").reshape(u.shape)
        picks = np.minimum(flat - np.arange(batch)[:, None] * classes, classes - 1)
        return picks.astype(self.dtype)
