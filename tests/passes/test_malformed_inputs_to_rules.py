"""Optimizer rules meet models that pass validation but are inconsistent (found by the fuzzer, tests/fuzz): they get
a carrack error naming the node, not a numpy error from inside a rule or a giant allocation."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.errors import CarrackError, InvalidModel


def _load(nodes, inputs, initializers, opset=17):
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return carrack.InferenceSession(model.SerializeToString())


def _x(shape=(1, 4, 2, 2)):
    return helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))


def test_batchnorm_parameters_of_different_lengths_are_reported_by_the_node():
    params = [numpy_helper.from_array(np.ones(n, np.float32), name) for n, name in
              ((4, "g"), (4, "b"), (3, "m"), (4, "v"))]
    w = numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "w")
    conv = helper.make_node("Conv", ["x", "w"], ["c"])  # Conv + BatchNormalization: folded when consistent
    bn = helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], name="bn")
    with pytest.raises(CarrackError, match="BatchNormalization node 'bn'"):
        _load([conv, bn], [_x()], [w, *params]).run(None, {"x": np.ones((1, 4, 2, 2), np.float32)})


def test_a_constant_of_shape_of_rank_beyond_numpy_is_refused_at_load():
    shape = numpy_helper.from_array(np.ones(128, np.int64), "shape")
    fill = helper.make_node("ConstantOfShape", ["shape"], ["c"], name="fill")
    with pytest.raises(InvalidModel, match="ConstantOfShape node 'fill' output 'c' has rank 128"):
        _load([fill, helper.make_node("Add", ["x", "c"], ["y"])], [_x((1,))], [shape])


def test_a_uniform_constant_larger_than_the_machine_is_refused_at_load():
    shape = numpy_helper.from_array(np.array([2**40], np.int64), "shape")
    fill = helper.make_node("ConstantOfShape", ["shape"], ["mean"], name="fill")
    params = [numpy_helper.from_array(np.ones(4, np.float32), name) for name in ("g", "b", "v")]
    bn = helper.make_node("BatchNormalization", ["x", "g", "b", "mean", "v"], ["y"])
    with pytest.raises(InvalidModel, match="ConstantOfShape node 'fill' output 'mean' has shape \\[1099511627776\\]"):
        _load([fill, bn], [_x()], [shape, *params])


def test_an_op_without_a_schema_at_the_model_opset_is_reported_not_folded():
    # Range exists from opset 11; at opset 9 it has no schema, so validation cannot count its inputs
    one = numpy_helper.from_array(np.array(1, np.int64), "one")
    rng = helper.make_node("Range", ["one"], ["r"], name="range")
    cast = helper.make_node("Cast", ["r"], ["c"], to=TensorProto.FLOAT)
    with pytest.raises(CarrackError, match="Range"):
        _load([rng, cast, helper.make_node("Add", ["x", "c"], ["y"])], [_x((1,))], [one], opset=9)


def test_batchnorm_after_a_conv_of_another_width_is_reported_by_a_node():
    params = [numpy_helper.from_array(np.ones(8, np.float32), name) for name in ("g", "b", "m", "v")]
    w = numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "w")
    conv = helper.make_node("Conv", ["x", "w"], ["c"])
    bn = helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], name="bn")
    with pytest.raises(CarrackError, match="BatchNormalization node 'bn'"):
        _load([conv, bn], [_x()], [w, *params]).run(None, {"x": np.ones((1, 4, 2, 2), np.float32)})


def test_a_rule_that_fails_on_a_node_is_reported_naming_the_node_and_the_rule():
    from carrack.ir.graph import Graph, Node
    from carrack.passes.graph_view import GraphView
    from carrack.passes.optimizer import _apply
    from carrack.passes.rewrite import Rewrite

    def reads_a_missing_input(node, view, ctx):
        return node.inputs[3] == "x"

    node = Node("FastGelu", [], ["g"], domain="com.microsoft", name="gelu")
    rule = Rewrite(name="reads_inputs", fn=reads_a_missing_input, ops=None, level=1)
    with pytest.raises(InvalidModel, match="FastGelu node 'gelu': optimizer rule 'reads_inputs' failed on it "
                                           "\\(IndexError"):
        _apply(rule, node, GraphView(Graph(nodes=[node])), None)
