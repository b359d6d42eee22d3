"""Native row kernels (carrack/native/rowops.c): softmax, layer normalization, GELU, and the kernels using them.

Each is checked against float64 references, against the kernels' numpy paths (CARRACK_NATIVE=0), and, for the
com.microsoft ops, against onnxruntime; the portable C build (no intrinsics) is checked as well.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import carrack
from carrack import native
from carrack.native import rowops
from carrack.ops.elementwise import erfc
from tests.native.portable import native_and_portable

needs_native = pytest.mark.skipif(rowops.library() is None, reason="native row kernels unavailable")
LENGTHS = [1, 3, 17, 768, 1000]
MS = "com.microsoft"
rng = np.random.default_rng(7)


def _rand(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# -- float64 references ------------------------------------------------------------------------------------------------
def _softmax64(x: np.ndarray, scale: float = 1.0, bias: np.ndarray | None = None) -> np.ndarray:
    """Exact softmax of the float32 differences z - max(z), z = x * scale + bias rounded as float32 computes it
    (the rounding of z - max, up to |z - max| ulps of exp's result, is float32's, not the kernel's)."""
    z = x * np.float32(scale) + (np.float32(0) if bias is None else bias)
    e = np.exp((z - z.max(axis=-1, keepdims=True)).astype(np.float64))
    return e / e.sum(axis=-1, keepdims=True)


def _layer_norm64(s: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None, eps: float) -> np.ndarray:
    s = s.astype(np.float64)
    mean = s.mean(axis=-1, keepdims=True)
    y = (s - mean) / np.sqrt(((s - mean) ** 2).mean(axis=-1, keepdims=True) + np.float32(eps)) * gamma
    return y if beta is None else y + beta


def _gelu64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * erfc(-x / math.sqrt(2))


def _tanh_gelu64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


# -- the wrapper functions -----------------------------------------------------------------------------------------
portable_library, build = native_and_portable("rowops", rowops.library, "intrinsics where it has them",
                                              "native row kernels unavailable")


@pytest.mark.parametrize("n", LENGTHS)
def test_softmax_rows(build, n):
    x = _rand(5, 7, n, scale=3)
    bias = _rand(7, n)
    np.testing.assert_allclose(rowops.softmax(x), _softmax64(x), rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(rowops.softmax(x, 0.3, bias), _softmax64(x, 0.3, bias), rtol=1e-6, atol=1e-30)


def test_softmax_exp_range(build):
    """exp over its whole float32 range (subnormal results rounded, not flushed), through two-element rows."""
    t = np.linspace(-104, 0, 400001, dtype=np.float32)
    got = rowops.softmax(np.stack([np.zeros_like(t), t], axis=1))[:, 1]
    e = np.exp(t.astype(np.float64))
    np.testing.assert_allclose(got, e / (1 + e), rtol=4e-7, atol=3e-45)


def test_softmax_special_rows(build):
    inf, nan = np.inf, np.nan
    x = np.array([[-inf, -inf, -inf], [0, nan, 1], [inf, 1, 2], [-inf, 0, -inf], [1e30, -1e30, 1e30],
                  [-3e38, 3e38, 0]], np.float32)
    with np.errstate(all="ignore"):
        e = np.exp(x - x.max(axis=1, keepdims=True))
        numpy_rows = e / e.sum(axis=1, keepdims=True)
    np.testing.assert_array_equal(rowops.softmax(x), numpy_rows)  # the first three rows: NaN
    masked = rowops.softmax(x, zero_masked=True)
    np.testing.assert_array_equal(masked[0], [0, 0, 0])
    np.testing.assert_array_equal(masked[1:], numpy_rows[1:])


@pytest.mark.parametrize("n", LENGTHS)
def test_layer_norm_rows(build, n):
    x, skip = _rand(9, n, scale=2) + 3, _rand(9, n)
    gamma, beta, bias = _rand(n), _rand(n), _rand(n)
    y, mean, inv_std, total = rowops.layer_norm(x, gamma, beta, 1e-5, n, skip=skip, bias=bias, stats=True,
                                                total=True)
    s = (x + skip) + bias
    np.testing.assert_array_equal(total, s)
    np.testing.assert_allclose(y, _layer_norm64(s, gamma, beta, 1e-5), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mean, s.astype(np.float64).mean(axis=1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(inv_std, 1 / np.sqrt(s.astype(np.float64).var(axis=1) + np.float32(1e-5)), rtol=1e-6)
    plain, no_stats, _, no_total = rowops.layer_norm(x, gamma, None, 1e-5, n)
    assert no_stats is None and no_total is None
    np.testing.assert_allclose(plain, _layer_norm64(x, gamma, None, 1e-5), rtol=1e-6, atol=1e-6)


def test_layer_norm_extreme_rows(build):
    x = np.array([[1e30, -1e30, 3e30, 0], [5, 5, 5, 5], [1e4 + 1, 1e4 - 1, 1e4, 1e4], [np.nan, 0, 1, 2],
                  [np.inf, 0, 1, 2]], np.float32)
    gamma, beta = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    y = rowops.layer_norm(x, gamma, beta, 1e-5, 4)[0]
    # (numpy's float32 statistics overflow on the first row)
    np.testing.assert_allclose(y[:3], _layer_norm64(x[:3], gamma, beta, 1e-5), rtol=1e-6, atol=1e-6)
    assert np.isnan(y[3:]).all()


@pytest.mark.parametrize("n", LENGTHS)
def test_gelu_rows(build, n):
    x, bias = _rand(6, n, scale=4), _rand(n)
    biased = x + bias
    for approximate, reference in ((False, _gelu64), (True, _tanh_gelu64)):
        np.testing.assert_allclose(rowops.gelu(x, approximate=approximate), reference(x), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(rowops.gelu(x, bias, approximate), reference(biased), rtol=1e-6, atol=1e-7)


def test_gelu_accuracy_and_special_values(build):
    x = np.concatenate([np.linspace(-14, 14, 100001), np.geomspace(1e-38, 14, 2000),
                        -np.geomspace(1e-38, 14, 2000)]).astype(np.float32)
    for approximate, reference, bound in ((False, _gelu64, 6e-7), (True, _tanh_gelu64, 2e-6)):
        got, expected = rowops.gelu(x, approximate=approximate), reference(x)
        rel = np.abs(got - expected) / np.maximum(np.abs(expected), 1e-300)
        assert rel[(x > -5) & (np.abs(expected) > 1e-37)].max() < bound
        assert np.abs(got - expected).max() < 1e-6
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e30, -1e30, 3e38, -3e38, 1e-40], np.float32)
    for approximate in (False, True):
        got = rowops.gelu(special, approximate=approximate)
        assert got[0] == np.inf and np.isnan(got[1]) and np.isnan(got[2])  # -inf * 0 is NaN, as in numpy
        np.testing.assert_array_equal(got[3:9], np.array([0, 0, 1e30, 0, 3e38, 0], np.float32))
        assert got[9] == np.float32(5e-41)


def test_awkward_arrays_and_outputs(build):
    base = _rand(4, 10, 33)
    strided = base[:, ::3, 1:]  # non-contiguous
    raw = np.zeros(strided.size * 4 + 1, np.uint8)[1:].view(np.float32).reshape(strided.shape)  # misaligned
    raw[...] = strided
    frozen = strided.copy()
    frozen.flags.writeable = False
    expected = rowops.softmax(np.ascontiguousarray(strided))
    for x in (strided, raw, frozen):
        np.testing.assert_array_equal(rowops.softmax(x), expected)
    snapshot = base.copy()
    out = np.empty((4, 10, 33), np.float32)
    assert rowops.gelu(base, out=out) is out
    np.testing.assert_array_equal(base, snapshot)  # inputs are never written
    in_place = base.copy()
    assert rowops.gelu(in_place, out=in_place) is in_place  # over the input itself: allowed
    np.testing.assert_array_equal(in_place, out)
    overlapping = base.copy().reshape(-1)
    shifted = rowops.gelu(overlapping[1:], out=overlapping[:-1])  # partial overlap: a new buffer
    np.testing.assert_array_equal(shifted, rowops.gelu(base.reshape(-1)[1:]))
    assert rowops.softmax(np.zeros((3, 0), np.float32)).shape == (3, 0)
    assert rowops.gelu(np.zeros((0, 5), np.float32), np.ones(5, np.float32)).shape == (0, 5)


def test_threaded_split_matches(build, monkeypatch):
    x, skip, gamma = _rand(37, 300), _rand(37, 300), _rand(300)
    scores, bias = _rand(2, 3, 37, 41), _rand(2, 1, 37, 41)
    single = (rowops.softmax(scores, 0.5, bias, True), rowops.layer_norm(x, gamma, gamma, 1e-5, 300, skip=skip)[0],
              rowops.gelu(x), rowops.gelu(x, gamma[:300], True))
    monkeypatch.setattr(rowops, "PARALLEL_MIN", 64)
    monkeypatch.setattr(native, "threads", lambda: 3)
    split = (rowops.softmax(scores, 0.5, bias, True), rowops.layer_norm(x, gamma, gamma, 1e-5, 300, skip=skip)[0],
             rowops.gelu(x), rowops.gelu(x, gamma[:300], True))
    for a, b in zip(single, split):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bias_shape", [(1, 1, 5, 6), (2, 1, 1, 6), (3, 5, 6), (6,), (2, 3, 5, 1)])
def test_softmax_bias_layouts(build, bias_shape):
    x, bias = _rand(2, 3, 5, 6), _rand(*bias_shape)
    np.testing.assert_allclose(rowops.softmax(x, 0.7, bias), _softmax64(x, 0.7, bias), rtol=1e-6)
    transposed = _rand(*bias_shape[::-1]).T  # negative-free but non-contiguous strides
    np.testing.assert_allclose(rowops.softmax(x, 1.0, transposed), _softmax64(x, 1.0, transposed), rtol=1e-6)


# -- the kernels: native against their numpy paths and onnxruntime --------------------------------------------------
def _model(op: str, inputs: dict[str, np.ndarray], n_out: int, domain: str = "", opset: int = 17,
           names: list[str] | None = None, **attrs) -> onnx.ModelProto:
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, names if names is not None else list(inputs), outs, domain=domain, **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                      for k, v in inputs.items()],
        [onnx.ValueInfoProto(name=o) for o in outs])
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(MS, 1)] if domain else [])
    return helper.make_model(graph, ir_version=9, opset_imports=opsets)


def _both_paths(monkeypatch, model: onnx.ModelProto, feeds: dict) -> tuple[list, list]:
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("CARRACK_NATIVE", flag)
        results.append(carrack.InferenceSession(model).run(None, feeds))
    return results[0], results[1]


def _check(monkeypatch, model: onnx.ModelProto, feeds: dict, ort: bool = True, rtol: float = 2e-6,
           atol: float = 2e-6) -> None:
    numpy_path, native_path = _both_paths(monkeypatch, model, feeds)
    expected = numpy_path
    if ort:
        import onnxruntime

        expected = onnxruntime.InferenceSession(model.SerializeToString(),
                                                providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b, e in zip(numpy_path, native_path, expected):
        assert a.shape == b.shape == e.shape and a.dtype == b.dtype == e.dtype
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)
        np.testing.assert_allclose(b, e, rtol=rtol * 5, atol=atol * 5)


@needs_native
@pytest.mark.parametrize("opset,axis,shape", [(13, -1, (2, 3, 17)), (11, 1, (2, 3, 17)), (13, 1, (2, 3, 17)),
                                              (13, 0, (768,))])
def test_softmax_kernel(monkeypatch, opset, axis, shape):
    feeds = {"x": _rand(*shape, scale=3)}
    _check(monkeypatch, _model("Softmax", feeds, 1, opset=opset, axis=axis), feeds)


@needs_native
def test_softmax_kernel_masked_rows(monkeypatch):
    x = _rand(3, 4)
    x[0] = -np.inf
    x[1, 2] = np.nan
    numpy_path, native_path = _both_paths(monkeypatch, _model("Softmax", {"x": x}, 1, opset=13), {"x": x})
    np.testing.assert_allclose(native_path[0], numpy_path[0], rtol=1e-6)
    assert np.isnan(native_path[0][:2]).all()


@needs_native
@pytest.mark.parametrize("axis,n_out", [(-1, 3), (-1, 1), (-2, 3), (1, 1)])
def test_layer_normalization_kernel(monkeypatch, axis, n_out):
    x = _rand(2, 5, 17, scale=2) + 1
    norm = x.shape[axis:]
    feeds = {"x": x, "scale": _rand(*norm), "bias": _rand(*norm)}
    _check(monkeypatch, _model("LayerNormalization", feeds, n_out, axis=axis, epsilon=1e-3), feeds)
    # onnxruntime's contrib LayerNormalization (ONNX domain before opset 17)
    _check(monkeypatch, _model("LayerNormalization", feeds, n_out, opset=16, axis=axis, epsilon=1e-3), feeds)


@needs_native
@pytest.mark.parametrize("extras,n_out", [((), 1), (("beta",), 1), (("beta", "bias"), 4), (("beta", "bias"), 1),
                                          (("", "bias"), 4)])
def test_skip_layer_normalization_kernel(monkeypatch, extras, n_out):
    feeds = {"x": _rand(2, 7, 768), "skip": _rand(2, 7, 768), "gamma": _rand(768)}
    names = ["x", "skip", "gamma"]
    for name in extras:
        names.append(name)
        if name:
            feeds[name] = _rand(768)
    _check(monkeypatch, _model("SkipLayerNormalization", feeds, n_out, domain=MS, names=names, epsilon=1e-12),
           feeds)


@needs_native
def test_skip_layer_normalization_broadcast_skip(monkeypatch):
    feeds = {"x": _rand(3, 4, 16), "skip": _rand(4, 16), "gamma": _rand(16), "beta": _rand(16)}
    numpy_path, native_path = _both_paths(
        monkeypatch, _model("SkipLayerNormalization", feeds, 4, domain=MS, epsilon=1e-5), feeds)
    for a, b in zip(numpy_path, native_path):
        np.testing.assert_allclose(b, a, rtol=2e-6, atol=2e-6)


@needs_native
@pytest.mark.parametrize("op,with_bias", [("BiasGelu", True), ("FastGelu", False), ("FastGelu", True),
                                          ("Gelu", False)])
def test_gelu_contrib_kernels(monkeypatch, op, with_bias):
    feeds = {"x": _rand(2, 5, 1000, scale=3)}
    if with_bias:
        feeds["bias"] = _rand(1000)
    _check(monkeypatch, _model(op, feeds, 1, domain=MS), feeds, atol=1e-6)


@needs_native
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_onnx_gelu_kernel(monkeypatch, approximate):
    feeds = {"x": _rand(3, 17, scale=4)}
    _check(monkeypatch, _model("Gelu", feeds, 1, opset=20, approximate=approximate), feeds, atol=1e-6)


@needs_native
@pytest.mark.parametrize("form", ["plain", "per_head", "masked", "fully_masked"])
def test_multi_head_attention_kernel(monkeypatch, form):
    batch, seq, total, heads, size = 2, 5, 7, 3, 8
    feeds = {"q": _rand(batch, seq, heads * size)}
    names = ["q", "k", "v"]
    if form == "per_head":
        feeds["k"], feeds["v"] = _rand(batch, heads, total, size), _rand(batch, heads, total, size)
    else:
        feeds["k"], feeds["v"] = _rand(batch, total, heads * size), _rand(batch, total, heads * size)
    if form in ("masked", "fully_masked"):
        bias = np.where(rng.random((batch, 1, seq, total)) < 0.3, -np.inf, 0).astype(np.float32)
        bias[..., 0] = 0
        if form == "fully_masked":
            bias[0, 0, 1] = -np.inf  # a query that sees no key: zeros, on both paths
        feeds["attention_bias"] = bias
        names += ["", "", "attention_bias"]
    model = _model("MultiHeadAttention", feeds, 1, domain=MS, names=names, num_heads=heads)
    _check(monkeypatch, model, feeds, ort=form != "fully_masked")
    if form == "fully_masked":
        np.testing.assert_array_equal(_both_paths(monkeypatch, model, feeds)[1][0][0, 1], 0)


@needs_native
def test_attention_kernel(monkeypatch):
    feeds = {"x": _rand(2, 6, 16), "w": _rand(16, 48), "b": _rand(48), "mask": np.ones((2, 6), np.int32)}
    feeds["mask"][1, 4:] = 0
    _check(monkeypatch, _model("Attention", feeds, 1, domain=MS, num_heads=4), feeds)


@needs_native
def test_planned_buffers(monkeypatch):
    """run_into: chains of these kernels write into the session's arena; results match the numpy path."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=-1),
             helper.make_node("Gelu", ["s"], ["g"]),
             helper.make_node("LayerNormalization", ["g", "gamma", "beta"], ["n"]),
             helper.make_node("BiasGelu", ["n", "beta"], ["bg"], domain=MS),
             helper.make_node("SkipLayerNormalization", ["bg", "n", "gamma", "beta"], ["sn"], domain=MS),
             helper.make_node("Relu", ["sn"], ["y"])]
    inits = [onnx.numpy_helper.from_array(_rand(64), "gamma"), onnx.numpy_helper.from_array(_rand(64), "beta")]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(MS, 1)])
    feeds = {"x": _rand(4, 64, scale=5)}
    numpy_path, native_path = _both_paths(monkeypatch, model, feeds)
    np.testing.assert_allclose(native_path[0], numpy_path[0], rtol=1e-5, atol=1e-5)
    planned = carrack.InferenceSession(model)._program._plan
    assert all(entry[6] >= 0 for entry in planned[:-1])  # each wrote into the arena


@pytest.mark.parametrize("native_on", ["0", "1"])
@pytest.mark.parametrize("shape,axis", [((2, 1000, 1, 1), 1), ((3, 5, 1, 1), -3), ((2, 7, 1), 1), ((2, 3, 4), 1)])
def test_softmax_axis_followed_by_unit_dims(shape, axis, native_on, monkeypatch):
    """A classifier's Softmax over [N, classes, 1, 1] (axis 1) is a row softmax: same values as the reference."""
    monkeypatch.setenv("CARRACK_NATIVE", native_on)
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=axis)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    y = carrack.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    e = np.exp(x.astype(np.float64) - x.max(axis=axis, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=axis, keepdims=True), rtol=2e-6, atol=1e-9)


# -- float16 <-> float32 -------------------------------------------------------------------------------------------
def test_half_to_float_every_value(build):
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    got, expected = rowops.half_to_float(every), every.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_array_equal(got.view(np.uint32)[finite], expected.view(np.uint32)[finite])


def test_float_to_half_rounds_like_numpy(build):
    rng = np.random.default_rng(1)
    scales = (1e-8, 3e-6, 1e-3, 1.0, 300.0, 7e4)
    special = [np.inf, -np.inf, np.nan, 0.0, -0.0, 65504, 65519.99, 65520, 6.1035156e-05, 5.9604645e-08,
               2.9802322e-08, 2.9802326e-08, 8.940697e-08, 1 + 2 ** -11, 1 + 3 * 2 ** -11]
    x = np.concatenate([rng.standard_normal(4099).astype(np.float32) * s for s in scales]
                       + [np.array(special, np.float32)])
    # every half's midpoints, where rounding to nearest even decides
    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    x = np.concatenate([x, ((halves[:-1] + halves[1:]) / 2).astype(np.float32)])
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    got = rowops.float_to_half(x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    numbers = ~np.isnan(expected)
    np.testing.assert_array_equal(got.view(np.uint16)[numbers], expected.view(np.uint16)[numbers])


def test_half_conversions_into_buffers(build):
    x = np.random.default_rng(2).standard_normal((3, 70001)).astype(np.float16)  # split across threads
    out = np.empty(x.shape, np.float32)
    assert rowops.half_to_float(x, out=out) is out
    np.testing.assert_array_equal(out, x.astype(np.float32))
    back = np.empty(x.shape, np.float16)
    assert rowops.float_to_half(out, out=back) is back
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(rowops.half_to_float(x[:, ::2]), x[:, ::2].astype(np.float32))  # strided view
