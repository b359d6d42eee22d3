"""onnxruntime.transformers.io_binding_helper's TypeHelper (used by optimum): type names between onnxruntime's
'tensor(float)' strings, numpy and torch."""

from __future__ import annotations

from typing import Any

import numpy as np

from carrack.ir.dtypes import to_numpy

_ORT_TO_ONNX = {"tensor(float)": 1, "tensor(uint8)": 2, "tensor(int8)": 3, "tensor(uint16)": 4, "tensor(int16)": 5,
                "tensor(int32)": 6, "tensor(int64)": 7, "tensor(string)": 8, "tensor(bool)": 9, "tensor(float16)": 10,
                "tensor(double)": 11, "tensor(uint32)": 12, "tensor(uint64)": 13, "tensor(bfloat16)": 16}


def _torch() -> Any:
    import torch  # optional: only the torch conversions need it

    return torch


class TypeHelper:
    @staticmethod
    def get_input_type(ort_session: Any, name: str) -> str:
        for arg in ort_session.get_inputs():
            if arg.name == name:
                return arg.type
        raise ValueError(f"input {name} not found")

    @staticmethod
    def get_output_type(ort_session: Any, name: str) -> str:
        for arg in ort_session.get_outputs():
            if arg.name == name:
                return arg.type
        raise ValueError(f"output {name} not found")

    @staticmethod
    def ort_type_to_onnx_type(ort_type: str) -> int:
        if ort_type not in _ORT_TO_ONNX:
            raise ValueError(f"{ort_type} not found in map")
        return _ORT_TO_ONNX[ort_type]

    @staticmethod
    def ort_type_to_numpy_type(ort_type: str) -> Any:
        code = TypeHelper.ort_type_to_onnx_type(ort_type)
        return np.dtype(to_numpy(code)).type if code != 8 else np.str_

    @staticmethod
    def ort_type_to_torch_type(ort_type: str) -> Any:
        return TypeHelper.numpy_type_to_torch_type(TypeHelper.ort_type_to_numpy_type(ort_type))

    @staticmethod
    def numpy_type_to_torch_type(numpy_type: Any) -> Any:
        torch = _torch()
        if np.dtype(numpy_type).name == "bfloat16":
            return torch.bfloat16
        return torch.from_numpy(np.zeros(0, dtype=numpy_type)).dtype

    @staticmethod
    def torch_type_to_numpy_type(torch_type: Any) -> Any:
        torch = _torch()
        if torch_type == torch.bfloat16:
            from ml_dtypes import bfloat16

            return bfloat16
        return torch.zeros(0, dtype=torch_type).numpy().dtype.type

    @staticmethod
    def get_io_onnx_type_map(ort_session: Any) -> dict[str, int]:
        args = list(ort_session.get_inputs()) + list(ort_session.get_outputs())
        return {a.name: TypeHelper.ort_type_to_onnx_type(a.type) for a in args}

    @staticmethod
    def get_io_numpy_type_map(ort_session: Any) -> dict[str, Any]:
        args = list(ort_session.get_inputs()) + list(ort_session.get_outputs())
        return {a.name: TypeHelper.ort_type_to_numpy_type(a.type) for a in args}

    @staticmethod
    def get_io_torch_type_map(ort_session: Any) -> dict[str, Any]:
        args = list(ort_session.get_inputs()) + list(ort_session.get_outputs())
        return {a.name: TypeHelper.ort_type_to_torch_type(a.type) for a in args}
