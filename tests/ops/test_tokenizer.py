"""com.microsoft Tokenizer against onnxruntime: scikit-learn text vectorizers converted by skl2onnx, and single
nodes over each mode (separators, token expression, characters), mark, mincharnum and input shape."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import carrack

ort = pytest.importorskip("onnxruntime")

DOCS = np.array(["the quick brown fox", "jumps over the lazy dog", "The DOG barks; the fox runs!", "a b c",
                 "fox, dog. Fox? dog!"], dtype=object)


def _ort(model: onnx.ModelProto, feeds: dict) -> list:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


VECTORIZERS = ["tfidf_words", "tfidf_separators", "count_bigrams", "tfidf_chars"]


@pytest.mark.parametrize("name", VECTORIZERS)
def test_skl2onnx_text_vectorizer_matches_onnxruntime(name):
    pytest.importorskip("sklearn")
    skl2onnx = pytest.importorskip("skl2onnx")
    from skl2onnx.common.data_types import StringTensorType
    from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer

    vectorizer, options = {
        "tfidf_words": (TfidfVectorizer(), None),
        "tfidf_separators": (TfidfVectorizer(), {"separators": [" ", "[.]", "[?]", ",", ";", "!"], "tokenexp": None}),
        "count_bigrams": (CountVectorizer(ngram_range=(1, 2)), None),
        "tfidf_chars": (TfidfVectorizer(analyzer="char", ngram_range=(1, 2)), None),
    }[name]
    vectorizer.fit(DOCS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = skl2onnx.to_onnx(vectorizer, initial_types=[("X", StringTensorType([None, 1]))],
                                 options={id(vectorizer): options} if options else None)
    assert any(n.op_type == "Tokenizer" for n in model.graph.node)
    feeds = {"X": DOCS.reshape(-1, 1)}
    got = carrack.InferenceSession(model).run(None, feeds)
    np.testing.assert_allclose(got[0], vectorizer.transform(DOCS).toarray(), rtol=1e-5, atol=1e-6)
    for node in model.graph.node:  # onnxruntime's StringNormalizer needs the locale installed: use one every system has
        if node.op_type == "StringNormalizer":
            node.attribute.append(helper.make_attribute("locale", "C.UTF-8"))
    np.testing.assert_allclose(got[0], _ort(model, feeds)[0], rtol=1e-5, atol=1e-6)


def _tokenizer(**attrs) -> onnx.ModelProto:
    node = helper.make_node("Tokenizer", ["x"], ["y"], domain="com.microsoft", pad_value="#", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.STRING, None)],
                              [helper.make_tensor_value_info("y", TensorProto.STRING, None)])
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17),
                                                                 helper.make_opsetid("com.microsoft", 1)])


MODES = {"space": {"separators": [" "]}, "two_separators": {"separators": [" ", r"\."]},
         "characters": {"separators": [""]}, "word_expression": {"tokenexp": "[a-zA-Z0-9_]+"},
         "any_character": {"tokenexp": "."}, "alternatives": {"tokenexp": "[a-z]+|[A-Z][a-z]*"}}
TEXT = np.array([["Hello World", "I love  computer science !"], ["a.b,c", "xy"]], dtype=object)
SHAPES = {"[C]": TEXT[0], "[N, C]": TEXT, "empty": np.empty((0,), dtype=object), "all_dropped": TEXT[1:, 1:],
          "some_dropped": np.array([["Hello World", "xy"]], dtype=object)}
CASES = [(mode, mark, chars, shape) for mode, mark, chars, shape in itertools.product(MODES, [0, 1], [1, 2], SHAPES)
         if mode not in ("characters", "any_character") or chars == 1 and not shape.endswith("dropped")]


@pytest.mark.parametrize("mode, mark, mincharnum, shape", CASES)
def test_tokenizer_node(mode, mark, mincharnum, shape):
    model = _tokenizer(mark=mark, mincharnum=3 if shape.endswith("dropped") else mincharnum, **MODES[mode])
    feeds = {"x": SHAPES[shape]}
    expected, got = _ort(model, feeds)[0], carrack.InferenceSession(model).run(None, feeds)[0]
    assert got.shape == expected.shape
    assert got.tolist() == expected.tolist()


def test_tokenizer_rejects_multi_character_minimum_for_characters():
    with pytest.raises(carrack.errors.CarrackError, match="mincharnum 2"):
        carrack.InferenceSession(_tokenizer(mark=0, mincharnum=2, tokenexp="."))
