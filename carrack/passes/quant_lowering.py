"""Quantized-model lowering: QDQ groups and dynamic-quantization chains become single integer kernels.

* DequantizeLinear(x) -> Conv/MatMul/Gemm(DequantizeLinear(const w), bias) -> QuantizeLinear becomes one
  carrack QLinearConvExact / QLinearMatMulExact node: the weight is shifted by its zero point and converted to
  float32 once, the bias folded into the accumulator, and x_scale * w_scale / y_scale precomputed.
* DequantizeLinear(a), DequantizeLinear(b) -> Add -> QuantizeLinear becomes com.microsoft QLinearAdd;
  DequantizeLinear -> MaxPool -> QuantizeLinear with equal parameters becomes MaxPool on the integers.
* DynamicQuantizeLinear -> MatMulInteger(const w) -> Cast -> Mul(x_scale * w_scale) [-> Add(const bias)] becomes
  one carrack DynamicQuantizedMatMul whose weight is pre-shifted and converted once.
* What remains of DequantizeLinear(const weight) feeding a float Conv/MatMul/Gemm is folded into a float weight,
  whatever its size (constant folding caps its output size).

Integer GEMMs stay exact: `k_splits` (computed here from the actual weight) cut K so that the sum of |products| of
each float32 GEMM stays within 2**24 for any activation of the input type (see carrack/ops/quant.py).
These rules run first in the pipeline (carrack.passes.optimizer.PIPELINE), so they see the quantized weights before
constant folding dequantizes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from carrack.ir.graph import Node
from carrack.ops import quant
from carrack.passes import shape_rules
from carrack.passes.facts import Fact, tensor_fact
from carrack.passes.graph_view import GraphView
from carrack.passes.rewrite import BASIC, EXTENDED, Context, RuleSet
from carrack.passes.shape_inference import rule

MS = "com.microsoft"
CARRACK = "carrack"
_QUANTIZED = (np.dtype(np.uint8), np.dtype(np.int8))
RULES = RuleSet("quantized")
_rule = RULES.rewrite


@dataclass
class Dequantized:
    """A DequantizeLinear with constant parameters: the integer input, its scale and zero point."""

    node: Node
    source: str
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int
    value: np.ndarray | None  # the integer input when it is constant


def _dequantized(view: GraphView, name: str) -> Dequantized | None:
    node = view.producer.get(name)
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", MS):
        return None
    if node.attrs.get("block_size", 0) or len(node.inputs) < 2:
        return None
    scale = view.const(node.inputs[1])
    zp_name = node.inputs[2] if len(node.inputs) > 2 else ""
    zero_point = view.const(zp_name) if zp_name else None
    if scale is None or scale.dtype != np.float32 or (zp_name and zero_point is None):
        return None
    value = view.const(node.inputs[0])
    dtype = zero_point.dtype if zero_point is not None else (value.dtype if value is not None else None)
    if dtype is None:
        return None
    if zero_point is None:
        zero_point = np.zeros(scale.shape, dtype)
    return Dequantized(node, node.inputs[0], scale, zero_point, int(node.attrs.get("axis", 1)), value)


def _quantize_after(view: GraphView, name: str) -> Node | None:
    """The per-tensor 8-bit QuantizeLinear that alone reads `name`."""
    q = view.single_consumer(name)
    if q is None or q.op_type != "QuantizeLinear" or q.domain not in ("", MS) or q.inputs[0] != name:
        return None
    if len(q.inputs) < 3 or not q.inputs[2]:
        return None
    scale, zero_point = view.const(q.inputs[1]), view.const(q.inputs[2])
    if scale is None or zero_point is None or scale.size != 1 or zero_point.size != 1:
        return None
    return q if zero_point.dtype in _QUANTIZED and scale.dtype == np.float32 else None


def compact_weight(shifted: np.ndarray) -> np.ndarray:
    """The zero-point-shifted weight as the lowered kernels keep it: int8 when every value fits (a quarter of the
    float32 bytes; the native GEMM packs it, the numpy path widens it once), else float32 integers."""
    if shifted.size and -128 <= shifted.min() and shifted.max() <= 127:
        return np.ascontiguousarray(shifted, np.int8)
    return np.ascontiguousarray(shifted, np.float32)


def k_splits(weight_abs_rows: np.ndarray, activation_bound: int, limit: int = quant.FLOAT32_EXACT) -> list[int] | None:
    """Chunk ends along K such that activation_bound * sum_{k in chunk} |w[k, n]| <= limit for every column n.

    `weight_abs_rows` is |w| shaped [K, N] (for convolutions K counts input channels, each row summing its taps).
    None when a single row already exceeds the limit.
    """
    ends: list[int] = []
    running = np.zeros(weight_abs_rows.shape[1], np.float64)
    budget = limit / max(activation_bound, 1)
    for k, row in enumerate(weight_abs_rows):
        if row.max(initial=0) > budget:
            return None
        if (running + row).max(initial=0) > budget:
            ends.append(k)
            running = row.astype(np.float64)
        else:
            running = running + row
    ends.append(len(weight_abs_rows))
    return ends


def _bias_of(view: GraphView, name: str, x: Dequantized, w_scale: np.ndarray) -> np.ndarray | None:
    """An int32 bias (DequantizeLinear with scale x_scale * w_scale) as exact float64 integers."""
    dq = _dequantized(view, name)
    if dq is None or dq.value is None or dq.value.dtype != np.int32 or np.any(dq.zero_point):
        return None
    expected = (np.float32(x.scale.reshape(())) * w_scale).astype(np.float32).reshape(-1)
    if not np.allclose(dq.scale.reshape(-1), expected, rtol=1e-6, atol=0):
        return None
    return dq.value.astype(np.float64).reshape(-1)


def _per_channel(p: np.ndarray, channels: int) -> np.ndarray | None:
    p = np.asarray(p).reshape(-1)
    if p.size == 1:
        return np.full(channels, p[0], p.dtype)
    return p if p.size == channels else None


# -- QDQ Conv / MatMul / Gemm -> one integer kernel ------------------------------------------------------------------
@_rule("qdq_to_integer_kernel", "Conv", "MatMul", "Gemm", level=EXTENDED)
def lower_qdq_linear(node: Node, view: GraphView, ctx: Context) -> bool:
    if node.domain or len(node.inputs) < 2:
        return False
    q = _quantize_after(view, node.outputs[0])
    x = _dequantized(view, node.inputs[0])
    w = _dequantized(view, node.inputs[1])
    if q is None or x is None or w is None or w.value is None or x.scale.size != 1 or x.zero_point.size != 1:
        return False
    if x.zero_point.dtype not in _QUANTIZED or w.value.dtype not in _QUANTIZED:
        return False
    weight = w.value
    if node.op_type == "Gemm":
        if node.attrs.get("transA", 0) or node.attrs.get("alpha", 1.0) != 1.0 or node.attrs.get("beta", 1.0) != 1.0:
            return False
        trans_b = bool(node.attrs.get("transB", 0))
        channel_axis = 0 if trans_b else 1
    else:
        trans_b = False
        channel_axis = 0 if node.op_type == "Conv" else 1
    if weight.ndim != (2 if node.op_type != "Conv" else weight.ndim) or weight.ndim < 2:
        return False
    channels = weight.shape[channel_axis]
    if w.scale.size > 1 and (w.axis % weight.ndim) != channel_axis:
        return False
    w_scale = _per_channel(w.scale, channels)
    w_zero = _per_channel(w.zero_point, channels)
    if w_scale is None or w_zero is None:
        return False
    bias = None
    if len(node.inputs) > 2 and node.inputs[2]:
        bias = _bias_of(view, node.inputs[2], x, w_scale)
        if bias is None or bias.size != channels:
            return False
    shape = [1] * weight.ndim
    shape[channel_axis] = channels
    shifted = weight.astype(np.float32) - w_zero.astype(np.float32).reshape(shape)
    if node.op_type != "Conv" and trans_b:
        shifted = shifted.T
    x_bound = quant.shifted_magnitude(x.zero_point.dtype, x.zero_point)
    splits = _splits_for(node, shifted, x_bound)
    if splits is None:
        return False
    total = x_bound * _max_column_l1(node, shifted) + (np.abs(bias).max() if bias is not None else 0)
    if total >= 2**31:  # an int32 accumulator could wrap: leave it to the reference kernels
        return False
    y_scale = np.float32(view.const(q.inputs[1]).reshape(()))
    multiplier = (np.float32(x.scale.reshape(())) * w_scale.astype(np.float32) / y_scale).astype(np.float32)
    inputs = [x.source,
              view.add_initializer(node.name or "w", compact_weight(shifted)),
              view.add_initializer((node.name or "w") + "_bias", bias if bias is not None else np.zeros(channels)),
              view.add_initializer((node.name or "w") + "_multiplier", multiplier),
              q.inputs[2]]
    attrs = {"x_zero_point": int(x.zero_point.reshape(())), "k_splits": splits,
             "float32_accumulator": int(total <= quant.FLOAT32_EXACT)}
    if node.op_type == "Conv":
        attrs.update({k: v for k, v in node.attrs.items() if k in ("auto_pad", "pads", "strides", "dilations", "group",
                                                                    "kernel_shape")})
        op = "QLinearConvExact"
    else:
        op = "QLinearMatMulExact"
    fused = Node(op, inputs, [q.outputs[0]], attrs, domain=CARRACK, name=node.name)
    view.replace([node, q], [fused])
    return True


def _abs_rows(node: Node, shifted: np.ndarray) -> np.ndarray | None:
    """|w| as [K, N] rows to split on: MatMul's [K, N]; Conv's input channels (summing taps) by output channels."""
    if node.op_type != "Conv":
        return np.abs(shifted)
    group = int(node.attrs.get("group", 1))
    per_channel = np.abs(shifted).reshape(shifted.shape[0], shifted.shape[1], -1).sum(axis=2)  # [M, C/group]
    if group == 1:
        return per_channel.T
    return None


def _max_column_l1(node: Node, shifted: np.ndarray) -> float:
    if node.op_type != "Conv":
        return float(np.abs(shifted).sum(axis=0).max(initial=0))
    return float(np.abs(shifted).reshape(shifted.shape[0], -1).sum(axis=1).max(initial=0))


def _splits_for(node: Node, shifted: np.ndarray, x_bound: int) -> list[int] | None:
    rows = _abs_rows(node, shifted)
    if rows is None:  # grouped convolution: each group's whole window must fit one float32 GEMM
        return [shifted.shape[1]] if x_bound * _max_column_l1(node, shifted) <= quant.FLOAT32_EXACT else None
    return k_splits(rows, x_bound)


# -- elementwise QDQ groups ------------------------------------------------------------------------------------------
@_rule("qdq_add_to_qlinear_add", "Add", level=EXTENDED)
def lower_qdq_add(node: Node, view: GraphView, ctx: Context) -> bool:
    if node.domain:
        return False
    q = _quantize_after(view, node.outputs[0])
    a, b = _dequantized(view, node.inputs[0]), _dequantized(view, node.inputs[1])
    if q is None or a is None or b is None:
        return False
    if a.scale.size != 1 or b.scale.size != 1 or a.zero_point.dtype != b.zero_point.dtype:
        return False
    if a.zero_point.dtype != view.const(q.inputs[2]).dtype or a.zero_point.dtype not in _QUANTIZED:
        return False
    inputs = [a.source, a.node.inputs[1], _zero_point_name(view, a), b.source, b.node.inputs[1],
              _zero_point_name(view, b), q.inputs[1], q.inputs[2]]
    view.replace([node, q], [Node("QLinearAdd", inputs, [q.outputs[0]], domain=MS, name=node.name)])
    return True


def _zero_point_name(view: GraphView, dq: Dequantized) -> str:
    if len(dq.node.inputs) > 2 and dq.node.inputs[2]:
        return dq.node.inputs[2]
    return view.add_initializer("zero_point", dq.zero_point.reshape(()))


@_rule("qdq_maxpool_on_integers", "MaxPool", level=EXTENDED)
def lower_qdq_maxpool(node: Node, view: GraphView, ctx: Context) -> bool:
    """max commutes with the monotone (de)quantization when both use the same scale and zero point."""
    if node.domain or len(node.outputs) > 1 and node.outputs[1]:
        return False
    q = _quantize_after(view, node.outputs[0])
    x = _dequantized(view, node.inputs[0])
    if q is None or x is None or x.scale.size != 1 or x.zero_point.size != 1:
        return False
    if not (np.array_equal(view.const(q.inputs[1]).reshape(()), x.scale.reshape(()))
            and view.const(q.inputs[2]).dtype == x.zero_point.dtype
            and np.array_equal(view.const(q.inputs[2]).reshape(()), x.zero_point.reshape(()))):
        return False
    if x.scale.reshape(())[()] <= 0:
        return False
    pooled = Node("MaxPool", [x.source], [q.outputs[0]], dict(node.attrs), name=node.name)
    view.replace([node, q], [pooled])
    return True


# -- dynamic quantization ----------------------------------------------------------------------------------------------
@_rule("dynamic_quantized_matmul", "MatMulInteger", level=EXTENDED)
def lower_dynamic_matmul(mm: Node, view: GraphView, ctx: Context) -> bool:
    """DynamicQuantizeLinear(x) -> MatMulInteger(., const w) -> Cast(float) -> Mul(x_scale * w_scale) [-> Add bias]."""
    dql = view.producer.get(mm.inputs[0])
    if mm.domain or dql is None or dql.op_type != "DynamicQuantizeLinear" or dql.domain:
        return False
    if len(mm.inputs) < 3 or mm.inputs[2] != dql.outputs[2]:
        return False
    weight = view.const(mm.inputs[1])
    w_zero = view.const(mm.inputs[3]) if len(mm.inputs) > 3 and mm.inputs[3] else np.zeros((), np.int8)
    if weight is None or w_zero is None or weight.ndim != 2 or weight.dtype not in _QUANTIZED:
        return False
    cast = view.single_consumer(mm.outputs[0])
    if cast is None or cast.op_type != "Cast" or cast.domain or cast.attrs.get("to") != 1:
        return False
    mul = view.single_consumer(cast.outputs[0])
    if mul is None or mul.op_type != "Mul" or mul.domain:
        return False
    scale_name = mul.inputs[1] if mul.inputs[0] == cast.outputs[0] else mul.inputs[0]
    w_scale = _weight_scale(view, scale_name, dql.outputs[1])
    n = weight.shape[1]
    if w_scale is None or w_scale.size not in (1, n) or w_zero.size not in (1, n):
        return False
    shifted = weight.astype(np.float32) - w_zero.astype(np.float32).reshape(-1)
    splits = k_splits(np.abs(shifted), 255)
    if splits is None or 255 * float(np.abs(shifted).sum(axis=0).max(initial=0)) >= 2**31:
        return False
    old = [mm, cast, mul]
    out = mul.outputs[0]
    bias = _following_bias(view, mul, n)
    if bias is not None:
        add, bias_value = bias
        old.append(add)
        out = add.outputs[0]
    inputs = [dql.inputs[0], view.add_initializer(mm.name or "w", compact_weight(shifted)),
              view.add_initializer((mm.name or "w") + "_scale", w_scale.astype(np.float32).reshape(-1))]
    if bias is not None:
        inputs.append(view.add_initializer((mm.name or "w") + "_bias", bias_value))
    fused = Node("DynamicQuantizedMatMul", inputs, [out], {"k_splits": splits}, domain=CARRACK, name=mm.name)
    view.replace(old, [fused])
    return True


def _weight_scale(view: GraphView, scale_name: str, x_scale_name: str) -> np.ndarray | None:
    """w_scale from Mul(x_scale, const w_scale) read only by the matched Mul."""
    node = view.producer.get(scale_name)
    if node is None or node.op_type != "Mul" or node.domain or x_scale_name not in node.inputs:
        return None
    other = node.inputs[1] if node.inputs[0] == x_scale_name else node.inputs[0]
    value = view.const(other)
    return None if value is None or value.dtype != np.float32 or value.ndim > 1 else value


def _following_bias(view: GraphView, mul: Node, n: int) -> tuple[Node, np.ndarray] | None:
    add = view.single_consumer(mul.outputs[0])
    if add is None or add.op_type != "Add" or add.domain:
        return None
    other = add.inputs[1] if add.inputs[0] == mul.outputs[0] else add.inputs[0]
    value = view.const(other)
    if value is None or value.dtype != np.float32 or value.shape != (n,):
        return None
    return add, value


# -- float kernels with a dequantized constant weight -----------------------------------------------------------------
@_rule("dequantize_constant_weight", "DequantizeLinear", level=BASIC)
def dequantize_constant_weight(node: Node, view: GraphView, ctx: Context) -> bool:
    """DequantizeLinear(const) read by float Conv/MatMul/Gemm weights: computed now, once, at any size."""
    if node.domain not in ("", MS) or not all(view.const(i) is not None for i in node.inputs if i):
        return False
    readers = view.consumers.get(node.outputs[0], [])
    if not readers or node.outputs[0] in view.outputs:
        return False
    if not all(r.op_type in ("Conv", "MatMul", "Gemm", "ConvTranspose") and not r.domain and len(r.inputs) > 1
               and r.inputs[1] == node.outputs[0] for r in readers):
        return False
    opset = node.opset or ctx.opsets.get(node.domain) or 1
    from carrack.ops import registry

    cls, version = registry.resolve(node.domain, node.op_type, opset)
    if cls is None:
        return False
    values = [view.const(i) if i else None for i in node.inputs]
    try:
        weight = cls(node, version, None).run(*values)
    except Exception:  # noqa: BLE001 - leave it to run time, where the error names the node
        return False
    view.graph.initializers[node.outputs[0]] = np.asarray(weight)
    view.remove([node])
    return True


@_rule("matmul_nbits_constant_weight", "MatMulNBits", level=BASIC)
def lower_matmul_nbits(node: Node, view: GraphView, ctx: Context) -> bool:
    """MatMulNBits with a constant packed weight becomes MatMul against the weight unpacked and dequantized now."""
    from carrack.ops.contrib_quant import dequantize_nbits

    if node.domain != MS:
        return False
    names = list(node.inputs) + [""] * (6 - len(node.inputs))
    values = {i: view.const(names[i]) for i in range(1, 5) if names[i]}
    if any(v is None for v in values.values()) or 1 not in values or 2 not in values:
        return False
    try:
        weight = dequantize_nbits(values[1], values[2], values.get(3), values.get(4), k=int(node.attrs["K"]),
                                  n=int(node.attrs["N"]), bits=int(node.attrs.get("bits", 4)),
                                  block_size=int(node.attrs["block_size"]))
    except (KeyError, ValueError):
        return False
    w_name = view.add_initializer(node.name or "nbits_weight", weight.astype(values[2].dtype))
    if not names[5]:
        view.replace([node], [Node("MatMul", [node.inputs[0], w_name], [node.outputs[0]], name=node.name)])
        return True
    product = view.fresh_name(node.outputs[0])
    view.replace([node], [Node("MatMul", [node.inputs[0], w_name], [product], name=node.name),
                          Node("Add", [product, names[5]], [node.outputs[0]], name=(node.name or "") + "_bias")])
    return True


# -- shape rules for the emitted kernels (so later fusions that infer shapes see through them) -----------------------
@rule("DynamicQuantizedMatMul", domain=CARRACK)
def _dynamic_matmul_shape(node: Node, ins: list[Fact], version: int) -> list[Fact]:
    return shape_rules.matmul_rule(node, ins, version)


@rule("QLinearMatMulExact", domain=CARRACK)
def _qlinear_matmul_shape(node: Node, ins: list[Fact], version: int) -> list[Fact]:
    fact = shape_rules.matmul_rule(node, ins, version)[0]
    return [tensor_fact(ins[4].elem_type, fact.shape)]


@rule("QLinearConvExact", domain=CARRACK)
def _qlinear_conv_shape(node: Node, ins: list[Fact], version: int) -> list[Fact]:
    fact = shape_rules.conv_rule(node, ins, version)[0]
    return [tensor_fact(ins[4].elem_type, fact.shape)]


@rule("QuantizeLinear")
@rule("QuantizeLinear", domain=MS)
def _quantize_shape(node: Node, ins: list[Fact], version: int) -> list[Fact]:
    """x's shape; the zero point's type, else output_dtype's, else uint8."""
    if len(ins) > 2 and ins[2].elem_type:
        elem_type = ins[2].elem_type
    else:
        elem_type = int(node.attrs.get("output_dtype", 0)) or 2  # TensorProto.UINT8
    return [tensor_fact(elem_type, ins[0].shape)]


@rule("DequantizeLinear")
@rule("DequantizeLinear", domain=MS)
def _dequantize_shape(node: Node, ins: list[Fact], version: int) -> list[Fact]:
    """x's shape; the scale's float type (or output_dtype)."""
    elem_type = int(node.attrs.get("output_dtype", 0)) or ins[1].elem_type
    return [tensor_fact(elem_type, ins[0].shape)]


@rule("QLinearAdd", domain=MS)
def _qlinear_add_shape(node: Node, ins: list[Fact], version: int) -> list[Fact]:
    """A and B broadcast; C's zero point type, else A's."""
    elem_type = ins[7].elem_type if len(ins) > 7 and ins[7].elem_type else ins[0].elem_type
    return [tensor_fact(elem_type, shape_rules.broadcast_shapes(ins[0].shape, ins[3].shape))]
