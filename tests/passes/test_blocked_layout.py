"""The channel-blocked layout pass (carrack/passes/blocked_layout.py): a torch-exported CNN with residual blocks
gives onnxruntime's outputs with its convolution chains blocked (reorders only at the chain's ends), the same bits at
1, 2 and 4 threads and on the bound second run; channel counts that are not multiples of 16, lone convolutions and
sessions that do not turn it on (the default) keep the NCHW convolutions; the numpy fallback and bad inputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.errors import CarrackError, InvalidModel
from carrack.native import blockconv
from carrack.native import convolution as native_conv
from carrack.ops.blocked import BlockedConv
from carrack.passes.blocked_layout import CONFIG_KEY
from tests.helpers import randomize_batch_norms

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
needs_vector_kernel = pytest.mark.skipif(not blockconv.vectorized(), reason="blockconv.c's tile needs AVX-512")


class Bottleneck(torch.nn.Module):
    def __init__(self, channels: int, mid: int, out: int, stride: int):
        super().__init__()
        bn = torch.nn.BatchNorm2d
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(channels, mid, 1, bias=False), bn(mid), torch.nn.ReLU(),
            torch.nn.Conv2d(mid, mid, 3, stride, 1, bias=False), bn(mid), torch.nn.ReLU(),
            torch.nn.Conv2d(mid, out, 1, bias=False), bn(out))
        self.shortcut = (torch.nn.Identity() if stride == 1 and channels == out else
                         torch.nn.Sequential(torch.nn.Conv2d(channels, out, 1, stride, bias=False), bn(out)))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class SmallResNet(torch.nn.Module):
    """7x7/2 stem on 3 channels, max pool, bottlenecks (one strided, with a downsampling shortcut), pool, head."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, width, 7, 2, 3), torch.nn.ReLU(),
                                        torch.nn.MaxPool2d(3, 2, 1))
        self.blocks = torch.nn.Sequential(Bottleneck(width, 16, 2 * width, 1), Bottleneck(2 * width, 16, 2 * width, 1),
                                          Bottleneck(2 * width, 32, 4 * width, 2))
        self.head = torch.nn.Linear(4 * width, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _export(net: torch.nn.Module, shape: tuple[int, ...]) -> bytes:
    import io

    torch.manual_seed(0)
    randomize_batch_norms(net)
    net.eval()
    buffer = io.BytesIO()
    torch.onnx.export(net, (torch.randn(*shape),), buffer, input_names=["x"], output_names=["y"], dynamo=False,
                      dynamic_axes={"x": {0: "batch"}})
    return buffer.getvalue()


def _session(model, threads: int = 1, blocked: str | None = "1", bind: bool = True) -> carrack.InferenceSession:
    options = carrack.SessionOptions()
    options.intra_op_num_threads = threads
    if blocked is not None:
        options.add_session_config_entry(CONFIG_KEY, blocked)
    session = carrack.InferenceSession(model, options)
    session._program.bind_steps = bind
    return session


def _ops(session) -> list[str]:
    return [n.op_type for n in session._plan.graph.nodes]


@pytest.fixture(scope="module")
def resnet() -> bytes:
    torch.manual_seed(0)
    return _export(SmallResNet(), (2, 3, 64, 64))


@needs_vector_kernel
def test_residual_cnn_matches_onnxruntime_with_its_chain_blocked(resnet, monkeypatch):
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)  # every layer split over the threads
    x = np.random.default_rng(0).standard_normal((2, 3, 64, 64), dtype=np.float32)
    want = ort.InferenceSession(resnet).run(None, {"x": x})[0]
    results = []
    for threads in (1, 2, 4):
        session = _session(resnet, threads)
        ops = _ops(session)
        # every convolution after the stem runs blocked, one reorder at each end of the chain, no Add left
        assert ops.count("BlockedConv") == 11 and "Add" not in ops
        assert ops.count("BlockChannels") == 1 and ops.count("UnblockChannels") == 1
        assert ops.index("MaxPool") < ops.index("BlockChannels") < ops.index("BlockedConv")
        assert session.optimizer_stats["blocked_layout"] == 11
        first = session.run(None, {"x": x})[0]
        second = session.run(None, {"x": x})[0]  # bound to the reused arena
        assert np.array_equal(first, second)
        results.append(first)
    np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=2e-5 * np.abs(want).max())
    assert all(np.array_equal(results[0], r) for r in results[1:])
    plain = _session(resnet, 1, blocked="0").run(None, {"x": x})[0]
    np.testing.assert_allclose(results[0], plain, rtol=1e-4, atol=2e-5 * np.abs(want).max())


@needs_vector_kernel
def test_other_batch_sizes_and_memory_plan(resnet):
    session = _session(resnet)
    x = np.random.default_rng(1).standard_normal((3, 3, 64, 64), dtype=np.float32)
    want = ort.InferenceSession(resnet).run(None, {"x": x})[0]
    np.testing.assert_allclose(session.run(None, {"x": x})[0], want, rtol=1e-4, atol=2e-5 * np.abs(want).max())
    plan = session.memory_plan({"batch": 3})
    assert plan.arena_bytes > 0 and plan.prepared_bytes > 0


@needs_vector_kernel
def test_numpy_fallback_of_blocked_nodes_matches(resnet):
    x = np.random.default_rng(2).standard_normal((2, 3, 64, 64), dtype=np.float32)
    session = _session(resnet, bind=False)
    native = session.run(None, {"x": x})[0]
    kernels = [s.kernel for s in session._program.steps if s.node.op_type in ("BlockedConv", "BlockChannels",
                                                                                "UnblockChannels")]
    assert len(kernels) == 13
    for kernel in kernels:
        kernel.lib = None  # as where blockconv.c does not load
    np.testing.assert_allclose(session.run(None, {"x": x})[0], native, rtol=1e-4,
                               atol=2e-5 * np.abs(native).max())


def _conv_chain(channels: tuple[int, ...], size: int = 10) -> bytes:
    """Conv -> Relu -> Conv -> Relu ... over the given channel counts (3x3, pads 1)."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for k, (c, m) in enumerate(zip(channels, channels[1:])):
        w = (rng.standard_normal((m, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{k}"))
        nodes += [helper.make_node("Conv", [prev, f"w{k}"], [f"c{k}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"])]
        prev = f"r{k}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             [1, channels[0], size, size])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@needs_vector_kernel
def test_channels_not_multiples_of_16_are_left_alone():
    session = _session(_conv_chain((24, 24, 24)))
    assert "BlockedConv" not in _ops(session)
    mixed = _session(_conv_chain((16, 32, 24, 32)))  # 16 -> 32 alone: 32 -> 24 breaks the chain
    assert "BlockedConv" not in _ops(mixed)


@needs_vector_kernel
def test_narrow_maps_are_left_alone():
    assert "BlockedConv" not in _ops(_session(_conv_chain((16, 32, 16), size=7)))  # rows of 7: packconv.c's
    assert _ops(_session(_conv_chain((16, 32, 16), size=8))).count("BlockedConv") == 2


@needs_vector_kernel
def test_chain_output_is_a_graph_output_and_matches():
    model = _conv_chain((16, 32, 16, 48), size=9)
    session = _session(model)
    ops = _ops(session)
    assert ops.count("BlockedConv") == 3 and ops[-1] == "UnblockChannels"
    x = np.random.default_rng(3).standard_normal((1, 16, 9, 9), dtype=np.float32)
    want = ort.InferenceSession(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(session.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)


@needs_vector_kernel
def test_lone_convolution_and_config_entry_keep_nchw(resnet):
    assert "BlockedConv" not in _ops(_session(_conv_chain((16, 32))))
    assert "BlockedConv" not in _ops(_session(resnet, blocked="0"))
    assert "BlockedConv" not in _ops(_session(resnet, blocked=None))  # off by default


@needs_vector_kernel
def test_environment_turns_it_on_for_sessions_without_the_entry(resnet, monkeypatch):
    monkeypatch.setenv("CARRACK_BLOCKED_LAYOUT", "1")
    assert "BlockedConv" in _ops(_session(resnet, blocked=None))
    assert "BlockedConv" not in _ops(_session(resnet, blocked="0"))
    with pytest.raises(CarrackError, match=CONFIG_KEY):
        _session(resnet, blocked="sometimes")


def test_blocked_conv_names_bad_weights_and_inputs():
    node = onnx.helper.make_node("BlockedConv", ["x", "w"], ["y"], domain="carrack", kernel_shape=[3, 3],
                                 pads=[1, 1, 1, 1])
    from carrack.ir.graph import Node

    kernel = BlockedConv(Node("BlockedConv", list(node.input), list(node.output),
                              {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, domain="carrack", name="b"), 1)
    with pytest.raises(InvalidModel, match="multiples of 16"):
        kernel.run(np.zeros((1, 1, 4, 4, 16), np.float32), np.zeros((24, 16, 3, 3), np.float32))
    with pytest.raises(InvalidModel, match=r"input X must be a blocked map \[N, 1, H, W, 16\]"):
        kernel.run(np.zeros((1, 16, 4, 4), np.float32), np.zeros((16, 16, 3, 3), np.float32))
    with pytest.raises(InvalidModel, match="residual Z"):
        kernel.run(np.zeros((1, 1, 4, 4, 16), np.float32), np.zeros((16, 16, 3, 3), np.float32), None,
                   np.zeros((1, 1, 3, 3, 16), np.float32))
