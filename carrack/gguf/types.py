"""ggml tensor type ids, their block sizes and byte sizes, and GGUF metadata value type ids.

A ggml tensor row is stored as blocks: `block_size` elements packed into `type_size` bytes. Plain types have a block
of one element. The ids and sizes follow ggml.h (checked against gguf-py in the tests, never imported from it).
"""

from __future__ import annotations

from enum import IntEnum

import ml_dtypes
import numpy as np


class GGMLType(IntEnum):
    """ggml tensor type id, as stored in a GGUF tensor record."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41

    @property
    def block_size(self) -> int:
        """Elements per block."""
        return GGML_BLOCK_SIZES[self][0]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return GGML_BLOCK_SIZES[self][1]

    @property
    def is_quantized(self) -> bool:
        """True for block-quantized types (no direct numpy dtype)."""
        return self not in GGML_NUMPY_DTYPES

    @property
    def numpy_dtype(self) -> np.dtype | None:
        """The numpy dtype (native byte order) of a plain type, None for quantized ones."""
        return GGML_NUMPY_DTYPES.get(self)

    def nbytes(self, n_elements: int) -> int:
        """Bytes taken by `n_elements` values; `n_elements` must be a multiple of the block size."""
        block, size = GGML_BLOCK_SIZES[self]
        if n_elements % block:
            raise ValueError(f"{self.name} needs a multiple of {block} elements, got {n_elements}")
        return n_elements // block * size


# (elements per block, bytes per block)
GGML_BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q8_1: (32, 4 + 4 + 32),
    GGMLType.Q2_K: (256, 2 + 2 + 256 // 16 + 256 // 4),
    GGMLType.Q3_K: (256, 2 + 256 // 4 + 256 // 8 + 12),
    GGMLType.Q4_K: (256, 2 + 2 + 256 // 2 + 12),
    GGMLType.Q5_K: (256, 2 + 2 + 256 // 2 + 256 // 8 + 12),
    GGMLType.Q6_K: (256, 2 + 256 // 16 + 3 * 256 // 4),
    GGMLType.Q8_K: (256, 4 + 256 + 256 // 8),
    GGMLType.IQ2_XXS: (256, 2 + 256 // 4),
    GGMLType.IQ2_XS: (256, 2 + 256 // 4 + 256 // 32),
    GGMLType.IQ3_XXS: (256, 2 + 256 // 4 + 256 // 8),
    GGMLType.IQ1_S: (256, 2 + 256 // 8 + 256 // 16),
    GGMLType.IQ4_NL: (32, 2 + 16),
    GGMLType.IQ3_S: (256, 2 + 256 // 4 + 256 // 8 + 256 // 32 + 4),
    GGMLType.IQ2_S: (256, 2 + 256 // 4 + 256 // 16),
    GGMLType.IQ4_XS: (256, 2 + 2 + 256 // 2 + 256 // 64),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 256 // 8 + 256 // 16 + 256 // 32),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (256, 2 + 4 * 13),
    GGMLType.TQ2_0: (256, 2 + 64),
    GGMLType.MXFP4: (32, 1 + 16),
    GGMLType.NVFP4: (64, 4 + 32),
    GGMLType.Q1_0: (128, 2 + 16),
}


# Plain (non-block) types and their numpy dtypes in native byte order.
GGML_NUMPY_DTYPES: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype(np.float32),
    GGMLType.F16: np.dtype(np.float16),
    GGMLType.BF16: np.dtype(ml_dtypes.bfloat16),
    GGMLType.F64: np.dtype(np.float64),
    GGMLType.I8: np.dtype(np.int8),
    GGMLType.I16: np.dtype(np.int16),
    GGMLType.I32: np.dtype(np.int32),
    GGMLType.I64: np.dtype(np.int64),
}


class GGUFValueType(IntEnum):
    """Type id of a GGUF metadata value."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Fixed-size metadata value types: struct format character (no byte-order prefix) and numpy dtype.
GGUF_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}

GGUF_SCALAR_DTYPES: dict[GGUFValueType, np.dtype] = {
    vtype: np.dtype(np.bool_ if fmt == "?" else fmt) for vtype, fmt in GGUF_SCALAR_FORMATS.items()
}

GGUF_INTEGER_TYPES = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)
