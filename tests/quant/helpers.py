"""Small helpers for the quantization tests: one-node models run in carrack and onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

import carrack
from carrack.ir.dtypes import to_onnx

MS = "com.microsoft"


def one_node_model(node: onnx.NodeProto, feeds: dict[str, np.ndarray], out_type: int,
                   initializers: dict[str, np.ndarray] | None = None, opset: int = 21) -> onnx.ModelProto:
    inits = initializers or {}
    inputs = [helper.make_tensor_value_info(k, to_onnx(v.dtype), v.shape) for k, v in feeds.items()]
    outputs = [helper.make_tensor_value_info(o, out_type, None) for o in node.output]
    graph = helper.make_graph([node], "g", inputs, outputs,
                              [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)],
                             ir_version=10)


def carrack_run(node, feeds, out_type, initializers=None):
    model = one_node_model(node, feeds, out_type, initializers)
    sess = carrack.InferenceSession(model.SerializeToString())
    return sess.run(None, feeds)[0]


def ort_run(node, feeds, out_type, initializers=None):
    model = one_node_model(node, feeds, out_type, initializers)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]
