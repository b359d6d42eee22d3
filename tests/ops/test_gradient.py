"""Gradient (ai.onnx.preview.training): each vector-Jacobian rule against central finite differences in float64."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.ops.gradient import unbroadcast

DOMAIN = "ai.onnx.preview.training"
UNOPTIMIZED = carrack.GraphOptimizationLevel.ORT_DISABLE_ALL


def _model(nodes, inputs: dict[str, np.ndarray], outputs: list[str], consts: dict[str, np.ndarray] | None = None,
           opset: int = 17) -> bytes:
    elem = {name: helper.np_dtype_to_tensor_dtype(v.dtype) for name, v in inputs.items()}
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, elem[n], v.shape) for n, v in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
        initializer=[numpy_helper.from_array(v, n) for n, v in (consts or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)])
    return model.SerializeToString()


def _session(model: bytes, level=UNOPTIMIZED) -> carrack.InferenceSession:
    opts = carrack.SessionOptions()
    opts.graph_optimization_level = level
    return carrack.InferenceSession(model, opts)


def _check(nodes, inputs: dict[str, np.ndarray], consts: dict[str, np.ndarray] | None = None, opset: int = 17,
           xs: list[str] | None = None, level=UNOPTIMIZED) -> None:
    """Gradient of sum(y * R), R a random weight, w.r.t. xs (default: every input) against finite differences."""
    consts = dict(consts or {})
    xs = list(inputs) if xs is None else xs
    zs = [n for n in inputs if n not in xs]
    y = _session(_model(nodes, inputs, ["y"], consts, opset)).run(None, inputs)[0]
    consts["R"] = np.random.default_rng(1).uniform(0.5, 1.5, y.shape)
    weighted = [*nodes, helper.make_node("Mul", ["y", "R"], ["out"])]
    loss = _session(_model(weighted, inputs, ["out"], consts, opset))
    grad_node = helper.make_node("Gradient", xs + zs, [f"d_{x}" for x in xs], domain=DOMAIN, xs=xs, y="out",
                                 **({"zs": zs} if zs else {}))
    outputs = ["out"] + [f"d_{x}" for x in xs]  # "out" is an output too, else the optimizer drops its nodes
    got = _session(_model([*weighted, grad_node], inputs, outputs, consts, opset), level).run(None, inputs)[1:]
    for x, g in zip(xs, got):
        assert g.shape == inputs[x].shape and g.dtype == inputs[x].dtype
        np.testing.assert_allclose(g, _finite_difference(loss, inputs, x), rtol=1e-6, atol=1e-8, err_msg=x)


def _finite_difference(loss: carrack.InferenceSession, inputs: dict[str, np.ndarray], x: str,
                       h: float = 1e-6) -> np.ndarray:
    flat = inputs[x].reshape(-1)
    grad = np.empty(flat.shape)
    for i in range(flat.size):
        total = []
        for step in (h, -h):
            moved = flat.copy()
            moved[i] += step
            total.append(loss.run(None, {**inputs, x: moved.reshape(inputs[x].shape)})[0].sum())
        grad[i] = (total[0] - total[1]) / (2 * h)
    return grad.reshape(inputs[x].shape)


def _rand(*shape: int, low: float = -1.0, high: float = 1.0, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).uniform(low, high, shape)


def _away_from_zero(*shape: int, seed: int = 0) -> np.ndarray:
    """Values with |v| >= 0.2, so kinks (Relu, Abs) are out of the finite difference's reach."""
    v = _rand(*shape, low=0.2, high=1.0, seed=seed)
    return v * np.where(_rand(*shape, seed=seed + 7) < 0, -1, 1)


def _node(op: str, inputs: list[str], **attrs):
    return helper.make_node(op, inputs, ["y"], **attrs)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("shapes", [((2, 3), (2, 3)), ((2, 3), (3,)), ((2, 1), (1, 3)), ((), (2, 2)),
                                    ((4, 1, 3), (2, 1))], ids=str)
def test_binary_broadcasting(op, shapes):
    a = _rand(*shapes[0])
    b = _rand(*shapes[1], low=0.5, high=1.5, seed=3)
    _check([_node(op, ["a", "b"])], {"a": a, "b": b})


@pytest.mark.parametrize(("op", "x"), [
    ("Neg", _rand(2, 3)), ("Identity", _rand(2, 3)), ("Relu", _away_from_zero(2, 3)),
    ("Sigmoid", _rand(2, 3)), ("Tanh", _rand(2, 3)), ("Exp", _rand(2, 3)),
    ("Log", _rand(2, 3, low=0.5, high=2.0)), ("Sqrt", _rand(2, 3, low=0.5, high=2.0)),
    ("Abs", _away_from_zero(2, 3)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_unary(op, x):
    _check([_node(op, ["x"])], {"x": x})


def test_leaky_relu():
    _check([_node("LeakyRelu", ["x"], alpha=0.2)], {"x": _away_from_zero(3, 4)})


def test_pow_constant_exponent():
    _check([_node("Pow", ["x", "e"])], {"x": _rand(2, 3, low=0.5, high=2.0)}, {"e": np.array([3.0, 0.5, -1.5])})


def test_pow_integer_exponent():
    _check([_node("Pow", ["x", "e"])], {"x": _rand(2, 3)}, {"e": np.array(2, np.int64)})


def test_pow_differentiable_exponent():
    _check([_node("Pow", ["x", "e"])], {"x": _rand(2, 3, low=0.5, high=2.0), "e": _rand(3, seed=4)})


def test_sum_of_three_broadcast():
    _check([_node("Sum", ["a", "b", "c"])], {"a": _rand(2, 3), "b": _rand(3), "c": _rand(2, 1)})


@pytest.mark.parametrize(("sa", "sb"), [((2, 3), (3, 4)), ((3,), (3, 4)), ((2, 3), (3,)), ((3,), (3,)),
                                        ((2, 2, 3), (3, 4)), ((1, 2, 3), (2, 3, 4)), ((2, 1, 2, 3), (3, 3, 2))],
                         ids=str)
def test_matmul(sa, sb):
    _check([_node("MatMul", ["a", "b"])], {"a": _rand(*sa), "b": _rand(*sb, seed=2)})


@pytest.mark.parametrize("c_shape", [None, (4,), (1, 4), (), (2, 4)], ids=str)
@pytest.mark.parametrize(("trans_a", "trans_b"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm(trans_a, trans_b, c_shape):
    inputs = {"a": _rand(*((3, 2) if trans_a else (2, 3))), "b": _rand(*((4, 3) if trans_b else (3, 4)), seed=2)}
    if c_shape is not None:
        inputs["c"] = _rand(*c_shape, seed=5)
    _check([_node("Gemm", list(inputs), alpha=0.7, beta=1.3, transA=trans_a, transB=trans_b)], inputs)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[1], [0, -1], None], ids=str)
def test_reduce_sum(opset, keepdims, axes):
    if axes is None:
        node, consts = _node("ReduceSum", ["x"], keepdims=keepdims), {}
    elif opset >= 13:
        node, consts = _node("ReduceSum", ["x", "axes"], keepdims=keepdims), {"axes": np.array(axes, np.int64)}
    else:
        node, consts = _node("ReduceSum", ["x"], keepdims=keepdims, axes=axes), {}
    _check([node], {"x": _rand(2, 3, 4)}, consts, opset=opset)


def test_reduce_sum_noop_with_empty_axes():
    _check([_node("ReduceSum", ["x"], noop_with_empty_axes=1)], {"x": _rand(2, 3)}, opset=13)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_mean(opset, keepdims):
    if opset >= 18:
        node, consts = _node("ReduceMean", ["x", "axes"], keepdims=keepdims), {"axes": np.array([0, 2], np.int64)}
    else:
        node, consts = _node("ReduceMean", ["x"], keepdims=keepdims, axes=[0, 2]), {}
    _check([node], {"x": _rand(2, 3, 4)}, consts, opset=opset)
    _check([_node("ReduceMean", ["x"], keepdims=keepdims)], {"x": _rand(2, 3)}, opset=opset)


def test_reshape_transpose_flatten():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Transpose", ["r"], ["t"],
                                                                                   perm=[2, 0, 1]),
             helper.make_node("Transpose", ["t"], ["u"]), _node("Flatten", ["u"], axis=2)]
    _check(nodes, {"x": _rand(4, 6)}, {"shape": np.array([2, 3, 4], np.int64)})


@pytest.mark.parametrize("opset", [11, 13])
def test_unsqueeze_squeeze(opset):
    if opset >= 13:
        consts = {"ax0": np.array([0, 3], np.int64), "ax1": np.array([0], np.int64)}
        nodes = [helper.make_node("Unsqueeze", ["x", "ax0"], ["u"]), _node("Squeeze", ["u", "ax1"])]
    else:
        consts = {}
        nodes = [helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0, 3]), _node("Squeeze", ["u"], axes=[0])]
    _check(nodes, {"x": _rand(2, 3)}, consts, opset=opset)


def test_expand():
    _check([_node("Expand", ["x", "shape"])], {"x": _rand(3, 1)}, {"shape": np.array([2, 3, 4], np.int64)})


@pytest.mark.parametrize(("opset", "axis"), [(13, 1), (13, -1), (11, 1), (11, 0)])
def test_softmax(opset, axis):
    _check([_node("Softmax", ["x"], axis=axis)], {"x": _rand(2, 3, 4)}, opset=opset)


def test_chain_with_shared_input_and_constant_weight():
    """A small MLP: x feeds two branches, so gradients accumulate; W and b are differentiated, x is in zs."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Tanh", ["hb"], ["t"]), helper.make_node("ReduceSum", ["x"], ["s"], axes=[1]),
             _node("Mul", ["t", "s"])]
    inputs = {"W": _rand(3, 4), "b": _rand(4, seed=1), "x": _rand(2, 3, seed=2)}
    _check(nodes, inputs, opset=11, xs=["W", "b"])
    _check(nodes, inputs, opset=11, xs=["W", "b", "x"], level=carrack.GraphOptimizationLevel.ORT_ENABLE_ALL)


@pytest.mark.parametrize(("base", "activation", "attrs"), [
    ("MatMul", "Relu", {}), ("MatMul", "Tanh", {}), ("Gemm", "LeakyRelu", {"alpha": 0.3}), ("Gemm", "Sigmoid", {}),
    ("MatMul", "LeakyRelu", {"alpha": 0.2}),
])
def test_through_optimizer_fusions(base, activation, attrs):
    """The optimizer fuses Gemm/MatMul + activation into FusedGemm/FusedMatMul; those are differentiated too."""
    nodes = [helper.make_node(base, ["a", "w"], ["h"]), _node(activation, ["h"], **attrs)]
    inputs = {"a": _away_from_zero(2, 3), "w": _away_from_zero(3, 4, seed=3)}
    _check(nodes, inputs, level=carrack.GraphOptimizationLevel.ORT_ENABLE_ALL)
    sess = _session(_model(nodes, inputs, ["y"]), carrack.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert sess.optimizer_stats.get("activation_fusion") == 1


def test_op_without_rule_fails_at_every_optimization_level():
    """The optimizer leaves graphs with a Gradient alone (it names y in an attribute, a use rewrites cannot see), so
    the error names the model's own op, not a fused one."""
    nodes = [helper.make_node("MatMul", ["a", "w"], ["h"]), helper.make_node("HardSigmoid", ["h"], ["y"]),
             helper.make_node("Gradient", ["a", "w"], ["da", "dw"], domain=DOMAIN, xs=["a", "w"], y="y")]
    model = _model(nodes, {"a": _rand(2, 3), "w": _rand(3, 4)}, ["y", "da", "dw"])
    for level in (carrack.GraphOptimizationLevel.ORT_ENABLE_ALL, carrack.GraphOptimizationLevel.ORT_DISABLE_ALL):
        with pytest.raises(carrack.InvalidModel, match=r"no derivative rule for HardSigmoid"):
            _session(model, level)


@pytest.mark.parametrize("opset", [7, 9, 12])
def test_old_opsets(opset):
    """Gemm, Softmax (2-D coerced), Sum, ReduceMean (axes attribute) and a Constant node at old opsets."""
    nodes = [helper.make_node("Gemm", ["a", "w", "c"], ["h"], transB=1),
             helper.make_node("Softmax", ["h"], ["s"]),
             helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([0.5, 2.0, -1.0, 3.0]))),
             helper.make_node("Sum", ["s", "k", "h"], ["t"]),
             _node("ReduceMean", ["t"], axes=[0], keepdims=0)]
    inputs = {"a": _rand(2, 3), "w": _rand(4, 3, seed=1), "c": _rand(1, 4, seed=2)}
    _check(nodes, inputs, opset=opset)


def test_intermediate_x_empty_output_unused_x_and_float32():
    """xs may name an intermediate (the path stops there); an empty output name is skipped; an x that y does not
    depend on gets zeros; float32 stays float32."""
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    nodes = [helper.make_node("Mul", ["a", "a"], ["h"]), helper.make_node("Mul", ["h", "a"], ["y"]),
             helper.make_node("Gradient", ["h", "a", "u"], ["dh", "", "du"], domain=DOMAIN, xs=["h", "a", "u"],
                              y="y")]
    sess = _session(_model(nodes, {"a": a, "u": a}, ["y", "dh", "du"]), carrack.GraphOptimizationLevel.ORT_ENABLE_ALL)
    y, dh, du = sess.run(None, {"a": a, "u": a})
    np.testing.assert_allclose(y, a**3)
    np.testing.assert_array_equal(dh, a)
    np.testing.assert_array_equal(du, np.zeros_like(a))
    assert dh.dtype == du.dtype == np.float32


def test_gradient_at_given_values():
    """The Gradient node's inputs are the point where the gradient is taken, not the forward graph's values."""
    nodes = [helper.make_node("Mul", ["a", "a"], ["y"]), helper.make_node("Identity", ["a"], ["a2"]),
             helper.make_node("Add", ["a2", "a2"], ["p"]),
             helper.make_node("Gradient", ["p"], ["dp"], domain=DOMAIN, xs=["a"], y="y")]
    a = np.array([1.0, 2.0], np.float32)
    (dp,) = _session(_model(nodes, {"a": a}, ["dp"])).run(None, {"a": a})
    np.testing.assert_array_equal(dp, 4 * a)


def test_non_differentiable_op_off_the_path_is_fine():
    nodes = [helper.make_node("Cos", ["z"], ["c"]), _node("Mul", ["x", "c"])]
    _check(nodes, {"x": _rand(3), "z": _rand(3, seed=1)}, xs=["x"])


def test_unsupported_op_on_path_fails_at_session_creation():
    nodes = [helper.make_node("Sin", ["x"], ["s"]), helper.make_node("Add", ["s", "x"], ["y"]),
             helper.make_node("Gradient", ["x"], ["dx"], domain=DOMAIN, xs=["x"], y="y")]
    with pytest.raises(carrack.InvalidModel, match=r"no derivative rule for Sin"):
        _session(_model(nodes, {"x": _rand(3)}, ["y", "dx"]))


def test_unlisted_graph_input_fails():
    nodes = [helper.make_node("Add", ["x", "w"], ["y"]),
             helper.make_node("Gradient", ["x"], ["dx"], domain=DOMAIN, xs=["x"], y="y")]
    with pytest.raises(carrack.InvalidModel, match=r"depends on 'w'"):
        _session(_model(nodes, {"x": _rand(3), "w": _rand(3)}, ["y", "dx"]))


def test_unknown_y_fails():
    nodes = [helper.make_node("Gradient", ["x"], ["dx"], domain=DOMAIN, xs=["x"], y="nowhere")]
    with pytest.raises(carrack.InvalidModel, match=r"'nowhere' is not computed"):
        _session(_model(nodes, {"x": _rand(3)}, ["dx"]))


def test_unbroadcast():
    g = np.ones((4, 2, 3))
    np.testing.assert_array_equal(unbroadcast(g, (2, 1)), np.full((2, 1), 12.0))
    np.testing.assert_array_equal(unbroadcast(g, ()), np.array(24.0))
    assert unbroadcast(g, (4, 2, 3)) is g
