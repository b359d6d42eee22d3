"""BASIC rules: remove what cannot matter at inference (Identity, inference-mode Dropout) and fold constants."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from carrack.errors import InvalidModel
from carrack.ir.graph import Graph, Node, canonical_domain
from carrack.onnx.validate import check_static_shape
from carrack.ops import registry
from carrack.passes.graph_view import GraphView
from carrack.passes.lazy_facts import context_fact as _fact
from carrack.passes.rewrite import BASIC, Context, RuleSet
from carrack.runtime.allocator import physical_memory_bytes

#: tract's cap: constant folding never creates a constant larger than this
FOLD_LIMIT_BYTES = 4 * 2**20

RULES = RuleSet("basic")


def fold_known_values(graph: Graph, facts: Mapping, limit_bytes: int = FOLD_LIMIT_BYTES) -> int:
    """Replace nodes whose every output is a known constant (per `facts`) by initializers; returns how many."""
    keep, folded = [], 0
    for node in graph.nodes:
        outs = [facts.get(o) for o in node.outputs if o]
        if (_foldable(node) and outs and all(f is not None and f.is_concrete() for f in outs)
                and sum(f.value.nbytes for f in outs) <= limit_bytes):
            for name in node.outputs:
                if name:
                    graph.initializers[name] = np.asarray(facts[name].value)
            folded += 1
        else:
            keep.append(node)
    graph.nodes = keep
    return folded


# -- basic -------------------------------------------------------------------------------------------------------------

@RULES.rewrite("identity_removal", "Identity", level=BASIC)
def remove_identity(node: Node, view: GraphView, ctx: Context) -> bool:
    if node.domain or not node.inputs or not node.inputs[0]:
        return False
    return view.bypass(node, node.inputs[0], node.outputs[0])


@RULES.rewrite("dropout_removal", "Dropout", level=BASIC)
def remove_dropout(node: Node, view: GraphView, ctx: Context) -> bool:
    """Dropout is the identity at inference unless training_mode is a true constant (or a runtime input)."""
    if len(node.outputs) > 1 and node.outputs[1] and view.n_uses(node.outputs[1]):
        return False
    if len(node.inputs) > 2 and node.inputs[2]:
        mode = view.const(node.inputs[2])
        if mode is None or bool(mode):
            return False
    if ctx.version(node) < 7 and not node.attrs.get("is_test", 0):
        # opset < 7 Dropout in training mode scales; in inference mode (is_test) it is the identity
        return False
    return view.bypass(node, node.inputs[0], node.outputs[0])


@RULES.rewrite("cast_removal", "Cast", level=BASIC)
def remove_same_type_cast(node: Node, view: GraphView, ctx: Context) -> bool:
    """A Cast to the type its input already has is the identity."""
    if node.domain or not node.inputs or not node.inputs[0] or "to" not in node.attrs:
        return False
    source_type = _fact(view, ctx, node.inputs[0]).elem_type
    if not source_type or source_type != node.attrs["to"]:
        return False
    return view.bypass(node, node.inputs[0], node.outputs[0])


@RULES.rewrite("concat_removal", "Concat", level=BASIC)
def remove_single_input_concat(node: Node, view: GraphView, ctx: Context) -> bool:
    """A Concat of one tensor is that tensor (kept when its axis is known to be out of range: the run reports it)."""
    if node.domain or len(node.inputs) != 1 or not node.inputs[0]:
        return False
    rank = _fact(view, ctx, node.inputs[0]).rank
    axis = node.attrs.get("axis")
    if rank is not None and (rank == 0 or not isinstance(axis, int) or not -rank <= axis < rank):
        return False
    return view.bypass(node, node.inputs[0], node.outputs[0])


# -- common subexpressions ---------------------------------------------------------------------------------------------

#: constants (initializers, Constant values, tensor attributes) up to this size are compared by contents; larger
#: ones only by name, so that keying a node never reads a weight
CSE_CONTENT_BYTES = 4096

#: never merged even where a kernel would call itself pure: two draws are two different values
_RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
                         "Multinomial", "Dropout"})


@RULES.rewrite("common_subexpression_elimination", level=BASIC)
def merge_common_subexpression(node: Node, view: GraphView, ctx: Context) -> bool:
    """Two nodes of the same op, attributes and inputs compute the same values: the later readers read the first's.
    Nodes are found by a hash of that key (one table per view), so a round costs one lookup per node."""
    if not _mergeable(node, ctx):
        return False
    key = _cse_key(node, view)
    if key is None:
        return False
    table = _cse_table(view, ctx)
    seen = table.get(key)
    if seen is None or seen is node or not view.alive(seen) or _cse_key(seen, view) != key:
        table[key] = node  # a stale entry (merged away or rewired since) is simply replaced
        return False
    keep, drop = seen, node
    if _feeds_graph_output(drop, view) and not _feeds_graph_output(keep, view):
        keep, drop = drop, keep  # the node that names a graph output stays, so the output keeps its name
    table[key] = keep
    view.remove([drop])
    renames = []
    for kept_name, dropped_name in zip(keep.outputs, drop.outputs):
        if not dropped_name:
            continue
        if dropped_name in view.outputs:
            renames.append(Node("Identity", [kept_name], [dropped_name], name=f"{drop.name or dropped_name}_cse"))
        else:
            view.redirect(dropped_name, kept_name)
    if renames:
        view.replace([], renames)
    return True


#: domains whose operators carrack implements to their specification; an op of another domain is a kernel a user
#: registered, which may have effects beyond its outputs (a counter, a log, a barrier), so it is never merged
_SPEC_DOMAINS = frozenset({canonical_domain(""), "ai.onnx.ml", "com.microsoft"})


def _mergeable(node: Node, ctx: Context) -> bool:
    if node.op_type in _RANDOM_OPS or node.op_type == "Identity" or not node.outputs or node.subgraphs():
        return False  # an Identity is only left where it renames a graph output: merging it would loop
    if canonical_domain(node.domain) not in _SPEC_DOMAINS:
        return False
    kernel = registry.traits(node, ctx.opsets)
    return kernel is not None and kernel.pure


def _feeds_graph_output(node: Node, view: GraphView) -> bool:
    return any(o in view.outputs for o in node.outputs if o)


def _cse_table(view: GraphView, ctx: Context) -> dict:
    slot = ctx.__dict__.get("_cse_table")
    if slot is None or slot[0] is not view:
        slot = ctx.__dict__["_cse_table"] = (view, {})
    return slot[1]


def _cse_key(node: Node, view: GraphView) -> tuple | None:
    inputs = []
    for name in node.inputs:
        value = view.const(name) if name else None
        inputs.append(name if value is None else _content_key(value, name))
    try:
        attrs = tuple(sorted((k, _attr_key(v)) for k, v in node.attrs.items()))
    except TypeError:  # an attribute kind with no order or hash: leave the node alone
        return None
    outputs = tuple(bool(o) for o in node.outputs)
    return node.domain, node.op_type, node.opset, tuple(inputs), attrs, outputs


def _content_key(value: np.ndarray, name: str) -> tuple:
    value = np.asarray(value)
    if value.dtype == object or value.nbytes > CSE_CONTENT_BYTES:
        return ("name", name)
    return ("tensor", value.dtype.str, value.shape, value.tobytes())


def _attr_key(value: object) -> object:
    if isinstance(value, float):
        return ("float", value.hex())  # 0.0 == -0.0 in Python, and they are different attributes
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        if value.dtype == object or value.nbytes > CSE_CONTENT_BYTES:
            return ("array", id(value))
        return ("tensor", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_attr_key(v) for v in value)
    if isinstance(value, (int, str, bytes)) or value is None:
        return value
    hash(value)  # raises TypeError for what cannot be a key
    return ("object", type(value).__name__, value)


_CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def _foldable(node: Node) -> bool:
    return node.op_type not in _CONTROL_FLOW and registry.is_pure(node.domain, node.op_type)


@RULES.rewrite("constant_folding", level=BASIC)
def fold_constants(node: Node, view: GraphView, ctx: Context) -> bool:
    """Evaluate a node whose inputs are all constants, if its outputs stay under the size cap."""
    if not _foldable(node) or node.op_type == "Constant" or not node.outputs:
        return False
    values = []
    for name in node.inputs:
        if not name:
            values.append(None)
            continue
        v = view.const(name)
        if v is None:
            return False
        values.append(v)
    if node.op_type == "ConstantOfShape" and not node.domain and values and values[0] is not None:
        return _fold_uniform(node, view, values[0])
    if ctx.facts is None and _estimated_bytes(node, values) > FOLD_LIMIT_BYTES:
        return False
    opset = node.opset or ctx.opsets.get(node.domain) or registry.default_opset(node.domain)
    cls, version = registry.resolve(node.domain, node.op_type, opset)
    if cls is None:
        return False
    try:
        with np.errstate(all="ignore"):
            result = cls(node, version, None).run(*values)
    except Exception:  # noqa: BLE001 - leave it to run time, where the error names the node
        return False
    outs = result if type(result) is tuple else (result,)
    if not all(isinstance(o, (np.ndarray, np.generic)) for o in outs):
        return False
    if sum(np.asarray(o).nbytes for o in outs) > FOLD_LIMIT_BYTES:
        return False
    for name, value in zip(node.outputs, outs):
        if name:
            view.graph.initializers[name] = np.asarray(value)
    view.remove([node])
    return True


def _fold_uniform(node: Node, view: GraphView, shape: np.ndarray) -> bool:
    """ConstantOfShape of a known shape: a read-only broadcast view of one value, so any size costs no memory."""
    value = node.attrs.get("value")
    scalar = np.asarray(value).reshape(-1)[:1] if isinstance(value, np.ndarray) else np.zeros(1, np.float32)
    dims = tuple(int(d) for d in np.asarray(shape).reshape(-1))
    if any(d < 0 for d in dims) or scalar.size != 1:
        return False
    where = f"{node.label()} output '{node.outputs[0]}'"
    check_static_shape(list(dims), scalar.itemsize, where)
    nbytes = math.prod(dims) * scalar.itemsize
    if nbytes > physical_memory_bytes():  # free as a broadcast view, but no kernel could ever materialize it
        raise InvalidModel(f"{where} has shape {list(dims)}: {nbytes:,} bytes, more than this machine's memory")
    view.graph.initializers[node.outputs[0]] = np.broadcast_to(scalar.reshape(()), dims)
    view.remove([node])
    return True


def _estimated_bytes(node: Node, values: list) -> int:
    """A cheap upper guess of a fold's output size, so that Expand/Tile/ConstantOfShape blow-ups are not even tried."""
    sizes = [v.nbytes for v in values if isinstance(v, np.ndarray)]
    if node.op_type in ("ConstantOfShape", "Expand", "Tile", "Range", "EyeLike"):
        shape_like = values[-1] if node.op_type != "Range" else None
        if node.op_type == "ConstantOfShape" and isinstance(values[0], np.ndarray):
            return int(np.prod(values[0].astype(np.float64))) * 8
        if node.op_type in ("Expand", "Tile") and isinstance(shape_like, np.ndarray):
            base = values[0]
            factor = float(np.prod(np.maximum(shape_like.astype(np.float64), 1)))
            return int(base.itemsize * max(factor, base.size) * (base.size if node.op_type == "Tile" else 1))
        if node.op_type == "Range":
            try:
                n = abs((float(values[1]) - float(values[0])) / float(values[2]))
            except (TypeError, ValueError, ZeroDivisionError, IndexError):
                return FOLD_LIMIT_BYTES + 1
            return int(n * 8)
    return max(sizes, default=0)
