"""Shape facts for rewrites, computed on demand from a value's producers up and kept: rewrites keep every name's
meaning, so a fact once known stays true, and asking about a value costs what its unknown ancestors cost."""

from __future__ import annotations

from collections.abc import Mapping

from carrack.passes.facts import Fact, const_fact
from carrack.passes.graph_view import GraphView
from carrack.passes.shape_inference import _elem_type, _with_hint, infer_node, input_facts


class LazyFacts:
    def __init__(self, view: GraphView, opsets: Mapping[str, int]):
        graph = view.graph
        self.view, self.opsets = view, opsets
        self.known: dict[str, Fact] = input_facts(graph)
        self.hints = {**{v.name: v for v in graph.outputs}, **graph.value_info}

    def get(self, name: str) -> Fact:
        if name in self.known:
            return self.known[name]
        stack = [name]
        while stack:
            top = stack[-1]
            if top in self.known:
                stack.pop()
                continue
            node = self.view.producer.get(top)
            if node is None:
                stack.pop()
                self.known[top] = self._leaf(top)
                continue
            pending = [i for i in node.inputs if i and i not in self.known]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            ins = [self.known[i] if i else Fact() for i in node.inputs]
            for out, fact in zip(node.outputs, infer_node(node, ins, self.opsets)):
                if out:
                    self.known[out] = _with_hint(fact, self.hints.get(out))
            self.known.setdefault(top, Fact())
        return self.known[name]

    def _leaf(self, name: str) -> Fact:
        graph = self.view.graph
        arr = graph.initializers.get(name)
        if arr is not None and name not in self.view.input_names:
            return const_fact(arr, _elem_type(arr))
        return Fact()


def context_fact(view: GraphView, ctx, name: str) -> Fact:
    """What shape inference knows about `name` for a rule: the caller's facts (`ctx.facts`), else inferred on demand
    by one LazyFacts per view, kept on the rule context so every rule of a pass shares it."""
    if ctx.facts is not None and name in ctx.facts:
        return ctx.facts[name]
    lazy = ctx.__dict__.get("_lazy_facts")
    if lazy is None or lazy.view is not view:
        lazy = ctx.__dict__["_lazy_facts"] = LazyFacts(view, ctx.opsets)
    return lazy.get(name)
