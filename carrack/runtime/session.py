"""InferenceSession: onnxruntime's Python API over carrack's loader, optimizer and executor."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from carrack.errors import InvalidArgument, MemoryLimitExceeded, NotImplementedOps
from carrack.ir.dims import Sym, binding_name, dim_label
from carrack.ir.graph import Model, ValueInfo
from carrack.ir.types import OptionalType, SequenceType, TensorType
from carrack.native.intra_op import intra_op_threads
from carrack.onnx.exporter import save_model
from carrack.onnx.importer import ModelSource, load_model
from carrack.onnx.tensors import seal_constants
from carrack.passes.memory_plan import MemoryPlan, plan_memory
from carrack.passes.optimizer import optimize, specialize
from carrack.runtime.allocator import retain_freed_memory
from carrack.runtime.feeds import check_feed
from carrack.runtime.options import ExecutionMode, RunOptions, SessionOptions
from carrack.runtime.profiler import Profiler
from carrack.runtime.program import BuildContext, Program


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime describes it."""

    name: str
    type: str
    shape: list[int | str | None] | None

    def __repr__(self) -> str:
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape!r})"


@dataclass(frozen=True)
class ModelMetadata:
    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str]


def _node_arg(v: ValueInfo) -> NodeArg:
    t = v.type
    if isinstance(t, TensorType):
        shape = None if t.shape is None else [dim_label(d) for d in t.shape]
        return NodeArg(v.name, t.ort_name(), shape)
    if t is None:
        return NodeArg(v.name, "tensor(undefined)", None)
    return NodeArg(v.name, t.ort_name(), None)


class InferenceSession:
    """Load a model once, run it many times (from several threads at once if you like).

    ``InferenceSession(path_or_bytes_or_ModelProto, sess_options=None, providers=None)``; ``providers`` is accepted
    for compatibility with onnxruntime and ignored (carrack runs on the CPU).
    """

    def __init__(self, path_or_bytes: ModelSource, sess_options: SessionOptions | None = None,
                 providers: Sequence[Any] | None = None, provider_options: Sequence[Any] | None = None,
                 **kwargs: Any):
        self._options = sess_options or SessionOptions()
        self._concurrency = _inter_op_threads(self._options)
        if self._options.enable_cpu_mem_arena:
            retain_freed_memory()
        self._source_model: Model = load_model(path_or_bytes)
        source = self._source_model.graph
        initialized = set(source.initializers)
        self._inputs = [v for v in source.inputs if v.name not in initialized]
        self._overridable = [v for v in source.inputs if v.name in initialized]
        self._outputs = list(source.outputs)
        self._input_info = {v.name: v for v in source.inputs}
        self._output_index = {v.name: i for i, v in enumerate(source.outputs)}
        self._level = int(self._options.graph_optimization_level)
        # initializers that are also graph inputs are optimized as constants; a run that overrides one uses
        # the unoptimized source graph instead
        frozen = replace(self._source_model, graph=replace(source, inputs=self._inputs))
        self._model, self.optimizer_stats = optimize(frozen, self._level)
        self._program = self._compile(self._model.graph)
        self._override_program: Program | None = None
        if self._options.optimized_model_filepath:
            save_model(self._model, self._options.optimized_model_filepath)
        self._dynamic = self._level > 0 and _has_symbolic_inputs(self._model.graph)
        self._specialized: OrderedDict[tuple, Program] = OrderedDict()
        self._profiler = Profiler(self._options.profile_file_prefix) if self._options.enable_profiling else None
        self._lock = threading.Lock()
        self._plans: dict[tuple[tuple[str, int], ...], MemoryPlan] = {}
        if self._options.memory_limit_bytes:
            self._check_memory(self.memory_plan(), "creating the session")

    # -- onnxruntime API -------------------------------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return [_node_arg(v) for v in self._inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(v) for v in self._outputs]

    def get_overridable_initializers(self) -> list[NodeArg]:
        return [_node_arg(v) for v in self._overridable]

    def get_providers(self) -> list[str]:
        return ["CPUExecutionProvider"]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {"CPUExecutionProvider": {}}

    def get_session_options(self) -> SessionOptions:
        return self._options

    def get_modelmeta(self) -> ModelMetadata:
        m = self._model
        return ModelMetadata(m.producer, m.graph.name, "", m.doc_string, "", 0, dict(m.metadata))

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: RunOptions | None = None) -> list[Any]:
        """Run the model; returns the requested outputs (all, in graph order, when output_names is None)."""
        wanted = self._output_positions(output_names)
        feed = self._bind_inputs(input_feed)
        if self._options.memory_limit_bytes:
            self._check_memory(self.memory_plan(self._dim_bindings(feed)), "this run")
        program = self._program_for(feed)
        inputs = [feed.get(name) for name in program.input_names]
        # intra_op_num_threads: this run's thread count (0: one per core), for this run only (see intra_op_threads)
        with intra_op_threads(self._options.intra_op_num_threads):
            if self._profiler is None:
                results = program.run(inputs, concurrency=self._concurrency)
            else:
                t0 = time.perf_counter_ns()
                results = program.run(inputs, profiler=self._profiler)
                self._profiler.record("model_run", "run", t0, time.perf_counter_ns(), category="Session")
        return [_owned(results[i], feed) for i in wanted]

    def end_profiling(self) -> str:
        """Write the Chrome trace collected since the session started; returns its path ('' when not profiling)."""
        if self._profiler is None:
            return ""
        path = self._profiler.write()
        self._profiler = Profiler(self._options.profile_file_prefix)
        return path

    @property
    def profiler(self) -> Profiler | None:
        return self._profiler

    # -- carrack extensions -----------------------------------------------------------------------------------------
    def memory_plan(self, dims: Mapping[str, int] | None = None) -> MemoryPlan:
        """The static memory plan for inputs whose symbolic dims take the given sizes (computed once per set)."""
        key = tuple(sorted((dims or {}).items()))
        with self._lock:
            plan = self._plans.get(key)
        if plan is None:
            plan = plan_memory(self._model.graph, self._model.opsets, dict(key))
            with self._lock:
                self._plans.setdefault(key, plan)
        return plan

    def _compile(self, graph, bindings: Mapping[str, int] | None = None) -> Program:
        seal_constants(graph)
        ctx = BuildContext(opsets=self._model.opsets, options=self._options)
        program = Program(graph, ctx)
        if ctx.missing:
            raise NotImplementedOps(ctx.missing)
        if self._options.enable_mem_pattern:
            program.use_arena(self._model.opsets, bindings)
        return program

    def _program_for(self, feed: dict[str, Any]) -> Program:
        """The program for this run: specialised to its input shapes (shape arithmetic folded), cached per
        signature; the unoptimized source graph when the run overrides an initializer."""
        if any(v.name in feed for v in self._overridable):
            with self._lock:
                if self._override_program is None:
                    self._override_program = self._compile(self._source_model.graph)
                return self._override_program
        if not self._dynamic:
            return self._program
        signature = tuple(getattr(feed.get(v.name), "shape", None) for v in self._inputs)
        with self._lock:
            program = self._specialized.get(signature)
            if program is not None:
                self._specialized.move_to_end(signature)
                return program
        try:
            bindings = self._dim_bindings(feed)
            program = self._compile(specialize(self._model, bindings, self._level), bindings)
        except Exception:  # noqa: BLE001 - the generic program handles every shape; specialising is an extra
            program = self._program
        with self._lock:
            self._specialized[signature] = program
            while len(self._specialized) > _MAX_SPECIALIZED:
                self._specialized.popitem(last=False)
        return program

    def _check_memory(self, plan: MemoryPlan, what: str) -> None:
        limit = self._options.memory_limit_bytes
        needed = plan.peak_bytes if not plan.unknown else plan.weight_bytes + plan.input_bytes
        if needed > limit:
            raise MemoryLimitExceeded(
                f"{what} needs {needed:,} bytes (weights {plan.weight_bytes:,} + inputs {plan.input_bytes:,} + "
                f"working arena {plan.arena_bytes:,}), more than SessionOptions.memory_limit_bytes = {limit:,}")

    def _dim_bindings(self, feed: dict[str, Any]) -> dict[str, int]:
        """Symbol name -> size from this run's inputs (anonymous and unk__N dims are named 'input:axis')."""
        bindings: dict[str, int] = {}
        for info in self._inputs:
            value = feed.get(info.name)
            if not isinstance(info.type, TensorType) or info.type.shape is None or not isinstance(value, np.ndarray):
                continue
            for axis, (d, size) in enumerate(zip(info.type.shape, value.shape)):
                if not isinstance(d, int):
                    bindings[binding_name(d, info.name, axis)] = int(size)
        return bindings

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _output_positions(self, output_names: Sequence[str] | None) -> list[int]:
        if output_names is None or len(output_names) == 0:
            return list(range(len(self._outputs)))
        if isinstance(output_names, str):
            raise InvalidArgument("output_names must be a list of names, not a string")
        unknown = [n for n in output_names if n not in self._output_index]
        if unknown:
            raise InvalidArgument(f"unknown output name(s) {unknown}; the model's outputs are "
                                  f"{[v.name for v in self._outputs]}")
        return [self._output_index[n] for n in output_names]

    def _bind_inputs(self, feed: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(feed, Mapping):
            raise InvalidArgument(f"input_feed must be a dict of input name -> array, got {type(feed).__name__}")
        unknown = [k for k in feed if k not in self._input_info]
        if unknown:
            raise InvalidArgument(f"unknown input name(s) {unknown}; the model's inputs are "
                                  f"{[v.name for v in self._inputs]}")
        missing = [v.name for v in self._inputs if v.name not in feed and not _may_omit(v)]
        if missing:
            raise InvalidArgument(f"missing input(s) {missing}: every model input needs a value")
        symbols: dict[Sym, tuple[int, str]] = {}
        return {name: check_feed(self._input_info[name], value, symbols) for name, value in feed.items()}


_MAX_SPECIALIZED = 16


def _owned(value: Any, feed: dict[str, Any]) -> Any:
    """An output the caller may keep and modify: never a session constant or a view of the caller's own input."""
    if not isinstance(value, np.ndarray):
        return value
    if not value.flags.writeable or any(isinstance(f, np.ndarray) and np.may_share_memory(value, f)
                                        for f in feed.values()):
        return value.copy()
    return value


def _has_symbolic_inputs(graph) -> bool:
    shapes = [v.type.shape for v in graph.inputs if isinstance(v.type, TensorType) and v.name not in graph.initializers]
    return any(s is None or any(not isinstance(d, int) for d in s) for s in shapes)


def _may_omit(v: ValueInfo) -> bool:
    return isinstance(v.type, OptionalType)


__all__ = ["InferenceSession", "ModelMetadata", "NodeArg", "SequenceType", "np"]


def _inter_op_threads(options: SessionOptions) -> int:
    """How many nodes a run may compute at once: 1 unless execution_mode is ORT_PARALLEL, then
    inter_op_num_threads (0: one per core), as onnxruntime's parallel executor."""
    if options.execution_mode != ExecutionMode.ORT_PARALLEL:
        return 1
    return options.inter_op_num_threads or os.cpu_count() or 1
