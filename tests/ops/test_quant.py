"""QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger, QLinearMatMul, ConvInteger, QLinearConv:
exact integer accumulation, rounding and saturation, granularities; compared with onnxruntime where it runs the case."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import carrack
from carrack.ir.dtypes import to_onnx

NATIVE = {np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16, np.int32,
                                 np.uint32, np.int64, np.uint64, np.bool_)}


def build(nodes: list[onnx.NodeProto], values: dict[str, np.ndarray | None], outputs: list[str], opset: int
          ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A model over `nodes`; plain numpy values become graph inputs, ml_dtypes values initializers (onnxruntime's
    Python API cannot feed those). Returns the model and its feed."""
    inputs, inits, feed = [], [], {}
    for name, v in values.items():
        if v is None:
            continue
        if v.dtype in NATIVE:
            inputs.append(helper.make_tensor_value_info(name, to_onnx(v.dtype), v.shape))
            feed[name] = v
        else:
            inits.append(numpy_helper.from_array(v, name))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_empty_tensor_value_info(o) for o in outputs],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10), feed


def node(op: str, inputs: dict[str, np.ndarray | None], out: str = "y", **attrs) -> onnx.NodeProto:
    names = [n if v is not None else "" for n, v in inputs.items()]
    while names and not names[-1]:
        names.pop()
    return helper.make_node(op, names, [out], **attrs)


def run_both(model: onnx.ModelProto, feed: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
    got = carrack.InferenceSession(model.SerializeToString()).run(None, feed)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feed)
    return got, want


def run_carrack(op: str, inputs: dict, opset: int, n_outputs: int = 1, **attrs):
    outs = ["y"] + [f"y{i}" for i in range(1, n_outputs)]
    n = node(op, inputs, **attrs)
    n.output[:] = outs
    model, _ = build([n], inputs, outs, opset)
    feed = {k: v for k, v in inputs.items() if v is not None}
    sess = carrack.InferenceSession(model.SerializeToString())
    inits = {t.name for t in model.graph.initializer}
    res = sess.run(None, {k: v for k, v in feed.items() if k not in inits})
    return res if n_outputs > 1 else res[0]


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


# -- QuantizeLinear ------------------------------------------------------------------------------------------------
def ties_and_noise(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Values that sit exactly on .5 rounding ties of x / scale, plus random ones, plus far out-of-range ones."""
    ties = (rng.integers(-300, 300, shape) + 0.5) * scale
    noise = rng.normal(0, 150 * scale, shape)
    x = np.where(rng.random(shape) < 0.5, ties, noise)
    x.flat[:2] = [1e6 * scale, -1e6 * scale]
    return x.astype(np.float32)


@pytest.mark.parametrize("zp_dtype, opset", [(t, v) for v in (10, 13, 19, 21) for t in (np.uint8, np.int8)]
                         + [(np.uint16, 21), (np.int16, 21)])
def test_quantize_per_tensor_matches_onnxruntime(zp_dtype, opset: int) -> None:
    rng = np.random.default_rng(opset)
    scale = np.array(0.125, np.float32)  # a power of two: the ties stay exact
    x = ties_and_noise(rng, (4, 50), 0.125)
    zp = np.array(3 if zp_dtype in (np.uint8, np.uint16) else -3, zp_dtype)
    inputs = {"x": x, "s": scale, "zp": zp}
    model, feed = build([node("QuantizeLinear", inputs)], inputs, ["y"], opset)
    assert_same(*run_both(model, feed))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_quantize_per_axis_matches_onnxruntime(axis: int) -> None:
    rng = np.random.default_rng(7)
    x = ties_and_noise(rng, (3, 4, 5), 0.25)
    n = x.shape[axis]
    inputs = {"x": x, "s": rng.choice([0.25, 0.5, 2.0], n).astype(np.float32),
              "zp": rng.integers(0, 20, n).astype(np.uint8)}
    model, feed = build([node("QuantizeLinear", inputs, axis=axis)], inputs, ["y"], 13)
    assert_same(*run_both(model, feed))


@pytest.mark.parametrize("zp_dtype", [np.uint8, np.int8, np.int16, ml_dtypes.int4, ml_dtypes.uint4])
def test_quantize_dequantize_blocked_matches_onnxruntime(zp_dtype) -> None:
    rng = np.random.default_rng(3)
    x = ties_and_noise(rng, (4, 7), 0.5)
    scale = rng.choice([0.5, 1.0, 4.0], (4, 3)).astype(np.float32)
    zp = rng.integers(0, 3, (4, 3)).astype(zp_dtype)
    inputs = {"x": x, "s": scale, "zp": zp}
    nodes = [node("QuantizeLinear", inputs, "q", axis=1, block_size=3),
             node("DequantizeLinear", {"q": None, "s": scale, "zp": zp}, axis=1, block_size=3)]
    nodes[1].input[:] = ["q", "s", "zp"]
    model, feed = build(nodes, inputs, ["y"], 21)
    assert_same(*run_both(model, feed))


def test_quantize_blocked_by_hand() -> None:
    x = np.array([[6, 12, 50, 5], [1, 8, 4, 5]], np.float32)
    scale = np.array([[1.5, 2.5], [3.0, 4.0]], np.float32)
    got = run_carrack("QuantizeLinear", {"x": x, "s": scale, "zp": np.array([[0, 1], [1, 0]], np.uint8)}, 21,
                      axis=1, block_size=2)
    # 6/1.5=4, 12/1.5=8, 50/2.5=20 (+1), 5/2.5=2 (+1); 1/3 -> 0 (+1), 8/3 -> 3 (+1), 4/4=1, 5/4=1.25 -> 1
    np.testing.assert_array_equal(got, [[4, 8, 21, 3], [1, 4, 1, 1]])
    # A last, partial block: 5 columns, block 2 -> 3 scale columns.
    got = run_carrack("QuantizeLinear", {"x": np.arange(5, dtype=np.float32)[None], "s": np.array(
        [[1.0, 2.0, 4.0]], np.float32)}, 21, axis=1, block_size=2)
    np.testing.assert_array_equal(got, [[0, 1, 1, 2, 1]])


def test_quantize_round_half_even_before_zero_point() -> None:
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5], np.float32)
    got = run_carrack("QuantizeLinear", {"x": x, "s": np.array(1, np.float32), "zp": np.array(1, np.int8)}, 13)
    np.testing.assert_array_equal(got, [1, 3, 3, 1, -1, -1])  # round(x) + 1, not round(x + 1)


@pytest.mark.parametrize("zp_dtype, lo, hi", [
    (np.uint8, 0, 255), (np.int8, -128, 127), (np.uint16, 0, 65535), (np.int16, -32768, 32767),
    (ml_dtypes.uint4, 0, 15), (ml_dtypes.int4, -8, 7), (ml_dtypes.uint2, 0, 3), (ml_dtypes.int2, -2, 1)])
def test_quantize_saturates(zp_dtype, lo: int, hi: int) -> None:
    x = np.array([-1e9, -70000, -3, -1, 0, 1, 3, 70000, 1e9], np.float32)
    opset = 25 if zp_dtype in (ml_dtypes.uint2, ml_dtypes.int2) else 21
    got = run_carrack("QuantizeLinear", {"x": x, "s": np.array(1, np.float32), "zp": np.zeros((), zp_dtype)}, opset)
    assert got.dtype == np.dtype(zp_dtype)
    np.testing.assert_array_equal(got.astype(np.int64), np.clip([-1e9, -70000, -3, -1, 0, 1, 3, 70000, 1e9], lo, hi))


def test_quantize_output_dtype_without_zero_point() -> None:
    x = np.array([1.0, -300.0], np.float32)
    got = run_carrack("QuantizeLinear", {"x": x, "s": np.array(1, np.float32)}, 21, output_dtype=T.INT16)
    assert got.dtype == np.int16 and got.tolist() == [1, -300]
    got = run_carrack("QuantizeLinear", {"x": x, "s": np.array(1, np.float32)}, 21)
    assert got.dtype == np.uint8 and got.tolist() == [1, 0]


@pytest.mark.parametrize("zp_dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
@pytest.mark.parametrize("saturate", [0, 1])
def test_quantize_float8_matches_onnxruntime(zp_dtype, saturate: int) -> None:
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(0, 3, 100), [1e4, -1e4, 0.0, 4.5]]).astype(np.float32)
    if not saturate:  # onnxruntime departs from the spec here: NaN for e5m2 overflow, 448 for e4m3fn up to 496
        x = x[np.abs(x) < 4.6]
    inputs = {"x": x, "s": np.array(0.01, np.float32), "zp": np.zeros((), zp_dtype)}
    nodes = [node("QuantizeLinear", inputs, "q", saturate=saturate), helper.make_node("Cast", ["q"], ["y"], to=T.FLOAT)]
    model, feed = build(nodes, inputs, ["y"], 19)
    assert_same(*run_both(model, feed))


def test_quantize_float8_saturation_by_hand() -> None:
    x = np.array([0, 1, 2, 100000, 200, -np.inf], np.float32)
    inputs = {"x": x, "s": np.array(2, np.float32), "zp": np.zeros((), ml_dtypes.float8_e4m3fn)}
    got = run_carrack("QuantizeLinear", inputs, 19).astype(np.float32)
    np.testing.assert_array_equal(got, [0, 0.5, 1, 448, 96, -448])
    got = run_carrack("QuantizeLinear", inputs, 19, saturate=0).astype(np.float32)
    assert np.isnan(got[3]) and np.isnan(got[5])


def test_quantize_float4() -> None:
    x = np.array([[0, 2.5, 4.8, 8.6], [-30, -20, 6, 9]], np.float32)
    inputs = {"x": x, "s": np.array([2, 3], np.float32), "zp": np.zeros(2, ml_dtypes.float4_e2m1fn)}
    got = run_carrack("QuantizeLinear", inputs, 23, axis=0)
    assert got.dtype == ml_dtypes.float4_e2m1fn
    np.testing.assert_array_equal(got.astype(np.float32), [[0, 1, 2, 4], [-6, -6, 2, 3]])


def test_quantize_float16_and_int32_inputs() -> None:
    got = run_carrack("QuantizeLinear", {"x": np.array([1, 2.5, -7], np.float16), "s": np.array(0.5, np.float16),
                                         "zp": np.array(0, np.int8)}, 19)
    assert got.tolist() == [2, 5, -14]
    got = run_carrack("QuantizeLinear", {"x": np.array([10, 15, -1000], np.int32), "s": np.array(10, np.float32),
                                         "zp": np.array(0, np.int8)}, 13)
    assert got.tolist() == [1, 2, -100]


def test_quantize_precision_attribute() -> None:
    # 2049 / 1 is 2049 in float32 but 2048 in float16: precision=FLOAT16 divides in float16.
    inputs = {"x": np.array([2049.0], np.float32), "s": np.array(1, np.float32), "zp": np.array(0, np.int16)}
    assert run_carrack("QuantizeLinear", inputs, 23).tolist() == [2049]
    assert run_carrack("QuantizeLinear", inputs, 23, precision=T.FLOAT16).tolist() == [2048]


# -- DequantizeLinear ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("x_dtype", [np.uint8, np.int8, np.int32])
@pytest.mark.parametrize("opset", [10, 13, 19])
def test_dequantize_matches_onnxruntime(x_dtype, opset: int) -> None:
    rng = np.random.default_rng(opset)
    info = np.iinfo(x_dtype)
    x = rng.integers(max(info.min, -10 ** 6), min(info.max, 10 ** 6), (3, 40), endpoint=True).astype(x_dtype)
    inputs = {"x": x, "s": np.array(0.0371, np.float32),
              "zp": None if x_dtype == np.int32 else np.array(info.max // 3, x_dtype)}
    model, feed = build([node("DequantizeLinear", inputs)], inputs, ["y"], opset)
    got, want = run_both(model, feed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert got[0].dtype == np.float32


def test_dequantize_per_axis_and_float16() -> None:
    x = np.array([[0, 100, 255], [10, 20, 30]], np.uint8)
    inputs = {"x": x, "s": np.array([0.5, 2], np.float16), "zp": np.array([100, 10], np.uint8)}
    got = run_carrack("DequantizeLinear", inputs, 19, axis=0)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, np.array([[-50, 0, 77.5], [0, 20, 40]], np.float16))


@pytest.mark.parametrize("x_dtype", [ml_dtypes.int4, ml_dtypes.uint4, np.int16, np.uint16,
                                     ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float4_e2m1fn])
def test_dequantize_exotic_inputs(x_dtype) -> None:
    x = np.array([0, 1, 2, 3, 6], np.float32).astype(x_dtype)
    zp = np.array(1, np.float32).astype(x_dtype)
    got = run_carrack("DequantizeLinear", {"x": x, "s": np.array(1.5, np.float32), "zp": zp}, 23)
    np.testing.assert_array_equal(got, (x.astype(np.float32) - 1) * np.float32(1.5))


def test_dequantize_output_dtype_and_e8m0_scale() -> None:
    x = np.array([-8, 3, 7], np.int8)
    got = run_carrack("DequantizeLinear", {"x": x, "s": np.array(0.25, np.float32)}, 23, output_dtype=T.BFLOAT16)
    assert got.dtype == ml_dtypes.bfloat16 and got.astype(np.float32).tolist() == [-2, 0.75, 1.75]
    scale = np.array([4.0, 0.5], np.float32).astype(ml_dtypes.float8_e8m0fnu)
    got = run_carrack("DequantizeLinear", {"x": np.array([[1, 2], [3, 4]], np.int8), "s": scale}, 24, axis=1,
                      output_dtype=T.FLOAT)
    assert got.dtype == np.float32 and got.tolist() == [[4, 1], [12, 2]]


def test_dequantize_blocked_by_hand() -> None:
    x = np.arange(12, dtype=np.int8).reshape(2, 6)
    scale = np.array([[1, 10, 100], [2, 20, 200]], np.float32)
    got = run_carrack("DequantizeLinear", {"x": x, "s": scale}, 21, axis=-1, block_size=2)
    np.testing.assert_array_equal(got, x * np.repeat(scale, 2, axis=1))


def test_bad_scale_shapes_are_errors() -> None:
    with pytest.raises(Exception, match="per-axis"):
        run_carrack("DequantizeLinear", {"x": np.zeros((2, 3), np.int8), "s": np.ones(2, np.float32)}, 13, axis=1)
    with pytest.raises(Exception, match="block"):
        run_carrack("DequantizeLinear", {"x": np.zeros((2, 7), np.int8), "s": np.ones((2, 2), np.float32)}, 21,
                    axis=1, block_size=3)


# -- DynamicQuantizeLinear -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("data", [
    [0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [-1.0, -2.0, -3.0], [-0.5, 0.25, 1e-3, 7.0], [1.0, 2.5, -4.0, 1e-7] * 10])
def test_dynamic_quantize_matches_onnxruntime(data: list[float]) -> None:
    x = np.array(data, np.float32).reshape(-1, 1)
    n = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
    model, feed = build([n], {"x": x}, ["y", "s", "z"], 11)
    assert_same(*run_both(model, feed))


def test_dynamic_quantize_random_matches_onnxruntime() -> None:
    x = np.random.default_rng(0).normal(0.3, 2, (16, 33)).astype(np.float32)
    model, feed = build([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])], {"x": x},
                        ["y", "s", "z"], 11)
    assert_same(*run_both(model, feed))


# -- MatMulInteger / QLinearMatMul ---------------------------------------------------------------------------------
def int_reference(a, a_zp, b, b_zp) -> np.ndarray:
    """Exact int64 matmul of the shifted operands, wrapped to int32."""
    acc = np.matmul(a.astype(np.int64) - a_zp, b.astype(np.int64) - b_zp)
    return acc.astype(np.int32)


@pytest.mark.parametrize("a_dtype, b_dtype", [(np.uint8, np.uint8), (np.int8, np.int8), (np.uint8, np.int8)])
def test_matmul_integer_exact_at_extremes(a_dtype, b_dtype) -> None:
    k = 40000  # 255 * 255 * 40000 > 2**31: the accumulator must wrap like int32, bit-exactly
    a_info, b_info = np.iinfo(a_dtype), np.iinfo(b_dtype)
    a = np.full((3, k), a_info.max, a_dtype)
    a[1] = a_info.min
    a[2, ::2] = a_info.min
    b = np.full((k, 2), b_info.min, b_dtype)
    b[:, 1] = b_info.max
    a_zp, b_zp = np.array(a_info.min, a_dtype), np.array(b_info.max, b_dtype)
    got = run_carrack("MatMulInteger", {"A": a, "B": b, "a_zp": a_zp, "b_zp": b_zp}, 10)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, int_reference(a, a_zp, b, b_zp))


def test_matmul_integer_random_large_k_matches_int64() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (2, 3, 5000), dtype=np.uint8)
    b = rng.integers(-128, 128, (5000, 4), dtype=np.int8)
    got = run_carrack("MatMulInteger", {"A": a, "B": b, "a_zp": np.array(200, np.uint8),
                                        "b_zp": np.array(-100, np.int8)}, 10)
    np.testing.assert_array_equal(got, int_reference(a, 200, b, -100))


def test_matmul_integer_per_row_and_per_column_zero_points() -> None:
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (4, 6), dtype=np.uint8)
    b = rng.integers(0, 256, (6, 3), dtype=np.uint8)
    a_zp = rng.integers(0, 256, 4).astype(np.uint8)
    b_zp = rng.integers(0, 256, 3).astype(np.uint8)
    inputs = {"A": a, "B": b, "a_zp": a_zp, "b_zp": b_zp}
    got = run_carrack("MatMulInteger", inputs, 10)
    np.testing.assert_array_equal(got, int_reference(a, a_zp[:, None], b, b_zp))
    model, feed = build([node("MatMulInteger", {"A": a, "B": b, "a_zp": None, "b_zp": b_zp})],
                        {"A": a, "B": b, "b_zp": b_zp}, ["y"], 10)
    model.graph.node[0].input[:] = ["A", "B", "", "b_zp"]
    assert_same(*run_both(model, feed))


def test_matmul_integer_broadcasting_and_vectors() -> None:
    rng = np.random.default_rng(4)
    a = rng.integers(-128, 128, (2, 1, 3, 5), dtype=np.int8)
    b = rng.integers(-128, 128, (4, 5, 2), dtype=np.int8)
    got = run_carrack("MatMulInteger", {"A": a, "B": b}, 10)
    np.testing.assert_array_equal(got, int_reference(a, 0, b, 0))
    v = rng.integers(0, 256, 5, dtype=np.uint8)
    got = run_carrack("MatMulInteger", {"A": v, "B": b, "a_zp": np.array(7, np.uint8)}, 10)
    np.testing.assert_array_equal(got, int_reference(v, 7, b, 0))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("opset", [10, 21])
def test_qlinear_matmul_matches_onnxruntime(dtype, opset: int) -> None:
    rng = np.random.default_rng(opset)
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, (2, 8, 64), endpoint=True, dtype=dtype)
    b = rng.integers(info.min, info.max, (64, 16), endpoint=True, dtype=dtype)
    inputs = {"a": a, "a_s": np.array(0.02, np.float32), "a_zp": np.array(info.min + 100, dtype),
              "b": b, "b_s": np.array(0.003, np.float32), "b_zp": np.array(info.max - 120, dtype),
              "y_s": np.array(0.25, np.float32), "y_zp": np.array(info.min + 128, dtype)}
    model, feed = build([node("QLinearMatMul", inputs)], inputs, ["y"], opset)
    assert_same(*run_both(model, feed))  # float32 requantization, as onnxruntime: bit-exact


def test_qlinear_matmul_per_row_and_column_by_hand() -> None:
    a = np.array([[1, 2], [3, 4]], np.uint8)
    b = np.array([[1, 0], [0, 1]], np.uint8)
    inputs = {"a": a, "a_s": np.array([1, 2], np.float32), "a_zp": np.array([0, 1], np.uint8),
              "b": b, "b_s": np.array([1, 0.5], np.float32), "b_zp": np.array([0, 0], np.uint8),
              "y_s": np.array(0.5, np.float32), "y_zp": np.array(10, np.uint8)}
    got = run_carrack("QLinearMatMul", inputs, 10)
    # real = (a - a_zp) * a_s per row  @  (b - b_zp) * b_s per column, requantized by 0.5 with zero point 10
    real = ((a - np.array([[0], [1]])) * np.array([[1], [2]])) @ (b * np.array([1, 0.5]))
    np.testing.assert_array_equal(got, np.rint(real / 0.5) + 10)


def test_qlinear_matmul_saturates() -> None:
    a = np.full((1, 100), 255, np.uint8)
    b = np.full((100, 2), 255, np.uint8)
    inputs = {"a": a, "a_s": np.array(1, np.float32), "a_zp": np.array(0, np.uint8), "b": b,
              "b_s": np.array([[1, -1]], np.float32).reshape(2), "b_zp": np.array([0, 0], np.uint8),
              "y_s": np.array(1, np.float32), "y_zp": np.array(0, np.int8)}
    assert run_carrack("QLinearMatMul", inputs, 21).tolist() == [[127, -128]]


# -- ConvInteger / QLinearConv -------------------------------------------------------------------------------------
def conv_reference(x, x_zp, w, w_zp, strides, pads, dilations, group) -> np.ndarray:
    """Direct int64 cross-correlation (loops over output positions: small cases only)."""
    xs = np.pad(x.astype(np.int64) - x_zp, [(0, 0), (0, 0)] + [(pads[i], pads[i + 2]) for i in range(2)])
    ws = w.astype(np.int64) - np.asarray(w_zp).reshape(-1, 1, 1, 1)
    n, c, h, wd = xs.shape
    m, cg, kh, kw = ws.shape
    oh = (h - (kh - 1) * dilations[0] - 1) // strides[0] + 1
    ow = (wd - (kw - 1) * dilations[1] - 1) // strides[1] + 1
    out = np.zeros((n, m, oh, ow), np.int64)
    per_group = m // group
    for oc in range(m):
        g = oc // per_group
        for i in range(oh):
            for j in range(ow):
                patch = xs[:, g * cg:(g + 1) * cg, i * strides[0]:i * strides[0] + (kh - 1) * dilations[0] + 1:
                           dilations[0], j * strides[1]:j * strides[1] + (kw - 1) * dilations[1] + 1:dilations[1]]
                out[:, oc, i, j] = (patch * ws[oc]).sum(axis=(1, 2, 3))
    return out.astype(np.int32)


@pytest.mark.parametrize("strides, pads, dilations, group", [
    ([1, 1], [0, 0, 0, 0], [1, 1], 1), ([2, 1], [1, 2, 0, 1], [1, 2], 1), ([1, 1], [1, 1, 1, 1], [1, 1], 2),
    ([1, 2], [0, 0, 0, 0], [2, 1], 4)])
def test_conv_integer_exact(strides, pads, dilations, group) -> None:
    rng = np.random.default_rng(group)
    x = rng.integers(0, 256, (2, 4, 7, 8), dtype=np.uint8)
    x[0, :, :3] = 255  # extremes
    w = rng.integers(-128, 128, (4, 4 // group, 3, 2), dtype=np.int8)
    w[0] = -128
    w_zp = rng.integers(-5, 5, 4).astype(np.int8)
    inputs = {"x": x, "w": w, "x_zp": np.array(17, np.uint8), "w_zp": w_zp}
    got = run_carrack("ConvInteger", inputs, 10, strides=strides, pads=pads, dilations=dilations, group=group)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, conv_reference(x, 17, w, w_zp, strides, pads, dilations, group))


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_conv_integer_auto_pad_matches_onnxruntime(auto_pad: str) -> None:
    rng = np.random.default_rng(9)
    x = rng.integers(0, 256, (1, 2, 6, 5), dtype=np.uint8)
    w = rng.integers(0, 256, (3, 2, 2, 3), dtype=np.uint8)
    inputs = {"x": x, "w": w, "x_zp": np.array(128, np.uint8), "w_zp": np.array(3, np.uint8)}
    model, feed = build([node("ConvInteger", inputs, auto_pad=auto_pad, strides=[2, 2])], inputs, ["y"], 10)
    assert_same(*run_both(model, feed))


def test_conv_integer_large_channel_count_is_exact() -> None:
    rng = np.random.default_rng(11)
    x = np.where(rng.random((1, 512, 4, 4)) < 0.5, 255, 0).astype(np.uint8)
    w = np.where(rng.random((2, 512, 3, 3)) < 0.5, 255, 0).astype(np.uint8)
    got = run_carrack("ConvInteger", {"x": x, "w": w}, 10)
    np.testing.assert_array_equal(got, conv_reference(x, 0, w, 0, [1, 1], [0, 0, 0, 0], [1, 1], 1))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_conv_matches_onnxruntime(dtype, per_channel: bool) -> None:
    rng = np.random.default_rng(int(per_channel))
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, (2, 3, 6, 6), endpoint=True, dtype=dtype)
    w = rng.integers(-127, 127, (4, 3, 3, 3), endpoint=True, dtype=np.int8)
    w_scale = rng.uniform(0.001, 0.01, 4 if per_channel else 1).astype(np.float32).reshape(-1 if per_channel else ())
    inputs = {"x": x, "x_s": np.array(0.02, np.float32), "x_zp": np.array(info.min + 120, dtype), "w": w,
              "w_s": w_scale, "w_zp": np.zeros(4 if per_channel else (), np.int8),
              "y_s": np.array(0.05, np.float32), "y_zp": np.array(info.min + 128, dtype),
              "B": rng.integers(-2000, 2000, 4).astype(np.int32)}
    model, feed = build([node("QLinearConv", inputs, pads=[1, 1, 1, 1], strides=[1, 2])], inputs, ["y"], 10)
    assert_same(*run_both(model, feed))
