"""Sequence and optional kernels. A sequence is a Python list of arrays; an empty optional is None."""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto

from carrack.errors import RunFailure
from carrack.ops.registry import Kernel, register


def _position(pos: Any, length: int, *, allow_end: bool) -> int:
    """A sequence position from a scalar tensor: negative counts from the back; `allow_end` admits `length`."""
    p = int(np.asarray(pos).reshape(-1)[0])
    upper = length if allow_end else length - 1
    if not -length <= p <= upper:
        valid = f"[{-length}, {upper}]"
        raise RunFailure(f"position {p} is out of range for a sequence of length {length} (valid: {valid})")
    return p + length if p < 0 else p


def _wrap(value: Any) -> Any:
    """A kernel result: sequences and optionals go in a one-element tuple."""
    return (value,) if value is None or isinstance(value, list) else value


@register("SequenceConstruct", since=11)
class SequenceConstruct(Kernel):
    def run(self, *tensors):
        return (list(tensors),)


@register("SequenceEmpty", since=11)
class SequenceEmpty(Kernel):
    def setup(self) -> None:
        self.dtype = self.attr("dtype", TensorProto.FLOAT)

    def run(self):
        return ([],)


@register("SequenceAt", since=11)
class SequenceAt(Kernel):
    def run(self, seq, pos):
        return seq[_position(pos, len(seq), allow_end=False)]


@register("SequenceInsert", since=11)
class SequenceInsert(Kernel):
    def run(self, seq, tensor, pos=None):
        out = list(seq)
        where = len(seq) if pos is None else _position(pos, len(seq), allow_end=True)
        out.insert(where, tensor)
        return (out,)


@register("SequenceErase", since=11)
class SequenceErase(Kernel):
    def run(self, seq, pos=None):
        if not seq:
            raise RunFailure("cannot erase from an empty sequence")
        where = len(seq) - 1 if pos is None else _position(pos, len(seq), allow_end=False)
        return (seq[:where] + seq[where + 1:],)


@register("SequenceLength", since=11)
class SequenceLength(Kernel):
    def run(self, seq):
        return np.array(len(seq), dtype=np.int64)


@register("SplitToSequence", since=11)
class SplitToSequence(Kernel):
    def setup(self) -> None:
        self.axis = self.attr("axis", 0)
        self.keepdims = bool(self.attr("keepdims", 1))

    def run(self, x, split=None):
        if not -x.ndim <= self.axis < x.ndim:
            raise RunFailure(f"axis {self.axis} is out of range for an input of rank {x.ndim}")
        axis = self.axis % x.ndim
        size = x.shape[axis]
        if split is None:
            parts = np.split(x, size, axis=axis) if size else []
            return ([p if self.keepdims else np.squeeze(p, axis=axis) for p in parts],)
        split = np.asarray(split).astype(np.int64)
        if split.ndim == 0:
            step = int(split)
            if step <= 0:
                raise RunFailure(f"split must be positive, got {step}")
            bounds = list(range(step, size, step))
        else:
            if (split < 0).any() or int(split.sum()) != size:
                raise RunFailure(f"split {split.tolist()} must be non-negative and sum to the axis size {size}")
            bounds = np.cumsum(split)[:-1].tolist()
        return (np.split(x, bounds, axis=axis),)


@register("ConcatFromSequence", since=11)
class ConcatFromSequence(Kernel):
    def setup(self) -> None:
        self.axis = self.required_attr("axis")
        self.new_axis = bool(self.attr("new_axis", 0))

    def run(self, seq):
        if not seq:
            raise RunFailure("cannot concatenate an empty sequence")
        rank = seq[0].ndim + (1 if self.new_axis else 0)
        if not -rank <= self.axis < rank:
            raise RunFailure(f"axis {self.axis} is out of range for rank {rank}")
        axis = self.axis % rank
        self.check_output([sum(np.asarray(v).nbytes for v in seq)], np.uint8)
        return np.stack(seq, axis=axis) if self.new_axis else np.concatenate(seq, axis=axis)


@register("Optional", since=15)
class Optional(Kernel):
    def run(self, x=None):
        return (x,)


@register("OptionalHasElement", since=15)
class OptionalHasElement(Kernel):
    def run(self, x=None):
        return np.array(x is not None)


@register("OptionalGetElement", since=15)
class OptionalGetElement(Kernel):
    def run(self, x=None):
        if x is None:
            raise RunFailure("OptionalGetElement got an empty optional")
        return _wrap(x)
