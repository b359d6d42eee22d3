"""Small helpers for the quantization tests: one-node models run in carrack and onnxruntime, models quantized by
onnxruntime.quantization from random calibration images, and onnxruntime's reference output."""

from __future__ import annotations

from pathlib import Path

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


def quantize_static(source: Path, target: Path, shape: tuple[int, ...], batches: int, **options) -> Path:
    """onnxruntime.quantization.quantize_static of `source` into `target`, calibrated on `batches` random normal
    inputs "x" of `shape` (batch k drawn with seed k); `options` go to quantize_static (quant_format as a name)."""
    from onnxruntime import quantization

    class Calibration(quantization.CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"x": np.random.default_rng(k).normal(size=shape).astype(np.float32)}
                                 for k in range(batches)])

        def get_next(self):
            return next(self.batches, None)

    if isinstance(options.get("quant_format"), str):
        options["quant_format"] = getattr(quantization.QuantFormat, options["quant_format"])
    quantization.quantize_static(str(source), str(target), Calibration(), **options)
    return target


def ort_reference(path: Path, feed: dict[str, np.ndarray], optimized: bool = True) -> np.ndarray:
    """onnxruntime's first output for `feed` at one thread; `optimized=False`: with its graph optimizations off
    (the model's own QDQ semantics)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feed)[0]


def output_step(path: Path) -> float:
    """One quantization step of the model's first output (a hair over its scale), where a DequantizeLinear makes
    it; float32 rounding (1e-4) when float layers come last. Carrack and onnxruntime may differ by one step there:
    requantization rounds a near-tie one way or the other depending on the order of float operations."""
    model = onnx.load(str(path))
    last = next(n for n in reversed(model.graph.node) if n.output[0] == model.graph.output[0].name)
    if last.op_type != "DequantizeLinear":
        return 1e-4
    scale = next(i for i in model.graph.initializer if i.name == last.input[1])
    return float(onnx.numpy_helper.to_array(scale)) * 1.001
