"""carrack's graph IR: a model is a graph of nodes over named, typed values.

Values are named by strings, as in ONNX; the empty name marks an omitted optional input or output.
Attributes are plain Python values (int, float, str, bytes, numpy arrays, lists, `Graph` for subgraphs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carrack.ir.types import ValueType

DEFAULT_DOMAIN = ""
ML_DOMAIN = "ai.onnx.ml"


def canonical_domain(domain: str) -> str:
    return DEFAULT_DOMAIN if domain in ("", "ai.onnx") else domain


@dataclass
class ValueInfo:
    name: str
    type: ValueType | None = None


@dataclass
class Node:
    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = DEFAULT_DOMAIN
    name: str = ""
    opset: int | None = None  # this node's own opset for its domain (nodes inlined from functions); None: the model's

    def label(self) -> str:
        """How errors name this node: its name if it has one, else its op and first output."""
        return f"{self.op_type} node '{self.name}'" if self.name else f"{self.op_type} node -> {self.outputs[:1]}"

    def subgraphs(self) -> list[Graph]:
        found = []
        for v in self.attrs.values():
            kind = type(v)
            if kind is Graph:
                found.append(v)
            elif kind is list and v and type(v[0]) is Graph:
                found.extend(v)
        return found


@dataclass
class Graph:
    name: str = ""
    inputs: list[ValueInfo] = field(default_factory=list)
    outputs: list[ValueInfo] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    value_info: dict[str, ValueInfo] = field(default_factory=dict)

    def defined_names(self) -> set[str]:
        names = {v.name for v in self.inputs} | set(self.initializers)
        for n in self.nodes:
            names.update(o for o in n.outputs if o)
        return names

    def free_names(self) -> set[str]:
        """Names this graph reads from an enclosing scope (its own and its subgraphs' outer references)."""
        used: set[str] = set()
        for n in self.nodes:
            used.update(i for i in n.inputs if i)
            for g in n.subgraphs():
                used |= g.free_names()
        used.update(o.name for o in self.outputs)
        return used - self.defined_names()


@dataclass
class Model:
    graph: Graph
    opsets: dict[str, int]
    ir_version: int = 0
    producer: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    doc_string: str = ""
    domain: str = ""
    model_version: int = 0
    graph_doc_string: str = ""
    #: (graph input name, axis) -> the dim's denotation (e.g. DATA_BATCH), for free-dimension overrides
    dim_denotations: dict[tuple[str, int], str] = field(default_factory=dict)

    def opset(self, domain: str) -> int:
        return self.opsets.get(canonical_domain(domain), 0)
