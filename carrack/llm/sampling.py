"""Next-token sampling in llama.cpp's default order: penalties, top-k, top-p, min-p, temperature, draw.

A temperature <= 0 is greedy decoding (the most likely token after the repeat penalty).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0


def apply_repeat_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float, frequency: float = 0.0,
                         presence: float = 0.0) -> np.ndarray:
    """llama.cpp's penalties over the recent tokens: each one's logit divided by `penalty` if positive, else
    multiplied, then lowered by `frequency` times its count and by `presence` once."""
    if (penalty == 1.0 and frequency == 0.0 and presence == 0.0) or len(recent) == 0:
        return logits
    logits = logits.copy()
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    values = logits[ids]
    values = np.where(values > 0, values / penalty, values * penalty)
    logits[ids] = values - counts * frequency - presence
    return logits


def candidate_probabilities(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, probabilities) left after top-k, top-p and min-p at the given temperature, most likely first."""
    order = np.argsort(-logits, kind="stable")
    if params.top_k > 0:
        order = order[:params.top_k]
    kept = logits[order].astype(np.float64)
    probs = np.exp(kept - kept[0])
    probs /= probs.sum()
    if 0.0 < params.top_p < 1.0:
        cumulative = np.cumsum(probs)
        keep = int(np.searchsorted(cumulative, params.top_p) + 1)
        order, kept, probs = order[:keep], kept[:keep], probs[:keep]
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs[0]
        order, kept = order[keep], kept[keep]
    scaled = (kept - kept[0]) / params.temperature
    probs = np.exp(scaled)
    return order, probs / probs.sum()


def sample_token(logits: np.ndarray, recent: Sequence[int], params: SamplingParams,
                 rng: np.random.Generator) -> int:
    logits = apply_repeat_penalty(np.asarray(logits, dtype=np.float32), recent[-params.repeat_last_n:]
                                  if params.repeat_last_n > 0 else (), params.repeat_penalty,
                                  params.frequency_penalty, params.presence_penalty)
    if params.temperature <= 0.0:
        return int(np.argmax(logits))
    ids, probs = candidate_probabilities(logits, params)
    return int(ids[rng.choice(len(ids), p=probs)])
