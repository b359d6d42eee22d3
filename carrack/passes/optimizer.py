"""The graph optimizer: small rewrite rules, each matching at one node, applied in a fixed order until nothing changes.

Levels follow onnxruntime's: DISABLE_ALL runs nothing; BASIC removes what cannot matter (dead nodes, Identity,
inference-mode Dropout) and folds constants; EXTENDED folds BatchNormalization into the layer before it and fuses
bias, activations and MatMul+Add; ALL adds the transformer-block fusions. `PIPELINE` is the order: quantized
patterns first (they must see quantized weights before constant folding dequantizes them), then the basic rules,
the layer fusions and the transformer fusions.
"""

from __future__ import annotations

import copy
import os

import numpy as np

from carrack.errors import CarrackError, InvalidModel
from carrack.ir.graph import Graph, Model
from carrack.passes import basic, fusions, quant_lowering, transformer_fusions
from carrack.passes.basic import FOLD_LIMIT_BYTES, fold_known_values
from carrack.passes.graph_view import GraphView
from carrack.passes.rewrite import ALL, BASIC, EXTENDED, Context, Rewrite

PIPELINE: tuple[Rewrite, ...] = (*quant_lowering.RULES, *basic.RULES, *fusions.RULES, *transformer_fusions.RULES)


def _checking() -> bool:
    """CARRACK_CHECK_REWRITES=1 (the test suite sets it) checks the graph's invariants after every rewrite."""
    return os.environ.get("CARRACK_CHECK_REWRITES", "") not in ("", "0")

__all__ = ["ALL", "BASIC", "EXTENDED", "FOLD_LIMIT_BYTES", "PIPELINE", "Context", "clone_graph",
           "fold_known_values", "optimize", "optimize_graph", "remove_dead_nodes"]


def optimize(model: Model, level: int = ALL, facts: dict | None = None, max_rounds: int = 50,
             in_place: bool = False) -> tuple[Model, dict]:
    """A new, optimized model and how often each rule fired. The input is not changed unless `in_place` (for a
    caller that has no further use for it: cloning a large graph costs more than optimizing it)."""
    model = copy.copy(model)
    if not in_place:
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


def reads_by_name(graph: Graph) -> bool:
    """Gradient names the value it differentiates in an attribute, a use no rewrite can see: leave such graphs be."""
    return any(n.op_type == "Gradient" and n.domain == "ai.onnx.preview.training" for n in graph.nodes)


#: how many times the rewrite loop has run in this process (tests use it to prove a new shape optimizes nothing)
RUNS = [0]


def optimize_graph(graph: Graph, ctx: Context, level: int, fired: dict[str, int], max_rounds: int = 50) -> None:
    if reads_by_name(graph):
        return
    RUNS[0] += 1
    view = GraphView(graph)
    rules = [r for r in PIPELINE if r.level <= level]
    checking = _checking()
    for _ in range(max_rounds):
        changed = False
        for r in rules:
            for node in view.nodes():
                if not view.alive(node) or (r.ops is not None and node.op_type not in r.ops):
                    continue
                if _apply(r, node, view, ctx):
                    fired[r.name] = fired.get(r.name, 0) + 1
                    changed = True
                    if checking:
                        check_invariants(view, r.name)
        changed |= remove_dead_nodes(view, fired)
        if not changed:
            break
    view.commit()
    for node in graph.nodes:  # subgraph bodies are optimized on their own
        for g in node.subgraphs():
            optimize_graph(g, ctx, level, fired, max_rounds)


def remove_dead_nodes(view: GraphView, fired: dict[str, int]) -> bool:
    """Drop nodes none of whose outputs is read (transitively) by a graph output; unused initializers go too.
    Walks producers back from the outputs, so it needs no particular node order."""
    graph = view.graph
    needed: set[str] = set()
    live: set[int] = set()
    stack = [o.name for o in graph.outputs]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        node = view.producer.get(name)
        if node is not None and id(node) not in live:
            live.add(id(node))
            stack.extend(view._reads(node))
    dead = [n for n in view.nodes() if id(n) not in live]
    unused = [k for k in graph.initializers if k not in needed and k not in view.input_names]
    for k in unused:
        del graph.initializers[k]
    if dead:
        view.remove(dead)
        fired["dead_node_elimination"] = fired.get("dead_node_elimination", 0) + len(dead)
    return bool(dead)


def check_invariants(view: GraphView, after: str) -> None:
    """Every value a live node reads is defined, every graph output is still produced, and the nodes can be ordered:
    a rewrite that breaks one of these is a bug in that rewrite."""
    graph = view.graph
    defined = view.input_names | set(graph.initializers) | set(view.producer)
    outer = graph.free_names()  # graph.nodes is the graph as given until commit: these are its outer reads
    for node in view.nodes():
        missing = [n for n in view._reads(node) if n not in defined and n not in outer]
        if missing:
            raise InvalidModel(f"rewrite '{after}' left {node.label()} reading {missing}, which nothing defines")
    lost = [o.name for o in graph.outputs if o.name not in defined and o.name not in outer]
    if lost:
        raise InvalidModel(f"rewrite '{after}' left graph output(s) {lost} unproduced")
    from carrack.ir.order import topological_order

    topological_order(graph, view.nodes())


def _apply(rule: Rewrite, node, view: GraphView, ctx: Context) -> bool:
    """`rule` on `node`. Validation at load checks each node against its schema, but not everything a rule may
    read (constant parameters of matching sizes, nodes of ops unknown at the model's opset): a rule that fails on
    such a node is reported naming it, not as a bare IndexError or ValueError from inside the optimizer."""
    try:
        return rule.fn(node, view, ctx)
    except (IndexError, ValueError, TypeError, KeyError, ZeroDivisionError, OverflowError) as e:
        if isinstance(e, CarrackError):
            raise
        raise InvalidModel(f"{node.label()}: optimizer rule '{rule.name}' failed on it ({type(e).__name__}: {e}); "
                           "the node or its inputs are inconsistent (or this is a carrack bug)") from e
