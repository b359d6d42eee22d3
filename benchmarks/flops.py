"""Model FLOPs from the ONNX graph: 2 x the multiply-accumulates of MatMul, Gemm, Conv and ConvTranspose.

Shapes come from carrack's shape inference (carrack.passes.shape_inference.infer with the graph inputs' symbolic dims
bound to the benchmark's sizes). Other ops (elementwise, normalisation, softmax, pooling) are not counted: on these
models they are a few percent of the arithmetic, though often much more of the time.

Usage: python benchmarks/flops.py MODEL.onnx [NAME=SIZE ...]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

COUNTED = ("MatMul", "Gemm", "Conv", "ConvTranspose", "FusedMatMul", "FusedConv")


@dataclass
class FlopCount:
    flops: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    uncounted: list[str] = field(default_factory=list)  # nodes whose shapes carrack's inference left unknown
    from_onnx: list[str] = field(default_factory=list)  # of those, nodes counted with onnx's shape inference

    @property
    def gflops(self) -> float:
        return self.flops / 1e9


def _static(shape) -> tuple[int, ...] | None:
    if shape is None or any(not isinstance(d, int) for d in shape):
        return None
    return tuple(shape)


def node_macs(op: str, attrs: Mapping, shapes: list[tuple[int, ...] | None], out: tuple[int, ...] | None) -> int | None:
    """Multiply-accumulates of one node from its static input and output shapes (None when unknown)."""
    if op in ("MatMul", "FusedMatMul"):
        a = shapes[0]
        if a is None or out is None:
            return None
        return math.prod(out) * (a[-1] if a else 1)
    if op == "Gemm":
        a = shapes[0]
        if a is None or out is None or len(a) != 2:
            return None
        return math.prod(out) * (a[0] if attrs.get("transA", 0) else a[1])
    if op in ("Conv", "FusedConv"):
        w = shapes[1] if len(shapes) > 1 else None
        if w is None or out is None:
            return None
        return math.prod(out) * math.prod(w[1:])
    if op == "ConvTranspose":
        x, w = shapes[0], shapes[1] if len(shapes) > 1 else None
        if x is None or w is None:
            return None
        return math.prod(x) * math.prod(w[1:])
    return 0


def count_flops(model: str | Path, bindings: Mapping[str, int] | None = None) -> FlopCount:
    """FLOPs of one inference with the graph inputs' symbolic dims set to `bindings` (name -> size)."""
    from carrack.onnx.importer import load_model
    from carrack.passes.shape_inference import infer, input_facts

    m = load_model(str(model))
    facts = infer(m.graph, m.opsets, input_facts(m.graph, dict(bindings or {})))
    result = FlopCount()
    fallback: dict[str, tuple[int, ...]] = {}
    for node in m.graph.nodes:
        if node.op_type not in COUNTED:
            continue
        shapes = [_static(facts[i].shape) if i in facts else None for i in node.inputs]
        out = _static(facts[node.outputs[0]].shape) if node.outputs[0] in facts else None
        macs = node_macs(node.op_type, node.attrs, shapes, out)
        if macs is None:
            fallback = fallback or _onnx_shapes(model, bindings or {})
            shapes = [fallback.get(i) for i in node.inputs]
            macs = node_macs(node.op_type, node.attrs, shapes, fallback.get(node.outputs[0]))
            result.uncounted.append(node.name or node.outputs[0])
            if macs is None:
                continue
            result.from_onnx.append(node.name or node.outputs[0])
        result.flops += 2 * macs
        result.by_op[node.op_type] = result.by_op.get(node.op_type, 0) + 2 * macs
    return result


def _onnx_shapes(model: str | Path, bindings: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Static shapes from onnx.shape_inference with the inputs' symbolic dims replaced by their sizes."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    del proto.graph.value_info[:]  # exporter hints keep symbolic names that would win over the bound sizes
    for v in proto.graph.input:
        for axis, d in enumerate(v.type.tensor_type.shape.dim):
            size = bindings.get(d.dim_param) or bindings.get(f"{v.name}:{axis}")
            if not d.HasField("dim_value") and size:
                d.dim_value = size
    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True).graph
    shapes: dict[str, tuple[int, ...]] = {}
    for v in list(inferred.value_info) + list(inferred.input) + list(inferred.output):
        dims = v.type.tensor_type.shape.dim
        if v.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[v.name] = tuple(d.dim_value for d in dims)
    for init in inferred.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def main(argv: list[str]) -> int:
    bindings = {k: int(v) for k, _, v in (a.partition("=") for a in argv[1:])}
    if not bindings:
        from bench_common import dim_bindings, input_spec

        bindings = dim_bindings(argv[0], input_spec(argv[0]))
    c = count_flops(argv[0], bindings)
    print(f"{c.gflops:.3f} GFLOP  " + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in c.by_op.items())
          + (f"  ({len(c.uncounted)} nodes with shapes unknown to carrack, {len(c.from_onnx)} of them counted "
             "with onnx's shape inference)" if c.uncounted else ""))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main(sys.argv[1:]))
