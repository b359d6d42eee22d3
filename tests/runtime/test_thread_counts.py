"""A whole model at 1, 2 and 4 intra-op threads: a tiny BERT from a transformers config (random weights) exported
by torch.onnx, run by carrack with every parallel kernel's split threshold lowered so that its small operands are
split too. Each output element is computed by one thread whatever the count, so the outputs are the same bits at
every count, and match onnxruntime within float32 rounding."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import carrack
from carrack import native
from carrack.native import convolution as native_conv
from carrack.native import intra_op, qgemm, rowops
from tests.helpers import first_output_module

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

needs_pool = pytest.mark.skipif(native.library("threadpool") is None or rowops.library() is None
                                or native_conv.load() is None, reason="native kernels are not built here")


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> tuple[bytes, dict[str, np.ndarray]]:
    """Heads of 64 and 70 tokens: every product of the model is one the native MatMul takes at any count (a
    smaller one would go to numpy's BLAS at some counts only, which rounds differently)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=256, max_position_embeddings=80)
    model = first_output_module(transformers.BertModel(config).eval())
    ids = torch.randint(0, 50, (1, 70))
    mask = torch.ones(1, 70, dtype=torch.int64)
    mask[0, 60:] = 0
    path = tmp_path_factory.mktemp("bert") / "bert.onnx"
    with torch.no_grad():
        torch.onnx.export(model, (ids, mask), str(path), dynamo=False, opset_version=17,
                          input_names=["ids", "mask"], output_names=["hidden"])
    return path.read_bytes(), {"ids": ids.numpy(), "mask": mask.numpy()}


@pytest.fixture
def split_everything(monkeypatch):
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)
    monkeypatch.setattr(rowops, "PARALLEL_MIN", 1)
    monkeypatch.setattr(qgemm, "_PARALLEL_MIN_MACS", 1)


@needs_pool
def test_bert_outputs_are_the_same_bits_at_1_2_and_4_threads(bert, split_everything, monkeypatch):
    model, feed = bert
    binary_calls = []
    original = rowops.binary
    monkeypatch.setattr(rowops, "binary", lambda *args: binary_calls.append(original(*args) is not None)
                        or original(*args))
    outputs = {}
    for count in (1, 2, 4):
        options = carrack.SessionOptions()
        options.intra_op_num_threads = count
        session = carrack.InferenceSession(model, options)
        split_before = intra_op.parallel_seconds()
        outputs[count] = session.run(None, feed)[0]
        if count > 1:
            assert intra_op.parallel_seconds() > split_before  # the run's kernels did split
    np.testing.assert_array_equal(outputs[2], outputs[1])
    np.testing.assert_array_equal(outputs[4], outputs[1])
    assert any(binary_calls), "no elementwise pass ran on the threads"

    from tests.helpers import ort_run

    expected = ort_run(onnx.load_from_string(model), feed)[0]
    np.testing.assert_allclose(outputs[2], expected, rtol=1e-4, atol=1e-4)
