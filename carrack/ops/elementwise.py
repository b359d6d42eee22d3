"""Elementwise kernels: arithmetic, comparison, logic, bitwise and math functions (numpy-style broadcasting).

Half-precision inputs (float16, bfloat16, float8) are computed in float32 and rounded back once.
Opset < 7 binary ops used "legacy" broadcasting (`broadcast=1`, optional `axis`), handled by `_align_legacy`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import ml_dtypes
import numpy as np
from numpy.polynomial import chebyshev

from carrack.native import rowops
from carrack.ops.registry import Kernel, register

_NARROW_FLOATS = frozenset(
    np.dtype(getattr(ml_dtypes, name))
    for name in ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                 "float8_e8m0fnu", "float4_e2m1fn")
    if hasattr(ml_dtypes, name)
) | {np.dtype(np.float16)}


def widen(x: np.ndarray) -> np.ndarray:
    """Half and narrower floats (float16, bfloat16, float8, ...) as float32; other arrays unchanged."""
    return x.astype(np.float32) if x.dtype in _NARROW_FLOATS else x


def _align_legacy(a: np.ndarray, b: np.ndarray, axis: int | None) -> np.ndarray:
    """Opset < 7 broadcasting: B's shape matches a contiguous run of A's dims starting at `axis`."""
    if axis is None or b.ndim == 0:
        return b
    if axis < 0:
        axis += a.ndim
    trailing = a.ndim - axis - b.ndim
    return b.reshape(b.shape + (1,) * trailing) if trailing > 0 else b


class _Binary(Kernel):
    """Two-input elementwise op; subclasses implement `compute(a, b)`."""

    def setup(self) -> None:
        legacy = self.version < 7 and self.attr("broadcast", 0)
        self.legacy_axis = self.attr("axis") if legacy else None
        #: float32 operands split over the run's threads by the native kernel (the plan's choice: Add, Sub, Mul, Div)
        self.split = self.implementation == "native"

    def run(self, a, b):
        if self.legacy_axis is not None:
            b = _align_legacy(a, b, self.legacy_axis)
        return self.compute(a, b)

    def compute(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        raise NotImplementedError


_ARITHMETIC = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}


def broadcasts_to(shape: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether `a` and `b` broadcast to exactly `shape` (np.broadcast_shapes(a, b) == shape, without its cost
    of a few microseconds; False where they do not broadcast at all)."""
    if a == shape and (b == shape or not b):
        return True
    n = len(shape)
    if len(a) > n or len(b) > n or max(len(a), len(b)) != n:
        return False
    for axis in range(1, n + 1):
        da = a[-axis] if axis <= len(a) else 1
        db = b[-axis] if axis <= len(b) else 1
        if (da if db == 1 else db if da == 1 else da if da == db else -1) != shape[-axis]:
            return False
    return True


@register(["Add", "Sub", "Mul"], since=1)
class Arithmetic(_Binary):
    def setup(self) -> None:
        super().setup()
        self.fn = _ARITHMETIC[self.node.op_type]

    def compute(self, a, b):
        y = rowops.binary(self.node.op_type, a, b) if self.split else None  # float32 over the run's threads
        return self.fn(a, b).astype(a.dtype, copy=False) if y is None else y

    def bind_into(self, out, a, b):
        """numpy's operation into `out` for these very arrays, where `run_into` would take it (no split over
        threads: the operands are below rowops' split size)."""
        if (self.legacy_axis is None and type(a) is np.ndarray and type(b) is np.ndarray
                and a.dtype == b.dtype == out.dtype and out.dtype.kind == "f"
                and broadcasts_to(out.shape, a.shape, b.shape)
                and not (self.split and max(a.size, b.size) >= 2 * rowops.PARALLEL_MIN)):
            return functools.partial(self.fn, a, b, out=out)
        return None

    def run_into(self, out, a, b):
        """The result, written into `out` (the planned buffer) when it fits; a planned shape that turns out wrong
        at run time costs an allocation, never a wrong result. Integers too (a position index grown by the past
        length): numpy's operation with `out` wraps as it does without."""
        if (self.legacy_axis is None and a.dtype == b.dtype == out.dtype and out.dtype.kind in "fiu"
                and broadcasts_to(out.shape, a.shape, b.shape)):
            y = rowops.binary(self.node.op_type, a, b, out) if self.split else None
            return self.fn(a, b, out=out) if y is None else y
        return self.run(a, b)


def truncating_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division rounding toward zero (C semantics); division by zero gives 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.floor_divide(a, b)
        if a.dtype.kind == "i":
            inexact = np.not_equal(np.multiply(q, b), a)
            q = q + (inexact & ((a < 0) != (b < 0)))
    return q.astype(a.dtype, copy=False)


@register("Div", since=1)
class Div(_Binary):
    def compute(self, a, b):
        if a.dtype.kind in "iu":
            return truncating_divide(a, b)
        y = rowops.binary("Div", a, b) if self.split else None
        if y is not None:
            return y
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.divide(widen(a), widen(b)).astype(a.dtype, copy=False)

    def run_into(self, out, a, b):
        if (self.legacy_axis is None and a.dtype == b.dtype == out.dtype and out.dtype in (np.float32, np.float64)
                and broadcasts_to(out.shape, a.shape, b.shape)):
            y = rowops.binary("Div", a, b, out) if self.split else None
            if y is not None:
                return y
            with np.errstate(divide="ignore", invalid="ignore"):
                return np.divide(a, b, out=out)
        return self.run(a, b)


@register("Mod", since=10)
class Mod(_Binary):
    def setup(self) -> None:
        super().setup()
        fmod = self.attr("fmod", 0)
        if fmod not in (0, 1):
            self.fail(f"fmod must be 0 or 1, got {fmod}")
        # fmod=1: remainder has the dividend's sign (C fmod); fmod=0: the divisor's sign (Python %).
        self.fn = np.fmod if fmod else np.mod

    def compute(self, a, b):
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.fn(widen(a), widen(b)).astype(a.dtype, copy=False)


@register("Pow", since=1)
class Pow(_Binary):
    """The output has the base's type, whatever the exponent's type."""

    def compute(self, x, y):
        with np.errstate(all="ignore"):
            if x.dtype.kind in "iu" and y.dtype.kind in "iu" and not np.any(y < 0):
                return np.power(x, y.astype(x.dtype, copy=False))
            work = np.float64 if x.dtype.kind in "iu" or np.float64 in (x.dtype, y.dtype) else np.float32
            return np.power(x.astype(work, copy=False), y.astype(work, copy=False)).astype(x.dtype)


_COMPARISONS = {"Equal": np.equal, "Greater": np.greater, "Less": np.less,
                "GreaterOrEqual": np.greater_equal, "LessOrEqual": np.less_equal}


@register(["Equal", "Greater", "Less"], since=1)
@register(["GreaterOrEqual", "LessOrEqual"], since=12)
class Comparison(_Binary):
    def setup(self) -> None:
        super().setup()
        self.fn = _COMPARISONS[self.node.op_type]

    def compute(self, a, b):
        return np.asarray(self.fn(a, b), dtype=np.bool_)


_LOGICAL = {"And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor}


@register(["And", "Or", "Xor"], since=1)
class Logical(_Binary):
    def setup(self) -> None:
        super().setup()
        self.fn = _LOGICAL[self.node.op_type]

    def compute(self, a, b):
        return self.fn(a, b)

    def bind_into(self, out, a, b):
        """numpy's logical ufunc into `out` for these very bool arrays (what `run` computes)."""
        if not (self.legacy_axis is None and type(a) is np.ndarray and type(b) is np.ndarray
                and a.dtype == b.dtype == out.dtype == np.bool_ and out.flags.writeable
                and broadcasts_to(out.shape, a.shape, b.shape)
                and not np.may_share_memory(out, a) and not np.may_share_memory(out, b)):
            return None
        return functools.partial(self.fn, a, b, out=out)


@register("Not", since=1)
class Not(Kernel):
    def run(self, x):
        return np.logical_not(x)


_BITWISE = {"BitwiseAnd": np.bitwise_and, "BitwiseOr": np.bitwise_or, "BitwiseXor": np.bitwise_xor}


@register(["BitwiseAnd", "BitwiseOr", "BitwiseXor"], since=18)
class Bitwise(_Binary):
    def setup(self) -> None:
        super().setup()
        self.fn = _BITWISE[self.node.op_type]

    def compute(self, a, b):
        return self.fn(a, b)


@register("BitwiseNot", since=18)
class BitwiseNot(Kernel):
    def run(self, x):
        return np.invert(x)


@register("BitShift", since=11)
class BitShift(_Binary):
    """Shifts by a negative amount or by the bit width or more give only the sign fill (0, or -1 right-shifting
    a negative signed value), instead of C's undefined behaviour."""

    def setup(self) -> None:
        super().setup()
        direction = self.required_attr("direction")
        if direction not in ("LEFT", "RIGHT"):
            self.fail(f"direction must be 'LEFT' or 'RIGHT', got {direction!r}")
        self.left = direction == "LEFT"

    def compute(self, x, y):
        y = y.astype(x.dtype, copy=False)
        in_range = (y >= 0) & (y < x.dtype.itemsize * 8)
        amount = np.where(in_range, y, 0).astype(x.dtype, copy=False)
        shifted = np.left_shift(x, amount) if self.left else np.right_shift(x, amount)
        fill = np.where(x < 0, -1, 0).astype(x.dtype) if not self.left and x.dtype.kind == "i" else x.dtype.type(0)
        return np.where(in_range, shifted, fill).astype(x.dtype, copy=False)


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Abs": np.abs, "Neg": np.negative, "Ceil": np.ceil, "Floor": np.floor, "Sqrt": np.sqrt, "Exp": np.exp,
    "Log": np.log, "Reciprocal": np.reciprocal, "Sign": np.sign,
    "Round": np.rint,  # rounds halves to even, as ONNX requires
    "Sin": np.sin, "Cos": np.cos, "Tan": np.tan, "Asin": np.arcsin, "Acos": np.arccos, "Atan": np.arctan,
    "Sinh": np.sinh, "Cosh": np.cosh, "Asinh": np.arcsinh, "Acosh": np.arccosh, "Atanh": np.arctanh,
}


@register(["Abs", "Neg", "Ceil", "Floor", "Sqrt", "Exp", "Log", "Reciprocal"], since=1)
@register(["Sin", "Cos", "Tan", "Asin", "Acos", "Atan"], since=7)
@register(["Sign", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh"], since=9)
@register("Round", since=11)
class UnaryMath(Kernel):
    """One numpy function applied elementwise, computed in float32 for half-precision inputs."""
    in_place = True

    def setup(self) -> None:
        self.fn = _UNARY[self.node.op_type]

    def run(self, x):
        with np.errstate(all="ignore"):
            return self.fn(widen(x)).astype(x.dtype, copy=False)

    def run_into(self, out, x):
        if x.dtype == out.dtype and x.dtype in (np.float32, np.float64) and x.shape == out.shape:
            with np.errstate(all="ignore"):
                return self.fn(x, out=out)
        return self.run(x)


# Chebyshev series fitted (to 40-digit references) for erf(x)/x in u = x*x on [0, 1], for the scaled
# complement exp(x*x) * erfc(x) in t = 1/x on [1/6, 1], and for x * exp(x*x) * erfc(x) in s = 1/x**2 on
# [0, 1/36]; all are accurate to a few float64 ulps.
_ERF_SMALL = (
    0.9754769393826545, -0.14226120510371362, 0.010035582187599782, -0.0005768764699766781,
    2.7419931252221024e-05, -1.104317550694442e-06, 3.8488755454355765e-08, -1.180858181358956e-09,
    3.2334232879340276e-11, -7.990593045356403e-13, 1.801681096339632e-14, -3.0224279829662674e-16,
    1.5700924586837757e-17,
)
_ERFC_MIDDLE = (
    0.27477468589795295, 0.16699329119310397, -0.014778434908201306, 0.00046076600437352215,
    0.00017657967835411158, -5.026984064245638e-05, 7.42701335562282e-06, -3.5188112194749215e-07,
    -1.7150112887073786e-07, 6.706623052712589e-08, -1.431658930280131e-08, 1.7595567878344333e-09,
    7.4521226898767e-11, -1.1543784205930177e-10, 3.8873460894775955e-11, -8.504860742878419e-12,
    1.1272382023583207e-12, 4.3256047236738024e-14, -8.421190902150432e-14, 3.2022035694855606e-14,
    -8.148779860568798e-15, 1.4798121423094588e-15, -5.4953236053932167e-17, -5.3726601320585464e-17,
    3.1401849173675526e-17,
)
_ERFC_TAIL = (
    0.5603874949378892, -0.0037644967870190484, 3.6987298044747394e-05, -5.912293529425133e-07,
    1.2927848547224909e-08, -3.554450530847313e-10, 1.169121692277523e-11, -4.451823873583812e-13,
    1.9150905578861813e-14, -9.317855912900776e-16, 3.1248143653732916e-17,
)


def _erf_near_zero(x: np.ndarray) -> np.ndarray:
    """erf(x) for |x| <= 1."""
    return x * chebyshev.chebval(2.0 * x * x - 1.0, _ERF_SMALL)


def _erfc_positive(a: np.ndarray) -> np.ndarray:
    """erfc(a) for a >= 1, without cancellation (underflows to 0 past a ~ 27)."""
    with np.errstate(all="ignore"):
        t = 1.0 / a
        middle = chebyshev.chebval((2.0 * t - 7.0 / 6.0) * 1.2, _ERFC_MIDDLE)
        tail = chebyshev.chebval(72.0 * t * t - 1.0, _ERFC_TAIL) * t
        return np.exp(-a * a) * np.where(a <= 6.0, middle, tail)


def erf(x: np.ndarray) -> np.ndarray:
    """Vectorised error function, computed and returned in float64 (a few ulps)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    small = np.abs(x) <= 1.0  # False for NaN, which the other branch passes through
    out[small] = _erf_near_zero(x[small])
    large = ~small
    out[large] = np.copysign(1.0 - _erfc_positive(np.abs(x[large])), x[large])
    return out


def erfc(x: np.ndarray) -> np.ndarray:
    """Vectorised 1 - erf(x) in float64, accurate in the tail where 1 - erf(x) would cancel."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    small = np.abs(x) <= 1.0
    out[small] = 1.0 - _erf_near_zero(x[small])
    large = ~small
    tail = _erfc_positive(np.abs(x[large]))
    out[large] = np.where(x[large] > 0, tail, 2.0 - tail)
    return out


# float32 Gelu: erfc(a) = t * exp(P(t) - a*a) with t = 1 / (1 + a/2) for a >= 0, P fitted (weighted least squares,
# ascending powers of t) to log(erfc(a) / t) + a*a on [0, 10] to 5e-8. Evaluated in float32, erfc's relative error
# is about 5e-7 for a < 1.5, growing with the rounding of a*a (2e-6 at a = 4, where erfc is 1.5e-8); Gelu is then
# within 1 ulp for x > 2, 7e-7 relative for |x| < 2 and 2e-6 for x > -4 (where its magnitude is above 1e-4).
_ERFC_EXP = (-1.2654413835356562, 0.9984914021411602, 0.3879094357495792, 0.028309681208468135,
             0.020339529028226336, -0.11706740077883677, -0.6508961489813752, 1.1221243079346663,
             -0.665939874689674, 0.14217049680394497)
# Horner order (highest power first); the constant term of the half-erfc form folds in the factor 1/2
_HALF_ERFC32 = np.array((_ERFC_EXP[0] + np.log(0.5),) + _ERFC_EXP[1:], dtype=np.float32)[::-1].copy()
_BLOCK = 1 << 14  # elements per block: a block's scratch buffers stay in the L2 cache


def _horner(poly: np.ndarray, t: np.ndarray, out: np.ndarray) -> np.ndarray:
    np.multiply(t, poly[0], out=out)
    np.add(out, poly[1], out=out)
    for c in poly[2:]:
        np.multiply(out, t, out=out)
        np.add(out, c, out=out)
    return out


def _half_erfc32(a: np.ndarray, scratch: np.ndarray, out: np.ndarray) -> np.ndarray:
    """erfc(a) / 2 for float32 a >= 0 (overwrites a with a*a)."""
    t = scratch
    np.multiply(a, 0.5, out=t)
    np.add(t, 1, out=t)
    np.reciprocal(t, out=t)
    _horner(_HALF_ERFC32, t, out)
    np.multiply(a, a, out=a)
    np.subtract(out, a, out=out)
    np.exp(out, out=out)
    return np.multiply(out, t, out=out)


def _blockwise(fn: Callable[..., None], x: np.ndarray, out: np.ndarray | None, scratch: int) -> np.ndarray:
    """Applies fn(x_block, out_block, *scratch_buffers) to L2-sized blocks of a float32 array."""
    src = np.ascontiguousarray(x).reshape(-1)
    result = np.empty(x.shape, dtype=np.float32) if out is None or not out.flags.c_contiguous else out
    dst = result.reshape(-1)
    buffers = [np.empty(min(src.size, _BLOCK), dtype=np.float32) for _ in range(scratch)]
    with np.errstate(all="ignore"):
        for start in range(0, src.size, _BLOCK):
            stop = min(src.size, start + _BLOCK)
            fn(src[start:stop], dst[start:stop], *(b[:stop - start] for b in buffers))
    if out is not None and result is not out:
        out[...] = result
        return out
    return result


def _gelu32_block(x, out, a, t, h) -> None:
    np.abs(x, out=a)
    np.multiply(a, np.float32(0.7071067811865476), out=a)
    _half_erfc32(a, t, h)  # Phi(x) = h for x < 0, 1 - h for x >= 0
    np.subtract(1, h, out=a)
    # pick h where x is negative with bit operations: numpy's masked copies are ten times slower than this
    a_bits, h_bits, sign = a.view(np.int32), h.view(np.int32), t.view(np.int32)
    np.right_shift(x.view(np.int32), 31, out=sign)  # all ones where x's sign bit is set
    np.bitwise_xor(a_bits, h_bits, out=h_bits)
    np.bitwise_and(h_bits, sign, out=h_bits)
    np.bitwise_xor(a_bits, h_bits, out=a_bits)
    np.multiply(x, a, out=out)


def gelu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """0.5 * x * (1 + erf(x / sqrt 2)): float32 in float32 arithmetic, other dtypes in float64 (exact to a few
    ulps). `out` may be x itself."""
    if x.dtype == np.float32:
        return _blockwise(_gelu32_block, x, out, 3)
    # 1 + erf(x / sqrt 2) as erfc(-x / sqrt 2): no cancellation for negative x
    y = (0.5 * x * erfc(x * (-1 / np.sqrt(2)))).astype(x.dtype, copy=False)
    if out is None:
        return y
    out[...] = y
    return out


def tanh_gelu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))), into out (which may be x)."""
    inner = np.multiply(x, x)
    np.multiply(inner, x.dtype.type(0.044715), out=inner)
    np.add(inner, 1, out=inner)
    np.multiply(inner, x, out=inner)
    np.multiply(inner, x.dtype.type(np.sqrt(2 / np.pi)), out=inner)
    np.tanh(inner, out=inner)
    np.add(inner, 1, out=inner)
    np.multiply(inner, 0.5, out=inner)
    return np.multiply(x, inner, out=out)


@register("Erf", since=9)
class Erf(Kernel):
    in_place = True

    def run(self, x):
        with np.errstate(all="ignore"):
            return erf(x).astype(x.dtype)


@register("IsNaN", since=9)
class IsNaN(Kernel):
    def run(self, x):
        return np.isnan(widen(x))


@register("IsInf", since=10)
class IsInf(Kernel):
    def setup(self) -> None:
        self.negative = bool(self.attr("detect_negative", 1))
        self.positive = bool(self.attr("detect_positive", 1))

    def run(self, x):
        x = widen(x)
        if self.negative and self.positive:
            return np.isinf(x)
        if self.positive:
            return np.isposinf(x)
        if self.negative:
            return np.isneginf(x)
        return np.zeros(x.shape, dtype=np.bool_)


@register("Clip", since=1)
class Clip(Kernel):
    """Bounds are attributes before opset 11 and optional inputs from 11 on; min > max gives max everywhere."""
    in_place = True

    def setup(self) -> None:
        self.attr_bounds = (self.attr("min"), self.attr("max")) if self.version < 11 else None

    def run(self, x, lo=None, hi=None):
        if self.attr_bounds is not None:
            lo, hi = self.attr_bounds
        if lo is not None and np.size(lo) == 0:
            lo = None
        if hi is not None and np.size(hi) == 0:
            hi = None
        out = x
        with np.errstate(over="ignore"):  # float16 clamps the float32 attribute defaults to +-inf
            lo = None if lo is None else np.asarray(lo).astype(x.dtype).reshape(())
            hi = None if hi is None else np.asarray(hi).astype(x.dtype).reshape(())
        if x.dtype.kind == "f" and x.dtype.itemsize >= 4 and (lo is not None or hi is not None):
            # one vectorised clip (numpy's maximum/minimum with a scalar are not); lo > hi gives hi, as required
            return np.clip(x, -np.inf if lo is None else lo, np.inf if hi is None else hi)
        if lo is not None:
            out = np.maximum(out, lo)
        if hi is not None:
            out = np.minimum(out, hi)
        return out


_VARIADIC = {"Max": np.maximum, "Min": np.minimum, "Sum": np.add, "Mean": np.add}


@register(["Max", "Min", "Sum", "Mean"], since=1)
class Variadic(Kernel):
    """Max, Min, Sum, Mean of any number of broadcastable inputs (half floats accumulate in float32)."""

    def setup(self) -> None:
        self.fn = _VARIADIC[self.node.op_type]
        self.mean = self.node.op_type == "Mean"

    def run(self, *inputs):
        first = inputs[0]
        with np.errstate(all="ignore"):
            out = functools.reduce(self.fn, [widen(x) for x in inputs])
            if self.mean:
                out = out / len(inputs)
        return np.asarray(out).astype(first.dtype, copy=False)


@register("Where", since=9)
class Where(Kernel):
    def run(self, condition, x, y):
        return np.where(condition, x, y)

    def _fits(self, out, condition, x, y) -> bool:
        """Whether the selection can be written into `out`: ndarrays of out's dtype (a bool condition) that
        broadcast to its shape and share no memory with it."""
        return (type(condition) is np.ndarray and type(x) is np.ndarray and type(y) is np.ndarray
                and condition.dtype == np.bool_ and x.dtype == y.dtype == out.dtype
                and np.broadcast_shapes(condition.shape, x.shape, y.shape) == out.shape
                and not any(np.may_share_memory(out, a) for a in (condition, x, y)))

    def run_into(self, out, condition, x, y):
        """np.where's result copied into the planned buffer when it has its shape and dtype (np.where has no out:
        a bound step selects into the buffer itself)."""
        result = np.where(condition, x, y)
        if result.shape != out.shape or result.dtype != out.dtype:
            return result
        np.copyto(out, result)
        return out

    def bind_into(self, out, condition, x, y):
        if not self._fits(out, condition, x, y):
            return None

        def select() -> None:
            np.copyto(out, y)
            np.copyto(out, x, where=condition)
        return select
