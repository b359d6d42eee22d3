"""A run on an arena bound at other sizes (a decoder's every token) makes each run of consecutive bound, fixed and
kept steps one segment: their calls, then the slot values they leave. Segments give the unbound bits, and when a
run cannot trust its bound steps (a placed step wrote elsewhere) they compute their steps from the inputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.ops import contrib
from carrack.runtime import program as program_module
from tests.helpers import one_thread_session
from tests.plan.decoder import TINY_HEADS, TINY_HIDDEN, TINY_PAST_NAMES, TINY_VOCAB, greedy_decode, tiny_gpt2_with_past

pytest.importorskip("torch")
pytest.importorskip("transformers")

HEADS, HIDDEN, VOCAB, PAST_NAMES = TINY_HEADS, TINY_HIDDEN, TINY_VOCAB, TINY_PAST_NAMES


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> bytes:
    return tiny_gpt2_with_past(tmp_path_factory.mktemp("gpt2"))


def _decode(run, steps: int = 20) -> tuple[list[int], list[np.ndarray]]:
    prompt = np.random.default_rng(0).integers(0, VOCAB, (1, 6), dtype=np.int64)
    return greedy_decode(run, PAST_NAMES, prompt, steps, HEADS, HIDDEN // HEADS)


def _with_kept_cast(model: bytes) -> bytes:
    """The model with a Cast to the type its input has that the optimizer keeps (it copies the first layer's key
    cache, itself a graph output, to another graph output: no rename can remove it), placed within the first layer;
    such a cast returns its input, an unbound step between bound ones."""
    proto = onnx.load_from_string(model)
    source = "present.0.key"
    at = next(k for k, n in enumerate(proto.graph.node) if source in n.output) + 1
    proto.graph.node.insert(at, helper.make_node("Cast", [source], ["key_copy"], to=TensorProto.FLOAT))
    proto.graph.output.append(helper.make_tensor_value_info("key_copy", TensorProto.FLOAT, None))
    return proto.SerializeToString()


def _assert_same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(a, b)


def test_decoding_runs_segments_and_gives_the_unbound_bits(tiny_gpt2, monkeypatch):
    session = one_thread_session(tiny_gpt2)
    ran = []
    segments = program_module._segments

    def counted(plan, views):
        result = segments(plan, views)
        ran.append(sum(entry[3] == program_module._SEGMENT for entry in result))
        return result

    monkeypatch.setattr(program_module, "_segments", counted)
    unbound = one_thread_session(tiny_gpt2, bind=False)
    _assert_same(_decode(lambda feed: session.run(None, feed)), _decode(lambda feed: unbound.run(None, feed)))
    assert ran and min(ran) >= 4  # the layers' projections, MLPs and norms between the cache's unbound steps
    (spare,) = session._program._spare_arenas
    for plan, _, segmented in spare[5].plans.values():
        runs = [entry for entry in segmented if entry[3] == program_module._SEGMENT]
        assert sum(len(entry[8]) for entry in runs) + len(segmented) - len(runs) == len(plan)


def test_segments_compute_their_steps_when_the_bound_steps_cannot_be_trusted(tiny_gpt2, monkeypatch):
    """From the third token on, the attention writes a new array instead of its planned buffer: the steps bound to
    that buffer (and every later bound step) must compute from their inputs, and the bits stay the unbound ones."""
    unbound = one_thread_session(tiny_gpt2, bind=False)
    want = _decode(lambda feed: unbound.run(None, feed))
    runs = []
    into = contrib.MultiHeadAttention._into

    def elsewhere(self, out, *inputs):
        result = into(self, out, *inputs)
        return result.copy() if len(runs) > 2 and out is not None else result

    monkeypatch.setattr(contrib.MultiHeadAttention, "_into", elsewhere)
    session = one_thread_session(tiny_gpt2)  # its kernels take their run_into when built
    untrusted = []
    run_untrusted = program_module._run_untrusted

    def counted(*args):
        untrusted.append(args[0][0].node.op_type)
        return run_untrusted(*args)

    monkeypatch.setattr(program_module, "_run_untrusted", counted)

    def run(feed):
        runs.append(1)
        return session.run(None, feed)

    _assert_same(_decode(run), want)
    assert "MatMul" in untrusted


def test_a_run_that_may_be_terminated_checks_before_every_step(tiny_gpt2):
    session = one_thread_session(tiny_gpt2)
    options = carrack.RunOptions()
    unbound = one_thread_session(tiny_gpt2, bind=False)
    want = _decode(lambda feed: unbound.run(None, feed))
    _assert_same(_decode(lambda feed: session.run(None, feed, options)), want)
    options.terminate = True
    feed = {"input_ids": np.array([[3]], np.int64), "attention_mask": np.ones((1, 30), np.int64),
            **{name: np.zeros((1, HEADS, 29, HIDDEN // HEADS), np.float32) for name in PAST_NAMES}}
    with pytest.raises(carrack.RunTerminated):
        session.run(None, feed, options)


def test_runs_of_one_size_with_an_unbound_step_run_segments_with_the_unbound_bits(tiny_gpt2):
    """A decode step at one past length, repeated with new ids and caches: the arena's bound plan is not all bound
    (a cast that returns its input stays unbound), so its runs take the segmented form, with the unbound bits."""
    model = _with_kept_cast(tiny_gpt2)
    session, unbound = one_thread_session(model), one_thread_session(model, bind=False)
    rng = np.random.default_rng(3)
    for _ in range(5):
        feed = {"input_ids": rng.integers(0, VOCAB, (1, 1), dtype=np.int64),
                "attention_mask": np.ones((1, 8), np.int64),
                **{name: rng.standard_normal((1, HEADS, 7, HIDDEN // HEADS)).astype(np.float32)
                   for name in PAST_NAMES}}
        for got, want in zip(session.run(None, feed), unbound.run(None, feed)):
            np.testing.assert_array_equal(got, want)
    (spare,) = session._program._spare_arenas
    bound_plan = spare[3][1]
    assert bound_plan.fast is None and bound_plan.segmented is not None
    assert sum(entry[3] == program_module._SEGMENT for entry in bound_plan.segmented) >= 2
