"""carrack's intermediate representation: graphs, values, element types and symbolic dims."""

from carrack.ir.dims import Dim, Shape, Sym
from carrack.ir.graph import Graph, Model, Node, ValueInfo
from carrack.ir.types import MapType, OptionalType, SequenceType, TensorType, ValueType

__all__ = ["Dim", "Graph", "MapType", "Model", "Node", "OptionalType", "SequenceType", "Shape", "Sym",
           "TensorType", "ValueInfo", "ValueType"]
