"""The symbolic dim algebra."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from carrack.ir.dims import Sym
from carrack.ir.symbolic import add, dmax, dmin, evaluate, floordiv, mod, mul, parse, symbols

B, S = Sym("batch"), Sym("seq")


def test_canonical_forms_compare_equal():
    assert add(mul(B, 2), B) == mul(B, 3)
    assert add(mul(B, S), mul(S, B)) == mul(2, mul(B, S))
    assert add(B, mul(B, -1)) == 0
    assert floordiv(mul(B, 4), 2) == mul(B, 2)
    assert mod(mul(B, 4), 2) == 0
    assert mul(B, 1) == B and isinstance(mul(B, 1), Sym)


def test_ints_stay_ints():
    assert add(2, 3) == 5 and isinstance(mul(2, 3), int)
    assert floordiv(7, 2) == 3 and dmin(3, 5) == 3 and dmax(3, 5) == 5


def test_evaluate_binds_symbols():
    e = add(mul(floordiv(add(S, 1), 2), B), dmax(B, 4))
    assert evaluate(e, {B: 3, S: 9}) == 5 * 3 + 4
    partial = evaluate(e, {S: 9})
    assert symbols(partial) == {B}


def test_parse_exporter_expressions():
    assert parse("batch") == B
    assert parse("4*batch") == mul(B, 4)
    assert parse("seq + 1") == add(S, 1)
    assert parse("(seq+1)//2") == floordiv(add(S, 1), 2)
    assert parse("unk__3") == Sym("unk__3")
    assert parse("weird dim!") == Sym("weird dim!")


@given(st.integers(1, 50), st.integers(1, 50), st.integers(-5, 5), st.integers(1, 7))
def test_algebra_agrees_with_integers(b, s, k, c):
    e = add(mul(add(B, k), S), floordiv(mul(B, s), c))
    assert evaluate(e, {B: b, S: s}) == (b + k) * s + (b * s) // c
    m = add(mod(add(B, S), c), dmin(B, S, 10))
    assert evaluate(m, {B: b, S: s}) == (b + s) % c + min(b, s, 10)
