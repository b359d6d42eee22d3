"""RNN / GRU / LSTM against onnxruntime on random weights: directions, layouts, sequence_lens, activations, clip."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import carrack

SEQ, BATCH, INPUT, HIDDEN = 5, 3, 4, 6
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
OUTPUTS = {"RNN": ["Y", "Y_h"], "GRU": ["Y", "Y_h"], "LSTM": ["Y", "Y_h", "Y_c"]}


def _model(op: str, inputs: dict[str, np.ndarray | None], opset: int, n_outputs: int | None = None,
           **attrs) -> onnx.ModelProto:
    order = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"][: 6 if op != "LSTM" else 8]
    names = [n if inputs.get(n) is not None else "" for n in order]
    while names and names[-1] == "":
        names.pop()
    outs = OUTPUTS[op][:n_outputs]
    node = helper.make_node(op, names, outs, hidden_size=HIDDEN, **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(inputs[n].dtype), None)
                    for n in names if n]
    x_type = helper.np_dtype_to_tensor_dtype(inputs["X"].dtype)
    graph_outputs = [helper.make_tensor_value_info(n, x_type, None) for n in outs]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _inputs(op: str, rng: np.random.Generator, dirs: int, layout: int = 0, lens=None, dtype=np.float32,
            bias=True, initial=True, peepholes=False) -> dict[str, np.ndarray | None]:
    g = GATES[op]
    x_shape = (SEQ, BATCH, INPUT) if layout == 0 else (BATCH, SEQ, INPUT)
    h_shape = (dirs, BATCH, HIDDEN) if layout == 0 else (BATCH, dirs, HIDDEN)
    feed = {
        "X": rng.standard_normal(x_shape),
        "W": rng.standard_normal((dirs, g * HIDDEN, INPUT)) * 0.5,
        "R": rng.standard_normal((dirs, g * HIDDEN, HIDDEN)) * 0.5,
        "B": rng.standard_normal((dirs, 2 * g * HIDDEN)) * 0.5 if bias else None,
        "initial_h": rng.standard_normal(h_shape) if initial else None,
    }
    if op == "LSTM":
        feed["initial_c"] = rng.standard_normal(h_shape) if initial else None
        feed["P"] = rng.standard_normal((dirs, 3 * HIDDEN)) * 0.5 if peepholes else None
    feed = {k: None if v is None else v.astype(dtype) for k, v in feed.items()}
    feed["sequence_lens"] = None if lens is None else np.array(lens, dtype=np.int32)
    return feed


def _compare(op: str, feed: dict, opset: int = 14, n_outputs: int | None = None, rtol: float = 1e-5,
             atol: float = 1e-5, **attrs) -> None:
    model = _model(op, feed, opset, n_outputs, **attrs)
    present = {k: v for k, v in feed.items() if v is not None}
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, present)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, present)
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)


DIRECTIONS = [("forward", 1), ("reverse", 1), ("bidirectional", 2)]


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction,dirs", DIRECTIONS)
@pytest.mark.parametrize("lens", [None, [5, 2, 3], [0, 5, 1]])
def test_directions_and_sequence_lens(op, direction, dirs, lens):
    feed = _inputs(op, np.random.default_rng(0), dirs, lens=lens)
    _compare(op, feed, direction=direction)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction,dirs", DIRECTIONS)
def test_batch_first_layout(op, direction, dirs):
    """onnxruntime rejects layout=1, so compare with carrack's layout=0 (checked against onnxruntime above)."""
    feed = _inputs(op, np.random.default_rng(1), dirs, lens=[2, 5, 4])
    seq_first = _carrack_only(op, feed, 14, direction=direction)
    batch_first_feed = dict(feed, X=feed["X"].transpose(1, 0, 2))
    for name in ("initial_h", "initial_c"):
        if batch_first_feed.get(name) is not None:
            batch_first_feed[name] = feed[name].transpose(1, 0, 2)
    batch_first = _carrack_only(op, batch_first_feed, 14, direction=direction, layout=1)
    np.testing.assert_array_equal(batch_first[0], seq_first[0].transpose(2, 0, 1, 3))
    for a, b in zip(batch_first[1:], seq_first[1:]):
        np.testing.assert_array_equal(a, b.transpose(1, 0, 2))


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("opset", [7, 14, 22])
def test_defaults_without_optional_inputs(op, opset):
    feed = _inputs(op, np.random.default_rng(2), 1, bias=False, initial=False)
    _compare(op, feed, opset=opset)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_double_precision(op):
    """onnxruntime has no double kernels; compare with its float32 result."""
    feed = _inputs(op, np.random.default_rng(3), 2, dtype=np.float64, lens=[5, 1, 3])
    feed32 = {k: None if v is None or v.dtype != np.float64 else v.astype(np.float32) for k, v in feed.items()}
    feed32["sequence_lens"] = feed["sequence_lens"]
    model = _model(op, feed32, 14, direction="bidirectional")
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {k: v for k, v in feed32.items() if v is not None})
    got = _carrack_only(op, feed, 14, direction="bidirectional")
    for e, g in zip(expected, got):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_only_final_state_requested(op):
    model = _model(op, _inputs(op, np.random.default_rng(4), 1), 14)
    node = model.graph.node[0]
    node.output[0] = ""
    del model.graph.output[0]
    feed = {k: v for k, v in _inputs(op, np.random.default_rng(4), 1).items() if v is not None}
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    got = carrack.InferenceSession(model.SerializeToString()).run(None, feed)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_clip():
    for op in ("RNN", "GRU", "LSTM"):
        feed = _inputs(op, np.random.default_rng(5), 2)
        _compare(op, feed, direction="bidirectional", clip=0.7)


@pytest.mark.parametrize("lbr", [0, 1])
def test_gru_linear_before_reset(lbr):
    feed = _inputs("GRU", np.random.default_rng(6), 2, lens=[4, 5, 1])
    _compare("GRU", feed, direction="bidirectional", linear_before_reset=lbr)


def test_lstm_peepholes_and_input_forget():
    feed = _inputs("LSTM", np.random.default_rng(7), 2, peepholes=True, lens=[3, 5, 2])
    _compare("LSTM", feed, direction="bidirectional")
    _compare("LSTM", feed, direction="bidirectional", input_forget=1)


ACTIVATION_SETS = [
    (["Relu"], [], []),
    (["Sigmoid"], [], []),
    (["Affine"], [0.5], [0.2]),
    (["LeakyRelu"], [0.3], []),
    (["ThresholdedRelu"], [0.4], []),
    (["ScaledTanh"], [1.5], [0.7]),
    (["HardSigmoid"], [0.3], [0.4]),
    (["Elu"], [0.8], []),
    (["Softsign"], [], []),
    (["Softplus"], [], []),
    (["LeakyRelu"], [], []),  # defaults for alpha
]


@pytest.mark.parametrize("acts,alphas,betas", ACTIVATION_SETS)
def test_rnn_activations(acts, alphas, betas):
    feed = _inputs("RNN", np.random.default_rng(8), 1)
    attrs = {"activations": acts}
    if alphas:
        attrs["activation_alpha"] = alphas
    if betas:
        attrs["activation_beta"] = betas
    _compare("RNN", feed, **attrs)


def test_mixed_activations_per_direction():
    feed = _inputs("GRU", np.random.default_rng(9), 2)
    _compare("GRU", feed, direction="bidirectional", activations=["HardSigmoid", "Softsign", "Sigmoid", "Tanh"],
             activation_alpha=[0.25], activation_beta=[0.45])
    feed = _inputs("LSTM", np.random.default_rng(9), 2)
    _compare("LSTM", feed, direction="bidirectional",
             activations=["Sigmoid", "LeakyRelu", "Tanh", "HardSigmoid", "Tanh", "ScaledTanh"],
             activation_alpha=[0.1, 0.2, 1.1], activation_beta=[0.6, 0.9])


def _carrack_only(op: str, feed: dict, opset: int, **attrs) -> list[np.ndarray]:
    model = _model(op, feed, opset, **attrs)
    present = {k: v for k, v in feed.items() if v is not None}
    return carrack.InferenceSession(model.SerializeToString()).run(None, present)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_opset1_matches_opset7(op):
    feed = _inputs(op, np.random.default_rng(10), 2)
    old = _carrack_only(op, feed, 1, direction="bidirectional", output_sequence=1)
    new = _carrack_only(op, feed, 7, direction="bidirectional")
    for a, b in zip(old, new):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_float16_keeps_dtype(op):
    feed32 = _inputs(op, np.random.default_rng(11), 1)
    feed16 = {k: None if v is None else v.astype(np.float16) for k, v in feed32.items()}
    got16 = _carrack_only(op, feed16, 14)
    got32 = _carrack_only(op, {k: None if v is None else v.astype(np.float32) for k, v in feed16.items()}, 14)
    for a, b in zip(got16, got32):
        assert a.dtype == np.float16
        np.testing.assert_allclose(a.astype(np.float32), b, rtol=1e-2, atol=1e-2)


def test_reverse_matches_flipped_forward():
    """A reverse pass over each sequence equals a forward pass over the sequence flipped within its length."""
    rng = np.random.default_rng(12)
    feed = _inputs("GRU", rng, 1, lens=[5, 3, 1])
    rev = _carrack_only("GRU", feed, 14, direction="reverse")
    flipped = feed["X"].copy()
    for b, n in enumerate(feed["sequence_lens"]):
        flipped[:n, b] = feed["X"][:n, b][::-1]
    fwd = _carrack_only("GRU", dict(feed, X=flipped), 14)
    np.testing.assert_allclose(rev[1], fwd[1], rtol=1e-6, atol=1e-6)
    for b, n in enumerate(feed["sequence_lens"]):
        np.testing.assert_allclose(rev[0][:n, 0, b], fwd[0][:n, 0, b][::-1], rtol=1e-6, atol=1e-6)
        assert not rev[0][n:, 0, b].any()


def test_bad_direction_is_rejected():
    feed = _inputs("RNN", np.random.default_rng(13), 1)
    with pytest.raises(carrack.InvalidModel):
        _carrack_only("RNN", feed, 14, direction="sideways")
