"""Per-node timing: a terminal table by op type and node, and a Chrome trace (chrome://tracing, Perfetto)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    name: str
    op_type: str
    start_ns: int
    duration_ns: int
    thread: int
    category: str = "Node"


class Profiler:
    """Collects events from any number of concurrent runs."""

    def __init__(self, prefix: str = "carrack_profile"):
        self.prefix = prefix
        self.origin_ns = time.perf_counter_ns()
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def record(self, name: str, op_type: str, start_ns: int, end_ns: int, category: str = "Node") -> None:
        event = Event(name, op_type, start_ns - self.origin_ns, end_ns - start_ns, threading.get_ident(), category)
        with self._lock:
            self._events.append(event)

    @property
    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def chrome_trace(self) -> list[dict]:
        """Complete events ('ph': 'X') in microseconds, as onnxruntime's profiler writes them."""
        pid = os.getpid()
        return [{"cat": e.category, "pid": pid, "tid": e.thread % 2**31, "dur": e.duration_ns // 1000,
                 "ts": e.start_ns // 1000, "ph": "X", "name": e.name, "args": {"op_name": e.op_type}}
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
