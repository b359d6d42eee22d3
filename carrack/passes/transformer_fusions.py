"""Transformer-block fusions: LayerNormalization, GELU, SkipLayerNorm and attention from their exported forms.

Every rule emits operators onnxruntime knows (standard ONNX ops, or its com.microsoft contrib ops), so an optimized
model written with `SessionOptions.optimized_model_filepath` still runs there. Rules that need shapes (head counts,
hidden sizes, the `1 / sqrt(d)` scale computed from a Shape chain) use `ctx.facts` when the caller computed them and
otherwise infer symbolic shapes of the values they look at, on demand (`LazyFacts`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from onnx import TensorProto

from carrack.ir import symbolic
from carrack.ir.dtypes import to_numpy
from carrack.ir.graph import Node
from carrack.ops import registry
from carrack.passes.facts import Fact, tensor_fact
from carrack.passes.graph_view import GraphView
from carrack.passes.lazy_facts import context_fact as _fact
from carrack.passes.rewrite import ALL, Context, RuleSet
from carrack.passes.shape_inference import rule
from carrack.passes.shape_rules import same_as_first

MS = "com.microsoft"
RULES = RuleSet("transformer")
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


# -- shape facts and small constants -------------------------------------------------------------------------------

def _shape(view: GraphView, ctx: Context, name: str) -> tuple | None:
    return _fact(view, ctx, name).shape


#: ops whose value the scale evaluator computes from small known inputs (Shape -> Gather -> Cast -> Sqrt chains)
_SCALAR_OPS = frozenset({"Cast", "Sqrt", "Pow", "Reciprocal", "Mul", "Div", "Add", "Sub", "Squeeze", "Unsqueeze",
                         "Gather", "Slice", "Identity", "Neg", "Reshape"})


#: ops whose output value shape inference may know although no input is a constant (sizes of activations)
_SIZE_OPS = frozenset({"Shape", "Size", "ConstantOfShape", "Range", "Concat", "Expand", "Where", "Equal", "Max",
                       "Min", "Floor", "Ceil", "ReduceProd", "Tile"})


def _value(view: GraphView, ctx: Context, name: str, depth: int = 8) -> np.ndarray | None:
    """The value of a small tensor fixed for the session: a constant, a concrete shape fact, or computed from those.
    Facts are asked only of values made from constants and sizes: asking them of an activation would infer every
    value upstream of it for nothing."""
    if not name:
        return None
    c = view.const(name)
    if c is not None:
        return c
    if not _fixed_chain(view, name, depth):
        return None
    f = _fact(view, ctx, name)
    if f.value is not None:
        if f.is_concrete():
            return f.value
        if all(isinstance(v, (int, np.integer)) for v in f.value.reshape(-1)):
            return f.value.astype(np.int64)
    node = view.producer[name]
    if node.op_type not in _SCALAR_OPS:
        return None
    values = [_value(view, ctx, i, depth - 1) if i else None for i in node.inputs]
    if any(v is None for v, i in zip(values, node.inputs) if i) or any(v.size > 64 for v in values if v is not None):
        return None
    cls, version = registry.resolve("", node.op_type, ctx.opsets.get("", registry.default_opset("")))
    if cls is None:
        return None
    try:
        with np.errstate(all="ignore"):
            out = cls(node, version, None).run(*values)
    except Exception:  # noqa: BLE001 - not evaluable here: the rule simply does not match
        return None
    out = out[node.outputs.index(name)] if type(out) is tuple else out
    return np.asarray(out)


#: ops whose output value shape inference may know although no input is a constant (sizes of activations)
_SIZE_OPS = frozenset({"Shape", "Size", "ConstantOfShape", "Range"})


def _fixed_chain(view: GraphView, name: str, depth: int) -> bool:
    """Whether `name` is made only of constants and sizes through small ops (so its value may be fixed)."""
    if view.const(name) is not None:
        return True
    node = view.producer.get(name)
    if node is None or node.domain or depth == 0:
        return False
    if node.op_type in _SIZE_OPS:
        return True
    return node.op_type in _SCALAR_OPS and all(_fixed_chain(view, i, depth - 1) for i in node.inputs if i)


def _scalar(view: GraphView, ctx: Context, name: str) -> float | None:
    v = _value(view, ctx, name)
    if v is None or v.size != 1 or v.dtype.kind not in "fiu":
        return None
    return float(v.reshape(()))


def _near(value: float | None, target: float, rel: float = 1e-3) -> bool:
    return value is not None and abs(value - target) <= rel * abs(target)


def _op(view: GraphView, name: str, *op_types: str) -> Node | None:
    """The producer of `name` if it is one of the (default-domain) op types."""
    node = view.producer.get(name)
    return node if node is not None and not node.domain and node.op_type in op_types else None


def _only_reader(view: GraphView, name: str, *op_types: str) -> Node | None:
    """The single (default-domain) node reading `name`, if it is one of the op types and `name` is no graph output."""
    node = view.single_consumer(name)
    return node if node is not None and not node.domain and node.op_type in op_types else None


def _other(node: Node, name: str) -> str:
    return node.inputs[1] if node.inputs[0] == name else node.inputs[0]


def _default_opset(ctx: Context) -> int:
    return ctx.opsets.get("", registry.default_opset(""))


# -- LayerNormalization ----------------------------------------------------------------------------------------------

def _reduce_axes(node: Node, view: GraphView, ctx: Context) -> list[int] | None:
    if node.attrs.get("keepdims", 1) != 1:
        return None
    if ctx.version(node) >= 18:
        axes = view.const(node.inputs[1]) if len(node.inputs) > 1 else None
        return None if axes is None else [int(a) for a in axes.reshape(-1)]
    axes = node.attrs.get("axes")
    return None if axes is None else [int(a) for a in axes]


def _trailing(axes: list[int], rank: int | None) -> int | None:
    """How many trailing dims `axes` covers, if it is exactly the last k axes."""
    if any(a >= 0 for a in axes):
        if rank is None:
            return None
        axes = [a - rank if a >= 0 else a for a in axes]
    k = len(axes)
    return k if sorted(axes) == list(range(-k, 0)) else None


def _inverse_std(view: GraphView, ctx: Context, diff: str, axes: list[int], reader: Node):
    """Match reader(diff, 1/std) where std = sqrt(mean(diff^2) + eps); returns (epsilon, matched nodes)."""
    if reader.op_type == "Div" and reader.inputs[0] == diff:
        sqrt = _op(view, reader.inputs[1], "Sqrt")
        chain = [reader]
    elif reader.op_type == "Mul":
        recip = _op(view, _other(reader, diff), "Reciprocal")
        sqrt = _op(view, recip.inputs[0], "Sqrt") if recip is not None else None
        chain = [reader, recip]
    else:
        return None
    if sqrt is None:
        return None
    add = _op(view, sqrt.inputs[0], "Add")
    var = None
    for i in (0, 1):
        if add is not None:
            var, eps = _op(view, add.inputs[i], "ReduceMean"), view.const(add.inputs[1 - i])
            if var is not None and eps is not None and eps.size == 1:
                break
            var = None
    if var is None or _reduce_axes(var, view, ctx) != axes:
        return None
    square = _op(view, var.inputs[0], "Pow", "Mul")
    if square is None or square.inputs[0] != diff:
        return None
    if square.op_type == "Pow" and not _near(_scalar(view, ctx, square.inputs[1]), 2.0, 1e-6):
        return None
    if square.op_type == "Mul" and square.inputs[1] != diff:
        return None
    inner = [square, var, add, sqrt]
    if any(view.n_uses(n.outputs[0]) != 1 for n in inner + chain[1:]):
        return None
    return float(eps.reshape(())), chain + inner


def _affine(view: GraphView, name: str, op_type: str) -> tuple[Node, np.ndarray] | None:
    """A following Mul/Add by a constant (gamma / beta), if `name` feeds only it."""
    node = _only_reader(view, name, op_type)
    if node is None:
        return None
    value = view.const(_other(node, name))
    return None if value is None or value.dtype.kind != "f" else (node, value)


def _to_norm_shape(value: np.ndarray, norm_shape: tuple[int, ...]) -> np.ndarray | None:
    """gamma/beta as an array of exactly the normalized shape, if they broadcast over the normalized axes only."""
    k = len(norm_shape)
    if value.ndim > k and any(d != 1 for d in value.shape[:-k]):
        return None
    trailing = value.reshape(value.shape[-k:] if value.ndim >= k else value.shape)
    try:
        return np.ascontiguousarray(np.broadcast_to(trailing, norm_shape))
    except ValueError:
        return None


@RULES.rewrite("layer_norm_fusion", "ReduceMean", level=ALL)
def fuse_layer_norm(mean: Node, view: GraphView, ctx: Context) -> bool:
    """x - mean(x), scaled by 1/sqrt(mean((x - mean)^2) + eps), times gamma plus beta -> LayerNormalization."""
    if mean.domain:
        return False
    axes = _reduce_axes(mean, view, ctx)
    sub = _only_reader(view, mean.outputs[0], "Sub")
    if axes is None or sub is None or sub.inputs != [mean.inputs[0], mean.outputs[0]]:
        return False
    x, diff = mean.inputs[0], sub.outputs[0]
    x_fact = _fact(view, ctx, x)
    k = _trailing(axes, x_fact.rank)
    readers = {id(n): n for n in view.consumers.get(diff, [])}
    if k is None or diff in view.outputs or len(readers) != 2 or x_fact.rank is None:
        return False
    norm_shape = x_fact.shape[-k:]
    if not all(isinstance(d, int) for d in norm_shape) or x_fact.elem_type not in _FLOATS:
        return False
    matched = None
    for reader in readers.values():
        if reader.op_type in ("Div", "Mul") and not reader.domain:
            matched = matched or _inverse_std(view, ctx, diff, axes, reader)
    if matched is None:
        return False
    epsilon, nodes = matched
    nodes = [mean, sub] + nodes
    out = nodes[2].outputs[0]
    dtype = to_numpy(x_fact.elem_type)
    scale, bias = np.ones(norm_shape, dtype), None
    gamma = _affine(view, out, "Mul")
    if gamma is not None:
        scale = _to_norm_shape(gamma[1], norm_shape)
        nodes.append(gamma[0])
        out = gamma[0].outputs[0]
    beta = _affine(view, out, "Add") if scale is not None else None
    if beta is not None:
        bias = _to_norm_shape(beta[1], norm_shape)
        nodes.append(beta[0])
        out = beta[0].outputs[0]
    if scale is None or beta is not None and bias is None:
        return False
    inputs = [x, view.add_initializer(f"{out}_scale", scale.astype(dtype))]
    if bias is not None:
        inputs.append(view.add_initializer(f"{out}_bias", bias.astype(dtype)))
    # below opset 17 this is onnxruntime's own contrib LayerNormalization, which it keeps in the ONNX domain
    fused = Node("LayerNormalization", inputs, [out], {"axis": -k, "epsilon": epsilon}, name=mean.name or out)
    view.replace(nodes, [fused])
    return True


# -- GELU --------------------------------------------------------------------------------------------------------------

def _half_x_times(view: GraphView, ctx: Context, one_plus: str, x: str) -> list[Node] | None:
    """The Mul nodes computing x * 0.5 * one_plus in any order and grouping (the last one produces the result)."""
    current, leaves, nodes = one_plus, [], []
    for _ in range(2):
        mul = _only_reader(view, current, "Mul")
        if mul is None:
            return None
        other = _other(mul, current)
        inner = _op(view, other, "Mul")
        nodes.append(mul)
        if inner is not None and other != x and view.n_uses(other) == 1 and len(leaves) == 0:
            leaves.extend(inner.inputs)
            nodes.insert(0, inner)
        else:
            leaves.append(other)
        current = mul.outputs[0]
        if len(leaves) == 2:
            break
    if len(leaves) != 2 or x not in leaves:
        return None
    half = leaves[1] if leaves[0] == x else leaves[0]
    return nodes if _near(_scalar(view, ctx, half), 0.5, 1e-6) else None


def _one_plus(view: GraphView, ctx: Context, name: str) -> Node | None:
    add = _only_reader(view, name, "Add")
    return add if add is not None and _near(_scalar(view, ctx, _other(add, name)), 1.0, 1e-6) else None


def _gelu_node(ctx: Context, x: str, out: str, approximate: bool, name: str) -> Node:
    if _default_opset(ctx) >= 20:
        return Node("Gelu", [x], [out], {"approximate": "tanh"} if approximate else {}, name=name)
    return Node("FastGelu" if approximate else "Gelu", [x], [out], domain=MS, name=name)


@RULES.rewrite("gelu_fusion", "Erf", level=ALL)
def fuse_gelu(erf: Node, view: GraphView, ctx: Context) -> bool:
    """x * 0.5 * (1 + erf(x / sqrt 2)) -> Gelu."""
    if erf.domain:
        return False
    scaled = _op(view, erf.inputs[0], "Div", "Mul")
    if scaled is None or view.n_uses(erf.inputs[0]) != 1:
        return False
    x = scaled.inputs[0]
    factor = _scalar(view, ctx, scaled.inputs[1])
    if scaled.op_type == "Mul" and factor is None:
        x, factor = scaled.inputs[1], _scalar(view, ctx, scaled.inputs[0])
    if not _near(factor, math.sqrt(2) if scaled.op_type == "Div" else 1 / math.sqrt(2)):
        return False
    add = _one_plus(view, ctx, erf.outputs[0])
    muls = _half_x_times(view, ctx, add.outputs[0], x) if add is not None else None
    if muls is None:
        return False
    out = muls[-1].outputs[0]
    view.replace([scaled, erf, add, *muls], [_gelu_node(ctx, x, out, False, erf.name)])
    return True


def _cube_of(view: GraphView, ctx: Context, name: str) -> tuple[str, list[Node]] | None:
    """x for name = x ** 3 (Pow(x, 3), x * (x * x) or (x * x) * x)."""
    node = _op(view, name, "Pow", "Mul")
    if node is None or view.n_uses(name) != 1:
        return None
    if node.op_type == "Pow":
        return (node.inputs[0], [node]) if _near(_scalar(view, ctx, node.inputs[1]), 3.0, 1e-6) else None
    for i in (0, 1):
        sq = _op(view, node.inputs[i], "Mul")
        x = node.inputs[1 - i]
        if sq is not None and sq.inputs == [x, x] and view.n_uses(node.inputs[i]) == 1:
            return x, [sq, node]
    return None


@RULES.rewrite("fast_gelu_fusion", "Tanh", level=ALL)
def fuse_fast_gelu(tanh: Node, view: GraphView, ctx: Context) -> bool:
    """0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))) -> FastGelu (Gelu with approximate=tanh)."""
    if tanh.domain:
        return False
    outer = _op(view, tanh.inputs[0], "Mul")
    if outer is None or view.n_uses(tanh.inputs[0]) != 1:
        return False
    for i in (0, 1):
        if _near(_scalar(view, ctx, outer.inputs[i]), math.sqrt(2 / math.pi)):
            inner = _op(view, outer.inputs[1 - i], "Add")
            break
    else:
        return False
    if inner is None or view.n_uses(inner.outputs[0]) != 1:
        return False
    for j in (0, 1):
        x, term = inner.inputs[j], _op(view, inner.inputs[1 - j], "Mul")
        if term is None or view.n_uses(term.outputs[0]) != 1:
            continue
        for m in (0, 1):
            cube = _cube_of(view, ctx, term.inputs[1 - m])
            if _near(_scalar(view, ctx, term.inputs[m]), 0.044715) and cube is not None and cube[0] == x:
                add = _one_plus(view, ctx, tanh.outputs[0])
                muls = _half_x_times(view, ctx, add.outputs[0], x) if add is not None else None
                if muls is None:
                    return False
                out = muls[-1].outputs[0]
                view.replace([*cube[1], term, inner, outer, tanh, add, *muls],
                             [_gelu_node(ctx, x, out, True, tanh.name)])
                return True
    return False


def _is_gelu(node: Node) -> str | None:
    """'erf' or 'tanh' for a bias-free Gelu-like node, else None."""
    if node.domain == MS and node.op_type == "Gelu":
        return "erf"
    if node.domain == MS and node.op_type == "FastGelu" and len([i for i in node.inputs if i]) == 1:
        return "tanh"
    if not node.domain and node.op_type == "Gelu":
        return "tanh" if node.attrs.get("approximate", "none") == "tanh" else "erf"
    return None


@RULES.rewrite("bias_gelu_fusion", "Gelu", "FastGelu", level=ALL)
def fuse_bias_gelu(gelu: Node, view: GraphView, ctx: Context) -> bool:
    """Gelu(x + bias) with a 1-D constant bias over the last axis -> com.microsoft BiasGelu / FastGelu(x, bias)."""
    kind = _is_gelu(gelu)
    add = _op(view, gelu.inputs[0], "Add") if kind else None
    if add is None or view.n_uses(gelu.inputs[0]) != 1:
        return False
    for i in (0, 1):
        bias, x = view.const(add.inputs[i]), add.inputs[1 - i]
        shape = _shape(view, ctx, x)
        if bias is not None and bias.ndim == 1 and shape and shape[-1] == bias.size and view.const(x) is None:
            op = "BiasGelu" if kind == "erf" else "FastGelu"
            fused = Node(op, [x, add.inputs[i]], [gelu.outputs[0]], domain=MS, name=gelu.name)
            view.replace([add, gelu], [fused])
            return True
    return False


# -- SkipLayerNormalization ----------------------------------------------------------------------------------------

@RULES.rewrite("skip_layer_norm_fusion", "LayerNormalization", level=ALL)
def fuse_skip_layer_norm(ln: Node, view: GraphView, ctx: Context) -> bool:
    """LayerNormalization(input + skip [+ bias]) over the last axis -> com.microsoft SkipLayerNormalization."""
    if ln.domain or any(view.n_uses(o) for o in ln.outputs[1:] if o) or len(ln.inputs) < 2:
        return False
    add = _op(view, ln.inputs[0], "Add")
    if add is None or any(view.const(i) is not None for i in add.inputs):
        return False
    a, b = (_fact(view, ctx, i) for i in add.inputs)
    if a.shape is None or a.shape != b.shape or a.rank not in (2, 3) or None in a.shape:
        return False
    if ln.attrs.get("axis", -1) not in (-1, a.rank - 1) or _shape(view, ctx, ln.inputs[1]) != a.shape[-1:]:
        return False
    if len(ln.inputs) > 2 and ln.inputs[2] and _shape(view, ctx, ln.inputs[2]) != a.shape[-1:]:
        return False
    inputs, bias, removed = list(add.inputs), "", [add, ln]
    for i in (0, 1):
        inner = _op(view, inputs[i], "Add")
        if inner is None or view.n_uses(inputs[i]) != 1:
            continue
        for j in (0, 1):
            c = view.const(inner.inputs[j])
            if c is not None and c.ndim == 1 and c.size == a.shape[-1] and view.const(inner.inputs[1 - j]) is None:
                inputs[i], bias = inner.inputs[1 - j], inner.inputs[j]
                removed.insert(0, inner)
                break
        if bias:
            break
    beta = ln.inputs[2] if len(ln.inputs) > 2 else ""
    outputs = [ln.outputs[0]]
    if view.n_uses(add.outputs[0]) > 1:
        outputs += ["", "", add.outputs[0]]  # the 4th output keeps input + skip (+ bias) for its other readers
    args = [*inputs, ln.inputs[1], beta, bias]
    while not args[-1]:
        args.pop()
    fused = Node("SkipLayerNormalization", args, outputs, {"epsilon": float(ln.attrs.get("epsilon", 1e-5))},
                 domain=MS, name=ln.name)
    view.replace(removed, [fused])
    return True


# -- projections -----------------------------------------------------------------------------------------------------

@RULES.rewrite("gemm_reshape_to_matmul", "Gemm", level=ALL)
def gemm_between_reshapes(gemm: Node, view: GraphView, ctx: Context) -> bool:
    """Reshape(x, [prod(lead), K]) -> Gemm(., W) -> Reshape(., lead + [N]) becomes MatMul(x, W) (+ Add of the
    bias): exporters flatten (B, S, K) activations around each Gemm, which costs two nodes per projection and gains
    nothing, since MatMul takes x as it is (a transposed constant W is transposed once here)."""
    if gemm.domain or gemm.attrs.get("transA", 0) or float(gemm.attrs.get("alpha", 1.0)) != 1.0:
        return False
    bias = gemm.inputs[2] if len(gemm.inputs) > 2 else ""
    if bias and float(gemm.attrs.get("beta", 1.0)) != 1.0:
        return False
    flat = _op(view, gemm.inputs[0], "Reshape")
    unflat = _only_reader(view, gemm.outputs[0], "Reshape")
    if flat is None or unflat is None or unflat.inputs[0] != gemm.outputs[0]:
        return False
    x, a2, y2, y = (_shape(view, ctx, n) for n in (flat.inputs[0], gemm.inputs[0], gemm.outputs[0], unflat.outputs[0]))
    if x is None or a2 is None or y2 is None or y is None or len(x) < 3 or len(a2) != 2 or len(y2) != 2:
        return False
    if any(d is None for d in x):  # an unknown dim (GPT-2 exported with past): its row count cannot be checked
        return False
    rows = x[0]
    for d in x[1:-1]:
        rows = symbolic.mul(rows, d)
    if tuple(a2) != (rows, x[-1]) or tuple(y) != (*x[:-1], y2[1]):
        return False
    bias_shape = _shape(view, ctx, bias) if bias else ()
    if bias_shape is None or len(bias_shape) > 2 or (len(bias_shape) == 2 and bias_shape[0] != 1):
        return False  # a bias per row of the flattened view does not broadcast over x's shape
    weights = gemm.inputs[1]
    if gemm.attrs.get("transB", 0):
        w = view.const(weights)
        if w is None or w.ndim != 2:
            return False
        weights = view.add_initializer(f"{weights}_t", np.ascontiguousarray(w.T))
    em = _Emitter(view, ctx, gemm.outputs[0])
    if bias:
        em.add("Add", [em.add("MatMul", [flat.inputs[0], weights], name=gemm.name), bias], out=unflat.outputs[0])
    else:
        em.add("MatMul", [flat.inputs[0], weights], out=unflat.outputs[0], name=gemm.name)
    view.replace([gemm, unflat], em.nodes)
    return True


# -- attention -------------------------------------------------------------------------------------------------------

def _strip_scales(view: GraphView, ctx: Context, name: str) -> tuple[str, float] | None:
    """Follow Mul/Div by scalars upward: the unscaled value and the accumulated factor."""
    factor = 1.0
    for _ in range(4):
        node = _op(view, name, "Mul", "Div")
        if node is None:
            break
        s = _scalar(view, ctx, node.inputs[1])
        if s is not None:
            src = node.inputs[0]
        elif node.op_type == "Mul" and (s := _scalar(view, ctx, node.inputs[0])) is not None:
            src = node.inputs[1]
        else:
            break
        if s == 0:
            return None
        factor *= s if node.op_type == "Mul" else 1 / s
        name = src
    return name, factor


class _Scores:
    """What lies between MatMul(Q, K^T) and Softmax: a scale factor and at most one additive mask."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.mask: tuple[str, ...] | None = None  # ("add", name) or ("where", cond, fill, chain_index)
        self.matmul: Node | None = None


def _scores_chain(view: GraphView, ctx: Context, name: str, reader: Node) -> _Scores | None:
    found = _Scores()
    for _ in range(6):
        node = view.producer.get(name)
        if node is None or node.domain or view.single_consumer(name) is not reader:
            return None
        if node.op_type == "MatMul":
            found.matmul = node
            return found
        if node.op_type in ("Mul", "Div"):
            s, src = _scalar(view, ctx, node.inputs[1]), node.inputs[0]
            if s is None and node.op_type == "Mul":
                s, src = _scalar(view, ctx, node.inputs[0]), node.inputs[1]
            if not s:
                return None
            found.scale *= s if node.op_type == "Mul" else 1 / s
            name = src
        elif found.mask is not None or found.scale != 1.0:
            return None  # a second mask, or a mask under a scale (which would scale the mask too)
        elif node.op_type == "Add":
            i = 0 if _leads_to_matmul(view, node.inputs[0]) else 1
            found.mask = ("add", node.inputs[1 - i])
            name = node.inputs[i]
        elif node.op_type == "Where":
            for i in (1, 2):
                fill = view.const(node.inputs[3 - i])
                if fill is not None and fill.size == 1 and _leads_to_matmul(view, node.inputs[i]):
                    found.mask = ("where", node.inputs[0], node.inputs[3 - i], str(i))
                    name = node.inputs[i]
                    break
            else:
                return None
        else:
            return None
        reader = node
    return None


def _leads_to_matmul(view: GraphView, name: str) -> bool:
    for _ in range(4):
        node = view.producer.get(name)
        if node is None or node.domain:
            return False
        if node.op_type == "MatMul":
            return True
        if node.op_type not in ("Mul", "Div"):
            return False
        name = node.inputs[0] if view.const(node.inputs[0]) is None else node.inputs[1]
    return False


def _split_heads_source(view: GraphView, ctx: Context, x4: str, perm: list[int], heads: int, size: int) -> str | None:
    """The (B, S, heads * size) tensor that Reshape -> Transpose(perm) turned into x4, if that is how x4 was made:
    directly, or through a longer chain of Reshapes and Transposes with the same net effect (exporters write K^T
    as transpose -> reshape -> transpose -> reshape, which the fallback would otherwise keep as four copies)."""
    name = x4
    for _ in range(_CHAIN_DEPTH):
        node = _op(view, name, "Reshape", "Transpose")
        if node is None:
            return None
        name = node.inputs[0]
        src = _shape(view, ctx, name)
        if src is not None and len(src) == 3 and src[2] == heads * size and _same_data_order(
                view, ctx, name, x4, lambda a: a.reshape(a.shape[0], a.shape[1], heads, size).transpose(perm)):
            return name
    return None


#: Reshape/Transpose nodes followed up from a per-head tensor to its (B, S, D) source
_CHAIN_DEPTH = 8
#: largest tensor (elements) whose chain is checked by moving an index array through it
_CHAIN_CHECK_LIMIT = 1 << 22


def _same_data_order(view: GraphView, ctx: Context, src: str, dst: str, expected) -> bool:
    """Whether the Reshape/Transpose chain from src to dst moves elements as `expected` (a numpy function) does:
    checked by passing an index array through both, with symbolic dims bound to two sets of small distinct sizes."""
    shapes = [_shape(view, ctx, src)]
    steps = []
    name = dst
    while name != src:
        node = _op(view, name, "Reshape", "Transpose")
        if node is None:
            return False
        steps.append(node)
        shapes.append(_shape(view, ctx, name))
        name = node.inputs[0]
    if any(s is None for s in shapes):
        return False
    syms = sorted({sym for shape in shapes for d in shape for sym in symbolic.symbols(d)}, key=str)
    for sizes in ((2, 3, 5, 7, 11), (3, 5, 7, 11, 13)):
        if len(syms) > len(sizes):
            return False
        bound = [tuple(symbolic.evaluate(d, dict(zip(syms, sizes))) for d in shape) for shape in shapes]
        if not all(isinstance(d, (int, np.integer)) and d >= 0 for shape in bound for d in shape):
            return False
        if math.prod(bound[0]) > _CHAIN_CHECK_LIMIT or not _moves_as(bound, steps, expected):
            return False
    return True


def _moves_as(shapes: list[tuple[int, ...]], steps: list[Node], expected) -> bool:
    """shapes: the source's, then each step's output (from the last step back), steps from the last one back."""
    index = np.arange(math.prod(shapes[0]), dtype=np.int64).reshape(shapes[0])
    moved = index
    for node, out_shape in zip(reversed(steps), reversed(shapes[1:])):
        if node.op_type == "Transpose":
            moved = moved.transpose(node.attrs.get("perm") or None)
        if moved.size != math.prod(out_shape):
            return False
        moved = moved.reshape(out_shape)
    want = expected(index)
    return want.shape == moved.shape and bool(np.array_equal(want, moved))


class _Emitter:
    """Collects the new nodes of one fusion, with constants added to the graph as initializers."""

    def __init__(self, view: GraphView, ctx: Context, base: str):
        self.view, self.ctx, self.base, self.nodes = view, ctx, base, []

    def add(self, op: str, inputs: list[str], attrs: dict | None = None, out: str | None = None, **kw) -> str:
        out = out or self.view.fresh_name(f"{self.base}_{op.lower()}")
        self.nodes.append(Node(op, inputs, [out], attrs or {}, **kw))
        return out

    def const(self, suffix: str, value: np.ndarray) -> str:
        return self.view.add_initializer(f"{self.base}_{suffix}", value)

    def merge_heads(self, x4: str, hidden: int) -> str:
        """(B, N, S, H) -> (B, S, N * H)."""
        t = self.add("Transpose", [x4], {"perm": [0, 2, 1, 3]})
        return self.add("Reshape", [t, self.const("merged_shape", np.array([0, 0, hidden], np.int64))])

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        if _default_opset(self.ctx) >= 13:
            return self.add("Unsqueeze", [x, self.const("axes", np.array(axes, np.int64))])
        return self.add("Unsqueeze", [x], {"axes": axes})


def _attention_bias(em: _Emitter, scores: _Scores, dims: tuple) -> str | None:
    """The mask as a 4-D additive bias (B or 1, N or 1, S, L) that MultiHeadAttention accepts, if it is one."""
    if scores.mask is None:
        return ""
    view, ctx = em.view, em.ctx
    if scores.mask[0] == "add":
        bias = scores.mask[1]
        shape = _shape(view, ctx, bias)
    else:
        _, cond, fill_name, chain_index = scores.mask
        fill = view.const(fill_name)
        zero = em.const("zero", np.zeros((), fill.dtype))
        args = [cond, zero, fill_name] if chain_index == "1" else [cond, fill_name, zero]
        shape = _shape(view, ctx, cond)
        bias = em.add("Where", args)
    if shape is None or len(shape) > 4 or len(shape) < 2:
        return None
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    batch, heads, seq, total = dims
    if padded[0] not in (1, batch) or padded[1] not in (1, heads) or padded[2:] != (seq, total):
        return None
    return em.unsqueeze(bias, list(range(4 - len(shape)))) if len(shape) < 4 else bias


@RULES.rewrite("attention_fusion", "Softmax", level=ALL)
def fuse_attention(softmax: Node, view: GraphView, ctx: Context) -> bool:
    """softmax(Q K^T * scale + mask) V over (B, N, S, H) heads -> com.microsoft MultiHeadAttention.

    Q, K and V are taken from before their head-split Reshape/Transpose when the graph has one (and the output after
    the head-merge Transpose/Reshape); otherwise the fused node gets the few Transposes/Reshapes it needs, which
    the Transpose rules then merge with their neighbours.
    """
    if softmax.domain:
        return False
    probs = _past_nan_guard(view, softmax.outputs[0])
    pv = _only_reader(view, probs, "MatMul")
    scores_fact = _fact(view, ctx, softmax.inputs[0])
    axis = softmax.attrs.get("axis", -1 if ctx.version(softmax) >= 13 else 1)
    if pv is None or pv.inputs[0] != probs or scores_fact.rank != 4 or axis not in (-1, 3):
        return False
    scores = _scores_chain(view, ctx, softmax.inputs[0], softmax)
    if scores is None:
        return False
    q_scaled, k_scaled = (_strip_scales(view, ctx, i) for i in scores.matmul.inputs)
    if q_scaled is None or k_scaled is None:
        return False
    (q4, q_factor), (kt4, k_factor), v4 = q_scaled, k_scaled, pv.inputs[1]
    q, kt, v = (_shape(view, ctx, n) for n in (q4, kt4, v4))
    if any(s is None or len(s) != 4 or None in s for s in (q, kt, v)):
        return False
    batch, heads, seq, size = q
    total, v_size = kt[3], v[3]
    if not (isinstance(heads, int) and isinstance(size, int) and isinstance(v_size, int)):
        return False
    if kt[:3] != (batch, heads, size) or v[:3] != (batch, heads, total):
        return False
    em = _Emitter(view, ctx, softmax.outputs[0])
    bias = _attention_bias(em, scores, (batch, heads, seq, total))
    if bias is None:
        return False
    query = _split_heads_source(view, ctx, q4, [0, 2, 1, 3], heads, size) or em.merge_heads(q4, heads * size)
    key = _split_heads_source(view, ctx, kt4, [0, 2, 3, 1], heads, size)
    value = _split_heads_source(view, ctx, v4, [0, 2, 1, 3], heads, v_size)
    if key is None or value is None:  # keys and values may also be given per head, (B, N, L, H)
        t = _op(view, kt4, "Transpose")
        key = t.inputs[0] if t is not None and t.attrs.get("perm") == [0, 1, 3, 2] else None
        key = key or em.add("Transpose", [kt4], {"perm": [0, 1, 3, 2]})
        value = v4
    merged = _merged_output(view, ctx, pv.outputs[0], (batch, seq, heads * v_size))
    removed = [pv] if merged is None else [pv, *merged]
    out = pv.outputs[0] if merged is None else merged[-1].outputs[0]
    attrs = {"num_heads": heads, "scale": float(scores.scale * q_factor * k_factor)}
    inputs = [query, key, value, "", "", bias] if bias else [query, key, value]
    if merged is None:
        o3 = em.add("MultiHeadAttention", inputs, attrs, domain=MS, name=softmax.name)
        shape = em.const("split_shape", np.array([0, 0, heads, v_size], np.int64))
        em.add("Transpose", [em.add("Reshape", [o3, shape])], {"perm": [0, 2, 1, 3]}, out=out)
    else:
        em.add("MultiHeadAttention", inputs, attrs, out=out, domain=MS, name=softmax.name)
    view.replace(removed, em.nodes)
    return True


def _past_nan_guard(view: GraphView, probs: str) -> str:
    """torch's dynamo export of scaled_dot_product_attention follows the softmax with Where(IsNaN(p), 0, p), which
    zeroes fully masked rows; MultiHeadAttention gives those rows zeros itself, so the guard's output stands for p."""
    readers = view.consumers.get(probs, [])
    isnan = next((r for r in readers if r.op_type == "IsNaN" and not r.domain), None)
    where = next((r for r in readers if r.op_type == "Where" and not r.domain), None)
    if len(readers) != 2 or probs in view.outputs or isnan is None or where is None:
        return probs
    zero = view.const(where.inputs[1])
    if (where.inputs[0] != isnan.outputs[0] or where.inputs[2] != probs or zero is None or zero.size != 1
            or float(zero.reshape(-1)[0]) != 0.0 or view.single_consumer(isnan.outputs[0]) is not where):
        return probs
    return where.outputs[0]


def _merged_output(view: GraphView, ctx: Context, o4: str, merged_shape: tuple) -> list[Node] | None:
    """The Transpose -> Reshape pair that turns (B, N, S, H) heads into (B, S, N * H), if o4 feeds only that."""
    t = _only_reader(view, o4, "Transpose")
    r = _only_reader(view, t.outputs[0], "Reshape") if t is not None and t.attrs.get("perm") == [0, 2, 1, 3] else None
    if r is None or r.inputs[0] != t.outputs[0] or _shape(view, ctx, r.outputs[0]) != merged_shape:
        return None
    return [t, r]


# -- shape rules for the contrib ops emitted above -------------------------------------------------------------------

def _register_same_as_first(ops: Iterable[str]) -> None:
    for op in ops:
        rule(op, domain=MS)(same_as_first)


_register_same_as_first(["Gelu", "FastGelu", "BiasGelu", "QuickGelu", "LayerNormalization"])


@rule("SkipLayerNormalization", domain=MS)
def skip_layer_norm_rule(node: Node, ins: list[Fact], version: int) -> list[Fact]:
    x = ins[0]
    out = tensor_fact(x.elem_type, x.shape)
    return [out, Fact(), Fact(), out]


@rule("MultiHeadAttention", domain=MS)
def multi_head_attention_rule(node: Node, ins: list[Fact], version: int) -> list[Fact]:
    q = ins[0]
    v = ins[2] if len(ins) > 2 else Fact()
    if q.rank != 3 or v.shape is None:
        return [tensor_fact(q.elem_type, None)]
    if v.rank == 3:
        hidden = v.shape[2]
    elif v.rank == 4 and isinstance(v.shape[1], int) and isinstance(v.shape[3], int):
        hidden = v.shape[1] * v.shape[3]
    else:
        hidden = None
    return [tensor_fact(q.elem_type, (q.shape[0], q.shape[1], hidden))]

