"""packconv.c's 1x1 convolutions that copy their columns into the aligned buffer instead of reading the image in
place (pointwise_copies: many row panels, planes that are not a multiple of 16 floats or are a multiple of 1 KiB):
the rule on squeezenet's and mobilenetv2's shapes, results against a float64 reference (tail pixels, several depth
blocks, groups, batches, residuals, activations), and the same bits as the in-place reads, which the pieces of a
row-split run take (fewer row panels each)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from carrack import native
from carrack.native import convolution as native_conv
from carrack.native import intra_op
from carrack.ops import conv as conv_ops

KERNELS = native_conv.load()
pytestmark = pytest.mark.skipif(KERNELS is None or not KERNELS.packs,
                                reason="packconv.c's vector code (AVX-512) is not available here")

RELU = (1, 0.0, 0.0)
CLIP = (2, -0.5, 0.75)
UNBOUNDED = (2, -np.inf, np.inf)  # a clip that keeps everything (the reference's "no activation")


def _pointwise_copies(plane: int, row_panels: int) -> bool:
    lib = native.library("packconv")
    rule = lib.packconv_pointwise_copies
    rule.argtypes, rule.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_int64
    return bool(rule(plane, row_panels))


def _row_panels(outputs: int) -> int:
    return -(-outputs // 6)


@pytest.mark.parametrize(("plane", "outputs", "copies"), [
    (13 * 13, 1000, True),   # squeezenet's conv10: 512 -> 1000 on 13x13
    (13 * 13, 256, True),    # fire8/9 expand1x1
    (13 * 13, 64, False),    # fire8/9 squeeze: 11 row panels on a small map
    (13 * 13, 48, False),    # fire6/7 squeeze
    (13 * 13, 192, True),    # fire6/7 expand1x1
    (14 * 14, 96, False),    # mobilenetv2's 14x14 projections: 16 row panels on a small map
    (55 * 55, 64, True),     # fire2/3 expand1x1: 11 row panels on a large map
    (55 * 55, 16, False),    # fire2/3 squeeze: 3 row panels
    (27 * 27, 32, False),    # fire4/5 squeeze
    (32 * 32, 48, True),     # a 4 KiB plane (every row of a block on the same L1 sets)
    (7 * 7, 1280, True),     # mobilenetv2's last 1x1
    (7 * 7, 60, False),
])
def test_copy_rule_on_small_cnn_shapes(plane, outputs, copies):
    assert _pointwise_copies(plane, _row_panels(outputs)) is copies


#: (x shape, w shape, group): 1x1 convolutions whose whole-output pieces copy their columns
COPIED = [
    ((1, 40, 13, 13), (150, 40, 1, 1), 1),    # 169 pixels: 64 + 64 + 41
    ((1, 20, 7, 7), (144, 20, 1, 1), 1),      # 49 pixels: a tail pixel (tail_dot) read from the copied buffer
    ((1, 200, 9, 9), (160, 200, 1, 1), 1),    # two depth blocks
    ((1, 24, 32, 32), (48, 24, 1, 1), 1),     # a 1 KiB-multiple plane, 8 row panels
    ((2, 64, 11, 13), (300, 32, 1, 1), 2),    # groups and batches
]


def _reference(x, w, b, z, group, activation):
    y = conv_ops.convolve(x.astype(np.float64), w.astype(np.float64), strides=(1, 1), pads=(0, 0, 0, 0),
                          dilations=(1, 1), group=group, bias=b.astype(np.float64), kernels=None)
    if z is not None:
        y = y + z
    code, low, high = activation
    return np.maximum(y, 0) if code == 1 else np.clip(y, low, high)


def _operands(x_shape, w_shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    return rng, x, w, b


@pytest.mark.parametrize("activation", [RELU, CLIP])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("index", range(len(COPIED)))
def test_copied_columns_match_float64(index, residual, activation):
    x_shape, w_shape, group = COPIED[index]
    assert _pointwise_copies(x_shape[2] * x_shape[3], _row_panels(w_shape[0] // group))
    rng, x, w, b = _operands(x_shape, w_shape, index)
    bound = KERNELS.bind("packed", x.shape, w, b, (1, 1), (0, 0, 0, 0), (1, 1), group, activation)
    assert bound is not None and bound.packed is not None
    z = rng.standard_normal(bound.y_shape).astype(np.float32) if residual else None
    with intra_op.intra_op_threads(1):
        y = bound(x, None, z)
    expected = _reference(x, w, b, z, group, activation)
    # float32 rounding of a sum of `depth` products: relative to the sum of their magnitudes
    magnitude = _reference(np.abs(x), np.abs(w), np.abs(b), None if z is None else np.abs(z), group, UNBOUNDED)
    tolerance = 4 * np.finfo(np.float32).eps * np.sqrt(w_shape[1]) * float(magnitude.max())
    assert y.shape == expected.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("index", range(len(COPIED)))
def test_copied_and_in_place_reads_give_the_same_bits(monkeypatch, index):
    # at 1 thread every piece covers all the row panels and copies; at 4 threads the few pixel panels split the row
    # panels into pieces too small to copy, which read in place: the bits must not change
    x_shape, w_shape, group = COPIED[index]
    rng, x, w, b = _operands(x_shape, w_shape, 50 + index)
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)
    bound = KERNELS.bind("packed", x.shape, w, b, (1, 1), (0, 0, 0, 0), (1, 1), group, RELU)
    z = rng.standard_normal(bound.y_shape).astype(np.float32)
    results = []
    for threads in (1, 2, 4):
        with intra_op.intra_op_threads(threads):
            results.append(bound(x, None, z))
    for y in results[1:]:
        assert np.array_equal(y, results[0])
