"""InferenceSession with the compiled executor (SessionOptions entry session.carrack.compiled_executor=native):
runs inside the declared maxima go to the compiled library and equal the plain session; others fall back."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.backends.c.emit import CompileError
from carrack.backends.c.executor import EXECUTOR_KEY, MAX_DIMS_KEY
from carrack.errors import InvalidArgument
from tests.compile.models import feeds, session_outputs

pytestmark = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                reason="no C compiler (apt-get install gcc)")


def _options(executor: str = "native", max_dims: str | None = "batch=4") -> carrack.SessionOptions:
    options = carrack.SessionOptions()
    options.add_session_config_entry(EXECUTOR_KEY, executor)
    if max_dims is not None:
        options.add_session_config_entry(MAX_DIMS_KEY, max_dims)
    return options


def test_runs_within_the_maxima_use_the_library_and_others_the_program(exported):
    path, _ = exported["small_cnn"]
    session = carrack.InferenceSession(str(path), _options())
    assert session._compiled is not None
    calls = []
    run = session._compiled.run
    session._compiled.run = lambda feed: calls.append(1) or run(feed)
    for feed in feeds("small_cnn"):  # batches 1, 3, 4: inside the maximum
        np.testing.assert_allclose(session.run(None, feed)[0], session_outputs(path, feed)[0], rtol=1e-5, atol=1e-6)
    assert len(calls) == 3
    big = {"x": np.random.default_rng(1).standard_normal((6, 3, 16, 16)).astype(np.float32)}
    np.testing.assert_allclose(session.run(None, big)[0], session_outputs(path, big)[0], rtol=1e-5, atol=1e-6)
    assert len(calls) == 3  # batch 6 ran on the session's program
    names = [o.name for o in session.get_outputs()]
    assert session.run(names, feeds("small_cnn")[0])[0].shape == (1, 10)


def test_unsupported_models_warn_and_keep_the_program(tmp_path):
    graph = helper.make_graph([helper.make_node("Cos", ["x"], ["y"])], "cos",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match="Cos"):
        session = carrack.InferenceSession(model.SerializeToString(), _options(max_dims=None))
    assert session._compiled is None
    x = np.array([0.0, 1.0], np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], np.cos(x), rtol=1e-6)


def test_bad_entries_are_named(exported):
    path, _ = exported["small_cnn"]
    with pytest.raises(InvalidArgument, match="native"):
        carrack.InferenceSession(str(path), _options(executor="wasm32"))
    with pytest.raises(InvalidArgument, match="NAME=SIZE"):
        carrack.InferenceSession(str(path), _options(max_dims="batch:4"))
    with pytest.raises(CompileError, match="batch"):
        carrack.InferenceSession(str(path), _options(max_dims=""))


def test_integer_inputs_run_on_the_library():
    """Feeds of int64, bool, uint8, int8 and int32 (each input's own type) go to the library; a float64 feed for an
    int64 input does not fit it and runs on the program, which names the type."""
    from tests.compile.test_values import _integer_feeds, _integer_graph

    model = _integer_graph().SerializeToString()
    session = carrack.InferenceSession(model, _options(max_dims="n=5"))
    plain = carrack.InferenceSession(model)
    calls = []
    run = session._compiled.run
    session._compiled.run = lambda feed: calls.append(1) or run(feed)
    for rows in (1, 4):
        feed = _integer_feeds(rows, rows)
        for got, want in zip(session.run(None, feed), plain.run(None, feed)):
            np.testing.assert_array_equal(got, want)
    assert len(calls) == 2
    feed = _integer_feeds(2, 0)
    feed["ids"] = feed["ids"].astype(np.float64)
    with pytest.raises(InvalidArgument, match="ids"):
        session.run(None, feed)
    assert len(calls) == 2
