"""SessionOptions and RunOptions, named and shaped like onnxruntime's."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any


class GraphOptimizationLevel(enum.IntEnum):
    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(enum.IntEnum):
    """Accepted for compatibility; carrack orders nodes topologically whatever the setting."""

    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


class _StrictAttributes:
    """Setting an attribute the class does not define raises AttributeError, as on onnxruntime's pybind objects
    (a misspelt option such as ``so.intra_op_threads = 1`` must not be silently ignored)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name not in {f.name for f in fields(self)}:  # type: ignore[arg-type]
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        object.__setattr__(self, name, value)


def _config_value(owner: str, key: Any, value: Any) -> tuple[str, str]:
    if not isinstance(key, str) or not isinstance(value, str):
        raise TypeError(f"{owner} config entries are (str, str); got ({type(key).__name__}, {type(value).__name__})")
    return key, value


@dataclass
class SessionOptions(_StrictAttributes):
    graph_optimization_level: GraphOptimizationLevel = GraphOptimizationLevel.ORT_ENABLE_ALL
    intra_op_num_threads: int = 0
    inter_op_num_threads: int = 0
    execution_mode: ExecutionMode = ExecutionMode.ORT_SEQUENTIAL
    enable_profiling: bool = False
    profile_file_prefix: str = "carrack_profile"
    optimized_model_filepath: str = ""
    log_severity_level: int = 2
    log_verbosity_level: int = 0
    logid: str = ""
    enable_mem_pattern: bool = True
    enable_cpu_mem_arena: bool = True
    enable_mem_reuse: bool = True
    use_deterministic_compute: bool = False
    execution_order: ExecutionOrder = ExecutionOrder.DEFAULT
    use_per_session_threads: bool = True
    #: carrack: refuse a session or run whose planned memory exceeds this many bytes (0: no limit).
    memory_limit_bytes: int = 0

    def __post_init__(self) -> None:
        self._configs: dict[str, str] = {}
        self._free_dims: dict[str, int] = {}
        self._free_dims_by_denotation: dict[str, int] = {}
        self._initializers: dict[str, Any] = {}

    def add_session_config_entry(self, key: str, value: str) -> None:
        key, value = _config_value("SessionOptions", key, value)
        self._configs[key] = value

    def get_session_config_entry(self, key: str) -> str:
        if key not in self._configs:
            raise RuntimeError(f"SessionOptions does not have configuration with key: {key}")
        return self._configs[key]

    def add_free_dimension_override_by_name(self, name: str, value: int) -> None:
        """Fix the symbolic input dim `name` to `value`: inputs report it, and feeds of another size are refused."""
        self._free_dims[name] = _dim_size(name, value)

    def add_free_dimension_override_by_denotation(self, denotation: str, value: int) -> None:
        """Fix every input dim whose denotation (e.g. DATA_BATCH) is `denotation` to `value`."""
        self._free_dims_by_denotation[denotation] = _dim_size(denotation, value)

    def add_initializer(self, name: str, value: Any) -> None:
        """Give the graph input or initializer `name` this value (an OrtValue) as a constant of the session."""
        from carrack.runtime.ortvalue import OrtValue

        if not isinstance(value, OrtValue):
            raise TypeError(f"add_initializer('{name}', ...) expects an OrtValue, got {type(value).__name__}")
        self._initializers[name] = value

    def add_external_initializers(self, names: list[str], values: list[Any]) -> None:
        if len(names) != len(values):
            raise ValueError(f"add_external_initializers got {len(names)} names and {len(values)} values")
        for name, value in zip(names, values):
            self.add_initializer(name, value)

    def register_custom_ops_library(self, library_path: str) -> None:
        from carrack.errors import UnsupportedFeature

        raise UnsupportedFeature(f"register_custom_ops_library('{library_path}'): carrack cannot load onnxruntime "
                                 "custom-op libraries (its kernels are Python/numpy and its own C code)")


def _dim_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"free dimension override '{name}' must be a non-negative int, got {value!r}")
    return value


@dataclass
class RunOptions(_StrictAttributes):
    log_severity_level: int = 2
    log_verbosity_level: int = 0
    logid: str = ""
    #: set (before or during a run, from any thread) to stop the run between two nodes with RunTerminated
    terminate: bool = False
    only_execute_path_to_fetches: bool = False

    def __post_init__(self) -> None:
        self._configs: dict[str, str] = {}

    def add_run_config_entry(self, key: str, value: str) -> None:
        key, value = _config_value("RunOptions", key, value)
        self._configs[key] = value

    def get_run_config_entry(self, key: str) -> str:
        if key not in self._configs:
            raise RuntimeError(f"RunOptions does not have configuration with key: {key}")
        return self._configs[key]
