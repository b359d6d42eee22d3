"""carrack's exceptions. Names follow onnxruntime's (InvalidArgument, InvalidGraph, NotImplemented, Fail)."""

from __future__ import annotations


class CarrackError(Exception):
    """Base class of every error carrack raises on purpose."""


class InvalidModel(CarrackError, ValueError):
    """The model file or graph is malformed, truncated or inconsistent."""


InvalidGraph = InvalidModel


class InvalidArgument(CarrackError, ValueError):
    """A run was given bad feeds: unknown or missing names, wrong dtype, rank or dim."""


class UnsupportedModel(CarrackError, NotImplementedError):
    """The model needs something carrack does not implement (an operator, an opset, a type)."""


class NotImplementedOps(UnsupportedModel):
    """Operators without a kernel, listed all at once."""

    def __init__(self, missing: list[tuple[str, str, int, str]]):
        self.missing = missing
        lines = [f"  {op} (domain '{dom or 'ai.onnx'}', opset {ver}) at {where}" for op, dom, ver, where in missing]
        super().__init__(f"{len(missing)} node(s) use operators carrack does not implement:\n" + "\n".join(lines))


class RunFailure(CarrackError, RuntimeError):
    """A kernel failed while running; the message names the node."""


class MemoryLimitExceeded(CarrackError, MemoryError):
    """The memory plan needs more bytes than SessionOptions.memory_limit_bytes allows."""


class PerformanceWarning(UserWarning):
    """carrack runs, but slower than it could: e.g. a native kernel is unavailable and its numpy path runs."""
