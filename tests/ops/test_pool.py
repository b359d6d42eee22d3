"""Pooling kernels against onnxruntime: windowed, global, unpooling and region-of-interest pools."""

from __future__ import annotations

import numpy as np
import pytest

from tests.ops.test_conv import assert_same_as_ort, make_model, run_carrack


def _window_cases(count: int, seed: int, dilations: bool = True):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        nd = int(rng.integers(1, 4))
        kernel = [int(rng.integers(1, 4)) for _ in range(nd)]
        attrs = dict(kernel_shape=kernel, strides=[int(rng.integers(1, 4)) for _ in range(nd)])
        auto_pad = str(rng.choice(["NOTSET", "NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
        attrs["auto_pad"] = auto_pad
        if auto_pad == "NOTSET":
            attrs["pads"] = [int(rng.integers(0, k)) for k in kernel + kernel]
            attrs["ceil_mode"] = int(rng.integers(0, 2))
            if dilations:
                attrs["dilations"] = [int(rng.integers(1, 3)) for _ in range(nd)]
        yield [int(rng.integers(4, 9)) for _ in range(nd)], attrs


def _ids(case):
    spatial, attrs = case
    return f"{len(spatial)}d-{attrs['auto_pad']}-ceil{attrs.get('ceil_mode', 0)}"


@pytest.mark.parametrize("case", list(_window_cases(24, 1)), ids=_ids)
def test_max_pool_with_indices(case):
    spatial, attrs = case
    x = np.random.default_rng(2).standard_normal([2, 3] + spatial).astype(np.float32)
    assert_same_as_ort("MaxPool", {"x": x}, 12, n_outputs=2, **attrs)


@pytest.mark.parametrize("op, opset", [("MaxPool", 10), ("MaxPool", 12), ("MaxPool", 22), ("AveragePool", 10),
                                       ("AveragePool", 19), ("AveragePool", 22), ("LpPool", 18)])
def test_ceil_mode_drops_a_last_window_starting_in_the_padding(op, opset):
    x = np.random.default_rng(0).standard_normal((1, 2, 5, 8)).astype(np.float32)
    attrs = dict(kernel_shape=[2, 2], strides=[3, 3], pads=[0, 1, 1, 1], ceil_mode=1)
    if op == "AveragePool":
        attrs["count_include_pad"] = 1
    model = make_model(op, {"x": x}, opset, **attrs)
    assert run_carrack(model, {"x": x})[0].shape == (1, 2, 2, 3)
    assert_same_as_ort(op, {"x": x}, opset, **attrs)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.float16, np.float64])
def test_max_pool_dtypes(dtype):
    x = np.random.default_rng(0).integers(0, 100, (1, 2, 7, 6)).astype(dtype)
    assert_same_as_ort("MaxPool", {"x": x}, 12, kernel_shape=[3, 2], strides=[2, 1], pads=[1, 1, 1, 0])


def test_max_pool_column_major_indices():
    x = np.random.default_rng(0).standard_normal((2, 2, 5, 4)).astype(np.float32)
    assert_same_as_ort("MaxPool", {"x": x}, 8, n_outputs=2, kernel_shape=[2, 2], storage_order=1, pads=[1, 0, 0, 1])


@pytest.mark.parametrize("case", list(_window_cases(24, 3)), ids=_ids)
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool(case, count_include_pad):
    spatial, attrs = case
    x = np.random.default_rng(2).standard_normal([2, 3] + spatial).astype(np.float32)
    assert_same_as_ort("AveragePool", {"x": x}, 19, count_include_pad=count_include_pad, **attrs)


@pytest.mark.parametrize("opset", [7, 10, 11])
def test_average_pool_old_versions(opset):
    x = np.random.default_rng(2).standard_normal((1, 2, 7, 5)).astype(np.float32)
    extra = {"ceil_mode": 1} if opset >= 10 else {}
    assert_same_as_ort("AveragePool", {"x": x}, opset, kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1],
                       count_include_pad=1, **extra)


@pytest.mark.parametrize("case", list(_window_cases(12, 5, dilations=False)), ids=_ids)
@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pool(case, p):
    spatial, attrs = case
    attrs = {k: v for k, v in attrs.items() if k != "ceil_mode"}
    x = np.random.default_rng(2).standard_normal([2, 3] + spatial).astype(np.float32)
    assert_same_as_ort("LpPool", {"x": x}, 11, p=p, **attrs)


def test_lp_pool_18_ceil_and_dilations():
    x = np.random.default_rng(2).standard_normal((1, 2, 9, 8)).astype(np.float32)
    model = make_model("LpPool", {"x": x}, 18, kernel_shape=[2, 3], strides=[2, 2], dilations=[2, 1], ceil_mode=1)
    (got,) = run_carrack(model, {"x": x})
    # rows: windows start at 0, 2, 4, 6 (taps +0, +2); cols: at 0, 2, 4, 6, the last one overhanging by a column
    assert got.shape == (1, 2, 4, 4)
    expected = np.sqrt((x[:, :, [2, 4], 6:8] ** 2).sum(axis=(2, 3)))
    np.testing.assert_allclose(got[:, :, 1, 3], expected, rtol=1e-5)


@pytest.mark.parametrize("p", [1, 3])
def test_lp_pool_18_matches_onnxruntime(p):
    x = np.random.default_rng(2).standard_normal((1, 2, 9, 8)).astype(np.float32)
    assert_same_as_ort("LpPool", {"x": x}, 18, kernel_shape=[2, 3], strides=[2, 2], dilations=[2, 1], ceil_mode=1,
                       pads=[1, 0, 0, 1], p=p)


@pytest.mark.parametrize("op, attrs", [("GlobalAveragePool", {}), ("GlobalMaxPool", {}), ("GlobalLpPool", {"p": 3})])
@pytest.mark.parametrize("shape", [(2, 3, 5), (1, 2, 4, 3), (1, 2, 3, 2, 4)])
def test_global_pools(op, attrs, shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert_same_as_ort(op, {"x": x}, 17, **attrs)


def test_global_average_pool_float16_accumulates_in_float32():
    x = np.full((1, 1, 64, 64), 1000.0, dtype=np.float16)
    (got,) = run_carrack(make_model("GlobalAveragePool", {"x": x}, 17), {"x": x})
    assert got.dtype == np.float16 and got.item() == 1000.0


@pytest.mark.parametrize("size, kernel, strides, pads", [(8, [2, 2], [2, 2], [0, 0, 0, 0]),
                                                          (7, [3, 3], [2, 2], [1, 1, 1, 1]), (6, [3], [2], [1, 0])])
def test_max_unpool_inverts_max_pool(size, kernel, strides, pads):
    x = np.random.default_rng(1).standard_normal([1, 2] + [size] * len(kernel)).astype(np.float32)
    pooled, indices = run_carrack(make_model("MaxPool", {"x": x}, 12, n_outputs=2, kernel_shape=kernel,
                                             strides=strides, pads=pads), {"x": x})
    inputs = {"x": pooled, "i": indices}
    assert_same_as_ort("MaxUnpool", inputs, 11, kernel_shape=kernel, strides=strides, pads=pads)
    inputs["shape"] = np.array(x.shape, dtype=np.int64)
    (got,) = run_carrack(make_model("MaxUnpool", inputs, 11, kernel_shape=kernel, strides=strides, pads=pads), inputs)
    assert got.shape == x.shape
    np.testing.assert_array_equal(got.reshape(-1)[indices.reshape(-1)], pooled.reshape(-1))


def test_max_roi_pool():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 10, 12)).astype(np.float32)
    rois = np.array([[0, 1, 1, 6, 8], [1, 0, 0, 11, 9], [1, 3.5, 2.2, 5.5, 4.9], [0, 8, 7, 30, 30]], dtype=np.float32)
    assert_same_as_ort("MaxRoiPool", {"x": x, "rois": rois}, 17, pooled_shape=[3, 2], spatial_scale=1.0)
    scaled = rois * np.array([1, 2, 2, 2, 2], dtype=np.float32)
    assert_same_as_ort("MaxRoiPool", {"x": x, "rois": scaled}, 17, pooled_shape=[2, 4], spatial_scale=0.5)


@pytest.mark.parametrize("opset, transform", [(10, None), (16, "half_pixel"), (16, "output_half_pixel")])
@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_roi_align(opset, transform, mode, sampling_ratio):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 10, 12)).astype(np.float32)
    rois = np.array([[1, 1, 6, 8], [0, 0, 11, 9], [3.6, 2.2, 5.1, 4.9], [-2, 7, 14, 12], [4, 4, 4.2, 4.1]],
                    dtype=np.float32)
    batch = np.array([0, 1, 1, 0, 1], dtype=np.int64)
    attrs = dict(mode=mode, output_height=3, output_width=4, sampling_ratio=sampling_ratio, spatial_scale=0.9)
    if transform:
        attrs["coordinate_transformation_mode"] = transform
    assert_same_as_ort("RoiAlign", {"x": x, "rois": rois, "batch": batch}, opset, **attrs)
