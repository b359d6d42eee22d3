"""Function expansion: model-local functions and function-bodied standard ops become plain nodes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from carrack.errors import InvalidModel
from carrack.ir.graph import Graph, Node


@dataclass
class Function:
    name: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    nodes: list[Node]
    attr_defaults: dict[str, Any] = field(default_factory=dict)
    opsets: dict[str, int] = field(default_factory=dict)


_counter = itertools.count()


def expand_call(call: Node, fn: Function, model_opsets: dict[str, int]) -> list[Node]:
    """The nodes of `fn`'s body, renamed apart, wired to `call`'s inputs and outputs."""
    from carrack.onnx.importer import AttrRef

    prefix = f"{call.name or fn.name}__{next(_counter)}/"
    rename: dict[str, str] = {"": ""}
    for i, formal in enumerate(fn.inputs):
        rename[formal] = call.inputs[i] if i < len(call.inputs) else ""
    for i, formal in enumerate(fn.outputs):
        rename[formal] = call.outputs[i] if i < len(call.outputs) else prefix + formal
    call_attrs = {**{k: v for k, v in fn.attr_defaults.items() if v is not None}, **call.attrs}

    def resolve_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for k, v in attrs.items():
            if isinstance(v, AttrRef):
                if v.name in call_attrs:
                    out[k] = call_attrs[v.name]
            elif isinstance(v, Graph):
                out[k] = _rename_graph(v, lambda n: rename.get(n, n))
            else:
                out[k] = v
        return out

    def name_of(n: str) -> str:
        if n not in rename:
            rename[n] = prefix + n
        return rename[n]

    body = []
    for n in fn.nodes:
        ins = [name_of(i) for i in n.inputs]
        outs = [name_of(o) for o in n.outputs]
        opset = fn.opsets.get(n.domain)
        if opset is not None and opset == model_opsets.get(n.domain):
            opset = None
        body.append(replace(n, inputs=ins, outputs=outs, attrs=resolve_attrs(n.attrs),
                            name=prefix + (n.name or n.op_type), opset=opset if n.opset is None else n.opset))
    return body


def _rename_graph(g: Graph, rename) -> Graph:
    """Rename outer references inside a subgraph (names it does not define itself)."""
    local = g.defined_names()

    def r(n: str) -> str:
        return n if (not n or n in local) else rename(n)

    nodes = [replace(n, inputs=[r(i) for i in n.inputs],
                     attrs={k: (_rename_graph(v, r) if isinstance(v, Graph) else v) for k, v in n.attrs.items()})
             for n in g.nodes]
    return replace(g, nodes=nodes, outputs=[replace(o, name=r(o.name)) for o in g.outputs])


def inline_functions(graph: Graph, functions: dict[tuple[str, str], Function], opsets: dict[str, int],
                     depth: int = 0) -> Graph:
    """Replace every call of a model-local function (recursively, in subgraphs too) by its body."""
    if depth > 64:
        raise InvalidModel("model-local functions call each other more than 64 levels deep (recursion?)")
    nodes: list[Node] = []
    changed = False
    for n in graph.nodes:
        fn = functions.get((n.domain, n.op_type))
        if fn is not None:
            nodes.extend(expand_call(n, fn, opsets))
            changed = True
            continue
        if n.subgraphs():
            attrs = {k: (inline_functions(v, functions, opsets, depth) if isinstance(v, Graph) else v)
                     for k, v in n.attrs.items()}
            n = replace(n, attrs=attrs)
        nodes.append(n)
    graph = replace(graph, nodes=nodes)
    return inline_functions(graph, functions, opsets, depth + 1) if changed else graph
