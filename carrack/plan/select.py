"""The selection table: which implementation runs each node, decided once when the plan is built.

Operators with more than one implementation (a native C kernel and its numpy twin) list their candidates here in
order of preference. Each candidate has a static predicate, evaluated at plan time from what the plan knows about
the node (input dtypes from shape inference, which inputs are constants, attributes) and from the machine
(whether the native library it needs loads here: CPU variant, CARRACK_NATIVE, compiler). The first candidate whose
predicate holds is the node's implementation; the plan records it as a name (plain data, picklable) and the
executor builds the kernel with it (`Kernel.implementation`), so kernels no longer ask at run time whether native
code is there. Where sizes decide (a product's row count, an input's size), the chosen native kernel keeps a cheap
run-time test, named in the candidate's `runtime` text, and falls back to its numpy path for sizes it does not take.

Forcing numpy for a session: ``SessionOptions.add_session_config_entry("carrack.kernels", "numpy")`` (or the
environment variable ``CARRACK_NATIVE=0`` for the whole process).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from carrack.errors import InvalidArgument
from carrack.ir.graph import Graph, Node, canonical_domain
from carrack.passes.facts import Fact, numpy_dtype

#: SessionOptions config entry: "auto" (default: the table's first available candidate) or "numpy"
KERNELS_CONFIG_KEY = "carrack.kernels"
KERNELS_CHOICES = ("auto", "numpy")

NUMPY = "numpy"
NATIVE = "native"


@dataclass(frozen=True)
class Site:
    """What the plan knows about one node when it picks its implementation."""

    node: Node
    facts: Mapping[str, Fact]
    constants: Mapping[str, Any]

    def dtype(self, index: int = 0) -> np.dtype | None:
        """The dtype of input `index`, None when unknown (or the input is omitted)."""
        name = self.node.inputs[index] if index < len(self.node.inputs) else ""
        if not name:
            return None
        if name in self.constants and isinstance(self.constants[name], np.ndarray):
            return self.constants[name].dtype
        fact = self.facts.get(name)
        return None if fact is None or fact.tensor is None else numpy_dtype(fact.elem_type)

    def constant(self, index: int) -> bool:
        name = self.node.inputs[index] if index < len(self.node.inputs) else ""
        return bool(name) and isinstance(self.constants.get(name), np.ndarray)

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attrs.get(name, default)


Predicate = Callable[[Site], bool]


@dataclass(frozen=True)
class Candidate:
    """One implementation of an operator: its name, the native libraries it needs, its static predicate, and the
    run-time test that remains where sizes decide (documentation; the kernel applies it)."""

    name: str
    libraries: tuple[str, ...] = ()
    accepts: Predicate | None = None
    runtime: str = ""

    def available(self, site: Site) -> bool:
        return all(library_loads(lib) for lib in self.libraries) and (self.accepts is None or self.accepts(site))


# -- the native libraries, as the kernels load them ---------------------------------------------------------------
def _convolution() -> bool:
    from carrack.native import convolution

    return convolution.load() is not None


def _matmul() -> bool:
    from carrack.native import matmul

    return matmul._load() is not None


def _rowops() -> bool:
    from carrack.native import rowops

    return rowops.library() is not None


def _qgemm() -> bool:
    from carrack.native import qgemm

    return qgemm.library() is not None


def _qconv() -> bool:
    from carrack.native import qconv

    return qconv.library() is not None


_LIBRARIES: dict[str, Callable[[], bool]] = {
    "convolution": _convolution, "matmul": _matmul, "rowops": _rowops, "qgemm": _qgemm, "qconv": _qconv,
}


def library_loads(name: str) -> bool:
    """Whether the native library `name` (a key of the table's `libraries`) is usable in this process now."""
    return _LIBRARIES[name]()


# -- static predicates ----------------------------------------------------------------------------------------------
_F32, _F16 = np.dtype(np.float32), np.dtype(np.float16)
_8BIT = (np.dtype(np.uint8), np.dtype(np.int8))


def _unknown_or(site: Site, index: int, dtypes: tuple[np.dtype, ...]) -> bool:
    """Input `index` has one of `dtypes`, or its dtype is not known before the run (the kernel then checks it).
    (Not `dtype in (None, ...)`: numpy compares None equal to float64.)"""
    dtype = site.dtype(index)
    return dtype is None or any(dtype == d for d in dtypes)


def _float32_or_unknown(index: int = 0) -> Predicate:
    return lambda site: _unknown_or(site, index, (_F32,))


def _float_or_unknown(site: Site) -> bool:
    """float32, or float16 computed through the float32 kernels (carrack.ops.half)."""
    return _unknown_or(site, 0, (_F32, _F16))


def _constant(*indices: int) -> Predicate:
    return lambda site: all(site.constant(i) for i in indices)


def _two_d_pool(site: Site) -> bool:
    shape = site.attr("kernel_shape")
    return shape is not None and len(shape) == 2 and _float_or_unknown(site)


def _eight_bit_max_pool(site: Site) -> bool:
    return _unknown_or(site, 0, _8BIT) and not any(site.node.outputs[1:])


def _inference_batch_norm(site: Site) -> bool:
    return (len(site.node.inputs) >= 5 and all(site.constant(i) for i in range(1, 5))
            and all(site.dtype(i) == _F32 for i in range(1, 5))
            and not any(site.node.outputs[1:]) and not site.attr("training_mode", 0) and _unknown_or(site, 0, (_F32,)))


def _float32_stash(site: Site) -> bool:
    return int(site.attr("stash_type", 1)) == 1 and _float32_or_unknown()(site)


def _numpy_only() -> tuple[Candidate, ...]:
    return (Candidate(NUMPY),)


def _native_first(libraries: tuple[str, ...], accepts: Predicate | None = None, runtime: str = ""
                  ) -> tuple[Candidate, ...]:
    return Candidate(NATIVE, libraries, accepts, runtime), Candidate(NUMPY)


MS = "com.microsoft"
CARRACK = "carrack"

_CONV = _native_first(("convolution",), _float_or_unknown,
                      "geometry and sizes pick the depthwise, direct, 1x1 or im2col kernel; the call is bound once "
                      "per input shape by the plan's per-size evaluation")
_PRODUCT = _native_first(("matmul",), _float_or_unknown,
                         "carrack.native.matmul.chosen(rows, depth, cols): 8-256 rows and sides >= 64, or any "
                         "size while BLAS would use more threads than the run allows; numpy where BLAS stays on "
                         "one thread (numpy_is_faster: 2^18 multiply-adds, 9216 for a vector, 460800 from "
                         "OpenBLAS 0.3.27)")
_GEMM = _native_first(("matmul",), _float_or_unknown,
                      "A @ B^T for at most 16 rows (transB), numpy where BLAS stays on one thread "
                      "(numpy_is_faster)")
_ROWS = _native_first(("rowops",), _float32_or_unknown())
_ATTENTION = _native_first(("rowops", "matmul"), _float32_or_unknown(),
                           "scores and context products by the native tile where carrack.native.matmul.chosen")
_INT8_WEIGHT = "the weight shifts into int8, 8-bit activations with one zero point"

#: (domain, op_type) -> the candidates, best first
TABLE: dict[tuple[str, str], tuple[Candidate, ...]] = {
    ("", "Conv"): _CONV,
    (MS, "FusedConv"): _CONV,
    (CARRACK, "FusedConv"): _CONV,
    (CARRACK, "InvertedResidual"): _CONV,
    ("", "MatMul"): _PRODUCT,
    (CARRACK, "FusedMatMul"): _PRODUCT,
    ("", "Gemm"): _GEMM,
    (MS, "FusedGemm"): _GEMM,
    (CARRACK, "FusedGemm"): _GEMM,
    ("", "Softmax"): _native_first(("rowops",), _float32_or_unknown(), "the normalized axis is the trailing one"),
    ("", "LayerNormalization"): _native_first(("rowops",), _float32_stash),
    (MS, "LayerNormalization"): _ROWS,
    (MS, "SkipLayerNormalization"): _native_first(("rowops",), _float32_or_unknown(),
                                                   "parameters of one row, skip of the input's shape"),
    ("", "Gelu"): _ROWS,
    (MS, "Gelu"): _ROWS,
    (MS, "BiasGelu"): _ROWS,
    (MS, "FastGelu"): _ROWS,
    (MS, "Attention"): _ATTENTION,
    (MS, "MultiHeadAttention"): _ATTENTION,
    ("", "MaxPool"): (Candidate(NATIVE, ("convolution",), _two_d_pool),
                      Candidate(NATIVE, ("qconv",), _eight_bit_max_pool), Candidate(NUMPY)),
    ("", "AveragePool"): _native_first(("convolution",), _two_d_pool),
    ("", "GlobalAveragePool"): _native_first(("convolution",), _float_or_unknown),
    ("", "BatchNormalization"): _native_first(("convolution",), _inference_batch_norm),
    (CARRACK, "FusedBatchNormalization"): _native_first(("convolution",), _inference_batch_norm),
    ("", "MatMulInteger"): _native_first(("qgemm",), _constant(1), _INT8_WEIGHT),
    ("", "QLinearMatMul"): _native_first(("qgemm",), _constant(3), _INT8_WEIGHT + ", K within exact range"),
    (MS, "QGemm"): _native_first(("qgemm",), _constant(3), _INT8_WEIGHT),
    (MS, "MatMulIntegerToFloat"): _native_first(("qgemm",), _constant(1), _INT8_WEIGHT),
    (MS, "DynamicQuantizeMatMul"): _native_first(("qgemm",), _constant(1), _INT8_WEIGHT),
    (CARRACK, "QLinearMatMulExact"): _native_first(("qgemm",), _constant(1), _INT8_WEIGHT),
    (CARRACK, "DynamicQuantizedMatMul"): _native_first(("qgemm",), _constant(1), _INT8_WEIGHT),
    ("", "QLinearConv"): _native_first(("qconv",), _constant(1, 3, 4, 6),
                                       "8-bit input of the weight's rank, geometry planned per input shape; the "
                                       "rest as exact float products on the native float convolution"),
    ("", "ConvInteger"): _native_first(("convolution",), None, "exact float products on the native convolution"),
    ("", "CausalConvWithState"): _native_first(("convolution",), _float_or_unknown),
    (CARRACK, "QLinearConvExact"): _native_first(("qconv",), _constant(1, 2, 3),
                                                 "8-bit input of the weight's rank"),
    (MS, "QLinearAdd"): _native_first(("qconv",), None, "operands of one shape with at least 4096 elements"),
    **{("", op): _native_first(("rowops",), _float32_or_unknown(),
                               "float32 arrays large enough to split, at 2 or more threads (else numpy)")
       for op in ("Add", "Sub", "Mul", "Div")},
}


def candidates(domain: str, op_type: str) -> tuple[Candidate, ...]:
    """The implementations of an operator, best first (numpy alone for operators with one implementation)."""
    return TABLE.get((canonical_domain(domain), op_type), _numpy_only())


def force_numpy(options: Any) -> bool:
    """Whether `options` (SessionOptions, or None) ask for the numpy implementations only ("carrack.kernels")."""
    configs = getattr(options, "_configs", None) or {}
    value = configs.get(KERNELS_CONFIG_KEY, "auto").strip().lower()
    if value not in KERNELS_CHOICES:
        raise InvalidArgument(f"session config entry {KERNELS_CONFIG_KEY!r} must be one of "
                              f"{', '.join(KERNELS_CHOICES)}; got {value!r}")
    return value == NUMPY


def choose(node: Node, facts: Mapping[str, Fact] | None = None, constants: Mapping[str, Any] | None = None,
           numpy_only: bool = False) -> str:
    """The implementation that runs `node`: the first candidate of the table whose predicate holds."""
    options = candidates(node.domain, node.op_type)
    if numpy_only or len(options) == 1:
        return NUMPY
    site = Site(node, facts or {}, constants or {})
    for candidate in options:
        if candidate.available(site):
            return candidate.name
    return NUMPY


def node_key(node: Node) -> str:
    """The name a node's choice is recorded under: its first output (unique in a graph), else its name."""
    return next((o for o in node.outputs if o), node.name)


def choose_all(graph: Graph, facts: Mapping[str, Fact], numpy_only: bool = False) -> dict[str, str]:
    """{node key: implementation} for every node of `graph` whose operator has more than one implementation."""
    return {node_key(node): choose(node, facts, graph.initializers, numpy_only) for node in graph.nodes
            if len(candidates(node.domain, node.op_type)) > 1}

