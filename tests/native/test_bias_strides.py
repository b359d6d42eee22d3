"""The softmax bias's grid found without broadcasting (a growing cache's scores change shape every call): the same
element strides as numpy's broadcast view, for broadcast, transposed and sliced biases; and the softmax of a buffer
the caller just made (no checks) gives softmax's bits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from carrack.native import rowops

SHAPE = (2, 3, 5, 6)


def _biases() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    full = rng.standard_normal((2, 3, 5, 12)).astype(np.float32)
    return [full[..., :6], full[..., ::2], full[:, :1, :, :6], full[0, 0, :, :6], full[0, 0, 0, :6],
            full[:, :, :1, :6].transpose(0, 2, 1, 3)[:, :1, :3].transpose(0, 2, 1, 3), full[0, 0, :1, :1],
            full[::-1, :, :, :6],
            rng.standard_normal((6, 5)).astype(np.float32).T, rng.standard_normal((3, 1, 1)).astype(np.float32)]


@pytest.mark.parametrize("index", range(len(_biases())))
def test_broadcast_strides_are_numpy_s(index):
    bias = _biases()[index]
    want = [s // 4 for s in np.broadcast_to(bias, SHAPE).strides]
    assert rowops._broadcast_strides(bias, SHAPE) == want


@pytest.mark.parametrize("shape", [(3, 6), (2, 3, 5, 6, 1), (4, 1, 1, 1)])
def test_a_bias_that_does_not_broadcast_has_no_strides(shape):
    bias = np.zeros(shape, np.float32)
    with pytest.raises(ValueError):
        np.broadcast_to(bias, SHAPE)
    assert rowops._broadcast_strides(bias, SHAPE) is None


@pytest.mark.skipif(rowops.library() is None, reason="native row kernels unavailable")
@pytest.mark.parametrize("index", range(len(_biases())))
def test_softmax_of_a_fresh_buffer_is_softmax_s(index):
    bias = _biases()[index]
    scores = np.random.default_rng(index).standard_normal(SHAPE).astype(np.float32)
    fresh = np.empty(SHAPE, np.float32)
    fresh[...] = scores
    got = rowops.softmax_fresh(fresh, 0.3, bias, True)
    assert got is fresh
    np.testing.assert_array_equal(got, rowops.softmax(scores, 0.3, bias, True))


@pytest.mark.parametrize("shape,bias_shape", [((1, 4, 1, 33), (1, 1, 1, 33)), ((2, 3, 5, 6), (6,)),
                                              ((2, 3, 5, 6), (1, 6)), ((1, 1, 1, 7), (1, 1, 1, 7)), ((9,), (9,))])
def test_one_row_of_biases_has_numpy_s_grid(shape, bias_shape):
    bias = np.arange(math.prod(bias_shape), dtype=np.float32).reshape(bias_shape)
    view = np.broadcast_to(bias, shape)
    want = rowops._merge_dims(shape[:-1], [s // 4 for s in view.strides[:-1]])
    b, dims, strides = rowops._bias_layout(bias, shape)
    assert b is bias and (dims, strides) == want
