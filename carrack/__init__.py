"""carrack: a neural-network inference engine for Python (ONNX and GGUF models on numpy arrays).

    import carrack
    sess = carrack.InferenceSession("model.onnx")
    outputs = sess.run(None, {"input": x})
"""

from carrack import ops as _ops  # noqa: F401 - registers the kernels
from carrack.backends.c.compiled import CompiledModel
from carrack.errors import (
    CarrackError,
    CorruptModel,
    InvalidArgument,
    InvalidGraph,
    InvalidModel,
    MemoryLimitExceeded,
    ModelFileNotFound,
    NotImplementedOps,
    PerformanceWarning,
    RunFailure,
    RunTerminated,
    UnsupportedFeature,
    UnsupportedModel,
)
from carrack.onnxruntime_compat import install_as_onnxruntime
from carrack.runtime.environment import (
    disable_telemetry_events,
    enable_telemetry_events,
    get_all_providers,
    get_available_providers,
    get_build_info,
    get_device,
    get_version_string,
    has_collective_ops,
    set_default_logger_severity,
    set_default_logger_verbosity,
)
from carrack.runtime.iobinding import IOBinding, SessionIOBinding
from carrack.runtime.options import ExecutionMode, ExecutionOrder, GraphOptimizationLevel, RunOptions, SessionOptions
from carrack.runtime.ortvalue import OrtDevice, OrtValue
from carrack.runtime.session import InferenceSession, ModelMetadata, NodeArg

__version__ = "0.1.0"

__all__ = [
    "CarrackError", "CorruptModel", "ExecutionMode", "ExecutionOrder", "GraphOptimizationLevel", "IOBinding",
    "InferenceSession", "InvalidArgument", "InvalidGraph", "InvalidModel", "MemoryLimitExceeded", "ModelFileNotFound",
    "ModelMetadata", "NodeArg", "NotImplementedOps", "OrtDevice", "OrtValue", "RunFailure", "RunOptions",
    "RunTerminated", "SessionIOBinding", "SessionOptions", "UnsupportedFeature", "UnsupportedModel",
    "disable_telemetry_events", "enable_telemetry_events", "get_all_providers", "get_available_providers",
    "get_build_info", "get_device", "get_version_string", "has_collective_ops", "install_as_onnxruntime",
    "set_default_logger_severity", "set_default_logger_verbosity",
    "PerformanceWarning",
]
__all__ += ["CompiledModel"]
