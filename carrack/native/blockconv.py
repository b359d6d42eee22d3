"""The Python side of blockconv.c: float32 convolutions on channel-blocked tensors ([N, C/16, H, W, 16], onnxruntime's
NCHWc with blocks of 16), and the reorders between that layout and NCHW.

`pack_weights` lays a [OC, IC, KH, KW] weight out as the kernel reads it ([OC/16, IC/16, KH, KW, 16 ic, 16 oc]);
`convolve` runs one convolution into a given buffer; `reorder` converts a tensor either way. The numpy twins
(`to_blocked`, `from_blocked`) are what the kernels must agree with and what runs where the library is missing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from carrack import native
from carrack.native import convolution, data_address
from carrack.native.convolution import Activation, _untyped
from carrack.onnx.tensors import aligned_empty

#: channels of a block (the vector lanes of one pixel)
BLOCK = 16
#: output blocks a tile computes (and a packed weight group holds)
GROUP_BLOCKS = 4
_F32 = np.dtype(np.float32)


def library() -> ctypes.CDLL | None:
    """blockconv.c compiled with its signatures declared (any variant: the portable one runs scalar C), or None."""
    return native.declared_library("blockconv", _declare)


def vectorized() -> bool:
    """Whether blockconv.c has its AVX-512 tile here (the layout pass only rewrites a graph where it has)."""
    lib = library()
    return lib is not None and bool(lib.blockconv_vectorized())


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.blockconv_vectorized.argtypes, lib.blockconv_vectorized.restype = [], i64
    lib.blockconv_f32_threads.argtypes = [p] * 5 + [i64] * 15 + [i64, f32, f32, i64]
    lib.blockconv_f32_threads.restype = i64
    lib.blockconv_reorder_threads.argtypes = [p, p, i64, i64, i64, i64, i64]
    lib.blockconv_reorder_threads.restype = i64


def to_blocked(x: np.ndarray) -> np.ndarray:
    """[N, C, H, W] -> [N, C/16, H, W, 16] (numpy)."""
    n, c, h, w = x.shape
    return np.ascontiguousarray(x.reshape(n, c // BLOCK, BLOCK, h, w).transpose(0, 1, 3, 4, 2))


def from_blocked(x: np.ndarray) -> np.ndarray:
    """[N, C/16, H, W, 16] -> [N, C, H, W] (numpy)."""
    n, cb, h, w, _ = x.shape
    return np.ascontiguousarray(x.transpose(0, 1, 4, 2, 3)).reshape(n, cb * BLOCK, h, w)


def pack_weights(w: np.ndarray) -> np.ndarray:
    """[OC, IC, KH, KW] float32 (channels multiples of 16) as blockconv.c reads it, 64-byte aligned: groups of up to
    GROUP_BLOCKS output blocks, each [IC/16, KH, KW, 16 ic, blocks x 16 oc] (one contiguous stream per group)."""
    oc, ic, kh, kw = w.shape
    packed = aligned_empty((w.size,), _F32)
    w = w.astype(_F32, copy=False)
    start = 0
    for first in range(0, oc, GROUP_BLOCKS * BLOCK):
        rows = w[first:first + GROUP_BLOCKS * BLOCK]
        part = rows.reshape(rows.shape[0], ic // BLOCK, BLOCK, kh, kw).transpose(1, 3, 4, 2, 0)
        packed[start:start + rows.size] = part.reshape(-1)
        start += rows.size
    return packed


@dataclass(frozen=True)
class Geometry:
    """One blocked convolution's sizes (2-D, group 1): input [n, in_channels/16, height, width, 16], kernel, strides,
    the top and left pads, dilations and the output map."""

    n: int
    in_channels: int
    height: int
    width: int
    out_channels: int
    out_height: int
    out_width: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[int, int]
    dilations: tuple[int, int]

    @property
    def out_shape(self) -> tuple[int, int, int, int, int]:
        return self.n, self.out_channels // BLOCK, self.out_height, self.out_width, BLOCK

    def work(self) -> int:
        """Multiply-adds of one run."""
        return (self.n * self.out_height * self.out_width * self.out_channels * self.in_channels
                * self.kernel[0] * self.kernel[1])

    def args(self) -> tuple[int, ...]:
        """The kernel's size arguments, in its order."""
        return (self.n, self.in_channels, self.height, self.width, self.out_channels, self.out_height,
                self.out_width, *self.kernel, *self.strides, *self.pads, *self.dilations)


def geometry(x_shape: tuple[int, ...], out_channels: int, kernel: tuple[int, int], strides: tuple[int, int],
             pads: tuple[int, int, int, int], dilations: tuple[int, int]) -> Geometry | None:
    """The geometry of a blocked input of `x_shape` ([N, C/16, H, W, 16]) with ONNX pads (top, left, bottom, right),
    or None when the shape is not a blocked map or the output would be empty."""
    if len(x_shape) != 5 or x_shape[4] != BLOCK or min(x_shape) <= 0:
        return None
    n, blocks, h, w, _ = x_shape
    out = [(size + pads[a] + pads[a + 2] - dilations[a] * (kernel[a] - 1) - 1) // strides[a] + 1
           for a, size in enumerate((h, w))]
    if min(out) <= 0:
        return None
    return Geometry(n, blocks * BLOCK, h, w, out_channels, out[0], out[1], kernel, strides, pads[:2], dilations)


def threads_for(work: int, allowed: int) -> int:
    """Threads worth using for `work` multiply-adds (each at least the convolutions' MIN_TASK_WORK)."""
    return max(1, min(allowed, work // convolution.MIN_TASK_WORK))


def convolve(lib: ctypes.CDLL, x: np.ndarray, packed: np.ndarray, bias: np.ndarray | None,
             residual: np.ndarray | None, out: np.ndarray, g: Geometry, activation: Activation) -> bool:
    """out = act(conv(x) + bias + residual) on blocked C-contiguous float32 arrays; False when the kernel refused."""
    threads = threads_for(g.work(), native.threads())
    return lib.blockconv_f32_threads(
        data_address(x), data_address(packed), _address(bias), _address(residual), data_address(out), *g.args(),
        *activation, threads) == 0


def bind_convolve(lib: ctypes.CDLL, x: np.ndarray, packed: np.ndarray, bias: np.ndarray | None,
                  residual: np.ndarray | None, out: np.ndarray, g: Geometry, activation: Activation
                  ) -> Callable[[], bool]:
    """`convolve` for these very arrays as a call without arguments, its ctypes arguments converted once per thread
    count. Its result: whether the kernel ran."""
    raw = _untyped(lib.blockconv_f32_threads)
    argtypes = lib.blockconv_f32_threads.argtypes
    addresses = (data_address(x), data_address(packed), _address(bias), _address(residual), data_address(out))
    by_threads: dict[int, tuple] = {}

    def call() -> bool:
        allowed = native.threads()
        args = by_threads.get(allowed)
        if args is None:
            values = (*addresses, *g.args(), *activation, threads_for(g.work(), allowed))
            args = by_threads[allowed] = tuple(kind(v) for kind, v in zip(argtypes, values))
        return raw(*args) == 0
    call.arrays = (x, packed, bias, residual, out)  # what the converted addresses point into
    return call


def reorder(lib: ctypes.CDLL, src: np.ndarray, dst: np.ndarray, to_blocked: bool) -> bool:
    """dst = src in the other layout (NCHW <-> blocked; both C-contiguous float32, channels a multiple of 16)."""
    plain = src if to_blocked else dst
    n, c = plain.shape[:2]
    pixels = int(np.prod(plain.shape[2:], dtype=np.int64))
    threads = threads_for(plain.size * 8, native.threads())  # a copy: far cheaper per element than a product
    return lib.blockconv_reorder_threads(data_address(src), data_address(dst), n, c, pixels, int(to_blocked),
                                         threads) == 0


def _address(a: np.ndarray | None) -> int | None:
    return None if a is None else data_address(a)
