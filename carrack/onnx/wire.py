"""Split a serialized ModelProto into a small "skeleton" and the places of its large raw_data payloads.

A model whose weights are embedded as TensorProto.raw_data (what torch.onnx writes below 2 GB) would otherwise sit in
memory three times while it loads: the file's bytes, protobuf's parsed copy, and the Python bytes each `raw_data`
access makes. Instead the file is memory-mapped and its protobuf wire format walked here, three levels deep
(ModelProto.graph -> GraphProto.initializer -> TensorProto.raw_data). Every large raw_data payload of a main-graph
initializer is cut out and only its (file offset, length) recorded; the enclosing length prefixes are re-encoded so
the remaining bytes are again a valid ModelProto, which protobuf parses in a few milliseconds. The loader then reads
each payload straight from the file.

Everything else (nodes, subgraphs, small tensors, unknown fields) is copied verbatim, so the skeleton parses to the
same message as the file, less those raw_data fields; repeated occurrences of `graph` merge as protobuf merges them.
Every length is checked against the bytes that remain: a truncated file or a lying length is InvalidModel.
"""

from __future__ import annotations

from dataclasses import dataclass

from carrack.errors import InvalidModel

MODEL_GRAPH = 7  # ModelProto.graph
GRAPH_INITIALIZER = 5  # GraphProto.initializer
TENSOR_RAW_DATA = 9  # TensorProto.raw_data

VARINT, FIXED64, LENGTH_DELIMITED, START_GROUP, END_GROUP, FIXED32 = range(6)

#: protobuf refuses messages and fields of 2 GiB or more
MAX_LENGTH = 2**31 - 1


class WireError(InvalidModel):
    """The bytes are not a well-formed protobuf message."""


@dataclass(frozen=True)
class Payload:
    """Where one initializer's raw_data lies, relative to the start of the buffer that was split."""

    offset: int
    length: int


@dataclass
class SplitModel:
    skeleton: bytes
    #: main-graph initializer index (in GraphProto.initializer order, as protobuf parses the skeleton) -> payload
    payloads: dict[int, Payload]
    #: how many main-graph initializers the walk saw (protobuf must parse as many from the skeleton)
    initializers: int


def read_varint(buf: memoryview | bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at `pos` (at most 10 bytes, not running past `end`) and the position after it."""
    value = shift = 0
    for i in range(pos, min(end, pos + 10)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if i == pos + 9 and byte > 1:
                raise WireError(f"varint at byte {pos} overflows 64 bits")
            return value, i + 1
        shift += 7
    if end - pos < 10:
        raise WireError(f"varint at byte {pos} is cut off by the end of its message (truncated file?)")
    raise WireError(f"varint at byte {pos} is longer than 10 bytes")


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@dataclass(frozen=True)
class Field:
    number: int
    wire_type: int
    start: int  # first byte of the tag
    value_start: int  # first byte of the value (after a length prefix, for length-delimited fields)
    end: int  # one past the field's last byte


def iter_fields(buf: memoryview | bytes, start: int, end: int):
    """The fields of the message in buf[start:end], in order; raises WireError on anything malformed."""
    pos = start
    while pos < end:
        field = _read_field(buf, pos, end)
        if field.wire_type == END_GROUP:
            raise WireError(f"unexpected end-group marker at byte {pos}")
        yield field
        pos = field.end


def _read_tag(buf: memoryview | bytes, pos: int, end: int) -> tuple[int, int, int]:
    """(field number, wire type, position after the tag)."""
    tag, after_tag = read_varint(buf, pos, end)
    number = tag >> 3
    if number == 0 or number >= 2**29:
        raise WireError(f"invalid field number {number} at byte {pos}")
    return number, tag & 7, after_tag


def _read_field(buf: memoryview | bytes, pos: int, end: int) -> Field:
    number, wire_type, after_tag = _read_tag(buf, pos, end)
    if wire_type == VARINT:
        _, value_end = read_varint(buf, after_tag, end)
        return Field(number, wire_type, pos, after_tag, value_end)
    if wire_type in (FIXED64, FIXED32):
        value_end = after_tag + (8 if wire_type == FIXED64 else 4)
        if value_end > end:
            raise WireError(f"fixed-size field {number} at byte {pos} runs past the end of its message")
        return Field(number, wire_type, pos, after_tag, value_end)
    if wire_type == LENGTH_DELIMITED:
        length, value_start = read_varint(buf, after_tag, end)
        if length > MAX_LENGTH or length > end - value_start:
            raise WireError(f"field {number} at byte {pos} claims {length} bytes but only {end - value_start} "
                            "remain in its message (truncated file or corrupt length)")
        return Field(number, wire_type, pos, value_start, value_start + length)
    if wire_type == START_GROUP:
        return Field(number, wire_type, pos, after_tag, _skip_group(buf, number, after_tag, end))
    if wire_type == END_GROUP:
        return Field(number, wire_type, pos, after_tag, after_tag)
    raise WireError(f"invalid wire type {wire_type} at byte {pos}")


def _skip_group(buf: memoryview | bytes, number: int, pos: int, end: int) -> int:
    """The position after the end-group marker that closes group `number` (deprecated encoding, still valid)."""
    depth = [number]
    while depth:
        if pos >= end:
            raise WireError(f"group {number} is not closed before the end of its message")
        if buf[pos] & 7 == START_GROUP:  # a nested group: iterate, not recurse, so deep nesting cannot overflow
            nested, _, pos = _read_tag(buf, pos, end)
            depth.append(nested)
            continue
        field = _read_field(buf, pos, end)
        if field.wire_type == END_GROUP:
            if field.number != depth[-1]:
                raise WireError(f"end-group marker for field {field.number} closes group {depth[-1]}")
            depth.pop()
        pos = field.end
    return pos


def split_model(buf: memoryview | bytes, min_payload: int) -> SplitModel:
    """Cut the raw_data of every main-graph initializer of at least `min_payload` bytes out of the ModelProto in
    `buf`; see the module docstring."""
    payloads: dict[int, Payload] = {}
    count = 0  # initializers seen so far, across every occurrence of ModelProto.graph
    chunks: list[memoryview | bytes] = []
    for field in iter_fields(buf, 0, len(buf)):
        if field.number == MODEL_GRAPH and field.wire_type == LENGTH_DELIMITED:
            graph, count = _split_graph(buf, field, min_payload, payloads, count)
            _emit(chunks, buf, field, graph)
        else:
            chunks.append(buf[field.start:field.end])
    return SplitModel(b"".join(chunks), payloads, count)


def _split_graph(buf, graph: Field, min_payload: int, payloads: dict[int, Payload],
                 count: int) -> tuple[list[memoryview | bytes] | None, int]:
    """The graph's bytes with large raw_data removed, as chunks (None if nothing was removed: copy it whole), and the
    initializer count after it (`count` before it)."""
    chunks: list[memoryview | bytes] = []
    changed = False
    for field in iter_fields(buf, graph.value_start, graph.end):
        if field.number == GRAPH_INITIALIZER and field.wire_type == LENGTH_DELIMITED:
            count += 1
            payload = _large_raw_data(buf, field, min_payload)
            if payload is not None:
                payloads[count - 1] = payload
                tensor = [buf[f.start:f.end] for f in iter_fields(buf, field.value_start, field.end)
                          if not (f.number == TENSOR_RAW_DATA and f.wire_type == LENGTH_DELIMITED)]
                _emit(chunks, buf, field, tensor)
                changed = True
                continue
        chunks.append(buf[field.start:field.end])
    return (chunks if changed else None), count


def _large_raw_data(buf, tensor: Field, min_payload: int) -> Payload | None:
    """The tensor's raw_data if it is at least `min_payload` bytes. A field repeated in one message takes its last
    value, so only the last raw_data counts; all of them are dropped from the skeleton when it is large."""
    last = None
    for field in iter_fields(buf, tensor.value_start, tensor.end):
        if field.number == TENSOR_RAW_DATA and field.wire_type == LENGTH_DELIMITED:
            last = field
    if last is None or last.end - last.value_start < min_payload:
        return None
    return Payload(last.value_start, last.end - last.value_start)


def _emit(out: list, buf, field: Field, body: list | None) -> None:
    """Append `field` to `out` with its value replaced by the chunks `body` (None: unchanged). The tag bytes are
    kept as they were; the length prefix is re-encoded."""
    if body is None:
        out.append(buf[field.start:field.end])
        return
    _, tag_end = read_varint(buf, field.start, field.end)
    out.append(buf[field.start:tag_end])
    out.append(encode_varint(sum(len(c) for c in body)))
    out.extend(body)


__all__ = ["Field", "Payload", "SplitModel", "WireError", "encode_varint", "iter_fields", "read_varint",
           "split_model"]
