"""carrack.gguf.dequant against gguf-py's reference dequantizer (a test-only dependency) and hand-written formulas."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from carrack.gguf import tables
from carrack.gguf.dequant import dequantize, dequantize_blocks, supported_types
from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType

gguf = pytest.importorskip("gguf")
gguf_quants = pytest.importorskip("gguf.quants")

T = GGMLType
OFFSETS = (0, 1, 2, 3, 7)

# Byte offsets of the f16 scale fields of every block type (made finite in random blocks).
F16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82), T.Q3_K: (108,),
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,),
    T.IQ3_S: (0,), T.IQ1_S: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,), T.MXFP4: (),
    T.NVFP4: (), T.IQ1_M: (), T.Q8_K: (),
}  # fmt: skip
BLOCK_TYPES = sorted(F16_FIELDS)
GGUF_PY_TYPES = [t for t in BLOCK_TYPES if gguf.GGMLQuantizationType(int(t)) in gguf_quants._type_traits]


def finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random f16 bit patterns of finite values (normals, subnormals and zeros of either sign)."""
    magnitude = rng.integers(0, 0x7C00, size=n, dtype=np.uint16)
    return magnitude | (rng.integers(0, 2, size=n, dtype=np.uint16) << 15)


def random_blocks(ggml_type: GGMLType, n_blocks: int, rng: np.random.Generator, f16_max: float | None = None):
    """(n_blocks, type_size) random block bytes whose float scales are finite (below `f16_max` if given)."""
    _, type_size = GGML_BLOCK_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)

    def scales() -> np.ndarray:
        if f16_max is None:
            return finite_f16_bits(rng, n_blocks)
        return rng.uniform(-f16_max, f16_max, n_blocks).astype("<f2").view("<u2")

    for offset in F16_FIELDS[ggml_type]:
        blocks[:, offset : offset + 2] = scales().astype("<u2").view(np.uint8).reshape(n_blocks, 2)
    if ggml_type == T.IQ1_M:  # the f16 scale is spread over the top nibbles of the last four u16s
        bits = scales().astype(np.uint16)
        for i in range(4):
            nibble = ((bits >> (4 * i)) & 0xF).astype(np.uint8)
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (nibble << 4)
    if ggml_type == T.Q8_K:
        d = rng.uniform(-1, 1, n_blocks) if f16_max is None else rng.uniform(-f16_max, f16_max, n_blocks)
        blocks[:, 0:4] = d.astype("<f4").view(np.uint8).reshape(n_blocks, 4)
    if ggml_type == T.MXFP4 and f16_max is not None:
        blocks[:, 0] = rng.integers(120, 130, n_blocks)
    return blocks


def embed(data: np.ndarray, offset: int) -> np.ndarray:
    """`data`'s bytes as a slice starting `offset` bytes into a larger buffer (so possibly misaligned)."""
    buffer = np.full(data.nbytes + offset + 5, 0xA5, dtype=np.uint8)
    buffer[offset : offset + data.nbytes] = data.reshape(-1).view(np.uint8)
    return buffer[offset : offset + data.nbytes]


def reference(blocks: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return gguf_quants.dequantize(blocks, gguf.GGMLQuantizationType(int(ggml_type)))


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("ggml_type", GGUF_PY_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf_py(ggml_type, offset):
    rng = np.random.default_rng([int(ggml_type), offset])
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    rows, blocks_per_row = (3, 2) if block_size == 256 else (5, 3)
    blocks = random_blocks(ggml_type, rows * blocks_per_row, rng).reshape(rows, blocks_per_row * type_size)
    expected = reference(blocks, ggml_type)
    got = dequantize(embed(blocks, offset), ggml_type, (rows, blocks_per_row * block_size))
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("ggml_type", [t for t in GGUF_PY_TYPES if t not in (T.Q8_K,)], ids=lambda t: t.name)
def test_larger_tensor_matches_gguf_py(ggml_type):
    """Enough blocks for several internal chunks, odd row count."""
    rng = np.random.default_rng(int(ggml_type))
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    rows, per_row = 37, max(1, 8192 // block_size)
    blocks = random_blocks(ggml_type, rows * per_row, rng).reshape(rows, per_row * type_size)
    got = dequantize(embed(blocks, 1), ggml_type, (rows, per_row * block_size))
    np.testing.assert_array_equal(got, reference(blocks, ggml_type))


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4],
                         ids=lambda t: t.name)  # fmt: skip
@pytest.mark.parametrize("offset", [0, 3])
def test_data_quantized_by_gguf_py(ggml_type, offset):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((7, 512)) * rng.uniform(0.01, 10, (7, 1))).astype(np.float32)
    raw = gguf_quants.quantize(x, gguf.GGMLQuantizationType(int(ggml_type)))
    got = dequantize(embed(raw, offset), ggml_type, x.shape)
    np.testing.assert_array_equal(got, reference(raw, ggml_type))
    if ggml_type not in (T.TQ1_0, T.TQ2_0):  # ternary types are lossy by design
        np.testing.assert_allclose(got, x, atol=0.2 * np.abs(x).max())


def test_q8_k_formula():
    rng = np.random.default_rng(3)
    blocks = random_blocks(T.Q8_K, 5, rng)
    d = blocks[:, 0:4].copy().view("<f4")
    expected = blocks[:, 4:260].view(np.int8).astype(np.float32) * d
    np.testing.assert_array_equal(dequantize(embed(blocks, 3), T.Q8_K, (5, 256)), expected)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize(
    ("ggml_type", "stored"),
    [(T.F32, "<f4"), (T.F16, "<f2"), (T.F64, "<f8"), (T.I8, "i1"), (T.I16, "<i2"), (T.I32, "<i4"), (T.I64, "<i8")],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_plain_types(ggml_type, stored, offset):
    rng = np.random.default_rng(5)
    values = (rng.standard_normal((3, 7)) * 100).astype(stored)
    got = dequantize(embed(values, offset), ggml_type, (3, 7))
    np.testing.assert_array_equal(got, values.astype(np.float32))
    assert got.dtype == np.float32 and got.flags.c_contiguous


@pytest.mark.parametrize("offset", OFFSETS)
def test_bf16_matches_gguf_py(offset):
    rng = np.random.default_rng(6)
    raw = gguf_quants.quantize(rng.standard_normal((3, 10)).astype(np.float32), gguf.GGMLQuantizationType.BF16)
    got = dequantize(embed(raw, offset), T.BF16, (3, 10))
    np.testing.assert_array_equal(got, reference(raw, T.BF16))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0, T.IQ2_XS, T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_output_dtypes(ggml_type, dtype):
    rng = np.random.default_rng(8)
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    if block_size == 1:
        raw = rng.standard_normal(256).astype(np.float32).astype({T.F32: "<f4", T.F16: "<f2"}.get(ggml_type, "<f4"))
        if ggml_type == T.BF16:
            raw = raw.astype(ml_dtypes.bfloat16)
        raw = raw.view(np.uint8)
    else:
        raw = random_blocks(ggml_type, 256 // block_size, rng, f16_max=1.0).reshape(-1)
    as_f32 = dequantize(embed(raw, 1), ggml_type, (256,))
    got = dequantize(embed(raw, 1), ggml_type, (1, 256), dtype=dtype)
    assert got.dtype == np.dtype(dtype) and got.shape == (1, 256)
    np.testing.assert_array_equal(got.reshape(-1), as_f32.astype(dtype))


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_buffer_kinds(kind):
    rng = np.random.default_rng(9)
    blocks = random_blocks(T.Q5_1, 6, rng)
    expected = reference(blocks, T.Q5_1).reshape(2, 96)
    data = b"\x00" + blocks.tobytes()
    raw = kind(data)[1:] if kind is not bytes else data[1:]
    np.testing.assert_array_equal(dequantize(raw, int(T.Q5_1), (2, 96)), expected)


def test_input_is_not_modified_and_output_is_fresh():
    rng = np.random.default_rng(10)
    blocks = random_blocks(T.Q4_0, 4, rng)
    before = blocks.copy()
    raw = np.frombuffer(blocks.tobytes(), dtype=np.uint8)  # read-only input
    out = dequantize(raw, T.Q4_0, (128,))
    np.testing.assert_array_equal(blocks, before)
    assert out.flags.writeable


def test_empty_tensor():
    assert dequantize(b"", T.Q4_K, (0, 256)).shape == (0, 256)
    assert dequantize(b"", T.F16, (0,)).shape == (0,)


def test_errors():
    with pytest.raises(ValueError, match="needs 68 bytes, got 35"):
        dequantize(np.zeros(35, np.uint8), T.Q8_0, (64,))
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0, (2, 16))
    with pytest.raises(ValueError, match="unknown ggml type"):
        dequantize(b"", 1234, (0,))
    with pytest.raises(NotImplementedError):
        dequantize(np.zeros(40, np.uint8), T.Q8_1, (32,))
    with pytest.raises(TypeError):
        dequantize(np.zeros(4, np.uint8), T.F32, (1,), dtype=np.int32)


def test_dequantize_blocks_into_float32_buffer():
    rng = np.random.default_rng(11)
    blocks = random_blocks(T.Q6_K, 3, rng)
    out = np.empty((3, 256), np.float32)
    dequantize_blocks(blocks, T.Q6_K, out)
    np.testing.assert_array_equal(out, reference(blocks, T.Q6_K))


def test_every_required_type_is_supported():
    required = {"F32", "F16", "BF16", "I8", "I16", "I32", "I64", "F64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K",
                "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4"}  # fmt: skip
    assert required <= {t.name for t in supported_types()}


@pytest.mark.parametrize(("name", "cls"), [("iq2xxs", "IQ2_XXS"), ("iq2xs", "IQ2_XS"), ("iq2s", "IQ2_S"),
                                           ("iq3xxs", "IQ3_XXS"), ("iq3s", "IQ3_S"), ("iq1s", "IQ1_S")])  # fmt: skip
def test_grids_equal_gguf_py(name, cls):
    ref = getattr(gguf_quants, cls)
    ref.init_grid()
    np.testing.assert_array_equal(tables.grid(name), ref.grid.reshape(ref.grid_shape))


def test_ksigns_and_kvalues_equal_gguf_py():
    np.testing.assert_array_equal(tables.ksigns(), np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8))
    assert tables.KVALUES_IQ4NL == tuple(gguf_quants.IQ4_NL.kvalues)
    assert tables.KVALUES_MXFP4 == tuple(gguf_quants.MXFP4.kvalues)


def test_f32_as_float32_is_a_read_only_view_when_aligned():
    values = np.arange(64, dtype="<f4")
    raw = values.view(np.uint8)
    out = dequantize(raw, T.F32, (4, 16))
    assert np.shares_memory(out, raw) and not out.flags.writeable
    np.testing.assert_array_equal(out.reshape(-1), values)
    misaligned = np.frombuffer(b"\0" + values.tobytes(), np.uint8)[1:]
    copied = dequantize(misaligned, T.F32, (4, 16))
    assert not np.shares_memory(copied, misaligned)
    np.testing.assert_array_equal(copied.reshape(-1), values)
