"""onnxruntime's error classes by name, at onnxruntime's module path (onnxruntime.capi.onnxruntime_pybind11_state).

Code written for onnxruntime catches these (``except InvalidArgument``); carrack's errors (carrack.errors) subclass
them, so such clauses catch carrack's errors. The session classes are re-exported here too, as in onnxruntime.
"""

from __future__ import annotations

from typing import Any


class Fail(Exception):
    """onnxruntime status FAIL: a generic failure."""


class InvalidArgument(Exception):
    """onnxruntime status INVALID_ARGUMENT: bad feeds or arguments."""


class NoSuchFile(Exception):
    """onnxruntime status NO_SUCHFILE: the model file does not exist."""


class NoModel(Exception):
    """onnxruntime status NO_MODEL."""


class EngineError(Exception):
    """onnxruntime status ENGINE_ERROR."""


class RuntimeException(Exception):
    """onnxruntime status RUNTIME_EXCEPTION: a kernel failed while running."""


class InvalidProtobuf(Exception):
    """onnxruntime status INVALID_PROTOBUF: the model bytes do not parse."""


class ModelLoaded(Exception):
    """onnxruntime status MODEL_LOADED."""


class NotImplemented(Exception):  # noqa: A001 - onnxruntime's name
    """onnxruntime status NOT_IMPLEMENTED: an operator or feature without an implementation."""


class InvalidGraph(Exception):
    """onnxruntime status INVALID_GRAPH: the graph is malformed."""


class EPFail(Exception):
    """onnxruntime status EP_FAIL: an execution provider failed (carrack has only its CPU engine)."""


class ModelLoadCanceled(Exception):
    """onnxruntime status MODEL_LOAD_CANCELED."""


class ModelRequiresCompilation(Exception):
    """onnxruntime status MODEL_REQUIRES_COMPILATION."""


class NotFound(Exception):
    """onnxruntime status NOT_FOUND."""


class DeviceReset(Exception):
    """onnxruntime status: a device was reset (never raised by carrack)."""


ERROR_CLASSES = (Fail, InvalidArgument, NoSuchFile, NoModel, EngineError, RuntimeException, InvalidProtobuf,
                 ModelLoaded, NotImplemented, InvalidGraph, EPFail, ModelLoadCanceled, ModelRequiresCompilation,
                 NotFound, DeviceReset)

_REEXPORTED = {
    "InferenceSession": "carrack.runtime.session", "SessionOptions": "carrack.runtime.options",
    "RunOptions": "carrack.runtime.options", "GraphOptimizationLevel": "carrack.runtime.options",
    "ExecutionMode": "carrack.runtime.options", "ExecutionOrder": "carrack.runtime.options",
    "NodeArg": "carrack.runtime.session", "ModelMetadata": "carrack.runtime.session",
    "OrtValue": "carrack.runtime.ortvalue", "OrtDevice": "carrack.runtime.ortvalue",
    "SessionIOBinding": "carrack.runtime.iobinding",
    "get_all_providers": "carrack.runtime.environment", "get_available_providers": "carrack.runtime.environment",
    "get_build_info": "carrack.runtime.environment", "get_device": "carrack.runtime.environment",
    "get_version_string": "carrack.runtime.environment",
    "set_default_logger_severity": "carrack.runtime.environment",
    "set_default_logger_verbosity": "carrack.runtime.environment",
}


def __getattr__(name: str) -> Any:
    # the session classes import carrack.errors, which imports this module: resolve them on first use
    if name in _REEXPORTED:
        import importlib

        return getattr(importlib.import_module(_REEXPORTED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
