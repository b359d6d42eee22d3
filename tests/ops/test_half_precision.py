"""float16 models (torch exports converted by onnxruntime's float16 tool) against onnxruntime, and the mechanism
that makes them fast: Conv, Gemm and MatMul compute through the float32 kernels with each constant weight widened
once, and round their result to float16 once."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

import carrack
from carrack.native import rowops
from carrack.ops import conv as conv_ops

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
float16_tool = pytest.importorskip("onnxruntime.transformers.float16")


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, 2, 1)
        self.depthwise = torch.nn.Conv2d(16, 16, 3, 1, 1, groups=16)
        self.pointwise = torch.nn.Conv2d(16, 32, 1)
        self.pool = torch.nn.MaxPool2d(2)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = self.pointwise(torch.relu(self.depthwise(y)) + y)
        y = torch.nn.functional.avg_pool2d(self.pool(y), 2)
        return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(y, 1), 1))


class TokenMLP(torch.nn.Module):
    """Linear layers over a 3-D input: MatMul + Add in the export, not Gemm."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        folded = self.down.weight @ self.up.weight
        return self.down(torch.relu(self.up(x))) + torch.nn.functional.linear(x[:, :1], folded)


class FlatMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _float16_export(module_cls, shape, tmp_path, keep_io_types: bool) -> tuple[onnx.ModelProto, np.ndarray]:
    torch.manual_seed(0)
    module = module_cls().eval()
    x = torch.randn(*shape)
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y"])
        model = float16_tool.convert_float_to_float16(onnx.load(str(path)), keep_io_types=keep_io_types)
    return model, x.numpy() if keep_io_types else x.numpy().astype(np.float16)


@pytest.mark.parametrize("keep_io_types", [False, True])
@pytest.mark.parametrize("module_cls, shape", [(SmallCNN, (2, 3, 20, 20)), (TokenMLP, (2, 5, 32)),
                                               (FlatMLP, (4, 32))], ids=["cnn", "token_mlp", "flat_mlp"])
def test_float16_export_matches_onnxruntime(module_cls, shape, keep_io_types, tmp_path):
    model, x = _float16_export(module_cls, shape, tmp_path, keep_io_types)
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    session = carrack.InferenceSession(model)
    for _ in range(2):  # the second run uses the widened weights kept by the first
        got = session.run(None, {"x": x})
        assert got[0].dtype == expected[0].dtype and got[0].shape == expected[0].shape
        np.testing.assert_allclose(got[0].astype(np.float32), expected[0].astype(np.float32), rtol=2e-2, atol=2e-3)


def test_float16_convolutions_take_the_native_float32_path(tmp_path, monkeypatch):
    from carrack.native import convolution

    if convolution.load() is None:
        pytest.skip("native convolution kernels unavailable")
    model, x = _float16_export(SmallCNN, (1, 3, 20, 20), tmp_path, keep_io_types=False)
    session = carrack.InferenceSession(model)
    session.run(None, {"x": x})

    numpy_convolution = conv_ops.convolve

    def float32_only(x, *args, **kwargs):
        assert x.dtype != np.float16, "a float16 convolution took the numpy path"
        return numpy_convolution(x, *args, **kwargs)

    monkeypatch.setattr(conv_ops, "convolve", float32_only)
    session.run(None, {"x": x})


def test_float16_weights_are_widened_once(tmp_path, monkeypatch):
    model, x = _float16_export(FlatMLP, (4, 32), tmp_path, keep_io_types=False)
    session = carrack.InferenceSession(model)
    session.run(None, {"x": x})
    widened = []
    real = rowops.half_to_float
    monkeypatch.setattr(rowops, "half_to_float", lambda a, out=None: widened.append(a.shape) or real(a, out))
    session.run(None, {"x": x})
    weight_shapes = {tuple(i.dims) for i in model.graph.initializer if len(i.dims) == 2}
    assert widened and not weight_shapes & set(widened), widened


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("with_c", [False, True])
def test_float16_gemm_node(trans_b, with_c):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 24) if trans_b else (24, 16)).astype(np.float16)
    inits = [numpy_helper.from_array(w, "w")]
    inputs = ["x", "w"]
    if with_c:
        inits.append(numpy_helper.from_array(rng.standard_normal(16).astype(np.float16), "c"))
        inputs.append("c")
    node = helper.make_node("Gemm", inputs, ["y"], transB=trans_b, alpha=0.5, beta=2.0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [5, 24])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    x = rng.standard_normal((5, 24)).astype(np.float16)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = carrack.InferenceSession(model).run(None, {"x": x})
    assert got[0].dtype == np.float16
    np.testing.assert_allclose(got[0].astype(np.float32), expected[0].astype(np.float32), rtol=1e-2, atol=1e-2)
