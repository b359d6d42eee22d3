"""Symbolic shape inference: shape chains, hints that lose to the graph, and never giving up."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from carrack.ir.dims import Sym
from carrack.ir.symbolic import mul
from carrack.onnx.importer import load_model
from carrack.passes.shape_inference import infer

B, S = Sym("batch"), Sym("seq")


def _model(nodes, inputs, outputs, inits=(), value_info=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits), value_info=list(value_info))
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _const(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def test_reshape_chain_from_shape_is_symbolic():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "one"], ["t"], axis=0),
        helper.make_node("Unsqueeze", ["b", "axes0"], ["b1"]),
        helper.make_node("Unsqueeze", ["t", "axes0"], ["t1"]),
        helper.make_node("Concat", ["b1", "t1", "heads"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
        helper.make_node("Transpose", ["y"], ["z"], perm=[0, 2, 1, 3]),
        helper.make_node("Mul", ["b", "four"], ["b4"]),
        helper.make_node("Unsqueeze", ["b4", "axes0"], ["b41"]),
        helper.make_node("ConstantOfShape", ["b41"], ["zeros"]),
    ]
    inits = [_const("zero", 0), _const("one", 1), _const("axes0", [0]), _const("heads", [12, -1]),
             _const("four", 4)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 768])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    model = _model(nodes, [x], [z], inits)
    facts = infer(model.graph, model.opsets)
    assert facts["target"].dims_value() == [B, S, 12, -1]
    assert facts["y"].shape == (B, S, 12, 64)
    assert facts["z"].shape == (B, 12, S, 64)
    assert facts["zeros"].shape == (mul(B, 4),)


def test_hints_lose_to_the_graph():
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    hint = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["unk__3", 1])  # a wrong annotation
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], value_info=[hint])
    assert infer(model.graph, model.opsets)["y"].shape == (B, 3)


def test_unknown_stays_unknown_without_raising():
    nodes = [helper.make_node("NonZero", ["x"], ["nz"]), helper.make_node("Reshape", ["x", "nz_shape"], ["y"]),
             helper.make_node("Shape", ["nz"], ["nz_shape"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    model = _model([nodes[0], nodes[2], nodes[1]], [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    facts = infer(model.graph, model.opsets)
    assert facts["y"].shape is None or all(d is None for d in facts["y"].shape)


def test_constant_subgraphs_are_evaluated():
    nodes = [helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("ConstantOfShape", ["c"], ["z"])]
    model = _model(nodes, [], [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                   [_const("a", [1, 2]), _const("b", [2, 3])])
    facts = infer(model.graph, model.opsets)
    assert facts["c"].value.tolist() == [3, 5]
    assert facts["z"].shape == (3, 5)


def test_runaway_expressions_are_dropped_to_unknown():
    """Squaring a symbolic size ten times would build n**1024; inference gives up on that one value instead."""
    from carrack.ir.symbolic import complexity
    from carrack.passes.shape_inference import MAX_DIM_COMPLEXITY

    nodes = [helper.make_node("Shape", ["x"], ["s0"])]
    for i in range(10):
        nodes.append(helper.make_node("Mul", [f"s{i}", f"s{i}"], [f"s{i + 1}"]))
    nodes.append(helper.make_node("ConstantOfShape", ["s10"], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    facts = infer(model.graph, model.opsets)
    assert facts["s2"].dims_value() == [mul(mul(Sym("n"), Sym("n")), mul(Sym("n"), Sym("n")))]
    assert facts["s10"].value is None and facts["y"].shape in (None, (None,))
    assert all(complexity(d) <= MAX_DIM_COMPLEXITY for f in facts.values() if f.shape for d in f.shape if d)
