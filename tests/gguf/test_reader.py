"""carrack.gguf reads what gguf-py writes (both byte orders, every tensor type, odd shapes and alignments) and agrees
with gguf-py's own GGUFReader on metadata, shapes, types, offsets and bytes."""

from __future__ import annotations

import argparse
import math
import sys

import ml_dtypes
import numpy as np
import pytest

from carrack.errors import InvalidModel, UnsupportedModel
from carrack.gguf import GGML_BLOCK_SIZES, GGMLType, GGUFError, GGUFFile, GGUFValueType, read_gguf
from carrack.gguf.cli import add_gguf_parser
from tests.gguf import (
    ARRAY,
    BOOL,
    F32_TYPE,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    UINT8,
    UINT16,
    UINT32,
    UINT64,
    RawGGUF,
    simple_raw_file,
    write_with_gguf_py,
)

gguf = pytest.importorskip("gguf")

PLAIN_DTYPES = [np.float32, np.float16, np.float64, np.int8, np.int16, np.int32, np.int64]
ENDIANS = [pytest.param(False, id="little"), pytest.param(True, id="big")]


def assert_matches_gguf_py(path, ours: GGUFFile) -> None:
    """Every key, value, tensor record and tensor byte agrees with gguf-py's GGUFReader."""
    ref = gguf.GGUFReader(str(path))
    assert ours.data_offset == ref.data_offset
    assert ours.alignment == ref.alignment
    assert ours.byte_order == ("big" if ref.endianess == gguf.GGUFEndian.BIG else "little")
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, field in ours.fields.items():
        ref_field = ref_fields[key]
        assert field.type == ref_field.types[0], key
        expected = ref_field.contents()
        if field.type == GGUFValueType.ARRAY:
            assert field.element_type == ref_field.types[1], key
            assert _flatten(field.value) == expected, key  # gguf-py flattens nested arrays
        elif field.type in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) and math.isnan(expected):
            assert math.isnan(field.value)
        else:
            assert field.value == expected, key
            assert type(field.value) is type(expected), key
    assert [t.name for t in ours.tensors.values()] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors.values(), ref.tensors):
        assert t.type == r.tensor_type.value
        assert t.shape == tuple(int(d) for d in reversed(r.shape.tolist()))
        assert t.ggml_shape == tuple(int(d) for d in r.shape.tolist())
        assert t.n_elements == r.n_elements
        assert t.offset == r.data_offset
        assert t.nbytes == r.n_bytes
        assert t.raw().dtype == np.uint8
        assert t.raw().tobytes() == np.asarray(ref.data[r.data_offset : r.data_offset + r.n_bytes]).tobytes()


def _flatten(value):
    if isinstance(value, list):
        return [x for v in value for x in (_flatten(v) if isinstance(v, (list, np.ndarray)) else [v])]
    return value.tolist()


# ---------------------------------------------------------------------------------------------------- type tables


def test_ggml_type_ids_and_sizes_match_gguf_py():
    assert {t.name for t in GGMLType} == {t.name for t in gguf.GGMLQuantizationType}
    for ref in gguf.GGMLQuantizationType:
        ours = GGMLType[ref.name]
        assert ours.value == ref.value, ref.name
        assert (ours.block_size, ours.type_size) == gguf.GGML_QUANT_SIZES[ref], ref.name
        assert GGML_BLOCK_SIZES[ours] == gguf.GGML_QUANT_SIZES[ref]


def test_value_type_ids_match_gguf_py():
    assert {t.name: t.value for t in GGUFValueType} == {t.name: t.value for t in gguf.GGUFValueType}


def test_type_helpers():
    assert GGMLType.Q4_K.nbytes(512) == 288
    assert GGMLType.F16.numpy_dtype == np.float16 and not GGMLType.F16.is_quantized
    assert GGMLType.BF16.numpy_dtype == ml_dtypes.bfloat16
    assert GGMLType.Q8_0.is_quantized and GGMLType.Q8_0.numpy_dtype is None
    with pytest.raises(ValueError, match="multiple of 32"):
        GGMLType.Q8_0.nbytes(33)
    assert issubclass(GGUFError, InvalidModel)


# ---------------------------------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("big_endian", ENDIANS)
def test_plain_types_round_trip(tmp_path, big_endian):
    rng = np.random.default_rng(0)
    arrays = {f"t.{np.dtype(dt).name}": (rng.standard_normal((3, 5)) * 100).astype(dt) for dt in PLAIN_DTYPES}
    bf16 = rng.standard_normal((2, 7)).astype(np.float32).astype(ml_dtypes.bfloat16)
    tensors = [(name, a, None) for name, a in arrays.items()]
    # gguf-py swaps a tensor by its numpy dtype: give bfloat16 as uint16 so a big-endian file gets it swapped too
    tensors.append(("t.bf16", bf16.view(np.uint16), GGMLType.BF16))
    path = tmp_path / "plain.gguf"
    write_with_gguf_py(path, tensors, big_endian=big_endian)
    with GGUFFile(path) as f:
        assert f.version == 3 and f.byte_order == ("big" if big_endian else "little")
        for name, a in arrays.items():
            got = f.tensors[name].data()
            assert got.dtype == a.dtype and got.dtype.isnative and got.shape == a.shape
            np.testing.assert_array_equal(got, a)
        got = f.tensors["t.bf16"].data()
        assert got.dtype == ml_dtypes.bfloat16 and got.shape == (2, 7)
        np.testing.assert_array_equal(got.view(np.uint16), bf16.view(np.uint16))
        assert_matches_gguf_py(path, f)


def _quantized_bytes(qtype: GGMLType, rows: int, rng: np.random.Generator) -> np.ndarray:
    """gguf-py's quantization where it has one, random block bytes otherwise (the reader does not look inside)."""
    ref_type = gguf.GGMLQuantizationType(qtype.value)
    values = rng.standard_normal((rows, 2 * qtype.block_size)).astype(np.float32)
    try:
        return gguf.quants.quantize(values, ref_type)
    except NotImplementedError:
        return rng.integers(0, 256, (rows, 2 * qtype.type_size), dtype=np.uint8)


QUANTIZED = [t for t in GGMLType if t.is_quantized]


@pytest.mark.parametrize("big_endian", ENDIANS)
def test_every_quantized_type(tmp_path, big_endian):
    rng = np.random.default_rng(1)
    written = {t: _quantized_bytes(t, rows=3, rng=rng) for t in QUANTIZED}
    path = tmp_path / "quant.gguf"
    write_with_gguf_py(path, [(f"q.{t.name}", b, t) for t, b in written.items()], big_endian=big_endian)
    with GGUFFile(path) as f:
        assert_matches_gguf_py(path, f)
        for t, b in written.items():
            tensor = f.tensors[f"q.{t.name}"]
            assert tensor.type == t and tensor.shape == (3, 2 * t.block_size)
            assert tensor.nbytes == 3 * 2 * t.type_size == b.nbytes
            assert tensor.raw().tobytes() == b.tobytes()
            assert tensor.offset % f.alignment == 0
        with pytest.raises(UnsupportedModel, match="block-quantized"):
            f.tensors["q.Q4_0"].data()


ODD_SHAPES = [(1,), (7,), (3, 5), (2, 3, 5), (1, 1, 1, 1), (2, 1, 3, 1), (5, 1)]


@pytest.mark.parametrize("alignment", [1, 2, 8, 64, 4096])
@pytest.mark.parametrize("big_endian", ENDIANS)
def test_odd_shapes_and_alignments(tmp_path, alignment, big_endian):
    rng = np.random.default_rng(2)
    tensors = []
    for i, shape in enumerate(ODD_SHAPES):
        dtype = PLAIN_DTYPES[i % len(PLAIN_DTYPES)]
        tensors.append((f"odd.{i}", (rng.standard_normal(shape) * 50).astype(dtype), None))
    tensors.append(("odd.i8", np.arange(5, dtype=np.int8), None))  # 5 bytes: with alignment 1 the next is odd
    tensors.append(("odd.after", np.arange(6, dtype=np.float64).reshape(2, 3), None))
    path = tmp_path / "odd.gguf"
    write_with_gguf_py(path, tensors, big_endian=big_endian, alignment=alignment)
    with GGUFFile(path) as f:
        assert f.alignment == alignment
        assert_matches_gguf_py(path, f)
        for name, a, _ in tensors:
            got = f.tensors[name].data()
            assert got.shape == a.shape and got.dtype == a.dtype and got.flags.aligned
            np.testing.assert_array_equal(got, a)
        if alignment == 1:
            assert f.tensors["odd.after"].offset % 8 != 0  # the case that needs an aligned copy


def test_native_aligned_data_is_a_read_only_view(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = tmp_path / "view.gguf"
    write_with_gguf_py(path, [("a", a, None)])
    f = GGUFFile(path)
    t = f.get_tensor("a")
    data, raw = t.data(), t.raw()
    if sys.byteorder == "little":
        assert np.shares_memory(data, raw)
    assert not data.flags.writeable and not raw.flags.writeable
    assert raw.nbytes == 48
    with pytest.raises(KeyError, match="no tensor named 'b'"):
        f.get_tensor("b")
    f.close()
    np.testing.assert_array_equal(data, a)  # views outlive close()
    with pytest.raises(ValueError, match="closed"):
        t.raw()


# ---------------------------------------------------------------------------------------------------- metadata

SCALARS = [
    ("s.u8", 255, UINT8),
    ("s.i8", -128, INT8),
    ("s.u16", 65535, UINT16),
    ("s.i16", -32768, INT16),
    ("s.u32", 2**32 - 1, UINT32),
    ("s.i32", -(2**31), INT32),
    ("s.u64", 2**64 - 1, UINT64),
    ("s.i64", -(2**63), INT64),
    ("s.f32", 1.5, FLOAT32),
    ("s.f32nan", float("nan"), FLOAT32),
    ("s.f64", -2.25e300, FLOAT64),
    ("s.true", True, BOOL),
    ("s.false", False, BOOL),
    ("s.str", "héllo wörld ✓", STRING),
    ("s.empty", "", STRING),
]
ARRAYS = [
    ("a.u8", [0, 1, 255], ARRAY, UINT8),
    ("a.i8", [-1, 2], ARRAY, INT8),
    ("a.u16", [1, 65535], ARRAY, UINT16),
    ("a.i16", [-5, 5], ARRAY, INT16),
    ("a.u32", [7] * 40, ARRAY, UINT32),
    ("a.i32", list(range(-3, 3)), ARRAY, INT32),
    ("a.u64", [2**64 - 1, 0], ARRAY, UINT64),
    ("a.i64", [-(2**63), 2**63 - 1], ARRAY, INT64),
    ("a.f32", [0.5, -1.25], ARRAY, FLOAT32),
    ("a.f64", [1e-300, 3.0], ARRAY, FLOAT64),
    ("a.bool", [True, False, True], ARRAY, BOOL),
    ("a.str", ["<unk>", "", "▁the", "日本"], ARRAY, STRING),
    ("a.nested", [[1, 2], [3, 4, 5]], ARRAY),
    ("a.nested3", [[[1.5], [2.5, 3.5]], [[4.5]]], ARRAY),
    ("a.nested_str", [["a", "bb"], ["ccc"]], ARRAY),
]
NUMPY_OF = {
    UINT8: np.uint8,
    INT8: np.int8,
    UINT16: np.uint16,
    INT16: np.int16,
    UINT32: np.uint32,
    INT32: np.int32,
    UINT64: np.uint64,
    INT64: np.int64,
    FLOAT32: np.float32,
    FLOAT64: np.float64,
    BOOL: np.bool_,
}


@pytest.mark.parametrize("big_endian", ENDIANS)
def test_metadata_of_every_type(tmp_path, big_endian):
    path = tmp_path / "meta.gguf"
    write_with_gguf_py(path, [("w", np.ones(3, np.float32), None)], metadata=SCALARS + ARRAYS, big_endian=big_endian)
    f = read_gguf(path)
    assert_matches_gguf_py(path, f)
    meta = f.metadata
    assert meta["general.architecture"] == "test"
    for key, value, vtype in SCALARS:
        assert f.fields[key].type == vtype and f.fields[key].element_type is None
        assert meta[key] == value or (math.isnan(value) and math.isnan(meta[key]))
    for key, value, _, etype in ARRAYS[:11]:
        got = meta[key]
        assert isinstance(got, np.ndarray) and got.dtype == NUMPY_OF[etype] and got.dtype.isnative
        np.testing.assert_array_equal(got, np.array(value, dtype=NUMPY_OF[etype]))
        assert f.fields[key].element_type == etype
    assert meta["a.str"] == ["<unk>", "", "▁the", "日本"]
    assert f.fields["a.nested"].element_type == GGUFValueType.ARRAY
    assert [v.tolist() for v in meta["a.nested"]] == [[1, 2], [3, 4, 5]]
    assert [[v.tolist() for v in inner] for inner in meta["a.nested3"]] == [[[1.5], [2.5, 3.5]], [[4.5]]]
    assert meta["a.nested_str"] == [["a", "bb"], ["ccc"]]


def test_version_2_reads_like_version_3(tmp_path):
    path = tmp_path / "v3.gguf"
    write_with_gguf_py(path, [("w", np.arange(4, dtype=np.float32), None)], metadata=SCALARS[:3])
    data = bytearray(path.read_bytes())
    data[4:8] = (2).to_bytes(4, "little")
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(bytes(data))
    f = GGUFFile(v2)
    assert f.version == 2
    assert_matches_gguf_py(v2, f)
    np.testing.assert_array_equal(f.tensors["w"].data(), np.arange(4, dtype=np.float32))


@pytest.mark.parametrize("order", ["<", ">"])
def test_raw_encoder_builds_what_both_readers_accept(tmp_path, order):
    path = tmp_path / "raw.gguf"
    path.write_bytes(simple_raw_file(order).tobytes())
    f = GGUFFile(path)
    assert_matches_gguf_py(path, f)
    assert f.metadata["general.name"] == "tiny"
    assert f.tensors["a"].shape == (2, 4) and f.tensors["b"].offset == f.data_offset + 32


def test_zero_dims_is_a_scalar_and_no_tensors_is_fine(tmp_path):
    raw = RawGGUF().header(n_tensors=1, n_kv=0).tensor_info("scalar", [], F32_TYPE, 0).pad()
    raw.put(np.float32(2.5).tobytes())
    path = tmp_path / "scalar.gguf"
    path.write_bytes(raw.tobytes())
    t = GGUFFile(path).tensors["scalar"]
    assert t.shape == () and t.n_elements == 1 and t.data() == np.float32(2.5)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(RawGGUF().header(n_tensors=0, n_kv=0).tobytes())
    f = GGUFFile(empty)
    assert f.tensors == {} and f.fields == {}
    assert "0 tensors" in repr(f)


# ---------------------------------------------------------------------------------------------------- CLI


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="carrack")
    add_gguf_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_info(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    meta = [("tok.tokens", [f"tok{i}" for i in range(1000)], ARRAY, STRING), ("chat", "x" * 500, STRING)]
    tensors = [
        ("w.f32", np.ones((4, 8), np.float32), None),
        ("w.f16", np.ones(16, np.float16), None),
        ("w.q", _quantized_bytes(GGMLType.Q8_0, 2, np.random.default_rng(0)), GGMLType.Q8_0),
    ]
    write_with_gguf_py(path, tensors, metadata=meta)
    assert _run_cli(["gguf", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "GGUF v3, little-endian" in out
    assert "[string x 1000]" in out and "... (1000 items)" in out and "tok999" not in out
    assert "... (500 chars)" in out
    assert "w.f32" in out and "[4, 8]" in out and "Q8_0" in out and "[2, 64]" in out
    assert "totals by type:" in out and "total" in out


def test_cli_dump_and_save(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    bf = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    write_with_gguf_py(path, [("a", a, None), ("bf", bf.view(np.uint16), GGMLType.BF16)])
    out_file = tmp_path / "a.npy"
    assert _run_cli(["gguf", "dump", str(path), "--tensor", "a", "--save", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "a: I16 shape [2, 3]" in out and "max 5" in out
    np.testing.assert_array_equal(np.load(out_file), a)
    assert _run_cli(["gguf", "dump", str(path), "--tensor", "bf", "--save", str(out_file)]) == 0
    saved = np.load(out_file)
    assert saved.dtype == np.float32 and saved.tolist() == [1.5, -2.0]
    with pytest.raises(SystemExit, match="no tensor named 'nope'"):
        _run_cli(["gguf", "dump", str(path), "--tensor", "nope"])


def test_cli_dump_dequantizes_quantized_tensors(tmp_path, capsys):
    pytest.importorskip("carrack.gguf.dequant")
    values = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    q = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    path = tmp_path / "q.gguf"
    write_with_gguf_py(path, [("q", q, GGMLType.Q8_0)])
    out_file = tmp_path / "q.npy"
    assert _run_cli(["gguf", "dump", str(path), "--tensor", "q", "--save", str(out_file)]) == 0
    assert "q: Q8_0 shape [2, 64]" in capsys.readouterr().out
    expected = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_allclose(np.load(out_file), expected, rtol=1e-6)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_READ is Linux's")
def test_prefault_maps_the_pages_before_they_are_read(tmp_path):
    """After prefault(), reading every page of the tensor data takes (almost) no page faults; without it, one per
    page or per fault-around batch (large folios: ~12 for these 16 MiB on Linux 6.18)."""
    import resource

    path = tmp_path / "big.gguf"
    weights = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)  # 16 MiB
    write_with_gguf_py(path, [("w", weights, None)])

    def faults_reading(gguf: GGUFFile) -> int:
        data = gguf.tensors["w"].data()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        total = float(data.reshape(-1)[::1024].sum())  # a value from every 4 KiB page
        assert np.isfinite(total)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    with read_gguf(path) as cold:
        cold_faults = faults_reading(cold)
    with read_gguf(path) as warm:
        if not warm.prefault():
            pytest.skip("the kernel refused MADV_POPULATE_READ (before Linux 5.14)")
        warm_faults = faults_reading(warm)
        np.testing.assert_array_equal(warm.tensors["w"].data(), weights)
    assert cold_faults > 0 and warm_faults <= cold_faults // 4, (cold_faults, warm_faults)
