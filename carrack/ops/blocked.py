"""Convolutions on channel-blocked tensors ([N, C/16, H, W, 16]) and the reorders at a blocked chain's ends: the
nodes the layout pass makes (carrack.passes.blocked_layout). blockconv.c runs them; without it (no native kernels,
a plan unpickled where the library does not load) each convolution runs as FusedConv on the reordered tensors."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from carrack import native
from carrack.native import blockconv
from carrack.onnx.tensors import aligned_empty
from carrack.ops import registry
from carrack.ops.fused import _activation, _epilogue
from carrack.ops.registry import Kernel, bound_or_run_into, register

CARRACK = "carrack"
_F32 = np.dtype(np.float32)


def _usable(a: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Whether blockconv.c can read or write `a` as a tensor of `shape`."""
    return (type(a) is np.ndarray and a.shape == shape and a.dtype == _F32 and a.flags.c_contiguous
            and a.flags.aligned)


def _output(out: np.ndarray | None, shape: tuple[int, ...], *inputs: np.ndarray | None) -> np.ndarray:
    """`out` where the kernel may write its result there, else a fresh aligned buffer."""
    if (out is not None and _usable(out, shape) and out.flags.writeable
            and not any(i is not None and np.may_share_memory(out, i) for i in inputs)):
        return out
    return aligned_empty(shape, _F32)


@register("BlockedConv", domain=CARRACK)
class BlockedConv(Kernel):
    """act(conv(X, W) + B + Z) with X, Z and the result channel-blocked ([N, C/16, H, W, 16]) and W the ordinary
    [M, C, KH, KW] weight (packed for blockconv.c when the kernel is prepared). 2-D, group 1; attributes as
    FusedConv's (kernel_shape, strides, pads, dilations, activation, activation_params)."""

    @classmethod
    def prepared_bytes(cls, node, constants) -> int:
        w = constants.get(node.inputs[1])
        return w.size * 4 if isinstance(w, np.ndarray) and blockconv.library() is not None else 0

    def setup(self) -> None:
        inputs = self.node.inputs
        if not 2 <= len(inputs) <= 4 or not inputs[0] or not inputs[1]:
            self.fail(f"expects inputs X, W and optionally B and Z; got {list(inputs)}")
        self.kernel = tuple(int(k) for k in self.attr("kernel_shape", ()))
        self.strides = tuple(int(s) for s in self.attr("strides", (1, 1)))
        self.pads = tuple(int(p) for p in self.attr("pads", (0, 0, 0, 0)))
        self.dilations = tuple(int(d) for d in self.attr("dilations", (1, 1)))
        if (len(self.kernel) != 2 or len(self.strides) != 2 or len(self.pads) != 4 or len(self.dilations) != 2
                or min(self.kernel + self.strides + self.dilations) < 1 or min(self.pads) < 0):
            self.fail(f"needs a 2-D kernel_shape, strides, pads (4) and dilations; got kernel_shape {self.kernel}, "
                      f"strides {self.strides}, pads {self.pads}, dilations {self.dilations}")
        name, params = self.attr("activation", ""), list(self.attr("activation_params", []))
        try:
            self.epilogue = _epilogue(name, params, _activation(name, params))
        except ValueError as e:
            self.fail(str(e))
        if self.epilogue.code < 0:
            self.fail(f"activation {name!r} is not one blockconv.c applies")
        self.activation = self.epilogue.native()
        self.prepared_weight: np.ndarray | None = None
        self.packed: np.ndarray | None = None
        self.bias: np.ndarray | None = None
        self.lib = blockconv.library() if native.enabled() else None
        self._fallback: Kernel | None = None

    def prepare(self, constants) -> None:
        w = constants[1] if len(constants) > 1 else None
        if self.lib is None or not isinstance(w, np.ndarray):
            return
        self._check_weight(w)
        self.prepared_weight = w
        self.packed = native.prepared("blockconv", (w,), lambda: blockconv.pack_weights(w))
        b = constants[2] if len(constants) > 2 else None
        self.bias = None if b is None else np.ascontiguousarray(b, _F32)

    def _check_weight(self, w: np.ndarray) -> None:
        if (w.dtype != _F32 or w.ndim != 4 or w.shape[0] % blockconv.BLOCK or w.shape[1] % blockconv.BLOCK
                or tuple(w.shape[2:]) != self.kernel):
            self.fail(f"weight W must be float32 [M, C, {self.kernel[0]}, {self.kernel[1]}] with M and C "
                      f"multiples of {blockconv.BLOCK}; got {w.dtype} {list(w.shape)}")

    def _geometry(self, x: np.ndarray, w: np.ndarray) -> blockconv.Geometry:
        g = None
        if type(x) is np.ndarray and x.ndim == 5 and x.shape[1] * blockconv.BLOCK == w.shape[1]:
            g = blockconv.geometry(x.shape, w.shape[0], self.kernel, self.strides, self.pads, self.dilations)
        if g is None:
            self.fail(f"input X must be a blocked map [N, {w.shape[1] // blockconv.BLOCK}, H, W, "
                      f"{blockconv.BLOCK}] giving a non-empty output; got {getattr(x, 'shape', type(x).__name__)}")
        return g

    def _operands(self, w: np.ndarray, b: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The packed weight and bias for this run's W and B (the prepared ones, or packed now)."""
        if w is self.prepared_weight:
            return self.packed, self.bias
        self._check_weight(w)
        return blockconv.pack_weights(w), None if b is None else np.ascontiguousarray(b, _F32)

    def run(self, x, w, b=None, z=None):
        return self.run_into(None, x, w, b, z)

    def run_into(self, out, x, w, b=None, z=None):
        g = self._geometry(x, w)
        if z is not None and (type(z) is not np.ndarray or z.shape != g.out_shape):
            self.fail(f"residual Z must have the output's blocked shape {list(g.out_shape)}; got "
                      f"{getattr(z, 'shape', type(z).__name__)}")
        if self.lib is None or x.dtype != _F32:
            return self._numpy(x, w, b, z)
        packed, bias = self._operands(w, b)
        x = np.require(x, _F32, ("C", "A"))
        z = None if z is None else np.require(z, _F32, ("C", "A"))
        y = _output(out, g.out_shape, x)
        if not blockconv.convolve(self.lib, x, packed, bias, z, y, g, self.activation):
            return self._numpy(x, w, b, z)
        return y

    def bind_into(self, out, x, w, b=None, z=None) -> Callable[[], None] | None:
        """blockconv.c's call for these very arrays, its arguments converted once."""
        if self.lib is None or w is not self.prepared_weight or type(x) is not np.ndarray:
            return None
        g = self._geometry(x, w)
        if (not _usable(x, x.shape) or (z is not None and not _usable(z, g.out_shape))
                or _output(out, g.out_shape, x) is not out):
            return None
        call = blockconv.bind_convolve(self.lib, x, self.packed, self.bias, z, out, g, self.activation)
        return bound_or_run_into(call, self.run_into, out, x, w, b, z)

    def _numpy(self, x, w, b, z):
        """The convolution as FusedConv on the NCHW tensors (where blockconv.c is not available)."""
        if self._fallback is None:
            attrs = {k: v for k, v in self.node.attrs.items()}
            node = self.node.__class__("FusedConv", ["x", "w", "b", "z"], ["y"], attrs, domain=CARRACK,
                                       name=self.node.name)
            cls, version = registry.resolve(CARRACK, "FusedConv", 1)
            self._fallback = cls(node, version, None)
        plain = self._fallback.run(blockconv.from_blocked(x), w, b,
                                   None if z is None else blockconv.from_blocked(z))
        return blockconv.to_blocked(np.asarray(plain, _F32))


class _Reorder(Kernel):
    """A reorder between NCHW and the blocked layout (float32, channels a multiple of 16)."""

    to_blocked = True

    def setup(self) -> None:
        self.lib = blockconv.library() if native.enabled() else None

    def _shape(self, x) -> tuple[int, ...]:
        block = blockconv.BLOCK
        if self.to_blocked:
            if type(x) is not np.ndarray or x.ndim != 4 or x.shape[1] % block or x.dtype != _F32:
                self.fail(f"input must be a float32 [N, C, H, W] tensor with C a multiple of {block}; got "
                          f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', ()))}")
            n, c, h, w = x.shape
            return n, c // block, h, w, block
        if type(x) is not np.ndarray or x.ndim != 5 or x.shape[4] != block or x.dtype != _F32:
            self.fail(f"input must be a float32 blocked [N, C/{block}, H, W, {block}] tensor; got "
                      f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', ()))}")
        n, cb, h, w, _ = x.shape
        return n, cb * block, h, w

    def run(self, x):
        return self.run_into(None, x)

    def run_into(self, out, x):
        shape = self._shape(x)
        if self.lib is None:
            return blockconv.to_blocked(x) if self.to_blocked else blockconv.from_blocked(x)
        x = np.require(x, _F32, ("C", "A"))
        y = _output(out, shape, x)
        blockconv.reorder(self.lib, x, y, self.to_blocked)
        return y

    def bind_into(self, out, x) -> Callable[[], None] | None:
        if self.lib is None:
            return None
        shape = self._shape(x)
        if not _usable(x, x.shape) or _output(out, shape, x) is not out:
            return None
        lib, to_blocked = self.lib, self.to_blocked
        return lambda: blockconv.reorder(lib, x, out, to_blocked) or None


@register("BlockChannels", domain=CARRACK)
class BlockChannels(_Reorder):
    """[N, C, H, W] -> [N, C/16, H, W, 16]: the entry of a blocked chain."""

    to_blocked = True


@register("UnblockChannels", domain=CARRACK)
class UnblockChannels(_Reorder):
    """[N, C/16, H, W, 16] -> [N, C, H, W]: where a blocked chain's value is read by anything else."""

    to_blocked = False
