"""A validating, memory-mapped GGUF reader.

Layout of a GGUF (v2/v3) file, all integers in the file's byte order (v3 files may be big-endian):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value_type: u32, value)
    tensor_count x  (name: string, n_dims: u32, dims: n_dims x u64 (innermost first), ggml_type: u32, offset: u64)
    padding to `general.alignment` (default 32) | tensor data (offsets are relative to here)

    string = length u64 + UTF-8 bytes;  array value = element_type u32 + length u64 + elements

Every length and count is checked against the bytes left in the file before anything is allocated, so a malformed or
hostile file gets a GGUFError naming what is wrong, never a hang or an allocation larger than the file.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carrack.errors import InvalidModel, UnsupportedModel
from carrack.gguf.types import (
    GGML_BLOCK_SIZES,
    GGML_NUMPY_DTYPES,
    GGUF_INTEGER_TYPES,
    GGUF_SCALAR_DTYPES,
    GGUF_SCALAR_FORMATS,
    GGMLType,
    GGUFValueType,
)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 31
MAX_DIMS = 4
MAX_ARRAY_NESTING = 64
ALIGNMENT_KEY = "general.alignment"

_HEADER_BYTES = 4 + 4 + 8 + 8
# Smallest possible encodings, used to reject counts that cannot fit in the bytes left.
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims = 0, type, offset
_MIN_ARRAY_BYTES = 4 + 8
_INT64_MAX = (1 << 63) - 1


class GGUFError(InvalidModel):
    """The GGUF file is malformed, truncated, inconsistent or uses something this reader does not know."""


@dataclass(frozen=True)
class GGUFField:
    """One metadata key-value pair. `element_type` is the element type of an array (None for scalars)."""

    key: str
    type: GGUFValueType
    value: Any
    element_type: GGUFValueType | None = None
    offset: int = 0


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """A tensor record. The data stays in the file until raw() or data() is called."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]  # numpy order (outermost first); the file stores it innermost first
    offset: int  # absolute byte offset in the file
    nbytes: int
    n_elements: int
    file: GGUFFile = field(repr=False)

    def raw(self) -> np.ndarray:
        """A read-only uint8 view of exactly this tensor's bytes."""
        return self.file._bytes_view(self.offset, self.nbytes)

    def data(self) -> np.ndarray:
        """The values as a numpy array of this tensor's shape, in native byte order (plain types only).

        A zero-copy read-only view when the file is in native byte order and the data is aligned for its dtype,
        otherwise an aligned native-order copy.
        """
        dtype = GGML_NUMPY_DTYPES.get(self.type)
        if dtype is None:
            raise UnsupportedModel(
                f"tensor '{self.name}' is {self.type.name} (block-quantized): use raw() for its bytes or "
                "carrack.gguf.dequant.dequantize() for its values"
            )
        raw = self.raw()
        if self.file.byte_order == sys.byteorder and self.offset % dtype.alignment == 0:
            return raw.view(dtype).reshape(self.shape)
        # Swap (or just copy, to align) through the unsigned integer of the same width: works for every dtype,
        # bfloat16 included.
        stored = np.dtype(f"u{dtype.itemsize}").newbyteorder("<" if self.file.byte_order == "little" else ">")
        return raw.view(stored).astype(stored.newbyteorder("=")).view(dtype).reshape(self.shape)

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        """Dimensions as ggml stores them (innermost first)."""
        return tuple(reversed(self.shape))


#: MADV_POPULATE_READ (Linux >= 5.14), missing from Python's mmap constants before 3.13
_MADV_POPULATE_READ_LINUX = 22


class GGUFFile:
    """A GGUF file opened read-only through mmap, with its metadata and tensor records validated.

    Attributes: path, file_size, version, byte_order ('little' or 'big'), alignment, data_offset (absolute start of
    the tensor data section), fields (key -> GGUFField), metadata (key -> value), tensors (name -> GGUFTensor, in
    file order).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            self.file_size = os.fstat(f.fileno()).st_size
            if self.file_size < _HEADER_BYTES:
                raise GGUFError(
                    f"{self.path}: not a GGUF file: {self.file_size} bytes, shorter than the "
                    f"{_HEADER_BYTES}-byte GGUF header"
                )
            self._mmap: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = len(self._mmap)  # what is mapped is what gets checked, even if the file changed meanwhile
        self._bytes: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        parser = _HeaderParser(self._mmap, self.file_size, self.path)
        self.version = parser.version
        self.byte_order = parser.byte_order
        self.fields: dict[str, GGUFField] = parser.read_metadata()
        self.alignment = _alignment(self.fields, self.path)
        infos = parser.read_tensor_infos()
        self.data_offset = _round_up(parser.pos, self.alignment)
        self.tensors: dict[str, GGUFTensor] = self._place_tensors(infos)

    @property
    def metadata(self) -> dict[str, Any]:
        return {key: f.value for key, f in self.fields.items()}

    def get_tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor named '{name}' ({len(self.tensors)} tensors)") from None

    def prefault(self) -> bool:
        """Map every page of the file into this process now (Linux MADV_POPULATE_READ, read-ahead elsewhere), as
        llama.cpp does when it loads a model: otherwise the first pass over the weights pays a page fault per 4 KiB
        (and any disk reads) inside the first prompt. True when the pages were mapped."""
        if self._mmap is None or not hasattr(self._mmap, "madvise"):
            return False
        populate = getattr(mmap, "MADV_POPULATE_READ", None)
        if populate is None and sys.platform.startswith("linux"):
            populate = _MADV_POPULATE_READ_LINUX
        if populate is not None:
            try:
                self._mmap.madvise(populate)
                return True
            except OSError:  # a kernel before Linux 5.14
                pass
        if hasattr(mmap, "MADV_WILLNEED"):
            self._mmap.madvise(mmap.MADV_WILLNEED)
        return False

    def close(self) -> None:
        """Drops this object's mapping; views returned by raw()/data() keep theirs alive until they go."""
        self._bytes = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # tensor views still reference the mapping; it is unmapped when they are freed
            self._mmap = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({self.path!r}, version={self.version}, {self.byte_order}-endian, "
            f"{len(self.fields)} keys, {len(self.tensors)} tensors)"
        )

    def _bytes_view(self, offset: int, nbytes: int) -> np.ndarray:
        if self._bytes is None:
            raise ValueError(f"{self.path} is closed")
        return self._bytes[offset : offset + nbytes]

    def _place_tensors(self, infos: list[_TensorInfo]) -> dict[str, GGUFTensor]:
        tensors: dict[str, GGUFTensor] = {}
        data_bytes = self.file_size - self.data_offset
        for info in infos:
            where = f"{self.path}: tensor '{info.name}'"
            if info.relative_offset % self.alignment:
                raise GGUFError(
                    f"{where}: data offset {info.relative_offset} is not a multiple of the alignment {self.alignment}"
                )
            if info.relative_offset + info.nbytes > data_bytes:
                raise GGUFError(
                    f"{where}: data at offset {info.relative_offset} + {info.nbytes} bytes runs past the end of the "
                    f"file (the data section holds {max(data_bytes, 0)} bytes, from absolute offset "
                    f"{self.data_offset})"
                )
            tensors[info.name] = GGUFTensor(
                name=info.name,
                type=info.type,
                shape=info.shape,
                offset=self.data_offset + info.relative_offset,
                nbytes=info.nbytes,
                n_elements=info.n_elements,
                file=self,
            )
        _check_no_overlap(list(tensors.values()), self.path)
        return tensors


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Opens and validates a GGUF file (see GGUFFile)."""
    return GGUFFile(path)


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    type: GGMLType
    shape: tuple[int, ...]
    relative_offset: int
    nbytes: int
    n_elements: int


class _HeaderParser:
    """Reads the header, metadata and tensor records with a cursor, checking every read against the file size."""

    def __init__(self, buf: mmap.mmap, size: int, path: str):
        self.buf = buf
        self.size = size
        self.path = path
        if buf[:4] != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file: magic is {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r}")
        (version,) = struct.unpack_from("<I", buf, 4)
        # A big-endian file read as little-endian has its (small) version in the high half, as gguf-py detects it.
        self.byte_order = "big" if version & 0xFFFF == 0 and version != 0 else "little"
        self.order = "<" if self.byte_order == "little" else ">"
        if self.byte_order == "big":
            (version,) = struct.unpack_from(">I", buf, 4)
        if version == 1:
            raise GGUFError(f"{path}: GGUF version 1 (32-bit lengths, pre-2023) is not supported; re-convert the model")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{path}: unsupported GGUF version {version} (carrack reads versions 2 and 3)")
        self.version = version
        self.pos = self.last = 8
        self.tensor_count = self.u64("tensor count")
        self.kv_count = self.u64("metadata key-value count")
        needed = self.kv_count * _MIN_KV_BYTES + self.tensor_count * _MIN_TENSOR_INFO_BYTES
        if needed > self.remaining:
            raise GGUFError(
                f"{path}: header declares {self.kv_count} metadata entries and {self.tensor_count} tensors, which "
                f"need at least {needed} bytes, but only {self.remaining} bytes follow the header"
            )

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def fail(self, what: str, message: str, at: int | None = None) -> GGUFError:
        """An error about `what`, located at `at` (default: the start of the last item read)."""
        return GGUFError(f"{self.path}: {what}: {message} (at byte offset {self.last if at is None else at})")

    def take(self, nbytes: int, what: str) -> int:
        """Claims the next `nbytes` bytes and returns where they start."""
        if nbytes > self.remaining:
            raise self.fail(
                what, f"needs {nbytes} bytes but the file has only {self.remaining} left (truncated?)", at=self.pos
            )
        self.last = start = self.pos
        self.pos += nbytes
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(self.order + fmt, self.buf, start)[0]

    def u32(self, what: str) -> int:
        return self.unpack("I", what)

    def u64(self, what: str) -> int:
        return self.unpack("Q", what)

    def string(self, what: str) -> str:
        length = self.u64(f"{what} length")
        if length > self.remaining:
            raise self.fail(what, f"string length {length} exceeds the {self.remaining} bytes left in the file")
        start = self.take(length, what)
        try:
            return self.buf[start : start + length].decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what}: invalid UTF-8 at byte offset {start + e.start}") from None

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.u32(f"{what} value type")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(what, f"unknown value type {raw} (known: 0..{int(max(GGUFValueType))})") from None

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> tuple[Any, GGUFValueType | None]:
        """Reads a value of type `vtype`; returns it and, for arrays, the element type."""
        if vtype == GGUFValueType.STRING:
            return self.string(what), None
        if vtype == GGUFValueType.ARRAY:
            return self.array(what, depth)
        return self.unpack(GGUF_SCALAR_FORMATS[vtype], what), None

    def array(self, what: str, depth: int) -> tuple[Any, GGUFValueType]:
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(what, f"arrays nested deeper than {MAX_ARRAY_NESTING} levels")
        etype = self.value_type(f"{what} array element")
        length = self.u64(f"{what} array length")
        min_bytes = _min_value_bytes(etype)
        if length > self.remaining // min_bytes:
            raise self.fail(
                what,
                f"array of {length} {etype.name} elements needs at least {length * min_bytes} bytes, "
                f"but the file has only {self.remaining} left",
            )
        if etype in GGUF_SCALAR_DTYPES:
            return self.scalar_array(etype, length, what), etype
        # Name the index path for shallow nesting only, so a deep-nesting error stays readable.
        items = [self.value(etype, f"{what}[{i}]" if depth < 3 else what, depth + 1)[0] for i in range(length)]
        return items, etype

    def scalar_array(self, etype: GGUFValueType, length: int, what: str) -> np.ndarray:
        dtype = GGUF_SCALAR_DTYPES[etype]
        start = self.take(length * dtype.itemsize, what)
        if etype == GGUFValueType.BOOL:
            return np.frombuffer(self.buf, dtype=np.uint8, count=length, offset=start).astype(np.bool_)
        stored = dtype.newbyteorder(self.order)
        return np.frombuffer(self.buf, dtype=stored, count=length, offset=start).astype(dtype)

    def read_metadata(self) -> dict[str, GGUFField]:
        fields: dict[str, GGUFField] = {}
        for index in range(self.kv_count):
            start = self.pos
            key = self.string(f"metadata key #{index}")
            what = f"metadata key '{key}'"
            if key in fields:
                first = fields[key].offset
                raise GGUFError(f"{self.path}: duplicate {what} (entries at byte offsets {first} and {start})")
            vtype = self.value_type(what)
            value, etype = self.value(vtype, what)
            fields[key] = GGUFField(key, vtype, value, etype, start)
        return fields

    def read_tensor_infos(self) -> list[_TensorInfo]:
        infos: list[_TensorInfo] = []
        names: set[str] = set()
        for index in range(self.tensor_count):
            record = self.pos
            name = self.string(f"tensor #{index} name")
            what = f"tensor #{index} '{name}'"
            if name in names:
                raise self.fail(what, "duplicate tensor name", at=record)
            names.add(name)
            infos.append(self.tensor_info(name, what, record))
        return infos

    def tensor_info(self, name: str, what: str, record: int) -> _TensorInfo:
        n_dims = self.u32(f"{what} n_dims")
        if n_dims > MAX_DIMS:
            raise self.fail(what, f"{n_dims} dimensions; ggml tensors have at most {MAX_DIMS}", at=record)
        ggml_dims = [self.u64(f"{what} dim {i}") for i in range(n_dims)]
        if any(d == 0 for d in ggml_dims):
            raise self.fail(what, f"dimension of size 0 in {ggml_dims} (ggml order, innermost first)", at=record)
        raw_type = self.u32(f"{what} type")
        try:
            ggml_type = GGMLType(raw_type)
        except ValueError:
            raise self.fail(what, f"unknown ggml type id {raw_type}", at=record) from None
        relative_offset = self.u64(f"{what} data offset")
        n_elements = 1
        for d in ggml_dims:
            n_elements *= d
        if n_elements > _INT64_MAX:
            raise self.fail(what, f"element count {n_elements} of dims {ggml_dims} overflows int64", at=record)
        block, type_size = GGML_BLOCK_SIZES[ggml_type]
        row = ggml_dims[0] if ggml_dims else 1
        if row % block:
            raise self.fail(
                what,
                f"innermost dimension {row} is not a multiple of the {ggml_type.name} block size {block}",
                at=record,
            )
        nbytes = n_elements // block * type_size
        if nbytes > self.size:
            message = f"{nbytes} bytes of data ({ggml_type.name}, dims {ggml_dims}) exceed the file size"
            raise self.fail(what, message, at=record)
        shape = tuple(reversed(ggml_dims))
        return _TensorInfo(name, ggml_type, shape, relative_offset, nbytes, n_elements)


def _min_value_bytes(vtype: GGUFValueType) -> int:
    if vtype == GGUFValueType.STRING:
        return 8
    if vtype == GGUFValueType.ARRAY:
        return _MIN_ARRAY_BYTES
    return GGUF_SCALAR_DTYPES[vtype].itemsize


def _alignment(fields: dict[str, GGUFField], path: str) -> int:
    f = fields.get(ALIGNMENT_KEY)
    if f is None:
        return DEFAULT_ALIGNMENT
    if f.type not in GGUF_INTEGER_TYPES:
        raise GGUFError(f"{path}: {ALIGNMENT_KEY} must be an integer (normally UINT32), got a {f.type.name}")
    value = int(f.value)
    if value <= 0 or value & (value - 1) or value > MAX_ALIGNMENT:
        raise GGUFError(f"{path}: {ALIGNMENT_KEY} is {value}; it must be a power of two between 1 and {MAX_ALIGNMENT}")
    return value


def _round_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _check_no_overlap(tensors: list[GGUFTensor], path: str) -> None:
    ordered = sorted(tensors, key=lambda t: t.offset)
    for before, after in zip(ordered, ordered[1:]):
        if before.offset + before.nbytes > after.offset:
            raise GGUFError(
                f"{path}: tensors '{before.name}' (bytes {before.offset}..{before.offset + before.nbytes}) and "
                f"'{after.name}' (bytes {after.offset}..{after.offset + after.nbytes}) overlap"
            )
