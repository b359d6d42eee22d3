"""Mutations of ONNX models (on the protobuf: attributes, dims, types, edges, names, op types, opsets, tensor
values, node order; and on the bytes) and of GGUF files (on the bytes). Every mutation is drawn from a
random.Random, so a (seed, case number) pair reproduces its mutant."""

from __future__ import annotations

import random

import onnx
from onnx import AttributeProto, ModelProto, TensorProto

EXTREME_INTS = [-(2**63), -(2**31), -65536, -2, -1, 0, 1, 2, 3, 7, 255, 65536, 2**31 - 1, 2**31, 2**32, 2**40,
                2**62, 2**63 - 1]
OP_TYPES = ["Add", "MatMul", "Conv", "MaxPool", "AveragePool", "Reshape", "Expand", "Tile", "ConstantOfShape", "Range",
            "Resize", "Pad", "OneHot", "TopK", "NonZero", "Cast", "Gather", "Concat", "Split", "Slice", "Transpose",
            "Softmax", "LayerNormalization", "Gemm", "Loop", "Scan", "If", "Identity", "Unsqueeze", "Squeeze",
            "ReduceSum", "Einsum", "ConvTranspose", "LSTM", "Attention", "FusedConv", "NotAnOp"]
ELEM_TYPES = list(range(0, 27))


def _extreme(rng: random.Random) -> int:
    return rng.choice(EXTREME_INTS) if rng.random() < 0.8 else rng.randint(-10, 100)


def _nodes(model: ModelProto) -> list[onnx.NodeProto]:
    found = []

    def walk(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            found.append(n)
            for a in n.attribute:
                if a.type == AttributeProto.GRAPH:
                    walk(a.g)
    walk(model.graph)
    return found


def _value_infos(model: ModelProto) -> list[onnx.ValueInfoProto]:
    g = model.graph
    return [*g.input, *g.output, *g.value_info]


def _attr_value(model: ModelProto, rng: random.Random) -> str:
    with_attrs = [n for n in _nodes(model) if n.attribute]
    if not with_attrs:
        return ""
    node = rng.choice(with_attrs)
    a = rng.choice(node.attribute)
    if a.type == AttributeProto.INT:
        a.i = _extreme(rng)
    elif a.type == AttributeProto.INTS and len(a.ints):
        a.ints[rng.randrange(len(a.ints))] = _extreme(rng)
    elif a.type == AttributeProto.FLOAT:
        a.f = rng.choice([float("nan"), float("inf"), -1.0, 0.0, 1e30])
    elif a.type == AttributeProto.STRING:
        a.s = rng.choice([b"", b"\xff\xfe", b"NOTSET", b"x" * 300])
    elif a.type == AttributeProto.TENSOR:
        _tensor_value(a.t, rng)
    else:
        a.type = rng.choice(list(AttributeProto.AttributeType.values()))
    return f"attribute {node.op_type}.{a.name}"


def _attr_type(model: ModelProto, rng: random.Random) -> str:
    with_attrs = [n for n in _nodes(model) if n.attribute]
    if not with_attrs:
        return ""
    node = rng.choice(with_attrs)
    a = rng.choice(node.attribute)
    if rng.random() < 0.5:
        a.type = rng.choice(list(AttributeProto.AttributeType.values()))
    else:
        node.attribute.add().CopyFrom(onnx.helper.make_attribute(rng.choice(["axis", "pads", "kernel_shape", "to",
                                                                             "strides", "perm", "junk"]),
                                                                 rng.choice([_extreme(rng), [_extreme(rng)] * 3,
                                                                             "s", 1.5])))
    return f"attribute type {node.op_type}.{a.name}"


def _tensor_value(t: TensorProto, rng: random.Random) -> None:
    if t.data_location == TensorProto.EXTERNAL:
        t.data_location = TensorProto.DEFAULT
    elif t.data_type == TensorProto.INT64 and (t.raw_data or t.int64_data):
        values = onnx.numpy_helper.to_array(t).copy().reshape(-1)
        if values.size:
            values[rng.randrange(values.size)] = _extreme(rng)
            t.ClearField("int64_data")
            t.raw_data = values.tobytes()
    elif rng.random() < 0.5 and t.raw_data:
        cut = rng.randrange(len(t.raw_data) + 1)
        t.raw_data = t.raw_data[:cut] if rng.random() < 0.5 else t.raw_data + b"\0" * rng.randint(1, 9)
    elif len(t.dims):
        t.dims[rng.randrange(len(t.dims))] = _extreme(rng)
    else:
        t.data_type = rng.choice(ELEM_TYPES)


def _tensor(model: ModelProto, rng: random.Random) -> str:
    tensors = list(model.graph.initializer) + [a.t for n in _nodes(model) for a in n.attribute
                                                if a.type == AttributeProto.TENSOR]
    if not tensors:
        return ""
    ints = [t for t in tensors if t.data_type == TensorProto.INT64]
    t = rng.choice(ints) if ints and rng.random() < 0.6 else rng.choice(tensors)
    _tensor_value(t, rng)
    if rng.random() < 0.05:
        t.data_location = TensorProto.EXTERNAL
        entry = t.external_data.add()
        entry.key, entry.value = "location", rng.choice(["../../etc/passwd", "/dev/zero", "missing.bin", ""])
    return f"tensor {t.name}"


def _dims(model: ModelProto, rng: random.Random) -> str:
    infos = [v for v in _value_infos(model) if v.type.HasField("tensor_type")]
    if not infos:
        return ""
    v = rng.choice(infos)
    tt = v.type.tensor_type
    choice = rng.random()
    if choice < 0.5 and len(tt.shape.dim):
        d = tt.shape.dim[rng.randrange(len(tt.shape.dim))]
        if rng.random() < 0.7:
            d.dim_value = _extreme(rng)
        else:
            d.dim_param = rng.choice(["N", "", "batch", "\u00e9"])
    elif choice < 0.75:
        tt.shape.dim.add().dim_value = rng.choice([0, 1, 2, 2**40])
    elif choice < 0.9:
        tt.elem_type = rng.choice(ELEM_TYPES)
    else:
        tt.ClearField("shape")
    return f"dims of {v.name}"


def _edges(model: ModelProto, rng: random.Random) -> str:
    nodes = _nodes(model)
    if not nodes:
        return ""
    node = rng.choice(nodes)
    names = [x for n in nodes for x in (*n.input, *n.output)] + [v.name for v in model.graph.input]
    choice = rng.random()
    if choice < 0.3 and len(node.input):
        del node.input[rng.randrange(len(node.input))]
    elif choice < 0.5:
        node.input.append(rng.choice(names + ["", "undefined_value"]))
    elif choice < 0.65 and len(node.input):
        node.input[rng.randrange(len(node.input))] = rng.choice(names + [""])
    elif choice < 0.8 and len(node.output):
        if rng.random() < 0.5:
            del node.output[rng.randrange(len(node.output))]
        else:
            node.output[rng.randrange(len(node.output))] = rng.choice(names)
    else:
        node.output.append(rng.choice(["extra_out", *names]))
    return f"edges of {node.op_type}"


def _op(model: ModelProto, rng: random.Random) -> str:
    nodes = _nodes(model)
    if not nodes:
        return ""
    node = rng.choice(nodes)
    if rng.random() < 0.85:
        node.op_type = rng.choice(OP_TYPES)
    else:
        node.domain = rng.choice(["com.microsoft", "ai.onnx.ml", "custom.domain", "ai.onnx"])
    return f"op {node.op_type}"


def _cast(model: ModelProto, rng: random.Random) -> str:
    casts = [n for n in _nodes(model) if n.op_type in ("Cast", "CastLike", "EyeLike", "RandomNormal")]
    node = rng.choice(casts) if casts else rng.choice(_nodes(model) or [None])
    if node is None:
        return ""
    node.attribute.add().CopyFrom(onnx.helper.make_attribute("to", rng.choice(ELEM_TYPES + [99, -1])))
    if node.op_type not in ("Cast", "CastLike"):
        node.op_type = "Cast"
        del node.input[1:]
    return "cast"


def _order(model: ModelProto, rng: random.Random) -> str:
    nodes = list(model.graph.node)
    if len(nodes) < 2:
        return ""
    choice = rng.random()
    if choice < 0.4:
        rng.shuffle(nodes)
    elif choice < 0.7:
        nodes.pop(rng.randrange(len(nodes)))
    else:
        nodes.insert(rng.randrange(len(nodes)), nodes[rng.randrange(len(nodes))])
    copies = [onnx.NodeProto.FromString(n.SerializeToString()) for n in nodes]
    del model.graph.node[:]
    model.graph.node.extend(copies)
    return "node order"


def _opset(model: ModelProto, rng: random.Random) -> str:
    if rng.random() < 0.8 and len(model.opset_import):
        model.opset_import[0].version = rng.choice([1, 5, 7, 9, 11, 13, 17, 21, 22, 23, 30, -1, 2**40])
    else:
        model.ir_version = rng.choice([0, 1, 3, 7, 12, 99])
    return "opset"


STRUCTURED = [(_attr_value, 4), (_attr_type, 1), (_tensor, 3), (_dims, 2), (_edges, 3), (_op, 2), (_cast, 1),
              (_order, 1), (_opset, 1)]


def _invalid_utf8_name(data: bytes, model: ModelProto, rng: random.Random) -> bytes:
    names = sorted({x for n in _nodes(model) for x in (*n.input, *n.output, n.name)
                    if isinstance(x, str) and len(x) >= 2}
                   | {v.name for v in _value_infos(model) if isinstance(v.name, str) and len(v.name) >= 2})
    if not names:
        return data
    name = rng.choice(names).encode()
    bad = b"\xff" + name[1:]
    return data.replace(name, bad, rng.choice([1, -1]))


def mutate_model(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One to three mutations of serialized model `data`; returns the mutant and what was done."""
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        kind = rng.random()
        if kind < 0.75:
            try:
                model = ModelProto.FromString(data)
            except Exception:
                data = mutate_bytes(data, rng)
                done.append("bytes")
                continue
            funcs, weights = zip(*STRUCTURED)
            func = rng.choices(funcs, weights)[0]
            try:
                what = func(model, rng)
                data = model.SerializeToString()
            except Exception:  # noqa: BLE001 - protobuf or numpy refused the edit (a name that is bytes...)
                what = ""

            done.append(what or "nothing")
        elif kind < 0.85:
            try:
                model = ModelProto.FromString(data)
            except Exception:
                continue
            data = _invalid_utf8_name(data, model, rng)
            done.append("invalid utf-8 name")
        else:
            data = mutate_bytes(data, rng)
            done.append("bytes")
    return data, "; ".join(done)


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """Byte-level damage: flips, an extreme integer written somewhere, truncation, deletion, insertion."""
    buf = bytearray(data)
    kind = rng.randrange(5) if len(buf) > 16 else 4
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] ^= rng.randint(1, 255)
    elif kind == 1:
        width = rng.choice([1, 2, 4, 8])
        pos = rng.randrange(0, max(1, min(len(buf), 512) - width))
        value = rng.choice(EXTREME_INTS) % (1 << (8 * width))
        buf[pos:pos + width] = value.to_bytes(width, rng.choice(["little", "big"]))
    elif kind == 2:
        del buf[rng.randrange(len(buf)):]
    elif kind == 3:
        start = rng.randrange(len(buf))
        del buf[start:start + rng.randint(1, 16)]
    else:
        start = rng.randrange(len(buf) + 1)
        buf[start:start] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(buf)
