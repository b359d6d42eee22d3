"""Reshape/Transpose chains around attention and Gemm that the transformer fusions see through."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto

from tests.passes.test_transformer_fusions import HEADS, HIDDEN, MS, SIZE, Builder, _x, check


def _dims(b: Builder, x: str, *parts) -> str:
    """A Reshape target: ints, or ("dim", i) for x's dim i (computed from Shape, as exporters write it)."""
    pieces = []
    for p in parts:
        if isinstance(p, tuple):
            pieces.append(b.op("Gather", b.op("Shape", x), b.const([p[1]], np.int64), axis=0))
        else:
            pieces.append(b.const([p], np.int64))
    return b.op("Concat", *pieces, axis=0)


def test_key_transposed_through_a_reshape_chain(tmp_path):
    """K^T as torch's dynamo export writes it: (B, N, L, H) -> (B*N, L, H) -> (B*N, H, L) -> (B, N, H, L). The
    fused MultiHeadAttention takes K straight from its (B, L, D) source, with no copies left."""
    b = Builder()
    x = b.input("x", ["B", "S", HIDDEN])
    q3, k3, v3 = b.op("Split", b.op("MatMul", x, b.const(_x(HIDDEN, 3 * HIDDEN) * 0.5)),
                      b.const([HIDDEN] * 3, np.int64), n_out=3, axis=2)
    heads = [b.op("Transpose", b.op("Reshape", t, b.const([0, 0, HEADS, SIZE], np.int64)), perm=[0, 2, 1, 3])
             for t in (q3, k3, v3)]
    q, k, v = heads
    k3d = b.op("Reshape", k, _dims(b, k, -1, ("dim", 2), SIZE))
    kt = b.op("Reshape", b.op("Transpose", k3d, perm=[0, 2, 1]), _dims(b, x, ("dim", 0), HEADS, SIZE, -1))
    probs = b.op("Softmax", b.op("Mul", b.op("MatMul", q, kt), b.const(SIZE ** -0.5)), axis=-1)
    out = b.op("Transpose", b.op("MatMul", probs, v), perm=[0, 2, 1, 3])
    y = b.op("Reshape", out, b.const([0, 0, HIDDEN], np.int64))
    ops = check(b.model([y], 17), {"x": _x(2, 5, HIDDEN)}, "attention_fusion", tmp_path=tmp_path)
    assert ops == Counter({("", "MatMul"): 1, ("", "Split"): 1, (MS, "MultiHeadAttention"): 1})


def test_key_chain_with_another_order_is_not_taken():
    """A chain that reshapes (B*N, H, L) heads in the wrong order is no plain K^T: the fusion keeps it."""
    b = Builder()
    x = b.input("x", ["B", "S", HIDDEN])
    k = b.op("Transpose", b.op("Reshape", x, b.const([0, 0, HEADS, SIZE], np.int64)), perm=[0, 2, 1, 3])
    kt = b.op("Reshape", k, _dims(b, x, ("dim", 0), HEADS, SIZE, -1))  # a reshape, not a transpose, of K
    q = b.op("Transpose", b.op("Reshape", x, b.const([0, 0, HEADS, SIZE], np.int64)), perm=[0, 2, 1, 3])
    probs = b.op("Softmax", b.op("MatMul", q, kt), axis=-1)
    y = b.op("MatMul", probs, q)
    ops = check(b.model([y], 17), {"x": _x(2, 5, HIDDEN)}, "attention_fusion")
    assert ops[(MS, "MultiHeadAttention")] == 1 and ops[("", "Transpose")] >= 1


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias", [None, "vector", "row"])
def test_gemm_between_reshapes_becomes_matmul(trans_b, bias, tmp_path):
    b = Builder()
    x = b.input("x", ["B", "S", HIDDEN])
    w = _x(3 * HIDDEN, HIDDEN) if trans_b else _x(HIDDEN, 3 * HIDDEN)
    inputs = [b.op("Reshape", x, b.const([-1, HIDDEN], np.int64)), b.const(w)]
    if bias:
        inputs.append(b.const(_x(3 * HIDDEN) if bias == "vector" else _x(1, 3 * HIDDEN)))
    flat = b.op("Gemm", *inputs, transB=trans_b)
    y = b.op("Reshape", flat, _dims(b, x, ("dim", 0), ("dim", 1), 3 * HIDDEN))
    for shape in [(2, 5), (1, 1)]:
        ops = check(b.model([y], 17), {"x": _x(*shape, HIDDEN)}, "gemm_reshape_to_matmul", tmp_path=tmp_path)
    assert ops[("", "Gemm")] == 0 and ops[("", "MatMul")] == 1 and ops[("", "Reshape")] == 0
    assert ops[("", "Add")] == (1 if bias else 0)


@pytest.mark.parametrize("attrs", [{"alpha": 2.0}, {"transA": 1}, {"beta": 0.5}])
def test_gemm_between_reshapes_kept_when_not_a_plain_product(attrs):
    b = Builder()
    x = b.input("x", ["B", HIDDEN, HIDDEN])
    flat = b.op("Reshape", x, b.const([-1, HIDDEN], np.int64))
    y2 = b.op("Gemm", flat, b.const(_x(HIDDEN, HIDDEN)), b.const(_x(HIDDEN)), **attrs)
    y = b.op("Reshape", y2, b.const([-1, HIDDEN, HIDDEN], np.int64))
    check(b.model([y], 17), {"x": _x(1, HIDDEN, HIDDEN)}, "gemm_reshape_to_matmul", fired=0)


def test_gemm_with_a_per_row_bias_is_kept():
    b = Builder()
    x = b.input("x", [2, 3, HIDDEN])
    flat = b.op("Reshape", x, b.const([-1, HIDDEN], np.int64))
    y2 = b.op("Gemm", flat, b.const(_x(HIDDEN, HIDDEN)), b.const(_x(6, 1)))
    y = b.op("Reshape", y2, b.const([2, 3, HIDDEN], np.int64))
    check(b.model([y], 17), {"x": _x(2, 3, HIDDEN)}, "gemm_reshape_to_matmul", fired=0)


def test_int_gemm_between_reshapes():
    b = Builder()
    x = b.input("x", [2, 3, 4], TensorProto.INT32)
    flat = b.op("Reshape", x, b.const([-1, 4], np.int64))
    y2 = b.op("Gemm", flat, b.const(np.arange(20).reshape(4, 5), np.int32))
    y = b.op("Reshape", y2, b.const([2, 3, 5], np.int64))
    feeds = {"x": np.arange(24, dtype=np.int32).reshape(2, 3, 4)}
    import carrack

    got = carrack.InferenceSession(b.model([y], 17)).run(None, feeds)[0]
    np.testing.assert_array_equal(got, feeds["x"] @ np.arange(20, dtype=np.int32).reshape(4, 5))
