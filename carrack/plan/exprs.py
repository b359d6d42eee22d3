"""Symbolic dims compiled to Python: many expressions over the same symbols become one function of their sizes.

A plan keeps the source text (plain data, picklable) and compiles it once per process; evaluating every shape,
size and shape-arithmetic value of a model for a new set of input sizes is then one call.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence

from carrack.ir.dims import Sym
from carrack.ir.symbolic import DimLike, Expr, OpAtom


def dim_source(d: DimLike, names: dict[Sym, str]) -> str:
    """Python source computing `d` from variables named by `names` (symbol -> identifier)."""
    if isinstance(d, bool):
        raise TypeError(f"not a dim: {d!r}")
    if isinstance(d, int):
        return str(int(d))
    if isinstance(d, Sym):
        return names[d]
    if not isinstance(d, Expr):
        raise TypeError(f"not a dim: {d!r}")
    terms = []
    for mono, c in d.terms.items():
        factors = [_atom_source(a, names) for a in mono]
        if c != 1 or not factors:
            factors.insert(0, str(c))
        terms.append("*".join(factors))
    return "(" + " + ".join(terms) + ")" if terms else "0"


def _atom_source(a: Sym | OpAtom, names: dict[Sym, str]) -> str:
    if isinstance(a, Sym):
        return names[a]
    args = [dim_source(x, names) for x in a.args]
    if a.op == "floordiv":
        return f"({args[0]} // {args[1]})"
    if a.op == "mod":
        return f"({args[0]} % {args[1]})"
    return f"{a.op}({', '.join(args)})"


def function_source(symbols: Sequence[Sym], dims: Sequence[DimLike]) -> str:
    """Source of ``lambda s0, s1, ...: (d0, d1, ...)`` computing `dims` from the symbols' sizes."""
    names = {s: f"s{k}" for k, s in enumerate(symbols)}
    body = ", ".join(dim_source(d, names) for d in dims)
    return f"lambda {', '.join(names.values())}: ({body}{',' if len(dims) == 1 else ''})"


def symbols_of_dims(source: str) -> list[frozenset[int]]:
    """Per dim of a dims function's source (`function_source`), the positions of the symbols it reads (`s<k>`
    is the k-th symbol), whether as a term or inside min, max, floordiv or mod."""
    body = ast.parse(source, mode="eval").body
    dims = body.body.elts if isinstance(body, ast.Lambda) and isinstance(body.body, ast.Tuple) else None
    if dims is None:
        raise ValueError(f"not a dims function: {source[:60]!r}")
    return [frozenset(int(n.id[1:]) for n in ast.walk(d) if isinstance(n, ast.Name) and _is_symbol_name(n.id))
            for d in dims]


def _is_symbol_name(name: str) -> bool:
    return name[:1] == "s" and name[1:].isdigit()


def compile_function(source: str) -> Callable[..., tuple[int, ...]]:
    return eval(compile(source, "<carrack plan dims>", "eval"), {"__builtins__": {"min": min, "max": max}})  # noqa: S307 - our own generated arithmetic
