"""Shape and layout kernels: Identity, Reshape, Transpose, Concat, Split, Slice, Squeeze, ..."""

from __future__ import annotations

from carrack.ops.registry import Kernel, register


@register("Identity", since=1)
class Identity(Kernel):
    def run(self, x):
        return x if type(x) is not list else (x,)
