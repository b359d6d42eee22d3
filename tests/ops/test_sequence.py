"""Sequence and optional kernels against onnxruntime: positions (negative, default), SplitToSequence forms,
ConcatFromSequence new_axis, and optionals."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _compare(model: onnx.ModelProto, feeds: dict) -> None:
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, feeds)
    for g, e in zip(got, expected):
        if isinstance(e, list):
            assert len(g) == len(e)
            for gi, ei in zip(g, e):
                assert gi.dtype == ei.dtype and gi.shape == ei.shape
                np.testing.assert_array_equal(gi, ei)
        else:
            assert g.dtype == e.dtype and g.shape == e.shape
            np.testing.assert_array_equal(g, e)


A = np.arange(6, dtype=np.float32).reshape(2, 3)
B = -A
C = A * 10


def _seq_then(op_nodes, extra_inputs=(), outputs=None):
    construct = helper.make_node("SequenceConstruct", ["a", "b", "c"], ["s"])
    inputs = [helper.make_tensor_value_info(n, F, [2, 3]) for n in "abc"] + list(extra_inputs)
    return _model([construct, *op_nodes], inputs, outputs)


@pytest.mark.parametrize("pos", [0, 2, -1, -3])
def test_sequence_at(pos):
    model = _seq_then([helper.make_node("SequenceAt", ["s", "p"], ["y"])],
                      [helper.make_tensor_value_info("p", I64, [])], [helper.make_tensor_value_info("y", F, None)])
    _compare(model, {"a": A, "b": B, "c": C, "p": np.array(pos, np.int64)})


@pytest.mark.parametrize("pos", [None, 0, 3, -1])
def test_sequence_insert_erase_length(pos):
    p = [] if pos is None else ["p"]
    nodes = [helper.make_node("SequenceInsert", ["s", "a", *p], ["s2"]),
             helper.make_node("SequenceErase", ["s2", *p], ["s3"]),
             helper.make_node("SequenceLength", ["s2"], ["n"]),
             helper.make_node("ConcatFromSequence", ["s3"], ["y"], axis=0)]
    extra = [] if pos is None else [helper.make_tensor_value_info("p", I64, [])]
    model = _seq_then(nodes, extra, [helper.make_tensor_value_info("n", I64, None),
                                     helper.make_tensor_value_info("y", F, None)])
    feeds = {"a": A, "b": B, "c": C} | ({} if pos is None else {"p": np.array(pos, np.int64)})
    _compare(model, feeds)


@pytest.mark.parametrize("axis,new_axis", [(0, 0), (1, 0), (0, 1), (2, 1), (-1, 1)])
def test_concat_from_sequence(axis, new_axis):
    model = _seq_then([helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=axis, new_axis=new_axis)], [],
                      [helper.make_tensor_value_info("y", F, None)])
    _compare(model, {"a": A, "b": B, "c": C})


@pytest.mark.parametrize("split,keepdims", [(None, 1), (None, 0), (np.array(2, np.int64), 1),
                                            (np.array([1, 4], np.int64), 0)])
def test_split_to_sequence(split, keepdims):
    x = np.arange(20, dtype=np.float32).reshape(4, 5)
    ins = ["x"] + ([] if split is None else ["split"])
    nodes = [helper.make_node("SplitToSequence", ins, ["s"], axis=1, keepdims=keepdims)]
    inputs = [helper.make_tensor_value_info("x", F, [4, 5])]
    feeds = {"x": x}
    if split is not None:
        inputs.append(helper.make_tensor_value_info("split", I64, list(split.shape)))
        feeds["split"] = split
    model = _model(nodes, inputs, [helper.make_tensor_sequence_value_info("s", F, None)])
    _compare(model, feeds)


def test_sequence_empty_then_insert():
    nodes = [helper.make_node("SequenceEmpty", [], ["s"], dtype=F),
             helper.make_node("SequenceInsert", ["s", "a"], ["s2"]),
             helper.make_node("SequenceLength", ["s"], ["n0"]),
             helper.make_node("SequenceLength", ["s2"], ["n1"])]
    model = _model(nodes, [helper.make_tensor_value_info("a", F, [2, 3])],
                   [helper.make_tensor_value_info("n0", I64, None), helper.make_tensor_value_info("n1", I64, None)])
    _compare(model, {"a": A})


def test_optional_roundtrip_and_empty():
    opt_type = helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [2, 3]))
    nodes = [helper.make_node("Optional", ["a"], ["o"]),
             helper.make_node("OptionalHasElement", ["o"], ["has"]),
             helper.make_node("OptionalGetElement", ["o"], ["y"]),
             helper.make_node("Optional", [], ["e"], type=helper.make_tensor_type_proto(F, [2, 3])),
             helper.make_node("OptionalHasElement", ["e"], ["has_e"])]
    model = _model(nodes, [helper.make_tensor_value_info("a", F, [2, 3])],
                   [helper.make_tensor_value_info("has", TensorProto.BOOL, None),
                    helper.make_tensor_value_info("y", F, None),
                    helper.make_tensor_value_info("has_e", TensorProto.BOOL, None)])
    del opt_type
    _compare(model, {"a": A})
