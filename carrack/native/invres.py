"""The Python side of invres.c: MobileNetV2's inverted-residual block (1x1 expansion, depthwise 3x3, 1x1 projection,
optional residual) as one native call computed band by band of output rows, the intermediates in a per-thread
scratch that stays in the L2 cache.

`pack` makes a `PackedBlock` from the block's constant weights (the two 1x1 weights packed once into packconv.c's
panels, shared by a session's programs); its `run` computes the block for an input into a given buffer. The band
height and the threads are chosen per call (`plan_bands`); they change neither which elements are summed nor in
which order, so the results are the same bits at any thread count.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from carrack import native
from carrack.native import data_address
from carrack.native.convolution import MIN_TASK_WORK, Activation, _untyped
from carrack.onnx.tensors import aligned_empty

#: bytes of one thread's scratch a band aims at (the expanded and the depthwise rows): well inside a core's L2
BAND_BYTES = 512 * 1024
#: packconv.c's weight panel rows
PANEL_ROWS = 6
_F32 = np.dtype(np.float32)


def library() -> ctypes.CDLL | None:
    """invres.c compiled with its signatures declared, when it has vector code (None otherwise)."""
    lib = native.declared_library("invres", _declare)
    return lib if lib is not None and lib.invres_vectorized() else None


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.invres_vectorized.argtypes, lib.invres_vectorized.restype = [], i64
    lib.invres_scratch_floats.argtypes, lib.invres_scratch_floats.restype = [i64] * 7, i64
    lib.packconv_pack_weights.argtypes = [p, p, i64, i64, i64, i64]
    lib.packconv_pack_weights.restype = None
    lib.invres_f32_threads.argtypes = [p] * 9 + [i64] * 9 + [i64, f32, f32] * 3 + [i64]
    lib.invres_f32_threads.restype = i64


def packed_floats(rows: int, depth: int) -> int:
    """Floats of a [rows, depth] 1x1 weight packed into packconv.c's panels."""
    return -(-rows // PANEL_ROWS) * PANEL_ROWS * depth


@dataclass(frozen=True)
class Geometry:
    """The block's sizes: input [n, channels, height, width], expanded channels, output channels, stride."""

    n: int
    channels: int
    expanded: int
    out_channels: int
    height: int
    width: int
    stride: int

    @property
    def out_height(self) -> int:
        return (self.height - 1) // self.stride + 1

    @property
    def out_width(self) -> int:
        return (self.width - 1) // self.stride + 1

    def work(self) -> int:
        """Multiply-adds of one run (the thread split's measure)."""
        expand = self.height * self.width * self.channels * self.expanded
        rest = self.out_height * self.out_width * self.expanded * (9 + self.out_channels)
        return self.n * (expand + rest)


def plan_bands(g: Geometry, threads: int) -> tuple[int, int]:
    """(output rows a band, threads) for a run allowed `threads`: bands whose scratch fits BAND_BYTES, at least two
    bands a thread when more than one thread is worth using (each multiply-add share at least MIN_TASK_WORK); for
    one image, of the heights from half that size up, the one whose consecutive runs of bands (a thread's piece)
    hold the most even numbers of rows."""
    threads = max(1, min(threads, g.work() // MIN_TASK_WORK))
    row_bytes = 4 * g.expanded * (g.stride * g.width + g.out_width)
    band = max(1, min(g.out_height, BAND_BYTES // max(row_bytes, 1)))
    if threads > 1:
        wanted = -(-2 * threads // g.n)  # bands an image
        band = min(band, max(1, -(-g.out_height // wanted)))
        if g.n == 1:
            band = min(range(band, max(1, band // 2) - 1, -1), key=lambda b: _longest_piece(g.out_height, b, threads))
    bands = g.n * -(-g.out_height // band)
    return band, max(1, min(threads, bands))


def _longest_piece(rows: int, band: int, threads: int) -> int:
    """The most output rows a thread computes when `rows` go in bands of `band` and the pool cuts the bands into
    min(threads, bands) contiguous pieces as threadpool.c's run_pieces does (piece i: bands [count i / pieces,
    count (i + 1) / pieces))."""
    bands = -(-rows // band)
    pieces = min(threads, bands)
    ends = [min(rows, bands * i // pieces * band) for i in range(pieces + 1)]
    return max(b - a for a, b in zip(ends, ends[1:]))


class PackedBlock:
    """One inverted-residual block's constants, packed for invres.c."""

    def __init__(self, lib: ctypes.CDLL, weights: tuple[np.ndarray, ...], activations: tuple[Activation, ...],
                 stride: int, residual: bool):
        w_expand, b_expand, w_depthwise, b_depthwise, w_project, b_project = weights
        self.lib, self.stride, self.residual = lib, stride, residual
        self.expanded = w_depthwise.shape[0]
        self.channels = self.expanded if w_expand is None else w_expand.shape[1]
        self.out_channels = w_project.shape[0]
        self.expand = None if w_expand is None else _packed(lib, w_expand)  # None: the block has no expansion
        self.project = _packed(lib, w_project)
        self.depthwise = np.ascontiguousarray(w_depthwise, _F32).reshape(self.expanded, 9)
        self.biases = tuple(None if b is None else np.ascontiguousarray(b, _F32)
                            for b in (b_expand, b_depthwise, b_project))
        self.activation_args = tuple(v for act in activations for v in act)

    @property
    def nbytes(self) -> int:
        return (0 if self.expand is None else self.expand.nbytes) + self.project.nbytes

    def geometry(self, shape: tuple[int, ...]) -> Geometry | None:
        """The geometry for an input of `shape`, or None when the block does not take it."""
        if len(shape) != 4 or shape[1] != self.channels or min(shape) <= 0:
            return None
        return Geometry(shape[0], self.channels, self.expanded, self.out_channels, shape[2], shape[3], self.stride)

    def run(self, x: np.ndarray, out: np.ndarray, g: Geometry) -> bool:
        """out = the block of x (C-contiguous aligned float32 arrays of the geometry's shapes, not overlapping);
        False when the kernel did not run."""
        band, threads = plan_bands(g, native.threads())
        scratch = _scratch(self.lib.invres_scratch_floats(g.n, g.expanded, g.height, g.width, g.stride, band,
                                                               threads))
        (be, bd, bp), (wd, we, wp) = self.biases, (self.depthwise, self.expand, self.project)
        return self.lib.invres_f32_threads(
            data_address(x), _address(we), _address(be), data_address(wd), data_address(bd),
            data_address(wp), data_address(bp), data_address(out), data_address(scratch), g.n, g.channels,
            g.expanded, g.out_channels, g.height, g.width, g.stride, int(self.residual), band,
            *self.activation_args, threads) == 0

    def bind(self, x: np.ndarray, out: np.ndarray, g: Geometry) -> Callable[[], bool]:
        """`run(x, out, g)` for these very arrays as a call without arguments, its ctypes arguments converted once
        per thread count (the conversion of 29 arguments costs as much as the checks it spares: microseconds,
        against a block of 100-500). Its result: whether the kernel ran."""
        raw = _untyped(self.lib.invres_f32_threads)
        argtypes = self.lib.invres_f32_threads.argtypes
        by_threads: dict[int, tuple] = {}
        arrays = (self.expand, self.biases[0], self.depthwise, self.biases[1], self.project, self.biases[2])
        we, be, wd, bd, wp, bp = (_address(a) for a in arrays)
        xa, ya = data_address(x), data_address(out)

        def converted(allowed: int) -> tuple:
            band, threads = plan_bands(g, allowed)
            floats = self.lib.invres_scratch_floats(g.n, g.expanded, g.height, g.width, g.stride, band, threads)
            scratch = _scratch(floats)  # the binding thread's; a run in another thread gets its own
            args = (xa, we, be, wd, bd, wp, bp, ya, data_address(scratch), g.n, g.channels, g.expanded,
                    g.out_channels, g.height, g.width, g.stride, int(self.residual), band, *self.activation_args,
                    threads)
            return scratch, tuple(kind(value) for kind, value in zip(argtypes, args))

        def call() -> bool:
            allowed = native.threads()
            entry = by_threads.get(allowed)
            if entry is None or entry[0] is not getattr(_LOCAL, "scratch", None):
                entry = by_threads[allowed] = converted(allowed)
            return raw(*entry[1]) == 0
        call.arrays = (x, out, self)  # what the converted addresses point into
        return call


#: each Python thread's scratch, shared by every block it runs (sessions may run in several threads at once): one
#: buffer that stays in the caches from block to block
_LOCAL = threading.local()


def _scratch(floats: int) -> np.ndarray:
    buf = getattr(_LOCAL, "scratch", None)
    if buf is None or buf.size < floats:
        buf = _LOCAL.scratch = aligned_empty((floats,), _F32)
    return buf


def _address(a: np.ndarray | None) -> int | None:
    return None if a is None else data_address(a)


def _packed(lib: ctypes.CDLL, w: np.ndarray) -> np.ndarray:
    rows, depth = w.shape[:2]
    w = np.ascontiguousarray(w, _F32)
    panels = aligned_empty((packed_floats(rows, depth),), _F32)
    lib.packconv_pack_weights(data_address(w), data_address(panels), 1, rows, depth, 1)
    return panels


def pack(weights: tuple[np.ndarray, ...], activations: tuple[Activation, ...], stride: int, residual: bool
         ) -> PackedBlock | None:
    """The block's constants packed (shared by the kernels of every program made for these very arrays), or None
    when invres.c is not available."""
    lib = library()
    if lib is None:
        return None
    build = lambda: PackedBlock(lib, weights, activations, stride, residual)  # noqa: E731
    if weights[0] is None:  # no expansion: not shared (native.prepared keys by the arrays)
        return build()
    return native.prepared(f"invres{activations}{stride}{residual}", weights, build)


def scratch_bytes(g: Geometry, threads: int) -> int:
    """Bytes of scratch a run with `threads` allowed uses (what the memory plan counts)."""
    lib = library()
    band, used = plan_bands(g, threads)
    if lib is None:
        return 0
    return 4 * lib.invres_scratch_floats(g.n, g.expanded, g.height, g.width, g.stride, band, used)
