"""docs/onnxruntime_compat.md is what tests/compat/onnxruntime_table.py prints for the installed onnxruntime: every
public onnxruntime name is listed, and its status agrees with what carrack has."""

from __future__ import annotations

import os

import onnxruntime
import pytest

from tests.compat import onnxruntime_table

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "onnxruntime_compat.md")


def test_every_row_agrees_with_carrack():
    rows = onnxruntime_table.rows()  # raises when a status contradicts what carrack has
    names = {name for _, name, _, _ in rows}
    assert {"InferenceSession.io_binding", "IOBinding.bind_output", "OrtValue.numpy", "get_all_providers"} <= names
    assert all(note for _, _, status, note in rows if status != "same"), "every difference and absence says why"


@pytest.mark.skipif(onnxruntime.__version__ != "1.32.0", reason="the committed table was generated for 1.32.0")
def test_the_committed_table_is_up_to_date():
    with open(DOC) as f:
        assert f.read() == onnxruntime_table.markdown(), \
            "regenerate: PYTHONPATH=. python -m tests.compat.onnxruntime_table > docs/onnxruntime_compat.md"
