"""SessionOptions and RunOptions, named and shaped like onnxruntime's."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GraphOptimizationLevel(enum.IntEnum):
    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


@dataclass
class SessionOptions:
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
    #: carrack: refuse a session or run whose planned memory exceeds this many bytes (0: no limit).
    memory_limit_bytes: int = 0

    def __post_init__(self) -> None:
        self._configs: dict[str, str] = {}
        self._free_dims: dict[str, int] = {}

    def add_session_config_entry(self, key: str, value: str) -> None:
        self._configs[key] = str(value)

    def get_session_config_entry(self, key: str) -> str:
        return self._configs[key]

    def add_free_dimension_override_by_name(self, name: str, value: int) -> None:
        self._free_dims[name] = int(value)


@dataclass
class RunOptions:
    log_severity_level: int = 2
    log_verbosity_level: int = 0
    logid: str = ""
    terminate: bool = False
