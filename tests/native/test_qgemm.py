"""The native int8 GEMM (carrack/native/qgemm.c) equals int64 accumulation wrapped to int32, bit for bit, through
every epilogue, and the kernels that use it give what their numpy paths give (CARRACK_NATIVE=0)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack import native
from carrack.native import qgemm
from carrack.ops import quant
from carrack.ops.contrib_quant import dynamic_quantize_shifted
from tests.helpers import count_calls
from tests.quant.helpers import one_node_model

pytestmark = pytest.mark.skipif(qgemm.library() is None, reason="the native qgemm library is unavailable here")

KS = [1, 3, 4, 5, 63, 64, 65, 1000, 4099]


def _reference(a: np.ndarray, a_zp: int, w: np.ndarray) -> np.ndarray:
    return ((a.astype(np.int64) - a_zp) @ w.astype(np.int64)).astype(np.int32)  # wraps like int32


def _operands(m: int, k: int, n: int, case: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    if case == "max":  # every product 255 * -128
        return np.full((m, k), 255, np.uint8), 0, np.full((k, n), -128, np.int8)
    if case == "zp_max":  # every product (0 - 255) * 127
        return np.zeros((m, k), np.uint8), 255, np.full((k, n), 127, np.int8)
    a = rng.choice(np.array([0, 1, 127, 128, 254, 255], np.uint8), (m, k))
    return a, int(rng.integers(0, 256)), rng.choice(np.array([-128, -127, -1, 0, 1, 126, 127], np.int8), (k, n))


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("case", ["random", "max", "zp_max"])
def test_int32_exact(k, case):
    a, zp, w = _operands(7, k, 67, case, seed=k)
    got = qgemm.qgemm(a, qgemm.PackedInt8Weight.pack(w), a_zero_point=zp)
    np.testing.assert_array_equal(got, _reference(a, zp, w))


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (6, 4, 16), (13, 17, 64), (19, 130, 129), (0, 5, 3), (4, 0, 5),
                                   (3, 7, 0)])
def test_shapes(m, k, n):
    a, zp, w = _operands(m, k, n, "random", seed=m + k + n)
    packed = qgemm.PackedInt8Weight.pack(w)
    assert (packed.k, packed.n) == (k, n)
    np.testing.assert_array_equal(packed.column_sums, w.astype(np.int64).sum(axis=0).astype(np.int32))
    np.testing.assert_array_equal(qgemm.qgemm(a, packed, a_zero_point=zp), _reference(a, zp, w))


def test_accumulator_wraps_like_int32():
    k = 70_000  # 255 * 127 * k passes 2**31
    a, w = np.full((2, k), 255, np.uint8), np.full((k, 17), 127, np.int8)
    bias = np.full(17, 2**31 - 1, np.int32)
    got = qgemm.qgemm(a, qgemm.PackedInt8Weight.pack(w), a_zero_point=3, bias_i32=bias)
    want = ((a.astype(np.int64) - 3) @ w.astype(np.int64) + bias).astype(np.int32)
    np.testing.assert_array_equal(got, want)


def test_strided_and_offset_activations():
    a, zp, w = _operands(9, 65, 33, "random", seed=5)
    packed = qgemm.PackedInt8Weight.pack(w)
    big = np.zeros((19, 80), np.uint8)
    view = big[1::2, 3:68]  # rows 160 bytes apart, starting at an odd address
    view[...] = a
    np.testing.assert_array_equal(qgemm.qgemm(view, packed, a_zero_point=zp), _reference(a, zp, w))
    fortran = np.asfortranarray(a)
    np.testing.assert_array_equal(qgemm.qgemm(fortran, packed, a_zero_point=zp), _reference(a, zp, w))
    wide = np.concatenate([a, np.full((9, 3), 77, np.uint8)], axis=1)  # only the first K columns count
    np.testing.assert_array_equal(qgemm.qgemm(wide, packed, a_zero_point=zp), _reference(a, zp, w))
    read_only = a.copy()
    read_only.flags.writeable = False
    np.testing.assert_array_equal(qgemm.qgemm(read_only, packed, a_zero_point=zp), _reference(a, zp, w))


def test_float_epilogue():
    a, zp, w = _operands(11, 100, 70, "random", seed=1)
    rng = np.random.default_rng(2)
    scale = rng.uniform(1e-4, 1e-2, 70).astype(np.float32)
    bias_i32 = rng.integers(-10**6, 10**6, 70).astype(np.int32)
    bias = rng.standard_normal(70).astype(np.float32)
    packed = qgemm.PackedInt8Weight.pack(w)
    acc = _reference(a, zp, w) + bias_i32
    got = qgemm.qgemm(a, packed, a_zero_point=zp, bias_i32=bias_i32, scale=scale, bias_f32=bias,
                      out_dtype=np.float32)
    np.testing.assert_array_equal(got, acc.astype(np.float32) * scale + bias)
    got = qgemm.qgemm(a, packed, a_zero_point=zp, scale=np.float32(0.3), out_dtype=np.float32)
    np.testing.assert_array_equal(got, _reference(a, zp, w).astype(np.float32) * np.float32(0.3))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_requantize_epilogue(dtype):
    a, zp, w = _operands(10, 37, 50, "random", seed=3)
    packed = qgemm.PackedInt8Weight.pack(w)
    acc = _reference(a, zp, w)
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    for multiplier, y_zp in [(np.float32(0.5), 3), (np.full(50, 1 / 4096, np.float32), -7 if dtype == np.int8 else 128),
                             (np.linspace(1e-5, 0.01, 50, dtype=np.float32), 0)]:
        got = qgemm.qgemm(a, packed, a_zero_point=zp, multiplier=multiplier, y_zero_point=y_zp, out_dtype=dtype)
        y = np.rint(acc.astype(np.float32) * multiplier) + np.float32(y_zp)  # halves round to even
        np.testing.assert_array_equal(got, np.clip(y, lo, hi).astype(dtype))


@pytest.mark.parametrize("mode", ["int32", "float", "u8"])
def test_transposed_output(mode):
    a, zp, w = _operands(13, 21, 35, "random", seed=4)
    packed = qgemm.PackedInt8Weight.pack(w)
    dtype = {"int32": np.int32, "float": np.float32, "u8": np.uint8}[mode]
    kwargs = {"float": {"scale": np.float32(0.25)}, "u8": {"multiplier": np.float32(1 / 64), "y_zero_point": 100},
              "int32": {}}[mode]
    want = qgemm.qgemm(a, packed, a_zero_point=zp, out_dtype=dtype, **kwargs)
    out = np.zeros((35, 13), dtype)  # C^T, as the convolution writes NCHW
    got = qgemm.qgemm(a, packed, a_zero_point=zp, out=out, out_strides=(1, 13), **kwargs)
    assert got is out
    np.testing.assert_array_equal(out.T, want)


def test_threads_split_the_output(monkeypatch):
    monkeypatch.setattr(qgemm, "_PARALLEL_MIN_MACS", 0)
    for m, n in [(50, 300), (50, 40), (3, 3)]:
        a, zp, w = _operands(m, 99, n, "random", seed=m)
        packed = qgemm.PackedInt8Weight.pack(w)
        for threads in (2, 3, 7):
            monkeypatch.setattr(native, "threads", lambda t=threads: t)
            np.testing.assert_array_equal(qgemm.qgemm(a, packed, a_zero_point=zp), _reference(a, zp, w))



def test_one_row_with_a_large_weight_splits_with_the_same_bits():
    # a classifier head's shape: one row streams a 2 MB weight, so its panels go to both threads
    from carrack.native import intra_op

    a, zp, w = _operands(1, 2048, 1000, "random", seed=5)
    packed = qgemm.PackedInt8Weight.pack(w)
    results = {}
    for threads in (1, 2, 4):
        with intra_op.intra_op_threads(threads):
            intra_op.trace_regions(True)
            results[threads] = qgemm.qgemm(a, packed, a_zero_point=zp)
            intra_op.trace_regions(False)
        split = [part for part in intra_op.region_trace() if part.slot == -1]
        if threads == 1:
            assert split == []
        elif native.library("threadpool") is not None:  # without it every product runs on one thread
            assert len(split) == 1 and split[0].pieces > 1
    for threads, result in results.items():
        np.testing.assert_array_equal(result, _reference(a, zp, w), err_msg=f"{threads} threads")

def _numpy_dynamic_quantize(x):
    q, scale, zp = quant.DynamicQuantizeLinear(helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
                                               11).run(x)
    return q, scale, zp


@pytest.mark.parametrize("case", ["normal", "ties", "positive", "negative", "zeros", "tiny", "empty"])
def test_dynamic_quantize(case):
    rng = np.random.default_rng(7)
    x = {"normal": rng.standard_normal((5, 37)), "positive": rng.uniform(1, 3, (3, 16)),
         "negative": -rng.uniform(1, 3, (4, 9)), "zeros": np.zeros((2, 5)), "tiny": rng.standard_normal((3, 3)) * 1e-40,
         "ties": np.concatenate([np.arange(-64, 191) + 0.5, [-64.0, 191.0]]).reshape(1, -1) / 8,
         "empty": np.zeros((0, 6))}[case].astype(np.float32)
    q, scale, zp = qgemm.dynamic_quantize_u8(x)
    want_q, want_scale, want_zp = _numpy_dynamic_quantize(x)
    assert q.shape == (x.shape[0], -(-x.shape[1] // 4) * 4)
    np.testing.assert_array_equal(q[:, :x.shape[1]], want_q)
    assert not q[:, x.shape[1]:].any()
    assert scale == want_scale and zp == int(want_zp)
    shifted, shifted_scale, shifted_zp = dynamic_quantize_shifted(x)
    np.testing.assert_array_equal(q[:, :x.shape[1]].astype(np.float32) - zp, shifted)
    assert (shifted_scale, shifted_zp) == (scale, zp)


def test_dynamic_quantize_strided_and_non_finite():
    x = np.random.default_rng(8).standard_normal((6, 40)).astype(np.float32)
    q, scale, zp = qgemm.dynamic_quantize_u8(x[::2, 1:34], row_bytes=40)
    want_q, want_scale, _ = _numpy_dynamic_quantize(x[::2, 1:34])
    np.testing.assert_array_equal(q[:, :33], want_q)
    assert q.shape == (3, 40) and scale == want_scale
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[2, 5] = bad
        assert qgemm.dynamic_quantize_u8(y) is None


def test_int8_weight():
    assert qgemm.int8_weight(np.array([[1.0, -128.0], [127.0, 0.0]], np.float32)).dtype == np.int8
    assert qgemm.int8_weight(np.array([[1.5]], np.float32)) is None
    assert qgemm.int8_weight(np.array([[128.0]], np.float32)) is None
    assert qgemm.int8_weight(np.array([[-129]], np.int32)) is None


def test_turned_off(monkeypatch):
    monkeypatch.setenv("CARRACK_NATIVE", "0")
    assert qgemm.PackedInt8Weight.pack(np.zeros((2, 2), np.int8)) is None
    assert qgemm.dynamic_quantize_u8(np.zeros((2, 2), np.float32)) is None


@pytest.mark.parametrize("variant,isa", [("avx2", 256), ("portable", 0)])
def test_other_instruction_sets(variant, isa, monkeypatch):
    """The AVX2 and the portable C paths: the package's variants of qgemm.c, loaded on this machine."""
    if native.compiler() is None and not native.manifest():
        pytest.skip("no prebuilt kernels and no C compiler")
    wanted = native.variants.by_name(variant, native.cpu.targets_x86())
    if wanted is None or not wanted.cpu_features <= native.cpu_features()[0]:
        pytest.skip(f"this CPU cannot run the {variant} variant")
    monkeypatch.setenv("CARRACK_NATIVE_VARIANT", variant)
    monkeypatch.setattr(native, "_loaded", {})
    assert qgemm.isa() == isa
    assert f"prebuilt {variant}" in native.origin("qgemm") or f"run time, {variant}" in native.origin("qgemm")
    for k, case in [(1, "random"), (5, "max"), (65, "zp_max"), (1000, "random")]:
        a, zp, w = _operands(7, k, 67, case, seed=k)
        packed = qgemm.PackedInt8Weight.pack(w)
        np.testing.assert_array_equal(qgemm.qgemm(a, packed, a_zero_point=zp), _reference(a, zp, w))
        got = qgemm.qgemm(a, packed, a_zero_point=zp, multiplier=np.float32(1 / 512), y_zero_point=-3,
                          out_dtype=np.int8)
        want = np.clip(np.rint(_reference(a, zp, w).astype(np.float32) / 512) - 3, -128, 127).astype(np.int8)
        np.testing.assert_array_equal(got, want)
    x = np.random.default_rng(1).standard_normal((3, 21)).astype(np.float32)
    np.testing.assert_array_equal(qgemm.dynamic_quantize_u8(x)[0][:, :21], _numpy_dynamic_quantize(x)[0])


# -- kernels: native and numpy paths agree -----------------------------------------------------------------------------
@pytest.fixture
def calls(monkeypatch):
    """Counts native GEMM calls."""
    return count_calls(monkeypatch, qgemm, "qgemm")


def _both_paths(monkeypatch, model, feeds, calls, native_used: bool = True) -> np.ndarray:
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("CARRACK_NATIVE", flag)
        before = calls["n"]
        session = carrack.InferenceSession(model.SerializeToString())
        results.append(session.run(None, feeds)[0])
        assert (calls["n"] > before) == (flag == "1" and native_used), f"native path taken: {flag}"
    np.testing.assert_array_equal(results[1], results[0])
    assert results[1].dtype == results[0].dtype
    return results[1]


def _int8_weight(k: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.integers(-128, 128, (k, n)).astype(np.int8)
    w[0] = -128
    return w


@pytest.mark.parametrize("k", [1, 5, 64, 1000])
@pytest.mark.parametrize("a_type", [np.uint8, np.int8])
def test_matmul_integer(k, a_type, monkeypatch, calls):
    info = np.iinfo(a_type)
    a = np.random.default_rng(k).integers(info.min, info.max + 1, (2, 3, k)).astype(a_type)
    a[0, 0] = info.max
    node = helper.make_node("MatMulInteger", ["a", "b", "az", "bz"], ["y"])
    inits = {"b": np.clip(_int8_weight(k, 19, k), -126, 127), "bz": np.asarray(2, np.int8)}  # b - 2 fits int8
    model = one_node_model(node, {"a": a, "az": np.asarray(info.min, a_type)}, TensorProto.INT32, inits)
    y = _both_paths(monkeypatch, model, {"a": a, "az": np.asarray(info.min, a_type)}, calls)
    np.testing.assert_array_equal(y, _reference(a.reshape(-1, k).astype(np.int64), info.min,
                                                inits["b"].astype(np.int64) - 2).reshape(2, 3, 19))


@pytest.mark.parametrize("out_type", [np.uint8, np.int8])
def test_qlinear_matmul(out_type, monkeypatch, calls):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (5, 70)).astype(np.uint8)
    node = helper.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])
    inits = {"as": np.asarray(0.02, np.float32), "az": np.asarray(120, np.uint8), "b": rng.integers(0, 200, (70, 33))
             .astype(np.uint8), "bs": rng.uniform(0.001, 0.01, 33).astype(np.float32),
             "bz": rng.integers(80, 120, 33).astype(np.uint8), "ys": np.asarray(0.05, np.float32),
             "yz": np.asarray(7, out_type)}
    model = one_node_model(node, {"a": a}, helper.np_dtype_to_tensor_dtype(np.dtype(out_type)), inits)
    _both_paths(monkeypatch, model, {"a": a}, calls)


def test_matmul_integer_to_float_and_dynamic_quantize_matmul(monkeypatch, calls):
    rng = np.random.default_rng(1)
    b, bias = _int8_weight(48, 20, 1), rng.standard_normal(20).astype(np.float32)
    a = rng.integers(-128, 128, (4, 48)).astype(np.int8)
    node = helper.make_node("MatMulIntegerToFloat", ["a", "b", "as", "bs", "az", "bz", "bias"], ["y"],
                            domain="com.microsoft")
    inits = {"b": b, "as": np.asarray(0.1, np.float32), "bs": rng.uniform(0.01, 0.1, 20).astype(np.float32),
             "az": np.asarray(-5, np.int8), "bz": np.zeros(20, np.int8), "bias": bias}
    _both_paths(monkeypatch, one_node_model(node, {"a": a}, TensorProto.FLOAT, inits), {"a": a}, calls)
    x = rng.standard_normal((3, 48)).astype(np.float32)
    node = helper.make_node("DynamicQuantizeMatMul", ["x", "b", "bs", "bz", "bias"], ["y"], domain="com.microsoft")
    inits = {"b": b, "bs": np.asarray(0.03, np.float32), "bz": np.asarray(0, np.int8), "bias": bias}
    _both_paths(monkeypatch, one_node_model(node, {"x": x}, TensorProto.FLOAT, inits), {"x": x}, calls)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 1)])
@pytest.mark.parametrize("quantized", [False, True])
def test_qgemm(trans_a, trans_b, quantized, monkeypatch, calls):
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (30, 6) if trans_a else (6, 30)).astype(np.uint8)
    b = _int8_weight(30, 17, 2)
    names = ["a", "as", "az", "b", "bs", "bz", "c"] + (["ys", "yz"] if quantized else [])
    node = helper.make_node("QGemm", names, ["y"], domain="com.microsoft", alpha=0.5, transA=trans_a, transB=trans_b)
    inits = {"as": np.asarray(0.1, np.float32), "az": np.asarray(130, np.uint8), "b": b.T.copy() if trans_b else b,
             "bs": np.asarray(0.02, np.float32), "bz": np.asarray(0, np.int8),
             "c": rng.integers(-1000, 1000, 17).astype(np.int32)}
    if quantized:
        inits.update(ys=np.asarray(0.5, np.float32), yz=np.asarray(-2, np.int8))
    model = one_node_model(node, {"a": a}, TensorProto.INT8 if quantized else TensorProto.FLOAT, inits)
    _both_paths(monkeypatch, model, {"a": a}, calls)


def test_overridden_weight_takes_the_numpy_path(monkeypatch, calls):
    a = np.random.default_rng(3).integers(0, 256, (2, 8)).astype(np.uint8)
    b = _int8_weight(8, 4, 3)
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"])
    model = one_node_model(node, {"a": a, "b": b}, TensorProto.INT32, {"b": b})  # b: an overridable initializer
    session = carrack.InferenceSession(model.SerializeToString())
    other = np.full_like(b, 3)
    got = session.run(None, {"a": a, "b": other})[0]
    np.testing.assert_array_equal(got, _reference(a, 0, other))


# -- the lowered kernels ---------------------------------------------------------------------------------------------
def _dynamic_chain(k: int, n: int, seed: int, per_column: bool):
    """DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul -> Add (-> Relu), as quantize_dynamic writes it."""
    rng = np.random.default_rng(seed)
    w = _int8_weight(k, n, seed)
    w_scale = rng.uniform(1e-3, 1e-2, n if per_column else ()).astype(np.float32)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["s"]),
             helper.make_node("Mul", ["accf", "s"], ["prod"]),
             helper.make_node("Add", ["prod", "bias"], ["biased"]),
             helper.make_node("Relu", ["biased"], ["y"])]  # the GEMM's output is planned: it runs into a buffer
    inits = {"w": w, "wz": np.zeros(n if per_column else (), np.int8), "ws": w_scale,
             "bias": rng.standard_normal(n).astype(np.float32)}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, name) for name, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("k", [1, 3, 65, 768])
@pytest.mark.parametrize("data", ["normal", "skewed", "zeros", "nan"])
def test_lowered_dynamic_matmul(k, data, monkeypatch, calls):
    model = _dynamic_chain(k, 70, k, per_column=k % 2 == 1)
    rng = np.random.default_rng(k)
    x = {"normal": rng.standard_normal((2, 9, k)), "skewed": rng.uniform(-0.1, 7, (1, 5, k)),
         "zeros": np.zeros((1, 3, k)), "nan": np.full((1, 2, k), np.nan)}[data].astype(np.float32)
    # with a NaN the native quantizer declines and both runs take the numpy path
    _both_paths(monkeypatch, model, {"x": x}, calls, native_used=data != "nan")
    assert carrack.InferenceSession(model.SerializeToString()).optimizer_stats.get("dynamic_quantized_matmul") == 1


def _qdq_linear(op: str, k: int, n: int, x_type, y_type, seed: int):
    """DequantizeLinear(x), DequantizeLinear(const w) [, DequantizeLinear(int32 bias)] -> MatMul/Gemm ->
    QuantizeLinear, as a QDQ quantizer writes it."""
    rng = np.random.default_rng(seed)
    x_scale, w_scale = np.float32(0.05), rng.uniform(1e-3, 1e-2, n).astype(np.float32)
    w = _int8_weight(k, n, seed)
    inits = {"xs": np.asarray(x_scale), "xz": np.asarray(3 if x_type == np.int8 else 128, x_type),
             "ws": w_scale, "wz": np.zeros(n, np.int8), "ys": np.asarray(0.7, np.float32),
             "yz": np.asarray(-4 if y_type == np.int8 else 17, y_type)}
    nodes = [helper.make_node("DequantizeLinear", ["x", "xs", "xz"], ["xf"])]
    if op == "Gemm":
        inits.update(w=w.T.copy(), b=rng.integers(-50000, 50000, n).astype(np.int32), bs=(x_scale * w_scale),
                     bz=np.zeros(n, np.int32))
        nodes += [helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=0),
                  helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["bf"], axis=0),
                  helper.make_node("Gemm", ["xf", "wf", "bf"], ["yf"], transB=1)]
    else:
        inits["w"] = w
        nodes += [helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=1),
                  helper.make_node("MatMul", ["xf", "wf"], ["yf"])]
    nodes.append(helper.make_node("QuantizeLinear", ["yf", "ys", "yz"], ["y"]))
    shape = [None, k] if op == "Gemm" else [None, None, k]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(
        np.dtype(x_type)), shape)], [helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(
            np.dtype(y_type)), None)], [numpy_helper.from_array(v, name) for name, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


@pytest.mark.parametrize("op,k", [("MatMul", 1), ("MatMul", 5), ("MatMul", 64), ("Gemm", 65), ("Gemm", 300)])
@pytest.mark.parametrize("x_type,y_type", [(np.uint8, np.uint8), (np.int8, np.int8)])
def test_lowered_qdq_linear(op, k, x_type, y_type, monkeypatch, calls):
    model = _qdq_linear(op, k, 35, x_type, y_type, k)
    info = np.iinfo(x_type)
    x = np.random.default_rng(k).integers(info.min, info.max + 1, (4, k) if op == "Gemm" else (2, 4, k))
    x = x.astype(x_type)
    x.reshape(-1, k)[0] = info.min
    _both_paths(monkeypatch, model, {"x": x}, calls)
    assert carrack.InferenceSession(model.SerializeToString()).optimizer_stats.get("qdq_to_integer_kernel") == 1


# -- AMX tiles (depth a multiple of 64, at least 32 rows) --------------------------------------------------------------
@pytest.mark.parametrize("m,k,n", [(32, 64, 16), (45, 128, 40), (64, 64, 64), (100, 576, 80), (71, 64, 200),
                                   (33, 4096, 33)])
@pytest.mark.parametrize("case", ["random", "max", "zp_max"])
def test_amx_blocks_exact(m, k, n, case, amx_restored):
    """Whole 32-row blocks with one or two 16-column tiles, the rows past them, narrow last panels and depths whose
    sums wrap around int32: the same bits as int64 accumulation, with AMX on (where the CPU has it) and off."""
    a, zp, w = _operands(m, k, n, case, seed=m + k + n)
    packed = qgemm.PackedInt8Weight.pack(w)
    bias = np.arange(-n, n, 2, dtype=np.int32)[:n] * 1000
    want = _reference(a, zp, w) + bias
    multiplier = np.linspace(1e-5, 3e-3, n, dtype=np.float32)
    results = []
    for on in (True, False):
        qgemm.amx(on)
        got = qgemm.qgemm(a, packed, a_zero_point=zp, bias_i32=bias)
        np.testing.assert_array_equal(got, want)
        results.append(qgemm.qgemm(a, packed, a_zero_point=zp, bias_i32=bias, multiplier=multiplier,
                                   y_zero_point=3, out_dtype=np.uint8))
    np.testing.assert_array_equal(results[0], results[1])


def test_amx_turned_off_by_environment(amx_restored, monkeypatch):
    monkeypatch.setenv("CARRACK_AMX", "0")
    assert qgemm.amx(True) is False  # re-checked: the environment says no
    monkeypatch.delenv("CARRACK_AMX")
    assert qgemm.amx(False) is False
