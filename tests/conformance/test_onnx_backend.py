"""ONNX backend conformance: every node case from onnx's own collection and every model shipped in the wheel."""

from __future__ import annotations

import numpy as np
import pytest

import carrack
from tests.conformance.cases import (
    folder_case,
    folder_case_ids,
    light_case,
    light_case_ids,
    node_cases,
    selected_node_case_ids,
)
from tests.conformance.compare import assert_outputs_match
from tests.conformance.expected_failures import EXPECTED_FAILURES


def _param(case_id: str):
    reason = EXPECTED_FAILURES.get(case_id)
    marks = [pytest.mark.xfail(reason=reason, strict=False)] if reason else []
    return pytest.param(case_id, marks=marks, id=case_id)


def _run_case(case, source, level=carrack.GraphOptimizationLevel.ORT_ENABLE_ALL) -> None:
    opts = carrack.SessionOptions()
    opts.graph_optimization_level = level
    sess = carrack.InferenceSession(source, opts)
    inits = {t.name for t in case.model.graph.initializer}
    names = [v.name for v in case.model.graph.input if v.name not in inits]
    with np.errstate(all="ignore"):
        for inputs, expected in case.data_sets:
            got = sess.run(None, dict(zip(names, inputs)))
            assert_outputs_match(expected, got, case.rtol, case.atol)


@pytest.mark.parametrize("case_id", [_param(c) for c in selected_node_case_ids()])
def test_node(case_id: str) -> None:
    case = node_cases()[case_id]
    _run_case(case, case.model.SerializeToString())


LEVELS = [pytest.param(carrack.GraphOptimizationLevel.ORT_DISABLE_ALL, id="unoptimized"),
          pytest.param(carrack.GraphOptimizationLevel.ORT_ENABLE_ALL, id="optimized")]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case_id", [_param(c) for c in folder_case_ids()])
def test_model_folder(case_id: str, level) -> None:
    case = folder_case(case_id)
    _run_case(case, case.model_path, level)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case_id", [_param(c) for c in light_case_ids()])
def test_light_model(case_id: str, level) -> None:
    case = light_case(case_id)
    _run_case(case, case.model_path, level)
