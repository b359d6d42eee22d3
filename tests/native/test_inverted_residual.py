"""MobileNetV2's inverted-residual block as one carrack.InvertedResidual node (passes/fusions.py) run by invres.c:
torch-exported blocks of every kind (stride 1 and 2, with and without the residual, ReLU6/ReLU/Hardswish, maps cut
in bands and small maps split by channels) give onnxruntime's results within float32 rounding and the same bits at
1, 2 and 4 threads and at any band height; the three-convolution path, the export of the optimized model, `carrack
compile` and the memory plan handle the node; graphs that are not a block stay as they are."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

import carrack
from carrack.errors import InvalidModel
from carrack.ir.graph import Node
from carrack.native import invres
from carrack.ops.fused import InvertedResidual
from carrack.passes.fusions import without_block_fusion
from carrack.runtime.session import InferenceSession, SessionOptions
from tests.helpers import randomize_batch_norms, session_at

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
needs_kernel = pytest.mark.skipif(invres.library() is None, reason="invres.c needs AVX-512 (not in this build)")


class Block(torch.nn.Module):
    """expand 1x1 -> BatchNorm -> act -> depthwise 3x3 -> BatchNorm -> act -> project 1x1 -> BatchNorm (+ x)"""

    def __init__(self, channels: int, out_channels: int, stride: int, act=torch.nn.ReLU6, expansion: int = 6):
        super().__init__()
        wide = expansion * channels
        expand = [torch.nn.Conv2d(channels, wide, 1, bias=False), torch.nn.BatchNorm2d(wide), act()]
        self.body = torch.nn.Sequential(
            *(expand if expansion > 1 else []),  # MobileNetV2's first block has no expansion
            torch.nn.Conv2d(wide, wide, 3, stride=stride, padding=1, groups=wide, bias=False),
            torch.nn.BatchNorm2d(wide), act(),
            torch.nn.Conv2d(wide, out_channels, 1, bias=False), torch.nn.BatchNorm2d(out_channels))
        self.residual = stride == 1 and channels == out_channels

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


def _export(net: torch.nn.Module, shape: tuple[int, ...], path, outputs: tuple[str, ...] = ("y",)) -> str:
    torch.manual_seed(1)
    randomize_batch_norms(net)
    net.eval()
    torch.onnx.export(net, (torch.randn(*shape),), str(path), input_names=["x"], output_names=list(outputs),
                      dynamo=False)
    return str(path)


def _ops(session: InferenceSession) -> list[str]:
    return [node.op_type for node in session._plan.graph.nodes]


#: (channels, out channels, stride, activation, input [N, C, H, W][, expansion]): band-cut maps (odd sizes, batch 2)
#: and small maps (14x14 and 7x7 outputs) of every kind of block; expansion 1: no expansion convolution (MobileNetV2's
#: first block, a depthwise-separable pair)
BLOCKS = {
    "s1_residual_relu6_bands": (8, 8, 1, torch.nn.ReLU6, (2, 8, 37, 23)),
    "s1_wider_relu_bands": (8, 12, 1, torch.nn.ReLU, (1, 8, 30, 33)),
    "s2_relu6_bands": (8, 12, 2, torch.nn.ReLU6, (2, 8, 45, 38)),
    "s2_hardswish_bands": (6, 10, 2, torch.nn.Hardswish, (1, 6, 40, 41)),
    "s1_residual_small": (16, 16, 1, torch.nn.ReLU6, (2, 16, 14, 14)),
    "s1_residual_7x7": (20, 20, 1, torch.nn.ReLU6, (1, 20, 7, 7)),
    "s2_to_7x7": (16, 24, 2, torch.nn.ReLU6, (1, 16, 14, 14)),
    "s2_odd_small": (5, 7, 2, torch.nn.LeakyReLU, (2, 5, 9, 11)),
    "first_block_bands": (8, 12, 1, torch.nn.ReLU6, (1, 8, 41, 35), 1),
    "separable_residual_small": (16, 16, 1, torch.nn.ReLU6, (2, 16, 12, 12), 1),
    "separable_s2_bands": (8, 8, 2, torch.nn.ReLU, (1, 8, 47, 40), 1),
}


@pytest.fixture(scope="module", params=list(BLOCKS))
def block(request, tmp_path_factory) -> tuple[str, np.ndarray]:
    channels, out_channels, stride, act, shape, *expansion = BLOCKS[request.param]
    path = _export(Block(channels, out_channels, stride, act, *expansion), shape,
                   tmp_path_factory.mktemp("invres") / f"{request.param}.onnx")
    return path, np.random.default_rng(2).standard_normal(shape).astype(np.float32)


@needs_kernel
def test_block_is_one_node_matching_onnxruntime_with_the_same_bits_at_any_thread_count(block):
    path, x = block
    expected = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    results = []
    for threads in (1, 2, 4):
        session = session_at(path, threads)
        assert _ops(session) == ["InvertedResidual"]
        results.append(session.run(None, {"x": x})[0])
        session.run(None, {"x": x[::-1].copy()})
        results.append(session.run(None, {"x": x})[0])  # the same bits after another input
    np.testing.assert_allclose(results[0], expected, rtol=1e-4, atol=1e-4)
    assert all(np.array_equal(y, results[0]) for y in results)


@needs_kernel
@pytest.mark.parametrize("band_bytes", [1, 3 * 4096, 1 << 30])
def test_any_band_height_gives_the_same_bits(block, band_bytes, monkeypatch):
    """Bands of one row (each band reuses the last one's expanded rows), of a few rows, and the whole map."""
    path, x = block
    reference = session_at(path, 1).run(None, {"x": x})[0]
    monkeypatch.setattr(invres, "BAND_BYTES", band_bytes)
    for threads in (1, 3):
        assert np.array_equal(session_at(path, threads).run(None, {"x": x})[0], reference)


@needs_kernel
def test_three_convolutions_without_the_kernel(block, monkeypatch):
    path, x = block
    expected = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    monkeypatch.setattr(invres, "pack", lambda *args: None)
    session = session_at(path, 2)
    assert _ops(session) == ["InvertedResidual"]
    assert all(kernel.block is None for kernel in _kernels(session))
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-4, atol=1e-4)


def _kernels(session: InferenceSession) -> list[InvertedResidual]:
    return [step.kernel for step in session._program.steps if isinstance(step.kernel, InvertedResidual)]


@pytest.fixture(scope="module")
def network(tmp_path_factory) -> str:
    """A MobileNetV2-like stack: a stem, blocks of each kind, a head."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU6(),
                              Block(8, 8, 1, expansion=1), Block(8, 8, 1), Block(8, 12, 2),
                              Block(12, 12, 1, torch.nn.ReLU), Block(12, 16, 2), Block(16, 16, 1),
                              torch.nn.Conv2d(16, 32, 1), torch.nn.ReLU6())
    return _export(net, (1, 3, 57, 50), tmp_path_factory.mktemp("invres_net") / "net.onnx")


@needs_kernel
def test_bound_blocks_give_the_same_bits_at_any_thread_count(network, monkeypatch):
    """Blocks reading and writing the arena are bound (their ctypes arguments converted once)."""
    bound_calls = []
    original_bind = invres.PackedBlock.bind

    def bind(self, *args):
        call = original_bind(self, *args)
        return lambda: bound_calls.append(1) or call()
    monkeypatch.setattr(invres.PackedBlock, "bind", bind)
    rng = np.random.default_rng(7)
    feeds = [{"x": rng.standard_normal((1, 3, 57, 50)).astype(np.float32)} for _ in range(3)]
    expected = [ort.InferenceSession(network, providers=["CPUExecutionProvider"]).run(None, f)[0] for f in feeds]
    first = None
    for threads in (1, 2, 4):
        session = session_at(network, threads)
        session.run(None, feeds[0])
        session.run(None, feeds[0])  # the first run into the reused arena binds the steps
        bound_calls.clear()
        results = [session.run(None, f)[0] for f in feeds]
        assert len(bound_calls) == 3 * 6  # every block of every run
        first = first or results
        for got, want, same in zip(results, expected, first):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
            assert np.array_equal(got, same)


@needs_kernel
def test_network_fuses_every_block_and_exports_the_convolutions_back(network, tmp_path):
    x = np.random.default_rng(5).standard_normal((1, 3, 57, 50)).astype(np.float32)
    expected = ort.InferenceSession(network, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    options = SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = InferenceSession(network, options)
    assert _ops(session).count("InvertedResidual") == 6
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-4, atol=1e-4)
    saved = onnx.load(options.optimized_model_filepath)
    assert "InvertedResidual" not in {n.op_type for n in saved.graph.node}
    again = ort.InferenceSession(options.optimized_model_filepath, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(again.run(None, {"x": x})[0], expected, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_memory_plan_counts_the_packed_weights_and_the_scratch(network):
    session = InferenceSession(network)
    with without_block_fusion():
        unfused = InferenceSession(network)
    node = next(n for n in session._plan.graph.nodes if n.op_type == "InvertedResidual" and n.inputs[1])
    w_expand, w_project = (session._plan.graph.initializers[node.inputs[k]] for k in (1, 5))
    packed = InvertedResidual.prepared_bytes(node, session._plan.graph.initializers)
    assert packed == 4 * (invres.packed_floats(*w_expand.shape[:2]) + invres.packed_floats(*w_project.shape[:2]))
    facts = session._plan.facts({})
    assert InvertedResidual.scratch_bytes(node, facts) > 0
    assert session.memory_plan().prepared_bytes > 0
    # the fused plan holds no intermediate maps: its arena is smaller than the three convolutions'
    assert session.memory_plan().arena_bytes < unfused.memory_plan().arena_bytes


def test_blocks_that_do_not_qualify_stay_three_convolutions(tmp_path):
    class Exposed(Block):  # the expanded map is also an output: it must exist
        def forward(self, x):
            expanded = self.body[:3](x)
            return self.body[3:](expanded), expanded

    path = _export(Exposed(8, 8, 1), (1, 8, 10, 10), tmp_path / "exposed.onnx", ("y", "e"))
    session = session_at(path, 1)  # the expansion stays; the rest is a block without expansion
    assert _ops(session) == ["FusedConv", "InvertedResidual"]
    assert [kernel.node.inputs[1:3] for kernel in _kernels(session)] == [["", ""]]
    x = np.random.default_rng(4).standard_normal((1, 8, 10, 10)).astype(np.float32)
    expected = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for got, want in zip(session.run(None, {"x": x}), expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    wide = torch.nn.Sequential(torch.nn.Conv2d(8, 48, 1), torch.nn.ReLU6(),
                               torch.nn.Conv2d(48, 48, 5, padding=2, groups=48), torch.nn.ReLU6(),
                               torch.nn.Conv2d(48, 8, 1))  # a 5x5 depthwise
    path = _export(wide, (1, 8, 10, 10), tmp_path / "five.onnx")
    assert "InvertedResidual" not in _ops(session_at(path, 1))


@needs_kernel
def test_compile_runs_the_three_convolutions(network, tmp_path):
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler (apt-get install gcc)")
    from carrack.backends.c.build import compile_model

    x = np.random.default_rng(6).standard_normal((1, 3, 57, 50)).astype(np.float32)
    session = InferenceSession(network)
    expected = session.run(None, {"x": x})[0]
    assert "InvertedResidual" in [n.op_type for n in session._plan.model.graph.nodes]
    # a model file (planned without the block fusion) and a session's plan (the compiled executor's case)
    for k, model in enumerate((network, session._plan.model)):
        compile_model(model, tmp_path / f"out{k}", "native")
        got = carrack.CompiledModel(tmp_path / f"out{k}").run(None, {"x": x})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_bad_nodes_are_refused_by_name():
    node = Node("InvertedResidual", ["x", "w"], ["y"], {"stride": 1}, domain="carrack", name="block7")
    with pytest.raises(InvalidModel, match="block7.*7 inputs"):
        InvertedResidual(node, 1)
    node = Node("InvertedResidual", ["x", *"abcdef"], ["y"], {"stride": 3}, domain="carrack", name="block8")
    with pytest.raises(InvalidModel, match="block8.*stride must be 1 or 2"):
        InvertedResidual(node, 1)


@needs_kernel
@pytest.mark.parametrize("stride, size", [(1, 31), (2, 15)])
def test_a_node_without_expansion_runs_the_depthwise_on_its_input(tmp_path, stride, size):
    """inputs 1-2 empty: depthwise 3x3 + ReLU6, projection (+ the input), in bands (31x31) and on a small map."""
    rng = np.random.default_rng(9)
    channels, out_channels = 8, 8 if stride == 1 else 12
    weights = {"wd": rng.standard_normal((channels, 1, 3, 3)), "bd": rng.standard_normal(channels),
               "wp": rng.standard_normal((out_channels, channels, 1, 1)), "bp": rng.standard_normal(out_channels)}
    inits = [onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    fused = onnx.helper.make_node(
        "InvertedResidual", ["x", "", "", "wd", "bd", "wp", "bp"], ["y"], domain="carrack", stride=stride,
        residual=int(stride == 1), expanded_channels=channels, depthwise_activation="Clip",
        depthwise_activation_params=[0.0, 6.0])
    plain = [onnx.helper.make_node("Conv", ["x", "wd", "bd"], ["d0"], group=channels, pads=[1] * 4,
                                   strides=[stride] * 2, kernel_shape=[3, 3]),
             onnx.helper.make_node("Clip", ["d0", "lo", "hi"], ["d"]),
             onnx.helper.make_node("Conv", ["d", "wp", "bp"], ["p" if stride == 1 else "y"]),
             *([onnx.helper.make_node("Add", ["p", "x"], ["y"])] if stride == 1 else [])]
    bounds = [onnx.numpy_helper.from_array(np.float32(v), k) for k, v in (("lo", 0.0), ("hi", 6.0))]
    x_info = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, channels, size, size])
    y_info = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    models = {}
    for name, nodes, extra in (("fused", [fused], []), ("plain", plain, bounds)):
        graph = onnx.helper.make_graph(nodes, name, [x_info], [y_info], inits + extra)
        opsets = [onnx.helper.make_opsetid("", 17)] + ([onnx.helper.make_opsetid("carrack", 1)] if name == "fused"
                                                        else [])
        models[name] = onnx.helper.make_model(graph, opset_imports=opsets).SerializeToString()
    x = rng.standard_normal((1, channels, size, size)).astype(np.float32)
    expected = ort.InferenceSession(models["plain"], providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    sessions = [session_at(models["fused"], threads) for threads in (1, 2, 4)]
    assert all(kernel.block is not None for s in sessions for kernel in _kernels(s))
    results = [s.run(None, {"x": x})[0] for s in sessions]
    np.testing.assert_allclose(results[0], expected, rtol=1e-4, atol=1e-4)
    assert all(np.array_equal(y, results[0]) for y in results)


@pytest.mark.parametrize("geometry, threads", [
    (invres.Geometry(1, 32, 32, 16, 112, 112, 1), 2),  # MobileNetV2's first block
    (invres.Geometry(1, 24, 144, 24, 56, 56, 1), 2),
    (invres.Geometry(1, 32, 192, 32, 28, 28, 1), 2),
    (invres.Geometry(1, 24, 144, 24, 56, 56, 1), 4),
])
def test_band_heights_give_the_threads_even_shares_of_rows(geometry, threads):
    """Each thread takes a contiguous run of bands (threadpool.c's pieces): a band height that does not divide the
    map evenly leaves one thread waiting for the other (7 bands of 16 rows on 112: 64 rows against 48)."""
    band, used = invres.plan_bands(geometry, threads)
    bands = -(-geometry.out_height // band)
    shares = [min(geometry.out_height, band * (bands * (i + 1) // used)) - min(geometry.out_height,
                                                                              band * (bands * i // used))
              for i in range(used)]
    assert used == threads and sum(shares) == geometry.out_height
    assert max(shares) == -(-geometry.out_height // threads)
    row_bytes = 4 * geometry.expanded * (geometry.stride * geometry.width + geometry.out_width)
    assert band * row_bytes <= invres.BAND_BYTES
