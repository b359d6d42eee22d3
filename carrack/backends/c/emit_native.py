"""Steps of a native x86-64 library with AVX-512 that call carrack's own session kernels instead of the portable
ones of ``runtime/carrack_rt.h``: packconv.c's convolutions on weights packed at compile time, dwconv.c's
depthwise convolutions and pools. The kernel sources are copied beside model.c and built into the library with
the session's flags (``KERNEL_SOURCES``); ``runtime/carrack_native.h`` declares the entry points model.c calls.
MobileNetV2's fused inverted-residual blocks (carrack.InvertedResidual) call invres.c, which includes packconv.c
whole: a library with such a block builds invres.c in packconv.c's place (``kernel_sources``).

Each emitter returns the step's C lines, or None where the session kernel does not take the node (the portable
kernel is emitted instead). A kernel that runs out of memory (dwconv.c's scratch rows) stops the run with
``NATIVE_KERNEL_FAILED``.
"""

from __future__ import annotations

import numpy as np

from carrack.ir.graph import Node
from carrack.plan.arena import Block

#: the session kernels' sources (carrack/native) a library with native kernels is built from
KERNEL_SOURCES = ("packconv.c", "dwconv.c")
#: headers those sources include, copied beside them
KERNEL_HEADERS = ("threadpool.h",)
#: invres.c includes packconv.c whole (its 6 x 64 tile): the library builds it instead of packconv.c
BLOCK_SOURCE, INCLUDED_BY_BLOCK = "invres.c", "packconv.c"
#: model.c's declarations of the kernels it calls
NATIVE_HEADER = "carrack_native.h"
#: model_run's error code when a session kernel could not allocate its scratch memory
NATIVE_KERNEL_FAILED = 6
#: packconv.c's weight panels (PR rows) and pixel panels (PW outputs)
PACK_ROWS, PACK_PIXELS = 6, 64
#: packconv.c works out input positions in 32-bit lanes (as carrack/native/convolution.py checks)
_INT32_REACH = (2**31 - 1) // 4
_POOL_MAX, _POOL_AVERAGE, _POOL_AVERAGE_PADS = 0, 1, 2


def packed_conv_weights(w: np.ndarray, groups: int) -> np.ndarray:
    """w[M, C / groups, KH, KW] in packconv.c's layout (packconv_pack_weights): per group, panels of PACK_ROWS
    output channels, each panel's depth k = tap * Cg + c contiguous with its rows side by side, zero rows past the
    group's last."""
    m, cg = w.shape[:2]
    mg, taps = m // groups, int(np.prod(w.shape[2:], dtype=np.int64))
    panels = -(-mg // PACK_ROWS)
    grouped = np.zeros((groups, panels * PACK_ROWS, cg, taps), np.float32)
    grouped[:, :mg] = np.asarray(w, np.float32).reshape(groups, mg, cg, taps)
    return np.ascontiguousarray(grouped.reshape(groups, panels, PACK_ROWS, cg, taps).transpose(0, 1, 4, 3, 2))


def conv_lines(em, x: str, w: str, w_array: np.ndarray, bias: str, z: str, y: str, dims: dict, geometry: dict,
               groups: int, activation: tuple[str, float, float]) -> list[str] | None:
    """A 2-D (or 1-D as 2-D) convolution through packconv.c, or dwconv.c for a depthwise one without a residual.
    x, bias, z, y: C pointers (bias and z "" for none); w: the weights' name, w_array their value; `dims`: n, c, h,
    w, m, oh, ow (fixed or run-time dims); `geometry`: _conv_geometry's k, s, d, p."""
    from carrack.backends.c.emit import _f, _pointer

    if z and z == y:  # packconv.c keeps partial sums in y between depth blocks: a residual read from y would be lost
        return None
    (kh, kw), (sh, sw), (dh, dw) = geometry["k"], geometry["s"], geometry["d"]
    pt, pl, pb, pr = geometry["p"]
    c, m = (int(dims[k]) for k in ("c", "m"))  # channels are fixed: the weights say them
    n, h, wd, oh, ow = (em.c_dim(dims[k]) for k in ("n", "h", "w", "oh", "ow"))
    act, a, b = activation
    if groups == c == m and w_array.shape[1] == 1 and not z:
        planes = _product(em, dims["n"], c)
        args = [x, _pointer(em, w), bias or "NULL", y, c, 1, h, wd, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl, 0, planes,
                act, _f(a), _f(b)]
        return _checked("dwconv2d_f32", args)
    cg, mg = w_array.shape[1], m // groups
    h_max, w_max, oh_max, ow_max = (em.at_maxima(dims[k]) for k in ("h", "w", "oh", "ow"))
    reach = (h_max * w_max, oh_max * ow_max, h_max + pt + pb, w_max + pl + pr, oh_max * sh, ow_max * sw, kh * dh,
             kw * dw)
    if cg * groups != c or m % groups or max(reach) > _INT32_REACH:
        return None
    packed = em.constant(f"{w}::packconv.{groups}", packed_conv_weights(w_array, groups))
    pixels = (dims["oh"], dims["ow"])
    if all(isinstance(d, int) for d in pixels):
        items = _product(em, dims["n"], groups * -(-pixels[0] * pixels[1] // PACK_PIXELS))
    else:
        items = f"{n} * {groups} * (({oh} * {ow} + {PACK_PIXELS - 1}) / {PACK_PIXELS})"
    args = [x, packed, bias or "NULL", y, z or "NULL", n, groups, mg, cg, h, wd, kh, kw, oh, ow, sh, sw, dh, dw, pt,
            pl, 0, items, act, _f(a), _f(b), 1]
    return [f"packconv_f32_threads({', '.join(map(str, args[:5]))},",
            f"                     {', '.join(map(str, args[5:21]))},",
            f"                     {', '.join(map(str, args[21:]))});"]


def pool_lines(em, x: str, y: str, planes, h, wd, oh, ow, kernel, strides, dilations, pads, is_max: bool,
               count_pad: bool) -> list[str]:
    """A 2-D max or average pool through dwconv.c's pool2d_f32 (ceil_mode's windows past the end pads included)."""
    mode = _POOL_MAX if is_max else _POOL_AVERAGE_PADS if count_pad else _POOL_AVERAGE
    args = [x, y, *(em.c_dim(d) for d in (h, wd)), *kernel, *(em.c_dim(d) for d in (oh, ow)), *strides, *dilations,
            *pads, 0, em.c_dim(planes), mode]
    return _checked("pool2d_f32", args)


def kernel_sources(uses_blocks: bool) -> tuple[str, ...]:
    """The sources a library is built from: invres.c (packconv.c included in it) when a step runs a fused
    inverted-residual block, packconv.c otherwise."""
    if not uses_blocks:
        return KERNEL_SOURCES
    return tuple(BLOCK_SOURCE if name == INCLUDED_BY_BLOCK else name for name in KERNEL_SOURCES)


def copied_sources(sources: tuple[str, ...]) -> tuple[str, ...]:
    """Every carrack/native file the build of `sources` reads: them, the sources they include whole, the headers."""
    included = (INCLUDED_BY_BLOCK,) if BLOCK_SOURCE in sources else ()
    return (*sources, *included, *KERNEL_HEADERS)


#: the expanded map's bytes (all the images at the maxima) from which a block runs fused: below, the two
#: intermediates stay in the L2 cache between three calls anyway, and packconv.c's and dwconv.c's own calls on
#: them are faster than invres.c's bands and channel chunks (mobilenetv2 at one thread: its 112x112 and 56x56
#: blocks 0.5-0.9x the three calls, the 28x28 and smaller ones 1.05-1.3x)
BLOCK_MIN_EXPANDED_BYTES = 1 << 20
#: invres.c's limits: output rows of at most MAX_VECTORS vectors of 16 floats
_BLOCK_MAX_OUT_WIDTH = 64 * 16
#: invres.c's SMALL_MAP_PIXELS and CHUNK (8 panels of packconv's PR rows)
_BLOCK_SMALL_MAP, _BLOCK_CHUNK = 256, 8 * PACK_ROWS


def block_scratch_floats(n, ce: int, h: int, w: int, stride: int, band: int):
    """invres_scratch_floats(n, ce, h, w, stride, band, 1) of invres.c: one thread's band (or channel chunk)
    scratch, and for maps of at most 256 output pixels the depthwise maps of the n images (n may be a dim)."""
    from carrack.ir import symbolic

    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    round16 = lambda v: -(-v // 16) * 16  # noqa: E731
    if oh * ow <= _BLOCK_SMALL_MAP:  # a run-time n: n rounded maps, at least round16(n * maps)
        maps = round16(n * ce * oh * ow) if isinstance(n, int) else symbolic.mul(n, round16(ce * oh * ow))
        return symbolic.add(round16(_BLOCK_CHUNK * h * w), maps)
    return ce * (round16(((band - 1) * stride + 3) * w) + round16(band * ow))


def block_lines(em, step: int, node, x_shape: tuple, y: str) -> list[str] | None:
    """A carrack.InvertedResidual node through invres.c, one thread: its two 1x1 weights packed into packconv's
    panels at compile time, its band scratch a block of the arena live at this step only (so model_arena_bytes
    counts it). None where invres.c does not take the node (spatial dims fixed only at run time, a map wider than
    it vectorizes, weights that are not constants) or is not the faster (BLOCK_MIN_EXPANDED_BYTES): the caller
    emits its convolutions."""
    from carrack.backends.c.emit import _activation, _const, _f, _itemsize, _pointer
    from carrack.ir import symbolic
    from carrack.native.invres import Geometry, plan_bands
    from carrack.passes.fusions import BLOCK_PARTS

    n, c, h, w = x_shape
    stride = int(node.attrs.get("stride", 1))
    names = list(node.inputs[1:7])
    weights = [_const(em, name) if name else None for name in names]
    w_expand, w_depthwise, w_project = weights[0], weights[2], weights[4]
    if (not all(isinstance(d, int) for d in (c, h, w)) or (w - 1) // stride + 1 > _BLOCK_MAX_OUT_WIDTH
            or any(v is None for v in weights[2:]) or (names[0] and w_expand is None)):
        return None
    ce, co = w_depthwise.shape[0], w_project.shape[0]
    if 4 * em.at_maxima(n) * ce * h * w < BLOCK_MIN_EXPANDED_BYTES:
        return None
    band, _ = plan_bands(Geometry(em.at_maxima(n), c, ce, co, h, w, stride), 1)
    scratch = symbolic.mul(_itemsize("float32"), block_scratch_floats(n, ce, h, w, stride, band))
    em.extra_blocks.append(Block(f"{node.outputs[0]}::invres.scratch", scratch, step, step))
    index = len(em.plan.arena.blocks if em.plan.arena else ()) + len(em.extra_blocks) - 1
    expand = "NULL" if w_expand is None else em.constant(f"{names[0]}::packconv.1", packed_conv_weights(w_expand, 1))
    project = em.constant(f"{names[4]}::packconv.1", packed_conv_weights(w_project, 1))
    x, (be, wd, bd, bp) = _pointer(em, node.inputs[0]), (_pointer(em, k) if k else "NULL" for k in
                                                         (names[1], names[2], names[3], names[5]))
    args = [x, expand, be, wd, bd, project, bp, y, f"(float *)(r->arena + r->off[{index}])", em.c_dim(n), c, ce, co,
            h, w, stride, int(node.attrs.get("residual", 0)), band]
    for part in BLOCK_PARTS:
        attrs = {"activation": node.attrs.get(f"{part}_activation", ""),
                 "activation_params": list(node.attrs.get(f"{part}_activation_params", []))}
        act, a, b = _activation(Node("FusedConv", [], [], attrs))
        args += [act, _f(a), _f(b)]
    return [f"invres_f32_threads({', '.join(map(str, args[:9]))},",
            f"                   {', '.join(map(str, args[9:18]))},",
            f"                   {', '.join(map(str, args[18:]))}, 1);"]


def _product(em, dim, factor: int) -> str:
    """C source of dim * factor (one number when the dim is fixed)."""
    return str(dim * factor) if isinstance(dim, int) else f"{em.c_dim(dim)} * {factor}"


def _checked(function: str, args: list) -> list[str]:
    text = ", ".join(map(str, args))
    return [f"if ({function}({text}) != 0)",
            f"    run_status = {NATIVE_KERNEL_FAILED};  /* out of memory for the kernel's scratch rows */"]


#: producers whose step writes its output wherever the value's pointer says (emit._output_value)
_WRITES_IN_PLACE = frozenset({"Conv", "FusedConv", "MaxPool", "AveragePool"})


def elide_concats(em) -> None:
    """Concats along an axis with nothing before it but ones (batch 1, channels): each part's producer writes its
    output straight into its slice of the concatenation, and the Concat step goes (squeezenet's fire modules).
    Where every part is a convolution or pool output read by this Concat alone, the concatenation gets a block of
    its own, live from its first part's step to its last reader, above the plan's blocks."""
    from carrack.backends.c.emit import _elements, _itemsize, _last_use, _Value
    from carrack.passes.graph_view import GraphView

    graph = em.plan.graph
    producer = {o: (k, em.replaced.get(k, node)) for k, node in enumerate(graph.nodes) if k not in em.skipped
                for o in em.replaced.get(k, node).outputs if o}  # a fused chain's value: its convolution's
    view = GraphView(graph)  # who reads each value (subgraph bodies included)
    for step, node in enumerate(graph.nodes):
        parts = node.inputs
        if node.op_type != "Concat" or node.domain or len(parts) < 2 or len(set(parts)) != len(parts):
            continue
        out = node.outputs[0]
        facts = [em.facts.get(name) for name in (*parts, out)]
        if any(f is None or f.shape is None or f.elem_type != 1 for f in facts):
            continue
        axis = int(node.attrs["axis"]) % len(facts[-1].shape)
        if any(not isinstance(d, int) for f in facts for d in f.shape) or _elements(facts[-1].shape[:axis]) != 1:
            continue
        if any(view.single_consumer(name) is not node or name not in producer
               or producer[name][1].op_type not in _WRITES_IN_PLACE or len(producer[name][1].outputs) != 1
               for name in parts):
            continue
        shape = tuple(facts[-1].shape)
        if out in view.outputs:
            whole = f"(float *)r->out[{[v.name for v in graph.outputs].index(out)}]"
        else:
            first = min(producer[name][0] for name in parts)
            em.extra_blocks.append(Block(out, _itemsize("float32") * _elements(shape), first, _last_use(em, out, step)))
            index = len(em.plan.arena.blocks if em.plan.arena else ()) + len(em.extra_blocks) - 1
            whole = f"(float *)(r->arena + r->off[{index}])"
        em.values[out] = _Value(out, shape, whole)
        offset = 0
        for name, fact in zip(parts, facts):
            em.values[name] = _Value(name, tuple(fact.shape), f"({whole} + {offset})")
            offset += _elements(tuple(fact.shape))
        em.elided.add(out)


#: element-wise nodes after a convolution that its store can apply: a per-channel affine, one residual, then one
#: activation
_NORMALIZATIONS = frozenset({("", "BatchNormalization"), ("carrack", "FusedBatchNormalization")})
_RESIDUALS = frozenset({("", "Add"), ("", "Sum")})
_ACTIVATION_NODES = frozenset({"Relu"})


def fuse_epilogues(em) -> None:
    """Convolution -> BatchNormalization -> Add/Sum of a residual of the output's shape -> Relu chains (each step
    optional but the convolution, each intermediate read by the next one alone; shufflenet's units, whose
    normalizations the model keeps) become one FusedConv step: the normalization folded into the weights and bias
    at compile time, the residual and the activation applied as the kernel stores. The chain's last value gets a
    block of its own from the convolution's step (the plan placed it from its own step); the other nodes' steps
    go (em.skipped)."""
    from carrack.passes.graph_view import GraphView

    graph = em.plan.graph
    view = GraphView(graph)
    step_of = {id(node): k for k, node in enumerate(graph.nodes)}
    produced_at = {o: k for k, node in enumerate(graph.nodes) for o in node.outputs if o}
    for step, conv in enumerate(graph.nodes):
        weights = _plain_conv_weights(em, conv)
        if weights is None:
            continue
        chain, z, activation, scale, shift = _epilogue_chain(em, view, conv, weights[0].shape[0], produced_at, step)
        steps = {step_of[id(node)] for node in chain}
        if not chain or steps & (em.skipped | set(em.replaced)) or step in em.skipped:
            continue
        final = chain[-1].outputs[0]
        w, bias = weights
        if scale is not None:
            w = (w.astype(np.float64) * scale.reshape(-1, *(1,) * (w.ndim - 1))).astype(np.float32)
            bias = (np.zeros(scale.size) if bias is None else bias.astype(np.float64)) * scale + shift
        inputs = [conv.inputs[0], _registered(em, f"{final}::epilogue.w", w)]
        inputs.append(_registered(em, f"{final}::epilogue.b", np.asarray(bias, np.float32)) if bias is not None
                      else "")
        inputs.append(z or "")
        attrs = {k: v for k, v in conv.attrs.items()}
        if activation is not None:
            attrs["activation"], attrs["activation_params"] = activation
        em.replaced[step] = Node("FusedConv", inputs, [final], attrs, domain="carrack", name=conv.name)
        em.skipped.update(steps)
        if final not in view.outputs:
            em.values.pop(final, None)  # a block of its own from this step on (the plan's starts later)


def _plain_conv_weights(em, conv) -> tuple[np.ndarray, np.ndarray | None] | None:
    """A 2-D Conv's constant float32 weight and bias (None for none), or None when it is not one."""
    from carrack.backends.c.emit import _known_or_folded

    if conv.op_type != "Conv" or conv.domain or len(conv.inputs) not in (2, 3) or not conv.outputs[0]:
        return None
    w = _known_or_folded(em, conv.inputs[1])
    bias = _known_or_folded(em, conv.inputs[2]) if len(conv.inputs) == 3 and conv.inputs[2] else None
    if w is None or w.dtype != np.float32 or w.ndim != 4 or (len(conv.inputs) == 3 and conv.inputs[2] and (
            bias is None or bias.shape != (w.shape[0],))):
        return None
    return w, bias


def _epilogue_chain(em, view, conv, channels: int, produced_at: dict, step: int):
    """(nodes after `conv` (of `channels` outputs) its store applies, residual input, activation (name, params),
    scale, shift)."""
    chain, z, activation, scale, shift = [], "", None, None, None
    value = conv.outputs[0]
    node = view.single_consumer(value)
    if node is not None and (node.domain, node.op_type) in _NORMALIZATIONS and node.inputs[0] == value:
        folded = _normalization(em, node, channels)
        if folded is not None:
            (scale, shift), activation = folded
            chain.append(node)
            value = node.outputs[0]
            node = view.single_consumer(value)
            if activation is not None:
                return chain, z, activation, scale, shift
    if node is not None and (node.domain, node.op_type) in _RESIDUALS and len(node.inputs) == 2:
        other = node.inputs[1] if node.inputs[0] == value else node.inputs[0]
        fact, out = em.facts.get(other), em.facts.get(value)
        if (other != value and fact is not None and out is not None and fact.shape is not None
                and tuple(fact.shape) == tuple(out.shape) and fact.elem_type == 1
                and produced_at.get(other, -1) < step):
            z, chain = other, [*chain, node]
            value = node.outputs[0]
            node = view.single_consumer(value)
    if node is not None and not node.domain and node.op_type in _ACTIVATION_NODES:
        activation, chain = (node.op_type, []), [*chain, node]
    return chain, z, activation, scale, shift


def _normalization(em, node, channels: int):
    """((scale, shift), activation or None) of an inference BatchNormalization with constant parameters."""
    from carrack.backends.c.emit import _known_or_folded

    if len(node.inputs) != 5 or any(node.outputs[1:]) or node.attrs.get("training_mode", 0):
        return None
    params = [_known_or_folded(em, name) for name in node.inputs[1:5]]
    if any(p is None or p.shape != (channels,) for p in params):
        return None
    scale_b, shift_b, mean, var = (p.astype(np.float64) for p in params)
    factor = scale_b / np.sqrt(var + float(node.attrs.get("epsilon", 1e-5)))
    activation = None
    if node.op_type == "FusedBatchNormalization" and node.attrs.get("activation", ""):
        activation = (node.attrs["activation"], list(node.attrs.get("activation_params", [])))
    return (factor, shift_b - mean * factor), activation


def _registered(em, name: str, array: np.ndarray) -> str:
    """`array` as a constant value `name` of the emitter (its pointer made on first use)."""
    from carrack.backends.c.emit import _Value

    em.constants[name] = array
    em.values[name] = _Value(name, tuple(array.shape), "", "float32")
    return name
