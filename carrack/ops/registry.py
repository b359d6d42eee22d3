"""The operator registry: kernels by (domain, op_type), each valid from an opset version on.

A kernel class handles one operator from the schema version given as ``since`` until the next registered class
for the same operator. At build time a node's opset resolves to the schema version in force (the ONNX rule: the
newest schema version not above the model's opset), and that version picks the kernel and is passed to it, so
one class can still branch on ``self.version`` for small differences.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np
import onnx

from carrack.errors import InvalidModel
from carrack.ir.graph import Node, canonical_domain
from carrack.runtime.allocator import check_shape

if TYPE_CHECKING:
    from carrack.runtime.program import BuildContext

_REGISTRY: dict[tuple[str, str], list[tuple[int, type[Kernel]]]] = {}
_Loaded = TypeVar("_Loaded")

class Kernel:
    """One operator instance: parses its attributes once (``setup``), then runs many times (``run``).

    ``run(*inputs)`` receives numpy arrays (``None`` for omitted optional inputs; lists for sequences) and returns
    one array, or a tuple when the node has several outputs (or its single output is a sequence/optional).
    Kernels never modify their inputs; session state is immutable, so one kernel may run in several threads.
    """

    op_type: str = ""
    domain: str = ""
    since: int = 1
    # traits the planner reads from the class (never per instance):
    #: the outputs are a function of the inputs (False: random draws, Dropout's mask); only pure nodes are
    #: evaluated ahead of a run, by constant folding, shape inference or the plan
    pure: ClassVar[bool] = True
    #: the output may overwrite the first input (same shape and dtype, each element read before it is written)
    in_place: ClassVar[bool] = False
    #: the output may be a view of the first input (no bytes of its own)
    view: ClassVar[bool] = False
    #: the kernel prepares per input shape (`prepare_shape`), called by the plan's per-size evaluation
    prepares_shapes: ClassVar[bool] = False

    @classmethod
    def scratch_bytes(cls, node: Node, facts: Mapping[str, Any]) -> int:
        """Working memory beyond its outputs while it runs, from what shape inference knows about `node`'s values
        (`facts`; 0: none, or not known): the memory report counts it."""
        return 0

    @classmethod
    def prepared_bytes(cls, node: Node, constants: Mapping[str, Any]) -> int:
        """Bytes the kernel keeps beside the graph's constants once prepared (e.g. weights repacked for its native
        code), from `node`'s constant inputs (`constants`: the graph's initializers); the memory report counts
        them with the weights."""
        return 0

    @classmethod
    def writes_into(cls) -> bool:
        """Whether the kernel can compute its single output into a buffer it is given (`run_into`, or `_into`
        offered per node by `carrack.ops.contrib.offer_run_into`)."""
        return (hasattr(cls, "run_into") or hasattr(cls, "_into")) and cls.execute is Kernel.execute

    def __init__(self, node: Node, version: int, ctx: BuildContext | None = None):
        self.node = node
        self.version = version
        self.ctx = ctx
        #: the implementation the plan chose for this node ("native", "numpy": carrack.plan.select), fixed here
        self.implementation = _implementation(node, ctx)
        self.setup()

    def if_native(self, load: Callable[[], _Loaded]) -> _Loaded | None:
        """`load()` (a native library or kernel set) when this node runs its native implementation, else None:
        the kernel's numpy path then runs."""
        return load() if self.implementation == "native" else None

    def setup(self) -> None:
        """Read attributes; raise InvalidModel (via `self.fail`) for bad ones."""

    def prepare_shape(self, shape: tuple[int, ...]) -> None:
        """Kernels with `prepares_shapes`: get ready for runs whose first input has `shape` (before any run)."""

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attrs.get(name, default)

    def required_attr(self, name: str) -> Any:
        if name not in self.node.attrs:
            self.fail(f"attribute '{name}' is required")
        return self.node.attrs[name]

    def fail(self, message: str) -> None:
        raise InvalidModel(f"{self.node.label()}: {message}")

    def check_output(self, shape: Sequence[int], dtype: Any, index: int = 0) -> None:
        """Before allocating output `index` of `shape`: refuse it when it is beyond the session's memory limit or
        the machine's memory (see carrack.runtime.allocator.check_shape), naming this node and the value."""
        check_shape(shape, dtype, lambda: self._output_label(index))

    def _output_label(self, index: int) -> str:
        name = self.node.outputs[index] if index < len(self.node.outputs) else f"#{index}"
        return f"{self.node.label()} output {name!r}"

    def prepare(self, constants: Sequence[Any]) -> None:
        """Called once by the executor when it is built, with the node's constant input values (None where an
        input is not a constant): a kernel may check and keep there what does not depend on a run (a weight's
        dtype and layout), so that `run`/`run_into` only check the run's own values. Kernels stay immutable
        after this. A kernel that is never prepared (shape inference, constant folding) must still work."""

    def bind_into(self, out: Any, *inputs: Any) -> Callable[[], Any] | None:
        """A call without arguments that does what `run_into(out, *inputs)` does for these very arrays, or None
        (the default: the step keeps its `run_into`). The executor asks a step whose `out` and inputs are all the
        same objects every run (views of a reused arena, constants): only their contents change between calls,
        never their shape, dtype or layout, so the checks and views a `run_into` makes per call are made here
        once. The call must write its whole result into `out`."""
        return None

    def run(self, *inputs: Any) -> Any:
        raise NotImplementedError

    def execute(self, inputs: Sequence[Any], scope: Mapping[str, Any]) -> Any:
        """What the executor calls; control-flow kernels override it to see outer-scope values."""
        return self.run(*inputs)


def bound_or_run_into(call: Callable[[], bool], run_into: Callable[..., Any], out: np.ndarray,
                      *args: Any) -> Callable[[], None]:
    """A bound step's call (`Kernel.bind_into`): the prepared native `call`, or, where it fails (returns False: out
    of memory), the kernel's `run_into(out, *args)` with its result put in `out`."""
    def bound() -> None:
        if not call():
            y = run_into(out, *args)
            if y is not out:
                np.copyto(out, y)
    return bound


def _implementation(node: Node, ctx: BuildContext | None) -> str:
    if ctx is not None:
        return ctx.implementation_of(node)
    from carrack.plan import select

    return select.choose(node)


def is_pure(domain: str, op_type: str) -> bool:
    """False when any kernel registered for the op draws random numbers (whatever the opset)."""
    return all(cls.pure for _, cls in _REGISTRY.get((canonical_domain(domain), op_type), ()))


def traits(node: Node, opsets: Mapping[str, int]) -> type[Kernel] | None:
    """The kernel class that will run `node` (its traits are what the planner reads), or None."""
    opset = node.opset or opsets.get(node.domain) or default_opset(node.domain)
    return resolve(node.domain, node.op_type, opset)[0]


def register(op_type: str | Sequence[str], since: int = 1, domain: str = "") -> Callable[[type], type]:
    """Class decorator: ``@register("Relu", since=6)``; several op types may share one class."""
    names = [op_type] if isinstance(op_type, str) else list(op_type)

    def wrap(cls: type[Kernel]) -> type[Kernel]:
        for name in names:
            entries = _REGISTRY.setdefault((canonical_domain(domain), name), [])
            entries[:] = [e for e in entries if e[0] != since] + [(since, cls)]
            entries.sort(key=lambda e: e[0])
        if not cls.op_type:
            cls.op_type = names[0]
        cls.domain = canonical_domain(domain)
        cls.since = since
        return cls

    return wrap


@functools.lru_cache(maxsize=4096)
def schema_version(domain: str, op_type: str, opset: int) -> int | None:
    """The since_version of the schema in force at `opset`, or None if ONNX knows no such schema."""
    try:
        return onnx.defs.get_schema(op_type, max_inclusive_version=opset, domain=domain).since_version
    except onnx.defs.SchemaError:
        return None


@functools.lru_cache(maxsize=4096)
def schema(domain: str, op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, max_inclusive_version=opset, domain=domain)
    except onnx.defs.SchemaError:
        return None


def default_opset(domain: str) -> int:
    """Newest opset of a domain that the installed onnx knows (1 for custom domains)."""
    return onnx.defs.onnx_opset_version() if domain == "" else _domain_max().get(domain, 1)


@functools.lru_cache(maxsize=1)
def _domain_max() -> dict[str, int]:
    # onnx's version map answers in microseconds; walking every schema (get_all_schemas_with_history) takes ~5 ms
    return {canonical_domain(d): hi for d, (_lo, hi) in onnx.defs.C.schema_version_map().items()}


def resolve(domain: str, op_type: str, opset: int) -> tuple[type[Kernel] | None, int]:
    """The kernel class for an op at a model opset, and the schema version it runs as."""
    entries = _REGISTRY.get((domain, op_type))
    version = schema_version(domain, op_type, opset) if domain in ("", "ai.onnx.ml", "ai.onnx.preview.training",
                                                                    "ai.onnx.preview") else None
    if version is None:
        version = opset
    if not entries:
        return None, version
    chosen = None
    for since, cls in entries:
        if since <= version:
            chosen = cls
    return chosen, version


def registered_ops() -> list[tuple[str, str, int]]:
    return sorted((d, op, since) for (d, op), es in _REGISTRY.items() for since, _ in es)
