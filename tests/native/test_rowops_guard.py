"""The native row kernels' Python wrappers refuse arguments that the C code would dereference as NULL."""

from __future__ import annotations

import numpy as np
import pytest

from carrack.native import rowops


def test_layer_norm_without_gamma_is_refused_not_a_segfault():
    if rowops.library() is None:
        pytest.skip("no C compiler: the native row kernels are not built")
    with pytest.raises(ValueError, match="needs its scale"):
        rowops.layer_norm(np.ones((2, 4), np.float32), None, None, 1e-5, 4)
