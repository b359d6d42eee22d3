"""Values of any element type in compiled models: int64, int32, bool, uint8 and int8 inputs, intermediates and
outputs (sizes by element size in the arena, constants of those types in the weights file), and the kernels that
move and compare them (carrack_values.h). A graph of every integer and bool kernel matches carrack's session bit
for bit, natively and in Node; a BERT encoder from transformers (random weights, exported by torch.onnx with both
exporters) matches it within float32 rounding, its token ids gathered from the embeddings and its attention-mask
chain (Cast, GreaterOrEqual, And, Expand, GatherND or Gather, Where) compiled; an index out of range is an error
code that becomes a clear error in Python and in JavaScript."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import carrack
from carrack.backends.c.build import compile_model
from carrack.errors import InvalidArgument, RunFailure
from tests.compile.helpers import needs_compiler, needs_wasm, node_outputs, run_in_node

# ------------------------------------------------------------------------------------- every integer/bool kernel

def _integer_graph() -> onnx.ModelProto:
    """Each kernel of carrack_values.h on each element type, with a run-time dim n: embedding rows gathered by
    int64 ids (negative ones from the end), columns gathered by int32 indices, casts both ways, comparisons of
    integers, floats and mixed, logic with broadcasting, Where on floats and integers, Expand, integer Concat and
    wrapping integer arithmetic."""
    const = helper.make_tensor
    n = "n"
    table = np.arange(18, dtype=np.float32).reshape(6, 3) * 0.5 - 2.0
    inits = [
        const("table", TensorProto.FLOAT, [6, 3], table.reshape(-1)),
        const("columns", TensorProto.INT32, [2], [-1, 1]),
        const("two", TensorProto.INT64, [], [2]),
        const("zero_i8", TensorProto.INT8, [], [0]),
        const("minus", TensorProto.FLOAT, [], [-1.5]),
        const("seven", TensorProto.INT64, [], [7]),
        const("rows", TensorProto.INT64, [2], [3, 4]),
        const("offsets", TensorProto.INT64, [4], [10, -20, 30, -(2 ** 40)]),
        const("big", TensorProto.UINT8, [], [200]),
        const("half", TensorProto.FLOAT, [], [0.5]),
    ]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["embedded"]),
        helper.make_node("Gather", ["ids", "columns"], ["picked"], axis=1),
        helper.make_node("Cast", ["ids"], ["ids_float"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["small"], ["small_int32"], to=TensorProto.INT32),
        helper.make_node("Greater", ["ids", "two"], ["greater"]),
        helper.make_node("LessOrEqual", ["signed", "zero_i8"], ["nonpositive"]),
        helper.make_node("Equal", ["counts", "small_int32"], ["equal"]),
        helper.make_node("Less", ["ids_float", "half"], ["less_mixed"]),
        helper.make_node("GreaterOrEqual", ["ids", "ids_float"], ["ge_mixed"]),
        helper.make_node("And", ["greater", "flags"], ["both"]),
        helper.make_node("Or", ["both", "nonpositive"], ["either"]),
        helper.make_node("Xor", ["either", "equal"], ["exclusive"]),
        helper.make_node("Not", ["exclusive"], ["negated"]),
        helper.make_node("Where", ["negated", "ids_float", "minus"], ["chosen"]),
        helper.make_node("Where", ["flags", "ids", "seven"], ["chosen_int"]),
        helper.make_node("Expand", ["signed", "rows"], ["expanded"]),
        helper.make_node("Concat", ["ids", "chosen_int"], ["joined"], axis=1),
        helper.make_node("Add", ["ids", "offsets"], ["shifted"]),
        helper.make_node("Mul", ["counts", "counts"], ["squared"]),
        helper.make_node("Sub", ["small", "big"], ["wrapped"]),
        helper.make_node("Cast", ["chosen"], ["chosen_int8"], to=TensorProto.INT8),
        helper.make_node("Cast", ["chosen"], ["chosen_bool"], to=TensorProto.BOOL),
        helper.make_node("Cast", ["flags"], ["flags_float"], to=TensorProto.FLOAT),
    ]
    value = helper.make_tensor_value_info
    inputs = [value("ids", TensorProto.INT64, [n, 4]), value("flags", TensorProto.BOOL, [n, 4]),
              value("small", TensorProto.UINT8, [n, 4]), value("signed", TensorProto.INT8, [4]),
              value("counts", TensorProto.INT32, [n, 4])]
    outputs = [value(name, elem, None) for name, elem in (
        ("embedded", TensorProto.FLOAT), ("picked", TensorProto.INT64), ("less_mixed", TensorProto.BOOL),
        ("ge_mixed", TensorProto.BOOL), ("negated", TensorProto.BOOL), ("chosen", TensorProto.FLOAT),
        ("expanded", TensorProto.INT8), ("joined", TensorProto.INT64), ("shifted", TensorProto.INT64),
        ("squared", TensorProto.INT32), ("wrapped", TensorProto.UINT8), ("chosen_int8", TensorProto.INT8),
        ("chosen_bool", TensorProto.BOOL), ("flags_float", TensorProto.FLOAT))]
    graph = helper.make_graph(nodes, "integers", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _integer_feeds(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(-6, 6, (rows, 4)).astype(np.int64), "flags": rng.integers(0, 2, (rows, 4)) == 1,
            "small": rng.integers(0, 256, (rows, 4)).astype(np.uint8),
            "signed": rng.integers(-128, 128, 4).astype(np.int8),
            "counts": rng.integers(-40000, 40000, (rows, 4)).astype(np.int32)}


@pytest.fixture(scope="module")
def integer_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("integers") / "integers.onnx"
    onnx.save(_integer_graph(), str(path))
    return path


def _assert_equal_to_session(path, got: list[np.ndarray], feed) -> None:
    want = carrack.InferenceSession(str(path)).run(None, feed)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@needs_compiler
def test_integer_and_bool_kernels_equal_the_session_natively(integer_model, tmp_path):
    compile_model(integer_model, tmp_path, "native", max_dims={"n": 5})
    model = carrack.CompiledModel(tmp_path)
    assert [i.type for i in model.get_inputs()] == ["tensor(int64)", "tensor(bool)", "tensor(uint8)", "tensor(int8)",
                                                    "tensor(int32)"]
    manifest = json.loads((tmp_path / "model.json").read_text())
    assert [o["dtype"] for o in manifest["outputs"]][:5] == ["float32", "int64", "bool", "bool", "bool"]
    for rows, seed in ((1, 0), (5, 1), (3, 2)):
        feed = _integer_feeds(rows, seed)
        _assert_equal_to_session(integer_model, model.run(None, feed), feed)
    swapped = {name: value.astype(value.dtype.newbyteorder(">")) if value.dtype.itemsize > 1 else value[::1]
               for name, value in _integer_feeds(3, 4).items()}
    _assert_equal_to_session(integer_model, model.run(None, swapped), _integer_feeds(3, 4))


@needs_compiler
def test_gather_out_of_range_is_an_error_not_a_crash(integer_model, tmp_path):
    compile_model(integer_model, tmp_path, "native", max_dims={"n": 5})
    model = carrack.CompiledModel(tmp_path)
    for bad in (6, -7, 2 ** 40):
        feed = _integer_feeds(2, 0)
        feed["ids"][1, 2] = bad
        with pytest.raises(RunFailure, match="code 5: an index is out of range"):
            model.run(None, feed)
    feed = _integer_feeds(2, 0)
    _assert_equal_to_session(integer_model, model.run(None, feed), feed)  # the model runs on after an error
    with pytest.raises(InvalidArgument, match="input 'ids' must be int64, got int32"):
        model.run(None, {**feed, "ids": feed["ids"].astype(np.int32)})


@needs_wasm
def test_integer_and_bool_kernels_equal_the_session_in_node(integer_model, tmp_path):
    compile_model(integer_model, tmp_path / "out", "wasm32", max_dims={"n": 5})
    feeds = [_integer_feeds(rows, seed) for rows, seed in ((1, 0), (5, 1), (3, 2))]
    bad = _integer_feeds(2, 0)
    bad["ids"][0, 0] = -7
    report = run_in_node(tmp_path / "out", tmp_path, feeds, {"out_of_range": bad})
    for feed, run in zip(feeds, report["runs"]):
        want = carrack.InferenceSession(str(integer_model)).run(None, feed)
        for g, w in zip(node_outputs(run, want), want):
            np.testing.assert_array_equal(g, w)
        assert all(run["variants"].values()) and len(run["variants"]) == 15
    assert report["errors"]["out_of_range"] == ("Error: carrack: the model failed with code 5: an index is out of "
                                                "range (Gather: each index must be in -size..size-1 of its axis)")
    assert report["errors"]["dtype"] == ("Error: carrack: input 'ids': expected dtype int64 (a BigInt64Array), "
                                         "got Float64Array")


def test_constants_of_every_type_are_aligned_in_the_weights(integer_model):
    from carrack.backends.c.emit import emit
    from carrack.onnx.importer import load_model
    from carrack.plan import build_plan

    emitted = emit(build_plan(load_model(str(integer_model)), 99), None, {"n": 5})
    offsets = [int(m) for m in __import__("re").findall(r"r->weights \+ (\d+)\)", emitted.source)]
    assert offsets and all(o % 64 == 0 for o in offsets)
    for ctype in ("const int64_t *", "const int32_t *", "const float *"):
        assert f"({ctype})(r->weights" in emitted.source


# ---------------------------------------------------------------------------------------------------------- BERT

BERT_NAMES = ["input_ids", "attention_mask", "token_type_ids"]
BERT_DIMS = {"batch": 2, "sequence": 8}


class _LastHiddenState(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids, attention_mask, token_type_ids, return_dict=False)[0]


def _export_bert(path, dynamo: bool) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=32)
    module = _LastHiddenState(transformers.BertModel(config, add_pooling_layer=False)).eval()
    args = tuple(torch.ones(2, 8, dtype=torch.int64) for _ in BERT_NAMES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=BERT_NAMES, output_names=["y"], dynamo=dynamo,
                          dynamic_axes={n: {0: "batch", 1: "sequence"} for n in BERT_NAMES}, verbose=False,
                          **({"opset_version": 18} if dynamo else {}))


def _bert_feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for padding in (0, 3):
        ids = rng.integers(0, 50, (2, 8)).astype(np.int64)
        mask = np.ones((2, 8), np.int64)
        mask[1, 8 - padding:] = 0
        segments = np.zeros((2, 8), np.int64)
        segments[:, 5:] = 1
        out.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": segments})
    return out


@pytest.fixture(scope="module", params=["torchscript", "dynamo"])
def bert(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"bert_{request.param}") / "bert.onnx"
    _export_bert(path, request.param == "dynamo")
    return path


@needs_compiler
def test_bert_native_equals_the_session(bert, tmp_path):
    compile_model(bert, tmp_path, "native", dims=BERT_DIMS)
    source = (tmp_path / "model.c").read_text()
    for kernel in ("cr_gather(", "cr_cast(", "cr_logic(CR_AND", "cr_where("):  # embeddings and the mask chain
        assert kernel in source
    model = carrack.CompiledModel(tmp_path)
    outputs = []
    for feed in _bert_feeds():
        got = model.run(None, feed)[0]
        np.testing.assert_allclose(got, carrack.InferenceSession(str(bert)).run(None, feed)[0], rtol=1e-5,
                                   atol=1e-5)
        outputs.append(got)
    assert not np.allclose(outputs[0][1], outputs[1][1], atol=1e-3)  # the padding mask changes the padded row


@needs_wasm
def test_bert_in_node_equals_the_session(bert, tmp_path):
    compile_model(bert, tmp_path / "out", "wasm32", dims=BERT_DIMS)
    feeds = _bert_feeds()
    bad = {name: value.copy() for name, value in feeds[0].items()}
    bad["input_ids"][1, 7] = 50
    report = run_in_node(tmp_path / "out", tmp_path, feeds, {"out_of_range": bad})
    for feed, run in zip(feeds, report["runs"]):
        want = carrack.InferenceSession(str(bert)).run(None, feed)
        np.testing.assert_allclose(node_outputs(run, want)[0], want[0], rtol=1e-5, atol=1e-5)
        assert all(run["variants"].values())
    assert "code 5: an index is out of range" in report["errors"]["out_of_range"]


BERT_MAXIMA = {"batch": 3, "sequence": 12}


def _bert_feeds_at_run_time_sizes() -> list[dict[str, np.ndarray]]:
    """Several batch and sequence sizes within the maxima; the last row of each batch half padded, and one
    sequence whose only token is masked (every key masked: the session's masked softmax gives zeros)."""
    rng = np.random.default_rng(2)
    out = []
    for batch, length in ((1, 1), (2, 8), (3, 12), (1, 5)):
        mask = np.ones((batch, length), np.int64)
        mask[-1, length // 2:] = 0
        out.append({"input_ids": rng.integers(0, 50, (batch, length)).astype(np.int64), "attention_mask": mask,
                    "token_type_ids": rng.integers(0, 2, (batch, length)).astype(np.int64)})
    return out


@needs_compiler
def test_bert_with_run_time_batch_and_sequence(bert, tmp_path):
    """With --max-dim the position ids are a Slice and the mask chain Ranges (and GatherND indices) computed from
    the run-time sequence length."""
    compile_model(bert, tmp_path, "native", max_dims=BERT_MAXIMA)
    source = (tmp_path / "model.c").read_text()
    assert "cr_range(" in source and "cr_slice(" in source
    model = carrack.CompiledModel(tmp_path)
    session = carrack.InferenceSession(str(bert))
    for feed in _bert_feeds_at_run_time_sizes():
        np.testing.assert_allclose(model.run(None, feed)[0], session.run(None, feed)[0], rtol=1e-5, atol=1e-5)


@needs_compiler
def test_bert_attention_in_blocks_of_query_rows(bert, tmp_path, monkeypatch):
    """cr_attention's scores in blocks of query rows (built here with room for 30 scores: 3 rows of a 10-key
    sequence, 2 of 12, a last partial block), masked rows and a wholly masked sequence among them."""
    from carrack.backends.c.build import native_compiler

    monkeypatch.setenv("CC", " ".join([*native_compiler(), "-DCR_ATTENTION_SCORES=30"]))
    compile_model(bert, tmp_path, "native", max_dims=BERT_MAXIMA)
    model = carrack.CompiledModel(tmp_path)
    session = carrack.InferenceSession(str(bert))
    feeds = _bert_feeds_at_run_time_sizes()
    for feed in [*feeds, {name: value[:, :10] for name, value in feeds[2].items()}]:
        np.testing.assert_allclose(model.run(None, feed)[0], session.run(None, feed)[0], rtol=1e-5, atol=1e-5)


@needs_wasm
def test_bert_with_run_time_sizes_in_node(bert, tmp_path):
    compile_model(bert, tmp_path / "out", "wasm32", max_dims=BERT_MAXIMA)
    feeds = _bert_feeds_at_run_time_sizes()
    report = run_in_node(tmp_path / "out", tmp_path, feeds)
    session = carrack.InferenceSession(str(bert))
    for feed, run in zip(feeds, report["runs"]):
        want = session.run(None, feed)
        np.testing.assert_allclose(node_outputs(run, want)[0], want[0], rtol=1e-5, atol=1e-5)
