"""A mutable view of a graph for rewrites: who produces and who reads each value, and which values are constant."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np

from carrack.ir.graph import Graph, Node


class GraphView:
    def __init__(self, graph: Graph):
        self.graph = graph
        self._fresh = itertools.count()
        self.reindex()

    def reindex(self) -> None:
        self.producer: dict[str, Node] = {}
        self.consumers: dict[str, list[Node]] = {}
        for node in self.graph.nodes:
            for o in node.outputs:
                if o:
                    self.producer[o] = node
            for i in self._reads(node):
                self.consumers.setdefault(i, []).append(node)
        self.outputs = {o.name for o in self.graph.outputs}
        self.input_names = {v.name for v in self.graph.inputs}

    @staticmethod
    def _reads(node: Node) -> Iterable[str]:
        yield from (i for i in node.inputs if i)
        for g in node.subgraphs():
            yield from g.free_names()

    # queries ----------------------------------------------------------------------------------------------------------
    def const(self, name: str) -> np.ndarray | None:
        """The value of `name` if it is fixed when the session is created (an initializer no feed can override,
        or a Constant node's output)."""
        if not name:
            return None
        if name in self.graph.initializers and name not in self.input_names:
            return self.graph.initializers[name]
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and not node.domain:
            value = node.attrs.get("value")
            if isinstance(value, np.ndarray):
                return value
        return None

    def single_consumer(self, name: str) -> Node | None:
        """The only node reading `name`, if it is not also a graph output."""
        readers = self.consumers.get(name, [])
        return readers[0] if len(readers) == 1 and name not in self.outputs else None

    def n_uses(self, name: str) -> int:
        return len(self.consumers.get(name, [])) + (name in self.outputs)

    # edits ------------------------------------------------------------------------------------------------------------
    def fresh_name(self, base: str) -> str:
        taken = self.graph.defined_names()
        while True:
            name = f"{base}__opt{next(self._fresh)}"
            if name not in taken:
                return name

    def add_initializer(self, base: str, value: np.ndarray) -> str:
        from carrack.onnx.tensors import aligned_copy

        name = self.fresh_name(base)
        self.graph.initializers[name] = aligned_copy(np.asarray(value))
        return name

    def replace_uses(self, old: str, new: str) -> None:
        """Make every reader of `old` read `new` instead (graph outputs keep their names via the producer)."""
        for node in self.consumers.get(old, []):
            node.inputs = [new if i == old else i for i in node.inputs]
        self.reindex()

    def remove(self, nodes: Iterable[Node]) -> None:
        doomed = {id(n) for n in nodes}
        self.graph.nodes = [n for n in self.graph.nodes if id(n) not in doomed]
        self.reindex()

    def replace(self, old_nodes: Iterable[Node], new_nodes: list[Node]) -> None:
        """Swap a connected group of nodes for new ones, keeping topological order at the first old node."""
        old_ids = {id(n) for n in old_nodes}
        out: list[Node] = []
        inserted = False
        for n in self.graph.nodes:
            if id(n) in old_ids:
                if not inserted:
                    out.extend(new_nodes)
                    inserted = True
                continue
            out.append(n)
        self.graph.nodes = out
        self.reindex()

    def bypass(self, node: Node, src: str, dst: str) -> bool:
        """Remove a node whose output `dst` equals its input `src`. Returns False when that is not possible
        (dst is a graph output fed by a graph input or a value that is also an output)."""
        if dst in self.outputs:
            producer = self.producer.get(src)
            if producer is None or src in self.outputs or self.n_uses(src) > 1:
                return False
            producer.outputs = [dst if o == src else o for o in producer.outputs]
            for reader in self.consumers.get(src, []):
                reader.inputs = [dst if i == src else i for i in reader.inputs]
            self.remove([node])
            return True
        for reader in self.consumers.get(dst, []):
            reader.inputs = [src if i == dst else i for i in reader.inputs]
            for g in reader.subgraphs():
                _rename_free(g, dst, src)
        self.remove([node])
        return True


def _rename_free(g: Graph, old: str, new: str) -> None:
    if old in g.defined_names():
        return
    for n in g.nodes:
        n.inputs = [new if i == old else i for i in n.inputs]
        for sub in n.subgraphs():
            _rename_free(sub, old, new)
    for o in g.outputs:
        if o.name == old:
            o.name = new
