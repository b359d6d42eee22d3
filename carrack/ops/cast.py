"""Type conversion kernels: Cast, CastLike, BitCast.

`cast_array` is the one conversion routine (QuantizeLinear reuses it). ml_dtypes provides the narrow types and does
the rounding (round to nearest even); this module adds what it does not do as ONNX wants:

* float64 and wide integers reach the narrow float types through float32 *rounded to odd*, so the final rounding is
  a single correct round-to-nearest-even (ml_dtypes itself rounds twice: to float32, then to the target);
* `saturate` for the float8 types (clamp to the largest finite value; Inf saturates too, except in the FNUZ types
  before Cast-24, whose spec table sends +-Inf to NaN);
* float8e8m0 with its `round_mode` (up / down / nearest) and saturation, done on the exponent bits;
* strings, parsed and formatted the way onnxruntime does (``%.8g``, ``NaN``, ``INF``, ``-INF``).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
from onnx import TensorProto

from carrack.ir.dtypes import to_numpy
from carrack.ops.registry import Kernel, register

_FLOAT8 = frozenset(np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
                                           ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz))
_FNUZ = frozenset(np.dtype(t) for t in (ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz))
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_FLOAT6 = {getattr(TensorProto, code): np.dtype(getattr(ml_dtypes, name))
           for code, name in (("FLOAT6E2M3", "float6_e2m3fn"), ("FLOAT6E3M2", "float6_e3m2fn"))
           if hasattr(TensorProto, code) and hasattr(ml_dtypes, name)}
#: Narrow float types that ml_dtypes implements (rounding from float32 is done by ml_dtypes).
_NARROW_FLOATS = frozenset(np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float4_e2m1fn)) | _FLOAT8 | frozenset(
    _FLOAT6.values())
#: Sub-byte integer types and their bit widths (ml_dtypes keeps one value per byte, in the low bits).
_SUB_BYTE_INTS = {np.dtype(ml_dtypes.int4): 4, np.dtype(ml_dtypes.uint4): 4,
                  np.dtype(ml_dtypes.int2): 2, np.dtype(ml_dtypes.uint2): 2}
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


def onnx_dtype(code: int) -> np.dtype:
    """numpy dtype for an ONNX element type code (float6 types included)."""
    if code in _FLOAT6:
        return _FLOAT6[code]
    return to_numpy(code)


def is_ml_float(dt: np.dtype) -> bool:
    return dt in _NARROW_FLOATS or dt == _E8M0


def bit_width(dt: np.dtype) -> int:
    if dt in _SUB_BYTE_INTS:
        return _SUB_BYTE_INTS[dt]
    if dt == np.dtype(ml_dtypes.float4_e2m1fn):
        return 4
    if dt in _FLOAT6.values():
        return 6
    return dt.itemsize * 8


def cast_array(x: np.ndarray, to: np.dtype, *, saturate: bool = True, round_mode: str = "up",
               fnuz_inf_is_nan: bool = False) -> np.ndarray:
    """Convert `x` to dtype `to` with ONNX Cast semantics (`fnuz_inf_is_nan`: the Cast-19..23 table for FNUZ)."""
    to = np.dtype(to)
    x = np.asarray(x)
    if to == x.dtype:
        return x
    if to.kind == "O":
        return x.astype(object) if x.dtype.kind in "OU" else _to_strings(x)
    if x.dtype.kind in "OU":
        return _from_strings(x, to, saturate, round_mode, fnuz_inf_is_nan)
    if is_ml_float(x.dtype) or (x.dtype == np.bool_ and is_ml_float(to)):
        x = x.astype(np.float32)  # exact: every narrow float (and bool) is a float32
        if to == np.float32:
            return x
    if to == _E8M0:
        return _to_e8m0(x, saturate, round_mode)
    if to in _NARROW_FLOATS:
        return _to_narrow_float(x, to, saturate, fnuz_inf_is_nan)
    if to == np.bool_:
        return x != 0
    if to in _SUB_BYTE_INTS and x.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            x = x.astype(np.int64)  # truncate toward zero, then wrap like the other integer narrowings
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(to)


def _as_float32_for_rounding(x: np.ndarray) -> np.ndarray:
    """float32 from which one more rounding to a <= 22-bit-mantissa format is exactly the direct rounding of `x`."""
    if x.dtype == np.float32 or x.dtype == np.float16 or (x.dtype.kind in "iub" and x.dtype.itemsize <= 2):
        return x.astype(np.float32)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x64.astype(np.float32)
        inexact = np.isfinite(x64) & (y.astype(np.float64) != x64)
        rounded_away = inexact & (np.abs(y.astype(np.float64)) > np.abs(x64))
    # Round to odd: truncate toward zero, then set the last bit when anything was dropped (a sticky bit).
    bits = y.view(np.uint32) - rounded_away.astype(np.uint32)
    return (bits | inexact.astype(np.uint32)).view(np.float32)


def _to_narrow_float(x: np.ndarray, to: np.dtype, saturate: bool, fnuz_inf_is_nan: bool) -> np.ndarray:
    x32 = _as_float32_for_rounding(x)
    if to in _FLOAT8 and saturate:
        largest = np.float32(ml_dtypes.finfo(to).max)
        clipped = np.clip(x32, -largest, largest)  # NaN stays NaN
        if fnuz_inf_is_nan and to in _FNUZ:
            clipped = np.where(np.isinf(x32), np.float32(np.nan), clipped)
        x32 = clipped
    return x32.astype(to)


def _to_e8m0(x: np.ndarray, saturate: bool, round_mode: str) -> np.ndarray:
    """float8e8m0 (a bare biased exponent): code e means 2**(e - 127); 255 is NaN."""
    x64 = np.asarray(x, dtype=np.float64)
    mantissa, exponent = np.frexp(x64)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    floor_exp = exponent.astype(np.int64) - 1
    if round_mode == "up":
        step = mantissa != 0.5
    elif round_mode == "down":
        step = np.zeros(x64.shape, dtype=bool)
    else:  # nearest, ties up: the midpoint of [2**e, 2**(e+1)) is 1.5 * 2**e
        step = mantissa >= 0.75
    code = floor_exp + step + 127
    with np.errstate(invalid="ignore"):
        too_big = x64 > 2.0 ** _E8M0_MAX_EXP
        too_small = ~(x64 >= 2.0 ** _E8M0_MIN_EXP) & ~np.isnan(x64)  # zero and negatives included
    code = np.where(too_big, 254 if saturate else 255, code)
    code = np.where(too_small, 0 if saturate else 255, code)
    code = np.where(np.isnan(x64), 255, code)
    return code.astype(np.uint8).view(_E8M0)


def _to_strings(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.bool_:
        text = np.where(x, "1", "0")
    elif x.dtype.kind in "iu" or x.dtype in _SUB_BYTE_INTS:
        text = x.astype(np.int64).astype(str) if x.dtype in _SUB_BYTE_INTS else x.astype(str)
    else:
        values = x.astype(np.float64)
        text = np.char.mod("%.8g", values)
        text = np.where(np.isnan(values), "NaN", text)
        text = np.where(np.isposinf(values), "INF", text)
        text = np.where(np.isneginf(values), "-INF", text)
    out = np.empty(x.shape, dtype=object)
    out[...] = text.astype(str).tolist() if x.ndim else str(text)
    return out


def _from_strings(x: np.ndarray, to: np.dtype, saturate: bool, round_mode: str, fnuz_inf_is_nan: bool) -> np.ndarray:
    text = np.asarray(x).astype(str)
    if to.kind in "iu" and to not in _SUB_BYTE_INTS:
        try:
            return text.astype(np.uint64 if to.kind == "u" else np.int64).astype(to)
        except (ValueError, OverflowError):
            pass  # "100.5" and the like: parse as a number, then truncate
    try:
        numbers = text.astype(np.float64)
    except ValueError as e:
        raise ValueError(f"Cast: cannot convert strings to numbers: {e}") from None
    return cast_array(numbers, to, saturate=saturate, round_mode=round_mode, fnuz_inf_is_nan=fnuz_inf_is_nan)


def _round_mode(kernel: Kernel) -> str:
    mode = kernel.attr("round_mode", "up")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in ("up", "down", "nearest"):
        kernel.fail(f"round_mode must be 'up', 'down' or 'nearest', got {mode!r}")
    return mode


class _CastBase(Kernel):
    def read_conversion_attrs(self) -> None:
        self.saturate = bool(self.attr("saturate", 1)) if self.version >= 19 else True
        self.round_mode = _round_mode(self) if self.version >= 24 else "up"
        self.fnuz_inf_is_nan = self.version < 24

    def convert(self, x: np.ndarray, to: np.dtype) -> np.ndarray:
        return cast_array(x, to, saturate=self.saturate, round_mode=self.round_mode,
                          fnuz_inf_is_nan=self.fnuz_inf_is_nan)


@register("Cast", since=1)
class Cast(_CastBase):
    def setup(self):
        to = self.required_attr("to")
        if isinstance(to, (bytes, str)):  # Cast-1 spelled the type as a string, e.g. "FLOAT"
            name = to.decode() if isinstance(to, bytes) else to
            to = getattr(TensorProto, name.upper(), None)
            if to is None:
                self.fail(f"unknown type name {name!r} in 'to'")
        try:
            self.to = onnx_dtype(int(to))
        except ValueError as e:
            self.fail(str(e))
        self.read_conversion_attrs()

    def run(self, x):
        return self.convert(x, self.to)

    def bind_into(self, out, x):
        """An integer or bool input converted to bool (x != 0) or to an integer type, into `out`: what `run` gives
        (cast_array's comparison, numpy's wrapping astype), for these very arrays; other conversions stay unbound."""
        if not (type(x) is np.ndarray and type(out) is np.ndarray and x.dtype.kind in "biu"
                and self.to.kind in "biu" and self.to != x.dtype and out.dtype == self.to and out.shape == x.shape
                and out.flags.writeable and not np.may_share_memory(out, x)):
            return None
        if self.to == np.bool_:
            return functools.partial(np.not_equal, x, 0, out=out)
        return functools.partial(np.copyto, out, x, casting="unsafe")


@register("CastLike", since=15)
class CastLike(_CastBase):
    def setup(self):
        self.read_conversion_attrs()

    def run(self, x, target_type):
        return self.convert(x, target_type.dtype)


@register("BitCast", since=26)
class BitCast(Kernel):
    def setup(self):
        try:
            self.to = onnx_dtype(int(self.required_attr("to")))
        except ValueError as e:
            self.fail(str(e))
        if self.to.kind == "O":
            self.fail("'to' must not be STRING")

    def run(self, x):
        if x.dtype.kind == "O":
            raise ValueError(f"{self.node.label()}: BitCast does not accept strings")
        if bit_width(x.dtype) != bit_width(self.to):
            raise ValueError(f"{self.node.label()}: cannot reinterpret {x.dtype} ({bit_width(x.dtype)} bits) as "
                             f"{self.to} ({bit_width(self.to)} bits)")
        width = bit_width(self.to)
        if width >= 8:
            return x.view(self.to)
        # Sub-byte values live in the low bits of a byte each; ml_dtypes reads that byte's low bits back.
        bits = x.view(np.uint8) & np.uint8((1 << width) - 1)
        return bits.view(self.to)
