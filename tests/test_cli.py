"""The command line."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from carrack.cli import main


def test_demo_prints_predictions_and_latency(capsys):
    assert main(["demo", "--model", "resnet50", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "top-5 predictions" in out and "latency over 1 runs" in out
    diff = float(out.split("max abs diff ")[1].split()[0])
    assert diff < 1e-3


def test_info_and_run(tmp_path, capsys):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "x: tensor(float) ['n', 3]" in out and "Relu" in out
    assert main(["info", str(path), "--memory", "--dim", "n=1000"]) == 0
    assert "expected peak" in capsys.readouterr().out
    np.save(tmp_path / "x.npy", np.array([[-1, 2, -3]], np.float32))
    assert main(["run", str(path), "--input", f"x={tmp_path / 'x.npy'}", "--save", str(tmp_path / "out.npz")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "out.npz")["y"], [[0, 2, 0]])


def test_bad_model_is_a_clean_error(tmp_path, capsys):
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"not a model at all")
    assert main(["info", str(path)]) == 1
    assert "not a valid ONNX model" in capsys.readouterr().err
