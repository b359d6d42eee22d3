"""Fused kernels the optimizer emits, under onnxruntime's com.microsoft names so optimized models stay portable."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from carrack.ops import registry
from carrack.ops.registry import Kernel, register

MS = "com.microsoft"


def _activation(name: str, params: list[float]):
    if name == "Relu":
        return lambda y: np.maximum(y, 0)
    if name == "Sigmoid":
        return lambda y: np.reciprocal(1 + np.exp(-y))
    if name == "Tanh":
        return np.tanh
    if name == "LeakyRelu":
        alpha = params[0] if params else 0.01
        return lambda y: np.where(y < 0, y * y.dtype.type(alpha), y)
    if name == "HardSigmoid":
        alpha, beta = params if len(params) == 2 else (0.2, 0.5)
        return lambda y: np.clip(y * y.dtype.type(alpha) + y.dtype.type(beta), 0, 1)
    if name == "HardSwish":
        return lambda y: y * np.clip(y * y.dtype.type(1 / 6) + y.dtype.type(0.5), 0, 1)
    if name == "Gelu":
        from carrack.ops.elementwise import erfc

        return lambda y: (y * y.dtype.type(0.5) * erfc(-y * y.dtype.type(0.7071067811865476))).astype(y.dtype)
    if name == "Clip":
        lo, hi = params if len(params) == 2 else (-np.inf, np.inf)
        return lambda y: np.clip(y, y.dtype.type(lo), y.dtype.type(hi))
    raise ValueError(f"unsupported fused activation '{name}'")


class _FusedBase(Kernel):
    base_op = ""
    base_opset = 11

    def setup(self) -> None:
        attrs = {k: v for k, v in self.node.attrs.items() if not k.startswith("activation")}
        base = replace(self.node, op_type=self.base_op, domain="", attrs=attrs)
        cls, version = registry.resolve("", self.base_op, self.base_opset)
        if cls is None:
            self.fail(f"no {self.base_op} kernel to fuse into")
        self.inner = cls(base, version, self.ctx)
        try:
            self.act = _activation(self.attr("activation", ""), self.activation_params())
        except ValueError as e:
            self.fail(str(e))

    def activation_params(self) -> list[float]:
        return list(self.attr("activation_params", []))

    def run(self, *inputs):
        return self.act(self.inner.run(*inputs))


@register("FusedConv", domain="carrack")
@register("FusedConv", domain=MS)
class FusedConv(_FusedBase):
    base_op = "Conv"


@register("FusedGemm", domain=MS)
class FusedGemm(_FusedBase):
    base_op = "Gemm"
    base_opset = 13

    def activation_params(self) -> list[float]:
        if self.node.domain == MS:
            return [self.attr(k) for k in ("activation_alpha", "activation_beta") if self.attr(k) is not None]
        return super().activation_params()


@register("FusedGemm", domain="carrack")
class CarrackFusedGemm(FusedGemm):
    pass


@register("FusedMatMul", domain="carrack")
class FusedMatMul(_FusedBase):
    base_op = "MatMul"
    base_opset = 13
