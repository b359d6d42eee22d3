"""Helpers for the GGUF tests: a gguf-py writer wrapper for valid files and a raw byte-level encoder for broken ones.

gguf-py is a test-only dependency: carrack's own code never imports it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

# GGUF value type ids (spelled out here so the raw encoder does not depend on the code under test)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR_FORMATS = {
    UINT8: "B",
    INT8: "b",
    UINT16: "H",
    INT16: "h",
    UINT32: "I",
    INT32: "i",
    FLOAT32: "f",
    BOOL: "?",
    UINT64: "Q",
    INT64: "q",
    FLOAT64: "d",
}
F32_TYPE, F16_TYPE, Q8_0_TYPE = 0, 1, 8


def write_with_gguf_py(
    path: Any,
    tensors: list[tuple[str, np.ndarray, int | None]],
    metadata: list[tuple] = (),
    big_endian: bool = False,
    alignment: int | None = None,
) -> None:
    """Writes a file with gguf-py's GGUFWriter.

    tensors: (name, array, raw ggml type id or None for the array's own dtype); metadata: (key, value, value type id)
    or (key, list, ARRAY, element type id).
    """
    import gguf

    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), "test", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype, *sub_type in metadata:
        sub = gguf.GGUFValueType(sub_type[0]) if sub_type else None
        w.add_key_value(key, value, gguf.GGUFValueType(vtype), sub_type=sub)
    for name, array, raw_type in tensors:
        w.add_tensor(name, array, raw_dtype=None if raw_type is None else gguf.GGMLQuantizationType(raw_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@dataclass
class RawGGUF:
    """Builds GGUF bytes piece by piece, with no validation, recording the offset where every piece ends."""

    order: str = "<"
    parts: list[bytes] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.parts)

    def put(self, data: bytes) -> RawGGUF:
        self.parts.append(data)
        self.boundaries.append(self.size)
        return self

    def pack(self, fmt: str, *values: Any) -> RawGGUF:
        return self.put(struct.pack(self.order + fmt, *values))

    def header(self, n_tensors: int, n_kv: int, version: int = 3, magic: bytes = b"GGUF") -> RawGGUF:
        return self.put(magic).pack("I", version).pack("Q", n_tensors).pack("Q", n_kv)

    def string(self, s: str | bytes, length: int | None = None) -> RawGGUF:
        data = s.encode() if isinstance(s, str) else s
        return self.pack("Q", len(data) if length is None else length).put(data)

    def kv(self, key: str | bytes, vtype: int, value: Any = None, **array: Any) -> RawGGUF:
        self.string(key).pack("I", vtype)
        return self.value(vtype, value, **array)

    def value(self, vtype: int, value: Any, etype: int | None = None, length: int | None = None) -> RawGGUF:
        if vtype == STRING:
            return self.string(value, length)
        if vtype == ARRAY:
            self.pack("I", etype).pack("Q", len(value) if length is None else length)
            for item in value:
                if isinstance(item, tuple):  # a nested array: (element type, items[, declared length])
                    self.value(ARRAY, item[1], etype=item[0], length=item[2] if len(item) > 2 else None)
                else:
                    self.value(etype, item)
            return self
        if vtype in SCALAR_FORMATS:
            return self.pack(SCALAR_FORMATS[vtype], value)
        return self.put(bytes(value or b""))  # unknown type: whatever payload the test wants

    def tensor_info(self, name: str | bytes, ggml_dims: list[int], ggml_type: int, offset: int) -> RawGGUF:
        self.string(name).pack("I", len(ggml_dims))
        for d in ggml_dims:
            self.pack("Q", d)
        return self.pack("I", ggml_type).pack("Q", offset)

    def pad(self, alignment: int = 32) -> RawGGUF:
        return self.put(b"\0" * (-self.size % alignment))

    def data(self, nbytes: int, fill: int = 0x3C) -> RawGGUF:
        return self.put(bytes([fill]) * nbytes)

    def tobytes(self) -> bytes:
        return b"".join(self.parts)


def simple_raw_file(order: str = "<") -> RawGGUF:
    """A small valid file built with the raw encoder: two keys, two F32 tensors."""
    raw = RawGGUF(order).header(n_tensors=2, n_kv=2)
    raw.kv("general.name", STRING, "tiny").kv("tiny.layers", ARRAY, [1, 2, 3], etype=INT32)
    raw.tensor_info("a", [4, 2], F32_TYPE, 0).tensor_info("b", [3], F32_TYPE, 32)
    return raw.pad().data(32).data(12)
