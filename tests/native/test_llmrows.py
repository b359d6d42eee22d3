"""llmrows.c (the GGUF decoder's RMS norm with the residual add, SiLU * up, rope and causal attention) against
the numpy statements in carrack/llm/model.py, in the build for this machine and the portable build, identical at
1, 2 and 4 threads."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.llm import model
from carrack.native import llmrows
from tests.native.portable import native_and_portable

THREADS = (1, 2, 4)


portable_library, build = native_and_portable("llmrows", llmrows.library, "AVX-512 where it has it",
                                              "native kernels unavailable (no C compiler?)")


def random(shape, seed, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def assert_same_at_every_thread_count(results: list[np.ndarray]) -> None:
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other)


@pytest.mark.parametrize("rows, n", [(1, 64), (37, 200), (300, 130)])
def test_rms_norm_matches_numpy(build, rows, n):
    x, weight = random((rows, n), 0, 3.0), random(n, 1)
    expected = model.rms_norm(x, weight, 1e-5)
    results = [llmrows.rms_norm(x, weight, 1e-5, threads) for threads in THREADS]
    np.testing.assert_allclose(results[0], expected, rtol=2e-6, atol=2e-6 * np.abs(expected).max())
    assert_same_at_every_thread_count(results)


def test_rms_norm_reads_strided_rows(build):
    wide = random((40, 300), 2)
    x = wide[:, 100:228]  # the columns of a fused projection
    got = llmrows.rms_norm(x, np.ones(128, np.float32), 1e-6)
    np.testing.assert_allclose(got, model.rms_norm(np.ascontiguousarray(x), np.ones(128, np.float32), 1e-6),
                               rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows, n", [(1, 64), (300, 130)])
def test_add_rms_norm_updates_the_residual_stream_then_normalizes(build, rows, n):
    x, residual, weight = random((rows, n), 12, 2.0), random((rows, n), 13), random(n, 14)
    expected_x = x + residual
    expected = model.rms_norm(expected_x, weight, 1e-5)
    results = []
    for threads in THREADS:
        stream = x.copy()
        results.append(llmrows.add_rms_norm(stream, residual, weight, 1e-5, threads))
        np.testing.assert_array_equal(stream, expected_x)  # the same float32 add
    np.testing.assert_allclose(results[0], expected, rtol=2e-6, atol=2e-6 * np.abs(expected).max())
    np.testing.assert_array_equal(results[0], llmrows.rms_norm(expected_x, weight, 1e-5))
    assert_same_at_every_thread_count(results)
    with pytest.raises(ValueError, match="updates x in place"):
        llmrows.add_rms_norm(x[:, ::2], residual[:, ::2], weight[::2], 1e-5)
    with pytest.raises(ValueError, match="needs a residual of x's shape"):
        llmrows.add_rms_norm(x, residual[:, 1:], weight, 1e-5)


@pytest.mark.parametrize("rows, n", [(1, 70), (33, 300), (200, 257)])
def test_silu_mul_matches_numpy(build, rows, n):
    gate_up = random((rows, 2 * n), 3, 6.0)
    gate, up = gate_up[:, :n], gate_up[:, n:]  # strided halves, as a fused gate_up gives them
    gate[0, :4] = [-100.0, 100.0, 0.0, -0.0]  # exp over- and underflow, signed zero
    expected = model.silu(gate) * up
    results = [llmrows.silu_mul(gate, up, threads) for threads in THREADS]
    np.testing.assert_allclose(results[0], expected, rtol=2e-6, atol=1e-6)
    assert_same_at_every_thread_count(results)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("rope_dim", [64, 32])
def test_rope_matches_numpy(build, neox, rope_dim):
    rows, heads, head_dim = 150, 4, 64
    x = random((rows, heads * head_dim), 4)
    angles = random((rows, rope_dim // 2), 5, 3.0)
    cos, sin = np.cos(angles), np.sin(angles)
    by_head = x.reshape(rows, heads, head_dim).transpose(1, 0, 2)
    expected = model._apply_rope(by_head, cos, sin, rope_dim, neox).transpose(1, 0, 2).reshape(rows, -1)
    results = []
    for threads in THREADS:
        rotated = x.copy()
        assert llmrows.rope_(rotated, cos, sin, head_dim, rope_dim, neox, threads)
        results.append(rotated)
    np.testing.assert_array_equal(results[0], expected)  # the same float32 steps, no fused multiply-add
    assert_same_at_every_thread_count(results)


def numpy_attention(q, keys, values, start, scale, window, softcap=0.0):
    """model.Decoder._attention's numpy steps for queries q (n, n_head * head_dim)."""
    n_head_kv, _, head_dim = keys.shape
    n, end = q.shape[0], start + q.shape[0]
    group = q.shape[1] // head_dim // n_head_kv
    by_kv = q.reshape(n, n_head_kv * group, head_dim).transpose(1, 0, 2).reshape(n_head_kv, group * n, head_dim)
    scores = (by_kv * np.float32(scale)) @ keys[:, :end].transpose(0, 2, 1)
    if softcap:
        scores = np.tanh(scores / np.float32(softcap)) * np.float32(softcap)
    scores = scores.reshape(n_head_kv, group, n, end) + model._attention_mask(start, n, window)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores.reshape(n_head_kv, group * n, end) @ values[:, :end]
    return out.reshape(n_head_kv * group, n, head_dim).transpose(1, 0, 2).reshape(n, -1)


@pytest.mark.parametrize("n_head, n_head_kv, head_dim", [(8, 2, 64), (4, 4, 40), (6, 1, 16)])
@pytest.mark.parametrize("start, n, window", [(0, 37, 0), (19, 5, 0), (40, 1, 0), (3, 30, 7)])
def test_attention_matches_numpy(build, n_head, n_head_kv, head_dim, start, n, window):
    n_ctx = 48
    keys, values = np.zeros((2, n_head_kv, n_ctx, head_dim), np.float32)
    keys[:, :start + n], values[:, :start + n] = random((2, n_head_kv, start + n, head_dim), 6)
    keys[:, start + n:] = np.nan  # positions past the queries are never read
    q = random((n, n_head * head_dim), 7, 2.0)
    scale = head_dim ** -0.5
    expected = numpy_attention(q, keys, values, start, scale, window)
    results = [llmrows.attention(q, keys, values, start, scale, window, threads) for threads in THREADS]
    np.testing.assert_allclose(results[0], expected, rtol=1e-5, atol=1e-5)
    assert_same_at_every_thread_count(results)


@pytest.mark.parametrize("window", [0, 5])
def test_attention_with_softcapped_scores_matches_numpy(build, window):
    keys, values = random((2, 2, 40, 16), 10, 2.0)
    q = random((30, 4 * 16), 11, 3.0)
    expected = numpy_attention(q, keys, values, 10, 0.25, window, softcap=5.0)
    results = [llmrows.attention(q, keys, values, 10, 0.25, window, threads, softcap=5.0) for threads in THREADS]
    np.testing.assert_allclose(results[0], expected, rtol=1e-5, atol=1e-5)
    assert_same_at_every_thread_count(results)
    assert np.abs(expected - numpy_attention(q, keys, values, 10, 0.25, window)).max() > 1e-2  # the cap matters


def test_attention_reads_query_rows_of_a_fused_projection(build):
    keys, values = random((2, 2, 16, 32), 8)
    qkv = random((9, 8 * 32 + 2 * 64), 9)
    q = qkv[:, :256]
    got = llmrows.attention(q, keys, values, 4, 0.2)
    np.testing.assert_allclose(got, numpy_attention(np.ascontiguousarray(q), keys, values, 4, 0.2, 0),
                               rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_named(build):
    keys = np.zeros((2, 16, 32), np.float32)
    with pytest.raises(ValueError, match="do not fit the cache of 16"):
        llmrows.attention(np.zeros((4, 128), np.float32), keys, keys, 13, 1.0)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads of 32"):
        llmrows.attention(np.zeros((4, 96), np.float32), keys, keys, 0, 1.0)
    with pytest.raises(ValueError, match="caches must be"):
        llmrows.attention(np.zeros((4, 128), np.float32), keys, keys[:, :8], 0, 1.0)
    with pytest.raises(ValueError, match="RMS norm weight has shape"):
        llmrows.rms_norm(np.zeros((2, 8), np.float32), np.ones(9, np.float32), 1e-5)
    with pytest.raises(ValueError, match="gate .* and up .* must have the same shape"):
        llmrows.silu_mul(np.zeros((2, 8), np.float32), np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="rope needs a writable float32"):
        llmrows.rope_(np.zeros((2, 8), np.float64), np.ones((2, 4)), np.ones((2, 4)), 8, 8, False)
    with pytest.raises(ValueError, match="rope angles must be"):
        llmrows.rope_(np.zeros((2, 8), np.float32), np.ones((3, 4)), np.ones((3, 4)), 8, 8, False)
