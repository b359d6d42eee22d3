"""A plan as C: one function per step calling a kernel of ``runtime/carrack_rt.h``, every intermediate at an arena
offset, constants in a 64-byte-aligned weights file, and a small C API:

    int model_init(const void *weights);                   // the weights file's bytes, 64-byte aligned
    int64_t model_arena_bytes(const int64_t *dims);        // arena bytes for these run-time dims
    int model_run(const int64_t *dims, const void *const *inputs, void *const *outputs);

`dims` holds the sizes of the run-time symbols (those given ``--max-dim``), in the manifest's order. Values the
plan places (`Plan.placed`) sit at the plan's arena offsets; values it leaves to their kernels (a pooled vector,
a transposed copy) get blocks of their own above the plan's, laid out by the same `carrack.plan.arena` rules. The
arena is static, sized for the declared maxima; `model_run` checks the dims against them and returns an error code
instead of writing past it. The output is a pure function of the plan and the options (same model, same bytes).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from carrack.backends.c import emit_native
from carrack.backends.c.compiled import MAX_RANK_IO
from carrack.errors import CarrackError, UnsupportedModel
from carrack.ir import symbolic
from carrack.ir.dims import Sym
from carrack.ir.graph import Node
from carrack.ir.symbolic import DimLike, Expr, OpAtom
from carrack.plan import Plan
from carrack.plan.arena import ALIGNMENT, Block, align, order_blocks

RUNTIME_HEADER = "carrack_rt.h"
#: the kernels for values of any element type (integers, bools), beside carrack_rt.h
VALUES_HEADER = "carrack_values.h"
#: the integer kernels of quantized models (QLinearConvExact, QuantizeLinear, ...), beside them
QUANT_HEADER = "carrack_quant.h"
#: output channels per group from which a convolution is vectorized over its channels rather than its pixels
CHANNEL_VECTORIZED_MIN = 16
#: output rows shorter than this (or strided, or of run-time length) are not what a convolution vectorizes over
SHORT_ROW = 32
#: output channels per group from which a convolution runs as a packed matrix product (cr_conv2d_gemm)
PACKED_GEMM_MIN = 8
MAX_RANK = 6

#: error codes of model_run, as the manifest tells the loaders
RUN_ERRORS = {1: "model_init was not called", 2: "a dim is outside 1..its declared maximum",
              3: "the arena is too small for these dims",
              5: "an index is out of range (Gather: each index must be in -size..size-1 of its axis)",
              emit_native.NATIVE_KERNEL_FAILED: "a native kernel could not allocate its scratch memory"}
#: the element types a compiled value may have: ONNX element type -> name, and name -> (C type, cr_type, bytes)
ELEMENT_TYPES = {1: "float32", 7: "int64", 6: "int32", 9: "bool", 2: "uint8", 3: "int8", 5: "int16"}
C_TYPES = {"float32": ("float", "CR_F32", 4), "int64": ("int64_t", "CR_I64", 8), "int32": ("int32_t", "CR_I32", 4),
           "bool": ("uint8_t", "CR_BOOL", 1), "uint8": ("uint8_t", "CR_U8", 1), "int8": ("int8_t", "CR_I8", 1),
           "int16": ("int16_t", "CR_I16", 2)}

_ACTIVATIONS = {"": "CR_ACT_NONE", "Relu": "CR_ACT_RELU", "Clip": "CR_ACT_CLIP", "LeakyRelu": "CR_ACT_LEAKY",
                "Sigmoid": "CR_ACT_SIGMOID", "Tanh": "CR_ACT_TANH", "HardSigmoid": "CR_ACT_HARDSIGMOID",
                "HardSwish": "CR_ACT_HARDSWISH", "Gelu": "CR_ACT_GELU", "Elu": "CR_ACT_ELU", "Exp": "CR_ACT_EXP",
                "Neg": "CR_ACT_NEG", "Sqrt": "CR_ACT_SQRT", "Abs": "CR_ACT_ABS", "Identity": "CR_ACT_NONE"}
_DEFAULT_PARAMS = {"LeakyRelu": (0.01, 0.0), "HardSigmoid": (0.2, 0.5), "Elu": (1.0, 0.0),
                   "Clip": (-math.inf, math.inf)}
_BINARY = {"Add": "CR_ADD", "Sub": "CR_SUB", "Mul": "CR_MUL", "Div": "CR_DIV"}
#: ops whose output is the input's bytes under another shape
_VIEWS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"}


class CompileError(CarrackError, ValueError):
    """`carrack compile` was given options that do not fit the model (a symbol without a size, a bad maximum)."""


class UnsupportedOperators(UnsupportedModel):
    """Nodes the C backend has no emitter for, listed all at once."""

    def __init__(self, missing: list[tuple[str, str]]):
        self.missing = missing
        lines = [f"  {op} at {where}" for op, where in missing]
        super().__init__(f"carrack compile: {len(missing)} node(s) have no C emitter:\n" + "\n".join(lines))


@dataclass
class Emitted:
    """The generated files' contents."""

    source: str  # model.c
    weights: bytes  # weights.bin
    manifest: dict  # model.json
    kernel_sources: tuple[str, ...] = ()  # carrack/native sources built into the library (emit_native)


@dataclass
class _Value:
    name: str
    shape: tuple[DimLike, ...]
    pointer: str  # C expression of its typed pointer (float * for float32)
    dtype: str = "float32"


@dataclass
class _Emitter:
    plan: Plan
    fixed: Mapping[str, int]
    maxima: Mapping[str, int]
    runtime: list[str] = field(default_factory=list)  # symbols that are run-time arguments, in dims order
    values: dict[str, _Value] = field(default_factory=dict)
    weights: bytearray = field(default_factory=bytearray)
    weight_offsets: dict[str, int] = field(default_factory=dict)
    steps: list[tuple[str, str, list[str]]] = field(default_factory=list)  # (function name, comment, body lines)
    extra_blocks: list[Block] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)
    constants: dict[str, np.ndarray] = field(default_factory=dict)  # Constant nodes' values
    failing_steps: set[str] = field(default_factory=set)  # steps that may set run_status (an index out of range)
    facts: dict = field(default_factory=dict)  # shape inference's facts at the fixed dims
    panel_width: int = 0  # > 0: constant matrix-product B written as panels of this many columns (cr_bsrc)
    native_kernels: bool = False  # convolutions and pools through the session's kernels (emit_native)
    uses_native: bool = False  # a step calls one
    uses_blocks: bool = False  # a step calls invres.c (a fused inverted-residual block)
    elided: set[str] = field(default_factory=set)  # Concat outputs whose parts were written in place
    replaced: dict[int, Node] = field(default_factory=dict)  # steps emitted as another node (emit_native)
    skipped: set[int] = field(default_factory=set)  # steps another step's kernel does (emit_native)
    producers: dict[str, Node] = field(default_factory=dict)  # value -> the node making it (filled on first use)

    # dims ------------------------------------------------------------------------------------------------------
    def c_dim(self, d: DimLike) -> str:
        """C source of a dim over the run-time symbols (`S_name` macros)."""
        if isinstance(d, (int, np.integer)):
            return str(int(d))
        if isinstance(d, Sym):
            return _symbol_macro(d.name)
        if not isinstance(d, Expr):
            raise TypeError(f"not a dim: {d!r}")
        terms = []
        for mono, c in sorted(d.terms.items(), key=lambda kv: str(kv[0])):
            factors = [self._c_atom(a) for a in mono]
            if c != 1 or not factors:
                factors.insert(0, str(int(c)))
            terms.append(" * ".join(factors))
        return "(" + " + ".join(terms) + ")" if terms else "0"

    def _c_atom(self, a: Sym | OpAtom) -> str:
        if isinstance(a, Sym):
            return _symbol_macro(a.name)
        args = [self.c_dim(x) for x in a.args]
        if a.op in ("floordiv", "mod"):
            return f"cr_{a.op}({args[0]}, {args[1]})"
        folded = args[0]
        for x in args[1:]:
            folded = f"cr_{a.op}({folded}, {x})"
        return folded

    def at_maxima(self, d: DimLike) -> int:
        return int(symbolic.evaluate(d, {Sym(s): self.maxima[s] for s in self.runtime}))

    # storage ---------------------------------------------------------------------------------------------------
    def constant(self, name: str, array: np.ndarray) -> str:
        """The weights-file pointer of a float32 constant (added once per name)."""
        if name not in self.weight_offsets:
            data = np.ascontiguousarray(array, dtype="<f4").tobytes()
            self.weights.extend(b"\0" * (align(len(self.weights)) - len(self.weights)))
            self.weight_offsets[name] = len(self.weights)
            self.weights.extend(data)
        return f"(const float *)(r->weights + {self.weight_offsets[name]})"

    def typed_constant(self, name: str, array: np.ndarray, dtype: str) -> str:
        """The weights-file pointer of a constant stored as `dtype` (a bool as one byte, 0 or 1)."""
        if dtype == "float32":
            return self.constant(name, array)
        if name not in self.weight_offsets:
            data = np.ascontiguousarray(array).astype(_numpy_dtype(dtype)).tobytes()
            self.weights.extend(b"\0" * (align(len(self.weights)) - len(self.weights)))
            self.weight_offsets[name] = len(self.weights)
            self.weights.extend(data)
        return f"(const {C_TYPES[dtype][0]} *)(r->weights + {self.weight_offsets[name]})"


def _numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype("u1") if dtype == "bool" else np.dtype(dtype).newbyteorder("<")


def _dtype_of_array(array: np.ndarray) -> str | None:
    """The compiled element type of a constant's numpy dtype (None: not compiled)."""
    name = "bool" if array.dtype == np.bool_ else array.dtype.name
    return name if name in C_TYPES else None


def _itemsize(dtype: str) -> int:
    return C_TYPES[dtype][2]


def _symbol_macro(name: str) -> str:
    return "S_" + _identifier(name)


def _identifier(name: str) -> str:
    text = re.sub(r"[^0-9A-Za-z_]+", "_", name).strip("_")
    return text if text and not text[0].isdigit() else f"v_{text}"


def emit(plan: Plan, fixed: Mapping[str, int] | None = None, maxima: Mapping[str, int] | None = None,
         panel_width: int = 0, embed_weights: bool = False, native_kernels: bool = False) -> Emitted:
    """The C source, weights and manifest of `plan`: symbols in `fixed` take that size, those in `maxima` are
    run-time dims bounded by it; every symbol of the model must be in one of them. `panel_width` > 0 writes the
    constant B of matrix products (MatMul, Gemm) into the weights as panels of that many columns, the packed
    product's layout on a target whose tile is that wide (read in place there, repacked elsewhere). With
    `embed_weights` the built library or module carries weights.bin itself (model_init(NULL) uses it). With
    `native_kernels` (native x86-64 builds with AVX-512) convolutions and pools call the session's kernels."""
    fixed, maxima = dict(fixed or {}), dict(maxima or {})
    _check_symbols(plan, fixed, maxima)
    em = _Emitter(plan, fixed, maxima, runtime=[s for s in plan.symbols if s in maxima], panel_width=panel_width,
                  native_kernels=native_kernels)
    facts = plan.facts(fixed)
    em.facts = facts
    graph = plan.graph
    em.missing.extend(_check_inputs_outputs(plan, facts))  # listed with the nodes' own, all at once
    _place_inputs_outputs(em, facts)
    if native_kernels:
        emit_native.fuse_epilogues(em)
        emit_native.elide_concats(em)
    for k, node in enumerate(graph.nodes):
        _emit_node(em, k, node, facts)
    if em.missing:
        raise UnsupportedOperators(em.missing)
    _copy_unwritten_outputs(em)
    return _assemble(em, embed_weights)


def _copy_unwritten_outputs(em: _Emitter) -> None:
    """Outputs no step wrote into the caller's buffer (an input or a constant passed through) are copied there."""
    for k, v in enumerate(em.plan.graph.outputs):
        value = em.values.get(v.name)
        if value is None or value.pointer == f"({C_TYPES[value.dtype][0]} *)r->out[{k}]":
            continue
        source = _pointer(em, v.name)
        size = em.c_dim(_elements(value.shape))
        em.steps.append((f"copy_output_{k}", f"output {v.name}: copied into the caller's buffer",
                         [f"memcpy(r->out[{k}], {source}, (size_t)({size}) * {_itemsize(value.dtype)});"]))


def _check_symbols(plan: Plan, fixed: Mapping[str, int], maxima: Mapping[str, int]) -> None:
    unknown = sorted((set(fixed) | set(maxima)) - set(plan.symbols))
    if unknown:
        raise CompileError(f"carrack compile: the model has no symbolic dim(s) {unknown}; its dims are "
                           f"{list(plan.symbols)}")
    both = sorted(set(fixed) & set(maxima))
    if both:
        raise CompileError(f"carrack compile: dim(s) {both} given both --dim and --max-dim; give one")
    unsized = [s for s in plan.symbols if s not in fixed and s not in maxima]
    if unsized:
        raise CompileError(f"carrack compile: symbolic dim(s) {unsized} need a size: --dim NAME=SIZE fixes one, "
                           "--max-dim NAME=SIZE makes it a run-time argument up to SIZE")
    bad = {k: v for k, v in {**fixed, **maxima}.items() if int(v) < 1}
    if bad:
        raise CompileError(f"carrack compile: dim sizes must be at least 1, got {bad}")


def _check_inputs_outputs(plan: Plan, facts) -> list[tuple[str, str]]:
    wrong = []
    for v in list(plan.inputs) + list(plan.graph.outputs):
        fact = facts.get(v.name)
        dtype = None if fact is None or fact.tensor is None else fact.elem_type
        if dtype not in ELEMENT_TYPES or fact.shape is None or len(fact.shape) > MAX_RANK_IO:
            wrong.append(f"'{v.name}' ({'unknown type' if dtype is None else f'element type {dtype}'})")
    rule = (f"only {', '.join(ELEMENT_TYPES.values())} tensors of known rank (at most {MAX_RANK_IO}) "
            "are compiled")
    return [("input/output", f"{w}: {rule}") for w in wrong]


def _place_inputs_outputs(em: _Emitter, facts) -> None:
    for k, v in enumerate(em.plan.inputs):
        if facts.get(v.name) is None or facts[v.name].shape is None:
            continue  # listed as unsupported already
        dtype = ELEMENT_TYPES.get(facts[v.name].elem_type, "float32")
        em.values[v.name] = _Value(v.name, tuple(facts[v.name].shape), f"(const {C_TYPES[dtype][0]} *)r->in[{k}]",
                                   dtype)
    for name, array in em.plan.graph.initializers.items():  # pointer made on first use
        em.values[name] = _Value(name, tuple(array.shape), "", _dtype_of_array(np.asarray(array)) or "float32")
    for p in em.plan.placed:
        dtype = ELEMENT_TYPES.get(facts[p.name].elem_type, "float32")
        em.values[p.name] = _Value(p.name, tuple(facts[p.name].shape),
                                   f"({C_TYPES[dtype][0]} *)(r->arena + r->off[{p.block}])", dtype)


def _pointer(em: _Emitter, name: str) -> str:
    value = em.values[name]
    if not value.pointer:
        value.pointer = em.typed_constant(name, np.asarray(_const(em, name)), value.dtype)
    return value.pointer


def _const(em: _Emitter, name: str) -> np.ndarray | None:
    array = em.plan.graph.initializers.get(name, em.constants.get(name))
    return None if array is None else np.asarray(array)


def _output_value(em: _Emitter, step: int, name: str, shape: tuple[DimLike, ...], dtype: str = "float32") -> _Value:
    """Where a node's output goes: the caller's output buffer, its plan block, or a block of its own."""
    outputs = [o.name for o in em.plan.graph.outputs]
    c_type = C_TYPES[dtype][0]
    if name in outputs:
        value = _Value(name, shape, f"({c_type} *)r->out[{outputs.index(name)}]", dtype)
    elif name in em.values:
        value = em.values[name]
        value.shape = shape
    else:
        size: DimLike = _itemsize(dtype)
        for d in shape:
            size = symbolic.mul(size, d)
        em.extra_blocks.append(Block(name, size, step, _last_use(em, name, step)))
        index = len(em.plan.arena.blocks if em.plan.arena else ()) + len(em.extra_blocks) - 1
        value = _Value(name, shape, f"({c_type} *)(r->arena + r->off[{index}])", dtype)
    em.values[name] = value
    return value


def _last_use(em: _Emitter, name: str, step: int) -> int:
    """The last step reading `name` or a view of it."""
    aliases, last = {name}, step
    for k, node in enumerate(em.plan.graph.nodes[step + 1:], start=step + 1):
        if any(i in aliases for i in node.inputs):
            last = k
            if node.op_type in _VIEWS and node.inputs[0] in aliases:
                aliases.update(o for o in node.outputs if o)
    if any(o.name in aliases for o in em.plan.graph.outputs):
        last = len(em.plan.graph.nodes)
    return last


def _elements(shape: tuple[DimLike, ...]) -> DimLike:
    n: DimLike = 1
    for d in shape:
        n = symbolic.mul(n, d)
    return n


def _known_value(em: _Emitter, name: str, facts) -> np.ndarray | None:
    """A value fixed at compile time: a constant, a folded node's output, or shape arithmetic at the fixed dims."""
    array = _const(em, name)
    if array is None and facts.get(name) is not None:
        array = facts[name].value
    if array is not None and array.dtype == object:  # dims as expressions: known once every symbol is fixed
        fixed = {Sym(k): v for k, v in em.fixed.items()}
        values = [symbolic.evaluate(v, fixed) if not isinstance(v, (int, np.integer)) else v for v in array.flat]
        if not all(isinstance(v, (int, np.integer)) for v in values):
            return None
        array = np.array(values, dtype=np.int64).reshape(array.shape)
    return array


def _known_or_folded(em: _Emitter, name: str) -> np.ndarray | None:
    """A constant, or the value a Constant/ConstantOfShape node of constant inputs makes (worked out ahead of its
    step, which _fold does later)."""
    array = _const(em, name)
    if array is not None:
        return array
    if not em.producers:
        em.producers.update((o, n) for n in em.plan.graph.nodes for o in n.outputs if o)
    node = em.producers.get(name)
    if node is None or node.domain or node.op_type not in ("Constant", "ConstantOfShape"):
        return None
    from carrack.ops.registry import resolve

    inputs = [_known_value(em, i, em.facts) for i in node.inputs if i]
    kernel_class, version = resolve("", node.op_type, em.plan.model.opsets.get("", 1))
    if kernel_class is None or any(v is None for v in inputs):
        return None
    try:
        value = kernel_class(node, version).run(*inputs)
    except Exception:  # a malformed node: left to its own step, whose emitter names it
        return None
    value = value[0] if isinstance(value, tuple) else value
    return np.asarray(value) if node.outputs[0] == name else None


def _fold(em: _Emitter, node: Node, facts) -> bool:
    """Evaluate a node whose inputs are all known at compile time with carrack's own kernel (a mask built from
    the fixed sequence length, a class token expanded to the fixed batch): its outputs become constants, and only
    the float32 ones that a compiled step reads reach the weights file."""
    from carrack.ops.registry import resolve

    inputs = [_known_value(em, name, facts) if name else None for name in node.inputs]
    if not node.inputs or any(name and value is None for name, value in zip(node.inputs, inputs)):
        return False
    kernel_class, version = resolve(node.domain or "", node.op_type, em.plan.model.opsets.get(node.domain or "", 1))
    if kernel_class is None or not kernel_class.pure:
        return False
    try:
        results = kernel_class(node, version).run(*inputs)
    except Exception:  # a kernel that needs a session's context: leave the node to its emitter
        return False
    results = results if isinstance(results, tuple) else (results,)
    for name, value in zip(node.outputs, results):
        if name and isinstance(value, np.ndarray):
            em.constants[name] = value
            em.values[name] = _Value(name, tuple(value.shape), "", _dtype_of_array(value) or "float32")
    return True


def _emit_node(em: _Emitter, step: int, node: Node, facts) -> None:
    if step in em.skipped:
        return
    node = em.replaced.get(step, node)
    op = node.op_type
    if op != "Constant" and _fold(em, node, facts):
        return
    emitter = _typed_emitter(em, node, facts)
    emitter = emitter or _EMITTERS.get((node.domain or "", op)) or _EMITTERS.get(("*", op))
    if emitter is None:
        em.missing.append((f"{op}" + (f" (domain '{node.domain}')" if node.domain else ""), node.label()))
        return
    out_facts = [facts.get(o) for o in node.outputs if o]
    any_type = emitter in _any_type_emitters()
    if any(f is None or f.shape is None or f.elem_type != 1 and not (any_type and f.elem_type in ELEMENT_TYPES)
           for f in out_facts):
        kinds = "outputs of a compiled element type" if any_type else "float32 outputs"
        em.missing.append((op, f"{node.label()}: only {kinds} of known shape are compiled"))
        return
    shapes = {name: tuple(facts[name].shape) for name in node.inputs if name and facts.get(name) is not None
              and facts[name].shape is not None}
    try:
        body = emitter(em, step, node, shapes, tuple(facts[node.outputs[0]].shape))
    except _Unsupported as e:
        em.missing.append((op, f"{node.label()}: {e}"))
        return
    except _Skipped:
        return
    if body is None:
        return
    label = node.name or node.outputs[0]
    function = f"step_{step:03d}_{_identifier(op)}_{_identifier(label)}"[:80]
    if any("run_status" in line for line in body):
        em.failing_steps.add(function)
    comment = f"step {step}: {op} {node.name or ''} ({', '.join(node.inputs)} -> {', '.join(node.outputs)})"
    em.steps.append((function, comment.replace("*/", "* /"), body))


class _Unsupported(Exception):
    pass


class _Skipped(Exception):
    """A node reading a value no emitter produced: the producer is the one to list."""


def _require_known(em: _Emitter, names) -> None:
    """Inputs of any element type must have been produced (or be constants of a compiled type)."""
    for name in names:
        if name and name not in em.values:
            derived = next((d for d in em.plan.derived if d.name == name), None)
            if derived is None:
                raise _Skipped()  # its producer is listed already
            from carrack.backends.c.emit_values import materialize_derived

            materialize_derived(em, derived)
        if name and em.values[name].dtype not in C_TYPES:
            raise _Unsupported(f"input '{name}' has element type {em.values[name].dtype}")


def _require_float(em: _Emitter, node: Node, names) -> None:
    for name in names:
        if name and _const(em, name) is not None and _const(em, name).dtype != np.float32:
            raise _Unsupported(f"input '{name}' is not float32")
        if name and name in em.values and em.values[name].dtype != "float32":
            raise _Unsupported(f"input '{name}' is {em.values[name].dtype}, not float32")
        if name and name not in em.values:
            if any(d.name == name for d in em.plan.derived):
                raise _Unsupported(f"input '{name}' is shape arithmetic computed from the dims at run time")
            raise _Skipped()  # its producer is listed already


def _f(x: float) -> str:
    if math.isinf(x):
        return "INFINITY" if x > 0 else "-INFINITY"
    return f"{float(np.float32(x))!r}f"


def _activation(node: Node) -> tuple[str, float, float]:
    name = node.attrs.get("activation", "")
    if name not in _ACTIVATIONS:
        raise _Unsupported(f"fused activation '{name}'")
    if "activation_alpha" in node.attrs or "activation_beta" in node.attrs:
        params = [node.attrs[k] for k in ("activation_alpha", "activation_beta") if k in node.attrs]
    else:
        params = list(node.attrs.get("activation_params", []))
    default = _DEFAULT_PARAMS.get(name, (0.0, 0.0))
    a = float(params[0]) if len(params) > 0 else default[0]
    b = float(params[1]) if len(params) > 1 else default[1]
    return _ACTIVATIONS[name], a, b


# emitters: (emitter, step, node, input shapes, output shape) -> C body lines ---------------------------------------

def _emit_constant(em, step, node, shapes, out_shape):
    if "value" in node.attrs:
        value = np.asarray(node.attrs["value"])
    elif "value_float" in node.attrs or "value_floats" in node.attrs:
        value = np.asarray(node.attrs.get("value_float", node.attrs.get("value_floats")), dtype=np.float32)
    else:
        raise _Unsupported(f"Constant with {sorted(node.attrs)}")
    if _dtype_of_array(value) is None:
        raise _Unsupported(f"a {value.dtype} Constant")
    em.constants[node.outputs[0]] = value
    em.values[node.outputs[0]] = _Value(node.outputs[0], tuple(value.shape), "", _dtype_of_array(value))
    return None


def _emit_constant_of_shape(em, step, node, shapes, out_shape):
    """A constant-filled tensor of a constant shape: a constant of the weights file."""
    if not all(isinstance(d, (int, np.integer)) for d in out_shape):
        raise _Unsupported("a shape that depends on the run-time dims")
    fill = node.attrs.get("value")
    fill = np.zeros(1, np.float32) if fill is None else np.asarray(fill).reshape(-1)
    if _dtype_of_array(fill) is None:
        raise _Unsupported(f"a {fill.dtype} fill value")
    value = np.full(tuple(int(d) for d in out_shape), fill[0], dtype=fill.dtype)
    em.constants[node.outputs[0]] = value
    em.values[node.outputs[0]] = _Value(node.outputs[0], tuple(value.shape), "", _dtype_of_array(value))
    return None


def _emit_view(em, step, node, shapes, out_shape):
    source = node.inputs[0]
    _require_known(em, [source])
    value = em.values[source]
    if not value.pointer:
        _pointer(em, source)
    outputs = [o.name for o in em.plan.graph.outputs]
    name = node.outputs[0]
    if name in outputs:  # the caller's buffer: copy
        target = _output_value(em, step, name, out_shape, value.dtype)
        return [f"memcpy({target.pointer}, {value.pointer}, (size_t)({em.c_dim(_elements(out_shape))}) * "
                f"{_itemsize(value.dtype)});"]
    em.values[name] = _Value(name, out_shape, value.pointer, value.dtype)
    return None


def _emit_unary(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    _require_float(em, node, [x])
    act, (a, b) = _ACTIVATIONS[node.op_type], _DEFAULT_PARAMS.get(node.op_type, (0.0, 0.0))
    if node.op_type in ("LeakyRelu", "Elu"):
        a = float(node.attrs.get("alpha", a))
    elif node.op_type == "HardSigmoid":
        a, b = float(node.attrs.get("alpha", 0.2)), float(node.attrs.get("beta", 0.5))
    elif node.op_type == "Clip":
        a, b = _clip_bounds(em, node)
    elif node.op_type == "Gelu" and node.attrs.get("approximate", "none") != "none":
        raise _Unsupported("Gelu with approximate='tanh'")
    y = _output_value(em, step, node.outputs[0], out_shape)
    return [f"cr_unary({_pointer(em, x)}, {y.pointer}, {em.c_dim(_elements(out_shape))}, {act}, {_f(a)}, {_f(b)});"]


def _clip_bounds(em, node) -> tuple[float, float]:
    if "min" in node.attrs or "max" in node.attrs:
        return float(node.attrs.get("min", -math.inf)), float(node.attrs.get("max", math.inf))
    bounds = []
    for k, default in ((1, -math.inf), (2, math.inf)):
        name = node.inputs[k] if len(node.inputs) > k else ""
        if not name:
            bounds.append(default)
            continue
        value = _const(em, name)
        if value is None or value.size != 1:
            raise _Unsupported(f"Clip bound '{name}' is not a constant scalar")
        bounds.append(float(value.reshape(())))
    return bounds[0], bounds[1]


def _broadcast_strides(shape: tuple[DimLike, ...], out_shape: tuple[DimLike, ...]) -> list[DimLike]:
    """Element strides of a tensor of `shape` over `out_shape`'s dims padded to MAX_RANK (0 where broadcast)."""
    padded = (1,) * (MAX_RANK - len(shape)) + tuple(shape)
    out = (1,) * (MAX_RANK - len(out_shape)) + tuple(out_shape)
    strides: list[DimLike] = [0] * MAX_RANK
    step: DimLike = 1
    for d in range(MAX_RANK - 1, -1, -1):
        strides[d] = 0 if padded[d] == 1 and out[d] != 1 else step
        step = symbolic.mul(step, padded[d])
    return strides


def _c_array(em: _Emitter, name: str, dims) -> str:
    return f"const int64_t {name}[{len(dims)}] = {{{', '.join(em.c_dim(d) for d in dims)}}};"


def _emit_binary(em, step, node, shapes, out_shape):
    a, b = node.inputs[:2]
    _require_float(em, node, [a, b])
    if len(out_shape) > MAX_RANK:
        raise _Unsupported(f"rank {len(out_shape)} above {MAX_RANK}")
    pa, pb = _pointer(em, a), _pointer(em, b)
    shape_a = shapes.get(a, em.values[a].shape)
    shape_b = shapes.get(b, em.values[b].shape)
    y = _output_value(em, step, node.outputs[0], out_shape)
    padded = (1,) * (MAX_RANK - len(out_shape)) + tuple(out_shape)
    return [_c_array(em, "shape", padded), _c_array(em, "sa", _broadcast_strides(shape_a, out_shape)),
            _c_array(em, "sb", _broadcast_strides(shape_b, out_shape)),
            f"cr_binary({_BINARY[node.op_type]}, {pa}, sa, {pb}, sb, {y.pointer}, shape);"]


def _emit_bias_gelu(em, step, node, shapes, out_shape):
    """com.microsoft BiasGelu: gelu(x + bias), the sum written then activated in place."""
    lines = _emit_binary(em, step, Node("Add", node.inputs[:2], node.outputs, name=node.name), shapes, out_shape)
    y = em.values[node.outputs[0]].pointer
    return lines + [f"cr_unary({y}, {y}, {em.c_dim(_elements(out_shape))}, CR_ACT_GELU, 0.0f, 0.0f);"]


def _emit_sum(em, step, node, shapes, out_shape):
    """Sum of any number of inputs: the first two added, then each next one added in place."""
    names = [i for i in node.inputs if i]
    if len(names) == 1:
        return _emit_unary(em, step, Node("Identity", names, node.outputs, name=node.name), shapes, out_shape)
    lines = _emit_binary(em, step, Node("Add", names[:2], node.outputs, name=node.name), shapes, out_shape)
    for name in names[2:]:
        _require_float(em, node, [name])
        y = em.values[node.outputs[0]]
        strides = _broadcast_strides(shapes.get(name, em.values[name].shape), out_shape)
        lines += ["{", "    " + _c_array(em, "sn", strides),
                  f"    cr_binary(CR_ADD, {y.pointer}, sa_out, {_pointer(em, name)}, sn, {y.pointer}, shape);", "}"]
    if len(names) > 2:
        lines.insert(3, _c_array(em, "sa_out", _broadcast_strides(out_shape, out_shape)))
    return lines


def _emit_lrn(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    _require_float(em, node, [x])
    x_shape = shapes[x]
    y = _output_value(em, step, node.outputs[0], out_shape)
    size = int(node.attrs["size"])
    alpha, beta = float(node.attrs.get("alpha", 1e-4)), float(node.attrs.get("beta", 0.75))
    bias = float(node.attrs.get("bias", 1.0))
    return [f"cr_lrn({_pointer(em, x)}, {y.pointer}, {em.c_dim(x_shape[0])}, {em.c_dim(x_shape[1])}, "
            f"{em.c_dim(_elements(x_shape[2:]))}, {size}, {_f(alpha)}, {_f(beta)}, {_f(bias)});"]


def _conv_geometry(node: Node, x_shape, w_shape) -> dict:
    spatial = len(x_shape) - 2
    if spatial not in (1, 2):
        raise _Unsupported(f"{spatial}-D convolution (1-D and 2-D are compiled)")
    if node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise _Unsupported(f"auto_pad {node.attrs['auto_pad']}")
    kernel = list(node.attrs.get("kernel_shape", w_shape[2:]))
    strides = list(node.attrs.get("strides", [1] * spatial))
    dilations = list(node.attrs.get("dilations", [1] * spatial))
    pads = list(node.attrs.get("pads", [0] * 2 * spatial))
    if node.attrs.get("auto_pad") == "VALID":
        pads = [0] * 2 * spatial
    if spatial == 1:  # a 1-D convolution is a 2-D one over rows of height 1
        kernel, strides, dilations = [1] + kernel, [1] + strides, [1] + dilations
        pads = [0, pads[0], 0, pads[1]]
    return {"k": kernel, "s": strides, "d": dilations, "p": pads, "spatial": spatial}


def _hw(shape, spatial):
    return (1, shape[2]) if spatial == 1 else (shape[2], shape[3])


def _emit_conv(em, step, node, shapes, out_shape):
    x, w = node.inputs[:2]
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else ""
    z = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3] else ""
    _require_float(em, node, [x, w, bias, z])
    w_array = _const(em, w)
    if w_array is None:
        raise _Unsupported("weights that are not a constant")
    x_shape = shapes[x]
    g = _conv_geometry(node, x_shape, w_array.shape)
    if z and tuple(shapes.get(z, ())) != tuple(out_shape):
        raise _Unsupported("a residual Z that is broadcast")
    act, a, b = _activation(node) if node.op_type == "FusedConv" else ("CR_ACT_NONE", 0.0, 0.0)
    y = _output_value(em, step, node.outputs[0], out_shape)
    h, wd = _hw(x_shape, g["spatial"])
    oh, ow = _hw(out_shape, g["spatial"])
    groups = int(node.attrs.get("group", 1))
    if em.native_kernels:
        dims = dict(zip(("n", "c", "h", "w", "m", "oh", "ow"), (x_shape[0], x_shape[1], h, wd, out_shape[1], oh, ow)))
        lines = emit_native.conv_lines(em, _pointer(em, x), w, w_array, _pointer(em, bias) if bias else "",
                                       _pointer(em, z) if z else "", y.pointer, dims, g, groups, (act, a, b))
        if lines:
            em.uses_native = True
            return lines
    short_rows = not isinstance(ow, int) or ow < SHORT_ROW or g["s"][1] != 1  # rows that vectorize poorly
    if groups == x_shape[1] == out_shape[1]:  # depthwise
        kernel, weights = "cr_dwconv2d", _pointer(em, w)
    elif w_array.shape[0] // groups >= PACKED_GEMM_MIN:  # weights as stored are the product's A
        kernel, weights = "cr_conv2d_gemm", _pointer(em, w)
    elif w_array.shape[0] // groups >= CHANNEL_VECTORIZED_MIN and short_rows:  # vectorize over the channels
        m_out, cg = w_array.shape[:2]
        reordered = w_array.reshape(groups, m_out // groups, cg, -1).transpose(0, 2, 3, 1)
        kernel, weights = "cr_conv2d_cm", em.constant(f"{w}::channels_last", reordered)
    else:
        kernel, weights = "cr_conv2d", _pointer(em, w)
    args = [_pointer(em, x), weights, _pointer(em, bias) if bias else "NULL",
            _pointer(em, z) if z else "NULL", y.pointer,
            *(em.c_dim(d) for d in (x_shape[0], x_shape[1], h, wd, out_shape[1], oh, ow)),
            *map(str, (*g["k"], *g["s"], *g["d"], g["p"][0], g["p"][1], groups)), act, _f(a), _f(b)]
    return [f"{kernel}({', '.join(args[:5])},", f"          {', '.join(args[5:12])},",
            f"          {', '.join(args[12:])});"]


def _emit_inverted_residual(em, step, node, shapes, out_shape):
    """carrack.InvertedResidual (MobileNetV2's fused block, in plans made for native libraries with the session
    kernels): one invres.c call, or where it does not take the node its three convolutions, the two intermediate
    maps in blocks of their own."""
    from carrack.passes.fusions import inverted_residual_parts

    x = node.inputs[0]
    _require_float(em, node, [name for name in node.inputs if name])
    y = _output_value(em, step, node.outputs[0], out_shape)
    lines = emit_native.block_lines(em, step, node, tuple(shapes[x]), y.pointer) if em.native_kernels else None
    if lines:
        em.uses_native = em.uses_blocks = True
        return lines
    lines, x_shape = [], tuple(shapes[x])
    for part in inverted_residual_parts(node):
        w_shape = np.shape(_const(em, part.inputs[1]))
        if not w_shape:
            raise _Unsupported("weights that are not a constant")
        expansion = part.inputs[0] == x and list(part.attrs["kernel_shape"]) == [1, 1]
        part_shape = (x_shape[0], w_shape[0], *(x_shape[2:] if expansion else out_shape[2:]))
        known = {i: em.values[i].shape for i in part.inputs if i in em.values}
        lines += _emit_conv(em, step, part, {**known, **shapes}, part_shape)
    return lines


def _emit_batchnorm(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    params = [_const(em, name) for name in node.inputs[1:5]]
    if any(p is None for p in params) or len(node.outputs) > 1 and any(node.outputs[1:]):
        raise _Unsupported("training mode or parameters that are not constants")
    _require_float(em, node, [x])
    scale, shift_b, mean, var = (p.astype(np.float64) for p in params)
    eps = float(node.attrs.get("epsilon", 1e-5))
    factor = scale / np.sqrt(var + eps)
    key = f"{node.outputs[0]}::affine"
    ps = em.constant(key + ".scale", factor.astype(np.float32))
    pt = em.constant(key + ".shift", (shift_b - mean * factor).astype(np.float32))
    act, a, b = _activation(node) if node.op_type == "FusedBatchNormalization" else ("CR_ACT_NONE", 0.0, 0.0)
    y = _output_value(em, step, node.outputs[0], out_shape)
    x_shape = shapes[x]
    inner = _elements(x_shape[2:])
    return [f"cr_affine({_pointer(em, x)}, {ps}, {pt}, {y.pointer}, {em.c_dim(x_shape[0])}, "
            f"{em.c_dim(x_shape[1])}, {em.c_dim(inner)}, {act}, {_f(a)}, {_f(b)});"]


def _pool_geometry(node: Node, x_shape) -> tuple[int, list[int], list[int], list[int], list[int]]:
    """(spatial rank, kernel, strides, dilations, pads) of a 1-D or 2-D pool, a 1-D one as 2-D of height 1."""
    spatial = len(x_shape) - 2
    if spatial not in (1, 2) or node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise _Unsupported("pooling other than 1-D/2-D with explicit pads")
    kernel = list(node.attrs["kernel_shape"])
    strides = list(node.attrs.get("strides", [1] * spatial))
    dilations = list(node.attrs.get("dilations", [1] * spatial))
    pads = list(node.attrs.get("pads", [0] * 2 * spatial))
    if node.attrs.get("auto_pad") == "VALID":
        pads = [0] * 2 * spatial
    if spatial == 1:
        kernel, strides, dilations, pads = [1] + kernel, [1] + strides, [1] + dilations, [0, pads[0], 0, pads[1]]
    return spatial, kernel, strides, dilations, pads


def _emit_pool(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    _require_float(em, node, [x])
    if len(node.outputs) > 1 and any(node.outputs[1:]):
        raise _Unsupported("MaxPool's Indices output")
    if node.attrs.get("storage_order", 0):
        raise _Unsupported("storage_order 1")
    x_shape = shapes[x]
    spatial, kernel, strides, dilations, pads = _pool_geometry(node, x_shape)
    y = _output_value(em, step, node.outputs[0], out_shape)
    h, wd = _hw(x_shape, spatial)
    oh, ow = _hw(out_shape, spatial)
    is_max = int(node.op_type == "MaxPool")
    count_pad = int(node.attrs.get("count_include_pad", 0))
    if em.native_kernels:
        em.uses_native = True
        return emit_native.pool_lines(em, _pointer(em, x), y.pointer, symbolic.mul(x_shape[0], x_shape[1]), h, wd,
                                      oh, ow, kernel, strides, dilations, pads, bool(is_max), bool(count_pad))
    args = [_pointer(em, x), y.pointer, em.c_dim(symbolic.mul(x_shape[0], x_shape[1])),
            *(em.c_dim(d) for d in (h, wd, oh, ow)), *map(str, (*kernel, *strides, *dilations, *pads)),
            str(is_max), str(count_pad)]
    return [f"cr_pool2d({', '.join(args[:7])},", f"          {', '.join(args[7:])});"]


def _emit_global_pool(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    _require_float(em, node, [x])
    x_shape = shapes[x]
    y = _output_value(em, step, node.outputs[0], out_shape)
    planes = symbolic.mul(x_shape[0], x_shape[1])
    return [f"cr_global_pool({_pointer(em, x)}, {y.pointer}, {em.c_dim(planes)}, {em.c_dim(_elements(x_shape[2:]))}, "
            f"{int(node.op_type == 'GlobalMaxPool')});"]


def _emit_reduce_trailing(em, step, node, shapes, out_shape):
    """ReduceMean/ReduceMax over trailing axes (a global pool of the leading dims' planes)."""
    x = node.inputs[0]
    _require_float(em, node, [x])
    x_shape = shapes[x]
    if len(node.inputs) > 1 and node.inputs[1]:
        axes_array = _const(em, node.inputs[1])
        if axes_array is None:
            raise _Unsupported("axes that are not a constant")
        axes = [int(a) for a in axes_array.reshape(-1)]
    else:
        axes = [int(a) for a in node.attrs.get("axes", [])]
    rank = len(x_shape)
    axes = sorted(a % rank for a in axes) if axes else list(range(rank))
    if not axes or axes != list(range(rank - len(axes), rank)):
        raise _Unsupported(f"axes {axes} are not the trailing dims of a rank-{rank} input")
    y = _output_value(em, step, node.outputs[0], out_shape)
    planes, size = _elements(x_shape[:rank - len(axes)]), _elements(x_shape[rank - len(axes):])
    return [f"cr_global_pool({_pointer(em, x)}, {y.pointer}, {em.c_dim(planes)}, {em.c_dim(size)}, "
            f"{int(node.op_type == 'ReduceMax')});"]


def _emit_layer_norm(em, step, node, shapes, out_shape):
    """LayerNormalization over the last axis, and com.microsoft's SkipLayerNormalization (x + skip + bias, with
    the sum as an optional fourth output); the mean and inverse deviation outputs are not compiled."""
    skip_form = node.op_type == "SkipLayerNormalization"
    names = list(node.inputs) + [""] * 5
    x, skip, gamma, beta, bias = (names[:5] if skip_form else [names[0], "", names[1], names[2], ""])
    _require_float(em, node, [x, skip, gamma, beta, bias])
    x_shape = tuple(shapes[x])
    axis = int(node.attrs.get("axis", -1))
    if not skip_form and axis % max(1, len(x_shape)) != len(x_shape) - 1:
        raise _Unsupported(f"axis {axis}: only the last axis is compiled")
    if any(node.outputs[1:3]):
        raise _Unsupported("the mean and inverse standard deviation outputs")
    hidden = x_shape[-1]
    for name in (gamma, beta, bias):
        if name and tuple(shapes.get(name, ())) not in ((hidden,), (1,) * (len(shapes.get(name, ())) - 1) + (hidden,)):
            raise _Unsupported(f"'{name}' of shape {shapes.get(name)}: expected [{hidden}]")
    if skip and tuple(shapes[skip]) != x_shape:
        raise _Unsupported("a skip input broadcast to the input's shape")
    epsilon = float(node.attrs.get("epsilon", 1e-12 if skip_form else 1e-5))
    y = _output_value(em, step, node.outputs[0], out_shape)
    total = "NULL"
    if skip_form and len(node.outputs) > 3 and node.outputs[3]:
        total = _output_value(em, step, node.outputs[3], x_shape).pointer
    pointers = [_pointer(em, n) if n else "NULL" for n in (x, skip, bias, gamma, beta)]
    rows = _elements(x_shape[:-1])
    return [f"cr_layer_norm({', '.join(pointers)},",
            f"              {y.pointer}, {total}, {em.c_dim(rows)}, {em.c_dim(hidden)}, {_f(epsilon)});"]


def _emit_attention(em, step, node, shapes, out_shape):
    """com.microsoft MultiHeadAttention with separate 3-D query, key and value and an optional additive attention
    bias; packed QKV, projection bias, key padding mask, past/present and unidirectional are not compiled."""
    names = list(node.inputs) + [""] * 8
    q, k, v, projection_bias, mask, attention_bias = names[:6]
    if projection_bias or mask or any(names[6:8]) or any(node.outputs[1:]):
        raise _Unsupported("projection bias, key padding mask or past/present key and value")
    if int(node.attrs.get("unidirectional", 0)):
        raise _Unsupported("unidirectional (causal) attention")
    if not k or not v or any(len(shapes.get(n, ())) != 3 for n in (q, k, v)):
        raise _Unsupported("query, key and value that are not all 3-D (batch, sequence, hidden)")
    _require_float(em, node, [q, k, v, attention_bias])
    heads = int(node.attrs["num_heads"])
    (batch, s, d), (_, length, _), (_, _, dv) = shapes[q], shapes[k], shapes[v]
    if not all(isinstance(x, int) and x % heads == 0 for x in (d, dv)):
        raise _Unsupported(f"hidden sizes {d}, {dv} that are not fixed multiples of {heads} heads")
    hd, hv = d // heads, dv // heads
    bias_b = bias_h = "0"
    if attention_bias:
        b_shape = (1,) * (4 - len(shapes[attention_bias])) + tuple(shapes[attention_bias])
        if tuple(b_shape[2:]) != (s, length) or b_shape[1] not in (1, heads) or b_shape[0] not in (1, batch):
            raise _Unsupported(f"an attention bias of shape {list(shapes[attention_bias])}")
        plane = symbolic.mul(s, length)
        bias_h = em.c_dim(plane) if b_shape[1] == heads else "0"
        bias_b = em.c_dim(symbolic.mul(plane, b_shape[1])) if b_shape[0] == batch and batch != 1 else "0"
    scale = float(node.attrs.get("scale", 0.0)) or 1.0 / math.sqrt(hd)
    y = _output_value(em, step, node.outputs[0], out_shape)
    pointers = [_pointer(em, n) for n in (q, k, v)] + [_pointer(em, attention_bias) if attention_bias else "NULL"]
    return [f"cr_attention({', '.join(pointers)}, {bias_b}, {bias_h},",
            f"             {y.pointer}, {em.c_dim(batch)}, {em.c_dim(s)}, {em.c_dim(length)}, {heads}, {hd}, {hv}, "
            f"{_f(scale)});"]


def _emit_gemm(em, step, node, shapes, out_shape):
    a, b = node.inputs[:2]
    c = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else ""
    _require_float(em, node, [a, b, c])
    trans_a, trans_b = int(node.attrs.get("transA", 0)), int(node.attrs.get("transB", 0))
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    a_shape = shapes[a]
    b_array = _const(em, b)
    m, k = (a_shape[1], a_shape[0]) if trans_a else (a_shape[0], a_shape[1])
    n = shapes[b][0] if trans_b else shapes[b][1]
    b_matrix = None if b_array is None else b_array.T if trans_b else b_array  # a constant B as [K, N]
    trans_b = 0 if b_array is not None else trans_b
    a_row, a_col = ("1", em.c_dim(m)) if trans_a else (em.c_dim(k), "1")
    b_row, b_col = ("1", em.c_dim(k)) if trans_b else (em.c_dim(n), "1")
    cs_row, cs_col, pc = "0", "0", "NULL"
    if c:
        c_shape = (1,) * (2 - len(shapes[c])) + tuple(shapes[c])
        pc = _pointer(em, c)
        cs_col = "0" if c_shape[1] == 1 and n != 1 else "1"
        cs_row = "0" if c_shape[0] == 1 and m != 1 else em.c_dim(c_shape[1])
    act, fa, fb = _activation(node) if node.op_type == "FusedGemm" else ("CR_ACT_NONE", 0.0, 0.0)
    y = _output_value(em, step, node.outputs[0], out_shape)
    if alpha == 1.0 and (not c or beta == 1.0 and cs_col == "1" and cs_row in ("0", em.c_dim(n))):
        col_bias, z = (pc if cs_row == "0" else "NULL", pc if cs_row != "0" else "NULL") if c else ("NULL", "NULL")
        if b_matrix is not None and em.panel_width:
            return _prepacked_matmul(em, a, b, b_matrix, col_bias, z, y, m, a_row, a_col, act, fa, fb)
        pb = _gemm_b(em, b, b_array, b_matrix)
        return [f"cr_matmul_packed({_pointer(em, a)}, {pb}, {col_bias}, {z}, {y.pointer},",
                f"                 1, {em.c_dim(m)}, {em.c_dim(k)}, {em.c_dim(n)}, {a_row}, {a_col}, {b_row}, "
                f"{b_col}, 0, 0, {act}, {_f(fa)}, {_f(fb)});"]
    pb = _gemm_b(em, b, b_array, b_matrix)
    return [f"cr_gemm({_pointer(em, a)}, {pb}, {pc}, {y.pointer},",
            f"        1, {em.c_dim(m)}, {em.c_dim(k)}, {em.c_dim(n)}, {a_row}, {a_col}, {b_row}, {b_col}, 0, 0,",
            f"        {cs_row}, {cs_col}, {_f(alpha)}, {_f(beta)}, {act}, {_f(fa)}, {_f(fb)});"]


def _gemm_b(em, b: str, b_array, b_matrix) -> str:
    """Gemm's B pointer: a constant stored as [K, N] (transposed when transB) so rows are read contiguously."""
    if b_array is None:
        return _pointer(em, b)
    return _pointer(em, b) if b_matrix is b_array else em.constant(f"{b}::transposed", b_matrix)


def _emit_matmul(em, step, node, shapes, out_shape):
    a, b = node.inputs[:2]
    _require_float(em, node, [a, b])
    a_shape, b_shape = tuple(shapes[a]), tuple(shapes[b])
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise _Unsupported("MatMul of a 1-D operand")
    k, n = b_shape[-2], b_shape[-1]
    if len(b_shape) == 2:  # [.., M, K] x [K, N]: the leading dims of A are rows
        batch, m, a_batch, b_batch = 1, _elements(a_shape[:-1]), 0, 0
    elif a_shape[:-2] == b_shape[:-2]:
        batch, m = _elements(a_shape[:-2]), a_shape[-2]
        a_batch, b_batch = symbolic.mul(m, k), symbolic.mul(k, n)
    else:
        raise _Unsupported("MatMul with broadcast batch dims")
    act, fa, fb = _activation(node) if node.op_type == "FusedMatMul" else ("CR_ACT_NONE", 0.0, 0.0)
    y = _output_value(em, step, node.outputs[0], out_shape)
    b_array = _const(em, b)
    if b_array is not None and len(b_shape) == 2 and em.panel_width:
        return _prepacked_matmul(em, a, b, b_array, "NULL", "NULL", y, m, em.c_dim(k), "1", act, fa, fb)
    return [f"cr_matmul_packed({_pointer(em, a)}, {_pointer(em, b)}, NULL, NULL, {y.pointer},",
            f"        {em.c_dim(batch)}, {em.c_dim(m)}, {em.c_dim(k)}, {em.c_dim(n)}, {em.c_dim(k)}, 1, "
            f"{em.c_dim(n)}, 1, {em.c_dim(a_batch)}, {em.c_dim(b_batch)}, {act}, {_f(fa)}, {_f(fb)});"]


def _panels(matrix: np.ndarray, width: int) -> np.ndarray:
    """[k, n] as [ceil(n / width), k, width]: column panels, the last zero-padded (cr_bsrc's `panel` layout)."""
    k, n = matrix.shape
    count = -(-n // width)
    padded = np.zeros((k, count * width), np.float32)
    padded[:, :n] = matrix
    return padded.reshape(k, count, width).transpose(1, 0, 2)


def _prepacked_matmul(em, a, b, b_array, col_bias, z, y, m, a_row, a_col, act, fa, fb) -> list[str]:
    """y = act(a b + col_bias + z) with the constant b ([k, n]) written as the target's panels at compile time."""
    k, n = b_array.shape
    panels = em.constant(f"{b}::panels{em.panel_width}", _panels(b_array, em.panel_width))
    return [f"cr_matmul_prepacked({_pointer(em, a)}, {panels}, {em.panel_width}, {col_bias}, {z}, {y.pointer},",
            f"                    {em.c_dim(m)}, {k}, {n}, {a_row}, {a_col}, {act}, {_f(fa)}, {_f(fb)});"]


def _emit_softmax(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    _require_float(em, node, [x])
    x_shape = shapes[x]
    rank = len(x_shape)
    opset = node.opset or em.plan.model.opset(node.domain or "")
    axis = int(node.attrs.get("axis", -1 if opset >= 13 else 1)) % rank
    if opset < 13:  # softmax over the flattened dims from axis on
        outer, size, inner = _elements(x_shape[:axis]), _elements(x_shape[axis:]), 1
    else:
        outer, size, inner = _elements(x_shape[:axis]), x_shape[axis], _elements(x_shape[axis + 1:])
    y = _output_value(em, step, node.outputs[0], out_shape)
    return [f"cr_softmax({_pointer(em, x)}, {y.pointer}, {em.c_dim(outer)}, {em.c_dim(size)}, {em.c_dim(inner)}, "
            f"{int(node.op_type == 'LogSoftmax')});"]


def _emit_concat(em, step, node, shapes, out_shape):
    if node.outputs[0] in em.elided:
        return None  # its parts are written in place
    names = [i for i in node.inputs if i]
    _require_float(em, node, names)
    axis = int(node.attrs["axis"]) % len(out_shape)
    y = _output_value(em, step, node.outputs[0], out_shape)
    outer = _elements(out_shape[:axis])
    whole = _elements(out_shape[axis:])
    lines, offset = [], 0
    for name in names:
        part = _elements(tuple(shapes.get(name, em.values[name].shape))[axis:])
        lines.append(f"cr_concat_part({_pointer(em, name)}, {y.pointer}, {em.c_dim(outer)}, {em.c_dim(part)}, "
                     f"{em.c_dim(whole)}, {em.c_dim(offset)});")
        offset = symbolic.add(offset, part)
    return lines


def _emit_transpose(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    _require_float(em, node, [x])
    x_shape = tuple(shapes[x])
    rank = len(x_shape)
    if rank > MAX_RANK:
        raise _Unsupported(f"rank {rank} above {MAX_RANK}")
    perm = list(node.attrs.get("perm", range(rank - 1, -1, -1)))
    x_strides: list[DimLike] = [1] * rank
    for d in range(rank - 2, -1, -1):
        x_strides[d] = symbolic.mul(x_strides[d + 1], x_shape[d + 1])
    pad = MAX_RANK - rank
    shape = [1] * pad + list(out_shape)
    strides = [0] * pad + [x_strides[p] for p in perm]
    y = _output_value(em, step, node.outputs[0], out_shape)
    return [_c_array(em, "shape", shape), _c_array(em, "strides", strides),
            f"cr_transpose({_pointer(em, x)}, {y.pointer}, shape, strides);"]


_EMITTERS = {
    **{("*", op): _emit_view for op in _VIEWS}, ("", "Constant"): _emit_constant,
    ("", "ConstantOfShape"): _emit_constant_of_shape,
    **{("*", op): _emit_unary for op in ("Relu", "Clip", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish",
                                         "Elu", "Exp", "Neg", "Sqrt", "Abs")},
    ("com.microsoft", "Gelu"): _emit_unary, ("", "Gelu"): _emit_unary, ("com.microsoft", "BiasGelu"): _emit_bias_gelu,
    **{("*", op): _emit_binary for op in _BINARY},
    ("", "Conv"): _emit_conv, ("com.microsoft", "FusedConv"): _emit_conv, ("carrack", "FusedConv"): _emit_conv,
    ("carrack", "InvertedResidual"): _emit_inverted_residual,
    ("", "BatchNormalization"): _emit_batchnorm, ("carrack", "FusedBatchNormalization"): _emit_batchnorm,
    ("", "MaxPool"): _emit_pool, ("", "AveragePool"): _emit_pool,
    ("", "GlobalAveragePool"): _emit_global_pool, ("", "GlobalMaxPool"): _emit_global_pool,
    ("", "ReduceMean"): _emit_reduce_trailing, ("", "ReduceMax"): _emit_reduce_trailing,
    ("", "LayerNormalization"): _emit_layer_norm, ("com.microsoft", "LayerNormalization"): _emit_layer_norm,
    ("com.microsoft", "SkipLayerNormalization"): _emit_layer_norm,
    ("com.microsoft", "MultiHeadAttention"): _emit_attention,
    ("", "Gemm"): _emit_gemm, ("com.microsoft", "FusedGemm"): _emit_gemm, ("carrack", "FusedGemm"): _emit_gemm,
    ("", "MatMul"): _emit_matmul, ("carrack", "FusedMatMul"): _emit_matmul,
    ("", "Softmax"): _emit_softmax, ("", "LogSoftmax"): _emit_softmax,
    ("", "Sum"): _emit_sum, ("", "LRN"): _emit_lrn,
    ("", "Concat"): _emit_concat, ("", "Transpose"): _emit_transpose,
}
_EMITTERS = {(d if d != "ai.onnx" else "", op): f for (d, op), f in _EMITTERS.items()}


def supported_operators() -> list[str]:
    ops = {op if d in ("", "*") else f"{d}:{op}" for d, op in _EMITTERS}
    from carrack.backends.c import emit_quant, emit_values

    return sorted(ops | set(emit_values.OPERATORS) | set(emit_quant.OPERATORS))


# assembly ----------------------------------------------------------------------------------------------------------

def _assemble(em: _Emitter, embed_weights: bool = False) -> Emitted:
    plan = em.plan
    plan_blocks = list(plan.arena.blocks) if plan.arena else []
    plan_below = list(plan.arena.below) if plan.arena else []
    fixed = {Sym(k): v for k, v in em.fixed.items()}
    extra = order_blocks(em.extra_blocks, [Sym(s) for s in em.runtime]) if em.extra_blocks else None
    # order_blocks reorders: map our extra block indices (assigned in creation order) to its order
    extra_position = {}
    if extra is not None:
        for k, block in enumerate(extra.blocks):
            extra_position[em.extra_blocks.index(block)] = k
    sizes = [symbolic.evaluate(b.size, fixed) for b in plan_blocks]
    extra_sizes = [symbolic.evaluate(b.size, fixed) for b in (extra.blocks if extra else [])]
    n_plan = len(plan_blocks)
    layout = ["static int64_t layout(const int64_t *dims, int64_t *off) {"]
    layout.append(f"    int64_t end[{max(1, n_plan + len(extra_sizes))}], top = 0, base = 0;")
    for k, size in enumerate(sizes):
        layout.append(_layout_line(em, k, size, plan_below[k], 0))
    if extra is not None:
        layout.append("    base = top;  /* blocks of values the plan leaves to their kernels */")
        for k, size in enumerate(extra_sizes):
            layout.append(_layout_line(em, n_plan + k, size, tuple(n_plan + j for j in extra.below[k]), 1))
    layout += ["    (void)base;", "    return top;", "}"]
    capacity = _capacity(em, sizes, plan_below, extra_sizes, extra.below if extra else [])

    def renumber(line: str) -> str:  # extra blocks were numbered in creation order; the layout uses order_blocks'
        return re.sub(r"r->off\[(\d+)\]",
                      lambda m: f"r->off[{n_plan + extra_position[int(m.group(1)) - n_plan]}]"
                      if int(m.group(1)) >= n_plan else m.group(0), line)

    inputs = [_io_entry(em, v.name) for v in plan.inputs]
    outputs = [_io_entry(em, v.name) for v in plan.graph.outputs]
    n_blocks = n_plan + len(extra_sizes)
    lines = [
        "/* Generated by `carrack compile`: do not edit. */",
        f"/* model inputs: {_describe(inputs)} */",
        f"/* model outputs: {_describe(outputs)} */",
        f"#include \"{RUNTIME_HEADER}\"",
        f"#include \"{VALUES_HEADER}\"",
        f"#include \"{QUANT_HEADER}\"",
        *([f"#include \"{emit_native.NATIVE_HEADER}\""] if em.uses_native else []),
        "",
        f"#define MODEL_N_INPUTS {len(inputs)}",
        f"#define MODEL_N_OUTPUTS {len(outputs)}",
        f"#define MODEL_N_DIMS {len(em.runtime)}",
        f"#define MODEL_WEIGHT_BYTES {len(em.weights)}",
        f"#define MODEL_EMBEDDED_WEIGHTS {int(embed_weights)}  /* weights.bin assembled into the binary */",
        f"#define MODEL_ARENA_CAPACITY {capacity}  /* bytes, at the declared maxima */",
        "",
        "typedef struct {",
        "    const unsigned char *weights;",
        "    unsigned char *arena;",
        "    const int64_t *dims;",
        f"    int64_t off[{max(1, n_blocks)}];",
        "    const void *const *in;",
        "    void *const *out;",
        "} run_t;",
        "",
        *(_embedded_weights(len(em.weights)) if embed_weights else []),
        "static _Alignas(CR_ALIGN) unsigned char arena[MODEL_ARENA_CAPACITY > 0 ? MODEL_ARENA_CAPACITY : 1];",
        "static const unsigned char *model_weights;",
        "static int run_status;  /* set by a step that fails (model_run's error code) */",
        f"static const int64_t dim_maxima[{max(1, len(em.runtime))}] = "
        f"{{{', '.join(str(em.maxima[s]) for s in em.runtime) or '0'}}};",
        "",
        *layout,
        "",
    ]
    for k, s in enumerate(em.runtime):
        lines.insert(lines.index("typedef struct {"), f"#define {_symbol_macro(s)} (dims[{k}])  /* {s} */")
    for function, comment, body in em.steps:
        lines.append(f"/* {comment} */")
        lines.append(f"static void {function}(const run_t *r) {{")
        if em.runtime:
            lines.append("    const int64_t *dims = r->dims;  /* the S_ macros read it */")
            lines.append("    (void)dims;")
        lines += [f"    {renumber(b)}" for b in body]
        lines += ["}", ""]
    lines += [
        "int model_init(const void *weights) {",
        "#if MODEL_EMBEDDED_WEIGHTS",
        "    if (!weights) weights = model_embedded_weights;",
        "#endif",
        "    if (((uintptr_t)weights) % CR_ALIGN != 0 && MODEL_WEIGHT_BYTES > 0) return 4;",
        "    model_weights = (const unsigned char *)weights;",
        "    return 0;",
        "}",
        "",
        "int64_t model_arena_bytes(const int64_t *dims) {",
        "    int64_t off[sizeof(((run_t *)0)->off) / sizeof(int64_t)];",
        "    return layout(dims, off);",
        "}",
        "",
        "int model_run(const int64_t *dims, const void *const *inputs, void *const *outputs) {",
        "    if (!model_weights && MODEL_WEIGHT_BYTES > 0) return 1;",
        "    for (int k = 0; k < MODEL_N_DIMS; k++)",
        "        if (dims[k] < 1 || dims[k] > dim_maxima[k]) return 2;",
        "    run_t run = {model_weights, arena, dims, {0}, inputs, outputs};",
        "    if (layout(dims, run.off) > MODEL_ARENA_CAPACITY) return 3;",
        "    const run_t *r = &run;",
        "    run_status = 0;",
        *[f"    {function}(r);" + (" if (run_status) return run_status;" if function in em.failing_steps else "")
          for function, _, _ in em.steps],
        "    return 0;",
        "}",
        "",
        *_output_shape_function(em),
        "",
        "int model_n_dims(void) { return MODEL_N_DIMS; }",
        "int64_t model_arena_capacity(void) { return MODEL_ARENA_CAPACITY; }",
        "",
        *_wasm_areas(em, inputs, outputs),
    ]
    manifest = {
        "format": "carrack-compiled/1",
        "dims": [{"name": s, "max": int(em.maxima[s])} for s in em.runtime],
        "fixed_dims": {k: int(v) for k, v in sorted(em.fixed.items())},
        "inputs": inputs,
        "outputs": outputs,
        "weights": {"file": "weights.bin", "bytes": len(em.weights), "alignment": ALIGNMENT,
                    "embedded": embed_weights},
        "arena_capacity": capacity,
        "run_errors": {str(k): v for k, v in RUN_ERRORS.items()},
        "steps": len(em.steps),
    }
    sources = emit_native.kernel_sources(em.uses_blocks) if em.uses_native else ()
    return Emitted("\n".join(lines) + "\n", bytes(em.weights), manifest, sources)


def _embedded_weights(size: int) -> list[str]:
    """weights.bin assembled into a read-only, 64-byte-aligned symbol of the library or module (no C array literal:
    the assembler copies the file's bytes, so a 100 MB model builds as fast as a 1 KB one)."""
    body = [".p2align 6", ".globl model_embedded_weights", "model_embedded_weights:", '.incbin \\"weights.bin\\"']
    wasm = ['.section .rodata.model_embedded_weights,\\"\\",@', ".type model_embedded_weights,@object", *body,
            f".size model_embedded_weights, {size}"]
    elf = ['.section .rodata.model_embedded_weights,\\"a\\"', ".hidden model_embedded_weights", *body, ".previous"]

    def block(directives: list[str]) -> str:
        return "__asm__(" + " ".join(f'"{d}\\n"' for d in directives) + ");"

    return ["#if defined(__wasm__)", block(wasm), "#elif defined(__ELF__)", block(elf), "#else",
            "#error \"embedded weights need an ELF or WebAssembly target: compile without --embed-weights\"",
            "#endif", "extern const unsigned char model_embedded_weights[];"]


def _describe(entries: list[dict]) -> str:
    return ", ".join(f"{e['name']} {e['shape']}".replace("*/", "* /") for e in entries)


def _layout_line(em: _Emitter, k: int, size: DimLike, below, extra: int) -> str:
    start = " ".join(f"if (end[{j}] > o) o = end[{j}];" for j in below)
    first = "base" if extra else "0"
    return (f"    {{ int64_t o = {first}; {start}{' ' if start else ''}off[{k}] = o; "
            f"end[{k}] = o + cr_align({em.c_dim(size)}); if (end[{k}] > top) top = end[{k}]; }}")


def _capacity(em: _Emitter, sizes, below, extra_sizes, extra_below) -> int:
    ends: list[int] = []
    top = 0
    for k, size in enumerate(sizes):
        end = max((ends[j] for j in below[k]), default=0) + align(em.at_maxima(size))
        ends.append(end)
        top = max(top, end)
    base = top
    for k, size in enumerate(extra_sizes):
        end = max((ends[len(sizes) + j] for j in extra_below[k]), default=base) + align(em.at_maxima(size))
        ends.append(end)
        top = max(top, end)
    return top


def _output_shape_function(em: _Emitter) -> list[str]:
    """model_output_shape(k, dims, shape): output k's shape for these run-time dims (its rank returned), so the
    loaders need not evaluate dims like (height - 1) / 2 + 1 themselves."""
    lines = ["int model_output_shape(int k, const int64_t *dims, int64_t *shape) {", "    (void)dims;",
             "    switch (k) {"]
    for k, v in enumerate(em.plan.graph.outputs):
        shape = em.values[v.name].shape
        assigns = " ".join(f"shape[{d}] = {em.c_dim(dim)};" for d, dim in enumerate(shape))
        lines.append(f"    case {k}: {assigns}{' ' if assigns else ''}return {len(shape)};")
    return lines + ["    default: return -1;", "    }", "}"]


def _io_entry(em: _Emitter, name: str) -> dict:
    shape = []
    for d in em.values[name].shape:
        d = symbolic.evaluate(d, {Sym(k): v for k, v in em.fixed.items()}) if not isinstance(d, int) else d
        shape.append(int(d) if isinstance(d, (int, np.integer)) else str(d))
    max_elements = em.at_maxima(_elements(tuple(em.values[name].shape)))
    return {"name": name, "dtype": em.values[name].dtype, "shape": shape, "max_elements": max_elements}


def _wasm_areas(em: _Emitter, inputs: list[dict], outputs: list[dict]) -> list[str]:
    """Static input, output and weights areas a WebAssembly host copies into (no allocation at run time)."""
    lines = ["#ifdef __wasm__", "/* areas the JavaScript loader fills and reads: the module never allocates */",
             "static _Alignas(CR_ALIGN) unsigned char weights_area[MODEL_WEIGHT_BYTES > 0 && "
             "!MODEL_EMBEDDED_WEIGHTS ? MODEL_WEIGHT_BYTES : 1];",
             f"static int64_t dims_area[{max(1, len(em.runtime))}];"]
    for kind, entries in (("input", inputs), ("output", outputs)):
        for k, entry in enumerate(entries):
            size = max(1, entry["max_elements"]) * _itemsize(entry["dtype"])
            lines.append(f"static _Alignas(CR_ALIGN) unsigned char {kind}_{k}[{size}];  /* {entry['name']} */")
    lines += [f"static const void *const input_areas[{max(1, len(inputs))}] = "
              f"{{{', '.join(f'input_{k}' for k in range(len(inputs))) or '0'}}};",
              f"static void *const output_areas[{max(1, len(outputs))}] = "
              f"{{{', '.join(f'output_{k}' for k in range(len(outputs))) or '0'}}};",
              "__attribute__((export_name(\"model_weights_area\"))) void *model_weights_area(void) "
              "{ return weights_area; }",
              "__attribute__((export_name(\"model_dims_area\"))) int64_t *model_dims_area(void) { return dims_area; }",
              "__attribute__((export_name(\"model_input_area\"))) const void *model_input_area(int k) "
              "{ return input_areas[k]; }",
              "__attribute__((export_name(\"model_output_area\"))) void *model_output_area(int k) "
              "{ return output_areas[k]; }",
              "__attribute__((export_name(\"model_init_area\"))) int model_init_area(void) "
              "{ return model_init(MODEL_EMBEDDED_WEIGHTS ? 0 : weights_area); }",
              "__attribute__((export_name(\"model_run_areas\"))) int model_run_areas(void) "
              "{ return model_run(dims_area, input_areas, output_areas); }",
              "__attribute__((export_name(\"model_arena_bytes_areas\"))) int64_t model_arena_bytes_areas(void) "
              "{ return model_arena_bytes(dims_area); }",
              f"static int64_t shape_area[{MAX_RANK_IO}];",
              "__attribute__((export_name(\"model_shape_area\"))) int64_t *model_shape_area(void) "
              "{ return shape_area; }",
              "__attribute__((export_name(\"model_output_shape_area\"))) int model_output_shape_area(int k) "
              "{ return model_output_shape(k, dims_area, shape_area); }",
              "#endif"]
    return lines


def manifest_json(manifest: dict) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def _typed_emitter(em: _Emitter, node: Node, facts):
    """The emitter of a node outside the float32 kernels (integer, bool and quantized values), where it has one."""
    from carrack.backends.c import emit_quant, emit_values

    return emit_quant.emitter_for(em, node, facts) or emit_values.emitter_for(em, node, facts)


def _any_type_emitters() -> set:
    """Emitters whose outputs may have any compiled element type (the others write float32)."""
    from carrack.backends.c import emit_quant, emit_values

    return emit_values.ANY_TYPE_EMITTERS | emit_quant.ANY_TYPE_EMITTERS | {_emit_view, _emit_constant,
                                                                             _emit_constant_of_shape}
