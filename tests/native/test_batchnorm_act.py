"""Inference BatchNormalization (+ activation) by the native one-pass kernel and numpy, and the graph rules around
it: a per-channel Mul/Add after a BatchNormalization or Conv folded into it (Caffe's Scale layer, as in DenseNet),
and BatchNormalization -> Relu fused into carrack's FusedBatchNormalization, which exports as the two nodes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from carrack.runtime.options import SessionOptions
from carrack.runtime.session import InferenceSession
from tests.helpers import ort_run

C = 6


def _t(name: str, a: np.ndarray) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.FLOAT, a.shape, a.ravel())


def _bn_params(rng: np.random.Generator, prefix: str) -> list[onnx.TensorProto]:
    return [_t(f"{prefix}_scale", rng.standard_normal(C).astype(np.float32)),
            _t(f"{prefix}_bias", rng.standard_normal(C).astype(np.float32)),
            _t(f"{prefix}_mean", rng.standard_normal(C).astype(np.float32)),
            _t(f"{prefix}_var", rng.random(C).astype(np.float32) + 0.5)]


def _bn(x: str, y: str, prefix: str) -> onnx.NodeProto:
    return helper.make_node("BatchNormalization", [x] + [f"{prefix}_{k}" for k in ("scale", "bias", "mean", "var")],
                            [y], epsilon=1e-3)


def _densenet_model(k_shape: tuple[int, ...], first: str = "Transpose") -> onnx.ModelProto:
    """x -> first -> [Concat with a Conv] -> BN -> Mul(k) -> Add(k2) -> Relu -> Conv -> BN -> Mul -> Add -> Relu."""
    rng = np.random.default_rng(len(k_shape))
    half = C // 2
    inits = [_t("w0", rng.standard_normal((half, half, 1, 1)).astype(np.float32)),
             _t("w1", rng.standard_normal((C, C, 3, 3)).astype(np.float32)),
             _t("k", rng.standard_normal(k_shape).astype(np.float32)),
             _t("k2", rng.standard_normal(k_shape).astype(np.float32)), *_bn_params(rng, "a"), *_bn_params(rng, "b")]
    nodes = [helper.make_node(first, ["x"], ["t"], **({"perm": [0, 1, 3, 2]} if first == "Transpose" else {})),
             helper.make_node("Conv", ["t", "w0"], ["c0"]),
             helper.make_node("Concat", ["t", "c0"], ["cat"], axis=1),
             _bn("cat", "a0", "a"), helper.make_node("Mul", ["a0", "k"], ["a1"]),
             helper.make_node("Add", ["a1", "k2"], ["a2"]), helper.make_node("Relu", ["a2"], ["a3"]),
             helper.make_node("Conv", ["a3", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             _bn("c1", "b0", "b"), helper.make_node("Mul", ["k", "b0"], ["b1"]),
             helper.make_node("Add", ["b1", "k2"], ["b2"]), helper.make_node("Relu", ["b2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, half, 9, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _run(monkeypatch, native: str, model: onnx.ModelProto, x: np.ndarray, **options) -> tuple[np.ndarray, dict]:
    monkeypatch.setenv("CARRACK_NATIVE", native)
    opts = SessionOptions()
    for k, v in options.items():
        setattr(opts, k, v)
    session = InferenceSession(model.SerializeToString(), opts)
    ops = [n.op_type for n in session._model.graph.nodes]
    return session.run(None, {"x": x})[0], {"stats": session.optimizer_stats, "ops": ops}


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("first", ["Transpose", "Identity"])
def test_scale_layers_fold_and_bn_relu_fuses(monkeypatch, native, first):
    model = _densenet_model((C, 1, 1), first)
    x = np.random.default_rng(1).standard_normal((2, C // 2, 9, 7)).astype(np.float32)
    ref = ort_run(model, {"x": x})[0]
    y, info = _run(monkeypatch, native, model, x)
    assert info["stats"]["affine_folding"] == 4
    assert "Mul" not in info["ops"] and "Add" not in info["ops"] and "Relu" not in info["ops"]
    assert "FusedBatchNormalization" in info["ops"]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k_shape", [(1, C, 1, 1), (1,), (9,), (7, 1)])
def test_other_constants(monkeypatch, k_shape):
    """Per-channel and scalar constants fold; ones along another axis (or of a higher rank) do not."""
    model = _densenet_model(k_shape)
    x = np.random.default_rng(2).standard_normal((2, C // 2, 9, 7)).astype(np.float32)
    ref = ort_run(model, {"x": x})[0]
    for native in ("0", "1"):
        y, info = _run(monkeypatch, native, model, x)
        assert ("Mul" in info["ops"]) == (k_shape[0] != 1)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


def test_optimized_model_exports(monkeypatch, tmp_path):
    model = _densenet_model((C, 1, 1))
    x = np.random.default_rng(3).standard_normal((2, C // 2, 9, 7)).astype(np.float32)
    path = tmp_path / "opt.onnx"
    y, info = _run(monkeypatch, "1", model, x, optimized_model_filepath=str(path))
    exported = onnx.load(str(path))
    assert "FusedBatchNormalization" not in {n.op_type for n in exported.graph.node}
    np.testing.assert_allclose(ort_run(exported, {"x": x})[0], y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("shape", [(2, C, 5, 33), (1, C, 0, 4), (3, C), (1, C, 2, 3, 17)])
def test_standalone_batchnorm(monkeypatch, native, shape):
    """A BatchNormalization alone (no fusion) of several ranks, zero-size included; the input stays unchanged."""
    rng = np.random.default_rng(4)
    graph = helper.make_graph([_bn("x", "y", "a")], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], _bn_params(rng, "a"))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)
    x = rng.standard_normal(shape).astype(np.float32)
    keep = x.copy()
    y, _ = _run(monkeypatch, native, model, x)
    np.testing.assert_allclose(y, ort_run(model, {"x": x})[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(x, keep)
