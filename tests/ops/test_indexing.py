"""Indexing kernels against onnxruntime (or hand-computed values): negative indices, batch dims, reductions,
tie order, empty inputs, and clear errors for out-of-range indices."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

import carrack
from tests.ops.test_shape_ops import I64, X, assert_arrays_equal, assert_like_ort, i64, run_carrack

M = np.arange(9, dtype=np.float32).reshape(3, 3)


# -- Gather family -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis,indices", [
    (1, np.array([[-1, 0], [2, 1]], np.int32)),
    (-1, np.array(-1, I64)),
    (0, np.zeros((0,), I64)),
    (2, np.array([3, -4, 0], I64)),
])
def test_gather(axis, indices):
    assert_like_ort("Gather", [("x", X), ("i", indices)], opset=13, axis=axis)


def test_gather_opset1_and_strings():
    assert_like_ort("Gather", [("x", X), ("i", i64(1, 0))], opset=1, axis=1)
    assert_like_ort("Gather", [("x", np.array(["a", "b"], dtype=object)), ("i", np.array(1, I64))], opset=13)


def test_gather_out_of_range_is_an_index_error():
    with pytest.raises(carrack.RunFailure, match="IndexError.*out of range"):
        run_carrack("Gather", [("x", X), ("i", i64(0, 3))], axis=1)
    with pytest.raises(carrack.RunFailure, match="out of range"):
        run_carrack("Gather", [("x", X), ("i", i64(-4))], axis=1)


@pytest.mark.parametrize("axis,indices", [
    (0, np.array([[-1, 0, 2], [1, 2, 0]], I64)),
    (1, np.array([[-1], [1]], I64)),
    (-1, np.array([[0, 0], [1, -3], [2, 2]], np.int32)),
])
def test_gather_elements(axis, indices):
    assert_like_ort("GatherElements", [("x", M), ("i", indices)], opset=13, axis=axis)


def test_gather_elements_out_of_range():
    with pytest.raises(carrack.RunFailure, match="out of range"):
        run_carrack("GatherElements", [("x", M), ("i", i64(3, 0, 0).reshape(1, 3))], opset=13)


@pytest.mark.parametrize("batch_dims,indices", [
    (0, np.array([[1, -1], [0, 2]], I64)),
    (0, np.array([[[1]], [[0]]], I64)),
    (0, np.array([1, 2, 3], I64)),
    (1, np.array([[[2], [0]], [[1], [-1]]], I64)),
    (1, np.array([[1, 2], [0, 3]], I64)),
    (2, np.array([[[1], [2], [0]], [[3], [0], [-1]]], I64)),
])
def test_gather_nd(batch_dims, indices):
    assert_like_ort("GatherND", [("x", X), ("i", indices)], opset=13, batch_dims=batch_dims)


def test_gather_nd_errors():
    with pytest.raises(carrack.RunFailure, match="out of range"):
        run_carrack("GatherND", [("x", X), ("i", i64(2, 0).reshape(1, 2))], opset=13)
    with pytest.raises(carrack.RunFailure, match="axes"):
        run_carrack("GatherND", [("x", X), ("i", i64(0, 0, 0, 0).reshape(1, 4))], opset=13)


def test_gather_nd_empty_indices():
    assert_like_ort("GatherND", [("x", M), ("i", np.zeros((0, 2), I64))], opset=13)
    assert_like_ort("GatherND", [("x", X), ("i", np.zeros((2, 0), I64))], opset=13)
    assert_like_ort("GatherND", [("x", X), ("i", np.zeros((2, 1, 0), I64))], opset=13, batch_dims=1)
    assert_like_ort("GatherND", [("x", X), ("i", np.zeros((2, 0, 2), I64))], opset=13, batch_dims=1)


# -- Scatter family ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_elements(reduction, axis):
    indices = np.array([[1, -1], [0, 2]], I64)
    updates = np.array([[5, -2], [3, 7]], np.float32)
    data = np.ones((3, 3), np.float32)
    assert_like_ort("ScatterElements", [("x", data), ("i", indices), ("u", updates)], opset=18, axis=axis,
                    reduction=reduction)


def test_scatter_elements_duplicates_accumulate():
    got = run_carrack("ScatterElements", [("x", np.zeros(3, np.float32)), ("i", i64(1, 1, -2)),
                                          ("u", np.array([1, 2, 3], np.float32))], opset=16, reduction="add")
    assert_arrays_equal(got, [np.array([0, 6, 0], np.float32)])


def test_scatter_elements_opset11_and_deprecated_scatter():
    inputs = [("x", np.zeros((3, 3), np.float32)), ("i", np.array([[1, 0, 2], [0, 2, 1]], I64)),
              ("u", np.ones((2, 3), np.float32))]
    assert_like_ort("ScatterElements", inputs, opset=11, axis=0)
    assert_like_ort("Scatter", inputs, opset=9, axis=0)
    got = run_carrack("Scatter", inputs, opset=11, axis=0)
    assert_arrays_equal(got, run_carrack("ScatterElements", inputs, opset=11, axis=0))


def test_scatter_elements_out_of_range():
    with pytest.raises(carrack.RunFailure, match="IndexError"):
        run_carrack("ScatterElements", [("x", M), ("i", i64(3).reshape(1, 1)), ("u", np.ones((1, 1), np.float32))],
                    opset=13)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
def test_scatter_nd_reductions(reduction):
    indices = np.array([[1, -1], [0, 0], [1, 2]], I64)
    updates = np.arange(12, dtype=np.float32).reshape(3, 4) - 4
    assert_like_ort("ScatterND", [("x", X), ("i", indices), ("u", updates)], opset=18, reduction=reduction)


@pytest.mark.parametrize("indices,updates_shape", [
    (np.array([[1], [0]], I64), (2, 3, 4)),
    (np.array([[[1, 2, 3]]], I64), (1, 1)),
    (np.array([[0, 1, 2], [1, 0, -1]], I64), (2,)),
])
def test_scatter_nd_shapes(indices, updates_shape):
    updates = np.full(updates_shape, -5, np.float32)
    assert_like_ort("ScatterND", [("x", X), ("i", indices), ("u", updates)], opset=11)


def test_scatter_nd_errors():
    with pytest.raises(carrack.RunFailure, match="out of range"):
        run_carrack("ScatterND", [("x", X), ("i", i64(2).reshape(1, 1)), ("u", np.ones((1, 3, 4), np.float32))],
                    opset=13)
    with pytest.raises(carrack.RunFailure, match="updates shape"):
        run_carrack("ScatterND", [("x", X), ("i", i64(1).reshape(1, 1)), ("u", np.ones((1, 3), np.float32))],
                    opset=13)


@pytest.mark.parametrize("mode,write", [("linear", (1, 3)), ("circular", (1, 4)), ("linear", None)])
def test_tensor_scatter(mode, write):
    past = np.zeros((2, 3, 5, 2), np.float32)
    update = np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2) + 1
    inputs = [("p", past), ("u", update), ("w", None if write is None else i64(*write))]
    assert_like_ort("TensorScatter", inputs, opset=24, mode=mode)


def test_tensor_scatter_axis1():
    past = np.zeros((2, 5, 3), np.float32)
    update = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    assert_like_ort("TensorScatter", [("p", past), ("u", update), ("w", i64(0, 2))], opset=24, axis=1)


def test_tensor_scatter_linear_overflow_is_an_error():
    past, update = np.zeros((1, 4, 2), np.float32), np.ones((1, 2, 2), np.float32)
    with pytest.raises(carrack.RunFailure, match="exceed"):
        run_carrack("TensorScatter", [("p", past), ("u", update), ("w", i64(3))], opset=24, axis=1)


# -- OneHot / NonZero --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [-1, 0, 1, -2])
def test_one_hot(axis):
    indices = np.array([[0, -1], [5, 3]], I64)
    inputs = [("i", indices), ("d", i64(4)), ("v", np.array([2, 5], np.float32))]
    assert_like_ort("OneHot", inputs, opset=11, axis=axis)


def test_one_hot_opset9_float_indices_and_depth():
    inputs = [("i", np.array([0.7, -1.2, 5, 3], np.float32)), ("d", np.array(4.5, np.float32)),
              ("v", np.array([2, 5], np.int32))]
    got = run_carrack("OneHot", inputs, opset=11)
    expected = np.array([[5, 2, 2, 2], [2, 2, 2, 5], [2, 2, 2, 2], [2, 2, 2, 5]], np.int32)
    assert_arrays_equal(got, [expected])


def test_non_zero():
    assert_like_ort("NonZero", [("x", X % 3)], opset=13)
    assert_like_ort("NonZero", [("x", np.array([True, False, True]))], opset=13)
    assert_like_ort("NonZero", [("x", np.zeros((2, 0), np.float32))], opset=13)


def test_non_zero_scalar_like_onnxruntime():
    assert_like_ort("NonZero", [("x", np.array(3.0, np.float32))], opset=13)
    assert_like_ort("NonZero", [("x", np.array(0.0, np.float32))], opset=13)


# -- TopK -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("largest", [0, 1])
def test_top_k_ties_prefer_smaller_index(largest):
    x = np.array([[1, 3, 3, 2, 3, 1], [0, 0, 0, 0, 0, 0]], np.float32)
    assert_like_ort("TopK", [("x", x), ("k", i64(4))], n_outputs=2, opset=11, largest=largest)


@pytest.mark.parametrize("largest, values, indices", [(1, [np.nan, 3, 3], [1, 2, 4]), (0, [1, 1, 2], [0, 5, 3])])
def test_top_k_nan_ranks_above_every_number(largest, values, indices):
    """The spec is silent on NaN; carrack follows numpy's order (onnxruntime 1.31 put NaN first for both)."""
    x = np.array([1, np.nan, 3, 2, 3, 1], np.float32)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["v", "i"], largest=largest)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]), helper.make_tensor_value_info("k", 7, [1])],
        [helper.make_tensor_value_info("v", TensorProto.FLOAT, [3]), helper.make_tensor_value_info("i", 7, [3])]),
        opset_imports=[helper.make_opsetid("", 11)])
    got_values, got_indices = carrack.InferenceSession(model).run(None, {"x": x, "k": i64(3)})
    np.testing.assert_array_equal(got_values, np.array(values, np.float32))
    np.testing.assert_array_equal(got_indices, indices)


@pytest.mark.parametrize("opset", [1, 10, 11])
def test_top_k_versions(opset):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, (3, 7, 4)).astype(np.float32)
    if opset == 1:
        got = run_carrack("TopK", [("x", x)], n_outputs=2, opset=1, k=3, axis=1)
        expected_idx = np.argsort(-x, axis=1, kind="stable")[:, :3]
        assert_arrays_equal(got, [np.take_along_axis(x, expected_idx, 1), expected_idx.astype(I64)])
    else:
        assert_like_ort("TopK", [("x", x), ("k", i64(3))], n_outputs=2, opset=opset, axis=1)


def test_top_k_ints_and_zero_k():
    x = np.array([[5, -3, 7, 7], [0, 2, 2, -1]], np.int32)
    assert_like_ort("TopK", [("x", x), ("k", i64(2))], n_outputs=2, opset=11)
    assert_like_ort("TopK", [("x", x), ("k", i64(2))], n_outputs=2, opset=11, largest=0)
    assert_like_ort("TopK", [("x", x.astype(np.float32)), ("k", i64(0))], n_outputs=2, opset=11)
    assert_like_ort("TopK", [("x", np.array([3, 1, 2], np.uint8)), ("k", i64(2))], n_outputs=2, opset=11)


def test_top_k_too_large_k():
    with pytest.raises(carrack.RunFailure, match="k=5"):
        run_carrack("TopK", [("x", np.zeros(4, np.float32)), ("k", i64(5))], n_outputs=2, opset=11)


# -- Unique -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sorted_", [0, 1])
@pytest.mark.parametrize("x,axis", [
    (np.array([2, 1, 1, 3, 4, 3], np.float32), None),
    (np.array([[1, 0, 0], [1, 0, 0], [2, 3, 4]], I64), 0),
    (np.array([[1, 0, 0], [1, 0, 0], [2, 3, 4]], I64), 1),
    (np.array([[1, 0, 0], [1, 0, 0], [2, 3, 4]], I64), -1),
    (np.array([[[1, 1], [0, 1], [2, 1], [0, 1]], [[1, 1], [0, 1], [2, 1], [0, 1]]], np.float32), 1),
    (np.array([[5, 1], [1, 5]], I64), None),
    (np.array(["b", "a", "b"], dtype=object), None),
    (np.zeros((0,), np.float32), None),
])
def test_unique(x, axis, sorted_):
    attrs = {} if axis is None else {"axis": axis}
    assert_like_ort("Unique", [("x", x)], n_outputs=4, opset=11, sorted=sorted_, **attrs)


def test_unique_unsorted_example():
    got = run_carrack("Unique", [("x", np.array([2, 1, 1, 3, 4, 3], np.float32))], n_outputs=4, opset=11, sorted=0)
    assert_arrays_equal(got, [np.array([2, 1, 3, 4], np.float32), i64(0, 1, 3, 4), i64(0, 1, 1, 2, 3, 2),
                              i64(1, 2, 2, 1)])


# -- Compress / CumSum / CumProd / ReverseSequence --------------------------------------------------------------------

@pytest.mark.parametrize("axis,condition", [
    (1, [0, 1, 1]), (None, [0, 1, 1, 0, 0, 1]), (-2, [0, 1, 0, 0]), (0, [0, 0]), (None, [1, 0]),
])
def test_compress(axis, condition):
    attrs = {} if axis is None else {"axis": axis}
    assert_like_ort("Compress", [("x", X), ("c", np.array(condition, bool))], opset=11, **attrs)


def test_compress_condition_selecting_past_the_end():
    with pytest.raises(carrack.RunFailure, match="beyond"):
        run_carrack("Compress", [("x", np.arange(3, dtype=np.float32)), ("c", np.array([0, 0, 0, 1], bool))],
                    opset=11)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [np.array(-1, np.int32), i64(1), np.array(0, I64)])
def test_cumsum(exclusive, reverse, axis):
    assert_like_ort("CumSum", [("x", X), ("a", axis)], opset=14, exclusive=exclusive, reverse=reverse)
    assert_like_ort("CumSum", [("x", X.astype(np.int32)), ("a", axis)], opset=14, exclusive=exclusive,
                    reverse=reverse)


def test_cumsum_empty_axis():
    assert_like_ort("CumSum", [("x", np.zeros((0, 3), np.float32)), ("a", np.array(0, I64))], opset=14, exclusive=1)


@pytest.mark.parametrize("exclusive,reverse,expected", [
    (0, 0, [1, 2, 6]), (1, 0, [1, 1, 2]), (0, 1, [6, 6, 3]), (1, 1, [6, 3, 1]),
])
def test_cumprod_spec_examples(exclusive, reverse, expected):
    x = np.array([1, 2, 3], np.float32)
    got = run_carrack("CumProd", [("x", x), ("a", np.array(0, np.int32))], opset=26, exclusive=exclusive,
                      reverse=reverse)
    assert_arrays_equal(got, [np.array(expected, np.float32)])


def test_cumprod_2d_int():
    x = np.array([[1, 2, 3], [4, 5, 6]], I64)
    got = run_carrack("CumProd", [("x", x), ("a", i64(-1))], opset=26, exclusive=1)
    assert_arrays_equal(got, [np.array([[1, 1, 2], [1, 4, 20]], I64)])


@pytest.mark.parametrize("batch_axis,time_axis,lens", [(1, 0, (1, 2, 0)), (0, 1, (3, 0)), (0, 1, (1, 2))])
def test_reverse_sequence(batch_axis, time_axis, lens):
    assert_like_ort("ReverseSequence", [("x", X), ("l", i64(*lens))], opset=10, batch_axis=batch_axis,
                    time_axis=time_axis)


def test_reverse_sequence_bad_length():
    with pytest.raises(carrack.RunFailure, match="sequence_lens"):
        run_carrack("ReverseSequence", [("x", X), ("l", i64(1, 3, 2))], opset=10)


@pytest.mark.parametrize("largest,values,indices", [(1, [np.nan, 3, 3], [1, 2, 4]), (0, [1, 1, 2], [0, 5, 3])])
def test_top_k_bfloat16_orders_by_value(largest, values, indices):
    x = np.array([1, np.nan, 3, 2, 3, 1], np.float32).astype(ml_dtypes.bfloat16)
    got = run_carrack("TopK", [("x", x), ("k", i64(3))], n_outputs=2, opset=24, largest=largest)
    assert got[0].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got[0].astype(np.float32), np.array(values, np.float32))
    assert_arrays_equal(got[1:], [i64(*indices)])
