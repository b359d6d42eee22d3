"""TensorProto -> numpy, including raw_data at any byte offset and external data read safely."""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from carrack.errors import InvalidModel
from carrack.ir.dtypes import to_numpy

_ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_copy(a: np.ndarray) -> np.ndarray:
    if a.dtype == object:
        return np.array(a, dtype=object, copy=True)
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def external_path(base_dir: str | None, location: str, tensor_name: str) -> str:
    """Resolve an external-data location, refusing anything that leaves the model's folder."""
    where = f"external data of tensor '{tensor_name}'"
    if base_dir is None:
        raise InvalidModel(f"{where} is in file '{location}', but the model was not loaded from a path; "
                           "load it by path so the file can be found")
    if not location or os.path.isabs(location) or location.startswith(("/", "\\")) or ":" in location[:3]:
        raise InvalidModel(f"{where}: location '{location}' must be a relative path inside the model's folder")
    parts = location.replace("\\", "/").split("/")
    if ".." in parts:
        raise InvalidModel(f"{where}: location '{location}' leaves the model's folder ('..' is not allowed)")
    base = os.path.realpath(base_dir)
    path = os.path.join(base, *parts)
    probe = base
    for part in parts:
        probe = os.path.join(probe, part)
        if os.path.islink(probe):
            raise InvalidModel(f"{where}: location '{location}' is a symbolic link, which is not allowed")
    if not os.path.isfile(path):
        raise InvalidModel(f"{where}: file '{location}' not found next to the model")
    return path


def _external_bytes(t: TensorProto, base_dir: str | None) -> bytes | np.ndarray:
    info = {e.key: e.value for e in t.external_data}
    path = external_path(base_dir, info.get("location", ""), t.name)
    try:
        offset = int(info.get("offset", 0) or 0)
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise InvalidModel(f"external data of tensor '{t.name}': offset/length are not integers") from None
    size = os.path.getsize(path)
    if length is None:
        length = size - offset
    if offset < 0 or length < 0 or offset + length > size:
        raise InvalidModel(f"external data of tensor '{t.name}': bytes [{offset}, {offset + length}) "
                           f"lie outside file '{info.get('location')}' of {size} bytes")
    if length == 0:
        return b""
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(length,))


def _expected_count(t: TensorProto) -> int:
    n = 1
    for d in t.dims:
        if d < 0:
            raise InvalidModel(f"tensor '{t.name}' has a negative dim {d}")
        n *= d
    return n


def tensor_to_array(t: TensorProto, base_dir: str | None = None) -> np.ndarray:
    """Decode a TensorProto into a numpy array with a 64-byte-aligned, writeable-safe copy of its data."""
    if t.data_type == TensorProto.UNDEFINED:
        raise InvalidModel(f"tensor '{t.name}' has no data type")
    try:
        dtype = to_numpy(t.data_type)
    except ValueError as e:
        raise InvalidModel(f"tensor '{t.name}': {e}") from None
    count = _expected_count(t)
    shape = tuple(t.dims)
    if t.data_location == TensorProto.EXTERNAL:
        raw = _external_bytes(t, base_dir)
        return _from_raw(t, bytes(raw) if dtype.itemsize == 0 or _packed(dtype) else raw, dtype, shape, count)
    if t.HasField("raw_data") and dtype.kind != "O":
        return _from_raw(t, t.raw_data, dtype, shape, count)
    try:
        arr = numpy_helper.to_array(t)
    except Exception as e:  # noqa: BLE001 - onnx raises assorted types on bad tensors
        raise InvalidModel(f"tensor '{t.name}' cannot be decoded: {e}") from None
    if arr.size != count:
        raise InvalidModel(f"tensor '{t.name}' has {arr.size} values for dims {list(shape)}")
    return aligned_copy(arr) if arr.dtype != object else arr


def _packed(dtype: np.dtype) -> bool:
    return dtype.name in ("int4", "uint4", "float4_e2m1fn", "int2", "uint2")


def _from_raw(t: TensorProto, raw, dtype: np.dtype, shape: tuple[int, ...], count: int) -> np.ndarray:
    if _packed(dtype):
        per_byte = 4 if dtype.name in ("int2", "uint2") else 2
        need = (count + per_byte - 1) // per_byte
        if len(raw) != need:
            raise InvalidModel(f"tensor '{t.name}' holds {len(raw)} bytes, expected {need} for dims {list(shape)}")
        proto = TensorProto()
        proto.CopyFrom(t)
        proto.ClearField("external_data")
        proto.data_location = TensorProto.DEFAULT
        proto.raw_data = bytes(raw)
        return aligned_copy(numpy_helper.to_array(proto))
    need = count * dtype.itemsize
    if len(raw) != need:
        raise InvalidModel(f"tensor '{t.name}' holds {len(raw)} bytes, expected {need} "
                           f"({count} x {dtype.name}) for dims {list(shape)}")
    # frombuffer works at any byte offset; the copy gives an aligned, little-endian, owned array
    src = np.frombuffer(raw, dtype=dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype, count=count)
    out = aligned_empty(shape, dtype)
    out.reshape(-1)[...] = src
    return out


def array_to_tensor(a: np.ndarray, name: str = "") -> TensorProto:
    return numpy_helper.from_array(np.asarray(a), name)


__all__ = ["aligned_copy", "aligned_empty", "array_to_tensor", "external_path", "tensor_to_array", "onnx"]
