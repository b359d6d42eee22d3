"""How many threads the native kernels of a run may use, and the thread pool they run on (threadpool.c).

The count belongs to the run, not to the process: a session's `intra_op_num_threads` is set for the calling thread
while its run executes (`intra_op_threads`), and every native kernel the run calls reads it (`threads()`) and
passes it to C. A session running beside another one in a second Python thread keeps its own count.

The pool itself is shared by the process: its workers are created once, and a parallel region only borrows
workers that are idle at that moment, so sessions running at the same time never start more pool threads than the
largest count they asked for (the calling threads take work too).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Any, NamedTuple

_local = threading.local()
_default: int | None = None


@functools.lru_cache(maxsize=1)
def cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform tells it, read once)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - platforms without sched_getaffinity
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """The thread count of a run that sets none (intra_op_num_threads 0): one per core, as onnxruntime; the
    environment's CARRACK_NUM_THREADS overrides it."""
    global _default
    if _default is None:
        chosen = os.environ.get("CARRACK_NUM_THREADS", "").strip()
        _default = int(chosen) if chosen.isdigit() and int(chosen) > 0 else cores()
    return _default


def threads() -> int:
    """The thread count native kernels may use now: the running session's, else the default."""
    return getattr(_local, "count", 0) or default_threads()


class _Hold:
    """The pool's hold count as this Python thread updates it: a word of the pool's that only this thread writes,
    updated by a store through a memoryview (a ctypes call each way would cost a small model's run about a
    microsecond), else the shared word through carrack_pool_hold. Made once per Python thread and pool library
    (`_pool_hold`)."""

    __slots__ = ("pool", "words", "slot", "call")

    def __init__(self, pool: ctypes.CDLL) -> None:
        pool.carrack_pool_hold.argtypes, pool.carrack_pool_hold.restype = [ctypes.c_int64], None
        pool.carrack_pool_hold_words.restype = ctypes.c_void_p
        pool.carrack_pool_hold_slot.restype = ctypes.c_int64
        self.pool = pool
        self.call = pool.carrack_pool_hold
        self.slot = int(pool.carrack_pool_hold_slot())
        address = pool.carrack_pool_hold_words()
        self.words = memoryview((ctypes.c_int64 * _HOLD_WORDS).from_address(address)).cast("B").cast("q")


_HOLD_WORDS = 64  # threadpool.c's HOLD_WORDS
_native = None  # carrack.native, once imported (it imports this module)


def _pool_hold() -> _Hold | None:
    """This Python thread's way to take and give back the hold of the pool the kernels use: the threadpool
    library as loaded now (a run before any kernel library has loaded it holds nothing, nor does one where it is
    turned off or failed to build), else None."""
    global _native
    if _native is None:
        from carrack import native

        _native = native
    pool = _native._loaded.get("threadpool")
    hold = getattr(_local, "hold", None)
    if hold is not None and hold.pool is pool:
        return hold
    if pool is None or not hasattr(pool, "carrack_pool_hold_slot"):
        return None
    hold = _local.hold = _Hold(pool)
    return hold


class intra_op_threads:  # noqa: N801 - used as the context manager function it was
    """Run the block (in this Python thread only) with native kernels limited to `count` threads; 0 or None
    means one per core. `with` gives the count in force. Nested blocks restore the outer count when they end.
    A block with two or more threads holds the pool (`holding_pool`) for its duration.
    (A class rather than a generator context manager: every session run enters one, and contextlib's costs
    ~2 us.)"""

    __slots__ = ("count", "before", "hold")

    def __init__(self, count: int | None) -> None:
        if count is not None and (not isinstance(count, int) or count < 0):
            from carrack.errors import InvalidArgument

            raise InvalidArgument(f"intra_op_num_threads must be an int >= 0 (0: one per core), got {count!r}")
        self.count = count

    def __enter__(self) -> int:
        self.before = getattr(_local, "count", 0)
        count = _local.count = self.count or default_threads()
        hold = self.hold = _pool_hold() if count > 1 else None
        if hold is not None:
            if hold.slot >= 0:
                hold.words[hold.slot] += 1
            else:
                hold.call(1)
        return count

    def __exit__(self, *exc) -> None:
        _local.count = self.before
        hold = self.hold
        if hold is not None:
            if hold.slot >= 0:
                hold.words[hold.slot] -= 1
            else:
                hold.call(-1)


def holding_pool() -> int:
    """Blocks (runs) holding the pool now: while there is one, idle pool workers keep spinning between the run's
    split kernels (up to CARRACK_HELD_SPIN_US, default 5000 us, per gap) instead of falling asleep after
    CARRACK_SPIN_US, so the next kernel does not wait for a worker to wake up. 0 without the pool library."""
    return _pool_counter("carrack_pool_holds")


def attach_pool(name: str, lib: ctypes.CDLL, pool: ctypes.CDLL | None) -> bool:
    """Hand the pool's entry point to a kernel library that includes threadpool.h (its `<name>_use_pool`);
    False when the library has none or there is no pool (its kernels then run on the calling thread)."""
    use_pool = getattr(lib, f"{name}_use_pool", None)
    if use_pool is None or pool is None:
        return False
    use_pool.argtypes, use_pool.restype = [ctypes.c_void_p], None
    use_pool(ctypes.cast(pool.carrack_parallel, ctypes.c_void_p))
    return True


def pool_workers() -> int:
    """Pool worker threads created so far in this process (0 before the first parallel region)."""
    return _pool_counter("carrack_pool_workers")


def parallel_seconds() -> float:
    """Wall time this process has spent in native regions split over two or more threads (all Python threads
    together); the rest of a run's time ran on one core. 0.0 without the pool library."""
    return _pool_counter("carrack_pool_parallel_ns") / 1e9


def pool_wakes() -> int:
    """Times a parallel region had to wake a sleeping pool worker in this process (a worker sleeps once it has
    spun CARRACK_SPIN_US without work; a woken worker starts later than a spinning one)."""
    return _pool_counter("carrack_pool_wakes")


def _pool_function(name: str, argtypes: list, restype: Any) -> Any:
    """The pool library's function `name` with its prototype set (None without the library, or in a build that
    lacks it)."""
    from carrack import native

    pool = native.library("threadpool")
    fn = getattr(pool, name, None) if pool is not None else None
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


def _pool_counter(function: str) -> int:
    """One of the pool library's int64 counters (0 without the library, or in a build that lacks it)."""
    fn = _pool_function(function, [], ctypes.c_int64)
    return 0 if fn is None else int(fn())


def count_work(on: bool) -> None:
    """Start (True) or stop counting `work_seconds()` (off by default: it costs two clock reads per thread and
    split region)."""
    fn = _pool_function("carrack_pool_count_work", [ctypes.c_int64], None)
    if fn is not None:
        fn(int(bool(on)))


def work_seconds() -> float:
    """CPU time the participants of split regions (calling threads and pool workers together) spent running their
    pieces while `count_work` was on, in this process. Beside the process's CPU time it separates a run's work
    from its spinning; beside a one-thread run's CPU time it shows the work a split adds. 0.0 without the pool
    library."""
    return _pool_counter("carrack_pool_work_ns") / 1e9


class RegionPart(NamedTuple):
    """One participant's share of a split region in the pool's trace (`region_trace`): times in seconds of
    CLOCK_MONOTONIC (start, end) and of the participant's CPU (cpu). slot -1 is the region as its caller saw it,
    from before it handed out work to after the last participant finished (pieces: the region's piece count)."""

    region: int
    slot: int
    pieces: int
    start: float
    end: float
    cpu: float


_TRACE_FIELDS = 6  # threadpool.c's TRACE_FIELDS
_TRACE_RECORDS = 8192  # threadpool.c's TRACE_RECORDS


def trace_regions(on: bool) -> None:
    """Start (True, forgetting earlier records) or stop (False, keeping them) recording how each split region's
    participants ran it: when each started and ended, its CPU time and pieces (`region_trace`). Off by default:
    it costs four clock reads per participant and region."""
    fn = _pool_function("carrack_pool_trace", [ctypes.c_int64], None)
    if fn is not None:
        fn(int(bool(on)))


def region_trace() -> list[RegionPart]:
    """The newest records of the regions split since `trace_regions(True)` (up to 8192, oldest first; a region's
    participants first, then its slot -1 record). Empty without the pool library."""
    fn = _pool_function("carrack_pool_trace_read", [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64)
    if fn is None:
        return []
    records = (ctypes.c_int64 * (_TRACE_RECORDS * _TRACE_FIELDS))()
    count = fn(records, _TRACE_RECORDS)
    parts = []
    for r in range(count):
        region, slot, pieces, start, end, cpu = records[r * _TRACE_FIELDS:(r + 1) * _TRACE_FIELDS]
        parts.append(RegionPart(region, slot, pieces, start / 1e9, end / 1e9, cpu / 1e9))
    return parts
