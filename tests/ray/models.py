"""Small models the Ray tests build in process (nothing stored): an MLP with a dynamic batch axis."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FEATURES, HIDDEN, CLASSES = 16, 32, 4


def mlp_model(seed: int = 0) -> bytes:
    """features[batch, 16] -> Gemm -> Relu -> Gemm -> Softmax: probs[batch, 4] and logits[batch, 4]."""
    rng = np.random.default_rng(seed)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.5, name)
               for name, shape in [("w1", (FEATURES, HIDDEN)), ("b1", (HIDDEN,)), ("w2", (HIDDEN, CLASSES)),
                                   ("b2", (CLASSES,))]]
    nodes = [helper.make_node("Gemm", ["features", "w1", "b1"], ["h"]),
             helper.make_node("Relu", ["h"], ["hr"]),
             helper.make_node("Gemm", ["hr", "w2", "b2"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=1)]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", CLASSES]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def features(rows: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, FEATURES)).astype(np.float32)
