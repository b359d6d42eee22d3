"""Cast, CastLike and BitCast: spec tables, rounding, strings, sub-byte types; onnxruntime where it has the case."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

import carrack
from carrack.ir.dtypes import to_numpy, to_onnx
from carrack.ops.cast import cast_array

NAN, INF = np.nan, np.inf


def chain_model(x_type: int, casts: list[dict], opset: int, ir_version: int = 10) -> onnx.ModelProto:
    """x -> Cast(**casts[0]) -> Cast(**casts[1]) ... -> y (a second Cast lets onnxruntime return exotic types)."""
    nodes, name = [], "x"
    for i, attrs in enumerate(casts):
        out = "y" if i == len(casts) - 1 else f"t{i}"
        nodes.append(helper.make_node("Cast", [name], [out], **attrs))
        name = out
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, None)],
                              [helper.make_tensor_value_info("y", casts[-1]["to"], None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


def run_carrack(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return carrack.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]


def run_ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep Cast pairs unfused
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def cast(x: np.ndarray, to: int, opset: int = 25, **attrs) -> np.ndarray:
    return run_carrack(chain_model(to_onnx(x.dtype), [dict(to=to, **attrs)], opset), x)


def bits(a: np.ndarray) -> list[int]:
    return a.view(np.uint8).tolist()


# -- ordinary numeric casts against onnxruntime ------------------------------------------------------------------
NUMERIC = [T.FLOAT, T.DOUBLE, T.FLOAT16, T.INT8, T.UINT8, T.INT16, T.UINT16, T.INT32, T.UINT32, T.INT64, T.UINT64,
           T.BOOL]


@pytest.mark.parametrize("src", NUMERIC)
@pytest.mark.parametrize("dst", NUMERIC)
def test_numeric_casts_match_onnxruntime(src: int, dst: int) -> None:
    rng = np.random.default_rng(src * 100 + dst)
    values = np.concatenate([rng.uniform(0, 100, 20).round(1), [0, 1, 2, 3, 100, 127]])
    if to_numpy(src).kind in "fib":
        values = np.concatenate([values, -values])  # negatives where the source type has them
    x = values.astype(to_numpy(src))
    if to_numpy(dst).kind == "u":  # negative float -> unsigned is undefined: keep those out
        x = np.abs(x) if to_numpy(src).kind == "f" else x
    model = chain_model(src, [dict(to=dst)], opset=19)
    got, want = run_carrack(model, x), run_ort(model, x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_integer_narrowing_wraps() -> None:
    np.testing.assert_array_equal(cast(np.array([200, -56, 300, 65535], np.int32), T.INT8), [-56, -56, 44, -1])
    np.testing.assert_array_equal(cast(np.array([-1, 256], np.int64), T.UINT8), [255, 0])


def test_float_to_bool_and_back() -> None:
    x = np.array([0.0, -0.0, 0.5, NAN, -INF], np.float32)
    np.testing.assert_array_equal(cast(x, T.BOOL), [False, False, True, True, True])
    np.testing.assert_array_equal(cast(np.array([True, False]), T.FLOAT16), np.array([1, 0], np.float16))


# -- float8: the spec's saturation tables --------------------------------------------------------------------------
SPECIAL = np.array([0.0, -0.0, NAN, INF, -INF, 1e6, -1e6, 1.0, 0.3], np.float32)
FLOAT8 = {T.FLOAT8E4M3FN: 448.0, T.FLOAT8E4M3FNUZ: 240.0, T.FLOAT8E5M2: 57344.0, T.FLOAT8E5M2FNUZ: 57344.0}


@pytest.mark.parametrize("to", list(FLOAT8))
@pytest.mark.parametrize("opset", [19, 21, 23, 24, 25])
def test_float8_saturate_table(to: int, opset: int) -> None:
    top = FLOAT8[to]
    fnuz = to in (T.FLOAT8E4M3FNUZ, T.FLOAT8E5M2FNUZ)
    inf = NAN if fnuz and opset < 24 else top  # Cast-19..23 send Inf to NaN in the FNUZ types, Cast-24 saturates
    want = np.array([0, 0, NAN, inf, -inf, top, -top, 1.0, 0.3125 if to in (T.FLOAT8E4M3FN, T.FLOAT8E4M3FNUZ)
                     else 0.3125], np.float32)
    got = cast(SPECIAL, to, opset=opset).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    if fnuz:
        assert bits(cast(np.array([-0.0], np.float32), to, opset=opset)) == [0]  # no negative zero


@pytest.mark.parametrize("to", list(FLOAT8))
def test_float8_no_saturate_table(to: int) -> None:
    got = cast(SPECIAL, to, saturate=0).astype(np.float32)
    over = INF if to == T.FLOAT8E5M2 else NAN
    np.testing.assert_array_equal(got[3:7], [over, -over, over, -over])
    np.testing.assert_array_equal(got[[0, 1, 7, 8]], [0, 0, 1, 0.3125])
    assert np.isnan(got[2])


@pytest.mark.parametrize("to", [T.FLOAT8E4M3FN, T.FLOAT8E5M2])
@pytest.mark.parametrize("saturate", [0, 1])
def test_float8_matches_onnxruntime(to: int, saturate: int) -> None:
    rng = np.random.default_rng(to)
    x = np.concatenate([rng.normal(0, 100, 300), rng.normal(0, 1e5, 50), [464, 470, 61440, 2 ** -10, 2 ** -17]])
    x = np.concatenate([x, -x]).astype(np.float32)
    if to == T.FLOAT8E5M2 and not saturate:
        x = x[np.abs(x) < 61440]  # onnxruntime gives NaN where the spec (and carrack) give +-Inf
    model = chain_model(T.FLOAT, [dict(to=to, saturate=saturate), dict(to=T.FLOAT)], opset=19)
    np.testing.assert_array_equal(run_carrack(model, x), run_ort(model, x))


def test_round_to_nearest_even_on_ties() -> None:
    # e4m3fn near 1 has steps of 1/8: 1.0625 ties to 1.0 (even), 1.1875 ties to 1.25 (even).
    x = np.array([1.0625, 1.1875, -1.0625], np.float32)
    np.testing.assert_array_equal(cast(x, T.FLOAT8E4M3FN).astype(np.float32), [1.0, 1.25, -1.0])
    np.testing.assert_array_equal(cast(np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8], np.float32), T.BFLOAT16).astype(
        np.float32), [1.0, 1 + 2 ** -6])


def test_float64_rounds_once() -> None:
    """A double just above a tie must round up; rounding through float32 first would land on the tie."""
    x = np.array([1 + 2 ** -8 + 2 ** -40, 1.0625 + 2 ** -40, -(1.0625 + 2 ** -40)], np.float64)
    assert cast(x[:1], T.BFLOAT16).astype(np.float64).tolist() == [1 + 2 ** -7]
    assert cast(x[1:], T.FLOAT8E4M3FN).astype(np.float64).tolist() == [1.125, -1.125]
    big = np.array([2 ** 40 + 2 ** 32 + 1], np.int64)  # int64 -> bfloat16: also one rounding
    assert cast(big, T.BFLOAT16).astype(np.float64).tolist() == [2 ** 40 + 2 ** 33]
    tiny = np.array([1e-300, -1e-300, 1e300, NAN], np.float64)
    got = cast(tiny, T.BFLOAT16).astype(np.float64)
    assert got[0] == 0 and got[1] == 0 and np.signbit(got[1]) and got[2] == INF and np.isnan(got[3])


def test_float4e2m1() -> None:
    x = np.array([0.25, 0.75, 2.5, 5.0, 7.0, 100, -INF, -0.0], np.float32)
    got = cast(x, T.FLOAT4E2M1).astype(np.float32)
    np.testing.assert_array_equal(got, [0, 1, 2, 4, 6, 6, -6, -0.0])
    np.testing.assert_array_equal(cast(cast(x, T.FLOAT4E2M1), T.FLOAT16), got.astype(np.float16))


# -- float8e8m0 ----------------------------------------------------------------------------------------------------
E8M0_INPUT = np.array([1.0, 1.1, 1.5, 1.6, 0.124, 0.0, 1e38, 2.0 ** 127 * 1.2, INF, NAN, 2.0 ** -130, 2.0 ** -127,
                       -3.0], np.float32)


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
@pytest.mark.parametrize("saturate", [0, 1])
def test_e8m0_matches_onnxruntime(round_mode: str, saturate: int) -> None:
    model = chain_model(T.FLOAT, [dict(to=T.FLOAT8E8M0, round_mode=round_mode, saturate=saturate),
                                  dict(to=T.FLOAT)], opset=24)
    np.testing.assert_array_equal(run_carrack(model, E8M0_INPUT), run_ort(model, E8M0_INPUT))


def test_e8m0_codes() -> None:
    got = cast(np.array([1.0, 3.0, 0.0, NAN], np.float32), T.FLOAT8E8M0, round_mode="nearest")
    assert bits(got) == [127, 129, 0, 255]
    assert cast(got, T.FLOAT).view(np.uint32).tolist()[2] == 0x00400000  # code 0 is 2**-127


# -- sub-byte integers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("to, want", [
    (T.INT4, [7, -8, -1, 0, 7, -8, 1]), (T.UINT4, [7, 8, 15, 0, 7, 8, 1]),
    (T.INT2, [-1, 0, -1, 0, -1, 0, 1]), (T.UINT2, [3, 0, 3, 0, 3, 0, 1])])
def test_sub_byte_integers_wrap(to: int, want: list[int]) -> None:
    x = np.array([-9, -8, -1, 0, 7, 8, 17], np.float32)
    np.testing.assert_array_equal(cast(x, to).astype(np.int8), want)
    np.testing.assert_array_equal(cast(x.astype(np.int32), to).astype(np.int8), want)


def test_int4_matches_onnxruntime_on_integers() -> None:
    x = np.arange(-20, 20, dtype=np.float32)
    for to in (T.INT4, T.UINT4):
        model = chain_model(T.FLOAT, [dict(to=to), dict(to=T.FLOAT)], opset=21)
        np.testing.assert_array_equal(run_carrack(model, x), run_ort(model, x))


# -- strings -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("src, values", [
    (T.FLOAT, [0.1, 1e-5, 1e20, 3.0, -0.0, NAN, INF, -INF, 123456789.0, 1 / 3]),
    (T.DOUBLE, [0.1, 1e-5, 1e20, 3.0, 1 / 3, 1e300]),
    (T.FLOAT16, [0.1, 3.0, 1 / 3]),
    (T.INT8, [-5, 7]), (T.INT64, [-(2 ** 62), 2 ** 62]), (T.UINT64, [2 ** 64 - 1]), (T.BOOL, [True, False])])
def test_to_string_matches_onnxruntime(src: int, values: list) -> None:
    x = np.array(values, to_numpy(src))
    model = chain_model(src, [dict(to=T.STRING)], opset=19, ir_version=9)
    got = run_carrack(model, x)
    assert got.dtype == object and all(type(s) is str for s in got)
    assert got.tolist() == run_ort(model, x).tolist()


@pytest.mark.parametrize("dst, values", [
    (T.FLOAT, ["1e-5", "INF", "-inf", "+INF", "NaN", "nan", "3.5", "-1E8", "0.47892547"]),
    (T.DOUBLE, ["0.1", "1e300", "-Inf"]),
    (T.INT64, ["100", "-7", "9223372036854775807"]),
    (T.UINT64, ["18446744073709551615"]), (T.INT32, ["-2147483648", "12"]), (T.UINT8, ["255", "0"])])
def test_from_string_matches_onnxruntime(dst: int, values: list[str]) -> None:
    x = np.array(values, dtype=object)
    model = chain_model(T.STRING, [dict(to=dst)], opset=19, ir_version=9)
    got, want = run_carrack(model, x), run_ort(model, x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_string_round_trips_and_exotic_targets() -> None:
    x = np.array([["1.5", "-2"], ["1e-3", "NaN"]], dtype=object)
    got = cast(x, T.FLOAT8E4M3FN)
    assert got.shape == (2, 2) and got.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(got.astype(np.float32)[0], [1.5, -2])
    assert cast(np.array("100.5", dtype=object), T.INT32).tolist() == 100  # a decimal string truncates
    assert cast(np.array(["0", "2.5"], dtype=object), T.BOOL).tolist() == [False, True]
    assert cast(np.array([1.5, -2.0], ml_dtypes.bfloat16), T.STRING).tolist() == ["1.5", "-2"]
    assert cast(np.array([-3, 5], ml_dtypes.int4), T.STRING).tolist() == ["-3", "5"]


# -- versions and CastLike -----------------------------------------------------------------------------------------
def test_cast_1_takes_a_type_name() -> None:
    node = helper.make_node("Cast", ["x"], ["y"], to="INT32")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", T.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", T.INT32, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 1)], ir_version=3)
    got = run_carrack(model, np.array([1.7, -2.2], np.float32))
    assert got.dtype == np.int32 and got.tolist() == [1, -2]


@pytest.mark.parametrize("opset", [15, 19, 21, 24])
def test_castlike(opset: int) -> None:
    like = np.array([0], dtype=np.float16 if opset == 15 else ml_dtypes.float8_e4m3fn)
    attrs = {"saturate": 0} if opset >= 19 else {}
    node = helper.make_node("CastLike", ["x", "like"], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", T.FLOAT, None),
                                            helper.make_tensor_value_info("like", to_onnx(like.dtype), None)],
                              [helper.make_tensor_value_info("y", to_onnx(like.dtype), None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    x = np.array([1.0, 1e6], np.float32)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, {"x": x, "like": like})[0]
    assert got.dtype == like.dtype
    if opset == 15:
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(got, x.astype(np.float16))
    else:
        assert got.astype(np.float32)[0] == 1 and np.isnan(got.astype(np.float32)[1])  # saturate=0: NaN


def test_cast_array_keeps_same_type_input() -> None:
    x = np.arange(3, dtype=np.float32)
    assert cast_array(x, np.float32) is x


# -- BitCast -------------------------------------------------------------------------------------------------------
def bitcast(x: np.ndarray, to: int) -> np.ndarray:
    node = helper.make_node("BitCast", ["x"], ["y"], to=to)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", to_onnx(x.dtype), None)],
                              [helper.make_tensor_value_info("y", to, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26)])
    return run_carrack(model, x)


def test_bitcast_reinterprets() -> None:
    x = np.array([[1.0, -2.5], [NAN, 0.0]], np.float32)
    got = bitcast(x, T.INT32)
    np.testing.assert_array_equal(got, x.view(np.int32))
    np.testing.assert_array_equal(bitcast(got, T.FLOAT).view(np.int32), got)
    assert bitcast(np.array([1.0], np.float16), T.BFLOAT16).view(np.uint16).tolist() == [0x3C00]
    assert bitcast(np.array(-1, np.int8), T.UINT8).tolist() == 255


def test_bitcast_sub_byte() -> None:
    codes = np.arange(16, dtype=np.uint8).view(ml_dtypes.uint4)
    as_int4 = bitcast(codes, T.INT4)
    np.testing.assert_array_equal(as_int4.astype(np.int8), list(range(8)) + list(range(-8, 0)))
    np.testing.assert_array_equal(bitcast(as_int4, T.UINT4).astype(np.uint8), np.arange(16))
    as_fp4 = bitcast(codes, T.FLOAT4E2M1)
    np.testing.assert_array_equal(as_fp4.astype(np.float32),
                                  [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def test_bitcast_width_mismatch_is_an_error() -> None:
    with pytest.raises(Exception, match="bits"):
        bitcast(np.array([1.0], np.float32), T.INT64)


def test_empty_and_scalar_inputs() -> None:
    for to in (T.STRING, T.FLOAT8E4M3FN, T.FLOAT8E8M0, T.INT4, T.BOOL):
        got = cast(np.zeros((2, 0), np.float32), to, opset=24)
        assert got.shape == (2, 0) and got.dtype == to_numpy(to)
    assert cast(np.array(2.5, np.float32), T.STRING).tolist() == "2.5"
