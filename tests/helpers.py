"""Small builders for test models."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper


def tensor_info(name: str, elem_type: int = TensorProto.FLOAT, shape=None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def single_op_model(op_type: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
                    opset: int = 17, initializers=(), domain: str = "", **attrs) -> onnx.ModelProto:
    node = helper.make_node(op_type, [v.name for v in inputs] + [t.name for t in initializers],
                            [v.name for v in outputs], domain=domain, **attrs)
    graph = helper.make_graph([node], "g", inputs, outputs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets)


def ort_run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def run_in_threads(worker, count: int = 4) -> None:
    """Run worker(k) for k < count on that many threads at once and wait for them all."""
    import threading

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def session_at(model, threads: int, bind: bool = True):
    """A carrack session of `model` (bytes or a path) at `threads` intra-op threads whose executor binds steps to
    reused arenas (`bind`) or never does."""
    import carrack

    options = carrack.SessionOptions()
    options.intra_op_num_threads = threads
    session = carrack.InferenceSession(model, options)
    session._program.bind_steps = bind
    return session


def one_thread_session(model: bytes, bind: bool = True):
    """A carrack session at one thread (see `session_at`)."""
    return session_at(model, 1, bind)


def first_output_module(model):
    """A torch module calling a transformers `model` with (input_ids, attention_mask) and returning its first
    output: the traceable form the torch exporters take."""
    import torch

    class FirstOutput(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask)[0]

    return FirstOutput(model)


def count_calls(monkeypatch, owner, name: str) -> dict[str, int]:
    """Replace `owner.name` (for the test, through `monkeypatch`) by a wrapper counting its calls in ["n"]."""
    counter = {"n": 0}
    real = getattr(owner, name)

    def counting(*args, **kwargs):
        counter["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return counter


def randomize_batch_norms(net) -> None:
    """Give a torch network's BatchNorm2d layers statistics and affine terms that are not the identity."""
    for m in net.modules():
        if type(m).__name__ == "BatchNorm2d":
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)


def apply_activation(y: np.ndarray, activation: tuple[int, float, float]) -> np.ndarray:
    """The native convolutions' fused activation by code (1 Relu, 2 Clip, 3 LeakyRelu, 4 HardSigmoid, 6 Sigmoid)
    applied to a reference result."""
    code, alpha, beta = activation
    if code == 1:
        return np.maximum(y, 0)
    if code == 2:
        return np.clip(y, alpha, beta)
    if code == 3:
        return np.where(y < 0, y * alpha, y)
    if code == 4:
        return np.clip(y * alpha + beta, 0, 1)
    if code == 6:
        return 1 / (1 + np.exp(-y))
    return y
