"""Each rewrite on a focused graph: it fires, the graph gets smaller, and results stay the same (also in onnxruntime
when the optimized model is exported)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.onnx.exporter import export_model
from carrack.onnx.importer import load_model
from carrack.passes.optimizer import ALL, BASIC, FOLD_LIMIT_BYTES, optimize
from carrack.passes.shape_inference import infer
from tests.helpers import ort_run

RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _f32(name, shape):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _info(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _check(proto, feed, level=ALL, with_facts=False):
    """Optimize; compare carrack unoptimized vs optimized vs onnxruntime on the exported optimized model."""
    model = load_model(proto)
    facts = infer(model.graph, model.opsets) if with_facts else None
    optimized, fired = optimize(model, level, facts)
    plain = carrack.SessionOptions()
    plain.graph_optimization_level = carrack.GraphOptimizationLevel.ORT_DISABLE_ALL
    expected = carrack.InferenceSession(proto, plain).run(None, feed)
    exported = export_model(optimized)
    onnx.checker.check_model(exported)
    got = carrack.InferenceSession(exported, plain).run(None, feed)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
    for e, g in zip(expected, ort_run(exported, feed)):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
    return optimized, fired


def _ops(model):
    return [n.op_type for n in model.graph.nodes]


def test_identity_and_dropout_removed():
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Dropout", ["a"], ["b"]),
             helper.make_node("Relu", ["b"], ["c"]), helper.make_node("Identity", ["c"], ["y"])]
    opt, fired = _check(_model(nodes, [_info("x", [2, 3])], [_info("y", [2, 3])]),
                        {"x": RNG.standard_normal((2, 3)).astype(np.float32)}, BASIC)
    assert _ops(opt) == ["Relu"] and fired["identity_removal"] == 2 and fired["dropout_removal"] == 1


def test_dropout_in_training_mode_is_kept():
    nodes = [helper.make_node("Dropout", ["x", "ratio", "train"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
             numpy_helper.from_array(np.array(True), "train")]
    opt, _ = optimize(load_model(_model(nodes, [_info("x", [4])], [_info("y", [4])], inits)), ALL)
    assert _ops(opt) == ["Dropout"]


def test_dead_nodes_and_unused_initializers_removed():
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["unused"]),
             helper.make_node("Add", ["unused", "w"], ["unused2"])]
    opt, fired = optimize(load_model(_model(nodes, [_info("x", [3])], [_info("y", [3])], [_f32("w", [3])])), BASIC)
    assert _ops(opt) == ["Relu"] and not opt.graph.initializers and fired["dead_node_elimination"] == 2


def test_constant_folding_respects_the_size_cap():
    small = [helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Mul", ["x", "c"], ["y"])]
    opt, fired = _check(_model(small, [_info("x", [4])], [_info("y", [4])], [_f32("a", [4]), _f32("b", [4])]),
                        {"x": np.ones(4, np.float32)}, BASIC)
    assert _ops(opt) == ["Mul"] and fired["constant_folding"] == 1
    n = FOLD_LIMIT_BYTES // 4 + 1024  # a Tile whose output would pass the cap stays a node
    big = [helper.make_node("Tile", ["a", "reps"], ["t"]), helper.make_node("ReduceSum", ["t"], ["s"]),
           helper.make_node("Add", ["x", "s"], ["y"])]
    inits = [numpy_helper.from_array(np.ones(1, np.float32), "a"), numpy_helper.from_array(np.array([n]), "reps")]
    opt, _ = optimize(load_model(_model(big, [_info("x", [1])], [_info("y", [1])], inits)), BASIC)
    assert "Tile" in _ops(opt)


def test_constant_of_shape_folds_without_memory():
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["w"], value=numpy_helper.from_array(
        np.array([0.5], np.float32))), helper.make_node("MatMul", ["x", "w"], ["y"])]
    inits = [numpy_helper.from_array(np.array([512, 4096]), "shape")]
    opt, _ = _check(_model(nodes, [_info("x", [2, 512])], [_info("y", [2, 4096])], inits),
                    {"x": RNG.standard_normal((2, 512)).astype(np.float32)})
    weight = next(iter(opt.graph.initializers.values()))
    assert weight.shape == (512, 4096) and weight.strides == (0, 0)


@pytest.mark.parametrize("layer", ["Conv", "ConvTranspose", "Gemm", "MatMul"])
def test_batchnorm_folding(layer):
    c = 6
    bn_params = [numpy_helper.from_array(v.astype(np.float32), n) for v, n in (
        (RNG.uniform(0.5, 2, c), "gamma"), (RNG.standard_normal(c), "beta"), (RNG.standard_normal(c), "mean"),
        (RNG.uniform(0.5, 2, c), "var"))]
    if layer in ("Conv", "ConvTranspose"):
        w = _f32("w", [4, c, 3, 3] if layer == "ConvTranspose" else [c, 4, 3, 3])
        x_shape, y_shape = [1, 4, 8, 8], [1, c, None, None]
        first = helper.make_node(layer, ["x", "w", "b"], ["h"], pads=[1, 1, 1, 1])
        inits = [w, _f32("b", [c])]
    else:
        x_shape, y_shape = [5, 4], [5, c]
        first = helper.make_node(layer, ["x", "w"] + (["b"] if layer == "Gemm" else []), ["h"])
        inits = [_f32("w", [4, c])] + ([_f32("b", [c])] if layer == "Gemm" else [])
    nodes = [first, helper.make_node("BatchNormalization", ["h", "gamma", "beta", "mean", "var"], ["y"])]
    proto = _model(nodes, [_info("x", x_shape)], [_info("y", y_shape)], inits + bn_params)
    opt, fired = _check(proto, {"x": RNG.standard_normal(x_shape).astype(np.float32)})
    assert "BatchNormalization" not in _ops(opt) and fired["batchnorm_folding"] == 1


def test_conv_bias_and_activation_fusion():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "bias"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    inits = [_f32("w", [8, 3, 3, 3]), _f32("bias", [1, 8, 1, 1])]
    opt, fired = _check(_model(nodes, [_info("x", [1, 3, 6, 6])], [_info("y", [1, 8, 6, 6])], inits),
                        {"x": RNG.standard_normal((1, 3, 6, 6)).astype(np.float32)})
    assert _ops(opt) == ["FusedConv"] and fired["conv_bias_fusion"] == 1 and fired["activation_fusion"] == 1


@pytest.mark.parametrize("activation", [("Sigmoid", {}), ("LeakyRelu", {"alpha": 0.2}), ("Tanh", {}),
                                        ("HardSigmoid", {"alpha": 0.3, "beta": 0.4})])
def test_gemm_activation_fusion(activation):
    op, attrs = activation
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1), helper.make_node(op, ["g"], ["y"], **attrs)]
    opt, _ = _check(_model(nodes, [_info("x", [3, 5])], [_info("y", [3, 4])], [_f32("w", [4, 5]), _f32("b", [4])]),
                    {"x": RNG.standard_normal((3, 5)).astype(np.float32)})
    assert _ops(opt) == ["FusedGemm"]


def test_clip_fusion_with_constant_bounds():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Clip", ["c", "lo", "hi"], ["y"])]
    inits = [_f32("w", [2, 3, 1, 1]), numpy_helper.from_array(np.array(0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6, np.float32), "hi")]
    opt, _ = _check(_model(nodes, [_info("x", [1, 3, 4, 4])], [_info("y", [1, 2, 4, 4])], inits),
                    {"x": 10 * RNG.standard_normal((1, 3, 4, 4)).astype(np.float32)})
    assert _ops(opt) == ["FusedConv"]


def test_matmul_add_becomes_gemm_when_rank_is_known():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    proto = _model(nodes, [_info("x", ["n", 5])], [_info("y", ["n", 4])], [_f32("w", [5, 4]), _f32("b", [4])])
    opt, fired = _check(proto, {"x": RNG.standard_normal((3, 5)).astype(np.float32)}, with_facts=True)
    assert _ops(opt) == ["Gemm"] and fired["matmul_add_to_gemm"] == 1


def test_matmul_add_on_3d_input_is_left_alone():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    proto = _model(nodes, [_info("x", [2, 3, 5])], [_info("y", [2, 3, 4])], [_f32("w", [5, 4]), _f32("b", [4])])
    opt, _ = _check(proto, {"x": RNG.standard_normal((2, 3, 5)).astype(np.float32)}, with_facts=True)
    assert _ops(opt) == ["MatMul", "Add"]


def test_transposes_merge_and_cancel():
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 1]),
             helper.make_node("Transpose", ["a"], ["b"], perm=[0, 2, 1]), helper.make_node("Relu", ["b"], ["c"]),
             helper.make_node("Transpose", ["c"], ["d"], perm=[1, 0, 2]),
             helper.make_node("Transpose", ["d"], ["y"], perm=[2, 1, 0])]
    opt, fired = _check(_model(nodes, [_info("x", [2, 3, 4])], [_info("y", [None, None, None])]),
                        {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)})
    assert _ops(opt) == ["Relu", "Transpose"] and fired["transpose_cancellation"] == 2


def test_shape_arithmetic_is_planned_once_for_every_shape():
    """Shape -> Gather -> Concat feeding a Reshape is computed from the input sizes by the plan: the program runs
    only the Reshape, and new batch sizes run neither the optimizer nor shape inference again."""
    from carrack.passes import optimizer

    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0), "zero"), numpy_helper.from_array(np.array([0]), "axes"),
             numpy_helper.from_array(np.array([-1]), "minus1")]
    proto = _model(nodes, [_info("x", ["b", 3, 4])], [_info("y", ["b", 12])], inits)
    sess = carrack.InferenceSession(proto)
    assert [s.node.op_type for s in sess._program.steps] == ["Reshape"]
    runs = optimizer.RUNS[0]
    for b in (1, 5, 2, 5, 7):
        x = RNG.standard_normal((b, 3, 4)).astype(np.float32)
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x.reshape(b, 12))
    assert optimizer.RUNS[0] == runs


@pytest.mark.parametrize("layer, activation, opset", [("MatMul", "Relu", 17), ("MatMul", "Gelu", 20),
                                                      ("Conv", "HardSwish", 17), ("Gemm", "HardSwish", 17),
                                                      ("MatMul", "HardSwish", 17)])
def test_activations_onnxruntime_cannot_fuse_use_carrack_fused_ops(layer, activation, opset):
    if layer == "Conv":
        first, x_shape, y_shape, inits = (helper.make_node("Conv", ["x", "w"], ["h"]), [1, 3, 4, 4], [1, 2, 4, 4],
                                          [_f32("w", [2, 3, 1, 1])])
    else:
        first, x_shape, y_shape, inits = (helper.make_node(layer, ["x", "w"], ["h"]), [3, 5], [3, 4],
                                          [_f32("w", [5, 4])])
    nodes = [first, helper.make_node(activation, ["h"], ["y"])]
    proto = _model(nodes, [_info("x", x_shape)], [_info("y", y_shape)], inits, opset=opset)
    opt, fired = _check(proto, {"x": 3 * RNG.standard_normal(x_shape).astype(np.float32)})
    assert _ops(opt) == [f"Fused{layer}"] and fired["activation_fusion"] == 1
    assert opt.graph.nodes[0].domain == "carrack"


def test_reshapes_merge_and_identity_reshapes_vanish():
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"]), helper.make_node("Reshape", ["a", "s2"], ["b"]),
             helper.make_node("Relu", ["b"], ["c"]), helper.make_node("Reshape", ["c", "s3"], ["y"])]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for v, n in (([6, 4], "s1"), ([2, 12], "s2"),
                                                                            ([2, 12], "s3"))]
    opt, fired = _check(_model(nodes, [_info("x", [2, 3, 4])], [_info("y", [2, 12])], inits),
                        {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)}, with_facts=True)
    assert _ops(opt) == ["Reshape", "Relu"] and fired["reshape_cancellation"] == 2


def test_transpose_sinks_through_elementwise_ops_and_cancels():
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 1]), helper.make_node("Sigmoid", ["a"], ["b"]),
             helper.make_node("Relu", ["b"], ["c"]), helper.make_node("Transpose", ["c"], ["y"], perm=[0, 2, 1])]
    opt, fired = _check(_model(nodes, [_info("x", [2, 3, 4])], [_info("y", [2, 3, 4])]),
                        {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)})
    assert _ops(opt) == ["Sigmoid", "Relu"] and fired["transpose_sinking"] == 2


def test_training_mode_dropout_of_constants_is_not_folded():
    """Its mask is drawn per run: folding would freeze one draw into the model."""
    nodes = [helper.make_node("Dropout", ["c", "r", "t"], ["d"]), helper.make_node("Add", ["x", "d"], ["y"])]
    inits = [numpy_helper.from_array(np.ones(1000, np.float32), "c"),
             numpy_helper.from_array(np.array(0.5, np.float32), "r"), numpy_helper.from_array(np.array(True), "t")]
    opt, fired = optimize(load_model(_model(nodes, [_info("x", [1000])], [_info("y", [1000])], inits)), ALL)
    assert "Dropout" in _ops(opt) and "constant_folding" not in fired
