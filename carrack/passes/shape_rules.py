"""Shape rules, grouped by how an operator computes its output shape (many ops share one rule).

Each rule takes the node, its input facts and its schema version, and returns output facts. Rules only state what
they can prove; anything else is left as an unknown `Fact()`.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from carrack.ir.symbolic import DimLike, add, ceildiv, dmax, dmin, floordiv, mul, nonnegative
from carrack.passes.facts import Fact, dims_array, tensor_fact
from carrack.passes.shape_inference import rule

INT64 = TensorProto.INT64
BOOL = TensorProto.BOOL


def _prod(dims) -> DimLike:
    total: DimLike = 1
    for d in dims:
        total = mul(total, d)
    return total


def _axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"axis {axis} out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


# -- elementwise ---------------------------------------------------------------------------------------------------

def broadcast_shapes(*shapes) -> tuple[DimLike, ...] | None:
    if any(s is None for s in shapes):
        return None
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(rank):
        dims = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
        out.append(_broadcast_dim(dims))
    return tuple(out)


def _broadcast_dim(dims: list[DimLike]) -> DimLike:
    known = [d for d in dims if d != 1]
    if not known:
        return 1
    if any(isinstance(d, int) for d in known):
        return next(d for d in known if isinstance(d, int))
    if any(d is None for d in known):
        return None
    distinct = list(dict.fromkeys(known))
    # for a valid broadcast every dim is 1 or the result, so the max is the result (symbols are >= 1 here)
    return distinct[0] if len(distinct) == 1 else dmax(*distinct)


_UNARY = ("Abs Acos Acosh Asin Asinh Atan Atanh Ceil Celu Cos Cosh Elu Erf Exp Floor Gelu HardSigmoid HardSwish "
          "Identity LeakyRelu Log LogSoftmax Softmax Hardmax Mish Neg Reciprocal Relu Round Selu Shrink Sigmoid "
          "Sign Sin Sinh Softplus Softsign Sqrt Tan Tanh ThresholdedRelu Swish Clip BitwiseNot CumSum CumProd "
          "LRN InstanceNormalization MeanVarianceNormalization LpNormalization Trilu").split()


@rule(*_UNARY)
def same_as_first(node, ins, version):
    x = ins[0]
    value = x.value if node.op_type == "Identity" else None
    return [tensor_fact(x.elem_type, x.shape, value)]


@rule("Not")
def not_rule(node, ins, version):
    return [tensor_fact(BOOL, ins[0].shape)]


@rule("IsNaN", "IsInf")
def predicate_rule(node, ins, version):
    return [tensor_fact(BOOL, ins[0].shape)]


_ARITH = {"Add": add, "Sub": lambda a, b: add(a, mul(b, -1)), "Mul": mul}


@rule("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "PRelu", "BitShift", "BitwiseAnd",
      "BitwiseOr", "BitwiseXor")
def broadcast_arith(node, ins, version):
    shape = broadcast_shapes(*(f.shape for f in ins))
    return [tensor_fact(ins[0].elem_type, shape, _symbolic_arith(node.op_type, ins, shape))]


def _symbolic_arith(op: str, ins: list[Fact], shape) -> np.ndarray | None:
    """Shape arithmetic on symbolic contents, e.g. Mul(Gather(Shape(x), 0), 4)."""
    if op not in ("Add", "Sub", "Mul", "Div") or len(ins) != 2 or shape is None or len(shape) > 1:
        return None
    if ins[0].elem_type != INT64 or ins[0].value is None or ins[1].value is None:
        return None
    a, b = (np.broadcast_to(f.value, tuple(shape)) for f in ins)
    if op == "Div":
        fn = floordiv  # shape values are non-negative, where truncation and floor agree
    else:
        fn = _ARITH[op]
    out = [fn(_dim(x), _dim(y)) for x, y in zip(a.reshape(-1), b.reshape(-1))]
    return dims_array(out).reshape(shape)


def _dim(v) -> DimLike:
    return int(v) if isinstance(v, (int, np.integer)) else v


@rule("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor")
def compare_rule(node, ins, version):
    shape = broadcast_shapes(*(f.shape for f in ins))
    value = _symbolic_equal(ins, shape) if node.op_type == "Equal" else None
    return [tensor_fact(BOOL, shape, value)]


def _symbolic_equal(ins: list[Fact], shape) -> np.ndarray | None:
    """Equal on shape contents where it is decided for every size: a size (never negative) against a negative
    constant (exporters test shapes for -1 before Expand), or a dim against itself."""
    if len(ins) != 2 or shape is None or len(shape) > 1 or ins[0].value is None or ins[1].value is None:
        return None
    a, b = (np.broadcast_to(f.value, tuple(shape)).reshape(-1) for f in ins)
    out = []
    for x, y in zip(a, b):
        x, y = _dim(x), _dim(y)
        if isinstance(x, int) and isinstance(y, int) or x == y:
            out.append(x == y)
        elif (isinstance(y, int) and y < 0 and nonnegative(x)) or (isinstance(x, int) and x < 0 and nonnegative(y)):
            out.append(False)
        else:
            return None
    return np.array(out, dtype=bool).reshape(shape)


@rule("Where")
def where_rule(node, ins, version):
    shape = broadcast_shapes(*(f.shape for f in ins))
    return [tensor_fact(ins[1].elem_type or ins[2].elem_type, shape, _symbolic_where(ins, shape))]


def _symbolic_where(ins: list[Fact], shape) -> np.ndarray | None:
    """Where with a known condition over shape contents: each element picked from the known side."""
    if len(ins) != 3 or shape is None or len(shape) > 1 or any(f.value is None for f in ins):
        return None
    if not ins[0].is_concrete() or not (ins[1].value.dtype == object or ins[2].value.dtype == object):
        return None
    cond, x, y = (np.broadcast_to(f.value, tuple(shape)).reshape(-1) for f in ins)
    return dims_array([_dim(a) if c else _dim(b) for c, a, b in zip(cond, x, y)]).reshape(shape)


@rule("Cast")
def cast_rule(node, ins, version):
    to = node.attrs.get("to", 0)
    value = ins[0].value if ins[0].value is not None and ins[0].value.dtype == object and to == INT64 else None
    return [tensor_fact(to, ins[0].shape, value)]


@rule("CastLike")
def castlike_rule(node, ins, version):
    return [tensor_fact(ins[1].elem_type, ins[0].shape)]


@rule("Dropout")
def dropout_rule(node, ins, version):
    x = ins[0]
    return [tensor_fact(x.elem_type, x.shape), tensor_fact(BOOL, x.shape)]


@rule("FusedBatchNormalization", domain="carrack")
@rule("BatchNormalization", "LayerNormalization", "GroupNormalization", "RMSNormalization")
def norm_rule(node, ins, version):
    return [tensor_fact(ins[0].elem_type, ins[0].shape)]


# -- shape arithmetic ------------------------------------------------------------------------------------------------

@rule("Shape")
def shape_rule(node, ins, version):
    shape = ins[0].shape
    if shape is None:
        return [tensor_fact(INT64, (None,))]
    rank = len(shape)
    start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    dims = list(shape[start:end]) if end > start else []
    if any(d is None for d in dims):
        return [tensor_fact(INT64, (len(dims),))]
    return [tensor_fact(INT64, (len(dims),), dims_array(dims))]


@rule("Size")
def size_rule(node, ins, version):
    shape = ins[0].shape
    value = None
    if shape is not None and all(d is not None for d in shape):
        value = dims_array([_prod(shape)]).reshape(())
    return [tensor_fact(INT64, (), value)]


@rule("Gather")
def gather_rule(node, ins, version):
    data, idx = ins[0], ins[1]
    if data.shape is None or idx.shape is None:
        return [tensor_fact(data.elem_type, None)]
    axis = _axis(node.attrs.get("axis", 0), len(data.shape))
    shape = data.shape[:axis] + idx.shape + data.shape[axis + 1:]
    value = None
    if data.value is not None and idx.is_concrete() and data.value.ndim == 1:
        n = data.value.shape[0]
        value = data.value[np.where(idx.value < 0, idx.value + n, idx.value)]
    return [tensor_fact(data.elem_type, shape, value)]


@rule("Concat")
def concat_rule(node, ins, version):
    shapes = [f.shape for f in ins]
    if any(s is None for s in shapes):
        return [tensor_fact(ins[0].elem_type, None)]
    axis = _axis(node.attrs.get("axis", 0), len(shapes[0]))
    total: DimLike = 0
    for s in shapes:
        total = add(total, s[axis]) if s[axis] is not None and total is not None else None
    shape = tuple(shapes[0][:axis]) + (total,) + tuple(shapes[0][axis + 1:])
    value = None
    if all(f.value is not None for f in ins) and len(shapes[0]) == 1:
        value = dims_array([d for f in ins for d in f.dims_value()])
    return [tensor_fact(ins[0].elem_type, shape, value)]


def _axes_input(node, ins, version, since: int) -> list[int] | None:
    if version >= since and len(ins) > 1 and node.inputs[1]:
        return None if not ins[1].is_concrete() else [int(a) for a in ins[1].value.reshape(-1)]
    return node.attrs.get("axes")


@rule("Unsqueeze")
def unsqueeze_rule(node, ins, version):
    x = ins[0]
    axes = _axes_input(node, ins, version, 13)
    if x.shape is None or axes is None:
        return [tensor_fact(x.elem_type, None)]
    rank = len(x.shape) + len(axes)
    axes = sorted(_axis(a, rank) for a in axes)
    dims = list(x.shape)
    for a in axes:
        dims.insert(a, 1)
    value = x.value.reshape(dims) if x.value is not None else None
    return [tensor_fact(x.elem_type, tuple(dims), value)]


@rule("Squeeze")
def squeeze_rule(node, ins, version):
    x = ins[0]
    axes = _axes_input(node, ins, version, 13)
    if x.shape is None:
        return [tensor_fact(x.elem_type, None)]
    if axes is None:
        if (len(ins) > 1 and node.inputs[1]) or any(not isinstance(d, int) for d in x.shape):
            return [tensor_fact(x.elem_type, None)]
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = {_axis(a, len(x.shape)) for a in axes}
    dims = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    value = x.value.reshape(dims) if x.value is not None else None
    return [tensor_fact(x.elem_type, dims, value)]


@rule("Split")
def split_rule(node, ins, version):
    """Split along `axis` by the `split` sizes (attribute before 13, input after) or into equal parts."""
    x, n = ins[0], len(node.outputs)
    if x.shape is None:
        return [tensor_fact(x.elem_type, None)] * n
    axis = _axis(node.attrs.get("axis", 0), len(x.shape))
    if version >= 13 and len(ins) > 1 and node.inputs[1]:
        sizes = [int(s) for s in ins[1].value.reshape(-1)] if ins[1].is_concrete() else None
    else:
        sizes = node.attrs.get("split")
    dim = x.shape[axis]
    if sizes is None and isinstance(dim, int):
        part = -(-dim // n) if version >= 18 else dim // n  # 18+: the last part may be smaller
        sizes = [min(part, dim - i * part) for i in range(n)]
    if sizes is None or len(sizes) != n:
        return [tensor_fact(x.elem_type, None)] * n
    return [tensor_fact(x.elem_type, x.shape[:axis] + (s,) + x.shape[axis + 1:]) for s in sizes]


@rule("Reshape")
def reshape_rule(node, ins, version):
    x = ins[0]
    target = ins[1].dims_value() if version >= 5 else node.attrs.get("shape")
    if target is None:
        n = ins[1].shape[0] if version >= 5 and ins[1].shape else None
        return [tensor_fact(x.elem_type, None if not isinstance(n, int) else (None,) * n)]
    allowzero = node.attrs.get("allowzero", 0)
    dims: list[DimLike] = []
    for i, d in enumerate(target):
        if isinstance(d, int) and d == 0 and not allowzero:
            d = x.shape[i] if x.shape is not None and i < len(x.shape) else None
        dims.append(d)
    if -1 in dims:
        i = dims.index(-1)
        known = [d for j, d in enumerate(dims) if j != i]
        if x.shape is not None and all(d is not None for d in list(x.shape) + known):
            dims[i] = floordiv(_prod(x.shape), _prod(known))
        else:
            dims[i] = None
    value = x.value.reshape([int(d) for d in dims]) if x.value is not None and all(
        isinstance(d, int) for d in dims) else None
    return [tensor_fact(x.elem_type, tuple(dims), value)]


@rule("Flatten")
def flatten_rule(node, ins, version):
    x = ins[0]
    if x.shape is None or any(d is None for d in x.shape):
        return [tensor_fact(x.elem_type, (None, None))]
    rank = len(x.shape)
    axis = node.attrs.get("axis", 1)
    axis = axis + rank if axis < 0 else axis  # Flatten's axis lies in [-rank, rank]
    if not 0 <= axis <= rank:
        raise ValueError(f"Flatten axis {node.attrs.get('axis')} out of range for rank {rank}")
    return [tensor_fact(x.elem_type, (_prod(x.shape[:axis]), _prod(x.shape[axis:])))]


@rule("Expand")
def expand_rule(node, ins, version):
    x, target = ins[0], ins[1].dims_value()
    if target is None:
        return [tensor_fact(x.elem_type, None)]
    return [tensor_fact(x.elem_type, broadcast_shapes(x.shape, tuple(target)))]


@rule("ConstantOfShape")
def constant_of_shape_rule(node, ins, version):
    value = node.attrs.get("value")
    elem = TensorProto.FLOAT
    if isinstance(value, np.ndarray):
        from carrack.ir.dtypes import to_onnx

        elem = to_onnx(value.dtype)
    dims = ins[0].dims_value()
    if dims is None:
        n = ins[0].shape[0] if ins[0].shape else None
        return [tensor_fact(elem, None if not isinstance(n, int) else (None,) * n)]
    return [tensor_fact(elem, tuple(dims))]


@rule("Transpose")
def transpose_rule(node, ins, version):
    x = ins[0]
    if x.shape is None:
        return [tensor_fact(x.elem_type, None)]
    perm = node.attrs.get("perm") or list(range(len(x.shape)))[::-1]
    return [tensor_fact(x.elem_type, tuple(x.shape[p] for p in perm))]


@rule("Slice")
def slice_rule(node, ins, version):
    x = ins[0]
    if x.shape is None:
        return [tensor_fact(x.elem_type, None)]
    if version < 10:
        starts, ends, axes, steps = (node.attrs.get("starts"), node.attrs.get("ends"), node.attrs.get("axes"), None)
    else:
        def val(i):
            if len(ins) <= i or not node.inputs[i]:
                return []
            return ins[i].dims_value()
        starts, ends, axes, steps = val(1), val(2), val(3), val(4)
    if starts is None or ends is None or axes is None or steps is None:
        return [tensor_fact(x.elem_type, (None,) * len(x.shape))]
    axes = axes or list(range(len(starts)))
    steps = steps or [1] * len(starts)
    dims = list(x.shape)
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = _axis(a, len(dims))
        d = dims[a]
        dims[a] = _slice_len(d, s, e, st)
    value = None
    if x.value is not None and x.value.ndim == 1 and len(axes) == 1 and all(
            isinstance(v, int) for v in (starts[0], ends[0], steps[0])):
        value = x.value[slice(starts[0], ends[0], steps[0])]
    return [tensor_fact(x.elem_type, tuple(dims), value)]


def _slice_len(d: DimLike, start: DimLike, end: DimLike, step: DimLike) -> DimLike:
    if not isinstance(start, int) or not isinstance(step, int):
        return None
    if not isinstance(end, int):  # a symbolic end (a size read from another tensor), slicing from 0
        return (end if end == d else dmin(end, d)) if start == 0 and step == 1 and d is not None else None
    if isinstance(d, int):
        return len(range(*slice(start, end, step).indices(d)))
    big = 2**62
    if step == 1 and start >= 0 and end >= big:
        return add(d, -start) if start else d
    if step == 1 and start >= 0 and 0 <= end < big:
        return None if start > 0 else None
    if step == 1 and start < 0 and end >= big:
        return -start  # the last |start| elements (assuming the dim is at least that long)
    return None


@rule("Range")
def range_rule(node, ins, version):
    vals = [f.dims_value() for f in ins]
    if all(v is not None for v in vals):
        start, limit, delta = (v[0] for v in vals)
        if start == 0 and delta == 1:
            return [tensor_fact(ins[0].elem_type, (limit,))]
    return [tensor_fact(ins[0].elem_type, (None,))]


# -- linear algebra --------------------------------------------------------------------------------------------------

@rule("FusedMatMul", domain="carrack")
@rule("MatMul", "MatMulInteger")
def matmul_rule(node, ins, version):
    a, b = ins[0].shape, ins[1].shape
    elem = TensorProto.INT32 if node.op_type == "MatMulInteger" else ins[0].elem_type
    if a is None or b is None or not a or not b:
        return [tensor_fact(elem, None)]
    a2 = (1,) + tuple(a) if len(a) == 1 else tuple(a)
    b2 = tuple(b) + (1,) if len(b) == 1 else tuple(b)
    batch = broadcast_shapes(a2[:-2], b2[:-2])
    shape = tuple(batch) + (a2[-2], b2[-1])
    if len(a) == 1:
        shape = shape[:-2] + shape[-1:]
    if len(b) == 1:
        shape = shape[:-1]
    return [tensor_fact(elem, shape)]


@rule("FusedGemm", domain="com.microsoft")
@rule("FusedGemm", domain="carrack")
@rule("Gemm")
def gemm_rule(node, ins, version):
    a, b = ins[0].shape, ins[1].shape
    if a is None or b is None:
        return [tensor_fact(ins[0].elem_type, (None, None))]
    m = a[1] if node.attrs.get("transA", 0) else a[0]
    n = b[0] if node.attrs.get("transB", 0) else b[1]
    return [tensor_fact(ins[0].elem_type, (m, n))]


# -- windows: conv and pooling -----------------------------------------------------------------------------------------

def window_dims(node, spatial, kernel) -> list[DimLike]:
    n = len(spatial)
    strides = node.attrs.get("strides") or [1] * n
    dilations = node.attrs.get("dilations") or [1] * n
    pads = node.attrs.get("pads") or [0] * (2 * n)
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    ceil_mode = node.attrs.get("ceil_mode", 0)
    out = []
    for i, d in enumerate(spatial):
        if d is None:
            out.append(None)
        elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out.append(ceildiv(d, strides[i]))
        else:
            p = 0 if auto_pad == "VALID" else pads[i] + pads[i + n]
            span = add(d, p - dilations[i] * (kernel[i] - 1) - 1)
            q = ceildiv(span, strides[i]) if ceil_mode else floordiv(span, strides[i])
            out.append(add(q, 1))
    return out


@rule("FusedConv", domain="com.microsoft")
@rule("FusedConv", domain="carrack")
@rule("Conv", "ConvInteger")
def conv_rule(node, ins, version):
    x, w = ins[0].shape, ins[1].shape
    elem = TensorProto.INT32 if node.op_type == "ConvInteger" else ins[0].elem_type
    if x is None or w is None:
        return [tensor_fact(elem, None)]
    kernel = node.attrs.get("kernel_shape") or list(w[2:])
    if any(not isinstance(k, int) for k in kernel):
        return [tensor_fact(elem, (x[0], w[0]) + (None,) * (len(x) - 2))]
    shape = (x[0], w[0], *window_dims(node, x[2:], kernel))
    if len(ins) > 3 and ins[3] is not None and node.inputs[3]:  # FusedConv's residual Z: added, with broadcasting
        shape = broadcast_shapes(shape, ins[3].shape) if ins[3].shape is not None else None
    return [tensor_fact(elem, shape)]


@rule("MaxPool", "AveragePool", "LpPool")
def pool_rule(node, ins, version):
    x = ins[0].shape
    if x is None:
        return [tensor_fact(ins[0].elem_type, None)]
    shape = (x[0], x[1], *window_dims(node, x[2:], node.attrs.get("kernel_shape")))
    return [tensor_fact(ins[0].elem_type, shape), tensor_fact(INT64, shape)]


@rule("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def global_pool_rule(node, ins, version):
    x = ins[0].shape
    if x is None:
        return [tensor_fact(ins[0].elem_type, None)]
    return [tensor_fact(ins[0].elem_type, (x[0], x[1]) + (1,) * (len(x) - 2))]


# -- reductions ------------------------------------------------------------------------------------------------------

_AXES_INPUT_SINCE = {"ReduceSum": 13}


@rule("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
      "ReduceLogSumExp", "ReduceSumSquare")
def reduce_rule(node, ins, version):
    x = ins[0]
    if x.shape is None:
        return [tensor_fact(x.elem_type, None)]
    axes = _axes_input(node, ins, version, _AXES_INPUT_SINCE.get(node.op_type, 18))
    keep = node.attrs.get("keepdims", 1)
    if axes is None and len(ins) > 1 and node.inputs[1]:
        return [tensor_fact(x.elem_type, None if not keep else (None,) * len(x.shape))]
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            return [tensor_fact(x.elem_type, x.shape)]
        axes = list(range(len(x.shape)))
    axes = {_axis(a, len(x.shape)) for a in axes}
    dims = tuple((1 if i in axes else d) for i, d in enumerate(x.shape) if keep or i not in axes)
    return [tensor_fact(x.elem_type, dims)]


@rule("ArgMax", "ArgMin")
def arg_rule(node, ins, version):
    x = ins[0]
    if x.shape is None:
        return [tensor_fact(INT64, None)]
    axis = _axis(node.attrs.get("axis", 0), len(x.shape))
    keep = node.attrs.get("keepdims", 1)
    dims = tuple((1 if i == axis else d) for i, d in enumerate(x.shape) if keep or i != axis)
    return [tensor_fact(INT64, dims)]


@rule("DynamicQuantizeLinear")
def dynamic_quantize_rule(node, ins, version):
    return [tensor_fact(TensorProto.UINT8, ins[0].shape), tensor_fact(TensorProto.FLOAT, ()),
            tensor_fact(TensorProto.UINT8, ())]


@rule("GatherND")
def gather_nd_rule(node, ins, version):
    data, idx = ins[0].shape, ins[1].shape
    b = node.attrs.get("batch_dims", 0)
    if data is None or idx is None or not idx or not isinstance(idx[-1], int):
        return [tensor_fact(ins[0].elem_type, None)]
    return [tensor_fact(ins[0].elem_type, tuple(idx[:-1]) + tuple(data[b + idx[-1]:]))]


@rule("GatherElements")
def gather_elements_rule(node, ins, version):
    return [tensor_fact(ins[0].elem_type, ins[1].shape)]


@rule("Tile")
def tile_rule(node, ins, version):
    x, reps = ins[0].shape, ins[1].dims_value()
    if x is None or reps is None or len(reps) != len(x):
        return [tensor_fact(ins[0].elem_type, None if x is None else (None,) * len(x))]
    return [tensor_fact(ins[0].elem_type, tuple(mul(d, r) for d, r in zip(x, reps)))]


@rule("InvertedResidual", domain="carrack")
def inverted_residual_rule(node, ins, version):
    """[N, C, H, W] -> [N, projection channels, ceil(H / stride), ceil(W / stride)] (pads 1, a 3x3 window)."""
    x, w_project = ins[0].shape, ins[5].shape
    if x is None or len(x) != 4:
        return [tensor_fact(ins[0].elem_type, None)]
    stride = int(node.attrs.get("stride", 1))
    out_channels = w_project[0] if w_project is not None else None
    spatial = [add(floordiv(add(d, -1), stride), 1) for d in x[2:]]
    return [tensor_fact(ins[0].elem_type, (x[0], out_channels, *spatial))]
