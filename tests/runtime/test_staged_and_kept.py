"""Bound runs beyond the arena: a reused arena's runs copy their small inputs into staged buffers (so the steps
reading a feed bind too) and keep the fresh result of a step outside the arena (a decoder's present keys/values,
a model's last layer) to rewrite it in place. Every such run must give the bits of the unbound run, read the new
feeds, and never hand the caller an array a later run overwrites."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.runtime import program as program_module
from tests.helpers import one_thread_session, run_in_threads

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

HEADS, HIDDEN, PAST = 4, 64, 16


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> bytes:
    """GPT2LMHeadModel, 2 layers, hidden 64, with past key values (torch.onnx's TorchScript exporter)."""
    from tests.plan.decoder import export_gpt2_with_past

    path = Path(tmp_path_factory.mktemp("gpt2")) / "gpt2.onnx"
    export_gpt2_with_past(path, False, 2, HEADS, HIDDEN, 100)
    return path.read_bytes()


@pytest.fixture(scope="module")
def tiny_mlp(tmp_path_factory) -> bytes:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 10)).eval()
    path = Path(tmp_path_factory.mktemp("mlp")) / "mlp.onnx"
    with torch.no_grad():
        torch.onnx.export(net, (torch.randn(1, 32),), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=False, opset_version=17)
    return path.read_bytes()


def _decode_feed(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    past = {f"past_key_values.{i}.{k}": rng.standard_normal((1, HEADS, PAST, HIDDEN // HEADS), dtype=np.float32)
            for i in range(2) for k in ("key", "value")}
    mask = np.ones((1, PAST + 1), np.int64)
    mask[0, : seed % 3] = 0
    return {"input_ids": np.array([[seed % 100]], np.int64), "attention_mask": mask, **past}


def _ops(session: carrack.InferenceSession, kind: int) -> list[str]:
    steps_bound = session._program._spare_arenas[0][3]
    return [entry[0].node.op_type for entry in steps_bound[1] if entry[3] == kind]


def test_a_decode_step_binds_its_cache_concat_and_attention_and_gives_the_unbound_bits(tiny_gpt2):
    bound, unbound = one_thread_session(tiny_gpt2), one_thread_session(tiny_gpt2, bind=False)
    reference = ort.InferenceSession(tiny_gpt2, providers=["CPUExecutionProvider"])
    for seed in range(6):  # the same sizes every run, new ids, masks and caches: bound calls must read them
        feed = _decode_feed(seed)
        got = bound.run(None, feed)
        for g, u in zip(got, unbound.run(None, feed)):
            np.testing.assert_array_equal(g, u)
        for g, r in zip(got, reference.run(None, feed)):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
    assert _ops(bound, program_module._KEPT).count("Concat") == 4  # present.* (graph outputs, outside the arena)
    assert "MultiHeadAttention" in _ops(bound, program_module._BOUND)  # reads the kept present.*
    # with its sum output read (two outputs: not placed): both kept
    assert _ops(bound, program_module._KEPT).count("SkipLayerNormalization") == 3


def test_outputs_kept_with_the_arena_are_the_callers_own(tiny_gpt2):
    session = one_thread_session(tiny_gpt2)
    runs = [session.run(None, _decode_feed(seed)) for seed in range(4)]
    expected = [one_thread_session(tiny_gpt2, bind=False).run(None, _decode_feed(seed)) for seed in range(4)]
    for got, want in zip(runs, expected):  # later runs rewrote the kept results: not the arrays handed out
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
            assert g.flags.writeable


def test_every_layer_of_a_one_row_mlp_binds_and_reads_each_new_input(tiny_mlp):
    bound, unbound = one_thread_session(tiny_mlp), one_thread_session(tiny_mlp, bind=False)
    reference = ort.InferenceSession(tiny_mlp, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    outputs = []
    for _ in range(5):
        x = rng.standard_normal((1, 32), dtype=np.float32)
        got = bound.run(None, {"x": x})[0]
        np.testing.assert_array_equal(got, unbound.run(None, {"x": x})[0])
        np.testing.assert_allclose(got, reference.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
        outputs.append((got, got.copy()))
    assert len(_ops(bound, program_module._BOUND)) == 2  # the first layer reads the staged input
    assert len(_ops(bound, program_module._KEPT)) == 1  # the last one writes the graph output
    for got, copy in outputs:
        np.testing.assert_array_equal(got, copy)


def test_an_input_passed_through_to_an_output_is_not_the_staged_buffer():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel().tolist())
    nodes = [helper.make_node("Identity", ["x"], ["same"]), helper.make_node("Reshape", ["x", "shape"], ["flat"]),
             helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [-1])
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("same", "flat", "y")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], outputs, [w, shape]),
                              opset_imports=[helper.make_opsetid("", 17)])
    session = one_thread_session(model.SerializeToString())
    feeds = [np.full((2, 4), k, np.float32) for k in range(5)]
    results = [session.run(None, {"x": f}) for f in feeds]
    for feed, (same, flat, y) in zip(feeds, results):
        np.testing.assert_array_equal(same, feed)
        np.testing.assert_array_equal(flat, feed.ravel())
        np.testing.assert_array_equal(y, np.maximum(feed, 0))
        assert not np.may_share_memory(same, feed) or same is feed


def test_threads_sharing_a_decode_session_get_serial_results(tiny_gpt2):
    session = one_thread_session(tiny_gpt2)
    feeds = [_decode_feed(seed) for seed in range(8)]
    expected = [one_thread_session(tiny_gpt2, bind=False).run(None, f) for f in feeds]
    errors: list[str] = []

    def worker(k: int) -> None:
        for rep in range(25):
            index = (k + rep) % len(feeds)
            got = session.run(None, feeds[index])
            if not all(np.array_equal(g, e) for g, e in zip(got, expected[index])):
                errors.append(f"thread {k} run {rep}")

    run_in_threads(worker)
    assert not errors


def test_a_feed_that_does_not_fit_its_staged_buffer_runs_the_steps_unbound(tiny_mlp):
    session = one_thread_session(tiny_mlp)
    program = session._program
    x = np.ones((1, 32), np.float32)
    for _ in range(3):
        session.run(None, {"x": x})
    bound = session._plan.bind(session._sizes({"x": x}))
    assert len(_ops(session, program_module._BOUND)) == 2
    odd = np.arange(32, dtype=np.float64).reshape(1, 32)  # not the staged dtype: its bound steps must not run
    got = program.run([odd], bound=bound)[0]
    np.testing.assert_array_equal(got, program.run([odd], bound=None)[0])


def test_the_bound_input_path_reads_each_new_id_and_names_an_id_outside_the_vocabulary(tiny_gpt2):
    session, unbound = one_thread_session(tiny_gpt2), one_thread_session(tiny_gpt2, bind=False)
    for seed in range(3):
        session.run(None, _decode_feed(seed))
    kept = _ops(session, program_module._KEPT)
    assert {"Gather", "Cast", "And", "Expand"} <= set(kept), kept  # the ids' and the mask's steps
    bad = _decode_feed(5)
    bad["input_ids"] = np.array([[100]], np.int64)  # vocabulary of 100
    with pytest.raises(carrack.CarrackError, match="Gather"):
        session.run(None, bad)
    with pytest.raises(carrack.CarrackError, match="Gather"):
        unbound.run(None, bad)
    for seed in (7, 8):
        for g, u in zip(session.run(None, _decode_feed(seed)), unbound.run(None, _decode_feed(seed))):
            np.testing.assert_array_equal(g, u)
