"""Quantized models give bit-identical outputs through the native int8 GEMM and through numpy.

Only qgemm is switched off for the reference run (its `library()` returning None, as CARRACK_NATIVE=0 would make
it): other native kernels (normalization, softmax) may round differently from their numpy versions."""

from __future__ import annotations

import numpy as np
import pytest

import carrack
from carrack.native import qgemm
from tests.helpers import count_calls

pytestmark = pytest.mark.skipif(qgemm.library() is None, reason="the native qgemm library is unavailable here")

CASES = [("transformer", "dynamic"), ("transformer", "dynamic_per_channel_reduce_range"), ("cnn", "dynamic"),
         ("transformer", "qdq"), ("transformer", "qoperator"), ("transformer", "qdq_per_channel"), ("cnn", "qdq")]


@pytest.mark.parametrize("model,variant", CASES)
def test_native_matches_numpy(model, variant, quantized_model, float_models, monkeypatch):
    path = quantized_model(model, variant)
    x = np.random.default_rng(5).normal(size=float_models[model][1]).astype(np.float32)
    calls = count_calls(monkeypatch, qgemm, "qgemm")
    with monkeypatch.context() as off:
        off.setattr(qgemm, "library", lambda: None)
        want = carrack.InferenceSession(str(path)).run(None, {"x": x})[0]
    assert calls["n"] == 0
    got = carrack.InferenceSession(str(path)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    if model == "transformer":
        assert calls["n"] > 0  # its matmuls went through the native GEMM
