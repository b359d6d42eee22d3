"""A small symbolic integer algebra for tensor dims.

A dim is an ``int`` or an `Expr`: an integer polynomial over *atoms*, where an atom is a named symbol (`Sym`) or an
opaque operation that does not distribute (floor division or remainder by a constant, min, max). Expressions are
kept in a canonical form, so two dims that are provably equal compare equal, and an expression with no symbols
left is returned as a plain ``int``. Good enough for the Shape -> Gather -> Concat -> Reshape chains exporters write.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Union

from carrack.ir.dims import Sym

Monomial = tuple["Atom", ...]  # sorted atoms, repeated for powers; () is the constant term
DimLike = Union[int, "Expr", Sym]


@dataclass(frozen=True)
class OpAtom:
    """An operation kept whole: ('floordiv', x, c), ('mod', x, c), ('min', a, b, ...), ('max', ...)."""

    op: str
    args: tuple[DimLike, ...]

    def __str__(self) -> str:
        if self.op in ("floordiv", "mod"):
            sym = "//" if self.op == "floordiv" else "%"
            return f"({_fmt(self.args[0])}{sym}{_fmt(self.args[1])})"
        return f"{self.op}({', '.join(_fmt(a) for a in self.args)})"


Atom = Sym | OpAtom


def _atom_key(a: Atom) -> str:
    return str(a)


class Expr:
    __slots__ = ("terms", "_hash")

    def __init__(self, terms: Mapping[Monomial, int]):
        self.terms = {m: c for m, c in terms.items() if c != 0}
        self._hash = hash(frozenset(self.terms.items()))

    # construction -------------------------------------------------------------------------------------------------
    @staticmethod
    def atom(a: Atom) -> Expr:
        return Expr({(a,): 1})

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (int, Sym)):
            other = lift(other)
        return isinstance(other, Expr) and self.terms == other.terms

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (Expr, (self.terms,))  # the hash is recomputed: string hashes differ between processes

    def __repr__(self) -> str:
        return f"Expr({self})"

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for mono, c in sorted(self.terms.items(), key=lambda mc: (len(mc[0]) == 0, [_atom_key(a) for a in mc[0]])):
            body = "*".join(str(a) for a in mono)
            if not body:
                parts.append(str(c))
            elif c == 1:
                parts.append(body)
            elif c == -1:
                parts.append(f"-{body}")
            else:
                parts.append(f"{c}*{body}")
        return "+".join(parts).replace("+-", "-")

    @property
    def name(self) -> str:
        """What onnxruntime-style APIs show as the dim's name."""
        return str(self)

    # arithmetic ---------------------------------------------------------------------------------------------------
    def __add__(self, other: DimLike) -> DimLike:
        return add(self, other)

    __radd__ = __add__

    def __sub__(self, other: DimLike) -> DimLike:
        return add(self, mul(other, -1))

    def __rsub__(self, other: DimLike) -> DimLike:
        return add(other, mul(self, -1))

    def __mul__(self, other: DimLike) -> DimLike:
        return mul(self, other)

    __rmul__ = __mul__

    def __floordiv__(self, other: DimLike) -> DimLike:
        return floordiv(self, other)

    def __mod__(self, other: DimLike) -> DimLike:
        return mod(self, other)

    def __neg__(self) -> DimLike:
        return mul(self, -1)


def lift(d: DimLike) -> Expr:
    if isinstance(d, Expr):
        return d
    if isinstance(d, Sym):
        return Expr.atom(d)
    if isinstance(d, (int,)) and not isinstance(d, bool):
        return Expr({(): int(d)})
    raise TypeError(f"not a dim: {d!r}")


def lower(e: Expr) -> DimLike:
    """A plain int when no symbol is left, a bare Sym when the expression is one symbol."""
    if not e.terms:
        return 0
    if len(e.terms) == 1:
        (mono, c), = e.terms.items()
        if not mono:
            return c
        if c == 1 and len(mono) == 1 and isinstance(mono[0], Sym):
            return mono[0]
    return e


def _unknown_absorbs(fn):
    """Arithmetic on an unknown dim (None) gives an unknown dim: rules never have to test for it first."""

    @functools.wraps(fn)
    def wrapper(*args: DimLike | None) -> DimLike | None:
        if any(a is None for a in args):
            return None
        return fn(*args)

    return wrapper


@_unknown_absorbs
def add(a: DimLike, b: DimLike) -> DimLike:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    terms = dict(lift(a).terms)
    for m, c in lift(b).terms.items():
        terms[m] = terms.get(m, 0) + c
    return lower(Expr(terms))


@_unknown_absorbs
def mul(a: DimLike, b: DimLike) -> DimLike:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    terms: dict[Monomial, int] = {}
    for ma, ca in lift(a).terms.items():
        for mb, cb in lift(b).terms.items():
            m = tuple(sorted(ma + mb, key=_atom_key))
            terms[m] = terms.get(m, 0) + ca * cb
    return lower(Expr(terms))


@_unknown_absorbs
def floordiv(a: DimLike, b: DimLike) -> DimLike:
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    if isinstance(b, int):
        if b == 1:
            return a
        e = lift(a)
        if b > 0 and all(c % b == 0 for c in e.terms.values()):
            return lower(Expr({m: c // b for m, c in e.terms.items()}))
    else:
        exact = _divide_by_monomial(lift(a), lift(b))
        if exact is not None:
            return exact
    return lower(Expr.atom(OpAtom("floordiv", (a, b))))


def _divide_by_monomial(a: Expr, b: Expr) -> DimLike | None:
    """a / b when b is one positive term that divides every term of a exactly (B*S*768 / (B*S*12) = 64)."""
    if len(b.terms) != 1:
        return None
    (mono_b, c_b), = b.terms.items()
    if c_b <= 0:
        return None
    out: dict[Monomial, int] = {}
    for mono, c in a.terms.items():
        rest = list(mono)
        for atom in mono_b:
            if atom not in rest:
                return None
            rest.remove(atom)
        if c % c_b:
            return None
        out[tuple(rest)] = out.get(tuple(rest), 0) + c // c_b
    return lower(Expr(out))


@_unknown_absorbs
def mod(a: DimLike, b: DimLike) -> DimLike:
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    if isinstance(b, int) and b > 0 and all(c % b == 0 for c in lift(a).terms.values()):
        return 0
    return lower(Expr.atom(OpAtom("mod", (a, b))))


@_unknown_absorbs
def ceildiv(a: DimLike, b: DimLike) -> DimLike:
    return mul(floordiv(mul(a, -1), b), -1)


def _minmax(op: str, args: Iterable[DimLike]) -> DimLike:
    args = list(dict.fromkeys(args))
    if any(a is None for a in args):
        return None
    # absorption: max(min(x, s), s) = s and min(max(x, s), s) = s (a Slice clamped to a table, then broadcast)
    dual = "min" if op == "max" else "max"
    args = [a for a in args if not any(b in _operands(a, dual) for b in args if b is not a)] or args
    ints = [a for a in args if isinstance(a, int)]
    syms = [a for a in args if not isinstance(a, int)]
    if not syms:
        return (min if op == "min" else max)(ints)
    if ints:
        syms.append((min if op == "min" else max)(ints))
    if len(syms) == 1:
        return syms[0]
    return lower(Expr.atom(OpAtom(op, tuple(sorted(syms, key=str)))))


def _operands(d: DimLike, op: str) -> tuple[DimLike, ...]:
    """The arguments of `d` when it is exactly one min/max (per `op`) atom, else ()."""
    if isinstance(d, Expr) and len(d.terms) == 1:
        (mono, c), = d.terms.items()
        if c == 1 and len(mono) == 1 and isinstance(mono[0], OpAtom) and mono[0].op == op:
            return mono[0].args
    return ()


def dmin(*args: DimLike) -> DimLike:
    return _minmax("min", args)


def dmax(*args: DimLike) -> DimLike:
    return _minmax("max", args)


def nonnegative(d: DimLike) -> bool:
    """Whether `d` is provably >= 0 for any sizes of its symbols (sizes are never negative)."""
    if isinstance(d, int):
        return d >= 0
    if isinstance(d, Sym):
        return True
    return all(c >= 0 and all(isinstance(a, Sym) or all(nonnegative(x) for x in a.args) for a in mono)
               for mono, c in d.terms.items())


def complexity(d: DimLike) -> int:
    """How big an expression is (1 for an int or a symbol): used to stop inference from growing runaway terms."""
    if not isinstance(d, Expr):
        return 1
    total = 0
    for mono in d.terms:
        total += 1
        for a in mono:
            total += 1 if isinstance(a, Sym) else sum(complexity(x) for x in a.args)
    return total


def symbols(d: DimLike) -> set[Sym]:
    """The named symbols a dim depends on."""
    if isinstance(d, int):
        return set()
    if isinstance(d, Sym):
        return {d}
    found: set[Sym] = set()
    for mono in d.terms:
        for a in mono:
            if isinstance(a, Sym):
                found.add(a)
            else:
                for arg in a.args:
                    found |= symbols(arg)
    return found


def evaluate(d: DimLike, bindings: Mapping[Sym, int]) -> DimLike:
    """Substitute known symbol values; the result is an int once every symbol is bound."""
    if isinstance(d, int):
        return d
    if isinstance(d, Sym):
        return bindings.get(d, d)
    total: DimLike = 0
    for mono, c in d.terms.items():
        term: DimLike = c
        for a in mono:
            term = mul(term, _eval_atom(a, bindings))
        total = add(total, term)
    return total


def _eval_atom(a: Atom, bindings: Mapping[Sym, int]) -> DimLike:
    if isinstance(a, Sym):
        return bindings.get(a, a)
    args = [evaluate(x, bindings) for x in a.args]
    return {"floordiv": lambda: floordiv(*args), "mod": lambda: mod(*args),
            "min": lambda: dmin(*args), "max": lambda: dmax(*args)}[a.op]()


_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_.:]*)|(//|[-+*/%()]))")


def parse(text: str) -> DimLike:
    """Parse a dim_param such as ``batch``, ``4*batch`` or ``seq+1``; anything else becomes one opaque symbol."""
    try:
        tokens = _tokens(text)
        value, rest = _parse_sum(tokens)
        if rest:
            raise ValueError
        return value
    except (ValueError, IndexError, ZeroDivisionError):
        return Sym(text)


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise ValueError(text)
        out.append(m.group(0).strip())
        pos = m.end()
    return out


def _parse_sum(t: list[str]) -> tuple[DimLike, list[str]]:
    value, t = _parse_product(t)
    while t and t[0] in "+-":
        op, (rhs, t) = t[0], _parse_product(t[1:])
        value = add(value, rhs if op == "+" else mul(rhs, -1))
    return value, t


def _parse_product(t: list[str]) -> tuple[DimLike, list[str]]:
    value, t = _parse_atom(t)
    while t and t[0] in ("*", "/", "//", "%"):
        op, (rhs, t) = t[0], _parse_atom(t[1:])
        if op == "*":
            value = mul(value, rhs)
        elif op == "%":
            value = mod(value, rhs)
        else:
            value = floordiv(value, rhs)
    return value, t


def _parse_atom(t: list[str]) -> tuple[DimLike, list[str]]:
    tok = t[0]
    if tok == "(":
        value, rest = _parse_sum(t[1:])
        if not rest or rest[0] != ")":
            raise ValueError("unbalanced")
        return value, rest[1:]
    if tok == "-":
        value, rest = _parse_atom(t[1:])
        return mul(value, -1), rest
    if tok.isdigit():
        return int(tok), t[1:]
    if tok[0].isalpha() or tok[0] == "_":
        return Sym(tok), t[1:]
    raise ValueError(tok)


def _fmt(d: DimLike) -> str:
    return f"({d})" if isinstance(d, Expr) and len(d.terms) > 1 else str(d)
