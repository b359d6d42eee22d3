"""SessionOptions.intra_op_num_threads limits numpy's BLAS pool while the session runs; the default leaves it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.runtime import program
from carrack.runtime.blas import blas_threads, limited_blas_threads, set_blas_threads


def _model() -> bytes:
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "ab"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.fixture
def threads_seen(monkeypatch):
    """Set the pool to 2 threads for the test (restored after); collects the pool size during each run."""
    before = blas_threads()
    if before is None:
        pytest.skip("numpy's BLAS thread count cannot be read here")
    set_blas_threads(2)
    seen: list[int | None] = []
    run = program.Program.run

    def recording_run(self, *args, **kwargs):
        seen.append(blas_threads())
        return run(self, *args, **kwargs)

    monkeypatch.setattr(program.Program, "run", recording_run)
    yield seen
    set_blas_threads(before)


def test_intra_op_threads_limit_blas_during_runs(threads_seen):
    options = carrack.SessionOptions()
    options.intra_op_num_threads = 1
    sess = carrack.InferenceSession(_model(), options)
    a = np.eye(2, dtype=np.float32)
    np.testing.assert_array_equal(sess.run(None, {"a": a, "b": a})[0], a)
    assert threads_seen == [1]
    assert blas_threads() == 2  # restored after the run


def test_default_leaves_blas_threads(threads_seen):
    sess = carrack.InferenceSession(_model())
    a = np.eye(2, dtype=np.float32)
    sess.run(None, {"a": a, "b": a})
    assert threads_seen == [2] and blas_threads() == 2


def test_limited_blas_threads_restores_after_errors(threads_seen):
    with pytest.raises(RuntimeError), limited_blas_threads(1):
        assert blas_threads() == 1
        raise RuntimeError("boom")
    assert blas_threads() == 2
