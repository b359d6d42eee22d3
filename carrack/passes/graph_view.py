"""A mutable view of a graph for rewrites: who produces and who reads each value, and which values are constant.

Every edit updates the producer/consumer index locally, so a rewrite costs what it touches, not the graph's size.
While rules run, node order is only a hint (each node keeps a position); `commit` writes the live nodes back to the
graph in a topological order that follows those positions, so a rule never has to keep the node list sorted.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np

from carrack.ir.graph import Graph, Node
from carrack.ir.order import topological_order


class Readers:
    """The nodes reading one value, in the order they started reading it, each once. Adding or removing one costs
    the same however many there are (thousands of duplicates read one value before CSE merges them)."""

    __slots__ = ("_nodes",)

    def __init__(self) -> None:
        self._nodes: dict[int, Node] = {}

    def add(self, node: Node) -> None:
        self._nodes.setdefault(id(node), node)

    def discard(self, node: Node) -> None:
        self._nodes.pop(id(node), None)

    def first(self) -> Node:
        return next(iter(self._nodes.values()))

    def __contains__(self, node: object) -> bool:
        return self._nodes.get(id(node)) is node

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def __repr__(self) -> str:
        return f"Readers({[n.label() for n in self]})"


class GraphView:
    def __init__(self, graph: Graph):
        self.graph = graph
        self._fresh = itertools.count()
        self._live: dict[int, Node] = {}
        self._position: dict[int, float] = {}
        self.producer: dict[str, Node] = {}
        self.consumers: dict[str, Readers] = {}
        self.outputs = {o.name for o in graph.outputs}
        self.input_names = {v.name for v in graph.inputs}
        self._taken = {v.name for v in graph.inputs} | set(graph.initializers) | self.outputs
        self._sorted: list[Node] | None = None  # the live nodes in position order, until the next edit
        for position, node in enumerate(graph.nodes):
            self._add(node, float(position))

    @staticmethod
    def _reads(node: Node) -> Iterable[str]:
        yield from (i for i in node.inputs if i)
        for g in node.subgraphs():
            yield from g.free_names()

    # index maintenance ------------------------------------------------------------------------------------------------
    def _add(self, node: Node, position: float) -> None:
        self._sorted = None
        self._live[id(node)] = node
        self._position[id(node)] = position
        for o in node.outputs:
            if o:
                self.producer[o] = node
                self._taken.add(o)
        for i in set(self._reads(node)):
            readers = self.consumers.get(i)
            if readers is None:
                readers = self.consumers[i] = Readers()
            readers.add(node)
            self._taken.add(i)

    def _drop(self, node: Node) -> None:
        if self._live.pop(id(node), None) is None:
            return
        self._sorted = None
        self._position.pop(id(node), None)
        for o in node.outputs:
            if o and self.producer.get(o) is node:
                del self.producer[o]
        for i in set(self._reads(node)):
            readers = self.consumers.get(i)
            if readers is not None:
                readers.discard(node)
                if not readers:
                    del self.consumers[i]

    def _rewire(self, node: Node, inputs: list[str]) -> None:
        """Give a live node new inputs, keeping the consumer index true."""
        position = self._position[id(node)]
        self._drop(node)
        node.inputs = inputs
        self._add(node, position)

    # queries ----------------------------------------------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        """The live nodes, in position order (a topological order only after `commit`)."""
        if self._sorted is None:
            self._sorted = sorted(self._live.values(), key=lambda n: self._position[id(n)])
        return list(self._sorted)

    def alive(self, node: Node) -> bool:
        return id(node) in self._live

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes())

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
        readers = self.consumers.get(name)
        return readers.first() if readers is not None and len(readers) == 1 and name not in self.outputs else None

    def n_uses(self, name: str) -> int:
        readers = self.consumers.get(name)
        return (0 if readers is None else len(readers)) + (name in self.outputs)

    # edits ------------------------------------------------------------------------------------------------------------
    def fresh_name(self, base: str) -> str:
        while True:
            name = f"{base}__opt{next(self._fresh)}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def add_initializer(self, base: str, value: np.ndarray) -> str:
        """A new constant under a fresh name, stored 64-byte aligned (copied only when it is not already)."""
        from carrack.onnx.tensors import aligned_copy, is_aligned

        value = np.asarray(value)
        keep = value.dtype != object and value.dtype.isnative and value.flags.c_contiguous and is_aligned(value)
        name = self.fresh_name(base)
        self.graph.initializers[name] = value if keep else aligned_copy(value)
        return name

    def replace_uses(self, old: str, new: str) -> None:
        """Make every reader of `old` read `new` instead (graph outputs keep their names via the producer)."""
        for node in list(self.consumers.get(old, [])):
            self._rewire(node, [new if i == old else i for i in node.inputs])

    def redirect(self, old: str, new: str) -> None:
        """Make every reader of `old` read `new` instead, names read inside subgraph bodies included. Only the
        index entries of `old` and `new` change, so a reader with many inputs (a wide Concat) is not re-indexed."""
        readers = self.consumers.pop(old, None)
        if not readers:
            return
        targets = self.consumers.get(new)
        if targets is None:
            targets = self.consumers[new] = Readers()
        for reader in readers:
            reader.inputs = [new if i == old else i for i in reader.inputs]
            for g in reader.subgraphs():
                _rename_free(g, old, new)
            targets.add(reader)
        self._taken.add(new)

    def remove(self, nodes: Iterable[Node]) -> None:
        for node in nodes:
            self._drop(node)

    def replace(self, old_nodes: Iterable[Node], new_nodes: list[Node]) -> None:
        """Swap a group of nodes for new ones, placed where the first (in position order) of the old ones was."""
        old = [n for n in old_nodes if self.alive(n)]
        start = min((self._position[id(n)] for n in old), default=float(len(self._live)))
        for node in old:
            self._drop(node)
        step = 1.0 / (len(new_nodes) + 1) / 1024
        for k, node in enumerate(new_nodes):
            self._add(node, start + k * step)

    def bypass(self, node: Node, src: str, dst: str) -> bool:
        """Remove a node whose output `dst` equals its input `src`. Returns False when that is not possible
        (dst is a graph output fed by a graph input or a value that is also an output)."""
        if dst in self.outputs:
            producer = self.producer.get(src)
            if producer is None or src in self.outputs or self.n_uses(src) > 1:
                return False
            position = self._position[id(producer)]
            readers = [r for r in self.consumers.get(src, []) if r is not node]
            self._drop(producer)
            producer.outputs = [dst if o == src else o for o in producer.outputs]
            self._drop(node)
            self._add(producer, position)
            for reader in readers:
                self._rewire(reader, [dst if i == src else i for i in reader.inputs])
            return True
        readers = [r for r in self.consumers.get(dst, [])]
        self._drop(node)
        for reader in readers:
            position = self._position[id(reader)]
            self._drop(reader)
            reader.inputs = [src if i == dst else i for i in reader.inputs]
            for g in reader.subgraphs():
                _rename_free(g, dst, src)
            self._add(reader, position)
        return True

    def commit(self) -> None:
        """Write the live nodes back to the graph, in a topological order that follows their positions."""
        self.graph.nodes = topological_order(self.graph, self.nodes())


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
