"""MatMul, Gemm, Einsum and Det against onnxruntime across opsets, shapes and dtypes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import carrack


def _model(op: str, inputs: dict[str, np.ndarray | None], opset: int, **attrs) -> onnx.ModelProto:
    names = [n if v is not None else "" for n, v in inputs.items()]
    while names and names[-1] == "":
        names.pop()
    node = helper.make_node(op, names, ["y"], **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for n, v in inputs.items() if v is not None]
    elem = helper.np_dtype_to_tensor_dtype(next(iter(inputs.values())).dtype)
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _compare(op: str, inputs: dict[str, np.ndarray | None], opset: int, rtol=1e-5, atol=1e-5, **attrs) -> np.ndarray:
    model = _model(op, inputs, opset, **attrs)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = carrack.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol)
    return got


def _run(op: str, inputs: dict[str, np.ndarray | None], opset: int, **attrs) -> np.ndarray:
    """carrack alone, for cases onnxruntime does not implement."""
    model = _model(op, inputs, opset, **attrs)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    return carrack.InferenceSession(model.SerializeToString()).run(None, feeds)[0]


def _rand(*shape, dtype=np.float32, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("opset", [7, 9, 13])
@pytest.mark.parametrize(("a_shape", "b_shape"), [
    ((3, 4), (4, 5)), ((4,), (4,)), ((4,), (2, 4, 5)), ((2, 3, 4), (4,)), ((2, 1, 3, 4), (5, 4, 2)), ((1, 4), (4, 1)),
])
def test_matmul_matches_onnxruntime(opset, a_shape, b_shape):
    _compare("MatMul", {"a": _rand(*a_shape), "b": _rand(*b_shape, seed=1)}, opset)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float64])
def test_matmul_other_dtypes(dtype):
    a = np.random.default_rng(0).integers(-4, 5, (3, 4)).astype(dtype)
    b = np.random.default_rng(1).integers(-4, 5, (4, 2)).astype(dtype)
    _compare("MatMul", {"a": a, "b": b}, 13)


def test_matmul_float16_accumulates_in_float32():
    a = np.full((1, 4096), 0.1, np.float16)
    b = np.ones((4096, 1), np.float16)
    got = _compare("MatMul", {"a": a, "b": b}, 13, rtol=2e-3)
    np.testing.assert_allclose(got.astype(np.float32), [[409.6]], rtol=2e-3)


@pytest.mark.parametrize("opset", [7, 9, 11, 13])
@pytest.mark.parametrize("c_shape", [(), (1,), (5,), (3, 1), (3, 5)])
@pytest.mark.parametrize(("trans_a", "trans_b"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm_matches_onnxruntime(opset, c_shape, trans_a, trans_b):
    a = _rand(4, 3) if trans_a else _rand(3, 4)
    b = _rand(5, 4, seed=1) if trans_b else _rand(4, 5, seed=1)
    c = _rand(*c_shape, seed=2)
    _compare("Gemm", {"a": a, "b": b, "c": c}, opset, transA=trans_a, transB=trans_b, alpha=0.5, beta=-2.0)


@pytest.mark.parametrize("opset", [11, 13])
def test_gemm_without_c(opset):
    _compare("Gemm", {"a": _rand(3, 4), "b": _rand(4, 5, seed=1), "c": None}, opset, alpha=2.0)


@pytest.mark.parametrize("opset", [1, 6])
def test_gemm_before_opset7_broadcast_attribute(opset):
    a, b, c = _rand(3, 4), _rand(5, 4, seed=1), _rand(5, seed=2)
    got = _run("Gemm", {"a": a, "b": b, "c": c}, opset, transB=1, broadcast=1, beta=0.5)
    np.testing.assert_allclose(got, a @ b.T + 0.5 * c, rtol=1e-5, atol=1e-6)


def test_gemm_integers():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    b = np.arange(8, dtype=np.int32).reshape(4, 2)
    c = np.array([1, -1], np.int32)
    got = _run("Gemm", {"a": a, "b": b, "c": c}, 13, alpha=2.0)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, 2 * (a @ b) + c)


@pytest.mark.parametrize(("equation", "shapes"), [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("ba,ac", [(3, 4), (4, 5)]),  # implicit output "bc"
    ("Ab,bA", [(2, 3), (3, 2)]),
    ("zA,Ab", [(2, 3), (3, 4)]),  # implicit output "bz"
    ("cB,Ba", [(2, 3), (3, 4)]),  # implicit output "ac"
    ("bA,Ac", [(2, 3), (3, 4)]),
    ("ii->i", [(4, 4)]),
    ("ii", [(4, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk", [(2, 3, 4), (2, 4, 5)]),
    ("bij , bjk -> bik", [(2, 3, 4), (2, 4, 5)]),
    ("i,i", [(5,), (5,)]),
    ("ij->", [(3, 4)]),
    ("ijk->kji", [(2, 3, 4)]),
])
def test_einsum_matches_onnxruntime(equation, shapes):
    inputs = {f"x{i}": _rand(*s, seed=i) for i, s in enumerate(shapes)}
    _compare("Einsum", inputs, 12, equation=equation)


def test_einsum_implicit_output_order():
    from carrack.ops.linalg import explicit_equation

    assert explicit_equation("ba,ac") == "ba,ac->bc"
    assert explicit_equation("Ba,aC") == "Ba,aC->BC"
    assert explicit_equation("zA,Ab") == "zA,Ab->bz"
    assert explicit_equation("...ij,...jk") == "...ij,...jk->...ik"


def test_einsum_integers():
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    b = np.arange(12, dtype=np.int64).reshape(3, 4)
    _compare("Einsum", {"a": a, "b": b}, 12, equation="ij,jk->ik")


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (2, 2, 3, 3)])
def test_det_matches_onnxruntime(shape):
    _compare("Det", {"x": _rand(*shape)}, 11, rtol=1e-4)


def test_det_float64():
    x = _rand(2, 3, 3, dtype=np.float64)
    got = _run("Det", {"x": x}, 22)
    assert got.dtype == np.float64 and got.shape == (2,)
    np.testing.assert_allclose(got, np.linalg.det(x), rtol=1e-12)


def test_det_singular_and_float16():
    x = np.array([[1.0, 2.0], [2.0, 4.0]], np.float16)
    got = _run("Det", {"x": x}, 22)
    assert got.dtype == np.float16 and got.shape == ()
    assert float(got) == 0.0
