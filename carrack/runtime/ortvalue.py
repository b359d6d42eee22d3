"""OrtValue and OrtDevice: onnxruntime's value handles, over numpy arrays in CPU memory.

An OrtValue made from a numpy array shares its memory, as onnxruntime's CPU OrtValue does: `numpy()` is a view of
the same bytes, and `update_inplace` writes into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from carrack.errors import InvalidArgument, UnsupportedFeature
from carrack.ir.dtypes import to_numpy, to_onnx, type_name


class OrtDevice:
    """Where a value lives; carrack has only the CPU."""

    _CPU = 0

    def __init__(self, device_type: int = 0, memory_type: int = 0, device_id: int = 0, vendor_id: int = 0):
        _require_cpu(device_type)
        self._type, self._memory_type, self._id, self._vendor = device_type, memory_type, device_id, vendor_id

    @staticmethod
    def make(device_type: str | int, device_id: int = 0, vendor_id: int = 0) -> OrtDevice:
        _require_cpu(device_type)
        return OrtDevice(0, 0, device_id, vendor_id)

    @staticmethod
    def cpu() -> int:
        return OrtDevice._CPU

    @staticmethod
    def default_memory() -> int:
        return 0

    def device_id(self) -> int:
        return self._id

    def device_type(self) -> int:
        return self._type

    def device_mem_type(self) -> int:
        return self._memory_type

    def device_vendor_id(self) -> int:
        return self._vendor


def _require_cpu(device: Any) -> None:
    name = device.lower() if isinstance(device, str) else device
    if name not in ("cpu", 0):
        raise UnsupportedFeature(f"device {device!r}: carrack runs on the CPU only (device_type must be 'cpu')")


def element_dtype(element_type: Any) -> np.dtype:
    """A numpy dtype from what onnxruntime accepts as an element type: a numpy type or an ONNX TensorProto code."""
    if isinstance(element_type, (int, np.integer)) and not isinstance(element_type, bool):
        try:
            return np.dtype(to_numpy(int(element_type)))
        except (KeyError, ValueError) as e:
            raise InvalidArgument(f"element type {element_type} is not an ONNX tensor element type") from e
    try:
        return np.dtype(element_type)
    except TypeError as e:
        raise InvalidArgument(f"element type {element_type!r} is not a numpy type or an ONNX element type") from e


class OrtValue:
    """A tensor (or a sequence of tensors, or None for an empty optional) held for onnxruntime-style APIs."""

    def __init__(self, value: Any, device: OrtDevice | None = None):
        if isinstance(value, OrtValue):
            value = value._value
        self._value = value
        self._device = device or OrtDevice()

    # -- constructors ----------------------------------------------------------------------------------------------
    @staticmethod
    def ortvalue_from_numpy(numpy_obj: np.ndarray, device_type: str = "cpu", device_id: int = 0,
                            vendor_id: int = -1) -> OrtValue:
        """Wrap an array without copying it when it is C-contiguous (a contiguous copy otherwise)."""
        _require_cpu(device_type)
        if not isinstance(numpy_obj, np.ndarray):
            raise InvalidArgument(f"ortvalue_from_numpy expects a numpy array, got {type(numpy_obj).__name__}")
        arr = numpy_obj if numpy_obj.flags.c_contiguous else np.ascontiguousarray(numpy_obj)
        if arr.dtype.kind == "U":
            arr = arr.astype(object)
        return OrtValue(arr)

    @staticmethod
    def ortvalue_from_numpy_with_onnx_type(data: np.ndarray, onnx_element_type: int) -> OrtValue:
        """Wrap an array whose bytes hold a type numpy lacks (bfloat16, float8 ...) given as its ONNX code."""
        dtype = element_dtype(onnx_element_type)
        if not isinstance(data, np.ndarray) or data.dtype.itemsize != dtype.itemsize:
            raise InvalidArgument(f"ortvalue_from_numpy_with_onnx_type: expected an array with {dtype.itemsize}-byte "
                                  f"elements for ONNX type {onnx_element_type}, got {getattr(data, 'dtype', None)}")
        return OrtValue(np.ascontiguousarray(data).view(dtype))

    @staticmethod
    def ortvalue_from_shape_and_type(shape: Sequence[int], element_type: Any, device_type: str = "cpu",
                                     device_id: int = 0, vendor_id: int = -1) -> OrtValue:
        """A new zero-filled tensor of that shape and element type (numpy type or ONNX code)."""
        _require_cpu(device_type)
        dims = [int(d) for d in shape]
        if any(d < 0 for d in dims):
            raise InvalidArgument(f"ortvalue_from_shape_and_type: shape {dims} has a negative dim")
        return OrtValue(np.zeros(dims, dtype=element_dtype(element_type)))

    @staticmethod
    def from_dlpack(data: Any, is_bool_tensor: bool = False) -> OrtValue:
        arr = np.from_dlpack(data)
        return OrtValue(arr.view(np.bool_) if is_bool_tensor and arr.dtype == np.uint8 else arr)

    # -- queries ---------------------------------------------------------------------------------------------------
    def numpy(self) -> Any:
        """The tensor as a numpy array sharing this value's memory (a list of arrays for a sequence)."""
        return self._value

    def shape(self) -> list[int]:
        return list(self._tensor("shape").shape)

    def data_type(self) -> str:
        """onnxruntime's type string, e.g. 'tensor(float)' or 'seq(tensor(int64))'."""
        if self.is_tensor_sequence():
            inner = OrtValue(self._value[0]).data_type() if self._value else "tensor(undefined)"
            return f"seq({inner})"
        return f"tensor({_onnx_type_name(self._tensor('data_type').dtype)})"

    def element_type(self) -> int:
        """The ONNX TensorProto element type code (1 for float ...)."""
        return _onnx_code(self._tensor("element_type").dtype)

    def device_name(self) -> str:
        return "cpu"

    def data_ptr(self) -> int:
        return int(self._tensor("data_ptr").ctypes.data)

    def tensor_size_in_bytes(self) -> int:
        return int(self._tensor("tensor_size_in_bytes").nbytes)

    def has_value(self) -> bool:
        return self._value is not None

    def is_tensor(self) -> bool:
        return isinstance(self._value, np.ndarray)

    def is_tensor_sequence(self) -> bool:
        return isinstance(self._value, list)

    def is_sparse_tensor(self) -> bool:
        return False

    def as_sparse_tensor(self) -> Any:
        raise UnsupportedFeature("OrtValue.as_sparse_tensor: carrack has no sparse tensors")

    def update_inplace(self, np_arr: np.ndarray) -> None:
        """Copy `np_arr` into this tensor's memory (same element count and type)."""
        target = self._tensor("update_inplace")
        source = np.asarray(np_arr)
        if source.dtype != target.dtype or source.size != target.size:
            raise InvalidArgument(f"update_inplace: got {source.dtype} x {source.size} elements for a tensor of "
                                  f"{target.dtype} x {target.size}")
        target.reshape(-1)[...] = source.reshape(-1)

    def to_dlpack(self) -> Any:
        return self._tensor("to_dlpack").__dlpack__()

    def _tensor(self, what: str) -> np.ndarray:
        if not isinstance(self._value, np.ndarray):
            kind = "None" if self._value is None else type(self._value).__name__
            raise InvalidArgument(f"OrtValue.{what}() needs a tensor; this value is {kind}")
        return self._value

    def __repr__(self) -> str:
        if self.is_tensor():
            return f"OrtValue({self.data_type()}, shape={self.shape()})"
        return f"OrtValue({type(self._value).__name__})"


def _onnx_code(dtype: np.dtype) -> int:
    if dtype.kind == "O":
        return 8  # STRING
    return int(to_onnx(dtype))


def _onnx_type_name(dtype: np.dtype) -> str:
    return type_name(_onnx_code(dtype))


def as_value(value: Any) -> Any:
    """The plain value behind an OrtValue (anything else as it is)."""
    return value._value if isinstance(value, OrtValue) else value
