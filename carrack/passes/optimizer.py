"""The graph optimizer: small rewrite rules, each matching at one node, applied until nothing changes.

Levels follow onnxruntime's: DISABLE_ALL runs nothing; BASIC removes what cannot matter (dead nodes, Identity,
inference-mode Dropout) and folds constants; EXTENDED folds BatchNormalization into the layer before it and fuses
bias, activations and MatMul+Add; ALL adds the transformer-block fusions.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from carrack.ir.graph import Graph, Model, Node
from carrack.ops import registry
from carrack.passes.graph_view import GraphView

BASIC, EXTENDED, ALL = 1, 2, 99
#: tract's cap: constant folding never creates a constant larger than this
FOLD_LIMIT_BYTES = 4 * 2**20

RuleFn = Callable[[Node, GraphView, "Context"], bool]


@dataclass(frozen=True)
class Rewrite:
    name: str
    ops: frozenset[str] | None  # op types the rule looks at (None: every node)
    level: int
    fn: RuleFn


REWRITES: list[Rewrite] = []


def rewrite(name: str, *ops: str, level: int = EXTENDED) -> Callable[[RuleFn], RuleFn]:
    """Register a rewrite rule: ``fn(node, view, ctx) -> changed``."""

    def wrap(fn: RuleFn) -> RuleFn:
        REWRITES.append(Rewrite(name, frozenset(ops) if ops else None, level, fn))
        return fn

    return wrap


@dataclass
class Context:
    opsets: Mapping[str, int]
    facts: dict | None = None  # shape facts, when the caller computed them (bound input shapes)

    def version(self, node: Node) -> int:
        opset = node.opset or self.opsets.get(node.domain) or registry.default_opset(node.domain)
        return registry.resolve(node.domain, node.op_type, opset)[1]


def optimize(model: Model, level: int = ALL, facts: dict | None = None, max_rounds: int = 50) -> tuple[Model, dict]:
    """A new, optimized model (the input is not changed) and how often each rule fired."""
    model = copy.copy(model)
    model.graph = clone_graph(model.graph)
    fired: dict[str, int] = {}
    if level <= 0:
        return model, fired
    ctx = Context(model.opsets, facts)
    optimize_graph(model.graph, ctx, level, fired, max_rounds)
    return model, fired


def clone_graph(graph: Graph) -> Graph:
    """A deep copy of the graph structure that shares (never copies) the weight arrays."""
    memo: dict[int, object] = {}

    def share(g: Graph) -> None:
        for arr in g.initializers.values():
            memo[id(arr)] = arr
        for n in g.nodes:
            for v in n.attrs.values():
                if isinstance(v, np.ndarray):
                    memo[id(v)] = v
            for sub in n.subgraphs():
                share(sub)

    share(graph)
    return copy.deepcopy(graph, memo)


def fold_known_values(graph: Graph, facts: Mapping, limit_bytes: int = FOLD_LIMIT_BYTES) -> int:
    """Replace nodes whose every output is a known constant (per `facts`) by initializers; returns how many."""
    keep, folded = [], 0
    for node in graph.nodes:
        outs = [facts.get(o) for o in node.outputs if o]
        if (node.op_type not in _NEVER_FOLD and outs and all(f is not None and f.is_concrete() for f in outs)
                and sum(f.value.nbytes for f in outs) <= limit_bytes):
            for name in node.outputs:
                if name:
                    graph.initializers[name] = np.asarray(facts[name].value)
            folded += 1
        else:
            keep.append(node)
    graph.nodes = keep
    return folded


def _reads_by_name(graph: Graph) -> bool:
    """Gradient names the value it differentiates in an attribute, a use no rewrite can see: leave such graphs be."""
    return any(n.op_type == "Gradient" and n.domain == "ai.onnx.preview.training" for n in graph.nodes)


def optimize_graph(graph: Graph, ctx: Context, level: int, fired: dict[str, int], max_rounds: int = 50) -> None:
    if _reads_by_name(graph):
        return
    view = GraphView(graph)
    rules = [r for r in REWRITES if r.level <= level]
    for _ in range(max_rounds):
        changed = False
        for r in rules:
            for node in list(graph.nodes):
                if not _alive(view, node) or (r.ops is not None and node.op_type not in r.ops):
                    continue
                if r.fn(node, view, ctx):
                    fired[r.name] = fired.get(r.name, 0) + 1
                    changed = True
        changed |= remove_dead_nodes(view, fired)
        if not changed:
            break
    for node in graph.nodes:  # subgraph bodies are optimized on their own
        for g in node.subgraphs():
            optimize_graph(g, ctx, level, fired, max_rounds)


def _alive(view: GraphView, node: Node) -> bool:
    return any(view.producer.get(o) is node for o in node.outputs if o) or not any(node.outputs)


def remove_dead_nodes(view: GraphView, fired: dict[str, int]) -> bool:
    """Drop nodes none of whose outputs is read or returned; unused initializers go too."""
    graph = view.graph
    needed = {o.name for o in graph.outputs}
    keep: list[Node] = []
    for node in reversed(graph.nodes):
        if any(o in needed for o in node.outputs if o):
            keep.append(node)
            needed.update(view._reads(node))
    removed = len(graph.nodes) - len(keep)
    unused = [k for k in graph.initializers if k not in needed and k not in view.input_names]
    for k in unused:
        del graph.initializers[k]
    if removed:
        graph.nodes = keep[::-1]
        view.reindex()
        fired["dead_node_elimination"] = fired.get("dead_node_elimination", 0) + removed
    return bool(removed)


# -- basic -------------------------------------------------------------------------------------------------------------

@rewrite("identity_removal", "Identity", level=BASIC)
def remove_identity(node: Node, view: GraphView, ctx: Context) -> bool:
    if node.domain or not node.inputs or not node.inputs[0]:
        return False
    return view.bypass(node, node.inputs[0], node.outputs[0])


@rewrite("dropout_removal", "Dropout", level=BASIC)
def remove_dropout(node: Node, view: GraphView, ctx: Context) -> bool:
    """Dropout is the identity at inference unless training_mode is a true constant (or a runtime input)."""
    if len(node.outputs) > 1 and node.outputs[1] and view.n_uses(node.outputs[1]):
        return False
    if len(node.inputs) > 2 and node.inputs[2]:
        mode = view.const(node.inputs[2])
        if mode is None or bool(mode):
            return False
    if ctx.version(node) < 7 and not node.attrs.get("is_test", 0):
        # opset < 7 Dropout in training mode scales; in inference mode (is_test) it is the identity
        return False
    return view.bypass(node, node.inputs[0], node.outputs[0])


_NEVER_FOLD = registry.IMPURE_OPS | {"If", "Loop", "Scan", "SequenceMap"}


@rewrite("constant_folding", level=BASIC)
def fold_constants(node: Node, view: GraphView, ctx: Context) -> bool:
    """Evaluate a node whose inputs are all constants, if its outputs stay under the size cap."""
    if node.op_type in _NEVER_FOLD or node.op_type == "Constant" or not node.outputs:
        return False
    values = []
    for name in node.inputs:
        if not name:
            values.append(None)
            continue
        v = view.const(name)
        if v is None:
            return False
        values.append(v)
    if node.op_type == "ConstantOfShape" and not node.domain and values and values[0] is not None:
        return _fold_uniform(node, view, values[0])
    if ctx.facts is None and _estimated_bytes(node, values) > FOLD_LIMIT_BYTES:
        return False
    opset = node.opset or ctx.opsets.get(node.domain) or registry.default_opset(node.domain)
    cls, version = registry.resolve(node.domain, node.op_type, opset)
    if cls is None:
        return False
    try:
        with np.errstate(all="ignore"):
            result = cls(node, version, None).run(*values)
    except Exception:  # noqa: BLE001 - leave it to run time, where the error names the node
        return False
    outs = result if type(result) is tuple else (result,)
    if not all(isinstance(o, (np.ndarray, np.generic)) for o in outs):
        return False
    if sum(np.asarray(o).nbytes for o in outs) > FOLD_LIMIT_BYTES:
        return False
    for name, value in zip(node.outputs, outs):
        if name:
            view.graph.initializers[name] = np.asarray(value)
    view.remove([node])
    return True


def _fold_uniform(node: Node, view: GraphView, shape: np.ndarray) -> bool:
    """ConstantOfShape of a known shape: a read-only broadcast view of one value, so any size costs no memory."""
    value = node.attrs.get("value")
    scalar = np.asarray(value).reshape(-1)[:1] if isinstance(value, np.ndarray) else np.zeros(1, np.float32)
    dims = tuple(int(d) for d in np.asarray(shape).reshape(-1))
    if any(d < 0 for d in dims) or scalar.size != 1:
        return False
    view.graph.initializers[node.outputs[0]] = np.broadcast_to(scalar.reshape(()), dims)
    view.remove([node])
    return True


def _estimated_bytes(node: Node, values: list) -> int:
    """A cheap upper guess of a fold's output size, so that Expand/Tile/ConstantOfShape blow-ups are not even tried."""
    sizes = [v.nbytes for v in values if isinstance(v, np.ndarray)]
    if node.op_type in ("ConstantOfShape", "Expand", "Tile", "Range", "EyeLike"):
        shape_like = values[-1] if node.op_type != "Range" else None
        if node.op_type == "ConstantOfShape" and isinstance(values[0], np.ndarray):
            return int(np.prod(values[0].astype(np.float64))) * 8
        if node.op_type in ("Expand", "Tile") and isinstance(shape_like, np.ndarray):
            base = values[0]
            factor = float(np.prod(np.maximum(shape_like.astype(np.float64), 1)))
            return int(base.itemsize * max(factor, base.size) * (base.size if node.op_type == "Tile" else 1))
        if node.op_type == "Range":
            try:
                n = abs((float(values[1]) - float(values[0])) / float(values[2]))
            except (TypeError, ValueError, ZeroDivisionError):
                return FOLD_LIMIT_BYTES + 1
            return int(n * 8)
    return max(sizes, default=0)


from carrack.passes import fusions as _fusions  # noqa: E402, F401 - registers the fusion rules


def specialize(model: Model, bindings: Mapping[str, int], level: int = ALL) -> Graph:
    """The graph for inputs whose symbolic dims are bound: shape arithmetic folded to constants, then re-optimized."""
    from carrack.passes.shape_inference import infer, input_facts

    graph = clone_graph(model.graph)
    if _reads_by_name(graph):
        return graph
    facts = infer(graph, model.opsets, input_facts(graph, bindings))
    fold_known_values(graph, facts)
    fired: dict[str, int] = {}
    view = GraphView(graph)
    remove_dead_nodes(view, fired)
    optimize_graph(graph, Context(model.opsets, infer(graph, model.opsets, input_facts(graph, bindings))), level, fired)
    return graph
from carrack.passes import quant_lowering as _quant_lowering  # noqa: E402, F401
from carrack.passes import transformer_fusions as _transformer_fusions  # noqa: E402, F401
