"""A reused arena whose every step is bound (a one-row MLP, an embedding lookup and its projection) runs as its
bound calls and nothing else (`_BoundPlan.fast`): the same bits as the unbound run, its outputs the caller's own,
an error still named after its node, and runs that cannot trust the bound calls (a feed that does not fit its
staged buffer, a run that may be stopped) take the step-by-step loop."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.runtime.ort_session import RunOptions
from tests.helpers import one_thread_session

VOCAB, WIDTH = 20, 8


def _lookup_model() -> bytes:
    """ids -> Gather(table) -> MatMul(w) -> Add(bias) -> y."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((VOCAB, WIDTH), dtype=np.float32), "table")
    w = numpy_helper.from_array(rng.standard_normal((WIDTH, 3), dtype=np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(3, dtype=np.float32), "bias")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"]), helper.make_node("MatMul", ["rows", "w"], ["h"]),
             helper.make_node("Add", ["h", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 3])],
                              [table, w, bias])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _fast(session: carrack.InferenceSession):
    return session._program._spare_arenas[0][3][1].fast


def test_a_fully_bound_run_gives_the_unbound_bits_and_outputs_the_caller_owns():
    model = _lookup_model()
    session, unbound = one_thread_session(model), one_thread_session(model, bind=False)
    kept = []
    for seed in range(6):
        ids = np.random.default_rng(seed).integers(0, VOCAB, (1, 2), dtype=np.int64)
        got = session.run(None, {"ids": ids})
        for g, u in zip(got, unbound.run(None, {"ids": ids})):
            np.testing.assert_array_equal(g, u)
        kept.append([(g, g.copy()) for g in got])
    assert _fast(session) is not None
    for pairs in kept:  # later runs rewrote the arena and the kept results, not what the caller holds
        for g, copy in pairs:
            np.testing.assert_array_equal(g, copy)


def test_an_error_in_a_fully_bound_run_names_its_node_and_later_runs_are_right():
    model = _lookup_model()
    session, unbound = one_thread_session(model), one_thread_session(model, bind=False)
    ids = np.array([[1, 2]], np.int64)
    for _ in range(3):
        session.run(None, {"ids": ids})
    assert _fast(session) is not None
    with pytest.raises(carrack.CarrackError, match="Gather"):
        session.run(None, {"ids": np.array([[1, VOCAB]], np.int64)})
    for seed in (3, 4):
        ids = np.random.default_rng(seed).integers(0, VOCAB, (1, 2), dtype=np.int64)
        for g, u in zip(session.run(None, {"ids": ids}), unbound.run(None, {"ids": ids})):
            np.testing.assert_array_equal(g, u)


def test_runs_that_cannot_take_the_bound_calls_alone_run_step_by_step():
    model = _lookup_model()
    session = one_thread_session(model)
    ids = np.array([[3, 4]], np.int64)
    for _ in range(3):
        session.run(None, {"ids": ids})
    fast = _fast(session)
    assert fast is not None
    made = [call for _, call in fast[0]]
    calls = []
    plan = session._program._spare_arenas[0][3][1]
    plan.fast = (tuple((step, lambda call=call: (calls.append(1), call())) for step, call in fast[0]), fast[1])
    session.run(None, {"ids": ids})
    assert len(calls) == len(made)  # a trusted run: the fast form
    expected = one_thread_session(model, bind=False).run(None, {"ids": ids})
    got = session.run(None, {"ids": ids}, RunOptions())  # a run that may be stopped: checked before each step
    assert len(calls) == len(made)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
    program = session._program
    bound = session._plan.bind(session._sizes({"ids": ids}))
    odd = np.array([[3, 4]], np.int32)  # not the staged dtype: the bound calls must not run
    program.run([odd], bound=bound)
    assert len(calls) == len(made)
