"""Adagrad, Adam and Momentum (ai.onnx.preview.training) on two tensors at once, against the spec's pseudo code."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import carrack

DOMAIN = "ai.onnx.preview.training"


def _run(op: str, roles: list[str], tensors: dict[str, list[np.ndarray]], rate: float, step: int,
         **attrs) -> list[np.ndarray]:
    """Runs `op` on R, T and the tensors grouped by role; returns the outputs, grouped the same way."""
    names = ["R", "T"] + [f"{role}{i}" for role in roles for i in range(len(tensors[roles[0]]))]
    out_roles = [r for r in roles if r != "G"]
    outs = [f"{role}{i}_new" for role in out_roles for i in range(len(tensors[roles[0]]))]
    node = helper.make_node(op, names, outs, domain=DOMAIN, **attrs)
    feeds = {"R": np.array(rate, np.float32), "T": np.array(step, np.int64)}
    for role in roles:
        for i, t in enumerate(tensors[role]):
            feeds[f"{role}{i}"] = t
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for n, v in feeds.items()]
    graph_outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    return carrack.InferenceSession(model.SerializeToString()).run(None, feeds)


def _tensors(*roles: str) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    shapes = [(3,), (2, 2)]
    out = {role: [rng.uniform(0.1, 1.0, s).astype(np.float32) for s in shapes] for role in roles}
    return out


def test_adagrad_two_tensors():
    t = _tensors("X", "G", "H")
    got = _run("Adagrad", ["X", "G", "H"], t, 0.1, 3, decay_factor=0.1, epsilon=1e-5, norm_coefficient=0.01)
    r = 0.1 / (1 + 3 * 0.1)
    for i in range(2):
        x, g, h = t["X"][i], t["G"][i], t["H"][i]
        g_reg = 0.01 * x + g
        h_new = h + g_reg * g_reg
        np.testing.assert_allclose(got[i], x - r * g_reg / (np.sqrt(h_new) + 1e-5), rtol=1e-5)
        np.testing.assert_allclose(got[2 + i], h_new, rtol=1e-5)
        assert got[i].dtype == np.float32


@pytest.mark.parametrize("step", [0, 4])
def test_adam_two_tensors(step):
    t = _tensors("X", "G", "V", "H")
    attrs = {"alpha": 0.8, "beta": 0.9, "epsilon": 1e-4, "norm_coefficient": 0.02, "norm_coefficient_post": 0.1}
    got = _run("Adam", ["X", "G", "V", "H"], t, 0.05, step, **attrs)
    rate = 0.05 * np.sqrt(1 - 0.9**step) / (1 - 0.8**step) if step > 0 else 0.05
    for i in range(2):
        x, g, v, h = t["X"][i], t["G"][i], t["V"][i], t["H"][i]
        g_reg = 0.02 * x + g
        v_new = 0.8 * v + 0.2 * g_reg
        h_new = 0.9 * h + 0.1 * g_reg * g_reg
        x_new = (1 - 0.1) * (x - rate * v_new / (np.sqrt(h_new) + 1e-4))
        np.testing.assert_allclose(got[i], x_new, rtol=1e-5)
        np.testing.assert_allclose(got[2 + i], v_new, rtol=1e-5)
        np.testing.assert_allclose(got[4 + i], h_new, rtol=1e-5)


@pytest.mark.parametrize("mode", ["standard", "nesterov"])
@pytest.mark.parametrize("step", [0, 2])
def test_momentum_two_tensors(mode, step):
    t = _tensors("X", "G", "V")
    got = _run("Momentum", ["X", "G", "V"], t, 0.1, step, alpha=0.9, beta=0.5, norm_coefficient=0.01, mode=mode)
    beta = 0.5 if step > 0 else 1.0
    for i in range(2):
        x, g, v = t["X"][i], t["G"][i], t["V"][i]
        g_reg = 0.01 * x + g
        v_new = 0.9 * v + beta * g_reg
        direction = g_reg + 0.9 * v_new if mode == "nesterov" else v_new
        np.testing.assert_allclose(got[i], x - 0.1 * direction, rtol=1e-5)
        np.testing.assert_allclose(got[2 + i], v_new, rtol=1e-5)


def test_momentum_rejects_unknown_mode():
    t = _tensors("X", "G", "V")
    with pytest.raises(carrack.InvalidModel, match="mode"):
        _run("Momentum", ["X", "G", "V"], t, 0.1, 1, alpha=0.9, beta=0.5, norm_coefficient=0.0, mode="heavy")
