"""Emitters for quantized models (runtime/carrack_quant.h): the integer kernels carrack's quantization lowering
leaves in the plan (QLinearConvExact, QLinearMatMulExact, QuantizeLinear, DequantizeLinear, QLinearAdd, MaxPool on
8-bit values), bit for bit equal to the session. `emit` asks `emitter_for` first for every node."""

from __future__ import annotations

import numpy as np

from carrack.backends.c.emit import (
    _const,
    _conv_geometry,
    _dtype_of_array,
    _elements,
    _Emitter,
    _f,
    _hw,
    _output_value,
    _pointer,
    _pool_geometry,
    _require_known,
    _Unsupported,
)
from carrack.backends.c.emit_values import _broadcast_lines, _dtype, _shape_of
from carrack.ir import symbolic
from carrack.ir.graph import Node
from carrack.plan.arena import Block

# quantized models (carrack_quant.h): the integer kernels carrack's quantization lowering leaves in the plan ---------

def _scratch(em: _Emitter, step: int, name: str, size: int) -> str:
    """A block of the arena that lives for this step only (a kernel's packing buffer)."""
    em.extra_blocks.append(Block(name, size, step, step))
    index = len(em.plan.arena.blocks if em.plan.arena else ()) + len(em.extra_blocks) - 1
    return f"(int16_t *)(r->arena + r->off[{index}])"


def _require_8bit(em: _Emitter, name: str) -> int:
    """1 for int8, 0 for uint8 (the kernels' `signed` flag)."""
    _require_known(em, [name])
    dtype = em.values[name].dtype
    if dtype not in ("uint8", "int8"):
        raise _Unsupported(f"input '{name}' is {dtype}, not uint8 or int8")
    return int(dtype == "int8")


def _scalar_param(em: _Emitter, name: str, what: str) -> np.ndarray:
    value = _const(em, name) if name else None
    if value is None or value.size != 1:
        raise _Unsupported(f"{what} '{name}' is not a constant scalar (per-tensor quantization is compiled)")
    return value.reshape(())


def _shifted_weight_rows(weight: np.ndarray, what: str) -> np.ndarray:
    """[channels, k] pre-shifted weights as int64, checked to be integers of int16 range."""
    if not np.array_equal(weight, np.rint(weight)) or np.abs(weight).max(initial=0) > 32767:
        raise _Unsupported(f"{what}: weights that are not integers of int16 range")
    return weight.astype(np.int64)


#: carrack_quant.h's CR_QCB: output channels per weight block
QUANT_CHANNEL_BLOCK = 16


def _padded_channels(channels: int) -> int:
    return -(-channels // QUANT_CHANNEL_BLOCK) * QUANT_CHANNEL_BLOCK


def _blocked_weights(rows: np.ndarray, groups: int) -> tuple[np.ndarray, str, int]:
    """Each group's [channels, k] rows as carrack_quant.h reads them, [block][k / 2][16 channels][2], with k padded
    to even and channels to whole blocks: int8 when every weight fits (a quarter of the bytes of float32), else
    int16. Returns the array, its type and the pairs of k."""
    channels, k = rows.shape
    per_group, pairs = channels // groups, -(-k // 2)
    dtype = "int8" if rows.size == 0 or -128 <= rows.min() and rows.max() <= 127 else "int16"
    padded = _padded_channels(per_group)
    parts = []
    for g in range(groups):
        block = np.zeros((padded, 2 * pairs), np.int64)
        block[:per_group, :k] = rows[g * per_group:(g + 1) * per_group]
        parts.append(block.reshape(padded // QUANT_CHANNEL_BLOCK, QUANT_CHANNEL_BLOCK, pairs, 2)
                     .transpose(0, 2, 1, 3).reshape(-1))
    return np.concatenate(parts).astype(dtype), dtype, pairs


def _requantize_params(em: _Emitter, node: Node, channels: int, groups: int, weight_rows: np.ndarray,
                       x_bound: int):
    """Pointers to the int32 bias and float32 multiplier per output channel (each group's padded to whole weight
    blocks); refuses an int32 accumulator that could wrap (the session's float sums are exact integers, so the C
    sums must be too)."""
    bias = np.asarray(_const(em, node.inputs[2]), np.float64).reshape(-1)
    multiplier = np.asarray(_const(em, node.inputs[3]), np.float32).reshape(-1)
    bias = np.broadcast_to(bias, (channels,))
    multiplier = np.broadcast_to(multiplier, (channels,))
    bound = x_bound * np.abs(weight_rows).sum(axis=1) + np.abs(bias)
    if bound.max(initial=0) >= 2 ** 31 or not np.array_equal(bias, np.rint(bias)):
        raise _Unsupported("an accumulator that may leave int32 (or a bias that is not an integer)")
    per_group = channels // groups
    padded = _padded_channels(per_group)
    bias_blocks, multiplier_blocks = np.zeros((groups, padded), np.int32), np.zeros((groups, padded), np.float32)
    bias_blocks[:, :per_group] = bias.reshape(groups, per_group)
    multiplier_blocks[:, :per_group] = multiplier.reshape(groups, per_group)
    key = node.outputs[0]
    return (em.typed_constant(f"{key}::bias", bias_blocks, "int32"),
            em.typed_constant(f"{key}::multiplier", multiplier_blocks, "float32"))


def _output_zero_point(em: _Emitter, node: Node, index: int) -> tuple[int, str]:
    """The output's zero point and type (uint8 without one)."""
    name = node.inputs[index] if len(node.inputs) > index else ""
    if not name:
        return 0, "uint8"
    value = _scalar_param(em, name, "zero point")
    return int(value), _zero_point_dtype(value)


def _zero_point_dtype(value: np.ndarray) -> str:
    dtype = _dtype_of_array(value)
    if dtype not in ("uint8", "int8"):
        raise _Unsupported(f"zero point of type {value.dtype}")
    return dtype


def _x_bound(x_signed: int, x_zero_point: int) -> int:
    lo, hi = (-128, 127) if x_signed else (0, 255)
    return max(x_zero_point - lo, hi - x_zero_point)


def _emit_qconv(em, step, node, shapes, out_shape):
    """QLinearConvExact: an int16 im2col panel per block of CR_QNB pixels times the int16 weights in int32."""
    x = node.inputs[0]
    x_signed = _require_8bit(em, x)
    weight = _const(em, node.inputs[1])
    if weight is None or any(_const(em, n) is None for n in node.inputs[2:4]):
        raise _Unsupported("weights, bias or multiplier that are not constants")
    x_shape = shapes[x]
    g = _conv_geometry(node, x_shape, weight.shape)
    groups = int(node.attrs.get("group", 1))
    rows = _shifted_weight_rows(np.asarray(weight, np.float64).reshape(weight.shape[0], -1), node.label())
    x_zero_point = int(node.attrs.get("x_zero_point", 0))
    bias, multiplier = _requantize_params(em, node, weight.shape[0], groups, rows, _x_bound(x_signed, x_zero_point))
    y_zero_point, y_dtype = _output_zero_point(em, node, 4)
    blocked, w_dtype, pairs = _blocked_weights(rows, groups)
    pw = em.typed_constant(f"{node.outputs[0]}::weight_blocks", blocked, w_dtype)
    panel = _scratch(em, step, f"{node.outputs[0]}::panel", pairs * 2 * QUANT_PIXEL_BLOCK * 2)
    y = _output_value(em, step, node.outputs[0], out_shape, y_dtype)
    h, wd = _hw(x_shape, g["spatial"])
    oh, ow = _hw(out_shape, g["spatial"])
    dims = [em.c_dim(d) for d in (x_shape[0], x_shape[1], h, wd, out_shape[1], oh, ow)]
    geometry = [str(v) for v in (*g["k"], *g["s"], *g["d"], g["p"][0], g["p"][1], groups, pairs)]
    wide = int(w_dtype == "int16")
    return [f"cr_qconv2d({_pointer(em, x)}, {x_signed}, {x_zero_point}, {pw}, {wide}, {bias}, {multiplier},",
            f"           {y.pointer}, {int(y_dtype == 'int8')}, {y_zero_point}, {', '.join(dims)},",
            f"           {', '.join(geometry)}, {panel});"]


def _emit_qmatmul(em, step, node, shapes, out_shape):
    """QLinearMatMulExact: x [..., K] rows against the weight [K, N], as cr_qconv2d's product transposed."""
    x = node.inputs[0]
    x_signed = _require_8bit(em, x)
    weight = _const(em, node.inputs[1])
    if weight is None or weight.ndim != 2 or any(_const(em, n) is None for n in node.inputs[2:4]):
        raise _Unsupported("a weight that is not a constant matrix, or bias/multiplier that are not constants")
    x_shape = shapes[x]
    k, n = weight.shape
    rows = _shifted_weight_rows(np.asarray(weight, np.float64).T, node.label())
    x_zero_point = int(node.attrs.get("x_zero_point", 0))
    bias, multiplier = _requantize_params(em, node, n, 1, rows, _x_bound(x_signed, x_zero_point))
    y_zero_point, y_dtype = _output_zero_point(em, node, 4)
    blocked, w_dtype, pairs = _blocked_weights(rows, 1)
    pw = em.typed_constant(f"{node.outputs[0]}::weight_blocks", blocked, w_dtype)
    panel = _scratch(em, step, f"{node.outputs[0]}::panel", pairs * 2 * QUANT_PIXEL_BLOCK * 2)
    y = _output_value(em, step, node.outputs[0], out_shape, y_dtype)
    return [f"cr_qmatmul({_pointer(em, x)}, {x_signed}, {x_zero_point}, {pw}, {int(w_dtype == 'int16')}, {bias}, "
            f"{multiplier},",
            f"           {y.pointer}, {int(y_dtype == 'int8')}, {y_zero_point}, {em.c_dim(_elements(x_shape[:-1]))}, "
            f"{k}, {n}, {pairs}, {panel});"]


def _emit_quantize(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    _require_known(em, [x])
    if em.values[x].dtype != "float32":
        raise _Unsupported(f"input '{x}' is {em.values[x].dtype}, not float32")
    if _per_axis(em, node):  # a 1-D scale and zero point along `axis` (per-channel)
        (scales, zero_points, *dims), y_dtype = _axis_params(em, node, shapes[x])
        kernel, params, sizes = "cr_quantize_axis", f"{scales}, {zero_points}", ", ".join(dims)
    else:
        scale = _scalar_param(em, node.inputs[1], "scale")
        zero_point, y_dtype = _output_zero_point(em, node, 2)
        _require_float32_scale(scale)
        kernel, params, sizes = "cr_quantize", f"{_f(float(scale))}, {_f(zero_point)}", em.c_dim(_elements(out_shape))
    y = _output_value(em, step, node.outputs[0], out_shape, y_dtype)
    return [f"{kernel}({_pointer(em, x)}, {params}, {y.pointer}, {int(y_dtype == 'int8')}, {sizes});"]


def _emit_dequantize(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    x_signed = _require_8bit(em, x)
    if int(node.attrs.get("output_dtype", 0)) not in (0, 1):
        raise _Unsupported("a dequantization to another type than float32")
    if _per_axis(em, node):  # a 1-D scale and zero point along `axis` (per-channel)
        (scales, zero_points, *dims), _ = _axis_params(em, node, shapes[x])
        kernel, params, sizes = "cr_dequantize_axis", f"{zero_points}, {scales}", ", ".join(dims)
    else:
        scale = _scalar_param(em, node.inputs[1], "scale")
        zero_point = _scalar_param(em, node.inputs[2], "zero point") if len(node.inputs) > 2 and node.inputs[2] else 0
        if scale.dtype != np.float32:
            raise _Unsupported("a dequantization to another type than float32")
        kernel, params = "cr_dequantize", f"{_f(float(zero_point))}, {_f(float(scale))}"
        sizes = em.c_dim(_elements(out_shape))
    y = _output_value(em, step, node.outputs[0], out_shape, "float32")
    return [f"{kernel}({_pointer(em, x)}, {x_signed}, {params}, {y.pointer}, {sizes});"]


def _require_float32_scale(scale: np.ndarray) -> None:
    if scale.dtype != np.float32:
        raise _Unsupported(f"a {scale.dtype} scale")


def _per_axis(em: _Emitter, node: Node) -> bool:
    """Whether a QuantizeLinear/DequantizeLinear has a scale or zero point of more than one value."""
    return any(value is not None and value.size > 1
               for value in (_const(em, name) if name else None for name in node.inputs[1:3]))


def _axis_params(em: _Emitter, node: Node, x_shape) -> tuple[list[str], str]:
    """A per-axis node's scale and zero point (float32 constants of one value per channel), the C dims
    outer, channels, inner around its axis, and the zero point's type (uint8 without one)."""
    if int(node.attrs.get("block_size", 0)):
        raise _Unsupported("blocked quantization (block_size)")
    rank = len(x_shape)
    axis = int(node.attrs.get("axis", 1))
    if not -rank <= axis < rank:
        raise _Unsupported(f"axis {axis} for an input of rank {rank}")
    axis %= rank
    channels = x_shape[axis]
    scale = _const(em, node.inputs[1])
    zp_name = node.inputs[2] if len(node.inputs) > 2 else ""
    zero_point = _const(em, zp_name) if zp_name else np.zeros(1, np.uint8)
    if scale is None or zero_point is None:
        raise _Unsupported("a scale or zero point that is not a constant")
    for what, value in (("scale", scale), ("zero point", zero_point)):
        per_channel = value.ndim == 1 and isinstance(channels, (int, np.integer)) and value.size == channels
        if value.size != 1 and not per_channel:
            raise _Unsupported(f"a {what} of shape {value.shape} along axis {axis} of length {channels} "
                               "(per-tensor or 1-D per-axis quantization is compiled)")
    _require_float32_scale(scale)
    zp_dtype = _zero_point_dtype(zero_point)
    key = node.outputs[0]
    scales = em.typed_constant(f"{key}::scales", np.broadcast_to(scale.reshape(-1), (channels,)), "float32")
    zero_points = em.typed_constant(f"{key}::zero_points",
                                    np.broadcast_to(zero_point.reshape(-1).astype(np.float32), (channels,)), "float32")
    dims = [em.c_dim(_elements(x_shape[:axis])), str(int(channels)), em.c_dim(_elements(x_shape[axis + 1:]))]
    return [scales, zero_points, *dims], zp_dtype


def _emit_qlinear_add(em, step, node, shapes, out_shape):
    """com.microsoft QLinearAdd: the session's float32 formula, its constants computed here as numpy does."""
    a, b = node.inputs[0], node.inputs[3]
    a_signed, b_signed = _require_8bit(em, a), _require_8bit(em, b)
    a_scale, a_zp, b_scale, b_zp, c_scale = (_scalar_param(em, node.inputs[i], "parameter") for i in (1, 2, 4, 5, 6))
    zero_point, y_dtype = _output_zero_point(em, node, 7)
    c = np.float32(c_scale)
    ka, kb = np.float32(a_scale) / c, np.float32(b_scale) / c
    offset = np.float32(zero_point) - np.float32(a_zp) * ka - np.float32(b_zp) * kb
    if _shape_of(em, a, shapes) == _shape_of(em, b, shapes) == tuple(out_shape):
        pa, pb = _pointer(em, a), _pointer(em, b)
        y = _output_value(em, step, node.outputs[0], out_shape, y_dtype)
        return [f"cr_qlinear_add_flat({pa}, {a_signed}, {pb}, {b_signed}, {_f(ka)}, {_f(kb)}, {_f(offset)}, "
                f"{y.pointer}, {int(y_dtype == 'int8')}, {em.c_dim(_elements(out_shape))});"]
    lines = _broadcast_lines(em, [a, b], ["sa", "sb"], shapes, out_shape)
    pa, pb = _pointer(em, a), _pointer(em, b)
    y = _output_value(em, step, node.outputs[0], out_shape, y_dtype)
    return lines + [f"cr_qlinear_add({pa}, {a_signed}, sa, {pb}, {b_signed}, sb, {_f(ka)}, {_f(kb)}, {_f(offset)}, "
                    f"{y.pointer}, {int(y_dtype == 'int8')}, shape);"]


def _emit_qmaxpool(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    signed = _require_8bit(em, x)
    if len(node.outputs) > 1 and any(node.outputs[1:]) or node.attrs.get("storage_order", 0):
        raise _Unsupported("MaxPool's Indices output")
    x_shape = shapes[x]
    spatial, kernel, strides, dilations, pads = _pool_geometry(node, x_shape)
    y = _output_value(em, step, node.outputs[0], out_shape, em.values[x].dtype)
    h, wd = _hw(x_shape, spatial)
    oh, ow = _hw(out_shape, spatial)
    dims = [em.c_dim(symbolic.mul(x_shape[0], x_shape[1])), *(em.c_dim(d) for d in (h, wd, oh, ow))]
    return [f"cr_qmaxpool2d({_pointer(em, x)}, {signed}, {y.pointer}, {', '.join(dims)},",
            f"              {', '.join(map(str, (*kernel, *strides, *dilations, pads[0], pads[1])))});"]


#: carrack_quant.h's CR_QNB: output pixels per packed activation block
QUANT_PIXEL_BLOCK = 32
_QUANT_EMITTERS = {("carrack", "QLinearConvExact"): _emit_qconv, ("carrack", "QLinearMatMulExact"): _emit_qmatmul,
                   ("com.microsoft", "QLinearAdd"): _emit_qlinear_add,
                   **{(d, "QuantizeLinear"): _emit_quantize for d in ("", "com.microsoft")},
                   **{(d, "DequantizeLinear"): _emit_dequantize for d in ("", "com.microsoft")}}
ANY_TYPE_EMITTERS = {*_QUANT_EMITTERS.values(), _emit_qmaxpool}
#: the ops these emitters compile (for supported_operators)
OPERATORS = sorted({op if d == "" else f"{d}:{op}" for d, op in _QUANT_EMITTERS})


def emitter_for(em: _Emitter, node: Node, facts):
    """The emitter of carrack_quant.h's kernels for this node, where it has one (MaxPool only on 8-bit values)."""
    quantized = _QUANT_EMITTERS.get((node.domain or "", node.op_type))
    if quantized is not None:
        return quantized
    if node.op_type == "MaxPool" and (node.domain or "") in ("", "ai.onnx") \
            and _dtype(em, node.inputs[0], facts) in ("uint8", "int8"):
        return _emit_qmaxpool
    return None
