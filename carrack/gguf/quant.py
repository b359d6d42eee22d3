"""Quantization of float32 data to the ggml 32-value block types Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1.

The arithmetic is ggml's reference quantizer (quantize_row_*_ref) step by step in float32, so the bytes equal those
of ggml and of gguf-py: the scale is computed in float32 and only stored as f16, values are scaled by the float32
reciprocal of that scale, Q8_0 rounds half away from zero, and the 4/5-bit types truncate `x * id + offset`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType

BlockQuantizer = Callable[[np.ndarray], np.ndarray]

# Blocks per chunk, so that the float32 temporaries of one chunk stay small.
_CHUNK_BLOCKS = 4096

_BLOCK_QUANTIZERS: dict[GGMLType, BlockQuantizer] = {}


def _quantizer(ggml_type: GGMLType) -> Callable[[BlockQuantizer], BlockQuantizer]:
    def wrap(fn: BlockQuantizer) -> BlockQuantizer:
        _BLOCK_QUANTIZERS[ggml_type] = fn
        return fn

    return wrap


def quantizable_types() -> list[GGMLType]:
    """The ggml types `quantize` produces."""
    return sorted(_BLOCK_QUANTIZERS)


def quantize(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """Quantize `x` (float32, last axis a multiple of 32) to ggml blocks: uint8 of shape (..., K / 32 * type_size)."""
    ggml_type = GGMLType(int(ggml_type))
    fn = _BLOCK_QUANTIZERS.get(ggml_type)
    if fn is None:
        raise NotImplementedError(f"quantization to ggml type {ggml_type.name} is not supported")
    x = np.asarray(x, dtype=np.float32)
    block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
    if x.ndim == 0 or x.shape[-1] % block_size:
        raise ValueError(f"{ggml_type.name} needs a last axis that is a multiple of {block_size}, got shape {x.shape}")
    blocks = x.reshape(-1, block_size)
    out = np.empty((blocks.shape[0], type_size), dtype=np.uint8)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        for start in range(0, len(blocks), _CHUNK_BLOCKS):
            out[start : start + _CHUNK_BLOCKS] = fn(blocks[start : start + _CHUNK_BLOCKS])
    return out.reshape(*x.shape[:-1], x.shape[-1] // block_size * type_size)


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def _f16_bytes(value: np.ndarray) -> np.ndarray:
    """(n, 1) float32 -> (n, 2) little-endian f16 bytes (round to nearest even, as ggml's fp32 -> fp16)."""
    return value.astype("<f2").view(np.uint8)


def _reciprocal(d: np.ndarray) -> np.ndarray:
    """1 / d, and 0 where d is 0 (ggml: `id = d ? 1.0f/d : 0.0f`)."""
    return np.where(d == 0, np.float32(0), np.float32(1) / d)


def _signed_absmax(blocks: np.ndarray) -> np.ndarray:
    """The value of largest magnitude of each block, with its sign (the first one on ties), shape (n, 1)."""
    index = np.abs(blocks).argmax(axis=1)[:, None]
    return np.take_along_axis(blocks, index, axis=1)


def _truncate_codes(scaled: np.ndarray, top: int) -> np.ndarray:
    """ggml's `MIN(top, (int8_t)(v))` for the non-negative float32 `v` of the 4/5-bit quantizers."""
    return np.trunc(scaled).astype(np.uint8).clip(0, top)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """(n, 32) codes -> (n, 16) bytes: value j in the low nibble of byte j, value j + 16 in its high nibble."""
    return (codes[:, :16] & 0x0F) | (codes[:, 16:] << 4)


def _high_bits(codes: np.ndarray) -> np.ndarray:
    """(n, 32) 5-bit codes -> (n, 4) bytes of the little-endian u32 whose bit j is bit 4 of value j."""
    return np.packbits(codes >> 4, axis=1, bitorder="little")


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf: round to nearest, ties away from zero (exact for every float32)."""
    whole = np.trunc(v)
    tie = np.abs(v - whole) == 0.5
    return np.where(tie, whole + np.sign(v), np.rint(v))


# ---------------------------------------------------------------------------------------------------------------------
# block quantizers: (n, 32) float32 -> (n, type_size) uint8


@_quantizer(GGMLType.Q8_0)
def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    codes = _round_half_away(blocks * _reciprocal(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), codes], axis=1)


@_quantizer(GGMLType.Q4_0)
def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _signed_absmax(blocks) / np.float32(-8)
    codes = _truncate_codes(blocks * _reciprocal(d) + np.float32(8.5), 15)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(codes)], axis=1)


@_quantizer(GGMLType.Q4_1)
def _q4_1(blocks: np.ndarray) -> np.ndarray:
    low = blocks.min(axis=1, keepdims=True)
    d = (blocks.max(axis=1, keepdims=True) - low) / np.float32(15)
    codes = _truncate_codes((blocks - low) * _reciprocal(d) + np.float32(0.5), 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(low), _pack_nibbles(codes)], axis=1)


@_quantizer(GGMLType.Q5_0)
def _q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _signed_absmax(blocks) / np.float32(-16)
    codes = _truncate_codes(blocks * _reciprocal(d) + np.float32(16.5), 31)
    return np.concatenate([_f16_bytes(d), _high_bits(codes), _pack_nibbles(codes)], axis=1)


@_quantizer(GGMLType.Q5_1)
def _q5_1(blocks: np.ndarray) -> np.ndarray:
    low = blocks.min(axis=1, keepdims=True)
    d = (blocks.max(axis=1, keepdims=True) - low) / np.float32(31)
    codes = _truncate_codes((blocks - low) * _reciprocal(d) + np.float32(0.5), 31)
    return np.concatenate([_f16_bytes(d), _f16_bytes(low), _high_bits(codes), _pack_nibbles(codes)], axis=1)
