"""Checking and normalising caller inputs at the session boundary.

Callers' arrays are never modified. Any layout is accepted (misaligned, read-only, strided, reversed, Fortran order,
broadcast with zero strides, byte-swapped, zero-size); what is not a native-order, C-contiguous, element-aligned
array gets one 64-byte-aligned C-contiguous copy here, so kernels see what they would for np.ascontiguousarray(x).
That matters for results, not only speed: numpy's summation order (reductions) follows the memory layout, so a
Fortran-order input would otherwise give results that differ in the last bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from carrack.errors import InvalidArgument
from carrack.ir.dims import Sym, format_shape, is_placeholder
from carrack.ir.dtypes import to_numpy, type_name
from carrack.ir.graph import ValueInfo
from carrack.ir.types import MapType, OptionalType, SequenceType, TensorType, ValueType
from carrack.onnx.tensors import aligned_copy


def check_feed(info: ValueInfo, value: Any, symbols: dict[Sym, tuple[int, str]]) -> Any:
    return _check(info.name, info.type, value, symbols)


def _check(name: str, t: ValueType | None, value: Any, symbols: dict[Sym, tuple[int, str]]) -> Any:
    if isinstance(t, OptionalType):
        return None if value is None else _check(name, t.elem, value, symbols)
    if isinstance(t, SequenceType):
        if not isinstance(value, (list, tuple)):
            raise InvalidArgument(f"input '{name}' expects a sequence (list of arrays), got {type(value).__name__}")
        return [_check(f"{name}[{i}]", t.elem, v, {}) for i, v in enumerate(value)]
    if isinstance(t, MapType):
        if not isinstance(value, dict):
            raise InvalidArgument(f"input '{name}' expects a map (dict), got {type(value).__name__}")
        return value
    if value is None:
        raise InvalidArgument(f"input '{name}' is None, but it is a tensor input and needs an array")
    if isinstance(t, TensorType) and t.elem_type and isinstance(value, (list, bool, int, float)):
        value = _python_values_as(name, t, value)
    arr = as_native_array(name, value)
    if isinstance(t, TensorType):
        _check_dtype(name, t, arr)
        _check_shape(name, t, arr, symbols)
    return arr


def _python_values_as(name: str, t: TensorType, value: Any) -> np.ndarray:
    """A Python list (or scalar) fed to a tensor input becomes an array of the input's type, as onnxruntime does
    for lists (numpy arrays are never cast: their type must match)."""
    dtype = to_numpy(t.elem_type)
    try:
        return np.asarray(value, dtype=object if dtype.kind in "OUS" else dtype)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidArgument(f"input '{name}' expects tensor({type_name(t.elem_type)}); its Python values "
                              f"cannot be converted: {e}") from None


def as_native_array(name: str, value: Any) -> np.ndarray:
    """A native-order, C-contiguous, element-aligned numpy array with the value's contents; strings as object arrays
    of str. The caller's array itself is returned (never written) when it already has that layout."""
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.dtype.kind in "US":
        return arr.astype(object) if arr.dtype.kind == "U" else np.vectorize(bytes.decode, otypes=[object])(arr)
    if arr.dtype.kind == "O":
        return arr if arr.flags.c_contiguous else arr.copy()  # (np.ascontiguousarray would make 0-d arrays 1-d)
    if type(arr) is not np.ndarray:
        arr = arr.view(np.ndarray)  # np.matrix, np.memmap, ...: kernels expect plain arrays
    if arr.dtype.isnative and arr.flags.c_contiguous and arr.flags.aligned:
        return arr
    return aligned_copy(arr)


def _check_dtype(name: str, t: TensorType, arr: np.ndarray) -> None:
    if not t.elem_type:
        return
    expected = to_numpy(t.elem_type)
    if arr.dtype != expected:
        got = _ort_type(arr.dtype)
        raise InvalidArgument(f"input '{name}' has the wrong type: expected tensor({type_name(t.elem_type)}), "
                              f"got {got}")


def _ort_type(dtype: np.dtype) -> str:
    from carrack.ir.dtypes import to_onnx

    try:
        return f"tensor({type_name(to_onnx(dtype))})"
    except ValueError:
        return f"numpy {dtype}"


def _check_shape(name: str, t: TensorType, arr: np.ndarray, symbols: dict[Sym, tuple[int, str]]) -> None:
    if t.shape is None:
        return
    if arr.ndim != len(t.shape):
        raise InvalidArgument(f"input '{name}' has the wrong rank: expected {len(t.shape)} dims "
                              f"{format_shape(t.shape)}, got {arr.ndim} dims {tuple(arr.shape)}")
    for axis, (want, got) in enumerate(zip(t.shape, arr.shape)):
        if isinstance(want, int) and want != got:
            raise InvalidArgument(f"input '{name}' has the wrong size on axis {axis}: expected {want} "
                                  f"(shape {format_shape(t.shape)}), got {got} (shape {tuple(arr.shape)})")
        if isinstance(want, Sym) and not is_placeholder(want):
            seen = symbols.setdefault(want, (got, f"'{name}' axis {axis}"))
            if seen[0] != got:
                raise InvalidArgument(f"input '{name}' axis {axis} is dim '{want}' = {got}, but {seen[1]} "
                                      f"already set '{want}' = {seen[0]}")
