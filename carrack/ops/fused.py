"""Fused kernels the optimizer emits, under onnxruntime's com.microsoft names so optimized models stay portable."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from carrack.native import rowlinear
from carrack.native.convolution import ACTIVATIONS
from carrack.ops import half, registry
from carrack.ops.conv import Epilogue, convolution_prepared_bytes, convolution_scratch_bytes
from carrack.ops.registry import Kernel, bound_or_run_into, register

MS = "com.microsoft"


def _activation(name: str, params: list[float]):
    """The activation as a function that overwrites its argument (a fresh result the fused kernel owns)."""
    if not name:
        return lambda y: y
    if name == "Relu":
        from carrack.ops.activations import relu

        return lambda y: relu(y, out=y)
    if name == "Sigmoid":
        return _sigmoid_inplace
    if name == "Tanh":
        return lambda y: np.tanh(y, out=y)
    if name == "LeakyRelu":
        alpha = params[0] if params else 0.01
        return lambda y: np.multiply(y, y.dtype.type(alpha), out=y, where=y < 0)
    if name == "HardSigmoid":
        alpha, beta = params if len(params) == 2 else (0.2, 0.5)
        return lambda y: _hard_sigmoid_inplace(y, alpha, beta)
    if name == "HardSwish":
        return lambda y: np.multiply(y, _hard_sigmoid_inplace(y.copy(), 1 / 6, 0.5), out=y)
    if name == "Gelu":
        from carrack.ops.elementwise import gelu

        return lambda y: gelu(y, out=y)
    if name == "Clip":
        lo, hi = params if len(params) == 2 else (-np.inf, np.inf)
        return lambda y: np.clip(y, y.dtype.type(lo), y.dtype.type(hi), out=y)
    raise ValueError(f"unsupported fused activation '{name}'")


def _epilogue(name: str, params: list[float], apply: Callable[[np.ndarray], np.ndarray]) -> Epilogue:
    """The activation for the convolution kernels: native code and parameters where the C kernels know it."""
    code = ACTIVATIONS.get(name, -1)
    if name == "Clip":
        alpha, beta = params if len(params) == 2 else (-np.inf, np.inf)
    elif name == "LeakyRelu":
        alpha, beta = (params[0] if params else 0.01), 0.0
    elif name == "HardSigmoid":
        alpha, beta = params if len(params) == 2 else (0.2, 0.5)
    else:
        alpha, beta = 0.0, 0.0
    return Epilogue(apply, code, float(alpha), float(beta))


def _sigmoid_inplace(y: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-y) overflows to inf for very negative y: 1 / (1 + inf) is the 0 wanted
        np.negative(y, out=y)
        np.exp(y, out=y)
    np.add(y, 1, out=y)
    return np.reciprocal(y, out=y)


def _hard_sigmoid_inplace(y: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    np.multiply(y, y.dtype.type(alpha), out=y)
    np.add(y, y.dtype.type(beta), out=y)
    return np.clip(y, 0, 1, out=y)


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

    def prepare(self, constants):
        self.inner.prepare(constants)

    def run(self, *inputs):
        if hasattr(self.inner, "widened_product") and half.is_half(*inputs):
            return half.narrow(self.act(self.inner.widened_product(*inputs)))
        y = self.inner.run(*inputs)
        if type(y) is not np.ndarray or not y.flags.writeable or any(y is i for i in inputs):
            y = np.array(y)  # Conv, Gemm and MatMul return fresh arrays; anything else gets a private copy
        return self.act(y)


class _FusedIntoBase(_FusedBase):
    """A fused op whose layer can write into a planned buffer: the activation then runs in place there."""

    def run_into(self, out, *inputs):
        if hasattr(self.inner, "widened_product") and half.is_half(*inputs):
            return half.narrow(self.act(self.inner.widened_product(*inputs)), out)
        y = self.inner.run_into(out, *inputs)
        if y is not out:  # the planned buffer did not fit: the layer allocated its result itself
            return self.run(*inputs) if not (type(y) is np.ndarray and y.flags.writeable) else self.act(y)
        return self.act(out)

    def bind_into(self, out, *inputs):
        """The layer's bound call, then the activation in place (what `run_into` does when the layer writes into
        `out`)."""
        if half.is_half(*inputs):
            return None
        layer = self.inner.bind_into(out, *inputs)
        if layer is None:
            return None
        act = self.act

        def fused() -> None:
            layer()
            act(out)
        return fused


@register("FusedConv", domain="carrack")
@register("FusedConv", domain=MS)
class FusedConv(_FusedIntoBase):
    """Conv (+ Z) + activation: act(conv(X, W) + B + Z), onnxruntime's FusedConv. The convolution adds Z and
    applies the activation as it finishes its output (natively, before the one store, where it can)."""

    base_op = "Conv"
    prepares_shapes = True

    @classmethod
    def scratch_bytes(cls, node, facts) -> int:
        return convolution_scratch_bytes(node, facts)

    @classmethod
    def prepared_bytes(cls, node, constants) -> int:
        return convolution_prepared_bytes(node, constants)

    def setup(self) -> None:
        super().setup()
        self.epilogue = _epilogue(self.attr("activation", ""), self.activation_params(), self.act)

    def prepare_shape(self, shape: tuple[int, ...]) -> None:
        residual = len(self.node.inputs) > 3 and bool(self.node.inputs[3])
        self.inner.prepare_shape(shape, self.epilogue, residual)

    def run(self, x, w, b=None, z=None):
        return self.inner.run_into(None, x, w, b, activation=self.epilogue, residual=z)

    def run_into(self, out, x, w, b=None, z=None):
        return self.inner.run_into(out, x, w, b, activation=self.epilogue, residual=z)

    def bind_into(self, out, x, w, b=None, z=None):
        return self.inner.bind_into(out, x, w, b, activation=self.epilogue, residual=z)


@register("FusedBatchNormalization", domain="carrack")
class FusedBatchNormalization(_FusedIntoBase):
    """Inference BatchNormalization + activation: one native pass x * scale + shift -> activation where it can."""

    base_op = "BatchNormalization"
    base_opset = 15

    def setup(self) -> None:
        super().setup()
        epilogue = _epilogue(self.attr("activation", ""), self.activation_params(), self.act)
        self.native_act = epilogue.native() if epilogue.code >= 0 else None

    def run(self, x, *params):
        y = None if self.native_act is None else self.inner.native_affine(x, self.native_act)
        return super().run(x, *params) if y is None else y

    def run_into(self, out, x, *params):
        y = None if self.native_act is None else self.inner.native_affine(x, self.native_act, out)
        return super().run_into(out, x, *params) if y is None else y


@register("FusedGemm", domain=MS)
class FusedGemm(_FusedIntoBase):
    """Gemm + activation. A prepared linear layer of a few rows runs as one native call that applies the
    activation too (rowlinear.c), where it knows the activation."""

    base_op = "Gemm"
    base_opset = 13

    @classmethod
    def prepared_bytes(cls, node, constants) -> int:
        return registry.resolve("", cls.base_op, cls.base_opset)[0].prepared_bytes(node, constants)

    def setup(self) -> None:
        super().setup()
        name = self.attr("activation", "")
        #: the few-row kernel applies the activation (else the layer runs as Gemm, then the activation)
        self.rows_fused = name in rowlinear.ACTIVATIONS
        if self.rows_fused:
            epilogue = _epilogue(name, self.activation_params(), self.act)
            self.inner.row_activation = (rowlinear.ACTIVATIONS[name], epilogue.alpha, epilogue.beta)

    def activation_params(self) -> list[float]:
        if self.node.domain == MS:
            return [self.attr(k) for k in ("activation_alpha", "activation_beta") if self.attr(k) is not None]
        return super().activation_params()

    def run(self, a, b, c=None):
        y = self.inner.rows_into(None, a, b, c) if self.rows_fused else None
        return super().run(a, b, c) if y is None else y

    def run_into(self, out, a, b, c=None):
        y = self.inner.rows_into(out, a, b, c) if self.rows_fused else None
        return super().run_into(out, a, b, c) if y is None else y

    def bind_into(self, out, *inputs):
        call = self.inner.bind_rows(out, *inputs) if self.rows_fused else None
        return super().bind_into(out, *inputs) if call is None else call


@register("FusedGemm", domain="carrack")
class CarrackFusedGemm(FusedGemm):
    pass


@register("FusedMatMul", domain="carrack")
class FusedMatMul(_FusedIntoBase):
    base_op = "MatMul"
    base_opset = 13


def _block_output(out: np.ndarray, shape: tuple, x: np.ndarray) -> bool:
    """Whether invres.c can write the block's result straight into `out`."""
    return (out.shape == shape and out.dtype == np.float32 and out.flags.c_contiguous and out.flags.aligned
            and out.flags.writeable and not np.may_share_memory(out, x))


@register("InvertedResidual", domain="carrack")
class InvertedResidual(Kernel):
    """MobileNetV2's inverted-residual block (carrack.passes.fusions.fuse_inverted_residual): a 1x1 expansion
    (inputs 1 and 2 empty when the block has none), a depthwise 3x3 and a 1x1 projection, each with its activation,
    plus the block's input for stride 1. invres.c runs it as one call, band by band of output rows
    (carrack/native/invres.py); without it (no AVX-512, native kernels off, weights that are not constants) the
    convolutions run one after the other."""

    @classmethod
    def scratch_bytes(cls, node, facts) -> int:
        from carrack.native import intra_op, invres

        x = facts.get(node.inputs[0])
        w_depthwise, w_project = facts.get(node.inputs[3]), facts.get(node.inputs[5])
        shapes = [getattr(f, "shape", None) for f in (x, w_depthwise, w_project)]
        if any(s is None or not all(isinstance(d, int) for d in s) for s in shapes):
            return 0
        (n, c, h, w), (expanded, *_), (out_channels, *_) = shapes
        geometry = invres.Geometry(n, c, expanded, out_channels, h, w, int(node.attrs.get("stride", 1)))
        return invres.scratch_bytes(geometry, intra_op.default_threads())

    @classmethod
    def prepared_bytes(cls, node, constants) -> int:
        from carrack.native import invres

        weights = [constants.get(node.inputs[k]) for k in (1, 5) if node.inputs[k]]
        if not all(isinstance(w, np.ndarray) and w.ndim == 4 for w in weights) or invres.library() is None:
            return 0
        return 4 * sum(invres.packed_floats(*w.shape[:2]) for w in weights)

    def setup(self) -> None:
        from carrack.passes.fusions import BLOCK_PARTS, inverted_residual_parts

        inputs = self.node.inputs
        if len(inputs) != 7 or not all(inputs[:1] + inputs[3:]) or bool(inputs[1]) != bool(inputs[2]):
            self.fail("expects 7 inputs: X and the weight and bias of the expansion (both empty for none), the "
                      f"depthwise convolution and the projection; got {list(inputs)}")
        self.stride = int(self.attr("stride", 1))
        if self.stride not in (1, 2):
            self.fail(f"stride must be 1 or 2, got {self.stride}")
        self.residual = bool(self.attr("residual", 0))
        #: the convolutions' kernels, and where their weight and bias are among the node's inputs
        self.parts, self.part_inputs = [], [k for k in (1, 3, 5) if inputs[k]]
        for part in inverted_residual_parts(self.node):
            cls, version = registry.resolve(part.domain, part.op_type, 11)
            self.parts.append(cls(part, version, self.ctx))
        self.activations = []
        for part in BLOCK_PARTS:
            name = self.attr(f"{part}_activation", "")
            params = list(self.attr(f"{part}_activation_params", []))
            epilogue = _epilogue(name, params, _activation(name, params))
            if epilogue.code < 0:
                self.fail(f"the {part} activation {name!r} is not one the fused block applies")
            self.activations.append(epilogue.native())
        self.block = None

    def prepare(self, constants) -> None:
        from carrack.native import convolution, invres

        for k, part in zip(self.part_inputs, self.parts):
            part.prepare([None, constants[k], constants[k + 1]] + ([None] * (len(part.node.inputs) - 3)))
        weights = tuple(constants[k + j] for k in self.part_inputs for j in (0, 1))
        if (self.implementation != "native" or not all(isinstance(w, np.ndarray) and w.dtype == np.float32
                                                       for w in weights) or convolution.load() is None):
            return
        w_expand, b_expand = constants[1:3] if self.node.inputs[1] else (None, None)
        w_depthwise, w_project = constants[3], constants[5]
        expanded = w_depthwise.shape[0]
        biases = ((b_expand, expanded),) if w_expand is not None else ()
        if ((w_expand is not None and (w_expand.ndim != 4 or w_expand.shape[0] != expanded
                                       or w_expand.shape[2:] != (1, 1)))
                or w_depthwise.shape != (expanded, 1, 3, 3) or w_project.ndim != 4
                or w_project.shape[1:] != (expanded, 1, 1)
                or any(b.shape != (m,) for b, m in (*biases, (constants[4], expanded),
                                                    (constants[6], w_project.shape[0])))):
            self.fail(f"weights of shapes {[w.shape for w in weights]} do not make an inverted-residual block")
        self.block = invres.pack((w_expand, b_expand, *constants[3:]), tuple(self.activations), self.stride,
                                 self.residual)

    def run(self, x, *params):
        return self.run_into(None, x, *params)

    def run_into(self, out, x, *params):
        block = self.block
        g = block.geometry(x.shape) if block is not None and type(x) is np.ndarray and x.dtype == np.float32 \
            else None
        if g is not None:
            x = np.require(x, np.float32, ("C", "A"))
            shape = (g.n, g.out_channels, g.out_height, g.out_width)
            y = out if out is not None and _block_output(out, shape, x) else np.empty(shape, np.float32)
            if block.run(x, y, g):
                return y
        return self._three_convolutions(x, *params)

    def bind_into(self, out, x, *params):
        """invres.c's call for these very arrays, its arguments converted once (a call that fails takes
        `run_into`)."""
        block = self.block
        g = block.geometry(x.shape) if block is not None and type(x) is np.ndarray else None
        if (g is None or x.dtype != np.float32 or not x.flags.c_contiguous or not x.flags.aligned
                or not _block_output(out, (g.n, g.out_channels, g.out_height, g.out_width), x)):
            return None
        return bound_or_run_into(block.bind(x, out, g), self.run_into, out, x, *params)

    def _three_convolutions(self, x, *params):
        y = x
        for k, part in zip(self.part_inputs, self.parts):
            residual = (x,) if self.residual and k == 5 else ()
            y = part.run(y, params[k - 1], params[k], *residual)
        return y
