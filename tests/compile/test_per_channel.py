"""Per-axis (per-channel) QuantizeLinear and DequantizeLinear compiled (carrack_quant.h's cr_quantize_axis and
cr_dequantize_axis): a 1-D scale and zero point along `axis`, as per-channel quantization writes them, bit for bit
equal to carrack's session natively and in Node. The models: torch's per-channel fake quantization exported by
torch.onnx (the Q/DQ pairs a quantization-aware model leaves on activations; a run-time batch), and a hand-made graph
whose scales are powers of two so every rounding meets exact halves, on axis 0, 1 and -1, uint8 and int8."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from carrack.backends.c.build import compile_model
from carrack.backends.c.emit import UnsupportedOperators
from tests.compile.helpers import assert_compiled_equals_session, needs_compiler, needs_wasm


class PerChannelFakeQuant(nn.Module):
    """A convolution whose output is fake-quantized per channel to uint8 (axis 1), then a linear layer over the
    pixels fake-quantized per feature to int8 (axis 2 of [batch, channels, features])."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.linear = nn.Linear(36, 7)
        self.register_buffer("conv_scale", torch.tensor([0.02, 0.05, 0.1, 0.03, 0.07]))
        self.register_buffer("conv_zero_point", torch.tensor([0, 3, 128, 250, 17], dtype=torch.int32))
        self.register_buffer("linear_scale", torch.linspace(0.01, 0.08, 7))
        self.register_buffer("linear_zero_point", torch.tensor([0, -5, 9, -128, 127, 1, -60], dtype=torch.int32))

    def forward(self, x):
        y = torch.fake_quantize_per_channel_affine(self.conv(x), self.conv_scale, self.conv_zero_point, 1, 0, 255)
        y = self.linear(torch.relu(y).flatten(2))
        return torch.fake_quantize_per_channel_affine(y, self.linear_scale, self.linear_zero_point, 2, -128, 127)


def _fake_quant_model(directory):
    torch.manual_seed(0)
    path = directory / "fake_quant.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(PerChannelFakeQuant().eval(), (torch.randn(1, 3, 6, 6),), str(path), input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False,
                          opset_version=13)
    axes = {int(a.i) for n in onnx.load(str(path)).graph.node if n.op_type.endswith("QuantizeLinear")
            for a in n.attribute if a.name == "axis"}
    assert axes == {1, 2}  # the exporter wrote per-axis Q/DQ nodes
    return path


def _fake_quant_feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": (rng.standard_normal((batch, 3, 6, 6)) * scale).astype(np.float32)}
            for batch, scale in ((1, 1.0), (3, 4.0), (2, 0.3))]


def _ties_graph() -> onnx.ModelProto:
    """x [n, 3, 4, 5] quantized along axis 1 (uint8), 0 of a constant-shaped view (int8, one channel per row of the
    transposed tensor) and -1 (int8), with power-of-two scales: x / scale meets exact halves. Both the integer
    values and their dequantization are outputs."""
    def param(values, dtype):
        return np.array(values, dtype)

    inits = [numpy_helper.from_array(a, n) for a, n in (
        (param([0.5, 0.25, 1.0], np.float32), "s1"), (param([128, 0, 255], np.uint8), "z1"),
        (param([0.5, 2.0, 0.125, 1.0, 0.25], np.float32), "s_last"), (param([0, -3, 5, -128, 127], np.int8), "z_last"),
        (param([0.25, 0.5, 1.0, 2.0], np.float32), "s0"), (param([1, -1, 0, 100], np.int8), "z0"))]
    N = helper.make_node  # noqa: N806 - short, for the node list
    nodes = [N("QuantizeLinear", ["x", "s1", "z1"], ["q1"], axis=1),
             N("DequantizeLinear", ["q1", "s1", "z1"], ["d1"], axis=1),
             N("QuantizeLinear", ["x", "s_last", "z_last"], ["q_last"], axis=-1),
             N("DequantizeLinear", ["q_last", "s_last", "z_last"], ["d_last"], axis=-1),
             N("Transpose", ["x"], ["xt"], perm=[2, 1, 0, 3]),
             N("QuantizeLinear", ["xt", "s0", "z0"], ["q0"], axis=0),
             N("DequantizeLinear", ["q0", "s0", "z0"], ["d0"], axis=0)]
    outputs = [helper.make_tensor_value_info(name, elem, None) for name, elem in (
        ("q1", TensorProto.UINT8), ("d1", TensorProto.FLOAT), ("q_last", TensorProto.INT8),
        ("d_last", TensorProto.FLOAT), ("q0", TensorProto.INT8), ("d0", TensorProto.FLOAT))]
    g = helper.make_graph(nodes, "per_axis_ties", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                   ["n", 3, 4, 5])], outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def _ties_feeds() -> list[dict[str, np.ndarray]]:
    return [{"x": (np.random.default_rng(seed).integers(-300, 300, (rows, 3, 4, 5)) * 0.125).astype(np.float32)}
            for rows, seed in ((1, 0), (3, 1))]


def _save_ties(tmp_path):
    path = tmp_path / "ties.onnx"
    onnx.save(_ties_graph(), str(path))
    return path


@pytest.mark.parametrize("target", [pytest.param("native", marks=needs_compiler),
                                    pytest.param("wasm32", marks=needs_wasm)])
@pytest.mark.parametrize("model", ["fake_quant", "ties"])
def test_per_axis_quantization_is_bit_exact(tmp_path, model, target):
    path = _fake_quant_model(tmp_path) if model == "fake_quant" else _save_ties(tmp_path)
    feeds = _fake_quant_feeds() if model == "fake_quant" else _ties_feeds()
    wants = assert_compiled_equals_session(path, tmp_path / "out", target, feeds,
                                           {"batch" if model == "fake_quant" else "n": 3},
                                           kernels=("cr_quantize_axis", "cr_dequantize_axis"))
    if model == "ties":  # the ties are really there, and mostly not saturated
        x = feeds[1]["x"]
        assert np.any(np.abs(x / np.float32(0.25) % 1) == 0.5)
        assert 0.5 < np.mean((wants[1][0] > 0) & (wants[1][0] < 255))


@needs_compiler
def test_blocked_and_misshapen_scales_are_listed(tmp_path):
    """A blocked scale (opset 21 block_size) and a per-axis scale of the wrong length are named, not compiled."""
    inits = [numpy_helper.from_array(np.full((4, 1), 0.5, np.float32), "blocked"),
             numpy_helper.from_array(np.full(3, 0.5, np.float32), "short")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "blocked"], ["a"], axis=1, block_size=2),
             helper.make_node("QuantizeLinear", ["x", "short"], ["b"], axis=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2])],
                          [helper.make_tensor_value_info(n, TensorProto.UINT8, None) for n in "ab"], inits)
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    with pytest.raises(UnsupportedOperators) as info:
        compile_model(path, tmp_path / "out", "native")
    message = str(info.value)
    assert "blocked quantization" in message
    assert "a scale of shape (3,) along axis 0 of length 4" in message
