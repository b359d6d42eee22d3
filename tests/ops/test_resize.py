"""Resize, Upsample, GridSample and AffineGrid against onnxruntime."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.ops.test_conv import assert_same_as_ort, make_model, run_carrack

TRANSFORMS = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric"]
X4 = np.random.default_rng(0).standard_normal((2, 3, 7, 9)).astype(np.float32)
EMPTY = np.zeros(0, dtype=np.float32)


def _scales(*values) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def _sizes(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("scales", [(1, 1, 2.0, 1.5), (1, 1, 0.6, 0.45), (1, 1, 1.7, 0.8)], ids=["up", "down", "mixed"])
def test_resize_scales(mode, transform, scales):
    lengths = np.array(X4.shape, dtype=np.float32) * _scales(*scales)
    if transform == "align_corners" and np.any(lengths != np.floor(lengths)):
        pytest.skip("onnxruntime divides by the integer output length; onnx (and carrack) by the fractional one")
    if transform == "half_pixel_symmetric" and mode == "nearest" and min(scales) < 1:
        pytest.skip("onnxruntime rounds exact .5 source positions differently here")
    inputs = {"x": X4, "roi": EMPTY, "scales": _scales(*scales)}
    assert_same_as_ort("Resize", inputs, 19, mode=mode, coordinate_transformation_mode=transform)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("sizes", [(2, 3, 11, 4), (2, 3, 1, 13), (2, 3, 5, 9)])
def test_resize_sizes(mode, transform, sizes):
    inputs = {"x": X4, "roi": None, "scales": None, "sizes": _sizes(*sizes)}
    assert_same_as_ort("Resize", inputs, 19, mode=mode, coordinate_transformation_mode=transform)


@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("transform", ["half_pixel", "asymmetric", "align_corners", "tf_half_pixel_for_nn"])
def test_resize_nearest_modes(nearest_mode, transform):
    inputs = {"x": X4[:, :, :6, :8], "roi": EMPTY, "scales": _scales(1, 1, 2.5, 0.5)}
    assert_same_as_ort("Resize", inputs, 11, mode="nearest", nearest_mode=nearest_mode,
                       coordinate_transformation_mode=transform)


def test_resize_output_length_is_computed_in_float32():
    x = np.random.default_rng(0).standard_normal((1, 1, 10, 10)).astype(np.float32)
    inputs = {"x": x, "roi": EMPTY, "scales": _scales(1, 1, 0.7, 0.29)}
    assert_same_as_ort("Resize", inputs, 13, mode="linear")


@pytest.mark.parametrize("a, exclude_outside", [(-0.5, 1), (-0.75, 1), (-0.5, 0)])
def test_resize_cubic_coefficient(a, exclude_outside):
    inputs = {"x": X4, "roi": EMPTY, "scales": _scales(1, 1, 1.6, 0.7)}
    assert_same_as_ort("Resize", inputs, 13, mode="cubic", cubic_coeff_a=a, exclude_outside=exclude_outside)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("scales", [(1, 1, 0.8, 1.2), (1, 1, 1.5, 0.6)])
def test_resize_tf_crop_and_resize(mode, scales):
    roi = np.array([0, 0, 0.1, 0.3, 1, 1, 0.8, 1.2], dtype=np.float32)
    inputs = {"x": X4, "roi": roi, "scales": None, "sizes": _sizes(2, 3, 6, 8)}
    assert_same_as_ort("Resize", inputs, 13, mode=mode, coordinate_transformation_mode="tf_crop_and_resize",
                       extrapolation_value=-3.0)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize("scales", [(1, 1, 0.5, 0.3), (1, 1, 0.7, 1.3)])
def test_resize_antialias(mode, scales):
    inputs = {"x": X4, "roi": EMPTY, "scales": _scales(*scales)}
    assert_same_as_ort("Resize", inputs, 18, mode=mode, antialias=1)


@pytest.mark.parametrize("policy", ["stretch", "not_larger", "not_smaller"])
@pytest.mark.parametrize("axes", [[2, 3], [3, 2], [3]])
def test_resize_axes_and_aspect_policy(policy, axes):
    sizes = _sizes(*[5, 12][: len(axes)])
    inputs = {"x": X4, "roi": None, "scales": None, "sizes": sizes}
    assert_same_as_ort("Resize", inputs, 19, mode="linear", axes=axes, keep_aspect_ratio_policy=policy)
    negative = [a - 4 for a in axes]  # onnxruntime ignores negative axes under a policy; carrack must not
    (got,) = run_carrack(make_model("Resize", inputs, 19, mode="linear", axes=negative,
                                    keep_aspect_ratio_policy=policy), inputs)
    (expected,) = run_carrack(make_model("Resize", inputs, 19, mode="linear", axes=axes,
                                         keep_aspect_ratio_policy=policy), inputs)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", [(1, 1, 2, 3), (1, 1, 0.5, 0.7), (1, 1, 1.5, 2.5)])
def test_resize_opset_10(mode, scales):
    assert_same_as_ort("Resize", {"x": X4, "scales": _scales(*scales)}, 10, mode=mode)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.float16])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_dtypes(dtype, mode):
    x = np.random.default_rng(1).integers(0, 100, (1, 2, 5, 6)).astype(dtype)
    assert_same_as_ort("Resize", {"x": x, "roi": EMPTY, "scales": _scales(1, 1, 1.5, 2)}, 13, mode=mode,
                       atol=1.01 if np.dtype(dtype).kind in "iu" else 1e-2)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_float64_matches_float32(mode):
    inputs = {"x": X4.astype(np.float64), "roi": EMPTY, "scales": _scales(1, 1, 1.5, 0.7)}
    (got,) = run_carrack(make_model("Resize", inputs, 13, mode=mode), inputs)
    inputs["x"] = X4
    (expected,) = run_carrack(make_model("Resize", inputs, 13, mode=mode), inputs)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_3d_and_1d(mode):
    x = np.random.default_rng(2).standard_normal((1, 2, 4, 5, 3)).astype(np.float32)
    if mode != "cubic":  # onnxruntime's cubic is 2-D only
        assert_same_as_ort("Resize", {"x": x, "roi": EMPTY, "scales": _scales(1, 1, 1.5, 0.6, 2)}, 13, mode=mode)
    x = np.random.default_rng(3).standard_normal((6, 7)).astype(np.float32)
    assert_same_as_ort("Resize", {"x": x, "roi": EMPTY, "scales": _scales(1, 1.5)}, 13, mode=mode)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample(mode):
    (got9,) = run_carrack(make_model("Upsample", {"x": X4, "s": _scales(1, 1, 2, 1.5)}, 9, mode=mode),
                          {"x": X4, "s": _scales(1, 1, 2, 1.5)})
    (got7,) = run_carrack(make_model("Upsample", {"x": X4}, 7, mode=mode, scales=[1.0, 1.0, 2.0, 1.5]), {"x": X4})
    (expected,) = run_carrack(make_model("Resize", {"x": X4, "s": _scales(1, 1, 2, 1.5)}, 10, mode=mode),
                              {"x": X4, "s": _scales(1, 1, 2, 1.5)})
    assert got9.shape == (2, 3, 14, 13)
    np.testing.assert_array_equal(got9, expected)
    np.testing.assert_array_equal(got7, expected)
    assert_same_as_ort("Upsample", {"x": X4, "s": _scales(1, 1, 2, 1.5)}, 9, mode=mode)


GRID_2D = (np.random.default_rng(4).random((2, 5, 6, 2)) * 2.6 - 1.3).astype(np.float32)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample_2d(mode, padding_mode, align_corners):
    assert_same_as_ort("GridSample", {"x": X4[:, :, :5], "grid": GRID_2D}, 16, mode=mode, padding_mode=padding_mode,
                       align_corners=align_corners)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample_3d(mode, padding_mode, align_corners):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2, 4, 5, 3)).astype(np.float32)
    grid = (rng.random((1, 3, 2, 4, 3)) * 2.6 - 1.3).astype(np.float32)
    assert_same_as_ort("GridSample", {"x": x, "grid": grid}, 20, mode=mode, padding_mode=padding_mode,
                       align_corners=align_corners)


def test_grid_sample_identity_grid_reproduces_input():
    x = np.random.default_rng(6).standard_normal((1, 1, 4, 6)).astype(np.float32)
    theta = np.array([[[1, 0, 0], [0, 1, 0]]], dtype=np.float32)
    for align in (0, 1):
        size = np.array(x.shape, dtype=np.int64)
        (grid,) = run_carrack(make_model("AffineGrid", {"t": theta, "s": size}, 20, align_corners=align),
                              {"t": theta, "s": size})
        for mode in ("linear", "cubic", "nearest"):
            (y,) = run_carrack(make_model("GridSample", {"x": x, "g": grid}, 20, mode=mode, align_corners=align),
                               {"x": x, "g": grid})
            np.testing.assert_allclose(y, x, atol=1e-5)


@pytest.mark.parametrize("size", [(2, 3, 4, 5), (2, 1, 3, 4, 2)])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_affine_grid(size, align_corners):
    rng = np.random.default_rng(7)
    nd = len(size) - 2
    theta = rng.standard_normal((2, nd, nd + 1)).astype(np.float32)
    inputs = {"t": theta, "s": np.array(size, dtype=np.int64)}
    (got,) = run_carrack(make_model("AffineGrid", inputs, 20, align_corners=align_corners), inputs)
    assert got.shape == (2,) + size[2:] + (nd,)
    # Each grid point is theta @ (x, y[, z], 1) at the normalised pixel centres (x along the last axis).
    for index in itertools.islice(itertools.product(*[range(s) for s in size[2:]]), 7):
        coords = []
        for i, n in zip(index[::-1], size[2:][::-1]):
            coords.append(-1 + 2 * i / (n - 1) if align_corners else (2 * i + 1) / n - 1)
        expected = theta @ np.array(coords + [1.0])
        np.testing.assert_allclose(got[(slice(None),) + index], expected, rtol=1e-5, atol=1e-6)
