"""The onnxruntime-compatible session API: metadata, feeds, errors, threads."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.errors import InvalidArgument
from tests.helpers import tensor_info


def _mlp_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"]), helper.make_node("Shape", ["x"], ["s"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", None])
    s = helper.make_tensor_value_info("s", TensorProto.INT64, [2])
    graph = helper.make_graph(nodes, "mlp", [x], [y, s], initializer=[w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _reference(x: np.ndarray) -> np.ndarray:
    m = _mlp_model()
    w1, w2 = (numpy_helper.to_array(t) for t in m.graph.initializer)
    return np.maximum(x @ w1, 0) @ w2


def test_inputs_and_outputs_describe_the_model():
    sess = carrack.InferenceSession(_mlp_model())
    (inp,) = sess.get_inputs()
    assert (inp.name, inp.type, inp.shape) == ("x", "tensor(float)", ["batch", 8])
    y, s = sess.get_outputs()
    assert (y.name, y.type, y.shape) == ("y", "tensor(float)", ["batch", None])
    assert (s.name, s.type, s.shape) == ("s", "tensor(int64)", [2])
    assert sess.get_providers() == ["CPUExecutionProvider"]


def test_run_all_and_selected_outputs():
    sess = carrack.InferenceSession(_mlp_model())
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    y, s = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, _reference(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(s, [5, 8])
    (s_only,) = sess.run(["s"], {"x": x})
    np.testing.assert_array_equal(s_only, [5, 8])


@pytest.mark.parametrize("feed, message", [
    ({}, "missing input"),
    ({"x": np.zeros((2, 8), np.float32), "extra": np.zeros(1)}, "unknown input name"),
    ({"x": np.zeros((2, 8), np.float64)}, r"'x'.*expected tensor\(float\), got tensor\(double\)"),
    ({"x": np.zeros((2, 8, 1), np.float32)}, "'x' has the wrong rank: expected 2"),
    ({"x": np.zeros((2, 7), np.float32)}, "'x' has the wrong size on axis 1: expected 8"),
    ({"x": None}, "'x' is None"),
])
def test_bad_feeds_name_the_input(feed, message):
    sess = carrack.InferenceSession(_mlp_model())
    with pytest.raises(InvalidArgument, match=message):
        sess.run(None, feed)


def test_unknown_output_name():
    sess = carrack.InferenceSession(_mlp_model())
    with pytest.raises(InvalidArgument, match="unknown output"):
        sess.run(["nope"], {"x": np.zeros((1, 8), np.float32)})


def test_same_symbol_must_bind_the_same_size():
    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [tensor_info("a", shape=["n"]), tensor_info("b", shape=["n"])],
                              [tensor_info("y", shape=["n"])])
    sess = carrack.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(InvalidArgument, match="dim 'n'"):
        sess.run(None, {"a": np.zeros(3, np.float32), "b": np.zeros(4, np.float32)})


def test_feeds_are_not_modified_and_any_layout_is_accepted():
    sess = carrack.InferenceSession(_mlp_model())
    base = np.random.default_rng(2).standard_normal((8, 10)).astype(np.float32)
    layouts = {
        "transposed view": base.T,
        "fortran": np.asfortranarray(base.T),
        "negative strides": base.T[::-1][::-1],
        "big endian": base.T.astype(">f4"),
        "read-only": np.frombuffer(base.T.copy().tobytes(), np.float32).reshape(10, 8),
        "misaligned": np.frombuffer(b"\0" + base.T.copy().tobytes(), np.float32, offset=1).reshape(10, 8),
    }
    expected = _reference(np.ascontiguousarray(base.T))
    for label, x in layouts.items():
        before = x.copy()
        y, _ = sess.run(None, {"x": x})
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5, err_msg=label)
        np.testing.assert_array_equal(x, before, err_msg=label)


def test_concurrent_runs_match_serial_runs():
    sess = carrack.InferenceSession(_mlp_model())
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((int(rng.integers(1, 9)), 8)).astype(np.float32) for _ in range(32)]
    serial = [sess.run(None, {"x": x})[0] for x in xs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        parallel = list(pool.map(lambda x: sess.run(None, {"x": x})[0], xs))
    for a, b in zip(serial, parallel):
        np.testing.assert_array_equal(a, b)


def test_overridable_initializer():
    w = numpy_helper.from_array(np.full(3, 2.0, np.float32), "w")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "g",
                              [tensor_info("x", shape=[3]), tensor_info("w", shape=[3])], [tensor_info("y", shape=[3])],
                              initializer=[w])
    sess = carrack.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert [a.name for a in sess.get_inputs()] == ["x"]
    assert [a.name for a in sess.get_overridable_initializers()] == ["w"]
    x = np.ones(3, np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], [2, 2, 2])
    np.testing.assert_array_equal(sess.run(None, {"x": x, "w": np.full(3, 5.0, np.float32)})[0], [5, 5, 5])


def test_if_branch_reads_outer_scope():
    then = helper.make_graph([helper.make_node("Add", ["x", "x"], ["t"])], "then", [], [tensor_info("t")])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [tensor_info("e")])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [tensor_info("c", TensorProto.BOOL, []), tensor_info("x", shape=[2])],
                              [tensor_info("y")])
    sess = carrack.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.array([1.0, -2.0], np.float32)
    np.testing.assert_array_equal(sess.run(None, {"c": np.array(True), "x": x})[0], [2, -4])
    np.testing.assert_array_equal(sess.run(None, {"c": np.array(False), "x": x})[0], [-1, 2])


def test_session_options_are_accepted():
    opts = carrack.SessionOptions()
    opts.graph_optimization_level = carrack.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    sess = carrack.InferenceSession(_mlp_model().SerializeToString(), sess_options=opts,
                                    providers=["CPUExecutionProvider"])
    assert sess.get_session_options() is opts


def test_placeholder_dims_are_hints_not_constraints():
    nodes = [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Relu", ["b"], ["z"])]
    graph = helper.make_graph(nodes, "g", [tensor_info("a", shape=["unk__1"]), tensor_info("b", shape=["unk__1"])],
                              [tensor_info("y"), tensor_info("z")])
    sess = carrack.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    y, z = sess.run(None, {"a": np.ones(3, np.float32), "b": np.ones(5, np.float32)})
    assert y.shape == (3,) and z.shape == (5,)


def test_profiling_writes_a_chrome_trace(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    opts = carrack.SessionOptions()
    opts.enable_profiling = True
    sess = carrack.InferenceSession(_mlp_model(), opts)
    for _ in range(3):
        sess.run(None, {"x": np.ones((2, 8), np.float32)})
    table = sess.profiler.table()
    assert "FusedMatMul" in table and "slowest nodes" in table  # MatMul + Relu fused by the optimizer
    path = sess.end_profiling()
    events = json.load(open(path))
    assert {e["args"]["op_name"] for e in events if e["cat"] == "Node"} >= {"FusedMatMul", "MatMul"}
    assert "model_run" in {e["name"] for e in events if e["cat"] == "Session"}
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)


def test_outputs_are_the_callers_to_keep():
    w = numpy_helper.from_array(np.arange(3, dtype=np.float32), "w")
    nodes = [helper.make_node("Identity", ["w"], ["const_out"]), helper.make_node("Reshape", ["x", "shape"], ["view"])]
    shape = numpy_helper.from_array(np.array([3]), "shape")
    graph = helper.make_graph(nodes, "g", [tensor_info("x", shape=[1, 3])],
                              [tensor_info("const_out", shape=[3]), tensor_info("view", shape=[3])],
                              initializer=[w, shape])
    opts = carrack.SessionOptions()
    opts.graph_optimization_level = carrack.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = carrack.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), opts)
    x = np.ones((1, 3), np.float32)
    const_out, view = sess.run(None, {"x": x})
    const_out[:] = 100
    view[:] = 7
    assert np.array_equal(x, np.ones((1, 3))), "writing an output changed the caller's input"
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], [0, 1, 2])


def test_placeholder_dims_are_never_bound_to_each_other():
    """Two inputs annotated unk__1 are independent sizes: Shape of each reports its own (the specialised program
    folds shapes from the bound dims, so a shared binding would give a wrong answer here)."""
    nodes = [helper.make_node("Shape", ["a"], ["sa"]), helper.make_node("Shape", ["b"], ["sb"])]
    graph = helper.make_graph(nodes, "g", [tensor_info("a", shape=["unk__1"]), tensor_info("b", shape=["unk__1"])],
                              [tensor_info("sa", TensorProto.INT64, [1]), tensor_info("sb", TensorProto.INT64, [1])])
    sess = carrack.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    sa, sb = sess.run(None, {"a": np.ones(3, np.float32), "b": np.ones(5, np.float32)})
    assert sa.tolist() == [3] and sb.tolist() == [5]
