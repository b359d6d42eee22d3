"""Native quantized convolution (carrack/native/qconv.py): bit-identical to the numpy path and to an int64 reference.

QDQ Conv models (DequantizeLinear -> Conv -> QuantizeLinear, lowered to carrack's QLinearConvExact) run with
CARRACK_NATIVE=1 and =0; both must equal the int64 accumulation requantized as the lowering specifies
(clamp(rint(float32(acc) * multiplier) + zp), multiplier = x_scale * w_scale / y_scale in float32).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack import native
from carrack.native import qconv
from carrack.ops import contrib_quant
from tests.quant.helpers import ort_reference, output_step, quantize_static

needs_native = pytest.mark.skipif(native.compiler() is None or not native.enabled(),
                                  reason="no C compiler on this machine, or CARRACK_NATIVE=0")
_ONNX = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8}


# -- model and reference ---------------------------------------------------------------------------------------------
def _qdq_conv(x_shape, x_dtype, w, w_scale, w_zp, bias, attrs, y_dtype, x_scale=0.05, y_scale=0.1, x_zp=3, y_zp=5):
    """DequantizeLinear(x), DequantizeLinear(w) [axis 0], DequantizeLinear(bias) -> Conv -> QuantizeLinear."""
    x_dtype, y_dtype = np.dtype(x_dtype), np.dtype(y_dtype)
    per_channel = np.size(w_scale) > 1
    inits = {"xs": np.float32(x_scale), "xz": np.array(x_zp, x_dtype), "w": w,
             "ws": np.asarray(w_scale, np.float32), "wz": np.asarray(w_zp, w.dtype),
             "ys": np.float32(y_scale), "yz": np.array(y_zp, y_dtype)}
    nodes = [helper.make_node("DequantizeLinear", ["x", "xs", "xz"], ["xf"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=0),
             helper.make_node("QuantizeLinear", ["yf", "ys", "yz"], ["y"])]
    conv_inputs = ["xf", "wf"]
    if bias is not None:
        inits.update({"b": bias, "bs": (np.float32(x_scale) * np.asarray(w_scale, np.float32)).astype(np.float32),
                      "bz": np.zeros(np.shape(w_scale), np.int32)})
        nodes.append(helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["bf"], axis=0))
        conv_inputs.append("bf")
    nodes.append(helper.make_node("Conv", conv_inputs, ["yf"], **attrs))
    if not per_channel:
        inits["ws"], inits["wz"] = inits["ws"].reshape(()), inits["wz"].reshape(())
        if bias is not None:
            inits["bs"], inits["bz"] = inits["bs"].reshape(()), inits["bz"].reshape(())
    graph = helper.make_graph(nodes, "qconv", [helper.make_tensor_value_info("x", _ONNX[x_dtype], x_shape)],
                              [helper.make_tensor_value_info("y", _ONNX[y_dtype], None)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


def _reference(x, x_zp, w, w_zp, bias, x_scale, w_scale, y_scale, y_zp, y_dtype, strides, pads, dilations, group):
    """int64 convolution of the shifted integers, + bias, requantized in float32 like an int32 accumulator."""
    nd = x.ndim - 2
    xs = x.astype(np.int64) - x_zp
    ws = w.astype(np.int64) - np.asarray(w_zp, np.int64).reshape((-1,) + (1,) * (nd + 1))
    xs = np.pad(xs, [(0, 0), (0, 0)] + [(pads[i], pads[i + nd]) for i in range(nd)])  # zero = the zero point
    m, cg, *kernel = w.shape
    span = [dilations[i] * (kernel[i] - 1) + 1 for i in range(nd)]
    win = np.lib.stride_tricks.sliding_window_view(xs, span, axis=tuple(range(2, 2 + nd)))
    win = win[(Ellipsis,) + tuple(slice(None, None, d) for d in dilations)]
    win = win[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)]
    mg = m // group
    parts = []
    for g in range(group):
        xw = np.moveaxis(win[:, g * cg:(g + 1) * cg], 1, 1 + nd)  # [n, *out, cg, *kernel]
        xw = xw.reshape(xw.shape[:1 + nd] + (-1,))
        parts.append(np.moveaxis(xw @ ws[g * mg:(g + 1) * mg].reshape(mg, -1).T, -1, 1))
    acc = np.concatenate(parts, axis=1)
    if bias is not None:
        acc = acc + bias.astype(np.int64).reshape((-1,) + (1,) * nd)
    multiplier = (np.float32(x_scale) * np.asarray(w_scale, np.float32) / np.float32(y_scale)).astype(np.float32)
    y = acc.astype(np.int32).astype(np.float32) * multiplier.reshape((-1,) + (1,) * nd)
    lo, hi = np.iinfo(y_dtype).min, np.iinfo(y_dtype).max
    return np.clip(np.rint(y) + np.float32(y_zp), lo, hi).astype(y_dtype)


def _run(model: bytes, x: np.ndarray, monkeypatch, native_on: bool, threads: int = 1) -> tuple[np.ndarray, int]:
    """(the output, how many times the native convolution ran)."""
    monkeypatch.setenv("CARRACK_NATIVE", "1" if native_on else "0")
    calls = []
    original = qconv.QuantizedConv.run

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(qconv.QuantizedConv, "run", counting)
    options = carrack.SessionOptions()
    options.intra_op_num_threads = threads
    session = carrack.InferenceSession(model, options)
    assert session.optimizer_stats.get("qdq_to_integer_kernel", 0) == 1
    y = session.run(None, {"x": x})[0]
    monkeypatch.setattr(qconv.QuantizedConv, "run", original)
    return y, len(calls)


CASES = {
    # name: (x shape, cout, kernel, attrs, group)
    "1x1": ((1, 16, 7, 9), 24, (1, 1), {}, 1),
    "1x1_stride2": ((2, 16, 9, 9), 8, (1, 1), {"strides": [2, 2]}, 1),
    "3x3_pad": ((1, 8, 10, 11), 16, (3, 3), {"pads": [1, 1, 1, 1]}, 1),
    "3x3_stride2_asym_pad": ((1, 5, 13, 12), 6, (3, 3), {"pads": [1, 0, 2, 1], "strides": [2, 2]}, 1),
    "7x7_stride2": ((1, 3, 23, 21), 16, (7, 7), {"pads": [3, 3, 3, 3], "strides": [2, 2]}, 1),
    "3x3_dilated": ((1, 6, 12, 12), 4, (3, 3), {"pads": [2, 2, 2, 2], "dilations": [2, 2]}, 1),
    "5x3_dilated_stride3": ((1, 4, 17, 15), 5, (5, 3), {"strides": [3, 2], "dilations": [1, 3], "pads": [2, 3, 1, 0]},
                            1),
    "same_upper": ((1, 4, 9, 10), 4, (3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, 1),
    "grouped": ((1, 12, 8, 8), 8, (3, 3), {"pads": [1, 1, 1, 1]}, 4),
    "depthwise": ((2, 16, 9, 11), 16, (3, 3), {"pads": [1, 1, 1, 1]}, 16),
    "depthwise_mult2_stride2": ((1, 8, 11, 9), 16, (3, 3), {"pads": [1, 2, 1, 0], "strides": [2, 2]}, 8),
    "depthwise_5x5_dilated": ((1, 4, 14, 14), 4, (5, 5), {"pads": [4, 4, 4, 4], "dilations": [2, 2]}, 4),
    "depthwise_wide_stride2": ((1, 4, 9, 75), 4, (3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}, 4),
    "depthwise_wide": ((1, 3, 5, 70), 3, (3, 3), {"pads": [1, 0, 1, 2]}, 3),
    "conv1d": ((1, 6, 31), 8, (3,), {"pads": [1, 1], "strides": [2]}, 1),
    "wide_many_blocks": ((1, 64, 40, 70), 8, (3, 3), {"pads": [1, 1, 1, 1]}, 1),
}


def _operands(case: str, x_dtype, extreme: bool, seed: int = 0):
    shape, cout, kernel, attrs, group = CASES[case]
    rng = np.random.default_rng(seed)
    info = np.iinfo(x_dtype)
    if extreme:
        x = np.where(rng.random(shape) < 0.5, info.min, info.max).astype(x_dtype)
        w = np.where(rng.random((cout, shape[1] // group, *kernel)) < 0.5, -128, 127).astype(np.int8)
    else:
        x = rng.integers(info.min, int(info.max) + 1, shape).astype(x_dtype)
        w = rng.integers(-128, 128, (cout, shape[1] // group, *kernel)).astype(np.int8)
    return x, w, dict(attrs, group=group) if group > 1 else attrs, group


@needs_native
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("x_dtype, y_dtype, extreme, per_channel",
                         [(np.uint8, np.uint8, False, False), (np.int8, np.int8, False, True),
                          (np.uint8, np.int8, True, True), (np.int8, np.uint8, True, False)])
def test_native_matches_numpy_and_int64(case, x_dtype, y_dtype, extreme, per_channel, monkeypatch):
    x, w, attrs, group = _operands(case, x_dtype, extreme)
    cout, taps = w.shape[0], w[0].size
    rng = np.random.default_rng(1)
    x_zp = int(np.iinfo(x_dtype).min if extreme else np.iinfo(x_dtype).min + 100)  # extreme: |x - zp| up to 255
    w_scale = rng.uniform(0.5, 2, cout).astype(np.float32) * 0.01 if per_channel else np.float32(0.01)
    bias = rng.integers(-3000, 3000, cout).astype(np.int32)
    y_scale = 0.05 * 0.01 * 60 * np.sqrt(taps)  # outputs spread over the whole 8-bit range, some saturating
    model = _qdq_conv(x.shape, x_dtype, w, w_scale, np.zeros(np.shape(w_scale), np.int8), bias, attrs, y_dtype,
                      x_zp=x_zp, y_scale=y_scale)
    got, native_calls = _run(model, x, monkeypatch, True)
    plain, numpy_calls = _run(model, x, monkeypatch, False)
    assert native_calls == 1 and numpy_calls == 0
    assert got.dtype == plain.dtype == np.dtype(y_dtype)
    np.testing.assert_array_equal(got, plain)
    nd = x.ndim - 2
    strides, dilations = attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd)
    pads = attrs.get("pads", [0] * 2 * nd)
    if attrs.get("auto_pad") == "SAME_UPPER":
        from carrack.ops.conv import conv_pads

        pads = conv_pads("SAME_UPPER", None, x.shape[2:], w.shape[2:], strides, dilations)
    want = _reference(x, x_zp, w, 0, bias, 0.05, w_scale, y_scale, 5, np.dtype(y_dtype), strides, pads, dilations,
                      group)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) > 2  # not everything saturated


@needs_native
@pytest.mark.parametrize("case", ["3x3_pad", "depthwise", "1x1_stride2"])
def test_threads_and_batches(case, monkeypatch):
    x, w, attrs, group = _operands(case, np.uint8, False, seed=3)
    x = np.concatenate([x, x[:, :, ::-1]])
    model = _qdq_conv(x.shape, np.uint8, w, np.float32(0.01), np.int8(0), None, attrs, np.uint8,
                      y_scale=0.05 * 0.01 * 60 * np.sqrt(w[0].size))
    one, _ = _run(model, x, monkeypatch, True)
    three, calls = _run(model, x, monkeypatch, True, threads=3)
    plain, _ = _run(model, x, monkeypatch, False)
    assert calls == 1
    np.testing.assert_array_equal(one, plain)
    np.testing.assert_array_equal(three, plain)


@needs_native
@pytest.mark.parametrize("case", ["3x3_stride2_asym_pad", "7x7_stride2", "1x1", "1x1_stride2", "5x3_dilated_stride3",
                                  "wide_many_blocks"])
@pytest.mark.parametrize("threads", [1, 2])
def test_small_blocks(case, threads, monkeypatch):
    """Blocks of 16 pixels (often part of an output row): each block's band and rows are rebuilt alone."""
    monkeypatch.setattr(qconv, "BLOCK_BYTES", 1024)
    x, w, attrs, group = _operands(case, np.int8, False, seed=4)
    model = _qdq_conv(x.shape, np.int8, w, np.float32(0.01), np.int8(0), None, attrs, np.uint8,
                      y_scale=0.05 * 0.01 * 60 * np.sqrt(w[0].size))
    got, calls = _run(model, x, monkeypatch, True, threads=threads)
    plain, _ = _run(model, x, monkeypatch, False)
    assert calls == 1
    np.testing.assert_array_equal(got, plain)


@needs_native
@pytest.mark.parametrize("zero_point, seed, y_scale, native_calls", [
    (0, 5, 2.0, 0),  # uint8 weights with zero point 0 shift to [0, 255]: not int8, so the numpy path runs
    (128, 6, 0.05 * 0.01 * 60 * 9, 1),  # with zero point 128 they shift into int8: native
])
def test_uint8_weights_native_where_they_shift_into_int8(zero_point, seed, y_scale, native_calls, monkeypatch):
    x, _, attrs, _ = _operands("3x3_pad", np.uint8, False)
    w = np.random.default_rng(seed).integers(0, 256, (16, 8, 3, 3)).astype(np.uint8)
    model = _qdq_conv(x.shape, np.uint8, w, np.float32(0.01), np.uint8(zero_point), None, attrs, np.uint8,
                      y_scale=y_scale)
    got, calls = _run(model, x, monkeypatch, True)
    plain, _ = _run(model, x, monkeypatch, False)
    assert calls == native_calls
    np.testing.assert_array_equal(got, plain)


@needs_native
def test_noncontiguous_readonly_input():
    rng = np.random.default_rng(7)
    w = rng.integers(-128, 128, (8, 6, 3, 3)).astype(np.float32)
    conv = qconv.QuantizedConv.prepare(w, np.arange(8.0), np.full(8, 0.002, np.float32), 1, 10)
    base = rng.integers(0, 256, (1, 12, 10, 22)).astype(np.uint8)
    x = base[:, ::2, :, ::2]
    x.flags.writeable = False
    plan = conv.plan(x.shape, [1, 1], [1, 1, 1, 1], [1, 1])
    got = conv.run(x, np.array(7, np.uint8), plan)
    want = conv.run(np.ascontiguousarray(x), np.array(7, np.uint8), plan)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(base[:, ::2, :, ::2], x)  # input untouched


@needs_native
@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 224), (15, 17), (16, 16), (64, 56), (130, 200), (17, 5)])
def test_transpose(rows, cols):
    src = np.random.default_rng(rows).integers(0, 256, (rows, cols + 3)).astype(np.uint8)[:, :cols]
    dst = np.zeros((cols, rows + 5), np.uint8)
    qconv.transpose_u8(src, dst, 0x80)
    np.testing.assert_array_equal(dst[:, :rows], src.T ^ 0x80)
    assert not dst[:, rows:].any()


# -- QLinearAdd -----------------------------------------------------------------------------------------------------
def _qlinear_add(monkeypatch, native_on, a, b, c_dtype):
    kernel = contrib_quant.QLinearAdd.__new__(contrib_quant.QLinearAdd)
    kernel.implementation = "native" if native_on else "numpy"  # what the plan's selection table would choose
    return kernel.run(a, np.float32(0.02), np.array(3, a.dtype), b, np.float32(0.031), np.array(7, b.dtype),
                      np.float32(0.027), np.array(5, c_dtype))


@needs_native
@pytest.mark.parametrize("in_dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("out_dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("shape", [(1, 64, 17, 19), (3, 5), (2, 1, 300000)])
def test_qlinear_add_native_matches_numpy(in_dtype, out_dtype, shape, monkeypatch):
    rng = np.random.default_rng(0)
    info = np.iinfo(in_dtype)
    a = rng.integers(info.min, int(info.max) + 1, shape).astype(in_dtype)
    b = rng.integers(info.min, int(info.max) + 1, shape).astype(in_dtype)
    a.flat[:4], b.flat[:4] = [info.min, info.max, info.min, info.max], [info.min, info.max, info.max, info.min]
    got = _qlinear_add(monkeypatch, True, a, b, out_dtype)
    want = _qlinear_add(monkeypatch, False, a, b, out_dtype)
    assert got.dtype == want.dtype == np.dtype(out_dtype)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(_qlinear_add(monkeypatch, True, a.T, b.T, out_dtype), want.T)  # non-contiguous


def _qlinear_add_formula(a, b, ka, kb, offset, out_dtype):
    value = a.astype(np.float32) * ka + b.astype(np.float32) * kb + offset  # float32 throughout, this order
    info = np.iinfo(out_dtype)
    return np.clip(np.rint(value), info.min, info.max).astype(out_dtype)


@needs_native
@pytest.mark.parametrize("in_dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("out_dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("ka, kb, offset", [(0.5, 0.25, 0.0), (0.1, 0.3, 0.0), (0.5, -0.5, 0.5), (3.0, 2.5, -40.0),
                                            (1e-3, 7e-4, 127.5), (3e38, 1.0, 0.0)])
def test_qlinear_add_ties_saturation_and_tails(in_dtype, out_dtype, ka, kb, offset):
    """Exact halves (round half to even), sums that a fused multiply-add would round differently, values far past
    the output range (to infinity) and every tail length of the vector loop: the native kernel gives the float32
    formula's bits."""
    info = np.iinfo(in_dtype)
    grid = np.arange(info.min, int(info.max) + 1).astype(in_dtype)
    a, b = np.repeat(grid, 256), np.tile(grid, 256)  # every pair of input values
    ka, kb, offset = np.float32(ka), np.float32(kb), np.float32(offset)
    with np.errstate(over="ignore"):
        for n in (a.size, 1, 15, 16, 17, 47):
            got = qconv.qlinear_add(a[:n], b[:n], ka, kb, offset, out_dtype)
            np.testing.assert_array_equal(got, _qlinear_add_formula(a[:n], b[:n], ka, kb, offset, out_dtype))


@needs_native
def test_qlinear_add_broadcast_uses_numpy(monkeypatch):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (2, 8, 5, 5)).astype(np.uint8)
    b = rng.integers(0, 256, (1, 8, 1, 1)).astype(np.uint8)
    np.testing.assert_array_equal(_qlinear_add(monkeypatch, True, a, b, np.uint8),
                                  _qlinear_add(monkeypatch, False, a, b, np.uint8))


# -- a model quantized by onnxruntime ----------------------------------------------------------------------------------
def _float_cnn() -> onnx.ModelProto:
    """conv 3x3 -> relu -> depthwise 3x3 stride 2 -> relu -> 1x1 -> relu, + residual, maxpool, GAP, Gemm."""
    rng = np.random.default_rng(0)

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], group=8),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"]),
             helper.make_node("Relu", ["c3"], ["r3"]),
             helper.make_node("Add", ["r2", "r3"], ["s"]),
             helper.make_node("MaxPool", ["s"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["p"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1)]
    inits = [weight("w1", 8, 3, 3, 3), weight("b1", 8), weight("w2", 8, 1, 3, 3), weight("b2", 8),
             weight("w3", 8, 8, 1, 1), weight("b3", 8), weight("wf", 4, 8), weight("bf", 4)]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 20, 20])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@needs_native
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_static_model_against_onnxruntime(per_channel, tmp_path, monkeypatch):
    source, target = tmp_path / "cnn.onnx", tmp_path / "cnn_qdq.onnx"
    onnx.save(_float_cnn(), str(source))
    quantize_static(source, target, (1, 3, 20, 20), 3, quant_format="QDQ", per_channel=per_channel)
    x = np.random.default_rng(9).normal(size=(1, 3, 20, 20)).astype(np.float32)
    want = ort_reference(target, {"x": x}, optimized=False)
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("CARRACK_NATIVE", flag)
        session = carrack.InferenceSession(str(target))
        assert session.optimizer_stats.get("qdq_to_integer_kernel", 0) >= 3
        results[flag] = session.run(None, {"x": x})[0]
    np.testing.assert_array_equal(results["1"], results["0"])
    np.testing.assert_allclose(results["1"], want, rtol=0, atol=output_step(target))


def _wide_cnn() -> onnx.ModelProto:
    """64-channel convolutions (depths 576 and 64: the int8 GEMM's AMX tiles where the CPU has them) with a residual
    add, on a 12x12 map (144 pixels: whole 32-row blocks and rows past them)."""
    rng = np.random.default_rng(5)

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"]),
             helper.make_node("Add", ["c2", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    inits = [weight("w1", 64, 64, 3, 3), weight("b1", 64), weight("w2", 64, 64, 1, 1), weight("b2", 64)]
    graph = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 12, 12])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _wide_qdq(tmp_path) -> str:
    """_wide_cnn quantized by onnxruntime's quantize_static (QDQ format); its path."""
    source, target = tmp_path / "wide.onnx", tmp_path / "wide_qdq.onnx"
    onnx.save(_wide_cnn(), str(source))
    quantize_static(source, target, (1, 64, 12, 12), 3, quant_format="QDQ")
    return str(target)


@needs_native
def test_wide_quantized_model_same_bits_at_any_thread_count_and_tile_kind(tmp_path, monkeypatch, amx_restored):
    """quantize_static's QDQ model of 64-channel convolutions: the same bits at 1, 2 and 4 threads with the AMX tiles
    on and off (VNNI), within one quantization step of onnxruntime."""
    from carrack.native import qgemm

    target = _wide_qdq(tmp_path)
    x = np.random.default_rng(9).normal(size=(1, 64, 12, 12)).astype(np.float32)
    want = ort_reference(target, {"x": x}, optimized=False)
    monkeypatch.setenv("CARRACK_NATIVE", "1")
    results = []
    for amx in (True, False):
        qgemm.amx(amx)
        for threads in (1, 2, 4):
            options = carrack.SessionOptions()
            options.intra_op_num_threads = threads
            session = carrack.InferenceSession(str(target), options)
            assert session.optimizer_stats.get("qdq_to_integer_kernel", 0) >= 2
            results.append(session.run(None, {"x": x})[0])
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    np.testing.assert_allclose(results[0], want, rtol=0, atol=output_step(target))
    assert len(np.unique(results[0])) > 10


# -- ONNX QLinearConv (QOperator format) with constant weights -------------------------------------------------------
@needs_native
@pytest.mark.parametrize("case", ["3x3_stride2_asym_pad", "depthwise_mult2_stride2", "grouped", "conv1d", "1x1"])
@pytest.mark.parametrize("x_dtype, per_channel", [(np.uint8, False), (np.int8, True)])
def test_qlinear_conv_native_matches_reference(case, x_dtype, per_channel, monkeypatch):
    x, w, attrs, group = _operands(case, x_dtype, False, seed=11)
    cout = w.shape[0]
    rng = np.random.default_rng(12)
    w_scale = (rng.uniform(0.5, 2, cout) * 0.01 if per_channel else np.array([0.01])).astype(np.float32)
    inits = {"xs": np.float32(0.05), "xz": np.array(7, x_dtype), "w": w,
             "ws": w_scale.reshape(-1 if per_channel else ()), "wz": np.zeros(cout if per_channel else (), np.int8),
             "ys": np.float32(0.05 * 0.01 * 40 * np.sqrt(w[0].size)),
             "yz": np.array(-3 if x_dtype == np.int8 else 120, x_dtype),
             "b": rng.integers(-2000, 2000, cout).astype(np.int32)}
    node = helper.make_node("QLinearConv", ["x", *inits], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", _ONNX[np.dtype(x_dtype)], x.shape)],
                              [helper.make_tensor_value_info("y", _ONNX[np.dtype(x_dtype)], None)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("CARRACK_NATIVE", flag)
        session = carrack.InferenceSession(model)
        kernels = [st.kernel for st in session._program.steps if st.node.op_type == "QLinearConv"]
        assert len(kernels) == 1 and (kernels[0].native is not None) == (flag == "1")
        results[flag] = session.run(None, {"x": x})[0]
    np.testing.assert_array_equal(results["1"], results["0"])
    assert len(np.unique(results["1"])) > 2


# -- QuantizeLinear's float32 fast path ------------------------------------------------------------------------------
@pytest.mark.parametrize("zero_point", [np.array(128, np.uint8), np.array(0, np.uint8), np.array(-128, np.int8),
                                        np.array(127, np.int8), None])
@pytest.mark.parametrize("scale", [0.0123, 1.0, 1e-30, 0.5])
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_quantize_linear_fast_path_matches_general(zero_point, scale, monkeypatch):
    from carrack.ops import quant

    rng = np.random.default_rng(0)
    specials = [np.inf, -np.inf, 3e38, -3e38, 0.5, 1.5, 2.5, -0.5, -2.5, 1e-45, 16777217, 50331648, 127.5, 255.5]
    x = np.concatenate([rng.standard_normal(5000) * 100, specials]).astype(np.float32).reshape(2, -1)
    inputs = {"x": x, "s": np.float32(scale)}
    if zero_point is not None:
        inputs["z"] = zero_point
    node = helper.make_node("QuantizeLinear", list(inputs), ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT if v.dtype == np.float32
                                                                          else _ONNX[v.dtype], v.shape)
                                            for k, v in inputs.items()],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()
    fast = carrack.InferenceSession(model).run(None, inputs)[0]
    monkeypatch.setattr(quant, "_quantize_per_tensor_8bit", lambda *args: None)
    general = carrack.InferenceSession(model).run(None, inputs)[0]
    assert fast.dtype == general.dtype
    np.testing.assert_array_equal(fast, general)


# -- MaxPool on 8-bit values ----------------------------------------------------------------------------------------
POOLS = [({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, (1, 16, 56, 56)),
         ({"kernel_shape": [2, 2], "strides": [2, 2]}, (2, 8, 9, 9)),
         ({"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, (1, 4, 10, 11)),
         ({"kernel_shape": [3, 2], "strides": [1, 3], "dilations": [2, 2], "pads": [2, 1, 0, 3]}, (1, 3, 12, 13)),
         ({"kernel_shape": [5], "strides": [2], "pads": [2, 2]}, (2, 3, 17)),
         ({"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]}, (1, 5, 7, 8)),
         ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, (1, 2, 5, 300)),
         ({"kernel_shape": [3, 3], "pads": [2, 2, 2, 2]}, (1, 2, 1, 1))]


@needs_native
@pytest.mark.parametrize("attrs, shape", POOLS)
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_maxpool_8bit_native_matches_numpy(attrs, shape, dtype, monkeypatch):
    from carrack.ir.graph import Node
    from carrack.ops import pool

    info = np.iinfo(dtype)
    x = np.random.default_rng(len(shape)).integers(info.min, int(info.max) + 1, shape).astype(dtype)
    kernel = pool.MaxPool(Node("MaxPool", ["x"], ["y"], attrs), 12, None)
    calls = []
    original = qconv.maxpool_8bit
    monkeypatch.setattr(qconv, "maxpool_8bit", lambda *a: calls.append(1) or original(*a))
    got = kernel.run(x)
    monkeypatch.setenv("CARRACK_NATIVE", "0")
    want = kernel.run(x)
    assert calls and got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@needs_native
@pytest.mark.parametrize("out_dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("nan_at", [None, 3, 2000, 2040])
def test_quantize_8bit_native(out_dtype, nan_at):
    """The one-pass native QuantizeLinear gives the float32 formula's bytes (ties, saturation, every tail length of
    the vector loop), and declines (None) when a NaN is anywhere, in the vector loop or the tail."""
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(2037) * 300, [0.5, 1.5, -2.5, 254.5, -128.5, np.inf, -np.inf]])
    x = x.astype(np.float32)
    if nan_at is not None:
        x[nan_at] = np.nan
    scale, zero = np.float32(0.5), np.float32(3 if out_dtype == np.uint8 else -2)
    info = np.iinfo(out_dtype)
    with np.errstate(invalid="ignore"):
        want = np.clip(np.rint(x / scale) + zero, info.min, info.max)
    for n in (x.size, 1, 15, 16, 17, 2037):
        got = qconv.quantize_8bit(x[:n], scale, zero, out_dtype)
        if nan_at is not None and nan_at < n:
            assert got is None
        else:
            np.testing.assert_array_equal(got, want[:n].astype(out_dtype))


# -- a GEMM convolution as one parallel region -----------------------------------------------------------------------
REGION_CASES = {
    # name: (x shape, cout, kernel, attrs, group): big maps cut into pixel tiles, small ones into column tiles
    "56x56_1x1": ((1, 64, 56, 56), 96, (1, 1), {}, 1),
    "28x28_3x3": ((1, 32, 28, 28), 64, (3, 3), {"pads": [1, 1, 1, 1]}, 1),
    "7x7_3x3_column_tiles": ((1, 64, 7, 7), 320, (3, 3), {"pads": [1, 1, 1, 1]}, 1),
    "1x1_stride2_two_images": ((2, 128, 13, 13), 200, (1, 1), {"strides": [2, 2]}, 1),
    "grouped_14x14": ((1, 64, 14, 14), 128, (3, 3), {"pads": [1, 1, 1, 1], "group": 2}, 2),
}


@needs_native
@pytest.mark.parametrize("case", list(REGION_CASES))
@pytest.mark.parametrize("x_dtype", [np.uint8, np.int8])
def test_gemm_convolution_is_one_region_with_the_same_bits(case, x_dtype):
    """At 2 and 4 threads a GEMM convolution splits its work once (im2col or transpose, product, requantization
    and the transpose back in the same pieces) and gives the int64 reference's bytes, as at 1 thread."""
    from carrack.native import intra_op

    shape, cout, kernel, attrs, group = REGION_CASES[case]
    rng = np.random.default_rng(len(case))
    info = np.iinfo(x_dtype)
    x = rng.integers(info.min, int(info.max) + 1, shape).astype(x_dtype)
    w = rng.integers(-128, 128, (cout, shape[1] // group, *kernel)).astype(np.int8)
    bias = rng.integers(-5000, 5000, cout).astype(np.int32)
    y_scale = 0.05 * 0.01 * 60 * np.sqrt(w[0].size)
    model = _qdq_conv(x.shape, x_dtype, w, np.float32(0.01), np.int8(0), bias, attrs, np.uint8, y_scale=y_scale)
    pads = attrs.get("pads", [0, 0, 0, 0])
    want = _reference(x, 3, w, 0, bias, 0.05, np.float32(0.01), y_scale, 5, np.dtype(np.uint8),
                      attrs.get("strides", [1, 1]), pads, [1, 1], group)
    for threads in (1, 2, 4):
        options = carrack.SessionOptions()
        options.intra_op_num_threads = threads
        session = carrack.InferenceSession(model, options)
        assert session.optimizer_stats.get("qdq_to_integer_kernel", 0) == 1
        session.run(None, {"x": x})
        intra_op.trace_regions(True)
        got = session.run(None, {"x": x})[0]
        intra_op.trace_regions(False)
        np.testing.assert_array_equal(got, want, err_msg=f"{threads} threads")
        split = [part for part in intra_op.region_trace() if part.slot == -1]
        if threads == 1:
            assert split == []
        elif native.library("threadpool") is not None:  # without it every kernel runs on one thread
            assert len(split) == 1 and split[0].pieces > 1, f"{threads} threads: {split}"


@needs_native
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_quantize_and_dequantize_split_with_the_same_bits(dtype):
    """QuantizeLinear's and DequantizeLinear's native passes cut a large tensor over the threads: the same bytes at
    1, 2 and 4 threads as the float32 formulas, and a NaN in the last piece alone still declines."""
    from carrack.native import intra_op

    rng = np.random.default_rng(11)
    x = (rng.standard_normal(3 * 2**16 + 13) * 80).astype(np.float32)
    x[:6] = [0.5, 1.5, -2.5, 254.5, np.inf, -np.inf]
    info = np.iinfo(dtype)
    scale, zero = np.float32(0.5), np.float32(3 if dtype == np.uint8 else -2)
    want_q = np.clip(np.rint(x / scale) + zero, info.min, info.max).astype(dtype)
    want_d = (want_q.astype(np.float32) - zero) * scale
    with_nan = x.copy()
    with_nan[-20] = np.nan
    for threads in (1, 2, 4):
        with intra_op.intra_op_threads(threads):
            intra_op.trace_regions(True)
            q = qconv.quantize_8bit(x, scale, zero, dtype)
            out = np.empty(x.shape, np.float32)
            d = qconv.dequantize_8bit(q, zero, scale, out)
            intra_op.trace_regions(False)
            assert qconv.quantize_8bit(with_nan, scale, zero, dtype) is None
        np.testing.assert_array_equal(q, want_q, err_msg=f"{threads} threads")
        assert d is out
        np.testing.assert_array_equal(d, want_d, err_msg=f"{threads} threads")
        split = [part for part in intra_op.region_trace() if part.slot == -1]
        if threads > 1 and native.library("threadpool") is not None:
            assert len(split) == 2 and all(part.pieces > 1 for part in split)


@needs_native
@pytest.mark.parametrize("zero_point", [np.array(128, np.uint8), np.array(-7, np.int8), None])
def test_dequantize_linear_native_into_a_buffer_matches_numpy(zero_point, monkeypatch):
    """DequantizeLinear per tensor from 8 bits: the native pass (written into the buffer it is given) equals the
    numpy operations, tails and extremes included."""
    from carrack.ir.graph import Node
    from carrack.ops import quant

    dtype = np.uint8 if zero_point is None else zero_point.dtype
    info = np.iinfo(dtype)
    x = np.concatenate([np.arange(info.min, int(info.max) + 1),
                        np.random.default_rng(2).integers(info.min, int(info.max) + 1, 4000)]).astype(dtype)
    x = x[:4141].reshape(41, 101)
    scale = np.float32(0.0371)
    inputs = [x, scale] if zero_point is None else [x, scale, zero_point]
    kernel = quant.DequantizeLinear(Node("DequantizeLinear", ["x", "s", "z"][:len(inputs)], ["y"], {}), 21, None)
    calls = []
    original = qconv.dequantize_8bit
    monkeypatch.setattr(qconv, "dequantize_8bit", lambda *a: calls.append(1) or original(*a))
    out = np.empty(x.shape, np.float32)
    got = kernel.run_into(out, *inputs)
    monkeypatch.setenv("CARRACK_NATIVE", "0")
    want = kernel.run(*inputs)
    assert calls and got is out
    np.testing.assert_array_equal(got, want)
    zero = np.float32(0) if zero_point is None else np.float32(zero_point)
    np.testing.assert_array_equal(got, (x.astype(np.float32) - zero) * scale)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_bound_convolution_steps_follow_their_inputs(tmp_path, monkeypatch, threads):
    """Runs that reuse an arena call the convolutions and the residual QLinearAdd bound to its views
    (QuantizedConv.bound_call, QLinearAdd.bind_into): every run's result is a fresh session's for its input, in any
    order of inputs."""
    target = _wide_qdq(tmp_path)
    bound, adds = [], []
    original, original_add = qconv.QuantizedConv.bound_call, contrib_quant.QLinearAdd.bind_into
    monkeypatch.setattr(qconv.QuantizedConv, "bound_call",
                        lambda *args: (lambda call: bound.append(call) or call)(original(*args)))
    monkeypatch.setattr(contrib_quant.QLinearAdd, "bind_into",
                        lambda *args: (lambda call: adds.append(call) or call)(original_add(*args)))
    options = carrack.SessionOptions()
    options.intra_op_num_threads = threads
    session = carrack.InferenceSession(target, options)
    inputs = [np.random.default_rng(i).normal(size=(1, 64, 12, 12)).astype(np.float32) for i in range(3)]
    want = [carrack.InferenceSession(target, options).run(None, {"x": x})[0] for x in inputs]
    for k in (0, 1, 2, 0, 2, 1, 1, 0):
        np.testing.assert_array_equal(session.run(None, {"x": inputs[k]})[0], want[k], err_msg=f"input {k}")
    assert any(call is not None for call in bound) and any(call is not None for call in adds)
    assert not np.array_equal(want[0], want[1])


@needs_native
@pytest.mark.parametrize("channels, kernel, padded", [(3, 7, 192), (5, 5, 128), (3, 3, 27), (64, 1, 64)])
def test_depth_padded_for_amx_gives_the_same_bytes(channels, kernel, padded, amx_restored):
    """Where AMX tiles run, a depth that is not a multiple of 64 (the 7x7 stem on 3 channels: 147) is padded with
    zero weight rows to one when that costs at most half as much again; A's padding columns are never written. The
    bytes equal the unpadded product's (VNNI) and the int64 reference at 1 and 2 threads."""
    from carrack.native import intra_op, qgemm

    rng = np.random.default_rng(channels * kernel)
    w = rng.integers(-128, 128, (80, channels, kernel, kernel)).astype(np.int8)
    bias = rng.integers(-3000, 3000, 80).astype(np.int32)
    x = rng.integers(0, 256, (1, channels, 45, 41)).astype(np.uint8)
    y_scale = 0.05 * 0.01 * 60 * np.sqrt(w[0].size)
    multiplier = np.full(80, np.float32(0.05) * np.float32(0.01) / np.float32(y_scale), np.float32)
    pads, strides = [kernel // 2] * 4, [2, 2]
    want = _reference(x, 3, w, 0, bias, 0.05, np.float32(0.01), y_scale, 5, np.dtype(np.uint8), strides, pads,
                      [1, 1], 1)
    qgemm.amx(False)
    plain = qconv.QuantizedConv.prepare(w.astype(np.float64), bias, multiplier, 1, 3)
    amx = qgemm.amx(True)
    tiled = qconv.QuantizedConv.prepare(w.astype(np.float64), bias, multiplier, 1, 3)
    assert plain.gemm_depth == channels * kernel * kernel
    assert tiled.gemm_depth == (padded if amx else channels * kernel * kernel)
    for threads in (1, 2):
        with intra_op.intra_op_threads(threads):
            for conv in (plain, tiled):
                got = conv.run(x, np.array(5, np.uint8), conv.plan(x.shape, strides, pads, [1, 1]))
                np.testing.assert_array_equal(got, want, err_msg=f"depth {conv.gemm_depth}, {threads} threads")
