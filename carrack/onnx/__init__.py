"""ONNX import: protobuf parsing, tensors and external data, function expansion."""

from carrack.onnx.importer import load_model

__all__ = ["load_model"]
