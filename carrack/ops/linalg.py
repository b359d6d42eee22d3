"""Linear algebra: MatMul, Gemm, Einsum, Det. Narrow floats (float16, bfloat16) are computed in float32."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from carrack import native as native_kernels
from carrack.native import matmul as native_matmul
from carrack.native import rowlinear
from carrack.ops import half
from carrack.ops.reduce import compute_dtype
from carrack.ops.registry import Kernel, register


def _widen(x: np.ndarray) -> np.ndarray:
    return x.astype(compute_dtype(x.dtype), copy=False)


def _flat_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """a (..., K) as one (rows, K) matrix when b is a plain matrix and that is a view: one BLAS call for every
    leading dim instead of numpy's loop of one call per leading index."""
    if b.ndim == 2 and a.ndim > 2 and a.size and a.flags.c_contiguous:
        return a.reshape(-1, a.shape[-1])
    return None


def _native_product(a: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> np.ndarray | None:
    """a (..., K) @ b[K, N] by the native float32 kernel where it beats BLAS (see carrack.native.matmul), into
    `out` when given (C-contiguous, of the result's shape); None when not done."""
    if a.dtype != np.float32 or b.dtype != np.float32 or b.ndim != 2 or a.ndim < 2 or not a.flags.c_contiguous:
        return None
    rows = a.size // a.shape[-1] if a.shape[-1] else 0
    if not native_matmul.chosen(rows, b.shape[0], b.shape[1]) or a.shape[-1] != b.shape[0]:
        return None
    y = np.empty(a.shape[:-1] + b.shape[-1:], np.float32) if out is None else out
    if not native_matmul.matmul_into(a.reshape(rows, -1), b, y.reshape(rows, -1)):
        return None
    return y


_F32 = np.dtype(np.float32)


def _plain_f32(x) -> bool:
    """A C-contiguous, aligned float32 ndarray (what the native product reads in place)."""
    return type(x) is np.ndarray and x.dtype == _F32 and x.flags.c_contiguous and x.flags.aligned


def _native_batched(a: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> np.ndarray | None:
    """a[..., T, K] @ b[..., K, N] over one or two batch dims that both share (attention left unfused, e.g. q @ k^T
    per head) by the native kernel on the run's threads, where it beats BLAS; numpy would make one BLAS call per
    head on BLAS's own threads. Into `out` when given; None when not done."""
    if (a.dtype != np.float32 or b.dtype != np.float32 or not 3 <= a.ndim <= 4 or a.ndim != b.ndim
            or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]
            or not native_matmul.chosen(a.shape[-2], a.shape[-1], b.shape[-1])):
        return None
    y = np.empty(a.shape[:-1] + b.shape[-1:], np.float32) if out is None else out
    return y if native_matmul.batched_into(a, b, y) else None


def _packed_rows(kernel) -> rowlinear.PackedLinear | None:
    """The kernel's few-row packed weight, packed by its `row_pack` on the first call (a missing library is not
    asked again)."""
    if kernel.rows is None:
        kernel.rows = kernel.row_pack()
        if kernel.rows is None:
            kernel.row_pack = None
    return kernel.rows


@register("MatMul", since=1)
class MatMul(Kernel):
    def setup(self):
        self.widened = half.WidenedConstants()
        #: the plan chose the native tile (it then still takes only the sizes where it pays: native_matmul.chosen)
        self.native = self.implementation == "native"
        self.weight: np.ndarray | None = None  # a constant 2-D float32 B, checked once (prepare)
        self.rows: rowlinear.PackedLinear | None = None  # the weight packed for products of 1..MAX_ROWS rows
        self.row_pack: Callable[[], rowlinear.PackedLinear | None] | None = None  # packs it: on first such use

    @classmethod
    def prepared_bytes(cls, node, constants) -> int:
        """The few-row kernel's packed copy of a constant float32 weight (made by the first product of
        1..rowlinear.MAX_ROWS rows, counted whether or not one comes)."""
        b = constants.get(node.inputs[1]) if len(node.inputs) > 1 else None
        if not (isinstance(b, np.ndarray) and b.dtype == _F32 and b.ndim == 2 and rowlinear.packs(*b.shape)
                and rowlinear.library() is not None):
            return 0
        return rowlinear.packed_bytes(*b.shape)

    def prepare(self, constants):
        b = constants[1] if len(constants) > 1 else None
        if b is not None and _plain_f32(b) and b.ndim == 2:
            self.weight = b
            if self.native and rowlinear.packs(*b.shape):
                self.row_pack = lambda: native_kernels.prepared("rowlinear", (b,), lambda: rowlinear.pack(b, None,
                                                                                                         False))

    def _few_rows(self, a) -> rowlinear.PackedLinear | None:
        """The packed weight when `a` (..., K) has 1..rowlinear.MAX_ROWS rows, else None. The weight is packed on
        the first such product (a model never run at a batch that small keeps no copy)."""
        if self.row_pack is None or type(a) is not np.ndarray or a.ndim < 2 or a.shape[-1] != self.weight.shape[0] \
                or not 0 < a.size // a.shape[-1] <= rowlinear.MAX_ROWS:
            return None
        return _packed_rows(self)

    def _rows_into(self, out, a) -> np.ndarray | None:
        """a (..., K) @ the prepared weight for 1..rowlinear.MAX_ROWS rows by the packed few-row kernel, into
        `out` when it fits, else into a new array; None when not done."""
        linear = self._few_rows(a)
        if linear is None:
            return None
        rows = a.size // linear.depth
        shape = a.shape[:-1] + (linear.columns,)
        if out is None or out.shape != shape or not out.flags.c_contiguous:
            out = np.empty(shape, _F32)
        return out if linear.into(a.reshape(rows, -1), out.reshape(rows, -1)) else None

    def run(self, a, b):
        y = self._rows_into(None, a) if b is self.weight else None
        if y is not None:
            return y
        if half.is_half(a, b):  # in float32, rounded once (carrack.ops.half)
            return half.narrow(self.widened_product(a, b))
        y = (_native_product(a, b, None) if b.ndim == 2 else _native_batched(a, b, None)) if self.native else None
        if y is not None:
            return y
        flat = _flat_rows(a, b) if a.dtype == b.dtype and a.dtype in (np.float32, np.float64) else None
        if flat is not None and flat.shape[-1] == b.shape[0]:
            return np.matmul(flat, b).reshape(a.shape[:-1] + b.shape[-1:])
        return np.matmul(_widen(a), _widen(b)).astype(a.dtype, copy=False)

    def _into_weight(self, out, a) -> bool:
        """out = a (..., K) @ the prepared weight [K, N] with only the run's operands checked; False when they
        are not plain float32 of matching shapes (the general path then handles them)."""
        views = self._weight_views(out, a)
        if views is None:
            return False
        a2, out2 = views
        if not (self.native and native_matmul.matmul_checked_into(a2, self.weight, out2)):
            np.matmul(a2, self.weight, out=out2)
        return True

    def _weight_views(self, out, a) -> tuple[np.ndarray, np.ndarray] | None:
        """(a, out) as 2-D [rows, K] and [rows, N] views for a product by the prepared weight, or None when they are
        not plain float32 of matching shapes with `out` writeable and apart from `a`."""
        k, n = self.weight.shape
        if not (_plain_f32(a) and a.ndim >= 2 and a.shape[-1] == k and out.dtype == _F32 and out.flags.c_contiguous
                and out.flags.writeable and out.shape == a.shape[:-1] + (n,) and a.size
                and not np.may_share_memory(out, a)):
            return None
        rows = a.size // k
        return a.reshape(rows, k), out.reshape(rows, n)

    def bind_into(self, out, a, b):
        """`_into_weight` for these very arrays: the checks and the 2-D views made once."""
        if self.weight is None or b is not self.weight:
            return None
        views = self._weight_views(out, a)
        if views is None:
            return None
        a2, out2 = views
        (rows, k), n = a2.shape, b.shape[1]
        linear = self._few_rows(a2)
        call = linear.bind(a2, out2) if linear is not None else None
        if call is not None:
            return call
        if not self.native or native_matmul.numpy_is_faster(rows, k, n):  # never the native tile (chosen is False)
            return functools.partial(np.matmul, a2, b, out=out2)

        def product() -> None:
            if not native_matmul.matmul_checked_into(a2, b, out2):
                np.matmul(a2, b, out=out2)
        return product

    def widened_product(self, a, b) -> np.ndarray:
        """The float32 product of float16 operands (a fused activation runs on it before the one rounding)."""
        return self.run(self.widened(a), self.widened(b))

    def run_into(self, out, a, b):
        """Into the planned buffer when it fits (a wrong planned shape costs an allocation, not a wrong result)."""
        if b is self.weight:
            y = self._rows_into(out, a)
            if y is not None:
                return y
            if self._into_weight(out, a):
                return out
        if half.is_half(a, b):
            return half.narrow(self.widened_product(a, b), out)
        if (a.dtype == b.dtype == out.dtype and out.dtype in (np.float32, np.float64) and a.ndim >= 2 and b.ndim >= 2
                and out.shape == np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
                and a.shape[-1] == b.shape[-2]):
            if self.native and out.flags.c_contiguous and (_native_product(a, b, out) if b.ndim == 2
                                                          else _native_batched(a, b, out)) is not None:
                return out
            flat = _flat_rows(a, b)
            if flat is not None and out.flags.c_contiguous:
                np.matmul(flat, b, out=out.reshape(flat.shape[0], b.shape[1]))
                return out
            return np.matmul(a, b, out=out)
        return self.run(a, b)


@register("Gemm", since=1)
class Gemm(Kernel):
    """Y = alpha * A' @ B' + beta * C, C broadcast to Y (the opset < 7 `broadcast` flag is implied)."""

    def setup(self):
        self.alpha = float(self.attr("alpha", 1.0))
        self.beta = float(self.attr("beta", 1.0))
        self.trans_a = bool(self.attr("transA", 0))
        self.trans_b = bool(self.attr("transB", 0))
        self.widened = half.WidenedConstants()
        self.widened_b = half.WidenedConstants(transposed=self.trans_b)
        self.native = self.implementation == "native"
        self.weight: tuple | None = None  # (B, C) of a plain float32 product checked once (prepare)
        #: the activation the few-row kernel applies (code, alpha, beta): FusedGemm sets its own before prepare
        self.row_activation: tuple[int, float, float] = (0, 0.0, 0.0)
        self.rows: rowlinear.PackedLinear | None = None  # B and C packed for products of 1..MAX_ROWS rows
        self.row_operands: tuple = (None, None)  # the (B, C) packed into `rows`
        self.row_pack: Callable[[], rowlinear.PackedLinear | None] | None = None  # packs them: on first such use

    @classmethod
    def prepared_bytes(cls, node, constants) -> int:
        """The few-row kernel's packed copy of a constant linear layer's weight (`prepare`; made by the first run
        of 1..rowlinear.MAX_ROWS rows, counted whether or not one comes)."""
        b = _linear_weight(node, constants)
        if b is None or rowlinear.library() is None:
            return 0
        depth, columns = b.shape[::-1] if node.attrs.get("transB", 0) else b.shape
        return rowlinear.packed_bytes(depth, columns)

    def prepare(self, constants):
        """A float32 A @ B^T + C with B and C constant (a linear layer as exporters write it): B and C checked
        here, once; a run then checks only A."""
        b = constants[1] if len(constants) > 1 else None
        c = constants[2] if len(constants) > 2 else None
        present_c = len(self.node.inputs) > 2 and bool(self.node.inputs[2])
        if (self.trans_b and not self.trans_a and self.alpha == 1.0 and self.beta == 1.0 and b is not None
                and _plain_f32(b) and b.ndim == 2 and b.shape[1] and (present_c == (c is not None))
                and (c is None or (c.dtype == _F32 and c.shape in ((b.shape[0],), (1, b.shape[0]))))):
            self.weight = (b, c)
        if self.native and _linear_weight(self.node, {n: v for n, v in zip(self.node.inputs, constants)
                                                      if v is not None}) is not None:
            act, trans_b = self.row_activation, self.trans_b
            self.row_pack = lambda: native_kernels.prepared(f"rowlinear{act}{trans_b}", (b,) if c is None else (b, c),
                                                            lambda: rowlinear.pack(b, c, trans_b, act))
            self.row_operands = (b, c)

    def run(self, a, b, c=None):
        return self.run_into(None, a, b, c)

    def rows_into(self, out, a, b, c=None) -> np.ndarray | None:
        """act(a @ B^T + C) for 1..rowlinear.MAX_ROWS rows of the prepared layer by the packed few-row kernel
        (act: `row_activation`), into `out` when it fits, else into a new array; None when not done."""
        rows = self._few_rows(a, b, c)
        if rows is None:
            return None
        if out is None or out.shape != (a.shape[0], rows.columns):
            out = np.empty((a.shape[0], rows.columns), _F32)
        return out if rows.into(a, out) else None

    def bind_rows(self, out, a, b, c=None):
        """`rows_into` for these very arrays as a call without arguments; None when not done."""
        rows = self._few_rows(a, b, c)
        return None if rows is None else rows.bind(a, out)

    def _few_rows(self, a, b, c) -> rowlinear.PackedLinear | None:
        """The packed layer when these are its operands and `a` has 1..rowlinear.MAX_ROWS rows, else None; packed
        on the first such product (a model never run at a batch that small keeps no copy)."""
        if self.row_pack is None or b is not self.row_operands[0] or c is not self.row_operands[1] \
                or type(a) is not np.ndarray or a.ndim != 2 or not 0 < a.shape[0] <= rowlinear.MAX_ROWS:
            return None
        return _packed_rows(self)

    def run_into(self, out, a, b, c=None):
        """The product goes straight into `out` (a planned buffer of Y's shape and dtype) and the scaling and bias
        are applied there in place, rather than each in a new array."""
        if self.row_activation[0] == 0:
            y = self.rows_into(out, a, b, c)
            if y is not None:
                return y
        prepared = self.weight
        if prepared is not None and b is prepared[0] and c is prepared[1] and _plain_f32(a) and a.ndim == 2 \
                and a.shape[1] == b.shape[1] and a.shape[0]:
            y = self._linear(out, a, b, c, self.native)
            if y is not None:
                return y
        if half.is_half(a, b, c):  # in float32, rounded once (carrack.ops.half)
            return half.narrow(self.widened_product(a, b, c), out)
        return self._product(out, a, b, c, self.trans_b)

    def bind_into(self, out, a, b, c=None):
        """`_linear` for these very arrays (a prepared linear layer whose result fits `out`)."""
        call = self.bind_rows(out, a, b, c) if self.row_activation[0] == 0 else None
        if call is not None:
            return call
        prepared = self.weight
        if not (prepared is not None and b is prepared[0] and c is prepared[1] and _plain_f32(a) and a.ndim == 2
                and a.shape[1] == b.shape[1] and a.shape[0] and _plain_f32(out)
                and out.shape == (a.shape[0], b.shape[0]) and out.flags.writeable
                and not np.may_share_memory(out, a)):
            return None
        weight_t, native = b.T, self.native
        rows, depth, cols = a.shape[0], a.shape[1], b.shape[0]
        if native and (rows > native_matmul.MAX_DOT_ROWS or native_matmul.numpy_is_faster(rows, depth, cols)):
            native = False  # transposed_checked_into would decline every call: numpy's product, chosen once

        def linear() -> None:
            if not (native and native_matmul.transposed_checked_into(a, b, out)):
                np.matmul(a, weight_t, out=out)
            if c is not None:
                np.add(out, c, out=out)
        return linear

    @staticmethod
    def _linear(out, a, b, c, native: bool) -> np.ndarray | None:
        """a @ b^T + c for checked float32 operands (prepare), into `out` when it is a plain buffer of the
        result's shape apart from a; None when `out` overlaps a."""
        shape = (a.shape[0], b.shape[0])
        if out is None or not (_plain_f32(out) and out.shape == shape and out.flags.writeable):
            out = np.empty(shape, _F32)
        elif np.may_share_memory(out, a):
            return None
        if not (native and native_matmul.transposed_checked_into(a, b, out)):
            np.matmul(a, b.T, out=out)
        if c is not None:
            np.add(out, c, out=out)
        return out

    def widened_product(self, a, b, c=None) -> np.ndarray:
        """The float32 result for float16 operands (a fused activation runs on it before the one rounding); B
        comes widened and already transposed."""
        return self._product(None, self.widened(a), self.widened_b(b), self.widened(c), trans_b=False)

    def _product(self, out, a, b, c, trans_b: bool):
        wa, wb = _widen(a), _widen(b)
        if self.trans_a:
            wa = wa.T
        if trans_b:
            wb = wb.T
        if not (out is not None and out.dtype == wa.dtype == wb.dtype and wa.ndim == wb.ndim == 2
                and out.shape == (wa.shape[0], wb.shape[1]) and wa.shape[1] == wb.shape[0]
                and out.flags.c_contiguous and out.flags.writeable):
            out = None
        y = self._native_transposed(wa, b, out) if self.trans_b and self.native else None
        if y is None:
            y = np.matmul(wa, wb, out=out)
        if self.alpha != 1.0:
            y = _scaled(y, self.alpha)
        if c is not None and self.beta != 0.0:
            wc = _widen(c)
            wc = _scaled(wc, self.beta) if self.beta != 1.0 else wc
            in_place = y.dtype == np.result_type(y, wc) and np.broadcast_shapes(y.shape, wc.shape) == y.shape
            y = np.add(y, wc, out=y if in_place else None)
        return y.astype(a.dtype, copy=False)

    @staticmethod
    def _native_transposed(a: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> np.ndarray | None:
        """A @ B^T for a few float32 rows by the native dot-product kernel, on the run's threads (numpy's BLAS
        would use its own pool); None when it does not apply."""
        if a.dtype != np.float32 or a.ndim != 2 or a.shape[0] > native_matmul.MAX_DOT_ROWS or b.ndim != 2:
            return None
        y = out if out is not None else np.empty((a.shape[0], b.shape[0]), np.float32)
        return y if native_matmul.transposed_into(a, b, y) else None


def _linear_weight(node, constants) -> np.ndarray | None:
    """B of a Gemm that `Gemm.prepare` packs for few rows (float32 A @ B + C or A @ B^T + C, B and C constant, C
    one value per column), from the node and its constants ({input name: array}); None for any other Gemm."""
    attrs = node.attrs
    if attrs.get("transA", 0) or float(attrs.get("alpha", 1.0)) != 1.0 or float(attrs.get("beta", 1.0)) != 1.0 \
            or len(node.inputs) < 2:
        return None
    b = constants.get(node.inputs[1])
    if not (isinstance(b, np.ndarray) and b.dtype == _F32 and b.ndim == 2):
        return None
    depth, columns = b.shape[::-1] if attrs.get("transB", 0) else b.shape
    c = constants.get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if len(node.inputs) > 2 and node.inputs[2] and not (isinstance(c, np.ndarray) and c.dtype == _F32
                                                        and c.shape in ((columns,), (1, columns))):
        return None
    return b if rowlinear.packs(depth, columns) else None


def _scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """x * factor, keeping x's dtype (integers are scaled in float64 and truncated)."""
    if x.dtype.kind in "iu":
        return (x * factor).astype(x.dtype)
    return x * x.dtype.type(factor)


@register("Einsum", since=12)
class Einsum(Kernel):
    def setup(self):
        equation = self.required_attr("equation")
        if isinstance(equation, bytes):
            equation = equation.decode()
        self.equation = explicit_equation(equation.replace(" ", ""))

    def run(self, *inputs):
        out = np.einsum(self.equation, *[_widen(x) for x in inputs], optimize=True)
        return np.asarray(out).astype(inputs[0].dtype, copy=False)


def explicit_equation(equation: str) -> str:
    """Adds the implicit output term: ellipsis first, then labels seen once, in ASCII order."""
    if "->" in equation:
        return equation
    labels = equation.replace("...", "").replace(",", "")
    once = sorted(c for c in set(labels) if labels.count(c) == 1)
    return equation + "->" + ("..." if "..." in equation else "") + "".join(once)


@register("Det", since=11)
class Det(Kernel):
    def run(self, x):
        return np.asarray(np.linalg.det(_widen(x))).astype(x.dtype, copy=False)
