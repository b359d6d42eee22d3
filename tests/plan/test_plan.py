"""One plan for every input shape: decoders with past at every level, no optimizer run on a new shape, pickled
sessions in another process, arena layouts that hold for any sizes, node order."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.errors import InvalidModel
from carrack.ir.dims import Sym
from carrack.ir.symbolic import evaluate, mul
from carrack.passes import optimizer
from carrack.plan.arena import Block, align, order_blocks
from tests.plan.arena_offsets import compiled_offsets, reference_offsets
from tests.plan.cnn import export_small_cnn
from tests.plan.decoder import export_gpt2_with_past, greedy_decode

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

LEVELS = [carrack.GraphOptimizationLevel.ORT_DISABLE_ALL, carrack.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          carrack.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, carrack.GraphOptimizationLevel.ORT_ENABLE_ALL]


@pytest.fixture(scope="module", params=["torchscript", "dynamo"])
def decoder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("decoder") / f"gpt2_{request.param}.onnx"
    past = export_gpt2_with_past(path, dynamo=request.param == "dynamo")
    return path, past


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
def test_decoder_with_past_matches_onnxruntime_without_recompiling(decoder, level):
    """Prompt + greedy decoding with the KV cache: every step is a new past length; the tokens equal
    onnxruntime's, the logits agree, and no step runs the optimizer."""
    path, past = decoder
    options = carrack.SessionOptions()
    options.graph_optimization_level = level
    session = carrack.InferenceSession(str(path), options)
    reference = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    prompt = np.random.default_rng(1).integers(0, 97, (2, 5)).astype(np.int64)
    runs = optimizer.RUNS[0]
    tokens, logits = greedy_decode(lambda feed: session.run(None, feed), past, prompt, 12)
    assert optimizer.RUNS[0] == runs
    want_tokens, want_logits = greedy_decode(lambda feed: reference.run(None, feed), past, prompt, 12)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_shapes_in_one_session_equal_fresh_sessions(decoder):
    path, past = decoder
    session = carrack.InferenceSession(str(path))
    rng = np.random.default_rng(2)
    for batch, seq, past_len in [(1, 1, 0), (2, 6, 3), (1, 1, 40), (3, 2, 1), (2, 6, 3)]:
        feed = {"input_ids": rng.integers(0, 97, (batch, seq)).astype(np.int64),
                "attention_mask": np.ones((batch, seq + past_len), np.int64),
                **{p: rng.standard_normal((batch, 4, past_len, 8)).astype(np.float32) for p in past}}
        shared = session.run(None, feed)
        fresh = carrack.InferenceSession(str(path)).run(None, feed)
        for a, b in zip(shared, fresh):
            np.testing.assert_array_equal(a, b)


_PICKLE_CHILD = textwrap.dedent("""
    import pickle, sys
    import numpy as np
    from carrack.passes import optimizer
    session, feeds = pickle.load(sys.stdin.buffer)
    outs = [session.run(None, f) for f in feeds]
    pickle.dump((outs, optimizer.RUNS[0]), sys.stdout.buffer)
""")


def test_pickled_session_runs_in_another_process_without_optimizing(decoder):
    path, past = decoder
    session = carrack.InferenceSession(str(path))
    rng = np.random.default_rng(3)
    feeds = [{"input_ids": rng.integers(0, 97, (1, n)).astype(np.int64),
              "attention_mask": np.ones((1, n + m), np.int64),
              **{p: rng.standard_normal((1, 4, m, 8)).astype(np.float32) for p in past}} for n, m in [(4, 0), (1, 9)]]
    payload = pickle.dumps((session, feeds))
    child = subprocess.run([sys.executable, "-c", _PICKLE_CHILD], input=payload, capture_output=True, check=False)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    outs, runs = pickle.loads(child.stdout)
    assert runs == 0  # the child never optimized: the plan came optimized
    for got, feed in zip(outs, feeds):
        for a, b in zip(got, session.run(None, feed)):
            np.testing.assert_array_equal(a, b)


def test_pickled_session_keeps_overridable_initializers():
    nodes = [helper.make_node("Add", ["x", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
                                           helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
                              initializer=[numpy_helper.from_array(np.array([2.0], np.float32), "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = pickle.loads(pickle.dumps(carrack.InferenceSession(model.SerializeToString())))
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x + 2)
    np.testing.assert_array_equal(session.run(None, {"x": x, "bias": np.array([5.0], np.float32)})[0], x + 5)
    assert [i.name for i in session.get_overridable_initializers()] == ["bias"]


@pytest.mark.parametrize("seed", range(20))
def test_arena_order_never_overlaps_live_blocks(seed):
    """Blocks placed once at reference sizes keep apart at any sizes of their symbols."""
    rng = np.random.default_rng(seed)
    a, b = Sym("a"), Sym("b")
    shapes = [(a,), (b,), (a, b), (a, a), ()]
    blocks = []
    for k in range(30):
        start = int(rng.integers(0, 40))
        size = int(rng.integers(1, 300))
        for d in shapes[int(rng.integers(0, len(shapes)))]:
            size = mul(size, d)
        blocks.append(Block(f"v{k}", size, start, start + int(rng.integers(0, 8))))
    order = order_blocks(blocks, [a, b])
    for sizes in [(1, 1), (3, 100), (100, 3), (0, 7), (64, 64)]:
        nbytes = [int(evaluate(blk.size, dict(zip([a, b], sizes)))) for blk in order.blocks]
        offsets, total = compiled_offsets(order, nbytes)
        assert (offsets, total) == reference_offsets(order, nbytes)
        for i, x in enumerate(order.blocks):
            assert offsets[i] % 64 == 0 and offsets[i] + align(nbytes[i]) <= total
            for j, y in enumerate(order.blocks[:i]):
                if x.start <= y.end and y.start <= x.end and nbytes[i] and nbytes[j]:
                    assert offsets[i] >= offsets[j] + nbytes[j] or offsets[j] >= offsets[i] + nbytes[i]


def _chain(order: list[int]) -> onnx.ModelProto:
    nodes = [helper.make_node("Neg" if k % 2 else "Abs", [f"t{k}"], [f"t{k + 1}"]) for k in range(6)]
    graph = helper.make_graph([nodes[k] for k in order], "g",
                              [helper.make_tensor_value_info("t0", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("t6", TensorProto.FLOAT, ["n"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
def test_nodes_out_of_order_run_at_every_level(level):
    options = carrack.SessionOptions()
    options.graph_optimization_level = level
    x = np.array([1.0, -2.0], np.float32)
    y = carrack.InferenceSession(_chain([5, 3, 1, 0, 2, 4]).SerializeToString(), options).run(None, {"t0": x})[0]
    np.testing.assert_array_equal(y, -np.abs(x))


def test_a_cycle_is_reported_with_its_nodes():
    nodes = [helper.make_node("Relu", ["x", ], ["a"], name="first"), helper.make_node("Add", ["a", "c"], ["b"],
                                                                                      name="second"),
             helper.make_node("Neg", ["b"], ["c"], name="third"), helper.make_node("Abs", ["b"], ["y"], name="out")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidModel, match=r"cycle: .*(second.*third|third.*second)"):
        carrack.InferenceSession(model.SerializeToString())


@pytest.fixture(scope="module")
def cnn(tmp_path_factory) -> str:
    """A small CNN (conv + BN + ReLU, depthwise, residual, pooling) with dynamic batch, height and width."""
    pytest.importorskip("torch")
    return export_small_cnn(tmp_path_factory.mktemp("cnn") / "cnn.onnx", pooled=False)


def test_cnn_at_many_sizes_in_one_session_equals_fresh_sessions(cnn):
    session = carrack.InferenceSession(cnn)
    reference = ort.InferenceSession(cnn, providers=["CPUExecutionProvider"])
    for batch, height, width in [(1, 16, 16), (2, 9, 31), (3, 32, 8), (1, 1, 1), (2, 9, 31), (4, 64, 48)]:
        x = np.random.default_rng(height).standard_normal((batch, 3, height, width)).astype(np.float32)
        runs = optimizer.RUNS[0]
        shared = session.run(None, {"x": x})[0]
        assert optimizer.RUNS[0] == runs
        np.testing.assert_array_equal(shared, carrack.InferenceSession(cnn).run(None, {"x": x})[0])
        np.testing.assert_allclose(shared, reference.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_memory_plan_for_new_sizes_substitutes_instead_of_inferring(cnn, monkeypatch):
    """The memory report for any sizes comes from the plan's symbolic facts (inferred once): a new set of sizes
    runs no shape inference, and the report equals one planned from facts inferred at those sizes."""
    from carrack.passes.memory_plan import plan_memory
    from carrack.passes.shape_inference import infer, input_facts
    from carrack.plan import plan as plan_module

    session = carrack.InferenceSession(cnn)
    session.memory_plan({"batch": 1, "height": 8, "width": 8})
    calls = []
    monkeypatch.setattr(plan_module, "infer", lambda *a, **k: calls.append(1) or infer(*a, **k))
    for dims in ({"batch": 2, "height": 32, "width": 16}, {"batch": 5, "height": 7, "width": 9}):
        report = session.memory_plan(dims)
        assert calls == []
        graph = session._plan.graph
        facts = input_facts(graph, dims, parse_names=False)
        for d, value in zip(session._plan.derived, session._plan.bind(session._plan.sizes_of(dims)).derived):
            facts[d.name] = plan_module.Fact(facts[d.name].type, value)
        direct = plan_memory(graph, session._model.opsets, dims, facts=infer(graph, session._model.opsets, facts))
        assert (report.arena_bytes, report.intermediate_bytes, report.unknown) == \
               (direct.arena_bytes, direct.intermediate_bytes, direct.unknown)
        assert report.arena_bytes > 0 and not report.unknown
