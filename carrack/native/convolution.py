"""The native convolution kernels (dwconv.c, convgemm.c, packconv.c) behind carrack.ops.conv, with their fused bias and
activation. On AVX-512, every 1-D and 2-D convolution but the depthwise ones runs on packconv.c's weights packed once
(`bind("packed")`, or packed per call for weights that are not constants); convgemm.c's direct, im2col and 1x1
kernels serve what packconv declines (N-D convolutions, operands it cannot read in place), and numpy's BLAS the
variants without AVX-512.

`load()` gives the kernels (None when native kernels are off or cannot be built): a convolution kernel calls it once
at setup. Each method returns None (or False) when it cannot serve a call (a case the C code does not cover) and the
caller keeps its numpy path. Results are written into `out` when it is a usable buffer (C-contiguous, aligned,
writable float32 of the result's shape, not overlapping an input), else into a fresh array. These calls are made per
layer of small networks, where Python overhead is a real share of the time: they avoid numpy calls that cost
microseconds (np.prod, ctypes objects) on the way.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from carrack import native
from carrack.native import data_address

#: activation codes of the C kernels (the numpy side keeps its own functions for the rest, e.g. Tanh, Gelu)
ACTIVATIONS = {"": 0, "Relu": 1, "Clip": 2, "LeakyRelu": 3, "HardSigmoid": 4, "HardSwish": 5, "Sigmoid": 6}
#: multiply-adds a thread should get at least before work is split: ~10-20 us of work, against the 1-5 us a hand-off
#: to a spinning pool worker costs (more when it has gone to sleep)
MIN_TASK_WORK = 1 << 19
#: a depthwise multiply-add costs several of the products': dwconv.c does 12-24 G of them a second on one core (one
#: multiply-add per loaded vector, memory-bound on large maps), the packed tile 60-100 G. Its work counts this many
#: times, so that its small layers (mobilenetv2's 14x14 and 7x7 ones, 30-60 us) split by the same measure of time
DEPTHWISE_WORK_SCALE = 6
GEMM_ROWS, GEMM_PIXELS = 6, 64  # convgemm.c's tile (packconv.c's too)
_INT32_MAX = 2**31 - 1

Activation = tuple[int, float, float]  # (code, alpha, beta)
NO_ACTIVATION: Activation = (0, 0.0, 0.0)

_F32 = np.dtype(np.float32)
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


def _declare(lib: ctypes.CDLL, name: str, restype, *argtypes) -> None:
    fn = getattr(lib, name)
    fn.argtypes = list(argtypes)
    fn.restype = restype


def load() -> NativeConvolution | None:
    """The native convolution kernels, or None (native kernels off, no compiler, build failed)."""
    dw, gemm = native.library("dwconv"), native.library("convgemm")
    if dw is None or gemm is None:
        return None
    kernels = getattr(gemm, "carrack_convolution", None)
    if kernels is None or kernels.dw is not dw:
        kernels = NativeConvolution(dw, gemm)
        gemm.carrack_convolution = kernels
    return kernels


def _threads(count: int, work_per_item: int) -> int:
    """The threads worth using for `count` items of `work_per_item` multiply-adds each: at most the run's count
    (native.threads()), each with at least MIN_TASK_WORK of work."""
    total = count * work_per_item
    if total < 2 * MIN_TASK_WORK:  # not worth asking for the thread count
        return 1
    return max(1, min(native.threads(), count, total // MIN_TASK_WORK))


def _depthwise_work(multiplier: int, oh: int, ow: int, kh: int, kw: int) -> int:
    """One input plane's work for the thread split, in the products' multiply-adds (DEPTHWISE_WORK_SCALE)."""
    return DEPTHWISE_WORK_SCALE * multiplier * oh * ow * kh * kw


def _run(fn, count: int, work_per_item: int, head: tuple, tail: tuple):
    """fn(*head, 0, count, *tail, threads): a kernel's `_threads` entry point over all its items, which the C code
    splits over the thread pool; fn's result."""
    return fn(*head, 0, count, *tail, _threads(count, work_per_item))


def _usable(out: np.ndarray | None, shape: tuple[int, ...], *inputs: np.ndarray) -> bool:
    if out is None or out.shape != shape or out.dtype != _F32:
        return False
    flags = out.flags
    if not (flags.c_contiguous and flags.aligned and flags.writeable):
        return False
    for a in inputs:
        if np.may_share_memory(out, a):
            return False
    return True


def _residual_fits(z: np.ndarray, like: np.ndarray | tuple[int, ...]) -> bool:
    """Whether z can be read as the residual of a result: float32, aligned, of its shape (and strides, for an
    array; C-contiguous for a shape)."""
    if z.dtype != _F32 or not z.flags.aligned:
        return False
    if isinstance(like, np.ndarray):
        return z.shape == like.shape and all(a == b for a, b, d in zip(z.strides, like.strides, z.shape) if d > 1)
    return z.shape == like and z.flags.c_contiguous


def _operand(a: np.ndarray) -> np.ndarray:
    """a as a C-contiguous aligned float32 array (a copy only when it is not one)."""
    flags = a.flags
    return a if flags.c_contiguous and flags.aligned and a.dtype == _F32 else np.require(a, _F32, ("C", "A"))


def _bias(bias: np.ndarray | None, m: int) -> tuple[np.ndarray | None, bool]:
    """(bias as contiguous float32 [m], usable)."""
    if bias is None:
        return None, True
    bias = _operand(bias)
    return bias, bias.size == m and bias.ndim == 1


def address(a: np.ndarray | None) -> int | None:
    """a's data address (None for None)."""
    return None if a is None else data_address(a)


class NativeConvolution:
    """The loaded libraries, with the argument types declared."""

    def __init__(self, dw: ctypes.CDLL, gemm: ctypes.CDLL):
        self.dw, self.gemm_lib = dw, gemm
        # each kernel's `_threads` entry point: its arguments, then the thread count to split [begin, end) over
        _declare(dw, "dwconv2d_f32_threads", _i64, _ptr, _ptr, _ptr, _ptr, *[_i64] * 17, _f32, _f32, _i64)
        _declare(dw, "bias_act_f32_threads", None, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _i64)
        _declare(dw, "pool2d_f32_threads", _i64, _ptr, _ptr, *[_i64] * 17, _i64)
        _declare(dw, "plane_mean_f32_threads", None, _ptr, _ptr, _i64, _i64, _i64, _i64)
        _declare(dw, "scale_shift_act_f32_threads", None, _ptr, _ptr, _ptr, _ptr, *[_i64] * 5, _f32, _f32, _i64)
        _declare(gemm, "convgemm_f32_threads", None, _ptr, _ptr, _ptr, _ptr, _ptr, *[_i64] * 13, _f32, _f32, _i64)
        _declare(gemm, "im2col_f32_threads", None, _ptr, _ptr, *[_i64] * 16, _i64)
        _declare(gemm, "dconv_f32_threads", _i64, _ptr, _ptr, _ptr, _ptr, _ptr, *[_i64] * 19, _f32, _f32, _i64)
        _declare(gemm, "dconv_tiles_f32", _i64, *[_i64] * 5)
        self._dwconv, self._bias_act = dw.dwconv2d_f32_threads, dw.bias_act_f32_threads
        self._gemm, self._pool = gemm.convgemm_f32_threads, dw.pool2d_f32_threads
        self._im2col, self._mean = gemm.im2col_f32_threads, dw.plane_mean_f32_threads
        self._dconv, self._dconv_tiles = gemm.dconv_f32_threads, gemm.dconv_tiles_f32
        self._scale_shift = dw.scale_shift_act_f32_threads
        _declare(gemm, "matmul_f32_vectorized", _i64)
        # convgemm.c's products and direct convolution have vector code for AVX-512 only: elsewhere (the avx2 and
        # portable variants) numpy's BLAS is several times faster, so they decline and the numpy path runs
        self.products = bool(gemm.matmul_f32_vectorized())
        self._packconv = self._pack_weights = None
        self._packed: dict[tuple[int, int], tuple[weakref.ref, np.ndarray]] = {}
        packconv = native.library("packconv")
        if packconv is not None:
            _declare(packconv, "packconv_vectorized", _i64)
            if packconv.packconv_vectorized():
                _declare(packconv, "packconv_weights_size", _i64, _i64, _i64, _i64)
                _declare(packconv, "packconv_pack_weights", None, _ptr, _ptr, _i64, _i64, _i64, _i64)
                _declare(packconv, "packconv_f32_threads", _i64, _ptr, _ptr, _ptr, _ptr, _ptr, *[_i64] * 19, _f32,
                         _f32, _i64)
                self._packconv, self._pack_weights = packconv.packconv_f32_threads, packconv
        #: whether packconv.c's convolution on packed weights runs here (AVX-512 only)
        self.packs = self._packconv is not None

    def packed_weight_bytes(self, w_shape: Sequence[int], group: int) -> int:
        """Bytes of `packed_weights` for weights shaped w_shape [M, C / group, ...] (0 without packconv)."""
        if not self.packs:
            return 0
        m = w_shape[0]
        return 4 * self._pack_weights.packconv_weights_size(group, m // group, math.prod(w_shape[1:]))

    def packed_weights(self, w: np.ndarray, group: int, keep: bool = True) -> np.ndarray:
        """w[M, C / group, KH, KW] (C-contiguous float32) in packconv.c's panels; with `keep` (constant weights
        only: a writable array may change) packed once per weight array and group count, kept while w lives."""
        key = (id(w), group)
        known = self._packed.get(key) if keep else None
        if known is not None and known[0]() is w:
            return known[1]
        m, cg = w.shape[:2]
        taps = math.prod(w.shape[2:])
        lib = self._pack_weights
        wp = np.empty(lib.packconv_weights_size(group, m // group, cg * taps), _F32)
        lib.packconv_pack_weights(data_address(w), data_address(wp), group, m // group, cg, taps)
        if not keep:
            return wp
        packed = self._packed
        packed[key] = (weakref.ref(w, lambda _, key=key: packed.pop(key, None)), wp)
        return wp

    def bind(self, kind: str, x_shape: tuple[int, ...], w: np.ndarray, bias: np.ndarray | None,
             strides: Sequence[int], pads: Sequence[int], dilations: Sequence[int], group: int,
             activation: Activation, keep: bool = True) -> BoundConvolution | None:
        """The `kind` ("pointwise", "direct", "depthwise" or "packed") convolution of inputs shaped x_shape by these
        constant weights (C-contiguous float32; bias too, [M]) bound once, as `pointwise`, `direct` and `depthwise`
        would run it (2-D for direct and depthwise, unit strides and no pads for pointwise), or "packed": any 1-D or
        2-D convolution on weights packed once (packconv.c; `keep`: see packed_weights); None when it does not
        apply."""
        if (kind != "depthwise" and not self.products) or (kind == "packed" and not self.packs):
            return None
        for a in (w, bias):
            if a is not None and (a.dtype != _F32 or not a.flags.c_contiguous or not a.flags.aligned):
                return None
        n, c = x_shape[:2]
        m = w.shape[0]
        if (bias is not None and bias.shape != (m,)) or min(pads, default=0) < 0 or n * c * m == 0:
            return None
        if kind == "pointwise":
            pixels = math.prod(x_shape[2:])
            if c % group or m % group or w.size != m * (c // group) or pixels == 0:
                return None
            mg, kg = m // group, c // group
            tiles = n * group * -(-mg // GEMM_ROWS) * -(-pixels // GEMM_PIXELS)
            middle = (n, group, mg, kg, pixels, c * pixels, pixels, m * pixels, pixels, kg)
            return BoundConvolution(self._gemm, w, bias, x_shape, (n, m) + x_shape[2:], middle, tiles,
                                    GEMM_ROWS * GEMM_PIXELS * max(kg, 1), activation, True, False)
        if kind == "packed" and len(x_shape) == 3 == w.ndim and len(pads) == 2:  # 1-D: an image of height 1
            h, wd, cg, kh, kw = 1, x_shape[2], w.shape[1], 1, w.shape[2]
            (sh, sw), (dh, dw), pads = (1, strides[0]), (1, dilations[0]), (0, pads[0], 0, pads[1])
        elif len(x_shape) != 4 or w.ndim != 4:
            return None
        else:
            h, wd = x_shape[2:]
            _, cg, kh, kw = w.shape
            (sh, sw), (dh, dw) = strides, dilations
        oh = (h + pads[0] + pads[2] - (kh - 1) * dh - 1) // sh + 1
        ow = (wd + pads[1] + pads[3] - (kw - 1) * dw - 1) // sw + 1
        if min(oh, ow, kh * kw) <= 0:
            return None
        if kind == "direct":
            if cg * group != c or m % group or sw > 2:
                return None
            tiles = n * group * -(-(m // group) // GEMM_ROWS) * self._dconv_tiles(oh, ow, wd, sh, sw)
            middle = (n, group, m // group, cg, h, wd, kh, kw, oh, ow, sh, sw, dh, dw, pads[0], pads[1])
            return BoundConvolution(self._dconv, w, bias, x_shape, (n, m, oh, ow), middle, tiles,
                                    GEMM_ROWS * GEMM_PIXELS * cg * kh * kw, activation, True, True)
        if kind == "packed":
            # packconv.c works out input positions in 32-bit lanes
            reach = (h * wd, oh * ow, h + pads[0] + pads[2], wd + pads[1] + pads[3], oh * sh, ow * sw, kh * dh, kw * dw)
            if cg * group != c or m % group or max(reach) > _INT32_MAX // 4:
                return None
            panels, row_panels = -(-(oh * ow) // GEMM_PIXELS), -(-(m // group) // GEMM_ROWS)
            middle = (n, group, m // group, cg, h, wd, kh, kw, oh, ow, sh, sw, dh, dw, pads[0], pads[1])
            # items: pixel panels; the C code splits the output rows too when they are fewer than the threads
            tile_work = GEMM_ROWS * GEMM_PIXELS * cg * kh * kw
            y_shape = (n, m, oh, ow) if len(x_shape) == 4 else (n, m, ow)
            return BoundConvolution(self._packconv, w, bias, x_shape, y_shape, middle, n * group * panels,
                                    row_panels * tile_work, activation, True, True,
                                    self.packed_weights(w, group, keep),
                                    (n * group * panels * row_panels, tile_work))
        if kind == "depthwise" and cg == 1 and group == c and m % c == 0:
            middle = (c, m // c, h, wd, kh, kw, oh, ow, sh, sw, dh, dw, pads[0], pads[1])
            return BoundConvolution(self._dwconv, w, bias, x_shape, (n, m, oh, ow), middle, n * c,
                                    _depthwise_work(m // c, oh, ow, kh, kw), activation, False, True)
        return None

    def packed(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None,
               strides: Sequence[int], pads: Sequence[int], dilations: Sequence[int], group: int,
               activation: Activation = NO_ACTIVATION, z: np.ndarray | None = None) -> np.ndarray | None:
        """y = act(conv(x[N, C, H, W], w[M, C / group, KH, KW]) + bias + z) on weights packed for this call only
        (weights that are not constants may change between calls); None when packconv.c cannot do it (z, when
        given: C-contiguous float32 of y's shape)."""
        if not self.packs or x.dtype != _F32 or w.dtype != _F32 or x.ndim != 4 or w.ndim != 4 or min(pads) < 0:
            return None
        b, ok = _bias(bias, w.shape[0])
        if not ok:
            return None
        bound = self.bind("packed", x.shape, _operand(w), b, strides, pads, dilations, group, activation, keep=False)
        # the bound call compares dtypes by identity: an equal dtype object (e.g. unpickled) is viewed as numpy's own
        x = _operand(x).view(_F32)
        z = z if z is None or z.dtype != _F32 else z.view(_F32)
        return None if bound is None else bound(x, out, z)

    def depthwise(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None,
                  strides: Sequence[int], pads: Sequence[int], dilations: Sequence[int],
                  activation: Activation = NO_ACTIVATION) -> np.ndarray | None:
        """y[N, C * k, OH, OW] = act(depthwise conv(x[N, C, H, W], w[C * k, 1, KH, KW]) + bias), pads >= 0 in
        ONNX order [top, left, bottom, right]; None when the native kernel cannot do it."""
        if x.dtype != _F32 or w.dtype != _F32 or x.ndim != 4 or w.ndim != 4 or min(pads) < 0:
            return None
        n, c, h, wd = x.shape
        m, cg, kh, kw = w.shape
        if cg != 1 or c == 0 or m % c or kh * kw == 0:
            return None
        (sh, sw), (dh, dw) = strides, dilations
        oh = max(0, (h + pads[0] + pads[2] - (kh - 1) * dh - 1) // sh + 1)
        ow = max(0, (wd + pads[1] + pads[3] - (kw - 1) * dw - 1) // sw + 1)
        b, ok = _bias(bias, m)
        if not ok:
            return None
        x, w = _operand(x), _operand(w)
        shape = (n, m, oh, ow)
        y = out if _usable(out, shape, x) else np.empty(shape, _F32)
        if y.size == 0:
            return y
        head = (address(x), address(w), address(b), data_address(y), c, m // c, h, wd, kh, kw, oh, ow, sh, sw,
                dh, dw, pads[0], pads[1])
        failed = _run(self._dwconv, n * c, _depthwise_work(m // c, oh, ow, kh, kw), head, activation)
        return None if failed else y

    def gemm(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, y: np.ndarray, groups: int,
             activation: Activation = NO_ACTIVATION, constants: tuple[int | None, int | None] | None = None,
             z: np.ndarray | None = None) -> bool:
        """y[N, G * Mg, P] = act(w[G * Mg, Kg] @ x[N, G * Kg, P] (group by group) + bias + z) for aligned float32
        arrays whose last axis is contiguous (y writable, not overlapping x, w or z; z, when given, strided like
        y); False when not done. `constants`: the addresses of w and bias when the caller has them (from `address`
        of the arrays it was given: views made per call, such as reshapes, have none worth remembering)."""
        for a in (x, w, y):
            if a.dtype != _F32 or a.strides[-1] != 4 or not a.flags.aligned:
                return False
        if z is not None and not _residual_fits(z, y):
            return False
        n, k, pixels = x.shape
        m, kg = w.shape
        b, ok = _bias(bias, m)
        if not ok or not y.flags.writeable or y.shape != (n, m, pixels) or k != kg * groups or m % groups:
            return False
        if y.size == 0:
            return True
        xs, ys = x.strides, y.strides
        tiles = n * groups * -(-(m // groups) // GEMM_ROWS) * -(-pixels // GEMM_PIXELS)
        wa, ba = constants or (address(w), address(b))
        head = (address(x), wa, ba, data_address(y), address(z), n, groups, m // groups, kg, pixels, xs[0] >> 2,
                xs[1] >> 2,
                ys[0] >> 2, ys[1] >> 2, w.strides[0] >> 2)
        _run(self._gemm, tiles, GEMM_ROWS * GEMM_PIXELS * max(kg, 1), head, activation)
        return True

    def pointwise(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None,
                  groups: int, activation: Activation = NO_ACTIVATION, z: np.ndarray | None = None
                  ) -> np.ndarray | None:
        """y[N, M, *spatial] = act(1x1 convolution of x[N, C, *spatial] with w[M, C / groups, 1...] + bias + z);
        None when the native kernel cannot do it (z, when given: C-contiguous float32 of y's shape)."""
        if not self.products or x.dtype != _F32 or w.dtype != _F32 or x.ndim < 3:
            return None
        n, c = x.shape[:2]
        m = w.shape[0]
        x, w = _operand(x), _operand(w)
        b, ok = _bias(bias, m)
        if not ok:
            return None
        shape = (n, m) + x.shape[2:]
        if z is not None and not _residual_fits(z, shape):
            return None
        y = out if _usable(out, shape, x, w, *(() if z is None else (z,))) else np.empty(shape, _F32)
        pixels = math.prod(x.shape[2:])
        if not self.gemm(x.reshape(n, c, pixels), w.reshape(m, -1), b, y.reshape(n, m, pixels), groups, activation,
                         (address(w), address(b)), None if z is None else z.reshape(n, m, pixels)):
            return None
        return y

    def bias_activation(self, y: np.ndarray, bias: np.ndarray | None, activation: Activation) -> bool:
        """y[N, C, *spatial] = act(y + bias[C]) in place, in one pass; False when the native kernel cannot."""
        if y.dtype != _F32 or not y.flags.c_contiguous or not y.flags.aligned or not y.flags.writeable or y.ndim < 2:
            return False
        b, ok = _bias(bias, y.shape[1])
        if not ok:
            return False
        planes = y.shape[0] * y.shape[1]
        size = y.size // planes if planes else 0
        _run(self._bias_act, planes, size * 4, (data_address(y), address(b), y.shape[1], size), activation)
        return True

    def scale_shift(self, x: np.ndarray, scale: np.ndarray, shift: np.ndarray, activation: Activation,
                    out: np.ndarray | None = None) -> np.ndarray | None:
        """act(x[N, C, *spatial] * scale[C] + shift[C]) in one pass (scale and shift: contiguous float32 [C]);
        None when the native kernel cannot."""
        if x.dtype != _F32 or x.ndim < 2 or scale.size != x.shape[1] or shift.size != x.shape[1]:
            return None
        x = _operand(x)
        y = out if _usable(out, x.shape, x) else np.empty(x.shape, _F32)
        planes = x.shape[0] * x.shape[1]
        size = x.size // planes if planes else 0
        _run(self._scale_shift, planes, size * 2,
             (data_address(x), data_address(y), address(scale), address(shift), x.shape[1], size), activation)
        return y

    def direct(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None,
               strides: Sequence[int], pads: Sequence[int], dilations: Sequence[int], group: int,
               activation: Activation = NO_ACTIVATION, z: np.ndarray | None = None) -> np.ndarray | None:
        """y = act(conv(x[N, C, H, W], w[M, C / group, KH, KW]) + bias + z) read straight from the image (no
        columns) for column strides 1 and 2; None when the native kernel cannot do it (z, when given: C-contiguous
        float32 of y's shape)."""
        if (not self.products or x.dtype != _F32 or w.dtype != _F32 or x.ndim != 4 or w.ndim != 4 or strides[1] > 2
                or min(pads) < 0):
            return None
        n, c, h, wd = x.shape
        m, cg, kh, kw = w.shape
        (sh, sw), (dh, dw) = strides, dilations
        oh = (h + pads[0] + pads[2] - (kh - 1) * dh - 1) // sh + 1
        ow = (wd + pads[1] + pads[3] - (kw - 1) * dw - 1) // sw + 1
        b, ok = _bias(bias, m)
        if not ok or cg * group != c or m % group or min(oh, ow, n, m, kh * kw) <= 0:
            return None
        x, w = _operand(x), _operand(w)
        shape = (n, m, oh, ow)
        if z is not None and not _residual_fits(z, shape):
            return None
        y = out if _usable(out, shape, x, w, *(() if z is None else (z,))) else np.empty(shape, _F32)
        tiles = n * group * -(-(m // group) // GEMM_ROWS) * self._dconv_tiles(oh, ow, wd, sh, sw)
        head = (address(x), address(w), address(b), data_address(y), address(z), n, group, m // group, cg, h, wd, kh,
                kw, oh, ow, sh, sw, dh, dw, pads[0], pads[1])
        failed = _run(self._dconv, tiles, GEMM_ROWS * GEMM_PIXELS * cg * kh * kw, head, activation)
        return None if failed else y

    def im2col(self, image: np.ndarray, cols: np.ndarray, kernel: Sequence[int], out_width: int,
               strides: Sequence[int], dilations: Sequence[int], pads: Sequence[int], r0: int, r1: int) -> None:
        """cols[C * KH * KW, (r1 - r0) * OW] = the columns of output rows [r0, r1) of image[C, H, W] (C-contiguous
        aligned float32 arrays): what each kernel tap reads for each output, 0 in the padding."""
        c, h, w = image.shape
        (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
        head = (data_address(image), data_address(cols), c, h, w, kh, kw, out_width, sh, sw, dh, dw, pads[0], pads[1],
                r0, r1)
        _run(self._im2col, c * kh * kw, (r1 - r0) * out_width * 4, head, ())

    def pool(self, x: np.ndarray, kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int],
             pads: Sequence[int], out_shape: Sequence[int], mode: int) -> np.ndarray | None:
        """2-D pool of x[N, C, H, W] into [N, C, *out_shape]: mode POOL_MAX, POOL_AVERAGE (dividing by the taps
        inside the image) or POOL_AVERAGE_PADS (inside the image and its explicit `pads`); output windows past
        the end pads (ceil_mode) read padding. None when the native kernel cannot do it."""
        if x.dtype != _F32 or x.ndim != 4 or len(kernel) != 2 or min(pads) < 0:
            return None
        n, c, h, w = x.shape
        x = _operand(x)
        y = np.empty((n, c, *out_shape), _F32)
        if y.size == 0:
            return y
        oh, ow = out_shape
        (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
        head = (address(x), data_address(y), h, w, kh, kw, oh, ow, sh, sw, dh, dw, *pads)
        failed = _run(self._pool, n * c, oh * ow * kh * kw, head, (mode,))
        return None if failed else y

    def plane_mean(self, x: np.ndarray) -> np.ndarray | None:
        """The mean over the spatial axes of x[N, C, *spatial] (float32), as [N, C, 1, ...]; None when the native
        kernel cannot do it."""
        if x.dtype != _F32 or x.ndim < 3:
            return None
        x = _operand(x)
        planes = x.shape[0] * x.shape[1]
        size = x.size // planes if planes else 0
        y = np.empty(x.shape[:2] + (1,) * (x.ndim - 2), _F32)
        if size == 0 or planes == 0:
            return None if size == 0 and planes else y
        _run(self._mean, planes, size, (address(x), data_address(y), size), ())
        return y


class BoundConvolution:
    """One native convolution with its constants and geometry worked out once: a call checks the input, output
    and residual arrays it is given and passes their addresses, with the rest of the arguments ready made. Small
    networks run dozens of convolutions of a few microseconds each, where the general path's Python (routing,
    shape arithmetic, argument conversion) cost as much as the kernel.

    `fn(x, w, bias, y, [z,] *middle, begin, end, *activation, threads)`; `count` items of `work` multiply-adds each are
    split over threads; `failures`: fn returns nonzero when it could not run (out of memory)."""

    def __init__(self, fn, w: np.ndarray, bias: np.ndarray | None, x_shape: tuple[int, ...],
                 y_shape: tuple[int, ...], middle: tuple, count: int, work: int, activation: Activation,
                 residual: bool, failures: bool, packed: np.ndarray | None = None,
                 split: tuple[int, int] | None = None):
        self.fn, self.w, self.bias, self.packed = fn, w, bias, packed
        #: (items, work per item) the thread count is chosen for, when the kernel splits finer than `count` items
        self.split = (count, work) if split is None else split
        self.x_shape, self.y_shape = x_shape, y_shape
        self.constants = (data_address(w if packed is None else packed), address(bias))
        self.middle, self.count, self.work, self.activation = middle, count, work, activation
        self.residual, self.failures = residual, failures

    def __call__(self, x: np.ndarray, out: np.ndarray | None, z: np.ndarray | None) -> np.ndarray | None:
        """The result (in `out` when usable), or None when these arrays do not fit the binding."""
        if x.dtype is not _F32 or x.shape != self.x_shape or not x.flags.c_contiguous or not x.flags.aligned:
            return None
        if z is not None and (not self.residual or z.dtype is not _F32 or z.shape != self.y_shape
                              or not z.flags.c_contiguous or not z.flags.aligned):
            return None
        if (out is not None and out.dtype is _F32 and out.shape == self.y_shape and out.flags.c_contiguous
                and out.flags.aligned and out.flags.writeable and not np.may_share_memory(out, x)
                and (z is None or not np.may_share_memory(out, z))):
            y = out
        else:
            y = np.empty(self.y_shape, _F32)
        head = (data_address(x), *self.constants, data_address(y))
        if self.residual:
            head += (None if z is None else data_address(z),)
        failed = self.fn(*head, *self.middle, 0, self.count, *self.activation, _threads(*self.split))
        return None if self.failures and failed else y

    def bind_call(self, x: np.ndarray, out: np.ndarray, z: np.ndarray | None) -> Callable[[], bool] | None:
        """This call for these very arrays (a step bound to its arena: the same objects every run, only their
        contents change), its arguments converted to ctypes objects once: ctypes' per-argument conversion of a
        call's 24-27 arguments costs 2.5-4 us, as much as a small layer's arithmetic, and the checks above another
        2-4 us. Calling the result writes the result into `out` and returns whether the kernel ran (False: it ran
        out of memory, `out` holds nothing usable). None when the arrays do not fit the binding, `out` cannot take
        the result, or `fn` is not a plain ctypes function."""
        if x.dtype is not _F32 or x.shape != self.x_shape or not x.flags.c_contiguous or not x.flags.aligned:
            return None
        if z is not None and (not self.residual or z.dtype is not _F32 or z.shape != self.y_shape
                              or not z.flags.c_contiguous or not z.flags.aligned or np.may_share_memory(out, z)):
            return None
        if not (out.dtype is _F32 and out.shape == self.y_shape and out.flags.c_contiguous and out.flags.aligned
                and out.flags.writeable and not np.may_share_memory(out, x)):
            return None
        argtypes = getattr(self.fn, "argtypes", None)
        head = (data_address(x), *self.constants, data_address(out))
        if self.residual:
            head += (None if z is None else data_address(z),)
        args = (*head, *self.middle, 0, self.count, *self.activation, 1)
        if not isinstance(self.fn, ctypes._CFuncPtr) or argtypes is None or len(argtypes) != len(args):
            return None
        converted = [kind(value) for kind, value in zip(argtypes, args)]
        threads = converted[-1]
        raw = _untyped(self.fn)
        split, failures = self.split, self.failures

        def call() -> bool:
            threads.value = _threads(*split)
            return not (raw(*converted) and failures)
        call.arrays = (x, out, z, self.w, self.bias, self.packed)  # what the converted addresses point into
        return call


_UNTYPED: dict[int, ctypes._CFuncPtr] = {}


def _untyped(fn: ctypes._CFuncPtr) -> ctypes._CFuncPtr:
    """The same native function without argtypes, called with ready ctypes objects (no conversion per call)."""
    address = ctypes.cast(fn, ctypes.c_void_p).value
    raw = _UNTYPED.get(address)
    if raw is None:
        raw = _UNTYPED[address] = ctypes.CFUNCTYPE(fn.restype)(address)
    return raw


POOL_MAX, POOL_AVERAGE, POOL_AVERAGE_PADS = 0, 1, 2
