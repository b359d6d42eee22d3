"""Native kernels of quantized models (over qconv.c, and qgemm's int8 GEMM for the convolutions):

* QuantizedConv: 1-D/2-D convolution of 8-bit NCHW activations with a constant int8 weight, int32 accumulation and
  the requantized 8-bit output. Per image and group, output pixels go in tiles (A stays near the L2 cache and
  memory stays bounded): qconv.c writes the tile's rows A[p, (i, j, c)] (a plain transpose for 1x1 stride-1
  convolutions), qgemm multiplies them by the packed weight [K, Cout] and requantizes in its epilogue into a
  [pixels, Cout] block, and qconv.c transposes that into the NCHW output. The whole convolution is one native
  call and one parallel region (qconv_gemm_threads): each piece does all three steps for its tiles, so the threads
  meet once per convolution. Depthwise convolutions run qconv.c's direct kernel instead. Bit for bit the numpy
  path's result: the accumulator is the exact integer (wrapping like int32), requantized as
  clamp(rint(float32(acc) * multiplier) + zp).
* qlinear_add: QLinearAdd's float32 formula for same-shape operands, in one pass.
* quantize_8bit: QuantizeLinear's float32 per-tensor formula to uint8/int8, in one pass.
* dequantize_8bit: DequantizeLinear's float32 per-tensor formula from uint8/int8, in one pass.
* maxpool_8bit: MaxPool on uint8/int8 values.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import numpy as np

from carrack import native
from carrack.native import data_address, qgemm

#: bytes of A (im2col rows) per block: about the L2 cache (qgemm blocks it further); fewer, larger blocks also
#: spend less on Python per call
BLOCK_BYTES = 1 << 20
_ROW_ALIGN = 16  # block rows: whole 16-row tiles of the byte transposes
#: with several threads: pixels per tile, at least (fewer pixels per thread split the output channels instead), and
#: tiles per thread on big maps
_MIN_SPLIT_ROWS = 64
_TILES_PER_THREAD = 4
_AMX_STEP = 64  # bytes of depth per AMX tile product (qgemm.c)

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_SIGNATURES = {
    "qconv_transpose": ([_p, _i64, _i64, _i64, _p, _i64, _i32], None),
    "qconv_band_bytes": ([_p, _i64], _i64),
    "qconv_depthwise_scratch": ([_p], _i64),
    "qconv_depthwise": ([_p, _p, _i64, _i64, _i64, _p, _p, _p, _i32, _i32, _i32, _i32, _p, _p], None),
    "qconv_qlinear_add": ([_p, _p, _i64, ctypes.c_float, ctypes.c_float, ctypes.c_float, _i32, _i32, _p], None),
    "qconv_quantize": ([_p, _i64, ctypes.c_float, ctypes.c_float, _i32, _p], _i64),
    "qconv_pool_scratch": ([_p], _i64),
    "qconv_maxpool": ([_p, _p, _i64, _i64, _i32, _p, _p], None),
    # the `_threads` entry points: [begin, end) cut into `chunks` pieces run by up to `threads` threads
    "qconv_depthwise_threads": ([_p, _p, _i64, _i64, _i64, _p, _p, _p, _i32, _i32, _i32, _i32, _p, _i64, _p, _i64,
                                 _i64], None),
    "qconv_qlinear_add_threads": ([_p, _p, _i64, ctypes.c_float, ctypes.c_float, ctypes.c_float, _i32, _i32, _p, _i64,
                                   _i64], None),
    "qconv_maxpool_threads": ([_p, _p, _i64, _i64, _i32, _p, _i64, _p, _i64, _i64], None),
    "qconv_quantize_threads": ([_p, _i64, ctypes.c_float, ctypes.c_float, _i32, _p, _i64, _i64], _i64),
    "qconv_dequantize_threads": ([_p, _i64, ctypes.c_float, ctypes.c_float, _i32, _p, _i64, _i64], None),
    "qconv_gemm_threads": ([_p, _p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _i32, _i32, _i32, _i32, _i32, _i64,
                            _i64, _i64, _i64, _p, _p, _i64, _i64], _i64),
}
_declare = native.signature_declarer(_SIGNATURES)
#: elements per thread below which QLinearAdd stays on one thread
_ADD_SPLIT = 1 << 15
#: elements per thread below which QuantizeLinear / DequantizeLinear stay on one thread (~8 us of work)
_CONVERT_SPLIT = 1 << 15
_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))


def library() -> ctypes.CDLL | None:
    """qconv.c compiled, with its signatures declared (None when native kernels are unavailable)."""
    return native.declared_library("qconv", _declare)


def transpose_u8(src: np.ndarray, dst: np.ndarray, mask: int = 0) -> None:
    """dst[c, r] = src[r, c] ^ mask for 8-bit 2-D arrays with unit column strides (dst written in place)."""
    lib = library()
    rows, cols = src.shape
    lib.qconv_transpose(native.pointer(src), rows, cols, src.strides[0], native.pointer(dst), dst.strides[0], mask)


def qlinear_add(a: np.ndarray, b: np.ndarray, ka: np.float32, kb: np.float32, offset: np.float32,
                out_dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray | None:
    """clamp(rint(a * ka + b * kb + offset)) in float32, for same-shape 8-bit a and b (the QLinearAdd formula);
    None when the library is unavailable or the operands do not qualify (broadcasting, other types)."""
    lib = library()
    out_dtype = np.dtype(out_dtype)
    if lib is None or a.shape != b.shape or a.dtype != b.dtype or a.dtype not in _EIGHT_BIT \
            or out_dtype not in _EIGHT_BIT:
        return None
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    y = out if out is not None and out.shape == a.shape and out.dtype == out_dtype and out.flags.c_contiguous \
        else np.empty(a.shape, out_dtype)
    qlinear_add_call(a, b, ka, kb, offset, y)()
    return y


def qlinear_add_call(a: np.ndarray, b: np.ndarray, ka: np.float32, kb: np.float32, offset: np.float32,
                     y: np.ndarray) -> Callable[[], bool]:
    """`qlinear_add` on these very C-contiguous arrays (y: the result's 8-bit type) as a call without arguments
    (a bound step's; always True), split over the thread count of the run that makes it."""
    function, n = library().qconv_qlinear_add_threads, a.size
    head = (data_address(a), data_address(b), n, ka, kb, offset, int(a.dtype == np.int8))
    tail = (int(y.dtype == np.int8), data_address(y))

    def call(arrays=(a, b, y)) -> bool:  # the arrays stay alive while the call may run
        parts = max(1, min(native.threads(), n // _ADD_SPLIT))
        function(*head, *tail, parts, parts)
        return True
    return call


def quantize_8bit(x: np.ndarray, scale: np.float32, zero_point: np.float32, out_dtype: np.dtype,
                  out: np.ndarray | None = None) -> np.ndarray | None:
    """clamp(rint(x / scale) + zero_point) in float32 for a C-contiguous float32 x, as out_dtype (uint8/int8),
    written into `out` when it is a C-contiguous array of x's shape and that type; None when the library is
    unavailable or some quotient is a NaN (the caller's general path decides those)."""
    lib = library()
    out_dtype = np.dtype(out_dtype)
    if lib is None or x.dtype != np.float32 or not x.flags.c_contiguous or out_dtype not in _EIGHT_BIT:
        return None
    y = _output(out, x.shape, out_dtype)
    parts = _convert_parts(x.size)
    status = lib.qconv_quantize_threads(data_address(x), x.size, scale, zero_point, int(out_dtype == np.int8),
                                        data_address(y), parts, parts)
    return None if status else y


def dequantize_8bit(x: np.ndarray, zero_point: np.float32, scale: np.float32,
                    out: np.ndarray | None = None) -> np.ndarray | None:
    """(float32(x) - zero_point) * scale in float32 for a C-contiguous 8-bit x (the numpy per-tensor path's
    operations), written into `out` when it is a C-contiguous float32 array of x's shape; None when the library is
    unavailable or x does not qualify."""
    lib = library()
    if lib is None or x.dtype not in _EIGHT_BIT or not x.flags.c_contiguous:
        return None
    y = _output(out, x.shape, np.dtype(np.float32))
    parts = _convert_parts(x.size)
    lib.qconv_dequantize_threads(data_address(x), x.size, zero_point, scale, int(x.dtype == np.int8),
                                 data_address(y), parts, parts)
    return y


def _output(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """`out` when it is a writable C-contiguous array of this shape and type, else a new one."""
    if out is not None and out.shape == shape and out.dtype == dtype and out.flags.c_contiguous \
            and out.flags.writeable:
        return out
    return np.empty(shape, dtype)


def _convert_parts(size: int) -> int:
    return max(1, min(native.threads(), size // _CONVERT_SPLIT))


def maxpool_8bit(x: np.ndarray, kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int],
                 pads: Sequence[int], out_shape: Sequence[int]) -> np.ndarray | None:
    """MaxPool of an 8-bit x [N, C, (H,) W] over windows that ignore padding, as the output shape and begin pads
    say (ceil_mode's overhang is padding too); None when the library is unavailable or x does not qualify."""
    lib = library()
    nd = len(kernel)
    if lib is None or x.dtype not in _EIGHT_BIT or nd not in (1, 2) or x.ndim != nd + 2 or min(pads) < 0:
        return None
    y = np.empty(x.shape[:2] + tuple(out_shape), x.dtype)
    if y.size == 0:
        return y
    x = np.ascontiguousarray(x)

    def lift(values: Sequence[int], fill: int = 1) -> list[int]:  # 1-D as 2-D of height 1
        return [fill, *values] if nd == 1 else list(values)

    (h, w), (kh, kw), (sh, sw), (dh, dw) = lift(x.shape[2:]), lift(kernel), lift(strides), lift(dilations)
    (oh, ow), (pt, pl) = lift(out_shape), lift(pads[:nd], 0)
    geometry = np.array([0, h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl], np.int64)
    planes = x.shape[0] * x.shape[1]
    parts = max(1, min(native.threads(), planes, x.size // _ADD_SPLIT))
    mask = 0x80 if x.dtype == np.int8 else 0
    at = native.pointer(geometry)
    scratch = np.empty((parts, 2 * int(lib.qconv_pool_scratch(at))), np.uint8)  # one per thread
    lib.qconv_maxpool_threads(data_address(x), at, 0, planes, mask, data_address(scratch), scratch.strides[0],
                              data_address(y), parts, parts)
    return y


class QuantizedConv:
    """A convolution's constant integer weight prepared once for the native kernels.

    weight: the zero-point-shifted weight [Cout, Cin/group, kh, kw] (integer values), bias: int32-valued [Cout],
    multiplier: float32 [Cout] (x_scale * w_scale / y_scale).
    """

    def __init__(self, weight: np.ndarray, bias: np.ndarray, multiplier: np.ndarray, group: int,
                 x_zero_point: int, lib: ctypes.CDLL):
        cout, per_group, kh, kw = weight.shape
        self.lib, self.group, self.x_zero_point = lib, group, x_zero_point
        self.cout, self.per_group, self.kernel = cout, per_group, (kh, kw)
        self.bias = np.ascontiguousarray(bias, np.int32).reshape(cout)
        self.multiplier = np.ascontiguousarray(multiplier, np.float32).reshape(cout)
        self.depthwise = per_group == 1 and group > 1
        if self.depthwise:
            self.taps = np.ascontiguousarray(weight.reshape(cout, kh * kw), np.int32)
            self.packed = []
            return
        m = cout // group
        depth = kh * kw * per_group
        self.gemm_depth = _gemm_depth(depth)
        self.packed = []
        for g in range(group):  # K ordered (i, j, c): a kernel row of a pixel is one contiguous copy in im2col
            w = np.zeros((self.gemm_depth, m), np.int8)  # rows past the depth: zero (the padding of A adds 0)
            w[:depth] = weight[g * m:(g + 1) * m].transpose(2, 3, 1, 0).reshape(depth, m)
            self.packed.append(qgemm.PackedInt8Weight.pack(w))
        # what qconv_gemm_threads reads per group, and qgemm.c's entry point (a library of its own)
        self.packed_addresses = np.array([data_address(p.data) for p in self.packed], np.int64)
        self.column_sum_addresses = np.array([data_address(p.column_sums) for p in self.packed], np.int64)
        self.qgemm_run = ctypes.cast(qgemm.library().qgemm_run, ctypes.c_void_p).value

    @classmethod
    def prepare(cls, weight: np.ndarray, bias: np.ndarray, multiplier: np.ndarray, group: int,
                x_zero_point: int) -> QuantizedConv | None:
        """The prepared convolution, or None when the native path does not apply (library unavailable, not a 1-D
        or 2-D convolution, a shifted weight outside int8 for the GEMM, or channels not divisible by group)."""
        lib = library()
        if lib is None or qgemm.library() is None or weight.ndim not in (3, 4) or group < 1:
            return None
        weight = np.asarray(weight)
        if weight.ndim == 3:
            weight = weight[:, :, None, :]
        cout, per_group = weight.shape[:2]
        if cout % group or not np.array_equal(weight, np.rint(weight)):
            return None
        bias = np.asarray(bias)
        if np.size(bias) != cout or np.size(multiplier) != cout or np.abs(bias).max(initial=0) >= 2**31 \
                or not np.array_equal(bias, np.rint(bias)):
            return None
        if per_group == 1 and group > 1:
            if np.abs(weight).max(initial=0) > 2**15:  # the direct kernel's products must fit int32
                return None
        elif qgemm.int8_weight(weight) is None:
            return None
        return cls(weight, bias, multiplier, group, x_zero_point, lib)

    # -- running -------------------------------------------------------------------------------------------------------
    def plan(self, x_shape: Sequence[int], strides: Sequence[int], pads: Sequence[int],
             dilations: Sequence[int]) -> ConvPlan | None:
        """What a run on inputs of this shape needs (None when the input does not fit this weight); callers may
        keep it per input shape."""
        kh, kw = self.kernel
        spatial = tuple(x_shape[2:])
        if len(x_shape) == 3:  # 1-D: a 2-D convolution of height 1
            x_shape = (*x_shape[:2], 1, x_shape[2])
            strides, dilations, pads = (1, *strides), (1, *dilations), (0, pads[0], 0, pads[1])
        if len(x_shape) != 4 or x_shape[1] != self.per_group * self.group:
            return None
        h, w = x_shape[2:]
        oh = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
        ow = (w + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
        if oh < 1 or ow < 1 or min(strides) < 1 or min(dilations) < 1 or min(pads) < 0:
            return None
        geometry = np.array([self.per_group, h, w, kh, kw, oh, ow, strides[0], strides[1], dilations[0],
                             dilations[1], pads[0], pads[1]], np.int64)
        transpose_only = kh == kw == 1 and strides[0] == strides[1] == 1 and not any(pads)
        out_spatial = (oh, ow) if len(spatial) == 2 else (ow,)
        return ConvPlan(self, geometry, out_spatial, transpose_only)

    def bound_call(self, x: np.ndarray, y_zero_point: np.ndarray, plan: ConvPlan, out: np.ndarray
                   ) -> Callable[[], bool] | None:
        """`run(x, y_zero_point, plan, out)` on these very arrays as a call without arguments (False: out of
        memory), for a step bound to its arena; None when it does not apply (depthwise, a non-contiguous x or out,
        or out not of the result's shape and type)."""
        shape = (x.shape[0], self.cout) + plan.out_spatial
        if self.depthwise or out.shape != shape or out.dtype != y_zero_point.dtype or not out.flags.c_contiguous \
                or not x.flags.c_contiguous or out.size == 0 or y_zero_point.size != 1:
            return None
        mask = 0x80 if x.dtype == np.int8 else 0
        zp = self.x_zero_point + (128 if mask else 0)
        return plan.gemm_call(x.view(np.uint8), mask, zp, int(y_zero_point.reshape(())), out)

    def run(self, x: np.ndarray, y_zero_point: np.ndarray, plan: ConvPlan, out: np.ndarray | None = None
            ) -> np.ndarray:
        """The requantized convolution of x (uint8/int8 [N, C, (H,) W], the shape `plan` was made for) as
        y_zero_point's type, written into `out` when it is a C-contiguous array of the result's shape and type."""
        y_dtype = np.dtype(y_zero_point.dtype)
        shape = (x.shape[0], self.cout) + plan.out_spatial
        y = out if out is not None and out.shape == shape and out.dtype == y_dtype and out.flags.c_contiguous \
            else np.empty(shape, y_dtype)
        if y.size == 0:
            return y
        mask = 0x80 if x.dtype == np.int8 else 0
        x = np.ascontiguousarray(x).view(np.uint8)
        zp = self.x_zero_point + (128 if mask else 0)
        y_zp = int(np.asarray(y_zero_point).reshape(()))
        if self.depthwise:
            self._depthwise(x, plan, mask, zp, y_zp, y)
        else:
            plan.gemm(x, mask, zp, y_zp, y)
        return y

    def _depthwise(self, x: np.ndarray, plan: ConvPlan, mask: int, zp: int, y_zp: int, y: np.ndarray) -> None:
        """qconv.c's direct kernel, output channels split over the threads (each with its own scratch)."""
        mult = self.cout // self.group
        image_in, image_out = x[0].size, y[0].size
        signed = int(y.dtype == np.int8)
        parts = max(1, min(native.threads(), self.cout))
        scratch = np.empty((parts, int(self.lib.qconv_depthwise_scratch(plan.geometry_pointer))), np.uint8)
        x_at, y_at = data_address(x), data_address(y)
        fn, geometry = self.lib.qconv_depthwise_threads, plan.geometry_pointer
        taps, bias, multiplier = (native.pointer(a) for a in (self.taps, self.bias, self.multiplier))
        chunks = min(self.cout, parts * 4)  # finer than one per thread: a delayed thread leaves its rest to others
        for n in range(x.shape[0]):
            fn(x_at + n * image_in, geometry, mult, 0, self.cout, taps, bias, multiplier, zp, mask, y_zp, signed,
               data_address(scratch), scratch.strides[0], y_at + n * image_out, chunks, parts)


class ConvPlan:
    """A prepared convolution on one input shape: the geometry qconv.c reads, and the GEMM path's block sizes.
    Immutable once made (runs in several threads may share it)."""

    def __init__(self, conv: QuantizedConv, geometry: np.ndarray, out_spatial: tuple[int, ...], transpose_only: bool):
        geometry.flags.writeable = False
        self.conv, self.geometry, self.out_spatial = conv, geometry, out_spatial
        self.geometry_pointer = native.pointer(geometry)
        kh, kw = conv.kernel
        self.pixels = int(geometry[5] * geometry[6])
        self.plane_in = int(geometry[1] * geometry[2])
        self.lda = _row_stride(conv.gemm_depth if not conv.depthwise else kh * kw * conv.per_group)
        self.ldc = _row_stride(conv.cout // conv.group)
        self.transpose_only = transpose_only  # a 1x1 stride-1 unpadded convolution: A is x's transpose
        width = max(self.lda, conv.cout // conv.group)  # A's rows and the GEMM's result rows both stay bounded
        self._band_bytes: dict[int, int] = {}
        rows = max(_ROW_ALIGN, BLOCK_BYTES // width // _ROW_ALIGN * _ROW_ALIGN)
        while rows > _ROW_ALIGN and not transpose_only and self.band_bytes(min(rows, self.pixels)) > BLOCK_BYTES:
            rows = max(_ROW_ALIGN, rows // 2 // _ROW_ALIGN * _ROW_ALIGN)  # strides skipping input rows: bound the band
        self.rows = min(rows, self.pixels)
        if not conv.depthwise:
            self._packed_pointer = native.pointer(conv.packed_addresses)
            self._column_sums_pointer = native.pointer(conv.column_sum_addresses)
            self._bias_pointer, self._multiplier_pointer = native.pointer(conv.bias), native.pointer(conv.multiplier)
        #: (threads, images) -> tiling(threads, images); filled by runs (a race only computes an entry twice)
        self._tilings: dict[tuple[int, int], tuple[int, int, int, int]] = {}

    def band_bytes(self, pixels: int) -> int:
        size = self._band_bytes.get(pixels)
        if size is None:
            size = self._band_bytes[pixels] = max(int(self.conv.lib.qconv_band_bytes(self.geometry_pointer, pixels)),
                                                  1)
        return size

    def gemm(self, x: np.ndarray, mask: int, zp: int, y_zp: int, y: np.ndarray) -> None:
        """The convolution through the GEMM in one native call: per tile of output pixels (and of output channels,
        on small maps), im2col (or transpose) rows into A, qgemm with the requantizing epilogue, the block
        transposed into y's planes, the tiles split over the threads (one parallel region)."""
        if not self.gemm_call(x, mask, zp, y_zp, y)():
            raise MemoryError(f"quantized convolution: no memory for the threads' tiles of {self.rows} pixels")

    def gemm_call(self, x: np.ndarray, mask: int, zp: int, y_zp: int, y: np.ndarray) -> Callable[[], bool]:
        """`gemm` on these very arrays as a call without arguments (a bound step's), False when it could not
        allocate its scratch. Each call takes the thread count of the run that makes it."""
        conv = self.conv
        images, function, qgemm_run = x.shape[0], conv.lib.qconv_gemm_threads, conv.qgemm_run
        mode = qgemm.REQUANT_S8 if y.dtype == np.int8 else qgemm.REQUANT_U8
        head = (data_address(x), self.geometry_pointer, images, conv.group, conv.cout // conv.group,
                conv.gemm_depth, self._packed_pointer, self._column_sums_pointer, self._bias_pointer,
                self._multiplier_pointer, zp, mask, y_zp, mode, int(self.transpose_only), self.lda, self.ldc)
        y_at, tilings = data_address(y), self._tilings

        def call(arrays=(x, y)) -> bool:  # the arrays stay alive while the call may run
            threads = native.threads()
            tiling = tilings.get((threads, images))
            if tiling is None:
                tiling = tilings[(threads, images)] = self.tiling(threads, images)
            rows, column_width, chunks, used = tiling
            return not function(*head, rows, column_width, y_at, qgemm_run, chunks, used)
        return call

    def tiling(self, threads: int, images: int) -> tuple[int, int, int, int]:
        """(pixels per tile, output channels per tile, pieces, threads) of a run at `threads` threads. One thread
        takes the largest tiles (self.rows). With several, big maps get about 4 tiles per thread (a delayed thread
        leaves some to the others); maps too small to give each thread 64 pixels split the output channels too,
        by whole weight panels (every piece then builds the same A: cheap beside its share of the product)."""
        conv = self.conv
        m = conv.cout // conv.group
        units = images * conv.group
        macs = units * self.pixels * m * int(self.geometry[0] * self.geometry[3] * self.geometry[4])
        threads = max(1, min(threads, macs // max(1, qgemm._PARALLEL_MIN_MACS)))
        panel = int(qgemm.library().qgemm_panel_columns())
        if threads == 1:
            return self.rows, m, 1, 1
        if units * self.pixels < threads * _MIN_SPLIT_ROWS:  # a small map: split the columns
            panels = -(-m // panel)
            tiles = min(panels, -(-threads // units))
            rows = self.pixels if self.pixels <= self.rows else self.rows
            pixel_tiles = -(-self.pixels // rows)
            column_width = -(-panels // tiles) * panel
            items = units * pixel_tiles * -(-m // column_width)
            return rows, column_width, min(items, threads), threads
        tiles = min(-(-threads * _TILES_PER_THREAD // units), self.pixels // _MIN_SPLIT_ROWS)
        while tiles > 1 and units * tiles % threads:  # few tiles: as many for each thread
            tiles -= 1
        tiles = max(tiles, -(-self.pixels // self.rows))
        rows = -(-self.pixels // tiles)
        return rows, m, units * -(-self.pixels // rows), threads


def _gemm_depth(depth: int) -> int:
    """The GEMM's depth for a convolution of this im2col depth: rounded up to a multiple of 64 where that lets the
    AMX tiles take it (they need whole 64-byte steps) for at most half as much again (the 7x7 stem on 3 channels:
    147 -> 192), else the depth itself. The extra weight rows are zero, so A's unwritten padding adds nothing."""
    padded = -(-depth // _AMX_STEP) * _AMX_STEP
    return padded if depth > _AMX_STEP and padded != depth and 2 * padded <= 3 * depth and qgemm.amx() else depth


def _row_stride(width: int) -> int:
    """Bytes between rows of a [pixels, width] buffer: width rounded up to 4 (the GEMM reads A in groups of 4), and
    off a multiple of 256 (rows 2**k apart share few cache sets: transposes and the GEMM's row tiles thrash them)."""
    stride = -(-width // 4) * 4
    return stride + 64 if stride % 256 == 0 else stride

