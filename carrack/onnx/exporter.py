"""carrack IR -> ONNX ModelProto, so optimized graphs can be saved and run by other engines."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from carrack.ir.dims import Sym
from carrack.ir.graph import Graph, Model, Node, ValueInfo
from carrack.ir.types import MapType, OptionalType, SequenceType, TensorType, ValueType


def export_model(model: Model) -> onnx.ModelProto:
    graph = export_graph(model.graph, model.opsets.get("", 1))
    domains = {n.domain for n in _all_nodes(model.graph)}
    opsets = dict(model.opsets)
    for d in domains - {"carrack"}:
        opsets.setdefault(d, 1)
    if any(n.op_type in ("Gelu", "FastGelu") and n.domain == "com.microsoft" for n in graph.node):
        opsets.setdefault("com.microsoft", 1)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                              producer_name="carrack")
    # the oldest IR version that carries these opsets, so older engines can load the file
    proto.ir_version = helper.find_min_ir_version_for(list(proto.opset_import), ignore_unknown=True)
    for k, v in model.metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = k, v
    return proto


def save_model(model: Model, path: str | os.PathLike) -> None:
    proto = export_model(model)
    if proto.ByteSize() > 2**31 - 2**20:
        onnx.save(proto, path, save_as_external_data=True, location=os.path.basename(path) + ".data")
    else:
        onnx.save(proto, path)


def _all_nodes(g: Graph):
    for n in g.nodes:
        yield n
        for sub in n.subgraphs():
            yield from _all_nodes(sub)


def export_graph(g: Graph, opset: int = 1) -> onnx.GraphProto:
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in g.initializers.items()]
    nodes = [p for n in g.nodes for p in _export_nodes(n, opset)]
    return helper.make_graph(
        nodes, g.name or "graph",
        [_value_info(v) for v in g.inputs], [_value_info(v) for v in g.outputs],
        initializer=inits, value_info=[_value_info(v) for v in g.value_info.values()])


_ACTIVATION_ATTRS = {"LeakyRelu": ("alpha",), "HardSigmoid": ("alpha", "beta")}


def _export_nodes(n: Node, opset: int) -> list[onnx.NodeProto]:
    """carrack's own fused nodes are written back as the standard layer and activation they came from."""
    if n.domain == "carrack" and n.op_type == "InvertedResidual":
        from carrack.passes.fusions import inverted_residual_parts

        return [p for part in inverted_residual_parts(n) for p in _export_nodes(part, opset)]
    if n.domain != "carrack" or not n.op_type.startswith("Fused"):
        return [_export_node(n)]
    act = n.attrs["activation"]
    params = n.attrs.get("activation_params", [])
    base_attrs = {k: v for k, v in n.attrs.items() if not k.startswith("activation")}
    hidden = f"{n.outputs[0]}__pre_{act.lower()}"
    base = Node(n.op_type[len("Fused"):], n.inputs, [hidden], base_attrs, name=n.name)
    attrs = dict(zip(_ACTIVATION_ATTRS.get(act, ()), params))
    domain = ""
    if act == "Gelu" and opset < 20:
        domain = "com.microsoft"
    activation = Node(act, [hidden], list(n.outputs), attrs, domain=domain, name=f"{n.name}_{act}" if n.name else "")
    return [_export_node(base), _export_node(activation)]


def _export_node(n: Node) -> onnx.NodeProto:
    node = helper.make_node(n.op_type, n.inputs, n.outputs, name=n.name or None, domain=n.domain or None)
    for k, v in n.attrs.items():
        node.attribute.append(_attribute(k, v))
    return node


def _attribute(name: str, v: Any) -> onnx.AttributeProto:
    if isinstance(v, Graph):
        return helper.make_attribute(name, export_graph(v))  # subgraphs keep the model's opset
    if isinstance(v, np.ndarray):
        return helper.make_attribute(name, numpy_helper.from_array(v))
    if isinstance(v, list) and v and isinstance(v[0], Graph):
        return helper.make_attribute(name, [export_graph(x) for x in v])
    if isinstance(v, list) and v and isinstance(v[0], np.ndarray):
        return helper.make_attribute(name, [numpy_helper.from_array(x) for x in v])
    if isinstance(v, (TensorType, SequenceType, OptionalType, MapType)):
        return helper.make_attribute(name, _type_proto(v))
    if isinstance(v, list) and not v:
        a = helper.make_attribute(name, [], attr_type=onnx.AttributeProto.INTS)
        return a
    return helper.make_attribute(name, v)


def _type_proto(t: ValueType | None) -> onnx.TypeProto:
    if isinstance(t, TensorType):
        shape = None if t.shape is None else [
            d if isinstance(d, int) else (d.name if isinstance(d, Sym) else (str(d) if d is not None else None))
            for d in t.shape]
        return helper.make_tensor_type_proto(t.elem_type, shape)
    if isinstance(t, SequenceType):
        return helper.make_sequence_type_proto(_type_proto(t.elem))
    if isinstance(t, OptionalType):
        return helper.make_optional_type_proto(_type_proto(t.elem))
    if isinstance(t, MapType):
        return helper.make_map_type_proto(t.key_type, _type_proto(t.value))
    return onnx.TypeProto()


def _value_info(v: ValueInfo) -> onnx.ValueInfoProto:
    if v.type is None:
        return helper.make_empty_tensor_value_info(v.name)
    return helper.make_value_info(v.name, _type_proto(v.type))
