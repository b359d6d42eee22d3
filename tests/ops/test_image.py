"""ImageDecoder: PNG round trip in each pixel format, undecodable bytes, and the error without Pillow."""

from __future__ import annotations

import builtins
import io

import numpy as np
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.errors import CarrackError


def _session(pixel_format: str) -> carrack.InferenceSession:
    node = helper.make_node("ImageDecoder", ["x"], ["y"], pixel_format=pixel_format)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    return carrack.InferenceSession(model.SerializeToString())


def _png(pixels: np.ndarray) -> np.ndarray:
    image = pytest.importorskip("PIL.Image")
    buf = io.BytesIO()
    image.fromarray(pixels).save(buf, format="PNG")
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


PIXELS = np.random.default_rng(0).integers(0, 256, (5, 7, 3)).astype(np.uint8)


@pytest.mark.parametrize("fmt", ["RGB", "BGR", "Grayscale"])
def test_png_decodes(fmt):
    got = _session(fmt).run(None, {"x": _png(PIXELS)})[0]
    assert got.dtype == np.uint8
    if fmt == "RGB":
        np.testing.assert_array_equal(got, PIXELS)
    elif fmt == "BGR":
        np.testing.assert_array_equal(got, PIXELS[:, :, ::-1])
    else:
        assert got.shape == (5, 7, 1)


def test_garbage_gives_empty_image():
    pytest.importorskip("PIL")
    got = _session("RGB").run(None, {"x": np.arange(40, dtype=np.uint8)})[0]
    assert got.shape == (0, 0, 3)


def test_without_pillow_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_pil(name, *args, **kwargs):
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError("no PIL")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pil)
    with pytest.raises(CarrackError, match="pip install pillow"):
        _session("RGB").run(None, {"x": np.arange(10, dtype=np.uint8)})
