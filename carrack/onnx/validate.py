"""Checks a parsed model before anything is imported or rewritten, so that import, the optimizer's rules and the
kernels may assume well-formed nodes. Cheap (one pass over the nodes, schema lookups cached) and complete for the
standard domains:

- every name (node, input, output, value, initializer, op type, domain) is text: protobuf hands invalid UTF-8 over
  as bytes, which is refused naming the field;
- every node of a standard domain (ai.onnx, ai.onnx.ml, ai.onnx.preview.training) has as many inputs and outputs
  as its schema at the model's opset allows, no empty name for a required input, its required attributes, no
  attribute its schema does not define, and each attribute of the schema's type (nodes of other domains are
  checked by their kernels);
- attributes that scale work or memory are in range, as onnxruntime checks them: kernel_shape, strides, dilations
  positive, pads non-negative, a pool's pads smaller than its kernel, none beyond 2**31 - 1; Cast's `to` is a type
  ONNX Cast converts to (not complex);
- static dims (graph inputs, outputs, value_info, initializers) describe tensors that fit in an address space.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import onnx
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto

from carrack.errors import InvalidModel

SCHEMA_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training")
#: the most bytes one tensor may describe: x86-64 and arm64 user address spaces are 2**47 bytes
MAX_TENSOR_BYTES = 1 << 47
#: numpy's most dims
MAX_RANK = 64
#: the largest kernel_shape, stride, dilation or pad accepted (kernels index with 32-bit offsets in places)
MAX_WINDOW_ATTR = 2**31 - 1
CONV_OPS = {"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "FusedConv", "NhwcConv", "DeformConv"}
POOL_OPS = {"MaxPool", "AveragePool", "LpPool", "MaxUnpool", "QLinearAveragePool", "NhwcMaxPool", "MaxRoiPool"}
_Option = onnx.defs.OpSchema.FormalParameterOption
_ELEM_TYPES = frozenset(TensorProto.DataType.values())


def validate_model(proto: ModelProto, opsets: Mapping[str, int], what: str = "model") -> None:
    """Raise InvalidModel naming the first malformed node, name or attribute of `proto` (see the module doc)."""
    _check_graph(proto.graph, opsets, f"{what}, graph")
    for f in proto.functions:
        f_opsets = {**opsets, **{_domain(o.domain): o.version for o in f.opset_import}}
        where = f"{what}, function {_text(f.name, 'function name', what)!r}"
        for i, name in enumerate([*f.input, *f.output]):
            _text(name, f"input/output {i}", where)
        for index, node in enumerate(f.node):
            _check_node(node, index, f_opsets, where)


def _check_graph(graph: GraphProto, opsets: Mapping[str, int], where: str) -> None:
    for kind, infos in (("input", graph.input), ("output", graph.output), ("value_info", graph.value_info)):
        for i, v in enumerate(infos):
            name = _text(v.name, f"{kind} {i} name", where)
            _check_declared_dims(v, f"{where}, {kind} {name!r}")
    for i, t in enumerate(graph.initializer):
        name = _text(t.name, f"initializer {i} name", where)
        _check_dims(list(t.dims), t.data_type, f"{where}, initializer {name!r}")
    for index, node in enumerate(graph.node):
        _check_node(node, index, opsets, where)


def _check_node(node: NodeProto, index: int, opsets: Mapping[str, int], where: str) -> None:
    op_type, domain = node.op_type, node.domain
    if not (isinstance(op_type, str) and isinstance(node.name, str) and isinstance(domain, str)
            and all(isinstance(x, str) for x in node.input) and all(isinstance(x, str) for x in node.output)
            and all(isinstance(a.name, str) for a in node.attribute)):
        _refuse_bytes(node, index, where)
    domain = _domain(domain)
    facts = _facts(domain, op_type, opsets.get(domain, 0)) if domain in SCHEMA_DOMAINS else None
    if facts is not None:
        _check_arity(node, facts, index, where)
        _check_attribute_types(node, facts, index, where)
        if op_type == "Cast":
            _check_cast(node, facts, _label(node, index, where))
    if (op_type in CONV_OPS or op_type in POOL_OPS) and (domain in SCHEMA_DOMAINS or domain == "com.microsoft"):
        _check_window_attributes(node, op_type, _label(node, index, where))
    for a in node.attribute:
        if a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS, AttributeProto.UNDEFINED):
            for sub in _subgraphs(a):
                _check_graph(sub, opsets, f"{_label(node, index, where)}, attribute {a.name!r}")


def _label(node: NodeProto, index: int, where: str) -> str:
    """How errors name a node (built only when needed: most nodes are fine)."""
    return f"{where}, node {index} ({node.op_type}" + (f" {node.name!r})" if node.name else ")")


def _refuse_bytes(node: NodeProto, index: int, where: str) -> None:
    op_type = _text(node.op_type, f"node {index} op_type", where)
    label = f"{where}, node {index} ({op_type})"
    _text(node.name, "name", label)
    label = _label(node, index, where)
    _text(node.domain, "domain", label)
    for i, x in enumerate(node.input):
        _text(x, f"input {i}", label)
    for i, x in enumerate(node.output):
        _text(x, f"output {i}", label)
    for a in node.attribute:
        _text(a.name, "attribute name", label)


def _subgraphs(a: AttributeProto) -> Iterator[GraphProto]:
    if a.type == AttributeProto.GRAPH or (a.type == AttributeProto.UNDEFINED and a.HasField("g")):
        yield a.g
    yield from a.graphs


@dataclass(frozen=True)
class _SchemaFacts:
    """What validation reads from an OpSchema, read once per (domain, op, opset): pybind copies on every access."""

    name: str
    since: int
    inputs: tuple[int, int]
    outputs: tuple[int, int]
    required_inputs: tuple[tuple[int, str], ...]  # (position, formal name) of Single inputs
    output0_required: str | None
    attributes: dict[str, int]
    required_attributes: tuple[str, ...]
    cast_targets: tuple[str, ...]


@functools.lru_cache(maxsize=4096)
def _facts(domain: str, op_type: str, opset: int) -> _SchemaFacts | None:
    if opset <= 0:
        return None
    try:
        schema = onnx.defs.get_schema(op_type, max_inclusive_version=opset, domain=domain)
    except onnx.defs.SchemaError:
        return None
    formal_in, formal_out, attrs = schema.inputs, schema.outputs, schema.attributes
    return _SchemaFacts(
        name=schema.name, since=schema.since_version,
        inputs=(schema.min_input, schema.max_input), outputs=(schema.min_output, schema.max_output),
        required_inputs=tuple((i, f.name) for i, f in enumerate(formal_in) if f.option == _Option.Single),
        output0_required=formal_out[0].name if formal_out and formal_out[0].option == _Option.Single else None,
        attributes={name: int(a.type) for name, a in attrs.items()},
        required_attributes=tuple(name for name, a in attrs.items() if a.required),
        cast_targets=tuple(next((c.allowed_type_strs for c in schema.type_constraints if c.type_param_str == "T2"),
                                [])))


def _check_arity(node: NodeProto, facts: _SchemaFacts, index: int, where: str) -> None:
    n_in, n_out = len(node.input), len(node.output)
    (min_in, max_in), (min_out, max_out) = facts.inputs, facts.outputs
    if not min_in <= n_in <= max_in:
        raise InvalidModel(f"{_label(node, index, where)} at opset {facts.since} has {n_in} input(s); {facts.name} "
                           f"takes {_range(min_in, max_in)}")
    if not min_out <= n_out <= max_out:
        raise InvalidModel(f"{_label(node, index, where)} at opset {facts.since} has {n_out} output(s); "
                           f"{facts.name} gives {_range(min_out, max_out)}")
    for i, formal in facts.required_inputs:
        if i < n_in and not node.input[i]:
            raise InvalidModel(f"{_label(node, index, where)} at opset {facts.since}: input {i} ({formal!r}) is "
                               "required but its name is empty")
    if facts.output0_required and n_out and not node.output[0]:
        raise InvalidModel(f"{_label(node, index, where)} at opset {facts.since}: output 0 "
                           f"({facts.output0_required!r}) is required but its name is empty")


def _range(low: int, high: int) -> str:
    if low == high:
        return str(low)
    return f"at least {low}" if high >= 2**30 else f"{low} to {high}"


def _check_attribute_types(node: NodeProto, facts: _SchemaFacts, index: int, where: str) -> None:
    for a in node.attribute:
        expected = facts.attributes.get(a.name)
        if expected is None:
            raise InvalidModel(f"{_label(node, index, where)} has attribute {a.name!r}, which {facts.name} (opset "
                               f"{facts.since}) does not define; it defines {sorted(facts.attributes)}")
        if a.ref_attr_name:  # inside a function body: the caller's attribute, checked at the call
            continue
        actual = _attribute_type(a)
        if actual != expected:
            raise InvalidModel(f"{_label(node, index, where)}: attribute {a.name!r} is {_type_name(actual)}; "
                               f"{facts.name} expects {_type_name(expected)}")
    if facts.required_attributes:
        given = {a.name for a in node.attribute}
        missing = [name for name in facts.required_attributes if name not in given]
        if missing:
            raise InvalidModel(f"{_label(node, index, where)} lacks required attribute(s) {missing}")


def _attribute_type(a: AttributeProto) -> int:
    """The attribute's type; old models leave it UNDEFINED and set one field, as the importer reads them."""
    if a.type != AttributeProto.UNDEFINED:
        return a.type
    for field, kind in (("f", AttributeProto.FLOAT), ("i", AttributeProto.INT), ("s", AttributeProto.STRING),
                        ("t", AttributeProto.TENSOR), ("g", AttributeProto.GRAPH)):
        if a.HasField(field):
            return kind
    for field, kind in (("floats", AttributeProto.FLOATS), ("ints", AttributeProto.INTS),
                        ("strings", AttributeProto.STRINGS)):
        if len(getattr(a, field)):
            return kind
    return AttributeProto.UNDEFINED


def _type_name(kind: int) -> str:
    try:
        return AttributeProto.AttributeType.Name(kind)
    except ValueError:
        return f"of unknown type {kind}"


def _ints(node: NodeProto, name: str) -> list[int] | None:
    for a in node.attribute:
        if a.name == name and a.type == AttributeProto.INTS:
            return list(a.ints)
    return None


def _check_window_attributes(node: NodeProto, op_type: str, label: str) -> None:
    """Kernel, stride, dilation and pad attributes of convolutions and pools, as onnxruntime validates them."""
    kernel = _ints(node, "kernel_shape")
    for attr, low in (("kernel_shape", 1), ("strides", 1), ("dilations", 1), ("pads", 0), ("output_padding", 0)):
        values = _ints(node, attr)
        if values is None:
            continue
        bad = [v for v in values if not low <= v <= MAX_WINDOW_ATTR]
        if bad:
            raise InvalidModel(f"{label}: attribute {attr!r} = {values} has {bad[0]}; each must be between {low} "
                               f"and {MAX_WINDOW_ATTR}")
        if kernel is not None and attr != "kernel_shape":
            want = 2 * len(kernel) if attr == "pads" else len(kernel)
            if len(values) != want:
                raise InvalidModel(f"{label}: attribute {attr!r} has {len(values)} value(s); kernel_shape "
                                   f"{kernel} needs {want}")
    pads = _ints(node, "pads")
    if op_type in POOL_OPS and kernel is not None and pads is not None and len(pads) == 2 * len(kernel):
        for axis, k in enumerate(kernel):
            if pads[axis] >= k or pads[axis + len(kernel)] >= k:
                raise InvalidModel(f"{label}: pads {pads} must be smaller than kernel_shape {kernel} on every "
                                   f"axis (axis {axis}: kernel {k}, pads {pads[axis]} and {pads[axis + len(kernel)]})")


def _check_cast(node: NodeProto, facts: _SchemaFacts, label: str) -> None:
    to = next((a.i for a in node.attribute if a.name == "to" and a.type == AttributeProto.INT), None)
    if to is None:
        return
    type_str = f"tensor({TensorProto.DataType.Name(to).lower()})" if to in TensorProto.DataType.values() else None
    if type_str not in facts.cast_targets:
        shown = TensorProto.DataType.Name(to) if type_str else str(to)
        raise InvalidModel(f"{label}: Cast to {shown} is not allowed; Cast (opset {facts.since}) converts "
                           f"to {', '.join(s[7:-1] for s in facts.cast_targets)}")


def _check_declared_dims(v: onnx.ValueInfoProto, where: str) -> None:
    if v.type.WhichOneof("value") != "tensor_type":
        return
    elem_type = v.type.tensor_type.elem_type
    if elem_type not in _ELEM_TYPES:
        raise InvalidModel(f"{where} has element type {elem_type}, which ONNX does not define")
    if not v.type.tensor_type.HasField("shape"):
        return
    for i, d in enumerate(v.type.tensor_type.shape.dim):
        if d.WhichOneof("value") == "dim_param":
            _text(d.dim_param, f"dim {i} name", where)
    # a negative dim_value is read as unknown (some tools write -1), so only the known dims count
    dims = [d.dim_value for d in v.type.tensor_type.shape.dim if d.WhichOneof("value") == "dim_value"
            and d.dim_value >= 0]
    _check_dims(dims, v.type.tensor_type.elem_type, where)


def _check_dims(dims: list[int], elem_type: int, where: str) -> None:
    check_static_shape(dims, _itemsize(elem_type), where)


def check_static_shape(dims: list[int], itemsize: int, where: str) -> None:
    """Dims of a tensor of static size must fit: each non-negative, and the byte count within an address space
    (InvalidModel naming `where` otherwise)."""
    if len(dims) > MAX_RANK:
        raise InvalidModel(f"{where} has rank {len(dims)}; carrack's arrays have at most {MAX_RANK} dims")
    count = 1
    for d in dims:
        if d < 0:
            raise InvalidModel(f"{where} has dim {d} in {dims}; dims must be non-negative")
        count *= d
    if count * itemsize > MAX_TENSOR_BYTES:
        raise InvalidModel(f"{where} has dims {dims}: {count:,} elements ({count * itemsize:,} bytes), more than an "
                           f"address space holds ({MAX_TENSOR_BYTES:,} bytes)")


def _itemsize(elem_type: int) -> int:
    try:
        return max(1, onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize)
    except (KeyError, ValueError, TypeError):
        return 1


def _text(value: str | bytes, field: str, where: str) -> str:
    """A name as text: protobuf hands invalid UTF-8 over as bytes, which cannot name anything."""
    if isinstance(value, str):
        return value
    raise InvalidModel(f"{where}: {field} is not valid UTF-8 text ({bytes(value)[:60]!r})")


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain
