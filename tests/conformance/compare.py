"""Compare outputs as onnx's backend runner does: same count, same shapes and dtypes, strings equal,
numbers within the case's rtol/atol (bfloat16 compared in float32 with rtol of at least 2**-6)."""

from __future__ import annotations

from typing import Any

import numpy as np


def assert_outputs_match(expected: list[Any], got: list[Any], rtol: float, atol: float) -> None:
    assert isinstance(got, list), f"run() returned {type(got).__name__}, expected a list"
    assert len(got) == len(expected), f"{len(got)} outputs, expected {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        _match(e, g, rtol, atol, f"output {i}")


def _match(e: Any, g: Any, rtol: float, atol: float, where: str) -> None:
    if e is None:
        assert g is None, f"{where}: expected an empty optional, got {type(g).__name__}"
        return
    if isinstance(e, (list, tuple)):
        assert isinstance(g, (list, tuple)), f"{where}: expected a sequence, got {type(g).__name__}"
        assert len(g) == len(e), f"{where}: sequence of {len(g)}, expected {len(e)}"
        for j, (ee, gg) in enumerate(zip(e, g)):
            _match(ee, gg, rtol, atol, f"{where}[{j}]")
        return
    assert isinstance(g, np.ndarray), f"{where}: got {type(g).__name__}, expected ndarray"
    assert g.shape == e.shape, f"{where}: shape {g.shape}, expected {e.shape}"
    if e.dtype == object:
        assert np.array_equal(g.astype(object), e), f"{where}: strings differ: {g!r} vs {e!r}"
        return
    assert g.dtype == e.dtype, f"{where}: dtype {g.dtype}, expected {e.dtype}"
    if e.dtype.name == "bfloat16":
        rtol = max(rtol, 2.0**-6)
        e, g = e.astype(np.float32), g.astype(np.float32)
    np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=where)
