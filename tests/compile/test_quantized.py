"""Quantized models compiled: a small CNN quantized by onnxruntime's own quantize_static (QDQ format, per-tensor;
uint8 and int8 activations, int8 weights) becomes, after carrack's lowering, QuantizeLinear, QLinearConvExact
(plain, strided, 1x1, depthwise), uint8 MaxPool, QLinearAdd, DequantizeLinear and QLinearMatMulExact. The compiled
integer kernels (carrack_quant.h) equal carrack's session bit for bit on every target: the portable C loop, SSE2,
AVX2, AVX-512 and WebAssembly SIMD128 in Node, at several batch sizes of a run-time batch dim."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import carrack
from carrack.backends.c.build import compile_model
from tests.compile.helpers import assert_compiled_equals_session, needs_compiler, needs_wasm, node_outputs, run_in_node
from tests.compile.test_native import ARCHES, _cpu_flags

pytest.importorskip("onnxruntime.quantization")


class QuantizableCNN(nn.Module):
    """A strided stem with BatchNorm, a padded max pool, a residual block of 3x3 and 1x1 convolutions, a depthwise
    convolution with its own residual, a strided convolution to more channels, global pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 1)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.down = nn.Conv2d(16, 37, 3, stride=2, padding=1)
        self.head = nn.Linear(37, 10)

    def forward(self, x):
        y = torch.relu(self.bn(self.stem(x)))
        y = nn.functional.max_pool2d(y, 3, stride=2, padding=1)
        y = torch.relu(self.conv2(torch.relu(self.conv1(y))) + y)
        y = torch.relu(self.depthwise(y)) + y
        y = torch.relu(self.down(y))
        return self.head(nn.functional.adaptive_avg_pool2d(y, 1).flatten(1))


class _Images:
    """quantize_static's calibration reader: a few random images."""

    def __init__(self, count: int = 4) -> None:
        rng = np.random.default_rng(0)
        self.batches = iter([{"x": rng.standard_normal((1, 3, 30, 30)).astype(np.float32)} for _ in range(count)])

    def get_next(self):
        return next(self.batches, None)


def _quantized_cnn(directory, activation: str, weight: str = "int8", per_channel: bool = False):
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    torch.manual_seed(0)
    module = QuantizableCNN().eval()
    with torch.no_grad():
        module.bn.running_mean.uniform_(-0.3, 0.3)
        module.bn.running_var.uniform_(0.5, 1.5)
    source, prepared, target = (directory / name for name in ("float.onnx", "prepared.onnx", "qdq.onnx"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(1, 3, 30, 30),), str(source), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False, opset_version=17)
        quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
        quantize_static(str(prepared), str(target), _Images(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8 if activation == "uint8" else QuantType.QInt8,
                        weight_type=QuantType.QInt8 if weight == "int8" else QuantType.QUInt8,
                        per_channel=per_channel)
    return target


#: activation and weight types (per-channel weight scales or not): uint8 weights with a zero point shift to int16
#: (the kernels' wide weights)
TYPES = {"uint8": ("uint8", "int8"), "int8": ("int8", "int8"), "uint8_weights": ("uint8", "uint8"),
         "per_channel": ("uint8", "int8", True)}


@pytest.fixture(scope="module", params=list(TYPES))
def quantized(request, tmp_path_factory):
    return _quantized_cnn(tmp_path_factory.mktemp(f"qdq_{request.param}"), *TYPES[request.param])


def _feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": (rng.standard_normal((batch, 3, 30, 30)) * scale).astype(np.float32)}
            for batch, scale in ((1, 1.0), (3, 2.0), (2, 0.5))]


QUANT_KERNELS = ("cr_quantize(", "cr_qconv2d(", "cr_qmaxpool2d(", "cr_qlinear_add", "cr_dequantize(", "cr_qmatmul(")


def _assert_bit_exact(path, model_run) -> None:
    session = carrack.InferenceSession(str(path))
    for feed in _feeds():
        want = session.run(None, feed)[0]
        got = model_run(feed)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


#: -march -> the CPU flags it needs, for the targets whose int16 pair products are vpdpwssd: AVX-512 VNNI on
#: 16 lanes (icelake-server), AVX-VNNI on 8 lanes without AVX-512 (alderlake)
VNNI_ARCHES = {"icelake-server": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
               "alderlake": {"avx2", "fma", "avx_vnni"}}
ALL_ARCHES = {**ARCHES, **VNNI_ARCHES}

#: native builds: the machine's own, each x86-64 level and VNNI target the CPU runs, and the portable loop forced by
#: a define
BUILDS = {"native": ("native", ""), **{arch: (arch, "") for arch in ALL_ARCHES},
          "portable": ("native", "-DCR_QUANT_PORTABLE")}


def _skip_unless_cpu_runs(arch: str) -> None:
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        pytest.skip("x86-64 Linux only")
    if not ALL_ARCHES[arch] <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(ALL_ARCHES[arch] - _cpu_flags())} for -march={arch}")


@needs_compiler
@pytest.mark.parametrize("build", list(BUILDS))
def test_quantized_cnn_native_is_bit_exact(quantized, tmp_path, monkeypatch, build):
    arch, define = BUILDS[build]
    if arch != "native":
        _skip_unless_cpu_runs(arch)
    if define:
        from carrack.backends.c.build import native_compiler

        monkeypatch.setenv("CC", " ".join([*native_compiler(), define]))
    compile_model(quantized, tmp_path, "native", max_dims={"batch": 3}, native_arch=arch)
    source = (tmp_path / "model.c").read_text()
    assert all(kernel in source for kernel in QUANT_KERNELS)
    model = carrack.CompiledModel(tmp_path)
    _assert_bit_exact(quantized, lambda feed: model.run(None, feed)[0])


def _disassembly(library) -> str:
    tool = shutil.which("objdump") or shutil.which("llvm-objdump")
    if tool is None:
        pytest.skip("neither objdump nor llvm-objdump is installed (binutils) to read the library's instructions")
    return subprocess.run([tool, "-d", str(library)], capture_output=True, text=True, check=True).stdout


#: (-march, weight type) -> the product instruction its library must contain on which registers, and the ones it
#: must not: AVX-512 VNNI multiplies int8 weights four bytes a lane (vpdpbusd) and int16 (shifted uint8) weights
#: in pairs (vpdpwssd); AVX-VNNI (256-bit) pairs with vpdpwssd; plain AVX-512BW keeps vpmaddwd
PRODUCT_INSTRUCTIONS = {
    ("x86-64-v4", "int8"): ("vpmaddwd", "%zmm", ("vpdpwssd", "vpdpbusd")),
    ("icelake-server", "int8"): ("vpdpbusd", "%zmm", ("vpmaddwd",)),
    ("icelake-server", "uint8"): ("vpdpwssd", "%zmm", ("vpmaddwd",)),
    ("alderlake", "int8"): ("vpdpwssd", "%ymm", ("vpmaddwd",)),
}


@needs_compiler
@pytest.mark.parametrize(("arch", "weight"), list(PRODUCT_INSTRUCTIONS))
def test_vnni_targets_use_their_product_instructions(tmp_path, arch, weight):
    """The built library really holds each target's product instruction; its results are the session's bits."""
    _skip_unless_cpu_runs(arch)
    from carrack.backends.c.build import library_name

    path = _quantized_cnn(tmp_path, "uint8", weight)
    compile_model(path, tmp_path / "out", "native", max_dims={"batch": 3}, native_arch=arch)
    code = _disassembly(tmp_path / "out" / library_name())
    wanted, register, unwanted = PRODUCT_INSTRUCTIONS[arch, weight]
    assert any(wanted in line and register in line for line in code.splitlines()), f"no {wanted} on {register}"
    assert not [name for name in unwanted if name in code]
    model = carrack.CompiledModel(tmp_path / "out")
    _assert_bit_exact(path, lambda feed: model.run(None, feed)[0])


@needs_wasm
def test_quantized_cnn_in_node_is_bit_exact(quantized, tmp_path):
    compile_model(quantized, tmp_path / "out", "wasm32", max_dims={"batch": 3})
    feeds = _feeds()
    report = run_in_node(tmp_path / "out", tmp_path, feeds)
    session = carrack.InferenceSession(str(quantized))
    for feed, run in zip(feeds, report["runs"]):
        want = session.run(None, feed)
        np.testing.assert_array_equal(node_outputs(run, want)[0], want[0])
        assert all(run["variants"].values())


@needs_compiler
def test_integer_outputs_are_bit_exact(tmp_path):
    """The uint8 values themselves (not only their dequantization): a graph ending on QuantizeLinear-ed products."""
    path = _quantized_cnn(tmp_path, "uint8")
    model = onnx.load(str(path))
    last = next(n for n in reversed(model.graph.node) if n.op_type == "DequantizeLinear")
    model.graph.output[0].name = last.input[0]
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.UINT8
    model.graph.node.remove(last)
    onnx.save(model, str(tmp_path / "integer_output.onnx"))
    compile_model(tmp_path / "integer_output.onnx", tmp_path / "out", "native", max_dims={"batch": 3})
    compiled = carrack.CompiledModel(tmp_path / "out")
    assert compiled.get_outputs()[0].type == "tensor(uint8)"
    _assert_bit_exact(tmp_path / "integer_output.onnx", lambda feed: compiled.run(None, feed)[0])


def _ties_graph() -> onnx.ModelProto:
    """QDQ by hand with scales of powers of two, so every rounding step meets exact halves: x / 0.5 of quarter
    values, accumulators times a multiplier of 0.25, QLinearAdd's ka = kb = 0.5; padded and unpadded uint8 max
    pools feed the add. Half-even rounding (rint) is what the session does; half away from zero differs."""
    rng = np.random.default_rng(0)
    w = rng.integers(-3, 4, (4, 2, 3, 3)).astype(np.int8)
    b = rng.integers(-50, 50, 4).astype(np.int32)
    inits = [numpy_helper.from_array(a, n) for a, n in (
        (np.array(0.5, np.float32), "s_half"), (np.array(128, np.uint8), "zp"), (w, "w_q"),
        (np.array(0.5, np.float32), "w_scale"), (np.array(0, np.int8), "w_zp"), (b, "b_q"),
        (np.array(0.25, np.float32), "b_scale"), (np.array(0, np.int32), "b_zp"),
        (np.array(1.0, np.float32), "s_one"), (np.array(2.0, np.float32), "s_two"))]
    N = helper.make_node  # noqa: N806 - short, for the node list
    nodes = [N("QuantizeLinear", ["x", "s_half", "zp"], ["xq"]), N("DequantizeLinear", ["xq", "s_half", "zp"], ["xd"]),
             N("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["wd"]),
             N("DequantizeLinear", ["b_q", "b_scale", "b_zp"], ["bd"]),
             N("Conv", ["xd", "wd", "bd"], ["conv"], pads=[1, 1, 1, 1]),
             N("QuantizeLinear", ["conv", "s_one", "zp"], ["cq"]), N("DequantizeLinear", ["cq", "s_one", "zp"], ["cd"]),
             N("MaxPool", ["cd"], ["pool"], kernel_shape=[2, 2], strides=[1, 1]),
             N("QuantizeLinear", ["pool", "s_one", "zp"], ["pq"]), N("DequantizeLinear", ["pq", "s_one", "zp"], ["pd"]),
             N("MaxPool", ["cd"], ["pool2"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 0, 0]),
             N("QuantizeLinear", ["pool2", "s_one", "zp"], ["p2q"]),
             N("DequantizeLinear", ["p2q", "s_one", "zp"], ["pd2"]),
             N("Add", ["pd", "pd2"], ["sum"]),
             N("QuantizeLinear", ["sum", "s_two", "zp"], ["sq"]), N("DequantizeLinear", ["sq", "s_two", "zp"], ["y"])]
    g = helper.make_graph(nodes, "ties", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, 6, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _check_ties(tmp_path, target: str) -> None:
    wants = _compiled_equals_session(tmp_path, target, _ties_graph(), ("cr_qconv2d", "cr_qlinear_add_flat"),
                                     _ties_feeds())
    for want in wants:  # mostly inside the range: the roundings are not all saturated
        assert 0.1 < np.mean(np.abs(want[0]) < 250)


@needs_compiler
def test_rounding_ties_are_bit_exact(tmp_path):
    _check_ties(tmp_path, "native")


@needs_wasm
def test_rounding_ties_in_node_are_bit_exact(tmp_path):
    _check_ties(tmp_path, "wasm32")


def _ties_feeds() -> list[dict[str, np.ndarray]]:
    return [{"x": (np.random.default_rng(seed).integers(-24, 24, (rows, 2, 6, 6)) * 0.25).astype(np.float32)}
            for rows, seed in ((1, 0), (3, 1))]


def _broadcast_add_graph() -> onnx.ModelProto:
    """QLinearAdd of an activation [n, 4, 3, 3] and a quantized constant per channel [1, 4, 1, 1] (broadcast), with
    scales that make ties (x / 0.5 of quarter values, ka = 0.25, kb = 0.125)."""
    inits = [numpy_helper.from_array(a, n) for a, n in (
        (np.array(0.5, np.float32), "s"), (np.array(128, np.uint8), "zp"),
        (np.arange(4, dtype=np.uint8).reshape(1, 4, 1, 1) * 40 + 10, "b_q"), (np.array(0.25, np.float32), "bs"),
        (np.array(2.0, np.float32), "s2"))]
    N = helper.make_node  # noqa: N806 - short, for the node list
    nodes = [N("QuantizeLinear", ["x", "s", "zp"], ["xq"]), N("DequantizeLinear", ["xq", "s", "zp"], ["xd"]),
             N("DequantizeLinear", ["b_q", "bs", "zp"], ["bd"]), N("Add", ["xd", "bd"], ["sum"]),
             N("QuantizeLinear", ["sum", "s2", "zp"], ["sq"]), N("DequantizeLinear", ["sq", "s2", "zp"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 3, 3])
    g = helper.make_graph(nodes, "broadcast_add", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _compiled_equals_session(tmp_path, target: str, graph: onnx.ModelProto, kernels: tuple[str, ...],
                             feeds: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    """Compiles `graph` for `target` (its code must call `kernels`) and checks that the library, or the module in
    Node, gives the session's bits on every feed; returns the session's outputs."""
    path = tmp_path / "graph.onnx"
    onnx.save(graph, str(path))
    return assert_compiled_equals_session(path, tmp_path / "out", target, feeds, {"n": 3}, kernels=kernels)


def _check_broadcast_add(tmp_path, target: str) -> None:
    feeds = [{"x": (np.random.default_rng(n).integers(-40, 40, (n, 4, 3, 3)) * 0.25).astype(np.float32)}
             for n in (1, 3)]
    _compiled_equals_session(tmp_path, target, _broadcast_add_graph(), ("cr_qlinear_add",), feeds)


@needs_compiler
def test_broadcast_qlinear_add_is_bit_exact(tmp_path):
    _check_broadcast_add(tmp_path, "native")


@needs_wasm
def test_broadcast_qlinear_add_in_node_is_bit_exact(tmp_path):
    _check_broadcast_add(tmp_path, "wasm32")


def _pointwise_graph() -> onnx.ModelProto:
    """A QDQ 1x1 convolution over an odd number of uint8 channels (5: the last pair half zeros) on a 7x7 plane
    (49 pixels: a 32-pixel block, then 17 = two 8-pixel steps and a scalar tail)."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(a, n) for a, n in (
        (np.array(0.25, np.float32), "s"), (np.array(100, np.uint8), "zp"),
        (rng.integers(-100, 100, (6, 5, 1, 1)).astype(np.int8), "w_q"), (np.array(0.5, np.float32), "ws"),
        (np.array(0, np.int8), "wzp"), (rng.integers(-300, 300, 6).astype(np.int32), "b_q"),
        (np.array(0.125, np.float32), "bs"), (np.array(0, np.int32), "bzp"), (np.array(4.0, np.float32), "s2"))]
    N = helper.make_node  # noqa: N806 - short, for the node list
    nodes = [N("QuantizeLinear", ["x", "s", "zp"], ["xq"]), N("DequantizeLinear", ["xq", "s", "zp"], ["xd"]),
             N("DequantizeLinear", ["w_q", "ws", "wzp"], ["wd"]), N("DequantizeLinear", ["b_q", "bs", "bzp"], ["bd"]),
             N("Conv", ["xd", "wd", "bd"], ["conv"]),
             N("QuantizeLinear", ["conv", "s2", "zp"], ["cq"]), N("DequantizeLinear", ["cq", "s2", "zp"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5, 7, 7])
    g = helper.make_graph(nodes, "pointwise", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _check_pointwise(tmp_path, target: str) -> None:
    feeds = [{"x": (np.random.default_rng(seed).standard_normal((rows, 5, 7, 7)) * 12).astype(np.float32)}
             for rows, seed in ((1, 0), (3, 1))]
    wants = _compiled_equals_session(tmp_path, target, _pointwise_graph(), ("cr_qconv2d",), feeds)
    assert 0.1 < np.mean((wants[1][0] > -390) & (wants[1][0] < 610))  # mostly not saturated


@needs_compiler
def test_pointwise_convolution_is_bit_exact(tmp_path):
    """1x1 convolutions pack their input pairs straight from the planes (8 pixels a step on SIMD128)."""
    _check_pointwise(tmp_path, "native")


@needs_wasm
def test_pointwise_convolution_in_node_is_bit_exact(tmp_path):
    _check_pointwise(tmp_path, "wasm32")
