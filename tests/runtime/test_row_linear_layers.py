"""Linear layers of a few rows (batch 1..4) run as one native call each (carrack/native/rowlinear.c): Gemm,
FusedGemm with its activation, MatMul and MatMul + Add by a constant weight, from torch.onnx exports. Against
onnxruntime; the bound run gives the unbound run's bits; the same bits at 1, 2 and 4 threads, from several Python
threads at once, and whatever the feed's alignment, strides or byte order; the packed copies are in the memory
plan."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.native import convolution as native_conv
from carrack.native import rowlinear
from carrack.runtime import program as program_module
from tests.helpers import one_thread_session, run_in_threads

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(rowlinear.library() is None, reason="native kernels unavailable here")

WIDTH = 48


def _export(net: torch.nn.Module, path: Path, example: torch.Tensor) -> bytes:
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net.eval(), (example,), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False, opset_version=17)
    return path.read_bytes()


@pytest.fixture(scope="module")
def activations_mlp(tmp_path_factory) -> bytes:
    """Linear layers followed by each activation the optimizer fuses into FusedGemm, then a plain Linear."""
    torch.manual_seed(0)
    nn = torch.nn
    layers = [nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
              nn.Sigmoid(), nn.Linear(WIDTH, WIDTH), nn.LeakyReLU(0.2), nn.Linear(WIDTH, WIDTH), nn.Hardtanh(-0.5, 0.5),
              nn.Linear(WIDTH, 7)]
    return _export(nn.Sequential(*layers), tmp_path_factory.mktemp("rows") / "mlp.onnx", torch.randn(1, WIDTH))


@pytest.fixture(scope="module")
def gelu_mlp() -> bytes:
    """carrack's FusedGemm with Gelu, an activation the few-row kernel does not apply (it runs after the layer),
    then a Gemm."""
    rng = np.random.default_rng(3)
    weights = [numpy_helper.from_array(rng.standard_normal(shape, dtype=np.float32) * 0.2, name)
               for name, shape in (("w1", (WIDTH, WIDTH)), ("b1", (WIDTH,)), ("w2", (5, WIDTH)), ("b2", (5,)))]
    nodes = [helper.make_node("FusedGemm", ["x", "w1", "b1"], ["h"], domain="carrack", transB=1, activation="Gelu"),
             helper.make_node("Gemm", ["h", "w2", "b2"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("carrack", 1)]
                             ).SerializeToString()


def _gelu_reference(x: np.ndarray, data: bytes) -> np.ndarray:
    import math

    import onnx

    graph = onnx.load_from_string(data).graph
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in graph.initializer}
    h = x.astype(np.float64) @ weights["w1"].T + weights["b1"]
    h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    return h @ weights["w2"].T + weights["b2"]


class _MatMulLayers(torch.nn.Module):
    """x @ W1 + b1 (MatMul, then Add), relu, @ W2 (a plain MatMul)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(WIDTH, 40) * 0.2)
        self.b1 = torch.nn.Parameter(torch.randn(40))
        self.w2 = torch.nn.Parameter(torch.randn(40, 24) * 0.2)

    def forward(self, x):
        return torch.relu(torch.matmul(x, self.w1) + self.b1) @ self.w2


@pytest.fixture(scope="module")
def matmul_layers(tmp_path_factory) -> bytes:
    torch.manual_seed(1)
    return _export(_MatMulLayers(), tmp_path_factory.mktemp("rows") / "matmul.onnx", torch.randn(1, WIDTH))


@pytest.fixture(scope="module")
def gemm_layers() -> bytes:
    """Gemm without transB (B is [K, N]) with a bias of shape (1, N), relu, then Gemm without a bias."""
    rng = np.random.default_rng(2)
    weights = [numpy_helper.from_array(rng.standard_normal(shape, dtype=np.float32) * 0.2, name)
               for name, shape in (("w1", (WIDTH, 33)), ("b1", (1, 33)), ("w2", (33, 20)))]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 20])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _feed(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, WIDTH), dtype=np.float32)


def _packed_layers(session: carrack.InferenceSession) -> list[str]:
    """The steps whose kernel (or fused kernel's layer) holds a packed few-row weight."""
    return [st.node.op_type for st in session._program.steps
            if getattr(getattr(st.kernel, "inner", st.kernel), "rows", None) is not None]


@pytest.mark.parametrize("model", ["activations_mlp", "matmul_layers", "gemm_layers", "gelu_mlp"])
def test_few_row_layers_match_onnxruntime_and_bind_to_the_unbound_bits(model, request):
    data = request.getfixturevalue(model)
    bound, unbound = one_thread_session(data), one_thread_session(data, bind=False)
    reference = ort.InferenceSession(data, providers=["CPUExecutionProvider"]) if model != "gelu_mlp" else None
    for rows in (1, 2, 3, 4, 6):  # 6: more rows than the kernel takes, the general path
        for seed in range(3):  # the same sizes again: the later runs are bound
            x = _feed(rows, seed)
            got = bound.run(None, {"x": x})[0]
            np.testing.assert_array_equal(got, unbound.run(None, {"x": x})[0])
            want = _gelu_reference(x, data) if reference is None else reference.run(None, {"x": x})[0]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    expected = {"activations_mlp": ["FusedGemm"] * 5 + ["Gemm"], "matmul_layers": ["MatMul", "MatMul"],
                "gemm_layers": ["FusedGemm", "Gemm"], "gelu_mlp": ["FusedGemm", "Gemm"]}[model]
    assert _packed_layers(bound) == expected


def test_the_packed_weights_are_in_the_memory_plan(activations_mlp, matmul_layers, gemm_layers):
    for data, shapes in ((activations_mlp, [(WIDTH, WIDTH)] * 5 + [(WIDTH, 7)]),
                         (matmul_layers, [(WIDTH, 40), (40, 24)]), (gemm_layers, [(WIDTH, 33), (33, 20)])):
        session = carrack.InferenceSession(data)
        packed = sum(rowlinear.packed_bytes(depth, columns) for depth, columns in shapes)
        assert session.memory_plan({"batch": 1}).prepared_bytes == packed


def test_the_same_bits_at_one_two_and_four_threads(activations_mlp, monkeypatch):
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)  # split even these small layers over the threads
    x = _feed(3, 5)
    results = []
    for threads in (1, 2, 4):
        options = carrack.SessionOptions()
        options.intra_op_num_threads = threads
        session = carrack.InferenceSession(activations_mlp, options)
        results += [session.run(None, {"x": x})[0] for _ in range(3)]  # unbound, binding, bound
    for y in results[1:]:
        np.testing.assert_array_equal(y, results[0])


def test_any_feed_layout_gives_the_same_bits(activations_mlp):
    session = one_thread_session(activations_mlp)
    x = _feed(2, 9)
    expected = session.run(None, {"x": x})[0]
    raw = np.zeros(x.nbytes + 1, np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(x.shape)
    unaligned[...] = x
    wide = np.zeros((2, 2 * WIDTH), np.float32)
    wide[:, ::2] = x
    for feed in (unaligned, wide[:, ::2], x.astype(">f4"), np.asfortranarray(x), x):
        for _ in range(2):
            np.testing.assert_array_equal(session.run(None, {"x": feed})[0], expected)


def test_threads_sharing_a_session_get_serial_results(activations_mlp):
    session = one_thread_session(activations_mlp)
    feeds = [_feed(1 + k % 4, k) for k in range(8)]
    expected = [one_thread_session(activations_mlp, bind=False).run(None, {"x": f})[0] for f in feeds]
    failures = []

    def worker(k: int) -> None:
        for _ in range(20):
            for j in (k, k + 4):
                got = session.run(None, {"x": feeds[j]})[0]
                if not np.array_equal(got, expected[j]):
                    failures.append(j)

    run_in_threads(worker, 4)
    assert not failures


def test_outputs_of_earlier_runs_are_not_rewritten(activations_mlp):
    session = one_thread_session(activations_mlp)
    runs = [(session.run(None, {"x": _feed(1, seed)})[0]) for seed in range(4)]
    copies = [one_thread_session(activations_mlp, bind=False).run(None, {"x": _feed(1, seed)})[0]
              for seed in range(4)]
    for got, want in zip(runs, copies):
        np.testing.assert_array_equal(got, want)
    steps_bound = session._program._spare_arenas[0][3][1]
    assert sum(entry[3] in (program_module._BOUND, program_module._KEPT) for entry in steps_bound) == 6


def test_a_weight_is_packed_by_the_first_run_of_few_rows_only(activations_mlp):
    session = one_thread_session(activations_mlp)
    for _ in range(2):
        session.run(None, {"x": _feed(8, 0)})
    assert _packed_layers(session) == []  # never run at 1..4 rows: no copy made
    session.run(None, {"x": _feed(2, 0)})
    assert len(_packed_layers(session)) == 6


def test_without_the_library_the_layers_run_their_numpy_paths(activations_mlp, monkeypatch):
    expected = one_thread_session(activations_mlp, bind=False).run(None, {"x": _feed(2, 4)})[0]
    monkeypatch.setattr(rowlinear, "library", lambda: None)
    session = one_thread_session(activations_mlp)
    for _ in range(3):
        got = session.run(None, {"x": _feed(2, 4)})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert _packed_layers(session) == []
    assert all(getattr(getattr(st.kernel, "inner", st.kernel), "row_pack", None) is None
               for st in session._program.steps)
