"""External data reached through symbolic links (a Hugging Face cache snapshot is made of them) and special files:
links are followed while their target stays inside the model's folder, a root the user names, or a snapshot's blobs
folder; FIFOs and devices are refused as not regular files, without being opened (opening a FIFO blocks)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.errors import InvalidModel

VALUES = np.arange(6, dtype=np.float32).reshape(2, 3)


def _model_bytes(location: str) -> bytes:
    w = numpy_helper.from_array(VALUES, "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(VALUES.nbytes))):
        entry = w.external_data.add()
        entry.key, entry.value = k, v
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _runs(path, options=None) -> None:
    (y,) = carrack.InferenceSession(str(path), options).run(None, {"x": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(y, VALUES + 1)


def test_a_link_inside_the_model_folder_is_followed(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "weights.bin").write_bytes(VALUES.tobytes())
    os.symlink("data/weights.bin", tmp_path / "w.bin")
    (tmp_path / "model.onnx").write_bytes(_model_bytes("w.bin"))
    _runs(tmp_path / "model.onnx")


def test_a_hugging_face_cache_snapshot_loads(tmp_path):
    """models--org--name/snapshots/<rev>/{model.onnx, model.onnx_data} are relative links into ../../blobs/<hash>,
    the layout huggingface_hub writes."""
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "aaa111").write_bytes(_model_bytes("model.onnx_data"))
    (repo / "blobs" / "bbb222").write_bytes(VALUES.tobytes())
    os.symlink("../../blobs/aaa111", snapshot / "model.onnx")
    os.symlink("../../blobs/bbb222", snapshot / "model.onnx_data")
    _runs(snapshot / "model.onnx")


def test_a_link_out_of_the_folder_is_refused_unless_its_root_is_named(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "weights.bin").write_bytes(VALUES.tobytes())
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    os.symlink(shared / "weights.bin", model_dir / "w.bin")
    (model_dir / "model.onnx").write_bytes(_model_bytes("w.bin"))
    with pytest.raises(InvalidModel, match="'w.bin' is a symbolic link to .*outside the model's folder.*"
                                           "session.external_data_root"):
        carrack.InferenceSession(str(model_dir / "model.onnx"))
    options = carrack.SessionOptions()
    options.add_session_config_entry("session.external_data_root", str(shared))
    _runs(model_dir / "model.onnx", options)
    other = carrack.SessionOptions()
    other.add_session_config_entry("session.external_data_root", str(model_dir))
    with pytest.raises(InvalidModel, match="outside the model's folder"):
        carrack.InferenceSession(str(model_dir / "model.onnx"), other)


def test_external_data_in_a_fifo_is_refused_without_opening_it(tmp_path):
    os.mkfifo(tmp_path / "w.bin")
    (tmp_path / "model.onnx").write_bytes(_model_bytes("w.bin"))
    with pytest.raises(InvalidModel, match="'w.bin' is not a regular file \\(a FIFO\\)"):
        carrack.InferenceSession(str(tmp_path / "model.onnx"))


def test_a_link_to_a_device_is_refused(tmp_path):
    os.symlink("/dev/zero", tmp_path / "w.bin")
    (tmp_path / "model.onnx").write_bytes(_model_bytes("w.bin"))
    options = carrack.SessionOptions()
    options.add_session_config_entry("session.external_data_root", "/dev")
    with pytest.raises(InvalidModel, match="not a regular file \\(a character device\\)"):
        carrack.InferenceSession(str(tmp_path / "model.onnx"), options)


def test_a_model_path_that_is_a_fifo_is_refused_without_opening_it(tmp_path):
    os.mkfifo(tmp_path / "model.onnx")
    with pytest.raises(InvalidModel, match="is not a regular file \\(a FIFO\\)"):
        carrack.InferenceSession(str(tmp_path / "model.onnx"))
