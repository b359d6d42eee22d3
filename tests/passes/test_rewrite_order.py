"""Rewrites that merge nodes around a value produced between them (reshape_cancellation merging two Reshapes with
the second one's shape Constant in between, as a Swin TorchScript export has it) must keep that value alive."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack

LEVELS = [carrack.GraphOptimizationLevel.ORT_ENABLE_BASIC, carrack.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
          carrack.GraphOptimizationLevel.ORT_ENABLE_ALL]


def _options(level) -> carrack.SessionOptions:
    options = carrack.SessionOptions()
    options.graph_optimization_level = level
    return options


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
def test_merged_reshapes_keep_the_constant_between_them(level):
    nodes = [helper.make_node("Reshape", ["x", "first"], ["a"]),
             helper.make_node("Constant", [], ["second"], value=numpy_helper.from_array(np.array([4, 6]))),
             helper.make_node("Reshape", ["a", "second"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])],
                              initializer=[numpy_helper.from_array(np.array([6, 4]), "first")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    y = carrack.InferenceSession(model.SerializeToString(), _options(level)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y, x.reshape(4, 6))


@pytest.fixture(scope="module")
def swin(tmp_path_factory) -> str:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                     window_size=2)  # the second block of each stage shifts its windows
    model = transformers.SwinModel(config).eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values):
            return self.model(pixel_values=pixel_values).last_hidden_state

    path = str(tmp_path_factory.mktemp("swin") / "swin.onnx")
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Hidden(), (torch.randn(1, 3, 32, 32),), path, input_names=["pixel_values"],
                          output_names=["y"], dynamic_axes={"pixel_values": {0: "batch"}}, opset_version=17,
                          dynamo=False)
    return path


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
def test_swin_torchscript_export_matches_onnxruntime(swin, level):
    ort = pytest.importorskip("onnxruntime")
    session = carrack.InferenceSession(swin, _options(level))
    reference = ort.InferenceSession(swin, providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32)).astype(np.float32)
        np.testing.assert_allclose(session.run(None, {"pixel_values": x})[0],
                                   reference.run(None, {"pixel_values": x})[0], rtol=1e-4, atol=1e-4)
