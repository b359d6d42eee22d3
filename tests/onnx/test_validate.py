"""Validation at load (carrack.onnx.validate): malformed nodes, names and attributes are refused with a message naming
the node and what was expected, before import or any optimizer rule sees them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.errors import InvalidModel


def _model(nodes, inputs=None, outputs=None, initializers=(), opset=17) -> onnx.ModelProto:
    inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])]
    outputs = outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _refused(model, *fragments: str) -> str:
    data = model if isinstance(model, bytes) else model.SerializeToString()
    with pytest.raises(InvalidModel) as caught:
        carrack.InferenceSession(data)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_name_that_is_not_utf8_is_refused_naming_the_field():
    data = _model([helper.make_node("Relu", ["x"], ["yy_relu"]), helper.make_node("Identity", ["yy_relu"], ["y"])]
                  ).SerializeToString()
    broken = data.replace(b"yy_relu", b"\xffy_relu")
    _refused(broken, "not valid UTF-8", "Relu", "output 0")


def test_a_node_with_too_few_inputs_is_refused():
    _refused(_model([helper.make_node("Relu", [], ["y"])]), "node 0 (Relu)", "has 0 input(s); Relu takes 1")


def test_a_node_with_too_many_outputs_is_refused():
    _refused(_model([helper.make_node("Relu", ["x"], ["y", "z"])]), "has 2 output(s)")


def test_an_empty_required_input_is_refused():
    _refused(_model([helper.make_node("Add", ["x", ""], ["y"])]), "input 1 ('B') is required")


def test_an_attribute_of_the_wrong_type_is_refused():
    node = helper.make_node("Transpose", ["x"], ["y"], perm=3)
    _refused(_model([node]), "attribute 'perm' is INT; Transpose expects INTS")


def test_an_attribute_the_schema_does_not_define_is_refused():
    _refused(_model([helper.make_node("Relu", ["x"], ["y"], alpha=0.5)]), "attribute 'alpha'", "does not define")


def test_a_missing_required_attribute_is_refused():
    _refused(_model([helper.make_node("Cast", ["x"], ["y"])]), "lacks required attribute(s) ['to']")


def test_cast_to_complex_is_refused():
    _refused(_model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.COMPLEX64)]),
             "Cast to COMPLEX64 is not allowed")


@pytest.mark.parametrize("attrs, fragment", [
    (dict(kernel_shape=[2, 2], pads=[0, 0, 2, 0]), "must be smaller than kernel_shape"),
    (dict(kernel_shape=[2, 2], pads=[0, 0, 65536, 0]), "must be smaller than kernel_shape"),
    (dict(kernel_shape=[2, 2], strides=[0, 1]), "'strides' = [0, 1] has 0"),
    (dict(kernel_shape=[2, 2], strides=[-1, 1]), "'strides' = [-1, 1] has -1"),
    (dict(kernel_shape=[2, 2], pads=[0, 0, 0, 2**32]), "has 4294967296"),
    (dict(kernel_shape=[2, 2], dilations=[1, 2, 3]), "'dilations' has 3 value(s)"),
])
def test_pool_window_attributes_are_checked_as_onnxruntime_does(attrs, fragment):
    _refused(_model([helper.make_node("MaxPool", ["x"], ["y"], **attrs)]), "MaxPool", fragment)


def test_conv_pads_beyond_the_kernel_are_allowed_but_huge_ones_are_not():
    w = helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 2, 2], np.ones(4, np.float32))
    ok = _model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[3, 3, 3, 3])], initializers=[w])
    out = carrack.InferenceSession(ok.SerializeToString()).run(None, {"x": np.ones((1, 1, 4, 4), np.float32)})[0]
    assert out.shape == (1, 1, 9, 9)
    _refused(_model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[0, 0, 2**32, 0])], initializers=[w]),
             "Conv", "'pads'")


def test_an_initializer_too_large_for_any_address_space_is_refused():
    t = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2**30, 2**30], raw_data=b"")
    _refused(_model([helper.make_node("Add", ["x", "w"], ["y"])], initializers=[t]), "initializer 'w'",
             "more than an address space holds")


def test_a_malformed_node_inside_a_loop_body_is_refused_naming_the_attribute():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Relu", [], ["v_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, None)])
    trip = helper.make_tensor("trip", TensorProto.INT64, [], [2])
    loop = helper.make_node("Loop", ["trip", "", "x"], ["y"], body=body)
    _refused(_model([loop], initializers=[trip]), "attribute 'body'", "(Relu)", "has 0 input(s)")


def test_well_formed_models_still_load():
    model = _model([helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[2, 2], pads=[1, 1, 1, 1]),
                    helper.make_node("Cast", ["p"], ["y"], to=TensorProto.DOUBLE)])
    out = carrack.InferenceSession(model.SerializeToString()).run(None, {"x": np.ones((1, 1, 4, 4), np.float32)})[0]
    assert out.dtype == np.float64 and out.shape == (1, 1, 5, 5)


def test_a_constant_whose_tensor_does_not_decode_names_the_node():
    value = TensorProto(data_type=TensorProto.FLOAT, dims=[2, 3], raw_data=b"\0" * 8)
    node = helper.make_node("Constant", [], ["c"], name="weights", value=value)
    _refused(_model([node, helper.make_node("Add", ["x", "c"], ["y"])]), "Constant node 'weights'", "holds 8 bytes")


@pytest.mark.parametrize("version", [0, -1])
def test_an_opset_version_below_one_is_refused(version):
    model = _model([helper.make_node("Conv", ["x", "x"], [])])
    model.opset_import[0].version = version
    _refused(model, f"imports opset versions {{'ai.onnx': {version}}}")


def test_an_element_type_onnx_does_not_define_is_refused():
    model = _model([helper.make_node("Relu", ["x"], ["y"])])
    model.graph.input[0].type.tensor_type.elem_type = 100
    _refused(model, "input 'x' has element type 100, which ONNX does not define")


def test_a_layer_normalization_without_scale_is_refused_at_load():
    # below opset 17 LayerNormalization is onnxruntime's contrib op: no ONNX schema checks its inputs
    node = helper.make_node("LayerNormalization", ["x", ""], ["y"], name="ln")
    _refused(_model([node], opset=6), "LayerNormalization node 'ln': input 1 (Scale) is required")
