"""What is known statically about a value: its type, symbolic shape and, for small int tensors, its contents.

Contents may be symbolic too: ``Shape(x)`` of an input with dims ``(batch, 128)`` is the 1-D tensor ``[batch, 128]``,
and the Gather/Concat/Reshape chains that follow are computed on those symbols.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from carrack.ir.dtypes import to_numpy
from carrack.ir.symbolic import DimLike
from carrack.ir.types import TensorType, ValueType

#: the largest constant whose contents inference carries along (bigger ones keep only type and shape)
MAX_CARRIED_ELEMENTS = 4096


@dataclass(frozen=True)
class Fact:
    type: ValueType | None = None
    #: contents when known: a numeric ndarray, or an object ndarray holding ints and symbolic dims
    value: np.ndarray | None = None

    @property
    def tensor(self) -> TensorType | None:
        return self.type if isinstance(self.type, TensorType) else None

    @property
    def shape(self) -> tuple[DimLike, ...] | None:
        t = self.tensor
        return None if t is None else t.shape

    @property
    def rank(self) -> int | None:
        s = self.shape
        return None if s is None else len(s)

    @property
    def elem_type(self) -> int:
        t = self.tensor
        return t.elem_type if t is not None else 0

    def is_concrete(self) -> bool:
        """Contents known and free of symbols."""
        return self.value is not None and self.value.dtype != object

    def dims_value(self) -> list[DimLike] | None:
        """Contents of a 0-D/1-D int tensor as a list of dims (ints or symbols), if known."""
        if self.value is None or self.value.ndim > 1:
            return None
        return [_as_dim(v) for v in self.value.reshape(-1)]


def _as_dim(v) -> DimLike:
    return int(v) if isinstance(v, (int, np.integer)) else v


def const_fact(value: np.ndarray, elem_type: int) -> Fact:
    carried = value if value.size <= MAX_CARRIED_ELEMENTS else None
    return Fact(TensorType(elem_type, tuple(int(d) for d in value.shape)), carried)


def tensor_fact(elem_type: int, shape: tuple[DimLike, ...] | None, value: np.ndarray | None = None) -> Fact:
    if value is not None and not isinstance(value, np.ndarray):
        boxed = np.empty((), dtype=object)
        boxed[()] = value
        value = boxed if not isinstance(value, (int, np.integer)) else np.asarray(value, dtype=np.int64)
    return Fact(TensorType(elem_type, None if shape is None else tuple(shape)), value)


def dims_array(dims: list[DimLike]) -> np.ndarray:
    """1-D contents for a shape tensor: int64 when every dim is known, else an object array."""
    if all(isinstance(d, int) for d in dims):
        return np.array(dims, dtype=np.int64)
    out = np.empty(len(dims), dtype=object)
    out[:] = dims
    return out


def numpy_dtype(elem_type: int) -> np.dtype | None:
    try:
        return to_numpy(elem_type)
    except ValueError:
        return None
