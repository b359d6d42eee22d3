"""dwconv.c's depthwise convolution, path by path (the flat path for small "same" maps, the 3x3 stride-1 and
stride-2 row kernels, the phase-plane path for the rest), bound and unbound, against a float64 numpy reference,
and the same bits at 1, 2, 3 and 4 threads."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.native import convolution as native_conv
from carrack.native import intra_op
from carrack.passes.fusions import without_block_fusion

KERNELS = native_conv.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native convolution kernels not built here")

#: activation name -> (the kernels' (code, alpha, beta), float64 reference)
ACTIVATIONS = {
    "none": ((0, 0.0, 0.0), lambda y: y),
    "Relu": ((1, 0.0, 0.0), lambda y: np.maximum(y, 0)),
    "Relu6": ((2, 0.0, 6.0), lambda y: np.clip(y, 0, 6)),
    "LeakyRelu": ((3, 0.1, 0.0), lambda y: np.where(y < 0, 0.1 * y, y)),
    "HardSigmoid": ((4, 0.2, 0.4), lambda y: np.clip(0.2 * y + 0.4, 0, 1)),
    "HardSwish": ((5, 0.0, 0.0), lambda y: y * np.clip(y / 6 + 0.5, 0, 1)),
    "Sigmoid": ((6, 0.0, 0.0), lambda y: 1 / (1 + np.exp(-y))),
}

#: (name, x shape, multiplier, kernel, strides, pads [top, left, bottom, right], dilations); the name says which
#: path of dwconv2d_f32 runs it
GEOMETRIES = [
    ("flat 7x7 same", (1, 24, 7, 7), 1, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ("flat 14x14 same, multiplier 2", (2, 5, 14, 14), 2, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ("flat 3x3 planes in pairs: odd channels, batch 2", (2, 5, 6, 9), 1, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ("flat 5x5 kernel, dilation 2", (1, 6, 9, 11), 1, (5, 5), (1, 1), (4, 4, 4, 4), (2, 2)),
    ("flat 1x3 kernel, no rows padded", (1, 3, 5, 13), 3, (1, 3), (1, 1), (0, 1, 0, 1), (1, 1)),
    ("3x3 s1 wide rows", (1, 7, 19, 113), 1, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ("3x3 s1 no pads, odd sizes", (2, 3, 23, 37), 2, (3, 3), (1, 1), (0, 0, 0, 0), (1, 1)),
    ("3x3 s1 asymmetric pads", (1, 4, 17, 33), 1, (3, 3), (1, 1), (0, 2, 2, 1), (1, 1)),
    ("3x3 s1 exactly 16 and 32 outputs", (1, 2, 18, 32), 1, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ("3x3 s2 odd width", (1, 9, 29, 57), 1, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    ("3x3 s2 'same' pads (0, 0, 1, 1)", (1, 5, 30, 112), 1, (3, 3), (2, 2), (0, 0, 1, 1), (1, 1)),
    ("3x3 s2 multiplier 3", (2, 2, 15, 15), 3, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    ("3x3 s2 narrow: 14x14 to 7x7", (1, 6, 14, 14), 1, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    ("3x3 s2 narrow: odd sizes, pads (0, 0, 1, 1), multiplier 2", (2, 3, 9, 12), 2, (3, 3), (2, 2), (0, 0, 1, 1),
     (1, 1)),
    ("3x3 s2 narrow: one column, pads 2", (1, 2, 6, 1), 1, (3, 3), (2, 2), (2, 2, 2, 2), (1, 1)),
    ("phase planes: 5x5 stride 2", (1, 6, 31, 45), 1, (5, 5), (2, 2), (2, 2, 2, 2), (1, 1)),
    ("phase planes: 3x3 stride 3, dilation 2", (1, 4, 40, 27), 2, (3, 3), (3, 3), (2, 1, 0, 3), (2, 2)),
    ("phase planes: 3x3 dilation 2, wide", (1, 3, 24, 70), 1, (3, 3), (1, 1), (2, 2, 2, 2), (2, 2)),
    ("phase planes: 3x3 stride (1, 2)", (1, 3, 21, 40), 1, (3, 3), (1, 2), (1, 1, 1, 1), (1, 1)),
]
IDS = [g[0] for g in GEOMETRIES]


def _operands(geometry, seed: int):
    _, x_shape, multiplier, kernel, *_ = geometry
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal((x_shape[1] * multiplier, 1, *kernel), dtype=np.float32)
    b = rng.standard_normal(x_shape[1] * multiplier, dtype=np.float32)
    return x, w, b


def _reference(x, w, b, strides, pads, dilations, activation: str) -> np.ndarray:
    """The depthwise convolution in float64, tap by tap over a zero-padded image."""
    n, c, h, wd = x.shape
    m, _, kh, kw = w.shape
    (sh, sw), (dh, dw) = strides, dilations
    oh = (h + pads[0] + pads[2] - (kh - 1) * dh - 1) // sh + 1
    ow = (wd + pads[1] + pads[3] - (kw - 1) * dw - 1) // sw + 1
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    source = np.repeat(padded, m // c, axis=1)  # output channel k reads input channel k // multiplier
    y = np.zeros((n, m, oh, ow)) + b.astype(np.float64)[:, None, None]
    for i in range(kh):
        for j in range(kw):
            window = source[:, :, i * dh:i * dh + (oh - 1) * sh + 1:sh, j * dw:j * dw + (ow - 1) * sw + 1:sw]
            y += w[:, 0, i, j].astype(np.float64)[:, None, None] * window
    return ACTIVATIONS[activation][1](y)


def _check(got: np.ndarray, expected: np.ndarray, x, w) -> None:
    # float32 rounding of sums of kh * kw + 1 terms of |x| * |w| ~ a few units
    scale = float(np.abs(x).max()) * float(np.abs(w).max()) * w[0].size
    np.testing.assert_allclose(got, expected, rtol=0, atol=4e-7 * max(1.0, scale))


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
def test_depthwise_matches_float64_reference(geometry, activation):
    _, _, _, _, strides, pads, dilations = geometry
    x, w, b = _operands(geometry, 11)
    expected = _reference(x, w, b, strides, pads, dilations, activation)
    code = ACTIVATIONS[activation][0]
    unbound = KERNELS.depthwise(x, w, b, None, strides, pads, dilations, code)
    assert unbound is not None and unbound.shape == expected.shape
    _check(unbound, expected, x, w)
    bound = KERNELS.bind("depthwise", x.shape, w, b, strides, pads, dilations, x.shape[1], code)
    assert bound is not None
    assert np.array_equal(bound(x, None, None), unbound)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
def test_depthwise_same_bits_at_any_thread_count(geometry, monkeypatch):
    _, _, _, _, strides, pads, dilations = geometry
    x, w, b = _operands(geometry, 12)
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)  # split even these small calls
    bound = KERNELS.bind("depthwise", x.shape, w, b, strides, pads, dilations, x.shape[1], ACTIVATIONS["Relu6"][0])
    results = []
    before = intra_op.parallel_seconds()
    for threads in (1, 2, 3, 4):
        with intra_op.intra_op_threads(threads):
            results.append(bound(x, None, None))
            results.append(KERNELS.depthwise(x, w, b, None, strides, pads, dilations, ACTIVATIONS["Relu6"][0]))
    assert intra_op.parallel_seconds() > before  # the split ran
    for y in results[1:]:
        assert np.array_equal(y, results[0])


def test_bias_absent_and_output_buffer_reused():
    geometry = GEOMETRIES[4]
    _, _, _, _, strides, pads, dilations = geometry
    x, w, b = _operands(geometry, 13)
    expected = _reference(x, w, np.zeros_like(b), strides, pads, dilations, "none")
    out = np.full(expected.shape, np.nan, np.float32)
    y = KERNELS.depthwise(x, w, None, out, strides, pads, dilations, ACTIVATIONS["none"][0])
    assert y is out
    _check(out, expected, x, w)


def test_small_depthwise_layers_split_over_two_threads(monkeypatch):
    """A depthwise multiply-add costs several of the packed products' (DEPTHWISE_WORK_SCALE): mobilenetv2's 7x7
    and 14x14 depthwise layers (0.25-0.7 M multiply-adds, 30-60 us) go to both threads where a product that size
    would not."""
    monkeypatch.setattr(native_conv.native, "threads", lambda: 2)
    for channels, size in ((960, 7), (384, 14), (576, 7)):  # 576 x 7 x 7: the 14x14 map's stride-2 layer
        work = native_conv._depthwise_work(1, size, size, 3, 3)
        assert native_conv._threads(channels, work) == 2
        assert native_conv._threads(channels, size * size * 9) == 1
    assert native_conv._threads(8, native_conv._depthwise_work(1, 4, 4, 3, 3)) == 1  # tiny: stays on one


def test_inverted_residual_network_matches_onnxruntime_at_every_thread_count(tmp_path, monkeypatch):
    """A torch-exported MobileNetV2 block pair (expand 1x1, depthwise 3x3 stride 1 and 2, project 1x1, residual)
    at the default split thresholds: the depthwise layers split at 2 and 4 threads, with the same bits as 1."""
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    from carrack.runtime.session import InferenceSession, SessionOptions

    class Block(torch.nn.Module):
        def __init__(self, channels: int, stride: int):
            super().__init__()
            wide = 6 * channels
            self.body = torch.nn.Sequential(
                torch.nn.Conv2d(channels, wide, 1), torch.nn.ReLU6(),
                torch.nn.Conv2d(wide, wide, 3, stride=stride, padding=1, groups=wide), torch.nn.ReLU6(),
                torch.nn.Conv2d(wide, channels, 1))
            self.residual = stride == 1

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    torch.manual_seed(0)
    net = torch.nn.Sequential(Block(16, 1), Block(16, 2), Block(16, 1)).eval()
    x = torch.randn(1, 16, 29, 29)
    path = tmp_path / "blocks.onnx"
    torch.onnx.export(net, (x,), str(path), input_names=["x"], output_names=["y"], dynamo=False)
    feed = {"x": x.numpy()}
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    depthwise_threads = []
    original_threads = native_conv._threads

    def recorded(count: int, work: int) -> int:
        threads = original_threads(count, work)
        if count == 96:  # the depthwise layers' planes (nothing else here has 96 items)
            depthwise_threads.append(threads)
        return threads

    monkeypatch.setattr(native_conv, "_threads", recorded)
    results = []
    for threads in (1, 2, 4):
        options = SessionOptions()
        options.intra_op_num_threads = threads
        with without_block_fusion():  # the three convolutions, not invres.c's block
            results.append(InferenceSession(str(path), options).run(None, feed)[0])
    np.testing.assert_allclose(results[0], expected, rtol=1e-4, atol=1e-5)
    for y in results[1:]:
        assert np.array_equal(y, results[0])
    assert max(depthwise_threads) >= 2
