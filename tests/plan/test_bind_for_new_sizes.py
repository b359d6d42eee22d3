"""A plan evaluated for a new set of sizes (a decoder's every token): only the derived values of the symbols that
changed are made again, and the arena offsets and places from the compiled layout function equal the arena
order's own evaluation at every size."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

import carrack
from carrack.ir.dims import Sym
from carrack.ir.symbolic import add, dmax, floordiv, mod, mul, symbols
from carrack.plan.exprs import function_source, symbols_of_dims
from tests.plan.arena_offsets import reference_offsets
from tests.plan.decoder import export_gpt2_with_past

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("bind") / "gpt2.onnx"
    export_gpt2_with_past(path, dynamo=False)
    return carrack.InferenceSession(str(path))._plan


def _reference(plan, sizes: tuple[int, ...]) -> tuple[list[np.ndarray], list[tuple], int]:
    """The derived values and places computed from the dims function and the arena order read directly."""
    flat = plan._function(*sizes)
    derived = [np.array(flat[d.first:d.first + math.prod(d.shape)], np.int64).reshape(d.shape).astype(d.dtype)
               for d in plan.derived]
    blocks = flat[plan.n_derived_dims:plan.n_derived_dims + len(plan.arena.blocks)]
    offsets, total = reference_offsets(plan.arena, blocks)
    places = []
    for p in plan.placed:
        shape = tuple(flat[p.first:p.first + p.rank])
        places.append((offsets[p.block], math.prod(shape) * np.dtype(p.dtype).itemsize, shape, np.dtype(p.dtype)))
    return derived, places, total


def _sizes(plan, **given: int) -> tuple[int, ...]:
    return tuple(given[name] for name in plan.symbols)


def test_new_sizes_give_the_arena_order_s_places_and_derived_values(plan):
    assert set(plan.symbols) == {"batch", "seq", "past_seq", "total_seq"}
    rng = np.random.default_rng(0)
    batch, seq, past = 1, 5, 0
    for _ in range(40):  # a walk: growing past, then other batches and prompt lengths, shrinking too
        change = rng.integers(0, 4)
        if change == 0:
            batch = int(rng.integers(1, 5))
        elif change == 1:
            seq = int(rng.integers(1, 9))
        else:
            past = int(rng.integers(0, 70)) if change == 2 else past + 1
        sizes = _sizes(plan, batch=batch, seq=seq, past_seq=past, total_seq=past + seq)
        bound = plan.bind(sizes)
        derived, places, total = _reference(plan, sizes)
        assert bound.arena_bytes == total and bound.places == places, sizes
        assert len(bound.derived) == len(derived)
        for got, want in zip(bound.derived, derived):
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), sizes
            assert not got.flags.writeable


def test_only_the_derived_values_of_changed_symbols_are_made_again(plan):
    fresh = pickle.loads(pickle.dumps(plan))  # no evaluation before
    first = fresh.bind(_sizes(fresh, batch=1, seq=1, past_seq=9, total_seq=10))
    second = fresh.bind(_sizes(fresh, batch=1, seq=1, past_seq=10, total_seq=11))
    depends = [any(s.name in ("past_seq", "total_seq") for x in d.values for s in symbols(x))
               for d in fresh.derived]
    assert any(depends) and not all(depends)
    for a, b, changed in zip(first.derived, second.derived, depends):
        assert (a is not b) if changed else (a is b)
    third = fresh.bind(_sizes(fresh, batch=2, seq=1, past_seq=10, total_seq=11))  # batch changed: its values anew
    assert any(a is not b for a, b, changed in zip(second.derived, third.derived, depends) if not changed)
    for got, want in zip(third.derived, _reference(fresh, third.sizes)[0]):
        assert np.array_equal(got, want)


def test_placed_values_outside_those_reading_a_changed_symbol_keep_their_shapes(plan):
    rng = np.random.default_rng(1)
    for _ in range(30):
        batch, seq, past = (int(v) for v in rng.integers(1, 6, 3))
        a = _sizes(plan, batch=batch, seq=seq, past_seq=past, total_seq=past + seq)
        grown = int(rng.integers(0, 3))  # past, or the prompt, or the batch changes
        b = _sizes(plan, batch=batch + (grown == 2), seq=seq + (grown == 1), past_seq=past + (grown == 0),
                   total_seq=past + seq + (grown < 2))
        changed = tuple(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        reading = set(plan.placed_reading(changed))
        first, second = plan.bind(a), plan.bind(b)
        assert any(p[2] != q[2] for p, q in zip(first.places, second.places))
        for k, (p, q) in enumerate(zip(first.places, second.places)):
            assert k in reading or p[2] == q[2], (plan.placed[k].name, changed)
    assert plan.placed_reading(()) == ()


def test_symbols_of_dims_finds_the_symbols_inside_every_kind_of_expression():
    a, b, c = Sym("a"), Sym("b"), Sym("c")
    dims = [7, a, add(mul(a, b), 3), floordiv(c, 2), mod(b, 3), dmax(a, c), mul(floordiv(add(a, c), 4), 64)]
    source = function_source([a, b, c], dims)
    assert symbols_of_dims(source) == [set(), {0}, {0, 1}, {2}, {1}, {0, 2}, {0, 2}]
    with pytest.raises(ValueError, match="not a dims function"):
        symbols_of_dims("1 + 2")


def test_symbols_read_by_derived_and_placed_values_are_their_expressions_symbols(plan):
    position = {name: k for k, name in enumerate(plan.symbols)}
    for d in plan.derived:
        assert plan.symbols_read(d) == {position[s.name] for x in d.values for s in symbols(x)}, d.name
    reads = [plan.symbols_read(p) for p in plan.placed]
    past = position["past_seq"]
    batch, seq = position["batch"], position["seq"]
    assert {batch} in reads and {batch, seq, past} in reads  # a mask's batch row; attention over the cache
    assert plan.placed_reading((past,)) == tuple(k for k, r in enumerate(reads) if past in r)
