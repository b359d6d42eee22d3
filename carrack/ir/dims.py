"""Tensor dimensions: ints, or symbols standing for sizes known only at run time.

A dim is an ``int`` (known), a ``Sym`` (a named size such as ``batch``; the same name means the same size), or
``None`` (unknown, no name). Graph passes may build expressions from symbols; `carrack.ir.symbolic` holds the algebra.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Sym:
    """A named dimension; equal names mean equal sizes within a model."""

    name: str

    def __str__(self) -> str:
        return self.name


Dim = int | Sym | None
Shape = tuple[Dim, ...]


#: names onnx's shape inference invents for dims it could not name: hints, not constraints
_PLACEHOLDER = re.compile(r"unk__\d+")


def is_placeholder(d: Dim) -> bool:
    """An `unk__N` dim: two of them with the same name say nothing about each other's size."""
    return isinstance(d, Sym) and _PLACEHOLDER.fullmatch(d.name) is not None


def binding_name(d: Dim, input_name: str, axis: int) -> str:
    """The name a run binds an input's non-fixed dim under: the symbol's own name, or 'input:axis' for anonymous
    and placeholder dims, which are each their own size."""
    return d.name if isinstance(d, Sym) and not is_placeholder(d) else f"{input_name}:{axis}"


def dim_label(d: Dim) -> int | str | None:
    """The dim as onnxruntime reports it: int, symbol name, or None."""
    return d.name if isinstance(d, Sym) else d


def format_shape(shape: Shape | None) -> str:
    if shape is None:
        return "(unknown rank)"
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
