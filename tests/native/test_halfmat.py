"""halfmat.c (F16 / BF16 weights times float32 activations) against numpy's float32(W) @ x."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.native import halfmat
from tests.native.portable import native_and_portable

# n * k * 2 bytes over 1 MiB, so 4 threads get 4 pieces (halfmat.PARALLEL_MIN_BYTES); k not a multiple of 32
N, K = 523, 1030


def random_weight(kind: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(16-bit weight as the kernel reads it, the same values as float32)."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.02
    if kind == "F16":
        weight = values.astype(np.float16)
        return weight, weight.astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # BF16: truncated float32
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


portable_library, build = native_and_portable("halfmat", halfmat.library, "F16C / AVX-512 where it has them",
                                              "native kernels unavailable (no C compiler?)")


def expected_product(x: np.ndarray, weight32: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ weight32.astype(np.float64).T).astype(np.float32)


@pytest.mark.parametrize("kind", ["F16", "BF16"])
@pytest.mark.parametrize("m", [1, 3, 6])
def test_matvec_matches_numpy_at_every_thread_count(build, kind, m):
    weight, weight32 = random_weight(kind, N, K)
    x = np.random.default_rng(1).standard_normal((m, K)).astype(np.float32)
    expected = expected_product(x, weight32)
    results = [halfmat.matvec(weight, x, threads) for threads in (1, 2, 4)]
    for got in results:
        assert got.shape == (m, N) and got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # whole rows per thread: the thread count changes no sum
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_decode_rows_widens_exactly(build, kind):
    weight, weight32 = random_weight(kind, N, K, seed=2)
    weight[0, :5] = np.array([0x0001, 0x8000, 0x7C00, 0x03FF, 0xFBFF], np.uint16).view(weight.dtype)  # edge bits
    weight32 = weight.astype(np.float32) if kind == "F16" else (weight.astype(np.uint32) << 16).view(np.float32)
    for threads in (1, 4):
        out = np.empty((N - 3, K), np.float32)
        assert halfmat.decode_rows(weight, 3, N, out, threads)
        np.testing.assert_array_equal(out, weight32[3:])
        first = np.empty((2, K), np.float32)
        assert halfmat.decode_rows(weight, 0, 2, first, threads)
        np.testing.assert_array_equal(first, weight32[:2])


def test_bad_weight_and_shapes_are_named():
    with pytest.raises(ValueError, match="float16 .*uint16"):
        halfmat.matvec(np.zeros((4, 8), np.float32), np.zeros((1, 8), np.float32))
    if halfmat.library() is None:
        pytest.skip("native kernels unavailable (no C compiler?)")
    with pytest.raises(ValueError, match=r"expected \(rows, 8\)"):
        halfmat.matvec(np.zeros((4, 8), np.float16), np.zeros((1, 7), np.float32))
    with pytest.raises(ValueError, match="out must be"):
        halfmat.decode_rows(np.zeros((4, 8), np.float16), 0, 2, np.empty((3, 8), np.float32))


@pytest.mark.parametrize("m", [1, 3])
def test_product_group_equals_one_matvec_per_matrix(build, m):
    """One call for matrices that share x (F16 and BF16 mixed, row counts not multiples of 4): each output equals
    that matrix's own matvec bit for bit at 1, 2 and 4 threads (pieces straddle matrices, and a piece's last rows
    of one matrix prefetch the next one's first rows)."""
    weights = [random_weight("F16", N, K, seed=3)[0], random_weight("BF16", 67, K, seed=4)[0],
               random_weight("F16", 130, K, seed=5)[0]]
    x = np.random.default_rng(6).standard_normal((m, K)).astype(np.float32)
    expected = [halfmat.matvec(w, x, 1) for w in weights]
    for threads in (1, 2, 4):
        got = halfmat.ProductGroup(weights, threads)(x)
        assert [g.shape for g in got] == [(m, N), (m, 67), (m, 130)]
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)


def test_product_group_matches_numpy_past_the_streamed_rows(build):
    """Rows streamed eight at a time with the next eight prefetched (from the same matrix or the next one), 1- to
    7-row tails, k with a 6-value tail."""
    weights = [random_weight("F16", n, 70, seed=n)[0] for n in (8, 17, 7, 1, 31)]
    x = np.random.default_rng(7).standard_normal((1, 70)).astype(np.float32)
    for got, w in zip(halfmat.ProductGroup(weights, 1)(x), weights):
        expected = expected_product(x, w.astype(np.float32))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_product_group_refuses_bad_groups_by_name():
    f16 = np.zeros((4, 8), np.float16)
    with pytest.raises(ValueError, match="share their row length"):
        halfmat.ProductGroup([f16, np.zeros((4, 16), np.float16)])
    with pytest.raises(ValueError, match="1 to 8 matrices, got 0"):
        halfmat.ProductGroup([])
    with pytest.raises(ValueError, match="1 to 8 matrices, got 9"):
        halfmat.ProductGroup([f16] * 9)
    with pytest.raises(ValueError, match="float16 .*uint16"):
        halfmat.ProductGroup([f16, np.zeros((4, 8), np.float32)])
    if halfmat.library() is None:
        pytest.skip("native kernels unavailable (no C compiler?)")
    with pytest.raises(ValueError, match=r"expected \(rows, 8\)"):
        halfmat.ProductGroup([f16])(np.zeros((1, 7), np.float32))
