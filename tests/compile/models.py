"""Small float networks exported with torch.onnx for the compile tests: each returns (path, feeds maker)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn


class SmallCNN(nn.Module):
    """Conv + BatchNorm + ReLU, a depthwise conv with ReLU6, a 1x1 conv, max and average pools, a scaled sum,
    global pooling, a linear layer and softmax: mobilenet's building blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.depthwise = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
        self.pointwise = nn.Conv2d(8, 16, 1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.bn(self.stem(x)))
        y = self.pointwise(nn.functional.relu6(self.depthwise(y)))
        y = nn.functional.max_pool2d(y, 2) + 0.5 * nn.functional.avg_pool2d(y, 2)
        y = nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
        return torch.softmax(self.fc(y), -1)


class Fire(nn.Module):
    def __init__(self, c_in: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(c_in, squeeze, 1)
        self.left = nn.Conv2d(squeeze, expand, 1)
        self.right = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x):
        s = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.left(s)), torch.relu(self.right(s))], 1)


class ResidualCNN(nn.Module):
    """Residual blocks (conv + add + relu), a squeezenet fire module (concat), BatchNorm after a concat,
    ceil-mode max pooling, padded average pooling counting the pads, a strided dilated conv, a grouped conv,
    hardswish, leaky relu, sigmoid gating and a global max pool; batch, height and width are dynamic. Its
    convolutions take both kernels: vectorized over pixels (few channels) and over channels (16 and more)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fire = Fire(16, 6, 8)
        self.bn = nn.BatchNorm2d(16)
        self.dilated = nn.Conv2d(16, 16, 3, stride=2, padding=2, dilation=2)
        self.grouped = nn.Conv2d(16, 32, 3, padding=1, groups=2)
        self.gate = nn.Conv2d(32, 32, 1)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        y = nn.functional.hardswish(self.stem(x))
        y = torch.relu(self.conv2(torch.relu(self.conv1(y))) + y)
        y = nn.functional.max_pool2d(y, 3, stride=2, ceil_mode=True)
        y = self.bn(self.fire(y))
        y = nn.functional.avg_pool2d(y, 3, stride=1, padding=1, count_include_pad=True)
        y = self.grouped(nn.functional.leaky_relu(self.dilated(y), 0.1))
        y = y * torch.sigmoid(self.gate(y))
        y = nn.functional.adaptive_max_pool2d(y, 1).flatten(1)
        return nn.functional.log_softmax(self.head(y), -1)


class SequenceMLP(nn.Module):
    """A 1-D convolution over a sequence, a transpose, and an MLP on every position (3-D MatMul + bias, GELU,
    tanh), with batch and sequence length dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(6, 16, 3, padding=1)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        y = torch.relu(self.conv(x)).transpose(1, 2)
        y = torch.tanh(self.fc2(nn.functional.gelu(self.fc1(y))))
        return y, torch.sigmoid(y) * 2.0 - y


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.Sigmoid(), nn.Linear(64, 3))

    def forward(self, x):
        return torch.softmax(self.layers(x), -1)


class WideBlocks(nn.Module):
    """Layers wide and deep enough for every edge of the packed matrix product: a 3x3 convolution over 40 channels
    (depth 360: two panels) with a fused residual (the first panel starts from it, the second adds to the sums),
    a 1x1 convolution to 300 channels (row tiles with a remainder), planes and linear widths that are not
    multiples of a vector tile nor of a panel block (130), and a mean over the trailing axes (ReduceMean,
    mobilenet's head); depthwise convolutions at stride 1 along the rows (3x3 with relu6, and 3x5 with a
    vertical stride and no bias), whose rows have vector and edge columns."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 40, 3, padding=1)
        self.mid = nn.Conv2d(40, 40, 1)
        self.body = nn.Conv2d(40, 40, 3, padding=1)
        self.depthwise = nn.Conv2d(40, 40, 3, padding=1, groups=40)
        self.depthwise_wide = nn.Conv2d(40, 40, (3, 5), stride=(2, 1), padding=(1, 2), groups=40, bias=False)
        self.expand = nn.Conv2d(40, 300, 1)
        self.fc1 = nn.Linear(300, 130)
        self.fc2 = nn.Linear(130, 7)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = torch.relu(self.body(torch.relu(self.mid(y))) + y)
        y = self.depthwise_wide(nn.functional.relu6(self.depthwise(y)))
        y = nn.functional.relu6(self.expand(y)).mean((2, 3))
        return self.fc2(nn.functional.gelu(self.fc1(y)))


class NormalizedResiduals(nn.Module):
    """A transformer's residual stream without attention: linear layers whose outputs are added to the stream and
    layer-normalized (carrack's optimizer makes SkipLayerNormalization of the add and LayerNormalization, with
    the sum kept for the next residual), GELU in between; batch and sequence dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 24)
        self.fc2 = nn.Linear(24, 24)
        self.norm1 = nn.LayerNorm(24)
        self.norm2 = nn.LayerNorm(24, eps=1e-3)
        self.norm3 = nn.LayerNorm(24)
        with torch.no_grad():
            for norm in (self.norm1, self.norm2, self.norm3):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        stream = self.norm1(x)
        stream = self.fc1(stream) + stream
        y = self.norm2(stream)
        stream = self.fc2(nn.functional.gelu(y)) + stream
        return self.norm3(stream)


class SelfAttention(nn.Module):
    """An encoder's attention block written as transformers writes it (projections, heads split and transposed,
    scaled scores, softmax, weighted values, heads merged; carrack's optimizer makes MultiHeadAttention of it),
    then a residual and a layer norm; batch and sequence dynamic."""

    def __init__(self, hidden: int = 40, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.size = heads, hidden // heads
        self.q, self.k, self.v, self.out = (nn.Linear(hidden, hidden) for _ in range(4))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        batch, length, hidden = x.shape
        size = self.size

        def split(t):
            return t.view(batch, length, self.heads, size).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(size), -1)
        return self.norm(self.out((p @ v).transpose(1, 2).reshape(batch, length, hidden)) + x)


def _randomize_batchnorm(module: nn.Module, rng: torch.Generator) -> None:
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=rng) * 0.3)
            m.running_var.copy_(torch.rand(m.num_features, generator=rng) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=rng) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=rng) * 0.1)


class FullyConvolutional(nn.Module):
    """A dense-prediction head: strided and padded convolutions whose output height and width are expressions of
    the input's ((height - 1) // 2 + 1), which the loaders get from the compiled model."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.mix = nn.Conv2d(8, 24, 3, padding=1)
        self.classes = nn.Conv2d(24, 4, 1)

    def forward(self, x):
        return torch.softmax(self.classes(torch.relu(self.mix(torch.relu(self.down(x))))), 1)


class StridedEdges(nn.Module):
    """The kernels' edge cases at odd sizes: depthwise convolutions at stride 2 (3x3 and 5x5, padded and not, with a
    bias and relu6) and at stride 1 (dilated along the rows, with a residual; rows wide enough to be read in
    place at 4 and 16 lanes), padded max and average pools at stride 2 (average with and without the pads counted, a
    dilated max pool), a channel shuffle (a Transpose whose rows stay contiguous) and channel-last transposes, and
    convolutions whose output channels (13, 7) and pixels are not multiples of any target's tile."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 12, 3, padding=1)
        self.flat = nn.Conv2d(12, 12, 3, padding=(1, 2), dilation=(1, 2), groups=12)
        self.down3 = nn.Conv2d(12, 12, 3, stride=2, padding=1, groups=12)
        self.down5 = nn.Conv2d(12, 12, 5, stride=2, padding=2, groups=12)
        self.valid = nn.Conv2d(12, 12, 3, stride=2, groups=12, bias=False)
        self.mix = nn.Conv2d(12, 13, 1)
        self.wide = nn.Conv2d(13, 7, 3, padding=1)
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = nn.functional.relu6(self.flat(y)) + y
        batch, channels, height, width = y.shape
        y = y.view(batch, 3, channels // 3, height, width).transpose(1, 2).reshape(batch, channels, height, width)
        a = nn.functional.relu6(self.down3(y))
        b = self.down5(y)
        m = nn.functional.max_pool2d(y, 3, stride=2, padding=1)
        p = nn.functional.avg_pool2d(y, 3, stride=2, padding=1, count_include_pad=False)
        q = nn.functional.avg_pool2d(y, 3, stride=2, padding=1, count_include_pad=True)
        y = a + b + m + 0.5 * p + 0.25 * q
        y = y + nn.functional.max_pool2d(y, 2, stride=1, padding=1, dilation=2)
        v = self.valid(y).permute(0, 2, 3, 1).mean((1, 2, 3))
        u = self.wide(self.mix(y)).permute(0, 2, 3, 1).mean((1, 2, 3))
        return self.head(nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)) + (u + v)[:, None]


#: name -> (module class, example input shape, dynamic axes of the input {axis: symbol}, run-time maxima)
MODELS = {
    "small_cnn": (SmallCNN, (2, 3, 16, 16), {0: "batch"}, {"batch": 4}),
    "residual_cnn": (ResidualCNN, (1, 3, 15, 17), {0: "batch", 2: "height", 3: "width"},
                     {"batch": 3, "height": 20, "width": 20}),
    "sequence_mlp": (SequenceMLP, (2, 6, 7), {0: "batch", 2: "length"}, {"batch": 3, "length": 12}),
    "mlp": (MLP, (2, 20), {0: "batch"}, {"batch": 5}),
    "fully_convolutional": (FullyConvolutional, (1, 3, 9, 12), {0: "batch", 2: "height", 3: "width"},
                            {"batch": 2, "height": 40, "width": 40}),
    "wide_blocks": (WideBlocks, (1, 3, 13, 11), {0: "batch", 2: "height", 3: "width"},
                    {"batch": 2, "height": 16, "width": 16}),
    "normalized_residuals": (NormalizedResiduals, (2, 5, 24), {0: "batch", 1: "sequence"},
                             {"batch": 3, "sequence": 9}),
    "self_attention": (SelfAttention, (2, 5, 40), {0: "batch", 1: "sequence"}, {"batch": 3, "sequence": 11}),
    "strided_edges": (StridedEdges, (1, 3, 15, 17), {0: "batch", 2: "height", 3: "width"},
                      {"batch": 2, "height": 23, "width": 67}),
}

#: outputs' dynamic axes where they are not just the batch
OUTPUT_AXES = {"fully_convolutional": {0: "batch", 2: "out_height", 3: "out_width"}}

#: input shapes each test runs (all within the maxima)
SHAPES = {
    "small_cnn": [(1, 3, 16, 16), (3, 3, 16, 16), (4, 3, 16, 16)],
    "residual_cnn": [(1, 3, 15, 17), (3, 3, 20, 20), (2, 3, 8, 11)],
    "sequence_mlp": [(1, 6, 1), (3, 6, 12), (2, 6, 5)],
    "mlp": [(1, 20), (5, 20), (2, 20)],
    "fully_convolutional": [(1, 3, 9, 12), (2, 3, 40, 33), (2, 3, 1, 2)],
    "wide_blocks": [(1, 3, 13, 11), (2, 3, 16, 16), (1, 3, 1, 1)],
    "normalized_residuals": [(2, 5, 24), (3, 9, 24), (1, 1, 24)],
    "self_attention": [(2, 5, 40), (3, 11, 40), (1, 1, 40)],
    "strided_edges": [(1, 3, 15, 17), (2, 3, 23, 67), (1, 3, 6, 9)],
}


def export(name: str, directory: Path) -> tuple[Path, dict[str, int]]:
    """The model exported to `directory`/`name`.onnx, and its run-time maxima."""
    module_class, shape, axes, maxima = MODELS[name]
    rng = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    module = module_class().eval()
    with torch.no_grad():
        _randomize_batchnorm(module, rng)
    path = directory / f"{name}.onnx"
    outputs = ["y", "z"] if name == "sequence_mlp" else ["y"]
    torch.onnx.export(module, (torch.randn(*shape),), str(path), input_names=["x"], output_names=outputs,
                      dynamic_axes={"x": axes, **{o: OUTPUT_AXES.get(name, {0: "batch"}) for o in outputs}},
                      dynamo=False)
    return path, maxima


def feeds(name: str, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for shape in SHAPES[name]]


def session_outputs(path: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    import carrack

    return carrack.InferenceSession(str(path)).run(None, feed)


Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]
