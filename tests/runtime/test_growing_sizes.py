"""Runs whose sizes change every time (greedy decoding with a growing KV cache): an arena laid out for a capacity
is reused by the next sizes that fit it, and the steps untouched by the changed sizes stay bound to it. Every such
run must give the bits of the unbound run, never hand the caller an array a later run overwrites, keep to the
memory limit, and give serial results from several threads."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import carrack
from carrack.runtime import program as program_module
from tests.helpers import one_thread_session, run_in_threads
from tests.plan.arena_offsets import compiled_offsets
from tests.plan.decoder import TINY_HEADS, TINY_HIDDEN, TINY_PAST_NAMES, TINY_VOCAB, greedy_decode, tiny_gpt2_with_past

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

HEADS, HIDDEN, VOCAB, PAST_NAMES = TINY_HEADS, TINY_HIDDEN, TINY_VOCAB, TINY_PAST_NAMES


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> bytes:
    return tiny_gpt2_with_past(tmp_path_factory.mktemp("gpt2"))


def _decode(session, prompt: np.ndarray, steps: int) -> tuple[list[int], list[np.ndarray]]:
    return greedy_decode(lambda feed: session.run(None, feed), PAST_NAMES, prompt, steps, HEADS, HIDDEN // HEADS)


def _prompt(length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (1, length), dtype=np.int64)


def _spare(session) -> tuple:
    (spare,) = session._program._spare_arenas
    return spare


def test_greedy_decoding_reuses_an_arena_per_capacity_with_the_unchanged_steps_bound(tiny_gpt2):
    session, unbound = one_thread_session(tiny_gpt2), one_thread_session(tiny_gpt2, bind=False)
    arenas = []

    def run(feed):
        outputs = session.run(None, feed)
        arenas.append(_spare(session)[1])
        return outputs

    tokens, logits = greedy_decode(run, PAST_NAMES, _prompt(6), 40, HEADS, HIDDEN // HEADS)
    expected_tokens, expected_logits = _decode(unbound, _prompt(6), 40)
    assert tokens == expected_tokens
    for got, want in zip(logits, expected_logits):
        np.testing.assert_array_equal(got, want)
    reference = ort.InferenceSession(tiny_gpt2, providers=["CPUExecutionProvider"])
    _, ort_logits = greedy_decode(lambda feed: reference.run(None, feed), PAST_NAMES, _prompt(6), 40, HEADS,
                                  HIDDEN // HEADS)
    for got, want in zip(logits, ort_logits):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # past length 0, 6, 7, ..., 45: capacities 8, 16, 32, 64 (one arena each, plus the prompt's)
    assert len({id(a) for a in arenas}) <= 6
    resizable = _spare(session)[5]
    assert resizable.binding_bound is not None and resizable.plans
    for plan, *_ in resizable.plans.values():
        kinds = [entry[3] for entry in plan]
        assert kinds.count(program_module._BOUND) >= 15  # the projections, MLPs and layer norms
        bound_ops = {entry[0].node.op_type for entry in plan if entry[3] == program_module._BOUND}
        assert {"MatMul", "FastGelu"} <= bound_ops
        # size-only steps of the unchanged sizes (the ranges over batch and the new tokens) keep their results
        assert "Range" in {entry[0].node.op_type for entry in plan if entry[3] == program_module._FIXED}
        # the cache (a new length every token) is read unbound
        unbound_ops = {entry[0].node.op_type for entry in plan if entry[3] > 0}
        assert {"Concat", "MultiHeadAttention"} <= unbound_ops


def test_outputs_of_earlier_tokens_are_never_rewritten_by_later_ones(tiny_gpt2):
    session = one_thread_session(tiny_gpt2)
    returned, copies = [], []

    def run(feed):
        outputs = session.run(None, feed)
        returned.append(outputs)
        copies.append([o.copy() for o in outputs])
        return outputs

    greedy_decode(run, PAST_NAMES, _prompt(5, seed=1), 24, HEADS, HIDDEN // HEADS)
    for outputs, saved in zip(returned, copies):
        for got, want in zip(outputs, saved):
            np.testing.assert_array_equal(got, want)


def _feed(length: int, past: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feed = {n: rng.standard_normal((1, HEADS, past, HIDDEN // HEADS), dtype=np.float32) for n in PAST_NAMES}
    mask = np.ones((1, past + length), np.int64)
    mask[0, : seed % 3] = 0
    return {"input_ids": rng.integers(0, VOCAB, (1, length), dtype=np.int64), "attention_mask": mask, **feed}


@pytest.mark.parametrize("order", ["grow", "shrink_and_grow"])
def test_sizes_that_change_in_any_direction_give_the_unbound_bits(tiny_gpt2, order):
    sizes = [(1, p) for p in range(3, 40, 3)] if order == "grow" else \
        [(1, 20), (1, 7), (1, 20), (4, 3), (1, 30), (1, 2), (4, 3), (1, 20), (1, 21), (2, 0), (1, 20)]
    session, unbound = one_thread_session(tiny_gpt2), one_thread_session(tiny_gpt2, bind=False)
    for seed, (length, past) in enumerate(sizes):  # new contents every run: bound calls must read them
        feed = _feed(length, past, seed)
        for got, want in zip(session.run(None, feed), unbound.run(None, feed)):
            np.testing.assert_array_equal(got, want)


def test_several_threads_decoding_on_one_session_give_the_serial_results(tiny_gpt2):
    session = one_thread_session(tiny_gpt2)
    expected = [_decode(one_thread_session(tiny_gpt2, bind=False), _prompt(3 + k, seed=k), 20) for k in range(4)]
    got: list = [None] * 4

    def worker(k: int) -> None:
        got[k] = _decode(session, _prompt(3 + k, seed=k), 20)

    run_in_threads(worker)
    for (tokens, logits), (want_tokens, want_logits) in zip(got, expected):
        assert tokens == want_tokens
        for a, b in zip(logits, want_logits):
            np.testing.assert_array_equal(a, b)


def test_under_a_memory_limit_every_arena_has_the_plans_bytes_for_its_sizes(tiny_gpt2):
    options = carrack.SessionOptions()
    options.intra_op_num_threads = 1
    options.memory_limit_bytes = 1 << 30
    session = carrack.InferenceSession(tiny_gpt2, options)
    plan = session._plan

    def run(feed):
        outputs = session.run(None, feed)
        bound = plan.bind(session._sizes(feed))
        assert _spare(session)[1].nbytes == max(bound.arena_bytes, 64)
        return outputs

    tokens, _ = greedy_decode(run, PAST_NAMES, _prompt(4), 12, HEADS, HIDDEN // HEADS)
    assert tokens == _decode(one_thread_session(tiny_gpt2, bind=False), _prompt(4), 12)[0]


def test_without_a_memory_limit_a_growing_size_gets_a_power_of_two_capacity(tiny_gpt2):
    session = one_thread_session(tiny_gpt2)
    session.run(None, _feed(1, 8, 0))
    session.run(None, _feed(1, 9, 1))  # the sizes changed: laid out for past 16 and total 16
    spare_bound, arena, _, _, _, resizable = _spare(session)
    assert resizable.layout.sizes == tuple(16 if s == "past_seq" or s == "total_seq" else 1
                                           for s in session._plan.symbols)
    assert arena.nbytes == resizable.layout.arena_bytes >= spare_bound.arena_bytes
    for past in range(10, 17):  # fits: the same arena
        session.run(None, _feed(1, past, past))
        assert _spare(session)[1] is arena
    session.run(None, _feed(1, 17, 0))  # past 17: a new one, for 32
    assert _spare(session)[1] is not arena


def test_a_capacity_layout_keeps_blocks_alive_together_apart_at_every_smaller_size(tiny_gpt2):
    plan = one_thread_session(tiny_gpt2)._plan
    order = plan.arena
    capacity = plan.layout(tuple(32 if s in ("past_seq", "total_seq") else 1 for s in plan.symbols))
    offsets, _ = compiled_offsets(order, capacity.block_sizes)
    assert capacity is not plan.bind(capacity.sizes)  # a layout is not one of the plan's cached evaluations
    for past in range(0, 32):
        sizes = tuple({"past_seq": past, "total_seq": past + 1}.get(s, 1) for s in plan.symbols)
        bound = plan.bind(sizes)
        assert bound.sizes == sizes
        assert all(a <= b for a, b in zip(bound.block_sizes, capacity.block_sizes))
        for k, under in enumerate(order.below):
            for j in under:  # alive together: their bytes at these sizes must not overlap
                ends = offsets[j] + bound.block_sizes[j], offsets[k] + bound.block_sizes[k]
                assert ends[0] <= offsets[k] or ends[1] <= offsets[j]


@pytest.mark.parametrize(("op", "dtype"), itertools.product(["Add", "Sub", "Mul"], [np.int64, np.int32, np.uint8]))
def test_integer_arithmetic_writes_into_its_planned_buffer_with_numpys_wrapping(op, dtype):
    from onnx import helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node(op, ["a", "b"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", elem, [2, 3]),
                                            helper.make_tensor_value_info("b", elem, [3])],
                              [helper.make_tensor_value_info("y", elem, [2, 3])])
    session = carrack.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    kernel = session._program.steps[0].kernel
    info = np.iinfo(dtype)
    a = np.array([[info.max, info.min, 7], [1, 2, 3]], dtype)
    b = np.array([1, info.max, 5], dtype)
    out = np.empty((2, 3), dtype)
    assert kernel.run_into(out, a, b) is out
    np.testing.assert_array_equal(out, getattr(np, {"Add": "add", "Sub": "subtract", "Mul": "multiply"}[op])(a, b))



def test_sizes_that_settle_after_a_change_run_bound(tiny_gpt2):
    """A capacity arena is bound by its first run, before the settled sizes have size-only values kept: later runs
    of those sizes still take its bound plan (every placed MatMul bound: no run_into call)."""
    session = one_thread_session(tiny_gpt2)
    calls = []
    for step in session._program.steps:
        if step.node.op_type == "MatMul":
            run_into = step.kernel.run_into
            step.kernel.run_into = lambda out, *inputs, run_into=run_into: calls.append(1) or run_into(out, *inputs)
    session._program.attach(session._plan)  # the run loop's plan takes the counting run_into
    unbound = one_thread_session(tiny_gpt2, bind=False)
    session.run(None, _feed(1, 16, 0))
    for seed in range(4):
        session.run(None, _feed(1, 20, seed))
    calls.clear()
    for seed in range(4, 7):
        feed = _feed(1, 20, seed)
        for got, want in zip(session.run(None, feed), unbound.run(None, feed)):
            np.testing.assert_array_equal(got, want)
    assert not calls


@pytest.mark.parametrize("op", ["Reshape", "Expand"])
def test_a_shape_read_from_a_feed_is_read_every_run(op):
    """A staged feed's contents change every run: a view step or bound call must not keep the shape it first read
    (the same input sizes, so the same arena and bound plan, with a new target shape)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Add", ["x", "x"], ["h"]), helper.make_node(op, ["h", "shape"], ["r"]),
             helper.make_node("Relu", ["r"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6]),
                                           helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    session = one_thread_session(model)
    reference = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    x = np.linspace(-3, 3, 6, dtype=np.float32)[None]
    shapes = [[2, 3], [2, 3], [2, 3], [3, 2], [6, 1]] if op == "Reshape" else [[2, 6], [2, 6], [2, 6], [3, 6], [1, 6]]
    for shape in shapes:
        feed = {"x": x, "shape": np.array(shape, np.int64)}
        got, want = session.run(None, feed)[0], reference.run(None, feed)[0]
        assert got.shape == want.shape == tuple(shape)
        np.testing.assert_array_equal(got, want)
