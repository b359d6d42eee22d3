"""carrack's exceptions. Names follow onnxruntime's (InvalidArgument, InvalidGraph, NotImplemented, Fail), and each
subclasses the onnxruntime error class of the same meaning (carrack.capi.onnxruntime_pybind11_state), so ``except``
clauses written for onnxruntime catch them."""

from __future__ import annotations

from carrack.capi import onnxruntime_pybind11_state as _ort


class CarrackError(Exception):
    """Base class of every error carrack raises on purpose."""


class InvalidModel(CarrackError, ValueError, _ort.InvalidGraph):
    """The model file or graph is malformed, truncated or inconsistent."""


InvalidGraph = InvalidModel


class ModelFileNotFound(InvalidModel, FileNotFoundError, _ort.NoSuchFile):
    """The model path names no file."""


class CorruptModel(InvalidModel, _ort.InvalidProtobuf):
    """The model bytes are not a parsable ONNX protobuf (truncated or corrupt)."""


class InvalidArgument(CarrackError, ValueError, _ort.InvalidArgument):
    """A run was given bad feeds: unknown or missing names, wrong dtype, rank or dim."""


class UnsupportedModel(CarrackError, NotImplementedError, _ort.NotImplemented):
    """The model needs something carrack does not implement (an operator, an opset, a type)."""


class NotImplementedOps(UnsupportedModel, _ort.InvalidGraph):
    """Operators without a kernel, listed all at once (onnxruntime says InvalidGraph for operators without a schema,
    NotImplemented for those without a kernel: this is both)."""

    def __init__(self, missing: list[tuple[str, str, int, str]]):
        self.missing = missing
        lines = [f"  {op} (domain '{dom or 'ai.onnx'}', opset {ver}) at {where}" for op, dom, ver, where in missing]
        super().__init__(f"{len(missing)} node(s) use operators carrack does not implement:\n" + "\n".join(lines))


class RunFailure(CarrackError, RuntimeError, _ort.Fail, _ort.RuntimeException):
    """A kernel failed while running; the message names the node (onnxruntime raises Fail or RuntimeException)."""


class MemoryLimitExceeded(CarrackError, MemoryError, _ort.Fail):
    """The memory plan needs more bytes than SessionOptions.memory_limit_bytes allows."""


class RunTerminated(CarrackError, RuntimeError, _ort.Fail):
    """RunOptions.terminate was set before or during the run; the run stopped between two nodes."""

    def __init__(self, where: str = ""):
        # onnxruntime's message, so code matching on it keeps working
        super().__init__("Exiting due to terminate flag being set to true." + (f" ({where})" if where else ""))


class UnsupportedFeature(UnsupportedModel):
    """An onnxruntime API carrack does not provide (custom-op libraries, execution providers)."""


class UnknownProvider(CarrackError, RuntimeError, _ort.InvalidArgument):
    """An execution provider name onnxruntime does not know (onnxruntime raises RuntimeError)."""


class PerformanceWarning(UserWarning):
    """carrack runs, but slower than it could: e.g. a native kernel is unavailable and its numpy path runs."""
