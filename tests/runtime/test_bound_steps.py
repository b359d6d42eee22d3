"""Steps bound to a reused arena (Kernel.bind_into): the first run that reuses an arena records, for each placed
step whose inputs are views of that arena or constants, a call without arguments; later runs with that arena call
it. Each bound run must give exactly what the same run gives through `run_into`, read the run's new contents, and
fall back when an earlier step stops writing into its view."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.native import packed, rowops
from carrack.runtime import program as program_module
from tests.helpers import first_output_module, one_thread_session, run_in_threads

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> bytes:
    """BertModel, 2 layers, hidden 64, 4 heads (random weights), exported by torch.onnx's TorchScript exporter
    with dynamic batch and sequence."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64)
    model = first_output_module(transformers.BertModel(config, add_pooling_layer=False).eval())
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    path = tmp_path_factory.mktemp("bert") / "bert.onnx"
    with torch.no_grad():
        torch.onnx.export(model, (ids, mask), str(path), dynamo=False, opset_version=17,
                          input_names=["ids", "mask"], output_names=["hidden"],
                          dynamic_axes={"ids": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}})
    return path.read_bytes()


def _feed(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[:, seq - 1 - seed % 3:] = 0
    return {"ids": rng.integers(0, 100, (batch, seq)).astype(np.int64), "mask": mask}


def _bound_ops(session: carrack.InferenceSession, kind: int = program_module._BOUND) -> list[str]:
    """The op types of the steps bound in the session's spare arena (kind _FIXED: view steps kept as results)."""
    spare = session._program._spare_arenas
    steps_bound = spare[0][3] if spare else None
    if not isinstance(steps_bound, tuple) or len(steps_bound) != 2 or steps_bound[1] is None:
        return []
    return [entry[0].node.op_type for entry in steps_bound[1] if entry[3] == kind]


def test_bound_runs_give_the_bits_of_unbound_runs_with_new_contents_each_run(tiny_bert):
    bound, unbound = one_thread_session(tiny_bert), one_thread_session(tiny_bert, bind=False)
    reference = ort.InferenceSession(tiny_bert, providers=["CPUExecutionProvider"])
    for seed in range(6):  # the same sizes every run, other ids and masks: bound calls must read the new values
        feed = _feed(2, 16, seed)
        got = bound.run(None, feed)[0]
        np.testing.assert_array_equal(got, unbound.run(None, feed)[0])
        np.testing.assert_allclose(got, reference.run(None, feed)[0], rtol=1e-4, atol=1e-5)
    ops = _bound_ops(bound)
    assert {"MatMul", "Add", "SkipLayerNormalization", "BiasGelu", "MultiHeadAttention"} <= set(ops), ops
    assert "Reshape" in _bound_ops(bound, program_module._FIXED)  # the exporter's reshapes around attention
    assert _bound_ops(unbound) == []


def test_other_sizes_take_their_own_arena_and_come_back_bound(tiny_bert):
    bound, unbound = one_thread_session(tiny_bert), one_thread_session(tiny_bert, bind=False)
    for seed, (batch, seq) in enumerate([(2, 16), (2, 16), (2, 16), (1, 7), (1, 7), (2, 16), (1, 7), (2, 16)]):
        feed = _feed(batch, seq, seed)
        np.testing.assert_array_equal(bound.run(None, feed)[0], unbound.run(None, feed)[0])


def test_threads_sharing_a_session_with_bound_steps_get_their_own_results(tiny_bert):
    session = one_thread_session(tiny_bert)
    feeds = [_feed(1 + i % 2, 16 if i % 3 else 9, seed=i) for i in range(6)]
    expected = [one_thread_session(tiny_bert, bind=False).run(None, f)[0] for f in feeds]
    failures: list[str] = []

    def worker(k: int) -> None:
        for _ in range(15):
            for i in range(len(feeds)):
                j = (i + k) % len(feeds)
                if not np.array_equal(session.run(None, feeds[j])[0], expected[j]):
                    failures.append(f"thread {k} feed {j}")

    run_in_threads(worker)
    assert not failures


def _relu_matmul_model() -> bytes:
    """Relu (placed, not bound: its input is the feed) -> Reshape (a view of Relu's view: kept as its result)
    -> MatMul by a constant (bound: its input is that view) -> Neg (the graph output)."""
    w = np.random.default_rng(3).standard_normal((32, 24)).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", "shape"], ["v"]),
             helper.make_node("MatMul", ["v", "w"], ["m"]), helper.make_node("Neg", ["m"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[onnx.numpy_helper.from_array(w, "w"),
                                           onnx.numpy_helper.from_array(np.array([-1, 32], np.int64), "shape")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _relu_writes_elsewhere(session: carrack.InferenceSession) -> None:
    """Make the Relu step return a result of its own instead of writing into its view (the view then keeps an
    earlier run's values), in the program's plans and in the spare arena's bound plan."""
    program = session._program
    plans = [program._plan, program._plan_after_memo]
    plans += [spare[3][1] for spare in program._spare_arenas if len(spare[3]) == 2 and spare[3][1] is not None]
    for plan in plans:
        for k, entry in enumerate(plan):
            if entry[0].node.op_type == "Relu":
                plan[k] = entry[:8] + ((lambda out, x: np.maximum(x, 0)),)


def test_a_step_that_stops_writing_into_its_view_turns_the_bound_steps_off_for_that_run():
    model = _relu_matmul_model()
    session = one_thread_session(model)
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal((5, 32)).astype(np.float32) for _ in range(5)]
    for x in feeds[:3]:
        session.run(None, {"x": x})
    assert _bound_ops(session) == ["MatMul"]
    assert _bound_ops(session, program_module._FIXED) == ["Reshape"]
    _relu_writes_elsewhere(session)
    for x in feeds[3:]:
        np.testing.assert_allclose(session.run(None, {"x": x})[0], reference.run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-5)


def test_a_binding_run_whose_step_writes_elsewhere_binds_nothing():
    model = _relu_matmul_model()
    session = one_thread_session(model)
    _relu_writes_elsewhere(session)
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for seed in range(4):
        x = np.random.default_rng(seed).standard_normal((3, 32)).astype(np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], reference.run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-5)
    assert _bound_ops(session) == []


@pytest.mark.skipif(rowops.library() is None, reason="native row kernels unavailable")
def test_a_bound_row_kernel_call_equals_the_checked_call_and_reads_new_contents():
    rng = np.random.default_rng(1)
    x, skip = rng.standard_normal((2, 7, 64), dtype=np.float32), rng.standard_normal((2, 7, 64), dtype=np.float32)
    gamma, beta, bias = (rng.standard_normal(64, dtype=np.float32) for _ in range(3))
    out, expected = np.empty_like(x), np.empty_like(x)
    call = rowops.layer_norm_bound(x, skip, bias, gamma, beta, out, 1e-5)
    for _ in range(2):
        x[...] = rng.standard_normal(x.shape, dtype=np.float32)
        call()
        assert rowops.layer_norm_checked(x, skip, bias, gamma, beta, expected, 1e-5)
        np.testing.assert_array_equal(out, expected)
    gelu = rowops.gelu_bound(x, gamma, out, True)
    gelu()
    np.testing.assert_array_equal(out, rowops.gelu(x, gamma, True))


def test_binding_a_packed_kernel_with_a_wrong_argument_count_raises():
    lib = rowops.library()
    if lib is None or not isinstance(lib.carrack_packed_gelu, packed.PackedKernel):
        pytest.skip("no packed row kernels here")
    with pytest.raises(ValueError):
        lib.carrack_packed_gelu.bind(1, 2, 3)


def test_where_written_into_its_planned_buffer_selects_what_numpy_selects():
    """Where's output placed in the arena (run_into: y, then x where the condition holds), with broadcast
    operands, -0.0 and NaN; bound in the later runs where its inputs are the arena's views."""
    row_mask = np.array([[True, False, True, False, False, True, True, False]])
    nodes = [helper.make_node("Less", ["x", "half"], ["c"]),
             helper.make_node("Where", ["c", "x", "negzero"], ["w"]),
             helper.make_node("Abs", ["w"], ["a"]),
             helper.make_node("Where", ["mask", "a", "w"], ["w2"]),
             helper.make_node("Mul", ["w2", "two"], ["y"])]
    inits = [onnx.numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             onnx.numpy_helper.from_array(np.array(-0.0, np.float32), "negzero"),
             onnx.numpy_helper.from_array(row_mask, "mask"),
             onnx.numpy_helper.from_array(np.array([2.0], np.float32), "two")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    session = one_thread_session(model)
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(4)
    for _ in range(4):
        x = rng.standard_normal((3, 8)).astype(np.float32)
        x[0, :3] = [np.nan, -0.0, 0.5]
        got = session.run(None, {"x": x})[0]
        w = np.where(x < np.float32(0.5), x, np.float32(-0.0))
        expected = np.where(row_mask, np.abs(w), w) * np.float32(2.0)
        np.testing.assert_array_equal(got.view(np.int32), expected.view(np.int32))  # -0.0 and NaN kept as numpy
        np.testing.assert_allclose(got, reference.run(None, {"x": x})[0])
    assert "Where" in _bound_ops(session)
