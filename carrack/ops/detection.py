"""Object detection: NonMaxSuppression."""

from __future__ import annotations

import numpy as np

from carrack.ops.registry import Kernel, register


def _corners(boxes: np.ndarray, center_point_box: bool) -> np.ndarray:
    """[..., 4] boxes -> [..., 4] as (y_min, x_min, y_max, x_max)."""
    boxes = boxes.astype(np.float64)
    if center_point_box:
        xc, yc, w, h = np.moveaxis(boxes, -1, 0)
        return np.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], axis=-1)
    y1, x1, y2, x2 = np.moveaxis(boxes, -1, 0)
    return np.stack([np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)], axis=-1)


def iou_with(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """Intersection over union of one (y0, x0, y1, x1) box with each of [M, 4] others; 0 where a box is empty."""
    y0, x0, y1, x1 = box
    inter_h = np.clip(np.minimum(y1, others[:, 2]) - np.maximum(y0, others[:, 0]), 0, None)
    inter_w = np.clip(np.minimum(x1, others[:, 3]) - np.maximum(x0, others[:, 1]), 0, None)
    inter = inter_h * inter_w
    area = (y1 - y0) * (x1 - x0)
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    union = area + areas - inter
    valid = (area > 0) & (areas > 0) & (union > 0)
    return np.where(valid, inter / np.where(valid, union, 1), 0.0)


def _greedy(order: np.ndarray, corners: np.ndarray, threshold: float, limit: int) -> list[int]:
    """Walk boxes by falling score; keep one, drop every remaining box overlapping it by more than threshold.

    Each kept box costs one vectorised IoU row against the boxes still in play, so memory stays linear in the
    number of boxes (a full IoU matrix of a detector's ~10^4 anchors would need ~1 GB).
    """
    kept: list[int] = []
    remaining = order
    while remaining.size and len(kept) < limit:
        best, remaining = remaining[0], remaining[1:]
        kept.append(int(best))
        remaining = remaining[iou_with(corners[best], corners[remaining]) <= threshold]
    return kept


def _scalar(v, default):
    return default if v is None or np.size(v) == 0 else np.asarray(v).reshape(-1)[0]


@register("NonMaxSuppression", since=10)
class NonMaxSuppression(Kernel):
    def setup(self) -> None:
        center = self.attr("center_point_box", 0)
        if center not in (0, 1):
            self.fail(f"center_point_box must be 0 or 1, got {center}")
        self.center_point_box = bool(center)

    def run(self, boxes, scores, max_output_boxes_per_class=None, iou_threshold=None, score_threshold=None):
        limit = int(_scalar(max_output_boxes_per_class, 0))
        iou_limit = float(_scalar(iou_threshold, 0.0))
        min_score = _scalar(score_threshold, None)
        n_batches, n_classes, _ = scores.shape
        if boxes.shape[0] != n_batches or boxes.shape[1] != scores.shape[2] or boxes.shape[2] != 4:
            raise ValueError(f"boxes {boxes.shape} do not match scores {scores.shape}")
        selected: list[tuple[int, int, int]] = []
        if limit <= 0:
            return np.zeros((0, 3), dtype=np.int64)
        corners = _corners(boxes, self.center_point_box)
        for b in range(n_batches):
            for c in range(n_classes):
                s = scores[b, c]
                # stable sort on the negated score: equal scores keep the lower box index first
                order = np.argsort(-s.astype(np.float64), kind="stable")
                if min_score is not None:
                    order = order[s[order] > min_score]
                selected.extend((b, c, i) for i in _greedy(order, corners[b], iou_limit, limit))
        return np.array(selected, dtype=np.int64).reshape(-1, 3)
