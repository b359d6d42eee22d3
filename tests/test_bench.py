"""carrack/bench.py on a tiny model: result structure, feeds, profiling (never timings)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.bench import (
    add_bench_parser,
    benchmark,
    blas_threads,
    limited_blas_threads,
    peak_rss_bytes,
    profiling_options,
    run_profile,
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """y = relu(x @ W + b) with a symbolic batch dim."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "W")
    b = numpy_helper.from_array(np.array([-1.0, 0.0, 1.0], dtype=np.float32), "B")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
         helper.make_node("Add", ["xw", "B"], ["pre"], name="add"),
         helper.make_node("Relu", ["pre"], ["y"], name="relu")],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], initializer=[w, b])
    path = tmp_path_factory.mktemp("bench") / "tiny.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return str(path)


def test_benchmark_counts_runs_and_binds_dims(tiny_model):
    result = benchmark(tiny_model, dims={"batch": 3}, iters=4, warmup=1)
    assert len(result.times_s) == 4
    assert result.feed_shapes == {"x": (3, 4)}
    assert result.batch == 3
    assert result.percentile(50) <= result.percentile(90) <= result.percentile(99) <= max(result.times_s)
    assert result.throughput > 0
    assert result.peak_rss >= result.rss_after_load > 0
    text = result.format()
    for word in ("p50", "p90", "p99", "inferences/s", "samples/s (batch 3)", "peak RSS"):
        assert word in text
    assert result.profile is None


def test_benchmark_uses_given_feed(tiny_model):
    x = np.ones((2, 4), np.float32)
    result = benchmark(tiny_model, feed={"x": x}, iters=1, warmup=0, threads=1)
    assert result.feed_shapes == {"x": (2, 4)}
    assert result.threads == 1


def test_benchmark_profile_leaves_warmup_out(tiny_model, tmp_path):
    trace = tmp_path / "trace.json"
    result = benchmark(tiny_model, iters=3, warmup=2, profile=True, trace_path=str(trace))
    assert result.profile is not None and result.profile.trace_path == str(trace)
    events = json.loads(trace.read_text())
    assert sum(e["name"] == "model_run" for e in events) == 3
    assert "op type" in result.profile.table
    assert "profile trace" in result.format()


def test_run_profile_from_path(tiny_model, tmp_path):
    feed = {"x": np.ones((5, 4), np.float32)}
    prof = run_profile(tiny_model, feed, iters=2, warmup=1, trace_path=str(tmp_path / "t.json"))
    assert len(prof.times_s) == 2
    expected = carrack.InferenceSession(tiny_model).run(None, feed)[0]
    np.testing.assert_allclose(prof.outputs[0], expected)
    events = json.loads((tmp_path / "t.json").read_text())
    assert sum(e["name"] == "model_run" for e in events) == 2
    assert prof.events == len(events)


def test_run_profile_from_profiling_session(tiny_model, tmp_path):
    sess = carrack.InferenceSession(tiny_model, profiling_options())
    prof = run_profile(sess, {"x": np.ones((1, 4), np.float32)}, iters=1, warmup=0, trace_path=str(tmp_path / "p.json"))
    assert prof.outputs[0].shape == (1, 3)


def test_run_profile_rejects_session_without_profiling(tiny_model):
    with pytest.raises(ValueError, match="enable_profiling"):
        run_profile(carrack.InferenceSession(tiny_model), {"x": np.ones((1, 4), np.float32)})


def test_profiling_options_copies():
    base = carrack.SessionOptions(intra_op_num_threads=2)
    opts = profiling_options(base)
    assert opts.enable_profiling and opts.intra_op_num_threads == 2
    assert not base.enable_profiling


def test_cmd_bench_prints_report(tiny_model, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    trace = tmp_path / "cli.json"
    args = parser.parse_args(["bench", tiny_model, "--dim", "batch=2", "--iters", "2", "--warmup", "0",
                              "--threads", "1", "--profile", "--trace", str(trace)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "x [2, 4]" in out and "latency ms" in out and f"profile trace: {trace}" in out
    assert trace.is_file()


def test_process_facts():
    assert peak_rss_bytes() > 0


def test_blas_threads_restored():
    before = blas_threads()
    with limited_blas_threads(1):
        if before is not None:
            assert blas_threads() == 1
    assert blas_threads() == before


def test_synthetic_integer_inputs_stay_in_range(tmp_path):
    """Token-id style inputs index a 2-row table: synthetic ids must be valid for it."""
    table = numpy_helper.from_array(np.ones((2, 3), np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"])], "ids",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 3])], initializer=[table])
    path = tmp_path / "ids.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString())
    result = benchmark(str(path), dims={"seq": 16}, iters=1, warmup=0)
    assert result.feed_shapes == {"ids": (1, 16)}


def test_benchmark_reports_the_share_of_time_on_split_kernels(tmp_path):
    from carrack import native

    if native.library("threadpool") is None or native.library("convgemm") is None:
        pytest.skip("native kernels are not built here")
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((512, 512)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [128, 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [128, 512])], [weight])
    path = tmp_path / "matmul.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    one = benchmark(str(path), iters=3, warmup=1, threads=1)
    two = benchmark(str(path), iters=3, warmup=1, threads=2)
    assert one.split_share == 0.0
    assert 0.0 < two.split_share <= 1.0 + 1e-6  # the product is split; its Python and the executor are not
    assert "cores:" in two.format()
