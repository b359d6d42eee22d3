"""NonMaxSuppression against onnxruntime: random boxes, both box formats, thresholds, limits, omitted inputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import carrack

INPUT_NAMES = ["boxes", "scores", "max_output_boxes_per_class", "iou_threshold", "score_threshold"]


def _model(feed: dict[str, np.ndarray | None], opset: int = 11, **attrs) -> onnx.ModelProto:
    names = [n if feed.get(n) is not None else "" for n in INPUT_NAMES]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("NonMaxSuppression", names, ["selected"], **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(feed[n].dtype), None)
                    for n in names if n]
    out = helper.make_tensor_value_info("selected", TensorProto.INT64, None)
    graph = helper.make_graph([node], "g", graph_inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _compare(feed: dict, opset: int = 11, **attrs) -> np.ndarray:
    model = _model(feed, opset, **attrs)
    present = {k: v for k, v in feed.items() if v is not None}
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, present)[0]
    got = carrack.InferenceSession(model.SerializeToString()).run(None, present)[0]
    assert got.dtype == np.int64 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    return got


def _random_boxes(rng: np.random.Generator, batches: int, n: int, center: bool) -> np.ndarray:
    xy = rng.uniform(0, 10, (batches, n, 2))
    wh = rng.uniform(0.5, 4, (batches, n, 2))
    if center:
        return np.concatenate([xy, wh], axis=-1).astype(np.float32)
    corners = np.concatenate([xy, xy + wh], axis=-1)
    flip = rng.random((batches, n)) < 0.3  # some boxes given by the other diagonal
    corners[flip] = corners[flip][:, [2, 3, 0, 1]]
    return corners.astype(np.float32)


def _feed(boxes, scores, limit=None, iou=None, score=None) -> dict:
    return {"boxes": boxes, "scores": scores,
            "max_output_boxes_per_class": None if limit is None else np.array([limit], np.int64),
            "iou_threshold": None if iou is None else np.array([iou], np.float32),
            "score_threshold": None if score is None else np.array([score], np.float32)}


@pytest.mark.parametrize("center", [0, 1])
@pytest.mark.parametrize("limit,iou,score", [(100, 0.5, None), (3, 0.3, 0.4), (50, 0.0, 0.2), (1000, 0.9, 0.0)])
def test_random_boxes_match_onnxruntime(center, limit, iou, score):
    rng = np.random.default_rng(center * 10 + limit)
    boxes = _random_boxes(rng, 2, 60, bool(center))
    scores = rng.random((2, 3, 60)).astype(np.float32)
    _compare(_feed(boxes, scores, limit, iou, score), center_point_box=center)


def test_opset10():
    rng = np.random.default_rng(1)
    boxes = _random_boxes(rng, 1, 30, False)
    scores = rng.random((1, 2, 30)).astype(np.float32)
    _compare(_feed(boxes, scores, 10, 0.4, 0.1), opset=10)


def test_tied_scores_and_score_equal_to_threshold():
    rng = np.random.default_rng(2)
    boxes = _random_boxes(rng, 1, 40, False)
    scores = np.round(rng.random((1, 2, 40)) * 4).astype(np.float32) / 4  # many ties, some exactly at 0.5
    _compare(_feed(boxes, scores, 100, 0.5, 0.5))


def test_omitted_optional_inputs_select_nothing():
    rng = np.random.default_rng(3)
    boxes = _random_boxes(rng, 1, 10, False)
    scores = rng.random((1, 1, 10)).astype(np.float32)
    got = _compare(_feed(boxes, scores))
    assert got.shape == (0, 3)


def test_default_iou_threshold_keeps_only_disjoint_boxes():
    boxes = np.array([[[0, 0, 1, 1], [0, 0.5, 1, 1.5], [0, 1, 1, 2], [5, 5, 6, 6]]], dtype=np.float32)
    scores = np.array([[[0.9, 0.8, 0.7, 0.6]]], dtype=np.float32)
    got = _compare(_feed(boxes, scores, 10))
    np.testing.assert_array_equal(got[:, 2], [0, 2, 3])  # boxes 0 and 2 only touch: IoU 0 is not above 0


def test_degenerate_boxes():
    boxes = np.array([[[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 3], [0, 0, 2, 2]]], dtype=np.float32)
    scores = np.array([[[0.9, 0.8, 0.7, 0.6]]], dtype=np.float32)
    _compare(_feed(boxes, scores, 10, 0.1))


def test_double_inputs():
    rng = np.random.default_rng(4)
    boxes = _random_boxes(rng, 1, 20, False)
    scores = rng.random((1, 1, 20)).astype(np.float32)
    model = _model(_feed(boxes, scores, 5, 0.5))
    feed32 = {k: v for k, v in _feed(boxes, scores, 5, 0.5).items() if v is not None}
    expected = carrack.InferenceSession(model.SerializeToString()).run(None, feed32)[0]
    feed64 = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feed32.items()}
    model64 = _model({k: feed64.get(k) for k in INPUT_NAMES})
    np.testing.assert_array_equal(carrack.InferenceSession(model64.SerializeToString()).run(None, feed64)[0], expected)
