"""InferenceSession: onnxruntime's Python API over carrack's loader, optimizer and executor."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from carrack.errors import InvalidArgument, MemoryLimitExceeded, NotImplementedOps
from carrack.ir.dims import Sym, binding_name, dim_label, is_placeholder
from carrack.ir.dtypes import to_numpy
from carrack.ir.graph import Graph, Model, ValueInfo
from carrack.ir.types import OptionalType, SequenceType, TensorType
from carrack.native.intra_op import intra_op_threads
from carrack.onnx.exporter import save_model
from carrack.onnx.importer import ModelSource, load_model
from carrack.onnx.tensors import EXTERNAL_DATA_ROOT_KEY, seal_constants
from carrack.passes.blocked_layout import enabled_by, session_blocked_layout
from carrack.passes.fusions import session_block_fusion
from carrack.passes.memory_plan import MemoryPlan, plan_memory
from carrack.passes.optimizer import optimize
from carrack.plan import Plan, build_plan, prepare_kernels, select
from carrack.runtime.allocator import retain_freed_memory, with_memory_limit
from carrack.runtime.feeds import check_feed
from carrack.runtime.options import ExecutionMode, RunOptions, SessionOptions
from carrack.runtime.ort_session import OrtSessionApi, apply_session_options, terminate_check
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


class InferenceSession(OrtSessionApi):
    """Load a model once, run it many times (from several threads at once if you like).

    ``InferenceSession(path_or_bytes_or_ModelProto, sess_options=None, providers=None)``; ``providers`` is accepted
    for compatibility with onnxruntime and ignored (carrack runs on the CPU).
    """

    def __init__(self, path_or_bytes: ModelSource, sess_options: SessionOptions | None = None,
                 providers: Sequence[Any] | None = None, provider_options: Sequence[Any] | None = None,
                 **kwargs: Any):
        options = sess_options or SessionOptions()
        self._record_source(path_or_bytes, providers, provider_options)
        source_model = apply_session_options(load_model(path_or_bytes, external_data_root(options)), options)
        source = source_model.graph
        initialized = set(source.initializers)
        # initializers that are also graph inputs are optimized as constants; a run that overrides one uses
        # the unoptimized source graph instead
        frozen = replace(source_model, graph=replace(source, inputs=[v for v in source.inputs
                                                                     if v.name not in initialized]))
        level = int(options.graph_optimization_level)
        if options.optimized_model_filepath:
            save_model(optimize(frozen, level)[0], options.optimized_model_filepath)
        overridable = any(v.name in initialized for v in source.inputs)
        # the graph's nodes are consumed by the plan unless runs may override its initializers (then they run the
        # source graph); its inputs and outputs, which the session reports, are lists the plan does not touch
        numpy_only = select.force_numpy(options)
        # a session's plan runs MobileNetV2's blocks as one node (invres.c) and, where enabled, chains of
        # convolutions on channel-blocked tensors (blockconv.c)
        with session_block_fusion(not numpy_only), session_blocked_layout(enabled_by(options)):
            plan = build_plan(frozen, level, arena=options.enable_mem_pattern, in_place=not overridable,
                              numpy_only=numpy_only)
        self._start(plan, options, source_model if overridable else None, source)

    def _start(self, plan: Plan, options: SessionOptions, source_model: Model | None, source: Graph) -> None:
        """Everything after the plan: what a session unpickled in another process does too."""
        self._options = options
        self._plan = plan
        self._source_model = source_model
        self._concurrency = _inter_op_threads(options)
        if options.enable_cpu_mem_arena:
            retain_freed_memory()
        initialized = set(source.initializers)
        self._inputs = [v for v in source.inputs if v.name not in initialized]
        self._overridable = [v for v in source.inputs if v.name in initialized]
        self._outputs = list(source.outputs)
        self._input_info = {v.name: v for v in source.inputs}
        self._output_index = {v.name: i for i, v in enumerate(source.outputs)}
        self._level = int(options.graph_optimization_level)
        self._model = plan.model
        self.optimizer_stats = plan.optimizer_stats
        self._program = self._compile(plan.graph, plan.implementations)
        prepare_kernels(plan, (step.kernel for step in self._program.steps))
        if not plan.symbols:  # static sizes: a value or arena too large for this machine is refused at load
            plan.bind(())
        self._program.memoize_size_only([d.name for d in plan.derived])
        if options.enable_mem_pattern:
            self._program.attach(plan)
        self._symbol_axes = _symbol_axes(self._inputs, plan.symbols)
        self._plain_feeds = _plain_feed_checks(self._inputs)
        self._all_outputs = list(range(len(self._outputs)))
        self._override_program: Program | None = None
        self._profiler = Profiler(options.profile_file_prefix) if options.enable_profiling else None
        self._lock = threading.Lock()
        self._plans: dict[tuple[tuple[str, int], ...], MemoryPlan] = {}
        if options.memory_limit_bytes:
            self._check_memory(self.memory_plan(), "creating the session")
        from carrack.backends.c.executor import compiled_executor  # a SessionOptions entry asks for it

        self._compiled = compiled_executor(plan, options)

    def __reduce__(self):
        """Pickles as its plan (optimized graph, constants, expressions) and options: unpickling builds the
        executor from the plan without optimizing again. The source model travels too only when the model has
        initializers a run may override."""
        return _restore_session, (self._plan, self._options, self._source_model, _interface(self))

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
        return ModelMetadata(m.producer, m.graph.name, m.domain, m.doc_string, m.graph_doc_string, m.model_version,
                             dict(m.metadata))

    @with_memory_limit(lambda session: session._options.memory_limit_bytes)  # for the allocation checks
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: RunOptions | None = None) -> list[Any]:
        """Run the model; returns the requested outputs (all, in graph order, when output_names is None)."""
        wanted = self._all_outputs if output_names is None else self._output_positions(output_names)
        should_stop = terminate_check(run_options)
        feed = self._bind_plain(input_feed)
        if feed is None:
            feed = self._bind_inputs(input_feed)
        if self._options.memory_limit_bytes:
            self._check_memory(self.memory_plan(self._dim_bindings(feed)), "this run")
        if self._compiled is not None and self._profiler is None and self._compiled.fits(feed):
            results = self._compiled.run(feed)
            return [results[i] for i in wanted]
        if self._overridable and any(v.name in feed for v in self._overridable):
            program, bound = self._override(), None
            inputs = [feed.get(name) for name in program.input_names]
        else:
            program = self._program
            bound = self._plan.bind(self._sizes(feed))
            inputs = [feed.get(v.name) for v in self._inputs] + bound.derived
        # intra_op_num_threads: this run's thread count (0: one per core), for this run only (see intra_op_threads)
        with intra_op_threads(self._options.intra_op_num_threads):
            if self._profiler is None:
                results = program.run(inputs, concurrency=self._concurrency, bound=bound, should_stop=should_stop)
            else:
                t0 = time.perf_counter_ns()
                results = program.run(inputs, profiler=self._profiler, should_stop=should_stop)
                self._profiler.record("model_run", "run", t0, time.perf_counter_ns(), category="Session")
        return _owned_outputs(results, wanted, feed)

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
            graph = self._plan.graph
            chosen = self._plan.implementations
            plan = plan_memory(graph, self._model.opsets, dict(key), facts=self._plan.facts(dict(key)),
                               numpy_nodes=lambda node: chosen.get(select.node_key(node)) == "numpy")
            with self._lock:
                self._plans.setdefault(key, plan)
        return plan

    def implementations(self) -> dict[str, str]:
        """{node: implementation} for every node of the optimized graph whose operator has more than one
        ("native" or "numpy"), as the plan chose them (carrack.plan.select); nodes are named by their name, else
        their first output."""
        names = {select.node_key(node): node.name or select.node_key(node) for node in self._plan.graph.nodes}
        return {names.get(key, key): chosen for key, chosen in self._plan.implementations.items()}

    def _compile(self, graph, implementations: Mapping[str, str] | None = None) -> Program:
        seal_constants(graph)
        ctx = BuildContext(opsets=self._model.opsets, options=self._options, implementations=implementations or {})
        program = Program(graph, ctx)
        if ctx.missing:
            raise NotImplementedOps(ctx.missing)
        return program

    def _override(self) -> Program:
        """The unoptimized source graph's program, for runs that override an initializer."""
        with self._lock:
            if self._override_program is None:
                self._override_program = self._compile(self._source_model.graph)
            return self._override_program

    def _sizes(self, feed: dict[str, Any]) -> tuple[int, ...]:
        """This run's symbol sizes, in the plan's order."""
        sizes = []
        for name, axis in self._symbol_axes:
            value = feed.get(name)
            sizes.append(value.shape[axis] if isinstance(value, np.ndarray) else 1)
        return tuple(sizes)

    def _check_memory(self, plan: MemoryPlan, what: str) -> None:
        limit = self._options.memory_limit_bytes
        known = plan.weight_bytes + plan.prepared_bytes + plan.input_bytes
        needed = plan.peak_bytes if not plan.unknown else known
        if needed > limit:
            raise MemoryLimitExceeded(
                f"{what} needs {needed:,} bytes (weights {plan.weight_bytes:,} + their prepared copies "
                f"{plan.prepared_bytes:,} + inputs {plan.input_bytes:,} + "
                f"working arena {plan.arena_bytes:,}), more than SessionOptions.memory_limit_bytes = {limit:,}")

    def _dim_bindings(self, feed: dict[str, Any]) -> dict[str, int]:
        """Symbol name -> size from this run's inputs (anonymous and unk__N dims are named 'input:axis')."""
        return {symbol: int(feed[name].shape[axis]) for symbol, (name, axis) in zip(self._plan.symbols,
                                                                                    self._symbol_axes)
                if isinstance(feed.get(name), np.ndarray)}

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

    def _bind_plain(self, feed: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The feed as it is when every value is what `_bind_inputs` would pass through unchanged (a native-order,
        C-contiguous, aligned ndarray of the input's dtype, rank and fixed dims, symbols consistent): the checks
        of the common case in one loop. None when anything differs: `_bind_inputs` then copies, converts or
        explains."""
        checks = self._plain_feeds
        if checks is None or type(feed) is not dict or len(feed) != len(checks):
            return None
        seen: dict[Sym, int] = {}
        for name, dtype, rank, fixed, symbolic in checks:
            value = feed.get(name)
            if type(value) is not np.ndarray or (value.dtype is not dtype and value.dtype != dtype) \
                    or value.ndim != rank:
                return None
            flags = value.flags
            if not (flags.c_contiguous and flags.aligned):
                return None
            shape = value.shape
            for axis, size in fixed:
                if shape[axis] != size:
                    return None
            for axis, sym in symbolic:
                if seen.setdefault(sym, shape[axis]) != shape[axis]:
                    return None
        return feed

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


def _owned_outputs(results: list[Any], wanted: Sequence[int], feed: Mapping[str, Any]) -> list[Any]:
    """`_owned` of each wanted result; the common case (a fresh array of the run, not a feed) with the feeds'
    identities gathered once."""
    fed = None
    owned = []
    for i in wanted:
        value = results[i]
        if type(value) is np.ndarray and value.base is None and value.flags.writeable:
            if fed is None:
                fed = {id(f) for f in feed.values()}
            if id(value) not in fed:
                owned.append(value)
                continue
        owned.append(_owned(value, feed))
    return owned


def _owned(value: Any, feed: Mapping[str, Any]) -> Any:
    """An output the caller may keep and modify: never a session constant or a view of the caller's own input."""
    if not isinstance(value, np.ndarray):
        return value
    if value.base is None and value.flags.writeable:
        for f in feed.values():
            if value is f:
                break
        else:
            return value  # owns its bytes, which no feed can be a view of (feeds existed before the run made it)
    if not value.flags.writeable or any(isinstance(f, np.ndarray) and np.may_share_memory(value, f)
                                        for f in feed.values()):
        return value.copy()
    return value


def _symbol_axes(inputs: list[ValueInfo], symbols: Sequence[str]) -> list[tuple[str, int]]:
    """For each plan symbol, an input and axis whose size it is."""
    where: dict[str, tuple[str, int]] = {}
    for v in inputs:
        if isinstance(v.type, TensorType) and v.type.shape is not None:
            for axis, d in enumerate(v.type.shape):
                if not isinstance(d, int):
                    where.setdefault(binding_name(d, v.name, axis), (v.name, axis))
    return [where[s] for s in symbols]


def _plain_feed_checks(inputs: list[ValueInfo]) -> list[tuple] | None:
    """Per input: (name, numpy dtype, rank, (axis, size) of fixed dims, (axis, symbol) of named dims), for
    `InferenceSession._bind_plain`; None when an input is not a tensor of known type and rank (sequences, maps,
    optionals: always checked in full)."""
    checks = []
    for v in inputs:
        t = v.type
        if type(t) is not TensorType or not t.elem_type or t.shape is None:
            return None
        try:
            dtype = np.dtype(to_numpy(t.elem_type))
        except (TypeError, ValueError, KeyError):
            return None
        if dtype.kind in "OUS":
            return None
        fixed = tuple((axis, d) for axis, d in enumerate(t.shape) if isinstance(d, int))
        named = tuple((axis, d) for axis, d in enumerate(t.shape) if isinstance(d, Sym) and not is_placeholder(d))
        checks.append((v.name, dtype, len(t.shape), fixed, named))
    return checks


def _interface(session: InferenceSession) -> Graph:
    """The source graph's inputs and outputs (what the session reports), without its nodes or weights."""
    return Graph(inputs=list(session._inputs), outputs=list(session._outputs))


def _restore_session(plan: Plan, options: SessionOptions, source_model: Model | None,
                     interface: Graph) -> InferenceSession:
    session = InferenceSession.__new__(InferenceSession)
    session._record_source(None, None, None)  # the model file stays where it was: not a path of this process
    source = source_model.graph if source_model is not None else interface
    session._start(plan, options, source_model, source)
    return session


def _may_omit(v: ValueInfo) -> bool:
    return isinstance(v.type, OptionalType)


__all__ = ["InferenceSession", "ModelMetadata", "NodeArg", "SequenceType", "np"]


def _inter_op_threads(options: SessionOptions) -> int:
    """How many nodes a run may compute at once: 1 unless execution_mode is ORT_PARALLEL, then
    inter_op_num_threads (0: one per core), as onnxruntime's parallel executor."""
    if options.execution_mode != ExecutionMode.ORT_PARALLEL:
        return 1
    return options.inter_op_num_threads or os.cpu_count() or 1


def external_data_root(options: SessionOptions) -> str | None:
    """The folder external data may also resolve into: the SessionOptions config entry
    "session.external_data_root" (carrack's own; onnxruntime has none)."""
    return options._configs.get(EXTERNAL_DATA_ROOT_KEY) or None
