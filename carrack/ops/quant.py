"""Quantization kernels: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger, QLinearMatMul,
ConvInteger, QLinearConv.

Integer products are accumulated exactly through float BLAS. The zero-point-shifted operands are small integers;
float32 holds every integer up to 2**24, so a float32 GEMM is exact in any summation order as long as the sum of
|products| along K stays within 2**24. K is therefore split into chunks whose worst case (the operand types' ranges
after zero-point subtraction, times the chunk length) fits, each chunk runs through sgemm, and the chunk results
are added in float64 (exact below 2**53). Operands too wide for useful float32 chunks (16-bit types) go through
float64 BLAS. The accumulator then wraps to int32 as the spec allows ("accumulation may overflow if and only if in
32 bits").

When the weight is a constant that fits int8 after its zero-point shift and the activations are 8-bit, the integer
matmuls run on the native int8 GEMM instead (carrack/native/qgemm.c: VNNI where the CPU has it), whose wrapping
int32 accumulation and fused epilogues give the same bits as the numpy path (`NativeWeight`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from carrack import native
from carrack.native import convolution as native_conv
from carrack.ops.cast import cast_array, is_ml_float, onnx_dtype
from carrack.ops.conv import PreparedShapes, convolution_scratch_bytes
from carrack.ops.registry import Kernel, register

_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


# -- shared helpers ----------------------------------------------------------------------------------------------------
def as_float64(a: np.ndarray) -> np.ndarray:
    """Exact float64 copy of a numeric array (narrow floats go through float32, which holds them exactly)."""
    a = np.asarray(a)
    if is_ml_float(a.dtype):
        a = a.astype(np.float32)
    return a.astype(np.float64)


_SUB_BYTE_INT_NAMES = ("int4", "uint4", "int2", "uint2")


def integer_range(dtype: np.dtype) -> tuple[int, int]:
    info = ml_dtypes.iinfo(dtype) if dtype.name in _SUB_BYTE_INT_NAMES else np.iinfo(dtype)
    return int(info.min), int(info.max)


def is_integer_type(dtype: np.dtype) -> bool:
    return dtype.kind in "iu" or dtype.name in _SUB_BYTE_INT_NAMES


def saturate_to(values: np.ndarray, dtype: np.dtype, *, saturate: bool = True, fnuz_inf_is_nan: bool = False
                ) -> np.ndarray:
    """Already-rounded integral values (float64) clamped into an integer `dtype`; float targets use Cast rules."""
    if is_integer_type(dtype):
        lo, hi = integer_range(dtype)
        with np.errstate(invalid="ignore"):
            return np.clip(values, lo, hi).astype(np.int64).astype(dtype)
    return cast_array(values, dtype, saturate=saturate, fnuz_inf_is_nan=fnuz_inf_is_nan)


def wrap_int32(acc: np.ndarray) -> np.ndarray:
    """Exact integer accumulations held in float64 -> int32, wrapping on overflow like a 32-bit accumulator."""
    return np.rint(acc).astype(np.int64).astype(np.int32)


def _normal_axis(axis: int, rank: int, where: str) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"{where}: axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def expand_qparam(p: np.ndarray, x_shape: tuple[int, ...], axis: int, block_size: int, where: str) -> np.ndarray:
    """A scale/zero-point made broadcastable against x: per-tensor, per-axis, or blocked along `axis`."""
    p = np.asarray(p)
    if p.size == 1 and (block_size == 0 or p.ndim != len(x_shape)):
        return p.reshape(())
    rank = len(x_shape)
    axis = _normal_axis(axis, rank, where)
    if block_size > 0:
        if p.ndim != rank:
            raise ValueError(f"{where}: blocked quantization needs a rank-{rank} scale, got shape {p.shape}")
        blocks = -(-x_shape[axis] // block_size)
        if p.shape[axis] != blocks or any(p.shape[i] != x_shape[i] for i in range(rank) if i != axis):
            raise ValueError(f"{where}: scale shape {p.shape} does not fit input shape {x_shape} with block_size "
                             f"{block_size} along axis {axis} (expected {blocks} blocks there)")
        return np.repeat(p, block_size, axis=axis)[(slice(None),) * axis + (slice(0, x_shape[axis]),)]
    if p.ndim != 1 or p.shape[0] != x_shape[axis]:
        raise ValueError(f"{where}: per-axis scale must be 1-D of length {x_shape[axis]} (axis {axis}), "
                         f"got shape {p.shape}")
    shape = [1] * rank
    shape[axis] = p.shape[0]
    return p.reshape(shape)


def _decoded(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- QuantizeLinear / DequantizeLinear ------------------------------------------------------------------------------
@register("QuantizeLinear", since=10)
class QuantizeLinear(Kernel):
    """y = saturate(round_half_even(x / y_scale) + y_zero_point)."""

    def setup(self):
        self.axis = self.attr("axis", 1)
        self.block_size = self.attr("block_size", 0)
        if self.block_size < 0:
            self.fail(f"block_size must be >= 0, got {self.block_size}")
        self.saturate = bool(self.attr("saturate", 1))
        self.output_dtype = self._dtype_attr("output_dtype")
        self.precision = self._dtype_attr("precision")

    def _dtype_attr(self, name: str) -> np.dtype | None:
        code = self.attr(name, 0)
        if not code:
            return None
        try:
            return onnx_dtype(code)
        except ValueError as e:
            self.fail(f"{name}: {e}")

    def run(self, x, y_scale, y_zero_point=None):
        return self.run_into(None, x, y_scale, y_zero_point)

    def run_into(self, out, x, y_scale, y_zero_point=None):
        out_dtype = self._output_dtype(y_zero_point)
        if self.precision in (None, np.float32):
            fast = _quantize_per_tensor_8bit(x, y_scale, y_zero_point, out_dtype, out)
            if fast is not None:
                return fast
        where = self.node.label()
        scale = expand_qparam(y_scale, x.shape, self.axis, self.block_size, where)
        precision = self.precision or _division_precision(x.dtype, y_scale.dtype)
        quotient = _divide(cast_array(x, precision), cast_array(scale, precision))
        zero_point = 0.0 if y_zero_point is None else as_float64(
            expand_qparam(y_zero_point, x.shape, self.axis, self.block_size, where))
        if is_integer_type(out_dtype):
            return saturate_to(as_float64(np.rint(quotient)) + zero_point, out_dtype)
        return cast_array(as_float64(quotient) + zero_point, out_dtype, saturate=self.saturate,
                          fnuz_inf_is_nan=self.version < 24)

    def _output_dtype(self, zero_point) -> np.dtype:
        if zero_point is None:
            return self.output_dtype or np.dtype(np.uint8)
        if self.output_dtype is not None and self.output_dtype != zero_point.dtype:
            raise ValueError(f"{self.node.label()}: output_dtype {self.output_dtype} differs from the zero point's "
                             f"type {zero_point.dtype}")
        return zero_point.dtype


#: from this many elements QuantizeLinear's and DequantizeLinear's per-tensor fast paths run natively
#: (carrack/native/qconv.c: one pass, not three to five)
_NATIVE_QUANTIZE_MIN = 1024


def _quantize_per_tensor_8bit(x: np.ndarray, scale: np.ndarray, zero_point, out_dtype: np.dtype,
                              out: np.ndarray | None = None) -> np.ndarray | None:
    """The common case (float32 x, one float32 scale, 8-bit result) in float32 passes, equal to the general path:
    rint(x / scale) + zero_point is exact in float32 below 2**24 and saturates alike above. None when it does not
    apply, or for NaN inputs (their integer conversion is left to the general path). The native pass writes into
    `out` when it fits."""
    if x.dtype != np.float32 or x.ndim == 0 or scale.dtype != np.float32 or scale.size != 1 \
            or out_dtype not in (np.uint8, np.int8) or (zero_point is not None and np.size(zero_point) != 1):
        return None
    if x.size >= _NATIVE_QUANTIZE_MIN and x.flags.c_contiguous:
        from carrack.native import qconv

        zero = np.float32(0 if zero_point is None else np.asarray(zero_point).reshape(()))
        y = qconv.quantize_8bit(x, np.float32(scale.reshape(())), zero, out_dtype, out)
        if y is not None:
            return y
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = x / scale.reshape(())
    np.rint(q, out=q)
    if zero_point is not None:
        q += np.float32(np.asarray(zero_point).reshape(()))
    lo, hi = integer_range(out_dtype)
    np.clip(q, lo, hi, out=q)
    if np.isnan(q).any():
        return None
    return q.astype(out_dtype)


def _divide(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x / scale rounded to their (common) float type, returned in float64 (exactly) or in that native type."""
    if x.dtype in (np.float16, np.float32, np.float64):
        with np.errstate(divide="ignore", invalid="ignore"):
            return x / scale  # IEEE division, correctly rounded (numpy's float16 goes via float32: still exact)
    with np.errstate(divide="ignore", invalid="ignore"):
        return as_float64(cast_array(as_float64(x) / as_float64(scale), x.dtype))


def _narrow_integer(dtype: np.dtype) -> bool:
    return dtype.name in _SUB_BYTE_INT_NAMES or (dtype.kind in "iu" and dtype.itemsize <= 2)


def _division_precision(x_dtype: np.dtype, scale_dtype: np.dtype) -> np.dtype:
    """The division runs in the scale's float type; an e8m0 or integer scale leaves it to x (or float32)."""
    for dt in (scale_dtype, x_dtype):
        if dt != _E8M0 and (dt.kind == "f" or dt == np.dtype(ml_dtypes.bfloat16)):
            return dt
    return np.dtype(np.float32)


@register("DequantizeLinear", since=10)
class DequantizeLinear(Kernel):
    """y = (x - x_zero_point) * x_scale, rounded once to the output type."""

    def setup(self):
        self.axis = self.attr("axis", 1)
        self.block_size = self.attr("block_size", 0)
        if self.block_size < 0:
            self.fail(f"block_size must be >= 0, got {self.block_size}")
        code = self.attr("output_dtype", 0)
        try:
            self.output_dtype = onnx_dtype(code) if code else None
        except ValueError as e:
            self.fail(f"output_dtype: {e}")

    def run(self, x, x_scale, x_zero_point=None):
        return self.run_into(None, x, x_scale, x_zero_point)

    def run_into(self, out, x, x_scale, x_zero_point=None):
        where = self.node.label()
        out_dtype = self.output_dtype or (x_scale.dtype if x_scale.dtype != _E8M0 else np.dtype(np.float32))
        # (x - zero_point) of 8/16-bit integers is exact in float32, so for a float32 output one float32 multiply
        # rounds correctly; otherwise the product is formed in float64 and rounded once to the output type.
        compute = np.float32 if out_dtype == np.float32 and _narrow_integer(x.dtype) else np.float64
        if compute == np.float32 and x_scale.size == 1 and (x_zero_point is None or x_zero_point.size == 1) \
                and x.ndim and self.block_size == 0:  # per tensor: the same float32 operations
            zero = np.float32(0) if x_zero_point is None else as_float64(x_zero_point.reshape(())).astype(np.float32)
            scale = as_float64(x_scale.reshape(())).astype(np.float32)
            if x.size >= _NATIVE_QUANTIZE_MIN and x.flags.c_contiguous and x.dtype in (np.uint8, np.int8):
                from carrack.native import qconv

                y = qconv.dequantize_8bit(x, zero, scale, out)
                if y is not None:
                    return y
            y = x.astype(np.float32)
            if x_zero_point is not None:
                y -= zero
            y *= scale
            return y
        scale = expand_qparam(x_scale, x.shape, self.axis, self.block_size, where)
        shifted = x.astype(compute) if compute == np.float32 else as_float64(x)
        if x_zero_point is not None:
            zero_point = expand_qparam(x_zero_point, x.shape, self.axis, self.block_size, where)
            shifted = shifted - as_float64(zero_point).astype(compute)
        return cast_array(shifted * as_float64(scale).astype(compute), out_dtype)


@register("DynamicQuantizeLinear", since=11)
class DynamicQuantizeLinear(Kernel):
    """uint8 quantization with a scale and zero point chosen from the data range (widened to include 0)."""

    def run(self, x):
        x = np.asarray(x, dtype=np.float32)
        low = np.minimum(np.float32(0), x.min()) if x.size else np.float32(0)
        high = np.maximum(np.float32(0), x.max()) if x.size else np.float32(0)
        scale = np.float32((high - low) / np.float32(255))
        if scale == 0:  # all zeros: any scale works; onnxruntime reports 1 (and zero point 0)
            return np.zeros(x.shape, np.uint8), np.asarray(1, np.float32), np.asarray(0, np.uint8)
        zero_point = np.clip(np.rint(np.float32(0) - low / scale), 0, 255)
        y = np.clip(np.rint(x / scale) + zero_point, 0, 255)
        return y.astype(np.uint8), np.asarray(scale, np.float32), np.asarray(zero_point.astype(np.uint8))


# -- integer matmul ------------------------------------------------------------------------------------------------
def _row_param(p: np.ndarray | None, a: np.ndarray) -> np.ndarray | float:
    """A per-row (or per-tensor) parameter of the left matmul operand, shaped to broadcast against a[..., M, K]."""
    if p is None:
        return 0.0
    p = np.asarray(p)
    if p.size == 1:
        return as_float64(p.reshape(()))
    if p.ndim == 1 or p.ndim == a.ndim - 1:
        return as_float64(p)[..., None]
    return as_float64(p)


def _column_param(p: np.ndarray | None, b: np.ndarray) -> np.ndarray | float:
    """A per-column (or per-tensor) parameter of the right matmul operand, broadcastable against b[..., K, N]."""
    if p is None:
        return 0.0
    p = np.asarray(p)
    if p.size == 1:
        return as_float64(p.reshape(()))
    if p.ndim == b.ndim - 1 and p.ndim > 1:
        return as_float64(p)[..., None, :]
    return as_float64(p)


#: float32 represents every integer of magnitude <= 2**24 exactly; float64 every one <= 2**53
FLOAT32_EXACT = 2**24
FLOAT64_EXACT = 2**53
#: below this many K per chunk, float32 chunking costs more than float64 BLAS
_MIN_FLOAT32_CHUNK = 64


def shifted_magnitude(dtype: np.dtype, zero_point) -> int:
    """The largest |q - zero_point| over every q of `dtype` (and every given zero point)."""
    dtype = np.dtype(dtype)
    if not is_integer_type(dtype):
        raise TypeError(f"expected an integer operand type, got {dtype}")
    lo, hi = integer_range(dtype)
    if zero_point is None or np.size(zero_point) == 0:
        return max(abs(lo), abs(hi))
    zp = as_float64(zero_point)
    return int(max(hi - zp.min(), zp.max() - lo))


def float32_chunk(term_bound: int) -> int:
    """How many products of magnitude <= term_bound float32 may sum exactly (0: float32 is not worth it)."""
    chunk = FLOAT32_EXACT // max(int(term_bound), 1)
    return chunk if chunk >= _MIN_FLOAT32_CHUNK else 0


def exact_matmul(left: np.ndarray, right: np.ndarray, term_bound: int) -> np.ndarray:
    """left @ right for integer-valued float arrays with every |left[k] * right[k]| <= term_bound, exactly.

    The result is float32 when one float32 GEMM is exact, else float64; either holds the exact integers.
    """
    k = left.shape[-1]
    chunk = float32_chunk(term_bound)
    if chunk == 0:
        if term_bound * k > FLOAT64_EXACT:
            raise ValueError(f"integer matmul with K={k} could exceed float64's exact range")
        return np.matmul(left.astype(np.float64, copy=False), right.astype(np.float64, copy=False))
    left = left.astype(np.float32, copy=False)
    right = right.astype(np.float32, copy=False)
    if k <= chunk:
        return np.matmul(left, right)
    acc = None
    for start in range(0, k, chunk):
        part = np.matmul(left[..., start:start + chunk], right[..., start:start + chunk, :])
        if acc is None:
            acc = part.astype(np.float64)
        else:
            np.add(acc, part, out=acc)
    return acc


def _shifted(x: np.ndarray, zero_point) -> np.ndarray:
    """x - zero_point in float32 (exact for 8/16-bit integers) or float64 for wider types."""
    dtype = np.float32 if _narrow_integer(x.dtype) else np.float64
    shifted = x.astype(dtype)
    if zero_point is not None and not isinstance(zero_point, float):
        shifted -= np.asarray(zero_point).astype(dtype)
    return shifted


def integer_matmul(a: np.ndarray, a_zero_point, b: np.ndarray, b_zero_point) -> np.ndarray:
    """(a - a_zero_point) @ (b - b_zero_point) as exact integers held in a float array."""
    left = _shifted(a, _row_param(a_zero_point, a) if a_zero_point is not None else None)
    right = _shifted(b, _column_param(b_zero_point, b) if b_zero_point is not None else None)
    bound = shifted_magnitude(a.dtype, a_zero_point) * shifted_magnitude(b.dtype, b_zero_point)
    return exact_matmul(left, right, bound)


# -- the native int8 GEMM (carrack/native/qgemm.c) ------------------------------------------------------------------
_8BIT = (np.dtype(np.uint8), np.dtype(np.int8))
#: the largest K whose accumulation cannot leave int32 (|a - a_zp| <= 255 times an int8 weight <= 128): up to it,
#: the native GEMM's wrapping int32 equals an exact (unwrapped) accumulation
NATIVE_EXACT_K = (2**31 - 1) // (255 * 128)


class NativeWeight:
    """A kernel's constant 2-D weight input (minus its constant zero point) packed for the native int8 GEMM.

    `of` returns None when native kernels are unavailable or the weight does not qualify (not a constant, not 2-D,
    shifted values outside int8); `matches` tells at run time whether the inputs are still those constants (a run
    may override an initializer that is also a graph input).
    """

    def __init__(self, packed, weight: np.ndarray, zero_point: np.ndarray | None):
        self.packed = packed
        self.k, self.n = packed.k, packed.n
        self._weight, self._zero_point = weight, zero_point

    @classmethod
    def of(cls, kernel: Kernel, index: int, zero_point_index: int | None = None, *, transpose: bool = False
           ) -> NativeWeight | None:
        from carrack.native import qgemm

        if kernel.implementation != "native":
            return None
        constants = kernel.ctx.graph.initializers if kernel.ctx is not None and kernel.ctx.graph is not None else {}
        weight, zero_point = _constant_input(kernel, index, constants), None
        if zero_point_index is not None and zero_point_index < len(kernel.node.inputs) and \
                kernel.node.inputs[zero_point_index]:
            zero_point = _constant_input(kernel, zero_point_index, constants)
            if zero_point is None:
                return None
        if weight is None or weight.ndim != 2 or weight.dtype.kind not in "iuf" or qgemm.library() is None:
            return None
        shifted = weight.T if transpose else weight
        if zero_point is not None and (zero_point.dtype.kind not in "iu"
                                       or zero_point.size not in (1, shifted.shape[1])):
            return None

        def pack():
            values = shifted if zero_point is None else \
                shifted.astype(np.int32) - zero_point.astype(np.int32).reshape(-1)
            int8 = qgemm.int8_weight(values)
            return qgemm.PackedInt8Weight.pack(int8) if int8 is not None else None

        arrays = (weight,) if zero_point is None else (weight, zero_point)
        packed = native.prepared(f"int8-gemm:{transpose}", arrays, pack)  # shared by a session's programs
        return cls(packed, weight, zero_point) if packed is not None else None

    def matches(self, weight: np.ndarray, zero_point: np.ndarray | None = None) -> bool:
        return weight is self._weight and zero_point is self._zero_point


def _constant_input(kernel: Kernel, index: int, constants) -> np.ndarray | None:
    names = kernel.node.inputs
    value = constants.get(names[index]) if index < len(names) and names[index] else None
    return value if isinstance(value, np.ndarray) else None


def native_rows(a: np.ndarray, zero_point, k: int) -> tuple[np.ndarray, int] | None:
    """8-bit activations [..., K] as the native GEMM's uint8 rows [M, K] and their zero point (int8 values move up
    by 128, their zero point with them); None when they do not qualify (other types, a per-row zero point)."""
    if a.dtype not in _8BIT or a.ndim < 1 or a.shape[-1] != k or (zero_point is not None and np.size(zero_point) != 1):
        return None
    zp = 0 if zero_point is None else int(np.asarray(zero_point).reshape(()))
    rows = a.reshape(-1, k)
    if a.dtype == np.int8:
        return rows.view(np.uint8) ^ np.uint8(0x80), zp + 128
    return rows, zp


def native_output(out: np.ndarray | None, shape: tuple[int, ...], dtype) -> np.ndarray:
    """`out` when it is a usable buffer for a result (C-contiguous, of this shape and type), else a fresh array."""
    if out is not None and out.shape == shape and out.dtype == dtype and out.flags.c_contiguous and \
            out.flags.writeable:
        return out
    return np.empty(shape, dtype)


def native_gemm(weight: NativeWeight, rows: np.ndarray, a_zero_point: int, batch: tuple[int, ...],
                out: np.ndarray | None = None, out_dtype=np.int32, **epilogue) -> np.ndarray:
    """rows [M, K] (uint8) through the native GEMM into an array of shape batch + (N,)."""
    from carrack.native import qgemm

    y = native_output(out, batch + (weight.n,), np.dtype(out_dtype))
    qgemm.qgemm(rows, weight.packed, a_zero_point=a_zero_point, out=y.reshape(-1, weight.n), **epilogue)
    return y


@register("MatMulInteger", since=10)
class MatMulInteger(Kernel):
    def setup(self):
        self.native = NativeWeight.of(self, 1, 3)

    def run(self, a, b, a_zero_point=None, b_zero_point=None):
        if self.native is not None and self.native.matches(b, b_zero_point):
            rows = native_rows(a, a_zero_point, self.native.k)
            if rows is not None:
                return native_gemm(self.native, rows[0], rows[1], a.shape[:-1])
        return wrap_int32(integer_matmul(a, a_zero_point, b, b_zero_point))


@register("QLinearMatMul", since=10)
class QLinearMatMul(Kernel):
    """Integer matmul, then requantization by a_scale * b_scale / y_scale (float32, as onnxruntime does)."""

    def setup(self):
        self.native = NativeWeight.of(self, 3, 5)

    def run(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
        multiplier = (np.asarray(_row_param(a_scale, a), np.float32) * np.asarray(_column_param(b_scale, b), np.float32)
                      / _scalar(y_scale).astype(np.float32))
        if (self.native is not None and self.native.matches(b, b_zero_point) and y_zero_point.dtype in _8BIT
                and np.size(a_scale) == 1 and self.native.k <= NATIVE_EXACT_K):
            rows = native_rows(a, a_zero_point, self.native.k)
            if rows is not None:
                return native_gemm(self.native, rows[0], rows[1], a.shape[:-1], out_dtype=y_zero_point.dtype,
                                   multiplier=multiplier, y_zero_point=int(y_zero_point.reshape(())))
        acc = integer_matmul(a, a_zero_point, b, b_zero_point)
        return _requantize(acc, multiplier, y_zero_point)


def _scalar(p: np.ndarray) -> np.ndarray:
    if np.size(p) != 1:
        raise ValueError(f"expected a per-tensor (one-element) parameter, got shape {np.shape(p)}")
    return as_float64(np.asarray(p).reshape(()))


def _requantize(acc: np.ndarray, multiplier: np.ndarray, y_zero_point: np.ndarray) -> np.ndarray:
    """saturate(round_half_even(float32(acc) * multiplier) + y_zero_point)."""
    scaled = as_float64(acc.astype(np.float32) * multiplier)
    zero_point = _scalar(y_zero_point)
    if is_integer_type(y_zero_point.dtype):
        return saturate_to(np.rint(scaled) + zero_point, y_zero_point.dtype)
    return cast_array(scaled + zero_point, y_zero_point.dtype)


# -- integer convolution ---------------------------------------------------------------------------------------------
class _IntegerConv(Kernel):
    @classmethod
    def scratch_bytes(cls, node, facts) -> int:
        return convolution_scratch_bytes(node, facts, integer=True)

    def setup(self):
        self.group = int(self.attr("group", 1))
        self.auto_pad = _decoded(self.attr("auto_pad", "NOTSET"))
        if self.auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
            self.fail(f"auto_pad must be NOTSET, SAME_UPPER, SAME_LOWER or VALID, got {self.auto_pad!r}")
        self.pads = self.attr("pads")
        self.strides = self.attr("strides")
        self.dilations = self.attr("dilations")
        self.kernel_shape = self.attr("kernel_shape")
        #: the float convolution kernels the exact integer products run on (None: numpy's)
        self.float_kernels = self.if_native(native_conv.load)

    def accumulate(self, x, x_zero_point, w, w_zero_point) -> np.ndarray:
        """conv(x - x_zero_point, w - w_zero_point[m]) as exact integers held in a float array."""
        from carrack.ops.conv import conv_pads

        kernel = list(w.shape[2:])
        if self.kernel_shape is not None and list(self.kernel_shape) != kernel:
            raise ValueError(f"{self.node.label()}: kernel_shape {self.kernel_shape} does not match weights {kernel}")
        nd = len(kernel)
        strides = list(self.strides or [1] * nd)
        dilations = list(self.dilations or [1] * nd)
        pads = conv_pads(self.auto_pad, self.pads, x.shape[2:], kernel, strides, dilations)
        shifted_x = _shifted(x, None if x_zero_point is None else np.asarray(x_zero_point).reshape(()))
        shifted_w = _shifted(w, None if w_zero_point is None else _per_channel(w_zero_point, w.shape[0], w.ndim))
        bound = shifted_magnitude(x.dtype, x_zero_point) * shifted_magnitude(w.dtype, w_zero_point)
        return exact_convolve(shifted_x, shifted_w, bound, strides=strides, pads=pads, dilations=dilations,
                              group=self.group, kernels=self.float_kernels)


def exact_convolve(x: np.ndarray, w: np.ndarray, term_bound: int, **geometry) -> np.ndarray:
    """Convolution of integer-valued float arrays, exact: input channels are split so that each float32
    convolution sums at most FLOAT32_EXACT / term_bound products per output, and the parts add in float64."""
    from carrack.ops.conv import convolve

    group = geometry["group"]
    taps = int(np.prod(w.shape[2:], dtype=np.int64))
    per_group = w.shape[1]
    chunk = float32_chunk(term_bound)
    if chunk == 0:
        if term_bound * taps * per_group > FLOAT64_EXACT:
            raise ValueError("integer convolution could exceed float64's exact range")
        return convolve(x.astype(np.float64, copy=False), w.astype(np.float64, copy=False), **geometry)
    x = x.astype(np.float32, copy=False)
    w = w.astype(np.float32, copy=False)
    channels = max(chunk // max(taps, 1), 1)
    if per_group <= channels or (group == w.shape[0] == x.shape[1] and taps <= chunk):
        return convolve(x, w, **geometry)
    if chunk < taps:  # one channel's window alone is too long for float32
        return convolve(x.astype(np.float64), w.astype(np.float64), **geometry)
    return _channel_chunked(x, w, channels, geometry)


def _channel_chunked(x: np.ndarray, w: np.ndarray, channels: int, geometry: dict) -> np.ndarray:
    from carrack.ops.conv import convolve

    group = geometry["group"]
    per_group, m_per_group = w.shape[1], w.shape[0] // group
    single = dict(geometry, group=1)
    outputs = []
    for g in range(group):
        xg = x[:, g * per_group:(g + 1) * per_group]
        wg = w[g * m_per_group:(g + 1) * m_per_group]
        acc = None
        for start in range(0, per_group, channels):
            part = convolve(xg[:, start:start + channels], wg[:, start:start + channels], **single)
            if acc is None:
                acc = part.astype(np.float64)
            else:
                np.add(acc, part, out=acc)
        outputs.append(acc)
    return outputs[0] if group == 1 else np.concatenate(outputs, axis=1)


def _per_channel(p: np.ndarray, channels: int, rank: int) -> np.ndarray:
    """A per-tensor or per-output-channel parameter, broadcastable against [N or M, channels, *spatial]."""
    p = as_float64(p)
    if p.size == 1:
        return p.reshape(())
    if p.size != channels:
        raise ValueError(f"per-channel parameter has {p.size} values, expected {channels}")
    return p.reshape((channels,) + (1,) * (rank - 1))


@register("ConvInteger", since=10)
class ConvInteger(_IntegerConv):
    def run(self, x, w, x_zero_point=None, w_zero_point=None):
        return wrap_int32(self.accumulate(x, x_zero_point, w, w_zero_point))


@register("QLinearConv", since=10)
class QLinearConv(_IntegerConv):
    """With constant weights and quantization parameters, 1-D/2-D convolutions run natively
    (carrack/native/qconv.py: the same wrapping int32 accumulator and float32 requantization, bit-identical)."""

    prepares_shapes = True  # the plan hands it each input shape it evaluates

    def setup(self):
        super().setup()
        self.native = self._native_conv()
        #: input shape -> the native run's plan (None: the reference path), filled by the plan's per-size evaluation
        self.prepared = PreparedShapes()
        weight = self.ctx.graph.initializers.get(self.node.inputs[3]) if self.native is not None else None
        self.kernel_size = None if weight is None else list(weight.shape[2:])

    def prepare_shape(self, shape: tuple[int, ...]) -> None:
        if self.kernel_size is not None and len(shape) == len(self.kernel_size) + 2 and shape not in self.prepared:
            self.prepared.add(shape, self._native_plan(shape, self.kernel_size))

    def _native_conv(self):
        graph = self.ctx.graph if self.ctx is not None else None
        if graph is None:
            return None

        if self.implementation != "native":
            return None
        names = list(self.node.inputs) + [""] * (9 - len(self.node.inputs))
        x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale = (
            graph.initializers.get(n) if n else None for n in names[1:7])
        bias = graph.initializers.get(names[8]) if names[8] else np.zeros(0, np.int32)
        if any(v is None for v in (x_scale, w, w_scale, y_scale, bias)) or w.ndim not in (3, 4):
            return None
        if (names[2] and x_zero_point is None) or (names[5] and w_zero_point is None):
            return None
        if np.size(x_scale) != 1 or np.size(y_scale) != 1 or (x_zero_point is not None and x_zero_point.size != 1):
            return None
        if self.kernel_shape is not None and list(self.kernel_shape) != list(w.shape[2:]):
            return None
        channels = w.shape[0]
        try:
            shifted = as_float64(w) - (0.0 if w_zero_point is None else _per_channel(w_zero_point, channels, w.ndim))
            multiplier = (_scalar(x_scale).astype(np.float32)
                          * _per_channel(w_scale, channels, 1).astype(np.float32).reshape(-1)
                          / _scalar(y_scale).astype(np.float32)) * np.ones(channels, np.float32)
        except ValueError:
            return None
        bias = bias.reshape(-1) if bias.size else np.zeros(channels, np.int32)
        if bias.dtype != np.int32 or bias.size != channels or not np.all(np.isfinite(multiplier)):
            return None
        from carrack.native.qconv import QuantizedConv

        x_zp = 0 if x_zero_point is None else int(x_zero_point.reshape(()))
        return QuantizedConv.prepare(shifted, bias, multiplier.astype(np.float32), self.group, x_zp)

    def _native_plan(self, shape: tuple[int, ...], kernel: list[int]):
        from carrack.ops.conv import conv_pads

        nd = len(kernel)
        strides = list(self.strides or [1] * nd)
        dilations = list(self.dilations or [1] * nd)
        pads = conv_pads(self.auto_pad, self.pads, shape[2:], kernel, strides, dilations)
        return self.native.plan(shape, strides, pads, dilations)

    def run(self, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, B=None):
        if self.native is not None and x.ndim == w.ndim and x.dtype in (np.uint8, np.int8) \
                and y_zero_point.dtype in (np.uint8, np.int8) and y_zero_point.size == 1:
            plan = self.prepared.get(x.shape, False)
            if plan is False:  # a shape the plan did not prepare (a subgraph, an unknown shape): planned per run
                plan = self._native_plan(x.shape, list(w.shape[2:]))
            if plan is not None:
                return self.native.run(x, y_zero_point, plan)
        acc = self.accumulate(x, x_zero_point, w, w_zero_point)
        if B is not None:
            acc = acc + as_float64(B).reshape((-1,) + (1,) * (acc.ndim - 2))
        acc = wrap_int32(acc)  # a 32-bit accumulator, bias included
        multiplier = _scalar(x_scale).astype(np.float32) * _per_channel(w_scale, acc.shape[1], acc.ndim - 1).astype(
            np.float32) / _scalar(y_scale).astype(np.float32)
        return _requantize(acc, multiplier, y_zero_point)
