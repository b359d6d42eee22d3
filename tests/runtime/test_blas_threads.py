"""SessionOptions.intra_op_num_threads is the thread count of the session's own runs: the native kernels read it
per run and per Python thread; numpy's process-wide BLAS pool is left as it is (other sessions and threads use
it too)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

import carrack
from carrack import native
from carrack.native import intra_op
from carrack.runtime import program
from carrack.runtime.blas import blas_threads, limited_blas_threads, set_blas_threads


def _model() -> bytes:
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "ab"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _session(threads: int | None = None) -> carrack.InferenceSession:
    options = carrack.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    return carrack.InferenceSession(_model(), options)


@pytest.fixture
def seen(monkeypatch):
    """Numpy's BLAS pool at 2 threads for the test (restored after); records, per run, the Python thread, the
    native kernels' thread count and the BLAS pool's size while the run executes."""
    before = blas_threads()
    if before is None:
        pytest.skip("numpy's BLAS thread count cannot be read here")
    set_blas_threads(2)
    records: list[tuple[int, int, int | None]] = []
    run = program.Program.run

    def recording_run(self, *args, **kwargs):
        records.append((threading.get_ident(), native.threads(), blas_threads()))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(program.Program, "run", recording_run)
    yield records
    set_blas_threads(before)


def test_intra_op_threads_set_the_runs_count_only(seen):
    a = np.eye(2, dtype=np.float32)
    np.testing.assert_array_equal(_session(1).run(None, {"a": a, "b": a})[0], a)
    np.testing.assert_array_equal(_session(3).run(None, {"a": a, "b": a})[0], a)
    assert [(count, pool) for _, count, pool in seen] == [(1, 2), (3, 2)]  # BLAS's pool untouched
    assert native.threads() == intra_op.default_threads() and blas_threads() == 2


def test_default_uses_one_thread_per_core(seen):
    a = np.eye(2, dtype=np.float32)
    _session().run(None, {"a": a, "b": a})
    assert [count for _, count, _ in seen] == [intra_op.cores()] or intra_op.default_threads() != intra_op.cores()


def test_sessions_beside_each_other_keep_their_counts(seen):
    """A one-thread session running beside a default one, each in its own Python thread, at the same time."""
    single, default = _session(1), _session()
    a = np.eye(2, dtype=np.float32)
    start = threading.Barrier(2)
    counts: dict[str, int] = {}

    def loop(name: str, sess: carrack.InferenceSession) -> None:
        start.wait()
        for _ in range(50):
            np.testing.assert_array_equal(sess.run(None, {"a": a, "b": a})[0], a)
        counts[name] = threading.get_ident()

    threads = [threading.Thread(target=loop, args=item) for item in (("single", single), ("default", default))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_thread: dict[int, set[int]] = {}
    for ident, count, _ in seen:
        by_thread.setdefault(ident, set()).add(count)
    assert by_thread[counts["single"]] == {1}
    assert by_thread[counts["default"]] == {intra_op.default_threads()}


def test_limited_blas_threads_restores_after_errors(seen):
    with pytest.raises(RuntimeError), limited_blas_threads(1):
        assert blas_threads() == 1
        raise RuntimeError("boom")
    assert blas_threads() == 2


def _matmul_model(rows: int, depth: int, cols: int, weight: np.ndarray) -> bytes:
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, depth])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("w", TensorProto.FLOAT, weight.shape, weight.ravel())])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_products_keep_to_a_smaller_runs_count(seen, monkeypatch):
    """A product numpy's 2-thread BLAS would do runs on the native kernel, on the run's one thread, when the
    session allows fewer threads than BLAS has; with the default count it stays with BLAS."""
    from carrack.native import matmul as native_matmul

    if native_matmul._load() is None:
        pytest.skip("the native MatMul kernel is not built here")
    monkeypatch.setattr(intra_op, "cores", lambda: 2)
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((96, 70)).astype(np.float32)
    x = rng.standard_normal((600, 96)).astype(np.float32)  # more rows than the native kernel takes by choice
    model = _matmul_model(600, 96, 70, weight)
    native_calls = []
    original = native_matmul.matmul_into
    monkeypatch.setattr(native_matmul, "matmul_into", lambda *args: native_calls.append(native.threads())
                        or original(*args))
    options = carrack.SessionOptions()
    options.intra_op_num_threads = 1
    single = carrack.InferenceSession(model, options).run(None, {"x": x})[0]
    np.testing.assert_allclose(single, x @ weight, rtol=1e-4, atol=1e-4)
    assert native_calls == [1]
    default = carrack.InferenceSession(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(default, x @ weight, rtol=1e-4, atol=1e-4)
    assert native_calls == [1]  # the default run left it to BLAS
    assert not native_matmul.blas_exceeds_run()
