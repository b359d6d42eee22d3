"""A graph compiled for execution: kernels bound to integer value slots, with liveness-based release.

A `Program` is immutable once built; each `run` works in its own slot list, so one program may run in several
threads at once. Subgraphs (If/Loop/Scan bodies) are Programs too; the values they read from enclosing scopes
are their *captures*, passed in by name.
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from carrack.errors import CarrackError, InvalidModel, RunFailure, RunTerminated
from carrack.ir.graph import Graph, Node
from carrack.ir.order import topological_order
from carrack.onnx.tensors import aligned_empty
from carrack.ops import registry
from carrack.runtime.allocator import CHECK_THRESHOLD, MEMORY_LIMIT, check_allocation

if TYPE_CHECKING:
    from carrack.plan.plan import Bound, Plan


@dataclass
class BuildContext:
    """What kernels may use while being built; collects every unsupported op before failing once."""

    opsets: dict[str, int]
    options: Any = None
    missing: list[tuple[str, str, int, str]] = field(default_factory=list)
    scope: frozenset[str] = frozenset()  # names visible to the node being built (for its subgraphs)
    graph: Graph | None = None  # the graph whose node is being built (operators such as Gradient read it)
    #: the plan's implementation per node key (carrack.plan.select); nodes it does not name are chosen on build
    implementations: Mapping[str, str] = field(default_factory=dict)

    def implementation_of(self, node: Node) -> str:
        from carrack.plan import select

        chosen = self.implementations.get(select.node_key(node))
        if chosen is None and len(select.candidates(node.domain, node.op_type)) == 1:
            return select.NUMPY
        if chosen is None:
            constants = self.graph.initializers if self.graph is not None else None
            chosen = select.choose(node, constants=constants, numpy_only=select.force_numpy(self.options))
        return chosen

    def opset_of(self, node: Node) -> int:
        if node.opset is not None:
            return node.opset
        return self.opsets.get(node.domain) or registry.default_opset(node.domain)

    def compile(self, graph: Graph) -> Program:
        """Compile a subgraph of the node being built; it may read any name visible to that node."""
        return Program(graph, self, self.scope)


@dataclass(frozen=True)
class Step:
    kernel: registry.Kernel
    node: Node
    ins: tuple[int, ...]  # -1: omitted optional input
    outs: tuple[int, ...]  # -1: output not used
    captures: tuple[tuple[str, int], ...]
    release: tuple[int, ...]  # slots whose value dies after this step


class Program:
    def __init__(self, graph: Graph, ctx: BuildContext, outer: frozenset[str] = frozenset()):
        self.graph = graph
        self.slot_of: dict[str, int] = {}
        self.input_names = [v.name for v in graph.inputs]
        self.input_slots = [self._slot(n) for n in self.input_names]
        self.constants = {self._slot(k): v for k, v in graph.initializers.items()}
        free = sorted(graph.free_names())
        unknown = [n for n in free if n not in outer]
        if unknown:
            what = f"graph '{graph.name}'" if graph.name else "the graph"
            raise InvalidModel(f"{what} reads values that nothing defines: {', '.join(map(repr, unknown[:10]))}")
        self.capture_slots = [(n, self._slot(n)) for n in free]
        nodes = _expand_function_ops(topological_order(graph), ctx)
        visible = frozenset(outer | graph.defined_names() | {o for n in nodes for o in n.outputs})
        self.steps = self._build_steps(nodes, ctx, visible)
        for st in self.steps:
            st.kernel.prepare([self.constants.get(s) if s >= 0 else None for s in st.ins])
        self.output_slots = [self.slot_of[o.name] if o.name in self.slot_of else self._slot(o.name)
                             for o in graph.outputs]
        self.n_slots = len(self.slot_of)
        self._assign_release()
        self._dependencies = None
        self._placed: dict[int, int] = {}  # step -> index of its output among the plan's placed values
        self._views: set[str] = set()
        self._plan = self._compile_plan()
        self._memo_steps: tuple[int, ...] = ()  # steps whose results depend only on the symbol sizes
        self._derived_slots: tuple[int, ...] = ()  # inputs that are the plan's shape arithmetic (fixed per sizes)
        self._memo_slots: tuple[int, ...] = ()  # their values read by the other steps (kept per Bound)
        self._plan_after_memo: list[tuple] = self._plan
        #: (bound, arena, views, bound steps, staged inputs, its _Resizable) of a finished run, for the next one
        self._spare_arenas: list[tuple] = []
        self._layout_plan: Plan | None = None  # the plan that lays arenas out for capacity sizes (attach)
        #: derived input slot -> the symbols it reads (Plan.symbols_read), made when a run first needs it
        self._symbols_of_slot: dict[int, frozenset[int]] | None = None
        self._slot_of_placed: list[int] = []  # placed value -> the slot of the step output written into it
        self._constant_ids = frozenset(id(v) for v in self.constants.values())
        self._env_start: list[Any] = [None] * (self.n_slots + 1)  # the extra last slot: omitted optional inputs
        for s, v in self.constants.items():
            self._env_start[s] = v
        #: whether runs that reuse an arena call its bound steps (Kernel.bind_into); False: every step's run_into
        self.bind_steps = True
        self._memo_lock = threading.Lock()
        self._memo_total = 0  # bytes of size-only values kept in live Bounds

    def _slot(self, name: str) -> int:
        if name not in self.slot_of:
            self.slot_of[name] = len(self.slot_of)
        return self.slot_of[name]

    def _build_steps(self, nodes: list[Node], ctx: BuildContext, visible: frozenset[str]) -> list[Step]:
        steps = []
        for node in nodes:
            opset = ctx.opset_of(node)
            cls, version = registry.resolve(node.domain, node.op_type, opset)
            if cls is None:
                ctx.missing.append((node.op_type, node.domain, version, node.name or f"output {node.outputs[:1]}"))
                continue
            ins = tuple(self._slot(i) if i else -1 for i in node.inputs)
            outer_scope, ctx.scope = ctx.scope, visible
            outer_graph, ctx.graph = ctx.graph, self.graph
            try:
                kernel = cls(node, version, ctx)
            except CarrackError:
                raise
            except Exception as e:  # noqa: BLE001 - a kernel rejecting its attributes
                raise InvalidModel(f"{node.label()}: {type(e).__name__}: {e}") from e
            finally:
                ctx.scope, ctx.graph = outer_scope, outer_graph
            captures = tuple((n, self._slot(n)) for g in node.subgraphs() for n in sorted(g.free_names()))
            outs = tuple(self._slot(o) if o else -1 for o in node.outputs)
            steps.append(Step(kernel, node, ins, outs, captures, ()))
        return steps

    def _assign_release(self) -> None:
        keep = set(self.output_slots) | set(self.constants)
        last_use: dict[int, int] = {}
        for i, st in enumerate(self.steps):
            for s in st.ins + tuple(s for _, s in st.captures) + st.outs:
                if s >= 0:
                    last_use[s] = i
        release: dict[int, list[int]] = {}
        for s, i in last_use.items():
            if s not in keep:
                release.setdefault(i, []).append(s)
        self.steps = [Step(st.kernel, st.node, st.ins, st.outs, st.captures, tuple(release.get(i, ())))
                      for i, st in enumerate(self.steps)]

    def dependencies(self):
        """Which steps wait on which (for running independent steps concurrently), computed once."""
        if self._dependencies is None:
            from carrack.runtime.concurrent import Dependencies

            self._dependencies = Dependencies(self)
        return self._dependencies

    def run(self, inputs: Sequence[Any], outer: Mapping[str, Any] | None = None, profiler: Any = None,
            concurrency: int = 1, bound: Bound | None = None, should_stop: Any = None) -> list[Any]:
        """Run on `inputs` (in input_names order); `concurrency` > 1 runs independent steps on that many threads;
        `bound` (the session's plan evaluated for this run's sizes) places intermediates in one arena.
        `should_stop` (optional callable) is asked before each step; when it returns true the run raises
        RunTerminated (RunOptions.terminate)."""
        env: list[Any] = self._env_start.copy()  # the constants in their slots; the extra last slot stays None
        for s, v in zip(self.input_slots, inputs):
            if v is not None or env[s] is None:
                env[s] = v
        for name, s in self.capture_slots:
            env[s] = outer[name]  # type: ignore[index]
        if concurrency > 1 and profiler is None and len(self.steps) > 1:
            from carrack.runtime.concurrent import run_concurrently

            run_concurrently(self, env, concurrency, _stoppable(_execute_step, should_stop))
            return [env[s] for s in self.output_slots]
        # this run's working memory: planned intermediates are written into it (one buffer, 64-byte aligned)
        # (a profiled run times each kernel as it allocates on its own, so it needs no arena)
        if bound is not None and bound.arena_bytes >= CHECK_THRESHOLD:
            check_allocation(bound.arena_bytes, "this run's arena (the intermediates the plan places in it)")
        plan = self._plan
        if profiler is None and bound is not None and self._memo_steps:
            # sizes seen once run every step (a decoder's growing cache never repeats them); the second run with
            # the same sizes keeps the size-only values for every later one
            memo = bound.memo.get(id(self))
            if memo is None:
                bound.memo[id(self)] = _SEEN_ONCE
            elif memo is _SEEN_ONCE:
                memo = self._memoize(bound, env)
            if memo and memo is not _SEEN_ONCE:
                for s, v in zip(self._memo_slots, memo):
                    env[s] = v
                plan = self._plan_after_memo
        arena, views, steps_bound, staged, resizable = (None, None, None, None, None) if bound is None \
            or profiler is not None or not self._placed else self._take_arena(bound)
        binding_derived = None
        binding = None
        fast = None  # a reused arena's every step bound: (its (step, call) pairs, the run's output objects)
        trusted = True  # every placed step so far wrote into its view (what the bound steps read)
        if steps_bound is not None and self.bind_steps:  # a reused arena: its steps bound to its views (bound
            # by the first run that reuses it)
            if steps_bound is _NOT_BOUND:
                staged = _Staged.for_inputs([s for s in self.input_slots if s not in self._derived_slots], env,
                                            self._constant_ids)  # the derived values are fixed already
                staged.stage(env)
                # the same objects every run with these sizes: constants, the arena's views, the plan's derived
                # values and the size-only values kept for these sizes, the staged inputs
                per_sizes = [env[s] for s in self._derived_slots] + (list(memo) if plan is self._plan_after_memo
                                                                      and self._memo_steps else [])
                unchanging = self._constant_ids | {id(v) for v in per_sizes}  # of fixed contents, too
                binding = _Binding(plan, views, unchanging | staged.buffer_ids(), self._size_only_steps(plan),
                                   unchanging)
                plan = binding.recording_plan()
                binding_derived = [(s, env[s]) for s in self._derived_slots]
            elif resizable is not None and resizable.binding_bound is not bound and (
                    steps_bound[0] is plan or steps_bound[0] is self._plan):
                # the arena was bound at other sizes: the steps untouched by the sizes that changed stay bound (the
                # size-only values of these sizes are computed, as at the binding run, when it computed them)
                plan = self._resized_plan(resizable, bound, steps_bound[0], steps_bound, staged, env,
                                          segmented=should_stop is None)
            else:
                trusted = staged is None or staged.stage(env)  # the bound steps read the staged buffers
                # bound by the first run of these sizes, before they had size-only values kept: its plan computes
                # them (or kept them, `_size_only_recorder`)
                if steps_bound[0] is plan or (steps_bound[0] is self._plan and plan is self._plan_after_memo):
                    plan = steps_bound[1]
                    fast = plan.fast if trusted and should_stop is None and profiler is None else None
                    if fast is None and should_stop is None:  # some steps unbound: the bound ones as segments
                        if plan.segmented is None:
                            plan.segmented = _segments(plan, views)
                        plan = plan.segmented
        step = None
        try:
            if fast is not None:
                for step, call in fast[0]:  # noqa: B007 - the handlers below name `step`
                    call()
            elif profiler is None:
                for step, call, gather, arity, single, release, placed, guard, run_into in plan:
                    if arity == _SEGMENT:  # consecutive bound, fixed and kept steps (never with should_stop)
                        if trusted:
                            for step, bound_call in call:  # noqa: B007, B020 - the handlers below name `step`
                                bound_call()
                            for s, value in gather:
                                env[s] = value
                        else:
                            for entry in run_into:
                                step = entry[0]
                                _run_untrusted(entry, env, views, arena)
                        continue
                    if should_stop is not None and should_stop():
                        raise RunTerminated(f"before {step.node.label()}")
                    if arity == _BOUND and trusted:
                        call()
                        result = views[placed]
                    elif arity == _FIXED and trusted:
                        result = call
                    elif arity == _KEPT and trusted:
                        result = call()
                    elif placed >= 0 and views is not None and views[placed] is not None:
                        out = views[placed]
                        result = run_into(out, gather(env)) if arity == 1 else run_into(out, *gather(env))
                        if result is not out:
                            trusted = False
                    else:
                        if arity == 1:
                            result = call(gather(env))
                        elif arity > 1:
                            result = call(*gather(env))
                        elif arity == 0:
                            result = call()
                        elif arity == _FIXED or arity == _KEPT:  # a fixed view's or kept step in a run
                            # that cannot trust it: computed
                            result = run_into(*gather(env))
                        else:
                            result = step.kernel.execute(list(gather(env)), _scope(step, env))
                        if guard and arena is not None and (type(result) is not np.ndarray
                                                            or result.base is not None):
                            result = _off_arena(result, arena)
                    if single >= 0 and type(result) is np.ndarray:
                        env[single] = result
                    else:
                        _store(step.outs, result, env)
                    for s in release:
                        env[s] = None
            else:
                for step in self.steps:
                    if should_stop is not None and should_stop():
                        raise RunTerminated(f"before {step.node.label()}")
                    args = [env[s] if s >= 0 else None for s in step.ins]
                    t0 = time.perf_counter_ns()
                    result = step.kernel.execute(args, _scope(step, env))
                    profiler.record(step.node.name or step.node.outputs[0], step.node.op_type, t0,
                                    time.perf_counter_ns(), io=(args, result, [s in self.constants for s in step.ins]))
                    _store(step.outs, result, env)
                    for s in step.release:
                        env[s] = None
        except CarrackError as e:
            _name_node(e, step)
            raise
        except Exception as e:  # noqa: BLE001 - name the node that failed
            if step is None:
                raise
            raise RunFailure(f"{step.node.label()} failed: {type(e).__name__}: {e}") from e
        outputs = list(fast[1]) if fast is not None else [env[s] for s in self.output_slots]
        if arena is None:
            return outputs
        if binding is not None:
            steps_bound = binding.bound_plan(outputs) if trusted else _NOT_BINDABLE
            if trusted:
                staged.kept = binding.kept_ids()
            if resizable is not None:
                resizable.bound_at(bound, views, binding_derived)
        outputs = [_off_arena(v, arena) for v in outputs]
        if staged is not None:
            outputs = [staged.own(v) for v in outputs]
        env.clear()  # nothing of this run refers to the arena any more: the next run may reuse it
        if not self._spare_arenas:
            self._spare_arenas.append((bound, arena, views, steps_bound, staged, resizable))
        return outputs

    def _take_arena(self, bound: Bound) -> tuple[np.ndarray, list[np.ndarray | None], tuple | None, Any, Any]:
        """An arena for a run with these sizes, a view of each placed value in it and, for a reused one, its steps
        bound to those views (`_NOT_BOUND` before they are; None for a new arena), its staged inputs (None
        before its steps are bound) and its `_Resizable` (None: laid out for these sizes only): the last finished
        run's when it had the same sizes (so a repeated shape allocates nothing and slices nothing) or when every
        block of these sizes fits its layout, else a new one, laid out for a capacity when the sizes changed.
        Runs in several threads each take their own (list.pop is atomic)."""
        previous = None
        try:
            spare_bound, arena, views, steps_bound, staged, resizable = self._spare_arenas.pop()
            if spare_bound is bound:
                return arena, views, steps_bound or _NOT_BOUND, staged, resizable
            if resizable is not None and resizable.fits(bound):
                views = resizable.views_for(bound, arena, views, spare_bound.sizes, self._layout_plan)
                return arena, views, steps_bound or _NOT_BOUND, staged, resizable
            previous = spare_bound.sizes
        except IndexError:
            pass
        layout = self._capacity(bound, previous)
        arena = aligned_empty((max(layout.arena_bytes, 64),), np.uint8)
        views = [None if place is None else arena[at[0]:at[0] + place[1]].view(place[3]).reshape(place[2])
                 for place, at in zip(bound.places, layout.places)]
        planned = bool(layout.block_sizes) and all(place is not None for place in bound.places)
        resizable = _Resizable(layout) if planned and self._layout_plan is not None else None
        # an arena for growing sizes is bound by its first run (the next sizes will reuse it)
        return arena, views, _NOT_BOUND if layout is not bound and resizable is not None else None, None, resizable

    def _capacity(self, bound: Bound, previous: tuple[int, ...] | None) -> Bound:
        """The layout of a new arena: `bound` itself, or when the sizes changed since the last run (a decoder's
        growing cache) the plan evaluated with each changed size rounded up to a power of two, so that the next
        sizes fit the same arena (at most CAPACITY_GROWTH times the bytes these sizes need; never under a memory
        limit, where the session's memory plan for the run's sizes is what may be allocated; else `bound`)."""
        if (previous is None or self._layout_plan is None or len(previous) != len(bound.sizes)
                or not bound.block_sizes or MEMORY_LIMIT.get()):  # under a memory limit: the plan's bytes only
            return bound
        sizes = tuple(s if s == p else 1 << max(s - 1, 0).bit_length() for s, p in zip(bound.sizes, previous))
        if sizes == bound.sizes:
            return bound
        try:
            layout = self._layout_plan.layout(sizes)
            if layout.arena_bytes > CAPACITY_GROWTH * bound.arena_bytes + CAPACITY_SLACK_BYTES:
                return bound
            if layout.arena_bytes >= CHECK_THRESHOLD:
                check_allocation(layout.arena_bytes, "this run's arena laid out for growing sizes")
        except CarrackError:  # the capacity is over the machine's memory: these sizes' own layout is checked by the run
            return bound
        return layout if _blocks_fit(bound, layout) else bound

    def _resized_plan(self, resizable: _Resizable, bound: Bound, plan: list[tuple], steps_bound: tuple,
                      staged: Any, env: list[Any], segmented: bool = False) -> list[tuple]:
        """The run loop's plan for a run on an arena bound at other sizes: the inputs that fit their staged buffers
        are staged, the derived values of unchanged symbols are the binding run's objects, and every bound, fixed
        or kept step reading a value whose object changed (a view of a new shape, an input fed as is, a derived
        value of a changed symbol, a size-only value of other sizes) runs unbound (one plan per such pattern).
        `segmented`: the plan with its runs of bound, fixed and kept steps as segments (`_segments`)."""
        unstaged = staged.stage_fitting(env) if staged is not None else ()
        binding_sizes = resizable.binding_bound.sizes
        changed = tuple(k for k, (a, b) in enumerate(zip(bound.sizes, binding_sizes)) if a != b) \
            if len(bound.sizes) == len(binding_sizes) else None
        memo_changed = plan is self._plan_after_memo and bool(self._memo_steps)
        key = (resizable.changed_views, unstaged, changed, memo_changed)
        found = resizable.plans.get(key)
        if found is None:
            seeds = {self._slot_of_placed[k] for k in resizable.changed_views} | set(unstaged)
            if changed is not None:
                reads = self._derived_symbols()
                seeds.update(s for s, _ in resizable.binding_derived if not reads[s].isdisjoint(changed))
            else:
                seeds.update(s for s, _ in resizable.binding_derived)
            if memo_changed:
                seeds.update(self._memo_slots)
            substitutes = [(s, v) for s, v in resizable.binding_derived if s not in seeds]
            resized_plan = _unbind_changed(steps_bound, seeds)
            found = resizable.plans[key] = (resized_plan, substitutes,
                                            _segments(resized_plan, resizable.binding_views))
        resized_plan, substitutes, segments = found
        for s, v in substitutes:
            env[s] = v
        return segments if segmented else resized_plan

    def _derived_symbols(self) -> dict[int, frozenset[int]]:
        """Per slot of a derived value of the attached plan, the symbols it reads (Plan.symbols_read)."""
        if self._symbols_of_slot is None:
            plan = self._layout_plan
            self._symbols_of_slot = {self.slot_of[d.name]: plan.symbols_read(d)
                                     for d in plan.derived if d.name in self.slot_of}
        return self._symbols_of_slot

    def memoize_size_only(self, derived: Sequence[str]) -> None:
        """Find the steps whose results depend only on constants and on `derived` values (the plan's shape
        arithmetic, a function of the symbol sizes): position ids, causal masks, their embedding lookups. A run
        computes them once per set of sizes (kept in the plan's Bound) instead of every time."""
        known = set(self.constants) | {self.slot_of[n] for n in derived if n in self.slot_of}
        self._derived_slots = tuple(self.slot_of[n] for n in derived if n in self.slot_of)
        steps = []
        for k, st in enumerate(self.steps):
            kernel = type(st.kernel)
            if (kernel.pure and not st.captures and kernel.execute is registry.Kernel.execute
                    and not st.node.subgraphs() and all(s < 0 or s in known for s in st.ins)):
                steps.append(k)
                known.update(s for s in st.outs if s >= 0)
        if not steps:
            return
        produced = {s for k in steps for s in self.steps[k].outs if s >= 0}
        chosen = set(steps)
        read = {s for k, st in enumerate(self.steps) if k not in chosen
                for s in st.ins + tuple(s for _, s in st.captures)} | set(self.output_slots)
        self._memo_steps = tuple(steps)
        self._memo_slots = tuple(sorted(produced & read))
        self._plan_after_memo = self._without_memo_steps()

    def _memoize(self, bound: Bound, env: list[Any]) -> list[Any] | None:
        """Run the size-only steps for these sizes (allocating, outside any arena) and keep their values in the
        bound, read-only; values above MEMO_BYTES in all are not kept (None: the run computes them itself)."""
        scratch = list(env)
        for k in self._memo_steps:
            step = self.steps[k]
            _execute_step(step, scratch)
        values = [scratch[s] for s in self._memo_slots]
        nbytes = sum(v.nbytes for v in values if isinstance(v, np.ndarray))
        with self._memo_lock:
            kept = (all(isinstance(v, np.ndarray) for v in values) and nbytes <= MEMO_BYTES
                    and self._memo_total + nbytes <= MEMO_TOTAL_BYTES)
            if kept:
                self._memo_total += nbytes
        if not kept:
            bound.memo[id(self)] = ()
            return None
        for v in values:
            v.flags.writeable = False
        bound.memo[id(self)] = values
        weakref.finalize(bound, self._forget_memo, nbytes)  # the plan dropped these sizes from its cache
        return values

    def _forget_memo(self, nbytes: int) -> None:
        with self._memo_lock:
            self._memo_total -= nbytes

    def attach(self, plan: Plan) -> None:
        """Write the intermediates the plan places in its arena straight into it (kernels with `run_into`)."""
        index = {p.name: k for k, p in enumerate(plan.placed)}
        self._placed = {}
        for k, st in enumerate(self.steps):
            if len(st.outs) == 1 and st.node.outputs[0] in index and hasattr(st.kernel, "run_into"):
                self._placed[k] = index[st.node.outputs[0]]
        self._layout_plan = plan
        self._slot_of_placed = [-1] * len(plan.placed)
        for k, p in self._placed.items():
            self._slot_of_placed[p] = self.steps[k].outs[0]
        self._symbols_of_slot = None
        self._views = {name for st in self.steps for name in st.node.outputs if type(st.kernel).view}
        self._plan = self._compile_plan()
        self._plan_after_memo = self._without_memo_steps()

    def _size_only_steps(self, plan: list[tuple]) -> frozenset[int]:
        """The size-only steps (memoize_size_only) of a plan that runs them, without those giving a graph output."""
        if plan is not self._plan:
            return frozenset()
        outputs = set(self.output_slots)
        return frozenset(k for k in self._memo_steps if not outputs.intersection(self.steps[k].outs))

    def _without_memo_steps(self) -> list[tuple]:
        """The run loop's plan for runs that take the size-only values from the memo."""
        memo = set(self._memo_steps)
        return [entry for k, entry in enumerate(self._plan) if k not in memo]

    def _compile_plan(self) -> list[tuple]:
        """Per step, what the run loop needs in the cheapest form: the kernel's `run` (None when the kernel
        overrides `execute`, e.g. control flow reading outer-scope values: arity -1), a C-level getter of its input
        values (omitted inputs read the always-None extra slot), how many inputs it takes, its output slot when it
        has exactly one (else -1), the slots it releases, the index of its output among the plan's placed values
        (-1: it allocates), whether its result must be checked for views into the arena, and its `run_into`."""
        plan = []
        for k, st in enumerate(self.steps):
            ins = tuple(s if s >= 0 else self.n_slots for s in st.ins)
            overridden = type(st.kernel).execute is not registry.Kernel.execute or bool(st.captures)
            call = None if overridden else st.kernel.run
            arity = -1 if overridden else len(ins)
            gather = _tuple_getter(ins) if overridden else operator.itemgetter(*ins) if ins else None
            single = st.outs[0] if len(st.outs) == 1 else -1  # -1: store through _store
            placed = self._placed.get(k, -1) if single >= 0 and arity > 0 else -1
            # a planned view's source bytes stay reserved while it is read; anything else may be a stray view
            guard = not any(o in self._views for o in st.node.outputs)
            run_into = st.kernel.run_into if placed >= 0 else None
            plan.append((st, call, gather, arity, single, st.release, placed, guard, run_into))
        return plan


class _Binding:
    """The first run that reuses an arena records which placed steps can be bound to its views (`Kernel.bind_into`):
    a step whose output went into its view and whose inputs were all fixed objects (views of that arena,
    constants, the plan's derived and size-only values for these sizes, kept results of view steps) or omitted.
    Later runs with the arena call those steps' bound calls instead of gathering, checking and slicing per call."""

    def __init__(self, plan: list[tuple], views: list[np.ndarray | None], constant_ids: frozenset[int],
                 size_only: frozenset[int] = frozenset(), unchanging_ids: frozenset[int] = frozenset()):
        self.plan = plan
        self.size_only = size_only  # steps whose results depend only on the sizes (and not a graph output)
        self.unchanging = set(unchanging_ids)  # objects whose contents are the same every run with these sizes
        self.fixed = set(constant_ids) | {id(v) for v in views if v is not None}  # live objects: ids are theirs
        self.calls: dict[int, Any] = {}
        self.views: dict[int, Any] = {}  # step -> its result, for view kernels' steps that give fixed objects
        self.kept: dict[int, tuple[Any, np.ndarray]] = {}  # step -> (bound call, its result kept for the arena)

    def recording_plan(self) -> list[tuple]:
        plan = []
        for k, entry in enumerate(self.plan):
            if entry[6] >= 0 and entry[8] is not None:
                entry = entry[:8] + (self._recorder(k, entry),)
            elif entry[6] < 0 and entry[3] > 0 and not entry[7]:  # a view kernel's step (its result is not guarded)
                entry = (entry[0], self._view_recorder(k, entry[1])) + entry[2:]
            elif entry[6] < 0 and entry[3] > 0:
                call = entry[1]
                if _binds(entry[0].kernel) if entry[4] >= 0 else hasattr(entry[0].kernel, "bind_outputs"):
                    call = self._kept_recorder(k, entry[0].kernel, call)
                if k in self.size_only:
                    call = self._size_only_recorder(k, entry[1], call)
                entry = (entry[0], call) + entry[2:]
            plan.append(entry)
        return plan

    def _view_recorder(self, k: int, call):
        """A view kernel's step whose first input is a fixed object, whose other inputs (target shape, axes, split
        sizes) are of unchanging contents (not a staged feed, whose values change every run) and whose every result
        is a view of its first input gives the same objects every run: kept as its result (and fixed, for the steps
        that read it)."""
        def record(*inputs):
            result = call(*inputs)
            parts = result if type(result) in (tuple, list) else (result,)
            if (inputs and type(inputs[0]) is np.ndarray and id(inputs[0]) in self.fixed
                    and all(v is None or id(v) in self.unchanging for v in inputs[1:])
                    and all(type(p) is np.ndarray and (p is inputs[0] or np.may_share_memory(p, inputs[0]))
                            for p in parts)):
                self.views[k] = result
                self.fixed.update(id(p) for p in parts)
                if id(inputs[0]) in self.unchanging:
                    self.unchanging.update(id(p) for p in parts)
            return result
        return record

    def _size_only_recorder(self, k: int, call, otherwise):
        """A step computing from the sizes alone (a causal mask's ranges) whose inputs are of unchanging contents
        (constants, derived values, other such results; not arena views, whose contents each run rewrites) gives
        the same values every run with these sizes: its result is kept, read-only, as the step's (fixed, for
        the steps that read it). Other inputs: `otherwise` records the step."""
        def record(*inputs):
            if not all(v is None or id(v) in self.unchanging for v in inputs):
                return otherwise(*inputs)
            result = call(*inputs)
            parts = result if type(result) is tuple else (result,)
            if all(type(p) is np.ndarray for p in parts):
                for p in parts:
                    p.flags.writeable = False
                self.views[k] = result
                self.fixed.update(id(p) for p in parts)
                self.unchanging.update(id(p) for p in parts)
            return result
        return record

    def _kept_recorder(self, k: int, kernel, call):
        """A step outside the arena (a graph output such as a decoder's cache, a step with several outputs) whose inputs
        are fixed objects and whose result is a fresh array: that array is kept with the arena as the step's
        output, bound (`Kernel.bind_into`) to be rewritten in place by later runs; fixed for the steps reading
        it. A graph output kept this way is copied for the caller (`_Staged.own`)."""
        def record(*inputs):
            result = call(*inputs)
            parts = [p for p in result if p is not None] if type(result) is tuple else [result]
            if (parts and all(type(p) is np.ndarray and p.base is None and p.flags.writeable
                              and not any(p is v for v in inputs) for p in parts)
                    and 0 < sum(p.nbytes for p in parts) <= KEPT_MAX_BYTES
                    and all(v is None or id(v) in self.fixed for v in inputs) and self._values_kept(kernel, inputs)):
                # several results from a kernel without bind_outputs (a LayerNormalization giving its statistics
                # too): not kept
                binder = getattr(kernel, "bind_outputs", None) if type(result) is tuple else kernel.bind_into
                bound = None if binder is None else binder(result, *inputs)
                if bound is not None:
                    self.kept[k] = (bound, result)
                    self.fixed.update(id(p) for p in parts)
            return result
        return record

    def _values_kept(self, kernel, inputs: tuple) -> bool:
        """Whether the inputs whose values a bound call of `kernel` bakes in (its `value_inputs`: Expand's target
        shape) are of unchanging contents."""
        return all(k >= len(inputs) or inputs[k] is None or id(inputs[k]) in self.unchanging
                   for k in getattr(kernel, "value_inputs", ()))

    def kept_ids(self) -> frozenset[int]:
        return frozenset(id(p) for _, result in self.kept.values()
                         for p in (result if type(result) is tuple else (result,)) if p is not None)

    def _recorder(self, k: int, entry: tuple):
        kernel, run_into = entry[0].kernel, entry[8]

        def record(out, *inputs):
            result = run_into(out, *inputs)
            if result is out and all(v is None or id(v) in self.fixed for v in inputs) and self._values_kept(
                    kernel, inputs):
                call = kernel.bind_into(out, *inputs)
                if call is not None:
                    self.calls[k] = call
            return result
        return record

    def bound_plan(self, outputs: Sequence[Any] = ()) -> tuple[list[tuple], list[tuple]]:
        """(the plan it was recorded on, that plan with the bound steps' entries marked _BOUND); the bound entries
        keep a tuple getter and `run_into` for a run in which an earlier step did not write into its view. When
        every step is bound, kept or a fixed view and the binding run's `outputs` are all fixed objects, the plan's
        `fast` is its calls and those outputs: a trusted run then makes the calls and nothing else."""
        plan = _BoundPlan(self.plan)
        for k, call in self.calls.items():
            step, _, _, _, single, release, placed, guard, run_into = plan[k]
            plan[k] = (step, call, self._getter(k), _BOUND, single, release, placed, guard, run_into)
        for k, result in self.views.items():
            step, call, _, _, single, release, placed, guard, _ = plan[k]
            plan[k] = (step, result, self._getter(k), _FIXED, single, release, placed, guard, call)
        for k, (bound, result) in self.kept.items():
            step, call, _, _, single, release, placed, guard, _ = plan[k]
            plan[k] = (step, _returning(bound, result), self._getter(k), _KEPT, single, release, placed, guard, call)
        if all(entry[3] in (_BOUND, _FIXED, _KEPT) for entry in plan) and all(
                v is None or id(v) in self.fixed for v in outputs):
            plan.fast = (tuple((entry[0], entry[1]) for entry in plan if entry[3] != _FIXED), tuple(outputs))
        return self.plan, plan

    def _getter(self, k: int):
        gather, arity = self.plan[k][2], self.plan[k][3]
        return gather if arity > 1 else (lambda env: (gather(env),))


class _BoundPlan(list):
    """A bound plan's entries, its `fast` form (None unless every step is bound: `_Binding.bound_plan`) and its
    `segmented` form (`_segments`, made by the first run that takes it: the views its bound steps write into)."""

    __slots__ = ("fast", "segmented")

    def __init__(self, entries):
        super().__init__(entries)
        self.fast = None
        self.segmented: list[tuple] | None = None


def _blocks_fit(small: Bound, large: Bound) -> bool:
    """Whether every arena block of `small` fits in the same block of `large` (the same blocks, none larger)."""
    return len(small.block_sizes) == len(large.block_sizes) and all(
        map(operator.le, small.block_sizes, large.block_sizes))


class _Resizable:
    """An arena laid out for sizes at least those of its runs (`layout`), so runs of other sizes whose every block
    fits reuse it: their views sit at the layout's offsets, and a view whose shape did not change is the same
    object as at the binding run (what the bound steps were bound to)."""

    def __init__(self, layout: Bound):
        self.layout = layout
        self.binding_bound: Bound | None = None  # the sizes the arena's steps were bound at
        self.binding_views: list[np.ndarray | None] | None = None
        self.binding_derived: list[tuple[int, Any]] = []  # (slot, object) of the derived values at binding
        self.changed_views: tuple[int, ...] = ()  # placed values whose view is not the binding run's
        self.plans: dict[tuple, tuple[list[tuple], list[tuple[int, Any]]]] = {}  # see Program._resized_plan

    def fits(self, bound: Bound) -> bool:
        return bool(bound.block_sizes) and _blocks_fit(bound, self.layout)

    def views_for(self, bound: Bound, arena: np.ndarray, views: list[np.ndarray | None],
                  views_sizes: tuple[int, ...], plan: Plan) -> list[np.ndarray | None]:
        """The views of `bound`'s placed values: the binding run's or the last run's object (`views`, of
        `views_sizes`) where the shape is the same, else a new view at the layout's offset. Only the values whose
        shape reads a symbol that changed are looked at (`Plan.placed_reading`)."""
        first, sizes = (self.binding_views, self.binding_bound.sizes) if self.binding_views else (views, views_sizes)
        result = list(first)
        if len(sizes) == len(bound.sizes):
            looked_at: Sequence[int] = plan.placed_reading(
                tuple(k for k, (a, b) in enumerate(zip(bound.sizes, sizes)) if a != b))
        else:
            looked_at = range(len(result))
        changed = []
        places, layout = bound.places, self.layout.places
        for k in looked_at:
            shape, kept, old = places[k][2], first[k], views[k]
            if kept is not None and kept.shape == shape:
                continue
            if old is not None and old.shape == shape:
                view = old
            else:  # (one constructor call: a third of slicing, viewing and reshaping)
                view = np.ndarray(shape, places[k][3], arena, layout[k][0])
            changed.append(k)
            result[k] = view
        self.changed_views = tuple(changed)
        return result

    def bound_at(self, bound: Bound, views: list[np.ndarray | None], derived: list[tuple[int, Any]]) -> None:
        """Its steps were bound (by a run of `bound`'s sizes) to these views and derived values."""
        self.binding_bound, self.binding_views, self.binding_derived = bound, list(views), derived
        self.changed_views, self.plans = (), {}


def _unbind_changed(steps_bound: tuple, changed: set[int]) -> list[tuple]:
    """The bound plan with every bound, fixed or kept step that reads a changed slot (or writes into a changed
    view) back to its unbound entry; the outputs of every step reading a changed slot are changed objects too
    (unbound steps' as well: one may pass its input through), except a placed output whose view did not change
    (the step still writes into it)."""
    recorded, bound_plan = steps_bound
    changed = set(changed)
    plan = []
    for k, entry in enumerate(bound_plan):
        step, arity = entry[0], entry[3]
        if changed.intersection(step.ins) or (entry[6] >= 0 and step.outs[0] in changed):
            if arity in (_BOUND, _FIXED, _KEPT):
                entry = recorded[k]
            # an unbound step's result may be its input itself (a Cast to the same type), which steps were bound to
            if entry[6] < 0:
                changed.update(s for s in step.outs if s >= 0)
        plan.append(entry)
    return plan


class _Staged:
    """An arena's copies of the run's small inputs: each run copies its feeds into the same buffers, so the steps
    reading an input (a decoder's ids and cache, an MLP's first layer) see fixed objects and can be bound too.
    One block holds them all, so an output that is an input (or a view of one) is found and copied off."""

    #: inputs up to this size are staged (a copy costs less than the per-step glue it saves); larger ones are not
    MAX_BYTES = 16384

    def __init__(self, slots: tuple[int, ...], buffers: tuple[np.ndarray, ...], block: np.ndarray | None):
        self.slots, self.buffers, self.block = slots, buffers, block
        self.kept: frozenset[int] = frozenset()  # the kept results of the arena's steps outside it (_Binding)

    @classmethod
    def for_inputs(cls, input_slots: Sequence[int], env: list[Any], constant_ids: frozenset[int]) -> _Staged:
        chosen = [(s, env[s]) for s in input_slots if type(env[s]) is np.ndarray and id(env[s]) not in constant_ids
                  and 0 < env[s].nbytes <= cls.MAX_BYTES and env[s].dtype.kind in "biuf"]
        if not chosen:
            return cls((), (), None)
        offsets, total = [], 0
        for _, v in chosen:
            offsets.append(total)
            total += -(-v.nbytes // 64) * 64
        block = aligned_empty((total,), np.uint8)
        buffers = tuple(block[o:o + v.nbytes].view(v.dtype).reshape(v.shape) for o, (_, v) in zip(offsets, chosen))
        return cls(tuple(s for s, _ in chosen), buffers, block)

    def buffer_ids(self) -> set[int]:
        return {id(b) for b in self.buffers}

    def own(self, value: Any) -> Any:
        """An output the next run with this arena will not overwrite: a kept result or a view of a staged input is
        copied."""
        if type(value) is np.ndarray and (id(value) in self.kept or (
                value.base is not None and self.block is not None and np.may_share_memory(value, self.block))):
            return value.copy()
        return value

    def stage(self, env: list[Any]) -> bool:
        """Copy this run's inputs into the buffers and put the buffers in their slots; False when an input does not
        fit its buffer (that input stays as fed, and the steps bound to the buffer must not run)."""
        return not self.stage_fitting(env)

    def stage_fitting(self, env: list[Any]) -> tuple[int, ...]:
        """`stage` for a run of other sizes: the inputs that fit are staged; returns the slots of those that do not
        (they stay as fed)."""
        unstaged = []
        for s, buffer in zip(self.slots, self.buffers):
            value = env[s]
            if type(value) is np.ndarray and value.shape == buffer.shape and value.dtype == buffer.dtype:
                np.copyto(buffer, value)
                env[s] = buffer
            else:
                unstaged.append(s)
        return tuple(unstaged)


def _binds(kernel: registry.Kernel) -> bool:
    return type(kernel).bind_into is not registry.Kernel.bind_into


def _returning(call, result: np.ndarray):
    def kept() -> np.ndarray:
        call()
        return result
    kept.result = result  # what a segment stores for it (`_segments`)
    return kept


def _segments(plan: list[tuple], views: list[np.ndarray | None]) -> list[tuple]:
    """`plan` (a bound plan, `views` the objects its bound steps write into) with each run of two or more
    consecutive bound, fixed and kept steps as one entry of arity _SEGMENT: their calls as (step, call) pairs, and
    the slot values those steps leave behind (their results, None for what they release), stored after the calls
    (the calls themselves read no slots); the original entries, for a run that cannot trust its bound steps."""
    result: list[tuple] = []
    run: list[tuple] = []
    for entry in [*plan, None]:
        if entry is not None and entry[3] in (_BOUND, _FIXED, _KEPT):
            run.append(entry)
            continue
        if len(run) > 1:
            calls = tuple((e[0], e[1]) for e in run if e[3] != _FIXED)
            left: dict[int, Any] = {}
            for e in run:
                step, arity = e[0], e[3]
                value = views[e[6]] if arity == _BOUND else e[1] if arity == _FIXED else e[1].result
                if e[4] >= 0 and type(value) is np.ndarray:  # as the run loop stores a result (or `_store`)
                    left[e[4]] = value
                else:
                    for s, part in zip(step.outs, value if type(value) is tuple else (value,)):
                        if s >= 0:
                            left[s] = part
                for s in e[5]:
                    left[s] = None
            result.append((run[0][0], calls, tuple(left.items()), _SEGMENT, -1, (), -1, False, tuple(run)))
        else:
            result.extend(run)
        run = []
        if entry is not None:
            result.append(entry)
    return result


def _run_untrusted(entry: tuple, env: list[Any], views: list[np.ndarray | None], arena: np.ndarray) -> None:
    """A bound, fixed or kept step of a segment in a run that cannot trust them (an earlier placed step wrote
    elsewhere): computed from its inputs, as the run loop does for such steps."""
    step, call, gather, arity, single, release, placed, guard, run_into = entry
    if arity == _BOUND:
        result = run_into(views[placed], *gather(env))
    else:
        result = run_into(*gather(env))
        if guard and (type(result) is not np.ndarray or result.base is not None):
            result = _off_arena(result, arena)
    if single >= 0 and type(result) is np.ndarray:
        env[single] = result
    else:
        _store(step.outs, result, env)
    for s in release:
        env[s] = None


#: an arena laid out for growing sizes takes at most this many times the bytes its first sizes need (plus the slack)
CAPACITY_GROWTH = 4
CAPACITY_SLACK_BYTES = 65536
#: results up to this size are kept with an arena for steps outside it (a bigger graph output costs its copy)
KEPT_MAX_BYTES = 65536
_BOUND = -2  # a plan entry's arity for a step bound to its arena's views
_FIXED = -3  # a plan entry's arity for a view kernel's step whose result is the same objects every run
_KEPT = -4  # a plan entry's arity for a step outside the arena bound to a result kept with the arena
_SEGMENT = -5  # a plan entry's arity for consecutive bound, fixed and kept steps run as one (`_segments`)
_NOT_BOUND = ("not bound",)  # a reused arena whose steps are not bound yet
_NOT_BINDABLE = ((), None)  # a reused arena whose binding run saw a step write elsewhere: never bound


def _execute_step(step: Step, env: list[Any]) -> None:
    """One step outside the sequential loop (concurrent runs): allocate its results, store them in env."""
    try:
        result = step.kernel.execute([env[s] if s >= 0 else None for s in step.ins], _scope(step, env))
    except CarrackError:
        raise
    except Exception as e:  # noqa: BLE001 - name the node that failed
        raise RunFailure(f"{step.node.label()} failed: {type(e).__name__}: {e}") from e
    _store(step.outs, result, env)


def _off_arena(value: Any, arena: np.ndarray) -> Any:
    """A value that is not backed by the arena: a view of arena bytes the plan does not know about (a kernel that
    returned a view of its input) is copied out, so later steps cannot overwrite it."""
    if type(value) is tuple:
        return tuple(_off_arena(v, arena) for v in value)
    if isinstance(value, np.ndarray) and value.base is not None and np.may_share_memory(value, arena):
        return value.copy()
    return value


def _tuple_getter(ins: tuple[int, ...]):
    """A getter that always returns a tuple (itemgetter returns a bare value for one index)."""
    if len(ins) == 1:
        get = operator.itemgetter(ins[0])
        return lambda env: (get(env),)
    return operator.itemgetter(*ins) if ins else (lambda env: ())


def _scope(step: Step, env: list[Any]) -> Mapping[str, Any]:
    return {n: env[s] for n, s in step.captures} if step.captures else _EMPTY


def _store(outs: tuple[int, ...], result: Any, env: list[Any]) -> None:
    values = result if type(result) is tuple else (result,)
    for s, v in zip(outs, values):
        if s >= 0:
            env[s] = np.asarray(v) if isinstance(v, np.generic) else v


_EMPTY: Mapping[str, Any] = {}
#: the most bytes of size-only values a Bound keeps per program (more are computed by each run), and in all the
#: Bounds a plan keeps (its cache holds up to 256 sets of sizes)
MEMO_BYTES = 1 << 20
MEMO_TOTAL_BYTES = 16 << 20
_SEEN_ONCE = "seen once"


def _expand_function_ops(nodes: list[Node], ctx: BuildContext, depth: int = 0) -> list[Node]:
    """Ops without a kernel whose ONNX schema defines a function body are replaced by that body."""
    from carrack.onnx.functions import Function, expand_call
    from carrack.onnx.importer import _attr_value, _import_function

    out: list[Node] = []
    for node in nodes:
        opset = ctx.opset_of(node)
        cls, version = registry.resolve(node.domain, node.op_type, opset)
        sch = registry.schema(node.domain, node.op_type, opset) if cls is None else None
        body = _function_body(sch, opset) if sch is not None and depth < 8 else None
        if body is None:
            out.append(node)
            continue
        fn: Function = _import_function(body, None)
        fn.opsets.setdefault(node.domain, opset)
        for name, attr in sch.attributes.items():  # a schema's defaults live in the schema, not in its body
            if fn.attr_defaults.get(name) is None and attr.default_value.type:
                fn.attr_defaults[name] = _attr_value(attr.default_value, None)
        out.extend(_expand_function_ops(expand_call(node, fn, ctx.opsets), ctx, depth + 1))
    return out


def _function_body(sch, opset: int) -> onnx.FunctionProto | None:
    """The schema's function body for a model opset, if it has a context-free one."""
    if not sch.has_function:
        return None
    versions = [v for v in sch.function_opset_versions if v <= opset]
    if not versions:
        return None
    fp = onnx.FunctionProto()
    fp.ParseFromString(sch.get_function_with_opset_version(max(versions)))
    return fp


def _stoppable(execute_step, should_stop):
    """`execute_step` that first asks `should_stop` (RunOptions.terminate) when there is one."""
    if should_stop is None:
        return execute_step

    def checked(step: Step, env: list[Any]) -> None:
        if should_stop():
            raise RunTerminated(f"before {step.node.label()}")
        execute_step(step, env)
    return checked


def _name_node(error: CarrackError, step: Step | None) -> None:
    """Put the node that raised a kernel's carrack error in front of its message, unless the message names it."""
    if step is not None and len(error.args) == 1 and isinstance(error.args[0], str):
        label = step.node.label()
        named = label in error.args[0] or (step.node.name and f"'{step.node.name}'" in error.args[0])
        if not named and not isinstance(error, RunTerminated):
            error.args = (f"{label}: {error.args[0]}",)
