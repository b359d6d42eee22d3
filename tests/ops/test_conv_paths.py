"""The 2-D convolution fast paths (im2col by kernel tap, flat depthwise, pointwise) against the generic N-D path."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.ops import conv
from carrack.ops.conv import _convolve_nd, convolve


def _cases(count: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        nd = int(rng.integers(1, 3))
        group = int(rng.choice([1, 2, 3]))
        cg, mg = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        kind = rng.random()
        if kind < 0.35:
            cg, mg = 1, 1  # depthwise
        elif kind < 0.45:
            cg, mg = 1, 2  # depthwise with a channel multiplier
        yield dict(n=int(rng.integers(1, 3)), c=cg * group, m=mg * group, group=group,
                   kernel=[int(rng.integers(1, 5)) for _ in range(nd)],
                   spatial=[int(rng.integers(1, 11)) for _ in range(nd)],
                   strides=[int(rng.integers(1, 4)) for _ in range(nd)],
                   dilations=[int(rng.integers(1, 3)) for _ in range(nd)],
                   pads=[int(rng.integers(0, 4)) for _ in range(2 * nd)])


@pytest.mark.parametrize("scratch", ["default", "tiny"])
def test_fast_paths_match_generic(monkeypatch, scratch):
    if scratch == "tiny":  # one output row of columns and one channel of depthwise accumulators at a time
        monkeypatch.setattr(conv, "COLUMN_BYTES", 1)
        monkeypatch.setattr(conv, "_DEPTHWISE_BYTES", 1)
    rng = np.random.default_rng(5)
    checked = 0
    for case in _cases(400, 11):
        x = rng.standard_normal([case["n"], case["c"]] + case["spatial"])
        w = rng.standard_normal([case["m"], case["c"] // case["group"]] + case["kernel"])
        b = rng.standard_normal(case["m"])
        geometry = dict(strides=case["strides"], pads=case["pads"], dilations=case["dilations"])
        extents = [(k - 1) * d + 1 for k, d in zip(case["kernel"], case["dilations"])]
        padded = [s + lo + hi for s, lo, hi in zip(case["spatial"], case["pads"][:len(extents)],
                                                      case["pads"][len(extents):])]
        if any(e > p for e, p in zip(extents, padded)):
            continue
        expected = _convolve_nd(x, w, group=case["group"], **geometry)
        expected = expected + b.reshape((1, -1) + (1,) * len(extents))
        got = convolve(x, w, group=case["group"], bias=b, **geometry)
        assert got.shape == expected.shape, case
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=str(case))
        checked += 1
    assert checked > 250


def test_float32_depthwise_and_strided_3x3_match_float64():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 8, 15, 13)).astype(np.float32)
    for w, group, strides in [(rng.standard_normal((8, 1, 3, 3)), 8, [2, 2]),
                              (rng.standard_normal((6, 8, 3, 3)), 1, [2, 1])]:
        w = w.astype(np.float32)
        got = convolve(x, w, strides=strides, pads=[1, 1, 1, 1], dilations=[1, 1], group=group)
        expected = _convolve_nd(x.astype(np.float64), w.astype(np.float64), strides, [1, 1, 1, 1], [1, 1], group)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_result_is_fresh_and_inputs_untouched():
    x = np.ones((1, 4, 5, 5), np.float32)
    w = np.ones((4, 1, 1, 1), np.float32)
    x.flags.writeable = False
    w.flags.writeable = False
    y = convolve(x, w, strides=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1], group=4, bias=np.ones(4, np.float32))
    assert y.flags.writeable and not np.shares_memory(y, x)
    np.testing.assert_array_equal(y, 2)
