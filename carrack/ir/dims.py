"""Tensor dimensions: ints, or symbols standing for sizes known only at run time.

A dim is an ``int`` (known), a ``Sym`` (a named size such as ``batch``; the same name means the same size), or
``None`` (unknown, no name). Graph passes may build expressions from symbols; `carrack.ir.symbolic` holds the algebra.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sym:
    """A named dimension; equal names mean equal sizes within a model."""

    name: str

    def __str__(self) -> str:
        return self.name


Dim = int | Sym | None
Shape = tuple[Dim, ...]


def dim_label(d: Dim) -> int | str | None:
    """The dim as onnxruntime reports it: int, symbol name, or None."""
    return d.name if isinstance(d, Sym) else d


def format_shape(shape: Shape | None) -> str:
    if shape is None:
        return "(unknown rank)"
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
