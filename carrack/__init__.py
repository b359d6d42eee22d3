"""carrack: a neural-network inference engine for Python (ONNX and GGUF models on numpy arrays).

    import carrack
    sess = carrack.InferenceSession("model.onnx")
    outputs = sess.run(None, {"input": x})
"""

from carrack import ops as _ops  # noqa: F401 - registers the kernels
from carrack.errors import (
    CarrackError,
    InvalidArgument,
    InvalidGraph,
    InvalidModel,
    MemoryLimitExceeded,
    NotImplementedOps,
    PerformanceWarning,
    RunFailure,
    UnsupportedModel,
)
from carrack.runtime.options import ExecutionMode, GraphOptimizationLevel, RunOptions, SessionOptions
from carrack.runtime.session import InferenceSession, ModelMetadata, NodeArg

__version__ = "0.1.0"


def get_available_providers() -> list[str]:
    return ["CPUExecutionProvider"]


def get_device() -> str:
    return "CPU"


__all__ = [
    "CarrackError", "ExecutionMode", "GraphOptimizationLevel", "InferenceSession", "InvalidArgument", "InvalidGraph",
    "InvalidModel", "MemoryLimitExceeded", "ModelMetadata", "NodeArg", "NotImplementedOps", "PerformanceWarning",
    "RunFailure", "RunOptions", "SessionOptions", "UnsupportedModel", "get_available_providers", "get_device",
]
