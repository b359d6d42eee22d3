"""float16 operands of the convolution and matrix-product kernels, computed by their float32 kernels.

numpy has no float16 arithmetic worth the name (each operation widens, computes and rounds element by element),
and onnxruntime's CPU provider runs float16 Conv, MatMul and Gemm in float32 with the result rounded once to
float16. So do these kernels: operands are widened exactly to float32 (constant weights once, kept), the float32
kernel computes (bias, residual and activation included), and the result is rounded to float16 once, to nearest
even, by the native converters of carrack.native.rowops.
"""

from __future__ import annotations

import numpy as np

from carrack.native import rowops

#: constant operands a kernel keeps widened copies of before it starts over (shapes keep changing: a constant
#: weight is one array, so only unusual graphs ever reach it)
_MAX_KEPT = 8


def is_half(*arrays: np.ndarray | None) -> bool:
    """Whether every given array (Nones aside) is float16, and there is at least one."""
    present = [a for a in arrays if a is not None]
    return bool(present) and all(isinstance(a, np.ndarray) and a.dtype == np.float16 for a in present)


def widen(x: np.ndarray | None) -> np.ndarray | None:
    """A float16 array as float32 (exact); anything else as it is."""
    if x is None or x.dtype != np.float16:
        return x
    return rowops.half_to_float(x)


def narrow(y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A float32 result rounded to float16, into `out` when it is a float16 buffer of y's shape."""
    return rowops.float_to_half(y, out)


class WidenedConstants:
    """The float32 copies of a kernel's constant (read-only) float16 operands, made on first use and kept: the
    weights of a float16 model are converted once, not on every run. Per-run values are widened each time.
    `transposed`: the copies are of the matrices' transposes, laid out contiguously (Gemm's transB weights, which
    BLAS reads much faster that way than as a transposed view)."""

    def __init__(self, transposed: bool = False) -> None:
        self._copies: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.transposed = transposed

    def _copy(self, a: np.ndarray) -> np.ndarray:
        copy = widen(a)
        return np.ascontiguousarray(copy.T) if self.transposed else copy

    def __call__(self, a: np.ndarray | None) -> np.ndarray | None:
        if a is None or a.dtype != np.float16 or a.flags.writeable:
            return a if a is None or a.dtype != np.float16 else self._copy(a)
        kept = self._copies.get(id(a))
        if kept is None or kept[0] is not a:
            if len(self._copies) >= _MAX_KEPT:
                self._copies.clear()
            copy = self._copy(a)
            copy.flags.writeable = False  # read-only like the constant: the float32 kernels may bind it as one
            kept = self._copies[id(a)] = (a, copy)  # the constant is held, so its id is not reused meanwhile
        return kept[1]
