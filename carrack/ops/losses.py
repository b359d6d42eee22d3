"""Loss functions: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (weights, ignore_index, reductions)."""

from __future__ import annotations

import numpy as np

from carrack.ops.reduce import compute_dtype
from carrack.ops.registry import Kernel, register

REDUCTIONS = ("none", "sum", "mean")


def _reduction(kernel: Kernel) -> str:
    reduction = kernel.attr("reduction", "mean")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    if reduction not in REDUCTIONS:
        kernel.fail(f"reduction must be one of {', '.join(REDUCTIONS)}, got '{reduction}'")
    return reduction


def nll_loss(log_prob: np.ndarray, target: np.ndarray, weight: np.ndarray | None, ignore_index: int | None,
             reduction: str) -> np.ndarray:
    """Loss of log-probabilities (N, C, d1..dk) against class indices (N, d1..dk), in log_prob's dtype."""
    ignored = target == ignore_index if ignore_index is not None else np.zeros(target.shape, dtype=bool)
    classes = np.where(ignored, 0, target).astype(np.int64)
    picked = np.take_along_axis(log_prob, np.expand_dims(classes, 1), axis=1).squeeze(1)
    sample_weight = np.ones(target.shape, log_prob.dtype) if weight is None else weight.astype(log_prob.dtype)[classes]
    sample_weight = np.where(ignored, 0, sample_weight).astype(log_prob.dtype)
    loss = -picked * sample_weight
    if reduction == "none":
        return loss
    if reduction == "sum":
        return np.sum(loss)
    return np.sum(loss) / np.sum(sample_weight)


class _Loss(Kernel):
    def setup(self):
        self.reduction = _reduction(self)
        ignore_index = self.attr("ignore_index")
        self.ignore_index = None if ignore_index is None else int(ignore_index)


@register("NegativeLogLikelihoodLoss", since=12)
class NegativeLogLikelihoodLoss(_Loss):
    def run(self, log_prob, target, weight=None):
        wide = log_prob.astype(compute_dtype(log_prob.dtype), copy=False)
        loss = nll_loss(wide, target, weight, self.ignore_index, self.reduction)
        return np.asarray(loss).astype(log_prob.dtype, copy=False)


@register("SoftmaxCrossEntropyLoss", since=12)
class SoftmaxCrossEntropyLoss(_Loss):
    def run(self, scores, labels, weights=None):
        wide = scores.astype(compute_dtype(scores.dtype), copy=False)
        shifted = wide - np.max(wide, axis=1, keepdims=True)
        log_prob = shifted - np.log(np.sum(np.exp(shifted), axis=1, keepdims=True))
        loss = nll_loss(log_prob, labels, weights, self.ignore_index, self.reduction)
        return np.asarray(loss).astype(scores.dtype, copy=False), log_prob.astype(scores.dtype, copy=False)
