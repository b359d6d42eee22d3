"""Native kernels called through callpack.c's one-pointer entry (carrack/native/packed.py): the same results as
the ctypes call with every argument converted (bit for bit: the same kernel, so any difference is a marshalling
error), float parameters carried as their bits, NULL pointers, one packet per thread under concurrent calls, the
ctypes fallback, and the size floor below which products go to numpy (carrack.native.matmul.numpy_is_faster)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

from carrack.native import data_address, packed, rowops
from carrack.native import matmul as native_matmul
from carrack.runtime import blas
from carrack.runtime.session import InferenceSession, SessionOptions
from tests.helpers import ort_run

callpack_loads = packed._load_entry() is not None
needs_callpack = pytest.mark.skipif(not callpack_loads or rowops.library() is None or native_matmul._load() is None,
                                    reason="callpack or the native kernels unavailable here")
rng = np.random.default_rng(15)


def _rand(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@needs_callpack
def test_the_kernels_go_through_the_packet():
    lib = rowops.library()
    for kernel in (lib.carrack_packed_softmax, lib.carrack_packed_layer_norm, lib.carrack_packed_gelu,
                   *native_matmul._packed_kernels()):
        assert isinstance(kernel, packed.PackedKernel), kernel


@needs_callpack
@pytest.mark.parametrize("t,k,n", [(1, 3, 5), (8, 64, 64), (13, 96, 130), (40, 200, 70)])
def test_product_equals_the_ctypes_call(t, k, n):
    a, b = _rand(t, k), _rand(k, n)
    direct, through = np.full((t, n), np.nan, np.float32), np.full((t, n), np.nan, np.float32)
    tiles = -(-t // native_matmul.GEMM_ROWS) * -(-n // native_matmul.GEMM_PIXELS)
    head = (data_address(a), data_address(b))
    tail = (t, k, n, k, n, n, native_matmul.depth_block(k), 0, tiles, 1)
    native_matmul._load()(*head, data_address(direct), *tail)
    native_matmul._packed_kernels()[0](*head, data_address(through), *tail)
    np.testing.assert_array_equal(through, direct)
    np.testing.assert_allclose(through, a @ b, rtol=1e-4, atol=1e-4)


@needs_callpack
@pytest.mark.parametrize("zero_masked", [0, 1])
def test_softmax_equals_the_ctypes_call(zero_masked):
    x, bias = _rand(2, 3, 5, 17), _rand(2, 1, 5, 17)
    x[0, 1, 2] = -np.inf  # a fully masked row: zeros or NaN by the flag (an int parameter)
    b = np.ascontiguousarray(np.broadcast_to(bias, x.shape))
    lib = rowops.library()
    outs = []
    for call in (lib.carrack_softmax_threads, lib.carrack_packed_softmax):
        y = np.full(x.shape, 7.0, np.float32)
        call(data_address(x), data_address(y), 0, 30, 17, 0.125, data_address(b), 3, 5, 85, 17, 0, zero_masked, 1)
        outs.append(y)
    np.testing.assert_array_equal(outs[1], outs[0])
    assert (outs[1][0, 1, 2] == 0).all() if zero_masked else np.isnan(outs[1][0, 1, 2]).all()


@needs_callpack
def test_layer_norm_with_nulls_and_stats_equals_the_ctypes_call():
    x, skip, gamma = _rand(6, 40), _rand(6, 40), _rand(40)
    lib = rowops.library()
    results = []
    for call in (lib.carrack_layer_norm_threads, lib.carrack_packed_layer_norm):
        y, mean, inv_std = np.empty((6, 40), np.float32), np.empty(6, np.float32), np.empty(6, np.float32)
        # no bias, no beta, no sum (NULL), an epsilon whose float32 rounding matters
        call(data_address(x), data_address(skip), 0, data_address(gamma), 0, data_address(y), data_address(mean),
             data_address(inv_std), 0, 0, 6, 40, 0.3, 1)
        results.append((y, mean, inv_std))
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)
    s = (x + skip).astype(np.float64)
    var = s.var(axis=-1)
    np.testing.assert_allclose(results[1][2], 1 / np.sqrt(var + np.float32(0.3)), rtol=1e-5)


@needs_callpack
@pytest.mark.parametrize("approximate", [0, 1])
def test_gelu_equals_the_ctypes_call(approximate):
    x, bias = _rand(5, 33), _rand(33)
    lib = rowops.library()
    outs = []
    for call in (lib.carrack_gelu_threads, lib.carrack_packed_gelu):
        y = np.empty_like(x)
        call(data_address(x), data_address(bias), data_address(y), 0, 5, 33, approximate, 1)
        outs.append(y)
    np.testing.assert_array_equal(outs[1], outs[0])
    other = np.empty_like(x)
    lib.carrack_packed_gelu(data_address(x), data_address(bias), data_address(other), 0, 5, 33, 1 - approximate, 1)
    assert not np.array_equal(other, outs[1])  # the flag reaches the kernel


@pytest.mark.parametrize("value", [0.0, -0.0, 1e-12, 0.1, -3.5, 1e38, math.inf, -math.inf, 1e-50])
def test_float_bits_are_the_float32_bits(value):
    assert packed.float_bits(value) == int(np.array(value, np.float32).view(np.uint32))


def test_float_bits_beyond_float32_give_an_infinity():
    assert packed.float_bits(1e40) == int(np.array(np.inf, np.float32).view(np.uint32))
    assert packed.float_bits(-1e40) == int(np.array(-np.inf, np.float32).view(np.uint32))
    assert math.isnan(np.array(packed.float_bits(math.nan), np.uint32).view(np.float32))


@needs_callpack
def test_a_wrong_argument_count_raises_and_calls_nothing():
    kernel = native_matmul._packed_kernels()[0]
    a = _rand(8, 64)
    y = np.full((8, 64), 3.0, np.float32)
    with pytest.raises(ValueError):
        kernel(data_address(a), data_address(a), data_address(y), 8, 64, 64)
    assert (y == 3.0).all()


@needs_callpack
def test_threads_each_use_their_own_packet():
    """Kernels run with the GIL released: threads calling at once must not read each other's arguments."""
    cases = []
    for i in range(6):
        t, k, n = 8 + i, 64 + 8 * i, 64 + 16 * i
        cases.append((_rand(t, k), _rand(k, n)))
    expected = [a @ b for a, b in cases]
    failures = []
    barrier = threading.Barrier(len(cases))

    def work(index):
        a, b = cases[index]
        t, k = a.shape
        n = b.shape[1]
        kernel = native_matmul._packed_kernels()[0]
        tiles = -(-t // native_matmul.GEMM_ROWS) * -(-n // native_matmul.GEMM_PIXELS)
        barrier.wait()
        for _ in range(300):
            y = np.empty((t, n), np.float32)
            kernel(data_address(a), data_address(b), data_address(y), t, k, n, k, n, n, native_matmul.depth_block(k),
                   0, tiles, 1)
            if not np.allclose(y, expected[index], rtol=1e-4, atol=1e-4):
                failures.append(index)
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_without_callpack_the_ctypes_function_is_kept(monkeypatch):
    monkeypatch.setattr(packed, "_load_entry", lambda: None)
    lib = rowops.library()
    if lib is None:
        pytest.skip("native row kernels unavailable")
    fn = lib.carrack_gelu_threads
    assert packed.packed(fn, 8, packed.GELU) is fn


@needs_callpack
def test_a_kind_of_another_arity_is_refused():
    with pytest.raises(ValueError, match="arguments"):
        packed.packed(rowops.library().carrack_gelu_threads, 8, packed.SOFTMAX)


# -- the size floor ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,numpy", [((16, 64, 64), True), ((4, 16, 16), True), ((64, 64, 64), True),
                                         ((64, 64, 65), False), ((1, 64, 64), True), ((1, 64, 144), False),
                                         ((1, 16, 17), True), ((16, 1, 16), True), ((16, 256, 256), False),
                                         ((200, 64, 1), False), ((100, 64, 1), True), ((1, 768, 768), False)])
def test_numpy_is_faster_below_single_thread_blas_work(monkeypatch, shape, numpy):
    monkeypatch.setattr(native_matmul, "SINGLE_THREAD_GEMV_WORK", 2304 * 4)  # OpenBLAS before 0.3.27
    assert native_matmul.numpy_is_faster(*shape) is numpy


@pytest.mark.parametrize("shape,numpy", [((1, 64, 144), True), ((200, 64, 1), True), ((1, 449, 1024), True),
                                         ((1, 450, 1024), False), ((1024, 450, 1), False), ((1, 768, 768), False)])
def test_products_by_a_vector_below_wide_gemv_work_go_to_numpy(monkeypatch, shape, numpy):
    monkeypatch.setattr(native_matmul, "SINGLE_THREAD_GEMV_WORK", 115200 * 4)  # OpenBLAS 0.3.27 and later
    assert native_matmul.numpy_is_faster(*shape) is numpy


@pytest.mark.parametrize("version,limit", [((0, 3, 31), 460800), ((0, 3, 27), 460800), ((0, 3, 26), 9216),
                                           ((0, 2, 20), 9216), (None, 9216)])
def test_the_vector_limit_follows_the_openblas_version(monkeypatch, version, limit):
    monkeypatch.setattr(native_matmul, "SINGLE_THREAD_GEMV_WORK", None)
    monkeypatch.setattr(blas, "openblas_version", lambda: version)
    assert native_matmul.single_thread_gemv_work() == limit
    assert native_matmul.numpy_is_faster(1, limit // 64, 64) is False
    assert native_matmul.numpy_is_faster(1, limit // 64 - 1, 64) is True


def test_openblas_version_is_read_from_numpys_blas():
    version = blas.openblas_version()
    config = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    if config.get("name", "").replace("-", "").lower().find("openblas") < 0:
        assert version is None
    else:
        assert version == tuple(int(part) for part in config["version"].split(".")[:3])


def _matmul_model(rows: int, depth: int, cols: int):
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, depth]),
                               helper.make_tensor_value_info("w", TensorProto.FLOAT, [depth, cols])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.mark.skipif(native_matmul._load() is None, reason="no vectorised native matmul here")
@pytest.mark.parametrize("rows,depth,cols,native_calls", [(16, 64, 64, False), (64, 128, 128, True)])
def test_small_products_run_on_numpy_at_one_thread(monkeypatch, rows, depth, cols, native_calls):
    model = _matmul_model(rows, depth, cols)
    calls = []
    original = native_matmul._packed_kernels
    monkeypatch.setattr(native_matmul, "_packed_kernels", lambda: calls.append(1) or original())
    options = SessionOptions()
    options.intra_op_num_threads = 1
    session = InferenceSession(model.SerializeToString(), options)
    feed = {"x": _rand(1, rows, depth), "w": _rand(depth, cols)}
    for _ in range(3):
        got = session.run(None, feed)[0]
    assert bool(calls) is native_calls
    np.testing.assert_allclose(got, ort_run(model, feed)[0], rtol=1e-4, atol=1e-4)


@needs_callpack
def test_attention_products_around_the_floor_match_numpy():
    """batched_into on the heads of attention: strided output (the merged-heads view), a key of transposed rows
    (copied), both sides of the floor."""
    for heads, seq, size in ((4, 16, 16), (4, 64, 96)):
        q, k = _rand(1, heads, seq, size), _rand(1, heads, seq, size)
        keys = k.swapaxes(-1, -2)
        scores = np.empty((1, heads, seq, seq), np.float32)
        done = native_matmul.batched_into(q, keys, scores)
        assert done is not native_matmul.numpy_is_faster(seq, size, seq) or native_matmul.blas_exceeds_run()
        if done:
            np.testing.assert_allclose(scores, q @ keys, rtol=1e-4, atol=1e-4)
        out = np.empty((1, seq, heads * size), np.float32)
        view = out.reshape(1, seq, heads, size).transpose(0, 2, 1, 3)
        probs = _rand(1, heads, seq, seq)
        if native_matmul.batched_into(probs, q, view):
            np.testing.assert_allclose(view, probs @ q, rtol=1e-4, atol=1e-4)


# -- attention's bias layout, found once per shapes --------------------------------------------------------------------
def _softmax_reference(x: np.ndarray, scale: float, bias: np.ndarray) -> np.ndarray:
    z = (x * np.float32(scale) + bias).astype(np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.skipif(rowops.library() is None, reason="native row kernels unavailable")
def test_bias_layouts_of_one_shape_are_each_read_right_on_every_call():
    """Biases of one shape but other strides (a transposed view), broadcast forms, misaligned memory: each gets
    its own grid, and the second call (the grid remembered) gives the first call's result."""
    x = _rand(1, 4, 16, 16)
    square = _rand(1, 1, 16, 16)
    raw = np.zeros(16 * 16 * 4 + 1, np.uint8)
    misaligned = raw[1:].view(np.float32).reshape(1, 1, 16, 16)
    misaligned[...] = square
    biases = [square, square.transpose(0, 1, 3, 2), _rand(16), _rand(1, 4, 1, 16), _rand(4, 1, 1), misaligned]
    for bias in biases:
        first = rowops.softmax(x, 0.25, bias)
        again = rowops.softmax(x, 0.25, bias)
        np.testing.assert_array_equal(again, first)
        np.testing.assert_allclose(again, _softmax_reference(x, 0.25, bias), rtol=1e-5, atol=1e-6)
    assert (x.shape, square.shape, square.strides) in rowops._BIAS_GRIDS  # the misaligned one (same key) is
    # not read through it: it takes the copying path, and its results above are right


@pytest.mark.skipif(rowops.library() is None, reason="native row kernels unavailable")
def test_remembered_bias_layouts_stay_bounded():
    for length in range(1, rowops._BIAS_GRIDS_MAX + 40):  # a decoder's growing key length
        x, bias = _rand(1, 2, 1, length), _rand(1, 1, 1, length)
        np.testing.assert_allclose(rowops.softmax(x, 1.0, bias), _softmax_reference(x, 1.0, bias), rtol=1e-5,
                                   atol=1e-6)
    assert len(rowops._BIAS_GRIDS) <= rowops._BIAS_GRIDS_MAX


@pytest.mark.skipif(rowops.library() is None, reason="native row kernels unavailable")
def test_a_bias_that_does_not_broadcast_is_still_refused():
    with pytest.raises(ValueError):
        rowops.softmax(_rand(1, 4, 16, 16), 1.0, _rand(1, 3, 16, 16))
    with pytest.raises(ValueError):  # also after a grid for the scores' shape is remembered
        rowops.softmax(_rand(1, 4, 16, 16), 1.0, _rand(1, 1, 16, 16))
        rowops.softmax(_rand(1, 4, 16, 16), 1.0, _rand(1, 3, 16, 16))
