"""The native float32 MatMul (carrack.native.matmul, convgemm.c's matmul_f32): against float64 products for row
counts, depths and widths around its tiles and depth blocks, arrays it must refuse, thread splits, and the MatMul
operator in a session against onnxruntime and the numpy path."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from carrack import native
from carrack.native import convolution as native_conv
from carrack.native import matmul as native_matmul
from carrack.runtime.session import InferenceSession
from tests.helpers import ort_run

pytestmark = pytest.mark.skipif(native_matmul._load() is None, reason="no vectorised native matmul here")


@pytest.fixture(autouse=True)
def _no_numpy_floor(monkeypatch):
    """These tests check the native tile itself, at sizes numpy takes in a run (numpy_is_faster): no floor here."""
    monkeypatch.setattr(native_matmul, "SINGLE_THREAD_BLAS_WORK", 0)
    monkeypatch.setattr(native_matmul, "SINGLE_THREAD_GEMV_WORK", 0)


def _check(t: int, k: int, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((t, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    y = np.full((t, n), np.nan, np.float32)
    assert native_matmul.matmul_into(a, b, y)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("t", [8, 9, 13, 64, 127, 197, 256])
def test_rows_around_the_tile(t):
    _check(t, 96, 130, seed=t)


@pytest.mark.parametrize("k,n", [(64, 64), (65, 64), (127, 200), (128, 65), (200, 1000), (768, 79)])
def test_depths_and_widths_around_blocks_and_panels(k, n):
    _check(24, k, n, seed=k + n)


def test_refuses_what_it_does_not_cover():
    a = np.ones((32, 128), np.float32)
    b = np.ones((128, 96), np.float32)
    y = np.empty((32, 96), np.float32)
    assert not native_matmul.matmul_into(a[:, ::2], b[::2], y[:, :])  # strided rows
    assert not native_matmul.matmul_into(a, b, np.empty((32, 96), np.float64))
    assert not native_matmul.pays(4, 128, 96)  # too few rows to pay (a run with threads still takes them)
    assert not native_matmul.matmul_into(a, b, y.T.copy().T)  # not C-contiguous
    big = np.zeros((128, 128), np.float32)
    assert not native_matmul.matmul_into(big[:32], big, big[32:64, :])  # the result would overwrite an operand
    raw = np.zeros(32 * 128 * 4 + 2, np.uint8)
    assert not native_matmul.matmul_into(raw[2:].view(np.float32).reshape(32, 128), b, y)  # misaligned


def test_thread_split_gives_the_same_result(monkeypatch):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((100, 300)).astype(np.float32)
    b = rng.standard_normal((300, 500)).astype(np.float32)
    one = np.empty((100, 500), np.float32)
    assert native_matmul.matmul_into(a, b, one)
    monkeypatch.setattr(native, "threads", lambda: 2)
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)
    split = np.empty_like(one)
    assert native_matmul.matmul_into(a, b, split)
    np.testing.assert_array_equal(one, split)  # every tile sums in the same order on any thread


@pytest.mark.parametrize("shape", [(1, 64, 768), (2, 17, 96), (200, 64)])
def test_matmul_operator_matches_onnxruntime(monkeypatch, shape):
    rng = np.random.default_rng(len(shape))
    w = rng.standard_normal((shape[-1], 80)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    x = rng.standard_normal(shape).astype(np.float32)
    calls = []
    original = native_matmul.matmul_into
    monkeypatch.setattr(native_matmul, "matmul_into", lambda *args: calls.append(1) or original(*args))
    got = InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert calls and got.shape == shape[:-1] + (80,)
    np.testing.assert_allclose(got, ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("CARRACK_NATIVE", "0")
    np.testing.assert_allclose(got, InferenceSession(model.SerializeToString()).run(None, {"x": x})[0],
                               rtol=1e-4, atol=1e-4)
