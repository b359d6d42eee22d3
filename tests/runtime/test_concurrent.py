"""ORT_PARALLEL: independent nodes run at the same time, with the sequential run's results."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.errors import RunFailure
from carrack.ops.registry import Kernel, register

TEST_DOMAIN = "carrack.test.concurrent"
_meeting = {"barrier": None}


@register("MeetPartner", domain=TEST_DOMAIN)
class MeetPartner(Kernel):
    """Waits until another MeetPartner node runs at the same time (fails after a timeout if run alone)."""

    def run(self, x):
        _meeting["barrier"].wait()  # the barrier's own timeout
        return x + 1


def _parallel_options(threads: int = 2) -> carrack.SessionOptions:
    options = carrack.SessionOptions()
    options.execution_mode = carrack.ExecutionMode.ORT_PARALLEL
    options.inter_op_num_threads = threads
    return options


def _two_branch_model() -> onnx.ModelProto:
    nodes = [helper.make_node("MeetPartner", ["x"], ["a"], domain=TEST_DOMAIN),
             helper.make_node("MeetPartner", ["x"], ["b"], domain=TEST_DOMAIN),
             helper.make_node("Add", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TEST_DOMAIN, 1)])


def test_independent_branches_run_at_the_same_time():
    _meeting["barrier"] = threading.Barrier(2, timeout=10)
    sess = carrack.InferenceSession(_two_branch_model().SerializeToString(), _parallel_options())
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], 2 * x + 2)


def test_sequential_mode_runs_one_node_at_a_time():
    _meeting["barrier"] = threading.Barrier(2, timeout=0.2)
    sess = carrack.InferenceSession(_two_branch_model().SerializeToString())
    with pytest.raises(RunFailure, match="MeetPartner"):  # the partner never comes: the barrier breaks
        sess.run(None, {"x": np.zeros(4, np.float32)})


def _inception_like(rng) -> onnx.ModelProto:
    """Four towers of convolutions over one input, concatenated; then a head: many independent nodes."""
    inits, nodes, towers = [], [], []
    for t, k in enumerate((1, 3, 5, 1)):
        w = rng.standard_normal((8, 4, k, k)).astype(np.float32)
        inits.append(onnx.numpy_helper.from_array(w, f"w{t}"))
        nodes.append(helper.make_node("Conv", ["x", f"w{t}"], [f"c{t}"], pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [f"c{t}"], [f"r{t}"]))
        towers.append(f"r{t}")
    nodes.append(helper.make_node("Concat", towers, ["cat"], axis=1))
    nodes.append(helper.make_node("ReduceMean", ["cat"], ["y"], axes=[2, 3], keepdims=0))
    nodes.append(helper.make_node("Sigmoid", ["r0"], ["side"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 9, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("side", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("threads", [2, 3, 0])
def test_parallel_matches_sequential(threads):
    rng = np.random.default_rng(0)
    model = _inception_like(rng).SerializeToString()
    x = rng.standard_normal((2, 4, 9, 9)).astype(np.float32)
    want = carrack.InferenceSession(model).run(None, {"x": x})
    sess = carrack.InferenceSession(model, _parallel_options(threads))
    for _ in range(5):
        for got, expected in zip(sess.run(None, {"x": x}), want):
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_parallel_session_shared_by_threads():
    rng = np.random.default_rng(1)
    model = _inception_like(rng).SerializeToString()
    sess = carrack.InferenceSession(model, _parallel_options())
    xs = [rng.standard_normal((2, 4, 9, 9)).astype(np.float32) for _ in range(6)]
    want = [sess.run(None, {"x": x}) for x in xs]
    got = [None] * len(xs)

    def work(i):
        got[i] = sess.run(None, {"x": xs[i]})

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            np.testing.assert_array_equal(a, b)


def test_failure_in_a_branch_names_the_node():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Reshape", ["x", "shape"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
                                           helper.make_tensor_value_info("shape", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = carrack.InferenceSession(model.SerializeToString(), _parallel_options())
    with pytest.raises(RunFailure, match="Reshape"):
        sess.run(None, {"x": np.zeros(4, np.float32), "shape": np.array([5], np.int64)})
    np.testing.assert_array_equal(  # and the session keeps working
        sess.run(None, {"x": np.ones(4, np.float32), "shape": np.array([4], np.int64)})[0], np.full(4, 2, np.float32))
