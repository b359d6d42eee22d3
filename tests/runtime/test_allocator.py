"""The session keeps freed activation memory mapped (glibc malloc tuning): repeated runs do not re-fault pages."""

from __future__ import annotations

import platform
import resource

import numpy as np
import pytest
from onnx import TensorProto, helper

import carrack
from carrack.runtime.allocator import retain_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_retain_freed_memory_is_applied_once():
    first = retain_freed_memory()
    assert retain_freed_memory() == first
    assert first == GLIBC


@pytest.mark.skipif(not GLIBC, reason="malloc tuning is glibc-only")
def test_repeated_runs_do_not_fault_in_fresh_pages():
    # a chain of 4 MB activations of alternating shapes: each result is a fresh malloc of a large block
    shape = [1, 16, 256, 256]
    nodes = []
    prev = "x"
    for i in range(12):
        op = "Relu" if i % 2 else "Sigmoid"
        nodes.append(helper.make_node(op, [prev], [f"t{i}"]))
        prev = f"t{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = carrack.InferenceSession(model.SerializeToString())
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for _ in range(3):
        sess.run(None, {"x": x})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        sess.run(None, {"x": x})
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
    assert faults < 200, f"{faults:.0f} page faults per run (a 4 MB activation is 1024 pages)"
