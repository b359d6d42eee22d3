"""A model whose weights are embedded in the .onnx file (raw_data, as onnx.save and torch.onnx write them below 2 GB)
loads with its weights in memory about once: the file is mapped, the protobuf parsed without the large raw_data, and
each tensor read straight into its aligned array (or used in place when its offset is aligned).

The test writes ~200 MB of embedded weights and bounds the peak RSS growth of a fresh interpreter that creates a
session and runs it once (1.03x; before the wire-level split it was 2.5x the weight bytes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.rss_probe import PEAK_RSS_PRELUDE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_IN, N_MID = 1000, 25_000  # w1 [N_IN, N_MID] and w2 [N_MID, N_IN], float32: 100 MB each


def _block() -> np.ndarray:
    return np.random.default_rng(2).standard_normal((100, N_MID)).astype(np.float32) / 100


def _weights() -> tuple[np.ndarray, np.ndarray]:
    block = _block()
    return np.tile(block, (N_IN // 100, 1)), np.tile(block[:, :N_IN], (N_MID // 100, 1))


_PEAK_SCRIPT = PEAK_RSS_PRELUDE + textwrap.dedent("""
    path, n_in = sys.argv[1], int(sys.argv[2])
    x = np.linspace(-1, 1, n_in, dtype=np.float32).reshape(1, n_in)
    sess = carrack.InferenceSession(path)
    y = sess.run(None, {"x": x})[0]
    peak = status("VmHWM")
    aligned = all(w.ctypes.data % 64 == 0 for w in sess._model.graph.initializers.values())
    np.save(sys.argv[3], y)
    print(json.dumps(dict(baseline=baseline, peak=peak, reset=reset, aligned=aligned)))
""")


def _write_model(path: str) -> int:
    w1, w2 = _weights()
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")]
    weight_bytes = w1.nbytes + w2.nbytes
    del w1, w2
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N_IN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N_IN])], initializer=inits)
    del inits
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return weight_bytes


def test_200mb_embedded_weights_load_about_once(tmp_path):
    model_path = str(tmp_path / "model.onnx")
    weight_bytes = _write_model(model_path)
    assert os.path.getsize(model_path) > weight_bytes  # the weights are inside the protobuf

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = str(tmp_path / "y.npy")
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, model_path, str(N_IN), out],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = result["peak"] - result["baseline"]
    print(f"embedded weights {weight_bytes / 2**20:.1f} MiB, peak RSS growth {growth / 2**20:.1f} MiB "
          f"({growth / weight_bytes:.2f}x, high-water mark reset: {result['reset']})")

    w1, w2 = _weights()
    x = np.linspace(-1, 1, N_IN, dtype=np.float32).reshape(1, N_IN)
    np.testing.assert_allclose(np.load(out), (x @ w1) @ w2, rtol=1e-4, atol=1e-3)
    assert result["aligned"], "every initializer must start on a 64-byte boundary"
    assert growth < 1.3 * weight_bytes, f"peak RSS grew by {growth / 2**20:.1f} MiB for {weight_bytes / 2**20:.1f} MiB"
