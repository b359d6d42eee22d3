"""Conv, ConvTranspose, DeformConv, Col2Im and CausalConvWithState against onnxruntime and numpy."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import carrack
from carrack.ops.conv import convolve


def make_model(op: str, inputs: dict[str, np.ndarray | None], opset: int, n_outputs: int = 1,
               **attrs) -> onnx.ModelProto:
    """A one-node model whose graph inputs are the non-None `inputs` (None: omitted optional input)."""
    names = [n if v is not None else "" for n, v in inputs.items()]
    while names and names[-1] == "":
        names.pop()
    outputs = [f"y{i}" for i in range(n_outputs)]
    node = helper.make_node(op, names, outputs, **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(inputs[n].dtype), None)
                    for n in names if n]
    graph_outputs = [helper.make_empty_tensor_value_info(o) for o in outputs]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def run_carrack(model: onnx.ModelProto, inputs: dict) -> list[np.ndarray]:
    feed = {k: v for k, v in inputs.items() if v is not None}
    return carrack.InferenceSession(model.SerializeToString()).run(None, feed)


def run_ort(model: onnx.ModelProto, inputs: dict) -> list[np.ndarray]:
    feed = {k: v for k, v in inputs.items() if v is not None}
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def assert_same_as_ort(op: str, inputs: dict, opset: int, n_outputs: int = 1, rtol=1e-4, atol=1e-4, **attrs):
    model = make_model(op, inputs, opset, n_outputs, **attrs)
    got, expected = run_carrack(model, inputs), run_ort(model, inputs)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, e.dtype, g.shape, e.shape)
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)


def _conv_cases(count: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        nd = int(rng.integers(1, 4))
        group = int(rng.choice([1, 1, 2, 3]))
        cg, mg = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        if rng.random() < 0.25:  # depthwise
            cg, mg = 1, 1
        kernel = [int(rng.integers(1, 4)) for _ in range(nd)]
        spatial = [int(rng.integers(5, 9)) for _ in range(nd)]
        yield dict(nd=nd, group=group, cg=cg, mg=mg, kernel=kernel, spatial=spatial,
                   strides=[int(rng.integers(1, 3)) for _ in range(nd)],
                   dilations=[int(rng.integers(1, 3)) for _ in range(nd)],
                   pads=[int(rng.integers(0, 3)) for _ in range(2 * nd)],
                   auto_pad=str(rng.choice(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"])),
                   bias=bool(rng.random() < 0.5))


@pytest.mark.parametrize("case", list(_conv_cases(24, 1)), ids=lambda c: f"{c['nd']}d-g{c['group']}-{c['auto_pad']}")
def test_conv_matches_onnxruntime(case):
    rng = np.random.default_rng(7)
    c, m = case["cg"] * case["group"], case["mg"] * case["group"]
    x = rng.standard_normal([2, c] + case["spatial"]).astype(np.float32)
    w = rng.standard_normal([m, case["cg"]] + case["kernel"]).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32) if case["bias"] else None
    attrs = dict(strides=case["strides"], dilations=case["dilations"], group=case["group"], auto_pad=case["auto_pad"])
    if case["auto_pad"] == "NOTSET":
        attrs["pads"] = case["pads"]
    if case["auto_pad"].startswith("SAME"):
        attrs["dilations"] = [1] * case["nd"]  # onnxruntime rejects SAME with dilations
    assert_same_as_ort("Conv", {"x": x, "w": w, "b": b}, 17, **attrs)


@pytest.mark.parametrize("opset", [1, 11, 22])
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_conv_versions_and_dtypes(opset, dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 7, 6)).astype(dtype)
    w = rng.standard_normal((6, 2, 3, 3)).astype(dtype)
    inputs = {"x": x, "w": w}
    model = make_model("Conv", inputs, opset, group=2, pads=[1, 0, 1, 2], kernel_shape=[3, 3])
    (got,) = run_carrack(model, inputs)
    expected = convolve(x.astype(np.float64), w.astype(np.float64), strides=[1, 1], pads=[1, 0, 1, 2],
                        dilations=[1, 1], group=2)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=1e-2 if dtype == np.float16 else 1e-10,
                               atol=2e-2 if dtype == np.float16 else 1e-10)


def test_convolve_in_batch_chunks(monkeypatch):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 6, 5))
    w = rng.standard_normal((2, 2, 3, 2))
    whole = convolve(x, w, strides=[1, 2], pads=[1, 0, 0, 1], dilations=[1, 1], group=2)
    monkeypatch.setattr("carrack.ops.conv.COLUMN_BYTES", 1)
    chunked = convolve(x, w, strides=[1, 2], pads=[1, 0, 0, 1], dilations=[1, 1], group=2)
    np.testing.assert_allclose(chunked, whole, rtol=1e-12)
    empty = convolve(x[:0], w, strides=[1, 2], pads=[1, 0, 0, 1], dilations=[1, 1], group=2)
    assert empty.shape == (0,) + whole.shape[1:]


def test_convolve_integer_inputs_stay_integer():
    x = np.arange(2 * 3 * 5, dtype=np.int32).reshape(1, 6, 5)
    w = np.ones((2, 3, 2), dtype=np.int32)
    y = convolve(x, w, strides=[1], pads=[0, 0], dilations=[1], group=2)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y[0, 0], x[0, :3, :-1].sum(0) + x[0, :3, 1:].sum(0))


def _transpose_cases(count: int, seed: int):
    rng = np.random.default_rng(seed)
    for i in range(count):
        nd = int(rng.integers(1, 4))
        group = int(rng.choice([1, 2]))
        strides = [int(rng.integers(1, 4)) for _ in range(nd)]
        dilations = [int(rng.integers(1, 3)) for _ in range(nd)]
        case = dict(nd=nd, group=group, cg=int(rng.integers(1, 3)), mg=int(rng.integers(1, 3)),
                    kernel=[int(rng.integers(1, 4)) for _ in range(nd)],
                    spatial=[int(rng.integers(2, 6)) for _ in range(nd)],
                    strides=strides, dilations=dilations, attrs={})
        variant = i % 4
        if variant == 0:
            case["attrs"]["pads"] = [int(rng.integers(0, 2)) for _ in range(2 * nd)]
        elif variant == 1:
            case["attrs"]["output_padding"] = [int(rng.integers(0, min(s, d) if min(s, d) > 1 else 1))
                                               for s, d in zip(strides, dilations)]
            case["attrs"]["pads"] = [int(rng.integers(0, 2)) for _ in range(2 * nd)]
        elif variant == 2:
            case["attrs"]["auto_pad"] = str(rng.choice(["SAME_UPPER", "SAME_LOWER"]))
            case["dilations"] = [1] * nd
        else:
            full = [(i - 1) * s + (k - 1) * d + 1 for i, s, k, d in
                    zip(case["spatial"], strides, case["kernel"], dilations)]
            case["attrs"]["output_shape"] = [f + int(rng.integers(-1, 1)) for f in full]
        yield case


@pytest.mark.parametrize("case", list(_transpose_cases(20, 2)), ids=lambda c: f"{c['nd']}d-{sorted(c['attrs'])}")
def test_conv_transpose_matches_onnxruntime(case):
    rng = np.random.default_rng(5)
    c, m = case["cg"] * case["group"], case["mg"] * case["group"]
    x = rng.standard_normal([2, c] + case["spatial"]).astype(np.float32)
    w = rng.standard_normal([c, case["mg"]] + case["kernel"]).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    assert_same_as_ort("ConvTranspose", {"x": x, "w": w, "b": b}, 17, strides=case["strides"],
                       dilations=case["dilations"], group=case["group"], **case["attrs"])


@pytest.mark.parametrize("offset_group, group, use_mask", [(1, 1, False), (2, 1, True), (2, 2, True)])
def test_deform_conv_matches_onnxruntime(offset_group, group, use_mask):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 4, 6, 5)).astype(np.float32)
    w = rng.standard_normal((6, 4 // group, 2, 3)).astype(np.float32)
    out_h, out_w = (6 + 2 - 2) // 2 + 1, (5 + 1 - 3) // 1 + 1
    offset = (rng.standard_normal((2, offset_group * 6 * 2, out_h, out_w)) * 1.5).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    mask = rng.random((2, offset_group * 6, out_h, out_w)).astype(np.float32) if use_mask else None
    assert_same_as_ort("DeformConv", {"x": x, "w": w, "offset": offset, "b": b, "mask": mask}, 19,
                       strides=[2, 1], pads=[1, 0, 1, 1], group=group, offset_group=offset_group)


def test_deform_conv_with_zero_offsets_is_conv():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 3, 5, 5, 4))
    w = rng.standard_normal((2, 3, 2, 2, 3))
    offset = np.zeros((1, 12 * 3, 5, 4, 3))
    inputs = {"x": x, "w": w, "offset": offset}
    (got,) = run_carrack(make_model("DeformConv", inputs, 19, pads=[1, 0, 0, 0, 0, 1]), inputs)
    expected = convolve(x, w, strides=[1, 1, 1], pads=[1, 0, 0, 0, 0, 1], dilations=[1, 1, 1], group=1)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("image, block, attrs", [
    ([5, 6], [2, 3], {}),
    ([6, 7], [3, 2], {"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 0, 2]}),
    ([4, 5, 3], [2, 2, 2], {"strides": [1, 2, 1]}),
])
def test_col2im_matches_onnxruntime(image, block, attrs):
    nd = len(image)
    strides, dilations = attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd)
    pads = attrs.get("pads", [0] * 2 * nd)
    blocks = [(i + pads[a] + pads[a + nd] - (k - 1) * d - 1) // s + 1
              for a, (i, k, d, s) in enumerate(zip(image, block, dilations, strides))]
    x = np.random.default_rng(0).standard_normal((2, 3 * int(np.prod(block)), int(np.prod(blocks)))).astype(np.float32)
    inputs = {"x": x, "image_shape": np.array(image, dtype=np.int64), "block_shape": np.array(block, dtype=np.int64)}
    if nd == 2:
        assert_same_as_ort("Col2Im", inputs, 18, **attrs)
    else:  # onnxruntime only does 2-D; Col2Im is the adjoint of im2col: <col2im(c), img> == <c, im2col(img)>
        (got,) = run_carrack(make_model("Col2Im", inputs, 18, **attrs), inputs)
        img = np.random.default_rng(1).standard_normal(got.shape)
        eye = np.eye(3 * int(np.prod(block))).reshape((3 * int(np.prod(block)), 3) + tuple(block))
        cols = convolve(img, eye, strides=strides, pads=pads, dilations=dilations, group=1)
        np.testing.assert_allclose((got * img).sum(), (x * cols.reshape(x.shape)).sum(), rtol=1e-5)


def _causal_reference(x, w, b, past, silu):
    k = w.shape[-1]
    past = np.zeros(x.shape[:2] + (k - 1,), x.dtype) if past is None else past
    seq = np.concatenate([past, x], axis=2).astype(np.float64)
    y = sum(seq[:, :, i:i + x.shape[2]] * w[None, :, 0, i:i + 1] for i in range(k))
    if b is not None:
        y = y + b[None, :, None]
    if silu:
        y = y / (1 + np.exp(-y))
    return y, seq[:, :, seq.shape[2] - (k - 1):]


@pytest.mark.parametrize("k, length, with_past, with_bias, activation", [
    (4, 7, False, False, "none"), (4, 2, True, True, "silu"), (1, 3, False, True, "swish"), (3, 1, True, False, "none"),
])
def test_causal_conv_with_state(k, length, with_past, with_bias, activation):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, length)).astype(np.float32)
    w = rng.standard_normal((3, 1, k)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32) if with_bias else None
    past = rng.standard_normal((2, 3, k - 1)).astype(np.float32) if with_past else None
    inputs = {"x": x, "w": w, "b": b, "past": past}
    y, state = run_carrack(make_model("CausalConvWithState", inputs, 27, 2, activation=activation), inputs)
    ey, estate = _causal_reference(x, w, b, past, activation != "none")
    assert y.dtype == np.float32 and state.shape == (2, 3, k - 1)
    np.testing.assert_allclose(y, ey, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, estate, rtol=0, atol=0)


def test_bad_auto_pad_is_rejected():
    inputs = {"x": np.zeros((1, 1, 3, 3), np.float32), "w": np.zeros((1, 1, 2, 2), np.float32)}
    with pytest.raises(Exception, match="auto_pad"):
        run_carrack(make_model("Conv", inputs, 17, auto_pad="SAME"), inputs)
