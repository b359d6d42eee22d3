"""Value types: tensors with element type and symbolic shape, sequences, optionals, maps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from carrack.ir.dims import Shape, format_shape
from carrack.ir.dtypes import to_numpy, type_name


@dataclass(frozen=True)
class TensorType:
    elem_type: int  # ONNX TensorProto code; 0 when unknown
    shape: Shape | None = None  # None: rank unknown

    @property
    def dtype(self) -> np.dtype | None:
        return to_numpy(self.elem_type) if self.elem_type else None

    def ort_name(self) -> str:
        return f"tensor({type_name(self.elem_type)})" if self.elem_type else "tensor(undefined)"

    def __str__(self) -> str:
        return f"{self.ort_name()}{format_shape(self.shape)}"


@dataclass(frozen=True)
class SequenceType:
    elem: ValueType | None

    def ort_name(self) -> str:
        return f"seq({self.elem.ort_name() if self.elem else 'undefined'})"


@dataclass(frozen=True)
class OptionalType:
    elem: ValueType | None

    def ort_name(self) -> str:
        return f"optional({self.elem.ort_name() if self.elem else 'undefined'})"


@dataclass(frozen=True)
class MapType:
    key_type: int
    value: ValueType | None

    def ort_name(self) -> str:
        return f"map({type_name(self.key_type)},{self.value.ort_name() if self.value else 'undefined'})"


ValueType = TensorType | SequenceType | OptionalType | MapType
