"""packconv.c: 2-D convolutions on weights packed once (implicit im2col in depth blocks) against a float64 numpy
reference, for geometries that do not fit its tiles (odd sizes, output channels not a multiple of 6, pixels not a
multiple of 64 or 16, depth past one 128-step block), strides, dilations, groups, asymmetric pads, residuals and
activations; the same bits at 1, 2 and 4 threads; and a torch-exported network against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.native import convolution as native_conv
from carrack.native import intra_op
from carrack.ops import conv as conv_ops
from tests.helpers import apply_activation

KERNELS = native_conv.load()
pytestmark = pytest.mark.skipif(KERNELS is None or not KERNELS.packs,
                                reason="packconv.c's vector code (AVX-512) is not available here")

#: (x shape, w shape, strides, pads [top, left, bottom, right], dilations, group)
GEOMETRIES = [
    ((1, 3, 17, 19), (7, 3, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    ((2, 8, 9, 11), (14, 4, 3, 3), (2, 2), (0, 1, 2, 1), (1, 1), 2),
    ((1, 16, 10, 10), (20, 16, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),
    ((1, 16, 10, 13), (20, 16, 1, 1), (2, 2), (0, 0, 0, 0), (1, 1), 1),
    ((1, 5, 23, 29), (9, 5, 5, 5), (1, 2), (2, 2, 2, 2), (2, 1), 1),
    ((1, 3, 30, 30), (10, 3, 7, 7), (2, 2), (3, 3, 3, 3), (1, 1), 1),
    ((1, 130, 7, 7), (70, 130, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    ((1, 33, 12, 9), (17, 33, 3, 2), (3, 1), (0, 2, 1, 0), (1, 3), 1),
    ((2, 12, 6, 40), (9, 4, 1, 3), (1, 3), (0, 0, 0, 2), (1, 2), 3),
    ((1, 40, 5, 5), (13, 40, 3, 3), (1, 1), (2, 2, 2, 2), (2, 2), 1),
    # output rows a multiple of 16 wide: each vector's outputs in one row (pack_columns' scalar read descriptors),
    # a stem-like 7x7 stride 2 on 3 channels, stride 1 dilated, stride 2 with asymmetric pads
    ((1, 3, 64, 64), (8, 3, 7, 7), (2, 2), (3, 3, 3, 3), (1, 1), 1),
    ((1, 4, 16, 16), (6, 4, 3, 3), (1, 1), (2, 2, 2, 2), (2, 2), 1),
    ((1, 5, 33, 33), (7, 5, 3, 3), (2, 2), (0, 1, 1, 0), (1, 1), 1),
]

ACTIVATIONS = {"none": (0, 0.0, 0.0), "relu": (1, 0.0, 0.0), "clip": (2, -0.5, 0.75), "leaky": (3, 0.1, 0.0),
               "hardsigmoid": (4, 0.2, 0.5), "sigmoid": (6, 0.0, 0.0)}


def _reference(x, w, b, z, strides, pads, dilations, group, activation):
    y = conv_ops.convolve(x.astype(np.float64), w.astype(np.float64), strides=strides, pads=pads,
                          dilations=dilations, group=group, bias=b.astype(np.float64), kernels=None)
    if z is not None:
        y = y + z
    return apply_activation(y, activation)


def _operands(geometry, seed: int):
    x_shape, w_shape = geometry[:2]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    return rng, x, w, b


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("index", range(len(GEOMETRIES)))
@pytest.mark.parametrize("residual", [False, True])
def test_packed_convolution_matches_float64(index, activation, residual):
    geometry = GEOMETRIES[index]
    _, _, strides, pads, dilations, group = geometry
    rng, x, w, b = _operands(geometry, index)
    act = ACTIVATIONS[activation]
    bound = KERNELS.bind("packed", x.shape, w, b, strides, pads, dilations, group, act)
    assert bound is not None and bound.packed is not None
    y_shape = bound.y_shape
    z = rng.standard_normal(y_shape).astype(np.float32) if residual else None
    expected = _reference(x, w, b, z, strides, pads, dilations, group, act)
    depth = w.shape[1] * w.shape[2] * w.shape[3]
    # float32 rounding of a sum of `depth` products: relative to the sum of their magnitudes
    magnitude = _reference(np.abs(x), np.abs(w), np.abs(b), None if z is None else np.abs(z), strides, pads,
                           dilations, group, ACTIVATIONS["none"])
    tolerance = 4 * np.finfo(np.float32).eps * np.sqrt(depth) * float(magnitude.max())
    with intra_op.intra_op_threads(1):
        y = bound(x, None, z)
    assert y is not None and y.shape == expected.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("index", range(len(GEOMETRIES)))
def test_packed_convolution_is_the_same_at_any_thread_count(monkeypatch, index):
    geometry = GEOMETRIES[index]
    _, _, strides, pads, dilations, group = geometry
    rng, x, w, b = _operands(geometry, 100 + index)
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)  # split even these small layers
    bound = KERNELS.bind("packed", x.shape, w, b, strides, pads, dilations, group, ACTIVATIONS["relu"])
    z = rng.standard_normal(bound.y_shape).astype(np.float32)
    results = []
    for threads in (1, 2, 4, 3):
        with intra_op.intra_op_threads(threads):
            results.append(bound(x, None, z))
    for y in results[1:]:
        assert np.array_equal(y, results[0])


def test_packed_convolution_splits_rows_when_pixels_are_few(monkeypatch):
    # 7x7 outputs are one pixel panel: at 4 threads the output channels are split instead
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)
    rng, x, w, b = _operands(((1, 64, 7, 7), (100, 64, 3, 3)), 7)
    bound = KERNELS.bind("packed", x.shape, w, b, (1, 1), (1, 1, 1, 1), (1, 1), 1, ACTIVATIONS["none"])
    assert bound.count == 1
    before = intra_op.parallel_seconds()
    with intra_op.intra_op_threads(1):
        one = bound(x, None, None)
    with intra_op.intra_op_threads(4):
        four = bound(x, None, None)
    assert intra_op.parallel_seconds() > before
    assert np.array_equal(one, four)
    expected = _reference(x, w, b, None, (1, 1), (1, 1, 1, 1), (1, 1), 1, ACTIVATIONS["none"])
    np.testing.assert_allclose(one, expected, rtol=0, atol=1e-4 * float(np.abs(expected).max()))


#: 1-D: (x shape, w shape, stride, pads [left, right], dilation, group)
GEOMETRIES_1D = [((2, 6, 50), (10, 3, 5), 1, (2, 2), 1, 2), ((1, 17, 129), (8, 17, 3), 2, (0, 1), 3, 1),
                 ((1, 4, 33), (70, 4, 1), 1, (0, 0), 1, 1),
                 # pads wider than a vector: stride-2 vectors whose only input inside is their last lane
                 ((1, 2, 8), (3, 2, 3), 2, (30, 29), 1, 1)]


@pytest.mark.parametrize("index", range(len(GEOMETRIES_1D)))
def test_one_dimensional_convolutions_run_as_images_of_height_one(index):
    x_shape, w_shape, stride, pads, dilation, group = GEOMETRIES_1D[index]
    rng, x, w, b = _operands((x_shape, w_shape), 200 + index)
    bound = KERNELS.bind("packed", x_shape, w, b, [stride], pads, [dilation], group, ACTIVATIONS["relu"])
    assert bound is not None and len(bound.y_shape) == 3
    z = rng.standard_normal(bound.y_shape).astype(np.float32)
    expected = _reference(x, w, b, z, [stride], pads, [dilation], group, ACTIVATIONS["relu"])
    with intra_op.intra_op_threads(1):
        y = bound(x, None, z)
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-4 * float(np.abs(expected).max()))
    kind = conv_ops._native_kind(x_shape, w_shape, [stride], pads, [dilation], group, True, packs=True)
    assert kind == "packed"


def test_weights_are_packed_once_per_array():
    rng, x, w, b = _operands(((1, 8, 9, 9), (10, 8, 3, 3)), 3)
    first = KERNELS.bind("packed", x.shape, w, b, (1, 1), (1, 1, 1, 1), (1, 1), 1, ACTIVATIONS["none"])
    second = KERNELS.bind("packed", (2, 8, 5, 6), w, b, (1, 1), (1, 1, 1, 1), (1, 1), 1, ACTIVATIONS["none"])
    assert first.packed is second.packed
    # 10 rows padded to 12 (two panels of 6), depth tap by tap
    assert first.packed.size == 12 * 8 * 9
    assert first.packed[:6].tolist() == w[:6, 0, 0, 0].tolist()
    assert first.packed[6 * 8:6 * 8 + 6].tolist() == w[:6, 0, 0, 1].tolist()
    assert not first.packed[(2 * 8 * 9 - 1) * 6 + 4:].any()  # rows 10 and 11 of the last step


def test_geometries_the_binding_refuses():
    w = np.ones((6, 4, 3, 3), np.float32)
    assert KERNELS.bind("packed", (1, 8, 9, 9), w, None, (1, 1), (1, 1, 1, 1), (1, 1), 1,
                        ACTIVATIONS["none"]) is None  # 8 channels, weights for 4 per group and 1 group
    assert KERNELS.bind("packed", (1, 4, 2, 2), w, None, (1, 1), (0, 0, 0, 0), (1, 1), 1,
                        ACTIVATIONS["none"]) is None  # no output pixel
    # input positions past 32-bit lanes (a huge stride over huge pads): refused, the other paths run it
    assert KERNELS.bind("packed", (1, 4, 3, 3), w, None, (1 << 20, 1), (1 << 30, 1, 1 << 30, 1), (1, 1), 1,
                        ACTIVATIONS["none"]) is None


def test_torch_network_matches_onnxruntime_at_every_thread_count(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    from carrack.runtime.session import InferenceSession, SessionOptions

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 20, 5, stride=2, padding=2), torch.nn.ReLU(),
        torch.nn.Conv2d(20, 36, 3, padding=2, dilation=2, groups=2), torch.nn.ReLU6(),
        torch.nn.Conv2d(36, 50, 1, stride=2), torch.nn.LeakyReLU(0.1),
        torch.nn.Conv2d(50, 50, (3, 1), padding=(1, 0)), torch.nn.Sigmoid(), torch.nn.Flatten(2),
        torch.nn.Conv1d(50, 12, 3, stride=2, padding=1))
    x = torch.randn(2, 3, 37, 45)
    path = tmp_path / "net.onnx"
    torch.onnx.export(net.eval(), (x,), str(path), input_names=["x"], output_names=["y"], dynamo=False)
    feed = {"x": x.numpy()}
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    packed_calls = []
    original = native_conv.BoundConvolution.__call__
    monkeypatch.setattr(native_conv.BoundConvolution, "__call__",
                        lambda self, *a: packed_calls.append(self.packed is not None) or original(self, *a))
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)
    results = []
    for threads in (1, 2, 4):
        options = SessionOptions()
        options.intra_op_num_threads = threads
        results.append(InferenceSession(str(path), options).run(None, feed)[0])
    assert packed_calls.count(True) == 3 * 5  # every convolution of every run
    np.testing.assert_allclose(results[0], expected, rtol=1e-4, atol=1e-5)
    for y in results[1:]:
        assert np.array_equal(y, results[0])


def test_weights_fed_as_inputs_are_packed_for_each_run(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from carrack.runtime.session import InferenceSession

    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 0, 1, 2], strides=[2, 1])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, 11, 12]),
                                            helper.make_tensor_value_info("w", TensorProto.FLOAT, [9, 5, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()
    calls = []
    original = native_conv.NativeConvolution.packed
    monkeypatch.setattr(native_conv.NativeConvolution, "packed", lambda self, *a: calls.append(1) or original(self, *a))
    session, reference = InferenceSession(model), ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(11)
    feed = {"x": rng.standard_normal((1, 5, 11, 12)).astype(np.float32),
            "w": rng.standard_normal((9, 5, 3, 3)).astype(np.float32)}
    for _ in range(2):  # the same weight array, changed in place between runs
        np.testing.assert_allclose(session.run(None, feed)[0], reference.run(None, feed)[0], rtol=1e-5, atol=1e-5)
        feed["w"] *= -2.0
    assert len(calls) == 2


def test_an_unpickled_input_gets_the_same_bits():
    # an unpickled array's dtype is equal to numpy's float32 but another object: the bound call (which compares by
    # identity) refuses it and the general path must still run packconv, not the old product
    import pickle

    rng, x, w, b = _operands(((1, 3, 9, 10), (8, 3, 3, 3)), 12)  # 3 channels: the old path is im2col
    w.flags.writeable = False
    unpickled = pickle.loads(pickle.dumps(x))
    expected = conv_ops.convolve(x, w, strides=[1, 1], pads=[1, 1, 1, 1], dilations=[1, 1], group=1, bias=b,
                                 kernels=KERNELS)
    got = conv_ops.convolve(unpickled, w, strides=[1, 1], pads=[1, 1, 1, 1], dilations=[1, 1], group=1, bias=b,
                            kernels=KERNELS)
    bound = KERNELS.bind("packed", x.shape, w, b, (1, 1), (1, 1, 1, 1), (1, 1), 1, ACTIVATIONS["none"])
    assert np.array_equal(got, expected) and np.array_equal(bound(x, None, None), expected)


def _bottleneck_network(torch):
    """A ResNet-50-like network, small: a 7x7/2 stem on 3 channels, max pool, bottleneck blocks (1x1, 3x3, 1x1 with
    BatchNorm, the residual added before the last ReLU) with stride-2 downsampling, on maps whose rows are a multiple
    of 16 wide (the stem's 32), 8x8, 4x4 and 7x7 (a pixel past the vectors), depth past one 128-step block."""
    nn = torch.nn

    def conv_bn(cin, cout, k, stride=1, relu=True):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            self.body = nn.Sequential(conv_bn(cin, mid, 1), conv_bn(mid, mid, 3, stride),
                                      conv_bn(mid, 4 * mid, 1, relu=False))
            self.shortcut = (conv_bn(cin, 4 * mid, 1, stride, relu=False) if stride != 1 or cin != 4 * mid
                             else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.shortcut(x))

    net = nn.Sequential(conv_bn(3, 16, 7, 2), nn.MaxPool2d(3, 2, 1), Bottleneck(16, 16, 1), Bottleneck(64, 16, 1),
                        Bottleneck(64, 40, 2), Bottleneck(160, 40, 1), Bottleneck(160, 48, 2))
    for module in net.modules():  # BatchNorm statistics as a trained network has them, not the identity
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5), module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5), module.bias.data.uniform_(-0.2, 0.2)
    return net.eval()


@pytest.mark.parametrize("size", [64, 56])
def test_torch_bottleneck_blocks_match_onnxruntime_at_every_thread_count(tmp_path, monkeypatch, size):
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    import onnx

    from carrack.runtime.session import InferenceSession, SessionOptions

    torch.manual_seed(1)
    x = torch.randn(1, 3, size, size)
    path = tmp_path / "resnet_blocks.onnx"
    torch.onnx.export(_bottleneck_network(torch), (x,), str(path), input_names=["x"], output_names=["y"],
                      dynamo=False)
    feed = {"x": x.numpy()}
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)  # every layer split, rows too on the small maps
    results = []
    for threads in (1, 2, 4):
        options = SessionOptions()
        options.intra_op_num_threads = threads
        options.optimized_model_filepath = str(tmp_path / f"optimized{threads}.onnx")
        session = InferenceSession(str(path), options)
        results.append([session.run(None, feed)[0] for _ in range(2)])  # the second run: steps bound to the arena
    optimized = onnx.load(str(tmp_path / "optimized1.onnx")).graph.node
    residual_convs = [n for n in optimized if n.op_type == "FusedConv" and len(n.input) == 4]
    assert len(residual_convs) == 5 and not [n for n in optimized if n.op_type == "Add"]
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(results[0][0], expected, rtol=0, atol=2e-5 * scale)
    for first, second in results:
        assert np.array_equal(first, results[0][0]) and np.array_equal(second, results[0][0])
