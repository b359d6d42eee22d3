"""Kernels that compute directly on ggml-quantized (GGUF) tensors inside carrack graphs."""

from __future__ import annotations

import numpy as np

from carrack.gguf.dequant import supported_types
from carrack.gguf.matmul import quantized_matmul
from carrack.gguf.types import GGML_BLOCK_SIZES, GGMLType
from carrack.ops.registry import Kernel, register

CARRACK_DOMAIN = "carrack"


@register("GGUFMatMul", domain=CARRACK_DOMAIN)
class GGUFMatMul(Kernel):
    """Y = X @ W.T for float32 X (..., K) and a weight W (N, K) given as raw ggml blocks (uint8 input `w`).

    Attributes: `ggml_type` (int, a ggml type id) and `shape` ([N, K], the logical weight shape). Y is (..., N).
    """

    def setup(self) -> None:
        type_id = int(self.required_attr("ggml_type"))
        try:
            self.ggml_type = GGMLType(type_id)
        except ValueError:
            self.fail(f"unknown ggml_type {type_id}")
        if self.ggml_type not in supported_types():
            self.fail(f"ggml_type {self.ggml_type.name} cannot be decoded")
        shape = [int(s) for s in self.required_attr("shape")]
        if len(shape) != 2 or min(shape) < 0:
            self.fail(f"shape must be [N, K] with non-negative sizes, got {shape}")
        block_size = GGML_BLOCK_SIZES[self.ggml_type][0]
        if shape[1] % block_size:
            self.fail(f"K = {shape[1]} is not a multiple of the {self.ggml_type.name} block size {block_size}")
        self.shape = (shape[0], shape[1])

    def run(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return quantized_matmul(x, w, self.ggml_type, self.shape)
