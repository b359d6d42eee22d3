"""Native kernels called through one prepared pointer (callpack.c) instead of ctypes' per-argument conversion.

ctypes converts every argument of a call through its argtypes: a kernel of 13 int64 arguments costs 3-5 us a call
before any arithmetic, more than numpy's whole 16x64x64 product; through callpack.c's `carrack_call_packed` the
arguments are written into a per-thread int64 packet and the call passes one prebuilt pointer (~0.3 us in all).
Only kernels whose parameters are all pointers or integers and which return nothing may be called this way (see
callpack.c for why that is sound on the 64-bit ABIs carrack builds for). Where callpack cannot be had (native
kernels off, a 32-bit build, a library that failed to build) `packed(fn, arity)` returns ctypes' own function, so
callers stay the same.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import threading
from collections.abc import Callable

from carrack import native

_i64 = ctypes.c_int64
_Packet = None  # ctypes array type, set when callpack loads
_entry = None  # carrack_call_packed, or False when it cannot be had
_local = threading.local()


def _load_entry():
    global _entry, _Packet
    if _entry is None:
        lib = native.library("callpack")
        if lib is None:
            return None  # not cached: native kernels may be turned back on
        lib.carrack_callpack_max_arguments.restype = _i64
        lib.carrack_callpack_max_arguments.argtypes = []
        limit = lib.carrack_callpack_max_arguments()
        if limit <= 0:
            _entry = False
        else:
            entry = lib.carrack_call_packed
            entry.restype = _i64
            entry.argtypes = None  # called with a prebuilt c_void_p only: no conversion
            _Packet = _i64 * (2 + limit)
            _entry = entry
            _entry.carrack_limit = limit
    return _entry or None


def _thread_packet():
    """This thread's packet and a pointer object to it (kernels run with the GIL released, so each Python thread
    needs its own; a call does not re-enter Python, so one per thread serves every kernel)."""
    packet = _Packet()
    _local.packet = packet, ctypes.c_void_p(ctypes.addressof(packet))
    return _local.packet


#: callpack.c's kinds for kernels with a float or int parameter: (kind, arity, position of the float or None)
SOFTMAX = (-1, 14, 5)
LAYER_NORM = (-2, 14, 12)
GELU = (-3, 8, None)
_FLOAT32 = struct.Struct("<f")
_UINT32 = struct.Struct("<I")


def float_bits(value: float) -> int:
    """A float's float32 bits as an int (how a packet carries a float parameter), rounded as ctypes' c_float
    would (a value beyond float32's range becomes an infinity)."""
    try:
        return _UINT32.unpack(_FLOAT32.pack(value))[0]
    except OverflowError:
        return _UINT32.unpack(_FLOAT32.pack(math.copysign(math.inf, value)))[0]


class PackedKernel:
    """A void native kernel called with plain ints (floats where its kind has one) through the packet."""

    __slots__ = ("address", "kind", "end", "float_at", "name")

    def __init__(self, fn: ctypes._CFuncPtr, kind: int, arity: int, float_at: int | None = None):
        self.address = ctypes.cast(fn, ctypes.c_void_p).value
        self.kind = kind
        self.end = 2 + arity
        self.float_at = float_at
        self.name = getattr(fn, "__name__", "kernel")

    def __call__(self, *args) -> None:
        try:
            packet, pointer = _local.packet
        except AttributeError:
            packet, pointer = _thread_packet()
        if self.float_at is not None:
            args = list(args)
            args[self.float_at] = float_bits(args[self.float_at])
        packet[2:self.end] = args  # raises for a wrong count: never a call with stale arguments
        packet[0] = self.address
        packet[1] = self.kind
        _entry(pointer)

    def bind(self, *args) -> Callable[[], None]:
        """This call with these arguments, written once into a packet of its own: calling the result passes the
        prebuilt pointer and nothing else. For a caller that runs it on one thread at a time (a step bound to
        one run's arena); a wrong argument count raises here."""
        if self.float_at is not None:
            args = list(args)
            args[self.float_at] = float_bits(args[self.float_at])
        packet = _Packet()
        packet[2:self.end] = args
        packet[0] = self.address
        packet[1] = self.kind
        call = functools.partial(_entry, ctypes.c_void_p(ctypes.addressof(packet)))
        call.packet = packet  # the pointer does not keep the packet alive: the call does
        return call

    def __repr__(self) -> str:
        return f"PackedKernel({self.name}, kind {self.kind})"


def bound_call(fn: Callable[..., None], *args) -> Callable[[], None]:
    """fn(*args) as a call without arguments: a packet of its own for a packed kernel, else ctypes' function with
    the arguments kept (converted at each call)."""
    if isinstance(fn, PackedKernel):
        return fn.bind(*args)
    return functools.partial(fn, *args)


def packed(fn: ctypes._CFuncPtr, arity: int, kind: tuple[int, int, int | None] | None = None
           ) -> Callable[..., None]:
    """`fn` (a ctypes function returning void, its argtypes set) as a callable taking the same arguments as plain
    ints (and floats): through the packet where callpack loads, else `fn` itself. Without `kind` every parameter
    must be a pointer or int64_t; with one (SOFTMAX, LAYER_NORM, GELU) the prototype is callpack.c's for it."""
    entry = _load_entry()
    if entry is None or arity > entry.carrack_limit or len(fn.argtypes or ()) != arity:
        return fn
    if kind is None:
        return PackedKernel(fn, arity, arity)
    code, kind_arity, float_at = kind
    if kind_arity != arity:
        raise ValueError(f"{fn.__name__}: packed kind {code} has {kind_arity} arguments, not {arity}")
    return PackedKernel(fn, code, arity, float_at)
