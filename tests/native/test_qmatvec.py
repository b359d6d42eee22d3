"""qmatvec.c against carrack's numpy dequantize-then-matmul, for every type it decodes."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.gguf.dequant import dequantize
from carrack.gguf.types import GGMLType
from carrack.native import qmatvec
from tests.native.portable import native_and_portable
from tests.native.test_qdot import random_blocks

TYPES = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.Q6_K]
needs_native = pytest.mark.skipif(qmatvec.library() is None, reason="native kernels unavailable (no C compiler?)")


portable_library, build = native_and_portable("qmatvec", qmatvec.library, "intrinsics where it has them",
                                              "native kernels unavailable (no C compiler?)")


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matches_dequantize_then_matmul(build, ggml_type, m):
    n, k = 37, 512
    rows = random_blocks(ggml_type, n, k)
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    weight = dequantize(rows, ggml_type, (n, k)).astype(np.float64)
    expected = x.astype(np.float64) @ weight.T
    got = qmatvec.matvec(rows, ggml_type, x)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@needs_native
def test_threads_split_rows_without_changing_results():
    rows = random_blocks(GGMLType.Q8_0, 1000, 1024)  # over PARALLEL_MIN_BYTES: split over threads
    x = np.random.default_rng(2).standard_normal((1, 1024)).astype(np.float32)
    np.testing.assert_array_equal(qmatvec.matvec(rows, GGMLType.Q8_0, x, threads=2),
                                  qmatvec.matvec(rows, GGMLType.Q8_0, x, threads=1))


@needs_native
def test_other_types_are_left_to_numpy():
    assert qmatvec.matvec(np.zeros((2, 20), np.uint8), GGMLType.Q4_1, np.zeros((1, 32), np.float32)) is None
    assert not qmatvec.supports(GGMLType.Q5_K)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_decode_rows_equals_dequantize(build, ggml_type):
    rows = random_blocks(ggml_type, 9, 512, seed=3)
    out = np.full((4, 512), np.nan, dtype=np.float32)
    assert qmatvec.decode_rows(rows, ggml_type, 3, 7, out)
    np.testing.assert_array_equal(out, dequantize(rows[3:7], ggml_type, (4, 512)))
