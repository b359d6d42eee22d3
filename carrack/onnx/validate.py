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
    op_type = _text(node.op_type, f"node {index} op_type", where)
    label = f"{where}, node {index} ({op_type}"
    name = _text(node.name, "name", label + ")")
    label += f" {name!r})" if name else ")"
    domain = _domain(_text(node.domain, "domain", label))
    for i, x in enumerate(node.input):
        _text(x, f"input {i}", label)
    for i, x in enumerate(node.output):
        _text(x, f"output {i}", label)
    for a in node.attribute:
        _text(a.name, "attribute name", label)
    schema = _schema(domain, op_type, opsets.get(domain, 0)) if domain in SCHEMA_DOMAINS else None
    if schema is not None:
        _check_arity(node, schema, label)
        _check_attribute_types(node, schema, label)
    if domain in SCHEMA_DOMAINS or domain == "com.microsoft":
        _check_window_attributes(node, op_type, label)
        if op_type == "Cast" and schema is not None:
            _check_cast(node, schema, label)
    for a in node.attribute:
        for sub in _subgraphs(a):
            _check_graph(sub, opsets, f"{label}, attribute {a.name!r}")


def _subgraphs(a: AttributeProto) -> Iterator[GraphProto]:
    if a.type == AttributeProto.GRAPH or (a.type == AttributeProto.UNDEFINED and a.HasField("g")):
        yield a.g
    yield from a.graphs


@functools.lru_cache(maxsize=4096)
def _schema(domain: str, op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    if opset <= 0:
        return None
    try:
        return onnx.defs.get_schema(op_type, max_inclusive_version=opset, domain=domain)
    except onnx.defs.SchemaError:
        return None


def _check_arity(node: NodeProto, schema: onnx.defs.OpSchema, label: str) -> None:
    at = f"{label} at opset {schema.since_version}"
    n_in, n_out = len(node.input), len(node.output)
    if not schema.min_input <= n_in <= schema.max_input:
        raise InvalidModel(f"{at} has {n_in} input(s); {schema.name} takes "
                           f"{_range(schema.min_input, schema.max_input)}")
    if not schema.min_output <= n_out <= schema.max_output:
        raise InvalidModel(f"{at} has {n_out} output(s); {schema.name} gives "
                           f"{_range(schema.min_output, schema.max_output)}")
    for i, (name, formal) in enumerate(zip(node.input, schema.inputs)):
        if not name and formal.option == _Option.Single:
            raise InvalidModel(f"{at}: input {i} ({formal.name!r}) is required but its name is empty")
    if any(not name for name in node.output[:1]) and schema.outputs and schema.outputs[0].option == _Option.Single:
        raise InvalidModel(f"{at}: output 0 ({schema.outputs[0].name!r}) is required but its name is empty")


def _range(low: int, high: int) -> str:
    if low == high:
        return str(low)
    return f"at least {low}" if high >= 2**30 else f"{low} to {high}"


def _check_attribute_types(node: NodeProto, schema: onnx.defs.OpSchema, label: str) -> None:
    given = set()
    for a in node.attribute:
        given.add(a.name)
        expected = schema.attributes.get(a.name)
        if expected is None:
            raise InvalidModel(f"{label} has attribute {a.name!r}, which {schema.name} (opset "
                               f"{schema.since_version}) does not define; it defines {sorted(schema.attributes)}")
        if a.ref_attr_name:  # inside a function body: the caller's attribute, checked at the call
            continue
        actual = _attribute_type(a)
        if actual != int(expected.type):
            raise InvalidModel(f"{label}: attribute {a.name!r} is {_type_name(actual)}; {schema.name} expects "
                               f"{_type_name(int(expected.type))}")
    missing = [name for name, attr in schema.attributes.items() if attr.required and name not in given]
    if missing:
        raise InvalidModel(f"{label} lacks required attribute(s) {missing}")


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
    if op_type not in CONV_OPS and op_type not in POOL_OPS:
        return
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


def _check_cast(node: NodeProto, schema: onnx.defs.OpSchema, label: str) -> None:
    to = next((a.i for a in node.attribute if a.name == "to" and a.type == AttributeProto.INT), None)
    if to is None:
        return
    allowed = next((c.allowed_type_strs for c in schema.type_constraints if c.type_param_str == "T2"), [])
    type_str = f"tensor({TensorProto.DataType.Name(to).lower()})" if to in TensorProto.DataType.values() else None
    if type_str not in allowed:
        shown = TensorProto.DataType.Name(to) if type_str else str(to)
        raise InvalidModel(f"{label}: Cast to {shown} is not allowed; Cast (opset {schema.since_version}) converts "
                           f"to {', '.join(s[7:-1] for s in allowed)}")


def _check_declared_dims(v: onnx.ValueInfoProto, where: str) -> None:
    if v.type.WhichOneof("value") != "tensor_type" or not v.type.tensor_type.HasField("shape"):
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
