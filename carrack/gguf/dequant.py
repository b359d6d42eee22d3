"""Dequantization of ggml tensor data (every GGUF tensor type with a defined float value) with vectorised numpy.

A quantized row is a run of blocks: `block_size` values packed into `type_size` bytes (carrack.gguf.types). The raw
bytes are viewed as a (n_blocks, type_size) uint8 matrix and each field is a column slice of it, so the data may
start at any byte offset; multi-byte fields (f16 scales, u16/u32 bit masks) are copied into a small contiguous buffer
before being viewed with an explicit little-endian dtype, which works on any alignment and any host byte order.

Each block type has a function `(blocks, out)` that writes the float32 values of a (n, type_size) block matrix into a
(n, block_size) float32 array. Most of them build the small integer value of every element (bit fields, or an int8
table lookup for non-linear levels) and write it times its block or sub-block scale into `out` with one mixed
int8 x float32 multiply; the grid types look float32 grid rows up straight into `out`, then scale them in place.
The arithmetic follows ggml's reference formulas in the same order (so results equal ggml / gguf-py bit for bit).
Large tensors are processed in chunks of blocks that stay in the CPU cache.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np
import numpy.typing as npt

from carrack.gguf import tables
from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType

BlockDequantizer = Callable[[np.ndarray, np.ndarray], None]

# Values per chunk: 128K float32 (512 KiB) keeps the temporaries of one chunk in L2/L3.
_CHUNK_VALUES = 1 << 17

# Plain types: their little-endian element dtype.
_PLAIN_DTYPES: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype("<f4"),
    GGMLType.F16: np.dtype("<f2"),
    GGMLType.F64: np.dtype("<f8"),
    GGMLType.I8: np.dtype("i1"),
    GGMLType.I16: np.dtype("<i2"),
    GGMLType.I32: np.dtype("<i4"),
    GGMLType.I64: np.dtype("<i8"),
}

_BLOCK_DEQUANTIZERS: dict[GGMLType, BlockDequantizer] = {}


def _dequantizer(ggml_type: GGMLType) -> Callable[[BlockDequantizer], BlockDequantizer]:
    def wrap(fn: BlockDequantizer) -> BlockDequantizer:
        _BLOCK_DEQUANTIZERS[ggml_type] = fn
        return fn

    return wrap


# ---------------------------------------------------------------------------------------------------------------------
# public API


def supported_types() -> list[GGMLType]:
    """The ggml types `dequantize` accepts."""
    return sorted([*_PLAIN_DTYPES, GGMLType.BF16, *_BLOCK_DEQUANTIZERS])


def as_bytes(raw: np.ndarray | bytes | bytearray | memoryview) -> np.ndarray:
    """`raw` as a 1-D uint8 array (a view whenever possible; any start offset / alignment is fine)."""
    if isinstance(raw, np.ndarray):
        if raw.dtype != np.uint8:
            raw = np.ascontiguousarray(raw).view(np.uint8)
        return raw.reshape(-1)
    return np.frombuffer(raw, dtype=np.uint8)


def dequantize(
    raw: np.ndarray | bytes | bytearray | memoryview,
    ggml_type: int,
    shape: Sequence[int],
    dtype: npt.DTypeLike = np.float32,
) -> np.ndarray:
    """Decode the raw bytes of a ggml tensor of logical `shape` (numpy order: the last axis is the row) to `dtype`.

    `ggml_type` is a ggml type id (GGMLType or int). `dtype` is float32 by default; float16, bfloat16 (ml_dtypes) and
    float64 are computed in float32 and rounded once. The result is a new array, except that F32 data asked for as
    float32 needs no decoding and comes back as a read-only view of `raw` when it is aligned (as gguf-py does);
    `raw` is never modified.
    """
    ggml_type = _ggml_type(ggml_type)
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    if dtype.kind != "f" and dtype != np.dtype(ml_dtypes.bfloat16):
        raise TypeError(f"dequantize produces floating point values, not {dtype}")
    data = _checked_bytes(raw, ggml_type, shape)
    if ggml_type == GGMLType.F32 and dtype == np.float32 and sys.byteorder == "little" and (
            data.ctypes.data % 4 == 0):
        view = data.view(np.float32).reshape(shape)
        view.flags.writeable = False
        return view
    if ggml_type == GGMLType.BF16 or ggml_type in _PLAIN_DTYPES:
        return _convert_plain(data, ggml_type, dtype).reshape(shape)
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    blocks = data.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block_size), dtype=dtype)
    dequantize_blocks(blocks, ggml_type, out)
    return out.reshape(shape)


def dequantize_blocks(blocks: np.ndarray, ggml_type: int, out: np.ndarray) -> None:
    """Decode a (n_blocks, type_size) uint8 block matrix of a block type into `out` (n_blocks, block_size).

    `out` may be float32 (written directly) or another float dtype (converted chunk by chunk).
    """
    ggml_type = _ggml_type(ggml_type)
    fn = _BLOCK_DEQUANTIZERS.get(ggml_type)
    if fn is None:
        raise NotImplementedError(f"no block dequantization for ggml type {ggml_type.name}")
    block_size, _ = GGML_BLOCK_SIZES[ggml_type]
    step = max(1, _CHUNK_VALUES // block_size)
    direct = out.dtype == np.float32
    scratch = None if direct else np.empty((min(step, len(blocks)), block_size), np.float32)
    # huge e8m0 exponents overflow to inf, and garbage scales may be inf/nan: that is the data's value, not an error
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, len(blocks), step):
            stop = min(start + step, len(blocks))
            if direct:
                fn(blocks[start:stop], out[start:stop])
            else:
                chunk = scratch[: stop - start]
                fn(blocks[start:stop], chunk)
                out[start:stop] = chunk


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def _ggml_type(ggml_type: int) -> GGMLType:
    try:
        return GGMLType(int(ggml_type))
    except ValueError:
        raise ValueError(f"unknown ggml type id {ggml_type}") from None


def _checked_bytes(raw, ggml_type: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    if ggml_type not in _PLAIN_DTYPES and ggml_type != GGMLType.BF16 and ggml_type not in _BLOCK_DEQUANTIZERS:
        raise NotImplementedError(f"dequantization of ggml type {ggml_type.name} is not supported")
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    block_size, _ = GGML_BLOCK_SIZES[ggml_type]
    if shape and shape[-1] % block_size:
        raise ValueError(f"{ggml_type.name} rows must be a multiple of {block_size} values, got shape {shape}")
    n_values = int(np.prod(shape, dtype=np.int64))
    data = as_bytes(raw)
    expected = ggml_type.nbytes(n_values)
    if data.size != expected:
        raise ValueError(f"{ggml_type.name} tensor of shape {shape} needs {expected} bytes, got {data.size}")
    return data


def _convert_plain(data: np.ndarray, ggml_type: GGMLType, dtype: np.dtype) -> np.ndarray:
    """Unquantized types, converted a cache-sized chunk at a time (faster than one whole-array astype); F16 to
    float32 goes through a 65536-entry table, which beats numpy's own half-to-single conversion."""
    if ggml_type == GGMLType.F16 and dtype == np.float32:
        source, table = data.view("<u2"), _f16_table()
        out = np.empty(source.shape, dtype=np.float32)
        for start in range(0, source.size, _CHUNK_VALUES):
            np.take(table, source[start : start + _CHUNK_VALUES], out=out[start : start + _CHUNK_VALUES])
        return out
    source = data.view("<u2") if ggml_type == GGMLType.BF16 else data.view(_PLAIN_DTYPES[ggml_type])
    out = np.empty(source.shape, dtype=dtype)
    for start in range(0, source.size, _CHUNK_VALUES):
        chunk = source[start : start + _CHUNK_VALUES]
        out[start : start + _CHUNK_VALUES] = _bf16_to_float32(chunk) if ggml_type == GGMLType.BF16 else chunk
    return out


@functools.cache
def _f16_table() -> np.ndarray:
    """float32 value of every f16 bit pattern (NaN payloads included), as numpy converts them."""
    table = np.arange(65536, dtype=np.uint16).view("<f2").astype(np.float32)
    table.setflags(write=False)
    return table


def _bf16_to_float32(data: np.ndarray) -> np.ndarray:
    bits = data.view("<u2").astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian f16 field at byte `start` of every block, as float32 of shape (n, 1)."""
    return blocks[:, start : start + 2].copy().view("<f2").astype(np.float32)


def _f32(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 4].copy().view("<f4").astype(np.float32)


def _u16(blocks: np.ndarray, start: int, count: int) -> np.ndarray:
    """`count` little-endian uint16 fields from byte `start`, shape (n, count), native byte order."""
    return blocks[:, start : start + 2 * count].copy().view("<u2").astype(np.uint16, copy=False)


def _u32(blocks: np.ndarray, start: int, count: int) -> np.ndarray:
    return blocks[:, start : start + 4 * count].copy().view("<u4").astype(np.uint32, copy=False)


_SHIFT_4 = np.array([0, 4], dtype=np.uint8)
_SHIFT_2 = np.array([0, 2, 4, 6], dtype=np.uint8)
_SHIFT_1 = np.arange(8, dtype=np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 2, k): all low nibbles, then all high nibbles."""
    out = np.empty((*q.shape[:-1], 2, q.shape[-1]), dtype=np.uint8)
    np.bitwise_and(q, 0x0F, out=out[..., 0, :])
    np.right_shift(q, 4, out=out[..., 1, :])
    return out


def _interleaved_nibbles(q: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 2k): low and high nibble of each byte next to each other."""
    return ((q[..., None] >> _SHIFT_4) & 0x0F).reshape(*q.shape[:-1], -1)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 4, k): the 2-bit fields at bit 0, 2, 4 and 6 of every byte."""
    return (q[..., None, :] >> _SHIFT_2[:, None]) & 3


def _bits(q: np.ndarray) -> np.ndarray:
    """(..., k) bytes -> (..., 8, k): bit b of byte l at [..., b, l] (a transposed view)."""
    return np.unpackbits(q, axis=-1, bitorder="little").reshape(*q.shape, 8).swapaxes(-1, -2)


def _lookup(table: np.ndarray, codes: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[...] = table[codes] along axis 0 of `table`, written into `out` reshaped to the result shape."""
    target = out.reshape(codes.shape + table.shape[1:])
    np.take(table, codes, axis=0, out=target, mode="wrap")  # codes are in range; "wrap" skips the checks
    return target


def _lookup_ints(table: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """table[codes] for a small int8 table: the int8 values are then scaled by one mixed int8 x float32 multiply
    (numpy converts in its inner loop), which is cheaper than a float32 lookup followed by an in-place multiply."""
    return np.take(table, codes, mode="wrap")


def _sign_table() -> np.ndarray:
    """byte -> 8 float32 multipliers: -1 where bit j is set, +1 elsewhere."""
    bits = (np.arange(256, dtype=np.uint8)[:, None] >> _SHIFT_1) & 1
    return np.where(bits == 1, np.float32(-1), np.float32(1))


_SIGNS = _sign_table()
_KSIGNS = _SIGNS[tables.ksigns()]  # 7 stored sign bits -> 8 multipliers
_KVALUES_IQ4NL = np.asarray(tables.KVALUES_IQ4NL, dtype=np.int8)
_KVALUES_MXFP4 = np.asarray(tables.KVALUES_MXFP4, dtype=np.int8)


# ---------------------------------------------------------------------------------------------------------------------
# 32-value blocks


@_dequantizer(GGMLType.Q4_0)
def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, qs[16]: value j in the low nibble of byte j, value j+16 in its high nibble; y = d * (q - 8)
    values = _nibbles(blocks[:, 2:18]).view(np.int8) - np.int8(8)
    np.multiply(values.reshape(out.shape), _f16(blocks, 0), out=out)


@_dequantizer(GGMLType.Q4_1)
def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, m: f16, qs[16]; y = d * q + m
    np.multiply(_nibbles(blocks[:, 4:20]).reshape(out.shape), _f16(blocks, 0), out=out)
    out += _f16(blocks, 2)


def _five_bit_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5 blocks: bit j of the little-endian u32 qh is the 5th bit of value j."""
    high = np.unpackbits(qh, axis=1, bitorder="little").reshape(-1, 2, 16)
    codes = _nibbles(qs)
    codes |= high << 4
    return codes


@_dequantizer(GGMLType.Q5_0)
def _q5_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, qh: u32, qs[16]; y = d * (q - 16)
    values = _five_bit_codes(blocks[:, 2:6], blocks[:, 6:22]).view(np.int8) - np.int8(16)
    np.multiply(values.reshape(out.shape), _f16(blocks, 0), out=out)


@_dequantizer(GGMLType.Q5_1)
def _q5_1(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, m: f16, qh: u32, qs[16]; y = d * q + m
    np.multiply(_five_bit_codes(blocks[:, 4:8], blocks[:, 8:24]).reshape(out.shape), _f16(blocks, 0), out=out)
    out += _f16(blocks, 2)


@_dequantizer(GGMLType.Q8_0)
def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, qs: int8[32]; y = q * d
    np.multiply(blocks[:, 2:34].view(np.int8), _f16(blocks, 0), out=out)


@_dequantizer(GGMLType.IQ4_NL)
def _iq4_nl(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, qs[16] as Q4_0, each nibble indexing the non-linear levels kvalues_iq4nl
    values = _lookup_ints(_KVALUES_IQ4NL, _nibbles(blocks[:, 2:18]))
    np.multiply(values.reshape(out.shape), _f16(blocks, 0), out=out)


@_dequantizer(GGMLType.MXFP4)
def _mxfp4(blocks: np.ndarray, out: np.ndarray) -> None:
    # e: e8m0 exponent, qs[16] as Q4_0 with fp4 (e2m1) nibbles; the doubled fp4 values meet a halved scale
    values = _lookup_ints(_KVALUES_MXFP4, _nibbles(blocks[:, 1:17]))
    np.multiply(values.reshape(out.shape), _e8m0_half(blocks[:, 0:1]), out=out)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """2**(e - 127) / 2 as float32 (ggml_e8m0_to_fp32_half), including the subnormal results of e = 0, 1."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


# ---------------------------------------------------------------------------------------------------------------------
# 256-value "k-quant" blocks


@_dequantizer(GGMLType.Q8_K)
def _q8_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f32, qs: int8[256], bsums: int16[16] (sums for dot products, unused here); y = d * q
    np.multiply(blocks[:, 4:260].view(np.int8), _f32(blocks, 0), out=out)


@_dequantizer(GGMLType.Q2_K)
def _q2_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # scales[16] (4-bit scale | 4-bit min), qs[64] (2-bit values), d: f16, dmin: f16
    # two halves of 128 values; within a half, 2-bit field s of byte l is value s*32 + l; 16 values per scale
    n = len(blocks)
    scales = blocks[:, 0:16]
    values = out.reshape(n, 16, 16)
    codes = _crumbs(blocks[:, 16:80].reshape(n, 2, 32)).reshape(n, 16, 16)
    np.multiply(codes, (_f16(blocks, 80) * (scales & 0x0F))[:, :, None], out=values)
    values -= (_f16(blocks, 82) * (scales >> 4))[:, :, None]


@_dequantizer(GGMLType.Q3_K)
def _q3_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # hmask[32] (3rd bit), qs[64] (low 2 bits, laid out as Q2_K), scales[12] (16 6-bit scales), d: f16
    # value = low 2 bits - 4 where its hmask bit is clear; the hmask bit of value 32*g + l is bit g of hmask[l]
    n = len(blocks)
    codes = _crumbs(blocks[:, 32:96].reshape(n, 2, 32)).reshape(n, 8, 32)
    codes |= _bits(blocks[:, 0:32]) << 2
    values = codes.view(np.int8) - np.int8(4)
    scales = (_f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108]))[:, :, None]
    np.multiply(values.reshape(n, 16, 16), scales, out=out.reshape(n, 16, 16))


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """12 bytes -> 16 signed 6-bit scales: low nibbles from bytes 0-7, 2 high bits from bytes 8-11."""
    n = len(packed)
    low = _nibbles(packed[:, 0:8]).reshape(n, 16)
    high = _crumbs(packed[:, 8:12]).reshape(n, 16)
    return (low | (high << 4)).astype(np.int8) - np.int8(32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 6-bit scales and 8 6-bit mins (ggml's get_scale_min_k4)."""
    lo_scale, lo_min, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo_scale & 0x3F, (rest & 0x0F) | ((lo_scale >> 2) & 0x30)], axis=1)
    mins = np.concatenate([lo_min & 0x3F, (rest >> 4) | ((lo_min >> 2) & 0x30)], axis=1)
    return scales, mins


def _apply_k_scales(blocks: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    # y = (d * scale) * q - (dmin * min), 32 values per scale
    n = len(blocks)
    scales, mins = _k_scales(blocks[:, 4:16])
    values = out.reshape(n, 8, 32)
    np.multiply(codes.reshape(n, 8, 32), (_f16(blocks, 0) * scales)[:, :, None], out=values)
    values -= (_f16(blocks, 2) * mins)[:, :, None]


@_dequantizer(GGMLType.Q4_K)
def _q4_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, dmin: f16, scales[12], qs[128]: 4 chunks of 32 bytes, low nibbles then high nibbles
    n = len(blocks)
    _apply_k_scales(blocks, _nibbles(blocks[:, 16:144].reshape(n, 4, 32)), out)


@_dequantizer(GGMLType.Q5_K)
def _q5_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # d, dmin, scales[12], qh[32], qs[128]: as Q4_K plus a 5th bit: bit g of qh[l] for value 32*g + l
    n = len(blocks)
    codes = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    codes |= _bits(blocks[:, 16:48]) << 4
    _apply_k_scales(blocks, codes, out)


@_dequantizer(GGMLType.Q6_K)
def _q6_k(blocks: np.ndarray, out: np.ndarray) -> None:
    # ql[128] (low 4 bits), qh[64] (high 2 bits), scales: int8[16], d: f16; y = d * scale * (q - 32)
    # per half of 128 values: the low nibbles of ql[0:64] are values 0-63, the high nibbles values 64-127;
    # 2-bit field s of qh[l] belongs to value 32*s + l
    n = len(blocks)
    codes = _nibbles(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 2, 128)
    codes |= _crumbs(blocks[:, 128:192].reshape(n, 2, 32)).reshape(n, 2, 128) << 4
    values = codes.view(np.int8) - np.int8(32)
    scales = (_f16(blocks, 208) * blocks[:, 192:208].view(np.int8))[:, :, None]
    np.multiply(values.reshape(n, 16, 16), scales, out=out.reshape(n, 16, 16))


@_dequantizer(GGMLType.IQ4_XS)
def _iq4_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, scales_h: u16 (2 bits per sub-block), scales_l[4] (4 bits per sub-block), qs[128] as 8 IQ4_NL blocks
    n = len(blocks)
    high = (_u16(blocks, 2, 1) >> (2 * np.arange(8, dtype=np.uint16))) & 3
    scales = (_interleaved_nibbles(blocks[:, 4:8]) | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    values = _lookup_ints(_KVALUES_IQ4NL, _nibbles(blocks[:, 8:136].reshape(n, 8, 16)))
    np.multiply(values.reshape(n, 8, 32), (_f16(blocks, 0) * scales)[:, :, None], out=out.reshape(n, 8, 32))


@_dequantizer(GGMLType.TQ1_0)
def _tq1_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # qs[48] + qh[4]: base-3 digits stored as fixed-point fractions of 256; d: f16; y = d * (trit - 1)
    # digit k of a byte is ((byte * 3**k mod 256) * 3) >> 8: bytes 0-31 give values 32*k + l, bytes 32-47 values
    # 160 + 16*k + l (5 digits each), qh gives values 240 + 4*k + l (4 digits)
    n = len(blocks)
    codes = np.empty((n, 256), dtype=np.uint8)
    np.multiply(blocks[:, None, 0:32], _POW3[:5, None], out=codes[:, 0:160].reshape(n, 5, 32))
    np.multiply(blocks[:, None, 32:48], _POW3[:5, None], out=codes[:, 160:240].reshape(n, 5, 16))
    np.multiply(blocks[:, None, 48:52], _POW3[:4, None], out=codes[:, 240:256].reshape(n, 4, 4))
    np.multiply(_lookup_ints(_TRITS, codes), _f16(blocks, 52), out=out)


_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
_TRITS = (((np.arange(256, dtype=np.uint16) * 3) >> 8).astype(np.int16) - 1).astype(np.int8)


@_dequantizer(GGMLType.TQ2_0)
def _tq2_0(blocks: np.ndarray, out: np.ndarray) -> None:
    # qs[64] 2-bit values laid out as Q2_K, d: f16; y = d * (q - 1)
    values = _crumbs(blocks[:, 0:64].reshape(-1, 2, 32)).view(np.int8) - np.int8(1)
    np.multiply(values.reshape(out.shape), _f16(blocks, 64), out=out)


# ---------------------------------------------------------------------------------------------------------------------
# "i-quants": values from fixed grids (tables.py), signs stored apart


def _iq2_scales(d: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """IQ2_XS / IQ2_S: 8 bytes of two 4-bit scales -> d * (0.5 + s) * 0.25, one per 16 values."""
    return d * (np.float32(0.5) + _interleaved_nibbles(packed)) * np.float32(0.25)


@_dequantizer(GGMLType.IQ2_XXS)
def _iq2_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, then per 32 values 8 bytes: 4 grid indices and a u32 of 4 x 7 sign bits + a 4-bit scale
    n = len(blocks)
    groups = blocks[:, 2:66].reshape(n, 8, 8)
    aux = groups[:, :, 4:8].copy().view("<u4").astype(np.uint32, copy=False)  # (n, 8, 1)
    values = _lookup(tables.grid("iq2xxs"), groups[:, :, 0:4], out)  # (n, 8, 4, 8)
    values *= _KSIGNS[(aux >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 127]
    scale = _f16(blocks, 0) * (np.float32(0.5) + (aux[:, :, 0] >> 28).astype(np.float32)) * np.float32(0.25)
    out.reshape(n, 8, 32)[...] *= scale[:, :, None]


@_dequantizer(GGMLType.IQ2_XS)
def _iq2_xs(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, qs: u16[32] (9-bit grid index | 7 sign bits << 9), scales[8]
    n = len(blocks)
    qs = _u16(blocks, 2, 32)
    values = _lookup(tables.grid("iq2xs"), qs & 511, out)  # (n, 32, 8)
    values *= _KSIGNS[qs >> 9]
    out.reshape(n, 16, 16)[...] *= _iq2_scales(_f16(blocks, 0), blocks[:, 66:74])[:, :, None]


@_dequantizer(GGMLType.IQ2_S)
def _iq2_s(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, qs[32] (grid index low bytes), signs[32], qh[8] (2 high index bits per grid row), scales[8]
    n = len(blocks)
    high = _crumbs(blocks[:, 66:74]).transpose(0, 2, 1).reshape(n, 32).astype(np.uint16)
    index = blocks[:, 2:34].astype(np.uint16) | (high << 8)
    values = _lookup(tables.grid("iq2s"), index, out)  # (n, 32, 8)
    values *= _SIGNS[blocks[:, 34:66]]
    out.reshape(n, 16, 16)[...] *= _iq2_scales(_f16(blocks, 0), blocks[:, 74:82])[:, :, None]


@_dequantizer(GGMLType.IQ3_XXS)
def _iq3_xxs(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, qs[64] (indices of 4-value grid rows), u32[8]: per 32 values 4 x 7 sign bits + a 4-bit scale
    n = len(blocks)
    aux = _u32(blocks, 66, 8)
    _lookup(tables.grid("iq3xxs"), blocks[:, 2:66], out)
    values = out.reshape(n, 8, 4, 8)
    values *= _KSIGNS[(aux[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & 127]
    scale = _f16(blocks, 0) * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)
    out.reshape(n, 8, 32)[...] *= scale[:, :, None]


@_dequantizer(GGMLType.IQ3_S)
def _iq3_s(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, qs[64] (index low bytes), qh[8] (9th index bit: bit k % 8 of qh[k // 8]), signs[32], scales[4]
    n = len(blocks)
    high = np.unpackbits(blocks[:, 66:74], axis=1, bitorder="little").astype(np.uint16)
    _lookup(tables.grid("iq3s"), blocks[:, 2:66].astype(np.uint16) | (high << 8), out)
    values = out.reshape(n, 32, 8)
    values *= _SIGNS[blocks[:, 74:106]]
    scale = _f16(blocks, 0) * (1 + 2 * _interleaved_nibbles(blocks[:, 106:110]))
    out.reshape(n, 8, 32)[...] *= scale[:, :, None]


@_dequantizer(GGMLType.IQ1_S)
def _iq1_s(blocks: np.ndarray, out: np.ndarray) -> None:
    # d: f16, qs[32] (index low bytes), qh: u16[8] per 32 values: 4 x 3 high index bits, 3-bit scale, delta sign
    # y = d * (2 * scale + 1) * (grid value + delta)
    n = len(blocks)
    qh = _u16(blocks, 34, 8)
    high = (qh[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7
    _lookup(tables.grid("iq1s"), blocks[:, 2:34].astype(np.uint16) | (high.reshape(n, 32) << 8), out)
    values = out.reshape(n, 8, 32)
    values += np.where(qh & 0x8000, np.float32(-tables.IQ1S_DELTA), np.float32(tables.IQ1S_DELTA))[:, :, None]
    values *= (_f16(blocks, 0) * (2 * ((qh >> 12) & 7) + 1))[:, :, None]


@_dequantizer(GGMLType.IQ1_M)
def _iq1_m(blocks: np.ndarray, out: np.ndarray) -> None:
    # qs[32] (index low bytes), qh[16] (a nibble per grid row: 3 high index bits + delta sign),
    # scales: u16[4] holding 16 3-bit scales (one per 16 values) and, in their top nibbles, the f16 block scale d
    n = len(blocks)
    packed = _u16(blocks, 48, 4)
    d_bits = (
        (packed[:, 0] >> 12) | ((packed[:, 1] >> 8) & 0x00F0) | ((packed[:, 2] >> 4) & 0x0F00) | (packed[:, 3] & 0xF000)
    )
    d = d_bits.astype("<u2").view("<f2").astype(np.float32)[:, None]
    scales = ((packed[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7).reshape(n, 16)
    row_bits = _interleaved_nibbles(blocks[:, 32:48])  # (n, 32)
    index = blocks[:, 0:32].astype(np.uint16) | ((row_bits & 7).astype(np.uint16) << 8)
    values = _lookup(tables.grid("iq1s"), index, out)  # (n, 32, 8)
    values += np.where(row_bits & 8, np.float32(-tables.IQ1S_DELTA), np.float32(tables.IQ1S_DELTA))[:, :, None]
    out.reshape(n, 16, 16)[...] *= (d * (2 * scales + 1))[:, :, None]


@_dequantizer(GGMLType.NVFP4)
def _nvfp4(blocks: np.ndarray, out: np.ndarray) -> None:
    # 4 ue4m3 scales (one per 16 values), qs[32]: per 16 values 8 bytes, low nibbles first, fp4 (e2m1) values
    n = len(blocks)
    values = _lookup_ints(_KVALUES_MXFP4, _nibbles(blocks[:, 4:36].reshape(n, 4, 8)))
    np.multiply(values.reshape(n, 4, 16), _UE4M3_HALF[blocks[:, 0:4]][:, :, None], out=out.reshape(n, 4, 16))


def _ue4m3_half_table() -> np.ndarray:
    """Unsigned e4m3 byte (bias 7, 0x7F read as 0) -> value / 2, to meet the doubled fp4 values."""
    code = np.arange(256)
    exponent, mantissa = (code >> 3) & 0x0F, code & 0x07
    value = np.where(exponent == 0, mantissa * 2.0**-9, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    value[(code == 0) | (code == 0x7F)] = 0
    return (value * 0.5).astype(np.float32)


_UE4M3_HALF = _ue4m3_half_table()
