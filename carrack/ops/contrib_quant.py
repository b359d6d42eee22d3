"""com.microsoft quantized kernels that onnxruntime's quantization tools and fusions emit.

Elementwise and pooling ops dequantize to float32, compute, and requantize (round half to even, saturate), which is
what onnxruntime's reference semantics describe; its vectorised kernels may differ by one quantization step on
near-tie values. Integer matmuls reuse quant.py's exact float32-chunked accumulation, or, for a constant weight
that fits int8 after its zero-point shift, the native int8 GEMM (carrack/native/qgemm.c) with the same results.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from carrack import native
from carrack.native import convolution as native_conv
from carrack.ops import quant, registry
from carrack.ops.conv import PreparedShapes, convolution_scratch_bytes
from carrack.ops.registry import Kernel, bound_or_run_into, register

MS = "com.microsoft"


# -- helpers -----------------------------------------------------------------------------------------------------------
def _scalar32(p, default: float = 0.0) -> np.float32:
    if p is None:
        return np.float32(default)
    if np.size(p) != 1:
        raise ValueError(f"expected a per-tensor (one-element) parameter, got shape {np.shape(p)}")
    return np.float32(np.asarray(p).reshape(()))


def dequantize(x: np.ndarray, scale, zero_point) -> np.ndarray:
    """(x - zero_point) * scale in float32, per tensor."""
    return (x.astype(np.float32) - _scalar32(zero_point)) * _scalar32(scale)


def quantize(y: np.ndarray, scale, zero_point, dtype: np.dtype) -> np.ndarray:
    """saturate(round_half_even(y / scale) + zero_point) into the integer type `dtype`, per tensor."""
    lo, hi = quant.integer_range(np.dtype(dtype))
    q = np.rint(np.asarray(y, np.float32) / _scalar32(scale))
    q += _scalar32(zero_point)
    return np.clip(q, lo, hi, out=q).astype(dtype)


def _out_dtype(x: np.ndarray, zero_point) -> np.dtype:
    return np.dtype(zero_point.dtype) if zero_point is not None else x.dtype


# -- QuantizeLinear / DequantizeLinear ---------------------------------------------------------------------------------
@register("QuantizeLinear", domain=MS)
class MsQuantizeLinear(quant.QuantizeLinear):
    """Same formula as ONNX QuantizeLinear (uint8/int8/uint16/int16/int4/uint4 outputs)."""


@register("DequantizeLinear", domain=MS)
class MsDequantizeLinear(quant.DequantizeLinear):
    """Same formula as ONNX DequantizeLinear."""


# -- elementwise -------------------------------------------------------------------------------------------------------
@register("QLinearAdd", domain=MS)
class QLinearAdd(Kernel):
    """C = quantize(dequantize(A) + dequantize(B)), with numpy broadcasting.

    Computed as A * (a_scale / c_scale) + B * (b_scale / c_scale) + offset in float32 (fewer passes than
    dequantizing both sides; equal up to float32 rounding, so a near-tie may land one step away, as in onnxruntime).
    Same-shape operands run natively (carrack/native/qconv.c) with the same float32 operations, bit-identical.
    """

    def run(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point=None):
        return self.run_into(None, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point)

    def run_into(self, out, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point=None):
        ka, kb, offset = _add_factors(a_scale, a_zero_point, b_scale, b_zero_point, c_scale, c_zero_point)
        dtype = _out_dtype(a, c_zero_point)
        if a.shape == b.shape and a.size >= _NATIVE_ADD_MIN and self.implementation == "native":
            from carrack.native import qconv

            y = qconv.qlinear_add(a, b, ka, kb, offset, dtype, out)
            if y is not None:
                return y
        value = a.astype(np.float32) * ka
        value = np.add(value, b.astype(np.float32) * kb, out=value if value.shape == np.broadcast_shapes(
            a.shape, b.shape) else None)
        value += offset
        np.rint(value, out=value)
        lo, hi = quant.integer_range(dtype)
        return np.clip(value, lo, hi, out=value).astype(dtype)

    def setup(self):
        graph = self.ctx.graph if self.ctx is not None else None
        parameters = [name for k, name in enumerate(self.node.inputs) if k not in (0, 3) and name]
        #: whether every scale and zero point is a constant (a bound call computes its factors once)
        self.constant_parameters = graph is not None and all(name in graph.initializers for name in parameters)

    def bind_into(self, out, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point=None):
        if not self.constant_parameters or self.implementation != "native" or a.shape != b.shape \
                or a.dtype != b.dtype or a.size < _NATIVE_ADD_MIN or a.dtype not in (np.uint8, np.int8) \
                or not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous) \
                or out.shape != a.shape or out.dtype != _out_dtype(a, c_zero_point):
            return None  # the factors are computed once: only constant scales and zero points qualify
        from carrack.native import qconv

        factors = _add_factors(a_scale, a_zero_point, b_scale, b_zero_point, c_scale, c_zero_point)
        return qconv.qlinear_add_call(a, b, *factors, out)


def _add_factors(a_scale, a_zero_point, b_scale, b_zero_point, c_scale, c_zero_point) -> tuple[np.float32, ...]:
    """QLinearAdd's (ka, kb, offset): C = A * ka + B * kb + offset, in float32."""
    c = _scalar32(c_scale)
    ka, kb = _scalar32(a_scale) / c, _scalar32(b_scale) / c
    return ka, kb, _scalar32(c_zero_point) - _scalar32(a_zero_point) * ka - _scalar32(b_zero_point) * kb


#: below this many elements the numpy QLinearAdd is as quick as a native call
_NATIVE_ADD_MIN = 256


@register("QLinearMul", domain=MS)
class QLinearMul(Kernel):
    """C = quantize(dequantize(A) * dequantize(B)), with numpy broadcasting."""

    def run(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point=None):
        value = dequantize(a, a_scale, a_zero_point) * dequantize(b, b_scale, b_zero_point)
        return quantize(value, c_scale, c_zero_point, _out_dtype(a, c_zero_point))


class _LookupActivation(Kernel):
    """quantize(f(dequantize(x))) through a 256-entry table (every 8-bit input value), built per call."""

    def function(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def run(self, x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        lo, hi = quant.integer_range(x.dtype)
        levels = np.arange(lo, hi + 1).astype(x.dtype)
        with np.errstate(over="ignore"):
            table = quantize(self.function(dequantize(levels, x_scale, x_zero_point)), y_scale, y_zero_point,
                             _out_dtype(x, y_zero_point))
        return table[x.astype(np.intp) - lo]


@register("QLinearSigmoid", domain=MS)
class QLinearSigmoid(_LookupActivation):
    def function(self, x):
        return np.reciprocal(np.float32(1) + np.exp(-x))


@register("QLinearLeakyRelu", domain=MS)
class QLinearLeakyRelu(_LookupActivation):
    def setup(self):
        self.alpha = np.float32(self.attr("alpha", 0.01))

    def function(self, x):
        return np.where(x < 0, x * self.alpha, x)


@register("QLinearSoftmax", domain=MS)
class QLinearSoftmax(Kernel):
    """quantize(Softmax(dequantize(x))); `opset` < 13 softmaxes the 2-D flattening at `axis`."""

    def setup(self):
        self.opset = int(self.required_attr("opset"))
        self.axis = int(self.attr("axis", -1 if self.opset >= 13 else 1))

    def run(self, x, x_scale, x_zero_point, y_scale, y_zero_point):
        value = dequantize(x, x_scale, x_zero_point)
        axis = self.axis + x.ndim if self.axis < 0 else self.axis
        shaped = value if self.opset >= 13 else value.reshape(int(np.prod(x.shape[:axis])), -1)
        along = axis if self.opset >= 13 else 1
        e = np.exp(shaped - shaped.max(axis=along, keepdims=True))
        e /= e.sum(axis=along, keepdims=True)
        return quantize(e.reshape(x.shape), y_scale, y_zero_point, _out_dtype(x, y_zero_point))


# -- pooling and concatenation -----------------------------------------------------------------------------------------
def _to_channels_first(x: np.ndarray) -> np.ndarray:
    return np.moveaxis(x, -1, 1)


def _to_channels_last(x: np.ndarray) -> np.ndarray:
    return np.moveaxis(x, 1, -1)


@register("QLinearGlobalAveragePool", domain=MS)
class QLinearGlobalAveragePool(Kernel):
    def setup(self):
        self.channels_last = bool(self.attr("channels_last", 0))

    def run(self, x, x_scale, x_zero_point, y_scale, y_zero_point):
        axes = tuple(range(1, x.ndim - 1)) if self.channels_last else tuple(range(2, x.ndim))
        mean = dequantize(x, x_scale, x_zero_point).mean(axis=axes, keepdims=True, dtype=np.float32)
        return quantize(mean, y_scale, y_zero_point, _out_dtype(x, y_zero_point))


@register("QLinearAveragePool", domain=MS)
class QLinearAveragePool(Kernel):
    """AveragePool (opset 19 semantics, without dilations) between dequantization and quantization."""

    def setup(self):
        self.channels_last = bool(self.attr("channels_last", 0))
        attrs = {k: v for k, v in self.node.attrs.items() if k != "channels_last"}
        base = replace(self.node, op_type="AveragePool", domain="", attrs=attrs)
        cls, version = registry.resolve("", "AveragePool", 19)
        self.pool = cls(base, version, self.ctx)

    def run(self, x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        value = dequantize(x, x_scale, x_zero_point)
        if self.channels_last:
            value = _to_channels_first(value)
        pooled = self.pool.run(value)
        if self.channels_last:
            pooled = _to_channels_last(pooled)
        return quantize(pooled, y_scale, y_zero_point, _out_dtype(x, y_zero_point))


@register("QLinearConcat", domain=MS)
class QLinearConcat(Kernel):
    """Inputs: Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) per tensor; each is requantized to Y's."""

    def setup(self):
        self.axis = int(self.required_attr("axis"))
        if (len(self.node.inputs) - 2) % 3 or len(self.node.inputs) < 5:
            self.fail("expects Y_scale, Y_zero_point and then (X, X_scale, X_zero_point) triples")

    def run(self, y_scale, y_zero_point, *triples):
        dtype = np.dtype(y_zero_point.dtype)
        parts = []
        for x, x_scale, x_zero_point in zip(triples[0::3], triples[1::3], triples[2::3]):
            same = _scalar32(x_scale) == _scalar32(y_scale) and _scalar32(x_zero_point) == _scalar32(y_zero_point)
            parts.append(x if same else quantize(dequantize(x, x_scale, x_zero_point), y_scale, y_zero_point, dtype))
        return np.concatenate(parts, axis=self.axis)


# -- integer matmuls ---------------------------------------------------------------------------------------------------
def _columns(p: np.ndarray) -> np.ndarray:
    """A per-tensor or per-column parameter as float32, broadcastable against [..., N]."""
    p = np.asarray(p, np.float32)
    return p.reshape(()) if p.size == 1 else p.reshape(-1)


@register("QGemm", domain=MS)
class QGemm(Kernel):
    """Y = alpha * a_scale * b_scale * ((A - a_zp) @ (B - b_zp) + C); quantized when y_scale is given."""

    def setup(self):
        self.alpha = np.float32(self.attr("alpha", 1.0))
        self.trans_a = bool(self.attr("transA", 0))
        self.trans_b = bool(self.attr("transB", 0))
        self.native = quant.NativeWeight.of(self, 3, 5, transpose=self.trans_b)

    def run(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point=None, c=None, y_scale=None, y_zero_point=None):
        if self.native is not None and self.native.matches(b, b_zero_point):
            y = self._run_native(a.T if self.trans_a else a, a_scale, a_zero_point, b_scale, c, y_scale, y_zero_point)
            if y is not None:
                return y
        if self.trans_a:
            a = a.T
        if self.trans_b:
            b = b.T
        acc = quant.integer_matmul(a, a_zero_point, b, b_zero_point)
        if c is not None:
            acc = acc + c.astype(np.float64)
        acc = quant.wrap_int32(acc).astype(np.float32)
        multiplier = self.alpha * _scalar32(a_scale) * _columns(b_scale)
        if y_scale is None:
            return acc * multiplier
        scaled = acc * (multiplier / _scalar32(y_scale))
        dtype = np.dtype(y_zero_point.dtype) if y_zero_point is not None else np.dtype(np.uint8)
        return quantize(scaled, np.float32(1), y_zero_point, dtype)

    def _run_native(self, a, a_scale, a_zero_point, b_scale, c, y_scale, y_zero_point) -> np.ndarray | None:
        n = self.native.n
        rows = quant.native_rows(a, a_zero_point, self.native.k) if a.ndim == 2 else None
        if rows is None or (c is not None and (c.dtype != np.int32 or not (c.size == 1 or c.shape[-1] == c.size == n))):
            return None
        multiplier = self.alpha * _scalar32(a_scale) * _columns(b_scale)
        if y_scale is None:
            return quant.native_gemm(self.native, *rows, a.shape[:-1], out_dtype=np.float32, bias_i32=c,
                                     scale=multiplier)
        dtype = np.dtype(y_zero_point.dtype) if y_zero_point is not None else np.dtype(np.uint8)
        if dtype not in (np.uint8, np.int8):
            return None
        return quant.native_gemm(self.native, *rows, a.shape[:-1], out_dtype=dtype, bias_i32=c,
                                 multiplier=multiplier / _scalar32(y_scale),
                                 y_zero_point=int(_scalar32(y_zero_point)))


@register("MatMulIntegerToFloat", domain=MS)
class MatMulIntegerToFloat(Kernel):
    """Y = (A - a_zp) @ (B - b_zp) * a_scale * b_scale + bias."""

    def setup(self):
        self.native = quant.NativeWeight.of(self, 1, 5)

    def run(self, a, b, a_scale, b_scale, a_zero_point=None, b_zero_point=None, bias=None):
        if self.native is not None and self.native.matches(b, b_zero_point):
            rows = quant.native_rows(a, a_zero_point, self.native.k)
            scale = _columns(a_scale) * _columns(b_scale)
            if rows is not None and scale.size in (1, self.native.n) and _float32_columns(bias, self.native.n):
                return quant.native_gemm(self.native, *rows, a.shape[:-1], out_dtype=np.float32, scale=scale,
                                         bias_f32=bias)
        acc = quant.wrap_int32(quant.integer_matmul(a, a_zero_point, b, b_zero_point)).astype(np.float32)
        y = acc * (_columns(a_scale) * _columns(b_scale))
        return y if bias is None else y + bias.astype(np.float32)


def dynamic_quantize_shifted(x: np.ndarray) -> tuple[np.ndarray, np.float32, int]:
    """DynamicQuantizeLinear's uint8 quantization of x, returned already shifted: (q - zero_point) as float32,
    the scale, and the zero point."""
    x = np.asarray(x, np.float32)
    low = min(np.float32(0), x.min()) if x.size else np.float32(0)
    high = max(np.float32(0), x.max()) if x.size else np.float32(0)
    scale = np.float32((high - low) / np.float32(255))
    if scale == 0:
        return np.zeros(x.shape, np.float32), np.float32(1), 0
    zero_point = int(np.clip(np.rint(np.float32(0) - low / scale), 0, 255))
    shifted = np.rint(x / scale)
    np.clip(shifted, -zero_point, 255 - zero_point, out=shifted)  # == clip(q + zp, 0, 255) - zp
    return shifted, scale, zero_point


def _float32_columns(bias: np.ndarray | None, n: int) -> bool:
    """Whether a bias may go to the native epilogue: absent, or float32 [N] (numpy adds it without promotion)."""
    return bias is None or (bias.dtype == np.float32 and bias.shape == (n,))


def native_dynamic_matmul(weight: quant.NativeWeight, x: np.ndarray, w_scale: np.ndarray, bias: np.ndarray | None,
                          out: np.ndarray | None = None) -> np.ndarray | None:
    """x (float32 [..., K]) quantized as DynamicQuantizeLinear does, times the packed weight in int32, then
    float32(acc) * (x_scale * w_scale) (+ bias), as the numpy paths compute it; None when it cannot serve the call
    (a NaN or an infinity in x, parameters of other types or shapes)."""
    from carrack.native import qgemm

    if x.dtype != np.float32 or x.ndim < 1 or x.shape[-1] != weight.k or w_scale.dtype != np.float32 or \
            w_scale.size not in (1, weight.n) or not _float32_columns(bias, weight.n):
        return None
    quantized = qgemm.dynamic_quantize_u8(x.reshape(-1, weight.k))
    if quantized is None:
        return None
    rows, x_scale, x_zero_point = quantized
    return quant.native_gemm(weight, rows, x_zero_point, x.shape[:-1], out, out_dtype=np.float32,
                             scale=x_scale * w_scale.reshape(-1), bias_f32=bias)


@register("DynamicQuantizeMatMul", domain=MS)
class DynamicQuantizeMatMul(Kernel):
    """A quantized to uint8 as DynamicQuantizeLinear does, then MatMulIntegerToFloat against B."""

    def setup(self):
        self.native = quant.NativeWeight.of(self, 1, 3)

    def run(self, a, b, b_scale, b_zero_point=None, bias=None):
        if self.native is not None and self.native.matches(b, b_zero_point) and self.native.k <= quant.NATIVE_EXACT_K:
            y = native_dynamic_matmul(self.native, a, _columns(b_scale), bias)
            if y is not None:
                return y
        left, a_scale, a_zero_point = dynamic_quantize_shifted(a)
        right = b.astype(np.float32)
        if b_zero_point is not None:
            right = right - _columns(b_zero_point)
        bound = max(a_zero_point, 255 - a_zero_point) * quant.shifted_magnitude(b.dtype, b_zero_point)
        acc = quant.exact_matmul(left, right, bound).astype(np.float32)
        y = acc * (a_scale * _columns(b_scale))
        return y if bias is None else y + bias.astype(np.float32)


# -- MatMulNBits ------------------------------------------------------------------------------------------------------
def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes holding 8/bits values each, lowest bits first -> one uint8 per value along the last axis."""
    per_byte = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    parts = [(packed >> np.uint8(bits * j)) & mask for j in range(per_byte)]
    return np.stack(parts, axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


def dequantize_nbits(b: np.ndarray, scales: np.ndarray, zero_points, g_idx, *, k: int, n: int, bits: int,
                     block_size: int) -> np.ndarray:
    """MatMulNBits' packed weight [N, k_blocks, blob] -> dequantized [K, N] in the scales' float type."""
    blocks = -(-k // block_size)
    q = unpack_bits(b.reshape(n, -1), bits)[:, :blocks * block_size].reshape(n, blocks * block_size)[:, :k]
    dtype = np.float32 if scales.dtype != np.float64 else np.float64
    scales = scales.astype(dtype).reshape(n, blocks)
    if zero_points is None:
        zp = np.full((n, blocks), float(1 << (bits - 1)), dtype)
    elif zero_points.dtype == np.uint8:
        zp = unpack_bits(zero_points.reshape(n, -1), bits)[:, :blocks].astype(dtype)
    else:
        zp = zero_points.astype(dtype).reshape(n, blocks)
    group = np.arange(k) // block_size if g_idx is None else np.asarray(g_idx, np.intp).reshape(-1)[:k]
    weight = (q.astype(dtype) - zp[:, group]) * scales[:, group]
    return np.ascontiguousarray(weight.T)


@register("MatMulNBits", domain=MS)
class MatMulNBits(Kernel):
    """Y = A @ dequantize(B) + bias. The optimizer's lowering replaces constant-weight instances by a float MatMul
    whose weight is dequantized once; this kernel serves the rest (weights fed at run time)."""

    def setup(self):
        self.k = int(self.required_attr("K"))
        self.n = int(self.required_attr("N"))
        self.bits = int(self.attr("bits", 4))
        self.block_size = int(self.required_attr("block_size"))
        if self.bits not in (2, 4, 8):
            self.fail(f"bits must be 2, 4 or 8, got {self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            self.fail(f"block_size must be a power of two >= 16, got {self.block_size}")

    def weight(self, b, scales, zero_points=None, g_idx=None) -> np.ndarray:
        return dequantize_nbits(b, scales, zero_points, g_idx, k=self.k, n=self.n, bits=self.bits,
                                block_size=self.block_size)

    def run(self, a, b, scales, zero_points=None, g_idx=None, bias=None):
        w = self.weight(b, scales, zero_points, g_idx)
        y = np.matmul(a.astype(np.float32, copy=False), w.astype(np.float32, copy=False))
        if bias is not None:
            y = y + bias.astype(np.float32)
        return y.astype(a.dtype, copy=False)


# -- kernels the quantization lowering emits (domain "carrack") ------------------------------------------------------
CARRACK = "carrack"


def split_matmul(left: np.ndarray, right: np.ndarray, ends: list[int], float32_accumulator: bool) -> np.ndarray:
    """left[M, K] @ right[K, N] as one float32 GEMM per K range (each exact by construction of `ends`), the parts
    added in float32 when the whole sum is known to stay exact there, else in float64."""
    start, acc = 0, None
    for end in ends:
        part = np.matmul(left[:, start:end], right[start:end])
        if acc is None:
            acc = part if float32_accumulator else part.astype(np.float64)
        else:
            acc += part
        start = end
    return acc


def float_weight(weight: np.ndarray) -> np.ndarray:
    """A lowered kernel's shifted weight as float32 for the numpy path: the lowering keeps it as int8 when it fits;
    a sealed (read-only) constant is widened once and the result shared."""
    if weight.dtype == np.float32:
        return weight
    if not weight.flags.writeable:
        return native.prepared("float32", (weight,), lambda: weight.astype(np.float32))
    return weight.astype(np.float32)


def requantize(acc: np.ndarray, multiplier: np.ndarray, y_zero_point: np.ndarray) -> np.ndarray:
    """saturate(round_half_even(float32(acc) * multiplier) + y_zero_point), as an int32 accumulator requantizes."""
    lo, hi = quant.integer_range(y_zero_point.dtype)
    y = acc.astype(np.float32, copy=False) * multiplier
    np.rint(y, out=y)
    y += np.float32(y_zero_point.reshape(()))
    return np.clip(y, lo, hi, out=y).astype(y_zero_point.dtype)


@register("QLinearMatMulExact", domain=CARRACK)
class QLinearMatMulExact(Kernel):
    """Lowered QDQ MatMul/Gemm: x[..., K] (8-bit) against a pre-shifted float32 weight [K, N]; the int32 bias is
    held as float64 integers; multiplier = x_scale * w_scale / y_scale per output column."""

    def setup(self):
        self.x_zero_point = np.float32(self.required_attr("x_zero_point"))
        self.ends = list(self.required_attr("k_splits"))
        self.float32_accumulator = bool(self.attr("float32_accumulator", 0))
        self.native = quant.NativeWeight.of(self, 1)

    def run(self, x, weight, bias, multiplier, y_zero_point):
        return self.run_into(None, x, weight, bias, multiplier, y_zero_point)

    def run_into(self, out, x, weight, bias, multiplier, y_zero_point):
        if self.native is not None and self.native.matches(weight):
            rows = quant.native_rows(x, np.asarray(int(self.x_zero_point)), self.native.k)
            if rows is not None:  # the lowering made sure the int32 accumulator cannot wrap
                return quant.native_gemm(self.native, *rows, x.shape[:-1], out, out_dtype=y_zero_point.dtype,
                                         bias_i32=bias.astype(np.int32), multiplier=multiplier,
                                         y_zero_point=int(y_zero_point.reshape(())))
        left = x.reshape(-1, x.shape[-1]).astype(np.float32)
        left -= self.x_zero_point
        acc = split_matmul(left, float_weight(weight), self.ends, self.float32_accumulator)
        acc += bias.astype(acc.dtype, copy=False)
        return requantize(acc, multiplier, y_zero_point).reshape(x.shape[:-1] + (weight.shape[1],))


#: input shapes per convolution whose native plans are kept


@register("QLinearConvExact", domain=CARRACK)
class QLinearConvExact(Kernel):
    """Lowered QDQ Conv: like QLinearMatMulExact with convolution geometry; `k_splits` cut input channels.

    With a constant weight, 1-D/2-D convolutions run natively (carrack/native/qconv.py: int8 GEMM or the direct
    depthwise kernel, bit-identical to the float path below, which serves the rest)."""

    prepares_shapes = True  # the plan hands it each input shape it evaluates

    @classmethod
    def scratch_bytes(cls, node, facts) -> int:
        return convolution_scratch_bytes(node, facts, integer=True)

    def setup(self):
        self.x_zero_point = np.float32(self.required_attr("x_zero_point"))
        self.ends = list(self.required_attr("k_splits"))
        self.float32_accumulator = bool(self.attr("float32_accumulator", 0))
        self.group = int(self.attr("group", 1))
        self.auto_pad = self.attr("auto_pad", "NOTSET")
        self.auto_pad = self.auto_pad.decode() if isinstance(self.auto_pad, bytes) else self.auto_pad
        self.pads, self.strides, self.dilations = self.attr("pads"), self.attr("strides"), self.attr("dilations")
        self.native = self._native_conv()
        self.float_kernels = self.if_native(native_conv.load)  # for the float path's exact products
        #: input shape -> the native run's plan (None: the numpy path), filled by the plan's per-size evaluation
        self.prepared = PreparedShapes()
        weight = self.ctx.graph.initializers.get(self.node.inputs[1]) if self.native is not None else None
        self.kernel_size = None if weight is None else list(weight.shape[2:])

    def prepare_shape(self, shape: tuple[int, ...]) -> None:
        if self.kernel_size is not None and len(shape) == len(self.kernel_size) + 2 and shape not in self.prepared:
            self.prepared.add(shape, self._native_plan(shape, self.kernel_size))

    def _native_conv(self):
        graph = self.ctx.graph if self.ctx is not None else None
        if graph is None or self.implementation != "native":
            return None
        constants = [graph.initializers.get(name) for name in self.node.inputs[1:4]]
        if any(c is None for c in constants):
            return None
        from carrack.native.qconv import QuantizedConv

        weight, bias, multiplier = constants
        zero_point = int(self.x_zero_point)
        return native.prepared(f"qconv:{self.group}:{zero_point}", (weight, bias, multiplier),
                               lambda: QuantizedConv.prepare(weight, bias, multiplier, self.group, zero_point))

    def geometry(self, spatial: tuple[int, ...], kernel: list[int]) -> dict:
        from carrack.ops.conv import conv_pads

        nd = len(kernel)
        strides = list(self.strides or [1] * nd)
        dilations = list(self.dilations or [1] * nd)
        return {"strides": strides, "dilations": dilations, "group": self.group,
                "pads": conv_pads(self.auto_pad, self.pads, spatial, kernel, strides, dilations)}

    def run(self, x, weight, bias, multiplier, y_zero_point):
        return self.run_into(None, x, weight, bias, multiplier, y_zero_point)

    def run_into(self, out, x, weight, bias, multiplier, y_zero_point):
        if self.native is not None and x.dtype in (np.uint8, np.int8) and x.ndim == weight.ndim:
            plan = self.prepared.get(x.shape, False)
            if plan is False:  # a shape the plan did not prepare (a subgraph, an unknown shape): planned per run
                plan = self._native_plan(x.shape, list(weight.shape[2:]))
            if plan is not None:
                return self.native.run(x, y_zero_point, plan, out)
        return self._run_numpy(x, weight, bias, multiplier, y_zero_point,
                               self.geometry(x.shape[2:], list(weight.shape[2:])))

    def bind_into(self, out, x, weight, bias, multiplier, y_zero_point):
        if self.native is None or x.dtype not in (np.uint8, np.int8) or x.ndim != weight.ndim:
            return None
        plan = self.prepared.get(x.shape, False)
        call = None if plan is None or plan is False else self.native.bound_call(x, y_zero_point, plan, out)
        if call is None:
            return None
        return bound_or_run_into(call, self.run_into, out, x, weight, bias, multiplier, y_zero_point)

    def _native_plan(self, shape: tuple[int, ...], kernel: list[int]):
        geometry = self.geometry(shape[2:], kernel)
        return self.native.plan(shape, geometry["strides"], geometry["pads"], geometry["dilations"])

    def _run_numpy(self, x, weight, bias, multiplier, y_zero_point, geometry):
        from carrack.ops.conv import convolve

        shifted = x.astype(np.float32)
        shifted -= self.x_zero_point
        weight = float_weight(weight)
        start, acc = 0, None
        for end in self.ends:
            whole = start == 0 and end == weight.shape[1]
            part = convolve(shifted if whole else shifted[:, start:end], weight if whole else weight[:, start:end],
                            **geometry, kernels=self.float_kernels)
            if acc is None:
                acc = part if self.float32_accumulator else part.astype(np.float64)
            else:
                acc += part
            start = end
        channel_shape = (-1,) + (1,) * (weight.ndim - 2)
        acc += bias.astype(acc.dtype, copy=False).reshape(channel_shape)
        return requantize(acc, multiplier.reshape(channel_shape), y_zero_point)


@register("DynamicQuantizedMatMul", domain=CARRACK)
class DynamicQuantizedMatMul(Kernel):
    """Lowered DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul [-> Add]: x quantized to uint8 per call, an
    exact split float32 GEMM against the pre-shifted weight, then x_scale * w_scale (+ bias)."""

    def setup(self):
        self.ends = list(self.required_attr("k_splits"))
        self.native = quant.NativeWeight.of(self, 1)

    def run(self, x, weight, w_scale, bias=None):
        return self.run_into(None, x, weight, w_scale, bias)

    def run_into(self, out, x, weight, w_scale, bias=None):
        if self.native is not None and self.native.matches(weight):
            y = native_dynamic_matmul(self.native, x, w_scale, bias, out)  # the lowering ruled out int32 wrapping
            if y is not None:
                return y
        left, a_scale, _ = dynamic_quantize_shifted(x)
        acc = split_matmul(left.reshape(-1, x.shape[-1]), float_weight(weight), self.ends, False)
        y = acc.astype(np.float32, copy=False) * (a_scale * w_scale)
        if bias is not None:
            y += bias
        return y.reshape(x.shape[:-1] + (weight.shape[1],))
