"""rowlinear.c: act(x @ W + bias) for 1..4 rows with W packed once into panels of 16 columns. Checked against a
float64 reference within float32 rounding of a K-term sum, the same bits at any thread count and whatever x's
layout, the activations against carrack's numpy ones, and what it declines."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.native import convolution as native_conv
from carrack.native import intra_op, rowlinear
from carrack.ops.fused import _activation, _epilogue

pytestmark = pytest.mark.skipif(rowlinear.library() is None, reason="native kernels unavailable here")


def _operands(rows: int, depth: int, columns: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, depth), dtype=np.float32)
    w = rng.standard_normal((columns, depth), dtype=np.float32)  # Gemm's transB layout
    b = rng.standard_normal(columns, dtype=np.float32)
    return x, w, b


def _bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """How far a float32 sum of the products may be from the exact one: K roundings of at most |x| . |w|."""
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64)
    return 2 * x.shape[1] * np.finfo(np.float32).eps * magnitude + 1e-30


@pytest.mark.parametrize("rows,depth,columns", [(1, 256, 256), (1, 256, 10), (2, 37, 45), (3, 16, 16),
                                                (4, 100, 130), (1, 1, 1), (4, 5, 33), (2, 300, 17)])
def test_the_product_with_bias_is_the_exact_one_within_float32_rounding(rows, depth, columns):
    x, w, b = _operands(rows, depth, columns, rows * 1000 + depth + columns)
    linear = rowlinear.pack(w, b, transposed=True)
    out = np.full((rows, columns), np.nan, np.float32)
    assert linear.into(x, out)
    exact = x.astype(np.float64) @ w.T.astype(np.float64) + b
    assert np.all(np.abs(out - exact) <= _bound(x, w) + np.finfo(np.float32).eps * np.abs(exact))


def test_a_weight_in_matmul_layout_gives_the_transposed_layouts_bits():
    x, w, b = _operands(3, 70, 50, 1)
    by_rows, by_columns = np.empty((3, 50), np.float32), np.empty((3, 50), np.float32)
    assert rowlinear.pack(w, b, transposed=True).into(x, by_rows)
    assert rowlinear.pack(np.ascontiguousarray(w.T), b, transposed=False).into(x, by_columns)
    np.testing.assert_array_equal(by_rows, by_columns)


@pytest.mark.parametrize("name,params", [("Relu", []), ("Clip", [-0.5, 0.75]), ("LeakyRelu", [0.1]),
                                         ("HardSigmoid", [0.3, 0.4]), ("HardSwish", []), ("Sigmoid", []),
                                         ("Tanh", []), ("", [])])
def test_each_activation_is_carracks_numpy_one_of_the_same_sums(name, params):
    x, w, b = _operands(2, 64, 40, 7)
    w *= 0.2  # sums around the activations' bends
    plain, fused = np.empty((2, 40), np.float32), np.empty((2, 40), np.float32)
    assert rowlinear.pack(w, b, transposed=True).into(x, plain)
    apply = _activation(name, params)
    epilogue = _epilogue(name, params, apply)  # the parameters FusedGemm passes
    activation = (rowlinear.ACTIVATIONS[name], epilogue.alpha, epilogue.beta)
    assert rowlinear.pack(w, b, transposed=True, activation=activation).into(x, fused)
    expected = apply(plain.copy())
    np.testing.assert_allclose(fused, expected, rtol=2e-6, atol=1e-7)
    if name in ("Relu", "Clip", "LeakyRelu", ""):  # no transcendental: the same float operations
        np.testing.assert_array_equal(fused, expected)


def test_the_same_bits_at_any_thread_count(monkeypatch):
    monkeypatch.setattr(native_conv, "MIN_TASK_WORK", 1)  # split even this small layer
    x, w, b = _operands(4, 200, 300, 3)  # 19 panels: uneven pieces
    linear = rowlinear.pack(w, b, transposed=True, activation=(1, 0.0, 0.0))
    results = []
    for threads in (1, 2, 4, 3):
        with intra_op.intra_op_threads(threads):
            out = np.empty((4, 300), np.float32)
            assert linear.into(x, out)
            bound_out = np.empty((4, 300), np.float32)
            linear.bind(x, bound_out)()
            results += [out, bound_out]
    for y in results[1:]:
        np.testing.assert_array_equal(y, results[0])


def test_any_layout_of_x_gives_the_contiguous_bits():
    x, w, b = _operands(3, 96, 48, 5)
    linear = rowlinear.pack(w, b, transposed=True)
    expected = np.empty((3, 48), np.float32)
    assert linear.into(x, expected)
    raw = np.zeros(x.nbytes + 1, np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(x.shape)
    unaligned[...] = x
    wide = np.zeros((3, 192), np.float32)
    wide[:, ::2] = x
    for variant in (unaligned, wide[:, ::2], x.astype(">f4"), np.asfortranarray(x)):
        out = np.empty((3, 48), np.float32)
        assert linear.into(variant, out)
        np.testing.assert_array_equal(out, expected)
        assert linear.bind(variant, out) is None or variant.flags.c_contiguous and variant.flags.aligned


def test_a_bound_call_reads_the_new_contents_of_its_arrays():
    x, w, b = _operands(1, 64, 20, 9)
    linear = rowlinear.pack(w, b, transposed=True)
    out = np.empty((1, 20), np.float32)
    call = linear.bind(x, out)
    for seed in range(3):
        x[...] = np.random.default_rng(seed).standard_normal(x.shape, dtype=np.float32)
        call()
        expected = np.empty_like(out)
        assert linear.into(x.copy(), expected)
        np.testing.assert_array_equal(out, expected)


def test_what_it_declines():
    x, w, b = _operands(4, 32, 24, 11)
    linear = rowlinear.pack(w, b, transposed=True)
    assert not linear.into(np.vstack([x, x]), np.empty((8, 24), np.float32))  # more than MAX_ROWS rows
    assert not linear.into(x[:, :31], np.empty((4, 24), np.float32))  # another depth
    assert not linear.into(x.astype(np.float64), np.empty((4, 24), np.float32))
    assert not linear.into(x, np.empty((4, 24), np.float64))
    assert not linear.into(x, np.empty((4, 48), np.float32)[:, ::2])  # out not contiguous
    shared = np.zeros((4, 56), np.float32)
    assert not linear.into(shared[:, :32], shared[:, 32:])  # out overlapping x
    assert rowlinear.pack(np.zeros((0, 8), np.float32), None, transposed=True) is None
    too_big = rowlinear.MAX_WEIGHT_BYTES // 4 // 64 + 1
    assert rowlinear.pack(np.zeros((too_big, 64), np.float32), None, transposed=True) is None
    assert rowlinear.pack(w.astype(np.float64), b, transposed=True) is None


def test_no_bias_is_a_zero_bias():
    x, w, _ = _operands(2, 48, 19, 13)
    with_none, with_zeros = np.empty((2, 19), np.float32), np.empty((2, 19), np.float32)
    assert rowlinear.pack(w, None, transposed=True).into(x, with_none)
    assert rowlinear.pack(w, np.zeros(19, np.float32), transposed=True).into(x, with_zeros)
    np.testing.assert_array_equal(with_none, with_zeros)


@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_the_other_instruction_sets(variant, monkeypatch):
    """The package's AVX2 build sums with the same fused multiply-adds in the same order as the AVX-512 one (the
    same bits); the portable build rounds each product (within float32 rounding)."""
    from carrack import native

    wanted = native.variants.by_name(variant, native.cpu.targets_x86())
    if wanted is None or not wanted.cpu_features <= native.cpu_features()[0]:
        pytest.skip(f"this CPU cannot run the {variant} variant")
    cases = [(1, 256, 256), (3, 37, 45), (4, 100, 130)]
    operands = [_operands(*case, seed=sum(case)) for case in cases]
    best = []
    for x, w, b in operands:
        out = np.empty((x.shape[0], w.shape[0]), np.float32)
        assert rowlinear.pack(w, b, transposed=True, activation=(1, 0.0, 0.0)).into(x, out)
        best.append(out)
    monkeypatch.setenv("CARRACK_NATIVE_VARIANT", variant)
    monkeypatch.setattr(native, "_loaded", {})
    assert rowlinear.library() is not None and variant in native.origin("rowlinear")
    for (x, w, b), expected in zip(operands, best):
        out = np.empty_like(expected)
        assert rowlinear.pack(w, b, transposed=True, activation=(1, 0.0, 0.0)).into(x, out)
        if variant == "avx2" and "avx512" in native.cpu.select_variant(native.cpu_features()[0], None).variant.name:
            np.testing.assert_array_equal(out, expected)
        exact = np.maximum(x.astype(np.float64) @ w.T.astype(np.float64) + b, 0)
        assert np.all(np.abs(out - exact) <= _bound(x, w) + np.finfo(np.float32).eps * np.abs(exact))


def test_a_bound_call_keeps_what_it_reads_alive():
    import gc

    x, w, b = _operands(1, 1024, 256, 17)  # a 1 MiB weight: its panels are returned to the system when freed
    expected = np.empty((1, 256), np.float32)
    assert rowlinear.pack(w, b, transposed=True).into(x, expected)
    call = rowlinear.pack(w, b, transposed=True).bind(x.copy(), np.empty((1, 256), np.float32))
    gc.collect()
    call()
    np.testing.assert_array_equal(call.operands[2], expected)


@pytest.mark.parametrize("code", [0, 1])
def test_a_nan_in_a_row_reaches_every_output_of_that_row_through_relu(code):
    x, w, b = _operands(2, 40, 35, 19)
    x[1, 7] = np.nan
    out = np.empty((2, 35), np.float32)
    assert rowlinear.pack(w, b, transposed=True, activation=(code, 0.0, 0.0)).into(x, out)
    assert np.isnan(out[1]).all() and not np.isnan(out[0]).any()
