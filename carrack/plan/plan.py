"""The plan: one compiled form of a model that runs every input shape it admits.

Built once per session: the graph is optimized, shape inference runs once over the inputs' symbolic dims, and what
it proves becomes part of the plan instead of work per run:
- shape arithmetic whose result is fixed (``Shape -> Gather -> Div`` giving 64) is folded into constants, and the
  graph optimized again, so fusions that need those numbers fire for every shape;
- shape arithmetic whose result depends on the input sizes (``Concat(batch, seq, 768)`` for a Reshape) is removed
  from the graph; its values are expressions over the symbols, evaluated per run by one compiled function;
- intermediates whose size is an expression over the symbols get a place in one arena (`carrack.plan.arena`).

A `Plan` is plain data (graph, constants, expressions as source text) and pickles; `bind(sizes)` evaluates it for
one set of symbol sizes in microseconds, and executors are built from it (`carrack.runtime.program.Program`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carrack.ir import symbolic
from carrack.ir.dims import Sym
from carrack.ir.graph import Graph, Model, Node, ValueInfo
from carrack.ir.order import node_reads
from carrack.ir.symbolic import DimLike, Expr, symbols
from carrack.ir.types import TensorType
from carrack.ops import registry
from carrack.passes import blocked_layout
from carrack.passes.facts import Fact, numpy_dtype
from carrack.passes.graph_view import GraphView
from carrack.passes.optimizer import (
    Context,
    fold_known_values,
    optimize,
    optimize_graph,
    reads_by_name,
    remove_dead_nodes,
)
from carrack.passes.rewrite import EXTENDED
from carrack.passes.shape_inference import infer, input_facts
from carrack.plan import select
from carrack.plan.arena import ArenaOrder, Block, order_blocks
from carrack.plan.exprs import compile_function, function_source, symbols_of_dims
from carrack.runtime.allocator import CHECK_THRESHOLD, check_allocation

#: how many distinct input-size combinations a plan keeps evaluated
BOUND_CACHE_SIZE = 256


@dataclass(frozen=True)
class Derived:
    """A value computed from the symbol sizes alone (shape arithmetic): `count` dims from `first` in the dims."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    first: int
    values: tuple[DimLike, ...] = ()  # the expressions, flattened (for facts about the plan's graph)

    @property
    def dims(self) -> range:
        """Its positions in the dims function's result (one per element)."""
        return range(self.first, self.first + math.prod(self.shape))


@dataclass(frozen=True)
class Placed:
    """An intermediate written into the arena: its block, and its shape's dims from `first` in the dims."""

    name: str
    block: int
    first: int
    rank: int
    dtype: str

    @property
    def dims(self) -> range:
        """Its shape's positions in the dims function's result."""
        return range(self.first, self.first + self.rank)


@dataclass(frozen=True)
class Shaped:
    """The first input of a node whose kernel prepares per input shape (`Kernel.prepare_shape`): its shape's dims
    from `first` in the dims."""

    node: str  # select.node_key
    first: int
    rank: int


@dataclass
class Bound:
    """A plan evaluated for one set of symbol sizes."""

    derived: list[np.ndarray]
    arena_bytes: int
    #: per Placed value: (byte offset, byte count, shape, dtype), or None when the sizes leave it unplanned
    places: list[tuple[int, int, tuple[int, ...], np.dtype] | None]
    #: node key -> its first input's shape at these sizes, for the plan's Shaped nodes
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: per executor (keyed by its id): the values of its steps that depend only on these sizes (see
    #: `carrack.runtime.program.Program.memoize_size_only`), computed by the first run with these sizes
    memo: dict[int, Any] = field(default_factory=dict)
    sizes: tuple[int, ...] = ()  # the symbol sizes it was evaluated for
    block_sizes: tuple[int, ...] = ()  # bytes of each arena block (ArenaOrder order) at these sizes


@dataclass
class Plan:
    model: Model  # optimized; its graph's inputs are the run inputs, then the derived values
    inputs: list[ValueInfo]  # what a run is fed
    symbols: tuple[str, ...]  # binding names of the input dims, in the order `bind` takes their sizes
    derived: list[Derived]
    placed: list[Placed]
    arena: ArenaOrder | None
    dims_source: str  # lambda over the symbol sizes: derived values, block sizes, placed shapes (flat)
    n_derived_dims: int
    optimizer_stats: dict[str, int] = field(default_factory=dict)
    #: node key -> the implementation that runs it (carrack.plan.select), for nodes with more than one
    implementations: dict[str, str] = field(default_factory=dict)
    shaped: list[Shaped] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._function: Callable[..., tuple[int, ...]] | None = None
        self._bound: dict[tuple[int, ...], Bound] = {}
        self._lock = threading.Lock()
        self._facts: dict[str, Fact] | None = None
        self._on_bind: list[Callable[[Bound], None]] = []
        self._dtypes: list[np.dtype] | None = None  # of the placed values
        self._places_function: Callable[..., tuple[list, int]] | None = None  # see _compile_places
        #: (sizes, derived arrays) of the last evaluation: a new one remakes only the arrays of changed symbols
        self._last_derived: tuple[tuple[int, ...], list[np.ndarray]] | None = None
        self._derived_reading: dict[tuple[int, ...], tuple[int, ...]] = {}  # changed symbols -> derived to remake
        self._placed_reading: dict[tuple[int, ...], tuple[int, ...]] = {}  # changed symbols -> placed reshaped
        self._dim_symbols: list[frozenset[int]] | None = None  # per dim of the dims function, the symbols it reads

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        state["_function"], state["_bound"], state["_facts"], state["_on_bind"] = None, {}, None, []
        state["_dtypes"], state["_places_function"], state["_last_derived"] = None, None, None
        state["_derived_reading"], state["_placed_reading"], state["_dim_symbols"] = {}, {}, None
        return state

    def on_bind(self, prepare: Callable[[Bound], None]) -> None:
        """Call `prepare(bound)` for every set of sizes this plan evaluates from now on (and for those already
        evaluated), before the evaluation is handed to any run: an executor prepares its per-shape state there
        (e.g. convolutions bound to their input shapes), never during a run."""
        with self._lock:
            self._on_bind.append(prepare)
            done = list(self._bound.values())
        for bound in done:
            prepare(bound)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def graph(self) -> Graph:
        return self.model.graph

    def bind(self, sizes: tuple[int, ...]) -> Bound:
        """The plan for these symbol sizes (cached: a repeated shape costs one dict lookup)."""
        bound = self._bound.get(sizes)
        if bound is None:
            bound = self._evaluate(sizes)
            for prepare in list(self._on_bind):
                prepare(bound)
            with self._lock:  # runs share the plan across threads
                if len(self._bound) >= BOUND_CACHE_SIZE:
                    self._bound.pop(next(iter(self._bound)))
                self._bound[sizes] = bound
        return bound

    def layout(self, sizes: tuple[int, ...]) -> Bound:
        """The plan evaluated for sizes no run has (an arena's capacity, `Program`): not cached, and no executor
        prepares for it; refused (MemoryLimitExceeded / InvalidArgument) as `bind` refuses."""
        return self._evaluate(sizes)

    def _evaluate(self, sizes: tuple[int, ...]) -> Bound:
        if self._function is None:
            self._function = compile_function(self.dims_source)  # racing threads compile the same function
        flat = self._function(*sizes)
        derived = self._derived_values(sizes, flat)
        shapes = {s.node: tuple(flat[s.first:s.first + s.rank]) for s in self.shaped}
        if self.arena is None:
            return Bound(derived, 0, [None] * len(self.placed), shapes, sizes=sizes)
        n_blocks = len(self.arena.blocks)
        block_sizes = flat[self.n_derived_dims:self.n_derived_dims + n_blocks]
        if min(block_sizes, default=0) < 0:
            return Bound(derived, 0, [None] * len(self.placed), shapes, sizes=sizes)
        if self._places_function is None:
            self._dtypes = [np.dtype(p.dtype) for p in self.placed]
            self._places_function = self._compile_places()
        places, arena_bytes = self._places_function(flat, self._dtypes)
        check_placed(self.placed, places, arena_bytes)
        return Bound(derived, arena_bytes, places, shapes, sizes=sizes, block_sizes=block_sizes)

    def _derived_values(self, sizes: tuple[int, ...], flat: tuple[int, ...]) -> list[np.ndarray]:
        """The derived arrays for these sizes (read-only, shared by every run): the last evaluation's arrays where
        no symbol they depend on changed, new ones for the rest."""
        last = self._last_derived
        if last is None or len(last[0]) != len(sizes):
            values: list[Any] = [None] * len(self.derived)
            remake: Iterable[int] = range(len(self.derived))
        else:
            changed = tuple(k for k, (a, b) in enumerate(zip(sizes, last[0])) if a != b)
            values = list(last[1])
            remake = self._derived_reading.get(changed)
            if remake is None:
                remake = self._derived_reading[changed] = self._reading(self.derived, changed)
        numbers = None
        for k in remake:
            if numbers is None:  # one array of every derived number: the values are read-only views of it
                numbers = np.array(flat[:self.n_derived_dims], dtype=np.int64)
                numbers.flags.writeable = False
            d = self.derived[k]
            value = numbers[d.first:d.first + math.prod(d.shape)].reshape(d.shape)
            if value.dtype != d.dtype:
                value = value.astype(d.dtype)
                value.flags.writeable = False
            values[k] = value
        self._last_derived = (sizes, values)
        return values

    def placed_reading(self, changed: tuple[int, ...]) -> tuple[int, ...]:
        """The placed values whose shape reads a symbol at one of the `changed` positions (of `symbols`): the
        others have the same shape at any sizes differing only there."""
        found = self._placed_reading.get(changed)
        if found is None:
            found = self._placed_reading[changed] = self._reading(self.placed, changed)
        return found

    def symbols_read(self, value: Derived | Placed) -> frozenset[int]:
        """The symbols (positions in `symbols`) that a derived value's numbers or a placed value's shape read,
        whether directly or through shape arithmetic: its dims' expressions are over the input symbols alone."""
        if self._dim_symbols is None:
            self._dim_symbols = symbols_of_dims(self.dims_source)
        return frozenset().union(*(self._dim_symbols[i] for i in value.dims))

    def _reading(self, values: Sequence[Derived | Placed], changed: tuple[int, ...]) -> tuple[int, ...]:
        """The positions in `values` of those that read a symbol at one of the `changed` positions."""
        return tuple(k for k, v in enumerate(values) if not self.symbols_read(v).isdisjoint(changed))

    def _compile_places(self) -> Callable[..., tuple[list, int]]:
        """The arena's offsets (`ArenaOrder.offsets_lines`) and each placed value's (offset, bytes, shape, dtype) as
        one function of the dims and the placed dtypes, compiled from straight-line source (evaluated for every new
        set of sizes)."""
        lines = self.arena.offsets_lines(self.n_derived_dims)
        entries = []
        for k, p in enumerate(self.placed):
            dims = [f"f[{p.first + i}]" for i in range(p.rank)]
            nbytes = "*".join(dims + [str(np.dtype(p.dtype).itemsize)])
            entries.append(f"(o{p.block}, {nbytes}, ({''.join(d + ', ' for d in dims)}), D[{k}])")
        lines.append(f"return [{', '.join(entries)}], arena_bytes")
        source = "def places(f, D):\n" + "".join(f"    {line}\n" for line in lines)
        namespace: dict[str, Any] = {"__builtins__": {"max": max}}
        exec(compile(source, "<carrack plan places>", "exec"), namespace)  # noqa: S102 - our own generated arithmetic
        return namespace["places"]

    def facts(self, dims: Mapping[str, int] | None = None) -> dict[str, Fact]:
        """What shape inference knows about every value of the plan's graph, with the symbols named in `dims`
        replaced by their sizes (inferred once per process; a new `dims` only substitutes)."""
        if self._facts is None:
            known = _input_facts(self.graph)
            for d in self.derived:
                value = np.empty(len(d.values), dtype=object)
                value[:] = d.values
                known[d.name] = Fact(known[d.name].type, value.reshape(d.shape))
            self._facts = infer(self.graph, self.model.opsets, known)
        if not dims:
            return dict(self._facts)
        sizes = {Sym(name): int(size) for name, size in dims.items()}
        return {name: _substitute(fact, sizes) for name, fact in self._facts.items()}

    def sizes_of(self, dims: Mapping[str, int]) -> tuple[int, ...]:
        """Symbol sizes in `bind` order from a name -> size mapping (as `InferenceSession.memory_plan` takes)."""
        missing = [s for s in self.symbols if s not in dims]
        if missing:
            raise KeyError(f"no size given for dim(s) {missing}")
        return tuple(int(dims[s]) for s in self.symbols)


def prepare_kernels(plan: Plan, kernels: Iterable[Any]) -> None:
    """Have the kernels that prepare per input shape (`Kernel.prepares_shapes`, e.g. convolutions binding their
    native call) do so in the plan's per-size evaluation: for every set of sizes the plan evaluates, before a run
    of those sizes starts. Kernels are never changed by a run."""
    by_key = {select.node_key(k.node): k for k in kernels if k.prepares_shapes}
    wanted = [(s.node, by_key[s.node]) for s in plan.shaped if s.node in by_key]
    if not wanted:
        return

    def prepare(bound: Bound) -> None:
        for key, kernel in wanted:
            kernel.prepare_shape(bound.shapes[key])

    plan.on_bind(prepare)


def _substitute(fact: Fact, sizes: Mapping[Sym, int]) -> Fact:
    t = fact.tensor
    if t is None or t.shape is None or all(isinstance(d, int) for d in t.shape):
        return fact
    shape = tuple(d if d is None or isinstance(d, int) else symbolic.evaluate(d, sizes) for d in t.shape)
    return Fact(TensorType(t.elem_type, shape))


def build_plan(model: Model, level: int, arena: bool = True, in_place: bool = False, numpy_only: bool = False
               ) -> Plan:
    """Optimize `model` at `level` and plan it for every input shape (see the module's docstring). `in_place`:
    the model's graph may be consumed (it is not cloned); `numpy_only`: every node runs its numpy implementation
    (else the selection table picks, carrack.plan.select)."""
    initialized = set(model.graph.initializers)
    inputs = [v for v in model.graph.inputs if v.name not in initialized]
    optimized, stats = optimize(model, level, in_place=in_place)
    graph = optimized.graph
    syms = _input_symbols(graph)
    facts = infer(graph, optimized.opsets, _input_facts(graph))
    if level > 0 and not reads_by_name(graph):
        if fold_known_values(graph, facts):
            view = GraphView(graph)
            remove_dead_nodes(view, stats)
            view.commit()
            optimize_graph(graph, Context(optimized.opsets), level, stats)
            facts = infer(graph, optimized.opsets, _input_facts(graph))
    if level >= EXTENDED and not numpy_only and blocked_layout.active() and not reads_by_name(graph):
        blocked = blocked_layout.apply_blocked_layout(graph, facts)
        if blocked:
            stats["blocked_layout"] = blocked
            facts = infer(graph, optimized.opsets, _input_facts(graph))
    derived_dims: list[DimLike] = []
    derived: list[Derived] = []
    if level > 0 and not reads_by_name(graph):
        derived = _extract_derived(graph, facts, set(syms), derived_dims, stats)
    placed: list[Placed] = []
    order = None
    dims = list(derived_dims)
    if arena:
        blocks, placed, shapes = _arena_blocks(graph, facts, set(syms), optimized.opsets, len(derived_dims))
        order = order_blocks(blocks, syms)
        position = {id(b): k for k, b in enumerate(order.blocks)}
        placed = [Placed(p.name, position[id(blocks[p.block])], p.first + len(blocks), p.rank, p.dtype)
                  for p in placed]
        dims += [b.size for b in order.blocks] + shapes
    shaped = _shaped_inputs(graph, facts, set(syms), optimized.opsets, dims)
    source = function_source(syms, dims)
    implementations = select.choose_all(graph, facts, numpy_only)
    return Plan(optimized, inputs, tuple(s.name for s in syms), derived, placed, order, source, len(derived_dims),
                stats, implementations, shaped)


def _shaped_inputs(graph: Graph, facts: Mapping[str, Fact], syms: set[Sym], opsets: Mapping[str, int],
                   dims: list[DimLike]) -> list[Shaped]:
    """The nodes whose kernels prepare per input shape (trait `prepares_shapes`) and whose first input's shape is
    known over the symbols: their shapes join the dims evaluated per run (appended to `dims`)."""
    shaped = []
    for node in graph.nodes:
        kernel = registry.traits(node, opsets)
        if kernel is None or not kernel.prepares_shapes or not node.inputs or not node.inputs[0]:
            continue
        shape = facts.get(node.inputs[0], Fact()).shape
        if shape is None or not all(_bindable(d, syms) for d in shape):
            continue
        shaped.append(Shaped(select.node_key(node), len(dims), len(shape)))
        dims.extend(_dim(d) for d in shape)
    return shaped


def _input_facts(graph: Graph) -> dict[str, Fact]:
    """Run inputs' facts with every non-fixed dim as the symbol it is bound under at run time."""
    return input_facts(graph, parse_names=False)


def _input_symbols(graph: Graph) -> list[Sym]:
    found: dict[Sym, None] = {}
    for fact in _input_facts(graph).values():
        for d in fact.shape or ():
            if isinstance(d, Sym):
                found[d] = None
    return list(found)


def _bindable(d: Any, syms: set[Sym]) -> bool:
    if isinstance(d, (bool, np.bool_)):
        return False
    if isinstance(d, (int, np.integer)):
        return True
    return isinstance(d, (Sym, Expr)) and symbols(d) <= syms


def _dim(x: Any) -> DimLike:
    return int(x) if isinstance(x, (int, np.integer)) else x


def _derivable(fact: Fact | None, syms: set[Sym]) -> bool:
    """Whether a value is known as numbers or expressions over the input symbols, of a type shape arithmetic makes."""
    if fact is None or fact.value is None or fact.tensor is None:
        return False
    dtype = numpy_dtype(fact.elem_type)
    return dtype is not None and dtype.kind in "iufb" and all(_bindable(x, syms) for x in fact.value.reshape(-1))


def _extract_derived(graph: Graph, facts: Mapping[str, Fact], syms: set[Sym], dims: list[DimLike],
                     stats: dict[str, int]) -> list[Derived]:
    """Remove nodes whose every output is known as an expression over the input symbols; their values become
    inputs of the plan's graph, computed per run from the sizes."""
    found: list[tuple[str, Fact]] = []
    kept: list[Node] = []
    for node in graph.nodes:
        named = [(o, facts.get(o)) for o in node.outputs if o]
        if (not named or not registry.is_pure(node.domain, node.op_type) or node.subgraphs()
                or not all(_derivable(f, syms) for _, f in named)):
            kept.append(node)
            continue
        found.extend(named)
    if len(kept) == len(graph.nodes):
        return []
    stats["shape_arithmetic_planned"] = stats.get("shape_arithmetic_planned", 0) + len(graph.nodes) - len(kept)
    graph.nodes = kept
    # only the values something still reads are computed per run (not the steps of the arithmetic)
    read = {o.name for o in graph.outputs} | {i for node in kept for i in node_reads(node)}
    derived: list[Derived] = []
    for name, fact in found:
        if name not in read:
            continue
        values = tuple(_dim(x) for x in fact.value.reshape(-1))
        derived.append(Derived(name, numpy_dtype(fact.elem_type).str, tuple(fact.value.shape), len(dims), values))
        dims.extend(values)
        graph.inputs.append(ValueInfo(name, TensorType(fact.elem_type, tuple(fact.value.shape))))
    view = GraphView(graph)
    remove_dead_nodes(view, stats)
    view.commit()
    return derived


def _arena_blocks(graph: Graph, facts: Mapping[str, Fact], syms: set[Sym], opsets: Mapping[str, int],
                  first_dim: int) -> tuple[list[Block], list[Placed], list[DimLike]]:
    """The blocks of every intermediate a kernel can write into a given buffer, with symbolic sizes and lifetimes;
    in-place ops share their input's block, views keep their source's block alive (traits of the kernel classes:
    `writes_into`, `in_place`, `view`)."""
    outputs = {o.name for o in graph.outputs}
    last_use: dict[str, int] = {}
    for step, node in enumerate(graph.nodes):
        for name in list(node.inputs) + [n for g in node.subgraphs() for n in g.free_names()]:
            last_use[name] = step
    blocks: list[Block] = []
    block_of: dict[str, int] = {}  # value -> block holding its bytes
    view_of: dict[str, int] = {}  # value -> block it may be a view of
    placed: list[Placed] = []
    shapes: list[DimLike] = []
    for step, node in enumerate(graph.nodes):
        kernel = registry.traits(node, opsets)
        first = node.inputs[0] if node.inputs else ""
        src = view_of.get(first, block_of.get(first))
        for name in node.outputs:
            if not name:
                continue
            end = len(graph.nodes) if name in outputs else last_use.get(name, step)
            if kernel is not None and kernel.view and src is not None:
                view_of[name] = src
                blocks[src].end = max(blocks[src].end, end)
        if len(node.outputs) != 1 or not node.outputs[0] or not node.inputs or kernel is None \
                or not kernel.writes_into():
            continue
        name = node.outputs[0]
        fact = facts.get(name, Fact())
        dtype = numpy_dtype(fact.elem_type)
        if (name in outputs or name in view_of or fact.shape is None or dtype is None or dtype.kind == "O"
                or not _named_by_str(dtype) or not all(_bindable(d, syms) for d in fact.shape)):
            continue
        shape = [_dim(d) for d in fact.shape]
        size: DimLike = dtype.itemsize
        for d in shape:
            size = symbolic.mul(size, d)
        end = last_use.get(name, step)
        if (kernel.in_place and src is not None and first not in view_of
                and blocks[src].size == size and blocks[src].end <= step):
            blocks[src].end = max(blocks[src].end, end)
            block = src
        else:
            block = len(blocks)
            blocks.append(Block(name, size, step, end))
        block_of[name] = block
        placed.append(Placed(name, block, first_dim + len(shapes), len(fact.shape), dtype.str))
        shapes.extend(shape)
    return blocks, placed, shapes


def check_placed(placed: list[Placed], places: list[tuple | None], arena_bytes: int) -> None:
    """Refuse input sizes that make a placed value or the arena larger than the memory limit or the machine
    (InvalidArgument / MemoryLimitExceeded naming the largest value), before any run allocates them."""
    if arena_bytes < CHECK_THRESHOLD:
        return
    sizes = [(place[1], p.name, place[2]) for p, place in zip(placed, places) if place is not None]
    nbytes, name, shape = max(sizes, default=(0, "", ()))
    if nbytes >= CHECK_THRESHOLD:
        check_allocation(nbytes, f"value '{name}' (shape {list(shape)})")
    check_allocation(arena_bytes, f"the run's arena (largest value '{name}', shape {list(shape)})")


def _named_by_str(dtype: np.dtype) -> bool:
    """Whether numpy reads `dtype.str` back (Placed keeps that string): not ml_dtypes' float8 types ('<f1')."""
    try:
        np.dtype(dtype.str)
    except TypeError:
        return False
    return True
