"""Load an ONNX model (path, bytes or ModelProto) into carrack's IR.

Checks what can be checked before anything runs: the protobuf parses, the graph is there, opsets are known,
initializers decode, names are defined before use. Model-local functions are expanded here.

A model file is memory-mapped rather than read, and its large embedded raw_data initializers never pass through
protobuf: carrack.onnx.wire cuts them out of a skeleton that protobuf parses, and each is then mapped in place or read
once into its aligned array, so loading holds the weights about once, not three times.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any

import onnx
from google.protobuf.message import DecodeError
from onnx import AttributeProto, ModelProto, TypeProto

from carrack.errors import CorruptModel, InvalidModel, ModelFileNotFound, UnsupportedModel
from carrack.ir.dims import Sym
from carrack.ir.graph import Graph, Model, Node, ValueInfo, canonical_domain
from carrack.ir.order import topological_order
from carrack.ir.types import MapType, OptionalType, SequenceType, TensorType, ValueType
from carrack.onnx.functions import Function, inline_functions
from carrack.onnx.tensors import (
    EXTERNAL_DATA_ROOT,
    IN_PLACE_RAW_BYTES,
    FileRange,
    aligned_copy,
    aligned_empty,
    file_kind,
    mapped_file,
    tensor_to_array,
)
from carrack.onnx.validate import validate_model
from carrack.onnx.wire import WireError, split_model

ModelSource = str | os.PathLike | bytes | ModelProto


def load_model(source: ModelSource, external_data_root: str | None = None) -> Model:
    """Parse and import a model from a file path, serialized bytes, or a ModelProto. External data may resolve
    (through symbolic links) into the model's folder or into `external_data_root` (see tensors.external_path)."""
    token = EXTERNAL_DATA_ROOT.set(external_data_root)
    try:
        return _load_model(source)
    finally:
        EXTERNAL_DATA_ROOT.reset(token)


def _load_model(source: ModelSource) -> Model:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        proto, raw_data = _parse_file(path)
        return import_model(proto, os.path.dirname(os.path.abspath(path)), f"model file '{path}'", raw_data)
    proto, base_dir, what = _parse(source)
    return import_model(proto, base_dir, what)


def _parse(source: bytes | bytearray | memoryview | ModelProto) -> tuple[ModelProto, str | None, str]:
    if isinstance(source, ModelProto):
        return source, None, "model"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _parse_bytes(bytes(source), "model bytes"), None, "model bytes"
    raise TypeError(f"expected a model path, bytes or onnx.ModelProto, got {type(source).__name__}")


def _refuse_gguf(head: bytes, what: str) -> None:
    if head[:4] == b"GGUF":
        raise UnsupportedModel(f"{what} is a GGUF file, not ONNX: run it with carrack.llm.Llama(path) or "
                               "`carrack generate FILE -p PROMPT`")


def _parse_bytes(data: bytes, what: str) -> ModelProto:
    if not data:
        raise CorruptModel(f"{what} is empty")
    _refuse_gguf(data[:4], what)
    proto = ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise CorruptModel(f"{what} is not a valid ONNX model (truncated or corrupt protobuf: {e})") from None
    return proto


def _parse_file(path: str) -> tuple[ModelProto, dict[int, FileRange]]:
    """The model in file `path`, parsed without its large main-graph raw_data, and where each of those lies in the
    file (keyed by initializer index)."""
    what = f"model file '{path}'"
    if not os.path.exists(path):
        raise ModelFileNotFound(f"model file '{path}' does not exist")
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):  # never opened: opening a FIFO blocks
        raise InvalidModel(f"{what} is not a regular file ({file_kind(mode)})")
    if os.path.getsize(path) == 0:
        raise CorruptModel(f"{what} is empty")
    with open(path, "rb") as f:
        _refuse_gguf(f.read(4), what)
    try:
        with memoryview(mapped_file(path)) as buf:
            split = split_model(buf, IN_PLACE_RAW_BYTES)
    except WireError as e:
        try:  # protobuf has the last word on what parses (the walk's message says better what is wrong)
            return _parse_whole_file(path, what), {}
        except InvalidModel:
            raise CorruptModel(f"{what} is not a valid ONNX model (truncated or corrupt protobuf: {e})") from None
    proto = _parse_bytes(split.skeleton, what)
    if len(proto.graph.initializer) != split.initializers:  # protobuf read the fields differently: trust it
        return _parse_whole_file(path, what), {}
    return proto, {i: FileRange(path, p.offset, p.length) for i, p in split.payloads.items()}


def _parse_whole_file(path: str, what: str) -> ModelProto:
    with open(path, "rb") as f:
        return _parse_bytes(f.read(), what)


def import_model(proto: ModelProto, base_dir: str | None = None, what: str = "model",
                 raw_data: Mapping[int, FileRange] | None = None) -> Model:
    """Import a parsed model. `raw_data` maps main-graph initializer indices to raw_data held in a file instead of
    in the proto (see _parse_file)."""
    if not proto.HasField("graph"):
        raise InvalidModel(f"{what} has no graph (not an ONNX model, or truncated)")
    opsets = _opsets(proto, what)
    validate_model(proto, opsets, what)
    functions = {(canonical_domain(f.domain), f.name): _import_function(f, base_dir) for f in proto.functions}
    graph = import_graph(proto.graph, base_dir, raw_data)
    if functions:
        graph = inline_functions(graph, functions, opsets)
    return Model(graph=graph, opsets=opsets, ir_version=proto.ir_version, producer=proto.producer_name,
                 metadata={p.key: p.value for p in proto.metadata_props}, doc_string=proto.doc_string,
                 domain=proto.domain, model_version=proto.model_version, graph_doc_string=proto.graph.doc_string,
                 dim_denotations=_dim_denotations(proto.graph))


def _dim_denotations(graph: onnx.GraphProto) -> dict[tuple[str, int], str]:
    found = {}
    for v in graph.input:
        if v.type.WhichOneof("value") == "tensor_type" and v.type.tensor_type.HasField("shape"):
            for axis, d in enumerate(v.type.tensor_type.shape.dim):
                if d.denotation:
                    found[(v.name, axis)] = d.denotation
    return found


def _opsets(proto: ModelProto, what: str) -> dict[str, int]:
    opsets: dict[str, int] = {}
    for imp in proto.opset_import:
        opsets[canonical_domain(imp.domain)] = imp.version
    if not proto.opset_import and proto.ir_version < 3:
        opsets[""] = 1
    newest = onnx.defs.onnx_opset_version()
    ver = opsets.get("", 0)
    if ver > newest:
        raise UnsupportedModel(f"{what} uses ai.onnx opset {ver}; carrack supports opsets 1 to {newest}")
    bad = {domain or "ai.onnx": v for domain, v in opsets.items()
           if v < 1 and domain in ("", "ai.onnx.ml", "ai.onnx.preview.training")}
    if bad:
        raise InvalidModel(f"{what} imports opset versions {bad}; a version is at least 1")
    return opsets


def import_graph(g: onnx.GraphProto, base_dir: str | None, raw_data: Mapping[int, FileRange] | None = None) -> Graph:
    inits = {}
    raw_data = raw_data or {}
    for i, t in enumerate(g.initializer):
        if not t.name:
            raise InvalidModel(f"graph '{g.name}' has an initializer without a name")
        inits[t.name] = tensor_to_array(t, base_dir, raw_data.get(i))
    for st in g.sparse_initializer:
        inits[st.values.name] = _sparse_to_dense(st, base_dir)
    graph = Graph(
        name=g.name,
        inputs=[_value_info(v) for v in g.input],
        outputs=[_value_info(v) for v in g.output],
        nodes=producers_first([_import_node(n, base_dir) for n in g.node]),
        initializers=inits,
        value_info={v.name: _value_info(v) for v in g.value_info},
    )
    return graph


def producers_first(nodes: list[Node]) -> list[Node]:
    """The nodes in an order where each comes after the nodes producing its inputs, otherwise as given. ONNX
    requires that order, but some tools break it (onnxruntime's float16 converter appends the Casts it adds for
    keep_io_types after their consumers) and onnxruntime sorts; a cycle is an InvalidModel naming its nodes."""
    return topological_order(Graph(nodes=nodes))


def _sparse_to_dense(st: onnx.SparseTensorProto, base_dir: str | None):
    import numpy as np

    values = tensor_to_array(st.values, base_dir)
    indices = tensor_to_array(st.indices, base_dir).astype(np.int64)
    dims = tuple(st.dims)
    dense = aligned_empty(dims, values.dtype)
    dense.fill(0)
    size = int(np.prod(dims, dtype=np.int64))
    if indices.ndim == 2:
        flat = np.ravel_multi_index(tuple(indices.T), dims) if indices.size else indices.reshape(0)
    else:
        flat = indices
    if flat.size and (flat.min() < 0 or flat.max() >= size):
        raise InvalidModel(f"sparse initializer '{st.values.name}' has indices outside dims {list(dims)}")
    dense.reshape(-1)[flat] = values.reshape(-1)
    return dense


def _import_node(n: onnx.NodeProto, base_dir: str | None) -> Node:
    try:
        attrs = {a.name: _attr_value(a, base_dir) for a in n.attribute}
    except InvalidModel as e:  # an attribute's tensor has no name of its own: say whose it is
        label = f"{n.op_type} node '{n.name}'" if n.name else f"{n.op_type} node -> {list(n.output[:1])}"
        raise type(e)(f"{label}: {e}") from None
    if n.op_type == "Constant" and not canonical_domain(n.domain):
        attrs = _constant_as_tensor(attrs)
    return Node(op_type=n.op_type, inputs=list(n.input), outputs=list(n.output), attrs=attrs,
                domain=canonical_domain(n.domain), name=n.name)


#: Constant's scalar/list attributes and the tensor each stands for
_CONSTANT_NUMBERS = {"value_float": "float32", "value_floats": "float32", "value_int": "int64", "value_ints": "int64"}


def _constant_as_tensor(attrs: dict[str, Any]) -> dict[str, Any]:
    """Constant(value_float=.../value_ints=...) as the equivalent Constant(value=tensor), so that its value is an
    aligned array like every other constant (and the optimizer sees it as one)."""
    import numpy as np

    given = [k for k in attrs if k in _CONSTANT_NUMBERS or k in ("value", "sparse_value", "value_string",
                                                                 "value_strings")]
    if len(given) != 1 or given[0] not in _CONSTANT_NUMBERS or isinstance(attrs[given[0]], AttrRef):
        return attrs
    key = given[0]
    value = np.array(attrs[key], dtype=_CONSTANT_NUMBERS[key])
    rest = {k: v for k, v in attrs.items() if k != key}
    return {**rest, "value": aligned_copy(value.reshape(-1) if key.endswith("s") else value)}


class AttrRef:
    """An attribute inside a function body that refers to the caller's attribute `name`."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"AttrRef({self.name!r})"


def _attr_value(a: AttributeProto, base_dir: str | None) -> Any:
    if a.ref_attr_name:
        return AttrRef(a.ref_attr_name)
    t = a.type
    A = AttributeProto
    if t == A.FLOAT:
        return float(a.f)
    if t == A.INT:
        return int(a.i)
    if t == A.STRING:
        return _decode(a.s)
    if t == A.TENSOR:
        return tensor_to_array(a.t, base_dir)
    if t == A.GRAPH:
        return import_graph(a.g, base_dir)
    if t == A.SPARSE_TENSOR:
        return _sparse_to_dense(a.sparse_tensor, base_dir)
    if t == A.TYPE_PROTO:
        return import_type(a.tp)
    if t == A.FLOATS:
        return [float(x) for x in a.floats]
    if t == A.INTS:
        return [int(x) for x in a.ints]
    if t == A.STRINGS:
        return [_decode(s) for s in a.strings]
    if t == A.TENSORS:
        return [tensor_to_array(x, base_dir) for x in a.tensors]
    if t == A.GRAPHS:
        return [import_graph(x, base_dir) for x in a.graphs]
    if t == A.SPARSE_TENSORS:
        return [_sparse_to_dense(x, base_dir) for x in a.sparse_tensors]
    if t == A.TYPE_PROTOS:
        return [import_type(x) for x in a.type_protos]
    if t == A.UNDEFINED:
        # old models sometimes omit the type; infer it from which field is set
        for field, conv in (("f", float), ("i", int), ("s", _decode)):
            if a.HasField(field):
                return conv(getattr(a, field))
        if a.HasField("t"):
            return tensor_to_array(a.t, base_dir)
        if a.HasField("g"):
            return import_graph(a.g, base_dir)
        for field in ("floats", "ints", "strings"):
            if len(getattr(a, field)):
                return [(_decode(x) if field == "strings" else x) for x in getattr(a, field)]
    raise InvalidModel(f"attribute '{a.name}' has unsupported type {t}")


def _decode(s: bytes) -> str | bytes:
    try:
        return s.decode("utf-8")
    except UnicodeDecodeError:
        return s


def import_type(tp: TypeProto) -> ValueType | None:
    kind = tp.WhichOneof("value")
    if kind == "tensor_type" or kind == "sparse_tensor_type":
        tt = getattr(tp, kind)
        shape = None
        if tt.HasField("shape"):
            shape = tuple(_dim(d) for d in tt.shape.dim)
        return TensorType(tt.elem_type, shape)
    if kind == "sequence_type":
        return SequenceType(import_type(tp.sequence_type.elem_type) if tp.sequence_type.HasField("elem_type")
                            else None)
    if kind == "optional_type":
        return OptionalType(import_type(tp.optional_type.elem_type) if tp.optional_type.HasField("elem_type")
                            else None)
    if kind == "map_type":
        return MapType(tp.map_type.key_type, import_type(tp.map_type.value_type))
    return None


def _dim(d: onnx.TensorShapeProto.Dimension):
    kind = d.WhichOneof("value")
    if kind == "dim_value":
        return int(d.dim_value) if d.dim_value >= 0 else None
    if kind == "dim_param" and d.dim_param:
        return Sym(d.dim_param)
    return None


def _value_info(v: onnx.ValueInfoProto) -> ValueInfo:
    return ValueInfo(v.name, import_type(v.type) if v.HasField("type") else None)


def _import_function(f: onnx.FunctionProto, base_dir: str | None) -> Function:
    nodes = [_import_node(n, base_dir) for n in f.node]
    defaults = {a.name: _attr_value(a, base_dir) for a in f.attribute_proto}
    for name in f.attribute:
        defaults.setdefault(name, None)
    opsets = {canonical_domain(o.domain): o.version for o in f.opset_import}
    return Function(name=f.name, domain=canonical_domain(f.domain), inputs=list(f.input), outputs=list(f.output),
                    attr_defaults=defaults, nodes=nodes, opsets=opsets)
