"""Gradient (ai.onnx.preview.training): reverse-mode derivatives of a value computed elsewhere in the same graph.

At build time the node finds the nodes that its ``y`` attribute depends on, stopping at the names in ``xs`` and
``zs`` (and at initializers), and compiles them into a small forward program whose inputs are xs then zs, the
values the Gradient node receives. At run time that program recomputes the intermediates at those values and the
vector-Jacobian rules below carry d(sum of y)/dy = ones back to each x. Broadcasting in the forward pass is undone
by summing the gradient over the broadcast axes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from carrack.ir.graph import Graph, Node, ValueInfo
from carrack.ops import registry
from carrack.ops.registry import Kernel, register
from carrack.runtime.program import Program

TRAINING = "ai.onnx.preview.training"
MS = "com.microsoft"

#: (forward inputs, forward outputs, gradient of the first output) -> gradient of each input (None: none flows)
VJP = Callable[[list, list, np.ndarray], list]
#: (domain, op type) -> factory(node, schema version) -> VJP
_RULES: dict[tuple[str, str], Callable[[Node, int], VJP]] = {}


class _NoRule(ValueError):
    """A node whose op has a rule but whose attributes the rule cannot handle."""


@register("Gradient", since=1, domain=TRAINING)
class Gradient(Kernel):
    def setup(self):
        self.xs = list(self.required_attr("xs"))
        self.zs = list(self.attr("zs", []))
        self.y = self.required_attr("y")
        if len(self.node.inputs) != len(self.xs) + len(self.zs):
            self.fail(f"has {len(self.node.inputs)} inputs, expected one per name in xs and zs "
                      f"({len(self.xs)} + {len(self.zs)})")
        if len(set(self.xs + self.zs)) != len(self.xs) + len(self.zs):
            self.fail("xs and zs must name distinct values")
        if self.ctx is None or self.ctx.graph is None:
            self.fail("can only be built inside a session (it reads the graph it belongs to)")
        graph = self.ctx.graph
        forward = self._forward_nodes(graph)
        self.differentiable = self._differentiable(forward)
        steps = [n for n in forward if _on_path(n, self.differentiable)]
        try:
            self.backward = [(n, _RULES[n.domain, n.op_type](n, self._version(n))) for n in reversed(steps)]
        except _NoRule as e:
            self.fail(f"cannot differentiate y '{self.y}': {e}")
        wanted = {self.y} | {v for n in steps for v in n.inputs + n.outputs if v}
        self.values = sorted(wanted)
        reads = {v for n in forward for v in _reads(n)}
        sub = Graph(name=f"{self.node.name or 'Gradient'}_forward",
                    inputs=[ValueInfo(v) for v in self.xs + self.zs],
                    outputs=[ValueInfo(v) for v in self.values], nodes=forward,
                    initializers={k: v for k, v in graph.initializers.items()
                                  if k in reads and k not in self.xs and k not in self.zs})
        self.forward = Program(sub, self.ctx, self.ctx.scope)

    def _version(self, node: Node) -> int:
        return registry.resolve(node.domain, node.op_type, self.ctx.opset_of(node))[1]

    def _forward_nodes(self, graph: Graph) -> list[Node]:
        """The nodes `y` depends on, producers first, stopping at xs, zs and initializers."""
        producer = {o: n for n in graph.nodes for o in n.outputs if o}
        leaves = set(self.xs) | set(self.zs)
        if self.y not in leaves and self.y not in producer:
            self.fail(f"y '{self.y}' is not computed by any node of this graph (nor is it in xs or zs); if graph "
                      "optimization removed or renamed it, create the session with ORT_DISABLE_ALL")
        order: list[Node] = []
        done: set[int] = set()
        stack: list[tuple[Node, bool]] = [] if self.y in leaves else [(producer[self.y], False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in done:
                continue
            if expanded:
                done.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            for name in _reads(node):
                if name in leaves or name in graph.initializers:
                    continue
                if name not in producer:
                    self.fail(f"y '{self.y}' depends on '{name}', which is neither computed in this graph nor "
                              "listed in xs or zs")
                if producer[name] is self.node:
                    self.fail(f"y '{self.y}' depends on this Gradient node's own output '{name}'")
                if id(producer[name]) not in done:
                    stack.append((producer[name], False))
        return order

    def _differentiable(self, forward: list[Node]) -> set[str]:
        """The values through which gradient flows from xs; every node reading one needs a derivative rule."""
        live = set(self.xs)
        for node in forward:
            if not _on_path(node, live):
                continue
            if (node.domain, node.op_type) not in _RULES:
                op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
                fused = node.domain in ("carrack", MS)
                hint = " (an optimizer fusion? create the session with ORT_DISABLE_ALL)" if fused else ""
                supported = ", ".join(sorted(name for domain, name in _RULES if not domain))
                self.fail(f"no derivative rule for {op} ({node.label()}) on the path from xs to y '{self.y}'{hint}; "
                          f"supported: {supported}")
            if node.subgraphs():
                self.fail(f"cannot differentiate through {node.label()}, which has subgraphs")
            live.update(o for o in node.outputs if o)
        return live

    def run(self, *inputs):
        values = dict(zip(self.values, self.forward.run(list(inputs))))
        grads: dict[str, np.ndarray] = {self.y: np.ones_like(values[self.y])}
        for node, vjp in self.backward:
            g = grads.get(node.outputs[0])
            if g is None:
                continue
            ins = [values[i] if i else None for i in node.inputs]
            outs = [values[o] if o else None for o in node.outputs]
            for name, dx in zip(node.inputs, vjp(ins, outs, g)):
                if dx is None or name not in self.differentiable or values[name].dtype.kind not in "fc":
                    continue
                grads[name] = grads[name] + dx if name in grads else dx
        result = []
        for name, x in zip(self.xs, inputs):
            x = np.asarray(x)
            g = grads.get(name)
            result.append(np.zeros_like(x) if g is None else np.ascontiguousarray(g, dtype=x.dtype).reshape(x.shape))
        return tuple(result[:len(self.node.outputs)])


def _reads(node: Node) -> list[str]:
    return [i for i in node.inputs if i] + sorted({n for g in node.subgraphs() for n in g.free_names()})


def _on_path(node: Node, live: set[str]) -> bool:
    return any(name in live for name in _reads(node))


# -- vector-Jacobian rules -------------------------------------------------------------------------------------------

def _rule(*ops: str, domain: str = "") -> Callable:
    """Register a rule factory ``(node, version) -> vjp`` that reads the node's attributes once."""

    def wrap(factory: Callable[[Node, int], VJP]) -> Callable[[Node, int], VJP]:
        for op in ops:
            _RULES[domain, op] = factory
        return factory

    return wrap


def _plain(*ops: str) -> Callable[[VJP], VJP]:
    """Register a vjp that needs no attributes."""

    def wrap(vjp: VJP) -> VJP:
        _rule(*ops)(lambda node, version: vjp)
        return vjp

    return wrap


def unbroadcast(g: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Sum `g` over the axes that numpy broadcasting added or stretched to turn `shape` into g's shape."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    stretched = tuple(lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1)
    return g.sum(axis=tuple(range(lead)) + stretched, keepdims=True).reshape(shape)


@_plain("Add", "Sum")
def _sum_vjp(ins, outs, g):
    return [unbroadcast(g, x.shape) for x in ins]


@_plain("Sub")
def _sub_vjp(ins, outs, g):
    a, b = ins
    return [unbroadcast(g, a.shape), unbroadcast(-g, b.shape)]


@_plain("Mul")
def _mul_vjp(ins, outs, g):
    a, b = ins
    return [unbroadcast(g * b, a.shape), unbroadcast(g * a, b.shape)]


@_plain("Div")
def _div_vjp(ins, outs, g):
    a, b = ins
    da = g / b
    return [unbroadcast(da, a.shape), unbroadcast(-da * outs[0], b.shape)]


@_plain("Neg")
def _neg_vjp(ins, outs, g):
    return [-g]


@_plain("Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten")
def _reshape_vjp(ins, outs, g):
    """Ops that only rearrange the shape: the gradient takes the input's shape back (shape/axes inputs get none)."""
    return [g.reshape(ins[0].shape)] + [None] * (len(ins) - 1)


@_plain("Expand")
def _expand_vjp(ins, outs, g):
    return [unbroadcast(g, ins[0].shape), None]


@_plain("Relu")
def _relu_vjp(ins, outs, g):
    return [np.where(ins[0] > 0, g, 0).astype(g.dtype, copy=False)]


@_plain("Abs")
def _abs_vjp(ins, outs, g):
    return [g * np.sign(ins[0]).astype(g.dtype, copy=False)]


@_plain("Sigmoid")
def _sigmoid_vjp(ins, outs, g):
    y = outs[0]
    return [g * y * (1 - y)]


@_plain("Tanh")
def _tanh_vjp(ins, outs, g):
    y = outs[0]
    return [g * (1 - y * y)]


@_plain("Exp")
def _exp_vjp(ins, outs, g):
    return [g * outs[0]]


@_plain("Log")
def _log_vjp(ins, outs, g):
    return [g / ins[0]]


@_plain("Sqrt")
def _sqrt_vjp(ins, outs, g):
    return [g * 0.5 / outs[0]]


@_plain("Pow")
def _pow_vjp(ins, outs, g):
    base, exponent = ins
    e = exponent.astype(base.dtype, copy=False)
    d_base = unbroadcast(g * e * np.power(base, e - 1), base.shape)
    if exponent.dtype.kind not in "fc":
        return [d_base, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        log_base = np.log(np.where(base > 0, base, 1))
    d_exponent = unbroadcast(g * outs[0] * log_base.astype(base.dtype, copy=False), exponent.shape)
    return [d_base, d_exponent.astype(exponent.dtype, copy=False)]


@_rule("LeakyRelu")
def _leaky_relu_rule(node: Node, version: int) -> VJP:
    alpha = float(node.attrs.get("alpha", 0.01))

    def vjp(ins, outs, g):
        return [np.where(ins[0] > 0, g, g * alpha)]

    return vjp


@_rule("MatMul")
def _matmul_rule(node: Node, version: int) -> VJP:
    def vjp(ins, outs, g):
        a, b = ins
        a2 = a[None, :] if a.ndim == 1 else a  # 1-D operands are a row (a) or a column (b) vector
        b2 = b[:, None] if b.ndim == 1 else b
        if b.ndim == 1:
            g = g[..., None]
        if a.ndim == 1:
            g = g[..., None, :]
        da = unbroadcast(g @ np.swapaxes(b2, -1, -2), a2.shape)
        db = unbroadcast(np.swapaxes(a2, -1, -2) @ g, b2.shape)
        return [da.reshape(a.shape), db.reshape(b.shape)]

    return vjp


@_rule("Gemm")
def _gemm_rule(node: Node, version: int) -> VJP:
    alpha = float(node.attrs.get("alpha", 1.0))
    beta = float(node.attrs.get("beta", 1.0))
    trans_a, trans_b = bool(node.attrs.get("transA", 0)), bool(node.attrs.get("transB", 0))

    def vjp(ins, outs, g):
        a, b = ins[0], ins[1]
        c = ins[2] if len(ins) > 2 else None
        a2, b2 = (a.T if trans_a else a), (b.T if trans_b else b)
        da = (g @ b2.T) * alpha
        db = (a2.T @ g) * alpha
        grads = [da.T if trans_a else da, db.T if trans_b else db]
        if len(ins) > 2:
            grads.append(None if c is None else unbroadcast(g * beta, c.shape))
        return grads

    return vjp


@_rule("Transpose")
def _transpose_rule(node: Node, version: int) -> VJP:
    perm = node.attrs.get("perm")

    def vjp(ins, outs, g):
        order = list(range(g.ndim))[::-1] if perm is None else list(perm)
        return [np.transpose(g, np.argsort(order))]

    return vjp


@_rule("ReduceSum", "ReduceMean")
def _reduce_rule(node: Node, version: int) -> VJP:
    axes_input = version >= (13 if node.op_type == "ReduceSum" else 18)
    attr_axes = node.attrs.get("axes")
    keepdims = bool(node.attrs.get("keepdims", 1))
    noop_when_empty = bool(node.attrs.get("noop_with_empty_axes", 0))
    mean = node.op_type == "ReduceMean"

    def vjp(ins, outs, g):
        x = ins[0]
        given = (ins[1] if len(ins) > 1 else None) if axes_input else attr_axes
        axes = [] if given is None or not x.ndim else [int(a) % x.ndim for a in np.asarray(given).reshape(-1)]
        if not axes:
            if noop_when_empty and axes_input:
                return [g] + [None] * (len(ins) - 1)
            axes = list(range(x.ndim))
        if not keepdims:
            g = np.expand_dims(g, tuple(sorted(axes)))
        dx = np.broadcast_to(g, x.shape)
        if mean:
            count = int(np.prod([x.shape[a] for a in set(axes)]))
            dx = dx / x.dtype.type(max(count, 1))
        return [dx] + [None] * (len(ins) - 1)

    return vjp


@_rule("Softmax")
def _softmax_rule(node: Node, version: int) -> VJP:
    axis_attr = int(node.attrs.get("axis", -1 if version >= 13 else 1))

    def vjp(ins, outs, g):
        y = outs[0]
        axis = axis_attr % max(y.ndim, 1)
        if version >= 13:
            return [y * (g - np.sum(g * y, axis=axis, keepdims=True))]
        rows = int(np.prod(y.shape[:axis]))
        y2, g2 = y.reshape(rows, -1), g.reshape(rows, -1)
        return [(y2 * (g2 - np.sum(g2 * y2, axis=1, keepdims=True))).reshape(y.shape)]

    return vjp


# -- the optimizer's fusions: the base op's rule after the activation's, written in terms of the fused output -----

_ACTIVATION_VJP: dict[str, Callable[[np.ndarray, np.ndarray, float], np.ndarray]] = {
    "Relu": lambda y, g, alpha: np.where(y > 0, g, 0).astype(g.dtype, copy=False),
    "LeakyRelu": lambda y, g, alpha: np.where(y > 0, g, g * alpha),
    "Sigmoid": lambda y, g, alpha: g * y * (1 - y),
    "Tanh": lambda y, g, alpha: g * (1 - y * y),
}


@_rule("FusedMatMul", "FusedGemm", domain="carrack")
@_rule("FusedGemm", domain=MS)
def _fused_rule(node: Node, version: int) -> VJP:
    activation = node.attrs.get("activation", "")
    if activation not in _ACTIVATION_VJP:
        raise _NoRule(f"{node.label()} (an optimizer fusion) fuses activation '{activation}', which has no "
                      "derivative rule here; create the session with ORT_DISABLE_ALL")
    params = node.attrs.get("activation_params") or [node.attrs.get("activation_alpha", 0.01)]
    alpha = float(params[0]) if activation == "LeakyRelu" else 0.0
    base_op = node.op_type.removeprefix("Fused")
    base = Node(base_op, node.inputs, node.outputs, {k: v for k, v in node.attrs.items()
                                                     if not k.startswith("activation")}, name=node.name)
    base_vjp = _RULES["", base_op](base, 13)
    act_vjp = _ACTIVATION_VJP[activation]

    def vjp(ins, outs, g):
        return base_vjp(ins, outs, act_vjp(outs[0], g, alpha))

    return vjp
