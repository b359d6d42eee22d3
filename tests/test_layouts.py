"""Caller inputs in any memory layout: results equal those for a C-contiguous copy, and the caller's array is untouched.

Each property test feeds one op's inputs as odd views (byte offsets 0-15, strides of +-1/+-2 per axis, any axis order
incl. Fortran, zero strides from np.broadcast_to, big-endian, read-only, zero-size dims) and checks
  * carrack's result on the odd views is bit-identical to carrack's result on np.ascontiguousarray(x) and on a fresh
    aligned native copy,
  * it is close to onnxruntime's (where onnxruntime supports the dtype),
  * the bytes under the caller's views did not change.
The helpers here are shared with tests/test_alignment.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

import carrack
from carrack.ir.dtypes import to_onnx

OPSET = 18
F32, F64, F16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)
I32, I64, I8, U8, BOOL = (np.dtype(t) for t in (np.int32, np.int64, np.int8, np.uint8, np.bool_))
FLOATS = (F32, F64, F16)
NUMBERS = FLOATS + (I32, I64, I8, U8)

ANY_OFFSET = st.integers(0, 15)
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- building odd layouts ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """How one input is laid out in memory (applied to an array's values by `lay_out`)."""

    offset: int = 0  # bytes past a 64-byte boundary
    steps: tuple[int, ...] = ()  # per axis of the (permuted) storage; negative: reversed
    perm: tuple[int, ...] = ()  # storage axis order (reversed: Fortran order)
    byteorder: str = "="
    readonly: bool = False
    broadcast: tuple[int, ...] = ()  # axes with stride 0 (the value is constant along them)


@dataclass
class Laid:
    value: np.ndarray  # the logical value (what any layout must behave like)
    view: np.ndarray  # the odd view fed to the session
    storage: np.ndarray  # the bytes under the view, to check they are not modified


def constant_along(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """x made constant along `axes` (so that a zero-stride view can represent it)."""
    if not axes or x.size == 0:
        return x
    first = tuple(slice(0, 1) if ax in axes else slice(None) for ax in range(x.ndim))
    return np.ascontiguousarray(np.broadcast_to(x[first], x.shape))


def lay_out(x: np.ndarray, layout: Layout) -> Laid:
    """A view with x's values (made constant along layout.broadcast) in the given odd layout."""
    value = constant_along(x, layout.broadcast)
    base = value[tuple(slice(0, 1) if ax in layout.broadcast else slice(None) for ax in range(x.ndim))]
    nd = base.ndim
    perm = layout.perm or tuple(range(nd))
    steps = layout.steps or (1,) * nd
    dtype = base.dtype.newbyteorder(layout.byteorder) if base.dtype.itemsize > 1 else base.dtype
    stored_shape = [base.shape[p] for p in perm]
    padded = [max(n * abs(s), 1) for n, s in zip(stored_shape, steps)]
    nbytes = int(np.prod(padded, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + layout.offset + 64, np.uint8)
    start = (-raw.ctypes.data) % 64 + layout.offset
    storage = raw[start:start + nbytes]
    full = storage.view(dtype).reshape(padded)
    pick = tuple(slice(0, 0) if n == 0 else slice(0, n * s, s) if s > 0 else slice(n * -s - 1, None, s)
                 for n, s in zip(stored_shape, steps))
    view = full[pick + (Ellipsis,)]  # a 0-d view, not a scalar, for rank 0
    view[...] = base.transpose(perm)
    view = view.transpose(np.argsort(perm))
    if layout.broadcast:
        view = np.broadcast_to(view, value.shape)
    elif layout.readonly:
        view.flags.writeable = False
    assert view.shape == value.shape and np.array_equal(view, value, equal_nan=True)
    return Laid(value, view, storage)


@st.composite
def layouts(draw, ndim: int, offsets: st.SearchStrategy[int] = ANY_OFFSET) -> Layout:
    perm = tuple(draw(st.permutations(range(ndim)))) if ndim else ()
    if ndim > 1 and draw(st.booleans()):
        perm = tuple(range(ndim))[::-1]  # Fortran order
    broadcast = tuple(ax for ax in range(ndim) if draw(st.integers(0, 5)) == 0)
    return Layout(offset=draw(offsets),
                  steps=tuple(draw(st.sampled_from([1, 1, 2, -1, -2])) for _ in range(ndim)),
                  perm=perm, byteorder=draw(st.sampled_from(["=", ">"])), readonly=draw(st.booleans()),
                  broadcast=broadcast)


def random_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if dtype == BOOL:
        return rng.random(shape) < 0.5
    if dtype.kind == "f":
        return (rng.standard_normal(shape) * 3).astype(dtype)
    if dtype.kind == "u":
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.integers(-50, 50, shape).astype(dtype)


# -- op cases ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One op with its inputs' dtypes; `attrs`/`consts` are part of the model (so part of the session cache key)."""

    op: str
    input_dtypes: tuple[np.dtype, ...]
    attrs: tuple[tuple[str, object], ...] = ()
    consts: tuple[tuple[str, tuple[int, ...]], ...] = ()  # int64 initializers appended as inputs
    tol: float = 1e-4

    @property
    def out_dtype(self) -> np.dtype:
        return self.input_dtypes[-1]


def build_model(case: Case) -> onnx.ModelProto:
    names = [f"x{i}" for i in range(len(case.input_dtypes))]
    inputs = [helper.make_tensor_value_info(n, to_onnx(dt), None) for n, dt in zip(names, case.input_dtypes)]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in case.consts]
    node = helper.make_node(case.op, names + [n for n, _ in case.consts], ["y"], **dict(case.attrs))
    out = helper.make_tensor_value_info("y", to_onnx(case.out_dtype), None)
    graph = helper.make_graph([node], "g", inputs, [out], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)


@functools.lru_cache(maxsize=256)
def carrack_session(case: Case) -> carrack.InferenceSession:
    return carrack.InferenceSession(build_model(case).SerializeToString())


@functools.lru_cache(maxsize=256)
def ort_session(case: Case):
    import onnxruntime as ort

    try:
        return ort.InferenceSession(build_model(case).SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - onnxruntime lacks a kernel for this dtype: compare with carrack only
        return None


def run_ort(case: Case, feed: dict[str, np.ndarray]) -> np.ndarray | None:
    sess = ort_session(case)
    if sess is None:
        return None
    try:
        return sess.run(None, feed)[0]
    except Exception as e:  # noqa: BLE001
        if "NOT_IMPLEMENTED" in str(e) or "not implemented" in str(e).lower():
            return None
        raise


def assert_bit_identical(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (what, got.dtype, expected.dtype,
                                                                         got.shape, expected.shape)
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(expected).tobytes(), what


def check_layouts(case: Case, values: list[np.ndarray], input_layouts: list[Layout]) -> None:
    """The property: odd layouts give the contiguous result, close to onnxruntime's, and stay untouched."""
    laid = [lay_out(v, lay) for v, lay in zip(values, input_layouts)]
    names = [f"x{i}" for i in range(len(laid))]
    before = [lv.storage.tobytes() for lv in laid]
    flags = [(lv.view.flags.writeable, lv.view.strides, lv.view.dtype) for lv in laid]
    sess = carrack_session(case)
    clean = [np.array(lv.value, order="C") for lv in laid]
    expected = sess.run(None, dict(zip(names, clean)))[0]
    got = sess.run(None, {n: lv.view for n, lv in zip(names, laid)})[0]
    what = f"{case.op} {[str(v.dtype) for v in clean]} {[v.shape for v in clean]} {input_layouts}"
    assert_bit_identical(got, expected, what)
    # np.ascontiguousarray makes 0-d arrays 1-d; reshape back
    contiguous = sess.run(None, {n: np.ascontiguousarray(lv.view).reshape(lv.view.shape)
                                 for n, lv in zip(names, laid)})[0]
    assert_bit_identical(contiguous, expected, what)
    assert [lv.storage.tobytes() for lv in laid] == before, f"caller's array modified: {what}"
    assert [(lv.view.flags.writeable, lv.view.strides, lv.view.dtype) for lv in laid] == flags
    reference = run_ort(case, dict(zip(names, clean)))
    if reference is not None:
        assert got.shape == reference.shape and got.dtype == reference.dtype, (what, got.shape, reference.shape)
        tol = max(case.tol, 2e-2) if got.dtype == F16 else case.tol
        np.testing.assert_allclose(got.astype(np.float64), reference.astype(np.float64), rtol=tol, atol=tol,
                                   err_msg=what)


# -- shapes ------------------------------------------------------------------------------------------------------------

@st.composite
def shapes(draw, min_rank: int = 0, max_rank: int = 4, max_dim: int = 5, zero_ok: bool = True) -> tuple[int, ...]:
    rank = draw(st.integers(min_rank, max_rank))
    dims = [draw(st.integers(1, max_dim)) for _ in range(rank)]
    if zero_ok and rank and draw(st.integers(0, 5)) == 0:
        dims[draw(st.integers(0, rank - 1))] = 0
    return tuple(dims)


def broadcast_partner(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts against `shape`: some leading axes dropped, some axes 1."""
    keep = draw(st.integers(0, len(shape)))
    tail = shape[len(shape) - keep:]
    return tuple(1 if draw(st.booleans()) else d for d in tail)


def draw_layouts(data, arrays: list[np.ndarray], offsets: st.SearchStrategy[int] = ANY_OFFSET) -> list[Layout]:
    return [data.draw(layouts(a.ndim, offsets)) for a in arrays]


def draw_rng(data) -> np.random.Generator:
    return np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))


# -- the families ------------------------------------------------------------------------------------------------------

Inputs = Callable[[object, np.random.Generator, np.dtype], tuple[Case, list[np.ndarray]]]


def elementwise_inputs(op: str, arity: int) -> Inputs:
    def make(data, rng, dtype):
        shape = data.draw(shapes())
        return Case(op, (dtype,) * arity), [random_values(rng, shape, dtype) for _ in range(arity)]
    return make


def add_broadcast_inputs(data, rng, dtype):
    shape = data.draw(shapes(min_rank=1))
    other = broadcast_partner(data.draw, shape)
    pair = [random_values(rng, shape, dtype), random_values(rng, other, dtype)]
    return Case("Add", (dtype, dtype)), pair[::-1] if data.draw(st.booleans()) else pair


def where_inputs(data, rng, dtype):
    shape = data.draw(shapes(min_rank=1))
    cond = random_values(rng, broadcast_partner(data.draw, shape), BOOL)
    x, y = random_values(rng, shape, dtype), random_values(rng, broadcast_partner(data.draw, shape), dtype)
    return Case("Where", (BOOL, dtype, dtype)), [cond, x, y]


def matmul_inputs(batched: bool) -> Inputs:
    def make(data, rng, dtype):
        m, k, n = (data.draw(st.sampled_from([0, 1, 3, 8, 17])) for _ in range(3))
        batch = (data.draw(st.integers(1, 3)),) if batched else ()
        b_batch = batch if batched and data.draw(st.booleans()) else ()
        a, b = random_values(rng, batch + (m, k), dtype), random_values(rng, b_batch + (k, n), dtype)
        return Case("MatMul", (dtype, dtype), tol=1e-3), [a, b]
    return make


def conv_inputs(data, rng, dtype):
    group = data.draw(st.sampled_from([1, 2]))
    cg, mg = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    kh, kw = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    strides = data.draw(st.sampled_from([(1, 1), (2, 1), (2, 2)]))
    pads = data.draw(st.sampled_from([(0, 0, 0, 0), (1, 1, 1, 1), (0, 1, 1, 0)]))
    # batch 0 with a 1x1 kernel is excluded here: see test_conv_pointwise_empty_batch
    batch = data.draw(st.sampled_from([0, 1, 2] if kh * kw > 1 else [1, 2]))
    h, w = data.draw(st.integers(kh, 7)), data.draw(st.integers(kw, 7))
    x = random_values(rng, (batch, group * cg, h, w), dtype)
    weights = random_values(rng, (group * mg, cg, kh, kw), dtype)
    attrs = (("group", group), ("strides", list(strides)), ("pads", list(pads)))
    return Case("Conv", (dtype, dtype), attrs=_hashable(attrs), tol=1e-3), [x, weights]


def reduce_inputs(op: str) -> Inputs:
    def make(data, rng, dtype):
        shape = data.draw(shapes(min_rank=1, zero_ok=op == "ReduceSum"))
        axes = tuple(sorted(data.draw(st.sets(st.integers(-len(shape), len(shape) - 1), max_size=len(shape)))))
        axes = tuple(sorted({a % len(shape) for a in axes}))
        keepdims = int(data.draw(st.booleans()))
        consts = (("axes", axes),) if axes else ()
        return (Case(op, (dtype,), attrs=(("keepdims", keepdims),), consts=consts, tol=1e-3),
                [random_values(rng, shape, dtype)])
    return make


def _hashable(attrs):
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs)


FAMILIES: dict[str, tuple[Inputs, tuple[np.dtype, ...]]] = {
    "Add": (elementwise_inputs("Add", 2), NUMBERS),
    "Mul": (elementwise_inputs("Mul", 2), NUMBERS),
    "Relu": (elementwise_inputs("Relu", 1), FLOATS + (I32, I64, I8)),
    "Sigmoid": (elementwise_inputs("Sigmoid", 1), FLOATS),
    "AddBroadcast": (add_broadcast_inputs, NUMBERS),
    "Where": (where_inputs, NUMBERS + (BOOL,)),
    "MatMul2D": (matmul_inputs(False), (F32, F64, F16, I32, I64)),
    "MatMulBatched": (matmul_inputs(True), (F32, F64, I32, I64)),
    "Conv": (conv_inputs, (F32, F64)),
    "ReduceSum": (reduce_inputs("ReduceSum"), (F32, F64, F16, I32, I64)),
    "ReduceMean": (reduce_inputs("ReduceMean"), (F32, F64, F16)),
    "ReduceMax": (reduce_inputs("ReduceMax"), (F32, F64, F16, I32, I64, I8, U8)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@SETTINGS
@given(data=st.data())
def test_any_layout_matches_contiguous(family, data):
    make, dtypes = FAMILIES[family]
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    case, values = make(data, draw_rng(data), dtype)
    check_layouts(case, values, draw_layouts(data, values))


@pytest.mark.parametrize("layout", [
    Layout(perm=(1, 0)),  # Fortran order
    Layout(steps=(-1, -1)),
    Layout(steps=(-2, 2), offset=3),
    Layout(byteorder=">"),
    Layout(readonly=True, offset=1),
    Layout(broadcast=(0,)),
    Layout(broadcast=(0, 1)),
], ids=str)
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax"])
def test_reductions_over_each_axis_ignore_layout(op, layout):
    """numpy sums in memory order; a Fortran-order caller array must still give the C-order result."""
    rng = np.random.default_rng(7)
    x = random_values(rng, (37, 53), F32)
    for axes in ((0,), (1,), (0, 1)):
        check_layouts(Case(op, (F32,), attrs=(("keepdims", 0),), consts=(("axes", axes),), tol=1e-4), [x], [layout])


def test_conv_pointwise_empty_batch():
    case = Case("Conv", (F32, F32))
    y = carrack_session(case).run(None, {"x0": np.zeros((0, 2, 3, 3), F32), "x1": np.ones((4, 2, 1, 1), F32)})[0]
    assert y.shape == (0, 4, 3, 3)


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i4", ">i8", ">f2", "<f4"])
def test_non_native_byte_order(dtype):
    x = np.arange(-6, 6).reshape(3, 4).astype(dtype)
    y = carrack_session(Case("Add", (np.dtype(dtype).newbyteorder("="),) * 2)).run(None, {"x0": x, "x1": x})[0]
    assert y.dtype.isnative and np.array_equal(y, np.arange(-6, 6).reshape(3, 4) * 2)


def test_zero_size_inputs_in_every_layout():
    x = np.zeros((0, 3), F32)
    views = [x, x.T.T, np.asfortranarray(x), x[::-1], np.broadcast_to(np.zeros((1, 3), F32), (0, 3)),
             np.zeros((3, 0), ">f4").T]
    sess = carrack_session(Case("Relu", (F32,)))
    for v in views:
        y = sess.run(None, {"x0": v})[0]
        assert y.shape == (0, 3) and y.dtype == F32


def test_plain_arrays_are_not_copied():
    """A C-contiguous aligned native array reaches the kernels as is (Identity returns its input)."""
    from carrack.runtime.feeds import as_native_array

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert as_native_array("x", x) is x
    x.flags.writeable = False
    assert as_native_array("x", x) is x
    odd = np.asfortranarray(x)
    fixed = as_native_array("x", odd)
    assert fixed is not odd and fixed.flags.c_contiguous and np.array_equal(fixed, x)
