"""blockconv.c: float convolutions on channel-blocked [N, C/16, H, W, 16] tensors, and the reorders at a chain's ends.

Every geometry (1x1 of stride 1 and 2, 3x3 with pads, strided, dilated, wide and asymmetric windows, maps narrower
than a tile, batches, output channels in groups of 1-4 blocks) with each epilogue (bias or none, residual or none,
every activation the kernel applies) against a float64 reference within float32 rounding, the AVX-512 and the
portable C builds; the same bits at 1, 2 and 4 threads; reorders exact both ways."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from carrack.native import blockconv
from carrack.native import convolution as native_conv
from carrack.native.intra_op import intra_op_threads
from tests.helpers import apply_activation
from tests.native.portable import portable_build

needs_library = pytest.mark.skipif(blockconv.library() is None, reason="native kernels are not available here")

# (batch, in_channels, height, width, out_channels, kernel, strides, pads (top, left, bottom, right), dilations)
GEOMETRIES = [
    (1, 64, 12, 12, 64, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1)),     # flat 1x1: 144 pixels = a segment and a tail
    (2, 32, 7, 9, 48, (1, 1), (2, 2), (0, 0, 0, 0), (1, 1)),       # 1x1 stride 2, three output blocks
    (1, 16, 11, 10, 80, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),     # 3x3 pads 1: a full group and one block
    (1, 32, 13, 15, 32, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),     # 3x3 stride 2 on odd maps
    (1, 16, 9, 8, 16, (5, 3), (1, 2), (2, 0, 1, 1), (2, 1)),       # dilated, asymmetric window and pads
    (1, 48, 7, 7, 128, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),      # a 7x7 map: rows shorter than two tiles
    (2, 16, 3, 3, 32, (3, 3), (1, 1), (3, 3, 3, 3), (1, 1)),       # pads wider than the map: all-padding pixels
    (1, 16, 1, 40, 64, (1, 7), (1, 1), (0, 3, 0, 3), (1, 1)),      # one row, wide window
]
ACTIVATIONS = [(0, 0.0, 0.0), (1, 0.0, 0.0), (2, -0.5, 0.75), (3, 0.1, 0.0), (4, 0.2, 0.5)]


def reference(x, w, b, z, strides, pads, dilations, activation):
    """The convolution in float64 numpy on NCHW arrays, then z and the activation."""
    n, c, h, width = x.shape
    m, _, kh, kw = w.shape
    padded = np.zeros((n, c, h + pads[0] + pads[2], width + pads[1] + pads[3]))
    padded[:, :, pads[0]:pads[0] + h, pads[1]:pads[1] + width] = x
    oh = (padded.shape[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (padded.shape[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    y = np.zeros((n, m, oh, ow))
    for r, s in itertools.product(range(kh), range(kw)):
        rows = padded[:, :, r * dilations[0]:r * dilations[0] + strides[0] * (oh - 1) + 1:strides[0],
                      s * dilations[1]:s * dilations[1] + strides[1] * (ow - 1) + 1:strides[1]]
        y += np.einsum("nchw,mc->nmhw", rows, w[:, :, r, s].astype(np.float64))
    if b is not None:
        y += b[None, :, None, None]
    if z is not None:
        y += z
    return apply_activation(y, activation)


def _operands(geometry, seed=0):
    n, c, h, width, m, kernel, strides, pads, dilations = geometry
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, width), dtype=np.float32)
    w = (rng.standard_normal((m, c, *kernel)) / np.sqrt(c * kernel[0] * kernel[1])).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    g = blockconv.geometry((n, c // 16, h, width, 16), m, kernel, strides, pads, dilations)
    z = rng.standard_normal((n, m, g.out_height, g.out_width), dtype=np.float32)
    return x, w, b, z, g


def _blocked_run(lib, x, w, b, z, g, activation):
    y = np.full(g.out_shape, np.nan, np.float32)
    assert blockconv.convolve(lib, blockconv.to_blocked(x), blockconv.pack_weights(w), b,
                              None if z is None else blockconv.to_blocked(z), y, g, activation)
    return blockconv.from_blocked(y)


def _check(lib, geometry, with_bias, with_residual, activation):
    x, w, b, z, g = _operands(geometry)
    b, z = (b if with_bias else None), (z if with_residual else None)
    got = _blocked_run(lib, x, w, b, z, g, activation)
    want = reference(x, w, b, z, g.strides, geometry[7], g.dilations, activation)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()))


@needs_library
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"g{k}" for k in range(len(GEOMETRIES))])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=["none", "relu", "clip", "leaky", "hardsigmoid"])
def test_blocked_convolution_matches_reference(geometry, activation):
    for with_bias, with_residual in ((True, True), (False, False)):
        _check(blockconv.library(), geometry, with_bias, with_residual, activation)


@needs_library
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"g{k}" for k in range(len(GEOMETRIES))])
def test_same_bits_at_one_two_and_four_threads(geometry, monkeypatch):
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)  # split even these small layers
    lib = blockconv.library()
    x, w, b, z, g = _operands(geometry, seed=3)
    results = []
    for threads in (1, 2, 4):
        with intra_op_threads(threads):
            results.append(_blocked_run(lib, x, w, b, z, g, (1, 0.0, 0.0)))
    assert all(np.array_equal(results[0], r) for r in results[1:])


def test_portable_build_matches_reference(tmp_path):
    lib = portable_build("blockconv", tmp_path)
    blockconv._declare(lib)
    assert lib.blockconv_vectorized() == 0
    for geometry in (GEOMETRIES[0], GEOMETRIES[2], GEOMETRIES[4]):
        _check(lib, geometry, True, True, (1, 0.0, 0.0))


@needs_library
@pytest.mark.parametrize("shape", [(1, 64, 5, 7), (2, 16, 1, 33), (1, 32, 17, 16)])
def test_reorders_are_exact_both_ways(shape):
    lib = blockconv.library()
    x = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    n, c, h, w = shape
    blocked = np.empty((n, c // 16, h, w, 16), np.float32)
    assert blockconv.reorder(lib, x, blocked, True)
    np.testing.assert_array_equal(blocked, blockconv.to_blocked(x))
    np.testing.assert_array_equal(blocked[0, 0, 0, 0], x[0, :16, 0, 0])
    back = np.empty_like(x)
    assert blockconv.reorder(lib, blocked, back, False)
    np.testing.assert_array_equal(back, x)


@needs_library
def test_kernel_refuses_channels_that_are_not_blocks():
    lib = blockconv.library()
    x = np.zeros((1, 1, 4, 4, 16), np.float32)
    y = np.zeros((1, 1, 4, 4, 16), np.float32)
    g = blockconv.geometry(x.shape, 24, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1))
    assert not blockconv.convolve(lib, x, np.zeros(24 * 16, np.float32), None, None, y, g, (0, 0.0, 0.0))
    assert not blockconv.reorder(lib, np.zeros((1, 24, 2, 2), np.float32), np.zeros(96, np.float32), True)
