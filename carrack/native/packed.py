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


class PackedKernel:
    """A void native kernel of `arity` pointer/integer arguments, called with plain ints through the packet."""

    __slots__ = ("address", "arity", "end", "name")

    def __init__(self, fn: ctypes._CFuncPtr, arity: int):
        self.address = ctypes.cast(fn, ctypes.c_void_p).value
        self.arity = arity
        self.end = 2 + arity
        self.name = getattr(fn, "__name__", "kernel")

    def __call__(self, *args: int) -> None:
        try:
            packet, pointer = _local.packet
        except AttributeError:
            packet, pointer = _thread_packet()
        packet[0] = self.address
        packet[1] = self.arity
        packet[2:self.end] = args  # raises for a wrong count: never a call with stale arguments
        _entry(pointer)

    def __repr__(self) -> str:
        return f"PackedKernel({self.name}, {self.arity} arguments)"


def packed(fn: ctypes._CFuncPtr, arity: int) -> Callable[..., None]:
    """`fn` (a ctypes function of `arity` pointer/integer arguments returning void, its argtypes set) as a callable
    taking the same arguments as ints: through the packet where callpack loads, else `fn` itself."""
    entry = _load_entry()
    if entry is None or arity > entry.carrack_limit or len(fn.argtypes or ()) != arity:
        return fn
    return PackedKernel(fn, arity)
