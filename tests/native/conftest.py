"""Fixtures of the native kernel tests."""

from __future__ import annotations

import pytest

from carrack.native import qgemm


@pytest.fixture
def amx_restored():
    """For a test that turns the int8 GEMM's AMX tiles off: on again afterwards (where CPU and environment allow)."""
    yield
    qgemm.amx(True)
