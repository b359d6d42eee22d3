"""Native libraries with the session kernels apply the element-wise nodes after a convolution as it stores
(shufflenet's units, whose normalizations a model may keep): Conv -> BatchNormalization -> Add/Sum of a residual ->
Relu becomes one kernel call, the normalization folded into the weights at compile time; the results equal the
session's at fixed and run-time dims, and a value read elsewhere keeps its own step."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.backends.c.build import compile_model
from tests.compile.models import session_outputs
from tests.compile.test_native_kernels import needs_avx512

pytestmark = [pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                 reason="no C compiler (apt-get install gcc)"), needs_avx512]

CHANNELS, GROUPS = 12, 3
ELEMENTWISE = ("cr_affine(", "cr_binary(", "cr_unary(")


class _Builder:
    def __init__(self, seed: int):
        self.rng, self.nodes, self.initializers = np.random.default_rng(seed), [], []

    def constant(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def conv(self, x: str, out: str, channels_in: int, channels: int, kernel: int = 1, group: int = 1,
             stride: int = 1, bias: bool = False) -> str:
        w = self.constant(f"{out}_w", (self.rng.standard_normal((channels, channels_in // group, kernel, kernel))
                                       * 0.4).astype(np.float32))
        inputs = [x, w] + ([self.constant(f"{out}_b", self.rng.standard_normal(channels).astype(np.float32))]
                           if bias else [])
        self.nodes.append(helper.make_node("Conv", inputs, [out], group=group, strides=[stride] * 2,
                                           pads=[kernel // 2] * 4, kernel_shape=[kernel] * 2))
        return out

    def batchnorm(self, x: str, out: str, channels: int) -> str:
        params = [self.rng.uniform(0.5, 1.5, channels), self.rng.uniform(-0.5, 0.5, channels),
                  self.rng.uniform(-0.5, 0.5, channels), self.rng.uniform(0.5, 2.0, channels)]
        names = [self.constant(f"{out}_{k}", p.astype(np.float32)) for k, p in zip("sbmv", params)]
        self.nodes.append(helper.make_node("BatchNormalization", [x, *names], [out], epsilon=1e-3))
        return out

    def node(self, op: str, inputs: list[str], out: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def shuffle(self, x: str, out: str, channels: int, size: int) -> str:
        five = self.constant(f"{out}_5d", np.array([-1, GROUPS, channels // GROUPS, size, size], np.int64))
        four = self.constant(f"{out}_4d", np.array([-1, channels, size, size], np.int64))
        moved = self.node("Transpose", [self.node("Reshape", [x, five], f"{out}_split")], f"{out}_moved",
                          perm=[0, 2, 1, 3, 4])
        return self.node("Reshape", [moved, four], out)


def shufflenet_like(path, extra_output: bool = False) -> str:
    """A stem (conv + bias -> BatchNorm -> Relu), a stride-1 unit (grouped 1x1 -> BatchNorm -> Relu -> channel
    shuffle -> depthwise 3x3 -> BatchNorm -> grouped 1x1 -> BatchNorm -> Sum with the unit's input -> Relu) and a
    downsampling unit (the same at stride 2, concatenated with an average pool of its input, then Relu)."""
    b, c = _Builder(seed=3), CHANNELS
    x = b.node("Relu", [b.batchnorm(b.conv("x", "stem", 3, c, kernel=3, bias=True), "stem_bn", c)], "stem_relu")
    units = []
    for k, stride in enumerate((1, 2)):
        expanded = b.node("Relu", [b.batchnorm(b.conv(x, f"u{k}_in", c, c, group=GROUPS), f"u{k}_in_bn", c)],
                          f"u{k}_in_relu")
        shuffled = b.shuffle(expanded, f"u{k}_shuffled", c, 10)
        depthwise = b.batchnorm(b.conv(shuffled, f"u{k}_dw", c, c, kernel=3, group=c, stride=stride),
                                f"u{k}_dw_bn", c)
        projected = b.batchnorm(b.conv(depthwise, f"u{k}_out", c, c, group=GROUPS), f"u{k}_out_bn", c)
        if stride == 1:
            x = b.node("Relu", [b.node("Sum", [projected, x], f"u{k}_sum")], f"u{k}_relu")
        else:
            pooled = b.node("AveragePool", [x], f"u{k}_pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
            x = b.node("Relu", [b.node("Concat", [projected, pooled], f"u{k}_cat", axis=1)], f"u{k}_relu")
        units.append(projected)
    outputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)]
    if extra_output:  # the first unit's projection is read by the Sum and by the caller
        outputs.append(helper.make_tensor_value_info(units[0], TensorProto.FLOAT, None))
    graph = helper.make_graph(b.nodes, "shufflenet_like",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 10, 10])],
                              outputs, b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path.write_bytes(model.SerializeToString())
    return str(path)


def _calls(directory) -> dict[str, int]:
    source = (directory / "model.c").read_text()
    return {call[:-1]: source.count(call) for call in ELEMENTWISE}


def _check(directory, path, batch: int, seed: int = 0) -> None:
    feed = {"x": np.random.default_rng(seed).standard_normal((batch, 3, 10, 10)).astype(np.float32)}
    for got, want in zip(carrack.CompiledModel(directory).run(None, feed), session_outputs(path, feed)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", [0, 1])  # without the optimizer's fusions: the normalizations stay in the plan
def test_normalization_residual_and_relu_are_the_convolutions_store(tmp_path, level):
    path = shufflenet_like(tmp_path / "net.onnx")
    compile_model(path, tmp_path / "out", "native", dims={"batch": 1}, level=level)
    # every BatchNormalization, the Sum and every Relu but the one after the Concat (an average pool's half) go
    assert _calls(tmp_path / "out") == {"cr_affine": 0, "cr_binary": 0, "cr_unary": 1}
    source = (tmp_path / "out" / "model.c").read_text()
    assert "cr_concat_part(" not in source  # the downsampling unit's convolution writes its half in place
    assert len(re.findall(r"packconv_f32_threads\([^;]*CR_ACT_RELU", source)) == 4  # stem, two units' inputs, Sum
    _check(tmp_path / "out", path, batch=1)


def test_run_time_dims_and_a_value_read_twice(tmp_path):
    """A run-time batch; the first unit's projection is also a model output: its normalization keeps a step of its
    own, the rest of the chain still fuses."""
    path = shufflenet_like(tmp_path / "net.onnx", extra_output=True)
    compile_model(path, tmp_path / "out", "native", max_dims={"batch": 3}, level=1)
    calls = _calls(tmp_path / "out")
    assert calls["cr_affine"] == 0 and calls["cr_binary"] == 1 and calls["cr_unary"] == 2
    for batch in (1, 3):
        _check(tmp_path / "out", path, batch, seed=batch)
