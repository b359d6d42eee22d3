"""Loading models: sources, initializers, external data safety, malformed files, opsets, functions."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.errors import InvalidModel, NotImplementedOps, UnsupportedModel
from tests.helpers import tensor_info


def _add_const_model(const: TensorProto, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Add", ["x", const.name], ["y"])], "g",
                              [tensor_info("x", shape=list(const.dims))], [tensor_info("y", shape=list(const.dims))],
                              initializer=[const])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _external_model(tmp_path, values: np.ndarray, location: str, offset: int = 0) -> str:
    const = numpy_helper.from_array(values, "w")
    const.ClearField("raw_data")
    const.ClearField("float_data")
    const.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(values.nbytes))):
        entry = const.external_data.add()
        entry.key, entry.value = k, v
    model = _add_const_model(const)
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return str(path)


def test_sources_path_bytes_and_proto_agree(tmp_path):
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    model = _add_const_model(w)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    x = np.ones((2, 3), np.float32)
    expected = x + np.arange(6, dtype=np.float32).reshape(2, 3)
    for source in (str(path), path, model.SerializeToString(), model):
        (y,) = carrack.InferenceSession(source).run(None, {"x": x})
        np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("offset", [0, 1, 3, 7])
def test_external_data_at_odd_offsets(tmp_path, offset):
    values = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    (tmp_path / "weights.bin").write_bytes(b"\xab" * offset + values.tobytes() + b"\xcd" * 5)
    path = _external_model(tmp_path, values, "weights.bin", offset)
    (y,) = carrack.InferenceSession(path).run(None, {"x": np.zeros((3, 4), np.float32)})
    np.testing.assert_array_equal(y, values)


@pytest.mark.parametrize("location, message", [
    ("/etc/passwd", "relative path"),
    ("../outside.bin", "leaves the model's folder"),
    ("sub/../../outside.bin", "leaves the model's folder"),
    ("missing.bin", "not found"),
])
def test_external_data_locations_refused(tmp_path, location, message):
    values = np.zeros(4, np.float32)
    (tmp_path.parent / "outside.bin").write_bytes(values.tobytes())
    path = _external_model(tmp_path, values, location)
    with pytest.raises(InvalidModel, match=message):
        carrack.InferenceSession(path)


def test_external_data_symlink_out_of_the_folder_refused(tmp_path):
    values = np.zeros(4, np.float32)
    (tmp_path / "real.bin").write_bytes(values.tobytes())
    (tmp_path / "model").mkdir()
    os.symlink(tmp_path / "real.bin", tmp_path / "model" / "link.bin")
    with pytest.raises(InvalidModel, match="symbolic link"):
        carrack.InferenceSession(_external_model(tmp_path / "model", values, "link.bin"))


def test_external_data_out_of_file_bounds(tmp_path):
    values = np.zeros(16, np.float32)
    (tmp_path / "w.bin").write_bytes(values.tobytes()[:10])
    with pytest.raises(InvalidModel, match="outside file"):
        carrack.InferenceSession(_external_model(tmp_path, values, "w.bin"))


def test_external_data_needs_a_path():
    const = numpy_helper.from_array(np.zeros(2, np.float32), "w")
    const.ClearField("raw_data")
    const.data_location = TensorProto.EXTERNAL
    entry = const.external_data.add()
    entry.key, entry.value = "location", "w.bin"
    with pytest.raises(InvalidModel, match="not loaded from a path"):
        carrack.InferenceSession(_add_const_model(const).SerializeToString())


def test_raw_data_with_wrong_length_is_refused():
    const = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    const.raw_data = const.raw_data[:-1]
    with pytest.raises(InvalidModel, match="holds 15 bytes, expected 16"):
        carrack.InferenceSession(_add_const_model(const).SerializeToString())


def test_typed_field_initializers():
    const = helper.make_tensor("w", TensorProto.FLOAT, [3], [1.5, 2.5, -3.0])
    (y,) = carrack.InferenceSession(_add_const_model(const)).run(None, {"x": np.zeros(3, np.float32)})
    np.testing.assert_array_equal(y, np.array([1.5, 2.5, -3.0], np.float32))


def test_initializers_are_64_byte_aligned():
    from carrack.onnx.importer import load_model

    const = numpy_helper.from_array(np.arange(33, dtype=np.float64), "w")
    model = load_model(_add_const_model(const))
    assert model.graph.initializers["w"].ctypes.data % 64 == 0


@pytest.mark.parametrize("data", [b"", b"\x00\x01garbage", b"\xff" * 64])
def test_malformed_bytes(data):
    with pytest.raises(InvalidModel):
        carrack.InferenceSession(data)


def test_truncated_file(tmp_path):
    const = numpy_helper.from_array(np.arange(1000, dtype=np.float32), "w")
    blob = _add_const_model(const).SerializeToString()
    for cut in (len(blob) // 3, len(blob) // 2, len(blob) - 7):
        path = tmp_path / f"cut{cut}.onnx"
        path.write_bytes(blob[:cut])
        with pytest.raises(InvalidModel):
            carrack.InferenceSession(str(path))


def test_missing_file():
    with pytest.raises(InvalidModel, match="does not exist"):
        carrack.InferenceSession("/nonexistent/model.onnx")


def test_opset_newer_than_supported():
    newest = onnx.defs.onnx_opset_version()
    model = _add_const_model(numpy_helper.from_array(np.zeros(2, np.float32), "w"), opset=newest)
    model.opset_import[0].version = newest + 5
    with pytest.raises(UnsupportedModel, match="opset"):
        carrack.InferenceSession(model)


def test_unsupported_ops_listed_together():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("FancyOp", ["a"], ["b"], name="first"),
             helper.make_node("OtherOp", ["b"], ["y"], domain="com.example", name="second")]
    graph = helper.make_graph(nodes, "g", [tensor_info("x", shape=[2])], [tensor_info("y", shape=[2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(NotImplementedOps) as info:
        carrack.InferenceSession(model)
    message = str(info.value)
    assert "FancyOp" in message and "first" in message and "OtherOp" in message and "com.example" in message
    assert len(info.value.missing) == 2


def test_undefined_input_name_is_a_clear_error():
    graph = helper.make_graph([helper.make_node("Relu", ["nowhere"], ["y"])], "g",
                              [tensor_info("x", shape=[2])], [tensor_info("y", shape=[2])])
    with pytest.raises(InvalidModel, match="nowhere"):
        carrack.InferenceSession(helper.make_model(graph))


def test_model_local_function_is_expanded():
    fn = helper.make_function("custom", "AddRelu", ["a", "b"], ["c"],
                              [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["c"])],
                              opset_imports=[helper.make_opsetid("", 17)])
    graph = helper.make_graph([helper.make_node("AddRelu", ["x", "x"], ["y"], domain="custom")], "g",
                              [tensor_info("x", shape=[3])], [tensor_info("y", shape=[3])])
    model = helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", 17),
                                                                     helper.make_opsetid("custom", 1)])
    (y,) = carrack.InferenceSession(model).run(None, {"x": np.array([-1, 0, 2], np.float32)})
    np.testing.assert_array_equal(y, [0, 0, 4])


def test_function_attribute_reference():
    leaky = helper.make_node("LeakyRelu", ["a"], ["c"])
    leaky.attribute.append(helper.make_attribute_ref("alpha", onnx.AttributeProto.FLOAT))
    fn = helper.make_function("custom", "Scaled", ["a"], ["c"], [leaky],
                              opset_imports=[helper.make_opsetid("", 17)], attributes=["alpha"])
    graph = helper.make_graph([helper.make_node("Scaled", ["x"], ["y"], domain="custom", alpha=0.5)], "g",
                              [tensor_info("x", shape=[2])], [tensor_info("y", shape=[2])])
    model = helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", 17),
                                                                     helper.make_opsetid("custom", 1)])
    (y,) = carrack.InferenceSession(model).run(None, {"x": np.array([-2, 2], np.float32)})
    np.testing.assert_array_equal(y, [-1, 2])


def test_function_bodied_op_without_kernel_is_expanded(monkeypatch):
    """An operator whose ONNX schema defines a function body runs through that body when carrack has no kernel."""
    from carrack.ops import registry

    monkeypatch.delitem(registry._REGISTRY, ("", "MeanVarianceNormalization"))
    graph = helper.make_graph([helper.make_node("MeanVarianceNormalization", ["x"], ["y"])], "g",
                              [tensor_info("x", shape=[2, 3, 4, 4])], [tensor_info("y", shape=[2, 3, 4, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    opts = carrack.SessionOptions()
    opts.graph_optimization_level = carrack.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = carrack.InferenceSession(model, opts)
    assert "MeanVarianceNormalization" not in {s.node.op_type for s in sess._program.steps}
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    std = np.sqrt(((x - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True))
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], (x - mean) / (std + 1e-9), rtol=1e-4, atol=1e-5)


def test_a_gguf_file_is_pointed_to_carrack_llm(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for source in (str(path), path.read_bytes()):
        with pytest.raises(UnsupportedModel, match=r"GGUF file.*carrack\.llm\.Llama"):
            carrack.InferenceSession(source)
