"""The Python side of rowlinear.c: a linear layer (product by a constant weight, bias, activation) for 1 to
MAX_ROWS rows in one native call, the weight packed once into rowlinear.c's panels.

At batch 1 numpy does a linear layer as three calls (the product, the bias add, the activation), each a few
microseconds of fixed cost; a small MLP's whole onnxruntime run is about that. `pack` makes a `PackedLinear` for a
constant weight (Gemm's B, MatMul's B) and bias; its `into` computes act(x @ W + bias) into a given buffer and its
`bind` gives that call for fixed arrays as a call without arguments (a step bound to its arena). The packed copy
counts in the memory plan (`packed_bytes`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from carrack import native
from carrack.native import data_address
from carrack.native.convolution import _threads
from carrack.native.packed import bound_call, packed
from carrack.onnx.tensors import aligned_empty

#: rows a call takes: the product keeps a vector of partial sums per row and panel in registers
MAX_ROWS = 4
#: output columns per packed panel (rowlinear.c's PANEL)
PANEL = 16
#: weights above this many bytes are not packed (the copy would double a large model's weights for batch-1 runs)
MAX_WEIGHT_BYTES = 4 << 20
#: activation codes (activations.h) that rowlinear.c applies, by ONNX operator name
ACTIVATIONS = {"": 0, "Relu": 1, "Clip": 2, "LeakyRelu": 3, "HardSigmoid": 4, "HardSwish": 5, "Sigmoid": 6,
               "Tanh": 7}
_F32 = np.dtype(np.float32)


def library() -> ctypes.CDLL | None:
    """rowlinear.c compiled, with its signatures declared (None when native kernels are unavailable)."""
    return native.declared_library("rowlinear", _declare)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.carrack_rowlinear_threads.argtypes = [p, i64, i64, p, p, p, i64, i64, i64, i64, p, i64]
    lib.carrack_rowlinear_threads.restype = None
    lib.carrack_rowlinear_panel.argtypes = []
    lib.carrack_rowlinear_panel.restype = i64
    lib.carrack_rowlinear_packed = packed(lib.carrack_rowlinear_threads, 12)


def packs(depth: int, columns: int) -> bool:
    """Whether a [depth, columns] float32 weight is packed for few-row products (not empty, not above
    MAX_WEIGHT_BYTES)."""
    return depth > 0 and columns > 0 and depth * columns * 4 <= MAX_WEIGHT_BYTES


def packed_bytes(depth: int, columns: int) -> int:
    """Bytes a `PackedLinear` of a [depth, columns] weight holds besides the weight: the panels and the bias."""
    padded = -(-columns // PANEL) * PANEL
    return (depth + 1) * padded * 4 + 8


class PackedLinear:
    """act(x @ W + bias) for x of 1..MAX_ROWS rows, W [depth, columns] packed into panels once."""

    __slots__ = ("panels", "bias", "params", "depth", "columns", "act", "kernel")

    def __init__(self, panels: np.ndarray, bias: np.ndarray, params: np.ndarray, act: int, columns: int, kernel):
        self.panels, self.bias, self.params, self.act, self.kernel = panels, bias, params, act, kernel
        self.columns, self.depth = columns, panels.shape[1]

    def into(self, x: np.ndarray, out: np.ndarray) -> bool:
        """out[rows, columns] = act(x[rows, depth] @ W + bias) for x of 1..MAX_ROWS rows of float32 (any layout: a
        non-contiguous, unaligned or byte-swapped x is copied first) and out a C-contiguous aligned writable
        float32 buffer not overlapping x; False when it does not apply (nothing written)."""
        if not self._fits(x, out):
            return False
        x = _plain(x)
        rows = x.shape[0]
        self.kernel(data_address(x), self.depth, rows, data_address(self.panels), data_address(self.bias),
                    data_address(out), self.columns, self.depth, self.columns, self.act, data_address(self.params),
                    self._threads(rows))
        return True

    def bind(self, x: np.ndarray, out: np.ndarray) -> Callable[[], None] | None:
        """`into(x, out)` for these very arrays as a call without arguments (their contents may change between
        calls, never their layout); None when it does not apply or x would need a copy."""
        if not self._fits(x, out) or _plain(x) is not x:
            return None
        rows = x.shape[0]
        call = bound_call(self.kernel, data_address(x), self.depth, rows, data_address(self.panels),
                          data_address(self.bias), data_address(out), self.columns, self.depth, self.columns,
                          self.act, data_address(self.params), self._threads(rows))
        call.operands = (self, x, out)  # the call holds their addresses: it keeps them alive
        return call

    def _fits(self, x: np.ndarray, out: np.ndarray) -> bool:
        return (type(x) is np.ndarray and x.ndim == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == self.depth
                and x.dtype.kind == "f" and x.dtype.itemsize == 4 and type(out) is np.ndarray and out.dtype == _F32
                and out.shape == (x.shape[0], self.columns) and out.flags.c_contiguous and out.flags.aligned
                and out.flags.writeable and not np.may_share_memory(out, x))

    def _threads(self, rows: int) -> int:
        return _threads(self.panels.shape[0], rows * self.depth * PANEL)


def _plain(x: np.ndarray) -> np.ndarray:
    """x as C-contiguous aligned native float32 (x itself when it is)."""
    if x.dtype == _F32 and x.flags.c_contiguous and x.flags.aligned:
        return x
    return np.require(x, _F32, ("C_CONTIGUOUS", "ALIGNED"))


def pack(weight: np.ndarray, bias: np.ndarray | None, transposed: bool,
         activation: tuple[int, float, float] = (0, 0.0, 0.0)) -> PackedLinear | None:
    """A PackedLinear of `weight` ([depth, columns], or [columns, depth] when `transposed`: Gemm's transB), a bias
    of `columns` values (or None) and an activation (code, alpha, beta) of ACTIVATIONS; None when the library is
    not loaded or the weight is not packed (`packs`)."""
    lib = library()
    w = weight.T if transposed else weight
    if lib is None or w.ndim != 2 or w.dtype != _F32 or not packs(*w.shape):
        return None
    depth, columns = w.shape
    count = -(-columns // PANEL)
    padded = np.zeros((depth, count * PANEL), _F32)
    padded[:, :columns] = w
    panels = aligned_empty((count, depth, PANEL), _F32)
    panels[...] = padded.reshape(depth, count, PANEL).transpose(1, 0, 2)
    full_bias = np.zeros(count * PANEL, _F32)
    if bias is not None:
        full_bias[:columns] = np.asarray(bias, _F32).reshape(-1)
    code, alpha, beta = activation
    return PackedLinear(panels, full_bias, np.array([alpha, beta], _F32), int(code), columns,
                        lib.carrack_rowlinear_packed)
