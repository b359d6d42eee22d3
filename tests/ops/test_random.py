"""Random generators: shapes and dtypes as onnxruntime gives them, seeded determinism, and the distributions."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack


def _model(op: str, inputs: dict[str, np.ndarray], out_type: int = TensorProto.FLOAT, opset: int = 15,
           **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, list(inputs), ["y"], **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), None)
                    for n, v in inputs.items()]
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info("y", out_type, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _run(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    return carrack.InferenceSession(model.SerializeToString()).run(None, feed)[0]


def _ort(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]


@pytest.mark.parametrize("op,attrs", [("RandomNormal", {"mean": 2.0, "scale": 3.0}),
                                      ("RandomUniform", {"low": -1.0, "high": 5.0})])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16])
def test_generators_shape_dtype_and_moments(op, attrs, dtype):
    model = _model(op, {}, out_type=dtype, shape=[200, 300], dtype=dtype, **attrs)
    got = _run(model, {})
    assert got.shape == (200, 300) and got.dtype == helper.tensor_dtype_to_np_dtype(dtype)
    if dtype != TensorProto.FLOAT16:  # onnxruntime has no float16 kernels for these
        expected = _ort(model, {})
        assert got.shape == expected.shape and got.dtype == expected.dtype
    x = got.astype(np.float64)
    if op == "RandomNormal":
        assert abs(x.mean() - 2.0) < 0.05 and abs(x.std() - 3.0) < 0.05
    else:
        assert x.min() >= -1.0 and x.max() <= 5.0
        assert abs(x.mean() - 2.0) < 0.05 and abs(x.var() - 3.0) < 0.1  # variance of U(-1, 5) is 36 / 12


def test_generator_bfloat16():
    got = _run(_model("RandomNormal", {}, out_type=TensorProto.BFLOAT16, opset=22, shape=[10],
                      dtype=TensorProto.BFLOAT16), {})
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == (10,)


def test_seed_makes_runs_repeat_and_no_seed_does_not():
    seeded = carrack.InferenceSession(_model("RandomUniform", {}, shape=[50], seed=3.0).SerializeToString())
    a, b = seeded.run(None, {})[0], seeded.run(None, {})[0]
    np.testing.assert_array_equal(a, b)
    other = _run(_model("RandomUniform", {}, shape=[50], seed=4.0), {})
    assert not np.array_equal(a, other)
    unseeded = carrack.InferenceSession(_model("RandomUniform", {}, shape=[50]).SerializeToString())
    assert not np.array_equal(unseeded.run(None, {})[0], unseeded.run(None, {})[0])


@pytest.mark.parametrize("op", ["RandomNormalLike", "RandomUniformLike"])
def test_like_ops_take_shape_and_dtype(op):
    x = np.zeros((3, 4, 5), dtype=np.float64)
    model = _model(op, {"x": x}, out_type=TensorProto.DOUBLE)
    got = _run(model, {"x": x})
    assert got.shape == _ort(model, {"x": x}).shape == (3, 4, 5) and got.dtype == np.float64
    ints = np.zeros((2, 7), dtype=np.int64)
    model = _model(op, {"x": ints}, out_type=TensorProto.FLOAT16, dtype=TensorProto.FLOAT16, seed=1.0)
    got = _run(model, {"x": ints})
    assert got.shape == (2, 7) and got.dtype == np.float16


def test_like_op_with_integer_input_needs_dtype():
    ints = np.zeros((2, 7), dtype=np.int64)
    with pytest.raises(carrack.RunFailure):
        _run(_model("RandomUniformLike", {"x": ints}), {"x": ints})


@pytest.mark.parametrize("dtype,out", [(None, TensorProto.FLOAT), (TensorProto.DOUBLE, TensorProto.DOUBLE),
                                       (TensorProto.INT64, TensorProto.INT64), (TensorProto.BOOL, TensorProto.BOOL)])
def test_bernoulli_dtype_and_frequency(dtype, out):
    p = np.linspace(0, 1, 11, dtype=np.float32)[None].repeat(4000, axis=0)
    attrs = {} if dtype is None else {"dtype": dtype}
    model = _model("Bernoulli", {"p": p}, out_type=out, seed=5.0, **attrs)
    got = _run(model, {"p": p})
    expected = _ort(model, {"p": p})
    assert got.shape == expected.shape and got.dtype == expected.dtype
    freq = got.astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(freq, p[0], atol=0.03)
    assert freq[0] == 0 and freq[-1] == 1
    np.testing.assert_array_equal(got, _run(model, {"p": p}))


@pytest.mark.parametrize("dtype", [TensorProto.INT32, TensorProto.INT64])
def test_multinomial_frequencies(dtype):
    probs = np.array([[0.1, 0.2, 0.7, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0]])
    with np.errstate(divide="ignore"):
        logits = np.log(probs).astype(np.float32) + 3.0
    model = _model("Multinomial", {"x": logits}, out_type=dtype, opset=7, sample_size=20000, dtype=dtype, seed=2.0)
    got = _run(model, {"x": logits})
    expected = _ort(model, {"x": logits})
    assert got.shape == expected.shape == (3, 20000) and got.dtype == expected.dtype
    assert got.min() >= 0 and got.max() <= 3
    for row, p in zip(got, probs):
        np.testing.assert_allclose(np.bincount(row, minlength=4) / row.size, p, atol=0.015)
    np.testing.assert_array_equal(got, _run(model, {"x": logits}))


def test_multinomial_default_dtype_is_int32():
    logits = np.zeros((2, 5), dtype=np.float32)
    got = _run(_model("Multinomial", {"x": logits}, out_type=TensorProto.INT32, opset=7, sample_size=3), {"x": logits})
    assert got.dtype == np.int32 and got.shape == (2, 3)
