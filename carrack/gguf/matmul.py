"""Matrix products with ggml-quantized weights, without materialising the float weight.

`quantized_matmul` computes ``x @ dequantize(W).T`` for a weight W of shape (N, K) stored as ggml blocks (each row of
K values is K / block_size blocks). It walks W a chunk of rows at a time: the chunk is decoded into one reused float32
buffer and multiplied with a single BLAS call, so the extra memory is one chunk (at most ~4 MiB, at least 16 rows)
instead of the N * K * 4 bytes of the float weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from carrack.gguf.dequant import _PLAIN_DTYPES, as_bytes, dequantize_blocks, supported_types
from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType

# Budget of the decoded-weight buffer, and the range of rows per chunk it is turned into.
_CHUNK_BYTES = 4 << 20
_MIN_CHUNK_ROWS = 16
_MAX_CHUNK_ROWS = 256


def chunk_rows(k: int) -> int:
    """Rows of a (N, K) weight decoded per chunk: about 4 MiB of float32, between 16 and 256 rows."""
    return max(_MIN_CHUNK_ROWS, min(_MAX_CHUNK_ROWS, _CHUNK_BYTES // (4 * max(k, 1))))


def quantized_matmul(
    x: np.ndarray,
    w_raw: np.ndarray | bytes | bytearray | memoryview,
    ggml_type: int,
    w_shape: Sequence[int],
    rows_per_chunk: int | None = None,
) -> np.ndarray:
    """``x @ W.T`` for float32 `x` of shape (..., K) and the ggml-encoded weight W of shape `w_shape` = (N, K).

    Returns float32 of shape (..., N). Any type `carrack.gguf.dequant.dequantize` reads is accepted.
    """
    ggml_type = GGMLType(int(ggml_type))
    if ggml_type not in supported_types():
        raise NotImplementedError(f"ggml type {ggml_type.name} has no dequantization")
    n, k = _weight_shape(w_shape, ggml_type)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] != k:
        raise ValueError(f"x of shape {x.shape} does not match a weight of shape ({n}, {k}): its last axis must be {k}")
    data = as_bytes(w_raw)
    row_bytes = ggml_type.nbytes(k)
    if data.size != n * row_bytes:
        raise ValueError(f"a {ggml_type.name} weight of shape ({n}, {k}) takes {n * row_bytes} bytes, got {data.size}")
    rows = data.reshape(n, row_bytes)

    lhs = x.reshape(-1, k)
    result_t = np.empty((n, lhs.shape[0]), dtype=np.float32)  # (N, M): each chunk fills contiguous rows
    step = max(1, min(n, rows_per_chunk or chunk_rows(k)))
    buffer = np.empty((step, k), dtype=np.float32)
    lhs_t = lhs.T
    for start in range(0, n, step):
        stop = min(start + step, n)
        weight = buffer[: stop - start]
        _decode_rows(rows[start:stop], ggml_type, weight)
        np.dot(weight, lhs_t, out=result_t[start:stop])
    return np.ascontiguousarray(result_t.T).reshape(*x.shape[:-1], n)


def _weight_shape(w_shape: Sequence[int], ggml_type: GGMLType) -> tuple[int, int]:
    if len(w_shape) != 2 or any(int(s) < 0 for s in w_shape):
        raise ValueError(f"the weight shape must be (N, K), got {tuple(w_shape)}")
    n, k = (int(s) for s in w_shape)
    block_size = GGML_BLOCK_SIZES[ggml_type][0]
    if k % block_size:
        raise ValueError(f"{ggml_type.name} rows must be a multiple of {block_size} values, got K = {k}")
    return n, k


def _decode_rows(rows: np.ndarray, ggml_type: GGMLType, out: np.ndarray) -> None:
    """Decode (r, row_bytes) raw rows into the float32 (r, K) buffer `out`."""
    if ggml_type in _PLAIN_DTYPES:
        out[...] = rows.reshape(-1).view(_PLAIN_DTYPES[ggml_type]).reshape(out.shape)
    elif ggml_type == GGMLType.BF16:
        bits = rows.reshape(-1).view("<u2").reshape(out.shape)
        out.view(np.uint32)[...] = bits.astype(np.uint32) << np.uint32(16)
    else:
        block_size, type_size = GGML_BLOCK_SIZES[ggml_type]
        dequantize_blocks(rows.reshape(-1, type_size), ggml_type, out.reshape(-1, block_size))
