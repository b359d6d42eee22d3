"""benchmarks/split_profile.py: the per-thread profile of a model's native products at 1 and 2 threads (the pool's
region trace matched to each MatMul call)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from carrack import native
from carrack.native import convolution as native_conv
from carrack.native import matmul as native_matmul
from tests.helpers import session_at

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
split_profile = pytest.importorskip("split_profile")

needs_native = pytest.mark.skipif(native.library("threadpool") is None or native_matmul._load() is None,
                                  reason="native kernels (and their thread pool) are not built here")


def _product_model(rows: int, depth: int, cols: int) -> bytes:
    weight = np.random.default_rng(0).standard_normal((depth, cols)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, depth])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, rows, cols])],
        [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@needs_native
def test_each_product_is_matched_to_its_split_region(monkeypatch):
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)  # split even this small product
    model = _product_model(64, 128, 192)
    feed = {"x": np.random.default_rng(1).standard_normal((1, 64, 128)).astype(np.float32)}
    result = split_profile.profile(session_at(model, 1), session_at(model, 2), feed, runs=3)
    [shape] = result.shapes
    assert shape.shape == (64, 128, 192)
    assert shape.calls_per_run == 1
    assert shape.regions == 3  # every 2-thread call found its region in the trace
    assert shape.one_thread_cpu_us > 0 and shape.region_wall_us > 0
    assert 0 <= shape.both_ran <= 3
    if shape.both_ran:  # (on a loaded machine the worker may have missed all three)
        assert shape.two_thread_cpu_us > 0 and shape.end_gap_us >= 0 and shape.worker_start_us >= 0
    assert 0 < result.split_wall <= result.two_thread_wall
    text = split_profile.report("product", result)
    assert "| 64x128x192 | 1 |" in text
    clock = split_profile._ProductClock()  # the wrappers are gone after the profile
    assert clock.inner == {"matmul_into": native_matmul.matmul_into,
                           "matmul_checked_into": native_matmul.matmul_checked_into}
    assert all(getattr(fn, "__name__", "") != "timed" for fn in clock.inner.values())


@needs_native
def test_a_deep_product_counts_both_of_its_regions(monkeypatch):
    """K >= 2048 and >= 4 N: the depth halves, then their sum, two regions of one call."""
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)
    model = _product_model(16, 2048, 64)
    feed = {"x": np.random.default_rng(1).standard_normal((1, 16, 2048)).astype(np.float32)}
    result = split_profile.profile(session_at(model, 1), session_at(model, 2), feed, runs=2)
    [shape] = result.shapes
    assert shape.shape == (16, 2048, 64) and shape.regions == 2


@needs_native
def test_a_product_left_to_numpy_is_not_profiled():
    model = _product_model(4, 16, 16)  # numpy_is_faster: never the native tile
    feed = {"x": np.ones((1, 4, 16), np.float32)}
    result = split_profile.profile(session_at(model, 1), session_at(model, 2), feed, runs=1)
    assert result.shapes == []
