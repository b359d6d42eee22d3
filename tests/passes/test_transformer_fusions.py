"""Transformer fusions: each rule on the small graphs exporters write, checked against onnxruntime."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.onnx.importer import load_model
from carrack.passes.optimizer import ALL, optimize

MS = "com.microsoft"
rng = np.random.default_rng(0)
HIDDEN = 16


class Builder:
    """A tiny graph builder: `b.op("Mul", a, c)` returns the output name; `b.const(v)` adds an initializer."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []

    def input(self, name: str, shape, elem_type=TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def const(self, value, dtype=np.float32) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs) -> str:
        outs = [f"{op_type.lower()}{len(self.nodes)}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def model(self, outputs: list[str], opset: int = 17) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "g", self.inputs, [onnx.ValueInfoProto(name=o) for o in outputs],
                                  initializer=self.inits)
        return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", opset)])


def _ops(model) -> Counter:
    return Counter((n.domain, n.op_type) for n in model.graph.nodes)


def check(model: onnx.ModelProto, feeds: dict, rule: str, fired: int = 1, tmp_path=None, atol=1e-5) -> Counter:
    """The rule fires `fired` times; carrack (optimized) and onnxruntime on the carrack-optimized model both match
    onnxruntime on the original. Returns the optimized model's op counts."""
    import onnxruntime as ort

    optimized, counts = optimize(load_model(model), ALL)
    assert counts.get(rule, 0) == fired, counts
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    options = carrack.SessionOptions()
    options.graph_optimization_level = ALL
    if tmp_path is not None:
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    got = carrack.InferenceSession(model, options).run(None, feeds)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=atol)
    if tmp_path is not None:
        again = ort.InferenceSession(options.optimized_model_filepath, providers=["CPUExecutionProvider"])
        for g, e in zip(again.run(None, feeds), expected):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=atol)
    return _ops(optimized)


def _x(*shape):
    return rng.standard_normal(shape).astype(np.float32)


# -- LayerNormalization ------------------------------------------------------------------------------------------

def _reduce_mean(b: Builder, x: str, opset: int) -> str:
    if opset >= 18:
        return b.op("ReduceMean", x, b.const([-1], np.int64))
    return b.op("ReduceMean", x, axes=[-1])


def decomposed_layer_norm(b: Builder, x: str, opset: int, square="Pow", divide="Div", affine=True) -> str:
    mean = _reduce_mean(b, x, opset)
    d = b.op("Sub", x, mean)
    sq = b.op("Pow", d, b.const(2.0)) if square == "Pow" else b.op("Mul", d, d)
    var = _reduce_mean(b, sq, opset)
    std = b.op("Sqrt", b.op("Add", var, b.const(1e-5)))
    n = b.op("Div", d, std) if divide == "Div" else b.op("Mul", d, b.op("Reciprocal", std))
    if not affine:
        return n
    return b.op("Add", b.op("Mul", n, b.const(_x(HIDDEN))), b.const(_x(HIDDEN)))


@pytest.mark.parametrize("opset,square,divide,affine", [(14, "Pow", "Div", True), (17, "Mul", "Mul", True),
                                                        (18, "Pow", "Div", False), (12, "Mul", "Div", True)])
def test_layer_norm_fusion(opset, square, divide, affine, tmp_path):
    b = Builder()
    x = b.input("x", ["B", "S", HIDDEN])
    y = decomposed_layer_norm(b, x, opset, square, divide, affine)
    ops = check(b.model([y], opset), {"x": _x(2, 3, HIDDEN)}, "layer_norm_fusion", tmp_path=tmp_path)
    assert ops == Counter({("", "LayerNormalization"): 1})


def test_layer_norm_not_fused_over_a_leading_axis():
    b = Builder()
    x = b.input("x", ["B", 4, HIDDEN])
    mean = b.op("ReduceMean", x, axes=[1])
    d = b.op("Sub", x, mean)
    var = b.op("ReduceMean", b.op("Mul", d, d), axes=[1])
    y = b.op("Div", d, b.op("Sqrt", b.op("Add", var, b.const(1e-5))))
    check(b.model([y], 14), {"x": _x(2, 4, HIDDEN)}, "layer_norm_fusion", fired=0)


# -- GELU ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["x_first", "half_first", "grouped"])
@pytest.mark.parametrize("opset", [14, 20])
def test_gelu_fusion(order, opset, tmp_path):
    b = Builder()
    x = b.input("x", ["B", HIDDEN])
    if order == "grouped":
        inner = b.op("Mul", x, b.const(1 / math.sqrt(2)))
    else:
        inner = b.op("Div", x, b.const(math.sqrt(2)))
    one_plus = b.op("Add", b.op("Erf", inner), b.const(1.0))
    if order == "x_first":  # torch.onnx (TorchScript): (x * (1 + erf)) * 0.5
        y = b.op("Mul", b.op("Mul", x, one_plus), b.const(0.5))
    elif order == "half_first":  # torch.onnx (dynamo): x * (0.5 * (1 + erf))
        y = b.op("Mul", x, b.op("Mul", b.const(0.5), one_plus))
    else:
        y = b.op("Mul", b.op("Mul", x, b.const(0.5)), one_plus)
    ops = check(b.model([y], opset), {"x": _x(3, HIDDEN) * 3}, "gelu_fusion", tmp_path=tmp_path)
    assert ops == Counter({("", "Gelu") if opset >= 20 else (MS, "Gelu"): 1})


@pytest.mark.parametrize("cube", ["Pow", "Mul"])
def test_fast_gelu_fusion(cube, tmp_path):
    b = Builder()
    x = b.input("x", ["B", HIDDEN])
    x3 = b.op("Pow", x, b.const(3.0)) if cube == "Pow" else b.op("Mul", x, b.op("Mul", x, x))
    inner = b.op("Add", x, b.op("Mul", b.const(0.044715), x3))
    t = b.op("Tanh", b.op("Mul", b.const(math.sqrt(2 / math.pi)), inner))
    y = b.op("Mul", b.const(0.5), b.op("Mul", x, b.op("Add", b.const(1.0), t)))
    ops = check(b.model([y], 14), {"x": _x(3, HIDDEN) * 3}, "fast_gelu_fusion", tmp_path=tmp_path)
    assert ops == Counter({(MS, "FastGelu"): 1})


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_fusion(approximate, tmp_path):
    b = Builder()
    x = b.input("x", ["B", "S", 8])
    h = b.op("Add", b.op("MatMul", x, b.const(_x(8, HIDDEN))), b.const(_x(HIDDEN)))
    y = b.op("Gelu", h, approximate=approximate)
    ops = check(b.model([y], 20), {"x": _x(2, 3, 8)}, "bias_gelu_fusion", tmp_path=tmp_path)
    assert ops[(MS, "BiasGelu" if approximate == "none" else "FastGelu")] == 1 and ops[("", "Add")] == 0


def test_bias_gelu_needs_a_bias_over_the_last_axis():
    b = Builder()
    x = b.input("x", ["B", HIDDEN, 1])
    y = b.op("Gelu", b.op("Add", x, b.const(_x(HIDDEN))))  # broadcasts to (B, 16, 16): not a bias
    check(b.model([y], 20), {"x": _x(2, HIDDEN, 1)}, "bias_gelu_fusion", fired=0)


# -- SkipLayerNormalization ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sum_used", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_layer_norm_fusion(sum_used, with_bias, tmp_path):
    b = Builder()
    x = b.input("x", ["B", "S", HIDDEN])
    h = b.op("MatMul", x, b.const(_x(HIDDEN, HIDDEN)))
    if with_bias:
        h = b.op("Add", h, b.const(_x(HIDDEN)))
    total = b.op("Add", x, h)
    y = b.op("LayerNormalization", total, b.const(_x(HIDDEN)), b.const(_x(HIDDEN)), epsilon=1e-5)
    outputs = [b.op("Add", y, total)] if sum_used else [y]
    ops = check(b.model(outputs, 17), {"x": _x(2, 3, HIDDEN)}, "skip_layer_norm_fusion", tmp_path=tmp_path)
    assert ops[(MS, "SkipLayerNormalization")] == 1
    assert ops[("", "Add")] == int(sum_used)


def test_skip_layer_norm_not_fused_when_shapes_broadcast():
    b = Builder()
    x = b.input("x", ["B", "S", HIDDEN])
    skip = b.input("skip", [1, 1, HIDDEN])
    y = b.op("LayerNormalization", b.op("Add", x, skip), b.const(_x(HIDDEN)))
    check(b.model([y], 17), {"x": _x(2, 3, HIDDEN), "skip": _x(1, 1, HIDDEN)}, "skip_layer_norm_fusion", fired=0)


# -- attention -----------------------------------------------------------------------------------------------------

HEADS, SIZE = 2, 8


def _split_heads(b: Builder, x3: str, perm: list[int]) -> str:
    return b.op("Transpose", b.op("Reshape", x3, b.const([0, 0, HEADS, SIZE], np.int64)), perm=perm)


def attention_block(b: Builder, x: str, scale: str, mask: str | None = None) -> str:
    """GPT-style: one packed projection, head split, scaled scores, mask, softmax, head merge."""
    qkv = b.op("Add", b.op("MatMul", x, b.const(_x(HIDDEN, 3 * HIDDEN) * 0.5)), b.const(_x(3 * HIDDEN)))
    q3, k3, v3 = b.op("Split", qkv, b.const([HIDDEN] * 3, np.int64), n_out=3, axis=2)
    q, kt, v = _split_heads(b, q3, [0, 2, 1, 3]), _split_heads(b, k3, [0, 2, 3, 1]), _split_heads(b, v3, [0, 2, 1, 3])
    scores = b.op("MatMul", q, kt)
    if scale == "mul":
        scores = b.op("Mul", scores, b.const(1 / math.sqrt(SIZE)))
    elif scale == "div_sqrt":
        scores = b.op("Div", scores, b.const(math.sqrt(SIZE)))
    elif scale == "shape":  # / k.size(-1) ** 0.5 computed from the shape
        d = b.op("Gather", b.op("Shape", kt), b.const(2, np.int64), axis=0)
        scores = b.op("Div", scores, b.op("Sqrt", b.op("Cast", d, to=TensorProto.FLOAT)))
    elif scale == "qk":  # torch's scaled_dot_product_attention export: sqrt(scale) on both q and k
        half = b.const(SIZE ** -0.25)
        scores = b.op("MatMul", b.op("Mul", q, half), b.op("Mul", kt, half))
    if mask == "add":
        scores = b.op("Add", scores, "mask")
    elif mask == "causal":
        shape = b.op("Shape", x)
        seq = b.op("Gather", shape, b.const([1], np.int64), axis=0)
        ones = b.op("ConstantOfShape", b.op("Concat", seq, seq, axis=0),
                    value=numpy_helper.from_array(np.ones(1, np.bool_)))
        scores = b.op("Where", b.op("Trilu", ones, b.const(1, np.int64), upper=1), b.const(-np.inf), scores)
    probs = b.op("Softmax", scores, axis=-1)
    out = b.op("Transpose", b.op("MatMul", probs, v), perm=[0, 2, 1, 3])
    return b.op("Reshape", out, b.const([0, 0, HIDDEN], np.int64))


@pytest.mark.parametrize("scale", ["mul", "div_sqrt", "shape", "qk"])
def test_attention_fusion_scales(scale, tmp_path):
    b = Builder()
    x = b.input("x", ["B", "S", HIDDEN])
    y = attention_block(b, x, scale)
    ops = check(b.model([y], 17), {"x": _x(2, 5, HIDDEN)}, "attention_fusion", tmp_path=tmp_path)
    assert ops == Counter({("", "MatMul"): 1, ("", "Add"): 1, ("", "Split"): 1, (MS, "MultiHeadAttention"): 1})


def test_attention_fusion_with_causal_where_mask(tmp_path):
    b = Builder()
    x = b.input("x", ["B", "S", HIDDEN])
    y = attention_block(b, x, "div_sqrt", mask="causal")
    for shape in [(1, 1), (2, 5)]:
        ops = check(b.model([y], 17), {"x": _x(*shape, HIDDEN)}, "attention_fusion", tmp_path=tmp_path)
    assert ops[(MS, "MultiHeadAttention")] == 1 and ops[("", "Softmax")] == 0


def test_attention_fusion_with_additive_mask(tmp_path):
    b = Builder()
    x = b.input("x", ["B", "S", HIDDEN])
    b.input("mask", ["B", 1, "S", "S"])
    y = attention_block(b, x, "mul", mask="add")
    feeds = {"x": _x(2, 5, HIDDEN), "mask": np.where(rng.random((2, 1, 5, 5)) > 0.7, -1e4, 0).astype(np.float32)}
    ops = check(b.model([y], 17), feeds, "attention_fusion", tmp_path=tmp_path)
    assert ops[(MS, "MultiHeadAttention")] == 1


def test_attention_fusion_on_bare_heads(tmp_path):
    """Q, K, V given per head (B, N, S, H): the fused node gets its own head merge and split."""
    b = Builder()
    q, k, v = (b.input(n, ["B", HEADS, "S", SIZE]) for n in "qkv")
    scores = b.op("Mul", b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2])), b.const(0.3))
    y = b.op("MatMul", b.op("Softmax", scores, axis=-1), v)
    feeds = {n: _x(2, HEADS, 4, SIZE) for n in "qkv"}
    ops = check(b.model([y], 17), feeds, "attention_fusion", tmp_path=tmp_path)
    assert ops[(MS, "MultiHeadAttention")] == 1 and ops[("", "Softmax")] == 0


def test_attention_not_fused_over_another_axis():
    b = Builder()
    q, k, v = (b.input(n, ["B", HEADS, 4, SIZE]) for n in "qkv")
    scores = b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2]))
    y = b.op("MatMul", b.op("Softmax", scores, axis=2), v)
    check(b.model([y], 17), {n: _x(2, HEADS, 4, SIZE) for n in "qkv"}, "attention_fusion", fired=0)


def test_whole_block_fuses_at_opset_14(tmp_path):
    """Pre-LN block written the way torch.onnx decomposes it below opset 17: every rule fires together."""
    b = Builder()
    x = b.input("x", ["B", "S", HIDDEN])
    h = b.op("Add", x, attention_block(b, decomposed_layer_norm(b, x, 14), "shape", mask="causal"))
    ff = b.op("Add", b.op("MatMul", decomposed_layer_norm(b, h, 14), b.const(_x(HIDDEN, HIDDEN))), b.const(_x(HIDDEN)))
    g = b.op("Mul", b.op("Mul", ff, b.op("Add", b.op("Erf", b.op("Div", ff, b.const(math.sqrt(2)))), b.const(1.0))),
             b.const(0.5))
    y = b.op("Add", h, g)
    model = b.model([y], 14)
    optimized, fired = optimize(load_model(model), ALL)
    assert {k: fired.get(k) for k in ("layer_norm_fusion", "gelu_fusion", "bias_gelu_fusion", "attention_fusion",
                                      "skip_layer_norm_fusion")} == dict.fromkeys(
        ("gelu_fusion", "bias_gelu_fusion", "attention_fusion", "skip_layer_norm_fusion"), 1) | {
        "layer_norm_fusion": 2}
    check(model, {"x": _x(2, 5, HIDDEN)}, "attention_fusion", tmp_path=tmp_path)
