"""Measured memory of a 50-layer Conv+BatchNormalization+Relu(+Dropout) network against the static memory plan.

The executor releases each value after its last reader, so the live set while running is what the plan's arena
holds (the previous activation and the next), plus the kernel's own scratch (im2col columns for kxk convolutions);
numpy's allocations are traced by tracemalloc. Training-only nodes are gone after optimization, and repeated runs
do not grow the process.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.onnx.importer import load_model
from carrack.passes.memory_plan import plan_memory

LAYERS, CHANNELS, SIDE = 50, 16, 64
ACTIVATION = CHANNELS * SIDE * SIDE * 4


def conv_bn_net(kernel: int, layers: int = LAYERS, dropout_every: int = 5) -> onnx.ModelProto:
    """x -> [Conv -> BatchNormalization -> Relu (-> Dropout)] * layers -> y, all 16 x 64 x 64 float32."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    inits.append(numpy_helper.from_array(np.array(0.25, np.float32), "ratio"))
    inits.append(numpy_helper.from_array(np.array(False), "inference"))
    for i in range(layers):
        w = rng.standard_normal((CHANNELS, CHANNELS, kernel, kernel)) / np.sqrt(CHANNELS * kernel * kernel)
        params = {"w": w, "scale": rng.random(CHANNELS) + 0.5, "shift": rng.standard_normal(CHANNELS) * 0.1,
                  "mean": rng.standard_normal(CHANNELS) * 0.1, "var": rng.random(CHANNELS) + 0.5}
        inits += [numpy_helper.from_array(v.astype(np.float32), f"{k}{i}") for k, v in params.items()]
        bn_attrs = {"training_mode": 0} if i % 2 else {}
        nodes += [helper.make_node("Conv", [prev, f"w{i}"], [f"conv{i}"], pads=[kernel // 2] * 4),
                  helper.make_node("BatchNormalization", [f"conv{i}", f"scale{i}", f"shift{i}", f"mean{i}",
                                                          f"var{i}"], [f"bn{i}"], epsilon=1e-5, **bn_attrs),
                  helper.make_node("Relu", [f"bn{i}"], [f"relu{i}"])]
        prev = f"relu{i}"
        if i % dropout_every == dropout_every - 1:
            inputs = [prev, "ratio", "inference"] if i % 2 else [prev]
            nodes.append(helper.make_node("Dropout", inputs, [f"drop{i}", f"mask{i}"]))
            prev = f"drop{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    shape = [1, CHANNELS, SIDE, SIDE]
    graph = helper.make_graph(nodes, "conv_bn_net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    # value_info as exporters write it: the plan then knows every size even after fusing into com.microsoft ops
    return onnx.shape_inference.infer_shapes(model)


def _input() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((1, CHANNELS, SIDE, SIDE)).astype(np.float32)


def traced_peak(sess: carrack.InferenceSession, x: np.ndarray) -> tuple[int, np.ndarray]:
    sess.run(None, {"x": x})  # warm up: lazily built state is not part of a run's working memory
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        y = sess.run(None, {"x": x})[0]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, y


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module", params=[1, 3], ids=["1x1", "3x3"])
def net(request):
    model = conv_bn_net(request.param)
    return request.param, model, carrack.InferenceSession(model.SerializeToString())


def test_training_nodes_are_gone(net):
    _, _, sess = net
    ops = {n.op_type for n in sess._model.graph.nodes}
    assert not ops & {"Dropout", "BatchNormalization", "Relu", "Identity"}, ops
    assert len(sess._model.graph.nodes) == LAYERS  # one fused convolution per layer
    for node in sess._model.graph.nodes:
        assert "training_mode" not in node.attrs and len([o for o in node.outputs if o]) == 1
    names = set(sess._model.graph.initializers)
    assert not any(n.startswith(("mean", "var", "scale", "shift", "ratio", "inference")) for n in names), names


def test_result_matches_onnxruntime(net):
    import onnxruntime as ort

    _, model, sess = net
    x = _input()
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], expected[0], rtol=1e-3, atol=1e-4)


def test_measured_peak_is_close_to_the_plan(net):
    kernel, model, sess = net
    plan = sess.memory_plan()
    peak, y = traced_peak(sess, _input())
    # kxk convolutions also hold their padded input and im2col columns while they run: the plan counts that scratch
    scratch = 0 if kernel == 1 else (CHANNELS * kernel * kernel * SIDE * SIDE * 4
                                     + CHANNELS * (SIDE + kernel - 1) ** 2 * 4)
    source_model = load_model(model)
    source = plan_memory(source_model.graph, source_model.opsets)
    budget = plan.arena_bytes + y.nbytes
    print(f"\n{kernel}x{kernel}: traced peak {peak / 2**20:.2f} MiB; plan arena {plan.arena_bytes / 2**20:.2f} MiB "
          f"(with conv scratch {scratch / 2**20:.2f} MiB) + output {y.nbytes / 2**20:.2f} MiB "
          f"(ratio {peak / budget:.2f}); plan efficiency {plan.efficiency:.3f}; intermediates "
          f"{plan.intermediate_bytes / 2**20:.2f} MiB optimized, {source.intermediate_bytes / 2**20:.2f} MiB source")
    assert [n for n in plan.unknown if n != "y"] == []
    # a chain needs two live activations (three with alignment slack), plus one convolution's scratch
    assert scratch <= plan.arena_bytes <= 3 * ACTIVATION + scratch
    assert plan.efficiency < 0.1
    assert peak <= 1.5 * budget
    assert peak < 0.2 * source.intermediate_bytes  # far below keeping every intermediate
    assert peak < 0.5 * plan.intermediate_bytes


_RSS_SCRIPT = """
import sys
import numpy as np
import carrack
from tests.test_memory_peak import _input, conv_bn_net, rss_bytes
sess = carrack.InferenceSession(conv_bn_net(int(sys.argv[1])).SerializeToString())
x = _input()
for _ in range(20):
    sess.run(None, {"x": x})
before = rss_bytes()
for _ in range(20):
    sess.run(None, {"x": x})
print(rss_bytes() - before)
"""


def test_repeated_runs_keep_rss_flat(net):
    """Measured in a fresh process: this process's heap, shaped by every earlier test, says nothing about leaks."""
    import subprocess
    import sys
    from pathlib import Path

    kernel, _, _ = net
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(kernel)], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    growth = int(done.stdout.split()[-1])
    assert growth < 4 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 20 runs"
