"""Weights of a GGUF language model as carrack holds them in memory.

F32 tensors stay zero-copy views of the memory-mapped file. F16 / BF16 matrices stay 16-bit views of the file too
(`HalfLinear`: carrack/native/halfmat.c widens them in registers while generating, a panel at a time into a float32
buffer for a BLAS product on prompts). Block-quantized matrices stay as their ggml blocks and are multiplied
straight from them (`QuantizedLinear`); with ``dequantize=True`` every matrix is decoded
to float32 at load instead, which is the reference path the quantized products are checked against.

``activations`` picks how a quantized product treats x: ``"int8"`` (the default, as llama.cpp) quantizes each
32 values of x to 8 bits and multiplies in integer dot products (carrack/native/qdot.c); ``"float"`` keeps x
float32 (carrack/native/qmatvec.c while generating, decode + BLAS for prompts), which differs from
dequantize-then-matmul only in the order of float additions.
"""

from __future__ import annotations

import numpy as np

from carrack.errors import InvalidModel, UnsupportedModel
from carrack.gguf.dequant import dequantize, supported_types
from carrack.gguf.matmul import chunk_rows, quantized_matmul
from carrack.gguf.reader import GGUFFile, GGUFTensor
from carrack.gguf.types import GGMLType
from carrack.native import halfmat, qdot, qmatvec

#: rows of x up to which a quantized product runs in the native kernel rather than decode + BLAS
NATIVE_MAX_ROWS = 8

_FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
#: 16-bit float types kept as 16 bits (HalfLinear), with the numpy dtype that views their bytes
_HALF_TYPES = {GGMLType.F16: np.float16, GGMLType.BF16: np.uint16}
#: float32 bytes of the panel of widened F16/BF16 rows per BLAS call on prompts: large, because each multithreaded
#: BLAS call pays a synchronisation that a loaded machine makes costly (4 MiB panels ran 3x slower at 2 threads)
HALF_PANEL_BYTES = 16 << 20
#: how a quantized product may treat its activations (see the module docstring)
ACTIVATION_MODES = ("int8", "float")


def checked_activations(activations: str) -> str:
    if activations not in ACTIVATION_MODES:
        raise ValueError(f"activations={activations!r}: expected one of {', '.join(map(repr, ACTIVATION_MODES))}")
    return activations


class FloatLinear:
    """``x @ W.T`` with a float32 weight W of shape (N, K)."""

    def __init__(self, weight: np.ndarray, name: str):
        self.weight = weight
        self.name = name
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.nbytes

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x @ self.weight.T

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.weight[ids], dtype=np.float32)

    def scratch_bytes(self, n_rows: int) -> int:
        return 0


class HalfLinear:
    """``x @ W.T`` for an F16 or BF16 weight W of shape (N, K) kept as 16 bits a value: float16, or BF16's bits as
    uint16. A few rows of x run in halfmat.c's matrix-vector kernel (the weights read once at 2 bytes a value);
    more rows widen a panel of weight rows at a time into one reused float32 buffer for a BLAS product."""

    def __init__(self, weight: np.ndarray, name: str, threads: int | None = None):
        if weight.dtype not in (np.float16, np.uint16) or weight.ndim != 2:
            raise ValueError(f"HalfLinear {name}: weight must be 2-D float16 or uint16 (BF16 bits), got "
                             f"{weight.ndim}-D {weight.dtype}")
        self.weight = weight
        self.name = name
        self.threads = threads
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.nbytes
        self.matvec = halfmat.ProductGroup([weight], threads)  # the address bound once, not per token

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.ndim == 2 and x.shape[0] <= NATIVE_MAX_ROWS:
            y = self.matvec(x)
            if y is not None:
                return y[0]
        n, k = self.out_features, self.in_features
        x2 = np.ascontiguousarray(x.reshape(-1, k), dtype=np.float32)
        step = self._panel_rows()
        panel = np.empty((step, k), dtype=np.float32)
        result = np.empty((x2.shape[0], n), dtype=np.float32)
        for start in range(0, n, step):
            stop = min(n, start + step)
            if not halfmat.decode_rows(self.weight, start, stop, panel[:stop - start], self.threads):
                panel[:stop - start] = self._widen(self.weight[start:stop])
            # BLAS writes the columns of the panel straight into the result's rows (a strided output costs the
            # same; transposing an (n, rows) result afterwards cost ~15% of an F16 prompt)
            np.matmul(x2, panel[:stop - start].T, out=result[:, start:stop])
        return result.reshape(*x.shape[:-1], n)

    def _widen(self, rows: np.ndarray) -> np.ndarray:
        if rows.dtype == np.uint16:  # BF16: the upper 16 bits of a float32
            return (rows.astype(np.uint32) << 16).view(np.float32)
        return rows.astype(np.float32)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self._widen(self.weight[ids])

    def _panel_rows(self) -> int:
        return max(1, min(self.out_features, HALF_PANEL_BYTES // (4 * self.in_features)))

    def scratch_bytes(self, n_rows: int) -> int:  # the float32 panel and the result
        step = self._panel_rows()
        return step * self.in_features * 4 + n_rows * self.out_features * 4


class QuantizedLinear:
    """``x @ W.T`` for a weight kept as ggml blocks (Q8_0, Q4_0, K-quants, ...).

    With int8 activations, every product of a type qdot.c decodes is one native call (a matrix-vector product while
    generating, a GEMM over the blocks for a prompt). With float activations, a few rows of x (generation, small
    batches) go to carrack/native/qmatvec.c (each weight row decoded in L1 and multiplied there) for the types it
    decodes; larger batches and the other types are decoded a chunk of rows at a time into a float32 buffer for a
    BLAS product (quantized_matmul).
    """

    def __init__(self, tensor: GGUFTensor, threads: int | None = None, activations: str = "int8"):
        self.name = tensor.name
        self.ggml_type = tensor.type
        self.out_features, self.in_features = tensor.shape
        self.raw = tensor.raw()
        self.nbytes = tensor.nbytes
        self.row_bytes = self.ggml_type.nbytes(self.in_features)
        self.rows_2d = self.raw.reshape(self.out_features, self.row_bytes)
        self.threads = threads
        self.native = qmatvec.supports(self.ggml_type)
        self.int8 = checked_activations(activations) == "int8" and qdot.supports(self.ggml_type)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.int8 and x.ndim == 2:
            y = qdot.matmul(self.rows_2d, self.ggml_type, x, self.threads)
            if y is not None:
                return y
        if self.native and x.ndim == 2 and x.shape[0] <= NATIVE_MAX_ROWS:
            y = qmatvec.matvec(self.rows_2d, self.ggml_type, x, self.threads)
            if y is not None:
                return y
        if self.native and x.ndim == 2:
            y = self._decoded_panels_product(x)
            if y is not None:
                return y
        return quantized_matmul(x, self.raw, self.ggml_type, (self.out_features, self.in_features))

    def _decoded_panels_product(self, x: np.ndarray) -> np.ndarray | None:
        """x @ W.T a panel of weight rows at a time, each decoded natively into one reused float32 buffer."""
        n, k = self.out_features, self.in_features
        step = min(n, chunk_rows(k))
        panel = np.empty((step, k), dtype=np.float32)
        x2 = np.ascontiguousarray(x, dtype=np.float32)
        result = np.empty((x.shape[0], n), dtype=np.float32)
        for start in range(0, n, step):
            stop = min(n, start + step)
            if not qmatvec.decode_rows(self.rows_2d, self.ggml_type, start, stop, panel[:stop - start]):
                return None
            np.matmul(x2, panel[:stop - start].T, out=result[:, start:stop])  # no transposed copy (HalfLinear)
        return result

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows `ids` (an embedding lookup decodes only the tokens it needs)."""
        rows = self.rows_2d[ids]
        return dequantize(rows, self.ggml_type, (len(ids), self.in_features))

    def scratch_bytes(self, n_rows: int) -> int:
        if self.int8:  # quantized activations and their sums (2.625 bytes a value) + per-thread decoded row tiles
            k = self.in_features  # + the result
            return n_rows * k * 21 // 8 + (self.threads or 1) * qdot.ROW_TILE * k * 3 + n_rows * self.out_features * 4
        step = min(self.out_features, chunk_rows(self.in_features))
        return step * self.in_features * 4 + 2 * n_rows * self.out_features * 4


Linear = FloatLinear | HalfLinear | QuantizedLinear


def grouped_products(linears: list[Linear], x: np.ndarray) -> list[np.ndarray] | None:
    """[m(x) for m in linears] in one native call when every matrix is quantized with int8 activations (x
    quantized once, one parallel region: a layer's q, k, v or gate, up projections); None otherwise."""
    if x.ndim != 2 or not all(isinstance(m, QuantizedLinear) and m.int8 for m in linears):
        return None
    return qdot.matmul_group([(m.rows_2d, m.ggml_type) for m in linears], x, linears[0].threads)


class SharedInputProducts:
    """A layer's matrices that share their input (q, k, v; gate, up), grouped once at load: `products(x)` is
    [m(x) for m in linears], in one native call where their kind allows it (16-bit matrices: halfmat's
    ProductGroup for a few rows of x; int8-quantized ones: qdot's matmul_group), else one call per matrix."""

    def __init__(self, linears: list[Linear]):
        self.linears = linears
        self.half_group = None
        if all(isinstance(m, HalfLinear) for m in linears):
            self.half_group = halfmat.ProductGroup([m.weight for m in linears], linears[0].threads)

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        if self.half_group is not None and x.ndim == 2 and x.shape[0] <= NATIVE_MAX_ROWS:
            outputs = self.half_group(x)
            if outputs is not None:
                return outputs
        outputs = grouped_products(self.linears, x)
        return outputs if outputs is not None else [m(x) for m in self.linears]


class WeightStore:
    """Looks tensors up by llama.cpp name; a missing required tensor is an InvalidModel naming it."""

    def __init__(self, gguf: GGUFFile, arch_name: str, dequantize_all: bool = False, threads: int | None = None,
                 activations: str = "int8"):
        self.gguf = gguf
        self.activations = checked_activations(activations)
        self.threads = threads
        self.arch_name = arch_name
        self.dequantize_all = dequantize_all
        self.float_copies: list[str] = []  # F16/BF16 matrices converted to float32 at load (dequantize_all)

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def tensor(self, name: str) -> GGUFTensor:
        tensor = self.gguf.tensors.get(name)
        if tensor is None:
            raise InvalidModel(f"{self.gguf.path}: tensor '{name}' is missing; the {self.arch_name} architecture "
                               "needs it")
        if tensor.type not in supported_types():
            raise UnsupportedModel(f"{self.gguf.path}: tensor '{name}' has ggml type {tensor.type.name}, which "
                                   "carrack cannot decode")
        return tensor

    def vector(self, name: str, length: int) -> np.ndarray:
        tensor = self.tensor(name)
        if tensor.n_elements != length:
            raise InvalidModel(f"{self.gguf.path}: tensor '{name}' has {tensor.n_elements} values, expected {length}")
        return np.asarray(dequantize(tensor.raw(), tensor.type, (length,)), dtype=np.float32)

    def optional_vector(self, name: str, length: int) -> np.ndarray | None:
        return self.vector(name, length) if self.has(name) else None

    def matrix(self, name: str, shape: tuple[int, int]) -> Linear:
        tensor = self.tensor(name)
        if tuple(tensor.shape) != shape:
            raise InvalidModel(f"{self.gguf.path}: tensor '{name}' has shape {list(tensor.shape)}, expected "
                               f"{list(shape)} (rows = outputs, columns = inputs)")
        if tensor.type in _HALF_TYPES and not self.dequantize_all:
            bits = tensor.data().view(_HALF_TYPES[tensor.type])  # native byte order, zero-copy when it can be
            return HalfLinear(bits.reshape(shape), name, self.threads)
        if tensor.type in _FLOAT_TYPES or self.dequantize_all:
            if tensor.type != GGMLType.F32:
                self.float_copies.append(name)
            weight = dequantize(tensor.raw(), tensor.type, shape)
            return FloatLinear(weight, name)
        return QuantizedLinear(tensor, self.threads, self.activations)
