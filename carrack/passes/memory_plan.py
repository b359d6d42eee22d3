"""A static memory plan: every intermediate gets an offset in one 64-byte-aligned arena, by liveness.

Sizes come from shape inference with the run's symbolic dims bound. A value lives from the step that produces it to
its last reader; two values may share bytes when their lifetimes do not overlap. Placement is greedy by size
(largest first, lowest offset that fits), which is close to optimal on the chains and residual blocks networks are
made of. Elementwise ops whose input dies at that step write in place, so their output reuses the input's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from carrack.ir.graph import Graph, Node
from carrack.ops import registry
from carrack.passes.facts import Fact, numpy_dtype
from carrack.passes.shape_inference import infer, input_facts

ALIGNMENT = 64

@dataclass
class Block:
    name: str
    nbytes: int
    start: int  # producing step (-1: graph input)
    end: int  # last reading step
    offset: int = -1
    shape: tuple[int, ...] = ()
    dtype: np.dtype | None = None


@dataclass
class MemoryPlan:
    arena_bytes: int
    weight_bytes: int
    input_bytes: int
    intermediate_bytes: int  # sum over intermediates and kernel scratch, as if none shared memory
    blocks: dict[str, Block] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)  # values whose size is only known at run time
    output_bytes: int = 0  # graph outputs: allocated for the caller, outside the arena
    #: value name -> the block it is written into (its own, or its input's when computed in place)
    storage: dict[str, str] = field(default_factory=dict)
    #: values that may be views of a block (outputs of view kernels whose input lives in the arena)
    views: frozenset[str] = frozenset()

    def placement(self, name: str) -> tuple[int, tuple[int, ...], np.dtype] | None:
        """Where a value lives in the arena: (byte offset, shape, dtype), or None when it is not planned."""
        block = self.blocks.get(self.storage.get(name, ""))
        if block is None or block.dtype is None:
            return None
        fact_shape, dtype = self._shapes.get(name, (None, None))
        if fact_shape is None:
            return None
        return block.offset, fact_shape, dtype

    _shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = field(default_factory=dict, repr=False)
    #: what kernels keep beside the weights once prepared (weights repacked for their native code)
    prepared_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """Expected peak: weights (and their prepared copies) + caller inputs + the arena + the outputs handed
        back."""
        return self.weight_bytes + self.prepared_bytes + self.input_bytes + self.arena_bytes + self.output_bytes

    @property
    def efficiency(self) -> float:
        """arena bytes / sum of intermediate bytes (lower is better; 1.0 means no reuse)."""
        return self.arena_bytes / self.intermediate_bytes if self.intermediate_bytes else 1.0

    def summary(self) -> str:
        mib = 2**20
        lines = [f"weights:       {self.weight_bytes / mib:10.2f} MiB",
                 f"prepared:      {self.prepared_bytes / mib:10.2f} MiB  (weights repacked for the kernels)",
                 f"inputs:        {self.input_bytes / mib:10.2f} MiB",
                 f"outputs:       {self.output_bytes / mib:10.2f} MiB",
                 f"arena:         {self.arena_bytes / mib:10.2f} MiB  ({len(self.blocks)} intermediates, "
                 f"{self.intermediate_bytes / mib:.2f} MiB if none shared memory; efficiency "
                 f"{self.efficiency:.3f})",
                 f"expected peak: {self.peak_bytes / mib:10.2f} MiB"]
        if self.unknown:
            lines.append(f"sizes known only at run time: {len(self.unknown)} values "
                         f"({', '.join(self.unknown[:5])}{', ...' if len(self.unknown) > 5 else ''})")
        return "\n".join(lines)


def fact_nbytes(fact: Fact) -> int | None:
    shape, dtype = fact.shape, numpy_dtype(fact.elem_type)
    if shape is None or dtype is None or dtype.kind == "O" or any(not isinstance(d, int) for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64)) * max(dtype.itemsize, 1)


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_memory(graph: Graph, opsets: Mapping[str, int], bindings: Mapping[str, int] | None = None,
                facts: Mapping[str, Fact] | None = None,
                writes_into: Callable[[Node], bool] | None = None,
                numpy_nodes: Callable[[Node], bool] | None = None) -> MemoryPlan:
    """Plan the arena for `graph` with symbolic input dims bound to `bindings` (dim name -> size).

    By default every intermediate is placed (the whole working set: what `session.memory_plan()` reports). With
    `writes_into`, only the outputs of nodes for which it is true are placed (the executor's arena: the nodes whose
    kernels can write into a given buffer; the others allocate their own results). `numpy_nodes`: the nodes the
    plan runs on numpy rather than native kernels (they prepare nothing).
    """
    facts = dict(facts) if facts is not None else infer(graph, opsets, input_facts(graph, bindings))
    weights = sum(a.nbytes for a in graph.initializers.values() if isinstance(a, np.ndarray))
    inputs = sum(fact_nbytes(facts[v.name]) or 0 for v in graph.inputs
                 if v.name not in graph.initializers and v.name in facts)
    outputs = {o.name for o in graph.outputs}
    last_use: dict[str, int] = {}
    for step, node in enumerate(graph.nodes):
        for name in list(node.inputs) + [n for g in node.subgraphs() for n in g.free_names()]:
            last_use[name] = step
    blocks: dict[str, Block] = {}
    unknown: list[str] = []
    storage: dict[str, str] = {}  # value -> block holding its bytes (its own, or its input's when in place)
    view_of: dict[str, str] = {}  # value -> block it may be a view of
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    output_bytes = prepared = 0
    for step, node in enumerate(graph.nodes):
        kernel = registry.traits(node, opsets)
        if kernel is not None and (numpy_nodes is None or not numpy_nodes(node)):
            prepared += kernel.prepared_bytes(node, graph.initializers)
        placed_here = writes_into is None or writes_into(node)
        for name in node.outputs:
            if not name:
                continue
            fact = facts.get(name, Fact())
            size = fact_nbytes(fact)
            end = len(graph.nodes) if name in outputs else last_use.get(name, step)
            first = node.inputs[0] if node.inputs else ""
            src = view_of.get(first) or storage.get(first, "")
            if kernel is not None and kernel.view and src in blocks:
                view_of[name] = src  # no bytes of its own; the source stays reserved while the view is read
                blocks[src].end = max(blocks[src].end, end)
                continue
            if size is None:
                unknown.append(name)
                continue
            if not placed_here:
                continue
            if name in outputs:
                output_bytes += size  # handed to the caller: allocated outside the arena
                continue
            shapes[name] = (tuple(fact.shape), numpy_dtype(fact.elem_type))
            if (kernel is not None and kernel.in_place and src in blocks and first not in view_of
                    and blocks[src].nbytes == size and blocks[src].end <= step):
                blocks[src].end = max(blocks[src].end, end)  # write in place: extend the input's block
                storage[name] = src
                continue
            blocks[name] = Block(name, size, step, end, shape=shapes[name][0], dtype=shapes[name][1])
            storage[name] = name
        scratch = kernel.scratch_bytes(node, facts) if writes_into is None and kernel is not None else 0
        if scratch:
            blocks[f"{node.name or node.outputs[0]}:scratch"] = Block(f"{node.name or node.outputs[0]}:scratch",
                                                                      scratch, step, step)
    arena = _place(list(blocks.values()))
    total = sum(b.nbytes for b in blocks.values())
    return MemoryPlan(arena, weights, inputs, total, blocks, unknown, output_bytes, storage, frozenset(view_of),
                      shapes, prepared)


def _place(blocks: list[Block]) -> int:
    placed: list[Block] = []
    arena = 0
    for b in sorted(blocks, key=lambda b: (-b.nbytes, b.start)):
        busy = sorted((p.offset, p.offset + _align(p.nbytes)) for p in placed if p.start <= b.end and b.start <= p.end)
        offset = 0
        for lo, hi in busy:
            if offset + b.nbytes <= lo:
                break
            offset = max(offset, hi)
        b.offset = offset
        placed.append(b)
        arena = max(arena, offset + _align(b.nbytes))
    return arena
