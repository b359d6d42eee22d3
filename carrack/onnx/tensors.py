"""TensorProto -> numpy, including raw_data at any byte offset and external data read safely.

Every constant carrack keeps starts on a 64-byte boundary. Large tensors (>= 64 KiB) are not copied when they need
not be: external data is memory-mapped (one read-only mapping per file) and used in place when its file offset is a
multiple of 64 (mappings start page-aligned), and raw_data is used in place when Python's bytes happen to be aligned.
Anything smaller, misaligned, byte-swapped or packed gets exactly one aligned copy.

raw_data embedded in a model file that was split by carrack.onnx.wire arrives as a FileRange: it is mapped in place
like external data when its offset is aligned, and otherwise read from the file straight into its aligned buffer (no
intermediate bytes, and no mapped pages left behind in the process's resident set).
"""

from __future__ import annotations

import contextvars
import os
import stat
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

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
    """A C-contiguous, 64-byte-aligned copy in native byte order (object arrays: a plain copy)."""
    if a.dtype == object:
        return np.array(a, dtype=object, copy=True)
    out = aligned_empty(a.shape, a.dtype.newbyteorder("=") if a.dtype.itemsize > 1 else a.dtype)
    out[...] = a
    return out


def is_aligned(a: np.ndarray) -> bool:
    return a.ctypes.data % _ALIGN == 0


def ensure_aligned(a: Any) -> Any:
    """`a` itself if it is a native-order array starting on a 64-byte boundary (or not a numeric array), else an
    aligned copy. Zero-stride (broadcast) views stay views: only the values they repeat are copied."""
    if not isinstance(a, np.ndarray) or a.dtype == object or (is_aligned(a) and a.dtype.isnative):
        return a
    if a.size and 0 in a.strides:
        repeated = a[tuple(slice(0, 1) if s == 0 else slice(None) for s in a.strides)]
        return np.broadcast_to(aligned_copy(repeated), a.shape)
    return aligned_copy(a)


def seal_constants(graph: Any) -> None:
    """Make every initializer and array attribute of `graph` (and its subgraphs) aligned and read-only.

    The optimizer's folds produce arrays wherever numpy put them; this aligns them before a program is built. Read-only
    constants are immutable session state: no kernel can write into one, and a run never hands one out writeable.
    """
    for name, value in graph.initializers.items():
        graph.initializers[name] = _sealed(value)
    for node in graph.nodes:
        for key, value in node.attrs.items():
            if isinstance(value, np.ndarray):
                node.attrs[key] = _sealed(value)
        for sub in node.subgraphs():
            seal_constants(sub)


def _sealed(value: np.ndarray) -> np.ndarray:
    aligned = ensure_aligned(value)
    if aligned.flags.writeable:
        aligned.setflags(write=False)
    return aligned


#: a folder that external data may also resolve into (symbolic links followed), besides the model's own folder;
#: set while a model loads from SessionOptions' "session.external_data_root" (see carrack.onnx.importer.load_model)
EXTERNAL_DATA_ROOT: contextvars.ContextVar[str | None] = contextvars.ContextVar("carrack_external_root", default=None)


def external_path(base_dir: str | None, location: str, tensor_name: str) -> str:
    """Resolve an external-data location inside the model's folder. Symbolic links are followed when their target
    stays inside the model's folder, the root named by EXTERNAL_DATA_ROOT, or (a Hugging Face cache snapshot,
    .../snapshots/<revision>/) the snapshot's blobs folder; anything else, and anything that is not a regular file
    (a FIFO, a device), is refused without being opened."""
    where = f"external data of tensor '{tensor_name}'"
    if base_dir is None:
        raise InvalidModel(f"{where} is in file '{location}', but the model was not loaded from a path; "
                           "load it by path so the file can be found")
    if not location or os.path.isabs(location) or location.startswith(("/", "\\")) or ":" in location[:3]:
        raise InvalidModel(f"{where}: location '{location}' must be a relative path inside the model's folder")
    parts = location.replace("\\", "/").split("/")
    if ".." in parts:
        raise InvalidModel(f"{where}: location '{location}' leaves the model's folder ('..' is not allowed)")
    path = os.path.join(os.path.abspath(base_dir), *parts)
    resolved = os.path.realpath(path)
    roots = _allowed_roots(base_dir)
    if not any(_inside(resolved, root) for root in roots):
        raise InvalidModel(f"{where}: location '{location}' is a symbolic link to '{resolved}', outside the model's "
                           f"folder; allowed: {', '.join(repr(r) for r in roots)} (name another root with the "
                           f"SessionOptions config entry '{EXTERNAL_DATA_ROOT_KEY}')")
    try:
        mode = os.stat(resolved).st_mode
    except OSError:
        raise InvalidModel(f"{where}: file '{location}' not found next to the model") from None
    if not stat.S_ISREG(mode):
        raise InvalidModel(f"{where}: '{location}' is not a regular file ({file_kind(mode)}); external data must be "
                           "a regular file")
    return resolved


EXTERNAL_DATA_ROOT_KEY = "session.external_data_root"


def _allowed_roots(base_dir: str) -> list[str]:
    base = os.path.realpath(base_dir)
    roots = [base]
    named = EXTERNAL_DATA_ROOT.get()
    if named:
        roots.append(os.path.realpath(named))
    snapshots = os.path.dirname(os.path.abspath(base_dir))
    if os.path.basename(snapshots) == "snapshots":  # Hugging Face cache: snapshots/<rev>/* link into ../../blobs
        roots.append(os.path.realpath(os.path.join(os.path.dirname(snapshots), "blobs")))
    return roots


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a special file"


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
    return mapped_file(path)[offset:offset + length]


_MAPPED: weakref.WeakValueDictionary[tuple, np.ndarray] = weakref.WeakValueDictionary()
_MAPPED_LOCK = threading.Lock()


def mapped_file(path: str) -> np.ndarray:
    """The whole file as a read-only uint8 array, mapped once however many tensors live in it.

    Tensors used in place keep the mapping alive through their `.base`; it is unmapped when the last one goes.
    """
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    with _MAPPED_LOCK:
        mapped = _MAPPED.get(key)
        if mapped is None:
            mapped = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
            _MAPPED[key] = mapped
    return mapped


def _expected_count(t: TensorProto) -> int:
    n = 1
    for d in t.dims:
        if d < 0:
            raise InvalidModel(f"tensor '{t.name}' has a negative dim {d}")
        n *= d
    return n


@dataclass(frozen=True)
class FileRange:
    """A tensor's raw_data that lies in a file at bytes [offset, offset + length) (embedded weights, see wire.py)."""

    path: str
    offset: int
    length: int


def tensor_to_array(t: TensorProto, base_dir: str | None = None, raw_data: FileRange | None = None) -> np.ndarray:
    """Decode a TensorProto into a numpy array with a 64-byte-aligned, writeable-safe copy of its data.

    `raw_data`, when given, stands for the tensor's raw_data field (which the caller removed from `t`)."""
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
    if raw_data is not None:
        if dtype.kind != "O":
            return _from_file(t, raw_data, dtype, shape, count)
        t.raw_data = _read_range(raw_data)  # not a numeric tensor: decode it exactly as if it had been parsed
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


#: tensors at least this large (external or raw_data) are used in place when aligned; smaller ones are copied, so
#: that they do not pin file mappings or protobuf bytes for a few bytes of data
IN_PLACE_RAW_BYTES = 64 * 1024

_LITTLE_ENDIAN = sys.byteorder == "little"


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
    need = _check_length(t, len(raw), dtype, shape, count)
    # frombuffer works at any byte offset; ONNX stores little-endian
    src = np.frombuffer(raw, dtype=dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype, count=count)
    if need >= IN_PLACE_RAW_BYTES and is_aligned(src) and (_LITTLE_ENDIAN or dtype.itemsize == 1):
        view = src.view(dtype).reshape(shape)  # read-only: frombuffer of bytes or of a read-only mapping
        view.flags.writeable = False
        return view
    out = aligned_empty(shape, dtype)
    out.reshape(-1)[...] = src
    return out


def _check_length(t: TensorProto, have: int, dtype: np.dtype, shape: tuple[int, ...], count: int) -> int:
    need = count * dtype.itemsize
    if have != need:
        raise InvalidModel(f"tensor '{t.name}' holds {have} bytes, expected {need} "
                           f"({count} x {dtype.name}) for dims {list(shape)}")
    return need


def _from_file(t: TensorProto, where: FileRange, dtype: np.dtype, shape: tuple[int, ...], count: int) -> np.ndarray:
    if _packed(dtype) or (not _LITTLE_ENDIAN and dtype.itemsize > 1):
        return _from_raw(t, _read_range(where), dtype, shape, count)
    need = _check_length(t, where.length, dtype, shape, count)
    if need >= IN_PLACE_RAW_BYTES and where.offset % _ALIGN == 0:
        return _from_raw(t, mapped_file(where.path)[where.offset:where.offset + need], dtype, shape, count)
    out = aligned_empty(shape, dtype)
    _read_into(where, out.reshape(-1).view(np.uint8))
    return out


def _read_into(where: FileRange, out: np.ndarray) -> None:
    """Fill the uint8 array `out` with the file's bytes at where.offset (read directly, no intermediate copy)."""
    view = memoryview(out)
    with open(where.path, "rb", buffering=0) as f:
        f.seek(where.offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise InvalidModel(f"model file '{where.path}' ended at byte {where.offset + done} while reading "
                                   f"{where.length} bytes at offset {where.offset} (was it changed while loading?)")
            done += n


def _read_range(where: FileRange) -> bytes:
    out = np.empty(where.length, np.uint8)
    _read_into(where, out)
    return out.tobytes()


def array_to_tensor(a: np.ndarray, name: str = "") -> TensorProto:
    return numpy_helper.from_array(np.asarray(a), name)


__all__ = ["FileRange", "seal_constants", "aligned_copy", "aligned_empty", "array_to_tensor", "ensure_aligned",
           "external_path", "is_aligned", "mapped_file", "tensor_to_array", "onnx"]
