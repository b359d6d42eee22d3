"""The four-byte products of AVX-512 VNNI builds (carrack_quant.h's vpdpbusd path: unshifted activation bytes times
int8 weights, the zero point's share taken from the bias) equal carrack's session bit for bit at the edges: every
k modulo 4 (a last quad of 1, 2 or 3 real k), uint8 and int8 activations at extreme zero points, extreme weights,
more rows than one packed block, and a product whose partial sums leave int32 before the zero point's share brings
the total back. Built for the machine (-march=native) and, where the CPU has AVX-512 VNNI, icelake-server."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import carrack
from carrack.backends.c.build import compile_model
from tests.compile.helpers import needs_compiler
from tests.compile.test_quantized import _skip_unless_cpu_runs


def _qdq_matmul(k: int, n: int, activation: str, zero_point: int, weights: np.ndarray, scale: float = 1.0
                ) -> onnx.ModelProto:
    """x [rows, k] float -> QuantizeLinear (scale 1, the zero point) -> DequantizeLinear -> MatMul with the
    dequantized int8 weights -> QuantizeLinear/DequantizeLinear of the product at `scale`."""
    x_type = np.uint8 if activation == "uint8" else np.int8
    inits = [numpy_helper.from_array(a, name) for a, name in (
        (np.array(1.0, np.float32), "s_x"), (np.array(zero_point, x_type), "z_x"), (weights, "w_q"),
        (np.array(1.0, np.float32), "s_w"), (np.array(0, np.int8), "z_w"),
        (np.array(scale, np.float32), "s_y"), (np.array(0, np.int8), "z_y"))]
    N = helper.make_node  # noqa: N806 - short, for the node list
    nodes = [N("QuantizeLinear", ["x", "s_x", "z_x"], ["xq"]), N("DequantizeLinear", ["xq", "s_x", "z_x"], ["xd"]),
             N("DequantizeLinear", ["w_q", "s_w", "z_w"], ["wd"]), N("MatMul", ["xd", "wd"], ["p"]),
             N("QuantizeLinear", ["p", "s_y", "z_y"], ["yq"]), N("DequantizeLinear", ["yq", "s_y", "z_y"], ["y"])]
    g = helper.make_graph(nodes, "quads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _extreme_rows(rng, rows: int, k: int, activation: str) -> np.ndarray:
    lo, hi = (0, 255) if activation == "uint8" else (-128, 127)
    x = rng.integers(lo, hi + 1, (rows, k)).astype(np.float32)
    x[0], x[1] = lo, hi  # whole rows at the range's ends
    return x


#: k (every remainder modulo 4, one and several quads), activation type and zero point (each range's ends)
CASES = [(1, "uint8", 0), (2, "uint8", 255), (3, "int8", -128), (5, "int8", 127), (6, "int8", 3),
         (7, "uint8", 255), (33, "int8", -128), (33, "uint8", 0)]


@needs_compiler
@pytest.mark.parametrize("arch", ["native", "icelake-server"])
def test_every_k_and_zero_point_is_bit_exact(tmp_path, arch):
    if arch != "native":
        _skip_unless_cpu_runs(arch)
    rng = np.random.default_rng(0)
    for index, (k, activation, zero_point) in enumerate(CASES):
        weights = rng.choice(np.array([-128, 127, -1, 0, 1, 64], np.int8), (k, 19))
        path = tmp_path / f"m{index}.onnx"
        onnx.save(_qdq_matmul(k, 19, activation, zero_point, weights, scale=float(4 * k)), str(path))
        out = tmp_path / f"out{index}"
        compile_model(path, out, "native", max_dims={"rows": 40}, native_arch=arch)
        assert "cr_qmatmul(" in (out / "model.c").read_text()
        compiled, session = carrack.CompiledModel(out), carrack.InferenceSession(str(path))
        for rows in (1, 40):
            feed = {"x": _extreme_rows(rng, rows, k, activation) if rows > 1 else
                    np.full((1, k), zero_point, np.float32)}
            want = session.run(None, feed)[0]
            np.testing.assert_array_equal(compiled.run(None, feed)[0], want, err_msg=f"k={k} {activation} "
                                                                                        f"zp={zero_point}")


@needs_compiler
@pytest.mark.parametrize("arch", ["native", "icelake-server"])
def test_wrapping_partial_sums_are_bit_exact(tmp_path, arch):
    """uint8 activations at zero point 128 times a long row of 127s: the unshifted bytes' sum (up to 255 * 127 * k)
    leaves int32 while the shifted one (at most 128 * 127 * k) stays inside, as the emitter requires."""
    if arch != "native":
        _skip_unless_cpu_runs(arch)
    k = 100_000
    weights = np.full((k, 1), 127, np.int8)
    path = tmp_path / "wide.onnx"
    onnx.save(_qdq_matmul(k, 1, "uint8", 128, weights, scale=2.0 ** 20), str(path))
    compile_model(path, tmp_path / "out", "native", max_dims={"rows": 4}, native_arch=arch)
    assert "cr_qmatmul(" in (tmp_path / "out" / "model.c").read_text()
    assert 255 * 127 * k >= 2 ** 31 > 128 * 127 * k
    compiled, session = carrack.CompiledModel(tmp_path / "out"), carrack.InferenceSession(str(path))
    x = np.stack([np.full(k, 255), np.full(k, 0), np.full(k, 128), np.arange(k) % 256]).astype(np.float32)
    want = session.run(None, {"x": x})[0]
    assert np.abs(want).max() > 0  # not all rounded to zero
    np.testing.assert_array_equal(compiled.run(None, {"x": x})[0], want)
