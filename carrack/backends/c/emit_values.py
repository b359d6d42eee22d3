"""Emitters for values of any element type (runtime/carrack_values.h): integer and bool tensors, embedding rows
gathered by index, a transformer's attention-mask chain, and values computed from the run-time dims (Range, Slice,
GatherND over them). `emit` asks `emitter_for` first for every node."""

from __future__ import annotations

import numpy as np

from carrack.backends.c.emit import (
    _BINARY,
    C_TYPES,
    ELEMENT_TYPES,
    MAX_RANK,
    _broadcast_strides,
    _c_array,
    _const,
    _dtype_of_array,
    _elements,
    _Emitter,
    _identifier,
    _itemsize,
    _last_use,
    _output_value,
    _pointer,
    _require_known,
    _Unsupported,
    _Value,
)
from carrack.ir import symbolic
from carrack.ir.graph import Node
from carrack.ir.symbolic import DimLike
from carrack.plan.arena import Block

# values of any element type (carrack_values.h): integer and bool tensors, embedding rows gathered by index -------

_COMPARISONS = {"Equal": "CR_EQ", "Less": "CR_LT", "LessOrEqual": "CR_LE", "Greater": "CR_GT",
                "GreaterOrEqual": "CR_GE"}
_LOGIC = {"And": "CR_AND", "Or": "CR_OR", "Xor": "CR_XOR"}


def _dtype(em: _Emitter, name: str, facts) -> str | None:
    if name in em.values:
        return em.values[name].dtype
    fact = facts.get(name)
    return None if fact is None else ELEMENT_TYPES.get(fact.elem_type)


def emitter_for(em: _Emitter, node: Node, facts):
    """The emitter of carrack_values.h's kernels for this node, where it has one: always for the ops that move or
    compare values of any type, and for Concat and integer arithmetic when a value is not float32."""
    op = node.op_type
    if (node.domain or "") not in ("", "ai.onnx"):
        return None
    if op in _ALWAYS_TYPED:
        return _ALWAYS_TYPED[op]
    names = [n for n in list(node.inputs) + list(node.outputs) if n]
    if op in _TYPED_WHEN_NOT_FLOAT and any(_dtype(em, n, facts) not in (None, "float32") for n in names):
        return _TYPED_WHEN_NOT_FLOAT[op]
    return None


def _shape_of(em: _Emitter, name: str, shapes) -> tuple[DimLike, ...]:
    return tuple(shapes.get(name, em.values[name].shape))


def _padded_shape(out_shape) -> tuple[DimLike, ...]:
    if len(out_shape) > MAX_RANK:
        raise _Unsupported(f"rank {len(out_shape)} above {MAX_RANK}")
    return (1,) * (MAX_RANK - len(out_shape)) + tuple(out_shape)


def _broadcast_lines(em: _Emitter, names: list[str], labels: list[str], shapes, out_shape) -> list[str]:
    lines = [_c_array(em, "shape", _padded_shape(out_shape))]
    for name, label in zip(names, labels):
        lines.append(_c_array(em, label, _broadcast_strides(_shape_of(em, name, shapes), out_shape)))
    return lines


def _cr_type(em: _Emitter, name: str) -> str:
    return C_TYPES[em.values[name].dtype][1]


def _emit_gather(em, step, node, shapes, out_shape):
    """Gather along an axis (embedding rows by token id): indices int64 or int32, negative ones counted from the
    end; an index out of range stops the run with error code 5."""
    data, indices = node.inputs[:2]
    _require_known(em, [data, indices])
    if em.values[indices].dtype not in ("int64", "int32"):
        raise _Unsupported(f"indices '{indices}' of type {em.values[indices].dtype} (int64 or int32 expected)")
    data_shape = _shape_of(em, data, shapes)
    axis = int(node.attrs.get("axis", 0)) % len(data_shape)
    dtype = em.values[data].dtype
    inner_bytes = symbolic.mul(_elements(data_shape[axis + 1:]), _itemsize(dtype))
    return _gather_lines(em, step, node.outputs[0], out_shape, dtype, _pointer(em, data), _pointer(em, indices),
                         _cr_type(em, indices), _elements(data_shape[:axis]), data_shape[axis], inner_bytes,
                         _elements(_shape_of(em, indices, shapes)))


def _gather_lines(em, step, name, out_shape, dtype, data, indices, index_type, outer, axis_size, inner_bytes,
                  count) -> list[str]:
    y = _output_value(em, step, name, out_shape, dtype)
    return [f"if (cr_gather({data}, {indices}, {index_type}, {y.pointer}, {em.c_dim(outer)}, {em.c_dim(axis_size)},",
            f"              {em.c_dim(inner_bytes)}, {em.c_dim(count)})) {{",
            "    run_status = 5;",
            "    return;",
            "}"]


def _emit_gather_nd(em, step, node, shapes, out_shape):
    """GatherND with constant indices (a mask chain's, fixed at the compiled dims): each index tuple becomes one
    flat row index at compile time, and the rows are gathered like Gather's."""
    data, indices = node.inputs[:2]
    _require_known(em, [data])
    if int(node.attrs.get("batch_dims", 0)):
        raise _Unsupported("batch_dims other than 0")
    index_array = _const(em, indices)
    if index_array is None:
        return _emit_gather_nd_runtime(em, step, node, shapes, out_shape)
    data_shape = _shape_of(em, data, shapes)
    depth = index_array.shape[-1]
    leading = data_shape[:depth]
    if not all(isinstance(d, (int, np.integer)) for d in leading):
        raise _Unsupported("indexed dims that are run-time dims")
    tuples = index_array.reshape(-1, depth).astype(np.int64)
    sizes = np.array([int(d) for d in leading], dtype=np.int64)
    if np.any(tuples < -sizes) or np.any(tuples >= sizes):
        raise _Unsupported(f"an index out of range of the data's dims {list(sizes)}")
    flat = np.ravel_multi_index(tuple((tuples % sizes).T), tuple(sizes)) if tuples.size else np.zeros(0, np.int64)
    pointer = em.typed_constant(f"{indices}::flat", flat.astype(np.int64), "int64")
    dtype = em.values[data].dtype
    inner_bytes = symbolic.mul(_elements(data_shape[depth:]), _itemsize(dtype))
    return _gather_lines(em, step, node.outputs[0], out_shape, dtype, _pointer(em, data), pointer, "CR_I64", 1,
                         int(np.prod(sizes)), inner_bytes, len(flat))


def _emit_cast(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    _require_known(em, [x])
    target = ELEMENT_TYPES.get(int(node.attrs["to"]))
    if target is None:
        raise _Unsupported(f"a cast to element type {node.attrs['to']}")
    y = _output_value(em, step, node.outputs[0], out_shape, target)
    return [f"cr_cast({_pointer(em, x)}, {_cr_type(em, x)}, {y.pointer}, {C_TYPES[target][1]}, "
            f"{em.c_dim(_elements(out_shape))});"]


def _emit_compare(em, step, node, shapes, out_shape):
    a, b = node.inputs[:2]
    _require_known(em, [a, b])
    lines = _broadcast_lines(em, [a, b], ["sa", "sb"], shapes, out_shape)
    pa, pb = _pointer(em, a), _pointer(em, b)
    y = _output_value(em, step, node.outputs[0], out_shape, "bool")
    return lines + [f"cr_compare({_COMPARISONS[node.op_type]}, {pa}, {_cr_type(em, a)}, sa, {pb}, {_cr_type(em, b)}, "
                    f"sb, {y.pointer}, shape);"]


def _require_bool(em, names) -> None:
    _require_known(em, names)
    for name in names:
        if em.values[name].dtype != "bool":
            raise _Unsupported(f"input '{name}' is {em.values[name].dtype}, not bool")


def _emit_logic(em, step, node, shapes, out_shape):
    a, b = node.inputs[:2]
    _require_bool(em, [a, b])
    lines = _broadcast_lines(em, [a, b], ["sa", "sb"], shapes, out_shape)
    pa, pb = _pointer(em, a), _pointer(em, b)
    y = _output_value(em, step, node.outputs[0], out_shape, "bool")
    return lines + [f"cr_logic({_LOGIC[node.op_type]}, {pa}, sa, {pb}, sb, {y.pointer}, shape);"]


def _emit_not(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    _require_bool(em, [x])
    y = _output_value(em, step, node.outputs[0], out_shape, "bool")
    return [f"cr_not({_pointer(em, x)}, {y.pointer}, {em.c_dim(_elements(out_shape))});"]


def _emit_where(em, step, node, shapes, out_shape):
    condition, a, b = node.inputs[:3]
    _require_bool(em, [condition])
    _require_known(em, [a, b])
    dtype = em.values[a].dtype
    if em.values[b].dtype != dtype:
        raise _Unsupported(f"branches of types {dtype} and {em.values[b].dtype}")
    lines = _broadcast_lines(em, [condition, a, b], ["sc", "sa", "sb"], shapes, out_shape)
    pc, pa, pb = _pointer(em, condition), _pointer(em, a), _pointer(em, b)
    y = _output_value(em, step, node.outputs[0], out_shape, dtype)
    return lines + [f"cr_where({pc}, sc, {pa}, sa, {pb}, sb, {y.pointer}, {_itemsize(dtype)}, shape);"]


def _emit_expand(em, step, node, shapes, out_shape):
    x = node.inputs[0]
    _require_known(em, [x])
    dtype = em.values[x].dtype
    lines = _broadcast_lines(em, [x], ["sx"], shapes, out_shape)
    px = _pointer(em, x)
    y = _output_value(em, step, node.outputs[0], out_shape, dtype)
    return lines + [f"cr_expand({px}, sx, {y.pointer}, {_itemsize(dtype)}, shape);"]


def _emit_concat_any(em, step, node, shapes, out_shape):
    names = [i for i in node.inputs if i]
    _require_known(em, names)
    dtype = em.values[names[0]].dtype
    if any(em.values[n].dtype != dtype for n in names):
        raise _Unsupported("inputs of different element types")
    axis = int(node.attrs["axis"]) % len(out_shape)
    y = _output_value(em, step, node.outputs[0], out_shape, dtype)
    size = _itemsize(dtype)
    outer, whole = _elements(out_shape[:axis]), symbolic.mul(_elements(out_shape[axis:]), size)
    lines, offset = [], 0
    for name in names:
        part = symbolic.mul(_elements(_shape_of(em, name, shapes)[axis:]), size)
        lines.append(f"cr_concat_bytes({_pointer(em, name)}, {y.pointer}, {em.c_dim(outer)}, {em.c_dim(part)}, "
                     f"{em.c_dim(whole)}, {em.c_dim(offset)});")
        offset = symbolic.add(offset, part)
    return lines


def _emit_binary_int(em, step, node, shapes, out_shape):
    """Add, Sub, Mul on integers of one type (wrapping like numpy's)."""
    a, b = node.inputs[:2]
    _require_known(em, [a, b])
    dtype = em.values[a].dtype
    if node.op_type == "Div" or dtype in ("float32", "bool") or em.values[b].dtype != dtype:
        raise _Unsupported(f"{node.op_type} of {dtype} and {em.values[b].dtype}")
    lines = _broadcast_lines(em, [a, b], ["sa", "sb"], shapes, out_shape)
    pa, pb = _pointer(em, a), _pointer(em, b)
    y = _output_value(em, step, node.outputs[0], out_shape, dtype)
    return lines + [f"cr_binary_int({_BINARY[node.op_type]}, {pa}, sa, {pb}, sb, {y.pointer}, {C_TYPES[dtype][1]}, "
                    "shape);"]


_ALWAYS_TYPED = {"Gather": _emit_gather, "GatherND": _emit_gather_nd, "Cast": _emit_cast, "Where": _emit_where,
                 "Expand": _emit_expand, "Not": _emit_not, **{op: _emit_compare for op in _COMPARISONS},
                 **{op: _emit_logic for op in _LOGIC}}
_TYPED_WHEN_NOT_FLOAT = {"Concat": _emit_concat_any, **{op: _emit_binary_int for op in _BINARY}}
#: emitters whose outputs may have any compiled element type
ANY_TYPE_EMITTERS = {*_ALWAYS_TYPED.values(), *_TYPED_WHEN_NOT_FLOAT.values()}


# values computed from the run-time dims (shape arithmetic): Range, Slice and GatherND over them -------------------

def materialize_derived(em: _Emitter, derived) -> None:
    """A value the plan computes from the dims alone (a sequence length, a shape), written into the arena by a
    first step from the run-time dims, for a kernel that reads it as data."""
    dtype = _dtype_of_array(np.empty(0, derived.dtype)) or "int64"
    size = max(1, len(derived.values)) * _itemsize(dtype)
    em.extra_blocks.append(Block(derived.name, size, 0, _last_use(em, derived.name, 0)))
    index = len(em.plan.arena.blocks if em.plan.arena else ()) + len(em.extra_blocks) - 1
    c_type = C_TYPES[dtype][0]
    pointer = f"({c_type} *)(r->arena + r->off[{index}])"
    em.values[derived.name] = _Value(derived.name, tuple(derived.shape), pointer, dtype)
    body = [f"{c_type} *v = {pointer};"]
    body += [f"v[{k}] = ({c_type})({em.c_dim(d)});" for k, d in enumerate(derived.values)]
    function = f"derived_{len([f for f, _, _ in em.steps if f.startswith('derived_')]):03d}_{_identifier(derived.name)}"
    em.steps.insert(0, (function[:80], f"{derived.name}: computed from the run-time dims", body))


def _dims_of(em: _Emitter, name: str) -> list[DimLike] | None:
    """A small integer value as dims (ints, or expressions of the run-time symbols): a constant, a value the plan
    derives from the dims, or one shape inference knows."""
    array = _const(em, name)
    if array is not None:
        return [int(v) for v in np.asarray(array).reshape(-1)] if np.asarray(array).dtype.kind in "iu" else None
    derived = next((d for d in em.plan.derived if d.name == name), None)
    if derived is not None:
        return list(derived.values)
    fact = em.facts.get(name)
    if fact is not None and fact.value is not None and fact.value.dtype.kind in "iuO":
        return list(fact.value.reshape(-1))
    return None


def _emit_range(em, step, node, shapes, out_shape):
    parts = [_dims_of(em, name) for name in node.inputs[:3]]
    if any(p is None or len(p) != 1 for p in parts):
        raise _Unsupported("start, limit and delta that are not known from the dims")
    dtype = ELEMENT_TYPES.get(em.facts[node.outputs[0]].elem_type)
    if dtype is None or dtype == "bool":
        raise _Unsupported(f"a Range of element type {em.facts[node.outputs[0]].elem_type}")
    y = _output_value(em, step, node.outputs[0], out_shape, dtype)
    start, delta = parts[0][0], parts[2][0]
    return [f"cr_range({y.pointer}, {C_TYPES[dtype][1]}, (double)({em.c_dim(start)}), (double)({em.c_dim(delta)}), "
            f"{em.c_dim(out_shape[0])});"]


def _emit_slice(em, step, node, shapes, out_shape):
    """Slice with starts, axes and steps known from the dims (ends only size the output, which facts give)."""
    x = node.inputs[0]
    _require_known(em, [x])
    x_shape = _shape_of(em, x, shapes)
    rank = len(x_shape)
    if rank > MAX_RANK or "starts" in node.attrs:
        raise _Unsupported("Slice of rank above 6 or with attribute starts (opset < 10)")
    starts = _dims_of(em, node.inputs[1])
    axes = _dims_of(em, node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else list(range(len(starts or [])))
    steps = _dims_of(em, node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1] * len(axes or [])
    if starts is None or axes is None or steps is None or not all(isinstance(a, int) for a in axes) \
            or not all(isinstance(s, int) and s != 0 for s in steps):
        raise _Unsupported("starts, axes or steps that are not known from the dims")
    full_starts: list[DimLike] = [0] * rank
    full_steps = [1] * rank
    for axis, start, stride in zip(axes, starts, steps):
        full_starts[axis % rank], full_steps[axis % rank] = start, stride
    pad = MAX_RANK - rank
    dtype = em.values[x].dtype
    lines = [_c_array(em, "x_shape", [1] * pad + list(x_shape)), _c_array(em, "starts", [0] * pad + full_starts),
             _c_array(em, "steps", [1] * pad + full_steps), _c_array(em, "shape", _padded_shape(out_shape))]
    px = _pointer(em, x)
    y = _output_value(em, step, node.outputs[0], out_shape, dtype)
    return lines + [f"cr_slice({px}, x_shape, starts, steps, {y.pointer}, shape, {_itemsize(dtype)});"]


def _emit_gather_nd_runtime(em, step, node, shapes, out_shape):
    """GatherND whose indices are computed at run time (int64, batch_dims 0): out-of-range indices stop the run."""
    data, indices = node.inputs[:2]
    _require_known(em, [data, indices])
    if em.values[indices].dtype != "int64" or int(node.attrs.get("batch_dims", 0)):
        raise _Unsupported("indices that are not int64, or batch_dims other than 0")
    index_shape = _shape_of(em, indices, shapes)
    depth = index_shape[-1]
    if not isinstance(depth, int):
        raise _Unsupported("an index depth that is a run-time dim")
    data_shape = _shape_of(em, data, shapes)
    dtype = em.values[data].dtype
    chunk = symbolic.mul(_elements(data_shape[depth:]), _itemsize(dtype))
    y = _output_value(em, step, node.outputs[0], out_shape, dtype)
    return [_c_array(em, "lead", list(data_shape[:depth]) or [1]),
            f"if (cr_gather_nd({_pointer(em, data)}, lead, {depth}, {_pointer(em, indices)}, "
            f"{em.c_dim(_elements(index_shape[:-1]))}, {em.c_dim(chunk)}, {y.pointer})) {{",
            "    run_status = 5;",
            "    return;",
            "}"]


_ALWAYS_TYPED.update({"Range": _emit_range, "Slice": _emit_slice})
ANY_TYPE_EMITTERS |= {_emit_range, _emit_slice, _emit_gather_nd_runtime}
#: the ops these emitters compile (for supported_operators)
OPERATORS = sorted(_ALWAYS_TYPED)
