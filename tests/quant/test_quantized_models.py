"""Models quantized by onnxruntime.quantization run in carrack and agree with onnxruntime.

Tolerance: static models end in DequantizeLinear, so their outputs lie on the output's quantization grid; carrack and
onnxruntime may differ by one step there (one output scale), because requantization rounds a near-tie value
(x / scale within float32 rounding of .5) one way or the other depending on the order of float operations.
The reference is onnxruntime with graph optimizations off (the model's own QDQ semantics): its optimized
transformer differs from its unoptimized self by two steps where flips in attention compound. Dynamic
models quantize activations at run time, where a flipped step changes the result by at most one activation step
times the weights; there we allow 2% of the output range. MatMulNBits dequantizes weights to float: float32
rounding only.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import carrack
from tests.quant.conftest import STATIC_VARIANTS
from tests.quant.helpers import ort_reference, output_step


def _run_both(path, shape, optimize_reference: bool = True):
    x = np.random.default_rng(123).normal(size=shape).astype(np.float32)
    want = ort_reference(path, {"x": x}, optimized=optimize_reference)
    session = carrack.InferenceSession(str(path))
    return session, session.run(None, {"x": x})[0], want


@pytest.mark.parametrize("variant", list(STATIC_VARIANTS))
@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_static(model, variant, quantized_model, float_models):
    path = quantized_model(model, variant)
    session, got, want = _run_both(path, float_models[model][1], optimize_reference=False)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=0, atol=output_step(path))
    if model == "cnn" and variant.startswith("qdq"):
        assert session.optimizer_stats.get("qdq_to_integer_kernel", 0) >= 4


@pytest.mark.parametrize("variant", ["dynamic", "dynamic_per_channel_reduce_range"])
@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_dynamic(model, variant, quantized_model, float_models):
    path = quantized_model(model, variant)
    session, got, want = _run_both(path, float_models[model][1])
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=0, atol=0.02 * float(np.ptp(want)))
    assert session.optimizer_stats.get("dynamic_quantized_matmul", 0) >= 1


def test_matmul_nbits_transformer(quantized_model, float_models):
    path = quantized_model("transformer", "nbits")
    assert any(n.op_type == "MatMulNBits" for n in onnx.load(str(path)).graph.node)
    session, got, want = _run_both(path, float_models["transformer"][1])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not any(n.op_type == "MatMulNBits" for n in session._model.graph.nodes)  # lowered at session creation
