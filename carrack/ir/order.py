"""Topological order of a graph's nodes in O(nodes + edges) (Kahn), stable with respect to the given order."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from carrack.errors import InvalidModel
from carrack.ir.graph import Graph, Node


def node_reads(node: Node) -> set[str]:
    """Every value a node needs before it runs: its inputs and what its subgraphs read from outside."""
    needs = {i for i in node.inputs if i}
    for g in node.subgraphs():
        needs |= g.free_names()
    return needs


def topological_order(graph: Graph, nodes: Sequence[Node] | None = None) -> list[Node]:
    """`nodes` (default: the graph's) in an order where every value is produced before it is read; among nodes that
    are ready together the earlier one in `nodes` goes first, so an already sorted list comes back unchanged.
    Values nothing in `nodes` produces are taken as given (graph inputs, initializers, outer-scope names)."""
    nodes = list(graph.nodes if nodes is None else nodes)
    producer_of: dict[str, int] = {}
    for k, node in enumerate(nodes):
        for o in node.outputs:
            if o:
                producer_of[o] = k
    waiting = [0] * len(nodes)
    readers: list[list[int]] = [[] for _ in nodes]
    for k, node in enumerate(nodes):
        for name in node_reads(node):
            p = producer_of.get(name)
            if p is not None and p != k:
                waiting[k] += 1
                readers[p].append(k)
            elif p == k:
                raise InvalidModel(f"{node.label()} reads its own output '{name}' (a cycle)")
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(nodes[k])
        for r in readers[k]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(nodes):
        raise InvalidModel(_cycle_message(nodes, waiting, producer_of))
    return order


def _cycle_message(nodes: Sequence[Node], waiting: list[int], producer_of: dict[str, int]) -> str:
    """Name the nodes of one cycle among those that never became ready."""
    stuck = {k for k, w in enumerate(waiting) if w > 0}
    start = min(stuck)
    path: list[int] = []
    seen: dict[int, int] = {}
    k = start
    while k not in seen:
        seen[k] = len(path)
        path.append(k)
        k = next(producer_of[n] for n in sorted(node_reads(nodes[k])) if producer_of.get(n) in stuck)
    cycle = path[seen[k]:][::-1]  # walked from readers to producers: reversed, it follows the data
    labels = " -> ".join(nodes[i].label() for i in cycle + [cycle[0]])
    return f"the graph has a cycle: {labels} ({len(stuck)} nodes cannot be ordered)"
