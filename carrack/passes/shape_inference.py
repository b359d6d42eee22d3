"""Static type and shape inference over carrack's IR, with symbolic dims; it never gives up.

Every value gets a `Fact`. Graph-input dims are symbols (named ``dim_param``s keep their names; anonymous ones get
fresh names), so ``Shape(x)`` is a symbolic tensor and Gather/Concat/Reshape/Expand/ConstantOfShape chains are
computed on symbols. Annotations in ``value_info`` and graph outputs are hints: used only where the graph itself
proves nothing. What stays unknown is simply left unknown (``Fact()``) and is resolved at run time; no rule raises
on an unresolved dim. Small all-constant subexpressions are evaluated with the real kernels.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import numpy as np

from carrack.ir.dims import Sym, binding_name
from carrack.ir.graph import Graph, Node
from carrack.ir.symbolic import DimLike, complexity, parse
from carrack.ir.types import TensorType
from carrack.ops import registry
from carrack.passes.facts import MAX_CARRIED_ELEMENTS, Fact, const_fact

Rule = Callable[[Node, list[Fact], int], list[Fact]]
RULES: dict[tuple[str, str], Rule] = {}


def rule(*op_types: str, domain: str = "") -> Callable[[Rule], Rule]:
    def wrap(fn: Rule) -> Rule:
        for op in op_types:
            RULES[(domain, op)] = fn
        return fn

    return wrap


def input_facts(graph: Graph, bindings: Mapping[str, int] | None = None, parse_names: bool = True) -> dict[str, Fact]:
    """Facts for graph inputs: declared dims, named ones as symbols, anonymous ones as fresh symbols. A dim_param
    such as ``4*batch`` is parsed into an expression unless `parse_names` is False (then every non-fixed dim is the
    one symbol a run binds it under)."""
    facts = {}
    for v in graph.inputs:
        if v.name in graph.initializers:
            continue
        t = v.type
        if isinstance(t, TensorType) and t.shape is not None:
            dims = tuple(_input_dim(d, v.name, axis, bindings or {}, parse_names) for axis, d in enumerate(t.shape))
            facts[v.name] = Fact(TensorType(t.elem_type, dims))
        else:
            facts[v.name] = Fact(t)
    return facts


def _input_dim(d, name: str, axis: int, bindings: Mapping[str, int], parse_names: bool) -> DimLike:
    if isinstance(d, int):
        return d
    label = binding_name(d, name, axis)
    if label in bindings:
        return int(bindings[label])
    return parse(label) if parse_names and label == getattr(d, "name", None) else Sym(label)


def infer(graph: Graph, opsets: Mapping[str, int], facts: dict[str, Fact] | None = None,
          outer: Mapping[str, Fact] | None = None) -> dict[str, Fact]:
    """Facts for every value of `graph` (inputs, initializers, node outputs)."""
    known: dict[str, Fact] = dict(outer or {})
    known.update(facts if facts is not None else input_facts(graph))
    for name, arr in graph.initializers.items():
        if name not in known or name not in {v.name for v in graph.inputs}:
            known[name] = const_fact(arr, _elem_type(arr))
    hints = {**{v.name: v for v in graph.outputs}, **graph.value_info}
    for node in graph.nodes:
        ins = [known.get(i, Fact()) if i else Fact() for i in node.inputs]
        outs = infer_node(node, ins, opsets)
        for name, fact in zip(node.outputs, outs):
            if name:
                known[name] = _with_hint(fact, hints.get(name))
    return known


def infer_node(node: Node, ins: list[Fact], opsets: Mapping[str, int]) -> list[Fact]:
    opset = node.opset or opsets.get(node.domain) or registry.default_opset(node.domain)
    cls, version = registry.resolve(node.domain, node.op_type, opset)
    folded = _fold(node, ins, cls, version)
    if folded is not None:
        return folded
    fn = RULES.get((node.domain, node.op_type))
    if fn is not None:
        try:
            outs = fn(node, ins, version)
        except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError):
            outs = []  # a rule that cannot decide leaves the outputs unknown
    else:
        outs = []
    outs = [_bounded(f) for f in outs]
    return outs + [Fact()] * (len(node.outputs) - len(outs))


#: a dim expression bigger than this is dropped to unknown (resolved at run time) rather than carried along
MAX_DIM_COMPLEXITY = 64


def _bounded(fact: Fact) -> Fact:
    t = fact.tensor
    if t is None:
        return fact
    value = fact.value
    if value is not None and value.dtype == object and any(complexity(v) > MAX_DIM_COMPLEXITY
                                                           for v in value.reshape(-1)):
        value = None
    shape = t.shape
    if shape is not None and any(d is not None and complexity(d) > MAX_DIM_COMPLEXITY for d in shape):
        shape = tuple(None if d is not None and complexity(d) > MAX_DIM_COMPLEXITY else d for d in shape)
    if value is fact.value and shape is t.shape:
        return fact
    return Fact(TensorType(t.elem_type, shape), value)


def _fold(node: Node, ins: list[Fact], cls, version: int) -> list[Fact] | None:
    """Run the real kernel when every input is a small known constant (shape arithmetic, mostly)."""
    if cls is None or node.subgraphs() or not cls.pure:
        return None
    if not all(f.is_concrete() for f, name in zip(ins, node.inputs) if name):
        return None
    try:
        kernel = cls(node, version, None)
        with np.errstate(all="ignore"):
            result = kernel.run(*[f.value if name else None for f, name in zip(ins, node.inputs)])
    except Exception:  # noqa: BLE001 - leave it to run time
        return None
    outs = result if type(result) is tuple else (result,)
    facts = []
    for o in outs:
        if not isinstance(o, (np.ndarray, np.generic)) or np.asarray(o).size > MAX_CARRIED_ELEMENTS:
            return None
        o = np.asarray(o)
        facts.append(const_fact(o, _elem_type(o)))
    return facts


def _elem_type(arr: np.ndarray) -> int:
    from carrack.ir.dtypes import to_onnx

    try:
        return to_onnx(arr.dtype)
    except ValueError:
        return 0


def _with_hint(fact: Fact, hint) -> Fact:
    """Use an annotation only where inference proved nothing; the graph always wins."""
    if hint is None or not isinstance(hint.type, TensorType):
        return fact
    t = fact.tensor
    if fact.type is None:
        return Fact(_anonymise(hint.type), fact.value)
    if t is not None and t.shape is None and hint.type.shape is not None:
        return Fact(TensorType(t.elem_type or hint.type.elem_type, _anonymise(hint.type).shape), fact.value)
    return fact


_fresh = itertools.count()


def _anonymise(t: TensorType) -> TensorType:
    """Hints keep their ints; their names (unk__N and friends) are not trusted, so each becomes a fresh symbol."""
    if t.shape is None:
        return t
    return TensorType(t.elem_type, tuple(d if isinstance(d, int) else Sym(f"hint{next(_fresh)}") for d in t.shape))


from carrack.passes import shape_rules as _rules  # noqa: E402, F401 - registers the rules
