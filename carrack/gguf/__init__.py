"""GGUF model files: a validating, memory-mapped reader (reader.py) and the ggml type tables (types.py)."""

from __future__ import annotations

from carrack.gguf.reader import GGUFError, GGUFField, GGUFFile, GGUFTensor, read_gguf
from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType, GGUFValueType

__all__ = [
    "GGML_BLOCK_SIZES",
    "GGMLType",
    "GGUFError",
    "GGUFField",
    "GGUFFile",
    "GGUFTensor",
    "GGUFValueType",
    "read_gguf",
]
