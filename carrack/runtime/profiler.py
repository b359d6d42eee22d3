"""Per-node timing: a terminal table by op type and node, and a Chrome trace (chrome://tracing, Perfetto)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Event:
    name: str
    op_type: str
    start_ns: int
    duration_ns: int
    thread: int
    category: str = "Node"
    #: onnxruntime's per-node args (op_name, input_type_shape, output_type_shape, sizes, provider)
    args: dict[str, Any] = field(default_factory=dict)


class Profiler:
    """Collects events from any number of concurrent runs."""

    def __init__(self, prefix: str = "carrack_profile"):
        self.prefix = prefix
        self.origin_ns = time.perf_counter_ns()
        self.start_time_ns = time.time_ns()  # the same instant on the wall clock (get_profiling_start_time_ns)
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def record(self, name: str, op_type: str, start_ns: int, end_ns: int, category: str = "Node",
               io: tuple[list[Any], Any, list[bool]] | None = None) -> None:
        """One event; `io` = (the node's inputs, its result, which inputs are initializers) adds onnxruntime's
        args describing them."""
        args = node_args(op_type, *io) if io is not None else {}
        event = Event(name, op_type, start_ns - self.origin_ns, end_ns - start_ns, threading.get_ident(), category,
                      args)
        with self._lock:
            self._events.append(event)

    @property
    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def chrome_trace(self) -> list[dict]:
        """Complete events ('ph': 'X') in microseconds, as onnxruntime's profiler writes them: node events are
        named '<node>_kernel_time' and carry onnxruntime's args; session events ('model_run') have none."""
        pid = os.getpid()
        return [{"cat": e.category, "pid": pid, "tid": e.thread % 2**31, "dur": e.duration_ns // 1000,
                 "ts": e.start_ns // 1000, "ph": "X",
                 "name": f"{e.name}_kernel_time" if e.category == "Node" else e.name,
                 "args": (e.args or {"op_name": e.op_type}) if e.category == "Node" else {}}
                for e in self.events]

    def write(self, path: str | None = None) -> str:
        path = path or f"{self.prefix}_{time.strftime('%Y-%m-%d_%H-%M-%S')}.json"
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path

    def table(self, top: int = 15) -> str:
        """Time by op type, then the slowest nodes."""
        nodes = [e for e in self.events if e.category == "Node"]
        total = sum(e.duration_ns for e in nodes) or 1
        by_op: dict[str, list[int]] = defaultdict(list)
        by_node: dict[tuple[str, str], list[int]] = defaultdict(list)
        for e in nodes:
            by_op[e.op_type].append(e.duration_ns)
            by_node[(e.name, e.op_type)].append(e.duration_ns)
        runs = max((len(v) for v in by_node.values()), default=1)
        lines = [f"{'op type':28s} {'calls':>7s} {'total ms':>10s} {'ms/run':>9s} {'share':>7s}"]
        for op, ds in sorted(by_op.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"{op:28s} {len(ds):7d} {sum(ds) / 1e6:10.2f} {sum(ds) / 1e6 / runs:9.3f} "
                         f"{100 * sum(ds) / total:6.1f}%")
        lines.append("")
        lines.append(f"{'slowest nodes':48s} {'op type':20s} {'ms/run':>9s}")
        for (name, op), ds in sorted(by_node.items(), key=lambda kv: -sum(kv[1]))[:top]:
            lines.append(f"{name[:48]:48s} {op[:20]:20s} {sum(ds) / 1e6 / len(ds):9.3f}")
        return "\n".join(lines)


def node_args(op_type: str, inputs: list[Any], result: Any, constant: list[bool]) -> dict[str, Any]:
    """onnxruntime's args of a node event: op name, input and output types and shapes, and byte counts of the
    outputs, the non-initializer inputs (activation_size) and the initializer inputs (parameter_size)."""
    outputs = list(result) if type(result) is tuple else [result]
    activation = sum(_nbytes(v) for v, c in zip(inputs, constant) if not c)
    parameters = sum(_nbytes(v) for v, c in zip(inputs, constant) if c)
    return {"op_name": op_type, "provider": "CPUExecutionProvider",
            "input_type_shape": [_type_shape(v) for v in inputs if v is not None],
            "output_type_shape": [_type_shape(v) for v in outputs if v is not None],
            "output_size": str(sum(_nbytes(v) for v in outputs)), "activation_size": str(activation),
            "parameter_size": str(parameters)}


def _type_shape(value: Any) -> dict[str, list[int]]:
    if isinstance(value, (np.ndarray, np.generic)):
        from carrack.ir.dtypes import to_onnx, type_name

        try:
            name = type_name(to_onnx(value.dtype))
        except ValueError:
            name = "string" if value.dtype == object else str(value.dtype)
        return {name: [int(d) for d in np.shape(value)]}
    return {type(value).__name__: []}


def _nbytes(value: Any) -> int:
    return int(value.nbytes) if isinstance(value, (np.ndarray, np.generic)) else 0
