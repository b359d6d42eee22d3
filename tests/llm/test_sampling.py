"""The sampler's filters, one at a time."""

from __future__ import annotations

import numpy as np

from carrack.llm.sampling import SamplingParams, apply_repeat_penalty, candidate_probabilities, sample_token


def test_temperature_zero_is_argmax_after_the_penalty():
    logits = np.array([1.0, 3.0, 2.9, -1.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert sample_token(logits, [], SamplingParams(temperature=0.0), rng) == 1
    assert sample_token(logits, [1], SamplingParams(temperature=0.0, repeat_penalty=1.1), rng) == 2


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    out = apply_repeat_penalty(np.array([2.0, -2.0, 1.0], dtype=np.float32), [0, 1, 1], 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])


def test_top_k_top_p_min_p_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    ids, _ = candidate_probabilities(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0))
    assert ids.tolist() == [0, 1]
    ids, _ = candidate_probabilities(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.75, min_p=0.0))
    assert ids.tolist() == [0, 1]
    ids, probs = candidate_probabilities(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))
    assert ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(probs, np.array([0.5, 0.3, 0.15]) / 0.95)


def test_draws_follow_the_distribution():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    counts = np.bincount([sample_token(logits, [], params, rng) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.6, 0.3, 0.1], atol=0.03)


def test_frequency_and_presence_penalties():
    out = apply_repeat_penalty(np.array([2.0, -2.0, 1.0], dtype=np.float32), [0, 0, 1], 1.0, frequency=0.5,
                               presence=0.25)
    np.testing.assert_allclose(out, [2.0 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 1.0])
