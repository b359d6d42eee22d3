"""If / Loop / Scan against onnxruntime: optional trip count and condition, zero iterations, Scan-8 batching,
Scan-9 axes and directions, and outer-scope values read from nested subgraphs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _vi(name: str, elem: int, shape=None):
    return helper.make_tensor_value_info(name, elem, shape)


def _run_both(model: onnx.ModelProto, feeds: dict) -> tuple[list, list]:
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, feeds)
    return got, expected


def _assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, g.shape, e.dtype, e.shape)
        np.testing.assert_allclose(g, e, rtol=1e-6)


def _loop_model(opset: int, with_m: bool, with_cond: bool) -> onnx.ModelProto:
    # body: acc += x (outer scope); stop when acc > limit; scan output: acc * 2
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "x"], ["acc_out"]),
         helper.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
         helper.make_node("Less", ["total", "limit"], ["cond_out"]),
         helper.make_node("Add", ["acc_out", "acc_out"], ["doubled"])],
        "body", [_vi("i", I64, []), _vi("cond_in", B, []), _vi("acc_in", F, [2])],
        [_vi("cond_out", B, []), _vi("acc_out", F, [2]), _vi("doubled", F, [2])])
    node = helper.make_node("Loop", ["M" if with_m else "", "cond" if with_cond else "", "acc0"],
                            ["acc", "scan"], body=body)
    inputs = [_vi("acc0", F, [2]), _vi("x", F, [2]), _vi("limit", F, [])]
    if with_m:
        inputs.append(_vi("M", I64, []))
    if with_cond:
        inputs.append(_vi("cond", B, []))
    graph = helper.make_graph([node], "g", inputs, [_vi("acc", F, [2]), _vi("scan", F, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("opset", [11, 13, 16])
@pytest.mark.parametrize("with_m,with_cond", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("trips", [0, 3, 10])
def test_loop(opset, with_m, with_cond, trips):
    feeds = {"acc0": np.array([1.0, 2.0], np.float32), "x": np.array([0.5, 1.0], np.float32),
             "limit": np.array(8.0, np.float32)}
    if with_m:
        feeds["M"] = np.array(trips, np.int64)
    if with_cond:
        feeds["cond"] = np.array(trips > 0 or with_m)
    got, expected = _run_both(_loop_model(opset, with_m, with_cond), feeds)
    if got[1].size == 0:  # zero iterations: an empty scan output
        assert got[1].shape[0] == 0 and expected[1].size == 0
        _assert_same(got[:1], expected[:1])
    else:
        _assert_same(got, expected)


def test_if_reads_outer_scope_inside_loop():
    """A nested subgraph (If inside Loop) reads a value defined in the outermost graph."""
    then_g = helper.make_graph([helper.make_node("Add", ["v_in", "outer"], ["r"])], "then", [], [_vi("r", F, [1])])
    else_g = helper.make_graph([helper.make_node("Sub", ["v_in", "outer"], ["r2"])], "else", [], [_vi("r2", F, [1])])
    body = helper.make_graph(
        [helper.make_node("Greater", ["v_in", "zero"], ["pos"]),
         helper.make_node("Squeeze", ["pos"], ["pos_s"]),
         helper.make_node("If", ["pos_s"], ["v_out"], then_branch=then_g, else_branch=else_g),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [_vi("i", I64, []), _vi("cond_in", B, []), _vi("v_in", F, [1])],
        [_vi("cond_out", B, []), _vi("v_out", F, [1])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["M", "", "v0"], ["v"], body=body)], "g",
        [_vi("M", I64, []), _vi("v0", F, [1]), _vi("outer", F, [1]), _vi("zero", F, [1])], [_vi("v", F, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    feeds = {"M": np.array(4, np.int64), "v0": np.array([-1.0], np.float32), "outer": np.array([1.5], np.float32),
             "zero": np.array([0.0], np.float32)}
    _assert_same(*_run_both(model, feeds))


def _scan_body(n_state_dims: int = 1) -> onnx.GraphProto:
    return helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]), helper.make_node("Mul", ["s_out", "x_t"], ["y_t"])],
        "body", [_vi("s_in", F, None), _vi("x_t", F, None)], [_vi("s_out", F, None), _vi("y_t", F, None)])


@pytest.mark.parametrize("in_axis,in_dir,out_axis,out_dir", [(0, 0, 0, 0), (1, 1, 0, 0), (1, 0, 1, 1),
                                                             (-1, 1, -1, 0)])
def test_scan9_axes_and_directions(in_axis, in_dir, out_axis, out_dir):
    node = helper.make_node("Scan", ["s0", "x"], ["s", "y"], body=_scan_body(), num_scan_inputs=1,
                            scan_input_axes=[in_axis], scan_input_directions=[in_dir],
                            scan_output_axes=[out_axis], scan_output_directions=[out_dir])
    graph = helper.make_graph([node], "g", [_vi("s0", F, [3]), _vi("x", F, [3, 3])],
                              [_vi("s", F, None), _vi("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=8)
    feeds = {"s0": np.array([1, 2, 3], np.float32), "x": np.arange(9, dtype=np.float32).reshape(3, 3) / 4}
    _assert_same(*_run_both(model, feeds))


@pytest.mark.parametrize("with_lens", [False, True])
def test_scan8_batched(with_lens):
    node = helper.make_node("Scan", ["lens" if with_lens else "", "s0", "x"], ["s", "y"], body=_scan_body(),
                            num_scan_inputs=1, directions=[1])
    inputs = [_vi("s0", F, [2, 3]), _vi("x", F, [2, 4, 3])] + ([_vi("lens", TensorProto.INT32, [2])]
                                                               if with_lens else [])
    graph = helper.make_graph([node], "g", inputs, [_vi("s", F, None), _vi("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=8)
    feeds = {"s0": np.ones((2, 3), np.float32), "x": np.arange(24, dtype=np.float32).reshape(2, 4, 3) / 8}
    if with_lens:
        feeds["lens"] = np.array([4, 2], np.int32)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, feeds)
    if not with_lens:
        _assert_same(got, ort.InferenceSession(model.SerializeToString(),
                                               providers=["CPUExecutionProvider"]).run(None, feeds))
        return
    # batch row 1 scans only its first 2 steps (in reverse); its later outputs are padding
    s, y = np.ones(3, np.float32), []
    for t in (1, 0):
        s = s + feeds["x"][1, t]
        y.append(s * feeds["x"][1, t])
    np.testing.assert_allclose(got[0][1], s)
    np.testing.assert_allclose(got[1][1, :2], y)
    assert got[1].shape == (2, 4, 3)


def test_if_returns_sequence():
    then_g = helper.make_graph([helper.make_node("SequenceConstruct", ["a", "b"], ["seq"])], "then", [],
                               [helper.make_tensor_sequence_value_info("seq", F, None)])
    else_g = helper.make_graph([helper.make_node("SequenceConstruct", ["b"], ["seq2"])], "else", [],
                               [helper.make_tensor_sequence_value_info("seq2", F, None)])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["out"], then_branch=then_g, else_branch=else_g)], "g",
        [_vi("c", B, []), _vi("a", F, [2]), _vi("b", F, [2])],
        [helper.make_tensor_sequence_value_info("out", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    sess = carrack.InferenceSession(model.SerializeToString())
    a, b = np.array([1, 2], np.float32), np.array([3, 4], np.float32)
    assert len(sess.run(None, {"c": np.array(True), "a": a, "b": b})[0]) == 2
    assert len(sess.run(None, {"c": np.array(False), "a": a, "b": b})[0]) == 1
