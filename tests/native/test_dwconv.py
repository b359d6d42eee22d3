"""The native convolution kernels (dwconv.c, convgemm.c): depthwise, 1x1 / im2col products and pools, with the
fused bias and activation, against float64 references, the numpy path (CARRACK_NATIVE=0) and onnxruntime."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from carrack import native
from carrack.native import convolution as native_conv
from carrack.ops import conv
from carrack.runtime.options import SessionOptions
from carrack.runtime.session import InferenceSession
from tests.helpers import ort_run

needs_native = pytest.mark.skipif(native_conv.load() is None, reason="native convolution kernels not built here")

#: (ONNX activation op, its attributes, the Epilogue code/alpha/beta, float64 reference)
ACTIVATIONS = {
    "none": (None, {}, None, lambda y: y),
    "Relu": ("Relu", {}, (1, 0.0, 0.0), lambda y: np.maximum(y, 0)),
    "Clip": ("Clip", {}, (2, 0.0, 6.0), lambda y: np.clip(y, 0, 6)),
    "LeakyRelu": ("LeakyRelu", {"alpha": 0.1}, (3, 0.1, 0.0), lambda y: np.where(y < 0, 0.1 * y, y)),
    "HardSigmoid": ("HardSigmoid", {"alpha": 0.2, "beta": 0.4}, (4, 0.2, 0.4), lambda y: np.clip(0.2 * y + 0.4, 0, 1)),
    "HardSwish": ("HardSwish", {}, (5, 0.0, 0.0), lambda y: y * np.clip(y / 6 + 0.5, 0, 1)),
    "Sigmoid": ("Sigmoid", {}, (6, 0.0, 0.0), lambda y: 1 / (1 + np.exp(-y))),
    "Tanh": ("Tanh", {}, None, np.tanh),  # not a native code: the numpy function runs after the kernel
}


def _epilogue(name: str) -> conv.Epilogue | None:
    code = ACTIVATIONS[name][2]
    ref = ACTIVATIONS[name][3]

    def apply(y: np.ndarray) -> np.ndarray:
        y[...] = ref(y.astype(np.float64))
        return y

    if name == "none":
        return None
    return conv.Epilogue(apply, *(code or (-1, 0.0, 0.0)))


def _reference(x, w, b, strides, pads, dilations, group, act: str) -> np.ndarray:
    y = conv._convolve_nd(x.astype(np.float64), w.astype(np.float64), strides, pads, dilations, group)
    if b is not None:
        y = y + b.astype(np.float64).reshape((1, -1) + (1,) * (y.ndim - 2))
    return ACTIVATIONS[act][3](y)


def _case(rng, depthwise: bool, nd: int = 2) -> dict:
    group = int(rng.integers(1, 6)) if depthwise else int(rng.choice([1, 1, 2, 3]))
    cg = 1 if depthwise else int(rng.choice([1, 2, 3, 5, 8, 11]))  # 4+: the direct convolution, else columns
    mg = int(rng.choice([1, 1, 2, 3])) if depthwise else int(rng.integers(1, 14))
    kernel = [int(rng.integers(1, 6)) for _ in range(nd)]
    spatial = [int(rng.integers(1, 40)) for _ in range(nd)]
    dilations = [int(rng.integers(1, 3)) for _ in range(nd)]
    pads = [int(rng.integers(0, 4)) for _ in range(2 * nd)]
    for i in range(nd):  # keep at least one output
        pads[i + nd] = max(pads[i + nd], (kernel[i] - 1) * dilations[i] + 1 - spatial[i] - pads[i])
    return dict(n=int(rng.integers(1, 3)), c=cg * group, m=mg * group, group=group, kernel=kernel, spatial=spatial,
                strides=[int(rng.integers(1, 4)) for _ in range(nd)], dilations=dilations, pads=pads)


def _run_case(case: dict, act: str, rng, noncontiguous: bool = False, bias: bool = True):
    x = rng.standard_normal([case["n"], case["c"]] + case["spatial"]).astype(np.float32)
    if noncontiguous:  # every other column of a wider image
        wide = rng.standard_normal(list(x.shape[:-1]) + [2 * x.shape[-1]]).astype(np.float32)
        wide[..., ::2] = x
        x = wide[..., ::2]
    w = rng.standard_normal([case["m"], case["c"] // case["group"]] + case["kernel"]).astype(np.float32)
    b = rng.standard_normal(case["m"]).astype(np.float32) if bias else None
    geometry = dict(strides=case["strides"], pads=case["pads"], dilations=case["dilations"], group=case["group"])
    expected = _reference(x, w, b, **geometry, act=act)
    got_native = conv.convolve(x, w, bias=b, activation=_epilogue(act), kernels=native_conv.load(), **geometry)
    got_numpy = conv.convolve(x, w, bias=b, activation=_epilogue(act), kernels=None, **geometry)
    scale = max(1.0, float(np.abs(expected).max(initial=0)))
    np.testing.assert_allclose(got_native, expected, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(got_native, got_numpy, rtol=1e-5, atol=1e-5 * scale)
    return got_native


@needs_native
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_depthwise_matches_reference(act):
    rng = np.random.default_rng(abs(hash(act)) % 1000)
    for i in range(25):
        _run_case(_case(rng, depthwise=True), act, rng, noncontiguous=i % 5 == 0, bias=i % 3 != 0)


@needs_native
@pytest.mark.parametrize("act", ["none", "Relu", "Clip", "HardSwish", "Sigmoid", "Tanh"])
def test_products_match_reference(act):
    """1x1 (grouped, strided) and im2col convolutions through the native matrix product."""
    rng = np.random.default_rng(7 + len(act))
    for i in range(25):
        case = _case(rng, depthwise=False)
        if i % 2:
            case.update(kernel=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1])
        _run_case(case, act, rng, noncontiguous=i % 7 == 0, bias=i % 3 != 0)


@needs_native
@pytest.mark.parametrize("stride", [1, 2])
def test_direct_convolution_shapes(stride):
    """Output rows of up to 16, 32 and more pixels (4, 2 and 1 rows a tile), row tiles of 1 to 6 outputs."""
    rng = np.random.default_rng(20 + stride)
    for width in [3, 13, 16, 17, 27, 32, 40, 64, 70]:
        m = int(rng.integers(1, 14))
        case = dict(n=1, c=16, m=2 * m, group=2, kernel=[3, 2], spatial=[9, width], strides=[stride, stride],
                    dilations=[1, 2], pads=[1, 0, 2, 1])
        _run_case(case, "Relu", rng, noncontiguous=width == 17)


@needs_native
@pytest.mark.parametrize("depthwise", [True, False])
def test_same_padding_runs_flat_across_rows(depthwise):
    """Stride 1 with output rows as wide as the input's: the kernels run their vectors across output rows, each
    lane masked by its own row and column (narrow maps, asymmetric and dilated pads, heights that differ)."""
    rng = np.random.default_rng(40 + depthwise)
    shapes = [(7, 7, [3, 3], [1, 1], [1, 1, 1, 1]), (14, 14, [3, 3], [1, 1], [1, 1, 1, 1]),
              (13, 13, [3, 3], [1, 1], [1, 1, 1, 1]), (5, 1, [3, 1], [1, 1], [1, 0, 1, 0]),
              (9, 11, [5, 3], [1, 2], [2, 0, 1, 4]), (4, 3, [3, 3], [1, 1], [0, 1, 3, 1]),
              (1, 17, [1, 5], [1, 1], [0, 4, 0, 0]), (27, 27, [3, 3], [1, 1], [1, 1, 1, 1]),
              (3, 55, [3, 3], [2, 1], [2, 1, 2, 1]), (16, 16, [7, 7], [1, 1], [3, 3, 3, 3])]
    for h, w, kernel, dilations, pads in shapes:
        assert pads[1] + pads[3] == (kernel[1] - 1) * dilations[1]
        group, cg = (3, 1) if depthwise else (1, int(rng.choice([4, 7, 16])))
        case = dict(n=int(rng.integers(1, 3)), c=cg * group, m=int(rng.choice([1, 2])) * group if depthwise
                    else int(rng.integers(1, 14)), group=group, kernel=kernel, spatial=[h, w], strides=[1, 1],
                    dilations=dilations, pads=pads)
        _run_case(case, "Clip", rng)


@needs_native
@pytest.mark.parametrize("pixels", [17, 18, 33, 49, 50, 196, 785])
def test_pixel_tails_as_dot_products(pixels):
    """A row of pixels one or two past a whole vector (a 7x7 map: 49) ends in dot products along the depth: every
    depth (below, at and past a vector), tile heights 1 to 6, with and without bias and residual, against float64."""
    kernels = native_conv.load()
    rng = np.random.default_rng(pixels)
    for depth, m, groups in [(1, 1, 1), (5, 7, 1), (16, 6, 2), (33, 13, 1), (160, 12, 3)]:
        x = rng.standard_normal((2, depth * groups, pixels)).astype(np.float32)
        w = rng.standard_normal((m * groups, depth)).astype(np.float32)
        b = rng.standard_normal(m * groups).astype(np.float32) if depth % 2 else None
        z = rng.standard_normal((2, m * groups, pixels)).astype(np.float32) if m % 2 else None
        y = np.full((2, m * groups, pixels), np.nan, np.float32)
        assert kernels.gemm(x, w, b, y, groups, (2, -1.0, 1.5), z=z)
        xg = x.astype(np.float64).reshape(2, groups, depth, pixels)
        ref = np.einsum("gmk,ngkp->ngmp", w.astype(np.float64).reshape(groups, m, depth), xg).reshape(y.shape)
        ref = ref + (0 if b is None else b[:, None]) + (0 if z is None else z)
        np.testing.assert_allclose(y, np.clip(ref, -1.0, 1.5), rtol=1e-5, atol=1e-5 * max(1, depth ** 0.5))


@needs_native
def test_one_dimensional_and_specialised_shapes():
    rng = np.random.default_rng(3)
    for _ in range(10):
        _run_case(_case(rng, depthwise=True, nd=1), "Relu", rng)
        _run_case(_case(rng, depthwise=False, nd=1), "Clip", rng)
    # the 3x3 stride 1 / 2 kernels, narrow (flat) and wide rows, odd sizes, channel multipliers
    for size, stride, mult in [(112, 1, 1), (57, 2, 1), (7, 1, 1), (14, 2, 2), (33, 1, 3), (1, 1, 1), (2, 2, 1)]:
        case = dict(n=1, c=5, m=5 * mult, group=5, kernel=[3, 3], spatial=[size, size + 3], strides=[stride] * 2,
                    dilations=[1, 1], pads=[1, 1, 1, 1])
        _run_case(case, "Clip", rng)
    # big kernels (more than 64 taps) and strides beyond the phase-plane limit fall back or still match
    _run_case(dict(n=1, c=2, m=2, group=2, kernel=[9, 9], spatial=[20, 20], strides=[1, 1], dilations=[1, 1],
                   pads=[4, 4, 4, 4]), "Relu", rng)
    _run_case(dict(n=1, c=2, m=2, group=2, kernel=[2, 2], spatial=[30, 30], strides=[9, 9], dilations=[1, 1],
                   pads=[0, 0, 0, 0]), "none", rng)


@needs_native
@pytest.mark.parametrize("kind", ["depthwise", "pointwise", "columns", "direct"])
def test_broadcast_weights_and_bias(kind):
    """Constant weights may be zero-stride broadcasts (uniform initializers): the C code must get dense copies."""
    rng = np.random.default_rng(8)
    c, m, k, group = {"depthwise": (6, 6, 3, 6), "pointwise": (6, 9, 1, 1), "columns": (3, 7, 5, 1),
                      "direct": (8, 7, 3, 1)}[kind]
    x = rng.standard_normal((1, c, 17, 19)).astype(np.float32)
    w = np.broadcast_to(np.float32(0.25), (m, c // group, k, k))
    b = np.broadcast_to(np.float32(-0.5), (m,))
    geometry = dict(strides=[2, 1], pads=[k // 2] * 4, dilations=[1, 1], group=group)
    got = conv.convolve(x, w, bias=b, kernels=native_conv.load(), **geometry)
    np.testing.assert_allclose(got, _reference(x, w, b, **geometry, act="none"), rtol=1e-5, atol=1e-5)


@needs_native
def test_writes_into_the_given_buffer_and_not_into_inputs():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 6, 9, 9)).astype(np.float32)
    x.setflags(write=False)
    kernels = native_conv.load()
    for w, group in [(rng.standard_normal((6, 1, 3, 3)), 6), (rng.standard_normal((4, 6, 1, 1)), 1),
                     (rng.standard_normal((4, 3, 3, 3)), 2)]:
        w = w.astype(np.float32)
        out = np.full((1, w.shape[0], 9, 9), np.nan, np.float32)
        y = conv.convolve(x, w, strides=[1, 1], pads=[1, 1, 1, 1] if w.shape[2] == 3 else [0] * 4,
                          dilations=[1, 1], group=group, out=out, kernels=kernels)
        assert np.shares_memory(y, out) and not np.isnan(out).any()
    assert not x.flags.writeable


@needs_native
def test_threads_split_the_work(monkeypatch):
    rng = np.random.default_rng(5)
    from carrack.native.intra_op import intra_op_threads

    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)  # split even small calls
    calls = []
    threads = native.threads
    monkeypatch.setattr(native, "threads", lambda: calls.append(threads()) or calls[-1])
    with intra_op_threads(2):
        for case in [dict(n=2, c=64, m=64, group=64, kernel=[3, 3], spatial=[40, 40], strides=[1, 1],
                          dilations=[1, 1], pads=[1, 1, 1, 1]),
                     dict(n=1, c=32, m=48, group=1, kernel=[1, 1], spatial=[40, 40], strides=[1, 1],
                          dilations=[1, 1], pads=[0, 0, 0, 0]),
                     dict(n=1, c=16, m=24, group=2, kernel=[3, 3], spatial=[20, 20], strides=[1, 1],
                          dilations=[1, 1], pads=[1, 1, 1, 1]),
                     dict(n=1, c=3, m=8, group=1, kernel=[3, 3], spatial=[30, 30], strides=[2, 2],
                          dilations=[1, 1], pads=[1, 1, 1, 1])]:
            _run_case(case, "Relu", rng)
    x = rng.standard_normal((1, 6, 30, 30)).astype(np.float32)
    with intra_op_threads(2):
        y = native_conv.load().pool(x, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1], [15, 15], native_conv.POOL_MAX)
    expected = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    expected = np.max([expected[:, :, i:i + 29:2, j:j + 29:2] for i in range(3) for j in range(3)], axis=0)
    np.testing.assert_array_equal(y, expected)
    assert calls and max(calls) >= 2  # the sessions of _run_case use every core


def test_activation_edges():
    """NaN stays NaN through the activations; sigmoid saturates without overflow warnings."""
    kernels = native_conv.load()
    if kernels is None:
        pytest.skip("native convolution kernels not built here")
    y = np.array([[np.nan, -np.inf, np.inf, -100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 3.0, 20.0, 100.0]], np.float32)
    y = np.repeat(y, 3, axis=0).reshape(1, 3, -1)
    for name in ACTIVATIONS:
        code = ACTIVATIONS[name][2]
        if code is None:
            continue
        got = y.copy()
        assert kernels.bias_activation(got, None, code)
        with np.errstate(over="ignore", invalid="ignore"):
            expected = ACTIVATIONS[name][3](y.astype(np.float64))
        np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-37, err_msg=name)  # float32 range


# -- through sessions ------------------------------------------------------------------------------------------------
def _conv_act_model(x_shape, w, b, act: str, **attrs) -> onnx.ModelProto:
    op, act_attrs = ACTIVATIONS[act][:2]
    inits = [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel()),
             helper.make_tensor("b", TensorProto.FLOAT, b.shape, b.ravel())]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c" if op else "y"], **attrs)]
    if op == "Clip":
        inits += [helper.make_tensor("lo", TensorProto.FLOAT, [], [0.0]),
                  helper.make_tensor("hi", TensorProto.FLOAT, [], [6.0])]
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
    elif op:
        nodes.append(helper.make_node(op, ["c"], ["y"], **act_attrs))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _session_outputs(model: onnx.ModelProto, feed: dict, monkeypatch, threads: int = 1) -> dict[str, np.ndarray]:
    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("CARRACK_NATIVE", flag)
        sess = InferenceSession(model.SerializeToString(), SessionOptions(intra_op_num_threads=threads))
        results[flag] = sess.run(None, feed)[0]
        results[flag + "-again"] = sess.run(None, feed)[0]  # the second run writes into the planned arena
    results["ort"] = ort_run(model, feed)[0]
    return results


@pytest.mark.parametrize("act", ["Relu", "Clip", "LeakyRelu", "HardSigmoid", "HardSwish", "Sigmoid", "Tanh"])
def test_fused_conv_sessions_match_onnxruntime(act, monkeypatch):
    rng = np.random.default_rng(len(act))
    x = rng.standard_normal((1, 12, 17, 15)).astype(np.float32)
    for w_shape, attrs in [((12, 1, 3, 3), dict(group=12, pads=[1, 1, 1, 1], strides=[2, 2])),
                           ((24, 12, 1, 1), {}), ((8, 3, 3, 3), dict(group=4, pads=[0, 1, 2, 1]))]:
        w = rng.standard_normal(w_shape).astype(np.float32)
        b = rng.standard_normal(w_shape[0]).astype(np.float32)
        out = _session_outputs(_conv_act_model(x.shape, w, b, act, **attrs), {"x": x}, monkeypatch)
        for key, value in out.items():
            np.testing.assert_allclose(value, out["ort"], rtol=1e-5, atol=1e-5, err_msg=f"{act} {attrs} {key}")


def _pool_model(op: str, x_shape, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


POOLS = [dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
         dict(kernel_shape=[3, 3], strides=[2, 2]),
         dict(kernel_shape=[2, 3], strides=[2, 1], pads=[0, 1, 1, 0], ceil_mode=1),
         dict(kernel_shape=[3, 3], strides=[3, 2], pads=[1, 1, 1, 1], ceil_mode=1),
         dict(kernel_shape=[3, 2], dilations=[2, 1], pads=[2, 0, 1, 1]),
         dict(kernel_shape=[7, 7]),
         dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2])]


@pytest.mark.parametrize("attrs", POOLS)
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "AveragePool-pads"])
def test_pools_match_numpy_and_onnxruntime(op, attrs, monkeypatch):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 13, 16)).astype(np.float32)
    attrs = dict(attrs)
    if op == "AveragePool-pads":
        op, attrs["count_include_pad"] = "AveragePool", 1
    if op == "MaxPool":
        x[0, 1, 4, 5] = np.nan
    out = _session_outputs(_pool_model(op, x.shape, **attrs), {"x": x}, monkeypatch)
    ort = out.pop("ort")
    for key, value in out.items():  # NaN where numpy has it (numpy's maximum keeps NaN)
        np.testing.assert_allclose(value, out["0"], rtol=1e-6, atol=1e-6, err_msg=key)
    nan = np.isnan(out["1"]) | np.isnan(ort)  # onnxruntime's MaxPool may drop a NaN: compare away from it
    np.testing.assert_allclose(np.where(nan, 0, out["1"]), np.where(nan, 0, ort), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op,attrs", [("GlobalAveragePool", {}), ("AveragePool", {"kernel_shape": [13, 16]}),
                                      ("AveragePool", {"kernel_shape": [13, 16], "strides": [2, 2]})])
def test_global_average_matches_numpy_and_onnxruntime(op, attrs, monkeypatch):
    x = np.random.default_rng(10).standard_normal((2, 5, 13, 16)).astype(np.float32)
    out = _session_outputs(_pool_model(op, x.shape, **attrs), {"x": x}, monkeypatch)
    expected = x.astype(np.float64).mean(axis=(2, 3), keepdims=True)
    for key, value in out.items():
        assert value.shape == (2, 5, 1, 1), key
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6, err_msg=key)


# -- the portable build --------------------------------------------------------------------------------------------
@pytest.mark.skipif(native.compiler() is None and not native.manifest(), reason="no prebuilt kernels, no compiler")
def test_portable_build_without_avx512(monkeypatch):
    """The scalar fallback of the C files (the portable variant: what non-AVX-512 machines and wasm32 run) computes
    the same."""
    if os.uname().machine not in ("x86_64", "amd64"):
        pytest.skip("the portable variant is the only one off x86")
    monkeypatch.setenv("CARRACK_NATIVE_VARIANT", "portable")
    monkeypatch.delenv("CARRACK_NATIVE", raising=False)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_reasons", {})
    kernels = native_conv.load()
    assert kernels is not None, native.unavailable_reason("dwconv") or native.unavailable_reason("convgemm")
    assert "portable" in native.origin("dwconv") and "portable" in native.origin("convgemm")
    rng = np.random.default_rng(12)
    for i in range(12):
        case = _case(rng, depthwise=i % 2 == 0)
        _run_case(case, ["Clip", "Sigmoid", "HardSwish", "LeakyRelu"][i % 4], rng)
    for stride in (1, 2):  # the direct convolution, and 3x3 depthwise kernels of stride 1 and 2
        _run_case(dict(n=1, c=16, m=6, group=2, kernel=[3, 3], spatial=[7, 20], strides=[stride] * 2,
                       dilations=[1, 1], pads=[1, 1, 1, 1]), "Relu", rng)
        _run_case(dict(n=1, c=3, m=3, group=3, kernel=[3, 3], spatial=[9, 21], strides=[stride] * 2,
                       dilations=[1, 1], pads=[1, 1, 1, 1]), "Clip", rng)
    x = rng.standard_normal((1, 2, 11, 12)).astype(np.float32)
    x[0, 0, 3, 3] = np.nan
    y = kernels.pool(x, [3, 3], [2, 2], [1, 1], [1, 1, 1, 1], [6, 6], native_conv.POOL_MAX)
    assert np.isnan(y[0, 0, 1:3, 1:3]).all() and not np.isnan(y[0, 1]).any()
    y = kernels.pool(x[:, 1:], [3, 3], [2, 2], [1, 1], [1, 1, 1, 1], [6, 6], native_conv.POOL_AVERAGE_PADS)
    padded = np.pad(x[0, 1].astype(np.float64), 1)
    expected = np.array([[padded[2 * i:2 * i + 3, 2 * j:2 * j + 3].mean() for j in range(6)] for i in range(6)])
    np.testing.assert_allclose(y[0, 0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernels.plane_mean(x[:, 1:]), x[:, 1:].mean(axis=(2, 3), keepdims=True), rtol=1e-5)
    # the depth-blocked matmul accumulates into its own result (the portable tile reads it before writing)
    from carrack.native import matmul as native_matmul

    lib = native.library("convgemm")
    assert native_matmul._load() is None  # no vector code: MatMul keeps numpy's BLAS
    a = rng.standard_normal((13, 150)).astype(np.float32)
    b = rng.standard_normal((150, 70)).astype(np.float32)
    y = np.zeros((13, 70), np.float32)
    lib.matmul_f32(*[ctypes.c_void_p(native.data_address(v)) for v in (a, b, y)],
                   *[ctypes.c_int64(v) for v in (13, 150, 70, 150, 70, 70, 64, 0, 3 * 2)])
    np.testing.assert_allclose(y, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)
