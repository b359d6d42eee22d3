"""What a rewrite rule is: a function matching at one node of a `GraphView`, with the level it belongs to.

Rules are collected per module in a `RuleSet` (no global registry); `carrack.passes.optimizer.PIPELINE` lists the
rule sets in the order they run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from carrack.ir.graph import Node
from carrack.ops import registry
from carrack.passes.graph_view import GraphView

BASIC, EXTENDED, ALL = 1, 2, 99

RuleFn = Callable[[Node, GraphView, "Context"], bool]


@dataclass(frozen=True)
class Rewrite:
    name: str
    ops: frozenset[str] | None  # op types the rule looks at (None: every node)
    level: int
    fn: RuleFn


class RuleSet:
    """An ordered list of rules, filled by the `rewrite` decorator of the module that defines them."""

    def __init__(self, name: str):
        self.name = name
        self._rules: list[Rewrite] = []

    def rewrite(self, name: str, *ops: str, level: int = EXTENDED) -> Callable[[RuleFn], RuleFn]:
        """Add a rule ``fn(node, view, ctx) -> changed`` that looks at nodes of the given op types."""

        def wrap(fn: RuleFn) -> RuleFn:
            self._rules.append(Rewrite(name, frozenset(ops) if ops else None, level, fn))
            return fn

        return wrap

    def __iter__(self) -> Iterator[Rewrite]:
        return iter(self._rules)


@dataclass
class Context:
    opsets: Mapping[str, int]
    facts: dict | None = None  # shape facts, when the caller computed them (bound input shapes)

    def version(self, node: Node) -> int:
        opset = node.opset or self.opsets.get(node.domain) or registry.default_opset(node.domain)
        return registry.resolve(node.domain, node.op_type, opset)[1]
