"""Fusion rules: BatchNormalization folding, bias and activation fusion, MatMul+Add -> Gemm, Transpose pairs."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import numpy as np

from carrack.ir.graph import Model, Node
from carrack.onnx.tensors import aligned_empty
from carrack.passes.graph_view import GraphView
from carrack.passes.rewrite import EXTENDED, Context, RuleSet

MS = "com.microsoft"
RULES = RuleSet("fusions")
#: a normalization with more channels than this is left to its kernel (its parameters are not real)
MAX_FOLDED_CHANNELS = 1 << 24


def _bn_scale_shift(bn: Node, view: GraphView) -> tuple[np.ndarray, np.ndarray] | None:
    """BatchNormalization (inference form) as y = x * scale + shift per channel, if all its parameters are constant."""
    if len(bn.outputs) > 1 and any(view.n_uses(o) for o in bn.outputs[1:] if o):
        return None
    if bn.attrs.get("training_mode", 0):
        return None
    params = [view.const(i) for i in bn.inputs[1:5]]
    if any(p is None for p in params) or len(params) != 4:
        return None
    if len({p.size for p in params}) != 1 or any(p.ndim != 1 or p.size > MAX_FOLDED_CHANNELS for p in params):
        return None  # inconsistent parameters: not folded, the kernel reports them
    gamma, beta, mean, var = (p.astype(np.float64) for p in params)
    scale = gamma / np.sqrt(var + bn.attrs.get("epsilon", 1e-5))
    return scale, beta - mean * scale


@RULES.rewrite("affine_folding", "Mul", "Add", level=EXTENDED)
def fold_affine(node: Node, view: GraphView, ctx: Context) -> bool:
    """Conv/BatchNormalization -> Mul or Add by a per-channel constant (Caffe's Scale layer after a BatchNorm)
    becomes one Conv/BatchNormalization with adjusted parameters."""
    if node.domain or len(node.inputs) != 2:
        return False
    for i in (0, 1):
        prev = view.producer.get(node.inputs[i])
        k = view.const(node.inputs[1 - i])
        if prev is None or prev.domain or k is None or view.single_consumer(node.inputs[i]) is not node:
            continue
        if prev.op_type == "BatchNormalization" and _inference_bn(prev, view, ctx):
            params = [view.const(n) for n in prev.inputs[1:5]]
            channels, rank = params[0].size, _rank(view, prev.inputs[0])
        elif prev.op_type == "Conv" and view.const(prev.inputs[1]) is not None:
            if node.op_type == "Add" and not (len(prev.inputs) > 2 and prev.inputs[2]):
                continue  # conv_bias_fusion's case
            params = [view.const(n) for n in prev.inputs[1:3]] if len(prev.inputs) > 2 and prev.inputs[2] else [
                view.const(prev.inputs[1]), None]
            if len(prev.inputs) > 2 and prev.inputs[2] and params[1] is None:
                continue
            channels, rank = params[0].shape[0], params[0].ndim
        else:
            continue
        if rank is None or params[0].dtype != k.dtype or k.dtype.kind != "f" or not _per_channel(k, channels, rank):
            continue
        vec = np.broadcast_to(k.reshape(-1), (channels,)).astype(k.dtype)
        inputs = list(prev.inputs)
        if prev.op_type == "BatchNormalization":
            gamma, beta = params[0], params[1]
            if node.op_type == "Mul":
                inputs[1] = view.add_initializer(prev.inputs[1] + "_scaled", (gamma * vec).astype(k.dtype))
                beta = beta * vec
            inputs[2] = view.add_initializer(prev.inputs[2] + "_shifted", (beta + vec * (node.op_type == "Add"))
                                             .astype(k.dtype))
        else:
            w, b = params
            b = np.zeros(channels, k.dtype) if b is None else b
            if node.op_type == "Mul":
                scaled = w * vec.reshape((-1,) + (1,) * (w.ndim - 1))
                inputs[1] = view.add_initializer(prev.inputs[1] + "_scaled", scaled.astype(k.dtype))
                b = b * vec
            else:
                b = b + vec
            inputs[2:] = [view.add_initializer(prev.outputs[0] + "_bias", b.astype(k.dtype))]
        view.replace([prev, node], [Node(prev.op_type, inputs, [node.outputs[0]], dict(prev.attrs), name=prev.name)])
        return True
    return False


def _inference_bn(bn: Node, view: GraphView, ctx: Context) -> bool:
    """Whether a BatchNormalization is the per-channel inference form with constant parameters."""
    if bn.attrs.get("training_mode", 0) or len(bn.inputs) != 5 or ctx.version(bn) < 7:
        return False
    if ctx.version(bn) < 9 and not bn.attrs.get("spatial", 1):
        return False
    if len(bn.outputs) > 1 and any(view.n_uses(o) for o in bn.outputs[1:] if o):
        return False
    params = [view.const(n) for n in bn.inputs[1:5]]
    return all(p is not None and p.ndim == 1 and p.size == params[0].size for p in params)


def _per_channel(k: np.ndarray, channels: int, rank: int) -> bool:
    """Whether constant k broadcasts against an [N, channels, ...] tensor of `rank` dims along the channels only."""
    if k.ndim > rank or k.size not in (1, channels):
        return False
    if k.size == 1:
        return True
    axis = k.ndim - (rank - 1)  # k's dim that lines up with the channel axis
    return axis >= 0 and k.shape[axis] == channels


#: ops whose output has the rank of their first input
_RANK_KEEPING = frozenset("BatchNormalization FusedBatchNormalization Relu LeakyRelu Sigmoid Dropout Identity "
                          "Transpose".split())


def _rank(view: GraphView, name: str, depth: int = 64) -> int | None:
    """The rank of a value when its producers tell it (a Conv's weight, a pooling's kernel, a graph input)."""
    for _ in range(depth):
        node = view.producer.get(name)
        if node is None:
            v = next((v for v in view.graph.inputs if v.name == name), None)
            shape = getattr(getattr(v, "type", None), "shape", None)
            return None if shape is None else len(shape)
        if node.domain not in ("", "carrack", MS):
            return None
        if node.op_type in ("Conv", "FusedConv") and len(node.inputs) > 1 and view.const(node.inputs[1]) is not None:
            return view.const(node.inputs[1]).ndim
        if node.op_type in ("MaxPool", "AveragePool") and "kernel_shape" in node.attrs:
            return len(node.attrs["kernel_shape"]) + 2
        if node.op_type == "Concat":  # DenseNet's concat chains: parts that are not another Concat first
            parts = sorted(node.inputs, key=lambda i: getattr(view.producer.get(i), "op_type", "") == "Concat")
            return next((r for r in (_rank(view, i, depth // 2) for i in parts if i) if r is not None), None)
        if node.op_type not in _RANK_KEEPING or not node.inputs:
            return None
        name = node.inputs[0]
    return None


def _channels_match(conv: Node, w: np.ndarray, scale: np.ndarray, bias: np.ndarray | None) -> bool:
    """Whether a convolution's weight (and bias) has as many output channels as the normalization after it."""
    if w.ndim < 2:
        return False
    group = conv.attrs.get("group", 1)
    channels = w.shape[0] if conv.op_type == "Conv" else w.shape[1] * group
    if conv.op_type == "ConvTranspose" and (group < 1 or w.shape[0] % group):
        return False
    return scale.size == channels and (bias is None or bias.size == channels)


@RULES.rewrite("batchnorm_folding", "BatchNormalization", level=EXTENDED)
def fold_batchnorm(bn: Node, view: GraphView, ctx: Context) -> bool:
    """Conv/ConvTranspose/Gemm/MatMul -> BatchNormalization becomes one layer with adjusted weights and bias."""
    if bn.domain or ctx.version(bn) < 7 and bn.attrs.get("spatial", 1) == 0:
        return False
    prev = view.producer.get(bn.inputs[0])
    if prev is None or prev.domain or view.single_consumer(bn.inputs[0]) is not bn:
        return False
    folded = _bn_scale_shift(bn, view)
    if folded is None:
        return False
    scale, shift = folded
    w = view.const(prev.inputs[1]) if len(prev.inputs) > 1 else None
    if w is None or w.dtype.kind != "f":
        return False
    bias = view.const(prev.inputs[2]) if len(prev.inputs) > 2 and prev.inputs[2] else None
    if len(prev.inputs) > 2 and prev.inputs[2] and bias is None:
        return False
    if prev.op_type in ("Conv", "ConvTranspose") and not _channels_match(prev, w, scale, bias):
        return False  # inconsistent: left to the kernels, which name the node
    if prev.op_type == "Conv":
        # straight into an aligned array of w's type: no float64 copy of the weights (float64 products per element)
        new_w = aligned_empty(w.shape, w.dtype)
        np.multiply(w, scale.reshape((-1,) + (1,) * (w.ndim - 1)), out=new_w, casting="unsafe")
    elif prev.op_type == "ConvTranspose":
        group = prev.attrs.get("group", 1)
        per_group = w.shape[1]
        cw = w.reshape((group, w.shape[0] // group, per_group) + w.shape[2:])
        new_w = (cw * scale.reshape(group, 1, per_group, *(1,) * (w.ndim - 2))).reshape(w.shape)
    elif prev.op_type == "Gemm" and not prev.attrs.get("transB", 0) and w.ndim == 2 and scale.size == w.shape[1]:
        new_w = w * scale
    elif prev.op_type == "Gemm" and prev.attrs.get("transB", 0) and w.ndim == 2 and scale.size == w.shape[0]:
        new_w = w * scale[:, None]
    elif prev.op_type == "MatMul" and w.ndim == 2 and scale.size == w.shape[1]:
        new_w = w * scale
    else:
        return False
    if prev.op_type == "Gemm":
        alpha, beta = prev.attrs.get("alpha", 1.0), prev.attrs.get("beta", 1.0)
        b = np.zeros(scale.size) if bias is None else np.broadcast_to(bias * beta, (scale.size,)) / alpha
        new_b = (b * scale + shift / alpha)
    else:
        b = np.zeros(scale.size) if bias is None else bias.astype(np.float64)
        if b.size != scale.size:
            return False
        new_b = b * scale + shift
    w_name = view.add_initializer(prev.inputs[1], new_w.astype(w.dtype, copy=False))
    b_name = view.add_initializer((prev.inputs[2] if bias is not None else prev.outputs[0]) + "_bias",
                                  new_b.astype(w.dtype).reshape(-1))
    if prev.op_type == "MatMul":
        fused = [Node("MatMul", [prev.inputs[0], w_name], [prev.outputs[0]], name=prev.name),
                 Node("Add", [prev.outputs[0], b_name], [bn.outputs[0]], name=bn.name)]
    else:
        attrs = dict(prev.attrs)
        if prev.op_type == "Gemm":
            attrs["beta"] = 1.0
        fused = [Node(prev.op_type, [prev.inputs[0], w_name, b_name], [bn.outputs[0]], attrs, name=prev.name)]
    view.replace([prev, bn], fused)
    return True


@RULES.rewrite("conv_bias_fusion", "Add", level=EXTENDED)
def fuse_conv_bias(add: Node, view: GraphView, ctx: Context) -> bool:
    """Conv (without bias) -> Add(constant of shape [C,1,1] or [1,C,1,1]) becomes Conv with a bias."""
    for i in (0, 1):
        prev = view.producer.get(add.inputs[i])
        bias = view.const(add.inputs[1 - i])
        if prev is None or prev.op_type != "Conv" or prev.domain or len(prev.inputs) > 2 and prev.inputs[2]:
            continue
        if bias is None or view.single_consumer(add.inputs[i]) is not add:
            continue
        w = view.const(prev.inputs[1])
        if w is None or bias.dtype != w.dtype:
            continue
        channels, spatial = w.shape[0], (1,) * (w.ndim - 2)
        if bias.shape not in ((channels, *spatial), (1, channels, *spatial)):
            continue
        squeezed = bias.reshape(-1)
        b_name = view.add_initializer(add.inputs[1 - i] + "_bias", squeezed)
        fused = Node("Conv", [prev.inputs[0], prev.inputs[1], b_name], [add.outputs[0]], dict(prev.attrs),
                     name=prev.name)
        view.replace([prev, add], [fused])
        return True
    return False


@RULES.rewrite("matmul_add_to_gemm", "Add", level=EXTENDED)
def fuse_matmul_add(add: Node, view: GraphView, ctx: Context) -> bool:
    """MatMul(A[M,K], B[K,N]) + C becomes Gemm when A is known to be 2-D and C broadcasts to [M,N]."""
    if ctx.facts is None:
        return False
    for i in (0, 1):
        mm = view.producer.get(add.inputs[i])
        if mm is None or mm.op_type != "MatMul" or mm.domain or view.single_consumer(add.inputs[i]) is not add:
            continue
        a, b = (ctx.facts.get(n) for n in mm.inputs)
        c = view.const(add.inputs[1 - i])
        if a is None or b is None or c is None or a.rank != 2 or b.rank != 2 or c.ndim > 2:
            continue
        if c.ndim == 2 and c.shape[0] != 1:
            continue
        fused = Node("Gemm", [mm.inputs[0], mm.inputs[1], add.inputs[1 - i]], [add.outputs[0]], name=mm.name)
        view.replace([mm, add], [fused])
        return True
    return False


#: activations onnxruntime's FusedConv/FusedGemm accept, with their parameter attributes
_ORT_FUSABLE = {"Relu": (), "Sigmoid": (), "Tanh": (), "LeakyRelu": (("alpha", 0.01),),
                "HardSigmoid": (("alpha", 0.2), ("beta", 0.5))}
#: activations carrack fuses under its own domain (the exporter writes them back as two standard nodes)
_CARRACK_FUSABLE = {**_ORT_FUSABLE, "HardSwish": (), "Gelu": ()}


@RULES.rewrite("activation_fusion", *_CARRACK_FUSABLE, "Clip", level=EXTENDED)
def fuse_activation(act: Node, view: GraphView, ctx: Context) -> bool:
    """Conv/Gemm/MatMul/BatchNormalization -> activation becomes one fused node: com.microsoft FusedConv/FusedGemm
    where onnxruntime knows the combination, else carrack's own FusedConv/FusedGemm/FusedMatMul/
    FusedBatchNormalization."""
    if act.domain:
        return False
    prev = view.producer.get(act.inputs[0])
    if prev is None or prev.domain or prev.op_type not in ("Conv", "Gemm", "MatMul", "BatchNormalization"):
        return False
    if view.single_consumer(act.inputs[0]) is not act:
        return False
    if prev.op_type == "BatchNormalization" and not _inference_bn(prev, view, ctx):
        return False
    if act.op_type == "Clip":
        params = _clip_params(act, view, ctx)
        if params is None or prev.op_type in ("MatMul", "BatchNormalization"):
            return False
    elif act.op_type == "Gelu":
        if act.attrs.get("approximate", "none") != "none":
            return False
        params = []
    else:
        params = [float(act.attrs.get(k, d)) for k, d in _CARRACK_FUSABLE[act.op_type]]
    attrs = dict(prev.attrs, activation=act.op_type)
    ort_knows = prev.op_type in ("Conv", "Gemm") and act.op_type in (*_ORT_FUSABLE, "Clip")
    if params and (prev.op_type != "Gemm" or not ort_knows):
        attrs["activation_params"] = params
    elif params:  # onnxruntime's FusedGemm names its activation parameters one by one
        attrs.update(zip(("activation_alpha", "activation_beta"), params))
    fused = Node(f"Fused{prev.op_type}", list(prev.inputs), [act.outputs[0]], attrs,
                 domain=MS if ort_knows else "carrack", name=prev.name)
    view.replace([prev, act], [fused])
    return True


@RULES.rewrite("conv_residual_fusion", "Add", "Sum", level=EXTENDED)
def fuse_conv_residual(add: Node, view: GraphView, ctx: Context) -> bool:
    """Conv -> Add(residual) (or a Sum of two) [-> Relu-like activation] becomes onnxruntime's FusedConv(X, W, B,
    Z): the convolution adds the residual (and applies the activation) as it stores its result, instead of two
    more passes. Only when the shapes are known to match or not known at all (the kernel then broadcasts as Add
    does)."""
    if add.domain or len(add.inputs) != 2:
        return False
    for i in (0, 1):
        conv = view.producer.get(add.inputs[i])
        residual = add.inputs[1 - i]
        if conv is None or conv.op_type != "Conv" or conv.domain or view.single_consumer(add.inputs[i]) is not add:
            continue
        if (view.const(residual) is not None or residual in conv.inputs or residual == add.inputs[i]
                or not _same_shape(ctx, add, residual)):
            continue
        attrs, outputs, absorbed = dict(conv.attrs), list(add.outputs), [add]
        act = view.single_consumer(add.outputs[0])
        if act is not None and not act.domain and act.op_type in _ORT_FUSABLE and act.inputs[0] == add.outputs[0]:
            attrs["activation"] = act.op_type
            params = [float(act.attrs.get(k, d)) for k, d in _ORT_FUSABLE[act.op_type]]
            if params:
                attrs["activation_params"] = params
            outputs, absorbed = list(act.outputs), absorbed + [act]
        bias = conv.inputs[2] if len(conv.inputs) > 2 else ""
        fused = Node("FusedConv", [conv.inputs[0], conv.inputs[1], bias, residual], outputs, attrs, domain=MS,
                     name=conv.name)
        view.remove([conv])  # the fused node goes where the Add was: the residual may be computed after the Conv
        view.replace(absorbed, [fused])
        return True
    return False


def _same_shape(ctx: Context, add: Node, residual: str) -> bool:
    """Whether the Add's inputs are known to have one and the same shape (or no shapes are known)."""
    if ctx.facts is None:
        return True
    shapes = [ctx.facts.get(name) for name in (*add.inputs, residual)]
    if any(f is None or f.shape is None for f in shapes):
        return False
    return shapes[0].shape == shapes[1].shape == shapes[2].shape and None not in shapes[0].shape


def _clip_params(act: Node, view: GraphView, ctx: Context) -> list[float] | None:
    if ctx.version(act) < 11:
        return [float(act.attrs.get("min", -3.4028234663852886e38)), float(act.attrs.get("max", 3.4028234663852886e38))]
    bounds = []
    for i, default in ((1, -np.inf), (2, np.inf)):
        if len(act.inputs) > i and act.inputs[i]:
            v = view.const(act.inputs[i])
            if v is None:
                return None
            bounds.append(float(v))
        else:
            bounds.append(float(np.finfo(np.float32).max) * (1 if default > 0 else -1))
    return bounds


@RULES.rewrite("transpose_cancellation", "Transpose", level=EXTENDED)
def merge_transposes(node: Node, view: GraphView, ctx: Context) -> bool:
    """Transpose(Transpose(x, p), q) is one Transpose (or nothing when the permutations cancel)."""
    prev = view.producer.get(node.inputs[0])
    if prev is None or prev.op_type != "Transpose" or prev.domain or node.domain:
        return False
    p, q = prev.attrs.get("perm"), node.attrs.get("perm")
    if p is None or q is None:
        return False
    combined = [p[i] for i in q]
    if combined == list(range(len(combined))):
        return view.bypass(node, prev.inputs[0], node.outputs[0])
    merged = Node("Transpose", [prev.inputs[0]], [node.outputs[0]], {"perm": combined}, name=node.name)
    view.replace([node], [merged])
    return True


@RULES.rewrite("reshape_cancellation", "Reshape", level=EXTENDED)
def merge_reshapes(node: Node, view: GraphView, ctx: Context) -> bool:
    """Reshape(Reshape(x, a), b) is Reshape(x, b) when b is a constant that copies no dim from its input (no 0s),
    and Reshape(x, shape of x) is nothing."""
    if node.domain or len(node.inputs) < 2:
        return False
    target = view.const(node.inputs[1])
    if target is None or (0 in target.tolist() and not node.attrs.get("allowzero", 0)):
        return False
    if ctx.facts is not None:
        src = ctx.facts.get(node.inputs[0])
        if src is not None and src.shape is not None and list(src.shape) == target.tolist():
            return view.bypass(node, node.inputs[0], node.outputs[0])
    prev = view.producer.get(node.inputs[0])
    if prev is None or prev.op_type != "Reshape" or prev.domain or view.single_consumer(node.inputs[0]) is not node:
        return False
    merged = Node("Reshape", [prev.inputs[0], node.inputs[1]], [node.outputs[0]], dict(node.attrs), name=node.name)
    view.replace([prev, node], [merged])
    return True


#: elementwise ops that commute with any Transpose of their only input
_LAYOUT_FREE = frozenset("Relu Sigmoid Tanh Neg Abs Exp Log Sqrt Erf LeakyRelu Elu Selu Celu HardSigmoid HardSwish "
                         "Softplus Softsign Gelu Mish Reciprocal Floor Ceil Round Sign Sin Cos Cast Clip".split())


def _reaches_transpose(view: GraphView, name: str, depth: int = 8) -> bool:
    """Whether `name` flows through a chain of single-reader layout-free ops into a Transpose."""
    for _ in range(depth):
        reader = view.single_consumer(name)
        if reader is None or reader.domain:
            return False
        if reader.op_type == "Transpose":
            return True
        if reader.op_type not in _LAYOUT_FREE or reader.inputs[0] != name:
            return False
        name = reader.outputs[0]
    return False


@RULES.rewrite("transpose_sinking", *_LAYOUT_FREE, level=EXTENDED)
def sink_transpose(node: Node, view: GraphView, ctx: Context) -> bool:
    """Transpose -> elementwise op becomes elementwise op -> Transpose, so the Transpose can meet and cancel the next
    one (Transpose, Relu, Transpose back is just Relu)."""
    if node.domain or not node.inputs:
        return False
    if any(i and view.const(i) is None for i in node.inputs[1:]):
        return False
    t = view.producer.get(node.inputs[0])
    if t is None or t.op_type != "Transpose" or t.domain or view.single_consumer(node.inputs[0]) is not node:
        return False
    if not _reaches_transpose(view, node.outputs[0]):
        return False  # only worth it when a Transpose follows to cancel with
    moved = view.fresh_name(node.outputs[0])
    first = Node(node.op_type, [t.inputs[0], *node.inputs[1:]], [moved], dict(node.attrs), name=node.name)
    second = Node("Transpose", [moved], [node.outputs[0]], dict(t.attrs), name=t.name)
    view.replace([t, node], [first, second])
    return True


#: activations the inverted-residual kernel applies (invres.c, by carrack.native.convolution.ACTIVATIONS' codes)
_BLOCK_ACTIVATIONS = frozenset(("", "Relu", "Clip", "LeakyRelu", "HardSigmoid", "HardSwish", "Sigmoid"))
#: the three convolutions of an inverted-residual block, as the fused node's attribute prefixes
BLOCK_PARTS = ("expand", "depthwise", "project")
#: whether `inverted_residual_fusion` fires: None (plans made outside a session: `carrack compile`, whose emitters
#: know the convolutions, not the block), True inside `session_block_fusion` (an InferenceSession's plan), False
#: inside `without_block_fusion`
_BLOCK_FUSION: contextvars.ContextVar[bool | None] = contextvars.ContextVar("carrack_block_fusion", default=None)


@contextlib.contextmanager
def session_block_fusion(allowed: bool = True) -> Iterator[None]:
    """Plans made inside (InferenceSession's) fuse MobileNetV2's inverted-residual blocks where invres.c runs (else
    the node would run its convolutions one by one, unbound), unless inside `without_block_fusion` or not
    `allowed` (a session whose kernels are forced to numpy)."""
    from carrack.native import invres

    token = _BLOCK_FUSION.set(allowed and _BLOCK_FUSION.get() is not False and invres.library() is not None)
    try:
        yield
    finally:
        _BLOCK_FUSION.reset(token)


@contextlib.contextmanager
def block_fusion(enabled: bool) -> Iterator[None]:
    """Plans made inside fuse MobileNetV2's inverted-residual blocks exactly when `enabled` (a native library built
    with invres.c: yes; the portable kernels, which know the convolutions: no)."""
    token = _BLOCK_FUSION.set(enabled)
    try:
        yield
    finally:
        _BLOCK_FUSION.reset(token)


def without_block_fusion() -> contextlib.AbstractContextManager[None]:
    """Sessions made inside keep MobileNetV2's inverted-residual blocks as their convolutions."""
    return block_fusion(False)


def _plain_conv(node: Node | None, view: GraphView, kernel: int, stride: int, pads: int,
                residual: bool = False) -> np.ndarray | None:
    """The float32 constant weight of a 2-D Conv/FusedConv with a `kernel` x `kernel` window, strides `stride`, pads
    `pads` on every side, dilation 1, no residual input (unless `residual`) and a constant (or no) bias, whose
    activation invres.c knows; None for anything else."""
    if node is None or node.op_type not in ("Conv", "FusedConv") or node.domain not in ("", MS, "carrack"):
        return None
    if (node.op_type == "Conv") != (node.domain == "") or not residual and len(node.inputs) > 3 and node.inputs[3]:
        return None
    w = view.const(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.dtype != np.float32 or w.ndim != 4 or w.shape[2:] != (kernel, kernel):
        return None
    if len(node.inputs) > 2 and node.inputs[2] and view.const(node.inputs[2]) is None:
        return None
    attrs = node.attrs
    if (attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET") or list(attrs.get("strides", [1, 1])) !=
            [stride, stride] or list(attrs.get("pads", [0] * 4)) != [pads] * 4
            or list(attrs.get("dilations", [1, 1])) != [1, 1]
            or list(attrs.get("kernel_shape", [kernel, kernel])) != [kernel, kernel]):
        return None
    return w if attrs.get("activation", "") in _BLOCK_ACTIVATIONS else None


def _block_bias(view: GraphView, conv: Node, channels: int) -> str:
    """The conv's bias input, or a new zero bias when it has none."""
    if len(conv.inputs) > 2 and conv.inputs[2]:
        return conv.inputs[2]
    return view.add_initializer(conv.outputs[0] + "_zero_bias", np.zeros(channels, np.float32))


def _conv_still_fusing(node: Node | None, view: GraphView) -> bool:
    """Whether `node` is a BatchNormalization or activation after a plain Conv: a rule of this round or the next
    may still fold it into that Conv, which could then be the block's expansion."""
    if node is None or node.domain != "" or node.op_type not in ("BatchNormalization", "Clip", *_CARRACK_FUSABLE):
        return False
    source = view.producer.get(node.inputs[0])
    return source is not None and source.op_type == "Conv" and source.domain == ""


@RULES.rewrite("inverted_residual_fusion", "Conv", "FusedConv", level=EXTENDED)
def fuse_inverted_residual(project: Node, view: GraphView, ctx: Context) -> bool:
    """MobileNetV2's inverted-residual block, 1x1 expansion (optional) -> depthwise 3x3 (stride 1 or 2, pads 1) ->
    1x1 projection (+ the block's input, for stride 1), each with its activation and constant weights, each
    intermediate read by the next node only, becomes one carrack.InvertedResidual node: invres.c computes it band
    by band of output rows with the intermediates in a per-thread scratch (carrack/ops/fused.py)."""
    if not _BLOCK_FUSION.get():
        return False
    reader = view.single_consumer(project.outputs[0])
    if project.op_type == "Conv" and reader is not None and reader.op_type in ("Add", "Sum", *_CARRACK_FUSABLE,
                                                                               "Clip"):
        return False  # the residual or activation fusion goes first
    residual = project.inputs[3] if len(project.inputs) > 3 else ""
    depthwise = view.producer.get(project.inputs[0])
    if depthwise is None or view.single_consumer(project.inputs[0]) is not project:
        return False
    stride = list(depthwise.attrs.get("strides", [1, 1]))[0]
    w_depthwise = _plain_conv(depthwise, view, 3, stride, 1) if stride in (1, 2) else None
    w_project = _plain_conv(project, view, 1, 1, 0, residual=True)
    if w_depthwise is None or w_project is None:
        return False
    expanded, out_channels = w_depthwise.shape[0], w_project.shape[0]
    expand = view.producer.get(depthwise.inputs[0])
    w_expand = _plain_conv(expand, view, 1, 1, 0) if view.single_consumer(depthwise.inputs[0]) is depthwise else None
    if w_expand is not None and (w_expand.shape[0] != expanded or expand.attrs.get("group", 1) != 1):
        w_expand = None
    if w_expand is None:  # a depthwise-separable pair (MobileNetV2's first block): inputs 1-2 left empty
        if _conv_still_fusing(expand, view):
            return False
        expand, block_input, channels = None, depthwise.inputs[0], expanded
    else:
        block_input, channels = expand.inputs[0], w_expand.shape[1]
    if (w_depthwise.shape[1] != 1 or depthwise.attrs.get("group", 1) != expanded or w_project.shape[1] != expanded
            or project.attrs.get("group", 1) != 1):
        return False
    if residual and (residual != block_input or stride != 1 or out_channels != channels):
        return False
    attrs: dict = {"stride": int(stride), "residual": int(bool(residual)), "expanded_channels": int(expanded)}
    inputs = [block_input]
    for part, conv, channels_out in zip(BLOCK_PARTS, (expand, depthwise, project), (expanded, expanded,
                                                                                     out_channels)):
        if conv is None:
            inputs += ["", ""]
            continue
        inputs += [conv.inputs[1], _block_bias(view, conv, channels_out)]
        attrs[f"{part}_activation"] = conv.attrs.get("activation", "")
        attrs[f"{part}_activation_params"] = [float(v) for v in conv.attrs.get("activation_params", [])]
    convs = [conv for conv in (expand, depthwise, project) if conv is not None]
    fused = Node("InvertedResidual", inputs, list(project.outputs), attrs, domain="carrack", name=convs[0].name)
    view.replace(convs, [fused])
    return True


def inverted_residual_parts(node: Node) -> list[Node]:
    """A carrack.InvertedResidual node as the convolutions it was (for an engine without it: the exporter writes
    these): the expansion (when it has one), the depthwise 3x3 and the projection."""
    x, *params = node.inputs
    stride, residual = node.attrs["stride"], node.attrs.get("residual", 0)
    geometry = {"expand": (1, 1, 0, 1), "depthwise": (3, stride, 1, node.attrs["expanded_channels"]),
                "project": (1, 1, 0, 1)}
    parts, source = [], x
    for k, part in enumerate(BLOCK_PARTS):
        if not params[2 * k]:
            continue  # a block without expansion
        kernel, step, pad, group = geometry[part]
        act = node.attrs.get(f"{part}_activation", "")
        act_params = list(node.attrs.get(f"{part}_activation_params", []))
        attrs = {"kernel_shape": [kernel, kernel], "strides": [step, step], "pads": [pad] * 4, "dilations": [1, 1]}
        if group > 1:
            attrs["group"] = group
        inputs = [source, params[2 * k], params[2 * k + 1]]
        if part == "project" and residual:
            inputs.append(x)
        if act:
            attrs["activation"] = act
            if act_params:
                attrs["activation_params"] = act_params
        if not act and len(inputs) == 3:
            op, domain = "Conv", ""
        else:
            op, domain = "FusedConv", MS if act in (*_ORT_FUSABLE, "Clip") or not act else "carrack"
        output = node.outputs[0] if part == "project" else f"{node.outputs[0]}__{part}"
        parts.append(Node(op, inputs, [output], attrs, domain=domain, name=f"{node.name}_{part}"))
        source = output
    return parts


def lower_inverted_residuals(model: Model) -> Model:
    """`model` with every carrack.InvertedResidual node of its main graph written back as its convolutions (a new
    Model and Graph when there are any; the given ones are not changed): for `carrack compile`, whose emitters
    know the convolutions."""
    if not any(n.op_type == "InvertedResidual" and n.domain == "carrack" for n in model.graph.nodes):
        return model
    nodes = [p for n in model.graph.nodes
             for p in (inverted_residual_parts(n) if n.op_type == "InvertedResidual" and n.domain == "carrack"
                       else [n])]
    return dataclasses.replace(model, graph=dataclasses.replace(model.graph, nodes=nodes))
