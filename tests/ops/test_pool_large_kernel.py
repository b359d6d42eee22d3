"""Pools whose kernel is far larger than their input (Hugging Face EfficientNet's pooler: AvgPool2d(hidden_dim,
ceil_mode=True) over the last, small feature map), exported by torch: same numbers as onnxruntime, and the
window taps that only ever read the ceil_mode overhang are not visited."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

import carrack
from carrack.ops.pool import PoolGeometry

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")


def _export_head(pool, tmp_path, channels: int = 8, size: int = 3) -> tuple[onnx.ModelProto, np.ndarray]:
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(channels, 16, 1)
            self.pool = pool

        def forward(self, x):
            return self.pool(self.conv(x))

    torch.manual_seed(0)
    x = torch.randn(2, channels, size, size)
    path = tmp_path / "head.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Head().eval(), (x,), str(path), dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y"])
    return onnx.load(str(path)), x.numpy()


@pytest.mark.parametrize("pool", ["average", "max"])
@pytest.mark.parametrize("size", [3, 5])
def test_kernel_larger_than_input_matches_onnxruntime(pool, size, tmp_path):
    module = (torch.nn.AvgPool2d(320, ceil_mode=True) if pool == "average"
              else torch.nn.MaxPool2d(320, ceil_mode=True))
    model, x = _export_head(module, tmp_path, size=size)
    kernels = [list(a.ints) for n in model.graph.node for a in n.attribute if a.name == "kernel_shape"]
    assert [320, 320] in kernels
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = carrack.InferenceSession(model).run(None, {"x": x})
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-6)


def test_pool_geometry_visits_only_taps_that_reach_the_input():
    geometry = PoolGeometry([3, 3], [320, 320], [320, 320], [1, 1], [0, 0, 0, 0], "NOTSET", ceil_mode=True)
    assert geometry.out_shape == [1, 1]
    assert geometry.kernel == [3, 3]
    assert geometry.padded(np.zeros((1, 1, 3, 3), np.float32), 0).shape == (1, 1, 3, 3)
    # explicit pads count as reachable; dilation spaces the taps
    padded = PoolGeometry([4, 4], [50, 50], [50, 50], [2, 2], [1, 1, 2, 2], "NOTSET", ceil_mode=True)
    assert padded.kernel == [4, 4]  # taps 0, 2, 4, 6 reach the 7 cells of pad + input + pad
    # a kernel that fits is left alone
    assert PoolGeometry([9, 9], [3, 3], [1, 1], [1, 1], None, "NOTSET", False).kernel == [3, 3]


@pytest.mark.parametrize("op, count_include_pad", [("AveragePool", 0), ("AveragePool", 1), ("MaxPool", 0),
                                                   ("LpPool", 0)])
def test_oversized_kernel_with_pads_and_dilation_matches_onnxruntime(op, count_include_pad):
    from tests.ops.test_conv import assert_same_as_ort

    attrs = dict(kernel_shape=[40, 7], strides=[40, 3], pads=[1, 2, 2, 1], ceil_mode=1)
    if op == "AveragePool":
        attrs["count_include_pad"] = count_include_pad
    if op == "MaxPool":
        attrs["dilations"] = [2, 1]
    x = np.random.default_rng(3).standard_normal([2, 3, 5, 6]).astype(np.float32)
    assert_same_as_ort(op, {"x": x}, 19 if op != "LpPool" else 18, **attrs)
