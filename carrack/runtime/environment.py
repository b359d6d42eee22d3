"""onnxruntime's module-level functions: providers, build info, logger settings."""

from __future__ import annotations

import logging
import platform

import numpy as np

#: every provider name onnxruntime knows; carrack accepts these names and runs all of them on its CPU engine only
#: when the name is CPUExecutionProvider (the others are refused as unavailable)
ALL_PROVIDERS = (
    "TensorrtExecutionProvider", "CUDAExecutionProvider", "MIGraphXExecutionProvider",
    "NV_TensorRT_RTX_ExecutionProvider", "OpenVINOExecutionProvider", "DnnlExecutionProvider",
    "VitisAIExecutionProvider", "QNNExecutionProvider",
    "NnapiExecutionProvider", "VSINPUExecutionProvider", "JsExecutionProvider", "CoreMLExecutionProvider",
    "ArmNNExecutionProvider", "ACLExecutionProvider", "DmlExecutionProvider", "RknpuExecutionProvider",
    "WebNNExecutionProvider", "WebGpuExecutionProvider", "XnnpackExecutionProvider", "CANNExecutionProvider",
    "AzureExecutionProvider", "CPUExecutionProvider",
)
AVAILABLE_PROVIDERS = ("CPUExecutionProvider",)

_LOG = logging.getLogger("carrack")
# onnxruntime's severities 0..4 (verbose, info, warning, error, fatal) as Python logging levels
_SEVERITY_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}


def get_all_providers() -> list[str]:
    return list(ALL_PROVIDERS)


def get_available_providers() -> list[str]:
    return list(AVAILABLE_PROVIDERS)


def get_device() -> str:
    return "CPU"


def get_version_string() -> str:
    from carrack import __version__

    return __version__


def get_build_info() -> str:
    from carrack import __version__

    return (f"carrack {__version__} (numpy {np.__version__}, Python {platform.python_version()}, "
            f"{platform.machine()}): CPU engine, native kernels compiled at first use")


def set_default_logger_severity(severity: int) -> None:
    """Severity 0 (verbose) to 4 (fatal), as onnxruntime; sets the level of the 'carrack' logger."""
    if severity not in _SEVERITY_LEVELS:
        raise ValueError(f"logger severity must be 0 (verbose) to 4 (fatal), got {severity!r}")
    _LOG.setLevel(_SEVERITY_LEVELS[severity])


def set_default_logger_verbosity(verbosity: int) -> None:
    """Accepted for compatibility: carrack's logging has no verbosity levels below VERBOSE."""
    if not isinstance(verbosity, int) or verbosity < 0:
        raise ValueError(f"logger verbosity must be a non-negative int, got {verbosity!r}")



def has_collective_ops() -> bool:
    """carrack has no collective (multi-device communication) operators."""
    return False


def enable_telemetry_events() -> None:
    """Accepted for compatibility: carrack sends no telemetry."""


def disable_telemetry_events() -> None:
    """Accepted for compatibility: carrack sends no telemetry."""
