"""A static memory plan: every intermediate gets an offset in one 64-byte-aligned arena, by liveness.

Sizes come from shape inference with the run's symbolic dims bound. A value lives from the step that produces it to
its last reader; two values may share bytes when their lifetimes do not overlap. Placement is greedy by size
(largest first, lowest offset that fits), which is close to optimal on the chains and residual blocks networks are
made of. Elementwise ops whose input dies at that step write in place, so their output reuses the input's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from carrack.ir.graph import Graph
from carrack.passes.facts import Fact, numpy_dtype
from carrack.passes.shape_inference import infer, input_facts

ALIGNMENT = 64

#: ops whose output may overwrite their first input (same shape and dtype, each element read before written)
IN_PLACE_OPS = frozenset(
    "Relu Sigmoid Tanh Neg Abs Exp Log Sqrt Erf LeakyRelu Elu Selu Celu HardSigmoid HardSwish Softplus Softsign "
    "Clip Gelu Mish Identity Dropout Reciprocal Floor Ceil Round Sign Sin Cos".split())


@dataclass
class Block:
    name: str
    nbytes: int
    start: int  # producing step (-1: graph input)
    end: int  # last reading step
    offset: int = -1


@dataclass
class MemoryPlan:
    arena_bytes: int
    weight_bytes: int
    input_bytes: int
    intermediate_bytes: int  # sum over intermediates and kernel scratch, as if none shared memory
    blocks: dict[str, Block] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)  # values whose size is only known at run time

    @property
    def peak_bytes(self) -> int:
        """Expected peak: weights + caller inputs + the arena."""
        return self.weight_bytes + self.input_bytes + self.arena_bytes

    @property
    def efficiency(self) -> float:
        """arena bytes / sum of intermediate bytes (lower is better; 1.0 means no reuse)."""
        return self.arena_bytes / self.intermediate_bytes if self.intermediate_bytes else 1.0

    def summary(self) -> str:
        mib = 2**20
        lines = [f"weights:       {self.weight_bytes / mib:10.2f} MiB",
                 f"inputs:        {self.input_bytes / mib:10.2f} MiB",
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


def scratch_bytes(node, facts: Mapping[str, Fact]) -> int:
    """Working memory a kernel needs beyond its output while it runs: a convolution's padded input and im2col
    columns (1x1 and depthwise convolutions need no columns)."""
    if node.op_type not in ("Conv", "FusedConv", "ConvInteger", "QLinearConv") or len(node.inputs) < 2:
        return 0
    x, w = facts.get(node.inputs[0]), facts.get(node.inputs[1])
    y = facts.get(node.outputs[0])
    if x is None or w is None or y is None or not all(f.shape and all(isinstance(d, int) for d in f.shape)
                                                      for f in (x, w, y)):
        return 0
    itemsize = max(numpy_dtype(x.elem_type).itemsize, 4)  # float16 and integer inputs are computed in float32/64
    n, c, *spatial = x.shape
    m, cg, *kernel = w.shape
    group = node.attrs.get("group", 1)
    pads = node.attrs.get("pads") or [0] * (2 * len(kernel))
    needs_padding = any(pads) or node.attrs.get("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER")
    padded = n * c * int(np.prod([d + 2 * (k // 2) for d, k in zip(spatial, kernel)])) * itemsize if needs_padding \
        else 0
    if all(k == 1 for k in kernel) or (group == c == m):
        return padded
    columns = n * cg * group * int(np.prod(kernel)) * int(np.prod(y.shape[2:])) * itemsize
    from carrack.ops.conv import COLUMN_BYTES  # convolutions build their columns in blocks of at most this size

    return padded + min(columns, COLUMN_BYTES)


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_memory(graph: Graph, opsets: Mapping[str, int], bindings: Mapping[str, int] | None = None,
                facts: Mapping[str, Fact] | None = None) -> MemoryPlan:
    """Plan the arena for `graph` with symbolic input dims bound to `bindings` (dim name -> size)."""
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
    alias: dict[str, str] = {}
    for step, node in enumerate(graph.nodes):
        for name in node.outputs:
            if not name:
                continue
            size = fact_nbytes(facts.get(name, Fact()))
            if size is None:
                unknown.append(name)
                continue
            end = len(graph.nodes) if name in outputs else last_use.get(name, step)
            src = alias.get(node.inputs[0], node.inputs[0]) if node.inputs else ""
            if (node.op_type in IN_PLACE_OPS and src in blocks and blocks[src].nbytes == size
                    and last_use.get(node.inputs[0]) == step and node.inputs[0] not in outputs):
                blocks[src].end = max(blocks[src].end, end)  # write in place: extend the input's block
                alias[name] = src
                continue
            blocks[name] = Block(name, size, step, end)
        scratch = scratch_bytes(node, facts)
        if scratch:
            blocks[f"{node.name or node.outputs[0]}:scratch"] = Block(f"{node.name or node.outputs[0]}:scratch",
                                                                      scratch, step, step)
    arena = _place(list(blocks.values()))
    total = sum(b.nbytes for b in blocks.values())
    return MemoryPlan(arena, weights, inputs, total, blocks, unknown)


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
