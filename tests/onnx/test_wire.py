"""Loading model files through the wire-level split (carrack.onnx.wire): the skeleton and payload offsets round-trip,
the arrays equal the plain protobuf path's bit for bit, aligned payloads are views of the file, and malformed files
are InvalidModel."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from carrack.errors import CarrackError, CorruptModel, InvalidModel
from carrack.onnx.importer import import_model, load_model
from carrack.onnx.tensors import IN_PLACE_RAW_BYTES
from carrack.onnx.wire import (
    END_GROUP,
    LENGTH_DELIMITED,
    START_GROUP,
    VARINT,
    WireError,
    encode_varint,
    iter_fields,
    read_varint,
    split_model,
)

LARGE = IN_PLACE_RAW_BYTES


# -- building wire bytes by hand ----------------------------------------------------------------------------------

def tag(number: int, wire_type: int) -> bytes:
    return encode_varint(number << 3 | wire_type)


def delimited(number: int, body: bytes, length: int | None = None) -> bytes:
    return tag(number, LENGTH_DELIMITED) + encode_varint(len(body) if length is None else length) + body


def varint_field(number: int, value: int) -> bytes:
    return tag(number, VARINT) + encode_varint(value)


def model_bytes(inits: list[bytes], outputs: list[str] = (), doc: str = "", graph_parts: int = 1,
                extra_graph: bytes = b"", extra_model: bytes = b"") -> bytes:
    """A ModelProto whose graph holds the serialized tensors `inits`, optionally split over several occurrences of
    ModelProto.graph (which protobuf merges)."""
    graph = helper.make_graph([], "g", [], [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None)
                                           for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], doc_string=doc)
    model.ClearField("graph")
    fields = [delimited(5, t) for t in inits]
    cut = (len(fields) + 1) // 2 if graph_parts > 1 else len(fields)
    parts = [graph.SerializeToString() + extra_graph + b"".join(fields[:cut])]
    if graph_parts > 1:
        parts.append(b"".join(fields[cut:]))
    return model.SerializeToString() + extra_model + b"".join(delimited(7, p) for p in parts)


def tensor_bytes(values: np.ndarray, name: str) -> bytes:
    return numpy_helper.from_array(values, name).SerializeToString()


def without_raw_data(t: TensorProto) -> bytes:
    header = TensorProto()
    header.CopyFrom(t)
    header.ClearField("raw_data")
    return header.SerializeToString()


def write(tmp_path, data: bytes, name: str = "m.onnx") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


# -- comparing the two paths --------------------------------------------------------------------------------------

def outcome(load):
    """('ok', {name: (dtype, shape, bytes or values)}) or ('error', class name, message); protobuf's parse errors
    and the wire walk's have different words, so both read 'unparseable'."""
    try:
        graph = load().graph
    except CarrackError as e:
        unparseable = "not a valid ONNX model" in str(e) or "protobuf refused" in str(e)
        return "error", type(e).__name__, "unparseable" if unparseable else str(e)
    return "ok", {k: _fingerprint(v) for k, v in graph.initializers.items()}


def _fingerprint(a: np.ndarray):
    if a.dtype == object:
        return a.dtype, a.shape, a.tolist()
    return a.dtype, a.shape, a.tobytes()


def reference(path: str):
    """The plain path: the whole file through protobuf, then the importer."""
    def load():
        proto = onnx.ModelProto()
        with open(path, "rb") as f:
            data = f.read()
        try:
            proto.ParseFromString(data)
        except Exception:  # noqa: BLE001
            raise CorruptModel("protobuf refused it") from None
        return import_model(proto, os.path.dirname(path), f"model file '{path}'")
    return outcome(load)


def assert_same_as_reference(path: str):
    got, expected = outcome(lambda: load_model(path)), reference(path)
    assert got == expected
    return got


def mapping_of(a: np.ndarray):
    base = a
    while base is not None and not isinstance(base, np.memmap):
        base = base.base if isinstance(base, np.ndarray) else None
    return base


def pad_until_aligned(build, payload_index: int = 0) -> bytes:
    """build(doc) for the first doc_string padding that puts payload `payload_index` at a file offset % 64 == 0."""
    for pad in range(200):
        data = build("x" * pad)
        split = split_model(data, LARGE)
        if split.payloads[payload_index].offset % 64 == 0:
            return data
    raise AssertionError("no padding aligns the payload")


# -- varints and fields -------------------------------------------------------------------------------------------

@given(st.integers(0, 2**64 - 1))
def test_varints_round_trip(value):
    data = encode_varint(value)
    assert read_varint(data, 0, len(data)) == (value, len(data))


def test_non_minimal_varints_are_accepted_and_bad_ones_refused():
    assert read_varint(b"\x85\x80\x00", 0, 3) == (5, 3)
    with pytest.raises(WireError, match="cut off"):
        read_varint(b"\x85\x80", 0, 2)
    with pytest.raises(WireError, match="longer than 10"):
        read_varint(b"\x80" * 11, 0, 11)
    with pytest.raises(WireError, match="overflows"):
        read_varint(b"\xff" * 9 + b"\x02", 0, 10)


def test_fields_and_groups_are_walked():
    group = tag(3, START_GROUP) + varint_field(1, 7) + tag(4, START_GROUP) + tag(4, END_GROUP) + tag(3, END_GROUP)
    data = varint_field(1, 300) + group + delimited(2, b"abc") + tag(5, 5) + b"\0" * 4 + tag(6, 1) + b"\0" * 8
    fields = list(iter_fields(data, 0, len(data)))
    assert [(f.number, f.wire_type) for f in fields] == [(1, 0), (3, 3), (2, 2), (5, 5), (6, 1)]
    assert data[fields[2].value_start:fields[2].end] == b"abc"
    assert fields[1].end - fields[1].start == len(group)


@pytest.mark.parametrize("data, message", [
    (delimited(2, b"abc", length=4), "claims 4 bytes"),
    (delimited(2, b"abc", length=2**62), "claims"),
    (tag(0, VARINT) + b"\x01", "field number 0"),
    (tag(1, 7), "wire type 7"),
    (tag(1, START_GROUP) + varint_field(2, 1), "not closed"),
    (tag(1, START_GROUP) + tag(2, END_GROUP), "closes group 1"),
    (tag(1, END_GROUP), "end-group"),
    (tag(1, 1) + b"\0" * 7, "runs past"),
])
def test_malformed_fields_are_wire_errors(data, message):
    with pytest.raises(WireError, match=message):
        list(iter_fields(data, 0, len(data)))


# -- skeleton and offsets -----------------------------------------------------------------------------------------

def test_skeleton_and_offsets_round_trip():
    rng = np.random.default_rng(0)
    big = rng.standard_normal(LARGE // 4 + 3).astype(np.float32)
    small = np.arange(10, dtype=np.int64)
    big16 = rng.standard_normal(LARGE // 2).astype(np.float16)
    inits = [numpy_helper.from_array(a, n) for a, n in ((big, "big"), (small, "small"), (big16, "big16"))]
    graph = helper.make_graph([helper.make_node("Identity", ["big"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph)
    data = model.SerializeToString()
    split = split_model(data, LARGE)
    assert sorted(split.payloads) == [0, 2] and split.initializers == 3
    for index, values in ((0, big), (2, big16)):
        p = split.payloads[index]
        assert data[p.offset:p.offset + p.length] == values.tobytes()
    assert len(split.skeleton) < 2000
    expected = onnx.ModelProto()
    expected.CopyFrom(model)
    for index in (0, 2):
        expected.graph.initializer[index].ClearField("raw_data")
    assert onnx.ModelProto.FromString(split.skeleton) == expected


def test_nothing_large_leaves_the_bytes_unchanged():
    data = model_bytes([tensor_bytes(np.arange(100, dtype=np.float32), "w")], ["w"])
    split = split_model(data, LARGE)
    assert split.skeleton == data and split.payloads == {} and split.initializers == 1


def test_aligned_payloads_are_read_only_views_of_the_file_others_are_aligned_copies(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {"a": rng.standard_normal(LARGE // 4).astype(np.float32),
              "b": rng.integers(-9, 9, LARGE + 5).astype(np.int8),
              "c": rng.standard_normal(LARGE // 8 + 1)}
    inits = [tensor_bytes(a, n) for n, a in arrays.items()]
    data = pad_until_aligned(lambda doc: model_bytes(inits, list(arrays), doc=doc))
    path = write(tmp_path, data)
    assert_same_as_reference(path)
    offsets = {n: p.offset for n, p in zip(arrays, split_model(data, LARGE).payloads.values())}
    graph = load_model(path).graph
    for name, values in arrays.items():
        w = graph.initializers[name]
        assert np.array_equal(w, values) and w.dtype == values.dtype and w.ctypes.data % 64 == 0
        if offsets[name] % 64 == 0:
            assert mapping_of(w) is not None and not w.flags.writeable, name
        else:
            assert mapping_of(w) is None, name
    assert offsets["a"] % 64 == 0


def test_subgraphs_sparse_and_external_data_mixed_in(tmp_path):
    rng = np.random.default_rng(2)
    big = rng.standard_normal(LARGE // 4 + 1).astype(np.float32)
    sub_big = rng.standard_normal(LARGE // 4 + 2).astype(np.float32)
    external = rng.standard_normal(LARGE // 4).astype(np.float32)
    (tmp_path / "w.bin").write_bytes(external.tobytes())
    ext = numpy_helper.from_array(external, "ext")
    ext.ClearField("raw_data")
    ext.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("offset", "0"), ("length", str(external.nbytes))):
        entry = ext.external_data.add()
        entry.key, entry.value = k, v
    sparse_values = numpy_helper.from_array(rng.standard_normal(LARGE // 4).astype(np.float32), "sp")
    sparse = helper.make_sparse_tensor(sparse_values, numpy_helper.from_array(np.arange(LARGE // 4) * 2, "i"),
                                       [LARGE // 2])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    branch = helper.make_graph([helper.make_node("Identity", ["sub_big"], ["y"])], "then", [], [out],
                               initializer=[numpy_helper.from_array(sub_big, "sub_big")])
    else_branch = helper.make_graph([helper.make_node("Identity", ["big"], ["y"])], "else", [], [out])
    cond = numpy_helper.from_array(np.array(True), "cond")
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=else_branch)
    graph = helper.make_graph([node], "g", [], [out], initializer=[numpy_helper.from_array(big, "big"), cond, ext],
                              sparse_initializer=[sparse])
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert sorted(split_model(open(path, "rb").read(), LARGE).payloads) == [0]  # only the main graph's big

    loaded = load_model(path).graph
    assert np.array_equal(loaded.initializers["big"], big)
    assert np.array_equal(loaded.initializers["ext"], external) and mapping_of(loaded.initializers["ext"]) is not None
    assert np.array_equal(loaded.initializers["sp"].reshape(-1)[::2], numpy_helper.to_array(sparse_values))
    assert np.array_equal(loaded.nodes[0].attrs["then_branch"].initializers["sub_big"], sub_big)
    assert_same_as_reference(path)


def test_wire_level_oddities_load_as_protobuf_reads_them(tmp_path):
    """Graph split over two ModelProto.graph fields, raw_data given twice (the last wins), unknown fields and
    groups, a non-minimal length prefix."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(LARGE // 4).astype(np.float32)
    b = rng.standard_normal(LARGE // 4 + 9).astype(np.float32)
    c = np.arange(5, dtype=np.float32)
    # a small decoy, then the real (large) raw_data; a large decoy, then the real (small) one
    twice_large_last = without_raw_data(numpy_helper.from_array(a, "a")) + delimited(9, b.tobytes()[:8]) + \
        delimited(9, a.tobytes())
    twice_small_last = without_raw_data(numpy_helper.from_array(c, "c")) + delimited(9, b"\0" * (LARGE + 4)) + \
        delimited(9, c.tobytes())
    unknown = varint_field(999, 5) + tag(998, START_GROUP) + varint_field(1, 1) + tag(998, END_GROUP)
    inits = [twice_large_last, twice_small_last, tensor_bytes(b, "b") + unknown]
    data = model_bytes(inits, ["a", "b", "c"], graph_parts=2, extra_graph=unknown, extra_model=unknown)
    split = split_model(data, LARGE)
    assert sorted(split.payloads) == [0, 2]
    path = write(tmp_path, data)
    kind, arrays = assert_same_as_reference(path)
    assert kind == "ok" and arrays["a"][2] == a.tobytes() and arrays["c"][2] == c.tobytes()

    # a non-minimal length prefix for the graph (protobuf accepts it); the skeleton re-encodes it minimally
    graph_field = next(f for f in iter_fields(data, 0, len(data)) if f.number == 7)
    length = graph_field.end - graph_field.value_start
    padded = encode_varint(length)
    padded = bytes(x | 0x80 for x in padded) + b"\x00"
    odd = data[:graph_field.start] + tag(7, LENGTH_DELIMITED) + padded + data[graph_field.value_start:]
    assert assert_same_as_reference(write(tmp_path, odd, "odd.onnx"))[0] == "ok"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int4", "uint8", "bool", "complex64",
                                   "float8_e4m3fn"])
def test_dtypes_through_the_file_path(tmp_path, dtype):
    import ml_dtypes  # noqa: F401 - registers the dtype names

    count = LARGE * 2 + 1
    values = np.random.default_rng(4).integers(0, 2, count).astype(np.dtype(dtype))
    t = numpy_helper.from_array(values, "w")
    assert len(t.raw_data) >= LARGE
    for pad in (0, 1):
        path = write(tmp_path, model_bytes([t.SerializeToString()], ["w"], doc="x" * pad), f"m{pad}.onnx")
        kind, arrays = assert_same_as_reference(path)
        assert kind == "ok" and arrays["w"][1] == values.shape


def test_wrong_length_raw_data_is_the_same_error(tmp_path):
    t = numpy_helper.from_array(np.zeros(LARGE, np.float32), "w")
    t.dims[0] += 1
    path = write(tmp_path, model_bytes([t.SerializeToString()], ["w"]))
    with pytest.raises(InvalidModel, match=r"holds 262144 bytes, expected 262148"):
        load_model(path)
    assert_same_as_reference(path)


# -- malformed files ----------------------------------------------------------------------------------------------

def _big_model() -> bytes:
    values = np.random.default_rng(5).standard_normal(LARGE // 4 + 1).astype(np.float32)
    return model_bytes([tensor_bytes(values, "w"), tensor_bytes(np.arange(3, dtype=np.int64), "s")], ["w", "s"])


def test_truncated_files_fail_or_load_exactly_like_protobuf(tmp_path):
    data = _big_model()
    cuts = sorted({1, 2, 5, 17, len(data) // 3, len(data) // 2, len(data) - LARGE // 2, len(data) - 3,
                   len(data) - 1} | {f.end for f in iter_fields(data, 0, len(data))})
    for cut in cuts:
        path = write(tmp_path, data[:cut], f"cut{cut}.onnx")
        assert_same_as_reference(path)
        graph_field = [f for f in iter_fields(data, 0, len(data)) if f.number == 7][0]
        if graph_field.start < cut < graph_field.end:
            with pytest.raises(InvalidModel, match="not a valid ONNX model"):
                load_model(path)


def _with_length(data: bytes, path: tuple[int, ...], new_length: int) -> bytes:
    """`data` with the length prefix of the field reached by following field numbers `path` replaced."""
    start, end, field = 0, len(data), None
    for number in path:
        field = next(f for f in iter_fields(data, start, end) if f.number == number)
        start, end = field.value_start, field.end
    _, tag_end = read_varint(data, field.start, field.end)
    return data[:tag_end] + encode_varint(new_length) + data[field.value_start:]


@pytest.mark.parametrize("path, delta", [
    ((7,), 1), ((7,), 2**40), ((7,), 2**63),  # the graph claims more than the file holds
    ((7, 5), 1), ((7, 5), 2**33),  # an initializer claims more than its graph
    ((7, 5, 9), 1), ((7, 5, 9), 2**31),  # raw_data claims more than its tensor
])
def test_lying_lengths_are_invalid_models(tmp_path, path, delta):
    data = _big_model()
    start, end, field = 0, len(data), None
    for number in path:
        field = next(f for f in iter_fields(data, start, end) if f.number == number)
        start, end = field.value_start, field.end
    lying = _with_length(data, path, field.end - field.value_start + delta)
    file = write(tmp_path, lying)
    with pytest.raises(InvalidModel, match="not a valid ONNX model"):
        load_model(file)


@pytest.mark.parametrize("data", [b"", b"\x00", b"not an onnx model at all\n", b"\xff" * 64, tag(1, 7)])
def test_garbage_files_are_invalid_models(tmp_path, data):
    with pytest.raises(InvalidModel):
        load_model(write(tmp_path, data))


# -- property: random models load identically through both paths --------------------------------------------------

_DTYPES = ["float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool", "bfloat16", "int4", "string"]


@st.composite
def random_tensor(draw, index: int) -> bytes:
    import ml_dtypes  # noqa: F401

    dtype = draw(st.sampled_from(_DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    name = f"t{index}"
    if dtype == "string":
        values = np.array([str(x) for x in rng.integers(0, 99, draw(st.integers(0, 5)))], dtype=object)
        return tensor_bytes(values, name)
    itemsize = 0.5 if dtype == "int4" else np.dtype(dtype).itemsize
    large = draw(st.booleans())
    count = int(LARGE / itemsize) + draw(st.integers(0, 40)) if large else draw(st.integers(0, 30))
    if dtype in ("bool", "int4"):
        values = rng.integers(0, 2, count).astype(dtype)
    else:  # arbitrary bit patterns, NaN payloads included
        values = np.frombuffer(rng.bytes(count * np.dtype(dtype).itemsize), dtype=dtype)
    t = numpy_helper.from_array(values.reshape(draw(st.sampled_from([(count,), (1, count)]))), name)
    if draw(st.integers(0, 9)) == 0 and t.dims:  # dims that do not match the data
        t.dims[0] += 1
    body = t.SerializeToString()
    if t.HasField("raw_data") and draw(st.integers(0, 4)) == 0:  # a decoy raw_data before the real one
        body = without_raw_data(t) + delimited(9, rng.bytes(draw(st.sampled_from([3, LARGE])))) + \
            delimited(9, t.raw_data)
    if draw(st.booleans()):
        body += varint_field(1000 + index, index)
    return body


@st.composite
def random_model(draw) -> bytes:
    n = draw(st.integers(1, 4))
    inits = [draw(random_tensor(i)) for i in range(n)]
    return model_bytes(inits, [f"t{i}" for i in range(n)], doc="d" * draw(st.integers(0, 70)),
                       graph_parts=draw(st.integers(1, 2)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=random_model())
def test_random_models_load_identically_through_both_paths(tmp_path, data):
    assert_same_as_reference(write(tmp_path, data))


@pytest.mark.parametrize("depth", [3, 100_000])
def test_nested_groups_in_unknown_fields(tmp_path, depth):
    """Valid when shallow; deep nesting is refused by protobuf and must not overflow the walk's stack."""
    groups = tag(900, START_GROUP) * depth + tag(900, END_GROUP) * depth
    data = model_bytes([tensor_bytes(np.zeros(LARGE // 4, np.float32), "w")], ["w"], extra_model=groups)
    assert split_model(data, LARGE).payloads
    assert assert_same_as_reference(write(tmp_path, data))[0] == ("ok" if depth < 10 else "error")
