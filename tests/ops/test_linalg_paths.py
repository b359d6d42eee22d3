"""MatMul and Gemm fast paths: (..., K) @ (K, N) as one flat product, and Gemm into a planned buffer."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.ir.graph import Node
from carrack.ops.linalg import Gemm, MatMul

rng = np.random.default_rng(1)


def _kernel(cls, op: str, **attrs):
    return cls(Node(op, ["a", "b", "c"], ["y"], attrs), 13, None)


@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_of_batched_rows(layout, dtype):
    a = rng.standard_normal((3, 5, 6)).astype(dtype)
    if layout == "strided":
        a = rng.standard_normal((3, 5, 12)).astype(dtype)[..., ::2]
    elif layout == "transposed":
        a = np.ascontiguousarray(a.transpose(1, 0, 2)).transpose(1, 0, 2)
    b = rng.standard_normal((6, 4)).astype(dtype)
    want = np.einsum("bsk,kn->bsn", a.astype(np.float64), b.astype(np.float64))
    k = _kernel(MatMul, "MatMul")
    np.testing.assert_allclose(k.run(a, b), want, rtol=1e-5, atol=1e-5)
    out = np.full((3, 5, 4), np.nan, dtype)
    assert k.run_into(out, a, b) is out
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    wrong = np.empty((5, 4), dtype)
    np.testing.assert_allclose(k.run_into(wrong, a, b), want, rtol=1e-5, atol=1e-5)


def test_matmul_of_zero_rows():
    k = _kernel(MatMul, "MatMul")
    assert k.run(np.ones((2, 0, 3), np.float32), np.ones((3, 4), np.float32)).shape == (2, 0, 4)
    out = np.empty((2, 0, 4), np.float32)
    assert k.run_into(out, np.ones((2, 0, 3), np.float32), np.ones((3, 4), np.float32)).shape == (2, 0, 4)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.5, 2.0), (1.0, 0.0)])
@pytest.mark.parametrize("bias_shape", [None, (4,), (1, 4), (3, 1), (3, 4), ()])
def test_gemm_into_a_planned_buffer(trans_a, trans_b, alpha, beta, bias_shape):
    a = rng.standard_normal((6, 3) if trans_a else (3, 6)).astype(np.float32)
    b = rng.standard_normal((4, 6) if trans_b else (6, 4)).astype(np.float32)
    c = None if bias_shape is None else rng.standard_normal(bias_shape).astype(np.float32)
    want = alpha * ((a.T if trans_a else a) @ (b.T if trans_b else b)).astype(np.float64)
    if c is not None:
        want = want + beta * c
    k = _kernel(Gemm, "Gemm", transA=trans_a, transB=trans_b, alpha=alpha, beta=beta)
    c_before = None if c is None else c.copy()
    np.testing.assert_allclose(k.run(a, b, c), want, rtol=1e-5, atol=1e-5)
    out = np.full((3, 4), np.nan, np.float32)
    np.testing.assert_allclose(k.run_into(out, a, b, c), want, rtol=1e-5, atol=1e-5)
    if c is not None:
        np.testing.assert_array_equal(c, c_before)  # the bias is never written


def test_gemm_with_integers_and_a_wider_bias():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.arange(12, dtype=np.int32).reshape(3, 4)
    c = np.arange(4, dtype=np.int64)
    k = _kernel(Gemm, "Gemm", alpha=2.0)
    got = k.run_into(np.empty((2, 4), np.int32), a, b, c)
    np.testing.assert_array_equal(got, (2 * (a @ b) + c).astype(np.int32))
    assert got.dtype == np.int32
