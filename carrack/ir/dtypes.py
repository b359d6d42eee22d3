"""Element types: ONNX TensorProto codes <-> numpy dtypes <-> onnxruntime type strings."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto

_T = TensorProto

#: ONNX element type code -> numpy dtype (ml_dtypes provides the narrow float and 4-bit types).
ONNX_TO_NUMPY: dict[int, np.dtype] = {
    _T.FLOAT: np.dtype(np.float32),
    _T.UINT8: np.dtype(np.uint8),
    _T.INT8: np.dtype(np.int8),
    _T.UINT16: np.dtype(np.uint16),
    _T.INT16: np.dtype(np.int16),
    _T.INT32: np.dtype(np.int32),
    _T.INT64: np.dtype(np.int64),
    _T.STRING: np.dtype(object),
    _T.BOOL: np.dtype(np.bool_),
    _T.FLOAT16: np.dtype(np.float16),
    _T.DOUBLE: np.dtype(np.float64),
    _T.UINT32: np.dtype(np.uint32),
    _T.UINT64: np.dtype(np.uint64),
    _T.COMPLEX64: np.dtype(np.complex64),
    _T.COMPLEX128: np.dtype(np.complex128),
    _T.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    _T.FLOAT8E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    _T.FLOAT8E4M3FNUZ: np.dtype(ml_dtypes.float8_e4m3fnuz),
    _T.FLOAT8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    _T.FLOAT8E5M2FNUZ: np.dtype(ml_dtypes.float8_e5m2fnuz),
    _T.UINT4: np.dtype(ml_dtypes.uint4),
    _T.INT4: np.dtype(ml_dtypes.int4),
}
for _name, _ml in (("FLOAT4E2M1", "float4_e2m1fn"), ("FLOAT8E8M0", "float8_e8m0fnu"),
                   ("UINT2", "uint2"), ("INT2", "int2"), ("FLOAT6E2M3", "float6_e2m3fn"),
                   ("FLOAT6E3M2", "float6_e3m2fn")):
    if hasattr(_T, _name) and hasattr(ml_dtypes, _ml):
        ONNX_TO_NUMPY[getattr(_T, _name)] = np.dtype(getattr(ml_dtypes, _ml))

NUMPY_TO_ONNX: dict[np.dtype, int] = {v: k for k, v in ONNX_TO_NUMPY.items()}
NUMPY_TO_ONNX[np.dtype(np.str_)] = _T.STRING

#: onnxruntime's NodeArg.type names, e.g. 'tensor(float)'.
_TYPE_NAMES = {
    _T.FLOAT: "float", _T.UINT8: "uint8", _T.INT8: "int8", _T.UINT16: "uint16", _T.INT16: "int16",
    _T.INT32: "int32", _T.INT64: "int64", _T.STRING: "string", _T.BOOL: "bool", _T.FLOAT16: "float16",
    _T.DOUBLE: "double", _T.UINT32: "uint32", _T.UINT64: "uint64", _T.COMPLEX64: "complex64",
    _T.COMPLEX128: "complex128", _T.BFLOAT16: "bfloat16", _T.FLOAT8E4M3FN: "float8e4m3fn",
    _T.FLOAT8E4M3FNUZ: "float8e4m3fnuz", _T.FLOAT8E5M2: "float8e5m2", _T.FLOAT8E5M2FNUZ: "float8e5m2fnuz",
    _T.UINT4: "uint4", _T.INT4: "int4",
}

FLOAT_TYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))


def to_numpy(elem_type: int) -> np.dtype:
    """numpy dtype for an ONNX element type code; ValueError names unknown codes."""
    try:
        return ONNX_TO_NUMPY[elem_type]
    except KeyError:
        raise ValueError(f"unsupported ONNX element type {elem_type}") from None


def to_onnx(dtype: np.dtype | type) -> int:
    """ONNX element type code for a numpy dtype."""
    dt = np.dtype(dtype)
    if dt.kind == "U":
        return _T.STRING
    try:
        return NUMPY_TO_ONNX[dt.newbyteorder("=") if dt.byteorder not in "=|" else dt]
    except KeyError:
        raise ValueError(f"numpy dtype {dt} has no ONNX element type") from None


def type_name(elem_type: int) -> str:
    """'float' for TensorProto.FLOAT, and so on."""
    return _TYPE_NAMES.get(elem_type) or TensorProto.DataType.Name(elem_type).lower()
