"""Arena offsets for tests: what an `ArenaOrder` means, read directly (the oracle), and the library's own
straight-line form of it (`ArenaOrder.offsets_lines`, which `Plan` compiles) made callable on its own."""

from __future__ import annotations

from collections.abc import Sequence

from carrack.plan.arena import ArenaOrder, align


def reference_offsets(order: ArenaOrder, block_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each block's byte offset (in `order.blocks` order) and the arena's size for these block sizes: a block sits
    at the highest aligned end of the blocks listed below it, or at 0."""
    offsets: list[int] = []
    ends: list[int] = []
    for under, size in zip(order.below, block_sizes):
        offset = max((ends[j] for j in under), default=0)
        offsets.append(offset)
        ends.append(offset + align(size))
    return offsets, max(ends, default=0)


def compiled_offsets(order: ArenaOrder, block_sizes: Sequence[int]) -> tuple[list[int], int]:
    """The same from the source lines the plan compiles (`ArenaOrder.offsets_lines`)."""
    lines = order.offsets_lines(0) + [f"return [{''.join(f'o{k}, ' for k in range(len(order.blocks)))}], arena_bytes"]
    namespace: dict = {"__builtins__": {"max": max}}
    exec("def offsets(f):\n" + "".join(f"    {line}\n" for line in lines), namespace)  # noqa: S102 - our own source
    return namespace["offsets"](tuple(block_sizes))
