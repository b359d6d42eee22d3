"""The arena layout of a plan, valid for every input size.

Each planned value is a block whose size is an expression over the input's symbolic dims and whose lifetime runs
from the step producing it to its last reader. Blocks are placed once, greedily, at reference sizes; what is kept
is not the offsets but the order: for each block, the blocks that overlap it in time and lie below it. At run time
a block's offset is the highest end among those below it, for the actual sizes, so no two blocks that are alive
together can overlap, whatever the sizes. When sizes grow in proportion (a longer text, a bigger batch) the layout
is as tight as at the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from carrack.ir.symbolic import DimLike, evaluate

ALIGNMENT = 64
#: every symbol takes this size when blocks are placed to find their order
REFERENCE_SIZE = 64


def align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass
class Block:
    name: str
    size: DimLike  # bytes, an expression over the symbols
    start: int  # producing step
    end: int  # last reading step


@dataclass
class ArenaOrder:
    """Blocks in placement order; `below[k]` lists the (earlier) blocks that block k must sit above."""

    blocks: list[Block]
    below: list[tuple[int, ...]]

    def offsets_lines(self, first: int) -> list[str]:
        """The layout as straight-line Python over the dims `f` (block k's size is f[first + k]): assigns o<k>, the
        offset of block k (the highest aligned end of the blocks `below` it, or 0), e<k> its end, and
        `arena_bytes`; for a function compiled once per plan (a decoder evaluates its plan every token)."""
        lines = []
        for k, under in enumerate(self.below):
            offset = "0" if not under else f"e{under[0]}" if len(under) == 1 else \
                f"max({', '.join(f'e{j}' for j in under)})"
            lines += [f"o{k} = {offset}", f"e{k} = o{k} + ((f[{first + k}] + {ALIGNMENT - 1}) & {-ALIGNMENT})"]
        ends = [f"e{k}" for k in range(len(self.below))]
        lines.append(f"arena_bytes = {'max(' + ', '.join(ends) + ')' if len(ends) > 1 else ends[0] if ends else '0'}")
        return lines


def order_blocks(blocks: list[Block], symbols: Sequence) -> ArenaOrder:
    """Place blocks greedily (largest first, lowest offset that fits) at reference sizes and keep the order."""
    reference = {s: REFERENCE_SIZE for s in symbols}
    sizes = [int(evaluate(b.size, reference)) for b in blocks]
    overlaps = _overlaps(blocks)
    offset_of: dict[int, int] = {}
    for k in sorted(range(len(blocks)), key=lambda k: (-sizes[k], blocks[k].start)):
        busy = sorted((offset_of[j], offset_of[j] + align(sizes[j])) for j in overlaps[k] if j in offset_of)
        offset = 0
        for lo, hi in busy:
            if offset + sizes[k] <= lo:
                break
            offset = max(offset, hi)
        offset_of[k] = offset
    by_offset = sorted(range(len(blocks)), key=lambda k: (offset_of[k], blocks[k].start, k))
    position = {k: p for p, k in enumerate(by_offset)}
    below = [tuple(sorted(position[j] for j in overlaps[k] if position[j] < position[k])) for k in by_offset]
    return ArenaOrder([blocks[k] for k in by_offset], below)


def _overlaps(blocks: list[Block]) -> list[list[int]]:
    """For each block, the blocks alive at some common step (a sweep over starts: cost ~ blocks x live blocks)."""
    found: list[list[int]] = [[] for _ in blocks]
    active: list[int] = []
    for k in sorted(range(len(blocks)), key=lambda k: blocks[k].start):
        start = blocks[k].start
        active = [j for j in active if blocks[j].end >= start]
        for j in active:
            found[j].append(k)
            found[k].append(j)
        active.append(k)
    return found
