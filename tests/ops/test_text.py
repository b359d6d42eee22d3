"""String kernels and TfIdfVectorizer against onnxruntime (or hand-computed values where ORT lacks the op)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack

S, F = TensorProto.STRING, TensorProto.FLOAT


def _model(op: str, x: np.ndarray, out_types: list[int], opset: int = 20, **attrs) -> onnx.ModelProto:
    outs = [f"y{i}" for i in range(len(out_types))]
    node = helper.make_node(op, ["x"], outs, **attrs)
    elem = helper.np_dtype_to_tensor_dtype(x.dtype) if x.dtype != object else S
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, x.shape)],
                              [helper.make_tensor_value_info(n, t, None) for n, t in zip(outs, out_types)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _carrack(model: onnx.ModelProto, x: np.ndarray) -> list:
    return carrack.InferenceSession(model.SerializeToString()).run(None, {"x": x})


def _compare(model: onnx.ModelProto, x: np.ndarray) -> None:
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for g, e in zip(_carrack(model, x), expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, g.shape, e.dtype, e.shape)
        assert g.tolist() == e.tolist() if g.dtype == object else np.allclose(g, e)


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("min_n,max_n,skip", [(1, 1, 0), (1, 2, 0), (2, 2, 2), (1, 3, 1), (3, 3, 3)])
def test_tfidf_ints(mode, min_n, max_n, skip):
    rng = np.random.default_rng(min_n * 10 + max_n + skip)
    x = rng.integers(0, 5, (3, 12)).astype(np.int64)
    pool = [0, 1, 2, 3, 0, 1, 1, 2, 2, 2, 4, 4, 0, 1, 2, 3, 3, 3]  # 4 unigrams, 4 bigrams, 2 trigrams
    attrs = dict(mode=mode, min_gram_length=min_n, max_gram_length=max_n, max_skip_count=skip,
                 ngram_counts=[0, 4, 12], ngram_indexes=[9, 8, 7, 6, 5, 4, 3, 2, 1, 0], pool_int64s=pool,
                 weights=[0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5])
    for rows in (x, x[0]):
        _compare(_model("TfIdfVectorizer", rows, [F], opset=9, **attrs), rows)


def test_tfidf_strings_int32_input_and_unknown_tokens():
    x = np.array([["a", "b", "zz", "a", "b"], ["b", "a", "b", "q", "a"]], dtype=object)
    model = _model("TfIdfVectorizer", x, [F], opset=9, mode="TF", min_gram_length=1, max_gram_length=2,
                   max_skip_count=1, ngram_counts=[0, 2], ngram_indexes=[0, 1, 2], pool_strings=["a", "b", "a", "b"])
    _compare(model, x)
    xi = np.array([[7, 8, 7, 9]], np.int32)
    model = _model("TfIdfVectorizer", xi, [F], opset=9, mode="TF", min_gram_length=1, max_gram_length=1,
                   max_skip_count=0, ngram_counts=[0], ngram_indexes=[1, 0], pool_int64s=[7, 9])
    _compare(model, xi)


@pytest.mark.parametrize("action,sensitive,expected", [
    ("LOWER", 0, ["tuesday", "wednesday"]),
    ("UPPER", 1, ["MONDAY", "TUESDAY", "MONDAY", "WEDNESDAY"]),
    ("NONE", 0, ["tuesday", "wednesday"]),
])
def test_string_normalizer(action, sensitive, expected):
    # onnxruntime needs an installed en_US locale for this op, so the expectations are written out
    x = np.array(["Monday", "tuesday", "MONDAY", "wednesday"], dtype=object)
    model = _model("StringNormalizer", x, [S], opset=10, case_change_action=action, is_case_sensitive=sensitive,
                   stopwords=["monday"])
    got = _carrack(model, x)[0]
    assert got.dtype == object and got.tolist() == expected


def test_string_normalizer_all_removed_2d():
    x = np.array([["a", "A"]], dtype=object)
    got = _carrack(_model("StringNormalizer", x, [S], opset=10, stopwords=["a"]), x)[0]
    assert got.shape == (1, 1) and got.tolist() == [[""]]


def test_string_split_and_concat():
    x = np.array([["a,b,,c", ""], ["x", "p,q"]], dtype=object)
    y, n = _carrack(_model("StringSplit", x, [S, TensorProto.INT64], delimiter=",", maxsplit=2), x)
    assert y.shape == (2, 2, 3) and y[0, 0].tolist() == ["a", "b", ",c"] and n.tolist() == [[3, 1], [1, 2]]
    y, n = _carrack(_model("StringSplit", np.array([" a  b "], dtype=object), [S, TensorProto.INT64]),
                    np.array([" a  b "], dtype=object))
    assert y.tolist() == [["a", "b"]] and n.tolist() == [2]


def test_regex_full_match():
    x = np.array([["abc@x.com", "nope"], ["q@y.org", "@"]], dtype=object)
    got = _carrack(_model("RegexFullMatch", x, [TensorProto.BOOL], pattern=r"\w+@\w+\.(com|org)"), x)[0]
    assert got.dtype == np.bool_ and got.tolist() == [[True, False], [True, False]]
